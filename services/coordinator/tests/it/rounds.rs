//! Fix rounds: the generator-critic loop (`test.gc` on test-runner tasks) and gap closure
//! (`gap_closure` on validator tasks), driven by fake workers over gRPC.

use serde_json::{Value, json};
use troupe_proto::v1::{self as pb, Role, SessionState, TaskState};

use tonic::Code;

use crate::support::{Db, Harness, assert_code, db_tests, id_of, ids, session_id, task, token};

fn gc_plan(max_rounds: Option<u32>) -> Value {
    let mut gc = json!({
        "agent": {"backend": "command", "command": ["python3", "{plan_dir}/agents/fix.py", "{worktree}"]},
        "focus_paths": ["src/"],
    });
    if let Some(max) = max_rounds {
        gc["max_rounds"] = json!(max);
    }
    json!({"name": "gc", "tasks": [
        {"id": "IMPL-1", "title": "build it"},
        {"id": "TESTRUN-1", "title": "run tests", "depends_on": ["IMPL-1"],
         "test": {"framework": "pytest", "coverage_target": 80, "gc": gc}},
        {"id": "DOC-1", "title": "document", "role": "executor", "depends_on": ["TESTRUN-1"]},
    ]})
}

/// A below-target test report with one failing test.
fn failing_run() -> pb::TaskResult {
    pb::TaskResult {
        summary: "1 test failed".to_owned(),
        detail: Some(pb::task_result::Detail::TestRun(pb::TestRunReport {
            outcome: pb::TestOutcome::TestsFailed as i32,
            totals: Some(pb::TestTotals {
                total: 3,
                passed: 2,
                failed: 1,
                ..Default::default()
            }),
            failures: vec![pb::TestFailure {
                name: "tests/test_calc.py::test_add".to_owned(),
                file: "tests/test_calc.py".to_owned(),
                line: 12,
                message: "assert 3 == 4".to_owned(),
                ..Default::default()
            }],
            coverage: Some(pb::Coverage {
                overall: Some(55.0),
                ..Default::default()
            }),
            coverage_target: 80.0,
            ..Default::default()
        })),
        ..Default::default()
    }
}

async fn fail_check(harness: &Harness, claimed: &pb::ClaimedTask, partial: pb::TaskResult) {
    let task = claimed.task.as_ref().expect("task");
    harness
        .client()
        .fail_task(pb::FailTaskRequest {
            session_id: task.session_id.clone(),
            task_id: task.id.clone(),
            fencing_token: token(claimed),
            error: Some(pb::TaskError {
                kind: pb::ErrorKind::CheckFailed as i32,
                message: "tests failed".to_owned(),
                retryable: false,
                details: Vec::new(),
                ..Default::default()
            }),
            partial_result: Some(partial),
        })
        .await
        .expect("fail task");
}

/// Claims exactly `id` for `role`.
async fn claim_one(harness: &Harness, role: Role, id: &str) -> pb::ClaimedTask {
    let claimed = harness.claim(&[role], 5).await;
    assert_eq!(ids(&claimed), vec![id], "claimable {role:?} tasks");
    claimed.into_iter().next().expect("claimed")
}

async fn failed_test_run_adds_a_fix_round_and_completes(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness.create(gc_plan(None)).await;
    let session = session_id(&created);
    let implement = claim_one(&harness, Role::Executor, "IMPL-1").await;
    harness
        .complete(&implement, "built")
        .await
        .expect("complete");
    let run = claim_one(&harness, Role::TestRunner, "TESTRUN-1").await;
    fail_check(&harness, &run, failing_run()).await;

    let view = harness.session(&session).await;
    let failed = task(&view.tasks, "TESTRUN-1");
    assert_eq!(failed.state(), TaskState::Failed);
    assert_eq!(failed.superseded_by, "TESTRUN-1-R1");
    let rerun = task(&view.tasks, "TESTRUN-1-R1");
    assert_eq!(rerun.state(), TaskState::Pending);
    assert_eq!(rerun.role(), Role::TestRunner);
    assert_eq!(rerun.depends_on, vec!["FIX-TESTRUN-1-R1".to_owned()]);
    let rerun_spec = crate::support::spec_json(rerun);
    assert_eq!(rerun_spec["gc_round"], json!(1));
    assert_eq!(rerun_spec["test"]["coverage_target"], json!(80));
    let doc = task(&view.tasks, "DOC-1");
    assert_eq!(doc.state(), TaskState::Pending, "downstream waits");
    assert_eq!(doc.depends_on, vec!["TESTRUN-1-R1".to_owned()]);
    let counts = view
        .session
        .as_ref()
        .expect("session")
        .counts
        .expect("counts");
    assert_eq!((counts.total, counts.failed), (5, 1));
    let order: Vec<&str> = view.tasks.iter().map(|task| task.id.as_str()).collect();
    assert_eq!(
        order,
        vec![
            "IMPL-1",
            "TESTRUN-1",
            "FIX-TESTRUN-1-R1",
            "TESTRUN-1-R1",
            "DOC-1"
        ],
        "topological order"
    );

    let triggers = harness.messages(&session, "gc_loop_trigger").await;
    assert_eq!(triggers.len(), 1);
    assert!(
        triggers[0].summary.contains("FIX-TESTRUN-1-R1"),
        "{}",
        triggers[0].summary
    );

    // The fix goes to an executor, told what failed.
    let fix = claim_one(&harness, Role::Executor, "FIX-TESTRUN-1-R1").await;
    let fix_task = fix.task.as_ref().expect("task");
    assert_eq!(
        fix_task.title,
        "Fix the failing tests of TESTRUN-1 (round 1)"
    );
    let fix_spec = crate::support::spec_json(fix_task);
    let description = fix_spec["description"].as_str().expect("description");
    assert!(
        description.contains("tests/test_calc.py::test_add (tests/test_calc.py:12): assert 3 == 4"),
        "{description}"
    );
    assert!(
        description.contains("coverage 55.0% vs target 80.0%"),
        "{description}"
    );
    assert_eq!(fix_spec["agent"]["backend"], json!("command"));
    assert_eq!(fix_spec["focus_paths"], json!(["src/"]));
    assert_eq!(fix_spec["allow_empty"], json!(false));
    assert!(
        harness.claim(&[Role::TestRunner], 5).await.is_empty(),
        "the re-run waits for the fix"
    );
    harness.complete(&fix, "fixed").await.expect("complete fix");
    let rerun = claim_one(&harness, Role::TestRunner, "TESTRUN-1-R1").await;
    assert_eq!(
        rerun
            .upstream
            .iter()
            .map(|up| up.task_id.as_str())
            .collect::<Vec<_>>(),
        vec!["FIX-TESTRUN-1-R1"]
    );
    harness
        .complete(&rerun, "green")
        .await
        .expect("complete re-run");
    let doc = claim_one(&harness, Role::Executor, "DOC-1").await;
    harness
        .complete(&doc, "documented")
        .await
        .expect("complete doc");

    let view = harness.session(&session).await;
    let session_msg = view.session.as_ref().expect("session");
    assert_eq!(session_msg.state(), SessionState::Completed);
    let counts = session_msg.counts.expect("counts");
    assert_eq!((counts.completed, counts.failed), (4, 1));
    let check = harness.check(&session).await;
    assert_eq!(check.percent_complete, 100);
    let node = check
        .graph
        .iter()
        .find(|node| node.task_id == "TESTRUN-1")
        .expect("node");
    assert_eq!(
        (
            troupe_proto::names::name(node.status()),
            node.superseded_by.as_str()
        ),
        ("failed", "TESTRUN-1-R1")
    );
    assert!(check.stall.is_none());

    // The rounds are in the event log with their reasons.
    let reasons: Vec<String> = harness
        .events(&session)
        .await
        .into_iter()
        .filter_map(|event| match event.kind {
            Some(pb::session_event::Kind::Task(transition)) => {
                Some(format!("{}: {}", transition.task_id, transition.reason))
            }
            _ => None,
        })
        .collect();
    for expected in [
        "TESTRUN-1: generator-critic round 1: superseded by TESTRUN-1-R1",
        "FIX-TESTRUN-1-R1: generator-critic round 1: fix TESTRUN-1 for TESTRUN-1",
        "TESTRUN-1-R1: generator-critic round 1: re-run TESTRUN-1 after FIX-TESTRUN-1-R1",
    ] {
        assert!(
            reasons.iter().any(|r| r == expected),
            "{expected} in {reasons:#?}"
        );
    }
    harness.stop().await;
}

async fn rounds_run_out_and_the_failure_cascades(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness.create(gc_plan(Some(2))).await;
    let session = session_id(&created);
    let implement = claim_one(&harness, Role::Executor, "IMPL-1").await;
    harness
        .complete(&implement, "built")
        .await
        .expect("complete");
    let mut run_id = "TESTRUN-1".to_owned();
    for round in 1..=2 {
        let run = claim_one(&harness, Role::TestRunner, &run_id).await;
        fail_check(&harness, &run, failing_run()).await;
        let fix = claim_one(&harness, Role::Executor, &format!("FIX-TESTRUN-1-R{round}")).await;
        harness.complete(&fix, "tried").await.expect("complete fix");
        run_id = format!("TESTRUN-1-R{round}");
        assert_eq!(
            task(&harness.session(&session).await.tasks, "DOC-1").depends_on,
            vec![run_id.clone()]
        );
    }
    let last = claim_one(&harness, Role::TestRunner, "TESTRUN-1-R2").await;
    fail_check(&harness, &last, failing_run()).await;

    let view = harness.session(&session).await;
    assert!(
        !view.tasks.iter().any(|task| task.id.ends_with("-R3")),
        "no third round"
    );
    assert_eq!(task(&view.tasks, "TESTRUN-1-R2").superseded_by, "");
    assert_eq!(task(&view.tasks, "DOC-1").state(), TaskState::Skipped);
    assert_eq!(
        view.session.as_ref().expect("session").state(),
        SessionState::Failed
    );
    let warnings = harness.messages(&session, "warning").await;
    assert!(
        warnings
            .iter()
            .any(|m| m.summary == "generator-critic rounds exhausted for TESTRUN-1"),
        "{warnings:#?}"
    );
    assert_eq!(harness.messages(&session, "gc_loop_trigger").await.len(), 2);

    // Resuming retries the last re-run only; superseded runs stay failed.
    harness
        .client()
        .resume_session(pb::ResumeSessionRequest {
            session_id: session.clone(),
        })
        .await
        .expect("resume");
    let view = harness.session(&session).await;
    for superseded in ["TESTRUN-1", "TESTRUN-1-R1"] {
        assert_eq!(task(&view.tasks, superseded).state(), TaskState::Failed);
    }
    assert_eq!(task(&view.tasks, "DOC-1").state(), TaskState::Pending);
    let retry = claim_one(&harness, Role::TestRunner, "TESTRUN-1-R2").await;
    fail_check(&harness, &retry, failing_run()).await;
    let view = harness.session(&session).await;
    assert_eq!(view.tasks.len(), 7, "still no third round");
    assert_eq!(
        view.session.as_ref().expect("session").state(),
        SessionState::Failed
    );
    harness.stop().await;
}

async fn test_runs_without_gc_fail_as_before(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "plain", "tasks": [
            {"id": "TESTRUN-1", "title": "run tests", "test": {"framework": "pytest"}},
            {"id": "DOC-1", "title": "document", "role": "executor", "depends_on": ["TESTRUN-1"]},
        ]}))
        .await;
    let session = session_id(&created);
    let run = claim_one(&harness, Role::TestRunner, "TESTRUN-1").await;
    fail_check(&harness, &run, failing_run()).await;
    let view = harness.session(&session).await;
    assert_eq!(view.tasks.len(), 2, "no round added");
    assert_eq!(task(&view.tasks, "TESTRUN-1").superseded_by, "");
    assert_eq!(task(&view.tasks, "DOC-1").state(), TaskState::Skipped);
    assert_eq!(
        view.session.as_ref().expect("session").state(),
        SessionState::Failed
    );
    assert!(
        harness
            .messages(&session, "gc_loop_trigger")
            .await
            .is_empty()
    );
    harness.stop().await;
}

async fn verification_gaps_start_gap_closure_per_chain(db: Db) {
    let harness = Harness::start(db).await;
    let closure =
        json!({"agent": {"backend": "command", "command": ["fix-gaps"]}, "max_rounds": 1});
    let created = harness
        .create(json!({"name": "gaps", "tasks": [
            {"id": "VERIFY-1", "title": "verify a", "gap_closure": closure},
            {"id": "VERIFY-2", "title": "verify b", "gap_closure": closure},
            {"id": "DONE-1", "title": "wrap up", "role": "executor", "depends_on": ["VERIFY-1", "VERIFY-2"]},
        ]}))
        .await;
    let session = session_id(&created);
    let gaps = pb::TaskResult {
        detail: Some(pb::task_result::Detail::Validation(pb::ValidationReport {
            verdict: pb::Verdict::Fail as i32,
            verification: Some(pb::GoalVerification {
                status: pb::VerificationStatus::GapsFound as i32,
                gaps: vec![pb::VerificationGap {
                    task: "IMPL-7".to_owned(),
                    r#type: pb::GapType::File as i32,
                    item: "src/api.py".to_owned(),
                    expected: "file exists".to_owned(),
                    actual: "missing".to_owned(),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        })),
        ..Default::default()
    };
    let claimed = harness.claim(&[Role::Validator], 5).await;
    assert_eq!(ids(&claimed), vec!["VERIFY-1", "VERIFY-2"]);
    for verify in &claimed {
        fail_check(&harness, verify, gaps.clone()).await;
    }
    let view = harness.session(&session).await;
    assert_eq!(
        task(&view.tasks, "DONE-1").depends_on,
        vec!["VERIFY-1-R1".to_owned(), "VERIFY-2-R1".to_owned()]
    );
    assert_eq!(harness.messages(&session, "gap_closure").await.len(), 2);

    let fixes = harness.claim(&[Role::Executor], 5).await;
    assert_eq!(ids(&fixes), vec!["FIX-VERIFY-1-R1", "FIX-VERIFY-2-R1"]);
    let fix_task = fixes[0].task.as_ref().expect("task");
    let description = crate::support::spec_json(fix_task)["description"]
        .as_str()
        .expect("description")
        .to_owned();
    assert!(
        description.contains("IMPL-7 file `src/api.py`: expected file exists, actual missing"),
        "{description}"
    );
    for fix in &fixes {
        harness.complete(fix, "closed").await.expect("complete fix");
    }
    let reruns = harness.claim(&[Role::Validator], 5).await;
    assert_eq!(ids(&reruns), vec!["VERIFY-1-R1", "VERIFY-2-R1"]);
    let (first, second) = (&reruns[0], &reruns[1]);
    assert_eq!(id_of(first), "VERIFY-1-R1");
    harness.complete(first, "verified").await.expect("complete");
    // VERIFY-2's chain used its one round: this failure cascades.
    fail_check(&harness, second, gaps).await;
    let view = harness.session(&session).await;
    assert_eq!(view.tasks.len(), 7, "no second round for VERIFY-2");
    assert_eq!(task(&view.tasks, "DONE-1").state(), TaskState::Skipped);
    let warnings = harness.messages(&session, "warning").await;
    assert!(
        warnings
            .iter()
            .any(|m| m.summary == "gap closure rounds exhausted for VERIFY-2"),
        "{warnings:#?}"
    );
    harness.stop().await;
}

async fn rounds_join_the_failed_task_wave_in_waves_mode(db: Db) {
    let harness = Harness::start(db).await;
    let mut plan = gc_plan(None);
    plan["mode"] = json!("waves");
    let created = harness.create(plan).await;
    let session = session_id(&created);
    let implement = claim_one(&harness, Role::Executor, "IMPL-1").await;
    harness
        .complete(&implement, "built")
        .await
        .expect("complete");
    let run = claim_one(&harness, Role::TestRunner, "TESTRUN-1").await;
    fail_check(&harness, &run, failing_run()).await;
    let view = harness.session(&session).await;
    assert_eq!(task(&view.tasks, "FIX-TESTRUN-1-R1").wave, 2);
    assert_eq!(task(&view.tasks, "TESTRUN-1-R1").wave, 2);
    let fix = claim_one(&harness, Role::Executor, "FIX-TESTRUN-1-R1").await;
    harness.complete(&fix, "fixed").await.expect("complete fix");
    let rerun = claim_one(&harness, Role::TestRunner, "TESTRUN-1-R1").await;
    harness
        .complete(&rerun, "green")
        .await
        .expect("complete re-run");
    let doc = claim_one(&harness, Role::Executor, "DOC-1").await;
    harness
        .complete(&doc, "documented")
        .await
        .expect("complete doc");
    assert_eq!(
        harness
            .session(&session)
            .await
            .session
            .as_ref()
            .expect("session")
            .state(),
        SessionState::Completed
    );
    harness.stop().await;
}

async fn bad_loop_configurations_are_refused_at_creation(db: Db) {
    let harness = Harness::start(db).await;
    let result = harness
        .try_create(
            &json!({"name": "bad", "repos": {"app": {"path": "repo"}}, "tasks": [
                {"id": "TESTRUN-1", "title": "run tests", "test": {"gc": {"max_rounds": 3}}},
            ]}),
        )
        .await;
    assert_code(
        result,
        Code::InvalidArgument,
        "task TESTRUN-1: `test.gc.agent` is missing: it must be an executor agent object",
    );
    harness.stop().await;
}

db_tests!(
    bad_loop_configurations_are_refused_at_creation,
    failed_test_run_adds_a_fix_round_and_completes,
    rounds_join_the_failed_task_wave_in_waves_mode,
    rounds_run_out_and_the_failure_cascades,
    test_runs_without_gc_fail_as_before,
    verification_gaps_start_gap_closure_per_chain,
);
