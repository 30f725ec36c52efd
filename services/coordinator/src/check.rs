//! CCW's `check`, free of I/O: the status graph, waves, active workers, stall report and
//! capability gaps of a session, computed from rows the store loaded.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use troupe_proto::v1::{self as pb, GraphStatus, SessionState, TaskState};

use crate::convert::{opt_timestamp, struct_to_json};
use crate::lifecycle::routing::{self, Offer};
use crate::store::check::CheckRows;
use crate::task;

/// Returns the graph status of a task state (CCW's done / running / ready / pending).
pub(crate) fn graph_status(state: TaskState) -> GraphStatus {
    match state {
        TaskState::Completed => GraphStatus::Done,
        TaskState::Running => GraphStatus::Running,
        TaskState::Ready => GraphStatus::Ready,
        TaskState::Pending | TaskState::Unspecified => GraphStatus::Pending,
        TaskState::Blocked => GraphStatus::Blocked,
        TaskState::Failed => GraphStatus::Failed,
        TaskState::TimedOut => GraphStatus::TimedOut,
        TaskState::WaitingApproval => GraphStatus::WaitingApproval,
        TaskState::Skipped => GraphStatus::Skipped,
        TaskState::Cancelled => GraphStatus::Cancelled,
    }
}

/// The task a `progress` message is about: `data.task_id`, else its sender.
fn progress_task(message: &pb::Message) -> String {
    message
        .data
        .as_ref()
        .map(struct_to_json)
        .and_then(|data| {
            data.get("task_id")
                .and_then(|id| id.as_str().map(str::to_owned))
        })
        .unwrap_or_else(|| message.from.clone())
}

/// The most stuck tasks, or ready task ids of a capability gap, a status lists (it counts the
/// rest); the one-line summaries name the first [`NAMED`].
pub(crate) const MAX_LISTED: usize = 1_000;

/// Task ids a one-line summary names before it counts the rest.
const NAMED: usize = 20;

/// The first [`NAMED`] of `ids`, joined, and how many more there are.
pub(crate) fn named<'a>(ids: impl ExactSizeIterator<Item = &'a str>) -> String {
    let count = ids.len();
    named_of(ids, count)
}

/// The first [`NAMED`] of `ids`, the first of `count`, joined, and how many more there are.
pub(crate) fn named_of<'a>(ids: impl Iterator<Item = &'a str>, count: usize) -> String {
    let mut text = ids.take(NAMED).collect::<Vec<_>>().join(", ");
    if count > NAMED {
        text.push_str(&format!(" and {} more", count - NAMED));
    }
    text
}

/// Builds the read-only status of a session from the rows [`crate::store::check`] read (its
/// graph bounded there: see [`CheckRows::shown`]).
pub(crate) fn status(
    session: pb::Session,
    rows: &CheckRows,
    blockers: Vec<pb::Message>,
    progress_messages: &[pb::Message],
    capability_gaps: Vec<pb::CapabilityGap>,
    now_ms: i64,
) -> pb::CheckSessionResponse {
    // A failed task a fix round superseded is replaced by its re-run: not counted as work.
    let total = rows.active as usize;
    let done = rows.counts.completed as usize;
    // An empty plan is trivially complete.
    let percent_complete = (done * 100)
        .checked_div(total)
        .map_or(100, |percent| u32::try_from(percent).unwrap_or(100));
    // Oldest first, so later notes win.
    let mut latest: HashMap<String, String> = HashMap::new();
    for message in progress_messages {
        latest.insert(progress_task(message), message.summary.clone());
    }
    let shown = &rows.shown;
    let graph: Vec<pb::StatusNode> = shown
        .iter()
        .map(|task| pb::StatusNode {
            task_id: task.id.clone(),
            title: task.title.clone(),
            role: task.role as i32,
            state: task.state as i32,
            status: graph_status(task.state) as i32,
            wave: task.wave,
            depends_on: task.depends_on.clone(),
            waiting_on: task
                .depends_on
                .iter()
                .filter(|dep| rows.dep_states.get(dep.as_str()) != Some(&TaskState::Completed))
                .cloned()
                .collect(),
            progress: if task.progress.is_empty() {
                latest.get(&task.id).cloned().unwrap_or_default()
            } else {
                task.progress.clone()
            },
            worker_id: task.worker_id.clone(),
            attempt: task.attempt,
            repo: task.repo.clone(),
            superseded_by: task.superseded_by.clone(),
        })
        .collect();
    let mut waves: BTreeMap<u32, pb::Wave> = rows
        .waves
        .iter()
        .map(|(number, task_count)| {
            let wave = pb::Wave {
                number: *number,
                task_count: *task_count,
                ..Default::default()
            };
            (*number, wave)
        })
        .collect();
    for task in shown {
        if let Some(wave) = waves.get_mut(&task.wave) {
            wave.task_ids.push(task.id.clone());
        }
    }
    let graph_omitted = rows
        .counts
        .total
        .saturating_sub(u32::try_from(graph.len()).unwrap_or(u32::MAX));
    let waves = waves.into_values().collect();
    // Every running task is in `shown`.
    let active_workers = shown
        .iter()
        .filter(|task| task.state == TaskState::Running)
        .map(|task| {
            let started = task.started_at.unwrap_or(now_ms);
            let elapsed = Duration::from_millis(u64::try_from(now_ms - started).unwrap_or(0));
            pb::ActiveWorker {
                worker_id: task.worker_id.clone(),
                task_id: task.id.clone(),
                role: task.role as i32,
                attempt: task.attempt,
                started_at: opt_timestamp(task.started_at),
                elapsed: prost_types::Duration::try_from(elapsed).ok(),
                lease_expires_at: opt_timestamp(task.lease_expires_at),
            }
        })
        .collect();
    let state = session.state();
    let stall = (!rows.moving && !rows.stuck.is_empty()).then(|| {
        let stuck: Vec<task::Stuck> = rows
            .stuck
            .iter()
            .map(|task| task::stuck(task, |dep| rows.dep_states.get(dep).copied(), state))
            .collect();
        let count = rows.counts.pending + rows.counts.blocked;
        stall_report(&stuck, count, state)
    });
    pb::CheckSessionResponse {
        session: Some(session),
        percent_complete,
        graph,
        waves,
        active_workers,
        blockers,
        stall,
        capability_gaps,
        quota_waits: Vec::new(),
        graph_omitted,
    }
}

/// `stuck`: the first of the `count` stuck tasks.
fn stall_report(stuck: &[task::Stuck], count: u32, state: SessionState) -> pb::StallReport {
    let hint = match state {
        SessionState::Paused | SessionState::Failed => "; `resume` retries and reactivates",
        _ => "",
    };
    pb::StallReport {
        summary: format!(
            "stalled: nothing ready or running and {count} task(s) cannot start: {}{hint}",
            named_of(
                stuck.iter().map(|task| task.task_id.as_str()),
                count as usize
            )
        ),
        task_count: count,
        tasks: stuck
            .iter()
            .take(MAX_LISTED)
            .map(|task| pb::StuckTask {
                task_id: task.task_id.clone(),
                state: task.state as i32,
                reason: task.reason.clone(),
            })
            .collect(),
    }
}

/// Returns the roles whose ready tasks (`ready`: task id and role) no worker has claimed for
/// `threshold`: `seen` is when a worker serving each role was last seen, `floor` when the
/// coordinator started (no one could have claimed before). `ready` may be the first of them:
/// `counts` has how many each role has (a role missing there: as many as `ready` lists).
pub(crate) fn capability_gaps(
    ready: &[(String, pb::Role)],
    counts: &HashMap<pb::Role, u32>,
    seen: &HashMap<pb::Role, i64>,
    floor: i64,
    now_ms: i64,
    threshold: Duration,
) -> Vec<pb::CapabilityGap> {
    let threshold_ms = i64::try_from(threshold.as_millis()).unwrap_or(i64::MAX);
    let served = |role: pb::Role| seen.get(&role).is_some_and(|at| now_ms - at < threshold_ms);
    let mut by_role: BTreeMap<i32, Vec<String>> = BTreeMap::new();
    for (task_id, role) in ready {
        by_role
            .entry(*role as i32)
            .or_default()
            .push(task_id.clone());
    }
    let mut gaps = Vec::new();
    for (role, task_ids) in by_role {
        let role = pb::Role::try_from(role).unwrap_or(pb::Role::Unspecified);
        let last = seen.get(&role).copied().unwrap_or(floor).max(floor);
        let unserved = now_ms - last;
        if unserved < threshold_ms {
            continue;
        }
        // CCW's redirect: another role whose id prefix covers these tasks and has workers.
        let covered_by = task_ids
            .iter()
            .filter_map(|id| troupe_plan::TaskKind::from_id(id))
            .map(|kind| kind.role().to_proto())
            .find(|other| *other != role && served(*other));
        let name = role_name(role);
        let listed = u32::try_from(task_ids.len()).unwrap_or(u32::MAX);
        let task_count = counts.get(&role).map_or(listed, |count| listed.max(*count));
        let mut message = format!(
            "no worker has claimed role {name} for {}s; ready: {}",
            unserved / 1000,
            named_of(task_ids.iter().map(String::as_str), task_count as usize)
        );
        match covered_by {
            Some(other) => message.push_str(&format!(
                "; role {} covers their id prefix and has workers: redirect them there or start a worker for role {name}",
                role_name(other)
            )),
            None => message.push_str(&format!("; start a worker for role {name}")),
        }
        let mut task_ids = task_ids;
        task_ids.truncate(MAX_LISTED);
        gaps.push(pb::CapabilityGap {
            role: role as i32,
            task_ids,
            task_count,
            unserved_for: prost_types::Duration::try_from(Duration::from_millis(
                u64::try_from(unserved).unwrap_or(0),
            ))
            .ok(),
            covered_by: covered_by.unwrap_or(pb::Role::Unspecified) as i32,
            message,
            backend: String::new(),
        });
    }
    gaps
}

/// A ready task: its id, role and the backends a worker must offer one of (see
/// [`crate::lifecycle::routing`]).
pub(crate) type Ready = (String, pb::Role, Vec<String>);

/// Returns, per role and backend, the ready tasks (`ready`) that no live worker can run:
/// `offers` are what the live workers of each role offer. Roles in `unserved` (no live worker
/// at all: a role gap already says so) are left out. `ready` may be the first of them:
/// `counts` has how many each role and primary backend has (missing: as many as listed).
pub(crate) fn backend_gaps(
    ready: &[Ready],
    counts: &HashMap<(pb::Role, String), u32>,
    offers: &HashMap<pb::Role, Vec<Offer>>,
    unserved: &[pb::Role],
) -> Vec<pb::CapabilityGap> {
    let mut by_backend: BTreeMap<(i32, String), (Vec<String>, Vec<String>)> = BTreeMap::new();
    for (task_id, role, routes) in ready {
        let Some(primary) = routes.first() else {
            continue;
        };
        let live = offers.get(role).map_or(&[][..], Vec::as_slice);
        if unserved.contains(role) || live.is_empty() || routing::served(live, routes) {
            continue;
        }
        let entry = by_backend
            .entry((*role as i32, primary.clone()))
            .or_default();
        entry.0.push(task_id.clone());
        for fallback in &routes[1..] {
            if !entry.1.contains(fallback) {
                entry.1.push(fallback.clone());
            }
        }
    }
    by_backend
        .into_iter()
        .map(|((role, backend), (task_ids, fallbacks))| {
            let role = pb::Role::try_from(role).unwrap_or(pb::Role::Unspecified);
            let name = role_name(role);
            let listed = u32::try_from(task_ids.len()).unwrap_or(u32::MAX);
            let task_count = counts
                .get(&(role, backend.clone()))
                .map_or(listed, |count| listed.max(*count));
            let also = if fallbacks.is_empty() {
                String::new()
            } else {
                format!(" (or their fallbacks: {})", fallbacks.join(", "))
            };
            let message = format!(
                "no live {name} worker can run backend {backend}{also}; ready: {}; start a \
                 worker for role {name} where `{backend}` is installed and signed in (`troupe \
                 doctor` there lists it available), or name a backend your workers have in \
                 these tasks' `agent.backend` or `agent.fallback`",
                named_of(task_ids.iter().map(String::as_str), task_count as usize)
            );
            let mut task_ids = task_ids;
            task_ids.truncate(MAX_LISTED);
            pb::CapabilityGap {
                role: role as i32,
                task_ids,
                task_count,
                unserved_for: None,
                covered_by: pb::Role::Unspecified as i32,
                message,
                backend,
            }
        })
        .collect()
}

/// Returns the plan name of a role (`executor`, `validator`, `test-runner`).
pub(crate) fn role_name(role: pb::Role) -> &'static str {
    troupe_plan::Role::from_proto(role).map_or("unspecified", troupe_plan::Role::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_need_the_threshold_and_name_a_covering_role() {
        let ready = vec![
            ("TEST-1".to_owned(), pb::Role::Validator),
            ("IMPL-1".to_owned(), pb::Role::Executor),
        ];
        let mut seen = HashMap::new();
        seen.insert(pb::Role::Executor, 9_500);
        seen.insert(pb::Role::TestRunner, 9_900);
        let gaps = capability_gaps(
            &ready,
            &HashMap::new(),
            &seen,
            0,
            10_000,
            Duration::from_secs(2),
        );
        assert_eq!(gaps.len(), 1, "{gaps:?}");
        assert_eq!(gaps[0].role(), pb::Role::Validator);
        assert_eq!(gaps[0].covered_by(), pb::Role::TestRunner);
        assert!(gaps[0].message.contains("validator"), "{}", gaps[0].message);
        // Right after the coordinator started nobody could have claimed yet.
        assert!(
            capability_gaps(
                &ready,
                &HashMap::new(),
                &seen,
                9_000,
                10_000,
                Duration::from_secs(2)
            )
            .is_empty()
        );
    }

    #[test]
    fn a_backend_gap_names_the_backend_no_live_worker_offers() {
        let names = |list: &[&str]| list.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>();
        let ready: Vec<Ready> = vec![
            ("IMPL-1".into(), pb::Role::Executor, names(&["claude"])),
            ("IMPL-2".into(), pb::Role::Executor, names(&["codex"])),
            (
                "IMPL-3".into(),
                pb::Role::Executor,
                names(&["claude", "gemini"]),
            ),
            ("IMPL-4".into(), pb::Role::Executor, Vec::new()),
            ("VALIDATE-1".into(), pb::Role::Validator, names(&["claude"])),
        ];
        let mut offers = HashMap::new();
        offers.insert(pb::Role::Executor, vec![Some(names(&["agent", "codex"]))]);
        let gaps = backend_gaps(&ready, &HashMap::new(), &offers, &[]);
        assert_eq!(gaps.len(), 1, "{gaps:?}");
        assert_eq!(gaps[0].backend, "claude");
        assert_eq!(gaps[0].role(), pb::Role::Executor);
        assert_eq!(gaps[0].task_ids, ["IMPL-1", "IMPL-3"]);
        assert!(
            gaps[0]
                .message
                .contains("backend claude (or their fallbacks: gemini)"),
            "{}",
            gaps[0].message
        );
        assert!(
            gaps[0].message.contains("troupe doctor"),
            "{}",
            gaps[0].message
        );
        // A live worker that declares nothing runs anything; a role with no live worker is
        // a role gap, not a backend one.
        offers.insert(pb::Role::Executor, vec![Some(names(&["codex"])), None]);
        assert!(backend_gaps(&ready, &HashMap::new(), &offers, &[]).is_empty());
        offers.insert(pb::Role::Executor, vec![Some(names(&["codex"]))]);
        assert!(backend_gaps(&ready, &HashMap::new(), &offers, &[pb::Role::Executor]).is_empty());
    }
}
