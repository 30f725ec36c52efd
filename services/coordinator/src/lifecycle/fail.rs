//! Failing an attempt: a retry after a backoff while attempts remain, else a terminal failure,
//! which may start a fix round ([`super::fix_round`]).

use std::time::Duration;

use troupe_proto::v1::{self as pb, TaskState};

use super::complete::write_back_convergence;
use super::fix_round::fix_round;
use super::{find_task_mut, save, stale};
use crate::Error;
use crate::store::Store;
use crate::store::sessions::lock_and_load_session;
use crate::store::tasks::{load_task, load_tasks_lite, update_task};
use crate::task::{self, Task};

/// Fails an attempt: back to pending with a retry time while attempts remain and the error
/// is retryable, else terminal (downstream skipped or blocked).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn fail(
    store: &Store,
    session_id: &str,
    task_id: &str,
    token: u64,
    error: pb::TaskError,
    partial: Option<pb::TaskResult>,
    backoff: impl FnOnce(u32) -> Duration,
    now: i64,
) -> Result<(Task, Option<i64>), Error> {
    let mut tx = store.begin().await?;
    let mut session = lock_and_load_session(&mut tx, session_id, store.for_update()).await?;
    let before = load_tasks_lite(&mut tx, session_id).await?;
    let mut tasks = before.clone();
    let task = find_task_mut(&mut tasks, task_id, session_id)?;
    if task.fencing_token != token {
        return Err(stale(task, token));
    }
    // A cancelled task's worker is told to stop and report; keep its error, change nothing.
    if task.state == TaskState::Cancelled {
        task.last_error = Some(error);
        let task = task.clone();
        update_task(&mut tx, &task).await?;
        tx.commit().await?;
        return Ok((task, None));
    }
    if task.state != TaskState::Running {
        return Err(stale(task, token));
    }
    let reason = error.message.clone();
    let kind = error.kind();
    let timed_out = kind == pb::ErrorKind::Timeout;
    let retry = error.retryable && task.attempt < task.max_attempts;
    let loop_inputs = (!retry && !timed_out).then(|| (error.clone(), partial.clone()));
    task.last_error = Some(error);
    if let Some(partial) = &partial {
        write_back_convergence(&mut tx, session_id, task_id, partial).await?;
    }
    if partial.is_some() {
        task.result = partial.map(Box::new);
    }
    let mut retry_at = None;
    let transition = if retry {
        let delay = backoff(task.attempt);
        let at = now + i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
        retry_at = Some(at);
        let transition = task::transition(task, TaskState::Pending, reason, now);
        task.not_before = Some(at);
        task.worker_id.clear();
        transition
    } else {
        let to = if timed_out {
            TaskState::TimedOut
        } else {
            TaskState::Failed
        };
        task::transition(task, to, reason, now)
    };
    let mut transitions = vec![transition];
    let mut before = before;
    if let Some((error, partial)) = loop_inputs
        && !task::is_session_terminal(session.state)
    {
        transitions.extend(
            fix_round(
                &mut tx,
                &mut before,
                &mut tasks,
                task_id,
                &error,
                partial.as_ref(),
                now,
            )
            .await?,
        );
    }
    save(&mut tx, &mut session, &before, &mut tasks, transitions, now).await?;
    let task = load_task(&mut tx, session_id, task_id).await?;
    tx.commit().await?;
    if retry_at.is_some() {
        crate::metrics::retried(task.role, kind);
    }
    Ok((task, retry_at))
}

/// Puts a running task whose provider rate-limited it back to ready, as if the attempt had
/// not been made: its attempt number goes back (the fencing token does not), no backoff, the
/// error kept as its last. The provider's pause (see [`crate::quota`]) holds it back.
pub(crate) async fn put_back(
    store: &Store,
    session_id: &str,
    task_id: &str,
    token: u64,
    error: pb::TaskError,
    reason: &str,
    now: i64,
) -> Result<Task, Error> {
    let mut tx = store.begin().await?;
    let mut session = lock_and_load_session(&mut tx, session_id, store.for_update()).await?;
    let before = load_tasks_lite(&mut tx, session_id).await?;
    let mut tasks = before.clone();
    let task = find_task_mut(&mut tasks, task_id, session_id)?;
    if task.fencing_token != token || task.state != TaskState::Running {
        return Err(stale(task, token));
    }
    task.last_error = Some(error);
    task.attempt = task.attempt.saturating_sub(1);
    let transition = task::transition(task, TaskState::Ready, reason, now);
    task.worker_id.clear();
    task.not_before = None;
    save(
        &mut tx,
        &mut session,
        &before,
        &mut tasks,
        vec![transition],
        now,
    )
    .await?;
    let task = load_task(&mut tx, session_id, task_id).await?;
    tx.commit().await?;
    Ok(task)
}
