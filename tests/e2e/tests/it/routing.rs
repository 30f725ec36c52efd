//! Routing by capability with real workers: a real `troupe-coordinator`, two real
//! `troupe-executor` workers, one with the real claude CLI (target/tools) signed in by key
//! against the scripted model server and one whose claude is not installed, and a plan of
//! claude tasks and `command` tasks (which both can run). Every claude task runs on the claude
//! worker with no fallback; once that worker is stopped, a new claude task shows as a
//! capability gap naming claude, in `CheckSession` and in `troupe check`.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};
use troupe_modelserver::{ModelServer, Script};
use troupe_proto::v1::{
    CheckSessionRequest, CreateSessionRequest, GetSessionRequest, GetSessionResponse, SessionState,
    task_result::Detail,
};

use crate::support::{ChildService, binary, free_addr, installed_cli};

const CLAUDE_TASKS: [&str; 3] = ["IMPL-C1", "IMPL-C2", "IMPL-C3"];
const COMMAND_TASKS: [&str; 3] = ["IMPL-X1", "IMPL-X2", "IMPL-X3"];

/// The executor's backend config: claude against the scripted server, or not installed.
fn config(claude: &str, url: &str) -> String {
    format!(
        "fallback = []\nretries = 0\n\n[backends.claude]\ncommand = {}\nmodel = \"fake-model\"\n\
         endpoint = {}\napi_key = \"fake-key\"\nfast_fail = true\ntimeout_seconds = 120\n",
        json!(claude),
        json!(url)
    )
}

fn claude_task(id: &str) -> Value {
    json!({"id": id, "title": format!("write {id}.txt"),
        "description": format!("route-{id}: create {id}.txt"),
        "agent": {"backend": "claude"}})
}

fn plan() -> Value {
    let mut tasks: Vec<Value> = CLAUDE_TASKS.iter().map(|id| claude_task(id)).collect();
    for id in COMMAND_TASKS {
        tasks.push(json!({"id": id, "title": format!("write {id}.txt"),
            "agent": {"command": ["python3", "-c",
                "import pathlib, sys; pathlib.Path(sys.argv[1], sys.argv[2] + '.txt').write_text('x')",
                "{worktree}", id]}}));
    }
    json!({"name": "routing", "repos": {"app": {"path": "repo"}}, "tasks": tasks})
}

/// Starts an executor worker logging to `<data>.log`, and waits until its worker loop runs
/// (after its backend probe), so both workers are claiming when a session arrives.
async fn executor(
    name: &str,
    url: &str,
    config_file: &Path,
    data: &Path,
) -> anyhow::Result<ChildService> {
    let log = data.with_extension("log");
    let service = ChildService::start_at(
        "troupe-executor",
        free_addr(),
        &[
            "--coordinator-url",
            url,
            "--worker-id",
            name,
            "--concurrency",
            "2",
            "--config",
            &config_file.display().to_string(),
            "--data-dir",
            &data.display().to_string(),
        ],
        &[],
        Some(&log),
    )
    .await?;
    troupe_testkit::eventually(&format!("{name}'s worker loop"), || async {
        std::fs::read_to_string(&log)
            .ok()
            .filter(|text| text.contains("\"worker started\""))
    })
    .await;
    Ok(service)
}

async fn create(url: &str, plan: &Value, base_dir: &Path) -> anyhow::Result<String> {
    let created = troupe_grpc::coordinator_client(url)?
        .create_session(CreateSessionRequest {
            plan_json: plan.to_string(),
            base_dir: base_dir.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(created.session.context("no session")?.id)
}

async fn finished(url: &str, id: &str) -> anyhow::Result<GetSessionResponse> {
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let view = troupe_grpc::coordinator_client(url)?
            .get_session(GetSessionRequest {
                session_id: id.to_owned(),
                ..Default::default()
            })
            .await?
            .into_inner();
        let state = view.session.as_ref().map(|s| s.state());
        if matches!(state, Some(SessionState::Completed | SessionState::Failed)) {
            return Ok(view);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "session {id} did not finish: {}",
            troupe::report::final_report(&view)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_tasks_go_to_the_worker_that_has_claude_and_a_gap_names_it() -> anyhow::Result<()> {
    let mut script = Script::default();
    for id in CLAUDE_TASKS.into_iter().chain(["IMPL-C4"]) {
        script = script.rule(
            &format!("route-{id}"),
            vec![troupe_modelserver::Action::WriteFile {
                path: format!("{id}.txt"),
                content: format!("{id} by claude\n"),
            }],
        );
    }
    let (model_url, model) = ModelServer::start(script).await?;
    let dir = tempfile::tempdir()?;
    let plan_dir = dir.path().join("plan");
    troupe_testkit::git_repo(&plan_dir.join("repo"), &[("README.md", "hello\n")])?;
    let with_claude = dir.path().join("with-claude.toml");
    std::fs::write(&with_claude, config(&installed_cli("claude"), &model_url))?;
    let without = dir.path().join("without-claude.toml");
    std::fs::write(&without, config("/nonexistent/claude", &model_url))?;

    let coordinator = ChildService::start(
        "troupe-coordinator",
        &[
            "--data-dir",
            &dir.path().join("coord").display().to_string(),
            "--capability-gap-seconds",
            "2",
        ],
        &[],
    )
    .await?;
    let url = coordinator.url();
    // Both poll when the tasks arrive: unrouted, the worker without claude would take a
    // claude task (they come first in claim order) and fail it.
    let other = executor("no-claude", &url, &without, &dir.path().join("a")).await?;
    let claude = executor("has-claude", &url, &with_claude, &dir.path().join("b")).await?;

    let session = create(&url, &plan(), &plan_dir).await?;
    let view = finished(&url, &session).await?;
    assert_eq!(
        view.session.as_ref().map(|s| s.state()),
        Some(SessionState::Completed),
        "{}\nmodel requests: {}",
        troupe::report::final_report(&view),
        model.requests().len()
    );
    for task in &view.tasks {
        let Some(Detail::Implementation(report)) =
            task.result.as_ref().and_then(|r| r.detail.as_ref())
        else {
            anyhow::bail!("{} has no implementation report", task.id);
        };
        if CLAUDE_TASKS.contains(&task.id.as_str()) {
            assert_eq!(task.worker_id, "has-claude", "{} ran elsewhere", task.id);
            assert_eq!(report.backend, "claude", "{}", task.id);
            assert!(
                report.fallbacks.is_empty(),
                "{}: {:?}",
                task.id,
                report.fallbacks
            );
            assert_eq!(task.attempt, 1, "{} took more than one attempt", task.id);
        } else {
            assert_eq!(report.backend, "command", "{}", task.id);
        }
    }
    // The worker without claude did work (the command tasks are anyone's), so it was live
    // and claiming all along.
    let by_other = view
        .tasks
        .iter()
        .filter(|task| task.worker_id == "no-claude")
        .count();
    assert!(by_other > 0, "the worker without claude ran nothing");

    // Without the claude worker, a claude task waits and is reported as a gap.
    claude.terminate(Duration::from_secs(30)).await?;
    let gap_plan = json!({"name": "gap", "repos": {"app": {"path": "repo"}},
        "tasks": [claude_task("IMPL-C4")]});
    let gap_session = create(&url, &gap_plan, &plan_dir).await?;
    let gap = troupe_testkit::eventually("a capability gap naming claude", || async {
        troupe_grpc::coordinator_client(&url)
            .ok()?
            .check_session(CheckSessionRequest {
                session_id: gap_session.clone(),
                ..Default::default()
            })
            .await
            .ok()?
            .into_inner()
            .capability_gaps
            .into_iter()
            .find(|gap| gap.backend == "claude")
    })
    .await;
    assert_eq!(gap.task_ids, ["IMPL-C4"]);
    let output = tokio::process::Command::new(binary("troupe"))
        .args(["check", &gap_session, "--connect", &url])
        .env_remove("RUST_LOG")
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("capability gap: no live executor worker can run backend claude"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        !stdout.contains("stalled:"),
        "a gap is not a stall: {stdout}"
    );
    other.terminate(Duration::from_secs(30)).await?;
    coordinator.terminate(Duration::from_secs(30)).await?;
    Ok(())
}
