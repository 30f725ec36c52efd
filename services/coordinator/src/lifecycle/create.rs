//! Creating a session: its rows, its tasks, and the first of them released.

use troupe_proto::v1::{self as pb, SessionState, TaskState, session_event::Kind};

use super::{finish, gate};
use crate::Error;
use crate::store::events::append_event;
use crate::store::intake::{insert_tasks, insert_transitions};
use crate::store::sessions::{NewSession, SessionRow};
use crate::store::{Store, sessions};
use crate::task;

/// Stores a new session with its repos and tasks and releases its first tasks, atomically.
/// Returns the session and its tasks as stored (what a read of them right after the commit
/// would give), for the group commit's copy of the session.
///
/// The graph is settled before the tasks are written, so each task goes in once, in the
/// state it starts in (no second pass updating every released task), and no copy of the
/// tasks is kept to tell what changed.
pub(crate) async fn create_session(
    store: &Store,
    new: NewSession,
    now: i64,
) -> Result<(SessionRow, Vec<task::Task>), Error> {
    let mut tx = store.begin().await?;
    sessions::insert_session(&mut tx, &new, now).await?;
    // As stored: intake's repositories carry only the stored fields.
    let repos = new.repos.clone();
    let assets_digest = new
        .assets
        .as_ref()
        .map(|(digest, _)| digest.clone())
        .unwrap_or_default();
    let NewSession {
        session, mut tasks, ..
    } = new;
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
    let gates: Vec<(String, String)> = tasks
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
    let mut transitions: Vec<pb::TaskTransition> = tasks
        .iter()
        .map(|task| pb::TaskTransition {
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
        })
        .collect();
    let created = transitions.len();
    transitions.extend(task::settle(
        &mut tasks,
        session.mode,
        session.on_failure,
        now,
    ));
    gate::hold(
        &mut tx,
        &session.id,
        &mut tasks,
        &mut transitions[created..],
    )
    .await?;
    insert_tasks(&mut tx, &tasks).await?;
    let count = transitions.len();
    insert_transitions(&mut tx, &session.id, now, transitions).await?;
    let mut active = session;
    active.state = SessionState::Active;
    finish(&mut tx, &mut active, &tasks, count, now).await?;
    active.last_seq = sessions::sequence_after(&mut tx, &active.id).await?;
    tx.commit().await?;
    let fixed = sessions::Fixed {
        repos,
        assets_digest,
        gated: !gates.is_empty(),
    };
    store.remember_fixed(&active.id, fixed);
    store.refresh_statistics(tasks.len());
    Ok((active, tasks))
}
