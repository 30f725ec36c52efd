//! Creating a session: its rows, its tasks, and the first of them released.

use troupe_proto::v1::{self as pb, SessionState, TaskState, session_event::Kind};

use super::save;
use crate::Error;
use crate::store::events::append_event;
use crate::store::sessions::NewSession;
use crate::store::tasks::insert_tasks;
use crate::store::{Store, sessions};

/// Stores a new session with its repos and tasks and releases its first tasks, atomically.
pub(crate) async fn create_session(store: &Store, new: NewSession, now: i64) -> Result<(), Error> {
    let mut tx = store.begin().await?;
    let session = &new.session;
    sessions::insert_session(&mut tx, &new, now).await?;
    append_event(
        &mut tx,
        &session.id,
        now,
        Kind::Session(pb::SessionTransition {
            from: SessionState::Unspecified as i32,
            to: SessionState::Active as i32,
            reason: "session created".to_owned(),
        }),
    )
    .await?;
    let gates: Vec<(String, String)> = new
        .tasks
        .iter()
        .filter_map(|task| {
            troupe_plan::approval_prompt(&task.spec).map(|prompt| (task.id.clone(), prompt))
        })
        .chain(
            troupe_plan::checkpoint::checkpoints_of(&new.plan_json)
                .into_iter()
                .map(|(id, prompt)| (super::gate::checkpoint_gate(&id), prompt)),
        )
        .collect();
    crate::store::gates::insert_gates(&mut tx, &session.id, &gates).await?;
    insert_tasks(&mut tx, &new.tasks).await?;
    let mut transitions = Vec::new();
    for task in &new.tasks {
        transitions.push(pb::TaskTransition {
            task_id: task.id.clone(),
            from: TaskState::Unspecified as i32,
            to: task.state as i32,
            attempt: 0,
            worker_id: String::new(),
            reason: if task.state == TaskState::Completed {
                "task imported as completed".to_owned()
            } else {
                "task created".to_owned()
            },
        });
    }
    let mut active = session.clone();
    active.state = SessionState::Active;
    let before = new.tasks.clone();
    let mut tasks = new.tasks;
    save(&mut tx, &mut active, &before, &mut tasks, transitions, now).await?;
    tx.commit().await?;
    Ok(())
}
