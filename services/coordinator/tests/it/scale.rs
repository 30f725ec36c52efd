//! Large plans over a real server: plans and replies beyond gRPC's 4 MiB default, the message
//! limit a deployment sets, refusals that stay small however large the plan, and malformed
//! requests.

use serde_json::{Value, json};
use tonic::Code;
use troupe_proto::v1::{self as pb, Role, SessionState};

use crate::support::{Db, Harness, assert_code, db_tests, session_id};

/// A plan of `count` tasks in chains of 100, each task's title padded so the plan is about
/// 100 bytes a task.
fn plan(count: usize) -> Value {
    let tasks: Vec<Value> = (0..count)
        .map(|i| {
            let deps: Vec<String> = if i % 100 == 0 {
                Vec::new()
            } else {
                vec![format!("IMPL-{}", i - 1)]
            };
            json!({"id": format!("IMPL-{i}"), "title": format!("step {i} of a long plan, with a title as long as a real one"), "depends_on": deps})
        })
        .collect();
    json!({"name": "large", "repos": {"app": {"path": "repo"}}, "tasks": tasks})
}

/// A 50,000-task plan (more than gRPC's default 4 MiB) goes in with the default limits,
/// CreateSession answers its counts and a first page, its tasks come back out in pages, and
/// its claims work as usual.
async fn a_50000_task_plan_goes_in_and_comes_out_with_the_default_limits(db: Db) {
    let harness = Harness::start(db).await;
    let plan = plan(50_000);
    let size = plan.to_string().len();
    assert!(size > 4 * 1024 * 1024, "the plan is {size} bytes");
    let created = harness.create(plan).await;
    assert_eq!(created.tasks.len(), 1_000, "a page, not the whole plan");
    let total = created.session.as_ref().and_then(|s| s.counts.as_ref());
    assert_eq!(total.map(|counts| counts.total), Some(50_000));
    assert_eq!(created.next_page_token, "after:999");
    assert_eq!(created.waves, 100, "chains of 100");
    let session = harness.session(&session_id(&created)).await;
    assert_eq!(session.tasks.len(), 1_000);
    let (ids, pages) = list_all(
        &harness,
        pb::ListTasksRequest {
            session_id: session_id(&created),
            page_size: 10_000,
            ..Default::default()
        },
    )
    .await;
    assert_eq!((ids.len(), pages), (50_000, 5));
    let counts = session.session.expect("session").counts.expect("counts");
    assert_eq!(counts.ready, 500, "the head of every chain is ready");
    let claimed = harness.claim(&[Role::Executor], 2).await;
    assert_eq!(claimed.len(), 2);
    harness.complete(&claimed[0], "ok").await.expect("complete");
    harness.stop().await;
}

/// A deployment may lower the limit: a plan over it is refused with the limit in the reason,
/// and nothing is stored.
async fn a_plan_over_the_configured_limit_is_refused_and_nothing_is_stored(db: Db) {
    let harness = Harness::start_with(db, troupe_coordinator::Tuning::default(), |config| {
        config.security.credentials.max_message_bytes = Some(64 * 1024);
    })
    .await;
    assert_code(
        harness.try_create(&plan(2_000)).await,
        Code::OutOfRange,
        "message length too large",
    );
    let listed = harness
        .client()
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert!(listed.sessions.is_empty(), "{:?}", listed.sessions);
    harness.create(plan(10)).await;
    harness.stop().await;
}

/// A 100,000-task plan with a problem in every task is refused with the first problems in
/// full and a count of the rest, in a message far below gRPC's metadata limits.
async fn a_refusal_lists_the_first_problems_and_counts_the_rest(db: Db) {
    let harness = Harness::start(db).await;
    let tasks: Vec<Value> = (0..100_000)
        .map(|i| json!({"id": format!("IMPL-{i}")}))
        .collect();
    let status = harness
        .try_create(
            &json!({"name": "untitled", "repos": {"app": {"path": "repo"}}, "tasks": tasks}),
        )
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    let message = status.message();
    assert!(message.len() < 8 * 1024, "{} bytes", message.len());
    assert!(message.contains("IMPL-0"), "{message}");
    assert!(message.contains("… and 99,980 more"), "{message}");
    harness.stop().await;
}

/// `CreateSessionRequest` as it goes on the wire, with `plan_json` as raw bytes, so a test can
/// send a string that is not UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
struct RawCreate {
    #[prost(bytes = "vec", tag = "1")]
    plan_json: Vec<u8>,
}

/// The same field number with another wire type: a message that does not decode.
#[derive(Clone, PartialEq, prost::Message)]
struct Garbled {
    #[prost(uint64, tag = "1")]
    plan_json: u64,
}

/// Sends `request` as a `CreateSession` call, bypassing the generated client's types.
async fn raw_create<M: prost::Message + Send + Sync + 'static>(
    url: &str,
    request: M,
) -> Result<pb::CreateSessionResponse, tonic::Status> {
    let channel = troupe_grpc::channel(url).expect("channel");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let codec = tonic_prost::ProstCodec::<M, pb::CreateSessionResponse>::default();
    let path = http::uri::PathAndQuery::from_static("/troupe.v1.Coordinator/CreateSession");
    grpc.unary(tonic::Request::new(request), path, codec)
        .await
        .map(tonic::Response::into_inner)
}

/// Invalid UTF-8 and bad protobuf are the caller's mistake: `INVALID_ARGUMENT`, not
/// `INTERNAL`.
async fn malformed_requests_are_invalid_arguments(db: Db) {
    let harness = Harness::start(db).await;
    let url = harness.service.url();
    let not_utf8 = RawCreate {
        plan_json: b"{\"name\": \"\xff\xfe\"}".to_vec(),
    };
    assert_code(
        raw_create(&url, not_utf8).await,
        Code::InvalidArgument,
        "malformed message",
    );
    assert_code(
        raw_create(&url, Garbled { plan_json: 7 }).await,
        Code::InvalidArgument,
        "malformed message",
    );
    // The service is unharmed.
    let created = harness.create(plan(3)).await;
    assert_eq!(
        harness
            .session(&session_id(&created))
            .await
            .session
            .expect("session")
            .state(),
        SessionState::Active
    );
    harness.stop().await;
}

/// Lists the session's tasks with `request` (its `session_id` set), page after page; returns
/// the ids in order and how many pages it took.
async fn list_all(harness: &Harness, mut request: pb::ListTasksRequest) -> (Vec<String>, usize) {
    let mut ids = Vec::new();
    let mut pages = 0;
    loop {
        let page = harness
            .client()
            .list_tasks(request.clone())
            .await
            .expect("list tasks")
            .into_inner();
        pages += 1;
        ids.extend(page.tasks.into_iter().map(|task| task.id));
        if page.next_page_token.is_empty() {
            return (ids, pages);
        }
        request.page_token = page.next_page_token;
    }
}

/// `GetSession` returns the counts of every task and a bounded first page; `ListTasks` goes
/// on from its token and pages through the tasks in plan order, filtered.
async fn a_large_session_comes_out_in_pages(db: Db) {
    let harness = Harness::start(db).await;
    // IMPL-i (executors, ready) each followed by TESTRUN-i (test runners, pending).
    let tasks: Vec<Value> = (0..1_250)
        .flat_map(|i| {
            [
                json!({"id": format!("IMPL-{i}"), "title": "work"}),
                json!({"id": format!("TESTRUN-{i}"), "title": "test", "depends_on": [format!("IMPL-{i}")]}),
            ]
        })
        .collect();
    // Plan order is topological: the first wave (every IMPL), then the second.
    let order: Vec<String> = (0..1_250)
        .map(|i| format!("IMPL-{i}"))
        .chain((0..1_250).map(|i| format!("TESTRUN-{i}")))
        .collect();
    let session = session_id(
        &harness
            .create(json!({"name": "paged", "tasks": tasks}))
            .await,
    );

    let first = harness.session(&session).await;
    assert_eq!(first.tasks.len(), 1_000);
    let counts = first
        .session
        .as_ref()
        .expect("session")
        .counts
        .expect("counts");
    assert_eq!(
        (counts.total, counts.ready, counts.pending),
        (2_500, 1_250, 1_250)
    );
    let repo_counts = first.session.as_ref().expect("session").repos[0]
        .counts
        .expect("repo counts");
    assert_eq!(repo_counts.total, 2_500);
    assert!(!first.next_page_token.is_empty());
    let first_ids: Vec<&str> = first.tasks.iter().map(|task| task.id.as_str()).collect();
    assert_eq!(first_ids, order[..1_000]);

    let rest = pb::ListTasksRequest {
        session_id: session.clone(),
        page_token: first.next_page_token.clone(),
        ..Default::default()
    };
    let (ids, pages) = list_all(&harness, rest).await;
    assert_eq!(ids, order[1_000..]);
    assert_eq!(pages, 3, "pages of 500 by default");

    let everything = pb::ListTasksRequest {
        session_id: session.clone(),
        page_size: 700,
        ..Default::default()
    };
    let (ids, pages) = list_all(&harness, everything.clone()).await;
    assert_eq!(ids, order);
    assert_eq!(pages, 4);

    let by_prefix = pb::ListTasksRequest {
        id_prefix: "TESTRUN-".to_owned(),
        ..everything.clone()
    };
    let (testruns, _) = list_all(&harness, by_prefix).await;
    let want: Vec<String> = order
        .iter()
        .filter(|id| id.starts_with("TESTRUN-"))
        .cloned()
        .collect();
    assert_eq!(testruns, want);
    let by_role = pb::ListTasksRequest {
        roles: vec![Role::TestRunner as i32],
        ..everything.clone()
    };
    assert_eq!(list_all(&harness, by_role).await.0, want);
    let by_state = pb::ListTasksRequest {
        states: vec![pb::TaskState::Ready as i32],
        ..everything.clone()
    };
    let (ready, _) = list_all(&harness, by_state).await;
    assert_eq!(ready, order[..1_250]);
    let by_repo = pb::ListTasksRequest {
        repo: "app".to_owned(),
        ..everything.clone()
    };
    assert_eq!(list_all(&harness, by_repo).await.0.len(), 2_500);
    let no_repo = pb::ListTasksRequest {
        repo: "elsewhere".to_owned(),
        ..everything.clone()
    };
    assert!(list_all(&harness, no_repo).await.0.is_empty());

    assert_code(
        harness
            .client()
            .list_tasks(pb::ListTasksRequest {
                page_token: "page 2".to_owned(),
                ..everything.clone()
            })
            .await,
        Code::InvalidArgument,
        "page_token",
    );
    assert_code(
        harness
            .client()
            .list_tasks(pb::ListTasksRequest {
                session_id: "no-such-session".to_owned(),
                ..everything
            })
            .await,
        Code::NotFound,
        "no-such-session",
    );
    harness.stop().await;
}

db_tests!(
    a_large_session_comes_out_in_pages,
    a_50000_task_plan_goes_in_and_comes_out_with_the_default_limits,
    a_plan_over_the_configured_limit_is_refused_and_nothing_is_stored,
    a_refusal_lists_the_first_problems_and_counts_the_rest,
    malformed_requests_are_invalid_arguments,
);
