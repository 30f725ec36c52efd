//! The real coding-agent CLIs (installed by scripts/setup/50-agent-clis.sh) and the built-in
//! `agent` loop, driven through `Executor.ExecuteTask` against the scripted model server.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use prost::Message;
use serde_json::{Value, json};
use tonic::Code;
use troupe_backends::{BackendConfig, BackendsConfig};
use troupe_executor::{Config, TASK_ERROR_METADATA};
use troupe_modelserver::{Action, ModelServer, Script};
use troupe_proto::v1::executor_client::ExecutorClient;
use troupe_proto::v1::{
    ErrorKind, ExecuteTaskRequest, ImplementationReport, ListBackendsRequest, TaskError,
    TaskResult, task_result,
};
use troupe_testkit::{TestService, git, git_repo, workspace_root};

use crate::{show, to_struct};

pub(crate) const CLIS: &[&str] = &["codex", "claude", "gemini", "qwen", "opencode"];

/// The CLI's program: on PATH, or where the setup script installs it.
pub(crate) fn cli_program(name: &str) -> String {
    if troupe_process::which(name).is_some() {
        return name.to_owned();
    }
    let installed = workspace_root().join("target/tools/npm/bin").join(name);
    assert!(
        installed.is_file(),
        "`{name}` is not installed: run scripts/setup/50-agent-clis.sh (scripts/test does)"
    );
    installed.display().to_string()
}

/// Where each backend's protocol lives under the server's base URL, and the model to ask for
/// (`gpt-5.5` makes codex offer `apply_patch`; `-m` spares gemini its router call).
fn endpoint_and_model(backend: &str, base: &str) -> (String, &'static str) {
    match backend {
        "codex" => (format!("{base}/v1"), "gpt-5.5"),
        "claude" => (base.to_owned(), "fake-model"),
        "gemini" => (base.to_owned(), "gemini-2.5-flash"),
        _ => (format!("{base}/v1"), "fake-model"),
    }
}

/// A backend section pointing at `base` (which may carry a fault prefix), failing fast.
pub(crate) fn backend_config(backend: &str, base: &str) -> BackendConfig {
    let (endpoint, model) = endpoint_and_model(backend, base);
    BackendConfig {
        command: (backend != "agent").then(|| cli_program(backend)),
        model: Some(model.to_owned()),
        endpoint: Some(endpoint),
        api_key: Some("fake-key".to_owned()),
        fast_fail: true,
        timeout_seconds: Some(120),
        ..BackendConfig::default()
    }
}

pub(crate) struct Fixture {
    _dirs: Vec<tempfile::TempDir>,
    pub(crate) repo: PathBuf,
    pub(crate) data: PathBuf,
    pub(crate) service: TestService,
    pub(crate) client: ExecutorClient<tonic::transport::Channel>,
}

pub(crate) async fn fixture(config: BackendsConfig) -> Fixture {
    let repo_dir = tempfile::tempdir().expect("tempdir");
    let data_dir = tempfile::tempdir().expect("tempdir");
    let repo = repo_dir.path().join("app");
    git_repo(
        &repo,
        &[("README.md", "app\n"), ("src/app.py", "print('v1')\n")],
    )
    .expect("repo");
    let config_file = data_dir.path().join("executor.toml");
    std::fs::write(&config_file, to_toml(&config)).expect("config file");
    let config = Config {
        listen: "127.0.0.1:0".parse().expect("addr"),
        data_dir: data_dir.path().join("data"),
        coordinator_url: None,
        concurrency: 1,
        worker_id: None,
        worker: Default::default(),
        backends_config: Some(config_file),
        validator_url: None,
        phase_concurrency: 4,
        summary_dir: troupe_executor::DEFAULT_SUMMARY_DIR.to_owned(),
        security: Default::default(),
        sandbox: Default::default(),
    };
    let data = data_dir.path().join("data");
    let service =
        TestService::spawn(|listener, shutdown| troupe_executor::run(config, listener, shutdown))
            .await;
    let client = ExecutorClient::connect(service.url())
        .await
        .expect("connect");
    Fixture {
        repo,
        data,
        _dirs: vec![repo_dir, data_dir],
        service,
        client,
    }
}

/// The config as the TOML file the executor reads (so `--config` is what gets tested).
pub(crate) fn to_toml(config: &BackendsConfig) -> String {
    let mut out = format!(
        "fallback = {}\nretries = {}\nretry_backoff_ms = {}\nauto_backend = \"{}\"\n",
        json!(config.fallback),
        config.retries,
        config.retry_backoff_ms,
        config.auto_backend
    );
    for (name, b) in &config.backends {
        out.push_str(&format!("\n[backends.{name}]\n"));
        let mut field = |key: &str, value: Option<Value>| {
            if let Some(value) = value {
                out.push_str(&format!("{key} = {value}\n"));
            }
        };
        field("command", b.command.clone().map(Value::from));
        field("model", b.model.clone().map(Value::from));
        field("endpoint", b.endpoint.clone().map(Value::from));
        field("api_key", b.api_key.clone().map(Value::from));
        field(
            "auth",
            match b.auth {
                troupe_backends::AuthMode::Auto => None,
                troupe_backends::AuthMode::Key => Some(Value::from("key")),
                troupe_backends::AuthMode::Login => Some(Value::from("login")),
                troupe_backends::AuthMode::None => Some(Value::from("none")),
            },
        );
        field(
            "login_dir",
            b.login_dir
                .as_ref()
                .map(|d| Value::from(d.display().to_string())),
        );
        field("fast_fail", Some(Value::from(b.fast_fail)));
        field("timeout_seconds", b.timeout_seconds.map(Value::from));
        field(
            "idle_timeout_seconds",
            b.idle_timeout_seconds.map(Value::from),
        );
        field("max_turns", b.max_turns.map(Value::from));
    }
    out
}

pub(crate) fn config_for(backends: &[(&str, &str)]) -> BackendsConfig {
    BackendsConfig {
        // Only the fallback test falls back: others would reach unconfigured CLIs.
        fallback: Vec::new(),
        retries: 0,
        retry_backoff_ms: 10,
        backends: backends
            .iter()
            .map(|(name, base)| ((*name).to_owned(), backend_config(name, base)))
            .collect(),
        ..BackendsConfig::default()
    }
}

impl Fixture {
    pub(crate) fn request(&self, task: Value) -> ExecuteTaskRequest {
        ExecuteTaskRequest {
            repo_path: self.repo.display().to_string(),
            base_ref: "main".to_owned(),
            branch: String::new(),
            task: Some(to_struct(&task)),
            base_dir: String::new(),
        }
    }

    pub(crate) async fn execute(&mut self, task: Value) -> Result<TaskResult, tonic::Status> {
        let request = self.request(task);
        self.client
            .execute_task(request)
            .await
            .map(|r| r.into_inner().result.expect("result"))
    }
}

pub(crate) fn report(result: &TaskResult) -> ImplementationReport {
    match &result.detail {
        Some(task_result::Detail::Implementation(report)) => report.clone(),
        other => panic!("expected an implementation report, got {other:?}"),
    }
}

pub(crate) fn task_error(status: &tonic::Status) -> TaskError {
    let bytes = status
        .metadata()
        .get_bin(TASK_ERROR_METADATA)
        .expect("typed error metadata")
        .to_bytes()
        .expect("binary metadata");
    TaskError::decode(bytes).expect("decodes")
}

pub(crate) fn task(id: &str, backend: &str, file: &str) -> Value {
    json!({
        "id": id,
        "title": format!("Create {file}"),
        "description": format!("Create the file {file} with a greeting."),
        "files": [{"path": file, "action": "create", "change": "new file"}],
        "agent": {"backend": backend},
    })
}

async fn completes_a_real_edit(backend: &str) {
    let script = Script::write_file("notes/hello.txt", "notes/hello.txt", "hello from the model");
    let (url, server) = ModelServer::start(script).await.expect("model server");
    let mut f = fixture(config_for(&[(backend, &url)])).await;
    let started = Instant::now();
    let result = f
        .execute(task("IMPL-1", backend, "notes/hello.txt"))
        .await
        .unwrap_or_else(|status| {
            panic!(
                "{backend} failed: {status:?}\nrequests: {:#?}",
                server.requests()
            )
        });
    let head = git(&f.repo, &["rev-parse", "troupe/direct/IMPL-1"]).expect("branch");
    assert_eq!(result.commit, head);
    assert_eq!(
        show(&f.repo, &head, "notes/hello.txt")
            .map(|t| t.trim_end().to_owned())
            .as_deref(),
        Some("hello from the model"),
        "{backend}"
    );
    assert_eq!(result.files_modified, ["notes/hello.txt"], "{backend}");
    let report = report(&result);
    assert_eq!(report.backend, backend);
    assert_eq!(report.backend_reason, "task agent.backend");
    let usage = report.usage.expect("usage recorded");
    assert!(
        usage.input_tokens >= 2 * troupe_modelserver::INPUT_TOKENS,
        "{backend}: {usage:?}"
    );
    assert!(
        usage.output_tokens >= troupe_modelserver::OUTPUT_TOKENS,
        "{backend}: {usage:?}"
    );
    if backend != "agent" {
        assert!(
            !report.native_session_id.is_empty(),
            "{backend} reported no session id"
        );
    }
    // The child ran with its own home: nothing of it leaked into the worktree or the repo.
    assert!(
        server
            .requests()
            .iter()
            .all(|r| r.api_key.as_deref().is_some_and(|k| k.contains("fake-key")))
    );
    eprintln!("{backend}: edit in {:?}", started.elapsed());
    f.service.stop().await;
}

#[tokio::test]
async fn codex_completes_a_real_edit() {
    completes_a_real_edit("codex").await;
}

#[tokio::test]
async fn claude_completes_a_real_edit() {
    completes_a_real_edit("claude").await;
}

#[tokio::test]
async fn gemini_completes_a_real_edit() {
    completes_a_real_edit("gemini").await;
}

#[tokio::test]
async fn qwen_completes_a_real_edit() {
    completes_a_real_edit("qwen").await;
}

#[tokio::test]
async fn opencode_completes_a_real_edit() {
    completes_a_real_edit("opencode").await;
}

#[tokio::test]
async fn agent_loop_reads_edits_and_writes() {
    let script = Script::default().rule(
        "src/app.py",
        vec![
            Action::ReadFile {
                path: "src/app.py".into(),
            },
            Action::Edit {
                path: "src/app.py".into(),
                search: "v1".into(),
                replace: "v2".into(),
            },
            Action::WriteFile {
                path: "src/extra.py".into(),
                content: "X = 1\n".into(),
            },
            Action::Shell {
                command: "git status --short".into(),
            },
            Action::WriteFile {
                path: "../escape.txt".into(),
                content: "nope".into(),
            },
        ],
    );
    let (url, server) = ModelServer::start(script).await.expect("model server");
    let mut f = fixture(config_for(&[("agent", &url)])).await;
    let mut spec = task("IMPL-A", "agent", "src/app.py");
    spec["files"] = json!(["src/app.py", "src/extra.py"]);
    let result = f.execute(spec).await.expect("agent loop succeeds");
    assert_eq!(
        show(&f.repo, &result.commit, "src/app.py").as_deref(),
        Some("print('v2')")
    );
    assert_eq!(
        show(&f.repo, &result.commit, "src/extra.py").as_deref(),
        Some("X = 1")
    );
    assert_eq!(result.files_modified, ["src/app.py", "src/extra.py"]);
    assert!(!f.repo.parent().expect("parent").join("escape.txt").exists());
    // 5 tool calls + the final answer, each a request carrying the growing conversation.
    let requests = server.requests();
    assert_eq!(requests.len(), 6, "{requests:#?}");
    let last = requests.last().expect("last").body_text();
    assert!(
        last.contains("print('v1')"),
        "read_file result went back to the model"
    );
    assert!(
        last.contains("?? src/extra.py"),
        "run result went back to the model: {last}"
    );
    assert!(
        last.contains("escapes the worktree"),
        "escape refused: {last}"
    );
    let report = report(&result);
    assert_eq!(
        report.usage.map(|u| u.input_tokens),
        Some(6 * troupe_modelserver::INPUT_TOKENS)
    );

    // A turn budget stops a loop that never ends.
    let mut config = config_for(&[("agent", &url)]);
    config.fallback.clear();
    if let Some(agent) = config.backends.get_mut("agent") {
        agent.max_turns = Some(2);
    }
    let mut g = fixture(config).await;
    let status = g
        .execute(task("IMPL-B", "agent", "src/app.py").tap_files())
        .await
        .expect_err("budget");
    let error = task_error(&status);
    assert_eq!(error.kind(), ErrorKind::BadOutput);
    assert!(
        error.message.contains("turn budget of 2"),
        "{}",
        error.message
    );
    f.service.stop().await;
    g.service.stop().await;
}

trait TapFiles {
    fn tap_files(self) -> Self;
}

impl TapFiles for Value {
    /// The same task mentioning `src/app.py`, so the looping rule fires.
    fn tap_files(mut self) -> Self {
        self["files"] = json!(["src/app.py", "src/extra.py"]);
        self
    }
}

/// Runs one backend against a faulty endpoint and returns the classified error.
async fn fault(
    backend: &str,
    base: &str,
    idle: Option<u64>,
    timeout_seconds: u64,
) -> (TaskError, Code, Duration) {
    let mut config = config_for(&[(backend, base)]);
    config.fallback.clear();
    if let Some(b) = config.backends.get_mut(backend) {
        b.idle_timeout_seconds = idle;
        b.timeout_seconds = Some(timeout_seconds);
    }
    let mut f = fixture(config).await;
    let started = Instant::now();
    let status = f
        .execute(task("IMPL-E", backend, "notes/hello.txt"))
        .await
        .expect_err("fault");
    let elapsed = started.elapsed();
    f.service.stop().await;
    (task_error(&status), status.code(), elapsed)
}

/// One fault against one backend: the class is right and names the backend. Returns how long
/// the attempt took.
async fn classifies_one(
    backend: &str,
    url: &str,
    prefix: &str,
    want: ErrorKind,
    timeout_seconds: u64,
) -> Duration {
    let base = if prefix == "refused" {
        troupe_modelserver::refused_url().await.expect("port")
    } else {
        format!("{url}/{prefix}")
    };
    let (error, code, elapsed) = fault(backend, &base, None, timeout_seconds).await;
    assert_eq!(error.kind(), want, "{backend} {prefix}: {error:?}");
    assert!(
        error.message.contains(&format!("`{backend}`")),
        "{}",
        error.message
    );
    assert_ne!(code, Code::Ok);
    eprintln!(
        "{backend} {prefix}: {:?} in {elapsed:?}: {}",
        error.kind(),
        error.message
    );
    elapsed
}

async fn classifies(backend: &str, cases: &[(&str, ErrorKind)]) {
    let (url, _server) = ModelServer::start(Script::write_file(
        "notes/hello.txt",
        "notes/hello.txt",
        "x",
    ))
    .await
    .expect("model server");
    for (prefix, want) in cases {
        classifies_one(backend, &url, prefix, *want, 90).await;
    }
}

/// A fault the CLI retries internally for 70–90 s with no switch to turn that off (qwen's
/// inner 7-attempt backoff, opencode's 5 session retries): under `fast_fail` troupe stops it
/// at the first failed call its log records, so the attempt ends in seconds, classified.
async fn stops_at_the_first_error(backend: &str, prefix: &str, want: ErrorKind) {
    let (url, _server) = ModelServer::start(Script::write_file(
        "notes/hello.txt",
        "notes/hello.txt",
        "x",
    ))
    .await
    .expect("model server");
    let base = if prefix == "refused" {
        troupe_modelserver::refused_url().await.expect("port")
    } else {
        format!("{url}/{prefix}")
    };
    let (error, _, elapsed) = fault(backend, &base, None, 150).await;
    eprintln!(
        "{backend} {prefix}: {:?} in {elapsed:?}: {}",
        error.kind(),
        error.message
    );
    assert_eq!(error.kind(), want, "{backend} {prefix}: {error:?}");
    assert!(
        error.message.contains("first failed model call"),
        "{backend} {prefix}: {}",
        error.message
    );
    // Without the watch: 70–90 s. With it: the first call, a 2 s grace, a loaded machine.
    assert!(
        elapsed < Duration::from_secs(45),
        "{backend} {prefix} took {elapsed:?}"
    );
}

#[tokio::test]
async fn codex_errors_classify() {
    classifies(
        "codex",
        &[
            ("__401", ErrorKind::Auth),
            ("__429", ErrorKind::RateLimited),
            ("__500", ErrorKind::Crash),
            ("refused", ErrorKind::Crash),
        ],
    )
    .await;
}

#[tokio::test]
async fn claude_errors_classify() {
    classifies(
        "claude",
        &[
            ("__401", ErrorKind::Auth),
            ("__429", ErrorKind::RateLimited),
            ("__500", ErrorKind::Crash),
            ("refused", ErrorKind::Crash),
        ],
    )
    .await;
}

#[tokio::test]
async fn gemini_errors_classify() {
    classifies(
        "gemini",
        &[
            ("__401", ErrorKind::Auth),
            ("__429", ErrorKind::RateLimited),
            ("__500", ErrorKind::Crash),
            ("refused", ErrorKind::Crash),
        ],
    )
    .await;
}

#[tokio::test]
async fn qwen_errors_classify() {
    classifies(
        "qwen",
        &[
            ("__401", ErrorKind::Auth),
            ("__429", ErrorKind::RateLimited),
        ],
    )
    .await;
}

#[tokio::test]
async fn opencode_errors_classify() {
    // 401 is not retried, 429 honours retry-after; 500 and refused are the slow tests below.
    classifies(
        "opencode",
        &[
            ("__401", ErrorKind::Auth),
            ("__429", ErrorKind::RateLimited),
        ],
    )
    .await;
}

#[tokio::test]
async fn fast_fail_stops_qwen_at_its_first_500() {
    stops_at_the_first_error("qwen", "__500", ErrorKind::Crash).await;
}

#[tokio::test]
async fn fast_fail_stops_qwen_at_its_first_refused_connection() {
    stops_at_the_first_error("qwen", "refused", ErrorKind::Crash).await;
}

#[tokio::test]
async fn fast_fail_stops_opencode_at_its_first_500() {
    stops_at_the_first_error("opencode", "__500", ErrorKind::Crash).await;
}

#[tokio::test]
async fn fast_fail_stops_opencode_at_its_first_refused_connection() {
    stops_at_the_first_error("opencode", "refused", ErrorKind::Crash).await;
}

#[tokio::test]
async fn agent_errors_classify() {
    classifies(
        "agent",
        &[
            ("__401", ErrorKind::Auth),
            ("__429", ErrorKind::RateLimited),
            ("__500", ErrorKind::Crash),
            ("refused", ErrorKind::Crash),
        ],
    )
    .await;
}

#[tokio::test]
async fn fallback_moves_on_after_a_classified_failure() {
    let (url, server) = ModelServer::start(Script::write_file(
        "notes/hello.txt",
        "notes/hello.txt",
        "via fallback",
    ))
    .await
    .expect("model server");
    // gemini's and qwen's keys are refused, codex works: gemini → qwen → codex.
    let mut config = config_for(&[
        ("gemini", &format!("{url}/__401")),
        ("qwen", &format!("{url}/__401")),
        ("codex", &url),
    ]);
    config.fallback = vec!["gemini".into(), "qwen".into(), "codex".into()];
    config.retries = 1;
    let mut f = fixture(config).await;
    let result = f
        .execute(task("IMPL-F", "gemini", "notes/hello.txt"))
        .await
        .expect("codex finishes the task");
    let report = report(&result);
    assert_eq!(report.backend, "codex");
    assert_eq!(report.fallbacks, ["gemini", "qwen"]);
    assert!(
        report
            .backend_reason
            .contains("fell back from gemini, qwen to codex"),
        "{}",
        report.backend_reason
    );
    assert_eq!(
        show(&f.repo, &result.commit, "notes/hello.txt")
            .map(|t| t.trim_end().to_owned())
            .as_deref(),
        Some("via fallback")
    );
    f.service.stop().await;
    drop(server);
}

/// A rate limit is the coordinator's to wait out (docs/quotas.md): the executor neither
/// retries it nor falls back, and names the backend (and the wait) in the error.
#[tokio::test]
async fn a_rate_limit_neither_retries_nor_falls_back() {
    let (url, server) = ModelServer::start(Script::write_file(
        "notes/hello.txt",
        "notes/hello.txt",
        "never written",
    ))
    .await
    .expect("model server");
    let mut config = config_for(&[("gemini", &format!("{url}/__429")), ("codex", &url)]);
    config.fallback = vec!["gemini".into(), "codex".into()];
    config.retries = 1;
    let mut f = fixture(config).await;
    let status = f
        .execute(task("IMPL-R", "gemini", "notes/hello.txt"))
        .await
        .expect_err("the rate limit ends the attempt");
    let error = task_error(&status);
    assert_eq!(error.kind(), ErrorKind::RateLimited, "{}", error.message);
    assert_eq!(error.rate_limited_backend, "gemini");
    let requests = server.requests();
    let limited = requests
        .iter()
        .filter(|r| r.path.starts_with("/__429/"))
        .count();
    assert_eq!(limited, 1, "gemini: one call, no retry");
    assert!(
        requests.iter().all(|r| r.path.starts_with("/__429/")),
        "codex never ran"
    );
    f.service.stop().await;
}

/// `fallbacks` names only the backends given up for another that then ran: a task failing on
/// its only backend has none, and the failing backend is the one reported.
#[tokio::test]
async fn fallbacks_name_only_backends_left_for_another() {
    let work = tempfile::tempdir().expect("tempdir");
    let repo = work.path().join("app");
    git_repo(&repo, &[("README.md", "app\n")]).expect("repo");
    git(&repo, &["branch", "troupe/sf", "main"]).expect("session branch");
    let data = work.path().join("data");
    std::fs::create_dir_all(&data).expect("data");
    let missing = |name: &str| BackendConfig {
        command: Some(format!("/nonexistent/{name}")),
        api_key: Some("k".into()),
        ..BackendConfig::default()
    };
    let run = |id: &'static str, fallback: Vec<String>| {
        let config = BackendsConfig {
            fallback,
            retries: 0,
            backends: [("codex", missing("codex")), ("claude", missing("claude"))]
                .into_iter()
                .map(|(name, settings)| (name.to_owned(), settings))
                .collect(),
            ..BackendsConfig::default()
        };
        let executor =
            troupe_executor::Executor::with_config(data.canonicalize().expect("canonical"), config);
        let job = troupe_executor::Job {
            spec: troupe_plan::TaskSpec::from_object(
                json!({"id": id, "title": "t", "files": ["a.txt"], "agent": {"backend": "codex"}})
                    .as_object()
                    .expect("object"),
                None,
            )
            .expect("valid task"),
            remote: troupe_workspace::Remote::from_path(&repo).expect("remote"),
            repo_name: "app".to_owned(),
            session_id: "sf".to_owned(),
            task_id: None,
            attempt: 1,
            plan_dir: None,
            upstream: Vec::new(),
            target: troupe_executor::Target::Session {
                branch: "troupe/sf".to_owned(),
                base: None,
            },
            lease: None,
            fencing_token: 0,
            context: Vec::new(),
            usage: None,
        };
        async move {
            let cancel = tokio_util::sync::CancellationToken::new();
            let failed = executor
                .execute(job, &cancel, &|_| {})
                .await
                .expect_err("nothing is installed");
            match failed.partial.expect("partial result").detail {
                Some(task_result::Detail::Implementation(report)) => report,
                other => panic!("{other:?}"),
            }
        }
    };
    let alone = run("IMPL-1", Vec::new()).await;
    assert_eq!(alone.backend, "codex");
    assert!(alone.fallbacks.is_empty(), "{:?}", alone.fallbacks);
    let chained = run("IMPL-2", vec!["claude".to_owned()]).await;
    assert_eq!(chained.backend, "claude");
    assert_eq!(chained.fallbacks, ["codex"]);
}

/// A process as `/proc/<pid>/stat` shows it: its state letter and its start time (in clock
/// ticks since boot), which tells a process from a later one that got its pid back.
fn proc_stat(pid: i32) -> Option<(String, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the `(comm)`: state is the first, starttime the twentieth.
    let rest: Vec<&str> = stat.rsplit(')').next()?.split_whitespace().collect();
    Some((rest.first()?.to_string(), rest.get(19)?.parse().ok()?))
}

/// Live (not zombie) processes whose working directory is under `dir`, with their start times.
fn processes_in(dir: &Path) -> Vec<(i32, u64)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter_map(|pid| {
            let (state, started) = proc_stat(pid)?;
            (state != "Z"
                && std::fs::read_link(format!("/proc/{pid}/cwd"))
                    .is_ok_and(|cwd| cwd.starts_with(dir)))
            .then_some((pid, started))
        })
        .collect()
}

/// Whether the process that had `pid` and started at `started` still runs (a zombie or a new
/// process with the same pid does not count).
fn still_running(pid: i32, started: u64) -> bool {
    proc_stat(pid).is_some_and(|(state, at)| at == started && state != "Z")
}

#[tokio::test]
async fn hung_agent_is_killed_with_its_children() {
    // Every model call hangs (accepted, never answered): codex waits with no output.
    let script = Script::write_file("notes/hello.txt", "notes/hello.txt", "x");
    let (url, server) = ModelServer::start(script).await.expect("model server");
    let mut config = config_for(&[("codex", &format!("{url}/__hang"))]);
    config.fallback.clear();
    if let Some(codex) = config.backends.get_mut("codex") {
        codex.idle_timeout_seconds = Some(3);
    }
    let mut f = fixture(config).await;
    let data = f.data.clone();
    let watcher = tokio::spawn(async move {
        // While the agent hangs, its processes (cwd in the worktree) are alive.
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut most = Vec::new();
        while Instant::now() < deadline {
            let now: Vec<(i32, u64, String)> = processes_in(&data.join("worktrees"))
                .into_iter()
                .map(|(pid, started)| {
                    let comm =
                        std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                    (pid, started, comm.trim().to_owned())
                })
                .collect();
            if now.len() > most.len() {
                most = now;
            }
            if !most.is_empty() && processes_in(&data.join("worktrees")).is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        most
    });
    let started = Instant::now();
    let status = f
        .execute(task("IMPL-H", "codex", "notes/hello.txt"))
        .await
        .expect_err("hangs");
    let error = task_error(&status);
    assert_eq!(error.kind(), ErrorKind::Timeout, "{error:?}");
    assert!(
        error.message.contains("produced no output"),
        "{}",
        error.message
    );
    assert!(started.elapsed() < Duration::from_secs(40));
    let seen = watcher.await.expect("watcher");
    eprintln!("agent processes while hung: {seen:?}");
    // The npm shim (`node`), the native `codex` it started, and whatever codex ran (its shell
    // snapshot `bash`): a parent with children, all in the group that gets killed.
    assert!(seen.iter().any(|(_, _, name)| name == "node"), "{seen:?}");
    assert!(
        seen.iter().any(|(_, _, name)| name.starts_with("codex")),
        "{seen:?}"
    );
    // SIGKILL is delivered asynchronously: a killed process can still show as running (its
    // cwd already released, so the watcher no longer counts it) until the kernel is done
    // with it. Give that a bounded moment, not a pass for a process that escaped the group.
    let deadline = Instant::now() + Duration::from_secs(5);
    let survivors = loop {
        let survivors: Vec<_> = seen
            .iter()
            .filter(|(pid, started, _)| still_running(*pid, *started))
            .collect();
        if survivors.is_empty() || Instant::now() > deadline {
            break format!("{survivors:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(survivors, "[]", "agent processes survived the kill");
    assert!(!server.requests().is_empty());
    f.service.stop().await;
}

#[tokio::test]
async fn list_backends_reports_installed_clis_with_versions() {
    let (url, _server) = ModelServer::start(Script::default())
        .await
        .expect("model server");
    let backends: Vec<(&str, &str)> = CLIS
        .iter()
        .map(|c| (*c, url.as_str()))
        .chain([("agent", url.as_str())])
        .collect();
    let mut f = fixture(config_for(&backends)).await;
    let listed = f
        .client
        .list_backends(ListBackendsRequest { probe: false })
        .await
        .expect("lists")
        .into_inner()
        .backends;
    for info in &listed {
        assert!(info.available, "{info:?}");
        assert!(!info.version.is_empty(), "{info:?}");
    }
    let version = |name: &str| {
        listed
            .iter()
            .find(|b| b.name == name)
            .map(|b| b.version.clone())
            .unwrap_or_default()
    };
    assert!(version("codex").contains("0.169.0"), "{}", version("codex"));
    assert!(
        version("claude").contains("2.1.330"),
        "{}",
        version("claude")
    );
    assert!(
        version("gemini").contains("0.61.0"),
        "{}",
        version("gemini")
    );
    assert!(version("qwen").contains("0.24.4"), "{}", version("qwen"));
    assert!(
        version("opencode").contains("1.18.33"),
        "{}",
        version("opencode")
    );
    f.service.stop().await;
}

/// A first task, then one resuming it and one forking it: both continue the CLI's own session
/// (same native id, the first prompt is in the history the model receives).
async fn resume_and_fork_reuse_the_native_session(backend: &str) {
    let script = Script::write_file("first.txt", "first.txt", "one")
        .rule(
            "second.txt",
            vec![Action::WriteFile {
                path: "second.txt".into(),
                content: "two".into(),
            }],
        )
        .rule(
            "third.txt",
            vec![Action::WriteFile {
                path: "third.txt".into(),
                content: "three".into(),
            }],
        );
    let (url, server) = ModelServer::start(script).await.expect("model server");
    let mut f = fixture(config_for(&[(backend, &url)])).await;
    let first = f
        .execute(task("IMPL-1", backend, "first.txt"))
        .await
        .expect("first run");
    let native = report(&first).native_session_id;
    assert!(!native.is_empty(), "{backend}: no native session id");
    let before = server.requests().len();

    let mut resume = task("IMPL-2", backend, "second.txt");
    resume["cli_execution"] =
        json!({"id": "s-IMPL-2", "strategy": "resume", "resume_from": "IMPL-1"});
    let second = f
        .execute(resume)
        .await
        .unwrap_or_else(|s| panic!("{backend} resume: {s:?}"));
    assert_eq!(
        report(&second).native_session_id,
        native,
        "{backend}: resume kept the session"
    );
    if backend == "codex" {
        // Codex reports the thread's running total; troupe records this run's share (2 calls).
        let usage = report(&second).usage.expect("usage");
        assert_eq!(usage.input_tokens, 2 * troupe_modelserver::INPUT_TOKENS);
    }
    assert_eq!(
        show(&f.repo, &second.commit, "second.txt")
            .map(|t| t.trim_end().to_owned())
            .as_deref(),
        Some("two")
    );
    let resumed: Vec<String> = server.requests()[before..]
        .iter()
        .map(|r| r.body_text())
        .collect();
    assert!(
        resumed
            .iter()
            .any(|b| b.contains("Create the file first.txt")
                && b.contains("Create the file second.txt")),
        "{backend}: the resumed conversation carries the first prompt"
    );

    let mut fork = task("IMPL-3", backend, "third.txt");
    fork["cli_execution"] = json!({"id": "s-IMPL-3", "strategy": "fork", "resume_from": "IMPL-1"});
    let before = server.requests().len();
    let third = f
        .execute(fork)
        .await
        .unwrap_or_else(|s| panic!("{backend} fork: {s:?}"));
    let forked: Vec<String> = server.requests()[before..]
        .iter()
        .map(|r| r.body_text())
        .collect();
    assert!(
        forked
            .iter()
            .any(|b| b.contains("Create the file first.txt")
                && b.contains("Create the file third.txt")),
        "{backend}: the fork starts from the first session"
    );
    // The fork did not see the resume's turn: the parent's session was copied, not shared.
    assert!(
        !forked
            .iter()
            .any(|b| b.contains("Create the file second.txt")),
        "{backend}: the fork saw the resumed turn"
    );
    assert!(!report(&third).native_session_id.is_empty());
    f.service.stop().await;
}

#[tokio::test]
async fn codex_resume_and_fork() {
    resume_and_fork_reuse_the_native_session("codex").await;
}

#[tokio::test]
async fn claude_resume_and_fork() {
    resume_and_fork_reuse_the_native_session("claude").await;
}

#[tokio::test]
async fn gemini_resume_and_fork() {
    resume_and_fork_reuse_the_native_session("gemini").await;
}

#[tokio::test]
async fn qwen_resume_and_fork() {
    resume_and_fork_reuse_the_native_session("qwen").await;
}

#[tokio::test]
async fn opencode_resume_and_fork() {
    resume_and_fork_reuse_the_native_session("opencode").await;
}

/// The saved session of a direct task (`ExecuteTask` keeps it under `sessions/direct/<id>`).
fn saved_session(data: &Path, task_id: &str) -> Value {
    let text = std::fs::read_to_string(
        data.join("sessions/direct")
            .join(task_id)
            .join("session.json"),
    )
    .expect("saved session");
    serde_json::from_str(&text).expect("session json")
}

/// The backend timeout of the taken-path tests: a resume that hung would fail on it.
const TAKEN_PATH_TIMEOUT: u64 = 90;
/// What a run at a taken path may take: well short of the timeout (a hang waits all of it),
/// with room for a loaded two-core CI machine.
const TAKEN_PATH_BOUND: Duration = Duration::from_secs(TAKEN_PATH_TIMEOUT * 2 / 3);

/// A resume whose parent's worktree path is taken (ccw-reference §3.6: a fork's two children at
/// once, or the parent's worktree still there) works in a new worktree. Returns the result,
/// how long the resume took, the request bodies the model received for it, and the parent's
/// native session id.
async fn resume_at_a_taken_path(backend: &str) -> (TaskResult, Duration, Vec<String>, String) {
    // `second.txt` first: the resume's prompt also names `first.txt` (first match wins).
    let script = Script::write_file("second.txt", "second.txt", "two").rule(
        "first.txt",
        vec![Action::WriteFile {
            path: "first.txt".into(),
            content: "one".into(),
        }],
    );
    let (url, server) = ModelServer::start(script).await.expect("model server");
    let mut config = config_for(&[(backend, &url)]);
    for settings in config.backends.values_mut() {
        settings.timeout_seconds = Some(TAKEN_PATH_TIMEOUT);
    }
    let mut f = fixture(config).await;
    let first = f
        .execute(task("IMPL-1", backend, "first.txt"))
        .await
        .unwrap_or_else(|s| panic!("{backend} first run: {s:?}"));
    let parent_native = report(&first).native_session_id;
    assert!(!parent_native.is_empty(), "{backend}: no native session id");
    let parent_cwd = PathBuf::from(
        saved_session(&f.data, "IMPL-1")["cwd"]
            .as_str()
            .expect("cwd")
            .to_owned(),
    );
    // Someone else works at the parent's path now.
    std::fs::create_dir_all(&parent_cwd).expect("occupy");
    std::fs::write(parent_cwd.join("occupied.txt"), "mine\n").expect("occupy");

    let before = server.requests().len();
    let mut resume = task("IMPL-2", backend, "second.txt");
    resume["cli_execution"] =
        json!({"id": "s-IMPL-2", "strategy": "resume", "resume_from": "IMPL-1"});
    let started = Instant::now();
    let result = f.execute(resume).await;
    let elapsed = started.elapsed();
    let bodies: Vec<String> = server.requests()[before..]
        .iter()
        .map(|r| r.body_text())
        .collect();
    let second = result.unwrap_or_else(|s| panic!("{backend} resume after {elapsed:?}: {s:?}"));
    assert_eq!(
        show(&f.repo, &second.commit, "second.txt")
            .map(|t| t.trim_end().to_owned())
            .as_deref(),
        Some("two"),
        "{backend}: the resume's edit landed in its own worktree"
    );
    // The occupant's directory is left as it was.
    assert_eq!(
        std::fs::read_to_string(parent_cwd.join("occupied.txt")).expect("still there"),
        "mine\n"
    );
    assert!(
        !parent_cwd.join("second.txt").exists(),
        "{backend}: the resume wrote into the occupied parent directory"
    );
    f.service.stop().await;
    (second, elapsed, bodies, parent_native)
}

/// Gemini, qwen and opencode bind a session to its directory: at a taken path the resume runs
/// a fresh session with the parent's result as context, says so, and never waits for the
/// timeout (before: gemini and qwen crashed, opencode hung until `timeout_seconds`).
async fn directory_bound_resume_at_a_taken_path(backend: &str) {
    let (result, elapsed, bodies, parent_native) = resume_at_a_taken_path(backend).await;
    eprintln!("{backend}: resume at a taken path took {elapsed:?}");
    assert!(elapsed < TAKEN_PATH_BOUND, "{backend}: took {elapsed:?}");
    let warning = result
        .warnings
        .iter()
        .find(|w| w.starts_with("native resume of IMPL-1 unavailable: its directory "))
        .unwrap_or_else(|| panic!("{backend}: no warning in {:?}", result.warnings));
    assert!(
        warning.ends_with(" is in use; resumed from its result as context"),
        "{warning}"
    );
    assert_ne!(
        report(&result).native_session_id,
        parent_native,
        "{backend}: a fresh session"
    );
    let line = format!("- IMPL-1 ({backend}): done: first.txt");
    assert!(
        bodies
            .iter()
            .any(|b| b.contains("CONTEXT FROM EARLIER SESSIONS (resume)") && b.contains(&line)),
        "{backend}: the parent's result is in the prompt: {bodies:?}"
    );
    assert!(
        !bodies
            .iter()
            .any(|b| b.contains("Create the file first.txt")),
        "{backend}: the parent's native history was sent"
    );
}

#[tokio::test]
async fn opencode_resume_at_a_taken_path_runs_fresh_with_the_parent_as_context() {
    directory_bound_resume_at_a_taken_path("opencode").await;
}

#[tokio::test]
async fn gemini_resume_at_a_taken_path_runs_fresh_with_the_parent_as_context() {
    directory_bound_resume_at_a_taken_path("gemini").await;
}

#[tokio::test]
async fn qwen_resume_at_a_taken_path_runs_fresh_with_the_parent_as_context() {
    directory_bound_resume_at_a_taken_path("qwen").await;
}

/// Codex resumes by session id: a taken parent path changes nothing.
#[tokio::test]
async fn codex_resume_at_a_taken_path_stays_native() {
    let (result, elapsed, bodies, parent_native) = resume_at_a_taken_path("codex").await;
    eprintln!("codex: resume at a taken path took {elapsed:?}");
    assert_eq!(report(&result).native_session_id, parent_native);
    assert!(
        bodies
            .iter()
            .any(|b| b.contains("Create the file first.txt")
                && b.contains("Create the file second.txt")),
        "codex: the resumed conversation carries the first prompt"
    );
    assert!(
        !result.warnings.iter().any(|w| w.contains("native resume")),
        "{:?}",
        result.warnings
    );
}

/// A fork's two children at once (ccw-reference §3.6): the first to claim the parent's path
/// continues its opencode session natively; the other gets its own worktree, a fresh session
/// with the parent's result as context, and the warning. Neither waits for the timeout.
#[tokio::test]
async fn opencode_two_forks_at_once_resume_one_natively_and_one_from_context() {
    let write = |file: &str, content: &str| {
        vec![Action::WriteFile {
            path: file.into(),
            content: content.into(),
        }]
    };
    let script = Script::write_file("second.txt", "second.txt", "two")
        .rule("third.txt", write("third.txt", "three"))
        .rule("first.txt", write("first.txt", "one"));
    let (url, server) = ModelServer::start(script).await.expect("model server");
    let mut config = config_for(&[("opencode", &url)]);
    for settings in config.backends.values_mut() {
        settings.timeout_seconds = Some(TAKEN_PATH_TIMEOUT);
    }
    let mut f = fixture(config).await;
    let first = f
        .execute(task("IMPL-1", "opencode", "first.txt"))
        .await
        .expect("first run");
    let parent_native = report(&first).native_session_id;
    let fork = |id: &str, file: &str| {
        let mut spec = task(id, "opencode", file);
        spec["cli_execution"] =
            json!({"id": format!("s-{id}"), "strategy": "fork", "resume_from": "IMPL-1"});
        f.request(spec)
    };
    let (a, b) = (fork("IMPL-2", "second.txt"), fork("IMPL-3", "third.txt"));
    let (mut ca, mut cb) = (f.client.clone(), f.client.clone());
    let started = Instant::now();
    let (ra, rb) = tokio::join!(ca.execute_task(a), cb.execute_task(b));
    let elapsed = started.elapsed();
    eprintln!("opencode: two forks at once took {elapsed:?}");
    assert!(elapsed < TAKEN_PATH_BOUND, "{elapsed:?}");
    let results: Vec<TaskResult> = [ra, rb]
        .into_iter()
        .map(|r| r.expect("fork").into_inner().result.expect("result"))
        .collect();
    let (native, fresh): (Vec<&TaskResult>, Vec<&TaskResult>) = results
        .iter()
        .partition(|r| report(r).native_session_id == parent_native);
    assert_eq!((native.len(), fresh.len()), (1, 1), "{results:?}");
    assert!(
        !native[0]
            .warnings
            .iter()
            .any(|w| w.contains("native resume")),
        "{:?}",
        native[0].warnings
    );
    assert!(
        fresh[0].warnings.iter().any(|w| w
            .starts_with("native resume of IMPL-1 unavailable: its directory ")
            && w.ends_with(" is in use; resumed from its result as context")),
        "{:?}",
        fresh[0].warnings
    );
    for (result, file, content) in [
        (&results[0], "second.txt", "two"),
        (&results[1], "third.txt", "three"),
    ] {
        assert_eq!(
            show(&f.repo, &result.commit, file)
                .map(|t| t.trim_end().to_owned())
                .as_deref(),
            Some(content)
        );
    }
    let bodies: Vec<String> = server.requests().iter().map(|r| r.body_text()).collect();
    assert!(
        bodies
            .iter()
            .any(|b| b.contains("CONTEXT FROM EARLIER SESSIONS (fork)")
                && b.contains("- IMPL-1 (opencode): done: first.txt")),
        "the fresh fork's prompt carries the parent's result"
    );
    f.service.stop().await;
}

/// Analysis mode: the model asks for a write; the file must not appear and the run changes
/// nothing.
async fn read_only_writes_nothing(backend: &str) {
    // One write: claude drops a denied turn from the history it resends, so a longer script
    // would repeat its second step forever against a stateless server.
    let script = Script::write_file("notes/hello.txt", "notes/hello.txt", "x");
    let (url, server) = ModelServer::start(script).await.expect("model server");
    let mut f = fixture(config_for(&[(backend, &url)])).await;
    let mut spec = task("IMPL-R", backend, "notes/hello.txt");
    spec["mode"] = json!("analysis");
    let result = f
        .execute(spec)
        .await
        .unwrap_or_else(|s| panic!("{backend}: {s:?}"));
    assert!(
        result.files_modified.is_empty(),
        "{backend}: {:?}",
        result.files_modified
    );
    assert_eq!(
        result.commit,
        git(&f.repo, &["rev-parse", "main"]).expect("main")
    );
    let offered = server
        .requests()
        .iter()
        .map(|r| r.body_text())
        .collect::<Vec<_>>()
        .join("\n");
    if backend == "opencode" {
        // Not `--agent plan` (its bash still writes): write, edit and bash are not offered.
        assert!(
            !offered.contains("\"name\":\"bash\""),
            "opencode offered bash"
        );
        assert!(
            !offered.contains("\"name\":\"write\""),
            "opencode offered write"
        );
    }
    f.service.stop().await;
}

#[tokio::test]
async fn read_only_mode_is_read_only() {
    for backend in ["opencode", "codex", "claude", "gemini", "qwen", "agent"] {
        read_only_writes_nothing(backend).await;
    }
}

/// Eight tasks of one session at once, through the session path (worktree per task,
/// integration into `troupe/<session>`), six on distinct files and two on the same file that
/// both start from the same base: seven land, one is a retryable MERGE_CONFLICT naming the file.
#[tokio::test]
async fn eight_parallel_tasks_two_conflicting() {
    let work = tempfile::tempdir().expect("tempdir");
    let barrier_dir = work.path().join("barrier");
    std::fs::create_dir_all(&barrier_dir).expect("barrier");
    let barrier = work.path().join("barrier.py");
    std::fs::write(
        &barrier,
        "import os, sys, time\nd, n = sys.argv[1], int(sys.argv[2])\nopen(os.path.join(d, str(os.getpid())), 'w').close()\n\
         end = time.time() + 30\nwhile len(os.listdir(d)) < n and time.time() < end:\n    time.sleep(0.02)\n",
    )
    .expect("barrier script");
    let wait = format!("python3 {} {} 2", barrier.display(), barrier_dir.display());
    let mut script = Script::default();
    for i in 1..=6 {
        script = script.rule(
            &format!("part-{i}.txt"),
            vec![Action::WriteFile {
                path: format!("parts/part-{i}.txt"),
                content: format!("part {i}"),
            }],
        );
    }
    for side in ["left", "right"] {
        script = script.rule(
            &format!("shared-{side}"),
            vec![
                Action::Shell {
                    command: wait.clone(),
                },
                Action::WriteFile {
                    path: "shared.txt".into(),
                    content: side.to_owned(),
                },
            ],
        );
    }
    let (url, _server) = ModelServer::start(script).await.expect("model server");

    let repo = work.path().join("app");
    git_repo(&repo, &[("shared.txt", "base\n")]).expect("repo");
    git(&repo, &["branch", "troupe/s8", "main"]).expect("session branch");
    let data = work.path().join("data");
    std::fs::create_dir_all(&data).expect("data");
    let executor = std::sync::Arc::new(troupe_executor::Executor::with_config(
        data.canonicalize().expect("canonical"),
        config_for(&[("agent", &url)]),
    ));
    let job = |id: &str, title: &str, file: &str| troupe_executor::Job {
        spec: troupe_plan::TaskSpec::from_object(
            json!({"id": id, "title": title, "files": [file], "agent": {"backend": "agent"}})
                .as_object()
                .expect("object"),
            None,
        )
        .expect("valid task"),
        remote: troupe_workspace::Remote::from_path(&repo).expect("remote"),
        repo_name: "app".to_owned(),
        session_id: "s8".to_owned(),
        task_id: None,
        attempt: 1,
        plan_dir: None,
        upstream: Vec::new(),
        target: troupe_executor::Target::Session {
            branch: "troupe/s8".to_owned(),
            base: None,
        },
        lease: None,
        fencing_token: 0,
        context: Vec::new(),
        usage: None,
    };
    let mut jobs: Vec<troupe_executor::Job> = (1..=6)
        .map(|i| {
            job(
                &format!("IMPL-{i}"),
                &format!("write part-{i}.txt"),
                &format!("parts/part-{i}.txt"),
            )
        })
        .collect();
    jobs.push(job("IMPL-7", "shared-left edit", "shared.txt"));
    jobs.push(job("IMPL-8", "shared-right edit", "shared.txt"));
    let cancel = tokio_util::sync::CancellationToken::new();
    let started = Instant::now();
    let results = futures::future::join_all(jobs.into_iter().map(|job| {
        let executor = std::sync::Arc::clone(&executor);
        let cancel = cancel.clone();
        async move { executor.execute(job, &cancel, &|_| {}).await }
    }))
    .await;
    eprintln!("8 tasks in {:?}", started.elapsed());
    let head = git(&repo, &["rev-parse", "troupe/s8"]).expect("head");
    for (i, result) in results[..6].iter().enumerate() {
        let result = result
            .as_ref()
            .unwrap_or_else(|e| panic!("IMPL-{} failed: {:?}", i + 1, e.error));
        git(
            &repo,
            &["merge-base", "--is-ancestor", &result.commit, &head],
        )
        .expect("integrated");
        assert_eq!(
            show(&repo, &head, &format!("parts/part-{}.txt", i + 1)).as_deref(),
            Some(format!("part {}", i + 1).as_str())
        );
    }
    let (landed, failed) = match (&results[6], &results[7]) {
        (Ok(ok), Err(err)) | (Err(err), Ok(ok)) => (ok, err),
        (a, b) => panic!("expected one landing and one conflict: {a:?} / {b:?}"),
    };
    assert_eq!(failed.error.kind(), ErrorKind::MergeConflict);
    assert!(failed.error.retryable);
    assert_eq!(failed.error.details, ["shared.txt"]);
    let winner = show(&repo, &head, "shared.txt").expect("shared.txt");
    assert!(winner == "left" || winner == "right", "{winner}");
    git(
        &repo,
        &["merge-base", "--is-ancestor", &landed.commit, &head],
    )
    .expect("landed");
}

/// `merge_fork` (ccw-reference §3.6): the first parent's session continues natively, the
/// other parent's result comes in as context; both parents' sessions stay untouched.
#[tokio::test]
async fn merge_fork_continues_the_first_parent_and_adds_the_second_as_context() {
    let script = Script::write_file("first.txt", "first.txt", "one")
        .rule(
            "second.txt",
            vec![Action::WriteFile {
                path: "second.txt".into(),
                content: "two".into(),
            }],
        )
        .rule(
            "merged.txt",
            vec![Action::WriteFile {
                path: "merged.txt".into(),
                content: "both".into(),
            }],
        );
    let (url, server) = ModelServer::start(script).await.expect("model server");
    let mut f = fixture(config_for(&[("claude", &url), ("agent", &url)])).await;
    let a = f
        .execute(task("IMPL-A", "claude", "first.txt"))
        .await
        .expect("parent a");
    f.execute(task("IMPL-B", "agent", "second.txt"))
        .await
        .expect("parent b");
    let before = server.requests().len();
    let mut merge = task("IMPL-C", "claude", "merged.txt");
    merge["cli_execution"] =
        json!({"id": "s-IMPL-C", "strategy": "merge_fork", "merge_from": ["IMPL-A", "IMPL-B"]});
    let merged = f.execute(merge).await.expect("merge_fork");
    assert_eq!(
        report(&merged).native_session_id,
        report(&a).native_session_id
    );
    let bodies: Vec<String> = server.requests()[before..]
        .iter()
        .map(|r| r.body_text())
        .collect();
    let first = &bodies[0];
    assert!(
        first.contains("Create the file first.txt"),
        "A's history is native"
    );
    assert!(
        first.contains("CONTEXT FROM EARLIER SESSIONS (merge_fork)")
            && first.contains("IMPL-B (agent): done: second.txt"),
        "B's result is context"
    );
    f.service.stop().await;
}
