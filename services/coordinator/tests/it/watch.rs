//! WatchSession: replay from a cursor, live events, end of stream.

use std::time::Duration;

use serde_json::json;
use tonic::Code;
use troupe_proto::v1::{self as pb, Role, SessionState, TaskState, session_event::Kind};

use crate::support::{Db, Harness, assert_code, db_tests, session_id, t};

async fn next_event(stream: &mut tonic::Streaming<pb::SessionEvent>) -> pb::SessionEvent {
    tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("event within 10s")
        .expect("stream ok")
        .expect("stream still open")
}

async fn watch_replays_from_a_cursor_then_follows_live_events_and_ends(db: Db) {
    let harness = Harness::start(db).await;
    let session = session_id(
        &harness
            .create(json!({"name": "watch", "tasks": [t("IMPL-1", &[]), t("IMPL-2", &["IMPL-1"])]}))
            .await,
    );
    // Creation wrote: session active (1), two pending (2, 3), IMPL-1 ready (4).
    let mut replay = harness
        .client()
        .watch_session(pb::WatchSessionRequest {
            session_id: session.clone(),
            after_sequence: 2,
            follow: false,
        })
        .await
        .expect("watch")
        .into_inner();
    let third = next_event(&mut replay).await;
    assert_eq!(third.sequence, 3);
    let fourth = next_event(&mut replay).await;
    match fourth.kind.clone().expect("kind") {
        Kind::Task(transition) => {
            assert_eq!(transition.task_id, "IMPL-1");
            assert_eq!(
                (transition.from(), transition.to()),
                (TaskState::Pending, TaskState::Ready)
            );
        }
        other => panic!("unexpected {other:?}"),
    }

    // Live: drive the session to completion while the stream is open.
    let driver = async {
        for _ in 0..2 {
            let claimed = harness.claim(&[Role::Executor], 1).await;
            harness.complete(&claimed[0], "ok").await.expect("complete");
        }
    };
    let collect = async {
        let mut events = vec![third, fourth];
        while let Some(event) = tokio::time::timeout(Duration::from_secs(10), replay.message())
            .await
            .expect("no stall")
            .expect("stream ok")
        {
            events.push(event);
        }
        events
    };
    let ((), events) = tokio::join!(driver, collect);
    let sequences: Vec<u64> = events.iter().map(|e| e.sequence).collect();
    let expected: Vec<u64> = (3..3 + sequences.len() as u64).collect();
    assert_eq!(sequences, expected, "no gaps, no duplicates");
    match &events.last().expect("last").kind {
        Some(Kind::Session(transition)) => assert_eq!(transition.to(), SessionState::Completed),
        other => panic!("stream should end with the session transition, got {other:?}"),
    }
    let last_sequence = harness
        .session(&session)
        .await
        .session
        .expect("session")
        .last_sequence;
    assert_eq!(*sequences.last().expect("last"), last_sequence);

    // After the end, a replay of a finished session ends on its own, and messages show up.
    let mut tail = harness
        .client()
        .watch_session(pb::WatchSessionRequest {
            session_id: session.clone(),
            after_sequence: last_sequence - 1,
            follow: false,
        })
        .await
        .expect("watch")
        .into_inner();
    assert_eq!(next_event(&mut tail).await.sequence, last_sequence);
    assert!(tail.message().await.expect("ok").is_none(), "stream ends");
    harness.stop().await;
}

async fn follow_keeps_the_stream_open_for_messages(db: Db) {
    let harness = Harness::start(db).await;
    let session = session_id(
        &harness
            .create(json!({"name": "follow", "tasks": [t("IMPL-1", &[])]}))
            .await,
    );
    let last = harness
        .session(&session)
        .await
        .session
        .expect("session")
        .last_sequence;
    let mut stream = harness
        .client()
        .watch_session(pb::WatchSessionRequest {
            session_id: session.clone(),
            after_sequence: last,
            follow: true,
        })
        .await
        .expect("watch")
        .into_inner();
    harness
        .client()
        .log_message(pb::LogMessageRequest {
            session_id: session.clone(),
            from: "executor".into(),
            r#type: "blocker".into(),
            ..Default::default()
        })
        .await
        .expect("log");
    let event = next_event(&mut stream).await;
    assert_eq!(event.sequence, last + 1);
    match event.kind.expect("kind") {
        Kind::Message(message) => assert_eq!(message.r#type, "blocker"),
        other => panic!("unexpected {other:?}"),
    }
    let missing = harness
        .client()
        .watch_session(pb::WatchSessionRequest {
            session_id: "nope".into(),
            ..Default::default()
        })
        .await;
    assert_code(missing.map(|_| ()), Code::NotFound, "not found");
    harness.stop().await;
}

db_tests!(
    watch_replays_from_a_cursor_then_follows_live_events_and_ends,
    follow_keeps_the_stream_open_for_messages,
);
