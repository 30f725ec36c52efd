//! Resuming a session (CCW's `resume`): reconcile, then advance.

use troupe_proto::v1::{self as pb, SessionState, TaskState};

use super::save;
use crate::Error;
use crate::store::Store;
use crate::store::sessions::{load_session, lock_session, set_session_state};
use crate::store::tasks::load_tasks_lite;
use crate::task;

/// Reconciles a session (ccw-reference 4.3) and advances it, in one transaction: orphaned
/// running tasks (lease expired) become ready, failed / timed-out tasks pending with one
/// more attempt, blocked / skipped tasks pending; a paused or failed session becomes active.
pub(crate) async fn resume(
    store: &Store,
    session_id: &str,
    now: i64,
) -> Result<Vec<pb::TaskTransition>, Error> {
    let mut tx = store.begin().await?;
    lock_session(&mut tx, session_id, store.for_update()).await?;
    let before = load_tasks_lite(&mut tx, session_id).await?;
    let mut session = load_session(&mut tx, session_id).await?;
    match session.state {
        SessionState::Cancelled => {
            return Err(Error::FailedPrecondition(format!(
                "session {session_id} was cancelled and cannot be resumed"
            )));
        }
        SessionState::Completed => {
            tx.rollback().await?;
            return Ok(Vec::new());
        }
        _ => {}
    }
    let mut tasks = before.clone();
    let mut transitions = Vec::new();
    for task in &mut tasks {
        let reason = match task.state {
            TaskState::Running if task.lease_expires_at.is_some_and(|at| at < now) => {
                task.max_attempts = task.max_attempts.max(task.attempt + 1);
                let transition = task::transition(
                    task,
                    TaskState::Ready,
                    "resumed: lease expired (orphaned)",
                    now,
                );
                task.worker_id.clear();
                transitions.push(transition);
                continue;
            }
            // A fix round replaced it; its re-run is what gets retried.
            TaskState::Failed if !task.superseded_by.is_empty() => continue,
            TaskState::Failed | TaskState::TimedOut => {
                task.max_attempts = task.max_attempts.max(task.attempt + 1);
                "resumed: retrying"
            }
            TaskState::Blocked | TaskState::Skipped => "resumed: dependency retried",
            _ => continue,
        };
        task.not_before = None;
        task.finished_at = None;
        task.worker_id.clear();
        transitions.push(task::transition(task, TaskState::Pending, reason, now));
    }
    if matches!(session.state, SessionState::Paused | SessionState::Failed) {
        set_session_state(&mut tx, &mut session, SessionState::Active, "resumed", now).await?;
    }
    let reconciled = transitions.clone();
    save(&mut tx, &mut session, &before, &mut tasks, transitions, now).await?;
    tx.commit().await?;
    Ok(reconciled)
}
