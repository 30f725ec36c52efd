//! Approval gates: a task whose plan entry asks for `approval` waits in `waiting_approval`
//! once its dependencies complete, until a person approves it (it becomes ready) or rejects it
//! (it fails as `REJECTED`). The answer and who gave it are the transition's event.

use troupe_proto::v1::{self as pb, ErrorKind, TaskState};

use super::save;
use crate::Error;
use crate::store::gates::{self, Decision};
use crate::store::sessions::lock_and_load_session;
use crate::store::tasks::load_tasks_lite;
use crate::store::{Store, Tx};
use crate::task::{self, Task};

/// Holds at their gate the tasks `transitions` just made ready whose gate has no answer yet:
/// they wait in `waiting_approval` instead, and the transition says so.
pub(crate) async fn hold(
    tx: &mut Tx,
    session_id: &str,
    tasks: &mut [Task],
    transitions: &mut [pb::TaskTransition],
) -> Result<(), Error> {
    let readied = |t: &pb::TaskTransition| t.to == TaskState::Ready as i32 && t.attempt == 0;
    if !transitions.iter().any(readied) {
        return Ok(());
    }
    let waiting = gates::waiting_gates(tx, session_id).await?;
    if waiting.is_empty() {
        return Ok(());
    }
    for transition in transitions.iter_mut().filter(|t| readied(t)) {
        let Some(prompt) = waiting.get(&transition.task_id) else {
            continue;
        };
        if let Some(task) = tasks.iter_mut().find(|t| t.id == transition.task_id) {
            task.state = TaskState::WaitingApproval;
            transition.to = TaskState::WaitingApproval as i32;
            transition.reason = if prompt.is_empty() {
                format!("{}; waiting for approval", transition.reason)
            } else {
                format!("{}; waiting for approval: {prompt}", transition.reason)
            };
        }
    }
    Ok(())
}

/// A person's answer to a gate.
#[derive(Debug, Clone)]
pub(crate) struct Answer<'a> {
    pub(crate) approve: bool,
    /// Who answered (the caller's token or certificate name).
    pub(crate) by: &'a str,
    pub(crate) note: &'a str,
}

/// Answers the gate of `task_id` and returns the task as it then stands.
pub(crate) async fn answer(
    store: &Store,
    session_id: &str,
    task_id: &str,
    answer: Answer<'_>,
    now: i64,
) -> Result<Task, Error> {
    let mut tx = store.begin().await?;
    let mut session = lock_and_load_session(&mut tx, session_id, store.for_update()).await?;
    if task::is_session_terminal(session.state) {
        return Err(Error::FailedPrecondition(format!(
            "session {session_id} already ended ({})",
            task::session_state_name(session.state)
        )));
    }
    let before = load_tasks_lite(&mut tx, session_id).await?;
    let mut tasks = before.clone();
    let Some(position) = tasks.iter().position(|t| t.id == task_id) else {
        return Err(Error::NotFound(format!(
            "session {session_id} has no task {task_id}"
        )));
    };
    if tasks[position].state != TaskState::WaitingApproval {
        return Err(Error::FailedPrecondition(format!(
            "task {task_id} is {}, not waiting for approval",
            task::state_name(tasks[position].state)
        )));
    }
    let decision = if answer.approve {
        Decision::Approved
    } else {
        Decision::Rejected
    };
    if !gates::decide(
        &mut tx,
        session_id,
        task_id,
        decision,
        (answer.by, answer.note),
        now,
    )
    .await?
    {
        return Err(Error::FailedPrecondition(format!(
            "task {task_id} has no gate waiting for an answer"
        )));
    }
    let verb = if answer.approve {
        "approved"
    } else {
        "rejected"
    };
    let reason = if answer.note.is_empty() {
        format!("{verb} by {}", answer.by)
    } else {
        format!("{verb} by {}: {}", answer.by, answer.note)
    };
    let task = &mut tasks[position];
    let transition = if answer.approve {
        task::transition(task, TaskState::Ready, reason, now)
    } else {
        task.last_error = Some(pb::TaskError {
            kind: ErrorKind::Rejected as i32,
            message: reason.clone(),
            retryable: false,
            details: Vec::new(),
            ..Default::default()
        });
        task::transition(task, TaskState::Failed, reason, now)
    };
    save(
        &mut tx,
        &mut session,
        &before,
        &mut tasks,
        vec![transition],
        now,
    )
    .await?;
    let task = tasks.swap_remove(position);
    tx.commit().await?;
    Ok(task)
}
