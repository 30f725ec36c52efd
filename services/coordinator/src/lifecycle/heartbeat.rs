//! A worker's heartbeat: the lease extended, progress recorded, a cancel request answered.

use troupe_proto::v1::{self as pb, TaskState, session_event::Kind};

use super::stale;
use super::task_cache::TaskCache;
use crate::Error;
use crate::store::Tx;
use crate::store::events::append_event;
use crate::store::tasks::{load_task, update_task};

/// Extends a lease and records progress under the session lock, inside a transaction the
/// caller commits (see [`crate::group_commit`]); returns the new expiry and whether the task was
/// cancelled.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn heartbeat_in(
    tx: &mut Tx,
    session_id: &str,
    task_id: &str,
    token: u64,
    (progress, figures): (&str, Option<&pb::WorkProgress>),
    lease_ms: Option<i64>,
    now: i64,
    cache: Option<&mut TaskCache>,
) -> Result<(i64, bool), Error> {
    let before = load_task(tx, session_id, task_id).await?;
    if before.fencing_token != token {
        return Err(stale(&before, token));
    }
    if before.state == TaskState::Cancelled {
        return Ok((now, true));
    }
    if before.state != TaskState::Running {
        return Err(stale(&before, token));
    }
    let mut task = before.clone();
    if let Some(lease_ms) = lease_ms {
        task.lease_ms = lease_ms;
    }
    let expires_at = now + task.lease_ms;
    task.lease_expires_at = Some(expires_at);
    let noted = !progress.is_empty() && progress != task.progress;
    if noted {
        task.progress = progress.to_owned();
    }
    // Figures come only when they changed (the worker sends them once), so each is an event.
    if noted || figures.is_some() {
        append_event(
            tx,
            session_id,
            now,
            Kind::Progress(pb::TaskProgress {
                task_id: task_id.to_owned(),
                note: task.progress.clone(),
                worker_id: task.worker_id.clone(),
                work_progress: figures.cloned(),
            }),
        )
        .await?;
    }
    update_task(tx, &task).await?;
    if let Some(cache) = cache {
        cache.put(task);
    }
    Ok((expires_at, false))
}
