//! Pausing a session.
//!
//! Kept apart from the claim/complete hot paths. Pausing needs no change there: claims only
//! take tasks of active sessions (both in the candidate query and again under the session
//! lock), and completions and failures of a paused session are recorded without settling the
//! graph, so nothing becomes ready until `ResumeSession` makes the session active again.

use serde_json::{Map, Value};
use troupe_proto::v1::{SessionState, TaskState};

use crate::Error;
use crate::store::Store;
use crate::store::messages::{NewMessage, insert_message};
use crate::store::sessions::{
    SessionSummary, load_summary, lock_and_load_session, set_session_state,
};
use crate::store::tasks::load_tasks_lite;
use crate::task::{self, session_state_name};

/// What [`pause_session`] did.
#[derive(Debug)]
pub(crate) struct Paused {
    /// The session after the command.
    pub(crate) summary: SessionSummary,
    /// Tasks still running; they finish while the session is paused.
    pub(crate) running: Vec<String>,
    /// False when the session was already paused (nothing was recorded).
    pub(crate) changed: bool,
}

/// Pauses an active session, recording a session transition and a `session_paused`
/// message; a paused session is left as it is. FAILED_PRECONDITION for a session that
/// ended (completed, failed or cancelled).
pub(crate) async fn pause_session(
    store: &Store,
    session_id: &str,
    reason: &str,
    now: i64,
) -> Result<Paused, Error> {
    let mut tx = store.begin().await?;
    let mut session = lock_and_load_session(&mut tx, session_id, store.for_update()).await?;
    let running: Vec<String> = load_tasks_lite(&mut tx, session_id)
        .await?
        .into_iter()
        .filter(|task| task.state == TaskState::Running)
        .map(|task| task.id)
        .collect();
    let changed = match session.state {
        SessionState::Paused => false,
        SessionState::Active => {
            let reason = if reason.is_empty() {
                "paused by user"
            } else {
                reason
            };
            set_session_state(&mut tx, &mut session, SessionState::Paused, reason, now).await?;
            let mut data = Map::new();
            data.insert("reason".to_owned(), Value::String(reason.to_owned()));
            data.insert(
                "running".to_owned(),
                Value::Array(running.iter().cloned().map(Value::String).collect()),
            );
            let message = NewMessage {
                from: "coordinator".to_owned(),
                to: "all".to_owned(),
                kind: "session_paused".to_owned(),
                summary: format!("[coordinator] session paused: {reason}"),
                data: Some(data),
                idempotency_key: None,
            };
            insert_message(&mut tx, session_id, message, now).await?;
            true
        }
        state if task::is_session_terminal(state) => {
            return Err(Error::FailedPrecondition(format!(
                "session {session_id} already ended ({}) and cannot be paused",
                session_state_name(state)
            )));
        }
        state => {
            return Err(Error::FailedPrecondition(format!(
                "session {session_id} is {} and cannot be paused",
                session_state_name(state)
            )));
        }
    };
    let summary = load_summary(&mut tx, session_id).await?;
    tx.commit().await?;
    Ok(Paused {
        summary,
        running,
        changed,
    })
}
