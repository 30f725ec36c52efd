//! Claims across several active sessions: sessions take turns (the one served least recently
//! goes first), so a large or older session does not starve the others.

use std::time::Duration;

use serde_json::json;
use troupe_proto::v1::{Role, SessionState, TaskState};

use crate::support::{Db, Harness, db_tests, id_of, moves_to, session_id};

/// A plan of `count` independent executor tasks.
fn plan(name: &str, count: usize) -> serde_json::Value {
    let tasks: Vec<_> = (0..count)
        .map(|i| json!({"id": format!("IMPL-{i}"), "title": format!("{name} {i}")}))
        .collect();
    json!({"name": name, "tasks": tasks})
}

/// Four sessions, the oldest with 40 tasks and three later ones with 4 each, drained by one
/// worker claiming one task at a time: the claims go round the sessions, so each later session
/// is done within the first 16 claims (oldest first would give the first 40 to the oldest).
async fn sessions_take_turns_and_none_starves(db: Db) {
    let harness = Harness::start(db).await;
    let mut sessions = vec![session_id(&harness.create(plan("big", 40)).await)];
    for name in ["b", "c", "d"] {
        sessions.push(session_id(&harness.create(plan(name, 4)).await));
    }
    let mut served: Vec<usize> = Vec::new();
    loop {
        let claimed = harness.claim(&[Role::Executor], 1).await;
        let Some(claimed) = claimed.first() else {
            break;
        };
        let session = &claimed.task.as_ref().expect("task").session_id;
        served.push(
            sessions
                .iter()
                .position(|known| known == session)
                .expect("a known session"),
        );
        harness.complete(claimed, "done").await.expect("complete");
    }
    assert_eq!(served.len(), 52, "every task is claimed once");
    // Round and round while every session has work: each window of four claims serves all.
    for (round, window) in served[..16].chunks(4).enumerate() {
        let mut window = window.to_vec();
        window.sort_unstable();
        assert_eq!(
            window,
            vec![0, 1, 2, 3],
            "round {round} serves every session: {served:?}"
        );
    }
    assert!(
        served[16..].iter().all(|&s| s == 0),
        "then the big one alone"
    );
    for session in &sessions {
        assert_eq!(
            harness
                .session(session)
                .await
                .session
                .expect("session")
                .state(),
            SessionState::Completed
        );
    }
    harness.stop().await;
}

/// A worker that claims each next task with its completion (`claim_next`) stays in one session
/// for a turn (the first claim and five more), then moves to the session served least
/// recently: with two sessions of 20 tasks it alternates in runs of six until one is done.
async fn claim_next_moves_on_after_a_turn(db: Db) {
    let harness = Harness::start(db).await;
    let first = session_id(&harness.create(plan("first", 20)).await);
    let second = session_id(&harness.create(plan("second", 20)).await);
    let mut next = harness.claim(&[Role::Executor], 1).await;
    let mut served: Vec<bool> = Vec::new();
    while let Some(claimed) = next.first().cloned() {
        let session = &claimed.task.as_ref().expect("task").session_id;
        served.push(session == &second);
        next = harness.complete_and_claim(&claimed, 1).await;
        if next.is_empty() {
            next = harness.claim(&[Role::Executor], 1).await;
        }
    }
    assert_eq!(served.len(), 40, "every task is claimed once");
    // Runs of one session: six each while both have tasks, then the rest of the other.
    let mut runs: Vec<usize> = Vec::new();
    for (i, in_second) in served.iter().enumerate() {
        if i == 0 || served[i - 1] != *in_second {
            runs.push(0);
        }
        *runs.last_mut().expect("a run") += 1;
    }
    assert_eq!(runs, vec![6, 6, 6, 6, 6, 6, 2, 2], "served: {served:?}");
    assert!(!served[0], "the older session first");
    for session in [&first, &second] {
        assert_eq!(
            harness
                .session(session)
                .await
                .session
                .expect("session")
                .state(),
            SessionState::Completed
        );
    }
    harness.stop().await;
}

/// A completion whose session has nothing left ready claims the worker's next task in another
/// session (`claim_next`): the worker does not come back empty-handed to claim again.
async fn claim_next_moves_on_when_its_session_runs_dry(db: Db) {
    let harness = Harness::start(db).await;
    let first = session_id(&harness.create(plan("first", 1)).await);
    let second = session_id(&harness.create(plan("second", 3)).await);
    let claimed = harness.claim(&[Role::Executor], 1).await;
    let claimed = claimed.first().expect("a task");
    assert_eq!(claimed.task.as_ref().expect("task").session_id, first);
    let next = harness.complete_and_claim(claimed, 1).await;
    let next = next.first().expect("the next task, from the other session");
    assert_eq!(next.task.as_ref().expect("task").session_id, second);
    let view = harness.session(&first).await;
    assert_eq!(
        view.session.expect("session").state(),
        SessionState::Completed
    );
    harness.stop().await;
}

/// Six workers (`claimNext`) burn down five sessions at once, so SQLite's one lane runs
/// groups that hold several sessions, each session's part worked out on its copy, their
/// writes sent together in one call. A failure outside the group commit (every task `IMPL-3` fails
/// once, retryably) makes a copy stale: that part's write finds the sequence moved, nothing of
/// the call lands, and the parts run again, each on its own. Every task completes once, the
/// failed ones on their second attempt, and every session's events are gap-free.
async fn groups_of_several_sessions_see_what_was_written_outside_them(db: Db) {
    const SESSIONS: usize = 5;
    const TASKS: usize = 12;
    let harness = Harness::start(db).await;
    let mut sessions = Vec::new();
    for s in 0..SESSIONS {
        let tasks: Vec<_> = (0..TASKS)
            .map(|i| json!({"id": format!("IMPL-{i}"), "title": format!("s{s} {i}"), "max_attempts": 2}))
            .collect();
        let plan = json!({"name": format!("s{s}"), "tasks": tasks});
        sessions.push(session_id(&harness.create(plan).await));
    }
    let worker = |n: usize| {
        let harness = &harness;
        async move {
            let (mut done, mut failed) = (0, 0);
            let wait = || {
                harness.claim_with(
                    &[Role::Executor],
                    1,
                    Duration::from_millis(1500),
                    Duration::from_secs(30),
                )
            };
            let mut next = wait().await;
            while let Some(claimed) = next.pop() {
                let attempt = claimed.lease.as_ref().expect("lease").attempt;
                if id_of(&claimed) == "IMPL-3" && attempt == 1 {
                    harness.fail(&claimed, true).await;
                    failed += 1;
                    next = wait().await;
                    continue;
                }
                next = harness.complete_as_worker(&claimed, n).await;
                done += 1;
                if next.is_empty() {
                    next = wait().await;
                }
            }
            (done, failed)
        }
    };
    let counts = futures::future::join_all((0..6).map(worker)).await;
    let done: usize = counts.iter().map(|(done, _)| done).sum();
    let failed: usize = counts.iter().map(|(_, failed)| failed).sum();
    assert_eq!((done, failed), (SESSIONS * TASKS, SESSIONS), "{counts:?}");
    for session in &sessions {
        let view = harness.session(session).await;
        let summary = view.session.expect("session");
        assert_eq!(summary.state(), SessionState::Completed);
        for task in &view.tasks {
            let attempts = if task.id == "IMPL-3" { 2 } else { 1 };
            assert_eq!(task.attempt, attempts, "{}", task.id);
            assert_eq!(task.state(), TaskState::Completed, "{}", task.id);
        }
        let events = harness.gap_free_events(&summary).await;
        let completions = moves_to(&events, TaskState::Completed);
        assert_eq!(completions, TASKS, "each task completes once in {session}");
    }
    harness.stop().await;
}

db_tests!(
    sessions_take_turns_and_none_starves,
    claim_next_moves_on_after_a_turn,
    claim_next_moves_on_when_its_session_runs_dry,
    groups_of_several_sessions_see_what_was_written_outside_them
);

/// On PostgreSQL the coordinator refreshes the planner's statistics itself each time intakes
/// double the sessions (from 64), not minutes later when autovacuum gets there. A claim's pick
/// of a session depends on it: planned while few sessions existed, the pick probed every
/// active session (10 ms a pick at 1,000 sessions); see `store::statistics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statistics_are_refreshed_as_sessions_come_in() {
    let Some(db) = Db::postgres() else {
        return;
    };
    let harness = Harness::start(db).await;
    let url = harness.database_url.clone().expect("a PostgreSQL schema");
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    // The rows the statistics count in `sessions`, once a manual ANALYZE ran (`last_analyze`;
    // autovacuum's is `last_autoanalyze`).
    let analyzed = || async {
        let (done, rows): (bool, f32) = sqlx::query_as(
            "SELECT s.last_analyze IS NOT NULL, c.reltuples FROM pg_stat_user_tables s \
             JOIN pg_class c ON c.oid = s.relid \
             WHERE s.schemaname = current_schema() AND s.relname = 'sessions'",
        )
        .fetch_one(&pool)
        .await
        .expect("read the statistics");
        done.then_some(rows)
    };
    let plan =
        |i: usize| json!({"name": format!("s{i}"), "tasks": [{"id": "IMPL-1", "title": "one"}]});
    for i in 0..63 {
        harness.create(plan(i)).await;
    }
    assert_eq!(analyzed().await, None, "not yet: 63 sessions");
    harness.create(plan(63)).await;
    let rows = troupe_testkit::eventually_within(
        "an ANALYZE after 64 sessions",
        Duration::from_secs(30),
        analyzed,
    )
    .await;
    assert!(rows >= 63.0, "the statistics count the sessions: {rows}");
    harness.stop().await;
}
