//! `Executor.ExecuteTask` and `ListBackends` over gRPC.

use prost::Message;
use serde_json::json;
use tonic::Code;
use troupe_executor::{Config, TASK_ERROR_METADATA};
use troupe_proto::v1::executor_client::ExecutorClient;
use troupe_proto::v1::{
    ErrorKind, ExecuteTaskRequest, ListBackendsRequest, TaskError, task_result,
};
use troupe_testkit::{TestService, git, git_repo};

use crate::{plan_dir, show, to_struct};

struct Fixture {
    _dirs: Vec<tempfile::TempDir>,
    repo: std::path::PathBuf,
    plan: std::path::PathBuf,
    data: std::path::PathBuf,
    service: TestService,
    client: ExecutorClient<tonic::transport::Channel>,
}

async fn fixture() -> Fixture {
    let repo_dir = tempfile::tempdir().expect("tempdir");
    let data_dir = tempfile::tempdir().expect("tempdir");
    let plan = plan_dir();
    let repo = repo_dir.path().join("app");
    git_repo(
        &repo,
        &[("src/app.py", "print('v1')\n"), ("README.md", "app\n")],
    )
    .expect("repo");
    let config = Config {
        listen: "127.0.0.1:0".parse().expect("addr"),
        data_dir: data_dir.path().to_path_buf(),
        coordinator_url: None,
        concurrency: 1,
        worker_id: None,
        worker: Default::default(),
        backends_config: None,
        validator_url: None,
        phase_concurrency: 4,
        summary_dir: troupe_executor::DEFAULT_SUMMARY_DIR.to_owned(),
        security: Default::default(),
        sandbox: Default::default(),
    };
    let service =
        TestService::spawn(|listener, shutdown| troupe_executor::run(config, listener, shutdown))
            .await;
    let client = ExecutorClient::connect(service.url())
        .await
        .expect("connect");
    Fixture {
        repo,
        plan: plan.path().to_path_buf(),
        data: data_dir.path().to_path_buf(),
        _dirs: vec![repo_dir, data_dir, plan],
        service,
        client,
    }
}

impl Fixture {
    fn request(&self, task: serde_json::Value) -> ExecuteTaskRequest {
        ExecuteTaskRequest {
            repo_path: self.repo.display().to_string(),
            base_ref: "main".to_owned(),
            branch: String::new(),
            task: Some(to_struct(&task)),
            base_dir: self.plan.display().to_string(),
        }
    }
}

fn task_error(status: &tonic::Status) -> TaskError {
    let bytes = status
        .metadata()
        .get_bin(TASK_ERROR_METADATA)
        .expect("typed error metadata")
        .to_bytes()
        .expect("valid binary metadata");
    TaskError::decode(bytes).expect("decodes")
}

#[tokio::test]
async fn execute_task_commits_the_agent_change_on_a_new_branch() {
    let mut f = fixture().await;
    let task = json!({
        "id": "IMPL-001",
        "title": "Bump the version",
        "description": "Print v2.",
        "files": [{"path": "src/app.py", "action": "modify", "change": "print v2"}],
        "convergence": {"criteria": ["prints v2"]},
        "agent": {"command": ["python3", "{plan_dir}/agent.py", "{worktree}", "--keep-prompt", "src/app.py=print('v2')"]},
    });
    let result = f
        .client
        .execute_task(f.request(task))
        .await
        .expect("executes")
        .into_inner()
        .result
        .expect("result");

    assert_eq!(result.task_branch, "troupe/direct/IMPL-001");
    let head = git(&f.repo, &["rev-parse", "troupe/direct/IMPL-001"]).expect("branch exists");
    assert_eq!(result.commit, head);
    assert_eq!(
        show(&f.repo, &head, "src/app.py").as_deref(),
        Some("print('v2')")
    );
    // One commit: the agent's change with its summary.
    assert_eq!(
        git(&f.repo, &["log", "-1", "--format=%s", &head]).expect("log"),
        "IMPL-001: Bump the version"
    );
    assert_eq!(
        git(&f.repo, &["rev-parse", &format!("{head}~1")]).expect("parent"),
        git(&f.repo, &["rev-parse", "main"]).expect("main")
    );
    let summary =
        show(&f.repo, &head, ".troupe-summaries/summary-IMPL-001.md").expect("summary committed");
    for needle in [
        "task: \"IMPL-001\"",
        "title: \"Bump the version\"",
        "affects: [\".prompt-seen\",\"src/app.py\"]",
        "convergence-met: pending",
        "- [ ] prints v2",
    ] {
        assert!(summary.contains(needle), "missing {needle:?} in\n{summary}");
    }
    // No validator is configured here, and the result says so.
    assert!(
        result
            .warnings
            .iter()
            .any(|w| w.starts_with("self-validation skipped: no validator configured")),
        "{:?}",
        result.warnings
    );
    // The agent also left its prompt copy, so two files changed; the scope check flags it.
    assert_eq!(result.files_modified, [".prompt-seen", "src/app.py"]);
    assert!(
        result.warnings.iter().any(|w| w.contains(".prompt-seen")),
        "{:?}",
        result.warnings
    );
    let prompt = show(&f.repo, &head, ".prompt-seen").expect("prompt reached stdin");
    assert!(prompt.contains("PURPOSE: Bump the version"), "{prompt}");
    assert!(prompt.contains("- [ ] prints v2"), "{prompt}");

    let Some(task_result::Detail::Implementation(report)) = result.detail else {
        panic!("implementation report")
    };
    assert_eq!(report.backend, "command");
    assert_eq!(report.backend_reason, "task agent.command");
    assert_eq!(report.exit_code, 0);
    assert!(
        report.output_tail.contains("edited 1 files"),
        "{}",
        report.output_tail
    );

    // The checkout and its branch are untouched; the worktree is gone.
    assert_eq!(
        git(&f.repo, &["status", "--porcelain"]).expect("status"),
        ""
    );
    assert_eq!(
        std::fs::read_to_string(f.repo.join("src/app.py")).expect("read"),
        "print('v1')\n"
    );
    let worktrees = git(&f.repo, &["worktree", "list", "--porcelain"]).expect("worktrees");
    assert_eq!(worktrees.matches("worktree ").count(), 1, "{worktrees}");
    assert!(f.data.join("attempts/direct").exists());

    // The branch must not exist yet.
    let again = json!({"id": "IMPL-001", "agent": {"command": ["true"]}});
    let status = f
        .client
        .execute_task(f.request(again))
        .await
        .expect_err("branch exists");
    assert_eq!(status.code(), Code::AlreadyExists, "{status:?}");
    f.service.stop().await;
}

#[tokio::test]
async fn failing_agent_is_a_classified_error_and_leaves_no_branch() {
    let mut f = fixture().await;
    let task = json!({
        "id": "IMPL-002",
        "files": ["src/app.py"],
        "agent": {"command": ["python3", "{plan_dir}/agent.py", "{worktree}", "--fail"]},
    });
    let status = f
        .client
        .execute_task(f.request(task))
        .await
        .expect_err("agent fails");
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    assert!(
        status
            .message()
            .starts_with("crash: backend `command` exited with code 3"),
        "{}",
        status.message()
    );
    let error = task_error(&status);
    assert_eq!(error.kind(), ErrorKind::Crash);
    assert!(error.retryable);
    assert_eq!(error.details, ["agent is unhappy"]);
    assert!(
        git(
            &f.repo,
            &["rev-parse", "--verify", "--quiet", "troupe/direct/IMPL-002"]
        )
        .is_err()
    );

    // A program that is not installed, and an agent that changes nothing.
    let missing = json!({"id": "IMPL-003", "agent": {"command": ["troupe-no-such-agent"]}});
    let status = f
        .client
        .execute_task(f.request(missing))
        .await
        .expect_err("not installed");
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(task_error(&status).kind(), ErrorKind::NotInstalled);
    let idle = json!({"id": "IMPL-004", "agent": {"command": ["true"]}});
    let status = f
        .client
        .execute_task(f.request(idle))
        .await
        .expect_err("no changes");
    assert_eq!(task_error(&status).kind(), ErrorKind::BadOutput);
    assert_eq!(task_error(&status).message, "agent made no changes");
    let allowed = json!({"id": "IMPL-005", "allow_empty": true, "agent": {"command": ["true"]}});
    let result = f
        .client
        .execute_task(f.request(allowed))
        .await
        .expect("allowed")
        .into_inner()
        .result
        .expect("result");
    assert_eq!(
        result.commit,
        git(&f.repo, &["rev-parse", "main"]).expect("main")
    );

    // Unknown backends and unknown placeholders are refused as invalid tasks.
    let unknown = json!({"id": "IMPL-006", "agent": {"backend": "cursor"}});
    let status = f
        .client
        .execute_task(f.request(unknown))
        .await
        .expect_err("unknown backend");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("unknown backend `cursor`"),
        "{}",
        status.message()
    );
    let bad = json!({"id": "IMPL-007", "agent": {"command": ["echo", "{workdir}"]}});
    let status = f
        .client
        .execute_task(f.request(bad))
        .await
        .expect_err("placeholder");
    assert_eq!(task_error(&status).kind(), ErrorKind::InvalidTask);
    f.service.stop().await;
}

#[tokio::test]
async fn scope_refusal_fails_out_of_scope() {
    let mut f = fixture().await;
    let task = json!({
        "id": "IMPL-008",
        "files": [{"path": "src/app.py", "action": "modify"}],
        "focus_paths": ["src"],
        "scope": "refuse",
        "agent": {"command": ["python3", "{plan_dir}/agent.py", "{worktree}", "--keep-prompt", "src/app.py=x", "README.md=hacked"]},
    });
    let status = f
        .client
        .execute_task(f.request(task))
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    let error = task_error(&status);
    assert_eq!(error.kind(), ErrorKind::OutOfScope);
    assert!(!error.retryable);
    assert_eq!(error.details, [".prompt-seen", "README.md"]);
    assert!(
        git(
            &f.repo,
            &["rev-parse", "--verify", "--quiet", "troupe/direct/IMPL-008"]
        )
        .is_err()
    );
    f.service.stop().await;
}

#[tokio::test]
async fn list_backends_probes_every_backend() {
    let mut f = fixture().await;
    let backends = f
        .client
        .list_backends(ListBackendsRequest { probe: false })
        .await
        .expect("lists")
        .into_inner()
        .backends;
    let names: Vec<&str> = backends.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "command", "codex", "gemini", "qwen", "claude", "opencode", "agent"
        ]
    );
    assert!(backends[0].available);
    for backend in &backends[1..6] {
        // Installed exactly when the program is on PATH, and then its version is known.
        // Usable when it also has a credential (no key here: a login of the user, if any).
        let installed = troupe_process::which(&backend.name).is_some();
        assert_eq!(
            backend.available,
            installed && !backend.credential.starts_with("missing: "),
            "{backend:?}"
        );
        assert!(!backend.credential.is_empty(), "{backend:?}");
        assert_eq!(!backend.version.is_empty(), installed, "{backend:?}");
        assert!(!backend.detail.is_empty());
    }
    // Without an endpoint and model the agent loop cannot run.
    assert!(!backends[6].available);
    assert!(
        backends[6].detail.contains("endpoint"),
        "{}",
        backends[6].detail
    );
    f.service.stop().await;
}

#[tokio::test]
async fn malformed_requests_are_invalid_arguments() {
    let mut f = fixture().await;
    let mut request = f.request(json!({"id": "IMPL-1", "agent": {"command": ["true"]}}));
    request.repo_path = "relative/path".to_owned();
    assert_eq!(
        f.client
            .execute_task(request)
            .await
            .expect_err("relative")
            .code(),
        Code::InvalidArgument
    );
    let request = f.request(json!({"agent": {"command": ["true"]}}));
    assert_eq!(
        f.client
            .execute_task(request)
            .await
            .expect_err("no id")
            .code(),
        Code::InvalidArgument
    );
    let mut request = f.request(json!({"id": "IMPL-1", "agent": {"command": ["true"]}}));
    request.base_ref = "no-such-ref".to_owned();
    assert_eq!(
        f.client
            .execute_task(request)
            .await
            .expect_err("ref")
            .code(),
        Code::NotFound
    );
    f.service.stop().await;
}

/// A plan's `agent.env` could point a CLI at the plan's own URL (`ANTHROPIC_BASE_URL`) while
/// the CLI holds the executor's key, or load code into it (`NODE_OPTIONS`): it is refused for
/// every backend but `command`, before anything runs.
#[tokio::test]
async fn a_plans_env_reaches_the_command_backend_only() {
    let mut f = fixture().await;
    for backend in ["claude", "codex", "agent"] {
        let task = json!({
            "id": "IMPL-009",
            "files": [{"path": "src/app.py", "action": "modify"}],
            "agent": {"backend": backend, "env": {"ANTHROPIC_BASE_URL": "http://127.0.0.1:9"}},
        });
        let status = f
            .client
            .execute_task(f.request(task))
            .await
            .expect_err("refused");
        let error = task_error(&status);
        assert_eq!(
            error.kind(),
            ErrorKind::InvalidTask,
            "{backend}: {status:?}"
        );
        assert!(!error.retryable);
        assert!(
            error.message.contains(&format!(
                "`agent.env` is given to the `command` backend only; backend `{backend}` gets its environment"
            )),
            "{backend}: {}",
            error.message
        );
    }
    f.service.stop().await;
}
