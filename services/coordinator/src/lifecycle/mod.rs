//! Every state change of a session and its tasks, one module per change: [`create`],
//! [`claim`], [`heartbeat`], [`complete`], [`fail`] (with the [`fix_round`] a failed check may
//! start), [`reap`], [`resume`], [`pause`], [`cancel`] and a person's answer at a [`gate`].
//!
//! The layers below: transactions → tables → lifecycle. A change runs in one transaction
//! ([`crate::store::Tx`]; the worker protocol's writes in a group commit's, see
//! [`crate::group_commit`]). It locks and loads the session and the tasks it needs through the
//! tables of [`crate::store`], decides with the task's state machine ([`crate::task`], free of
//! I/O: transitions, settling the graph, the session's outcome, stalls), and writes the changed
//! tasks with their events back through the tables ([`save`]). Nothing here writes SQL, and
//! nothing in the store decides a change.
//!
//! [`task_cache`] holds a session's tasks in memory, which a group commit's batch works on
//! instead of reading them.

use serde_json::{Map, Value};
use troupe_proto::v1::{self as pb, SessionState, TaskState, session_event::Kind};

use crate::Error;
use crate::store::Tx;
use crate::store::events::append_events;
use crate::store::messages::{NewMessage, insert_message};
use crate::store::sessions::{SessionRow, set_session_state};
use crate::store::tasks::{any_task_in, load_tasks_lite, replace_deps, reshaped};
use crate::task::{self, Task};

pub(crate) mod cancel;
pub(crate) mod claim;
pub(crate) mod complete;
pub(crate) mod create;
pub(crate) mod fail;
pub(crate) mod fix_round;
pub(crate) mod gate;
pub(crate) mod heartbeat;
pub(crate) mod pause;
pub(crate) mod reap;
pub(crate) mod resume;
pub(crate) mod routing;
pub(crate) mod task_cache;

/// Applies the graph's consequences of a change (settle, session outcome), writes the changed
/// tasks and appends every transition as an event. Returns the number of task transitions.
async fn save(
    tx: &mut Tx,
    session: &mut SessionRow,
    before: &[Task],
    tasks: &mut [Task],
    mut transitions: Vec<pb::TaskTransition>,
    now: i64,
) -> Result<usize, Error> {
    if session.state == SessionState::Active {
        let settled = transitions.len();
        transitions.extend(task::settle(tasks, session.mode, session.on_failure, now));
        gate::hold(tx, &session.id, tasks, &mut transitions[settled..]).await?;
    }
    let count = write_changes(tx, &session.id, before, tasks, transitions, now).await?;
    finish(tx, session, tasks, count, now).await?;
    Ok(count)
}

/// Writes the tasks that changed and appends every transition as an event.
async fn write_changes(
    tx: &mut Tx,
    session_id: &str,
    before: &[Task],
    tasks: &[Task],
    transitions: Vec<pb::TaskTransition>,
    now: i64,
) -> Result<usize, Error> {
    let count = transitions.len();
    append_events(
        tx,
        session_id,
        now,
        transitions.into_iter().map(Kind::Task).collect(),
    )
    .await?;
    // Each task compared with its stored form once: the write, its shape columns and the
    // dependency rows all follow from the tasks that changed.
    let changes: Vec<(&Task, &Task)> = before
        .iter()
        .zip(tasks.iter())
        .filter(|(old, new)| old != new)
        .collect();
    let changed: Vec<&Task> = changes.iter().map(|(_, new)| *new).collect();
    // With the session's events so far: one statement on PostgreSQL (see `write_events`).
    tx.write_with_events(session_id, &changed, reshaped(changes.iter().copied()))
        .await?;
    // Only a fix round re-points dependencies (under the lock).
    let repointed: Vec<&Task> = changes
        .iter()
        .filter(|(old, new)| old.depends_on != new.depends_on)
        .map(|(_, new)| *new)
        .collect();
    if !repointed.is_empty() {
        replace_deps(tx, &repointed).await?;
    }
    Ok(count)
}

/// After `count` transitions on the whole graph `tasks`: ends the session when every task is
/// terminal (updating `session` too: a group commit runs the next operation with it), and
/// reports a stall once, as it happens.
async fn finish(
    tx: &mut Tx,
    session: &mut SessionRow,
    tasks: &[Task],
    count: usize,
    now: i64,
) -> Result<(), Error> {
    let mut state = session.state;
    if session.state == SessionState::Active
        && let Some(outcome) = task::session_outcome(tasks)
    {
        let reason = if outcome == SessionState::Completed {
            "every task completed"
        } else {
            "every task is terminal and some did not complete"
        };
        set_session_state(tx, session, outcome, reason, now).await?;
        state = outcome;
    }
    // A change that leaves nothing able to move is reported once, as it happens (a paused
    // session is still on purpose; `check` says why its tasks wait).
    if count > 0
        && state != SessionState::Paused
        && let Some(stuck) = task::stall(tasks, state, now)
    {
        tracing::warn!(session_id = %session.id, stuck = stuck.len(), "session stalled");
        insert_message(tx, &session.id, stall_message(&stuck), now).await?;
    }
    Ok(())
}

/// Ends the session or reports its stall, after `count` transitions that readied nothing.
/// While some task is ready or running the session can neither end nor stall, so only when
/// none is (rare) is the whole graph read to decide.
pub(crate) async fn check_end(
    tx: &mut Tx,
    session: &mut SessionRow,
    count: usize,
    now: i64,
) -> Result<(), Error> {
    if any_task_in(tx, &session.id, &[TaskState::Ready, TaskState::Running]).await? {
        return Ok(());
    }
    // The usual end, every task completed, is known from the index alone.
    let not_completed: Vec<TaskState> = task::STATES
        .into_iter()
        .filter(|state| *state != TaskState::Completed)
        .collect();
    if session.state == SessionState::Active
        && !any_task_in(tx, &session.id, &not_completed).await?
    {
        let reason = "every task completed";
        return set_session_state(tx, session, SessionState::Completed, reason, now).await;
    }
    let tasks = load_tasks_lite(tx, &session.id).await?;
    finish(tx, session, &tasks, count, now).await
}

/// Returns the bus message reporting a stall.
fn stall_message(stuck: &[task::Stuck]) -> NewMessage {
    // Bounded however large the session: the first stuck tasks, and their count.
    let tasks = stuck
        .iter()
        .take(crate::check::MAX_LISTED)
        .map(|task| {
            let mut entry = Map::new();
            entry.insert("task_id".to_owned(), Value::String(task.task_id.clone()));
            entry.insert(
                "state".to_owned(),
                Value::String(task::state_name(task.state).to_owned()),
            );
            entry.insert("reason".to_owned(), Value::String(task.reason.clone()));
            Value::Object(entry)
        })
        .collect();
    let mut data = Map::new();
    data.insert("kind".to_owned(), Value::String("stall".to_owned()));
    data.insert("tasks".to_owned(), Value::Array(tasks));
    data.insert("task_count".to_owned(), Value::from(stuck.len()));
    NewMessage {
        from: "coordinator".to_owned(),
        to: "user".to_owned(),
        kind: "warning".to_owned(),
        summary: format!(
            "[coordinator] stalled: nothing ready or running, stuck: {}",
            crate::check::named(stuck.iter().map(|task| task.task_id.as_str()))
        ),
        data: Some(data),
        idempotency_key: None,
    }
}

/// The refusal of a heartbeat or report under a token that no longer holds the task. It says
/// which way the token is off, since the fixes differ: behind means a newer attempt took the
/// task (the caller must stop); ahead means the caller invented or mixed up a token.
fn stale(task: &Task, token: u64) -> Error {
    let current = task.fencing_token;
    let why = match token.cmp(&current) {
        std::cmp::Ordering::Less => "behind the current token: a newer attempt holds the task",
        std::cmp::Ordering::Greater => "ahead of the current token: no claim was given it",
        std::cmp::Ordering::Equal => "the current token, but the task is no longer running",
    };
    Error::FailedPrecondition(format!(
        "stale fencing token {token} for task {} (state {}, current token {current}): {why}",
        task.id,
        task::state_name(task.state),
    ))
}

fn find_task_mut<'a>(
    tasks: &'a mut [Task],
    task_id: &str,
    session_id: &str,
) -> Result<&'a mut Task, Error> {
    tasks
        .iter_mut()
        .find(|task| task.id == task_id)
        .ok_or_else(|| Error::NotFound(format!("task {task_id} not found in session {session_id}")))
}
