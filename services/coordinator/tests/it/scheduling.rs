//! The worker protocol: claims, leases, fencing, retries, failure policies, cancel.

use std::time::Duration;

use serde_json::json;
use tonic::Code;
use troupe_proto::v1::{self as pb, Role, SessionState, TaskState};

use crate::support::{Db, Harness, assert_code, db_tests, id_of, ids, session_id, t, task, token};

async fn claims_follow_roles_dependencies_and_priority(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "prio", "tasks": [
            {"id": "IMPL-A", "title": "low", "priority": "P2"},
            {"id": "IMPL-B", "title": "urgent", "priority": "P0"},
            {"id": "IMPL-C", "title": "long chain", "priority": "P1"},
            {"id": "IMPL-D", "title": "after C", "priority": "P1", "depends_on": ["IMPL-C"]},
            {"id": "IMPL-E", "title": "short chain", "priority": "P1"},
            {"id": "VALIDATE-1", "title": "check B", "depends_on": ["IMPL-B"]},
        ]}))
        .await;
    let session = session_id(&created);

    assert!(
        harness.claim(&[Role::Validator], 5).await.is_empty(),
        "validator task is not ready yet"
    );
    let first = harness.claim(&[Role::Executor], 1).await;
    assert_eq!(ids(&first), vec!["IMPL-B"], "P0 first");
    let next = harness.claim(&[Role::Executor], 2).await;
    assert_eq!(
        ids(&next),
        vec!["IMPL-C", "IMPL-E"],
        "then the longer critical path"
    );
    let last = harness.claim(&[Role::Executor, Role::TestRunner], 5).await;
    assert_eq!(ids(&last), vec!["IMPL-A"], "IMPL-D still waits for IMPL-C");

    let claimed = &first[0];
    let lease = claimed.lease.as_ref().expect("lease");
    assert_eq!((lease.attempt, lease.fencing_token), (1, 1));
    assert_eq!(
        claimed.plan_dir,
        harness
            .base_dir
            .canonicalize()
            .expect("canonical")
            .display()
            .to_string()
    );
    assert_eq!(
        claimed.repo.as_ref().expect("repo").branch,
        format!("troupe/{session}")
    );
    let running = claimed.task.as_ref().expect("task");
    assert_eq!(running.state(), TaskState::Running);
    assert_eq!(running.worker_id, "worker-test");

    harness
        .complete(claimed, "did B")
        .await
        .expect("complete B");
    let validators = harness.claim(&[Role::Validator], 5).await;
    assert_eq!(ids(&validators), vec!["VALIDATE-1"]);
    let upstream = &validators[0].upstream;
    assert_eq!(upstream.len(), 1);
    assert_eq!(upstream[0].task_id, "IMPL-B");
    assert_eq!(upstream[0].role(), Role::Executor);
    assert_eq!(
        upstream[0].result.as_ref().expect("result").summary,
        "did B"
    );
    harness.stop().await;
}

async fn estimates_rank_ready_tasks_by_their_expected_chain(db: Db) {
    let harness = Harness::start(db).await;
    // Counted in tasks IMPL-S1 (two to go) would come first. By estimate: LONG 1800 s, then
    // X (no estimate: the mean of the three given, 800 s), then S1 (300 + 300 s).
    let created = harness
        .create(json!({"name": "estimates", "tasks": [
            {"id": "IMPL-S1", "title": "short", "effort": "small"},
            {"id": "IMPL-S2", "title": "short tail", "estimate_seconds": 300, "depends_on": ["IMPL-S1"]},
            {"id": "IMPL-X", "title": "unknown"},
            {"id": "IMPL-LONG", "title": "long", "estimate_seconds": 1800},
        ]}))
        .await;
    let session = session_id(&created);
    let first = harness.claim(&[Role::Executor], 1).await;
    assert_eq!(ids(&first), vec!["IMPL-LONG"]);
    // The same order through `claimNext`, which PostgreSQL serves from the session's copy.
    let second = harness.complete_and_claim(&first[0], 1).await;
    assert_eq!(ids(&second), vec!["IMPL-X"]);
    let third = harness.complete_and_claim(&second[0], 1).await;
    assert_eq!(ids(&third), vec!["IMPL-S1"]);
    let fourth = harness.complete_and_claim(&third[0], 1).await;
    assert_eq!(ids(&fourth), vec!["IMPL-S2"]);
    assert!(harness.complete_and_claim(&fourth[0], 1).await.is_empty());
    assert_eq!(
        harness.summary(&session).await.state(),
        SessionState::Completed
    );
    harness.stop().await;
}

async fn tasks_without_estimates_rank_by_what_their_role_took_lately(db: Db) {
    let harness = Harness::start(db).await;
    // The executors' chain is now the longer one by what each role took (3 × 250 ms against
    // 4 × a few ms), so it goes first.
    assert_eq!(after_history(&harness).await, "IMPL-1");
    // A task's own estimate still outranks what its role took.
    let estimated = harness
        .create(json!({"name": "estimated", "tasks": [
            {"id": "VALIDATE-1", "title": "slow check", "estimate_seconds": 60},
            t("IMPL-1", &[]),
        ]}))
        .await;
    let estimated = session_id(&estimated);
    // Sessions take turns (a claim serves one session): the older one may come first.
    let next = loop {
        let next = harness.claim(&[Role::Executor, Role::Validator], 3).await;
        assert!(!next.is_empty(), "the estimated session is served");
        if next[0].task.as_ref().expect("task").session_id == estimated {
            break next;
        }
    };
    assert_eq!(ids(&next), vec!["VALIDATE-1", "IMPL-1"]);
    harness.stop().await;
}

async fn learning_durations_can_be_turned_off(db: Db) {
    let tuning = troupe_coordinator::Tuning {
        learn_from_sessions: 0,
        ..Default::default()
    };
    let harness = Harness::start_tuned(db, tuning).await;
    assert_eq!(after_history(&harness).await, "VALIDATE-1");
    harness.stop().await;
}

/// Runs a plan of four validators in a chain and three executors in another, none with an
/// estimate, where each executor takes 250 ms and each validator next to nothing; then
/// creates it again and returns the task its first claim gets.
async fn after_history(harness: &Harness) -> String {
    let chains = json!({"name": "learned", "tasks": [
        t("VALIDATE-1", &[]), t("VALIDATE-2", &["VALIDATE-1"]),
        t("VALIDATE-3", &["VALIDATE-2"]), t("VALIDATE-4", &["VALIDATE-3"]),
        t("IMPL-1", &[]), t("IMPL-2", &["IMPL-1"]), t("IMPL-3", &["IMPL-2"]),
    ]});
    let both = [Role::Executor, Role::Validator];
    // No history: counted in tasks, the validators' chain goes first.
    harness.create(chains.clone()).await;
    let mut claimed = harness.claim(&both, 1).await;
    assert_eq!(ids(&claimed), vec!["VALIDATE-1"]);
    while let Some(task) = claimed.first() {
        if task.task.as_ref().expect("task").role() == Role::Executor {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        harness.complete(task, "done").await.expect("complete");
        claimed = harness.claim(&both, 1).await;
    }
    let created = harness.create(chains).await;
    let first = harness.claim(&both, 1).await;
    let task = first[0].task.as_ref().expect("task");
    assert_eq!(task.session_id, session_id(&created));
    task.id.clone()
}

async fn completing_tasks_advances_the_dag_until_the_session_completes(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "chain", "tasks": [
            t("IMPL-1", &[]), t("IMPL-2", &["IMPL-1"]), t("VALIDATE-1", &["IMPL-2"]), t("TESTRUN-1", &["VALIDATE-1"]),
        ]}))
        .await;
    let session = session_id(&created);
    for (role, id) in [
        (Role::Executor, "IMPL-1"),
        (Role::Executor, "IMPL-2"),
        (Role::Validator, "VALIDATE-1"),
        (Role::TestRunner, "TESTRUN-1"),
    ] {
        let claimed = harness.claim(&[role], 4).await;
        assert_eq!(ids(&claimed), vec![id]);
        let done = harness
            .complete(&claimed[0], &format!("{id} done"))
            .await
            .expect("complete");
        assert_eq!(done.state(), TaskState::Completed);
        assert!(done.finished_at.is_some());
    }
    // Upstream of the last task is every transitive dependency, in topological order.
    let view = harness.session(&session).await;
    let summary = view.session.expect("session");
    assert_eq!(summary.state(), SessionState::Completed);
    assert_eq!(summary.counts.expect("counts").completed, 4);
    assert_eq!(
        task(&view.tasks, "IMPL-2")
            .result
            .as_ref()
            .expect("result")
            .summary,
        "IMPL-2 done"
    );
    harness.stop().await;
}

/// A worker's claim carries its direct dependencies' results only (not the whole chain
/// before it); a checker's also their completed ancestors, nearest first, in plan order.
async fn upstream_is_direct_for_workers_and_transitive_for_checkers(db: Db) {
    let harness = Harness::start(db).await;
    harness.create(json!({"name": "up", "tasks": [t("IMPL-1", &[]), t("IMPL-2", &["IMPL-1"]), t("IMPL-3", &["IMPL-2"]), t("VALIDATE-1", &["IMPL-3"])]})).await;
    let upstream_ids = |claimed: &pb::ClaimedTask| -> Vec<String> {
        claimed.upstream.iter().map(|u| u.task_id.clone()).collect()
    };
    let mut seen = Vec::new();
    for _ in 0..3 {
        let claimed = harness.claim(&[Role::Executor], 1).await;
        seen.push(upstream_ids(&claimed[0]));
        harness.complete(&claimed[0], "ok").await.expect("complete");
    }
    assert_eq!(
        seen,
        vec![vec![], vec!["IMPL-1".to_owned()], vec!["IMPL-2".to_owned()]]
    );
    let claimed = harness.claim(&[Role::Validator], 1).await;
    assert_eq!(
        upstream_ids(&claimed[0]),
        vec!["IMPL-1", "IMPL-2", "IMPL-3"]
    );
    harness.stop().await;
}

async fn stale_fencing_tokens_are_refused(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "fence", "tasks": [t("IMPL-1", &[])]}))
        .await;
    let session = session_id(&created);
    let claimed = harness.claim(&[Role::Executor], 1).await;
    let claimed = &claimed[0];
    // A token no claim was given is ahead of the task's, and the refusal says so.
    assert_code(
        harness
            .complete_with_token(claimed, token(claimed) + 1, "late")
            .await,
        Code::FailedPrecondition,
        "stale fencing token 2 for task IMPL-1 (state running, current token 1): ahead of the current token",
    );
    let heartbeat = harness
        .client()
        .heartbeat(pb::HeartbeatRequest {
            session_id: session.clone(),
            task_id: "IMPL-1".to_owned(),
            fencing_token: token(claimed) + 7,
            ..Default::default()
        })
        .await;
    assert_code(
        heartbeat,
        Code::FailedPrecondition,
        "stale fencing token 8 for task IMPL-1 (state running, current token 1): ahead of the current token",
    );

    harness.complete(claimed, "first").await.expect("complete");
    let before = harness
        .session(&session)
        .await
        .session
        .expect("session")
        .last_sequence;
    assert_code(
        harness.complete(claimed, "second").await,
        Code::FailedPrecondition,
        "stale fencing token 1 for task IMPL-1 (state completed, current token 1): the current token, but the task is no longer running",
    );
    let after = harness.session(&session).await;
    assert_eq!(
        after.session.expect("session").last_sequence,
        before,
        "nothing applied twice"
    );
    assert_eq!(
        task(&after.tasks, "IMPL-1")
            .result
            .as_ref()
            .expect("result")
            .summary,
        "first"
    );

    let missing = harness
        .client()
        .complete_task(pb::CompleteTaskRequest {
            session_id: "nope".into(),
            task_id: "IMPL-1".into(),
            fencing_token: 1,
            result: None,
            claim_next: None,
        })
        .await;
    assert_code(missing, Code::NotFound, "session nope not found");
    harness.stop().await;
}

async fn heartbeats_extend_leases_and_record_progress(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "beat", "tasks": [t("IMPL-1", &[])]}))
        .await;
    let session = session_id(&created);
    let claimed = harness
        .claim_with(&[Role::Executor], 1, Duration::ZERO, Duration::from_secs(2))
        .await;
    let first_expiry = claimed[0]
        .lease
        .as_ref()
        .expect("lease")
        .expires_at
        .expect("expiry");
    let response = harness
        .client()
        .heartbeat(pb::HeartbeatRequest {
            session_id: session.clone(),
            task_id: "IMPL-1".into(),
            fencing_token: token(&claimed[0]),
            progress: "halfway".into(),
            lease_duration: Some(prost_types::Duration {
                seconds: 60,
                nanos: 0,
            }),
            work_progress: None,
        })
        .await
        .expect("heartbeat")
        .into_inner();
    assert!(!response.cancel_requested);
    assert!(response.expires_at.expect("expiry").seconds >= first_expiry.seconds + 50);
    let view = harness.session(&session).await;
    assert_eq!(task(&view.tasks, "IMPL-1").progress, "halfway");
    harness.stop().await;
}

/// The value of the sample `series` (`name{labels}`) in this process's metrics, 0 when absent.
/// Each test runs in a process of its own (nextest), so a counter holds that test's counts.
fn metric(series: &str) -> f64 {
    troupe_telemetry::metrics::encode()
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

async fn expired_leases_are_redispatched_then_time_out(db: Db) {
    let expiries = r#"troupe_lease_expiries_total{role="executor"}"#;
    let expired_before = metric(expiries);
    let harness = Harness::start(db).await;
    let created = harness.create(json!({"name": "lease", "max_attempts": 2, "tasks": [t("IMPL-1", &[]), t("IMPL-2", &["IMPL-1"])]})).await;
    let session = session_id(&created);
    let lease = Duration::from_secs(1);
    let first = harness
        .claim_with(&[Role::Executor], 1, Duration::ZERO, lease)
        .await;
    assert_eq!(ids(&first), vec!["IMPL-1"]);
    // No heartbeat: the reaper returns the task and a waiting claim picks it up again.
    let second =
        troupe_testkit::eventually("task re-claimable after its lease expired", || async {
            let claimed = harness
                .claim_with(&[Role::Executor], 1, Duration::from_secs(2), lease)
                .await;
            (!claimed.is_empty()).then_some(claimed)
        })
        .await;
    assert_eq!(id_of(&second[0]), "IMPL-1");
    let second_lease = second[0].lease.as_ref().expect("lease");
    assert_eq!((second_lease.attempt, second_lease.fencing_token), (2, 2));
    // The first attempt's token is behind the task's, and the refusal says so.
    assert_code(
        harness.complete(&first[0], "late").await,
        Code::FailedPrecondition,
        "stale fencing token 1 for task IMPL-1 (state running, current token 2): behind the current token: a newer attempt holds the task",
    );

    // The last attempt's lease expires too: timed out for good, downstream skipped.
    troupe_testkit::eventually("task timed out", || async {
        (harness.state_of(&session, "IMPL-1").await == TaskState::TimedOut).then_some(())
    })
    .await;
    let view = harness.session(&session).await;
    assert_eq!(task(&view.tasks, "IMPL-2").state(), TaskState::Skipped);
    let last_error = task(&view.tasks, "IMPL-1")
        .last_error
        .clone()
        .expect("error");
    assert_eq!(last_error.kind(), pb::ErrorKind::Timeout);
    assert_eq!(view.session.expect("session").state(), SessionState::Failed);
    // Both attempts' leases expired, and the metrics counted each once.
    assert_eq!(metric(expiries) - expired_before, 2.0);
    // The task gauges come from the store: another coordinator on the database reads them.
    let mut config = troupe_coordinator::Config::new(harness.dir.path().join("data"));
    config.database_url.clone_from(&harness.database_url);
    let other = troupe_coordinator::App::open(config).await.expect("open");
    let refresh = troupe_grpc::boot::Service::metrics_refresh(&other);
    refresh[0]().await.expect("refresh");
    let count = |state: &str| {
        metric(&format!(
            r#"troupe_tasks{{role="executor",state="{state}"}}"#
        ))
    };
    // Other tests' sessions may share the PostgreSQL database: at least this one's tasks.
    assert!(count("timed_out") >= 1.0);
    assert!(count("skipped") >= 1.0);
    harness.stop().await;
}

async fn retryable_failure_backs_off_then_succeeds(db: Db) {
    let retries = r#"troupe_task_retries_total{role="executor",kind="check_failed"}"#;
    let retried_before = metric(retries);
    let harness = Harness::start(db).await;
    let created = harness.create(json!({"name": "retry", "tasks": [{"id": "IMPL-1", "title": "flaky", "max_attempts": 3}]})).await;
    let session = session_id(&created);
    let first = harness.claim(&[Role::Executor], 1).await;
    let failed = harness.fail(&first[0], true).await;
    let task_after = failed.task.expect("task");
    assert_eq!(task_after.state(), TaskState::Pending);
    assert_eq!(
        task_after.last_error.expect("error").message,
        "verification failed"
    );
    let retry_at = failed.retry_at.expect("retry_at");
    let now = chrono::Utc::now().timestamp();
    assert!(
        retry_at.seconds >= now - 1 && retry_at.seconds <= now + 2,
        "backoff about 1s: {retry_at:?}"
    );
    assert!(
        harness.claim(&[Role::Executor], 1).await.is_empty(),
        "not before the backoff"
    );

    let second = troupe_testkit::eventually("retry becomes claimable", || async {
        let claimed = harness
            .claim_with(
                &[Role::Executor],
                1,
                Duration::from_secs(3),
                Duration::from_secs(30),
            )
            .await;
        (!claimed.is_empty()).then_some(claimed)
    })
    .await;
    assert_eq!(second[0].lease.as_ref().expect("lease").attempt, 2);
    harness
        .complete(&second[0], "fixed")
        .await
        .expect("complete");
    let view = harness.session(&session).await;
    assert_eq!(
        view.session.expect("session").state(),
        SessionState::Completed
    );
    assert_eq!(task(&view.tasks, "IMPL-1").attempt, 2);
    // One retry, counted by its error kind.
    assert_eq!(metric(retries) - retried_before, 1.0);
    harness.stop().await;
}

async fn terminal_failure_skips_downstream(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "skip", "tasks": [
            t("IMPL-1", &[]), t("IMPL-2", &["IMPL-1"]), t("VALIDATE-1", &["IMPL-2"]), t("IMPL-3", &[]),
        ]}))
        .await;
    let session = session_id(&created);
    let claimed = harness.claim(&[Role::Executor], 2).await;
    assert_eq!(ids(&claimed), vec!["IMPL-1", "IMPL-3"]);
    // Non-retryable: terminal on the first attempt even though attempts remain.
    let failed = harness.fail(&claimed[0], false).await;
    assert_eq!(failed.task.expect("task").state(), TaskState::Failed);
    assert!(failed.retry_at.is_none());
    let view = harness.session(&session).await;
    assert_eq!(task(&view.tasks, "IMPL-2").state(), TaskState::Skipped);
    assert_eq!(task(&view.tasks, "VALIDATE-1").state(), TaskState::Skipped);
    assert_eq!(
        view.session.expect("session").state(),
        SessionState::Active,
        "IMPL-3 still running"
    );
    harness.complete(&claimed[1], "ok").await.expect("complete");
    let view = harness.session(&session).await;
    let summary = view.session.expect("session");
    assert_eq!(summary.state(), SessionState::Failed);
    let counts = summary.counts.expect("counts");
    assert_eq!((counts.failed, counts.skipped, counts.completed), (1, 2, 1));
    harness.stop().await;
}

async fn block_policy_blocks_downstream_and_retries_run_out(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(
            json!({"name": "block", "on_failure": "block", "max_attempts": 1, "tasks": [
                t("IMPL-1", &[]), t("IMPL-2", &["IMPL-1"]), t("TESTRUN-1", &["IMPL-2"]),
            ]}),
        )
        .await;
    let session = session_id(&created);
    let claimed = harness.claim(&[Role::Executor], 1).await;
    // Retryable, but max_attempts = 1: terminal.
    let failed = harness.fail(&claimed[0], true).await;
    assert_eq!(failed.task.expect("task").state(), TaskState::Failed);
    let view = harness.session(&session).await;
    assert_eq!(task(&view.tasks, "IMPL-2").state(), TaskState::Blocked);
    assert_eq!(task(&view.tasks, "TESTRUN-1").state(), TaskState::Blocked);
    assert_eq!(view.session.expect("session").state(), SessionState::Failed);
    harness.stop().await;
}

async fn waves_mode_waits_for_the_whole_wave(db: Db) {
    let harness = Harness::start(db).await;
    harness
        .create(json!({"name": "waves", "mode": "waves", "tasks": [
            t("IMPL-1", &[]), t("IMPL-2", &[]), t("IMPL-3", &["IMPL-1"]),
        ]}))
        .await;
    let claimed = harness.claim(&[Role::Executor], 2).await;
    assert_eq!(ids(&claimed), vec!["IMPL-1", "IMPL-2"]);
    harness.complete(&claimed[0], "ok").await.expect("complete");
    assert!(
        harness.claim(&[Role::Executor], 1).await.is_empty(),
        "IMPL-2 of wave 1 still runs"
    );
    harness.complete(&claimed[1], "ok").await.expect("complete");
    assert_eq!(
        ids(&harness.claim(&[Role::Executor], 1).await),
        vec!["IMPL-3"]
    );
    harness.stop().await;
}

async fn cancel_stops_everything_and_tells_running_workers(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness.create(json!({"name": "cancel", "tasks": [t("IMPL-1", &[]), t("IMPL-2", &["IMPL-1"]), t("IMPL-3", &[])]})).await;
    let session = session_id(&created);
    let claimed = harness.claim(&[Role::Executor], 1).await;
    let cancelled = harness
        .client()
        .cancel_session(pb::CancelSessionRequest {
            session_id: session.clone(),
            reason: "user abort".into(),
        })
        .await
        .expect("cancel")
        .into_inner()
        .session
        .expect("session");
    assert_eq!(cancelled.state(), SessionState::Cancelled);
    assert_eq!(cancelled.counts.expect("counts").cancelled, 3);
    let beat = harness
        .client()
        .heartbeat(pb::HeartbeatRequest {
            session_id: session.clone(),
            task_id: id_of(&claimed[0]).to_owned(),
            fencing_token: token(&claimed[0]),
            ..Default::default()
        })
        .await
        .expect("heartbeat")
        .into_inner();
    assert!(beat.cancel_requested);
    assert_code(
        harness.complete(&claimed[0], "too late").await,
        Code::FailedPrecondition,
        "cancelled",
    );
    // The worker reports the stop as told; the task stays cancelled.
    let failed = harness.fail(&claimed[0], true).await;
    assert_eq!(failed.task.expect("task").state(), TaskState::Cancelled);
    assert!(harness.claim(&[], 5).await.is_empty());
    let view = harness.session(&session).await;
    assert!(
        view.tasks
            .iter()
            .all(|task| task.state() == TaskState::Cancelled)
    );
    harness.stop().await;
}

async fn long_poll_claim_wakes_when_work_appears(db: Db) {
    let harness = Harness::start(db).await;
    let waiter = {
        let client = harness.client();
        tokio::spawn(async move {
            let mut client = client;
            client
                .claim_tasks(pb::ClaimTasksRequest {
                    worker_id: "w".into(),
                    roles: vec![Role::TestRunner as i32],
                    max_tasks: 1,
                    wait: Some(prost_types::Duration {
                        seconds: 20,
                        nanos: 0,
                    }),
                    ..Default::default()
                })
                .await
        })
    };
    let started = std::time::Instant::now();
    harness
        .create(json!({"name": "wake", "tasks": [t("TESTRUN-1", &[])]}))
        .await;
    let claimed = waiter
        .await
        .expect("join")
        .expect("claim")
        .into_inner()
        .tasks;
    assert_eq!(ids(&claimed), vec!["TESTRUN-1"]);
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "woke on the new session, not the timeout"
    );
    harness.stop().await;
}

/// A long-polling claim that finds nothing parks; the completion that readies a task of its
/// roles claims it for the waiting worker in the completion's own transaction. A claim whose
/// wait ran out, or that was answered, is withdrawn: later completions lease it nothing.
async fn a_waiting_claim_gets_the_task_a_completion_readies(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "handoff", "tasks": [
            t("IMPL-1", &[]),
            t("IMPL-2", &["IMPL-1"]),
            t("IMPL-3", &["IMPL-2"]),
        ]}))
        .await;
    let session = session_id(&created);
    let first = harness.claim(&[Role::Executor], 1).await;
    assert_eq!(ids(&first), vec!["IMPL-1"]);
    // Parks, then its wait runs out.
    let expired = harness
        .claim_with(
            &[Role::Executor],
            1,
            Duration::from_millis(200),
            Duration::from_secs(30),
        )
        .await;
    assert!(expired.is_empty());
    let waiter = {
        let mut client = harness.client();
        tokio::spawn(async move {
            client
                .claim_tasks(pb::ClaimTasksRequest {
                    worker_id: "waiter".into(),
                    roles: vec![Role::Executor as i32],
                    max_tasks: 1,
                    wait: Some(prost_types::Duration {
                        seconds: 20,
                        nanos: 0,
                    }),
                    ..Default::default()
                })
                .await
        })
    };
    // Let it park (were it not parked yet, it would claim IMPL-2 on the wake-up instead).
    tokio::time::sleep(Duration::from_millis(200)).await;
    harness
        .complete(&first[0], "first")
        .await
        .expect("complete IMPL-1");
    let second = waiter
        .await
        .expect("join")
        .expect("claim")
        .into_inner()
        .tasks;
    assert_eq!(ids(&second), vec!["IMPL-2"]);
    assert_eq!(second[0].task.as_ref().expect("task").worker_id, "waiter");
    // Neither claim is parked any more: what IMPL-2's completion readies stays ready.
    harness
        .complete(&second[0], "second")
        .await
        .expect("complete IMPL-2");
    assert_eq!(harness.state_of(&session, "IMPL-3").await, TaskState::Ready);
    harness.stop().await;
}

/// Many concurrent worker calls (group commit runs those that queue behind a transaction in
/// one transaction): every valid completion and heartbeat commits, every stale one (mixed
/// into the same groups) is refused alone, and the event sequence stays gap-free.
async fn concurrent_worker_calls_commit_together_and_stale_ones_fail_alone(db: Db) {
    let harness = Harness::start(db).await;
    let tasks: Vec<_> = (1..=40).map(|i| t(&format!("IMPL-{i}"), &[])).collect();
    let created = harness
        .create(json!({"name": "group", "tasks": tasks}))
        .await;
    let session = session_id(&created);
    let claimed = harness.claim(&[Role::Executor], 40).await;
    assert_eq!(claimed.len(), 40);
    let calls = claimed.iter().enumerate().map(|(i, claimed)| {
        let harness = &harness;
        let session = session.clone();
        async move {
            // Every fourth task also gets a stale completion and a stale heartbeat.
            let stale = i % 4 == 0;
            let late = async {
                if stale {
                    let completion = harness
                        .complete_with_token(claimed, token(claimed) + 1, "stale")
                        .await;
                    let heartbeat = harness
                        .client()
                        .heartbeat(pb::HeartbeatRequest {
                            session_id: session.clone(),
                            task_id: id_of(claimed).to_owned(),
                            fencing_token: token(claimed) + 1,
                            ..Default::default()
                        })
                        .await;
                    Some((completion, heartbeat))
                } else {
                    None
                }
            };
            let mut client = harness.client();
            let beat = client.heartbeat(pb::HeartbeatRequest {
                session_id: session.clone(),
                task_id: id_of(claimed).to_owned(),
                fencing_token: token(claimed),
                progress: "working".to_owned(),
                ..Default::default()
            });
            let (late, beat) = tokio::join!(late, beat);
            assert!(!beat.expect("heartbeat").into_inner().cancel_requested);
            let done = harness
                .complete(claimed, &format!("{} done", id_of(claimed)))
                .await
                .expect("complete");
            assert_eq!(done.state(), TaskState::Completed);
            if let Some((completion, heartbeat)) = late {
                assert_code(completion, Code::FailedPrecondition, "stale fencing token");
                assert_code(heartbeat, Code::FailedPrecondition, "stale fencing token");
            }
        }
    });
    futures::future::join_all(calls).await;
    let view = harness.session(&session).await;
    let summary = view.session.expect("session");
    assert_eq!(summary.state(), SessionState::Completed);
    for claimed in &claimed {
        let id = id_of(claimed);
        let stored = task(&view.tasks, id);
        assert_eq!(
            stored.result.as_ref().expect("result").summary,
            format!("{id} done")
        );
        assert_eq!(stored.progress, "working");
    }
    harness.gap_free_events(&summary).await;
    harness.stop().await;
}

/// `CompleteTask` with `claim_next`: the completion and the claim of the worker's next tasks
/// of the session commit together, the claim sees what the completion readied, and a refused
/// completion claims nothing.
async fn completing_a_task_can_claim_the_next_in_the_same_transaction(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "next", "tasks": [
            t("IMPL-1", &[]),
            t("IMPL-2", &[]),
            t("IMPL-3", &["IMPL-1"]),
            t("IMPL-4", &["IMPL-3"]),
        ]}))
        .await;
    let session = session_id(&created);
    let first = harness.claim(&[Role::Executor], 1).await;
    assert_eq!(ids(&first), vec!["IMPL-1"]);
    let next_claim = |max: u32| pb::ClaimTasksRequest {
        worker_id: "worker-next".to_owned(),
        roles: vec![Role::Executor as i32],
        max_tasks: max,
        lease_duration: prost_types::Duration::try_from(Duration::from_secs(30)).ok(),
        ..Default::default()
    };
    let complete = |claimed: &pb::ClaimedTask, token: u64, claim_next| pb::CompleteTaskRequest {
        session_id: session.clone(),
        task_id: id_of(claimed).to_owned(),
        fencing_token: token,
        result: Some(pb::TaskResult {
            summary: format!("{} done", id_of(claimed)),
            ..Default::default()
        }),
        claim_next,
    };

    // A stale completion is refused and claims nothing.
    assert_code(
        harness
            .client()
            .complete_task(complete(
                &first[0],
                token(&first[0]) + 1,
                Some(next_claim(4)),
            ))
            .await,
        Code::FailedPrecondition,
        "stale fencing token",
    );
    assert_eq!(harness.state_of(&session, "IMPL-2").await, TaskState::Ready);
    // A claim_next without a worker is refused before anything is done.
    let mut nameless = next_claim(1);
    nameless.worker_id.clear();
    assert_code(
        harness
            .client()
            .complete_task(complete(&first[0], token(&first[0]), Some(nameless)))
            .await,
        Code::InvalidArgument,
        "worker_id",
    );
    assert_eq!(
        harness.state_of(&session, "IMPL-1").await,
        TaskState::Running
    );

    // Completing IMPL-1 readies IMPL-3, which the same transaction claims with IMPL-2.
    let response = harness
        .client()
        .complete_task(complete(&first[0], token(&first[0]), Some(next_claim(4))))
        .await
        .expect("complete")
        .into_inner();
    assert_eq!(response.task.expect("task").state(), TaskState::Completed);
    let mut next_ids = ids(&response.next);
    next_ids.sort_unstable();
    assert_eq!(next_ids, vec!["IMPL-2", "IMPL-3"]);
    let third = response
        .next
        .iter()
        .find(|claimed| id_of(claimed) == "IMPL-3")
        .expect("IMPL-3");
    assert_eq!(third.task.as_ref().expect("task").worker_id, "worker-next");
    let upstream: Vec<&str> = third
        .upstream
        .iter()
        .map(|up| up.task_id.as_str())
        .collect();
    assert_eq!(
        upstream,
        vec!["IMPL-1"],
        "the claim carries the upstream result"
    );
    assert!(third.lease.as_ref().expect("lease").expires_at.is_some());

    // The claimed leases are real: each completes under its token; the last claim_next finds
    // IMPL-4 once IMPL-3 is done, and then nothing.
    let second = response
        .next
        .iter()
        .find(|claimed| id_of(claimed) == "IMPL-2")
        .expect("IMPL-2");
    let none = harness
        .client()
        .complete_task(complete(second, token(second), Some(next_claim(1))))
        .await
        .expect("complete IMPL-2")
        .into_inner();
    assert!(none.next.is_empty(), "IMPL-4 still waits for IMPL-3");
    let fourth = harness
        .client()
        .complete_task(complete(third, token(third), Some(next_claim(1))))
        .await
        .expect("complete IMPL-3")
        .into_inner()
        .next;
    assert_eq!(ids(&fourth), vec!["IMPL-4"]);
    let end = harness
        .client()
        .complete_task(complete(&fourth[0], token(&fourth[0]), Some(next_claim(1))))
        .await
        .expect("complete IMPL-4")
        .into_inner();
    assert!(end.next.is_empty());
    let view = harness.session(&session).await;
    assert_eq!(
        view.session.expect("session").state(),
        SessionState::Completed
    );
    harness.stop().await;
}

/// The shared worker loop (`troupe_grpc::worker`, which every worker service runs) takes a
/// chain's next task with the completion that readies it: one call per task after the first
/// claim.
async fn the_worker_loop_claims_each_next_task_with_its_completion(db: Db) {
    use troupe_grpc::worker::{TaskContext, TaskFailure, TaskHandler, WorkerConfig, WorkerStats};

    struct Quick;
    impl TaskHandler for Quick {
        async fn handle(
            &self,
            claimed: pb::ClaimedTask,
            _ctx: TaskContext,
        ) -> Result<pb::TaskResult, TaskFailure> {
            Ok(pb::TaskResult {
                summary: format!("{} done", id_of(&claimed)),
                ..Default::default()
            })
        }
    }

    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "loop", "tasks": [
            t("IMPL-1", &[]),
            t("IMPL-2", &["IMPL-1"]),
            t("IMPL-3", &["IMPL-2"]),
            t("IMPL-4", &["IMPL-3"]),
        ]}))
        .await;
    let session = session_id(&created);
    let mut config = WorkerConfig::new(harness.service.url(), "loop-worker", vec![Role::Executor]);
    config.poll_wait = Duration::from_millis(200);
    let stop = tokio_util::sync::CancellationToken::new();
    let worker = tokio::spawn(troupe_grpc::worker::run_worker(
        config,
        std::sync::Arc::new(Quick),
        stop.clone(),
    ));
    let finished = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let view = harness.session(&session).await;
            if view.session.expect("session").state() == SessionState::Completed {
                return view.tasks;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the session completes");
    assert!(
        finished
            .iter()
            .all(|task| task.worker_id == "loop-worker" && task.attempt == 1),
        "{finished:?}"
    );
    stop.cancel();
    let stats = worker.await.expect("join").expect("worker loop");
    assert_eq!(
        stats,
        WorkerStats {
            claimed: 1,
            claimed_next: 3,
            completed: 4,
            failed: 0,
            abandoned: 0,
        }
    );
    harness.stop().await;
}

/// Batches work on an in-memory copy of the session's tasks (both databases), which a write
/// outside the group commit makes stale: here a failure changes a task between two batches.
/// The next batch must see the stored task, not the copy: the completion under the old lease
/// is refused, and the other tasks go on.
async fn batches_see_what_was_written_outside_them(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "outside", "tasks": [
            t("IMPL-1", &[]),
            t("IMPL-2", &[]),
            t("IMPL-3", &[]),
            t("IMPL-4", &["IMPL-1"]),
        ]}))
        .await;
    let session = session_id(&created);
    let claimed = harness.claim(&[Role::Executor], 3).await;
    assert_eq!(ids(&claimed), vec!["IMPL-1", "IMPL-2", "IMPL-3"]);
    // A batch: the completion readies IMPL-4, which its claim takes.
    let fourth = harness.complete_and_claim(&claimed[0], 1).await;
    assert_eq!(ids(&fourth), vec!["IMPL-4"]);
    // A message moves the sequence and changes no task: the batches' copy stays good.
    let note = |summary: &str| pb::LogMessageRequest {
        session_id: session.clone(),
        from: "coordinator".into(),
        summary: summary.into(),
        ..Default::default()
    };
    harness
        .client()
        .log_message(note("between batches"))
        .await
        .expect("log");
    // Outside the batches, IMPL-2 fails for good; a message after that does not make the
    // copy from before the failure look current.
    let failed = harness.fail(&claimed[1], false).await;
    assert_eq!(failed.task.expect("task").state(), TaskState::Failed);
    harness
        .client()
        .log_message(note("after the failure"))
        .await
        .expect("log");
    // Its old lease no longer completes it, in a batch of its own or with a claim.
    assert_code(
        harness
            .complete_with_token(&claimed[1], token(&claimed[1]), "late")
            .await,
        Code::FailedPrecondition,
        "stale fencing token",
    );
    assert_code(
        harness
            .client()
            .complete_task(pb::CompleteTaskRequest {
                session_id: session.clone(),
                task_id: "IMPL-2".to_owned(),
                fencing_token: token(&claimed[1]),
                result: None,
                claim_next: Some(pb::ClaimTasksRequest {
                    worker_id: "worker-test".to_owned(),
                    roles: vec![Role::Executor as i32],
                    max_tasks: 1,
                    ..Default::default()
                }),
            })
            .await,
        Code::FailedPrecondition,
        "stale fencing token",
    );
    assert_eq!(
        harness.state_of(&session, "IMPL-2").await,
        TaskState::Failed
    );
    // The rest completes; the session ends failed, every sequence number once.
    assert!(harness.complete_and_claim(&claimed[2], 1).await.is_empty());
    assert!(harness.complete_and_claim(&fourth[0], 1).await.is_empty());
    let view = harness.session(&session).await;
    let summary = view.session.expect("session");
    assert_eq!(summary.state(), SessionState::Failed);
    harness.gap_free_events(&summary).await;
    harness.stop().await;
}

/// Writes outside the group commit (messages here) move the session's sequence between and
/// during the workers' batches: on PostgreSQL that makes optimistic batches lose their race
/// and run again under the lock. Nothing is lost, applied twice or numbered twice.
async fn messages_interleaved_with_workers_lose_and_repeat_nothing(db: Db) {
    burn_down_pairs(db, 24, 6, 4, 40).await;
}

/// Eight workers and nothing else: batches of several completions and claims on the
/// session's copy, whose EXEC claims read their upstream right after their batch's write.
/// Every task completes once, upstream results are all there and the sequence is gap-free.
async fn eight_workers_complete_each_task_once_with_its_upstream(db: Db) {
    burn_down_pairs(db, 48, 24, 8, 0).await;
}

/// `workers` workers (`claimNext`) burn down `impls` independent tasks and `execs` tasks
/// that each wait for two of them, while `messages` messages are logged.
async fn burn_down_pairs(db: Db, impls: usize, execs: usize, workers: usize, messages: usize) {
    let harness = Harness::start(db).await;
    let mut tasks: Vec<_> = (1..=impls).map(|i| t(&format!("IMPL-{i}"), &[])).collect();
    for i in 1..=execs {
        let deps = [format!("IMPL-{}", 2 * i - 1), format!("IMPL-{}", 2 * i)];
        let deps: Vec<&str> = deps.iter().map(String::as_str).collect();
        tasks.push(t(&format!("EXEC-{i}"), &deps));
    }
    let session = session_id(
        &harness
            .create(json!({"name": "interleaved", "tasks": tasks}))
            .await,
    );
    let worker = |n: usize| {
        let harness = &harness;
        async move {
            let mut done = 0;
            let mut next = harness
                .claim_with(
                    &[Role::Executor],
                    1,
                    Duration::from_millis(300),
                    Duration::from_secs(30),
                )
                .await;
            while let Some(claimed) = next.pop() {
                // An EXEC task's claim reads its upstream after its batch's write: it sees
                // both IMPL tasks' results.
                if id_of(&claimed).starts_with("EXEC") {
                    let mut upstream: Vec<(&str, bool)> = claimed
                        .upstream
                        .iter()
                        .map(|up| {
                            let by = up.result.as_ref().map(|r| r.summary.as_str());
                            let by_someone = by.is_some_and(|s| s.starts_with(&up.task_id));
                            (up.task_id.as_str(), by_someone)
                        })
                        .collect();
                    upstream.sort();
                    let i: usize = id_of(&claimed)["EXEC-".len()..].parse().expect("number");
                    let (a, b) = (format!("IMPL-{}", 2 * i - 1), format!("IMPL-{}", 2 * i));
                    let mut want = vec![(a.as_str(), true), (b.as_str(), true)];
                    want.sort();
                    assert_eq!(upstream, want, "upstream of {}", id_of(&claimed));
                }
                next = harness.complete_as_worker(&claimed, n).await;
                done += 1;
                if next.is_empty() {
                    next = harness
                        .claim_with(
                            &[Role::Executor],
                            1,
                            Duration::from_millis(300),
                            Duration::from_secs(30),
                        )
                        .await;
                }
            }
            done
        }
    };
    let logging = async {
        for n in 0..messages {
            harness
                .client()
                .log_message(pb::LogMessageRequest {
                    session_id: session.clone(),
                    from: "coordinator".into(),
                    r#type: "progress".into(),
                    summary: format!("note {n}"),
                    ..Default::default()
                })
                .await
                .expect("log");
            tokio::task::yield_now().await;
        }
    };
    let (done, ()) = tokio::join!(futures::future::join_all((0..workers).map(worker)), logging);
    assert_eq!(
        done.iter().sum::<usize>(),
        impls + execs,
        "each task completed once: {done:?}"
    );

    let view = harness.session(&session).await;
    let summary = view.session.expect("session");
    assert_eq!(summary.state(), SessionState::Completed);
    let events = harness.gap_free_events(&summary).await;
    let mut completed = std::collections::HashMap::new();
    let mut logged = 0;
    for event in &events {
        match &event.kind {
            Some(pb::session_event::Kind::Task(moved)) if moved.to() == TaskState::Completed => {
                *completed.entry(moved.task_id.clone()).or_insert(0) += 1;
            }
            Some(pb::session_event::Kind::Message(_)) => logged += 1,
            _ => {}
        }
    }
    assert_eq!(completed.len(), impls + execs);
    assert!(completed.values().all(|&n| n == 1), "{completed:?}");
    assert_eq!(logged, messages);
    harness.stop().await;
}

db_tests!(
    claims_follow_roles_dependencies_and_priority,
    estimates_rank_ready_tasks_by_their_expected_chain,
    tasks_without_estimates_rank_by_what_their_role_took_lately,
    learning_durations_can_be_turned_off,
    completing_tasks_advances_the_dag_until_the_session_completes,
    upstream_is_direct_for_workers_and_transitive_for_checkers,
    stale_fencing_tokens_are_refused,
    heartbeats_extend_leases_and_record_progress,
    expired_leases_are_redispatched_then_time_out,
    retryable_failure_backs_off_then_succeeds,
    terminal_failure_skips_downstream,
    block_policy_blocks_downstream_and_retries_run_out,
    waves_mode_waits_for_the_whole_wave,
    cancel_stops_everything_and_tells_running_workers,
    long_poll_claim_wakes_when_work_appears,
    a_waiting_claim_gets_the_task_a_completion_readies,
    concurrent_worker_calls_commit_together_and_stale_ones_fail_alone,
    completing_a_task_can_claim_the_next_in_the_same_transaction,
    messages_interleaved_with_workers_lose_and_repeat_nothing,
    eight_workers_complete_each_task_once_with_its_upstream,
    batches_see_what_was_written_outside_them,
    the_worker_loop_claims_each_next_task_with_its_completion,
);
