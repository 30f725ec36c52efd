//! Large plans in pieces (`UploadPlan`) and large sessions out in bounded replies
//! (`CreateSession`'s page, `CheckSession`'s bounded graph), over a real server.

use std::time::Duration;

use prost::Message as _;
use serde_json::{Value, json};
use tonic::Code;
use troupe_proto::v1::{self as pb, Role};

use crate::support::{Db, Harness, assert_code, db_tests, session_id};

/// A plan of `count` tasks in chains of 100.
fn chains(count: usize) -> Value {
    let tasks: Vec<Value> = (0..count)
        .map(|i| {
            let deps: Vec<String> = if i % 100 == 0 {
                Vec::new()
            } else {
                vec![format!("IMPL-{}", i - 1)]
            };
            json!({"id": format!("IMPL-{i}"), "title": format!("step {i}"), "depends_on": deps})
        })
        .collect();
    json!({"name": "uploaded", "repos": {"app": {"path": "repo"}}, "tasks": tasks})
}

/// An upload of `plan` as `UploadPlan` messages: the request, then pieces of `piece` bytes.
fn pieces(harness: &Harness, plan: &[u8], piece: usize) -> Vec<pb::PlanChunk> {
    let head = pb::PlanChunk {
        request: Some(pb::CreateSessionRequest {
            base_dir: harness.base_dir.display().to_string(),
            ..Default::default()
        }),
        plan_json: Vec::new(),
    };
    std::iter::once(head)
        .chain(plan.chunks(piece).map(|bytes| pb::PlanChunk {
            request: None,
            plan_json: bytes.to_vec(),
        }))
        .collect()
}

async fn upload(
    harness: &Harness,
    chunks: Vec<pb::PlanChunk>,
) -> Result<pb::CreateSessionResponse, tonic::Status> {
    harness
        .client()
        .upload_plan(tokio_stream::iter(chunks))
        .await
        .map(tonic::Response::into_inner)
}

async fn sessions(harness: &Harness) -> Vec<pb::Session> {
    harness
        .client()
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect("list")
        .into_inner()
        .sessions
}

/// A 100,000-task plan goes in as 1 MiB pieces (pieces that split characters: a title is not
/// ASCII); `CreateSession`'s answer and `CheckSession`'s are bounded (counts, a page, the
/// graph's first nodes with a count of the rest, every wave counted), and the session works.
async fn a_100000_task_plan_goes_in_pieces_and_its_replies_stay_bounded(db: Db) {
    let harness = Harness::start(db).await;
    let mut plan = chains(100_000);
    plan["tasks"][0]["title"] = json!("première étape ✓");
    let plan = plan.to_string().into_bytes();
    let created = upload(&harness, pieces(&harness, &plan, 1024 * 1024 + 1))
        .await
        .expect("upload");
    drop(plan);
    assert!(
        created.encoded_len() < 1024 * 1024,
        "{} bytes",
        created.encoded_len()
    );
    assert_eq!(created.tasks.len(), 1_000);
    assert_eq!(created.tasks[0].title, "première étape ✓");
    assert_eq!(created.waves, 100);
    assert_eq!(created.next_page_token, "after:999");
    let session = created.session.clone().expect("session");
    let counts = session.counts.expect("counts");
    assert_eq!((counts.total, counts.ready), (100_000, 1_000));

    // Two tasks run: a bounded check lists them ahead of the others. Their leases outlast
    // the slowest check of 100,000 tasks on a loaded machine (a lapsed one is ready again).
    let claimed = harness
        .claim_with(
            &[Role::Executor],
            2,
            Duration::ZERO,
            Duration::from_secs(600),
        )
        .await;
    assert_eq!(claimed.len(), 2);
    let check = harness
        .client()
        .check_session(pb::CheckSessionRequest {
            session_id: session.id.clone(),
            max_graph: 10,
        })
        .await
        .expect("check")
        .into_inner();
    assert!(
        check.encoded_len() < 64 * 1024,
        "{} bytes",
        check.encoded_len()
    );
    assert_eq!(check.graph.len(), 10);
    assert_eq!(check.graph_omitted, 99_990);
    let running: Vec<&str> = check
        .graph
        .iter()
        .filter(|node| node.state() == pb::TaskState::Running)
        .map(|node| node.task_id.as_str())
        .collect();
    assert_eq!(running.len(), 2, "{running:?}");
    assert_eq!(check.active_workers.len(), 2);
    assert_eq!(check.waves.len(), 100);
    let counted: u32 = check.waves.iter().map(|wave| wave.task_count).sum();
    let listed: usize = check.waves.iter().map(|wave| wave.task_ids.len()).sum();
    assert_eq!((counted, listed), (100_000, 10));
    // The default graph is 1,000 nodes.
    let check = harness.check(&session.id).await;
    assert_eq!((check.graph.len(), check.graph_omitted), (1_000, 99_000));
    harness.complete(&claimed[0], "ok").await.expect("complete");
    harness.stop().await;
}

/// Intake turns a plan's tasks into rows without copying them (it consumes them from the
/// back, giving the plan's memory back as it goes): every task of a plan larger than the
/// steps it shrinks by is stored whole, in topological order (by wave, then plan order), with
/// its own fields.
async fn a_large_plan_s_tasks_are_stored_whole_in_order(db: Db) {
    let harness = Harness::start(db).await;
    let count = 9_001;
    let mut plan = chains(count);
    for (i, task) in plan["tasks"]
        .as_array_mut()
        .expect("tasks")
        .iter_mut()
        .enumerate()
    {
        task["description"] = json!(format!("about {i}"));
        task["note"] = json!(i);
    }
    let plan = plan.to_string().into_bytes();
    let created = upload(&harness, pieces(&harness, &plan, 256 * 1024))
        .await
        .expect("upload");
    let session = session_id(&created);
    let mut tasks = Vec::new();
    let mut token = String::new();
    loop {
        let page = harness
            .client()
            .list_tasks(pb::ListTasksRequest {
                session_id: session.clone(),
                page_size: 2_500,
                page_token: token,
                ..Default::default()
            })
            .await
            .expect("list")
            .into_inner();
        tasks.extend(page.tasks);
        token = page.next_page_token;
        if token.is_empty() {
            break;
        }
    }
    assert_eq!(tasks.len(), count);
    // Chains of 100: the wave of `IMPL-i` is `i % 100 + 1`.
    let mut order: Vec<usize> = (0..count).collect();
    order.sort_by_key(|i| (i % 100, *i));
    for (&i, task) in order.iter().zip(&tasks) {
        assert_eq!(task.id, format!("IMPL-{i}"));
        assert_eq!(task.title, format!("step {i}"));
        assert_eq!(task.description, format!("about {i}"));
        let deps: Vec<String> = match i % 100 {
            0 => Vec::new(),
            _ => vec![format!("IMPL-{}", i - 1)],
        };
        assert_eq!(task.depends_on, deps);
        assert_eq!(task.wave as usize, i % 100 + 1, "{}", task.id);
        let note = task
            .spec
            .as_ref()
            .and_then(|spec| spec.fields.get("note"))
            .and_then(|value| value.kind.clone());
        assert_eq!(
            note,
            Some(prost_types::value::Kind::NumberValue(i as f64)),
            "{}",
            task.id
        );
        let expected = if i % 100 == 0 {
            pb::TaskState::Ready
        } else {
            pb::TaskState::Pending
        };
        assert_eq!(task.state(), expected, "{}", task.id);
    }
    harness.stop().await;
}

/// A refused upload stores nothing, whether the plan is invalid (all or nothing: its last task
/// names a dependency no task has), not UTF-8, or the stream breaks the protocol.
async fn a_refused_upload_stores_nothing(db: Db) {
    let harness = Harness::start(db).await;
    let mut plan = chains(20_000);
    plan["tasks"][19_999]["depends_on"] = json!(["IMPL-missing"]);
    let plan = plan.to_string().into_bytes();
    assert_code(
        upload(&harness, pieces(&harness, &plan, 64 * 1024)).await,
        Code::InvalidArgument,
        "IMPL-missing",
    );
    let not_utf8 = pieces(&harness, b"{\"name\": \"\xff\xfe\"}", 4);
    assert_code(
        upload(&harness, not_utf8).await,
        Code::InvalidArgument,
        "not UTF-8",
    );
    let good = chains(3).to_string().into_bytes();
    let mut headless = pieces(&harness, &good, 64);
    headless.remove(0);
    assert_code(
        upload(&harness, headless).await,
        Code::InvalidArgument,
        "first message carries the request",
    );
    let mut twice = pieces(&harness, &good, 64);
    twice[1].request = twice[0].request.clone();
    assert_code(
        upload(&harness, twice).await,
        Code::InvalidArgument,
        "only the upload's first message",
    );
    let mut inline = pieces(&harness, &good, 64);
    if let Some(request) = inline[0].request.as_mut() {
        request.plan_json = "{}".to_owned();
    }
    assert_code(
        upload(&harness, inline).await,
        Code::InvalidArgument,
        "carries plan_json",
    );
    assert_code(
        upload(&harness, Vec::new()).await,
        Code::InvalidArgument,
        "an empty upload",
    );
    assert!(sessions(&harness).await.is_empty());
    // The same plan, whole, goes in.
    let created = upload(&harness, pieces(&harness, &good, 64))
        .await
        .expect("upload");
    assert_eq!(created.tasks.len(), 3);
    assert_eq!(sessions(&harness).await.len(), 1);
    assert!(!session_id(&created).is_empty());
    harness.stop().await;
}

/// Text that array and SQL syntax give meaning to (quotes, backslashes, braces, commas, `NULL`,
/// newlines, surrounding blanks, non-ASCII, nothing at all) is stored as written: PostgreSQL
/// intake sends each column as the text form of an array.
async fn awkward_text_is_stored_as_written(db: Db) {
    let harness = Harness::start(db).await;
    let texts = [
        "say \"hi\"",
        "back\\slash \\\\ and \\\" and \\x00ff",
        "line one\nline two\r\n\ttabbed",
        "{braces}, commas, {\"nested\": [1, 2]}",
        "NULL",
        "",
        "  blanks around  ",
        "ünïcödé — 日本語 🎭",
        "'single'; DROP TABLE tasks; --",
    ];
    let tasks: Vec<Value> = texts
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let deps: Vec<String> = (0..i).take(2).map(|d| format!("IMPL-{d}")).collect();
            json!({"id": format!("IMPL-{i}"), "title": format!("title {text}"), "description": text,
                   "note": text, "depends_on": deps})
        })
        .collect();
    let created = harness
        .create(json!({"name": "awkward", "tasks": tasks}))
        .await;
    let session = harness.session(&session_id(&created)).await;
    assert_eq!(session.tasks.len(), texts.len());
    for (i, text) in texts.iter().enumerate() {
        let task = crate::support::task(&session.tasks, &format!("IMPL-{i}"));
        assert_eq!(task.title, format!("title {text}"));
        assert_eq!(task.description, *text);
        assert_eq!(crate::support::spec_json(task)["note"], json!(text));
        let deps: Vec<String> = (0..i).take(2).map(|d| format!("IMPL-{d}")).collect();
        assert_eq!(task.depends_on, deps);
    }
    harness.stop().await;
}

db_tests!(
    a_100000_task_plan_goes_in_pieces_and_its_replies_stay_bounded,
    awkward_text_is_stored_as_written,
    a_large_plan_s_tasks_are_stored_whole_in_order,
    a_refused_upload_stores_nothing,
);
