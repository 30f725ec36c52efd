//! Cancelling a session and every task it has not finished.

use troupe_proto::v1::{SessionState, TaskState};

use super::save;
use crate::Error;
use crate::store::Store;
use crate::store::sessions::{
    SessionSummary, load_summary, lock_and_load_session, set_session_state,
};
use crate::store::tasks::load_tasks_lite;
use crate::task::{self, session_state_name};

/// Cancels every non-terminal task and the session.
pub(crate) async fn cancel_session(
    store: &Store,
    session_id: &str,
    reason: &str,
    now: i64,
) -> Result<SessionSummary, Error> {
    let mut tx = store.begin().await?;
    let mut session = lock_and_load_session(&mut tx, session_id, store.for_update()).await?;
    let before = load_tasks_lite(&mut tx, session_id).await?;
    match session.state {
        SessionState::Cancelled => {}
        SessionState::Completed | SessionState::Failed => {
            return Err(Error::FailedPrecondition(format!(
                "session {session_id} already ended ({})",
                session_state_name(session.state)
            )));
        }
        _ => {
            let reason = if reason.is_empty() {
                "cancelled by user"
            } else {
                reason
            };
            let mut tasks = before.clone();
            let mut transitions = Vec::new();
            for task in tasks
                .iter_mut()
                .filter(|task| !task::is_terminal(task.state))
            {
                transitions.push(task::transition(task, TaskState::Cancelled, reason, now));
            }
            set_session_state(&mut tx, &mut session, SessionState::Cancelled, reason, now).await?;
            save(&mut tx, &mut session, &before, &mut tasks, transitions, now).await?;
        }
    }
    let summary = load_summary(&mut tx, session_id).await?;
    tx.commit().await?;
    Ok(summary)
}
