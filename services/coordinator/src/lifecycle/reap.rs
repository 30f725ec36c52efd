//! The reaper's pass: expired leases go back to ready (or time out on the last attempt), and
//! retries whose backoff elapsed become ready.

use troupe_proto::v1::{self as pb, TaskState};

use super::save;
use crate::Error;
use crate::store::Store;
use crate::store::sessions::{load_session, lock_session};
use crate::store::tasks::load_tasks_lite;
use crate::task;

/// Returns expired leases (ready again while attempts remain, else timed out) and releases
/// retries whose backoff elapsed. Returns how many sessions changed.
pub(crate) async fn reap(store: &Store, now: i64) -> Result<usize, Error> {
    let due = store.sessions_due(now).await?;
    let mut changed = 0;
    for session_id in due {
        let mut tx = store.begin().await?;
        lock_session(&mut tx, &session_id, store.for_update()).await?;
        let before = load_tasks_lite(&mut tx, &session_id).await?;
        let mut session = load_session(&mut tx, &session_id).await?;
        let mut tasks = before.clone();
        let mut transitions = Vec::new();
        let mut expired_roles = Vec::new();
        for task in tasks.iter_mut() {
            let expired = task.state == TaskState::Running
                && task.lease_expires_at.is_some_and(|at| at < now);
            if !expired {
                continue;
            }
            tracing::warn!(session_id = %session_id, task_id = %task.id, worker_id = %task.worker_id, attempt = task.attempt, "lease expired");
            expired_roles.push(task.role);
            if task.attempt < task.max_attempts {
                transitions.push(task::transition(
                    task,
                    TaskState::Ready,
                    "lease expired",
                    now,
                ));
            } else {
                task.last_error = Some(pb::TaskError {
                    kind: pb::ErrorKind::Timeout as i32,
                    message: format!(
                        "lease of worker {} expired on the last attempt",
                        task.worker_id
                    ),
                    retryable: false,
                    details: Vec::new(),
                    ..Default::default()
                });
                transitions.push(task::transition(
                    task,
                    TaskState::TimedOut,
                    "lease expired on the last attempt",
                    now,
                ));
            }
            task.worker_id.clear();
        }
        let before_len = transitions.len();
        let total = save(&mut tx, &mut session, &before, &mut tasks, transitions, now).await?;
        tx.commit().await?;
        for role in expired_roles {
            crate::metrics::lease_expired(role);
        }
        if total > 0 || before_len > 0 {
            changed += 1;
        }
    }
    Ok(changed)
}
