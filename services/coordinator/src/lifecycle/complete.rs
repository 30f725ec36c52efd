//! Completing: a running task's result recorded under its fencing token, and what that
//! readies.

use std::collections::HashMap;

use troupe_proto::v1::{self as pb, SessionState, TaskState, session_event::Kind};

use super::claim::{ClaimRequest, Claimed, hand_out, lease};
use super::task_cache::TaskCache;
use super::{find_task_mut, save, stale, write_changes};
use crate::Error;
use crate::store::events::append_events;
use crate::store::sessions::{SessionRow, set_session_state};
use crate::store::tasks::{
    Gathered, lite_columns, load_task, load_tasks_by_id, load_tasks_lite, read_batch,
    set_convergence,
};
use crate::store::{Store, Tx};
use crate::task::{self, Task, claim_order};

/// One `CompleteTask`, checked.
#[derive(Debug, Clone)]
pub(crate) struct Completion {
    pub(crate) task_id: String,
    pub(crate) token: u64,
    pub(crate) result: pb::TaskResult,
}

/// Completes a running task under its current fencing token, with the session locked and
/// loaded, inside a transaction the caller commits (see [`crate::group_commit`]), reading the whole
/// graph: for sessions that are not active and eager (see [`complete_eager`]).
pub(crate) async fn complete_in(
    tx: &mut Tx,
    session: &mut SessionRow,
    completion: Completion,
    now: i64,
) -> Result<Task, Error> {
    // Owned: `session` is passed on mutably (see `finish`).
    let session_id = session.id.clone();
    let session_id = session_id.as_str();
    let task_id = completion.task_id.as_str();
    let before = load_tasks_lite(tx, session_id).await?;
    let mut tasks = before.clone();
    let task = find_task_mut(&mut tasks, task_id, session_id)?;
    if task.state != TaskState::Running || task.fencing_token != completion.token {
        return Err(stale(task, completion.token));
    }
    write_back_convergence(tx, session_id, task_id, &completion.result).await?;
    task.result = Some(Box::new(completion.result));
    let transition = task::transition(task, TaskState::Completed, "completed", now);
    save(tx, session, &before, &mut tasks, vec![transition], now).await?;
    let task = load_task(tx, session_id, task_id).await?;
    Ok(task)
}

/// What [`complete_eager`] did.
pub(crate) struct EagerBatch {
    /// The completed tasks, in the order given.
    pub(crate) tasks: Vec<Task>,
    /// Each claim's tasks, in the order given.
    pub(crate) claimed: Vec<Vec<Claimed>>,
    /// `Some(transitions)` when it completed tasks and left no task of the session ready or
    /// running: the session may have ended or stalled, which [`super::check_end`] decides.
    pub(crate) check_end: Option<usize>,
}

/// Completes several running tasks of an active eager session and serves claims of it, at
/// once (a group commit's; one completion alone is a batch of one). All `claims` must ask
/// for the same roles. One read fetches the completed tasks, their pending dependents and
/// the session's best ready tasks; settling and the claims (which also see the tasks the
/// completions just readied) happen in memory; one update writes every change. So the
/// batch costs the same few statements however many operations it holds, and the graph is
/// never read whole (a completion can only make its own pending dependents ready). With
/// `cache` (an optimistic group's copy of the session's tasks) there is no read, and the
/// copy follows the write. Any stale token fails the whole batch (a group then runs each
/// operation alone).
pub(crate) async fn complete_eager(
    store: &Store,
    tx: &mut Tx,
    session: &mut SessionRow,
    completions: Vec<Completion>,
    claims: &[ClaimRequest],
    now: i64,
    cache: Option<&mut TaskCache>,
) -> Result<EagerBatch, Error> {
    let session_id = session.id.clone();
    let session_id = session_id.as_str();
    // Every claim asks for the same filter (see `one_batch` in the group commit).
    let filter = claims.first().map_or((&[][..], None), ClaimRequest::filter);
    let roles = filter.0;
    let wanted: usize = claims.iter().map(|claim| claim.max as usize).sum::<usize>()
        + claims.first().map_or(0, ClaimRequest::lookahead);
    let ids: Vec<String> = completions.iter().map(|c| c.task_id.clone()).collect();
    let Gathered {
        mut originals,
        dependents,
        ready,
        busy,
    } = match cache.as_deref() {
        Some(cache) => cache.gather(&ids, filter, wanted),
        None => read_batch(tx, session_id, &ids, filter, wanted).await?,
    };

    // The working set, each task once, with its stored form alongside.
    let mut before: Vec<Task> = Vec::new();
    let mut work: Vec<Task> = Vec::new();
    let mut transitions = Vec::new();
    for completion in completions {
        // Taken out, so a task completed twice in one batch is stale the second time.
        let Some(original) = originals.remove(&completion.task_id) else {
            if work.iter().any(|task| task.id == completion.task_id) {
                return Err(Error::FailedPrecondition(format!(
                    "task {} is completed twice in one transaction",
                    completion.task_id
                )));
            }
            return Err(Error::NotFound(format!(
                "task {} not found in session {session_id}",
                completion.task_id
            )));
        };
        if original.state != TaskState::Running || original.fencing_token != completion.token {
            return Err(stale(&original, completion.token));
        }
        write_back_convergence(tx, session_id, &completion.task_id, &completion.result).await?;
        before.push(original.clone());
        let mut task = original;
        task.result = Some(Box::new(completion.result));
        transitions.push(task::transition(
            &mut task,
            TaskState::Completed,
            "completed",
            now,
        ));
        work.push(task);
    }
    let completed = work.len();
    for task in dependents.into_iter().chain(ready) {
        before.push(task.clone());
        work.push(task);
    }
    // The dependents' other dependencies: only their states decide the settling, so they
    // stay out of the working set (which is copied, compared and written). A copy answers
    // for each; else the pending dependents' are read (the ready tasks settle no further).
    let read: HashMap<String, TaskState> = match cache.as_deref() {
        Some(_) => HashMap::new(),
        None => {
            let mut others: Vec<String> = Vec::new();
            for dependent in &work[completed..] {
                if dependent.state != TaskState::Pending {
                    continue;
                }
                for dep in &dependent.depends_on {
                    if !work.iter().any(|known| &known.id == dep) && !others.contains(dep) {
                        others.push(dep.clone());
                    }
                }
            }
            load_tasks_by_id(tx, session_id, &others, &lite_columns())
                .await?
                .into_iter()
                .map(|(id, task)| (id, task.state))
                .collect()
        }
    };
    let beside = |id: &str| match cache.as_deref() {
        Some(cache) => cache.state(id),
        None => read.get(id).copied(),
    };
    let settled = transitions.len();
    // Only eager sessions come here (see `one_batch` in the group commit).
    transitions.extend(task::settle_beside(
        &mut work,
        beside,
        session.mode,
        session.on_failure,
        now,
    ));
    if store.fixed(tx, session_id).await?.gated {
        super::gate::hold(tx, session_id, &mut work, &mut transitions[settled..]).await?;
    }

    // The claims take the best ready tasks, those just readied included, in claim order.
    let mut candidates: Vec<usize> = (0..work.len())
        .filter(|&i| {
            work[i].state == TaskState::Ready
                && (roles.is_empty() || roles.contains(&work[i].role))
                && super::routing::can_run(filter.1, &work[i].backends)
        })
        .collect();
    candidates.sort_by_key(|&i| claim_order(&work[i]));
    let mut candidates = candidates.into_iter();
    let mut taken: Vec<(usize, usize)> = Vec::new();
    if let Some(claim) = claims.first() {
        // The completed tasks leave their quotas before the claims count theirs.
        for task in &work[..completed] {
            claim
                .quotas
                .release(session_id, &task.id, task.fencing_token, now);
        }
    }
    for (c, claim) in claims.iter().enumerate() {
        let mut given = 0;
        while given < claim.max {
            let Some(i) = candidates.next() else { break };
            if !claim.admits(&work[i]) {
                continue;
            }
            transitions.push(lease(&mut work[i], claim));
            taken.push((c, i));
            given += 1;
        }
    }
    // Only a completion can end the session; a task ready or running keeps it going.
    let open = completed == 0
        || busy
        || work
            .iter()
            .any(|task| matches!(task.state, TaskState::Ready | TaskState::Running));
    // The usual end, every task completed, is known from a copy of the session's tasks: the
    // session's state goes out with this write (see `set_session_state`), its transition
    // after its tasks' in the log. Else, when nothing is open, `check_end` decides.
    let ends = !open
        && cache
            .as_deref()
            .is_some_and(|cache| cache.all_completed(&work));
    let count = transitions.len();
    let kinds = transitions.into_iter().map(Kind::Task).collect();
    append_events(tx, session_id, now, kinds).await?;
    if ends {
        let reason = "every task completed";
        set_session_state(tx, session, SessionState::Completed, reason, now).await?;
    }
    // The events appended above go out with the tasks.
    write_changes(tx, session_id, &before, &work, Vec::new(), now).await?;
    let cache = cache.map(|cache| {
        // Written (an optimistic write commits on its own): the cache follows.
        for (old, task) in before.iter().zip(&work) {
            if old != task {
                cache.put(task.clone());
            }
        }
        &*cache
    });
    // Moved out: a claimed task is never one of the completed ones kept below (it was ready).
    let taken = taken
        .into_iter()
        .map(|(c, i)| (c, std::mem::take(&mut work[i])))
        .collect();
    let claimed = hand_out(store, tx, session, claims.len(), taken, cache).await?;
    work.truncate(completed);
    Ok(EagerBatch {
        tasks: work,
        claimed,
        check_end: (!open && !ends).then_some(count),
    })
}

/// Whether completing with `result` writes convergence onto other tasks (see
/// [`write_back_convergence`]).
pub(crate) fn writes_convergence(result: &pb::TaskResult) -> bool {
    matches!(&result.detail, Some(pb::task_result::Detail::Validation(report)) if !report.upstream_convergence.is_empty())
}

/// Copies a validator task's per-task criterion results (`upstream_convergence` of its report)
/// onto the tasks they belong to, so each task's record carries its own `convergence`. Written
/// in the same transaction as the validator's result; a later validator overwrites it.
pub(super) async fn write_back_convergence(
    tx: &mut Tx,
    session_id: &str,
    checked_by: &str,
    result: &pb::TaskResult,
) -> Result<(), Error> {
    let Some(pb::task_result::Detail::Validation(report)) = &result.detail else {
        return Ok(());
    };
    for entry in &report.upstream_convergence {
        let convergence = pb::TaskConvergence {
            verified: entry.convergence_verified.clone(),
            met: entry.convergence_met,
            checked_by: checked_by.to_owned(),
            commit: entry.commit.clone(),
            ..pb::TaskConvergence::default()
        };
        let written = set_convergence(tx, session_id, &entry.task_id, &convergence).await?;
        if !written {
            tracing::warn!(session_id, checked_by, task_id = %entry.task_id, "convergence names an unknown task");
        }
    }
    Ok(())
}
