//! Approval gates: a task whose plan entry asks for `approval` waits in `waiting_approval`
//! once its dependencies complete, until a person approves it (it becomes ready) or rejects it
//! (it fails as `REJECTED`). The answer and who gave it are the transition's event.
//!
//! A role's checkpoint (the plan's `checkpoints`, see [`troupe_plan::checkpoint`]) is a gate
//! too, stored under the id `checkpoint:ROLE:WHEN`: `before` holds each task of the role as it
//! becomes ready, `after` each task downstream of the role (depending on one of its tasks, of
//! another role). Its answer releases (or fails) every task it holds, and is also logged as a
//! `state_update` message (`data.kind` `checkpoint`), so it is an event even when it held
//! nothing.

use troupe_plan::checkpoint::{Checkpoint, When};
use troupe_proto::v1::{self as pb, ErrorKind, TaskState};

use super::save;
use crate::Error;
use crate::store::gates::{self, Decision};
use crate::store::messages::{NewMessage, insert_message};
use crate::store::sessions::{SessionRow, lock_and_load_session};
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
    let checkpoints = waiting_checkpoints(&waiting);
    for transition in transitions.iter_mut().filter(|t| readied(t)) {
        let holder = tasks
            .iter()
            .find(|t| t.id == transition.task_id)
            .and_then(|task| {
                checkpoints
                    .iter()
                    .find(|(checkpoint, _)| holds(*checkpoint, task, tasks))
            })
            .map(|((role, when), prompt)| {
                (
                    format!("checkpoint {}:{}", role.as_str(), when.as_str()),
                    prompt,
                )
            });
        let prompt = match (waiting.get(&transition.task_id), &holder) {
            (Some(prompt), _) => prompt.clone(),
            (None, Some((name, prompt))) if prompt.is_empty() => format!("at {name}"),
            (None, Some((name, prompt))) => format!("at {name}: {prompt}"),
            (None, None) => continue,
        };
        let prompt = &prompt;
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

/// The gate id a checkpoint is stored under.
pub(crate) fn checkpoint_gate(id: &str) -> String {
    format!("{CHECKPOINT}{id}")
}

const CHECKPOINT: &str = "checkpoint:";

/// The checkpoints among the waiting gates, with their prompts.
fn waiting_checkpoints(
    waiting: &std::collections::HashMap<String, String>,
) -> Vec<((troupe_plan::Role, When), String)> {
    waiting
        .iter()
        .filter_map(|(id, prompt)| {
            let checkpoint = Checkpoint::parse_id(id.strip_prefix(CHECKPOINT)?)?;
            Some((checkpoint, prompt.clone()))
        })
        .collect()
}

/// Whether the checkpoint holds `task`: one of its role's for `before`; one downstream of its
/// role (another role's, depending on one of the role's tasks) for `after`.
fn holds((role, when): (troupe_plan::Role, When), task: &Task, tasks: &[Task]) -> bool {
    let role = role.to_proto();
    match when {
        When::Before => task.role == role,
        When::After => {
            task.role != role
                && task.depends_on.iter().any(|dep| {
                    tasks
                        .iter()
                        .any(|other| other.id == *dep && other.role == role)
                })
        }
    }
}

/// Opens the transaction an answer runs in, with the session locked: a session that ended
/// takes no more answers.
async fn lock_unended(store: &Store, session_id: &str) -> Result<(Tx, SessionRow), Error> {
    let mut tx = store.begin().await?;
    let session = lock_and_load_session(&mut tx, session_id, store.for_update()).await?;
    if task::is_session_terminal(session.state) {
        return Err(Error::FailedPrecondition(format!(
            "session {session_id} already ended ({})",
            task::session_state_name(session.state)
        )));
    }
    Ok((tx, session))
}

/// Answers a role's checkpoint (`ROLE:WHEN`) and returns the tasks it held, as they then stand:
/// approved, each becomes ready unless another gate still holds it; rejected, they fail as
/// `REJECTED` (for `before`, every unfinished task of the role, since none may start now).
pub(crate) async fn answer_checkpoint(
    store: &Store,
    session_id: &str,
    id: &str,
    answer: Answer<'_>,
    now: i64,
) -> Result<Vec<Task>, Error> {
    let Some((role, when)) = Checkpoint::parse_id(id) else {
        return Err(Error::InvalidArgument(format!(
            "checkpoint must be ROLE:before or ROLE:after (ROLE executor, validator or test-runner), not {id:?}"
        )));
    };
    let (mut tx, mut session) = lock_unended(store, session_id).await?;
    let waiting = gates::waiting_gates(&mut tx, session_id).await?;
    if !waiting.contains_key(&checkpoint_gate(id)) {
        return Err(
            if gates::has_gate(&mut tx, session_id, &checkpoint_gate(id)).await? {
                Error::FailedPrecondition(format!("checkpoint {id} was already answered"))
            } else {
                Error::NotFound(format!("session {session_id} has no checkpoint {id}"))
            },
        );
    }
    let before = load_tasks_lite(&mut tx, session_id).await?;
    let mut tasks = before.clone();
    let proto_role = role.to_proto();
    let unfinished = tasks
        .iter()
        .filter(|t| t.role == proto_role && !task::is_terminal(t.state))
        .count();
    if when == When::After && unfinished > 0 {
        return Err(Error::FailedPrecondition(format!(
            "checkpoint {id} is not reached yet: {unfinished} {} task(s) still to finish",
            role.as_str()
        )));
    }
    let held = |t: &Task| t.state == TaskState::WaitingApproval && holds((role, when), t, &before);
    if when == When::Before && !before.iter().any(held) {
        return Err(Error::FailedPrecondition(format!(
            "checkpoint {id} is not reached yet: no {} task is ready to start",
            role.as_str()
        )));
    }
    let decision = if answer.approve {
        Decision::Approved
    } else {
        Decision::Rejected
    };
    gates::decide(
        &mut tx,
        session_id,
        &checkpoint_gate(id),
        decision,
        (answer.by, answer.note),
        now,
    )
    .await?;
    let verb = answer.verb();
    let reason = format!("checkpoint {id} {}", answer.decision());
    // Gates still waiting after this answer: a task another one holds stays.
    let mut still = waiting;
    still.remove(&checkpoint_gate(id));
    let others = waiting_checkpoints(&still);
    let mut transitions = Vec::new();
    let mut touched = Vec::new();
    for (i, t) in before.iter().enumerate() {
        let task = &mut tasks[i];
        if answer.approve {
            let blocked = still.contains_key(&t.id)
                || others
                    .iter()
                    .any(|(checkpoint, _)| holds(*checkpoint, t, &before));
            if held(t) && !blocked {
                transitions.push(task::transition(task, TaskState::Ready, &reason, now));
                touched.push(i);
            }
        } else if !task::is_terminal(t.state)
            && t.state != TaskState::Running
            && holds((role, when), t, &before)
        {
            task.last_error = Some(pb::TaskError {
                kind: ErrorKind::Rejected as i32,
                message: reason.clone(),
                retryable: false,
                details: Vec::new(),
                ..pb::TaskError::default()
            });
            transitions.push(task::transition(task, TaskState::Failed, &reason, now));
            touched.push(i);
        }
    }
    let data = serde_json::json!({"kind": "checkpoint", "checkpoint": id, "decision": verb,
        "by": answer.by, "note": answer.note});
    insert_message(
        &mut tx,
        session_id,
        NewMessage {
            from: "coordinator".to_owned(),
            to: "user".to_owned(),
            kind: "state_update".to_owned(),
            summary: format!("[coordinator] {reason}"),
            data: data.as_object().cloned(),
            idempotency_key: None,
        },
        now,
    )
    .await?;
    save(&mut tx, &mut session, &before, &mut tasks, transitions, now).await?;
    tx.commit().await?;
    Ok(touched.into_iter().map(|i| tasks[i].clone()).collect())
}

/// The session's tasks waiting at a checkpoint (and not at a gate of their own), with the
/// checkpoint's id (`ROLE:WHEN`): for views that offer to answer it.
pub(crate) async fn held_at_checkpoints(
    store: &Store,
    session_id: &str,
) -> Result<std::collections::HashMap<String, String>, Error> {
    let mut tx = store.begin().await?;
    let waiting = gates::waiting_gates(&mut tx, session_id).await?;
    let checkpoints = waiting_checkpoints(&waiting);
    if checkpoints.is_empty() {
        return Ok(std::collections::HashMap::new());
    }
    let tasks = load_tasks_lite(&mut tx, session_id).await?;
    drop(tx);
    Ok(tasks
        .iter()
        .filter(|t| t.state == TaskState::WaitingApproval && !waiting.contains_key(&t.id))
        .filter_map(|t| {
            let ((role, when), _) = checkpoints
                .iter()
                .find(|(checkpoint, _)| holds(*checkpoint, t, &tasks))?;
            Some((t.id.clone(), format!("{}:{}", role.as_str(), when.as_str())))
        })
        .collect())
}

/// A person's answer to a gate.
#[derive(Debug, Clone)]
pub(crate) struct Answer<'a> {
    pub(crate) approve: bool,
    /// Who answered (the caller's token or certificate name).
    pub(crate) by: &'a str,
    pub(crate) note: &'a str,
}

impl Answer<'_> {
    fn verb(&self) -> &'static str {
        if self.approve { "approved" } else { "rejected" }
    }

    /// "approved by X" (with ": note" when there is one): the reason the answer's transitions
    /// record.
    fn decision(&self) -> String {
        match self.note {
            "" => format!("{} by {}", self.verb(), self.by),
            note => format!("{} by {}: {note}", self.verb(), self.by),
        }
    }
}

/// Answers the gate of `task_id` and returns the task as it then stands.
pub(crate) async fn answer(
    store: &Store,
    session_id: &str,
    task_id: &str,
    answer: Answer<'_>,
    now: i64,
) -> Result<Task, Error> {
    let (mut tx, mut session) = lock_unended(store, session_id).await?;
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
        let waiting = gates::waiting_gates(&mut tx, session_id).await?;
        let task = &tasks[position];
        if let Some(((role, when), _)) = waiting_checkpoints(&waiting)
            .into_iter()
            .find(|(checkpoint, _)| holds(*checkpoint, task, &before))
        {
            let id = format!("{}:{}", role.as_str(), when.as_str());
            return Err(Error::FailedPrecondition(format!(
                "task {task_id} waits at checkpoint {id}: answer the checkpoint (--checkpoint {id})"
            )));
        }
        return Err(Error::FailedPrecondition(format!(
            "task {task_id} has no gate waiting for an answer"
        )));
    }
    let reason = answer.decision();
    // A role's checkpoint that holds the task too keeps it waiting after its own approval.
    let still_held = if answer.approve {
        let waiting = gates::waiting_gates(&mut tx, session_id).await?;
        waiting_checkpoints(&waiting)
            .into_iter()
            .find(|(checkpoint, _)| holds(*checkpoint, &before[position], &before))
            .map(|((role, when), _)| format!("{}:{}", role.as_str(), when.as_str()))
    } else {
        None
    };
    let task = &mut tasks[position];
    let transition = if let Some(checkpoint) = still_held {
        let reason = format!("{reason}; still waiting at checkpoint {checkpoint}");
        task::transition(task, TaskState::WaitingApproval, reason, now)
    } else if answer.approve {
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
