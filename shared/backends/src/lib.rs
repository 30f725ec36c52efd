//! Agent backends behind one interface.
//!
//! A [`Backend`] probes whether it can run here and runs one attempt of a task in a worktree:
//! the handoff prompt goes to the child's stdin and to a prompt file, the child runs as an argv
//! vector in its own process group (troupe-process) with wall-clock and idle timeouts, and a
//! failure comes back classified ([`BackendError::kind`], [`BackendError::retryable`]) so the
//! caller can decide between a retry, another backend, or giving up.
//!
//! Backends: `command` (an argv template from the task's `agent.command`), the coding-agent
//! CLIs `codex`, `gemini`, `qwen`, `claude` and `opencode` (each in its own home, JSON-lines
//! parsed into [`AgentEvent`]s, native sessions resumable), and `agent`, troupe's own tool loop
//! against an OpenAI-compatible endpoint. Settings come from [`BackendsConfig`].

mod agent;
pub mod chain;
mod cli;
mod command;
mod config;
mod confine;
pub mod credential;
mod events;
mod placeholder;
mod usage;

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

pub use agent::AgentLoopBackend;
pub use cli::CliBackend;
pub use command::CommandBackend;
pub use config::{AuthMode, BackendConfig, BackendsConfig, ConfigError};
pub use confine::{confine, relative_inside};
pub use credential::Credential;
pub use events::{
    AgentEvent, CliKind, StreamParser, Transcript, classify_message, parse as parse_events,
};
pub use placeholder::{PLACEHOLDERS, substitute};
pub use usage::UsageMeter;

/// The TCP port of a model endpoint URL (explicit, or the scheme's default), which a
/// sandbox restricting connections must allow.
pub fn endpoint_port(endpoint: &str) -> Option<u16> {
    reqwest::Url::parse(endpoint).ok()?.port_or_known_default()
}

/// A boxed future, so [`Backend`] stays object-safe.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Names of every backend, in the order they are listed.
pub const BACKEND_NAMES: &[&str] = &[
    "command", "codex", "gemini", "qwen", "claude", "opencode", "agent",
];

/// What a backend's probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendInfo {
    /// Backend name as used in plans.
    pub name: String,
    /// Whether this backend can run tasks here.
    pub available: bool,
    /// Version the tool reported, when installed.
    pub version: Option<String>,
    /// Why it is unavailable, or what it runs.
    pub detail: String,
    /// Where its credential comes from (`key: $OPENAI_API_KEY (api_key_env)`, `login: <file>`,
    /// `none`, `missing: <how to fix>`); empty for backends that take none.
    pub credential: String,
}

/// One attempt for a backend to run.
#[derive(Debug, Clone, Default)]
pub struct RunSpec {
    /// The worktree the agent edits; the child's working directory.
    pub worktree: PathBuf,
    /// The handoff prompt, written to the child's stdin.
    pub prompt: String,
    /// Where the same prompt was written (outside the worktree).
    pub prompt_file: PathBuf,
    /// Values for `{plan_dir}`, `{task_id}`, `{session_id}`, `{repo}`; `{worktree}` and
    /// `{prompt_file}` come from the fields above.
    pub placeholders: BTreeMap<String, String>,
    /// The `command` backend's argv template (the task's `agent.command`).
    pub command: Vec<String>,
    /// Wall-clock limit.
    pub timeout: Option<Duration>,
    /// Limit on time without any output.
    pub idle_timeout: Option<Duration>,
    /// Extra environment variables for the child (on top of the allow-list).
    pub env: BTreeMap<String, String>,
    /// A private directory for the run: the child's `HOME`, `TMPDIR` and CLI home (CLI backends
    /// need one).
    pub home: Option<PathBuf>,
    /// Analysis mode: the agent may read but not change anything.
    pub read_only: bool,
    /// Continue an earlier run's native session.
    pub resume: Option<ResumeFrom>,
    /// The service's base sandbox; the backend adds the worktree, home and prompt file
    /// ([`RunSpec::child_sandbox`]). Default: off.
    pub sandbox: troupe_process::Sandbox,
    /// Told the run's token usage so far each time the backend learns more of it (a CLI's
    /// usage event, an `agent` turn), so a worker can report it while the run goes on.
    pub usage_sink: Option<UsageSink>,
}

/// Receives a run's token usage so far (cumulative within the run).
#[derive(Clone)]
pub struct UsageSink(std::sync::Arc<dyn Fn(Usage) + Send + Sync>);

impl UsageSink {
    /// A sink calling `f`.
    pub fn new(f: impl Fn(Usage) + Send + Sync + 'static) -> Self {
        Self(std::sync::Arc::new(f))
    }

    /// Reports `usage` so far.
    pub fn report(&self, usage: Usage) {
        (self.0)(usage);
    }
}

impl std::fmt::Debug for UsageSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UsageSink")
    }
}

impl RunSpec {
    /// The sandbox this run's child runs under: the base, plus write access to the worktree
    /// (and its git admin dir) and the run's home, and read access to the prompt file and the
    /// plan's directory (where a `command` agent's script lives).
    pub fn child_sandbox(&self) -> troupe_process::Sandbox {
        let mut sandbox = self.sandbox.clone();
        // Analysis mode: the kernel, not only the prompt, keeps the worktree unchanged.
        sandbox = if self.read_only {
            sandbox.read(&self.worktree).git_worktree(&self.worktree)
        } else {
            sandbox.write(&self.worktree).git_worktree(&self.worktree)
        };
        sandbox = sandbox.read(&self.prompt_file);
        if let Some(home) = &self.home {
            sandbox = sandbox.home(home);
        }
        if let Some(plan_dir) = self.placeholders.get("plan_dir") {
            sandbox = sandbox.read(plan_dir);
        }
        sandbox
    }

    /// The sandbox denial the output of a failed child reports (see
    /// [`troupe_process::Sandbox::denied`]).
    pub fn sandbox_denied(&self, output: &str) -> Option<String> {
        self.child_sandbox().denied(output, Some(&self.worktree))
    }
}

/// The native session a run continues.
#[derive(Debug, Clone, Default)]
pub struct ResumeFrom {
    /// The CLI's own session id.
    pub native_session_id: String,
    /// The earlier run's home, copied into this run's home first (so a fork leaves the parent
    /// as it was).
    pub home: Option<PathBuf>,
    /// The earlier run's working directory (some CLIs key their sessions by it).
    pub cwd: Option<PathBuf>,
}

/// Token counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Completion tokens.
    pub output_tokens: u64,
    /// Prompt tokens served from a cache.
    pub cached_input_tokens: u64,
}

/// What a successful run produced.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// The argv that ran, after substitution.
    pub argv: Vec<String>,
    /// Exit code of the child.
    pub exit_code: i32,
    /// Last lines of stdout.
    pub stdout_tail: String,
    /// Last lines of stderr.
    pub stderr_tail: String,
    /// Wall time.
    pub duration: Duration,
    /// The tool's own session id, when it reports one.
    pub native_session_id: Option<String>,
    /// Token usage, when the tool reports it.
    pub usage: Option<Usage>,
    /// The model the backend was configured to use, when its configuration names one.
    pub model: Option<String>,
    /// The agent's final message.
    pub final_message: String,
    /// Names of the tools the agent called, in order.
    pub tool_calls: Vec<String>,
    /// What the agent did (sessions, tool calls, file changes, end of run).
    pub events: Vec<AgentEvent>,
}

impl RunOutcome {
    /// Actions the CLI's own permission rules refused, in order.
    pub fn permission_denials(&self) -> Vec<String> {
        self.events
            .iter()
            .filter_map(|e| match e {
                AgentEvent::Denied(what) => Some(what.clone()),
                _ => None,
            })
            .collect()
    }

    /// Stdout and stderr tails in one text, for reports.
    pub fn output_tail(&self) -> String {
        match (self.stdout_tail.is_empty(), self.stderr_tail.is_empty()) {
            (_, true) => self.stdout_tail.clone(),
            (true, false) => self.stderr_tail.clone(),
            (false, false) => format!("{}\n--- stderr ---\n{}", self.stdout_tail, self.stderr_tail),
        }
    }
}

/// The classified cause of a failed run; mirrors `troupe.v1.ErrorKind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The backend's program is not installed.
    NotInstalled,
    /// Credentials were refused.
    Auth,
    /// Asked to slow down.
    RateLimited,
    /// Quota used up.
    Quota,
    /// Wall-clock or idle time ran out.
    Timeout,
    /// Crashed or exited non-zero.
    Crash,
    /// Output could not be understood.
    BadOutput,
    /// Malformed task or an unsupported request.
    InvalidTask,
    /// Anything else inside troupe.
    Internal,
    /// Stopped by a cancel (not a failure of the backend).
    Cancelled,
    /// The child's sandbox denied it a path or port.
    SandboxDenied,
    /// The CLI's own permission rules refused every action the agent tried.
    PermissionDenied,
}

/// Why a run failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BackendError {
    /// The program is not installed.
    #[error("backend `{backend}` is not installed: program `{program}` not found")]
    NotInstalled {
        /// Backend name.
        backend: String,
        /// The program that was looked for.
        program: String,
    },
    /// The backend refused our credentials.
    #[error("backend `{backend}` rejected its credentials: {message}")]
    Auth {
        /// Backend name.
        backend: String,
        /// What the tool said.
        message: String,
    },
    /// The backend asked us to slow down.
    #[error("backend `{backend}` is rate limited: {message}")]
    RateLimited {
        /// Backend name.
        backend: String,
        /// What the tool said.
        message: String,
        /// How long the provider asked to wait (`retry-after`, or the tool's own text).
        retry_after: Option<Duration>,
    },
    /// The backend's quota is used up.
    #[error("backend `{backend}` is out of quota: {message}")]
    Quota {
        /// Backend name.
        backend: String,
        /// What the tool said.
        message: String,
        /// When the quota resets, as a wait (`retry-after`, or the tool's own text).
        retry_after: Option<Duration>,
    },
    /// The run hit its wall-clock or idle limit and was killed.
    #[error("backend `{backend}` {} after {}s", if *.idle { "produced no output" } else { "timed out" }, limit.as_secs())]
    Timeout {
        /// Backend name.
        backend: String,
        /// The limit that fired.
        limit: Duration,
        /// True for the idle limit.
        idle: bool,
        /// What it printed last.
        output_tail: String,
    },
    /// The child exited non-zero or was killed by a signal.
    #[error("backend `{backend}` {}{}", crash_text(*.exit_code, *.signal), if .reason.is_empty() { String::new() } else { format!(": {}", .reason) })]
    Crash {
        /// Backend name.
        backend: String,
        /// What the tool said went wrong (server error, connection refused), when it said.
        reason: String,
        /// Exit code, when it exited.
        exit_code: Option<i32>,
        /// Signal, when it was killed.
        signal: Option<i32>,
        /// Last lines of stderr (or of stdout when stderr was empty).
        stderr_tail: String,
    },
    /// The output could not be understood.
    #[error("backend `{backend}` produced output troupe cannot use: {message}")]
    BadOutput {
        /// Backend name.
        backend: String,
        /// What was wrong.
        message: String,
    },
    /// The run was cancelled.
    #[error("run cancelled")]
    Cancelled,
    /// The sandbox denied the child a path or port (or could not confine it).
    #[error("backend `{backend}` was denied by its sandbox: {denied}")]
    SandboxDenied {
        /// Backend name.
        backend: String,
        /// The path (`/srv/x`, `link -> /srv/x`) or `tcp port N` denied, or why the child
        /// could not be confined.
        denied: String,
        /// The child's last output.
        output_tail: String,
    },
    /// The agent tried to act and the CLI's own permission rules refused every action, so it
    /// did nothing of what it was asked (exit 0 notwithstanding).
    #[error("backend `{backend}` was refused every action it tried by its permission mode: {}", .denials.join("; "))]
    PermissionDenied {
        /// Backend name.
        backend: String,
        /// What was refused (`Bash: pytest -q`).
        denials: Vec<String>,
    },
    /// The task asks for something this backend cannot do (bad template, not implemented).
    #[error("{message}")]
    InvalidTask {
        /// What is wrong.
        message: String,
    },
    /// A failure inside troupe (cannot start the child, i/o).
    #[error("{message}")]
    Internal {
        /// What failed.
        message: String,
    },
}

fn crash_text(exit_code: Option<i32>, signal: Option<i32>) -> String {
    match (exit_code, signal) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(signal)) => format!("was killed by signal {signal}"),
        (None, None) => "failed".to_owned(),
    }
}

impl BackendError {
    /// The classified cause.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::NotInstalled { .. } => ErrorKind::NotInstalled,
            Self::Auth { .. } => ErrorKind::Auth,
            Self::RateLimited { .. } => ErrorKind::RateLimited,
            Self::Quota { .. } => ErrorKind::Quota,
            Self::Timeout { .. } => ErrorKind::Timeout,
            Self::Crash { .. } => ErrorKind::Crash,
            Self::BadOutput { .. } => ErrorKind::BadOutput,
            Self::Cancelled => ErrorKind::Cancelled,
            Self::SandboxDenied { .. } => ErrorKind::SandboxDenied,
            Self::PermissionDenied { .. } => ErrorKind::PermissionDenied,
            Self::InvalidTask { .. } => ErrorKind::InvalidTask,
            Self::Internal { .. } => ErrorKind::Internal,
        }
    }

    /// Whether another attempt with the same backend may succeed. Not installed, auth, quota
    /// and invalid tasks will not fix themselves (another backend might).
    pub fn retryable(&self) -> bool {
        match self.kind() {
            ErrorKind::RateLimited
            | ErrorKind::Timeout
            | ErrorKind::Crash
            | ErrorKind::BadOutput
            | ErrorKind::Internal => true,
            ErrorKind::NotInstalled
            | ErrorKind::Auth
            | ErrorKind::Quota
            | ErrorKind::InvalidTask
            | ErrorKind::Cancelled
            | ErrorKind::SandboxDenied
            | ErrorKind::PermissionDenied => false,
        }
    }

    /// A rate limit or used-up quota that names when to try again: what the coordinator
    /// pauses the provider for (see docs/quotas.md). `None` for every other error, and for
    /// a quota error that names no reset time (billing: it will not fix itself).
    pub fn rate_limit(&self) -> Option<(&str, Option<Duration>)> {
        match self {
            Self::RateLimited {
                backend,
                retry_after,
                ..
            } => Some((backend, *retry_after)),
            Self::Quota {
                backend,
                retry_after: Some(after),
                ..
            } => Some((backend, Some(*after))),
            _ => None,
        }
    }

    /// Evidence for the error's `details`: output tails.
    pub fn details(&self) -> Vec<String> {
        match self {
            Self::Timeout {
                output_tail: tail, ..
            }
            | Self::Crash {
                stderr_tail: tail, ..
            }
            | Self::SandboxDenied {
                output_tail: tail, ..
            } if !tail.is_empty() => {
                vec![tail.clone()]
            }
            _ => Vec::new(),
        }
    }
}

/// An agent backend. Object-safe: keep them as `Arc<dyn Backend>`.
pub trait Backend: Send + Sync + fmt::Debug {
    /// Name used in plans.
    fn name(&self) -> &'static str;

    /// Whether this backend can run here, and which version of its tool is installed.
    fn probe(&self) -> BoxFuture<'_, BackendInfo>;

    /// Runs one attempt in `spec.worktree`. The caller commits whatever the agent changed.
    fn run<'a>(
        &'a self,
        spec: RunSpec,
        cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, Result<RunOutcome, BackendError>>;
}

/// Every backend troupe knows, in [`BACKEND_NAMES`] order, with default settings.
pub fn all() -> Vec<Arc<dyn Backend>> {
    all_with(&BackendsConfig::default())
}

/// Every backend, configured by `config`.
pub fn all_with(config: &BackendsConfig) -> Vec<Arc<dyn Backend>> {
    BACKEND_NAMES
        .iter()
        .filter_map(|name| by_name_with(name, config))
        .collect()
}

/// The backend called `name` with default settings, if troupe knows it.
pub fn by_name(name: &str) -> Option<Arc<dyn Backend>> {
    by_name_with(name, &BackendsConfig::default())
}

/// The backend called `name`, configured by `config`.
pub fn by_name_with(name: &str, config: &BackendsConfig) -> Option<Arc<dyn Backend>> {
    let settings = config.backend(name);
    if let Some(kind) = CliKind::from_name(name) {
        return Some(Arc::new(CliBackend::new(kind, settings.clone())));
    }
    let backend: Arc<dyn Backend> = match name {
        "command" => Arc::new(CommandBackend),
        "agent" => Arc::new(AgentLoopBackend::new(settings.clone())),
        _ => return None,
    };
    Some(backend)
}

/// Probes every backend concurrently, with default settings.
pub async fn probe_all() -> Vec<BackendInfo> {
    probe_all_with(&BackendsConfig::default()).await
}

/// Probes every backend concurrently, configured by `config`.
pub async fn probe_all_with(config: &BackendsConfig) -> Vec<BackendInfo> {
    let backends = all_with(config);
    futures::future::join_all(backends.iter().map(|backend| backend.probe())).await
}

/// Makes one tiny live call with `backend` (a one-word prompt, read-only, in a scratch
/// directory): `Ok("ok in 1.2s: OK")`, or the classified failure.
pub async fn probe_live(backend: &dyn Backend) -> Result<String, String> {
    let scratch = tempfile::tempdir().map_err(|err| format!("no scratch directory: {err}"))?;
    let worktree = scratch.path().join("work");
    let prompt_file = scratch.path().join("prompt.md");
    let prompt = "Reply with the single word OK. Do not use any tool.\n".to_owned();
    std::fs::create_dir_all(&worktree)
        .and_then(|()| std::fs::write(&prompt_file, &prompt))
        .map_err(|err| format!("no scratch directory: {err}"))?;
    let started = std::time::Instant::now();
    let spec = RunSpec {
        worktree,
        prompt,
        prompt_file,
        timeout: Some(Duration::from_secs(120)),
        home: Some(scratch.path().join("home")),
        read_only: true,
        ..RunSpec::default()
    };
    match backend.run(spec, &CancellationToken::new()).await {
        Ok(outcome) => Ok(format!(
            "ok in {:.1}s: {}",
            started.elapsed().as_secs_f64(),
            outcome
                .final_message
                .chars()
                .take(60)
                .collect::<String>()
                .trim()
        )),
        Err(err) => Err(err.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_resolves_and_errors_classify() {
        for name in BACKEND_NAMES {
            assert_eq!(by_name(name).map(|b| b.name()), Some(*name));
        }
        assert!(by_name("nope").is_none());

        let crash = BackendError::Crash {
            backend: "command".into(),
            reason: String::new(),
            exit_code: Some(2),
            signal: None,
            stderr_tail: "boom".into(),
        };
        assert_eq!(crash.kind(), ErrorKind::Crash);
        assert!(crash.retryable());
        assert_eq!(crash.to_string(), "backend `command` exited with code 2");
        assert_eq!(crash.details(), ["boom"]);
        let missing = BackendError::NotInstalled {
            backend: "codex".into(),
            program: "codex".into(),
        };
        assert!(!missing.retryable());
    }

    #[tokio::test]
    async fn probe_all_lists_every_backend_in_order() {
        let infos = probe_all().await;
        let names: Vec<&str> = infos.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, BACKEND_NAMES);
        assert!(infos[0].available, "command is always available");
        // A CLI is available exactly when its program is on PATH and it has a credential
        // (here: a login of the user running the tests, if any).
        for info in &infos[1..6] {
            let installed = troupe_process::which(&info.name).is_some();
            assert_eq!(installed, info.version.is_some(), "{info:?}");
            assert_eq!(
                info.available,
                installed && !info.credential.starts_with("missing: "),
                "{info:?}"
            );
        }
        // The agent loop needs an endpoint and a model.
        assert!(!infos[6].available);
    }
}
