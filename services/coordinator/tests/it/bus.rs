//! The message bus: ids, sequences, filters, idempotency, role state.

use std::collections::HashSet;

use serde_json::json;
use tonic::Code;
use troupe_proto::v1 as pb;

use crate::support::{Db, Harness, assert_code, db_tests, session_id, t};

fn data(value: serde_json::Value) -> prost_types::Struct {
    let serde_json::Value::Object(object) = value else {
        panic!("object")
    };
    prost_types::Struct {
        fields: object
            .into_iter()
            .map(|(key, value)| {
                let kind = match value {
                    serde_json::Value::String(text) => prost_types::value::Kind::StringValue(text),
                    serde_json::Value::Number(n) => {
                        prost_types::value::Kind::NumberValue(n.as_f64().expect("f64"))
                    }
                    serde_json::Value::Bool(b) => prost_types::value::Kind::BoolValue(b),
                    other => panic!("unsupported in this helper: {other}"),
                };
                (key, prost_types::Value { kind: Some(kind) })
            })
            .collect(),
    }
}

async fn concurrent_messages_get_unique_gap_free_ids(db: Db) {
    let harness = Harness::start(db).await;
    let session = session_id(
        &harness
            .create(json!({"name": "bus", "tasks": [t("IMPL-1", &[])]}))
            .await,
    );
    let mut writers = Vec::new();
    for n in 0..100 {
        let mut client = harness.client();
        let session = session.clone();
        writers.push(tokio::spawn(async move {
            client
                .log_message(pb::LogMessageRequest {
                    session_id: session,
                    from: if n % 2 == 0 {
                        "executor".into()
                    } else {
                        "IMPL-1".into()
                    },
                    r#type: if n % 2 == 0 {
                        "impl_progress".into()
                    } else {
                        "progress".into()
                    },
                    data: Some(data(json!({"n": n}))),
                    ..Default::default()
                })
                .await
                .expect("log")
                .into_inner()
                .message
                .expect("message")
        }));
    }
    let mut messages = Vec::new();
    for writer in writers {
        messages.push(writer.await.expect("join"));
    }
    let ids: HashSet<String> = messages.iter().map(|m| m.id.clone()).collect();
    let expected: HashSet<String> = (1..=100).map(|n| format!("MSG-{n:03}")).collect();
    assert_eq!(ids, expected);
    let mut sequences: Vec<u64> = messages.iter().map(|m| m.sequence).collect();
    sequences.sort_unstable();
    assert!(
        sequences.windows(2).all(|w| w[1] == w[0] + 1),
        "gap-free: {sequences:?}"
    );
    let first = &messages[0];
    assert_eq!(first.to, "coordinator");
    assert_eq!(
        first.summary,
        format!("[{}] {} -> coordinator", first.from, first.r#type)
    );

    let listed = harness
        .client()
        .list_messages(pb::ListMessagesRequest {
            session_id: session.clone(),
            last: 1000,
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(listed.messages.len(), 100);
    assert!(
        listed
            .messages
            .windows(2)
            .all(|w| w[0].sequence < w[1].sequence),
        "oldest first"
    );
    assert_eq!(
        listed.next_sequence,
        listed.messages.last().expect("last").sequence
    );

    let filtered = harness
        .client()
        .list_messages(pb::ListMessagesRequest {
            session_id: session.clone(),
            from: "IMPL-1".into(),
            r#type: "progress".into(),
            last: 5,
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(filtered.messages.len(), 5);
    assert!(
        filtered
            .messages
            .iter()
            .all(|m| m.from == "IMPL-1" && m.r#type == "progress")
    );
    let cursor = listed.messages[89].sequence;
    let after = harness
        .client()
        .list_messages(pb::ListMessagesRequest {
            session_id: session.clone(),
            after_sequence: cursor,
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(after.messages.len(), 10);
    assert_eq!(after.messages[0].id, listed.messages[90].id);

    // With a cursor, `last` pages forward: the 5 after message 50, not the newest 5.
    let page = harness
        .client()
        .list_messages(pb::ListMessagesRequest {
            session_id: session.clone(),
            after_sequence: listed.messages[49].sequence,
            last: 5,
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner();
    let ids: Vec<&str> = page.messages.iter().map(|m| m.id.as_str()).collect();
    let expected: Vec<&str> = listed.messages[50..55]
        .iter()
        .map(|m| m.id.as_str())
        .collect();
    assert_eq!(ids, expected);
    assert_eq!(page.next_sequence, listed.messages[54].sequence);
    harness.stop().await;
}

async fn idempotency_key_returns_the_first_message(db: Db) {
    let harness = Harness::start(db).await;
    let session = session_id(
        &harness
            .create(json!({"name": "idem", "tasks": [t("IMPL-1", &[])]}))
            .await,
    );
    let request = pb::LogMessageRequest {
        session_id: session.clone(),
        from: "executor".into(),
        to: "all".into(),
        r#type: "impl_complete".into(),
        summary: "done".into(),
        idempotency_key: "IMPL-1-attempt-1".into(),
        data: None,
    };
    let first = harness
        .client()
        .log_message(request.clone())
        .await
        .expect("log")
        .into_inner()
        .message
        .expect("message");
    let again = harness
        .client()
        .log_message(request)
        .await
        .expect("log")
        .into_inner()
        .message
        .expect("message");
    assert_eq!(first, again);
    assert_eq!(first.id, "MSG-001");
    assert_eq!((first.to.as_str(), first.summary.as_str()), ("all", "done"));
    let missing = harness
        .client()
        .log_message(pb::LogMessageRequest {
            session_id: "nope".into(),
            from: "x".into(),
            ..Default::default()
        })
        .await;
    assert_code(missing, Code::NotFound, "not found");
    let no_sender = harness
        .client()
        .log_message(pb::LogMessageRequest {
            session_id: session,
            ..Default::default()
        })
        .await;
    assert_code(no_sender, Code::InvalidArgument, "from is required");
    harness.stop().await;
}

async fn update_state_merges_and_records_a_state_update(db: Db) {
    let harness = Harness::start(db).await;
    let session = session_id(
        &harness
            .create(json!({"name": "state", "tasks": [t("IMPL-1", &[])]}))
            .await,
    );
    let update = |fields: serde_json::Value| pb::UpdateStateRequest {
        session_id: session.clone(),
        role: "executor".into(),
        data: Some(data(fields)),
    };
    harness
        .client()
        .update_state(update(json!({"status": "working", "task_id": "IMPL-1"})))
        .await
        .expect("update");
    let second = harness
        .client()
        .update_state(update(
            json!({"status": "task_complete", "verification": "tested"}),
        ))
        .await
        .expect("update")
        .into_inner();
    let state = second.state.expect("state");
    let text = |key: &str| match state.fields.get(key).and_then(|v| v.kind.clone()) {
        Some(prost_types::value::Kind::StringValue(text)) => text,
        other => panic!("{key}: {other:?}"),
    };
    assert_eq!(text("status"), "task_complete");
    assert_eq!(
        text("task_id"),
        "IMPL-1",
        "shallow merge keeps earlier keys"
    );
    assert_eq!(text("verification"), "tested");
    assert!(text("_updated_at").ends_with('Z'));
    let message = second.message.expect("message");
    assert_eq!(
        (
            message.r#type.as_str(),
            message.from.as_str(),
            message.id.as_str()
        ),
        ("state_update", "executor", "MSG-002")
    );

    harness
        .client()
        .update_state(pb::UpdateStateRequest {
            session_id: session.clone(),
            role: "tester".into(),
            data: Some(data(json!({"pass_rate": 1.0}))),
        })
        .await
        .expect("update");
    let all = harness
        .client()
        .get_state(pb::GetStateRequest {
            session_id: session.clone(),
            role: String::new(),
        })
        .await
        .expect("get")
        .into_inner();
    let mut roles: Vec<&String> = all.role_state.keys().collect();
    roles.sort();
    assert_eq!(roles, vec!["executor", "tester"]);
    let one = harness
        .client()
        .get_state(pb::GetStateRequest {
            session_id: session.clone(),
            role: "tester".into(),
        })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(one.role_state.len(), 1);
    let updates = harness
        .client()
        .list_messages(pb::ListMessagesRequest {
            session_id: session,
            r#type: "state_update".into(),
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(updates.messages.len(), 3);
    harness.stop().await;
}

db_tests!(
    concurrent_messages_get_unique_gap_free_ids,
    idempotency_key_returns_the_first_message,
    update_state_merges_and_records_a_state_update,
);
