//! Routing by capability: workers that offer backends (`backend:<name>` capabilities) get
//! only tasks they can run, by plain claims and by claims riding on completions, in eager
//! and waves sessions; a ready task no live worker can run is a capability gap naming its
//! backend.

use std::time::Duration;

use serde_json::{Value, json};
use troupe_proto::v1::{self as pb, Role};

use crate::support::{Db, Harness, db_tests, id_of, ids, session_id, token};

fn plan(name: &str, mode: &str) -> Value {
    json!({"name": name, "mode": mode, "tasks": [
        {"id": "IMPL-1", "title": "claude", "agent": {"backend": "claude"}},
        {"id": "IMPL-2", "title": "codex", "description": "x\nExecutor: codex"},
        {"id": "IMPL-3", "title": "claude again", "agent": {"backend": "claude"}},
        {"id": "IMPL-4", "title": "claude or codex",
            "agent": {"backend": "claude", "fallback": ["codex"]}},
        {"id": "IMPL-5", "title": "anyone's auto choice"},
        {"id": "IMPL-6", "title": "claude after codex", "agent": {"backend": "claude"},
            "depends_on": ["IMPL-2"]},
    ]})
}

fn request(worker: &str, backends: &[&str], max: u32) -> pb::ClaimTasksRequest {
    pb::ClaimTasksRequest {
        worker_id: worker.to_owned(),
        roles: vec![Role::Executor as i32],
        capabilities: backends
            .iter()
            .map(|name| format!("backend:{name}"))
            .chain(["python".to_owned()])
            .collect(),
        max_tasks: max,
        ..Default::default()
    }
}

async fn claim(
    harness: &Harness,
    worker: &str,
    backends: &[&str],
    max: u32,
) -> Vec<pb::ClaimedTask> {
    harness
        .client()
        .claim_tasks(request(worker, backends, max))
        .await
        .expect("claim")
        .into_inner()
        .tasks
}

fn sorted(claimed: &[pb::ClaimedTask]) -> Vec<&str> {
    let mut out = ids(claimed);
    out.sort_unstable();
    out
}

async fn claims_go_only_to_workers_that_can_run_the_backend(db: Db) {
    let harness = Harness::start(db).await;
    for mode in ["eager", "waves"] {
        let session = session_id(&harness.create(plan(mode, mode)).await);
        // The codex worker gets the codex task, the one claude may hand to codex, and the
        // auto one; never a task only claude runs.
        let codex = claim(&harness, "codex-worker", &["agent", "codex"], 10).await;
        assert_eq!(sorted(&codex), ["IMPL-2", "IMPL-4", "IMPL-5"], "{mode}");
        // Nothing left for it, though claude tasks are ready (the session is not picked).
        assert!(
            claim(&harness, "codex-worker", &["codex"], 10)
                .await
                .is_empty()
        );
        // Completing the codex task readies IMPL-6 (claude): the claim riding on the
        // completion (the eager batch) does not take it.
        let codex_task = codex.iter().find(|c| id_of(c) == "IMPL-2").expect("IMPL-2");
        let task = codex_task.task.as_ref().expect("task");
        let next = harness
            .client()
            .complete_task(pb::CompleteTaskRequest {
                session_id: task.session_id.clone(),
                task_id: task.id.clone(),
                fencing_token: token(codex_task),
                result: None,
                claim_next: Some(request("codex-worker", &["agent", "codex"], 5)),
            })
            .await
            .expect("complete and claim")
            .into_inner()
            .next;
        assert!(next.is_empty(), "{mode}: {:?}", ids(&next));
        let mut claude = claim(&harness, "claude-worker", &["agent", "claude"], 10).await;
        if mode == "eager" {
            assert_eq!(sorted(&claude), ["IMPL-1", "IMPL-3", "IMPL-6"]);
        } else {
            // IMPL-6 is in the second wave, released once the first is done.
            assert_eq!(sorted(&claude), ["IMPL-1", "IMPL-3"]);
        }
        for claimed in codex.iter().chain(&claude) {
            if id_of(claimed) != "IMPL-2" {
                harness.complete(claimed, "ok").await.expect("complete");
            }
        }
        if mode == "waves" {
            assert!(
                claim(&harness, "codex-worker", &["codex"], 10)
                    .await
                    .is_empty()
            );
            claude = claim(&harness, "claude-worker", &["claude"], 10).await;
            assert_eq!(ids(&claude), ["IMPL-6"]);
            harness.complete(&claude[0], "ok").await.expect("complete");
        }
        let check = harness.check(&session).await;
        assert_eq!(check.percent_complete, 100, "{mode}");
    }
    // A worker that declares no backend may run anything (workers from before routing).
    harness.create(plan("any", "eager")).await;
    let any = harness.claim(&[Role::Executor], 10).await;
    assert_eq!(
        sorted(&any),
        ["IMPL-1", "IMPL-2", "IMPL-3", "IMPL-4", "IMPL-5"]
    );
    harness.stop().await;
}

async fn a_backend_no_live_worker_offers_is_a_gap(db: Db) {
    let harness = Harness::start_tuned(
        db,
        troupe_coordinator::Tuning {
            capability_gap_seconds: 1.0,
            ..Default::default()
        },
    )
    .await;
    let session = session_id(
        &harness
            .create(json!({"name": "gap", "tasks": [
                {"id": "IMPL-1", "title": "claude", "agent": {"backend": "claude", "fallback": ["gemini"]}},
                {"id": "IMPL-2", "title": "codex", "agent": {"backend": "codex"}},
            ]}))
            .await,
    );
    // Only a codex worker is live: it keeps polling.
    let client = harness.client();
    let poller = tokio::spawn(async move {
        let mut taken = Vec::new();
        loop {
            let mut client = client.clone();
            let mut req = request("codex-worker", &["codex"], 5);
            req.wait = Some(prost_types::Duration {
                seconds: 0,
                nanos: 200_000_000,
            });
            let claimed = client
                .claim_tasks(req)
                .await
                .expect("claim")
                .into_inner()
                .tasks;
            taken.extend(
                claimed
                    .iter()
                    .map(|c| c.task.as_ref().expect("task").id.clone()),
            );
            assert!(
                !taken.contains(&"IMPL-1".to_owned()),
                "codex took a claude task"
            );
        }
    });
    let gap = troupe_testkit::eventually("a backend gap in check", || async {
        harness
            .check(&session)
            .await
            .capability_gaps
            .into_iter()
            .find(|gap| gap.backend == "claude")
    })
    .await;
    assert_eq!(gap.task_ids, ["IMPL-1"]);
    assert_eq!(gap.role(), Role::Executor);
    assert!(
        gap.message
            .contains("backend claude (or their fallbacks: gemini)"),
        "{}",
        gap.message
    );
    assert!(gap.message.contains("troupe doctor"), "{}", gap.message);
    let check = harness.check(&session).await;
    assert!(check.stall.is_none(), "a gap is not a stall");
    assert_eq!(
        check.capability_gaps.len(),
        1,
        "{:?}",
        check.capability_gaps
    );
    let message = troupe_testkit::eventually("a capability_gap message", || async {
        harness
            .messages(&session, "capability_gap")
            .await
            .into_iter()
            .next()
    })
    .await;
    assert!(
        message.summary.contains("backend claude"),
        "{}",
        message.summary
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(harness.messages(&session, "capability_gap").await.len(), 1);
    poller.abort();
    harness.stop().await;
}

db_tests!(
    claims_go_only_to_workers_that_can_run_the_backend,
    a_backend_no_live_worker_offers_is_a_gap,
);
