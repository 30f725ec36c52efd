//! CCW round trip: run a session in-process, export it to a CCW folder, import the folder back
//! and check that nothing was lost.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;
use troupe::ccw_export;
use troupe::embedded::{Embedded, EmbeddedConfig};
use troupe_proto::json::{struct_to_object as struct_to_json, to_struct};
use troupe_proto::v1::{
    self as pb, CreateSessionRequest, GetSessionRequest, ListMessagesRequest, LogMessageRequest,
    SessionState, TaskState, UpdateStateRequest,
};

/// An agent that writes `name` into the worktree (argv only, no shell).
fn writer(name: &str) -> Value {
    json!({
        "backend": "command",
        "command": ["python3", "-c", format!("import sys; open(sys.argv[1] + '/{name}', 'w').write('{name}\\n')"), "{worktree}"],
        "timeout_seconds": 60
    })
}

fn plan(repo: &Path) -> Value {
    json!({
        "name": "ccw-roundtrip",
        "description": "Write three files, document them and validate the result.",
        "mode": "eager",
        "on_failure": "skip",
        "repos": {"app": {"path": repo.display().to_string()}},
        "tasks": [
            {"id": "IMPL-001", "title": "Write a.txt", "description": "Create a.txt.", "depends_on": [],
             "priority": "high", "max_attempts": 1, "timeout_seconds": 120,
             "files": [{"path": "a.txt", "action": "create", "change": "new file"}],
             "convergence": {"criteria": ["file: a.txt exists"]},
             "rationale": {"chosen_approach": "python one-liner"},
             "agent": writer("a.txt")},
            {"id": "IMPL-002", "title": "Write b.txt", "description": "Create b.txt.", "depends_on": ["IMPL-001"],
             "files": [{"path": "b.txt", "action": "create"}],
             "convergence": {"criteria": ["file: b.txt exists"]},
             "agent": writer("b.txt")},
            {"id": "DOC-001", "title": "Write docs.md", "role": "executor", "depends_on": ["IMPL-001"],
             "files": [{"path": "docs.md", "action": "create"}],
             "agent": writer("docs.md")},
            {"id": "VALIDATE-001", "title": "Validate", "depends_on": ["IMPL-002", "DOC-001"],
             "convergence": {"criteria": ["every file exists"],
                             "verification": ["python3", "-c", "import os; assert all(map(os.path.exists, ['a.txt', 'b.txt', 'docs.md']))"]}}
        ]
    })
}

/// Spec fields the engine adds at run time (CCW §2.1 "runtime").
const RUNTIME: [&str; 3] = ["status", "result", "executed_at"];

fn without_runtime(spec: &Map<String, Value>) -> Map<String, Value> {
    let mut spec = spec.clone();
    for field in RUNTIME {
        spec.remove(field);
    }
    spec
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_survives_export_and_import() {
    let temp = tempfile::tempdir().unwrap();
    let repo = temp.path().join("repo");
    troupe_testkit::git_repo(&repo, &[("README.md", "roundtrip\n")]).unwrap();
    let shutdown = CancellationToken::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let embedded = Embedded::start(
        EmbeddedConfig {
            data_dir: temp.path().join("data"),
            executor_concurrency: 2,
            python: "python3".into(),
            security: Default::default(),
        },
        listener,
        shutdown.clone(),
    )
    .await
    .unwrap();
    let url = troupe_grpc::url_for(embedded.addr());
    let mut client = troupe_grpc::coordinator_client(&url).unwrap();

    let created = client
        .create_session(CreateSessionRequest {
            plan_json: plan(&repo).to_string(),
            base_dir: temp.path().display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let session_id = created.session.unwrap().id;
    // Messages on the bus, as workers and the coordinator would log them.
    for (from, kind) in [
        ("executor", "impl_progress"),
        ("IMPL-001", "task_complete"),
        ("validator", "verify_passed"),
    ] {
        client
            .log_message(LogMessageRequest {
                session_id: session_id.clone(),
                from: from.into(),
                r#type: kind.into(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    client
        .update_state(UpdateStateRequest {
            session_id: session_id.clone(),
            role: "executor".into(),
            data: Some(to_struct(
                &json!({"status": "task_complete", "task_id": "IMPL-002"}),
            )),
        })
        .await
        .unwrap();

    let finished = troupe_testkit::eventually("the session finishes", || {
        let mut client = client.clone();
        let session_id = session_id.clone();
        async move {
            let response = client
                .get_session(GetSessionRequest {
                    session_id,
                    ..Default::default()
                })
                .await
                .ok()?
                .into_inner();
            let state = response.session.as_ref()?.state;
            (state != SessionState::Active as i32).then_some(response)
        }
    })
    .await;
    assert_eq!(
        finished.session.as_ref().unwrap().state,
        SessionState::Completed as i32,
        "{}",
        troupe::report::final_report(&finished)
    );
    let messages = client
        .list_messages(ListMessagesRequest {
            session_id: session_id.clone(),
            last: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .messages;
    assert!(messages.len() >= 4, "{messages:?}");

    // Export.
    let out = temp.path().join("ccw");
    let summary = ccw_export::export(&troupe_grpc::Connector::default(), &url, &session_id, &out)
        .await
        .unwrap();
    assert_eq!(summary.tasks, 4);
    assert_eq!(summary.messages, messages.len());

    let read = |path: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(out.join(path)).unwrap()).unwrap()
    };
    let team = read("team-session.json");
    assert_eq!(team["session_id"], session_id.as_str());
    assert_eq!(team["status"], "completed");
    assert_eq!(team["team_name"], "ccw-roundtrip");
    assert_eq!(team["pipeline"]["tasks_total"], 4);
    assert_eq!(team["pipeline"]["tasks_completed"], 4);
    assert_eq!(
        team["pipeline"]["dependency_graph"]["VALIDATE-001"],
        json!(["IMPL-002", "DOC-001"])
    );
    let role_names: Vec<&str> = team["roles"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(role_names, ["executor", "validator"]);
    assert_eq!(team["roles"][0]["prefix"], "IMPL");
    for role in &role_names {
        assert!(out.join(format!("role-specs/{role}.md")).is_file());
    }
    let analysis = read("task-analysis.json");
    assert_eq!(
        analysis["dependency_graph"]["DOC-001"],
        json!({"depends_on": ["IMPL-001"], "role": "executor"})
    );

    // Messages: same count, ids and order; CCW's `+00:00` timestamps.
    let lines: Vec<Value> = std::fs::read_to_string(out.join(".msg/messages.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let exported_ids: Vec<&str> = lines.iter().map(|m| m["id"].as_str().unwrap()).collect();
    let live_ids: Vec<&str> = messages.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(exported_ids, live_ids);
    for line in &lines {
        for field in ["id", "ts", "from", "to", "type", "summary"] {
            assert!(line.get(field).is_some(), "{field} missing in {line}");
        }
        assert!(line["ts"].as_str().unwrap().ends_with("+00:00"), "{line}");
    }
    assert!(
        lines
            .iter()
            .any(|m| m["from"] == "IMPL-001" && m["type"] == "task_complete")
    );
    let meta = read(".msg/meta.json");
    assert_eq!(meta["status"], "completed");
    assert_eq!(meta["role_state"]["executor"]["task_id"], "IMPL-002");
    assert!(meta["role_state"]["executor"].get("_updated_at").is_some());

    // Task JSON: the spec as written plus runtime status and result.
    let live: BTreeMap<&str, &pb::Task> =
        finished.tasks.iter().map(|t| (t.id.as_str(), t)).collect();
    for (id, task) in &live {
        let exported = read(&format!(".task/{id}.json"));
        assert_eq!(exported["status"], "completed");
        assert_eq!(exported["result"]["success"], true);
        assert_eq!(
            exported["result"]["commit_hash"],
            task.result.as_ref().unwrap().commit.as_str()
        );
        let spec = struct_to_json(task.spec.as_ref().unwrap());
        assert_eq!(without_runtime(exported.as_object().unwrap()), spec, "{id}");
    }
    assert_eq!(read(".task/IMPL-001.json")["timeout_seconds"], 120);
    let summary_md = std::fs::read_to_string(out.join("summary-IMPL-001.md")).unwrap();
    assert!(summary_md.starts_with("---\n"), "{summary_md}");
    assert!(summary_md.contains("task: \"IMPL-001\""), "{summary_md}");
    assert!(summary_md.contains("convergence-met: pass"), "{summary_md}");
    assert!(summary_md.contains("affects: [\"a.txt\"]"), "{summary_md}");
    assert!(!out.join("summary-VALIDATE-001.md").exists());

    // Import the folder back: the same plan, every task completed.
    let document = troupe_plan::ccw::import_session(&out).unwrap();
    assert_eq!(document["name"], "ccw-roundtrip");
    assert_eq!(document["mode"], "eager");
    assert_eq!(document["on_failure"], "skip");
    let imported: BTreeMap<&str, &Value> = document["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["id"].as_str().unwrap(), t))
        .collect();
    assert_eq!(
        imported.keys().collect::<Vec<_>>(),
        live.keys().collect::<Vec<_>>()
    );
    for (id, task) in &live {
        let spec = imported[id].as_object().unwrap();
        assert_eq!(spec["status"], "completed", "{id}");
        assert_eq!(
            without_runtime(spec),
            struct_to_json(task.spec.as_ref().unwrap()),
            "{id}"
        );
    }
    let replayed = client
        .create_session(CreateSessionRequest {
            plan_json: document.to_string(),
            base_dir: out.display().to_string(),
            dry_run: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let order: Vec<&str> = replayed.tasks.iter().map(|t| t.id.as_str()).collect();
    let live_order: Vec<&str> = finished.tasks.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(order, live_order, "topological order survives");
    for task in &replayed.tasks {
        let original = live[task.id.as_str()];
        assert_eq!(task.depends_on, original.depends_on, "{}", task.id);
        assert_eq!(task.role, original.role, "{}", task.id);
        assert_eq!(task.priority, original.priority, "{}", task.id);
        assert_eq!(task.max_attempts, original.max_attempts, "{}", task.id);
        assert_eq!(task.files, original.files, "{}", task.id);
        assert_eq!(task.repo, original.repo, "{}", task.id);
    }
    assert_eq!(
        replayed.session.unwrap().repos[0].path,
        finished.session.as_ref().unwrap().repos[0].path
    );

    // Submitted for real, the imported session is already complete: nothing runs twice.
    let resumed = client
        .create_session(CreateSessionRequest {
            plan_json: document.to_string(),
            base_dir: out.display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let resumed_session = resumed.session.unwrap();
    // Its branch starts where the exported session's branch is, with the completed work, not
    // at the repository's HEAD.
    let exported = finished.session.as_ref().unwrap().repos[0].clone();
    assert_eq!(document["repos"].as_object().unwrap().len(), 1);
    let (_, imported_repo) = document["repos"]
        .as_object()
        .unwrap()
        .iter()
        .next()
        .unwrap();
    assert_eq!(imported_repo["base"], exported.branch.as_str());
    let rev_parse = |rev: &str| {
        let output = std::process::Command::new("git")
            .arg("-C")
            .arg(&exported.path)
            .args(["rev-parse", "--verify", rev])
            .output()
            .unwrap();
        assert!(output.status.success(), "rev-parse {rev}");
        String::from_utf8(output.stdout).unwrap().trim().to_owned()
    };
    let exported_tip = rev_parse(&exported.branch);
    assert_ne!(
        exported_tip,
        rev_parse("HEAD"),
        "the exported branch has commits"
    );
    let new_repo = &resumed_session.repos[0];
    assert_eq!(new_repo.base_commit, exported_tip);
    assert_eq!(rev_parse(&new_repo.branch), exported_tip);
    let resumed_id = resumed_session.id;
    let resumed = troupe_testkit::eventually("the imported session settles", || {
        let mut client = client.clone();
        let session_id = resumed_id.clone();
        async move {
            let response = client
                .get_session(GetSessionRequest {
                    session_id,
                    ..Default::default()
                })
                .await
                .ok()?
                .into_inner();
            let state = response.session.as_ref()?.state;
            (state != SessionState::Active as i32).then_some(response)
        }
    })
    .await;
    assert_eq!(
        resumed.session.as_ref().unwrap().state,
        SessionState::Completed as i32
    );
    for task in &resumed.tasks {
        assert_eq!(task.state, TaskState::Completed as i32, "{}", task.id);
        assert_eq!(task.attempt, 0, "{} ran again", task.id);
        assert_eq!(
            task.result.as_ref().unwrap().commit,
            live[task.id.as_str()].result.as_ref().unwrap().commit,
            "{}",
            task.id
        );
    }

    shutdown.cancel();
    embedded.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_holds_every_message_past_one_page() {
    let temp = tempfile::tempdir().unwrap();
    let repo = temp.path().join("repo");
    troupe_testkit::git_repo(&repo, &[("README.md", "many messages\n")]).unwrap();
    let shutdown = CancellationToken::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let embedded = Embedded::start(
        EmbeddedConfig {
            data_dir: temp.path().join("data"),
            executor_concurrency: 1,
            python: "python3".into(),
            security: Default::default(),
        },
        listener,
        shutdown.clone(),
    )
    .await
    .unwrap();
    let url = troupe_grpc::url_for(embedded.addr());
    let mut client = troupe_grpc::coordinator_client(&url).unwrap();
    let plan = json!({
        "name": "chatty",
        "repos": {"app": {"path": repo.display().to_string()}},
        "tasks": [{"id": "IMPL-001", "title": "Write a.txt", "agent": writer("a.txt")}]
    });
    let session_id = client
        .create_session(CreateSessionRequest {
            plan_json: plan.to_string(),
            base_dir: temp.path().display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .session
        .unwrap()
        .id;
    // More than one ListMessages page (1000), so the export must not stop at the newest page.
    let count = 1005;
    for index in 0..count {
        client
            .log_message(LogMessageRequest {
                session_id: session_id.clone(),
                from: "executor".into(),
                r#type: "impl_progress".into(),
                summary: format!("step {index}"),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let out = temp.path().join("ccw");
    let summary = ccw_export::export(&troupe_grpc::Connector::default(), &url, &session_id, &out)
        .await
        .unwrap();
    assert!(summary.messages >= count, "{}", summary.messages);
    let ids: Vec<String> = std::fs::read_to_string(out.join(".msg/messages.jsonl"))
        .unwrap()
        .lines()
        .map(|line| {
            serde_json::from_str::<Value>(line).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(ids.len(), summary.messages);
    let expected: Vec<String> = (1..=ids.len()).map(|n| format!("MSG-{n:03}")).collect();
    assert_eq!(ids, expected, "every id, in order, none skipped");

    shutdown.cancel();
    embedded.wait().await.unwrap();
}
