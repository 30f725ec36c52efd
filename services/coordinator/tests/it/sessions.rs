//! Session commands: imported task status, `CheckSession`, `ResumeSession`, stall reports and
//! capability gaps.

use std::time::Duration;

use serde_json::{Value, json};
use tonic::Code;
use troupe_proto::v1::{self as pb, Role, SessionState, TaskState};

use crate::support::{
    Db, Harness, assert_code, db_tests, ids, moves_to, session_id, t, task, token,
};

fn node<'a>(check: &'a pb::CheckSessionResponse, id: &str) -> &'a pb::StatusNode {
    check
        .graph
        .iter()
        .find(|node| node.task_id == id)
        .unwrap_or_else(|| panic!("node {id} missing"))
}

fn data_of(message: &pb::Message) -> Value {
    let data = message.data.as_ref().expect("data");
    serde_json::to_value(
        data.fields
            .iter()
            .map(|(key, value)| (key.clone(), proto_value(value)))
            .collect::<serde_json::Map<_, _>>(),
    )
    .expect("json")
}

fn proto_value(value: &prost_types::Value) -> Value {
    use prost_types::value::Kind;
    match &value.kind {
        Some(Kind::StringValue(text)) => Value::String(text.clone()),
        Some(Kind::NumberValue(number)) => json!(number),
        Some(Kind::BoolValue(flag)) => Value::Bool(*flag),
        Some(Kind::ListValue(list)) => Value::Array(list.values.iter().map(proto_value).collect()),
        Some(Kind::StructValue(object)) => Value::Object(
            object
                .fields
                .iter()
                .map(|(key, value)| (key.clone(), proto_value(value)))
                .collect(),
        ),
        Some(Kind::NullValue(_)) | None => Value::Null,
    }
}

async fn imported_completed_tasks_resume_where_they_were(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "imported", "tasks": [
            {"id": "IMPL-1", "title": "done before", "status": "completed",
             "result": {"summary": "rotated tokens", "files_modified": ["src/auth.py"]}},
            {"id": "IMPL-2", "title": "was running", "status": "in_progress", "depends_on": ["IMPL-1"]},
            {"id": "IMPL-3", "title": "string result", "status": "completed", "result": "ok"},
            {"id": "VALIDATE-1", "title": "check", "status": "pending", "depends_on": ["IMPL-2", "IMPL-3"]},
        ]}))
        .await;
    let session = session_id(&created);
    let view = harness.session(&session).await;
    let first = task(&view.tasks, "IMPL-1");
    assert_eq!(first.state(), TaskState::Completed);
    let result = first.result.as_ref().expect("imported result");
    assert_eq!(result.summary, "rotated tokens");
    assert_eq!(result.files_modified, vec!["src/auth.py"]);
    assert_eq!(
        task(&view.tasks, "IMPL-3")
            .result
            .as_ref()
            .expect("result")
            .summary,
        "ok"
    );
    assert_eq!(task(&view.tasks, "IMPL-2").state(), TaskState::Ready);
    assert_eq!(task(&view.tasks, "VALIDATE-1").state(), TaskState::Pending);
    let claimed = harness.claim(&[Role::Executor], 5).await;
    assert_eq!(
        ids(&claimed),
        vec!["IMPL-2"],
        "only the unfinished task runs"
    );
    assert_eq!(claimed[0].upstream[0].task_id, "IMPL-1");
    harness.complete(&claimed[0], "ok").await.expect("complete");
    let validators = harness.claim(&[Role::Validator], 5).await;
    assert_eq!(ids(&validators), vec!["VALIDATE-1"]);
    harness.stop().await;
}

/// Figures a worker's heartbeat carries.
fn figures() -> pb::WorkProgress {
    pb::WorkProgress {
        tokens: Some(pb::Usage {
            input_tokens: 1200,
            output_tokens: 80,
            cached_input_tokens: 100,
        }),
        test: Some(pb::TestIterationProgress {
            iteration: 1,
            max_iterations: 3,
            pass_rate: 0.5,
            coverage: Some(70.0),
            failing: 2,
            total: 4,
        }),
        backend: "codex".to_owned(),
    }
}

async fn check_reports_graph_workers_progress_and_blockers(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "check", "tasks": [
            t("IMPL-1", &[]), t("IMPL-2", &["IMPL-1"]), t("IMPL-3", &["IMPL-2"]), t("VALIDATE-1", &["IMPL-1"]),
        ]}))
        .await;
    let session = session_id(&created);
    let claimed = harness.claim(&[Role::Executor], 1).await;
    harness
        .client()
        .heartbeat(pb::HeartbeatRequest {
            session_id: session.clone(),
            task_id: "IMPL-1".into(),
            fencing_token: token(&claimed[0]),
            progress: "halfway".into(),
            lease_duration: None,
            work_progress: Some(figures()),
        })
        .await
        .expect("heartbeat");
    // The figures reach the running task in GetSession and ListTasks, and the event log.
    let running = harness.session(&session).await;
    let impl1 = running
        .tasks
        .iter()
        .find(|t| t.id == "IMPL-1")
        .expect("IMPL-1");
    assert_eq!(impl1.work_progress, Some(figures()));
    assert!(
        running
            .tasks
            .iter()
            .filter(|t| t.id != "IMPL-1")
            .all(|t| t.work_progress.is_none())
    );
    let listed = harness
        .client()
        .list_tasks(pb::ListTasksRequest {
            session_id: session.clone(),
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner();
    let impl1 = listed
        .tasks
        .iter()
        .find(|t| t.id == "IMPL-1")
        .expect("IMPL-1");
    assert_eq!(impl1.work_progress, Some(figures()));
    let mut events = harness
        .client()
        .watch_session(pb::WatchSessionRequest {
            session_id: session.clone(),
            after_sequence: 0,
            follow: false,
        })
        .await
        .expect("watch")
        .into_inner();
    // The session is active, so the stream stays open: read up to its progress event.
    let mut carried = Vec::new();
    while let Some(event) = events.message().await.expect("event") {
        if let Some(pb::session_event::Kind::Progress(p)) = event.kind {
            carried.push((p.note, p.work_progress));
            break;
        }
    }
    assert_eq!(carried, vec![("halfway".to_owned(), Some(figures()))]);
    harness
        .client()
        .log_message(pb::LogMessageRequest {
            session_id: session.clone(),
            from: "IMPL-1".into(),
            r#type: "blocker".into(),
            summary: "need an API key".into(),
            ..Default::default()
        })
        .await
        .expect("log blocker");
    let before = harness
        .session(&session)
        .await
        .session
        .expect("s")
        .last_sequence;

    let check = harness.check(&session).await;
    assert_eq!(check.percent_complete, 0);
    assert_eq!(
        troupe_proto::names::name(node(&check, "IMPL-1").status()),
        "running"
    );
    assert_eq!(node(&check, "IMPL-1").progress, "halfway");
    assert_eq!(node(&check, "IMPL-1").worker_id, "worker-test");
    assert_eq!(
        troupe_proto::names::name(node(&check, "IMPL-2").status()),
        "pending"
    );
    assert_eq!(node(&check, "IMPL-2").waiting_on, vec!["IMPL-1"]);
    let waves: Vec<(u32, Vec<String>)> = check
        .waves
        .iter()
        .map(|wave| (wave.number, wave.task_ids.clone()))
        .collect();
    assert_eq!(
        waves,
        vec![
            (1, vec!["IMPL-1".to_owned()]),
            (2, vec!["IMPL-2".to_owned(), "VALIDATE-1".to_owned()]),
            (3, vec!["IMPL-3".to_owned()]),
        ]
    );
    assert_eq!(check.active_workers.len(), 1);
    let worker = &check.active_workers[0];
    assert_eq!(
        (worker.worker_id.as_str(), worker.task_id.as_str()),
        ("worker-test", "IMPL-1")
    );
    assert!(worker.elapsed.is_some() && worker.lease_expires_at.is_some());
    assert_eq!(check.blockers.len(), 1);
    assert_eq!(check.blockers[0].summary, "need an API key");
    assert!(check.stall.is_none());
    assert!(check.capability_gaps.is_empty());
    let after = harness
        .session(&session)
        .await
        .session
        .expect("s")
        .last_sequence;
    assert_eq!(before, after, "check is read-only");

    harness.complete(&claimed[0], "ok").await.expect("complete");
    let done = harness.session(&session).await;
    assert!(
        done.tasks.iter().all(|t| t.work_progress.is_none()),
        "figures are for running attempts only"
    );
    let check = harness.check(&session).await;
    assert_eq!(check.percent_complete, 25);
    assert_eq!(
        troupe_proto::names::name(node(&check, "IMPL-1").status()),
        "done"
    );
    assert_eq!(
        troupe_proto::names::name(node(&check, "IMPL-2").status()),
        "ready"
    );
    assert!(check.active_workers.is_empty());
    assert_code(
        harness
            .client()
            .check_session(pb::CheckSessionRequest {
                session_id: "nope".into(),
                ..Default::default()
            })
            .await,
        Code::NotFound,
        "nope",
    );
    harness.stop().await;
}

async fn stall_is_reported_then_resume_retries_and_finishes(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(
            json!({"name": "stall", "on_failure": "block", "max_attempts": 1, "tasks": [
                t("IMPL-1", &[]), t("IMPL-2", &["IMPL-1"]), t("IMPL-3", &["IMPL-2"]),
            ]}),
        )
        .await;
    let session = session_id(&created);
    let claimed = harness.claim(&[Role::Executor], 1).await;
    harness.fail(&claimed[0], false).await;

    let check = harness.check(&session).await;
    assert_eq!(
        check.session.as_ref().expect("s").state(),
        SessionState::Failed
    );
    let stall = check.stall.expect("stall report");
    let stuck: Vec<(&str, &str)> = stall
        .tasks
        .iter()
        .map(|task| (task.task_id.as_str(), task.reason.as_str()))
        .collect();
    assert_eq!(
        stuck,
        vec![
            ("IMPL-2", "waits on IMPL-1 (failed)"),
            ("IMPL-3", "waits on IMPL-2 (blocked)")
        ]
    );
    assert!(
        stall.summary.contains("IMPL-2, IMPL-3"),
        "{}",
        stall.summary
    );
    let warnings = harness.messages(&session, "warning").await;
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(data_of(&warnings[0])["kind"], "stall");
    assert_eq!(data_of(&warnings[0])["tasks"][0]["task_id"], "IMPL-2");

    let resumed = harness
        .client()
        .resume_session(pb::ResumeSessionRequest {
            session_id: session.clone(),
        })
        .await
        .expect("resume")
        .into_inner();
    let reconciled: Vec<(&str, TaskState)> = resumed
        .reconciled
        .iter()
        .map(|change| (change.task_id.as_str(), change.to()))
        .collect();
    assert_eq!(
        reconciled,
        vec![
            ("IMPL-1", TaskState::Pending),
            ("IMPL-2", TaskState::Pending),
            ("IMPL-3", TaskState::Pending)
        ]
    );
    let status = resumed.status.expect("status");
    assert_eq!(
        status.session.as_ref().expect("s").state(),
        SessionState::Active
    );
    assert_eq!(
        troupe_proto::names::name(node(&status, "IMPL-1").status()),
        "ready"
    );
    assert!(status.stall.is_none());
    for id in ["IMPL-1", "IMPL-2", "IMPL-3"] {
        let claimed = harness.claim(&[Role::Executor], 1).await;
        assert_eq!(ids(&claimed), vec![id]);
        harness.complete(&claimed[0], "ok").await.expect("complete");
    }
    let view = harness.session(&session).await;
    assert_eq!(view.session.expect("s").state(), SessionState::Completed);
    assert_eq!(
        task(&view.tasks, "IMPL-1").attempt,
        2,
        "one more attempt was granted"
    );
    harness.stop().await;
}

async fn resume_keeps_live_leases_and_refuses_cancelled_sessions(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "resume", "tasks": [t("IMPL-1", &[]), t("IMPL-2", &[])]}))
        .await;
    let session = session_id(&created);
    let claimed = harness.claim(&[Role::Executor], 1).await;
    let resumed = harness
        .client()
        .resume_session(pb::ResumeSessionRequest {
            session_id: session.clone(),
        })
        .await
        .expect("resume")
        .into_inner();
    assert!(resumed.reconciled.is_empty(), "{:?}", resumed.reconciled);
    let status = resumed.status.expect("status");
    assert_eq!(
        troupe_proto::names::name(node(&status, "IMPL-1").status()),
        "running"
    );
    assert_eq!(
        troupe_proto::names::name(node(&status, "IMPL-2").status()),
        "ready"
    );
    harness
        .complete(&claimed[0], "ok")
        .await
        .expect("lease still valid");
    harness
        .client()
        .cancel_session(pb::CancelSessionRequest {
            session_id: session.clone(),
            reason: String::new(),
        })
        .await
        .expect("cancel");
    assert_code(
        harness
            .client()
            .resume_session(pb::ResumeSessionRequest {
                session_id: session,
            })
            .await,
        Code::FailedPrecondition,
        "cancelled",
    );
    harness.stop().await;
}

async fn capability_gap_is_warned_and_names_a_covering_role(db: Db) {
    let harness = Harness::start_tuned(
        db,
        troupe_coordinator::Tuning {
            capability_gap_seconds: 1.0,
            ..Default::default()
        },
    )
    .await;
    let created = harness
        .create(json!({"name": "gap", "tasks": [
            {"id": "TEST-1", "title": "tests, assigned to the validator", "role": "validator"},
        ]}))
        .await;
    let session = session_id(&created);
    // A test-runner worker keeps polling: it is alive but may not take validator tasks.
    let client = harness.client();
    let poller = tokio::spawn(async move {
        loop {
            let mut client = client.clone();
            let claimed = client
                .claim_tasks(pb::ClaimTasksRequest {
                    worker_id: "test-runner-1".into(),
                    roles: vec![Role::TestRunner as i32],
                    wait: Some(prost_types::Duration {
                        seconds: 0,
                        nanos: 200_000_000,
                    }),
                    ..Default::default()
                })
                .await
                .expect("claim")
                .into_inner();
            assert!(
                claimed.tasks.is_empty(),
                "test-runner took a validator task"
            );
        }
    });
    let gap = troupe_testkit::eventually("a capability_gap message", || async {
        harness
            .messages(&session, "capability_gap")
            .await
            .into_iter()
            .next()
    })
    .await;
    let data = data_of(&gap);
    assert_eq!(data["role"], "validator");
    assert_eq!(data["covered_by"], "test-runner");
    assert_eq!(data["task_ids"], json!(["TEST-1"]));
    assert!(gap.summary.contains("validator"), "{}", gap.summary);
    let check = harness.check(&session).await;
    assert_eq!(check.capability_gaps.len(), 1);
    assert_eq!(check.capability_gaps[0].role(), Role::Validator);
    assert_eq!(check.capability_gaps[0].covered_by(), Role::TestRunner);
    // Reported once per gap, not once per scan.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(harness.messages(&session, "capability_gap").await.len(), 1);
    poller.abort();
    harness.stop().await;
}

/// A check of a large session reads and lists a bounded part of it and counts the rest: a
/// stall with 1,499 stuck tasks lists 1,000 of them (the graph as many, the failed task
/// first), and a capability gap of 1,500 ready tasks lists 1,000.
async fn a_large_check_counts_what_it_does_not_list(db: Db) {
    let harness = Harness::start_tuned(
        db,
        troupe_coordinator::Tuning {
            capability_gap_seconds: 0.2,
            ..Default::default()
        },
    )
    .await;
    let mut tasks = vec![t("IMPL-0", &[])];
    tasks.extend((1..1_500).map(|i| t(&format!("IMPL-{i}"), &["IMPL-0"])));
    let created = harness
        .create(json!({"name": "stuck", "on_failure": "block", "max_attempts": 1, "tasks": tasks}))
        .await;
    let session = session_id(&created);
    let claimed = harness.claim(&[Role::Executor], 1).await;
    harness.fail(&claimed[0], false).await;
    let check = harness.check(&session).await;
    let stall = check.stall.expect("stall report");
    assert_eq!((stall.task_count, stall.tasks.len()), (1_499, 1_000));
    assert_eq!(stall.tasks[0].task_id, "IMPL-1");
    assert_eq!(stall.tasks[0].reason, "waits on IMPL-0 (failed)");
    assert!(stall.summary.contains("1499 task(s)"), "{}", stall.summary);
    assert!(
        stall.summary.contains("IMPL-20 and 1479 more;"),
        "{}",
        stall.summary
    );
    assert_eq!((check.graph.len(), check.graph_omitted), (1_000, 500));
    assert_eq!(check.graph[0].task_id, "IMPL-0");
    assert_eq!(check.graph[0].state(), TaskState::Failed);
    assert_eq!(check.graph[1].waiting_on, ["IMPL-0"]);
    let counted: u32 = check.waves.iter().map(|wave| wave.task_count).sum();
    assert_eq!((check.waves.len(), counted), (2, 1_500));

    let validate: Vec<Value> = (0..1_500)
        .map(|i| json!({"id": format!("TEST-{i}"), "title": "t", "role": "validator"}))
        .collect();
    let created = harness
        .create(json!({"name": "gap", "tasks": validate}))
        .await;
    // No validator worker: past the threshold its tasks are a gap.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let check = harness.check(&session_id(&created)).await;
    assert!(check.stall.is_none());
    assert_eq!(
        check.capability_gaps.len(),
        1,
        "{:?}",
        check.capability_gaps
    );
    let gap = &check.capability_gaps[0];
    assert_eq!(gap.role(), Role::Validator);
    assert_eq!((gap.task_count, gap.task_ids.len()), (1_500, 1_000));
    assert_eq!(gap.task_ids[999], "TEST-999");
    assert!(gap.message.contains("and 1480 more"), "{}", gap.message);
    harness.stop().await;
}

/// The completion that leaves every task completed ends the session in its own write (the
/// session's state goes out with its sequence): the session reads completed, its transition
/// is the last event of a gap-free log, after every task's, and happens once.
async fn the_last_completion_ends_the_session_in_its_own_write(db: Db) {
    let harness = Harness::start(db).await;
    let plan = json!({"name": "ends", "tasks": [
        t("IMPL-1", &[]), t("IMPL-2", &["IMPL-1"]), t("IMPL-3", &[])
    ]});
    let session = session_id(&harness.create(plan).await);
    let first = harness.claim(&[Role::Executor], 2).await;
    assert_eq!(ids(&first), ["IMPL-1", "IMPL-3"]);
    // Completions that claim their next task run as one batch on the session's copy.
    assert!(harness.complete_and_claim(&first[1], 1).await.is_empty());
    let next = harness.complete_and_claim(&first[0], 1).await;
    assert_eq!(ids(&next), ["IMPL-2"]);
    assert!(harness.complete_and_claim(&next[0], 1).await.is_empty());

    let summary = harness.summary(&session).await;
    assert_eq!(summary.state(), SessionState::Completed);
    let events = harness.gap_free_events(&summary).await;
    let ended: Vec<usize> = events
        .iter()
        .enumerate()
        .filter(|(_, event)| {
            matches!(&event.kind, Some(pb::session_event::Kind::Session(moved))
                if moved.to() == SessionState::Completed)
        })
        .map(|(at, _)| at)
        .collect();
    assert_eq!(ended, [events.len() - 1], "one end, last: {events:?}");
    let Some(pb::session_event::Kind::Session(moved)) = &events[events.len() - 1].kind else {
        unreachable!("the end is a session transition");
    };
    assert_eq!(
        (moved.from(), moved.reason.as_str()),
        (SessionState::Active, "every task completed")
    );
    assert_eq!(moves_to(&events, TaskState::Completed), 3);
    // Nothing is left to claim, and a late claim does not wake the session.
    assert!(harness.claim(&[Role::Executor], 1).await.is_empty());
    let after = harness.summary(&session).await;
    assert_eq!(after.last_sequence, summary.last_sequence);
    harness.stop().await;
}

db_tests!(
    imported_completed_tasks_resume_where_they_were,
    check_reports_graph_workers_progress_and_blockers,
    stall_is_reported_then_resume_retries_and_finishes,
    resume_keeps_live_leases_and_refuses_cancelled_sessions,
    capability_gap_is_warned_and_names_a_covering_role,
    a_large_check_counts_what_it_does_not_list,
    the_last_completion_ends_the_session_in_its_own_write,
);
