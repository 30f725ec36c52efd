//! Write-back: a validator task's per-task criterion results land on the tasks they belong to.

use serde_json::json;
use troupe_proto::v1::{self as pb, Role, TaskState};

use crate::support::{Db, Harness, db_tests, id_of, session_id, task, token};

fn report(entries: &[(&str, &[bool], &str)]) -> pb::TaskResult {
    pb::TaskResult {
        summary: "checked".to_owned(),
        commit: "abc123".to_owned(),
        detail: Some(pb::task_result::Detail::Validation(pb::ValidationReport {
            verdict: pb::Verdict::Fail as i32,
            upstream_convergence: entries
                .iter()
                .map(|(task_id, verified, met)| pb::UpstreamConvergence {
                    task_id: (*task_id).to_owned(),
                    convergence_verified: verified.to_vec(),
                    convergence_met: troupe_proto::names::parse::<pb::ConvergenceMet>(met)
                        .expect("a convergence-met name")
                        as i32,
                    commit: "abc123".to_owned(),
                    ..pb::UpstreamConvergence::default()
                })
                .collect(),
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn plan(mode: &str) -> serde_json::Value {
    json!({"name": "write-back", "mode": mode, "tasks": [
        {"id": "IMPL-1", "title": "one", "convergence": {"criteria": ["a", "b"]}},
        {"id": "IMPL-2", "title": "two", "convergence": {"criteria": ["c"]}},
        {"id": "VALIDATE-1", "title": "check", "role": "validator", "depends_on": ["IMPL-1", "IMPL-2"]},
    ]})
}

async fn implement_both(harness: &Harness) -> pb::ClaimedTask {
    for claimed in harness.claim(&[Role::Executor], 5).await {
        harness.complete(&claimed, "done").await.expect("complete");
    }
    let mut claimed = harness.claim(&[Role::Validator], 5).await;
    assert_eq!(claimed.len(), 1);
    let validate = claimed.remove(0);
    assert_eq!(id_of(&validate), "VALIDATE-1");
    validate
}

fn convergence(view: &pb::GetSessionResponse, id: &str) -> pb::TaskConvergence {
    task(&view.tasks, id)
        .convergence
        .clone()
        .unwrap_or_else(|| panic!("{id} has no convergence"))
}

async fn validator_results_are_written_back_onto_each_task(db: Db) {
    let harness = Harness::start(db).await;
    // Eager (the completion path that reads only the neighbourhood) and waves (the whole graph).
    for mode in ["eager", "waves"] {
        let session = session_id(&harness.create(plan(mode)).await);
        let view = harness.session(&session).await;
        assert!(
            task(&view.tasks, "IMPL-1").convergence.is_none(),
            "unset until checked"
        );
        let validate = implement_both(&harness).await;
        let claimed = validate.task.as_ref().expect("task");
        harness
            .client()
            .complete_task(pb::CompleteTaskRequest {
                session_id: session.clone(),
                task_id: claimed.id.clone(),
                fencing_token: token(&validate),
                result: Some(report(&[
                    ("IMPL-1", &[true, true], "pass"),
                    ("IMPL-2", &[false], "fail"),
                    ("IMPL-404", &[true], "pass"),
                ])),
                claim_next: None,
            })
            .await
            .expect("complete");
        let view = harness.session(&session).await;
        let one = convergence(&view, "IMPL-1");
        assert_eq!(
            (
                one.verified.clone(),
                troupe_proto::names::name(one.met()),
                one.checked_by.as_str(),
                one.commit.as_str()
            ),
            (vec![true, true], "pass", "VALIDATE-1", "abc123"),
            "{mode}"
        );
        let two = convergence(&view, "IMPL-2");
        assert_eq!(
            (two.verified.clone(), troupe_proto::names::name(two.met())),
            (vec![false], "fail"),
            "{mode}"
        );
        assert!(task(&view.tasks, "VALIDATE-1").convergence.is_none());
    }
}

async fn a_failed_validation_writes_back_its_partial_report(db: Db) {
    let harness = Harness::start(db).await;
    let session = session_id(&harness.create(plan("eager")).await);
    let validate = implement_both(&harness).await;
    harness
        .client()
        .fail_task(pb::FailTaskRequest {
            session_id: session.clone(),
            task_id: "VALIDATE-1".to_owned(),
            fencing_token: token(&validate),
            error: Some(pb::TaskError {
                kind: pb::ErrorKind::CheckFailed as i32,
                message: "IMPL-2: criterion 1 failed".to_owned(),
                retryable: false,
                details: Vec::new(),
                ..Default::default()
            }),
            partial_result: Some(report(&[
                ("IMPL-1", &[true, true], "pass"),
                ("IMPL-2", &[false], "fail"),
            ])),
        })
        .await
        .expect("fail");
    let view = harness.session(&session).await;
    assert_eq!(task(&view.tasks, "VALIDATE-1").state(), TaskState::Failed);
    assert_eq!(
        troupe_proto::names::name(convergence(&view, "IMPL-2").met()),
        "fail"
    );
    assert_eq!(convergence(&view, "IMPL-1").verified, vec![true, true]);
}

db_tests!(
    validator_results_are_written_back_onto_each_task,
    a_failed_validation_writes_back_its_partial_report,
);
