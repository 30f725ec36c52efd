//! `PauseSession`: running tasks finish and are recorded, nothing new is claimed while paused,
//! `ResumeSession` continues.

use std::time::Duration;

use serde_json::json;
use tonic::Code;
use troupe_proto::v1::{self as pb, Role, SessionState, TaskState};

use crate::support::{Db, Harness, assert_code, db_tests, ids, session_id, t, task};

async fn pause(harness: &Harness, session: &str, reason: &str) -> pb::PauseSessionResponse {
    harness
        .client()
        .pause_session(pb::PauseSessionRequest {
            session_id: session.to_owned(),
            reason: reason.to_owned(),
        })
        .await
        .expect("pause")
        .into_inner()
}

async fn running_task_finishes_nothing_new_is_claimed_and_resume_runs_the_rest(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "pause", "tasks": [
            t("IMPL-1", &[]), t("IMPL-2", &[]), t("IMPL-3", &["IMPL-1"]),
        ]}))
        .await;
    let session = session_id(&created);
    let running = harness.claim(&[Role::Executor], 1).await;
    assert_eq!(ids(&running), vec!["IMPL-1"]);

    let paused = pause(&harness, &session, "rate limit window").await;
    assert_eq!(
        paused.session.as_ref().expect("session").state(),
        SessionState::Paused
    );
    assert_eq!(paused.running_task_ids, vec!["IMPL-1"]);
    // A second pause changes nothing and records nothing.
    let again = pause(&harness, &session, "again").await;
    assert_eq!(
        again.session.as_ref().expect("session").state(),
        SessionState::Paused
    );

    // IMPL-2 is ready, but a paused session hands out nothing, even to a long poll.
    let claimed = harness
        .claim_with(&[], 4, Duration::from_millis(300), Duration::from_secs(30))
        .await;
    assert!(claimed.is_empty(), "claimed while paused: {claimed:?}");

    // The running task's result is recorded; its dependent does not become ready.
    let done = harness
        .complete(&running[0], "finished while paused")
        .await
        .expect("complete while paused");
    assert_eq!(done.state(), TaskState::Completed);
    assert!(harness.claim(&[], 4).await.is_empty());
    let check = harness.check(&session).await;
    assert_eq!(
        check.session.as_ref().expect("session").state(),
        SessionState::Paused
    );
    let view = harness.session(&session).await;
    assert_eq!(task(&view.tasks, "IMPL-1").state(), TaskState::Completed);
    assert_eq!(
        task(&view.tasks, "IMPL-1")
            .result
            .as_ref()
            .expect("result")
            .summary,
        "finished while paused"
    );
    assert_eq!(task(&view.tasks, "IMPL-3").state(), TaskState::Pending);

    // One event and one bus message record the pause, with its reason.
    let messages = harness.messages(&session, "session_paused").await;
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(
        messages[0].summary.contains("rate limit window"),
        "{}",
        messages[0].summary
    );
    assert_eq!(messages[0].to, "all");

    // Resume: active again, and the rest runs to the end.
    let resumed = harness
        .client()
        .resume_session(pb::ResumeSessionRequest {
            session_id: session.clone(),
        })
        .await
        .expect("resume")
        .into_inner();
    let status = resumed.status.expect("status");
    assert_eq!(
        status.session.as_ref().expect("session").state(),
        SessionState::Active
    );
    let rest = harness.claim(&[], 4).await;
    let mut rest_ids = ids(&rest);
    rest_ids.sort_unstable();
    assert_eq!(rest_ids, vec!["IMPL-2", "IMPL-3"]);
    for claimed in &rest {
        harness.complete(claimed, "ok").await.expect("complete");
    }
    let view = harness.session(&session).await;
    assert_eq!(
        view.session.expect("session").state(),
        SessionState::Completed
    );
    harness.stop().await;
}

async fn pausing_an_ended_or_unknown_session_is_refused(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "ended", "tasks": [t("IMPL-1", &[])]}))
        .await;
    let session = session_id(&created);
    let claimed = harness.claim(&[Role::Executor], 1).await;
    harness.complete(&claimed[0], "ok").await.expect("complete");
    let result = harness
        .client()
        .pause_session(pb::PauseSessionRequest {
            session_id: session.clone(),
            reason: String::new(),
        })
        .await;
    assert_code(
        result,
        Code::FailedPrecondition,
        "already ended (completed)",
    );

    let cancelled = session_id(
        &harness
            .create(json!({"name": "cancelled", "tasks": [t("IMPL-1", &[])]}))
            .await,
    );
    harness
        .client()
        .cancel_session(pb::CancelSessionRequest {
            session_id: cancelled.clone(),
            reason: String::new(),
        })
        .await
        .expect("cancel");
    let result = harness
        .client()
        .pause_session(pb::PauseSessionRequest {
            session_id: cancelled,
            reason: String::new(),
        })
        .await;
    assert_code(result, Code::FailedPrecondition, "cancelled");

    let result = harness
        .client()
        .pause_session(pb::PauseSessionRequest {
            session_id: "nope".to_owned(),
            reason: String::new(),
        })
        .await;
    assert_code(result, Code::NotFound, "nope");
    harness.stop().await;
}

async fn a_paused_session_can_still_be_cancelled(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "pause-cancel", "tasks": [t("IMPL-1", &[]), t("IMPL-2", &[])]}))
        .await;
    let session = session_id(&created);
    let running = harness.claim(&[Role::Executor], 1).await;
    pause(&harness, &session, "").await;
    let messages = harness.messages(&session, "session_paused").await;
    assert!(
        messages[0].summary.contains("paused by user"),
        "{}",
        messages[0].summary
    );
    harness
        .client()
        .cancel_session(pb::CancelSessionRequest {
            session_id: session.clone(),
            reason: "changed my mind".to_owned(),
        })
        .await
        .expect("cancel");
    let view = harness.session(&session).await;
    assert_eq!(
        view.session.expect("session").state(),
        SessionState::Cancelled
    );
    for id in ["IMPL-1", "IMPL-2"] {
        assert_eq!(task(&view.tasks, id).state(), TaskState::Cancelled);
    }
    // The running worker learns it from its heartbeat.
    let heartbeat = harness
        .client()
        .heartbeat(pb::HeartbeatRequest {
            session_id: session.clone(),
            task_id: "IMPL-1".to_owned(),
            fencing_token: crate::support::token(&running[0]),
            ..Default::default()
        })
        .await
        .expect("heartbeat")
        .into_inner();
    assert!(heartbeat.cancel_requested);
    harness.stop().await;
}

async fn a_paused_session_is_not_reported_as_stalled(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(json!({"name": "pause", "tasks": [t("IMPL-1", &[]), t("IMPL-2", &["IMPL-1"])]}))
        .await;
    let session = session_id(&created);
    let running = harness.claim(&[Role::Executor], 1).await;
    pause(&harness, &session, "lunch").await;
    // Its last running task finishes: nothing is ready or running, but on purpose.
    harness
        .complete(&running[0], "done")
        .await
        .expect("complete while paused");
    assert!(harness.messages(&session, "warning").await.is_empty());
    // `check` still says why the rest waits.
    let stall = harness
        .check(&session)
        .await
        .stall
        .expect("why IMPL-2 waits");
    assert!(
        stall
            .tasks
            .iter()
            .all(|task| task.reason.contains("paused")),
        "{stall:?}"
    );
}

db_tests!(
    a_paused_session_is_not_reported_as_stalled,
    running_task_finishes_nothing_new_is_claimed_and_resume_runs_the_rest,
    pausing_an_ended_or_unknown_session_is_refused,
    a_paused_session_can_still_be_cancelled,
);
