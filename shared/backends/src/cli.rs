//! The coding-agent CLIs: `codex`, `claude`, `gemini`, `qwen`, `opencode`
//! (docs/agent-clis.md says what each flag here lets the CLI do).
//!
//! Each run gets its own `HOME`, `TMPDIR` and CLI home under [`RunSpec::home`], with the CLI's
//! config files written there (endpoint, model, retries off when `fast_fail`), the prompt on
//! stdin, and the JSON-lines output parsed into [`AgentEvent`]s. Resume and fork continue the
//! CLI's own session: the parent run's home is copied in first (the parent's copy stays as it
//! was, so a fork never disturbs it) and the CLI's resume flag names the native session id.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::info;
use troupe_process::{Command, Termination};

use crate::credential::{self, Credential};
use crate::events::CliKind;
use crate::events::{self, AgentEvent};
use crate::{
    Backend, BackendConfig, BackendError, BackendInfo, BoxFuture, ErrorKind, RunOutcome, RunSpec,
};

/// Longer than CCW's 5 s probe: `gemini --version` alone takes about 5 s on a 2-core machine
/// (node start plus its self-relaunch).
const PROBE_TIMEOUT: Duration = Duration::from_secs(20);
const TAIL_LINES: usize = 40;
const TAIL_CHARS: usize = 4000;
/// The variable our children read their API key from (codex `env_key`, opencode `{env:..}`).
const KEY_VAR: &str = "TROUPE_MODEL_API_KEY";
/// The key handed to CLIs that refuse to start without one when `auth = "none"`.
const NO_KEY: &str = "none";
/// How long a CLI that retries on its own may go on after its first failed model call when
/// `fast_fail` is set, before troupe stops it (qwen's inner backoff, opencode's retries).
const FIRST_ERROR_GRACE: Duration = Duration::from_secs(2);

/// A coding-agent CLI.
#[derive(Debug, Clone)]
pub struct CliBackend {
    kind: CliKind,
    config: BackendConfig,
}

impl CliBackend {
    /// The CLI `kind` with its settings.
    pub fn new(kind: CliKind, config: BackendConfig) -> Self {
        Self { kind, config }
    }

    fn program(&self) -> String {
        self.config
            .command
            .clone()
            .unwrap_or_else(|| self.kind.name().to_owned())
    }

    fn model(&self) -> Option<String> {
        self.config.model.clone()
    }
}

impl Backend for CliBackend {
    fn name(&self) -> &'static str {
        self.kind.name()
    }

    fn probe(&self) -> BoxFuture<'_, BackendInfo> {
        Box::pin(async move {
            let program = self.program();
            let (version, installed) = probe_version(&program).await;
            let credential = credential::resolve(self.kind, &self.config);
            let (available, detail) = match (installed, &credential) {
                (Err(reason), _) => (false, reason),
                // Installed but unusable: a task would fail at once as AUTH.
                (Ok(()), Credential::Missing { .. }) => (
                    false,
                    format!("`{program}` is installed but has no credential (see credential)"),
                ),
                (Ok(()), _) => (
                    true,
                    match &self.config.endpoint {
                        Some(endpoint) => format!("`{program}` against {endpoint}"),
                        None => format!("`{program}` with its default endpoint"),
                    },
                ),
            };
            BackendInfo {
                name: self.kind.name().to_owned(),
                available,
                version,
                detail,
                credential: credential.describe(),
            }
        })
    }

    fn run<'a>(
        &'a self,
        spec: RunSpec,
        cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, Result<RunOutcome, BackendError>> {
        Box::pin(self.run_cli(spec, cancel))
    }
}

/// Runs `<program> --version` in a throw-away home (bare `--version` runs create `~/.codex` and
/// friends); returns the version line and whether the program is installed.
pub(crate) async fn probe_version(program: &str) -> (Option<String>, Result<(), String>) {
    if troupe_process::which(program).is_none() {
        return (None, Err(format!("`{program}` not found on PATH")));
    }
    let home = match tempfile::tempdir() {
        Ok(dir) => dir,
        Err(err) => return (None, Err(format!("cannot make a probe home: {err}"))),
    };
    let cmd = Command::new(program)
        .arg("--version")
        .env("HOME", home.path().display().to_string())
        .env("TMPDIR", home.path().display().to_string())
        .env("CODEX_HOME", home.path().display().to_string())
        .timeout(PROBE_TIMEOUT)
        .max_output_bytes(64 * 1024);
    match cmd.run(&CancellationToken::new()).await {
        Ok(output) if output.success() => {
            let text = output.stdout_text();
            let text = if text.trim().is_empty() {
                output.stderr_text()
            } else {
                text
            };
            let version = text
                .lines()
                .map(str::trim)
                .find(|l| !l.is_empty() && !l.starts_with("WARNING"))
                .map(str::to_owned);
            (version, Ok(()))
        }
        Ok(output) => (
            None,
            Err(format!(
                "`{program} --version` failed ({:?}, exit {:?}): {}",
                output.termination,
                output.exit_code,
                troupe_process::tail(&output.stderr_text(), 3, 300)
            )),
        ),
        Err(err) => (
            None,
            Err(format!("`{program} --version` could not run: {err}")),
        ),
    }
}

fn internal(what: &str, path: &Path, err: &std::io::Error) -> BackendError {
    BackendError::Internal {
        message: format!("{what} {}: {err}", path.display()),
    }
}

async fn write(path: PathBuf, text: String) -> Result<(), BackendError> {
    if let Some(parent) = path.parent() {
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(|err| internal("creating", parent, &err))?;
    }
    tokio::fs::write(&path, text)
        .await
        .map_err(|err| internal("writing", &path, &err))
}

/// Copies a directory tree (the parent run's CLI home) into `to`.
pub(crate) fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let target = to.join(entry.file_name());
        if kind.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else if kind.is_file() {
            std::fs::copy(entry.path(), &target)?;
        } else if kind.is_symlink() {
            let link = std::fs::read_link(entry.path())?;
            let _ = std::fs::remove_file(&target);
            std::os::unix::fs::symlink(link, &target)?;
        }
    }
    Ok(())
}

/// Claude keeps sessions under `projects/<cwd with every non-alphanumeric as '-'>`; a resumed
/// run works in a new worktree, so the parent's project folder is linked under the new name.
fn claude_project_key(cwd: &Path) -> String {
    cwd.display()
        .to_string()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect()
}

/// Makes a copied CLI home find the parent's session from the new worktree: claude keys its
/// session store by the working directory, and codex's state databases hold the parent's paths.
fn relocate(kind: CliKind, home: &Path, old_cwd: &Path, new_cwd: &Path) -> std::io::Result<()> {
    let link = |dir: PathBuf| -> std::io::Result<()> {
        let old = dir.join(claude_project_key(old_cwd));
        let new = dir.join(claude_project_key(new_cwd));
        if old.is_dir() && !new.exists() {
            std::os::unix::fs::symlink(&old, &new)?;
        }
        Ok(())
    };
    match kind {
        CliKind::Claude => link(home.join(".claude/projects")),
        CliKind::Codex => {
            // Codex's state databases hold absolute paths into the parent's home; without
            // them it finds the thread by its rollout file in the copied `sessions/`.
            for entry in std::fs::read_dir(home.join(".codex"))? {
                let entry = entry?;
                if entry.file_name().to_string_lossy().contains(".sqlite") {
                    std::fs::remove_file(entry.path())?;
                }
            }
            Ok(())
        }
        // Sessions bound to their directory (`CliKind::session_bound_to_directory`) are only
        // resumed there: nothing to move.
        CliKind::Gemini | CliKind::Qwen | CliKind::Opencode => Ok(()),
    }
}

impl CliBackend {
    /// argv (after the program) and environment for one run.
    async fn prepare(
        &self,
        spec: &RunSpec,
        home: &Path,
        credential: &Credential,
    ) -> Result<(Vec<String>, Vec<(String, String)>), BackendError> {
        let mut env: Vec<(String, String)> = vec![
            ("HOME".to_owned(), home.display().to_string()),
            ("TMPDIR".to_owned(), home.join("tmp").display().to_string()),
            (
                "XDG_CONFIG_HOME".to_owned(),
                home.join(".config").display().to_string(),
            ),
            (
                "XDG_DATA_HOME".to_owned(),
                home.join(".local/share").display().to_string(),
            ),
            (
                "XDG_CACHE_HOME".to_owned(),
                home.join(".cache").display().to_string(),
            ),
            (
                "XDG_STATE_HOME".to_owned(),
                home.join(".local/state").display().to_string(),
            ),
            ("NO_COLOR".to_owned(), "1".to_owned()),
        ];
        let login = credential.is_login();
        // The key troupe hands over: the configured one, or a stand-in for `auth = "none"`
        // (claude, gemini and qwen refuse to start without any).
        let key = match credential {
            Credential::Key { key, .. } => key.clone(),
            Credential::None => Some(NO_KEY.to_owned()),
            Credential::Login { .. } | Credential::Missing { .. } => None,
        };
        if let Some(key) = &key {
            env.push((KEY_VAR.to_owned(), key.clone()));
        }
        let endpoint = self.config.endpoint.clone();
        let model = self.model();
        let resume = spec.resume.as_ref().map(|r| r.native_session_id.clone());
        let fast = self.config.fast_fail;
        let mut args: Vec<String> = Vec::new();
        match self.kind {
            CliKind::Codex => {
                let codex_home = home.join(".codex");
                let mut toml = String::new();
                if let Some(model) = &model {
                    toml.push_str(&format!("model = {}\n", json!(model)));
                }
                // Codex's own sandbox (bubblewrap) mounts, which Landlock refuses to a confined
                // process: under troupe's sandbox, which already limits it to the worktree
                // (read-only in analysis mode), codex runs without its own.
                let codex_sandbox = if spec.sandbox.mode() != troupe_process::SandboxMode::Off {
                    "danger-full-access"
                } else if spec.read_only {
                    "read-only"
                } else {
                    "workspace-write"
                };
                toml.push_str(&format!(
                    "sandbox_mode = \"{codex_sandbox}\"\napproval_policy = \"never\"\n"
                ));
                if let Some(endpoint) = &endpoint {
                    toml.push_str("model_provider = \"troupe\"\n\n[model_providers.troupe]\nname = \"troupe\"\n");
                    toml.push_str(&format!(
                        "base_url = {}\nwire_api = \"responses\"\n",
                        json!(endpoint)
                    ));
                    if login {
                        // The signed-in user's token (auth.json) as the bearer.
                        toml.push_str("requires_openai_auth = true\n");
                    } else if matches!(credential, Credential::Key { key: Some(_), .. }) {
                        toml.push_str(&format!("env_key = \"{KEY_VAR}\"\n"));
                    }
                    if fast {
                        toml.push_str("request_max_retries = 0\nstream_max_retries = 0\n");
                    }
                }
                write(codex_home.join("config.toml"), toml).await?;
                env.push(("CODEX_HOME".to_owned(), codex_home.display().to_string()));
                if endpoint.is_none()
                    && let Credential::Key { key: Some(key), .. } = credential
                {
                    // The built-in OpenAI provider takes an API key from here.
                    env.push(("CODEX_API_KEY".to_owned(), key.clone()));
                }
                args.push("exec".to_owned());
                if let Some(id) = &resume {
                    args.extend(["resume".to_owned(), id.clone()]);
                } else {
                    args.extend(["-s".to_owned(), codex_sandbox.to_owned()]);
                }
                args.extend([
                    "--json".to_owned(),
                    "--skip-git-repo-check".to_owned(),
                    // Codex otherwise retries a refused connection forever.
                    "--disable".to_owned(),
                    "unbounded_connection_retries".to_owned(),
                ]);
                if let Some(model) = &model {
                    args.extend(["-m".to_owned(), model.clone()]);
                }
                args.push("-".to_owned());
            }
            CliKind::Claude => {
                let dir = home.join(".claude");
                tokio::fs::create_dir_all(&dir)
                    .await
                    .map_err(|err| internal("creating", &dir, &err))?;
                env.extend(
                    [
                        ("CLAUDE_CONFIG_DIR", dir.display().to_string()),
                        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1".to_owned()),
                        ("DISABLE_AUTOUPDATER", "1".to_owned()),
                        ("DISABLE_TELEMETRY", "1".to_owned()),
                    ]
                    .map(|(k, v)| (k.to_owned(), v)),
                );
                if let Some(endpoint) = &endpoint {
                    env.push(("ANTHROPIC_BASE_URL".to_owned(), endpoint.clone()));
                }
                if let Some(key) = &key {
                    env.push(("ANTHROPIC_API_KEY".to_owned(), key.clone()));
                }
                if fast {
                    env.push(("CLAUDE_CODE_MAX_RETRIES".to_owned(), "0".to_owned()));
                }
                args.extend(
                    [
                        "-p",
                        "--output-format",
                        "stream-json",
                        "--verbose",
                        "--permission-mode",
                        // `default` denies every write and shell call headless (exit 0);
                        // `plan` could end the run early asking to leave plan mode.
                        if spec.read_only {
                            "default"
                        } else {
                            "acceptEdits"
                        },
                    ]
                    .map(str::to_owned),
                );
                if !spec.read_only {
                    // acceptEdits alone approves edits and a few filesystem commands: the
                    // task's tests (`pytest`, `npm test`) would be denied. Bash is allowed and
                    // troupe's sandbox, not claude's prompts, confines it to the worktree.
                    args.extend(["--allowedTools".to_owned(), "Bash".to_owned()]);
                }
                if let Some(model) = &model {
                    args.extend(["--model".to_owned(), model.clone()]);
                }
                if let Some(id) = &resume {
                    args.extend(["--resume".to_owned(), id.clone()]);
                }
            }
            CliKind::Gemini => {
                let dir = home.join("gemini");
                let mut general = json!({"disableAutoUpdate": true});
                if fast {
                    general["maxAttempts"] = json!(1);
                }
                // A Google sign-in speaks Code Assist (its own endpoint), a key the Gemini API.
                let auth_type = if login {
                    "oauth-personal"
                } else {
                    "gemini-api-key"
                };
                let settings = json!({
                    "security": {"auth": {"selectedType": auth_type}},
                    "privacy": {"usageStatisticsEnabled": false},
                    "general": general,
                    "telemetry": {"enabled": false},
                });
                write(dir.join(".gemini/settings.json"), settings.to_string()).await?;
                env.push(("GEMINI_CLI_HOME".to_owned(), dir.display().to_string()));
                env.push(("GEMINI_CLI_TRUST_WORKSPACE".to_owned(), "true".to_owned()));
                if let Some(endpoint) = &endpoint {
                    let var = if login {
                        "CODE_ASSIST_ENDPOINT"
                    } else {
                        "GOOGLE_GEMINI_BASE_URL"
                    };
                    env.push((var.to_owned(), endpoint.clone()));
                }
                if let Some(key) = &key {
                    env.push(("GEMINI_API_KEY".to_owned(), key.clone()));
                }
                args.extend(["-o", "stream-json", "--approval-mode"].map(str::to_owned));
                args.push(if spec.read_only { "default" } else { "yolo" }.to_owned());
                if let Some(model) = &model {
                    args.extend(["-m".to_owned(), model.clone()]);
                }
                if let Some(id) = &resume {
                    args.extend(["--resume".to_owned(), id.clone()]);
                }
            }
            CliKind::Qwen => {
                let dir = home.join(".qwen");
                let mut settings = json!({"memory": {"enableManagedAutoMemory": false}});
                if fast {
                    // Covers the SDK's and the rate-limit retries. Its inner backoff on 5xx and
                    // network errors (7 attempts, ~70 s) has no setting or env var in 0.24.4.
                    settings["model"] = json!({"generationConfig": {"maxRetries": 0}});
                }
                write(dir.join("settings.json"), settings.to_string()).await?;
                env.push(("QWEN_HOME".to_owned(), dir.display().to_string()));
                env.push(("QWEN_CODE_SUPPRESS_YOLO_WARNING".to_owned(), "1".to_owned()));
                if let Some(endpoint) = &endpoint {
                    env.push(("OPENAI_BASE_URL".to_owned(), endpoint.clone()));
                }
                if let Some(key) = &key {
                    env.push(("OPENAI_API_KEY".to_owned(), key.clone()));
                }
                if let Some(model) = &model {
                    env.push(("OPENAI_MODEL".to_owned(), model.clone()));
                }
                args.extend(
                    [
                        "-o",
                        "stream-json",
                        "--auth-type",
                        if login { "qwen-oauth" } else { "openai" },
                        "--approval-mode",
                    ]
                    .map(str::to_owned),
                );
                args.push(if spec.read_only { "plan" } else { "yolo" }.to_owned());
                if fast {
                    // Its retry log (`$QWEN_HOME/debug/<session>.txt`) is what troupe watches
                    // for the first failed call; stdout stays JSON lines.
                    args.push("--debug".to_owned());
                }
                if let Some(model) = &model {
                    args.extend(["-m".to_owned(), model.clone()]);
                }
                if let Some(id) = &resume {
                    args.extend(["--resume".to_owned(), id.clone()]);
                }
            }
            CliKind::Opencode => {
                // opencode 1.18.33 retries retryable errors 5 times (2 s doubling, ~70–90 s)
                // with no config key or env var to change that: under fast_fail troupe stops it
                // at the first `stream error` its log file records.
                let model_name = model.clone().unwrap_or_else(|| "default".to_owned());
                let mut config = json!({
                    "$schema": "https://opencode.ai/config.json",
                    "autoupdate": false,
                    "share": "disabled",
                });
                if let Some(endpoint) = &endpoint {
                    config["model"] = json!(format!("troupe/{model_name}"));
                    config["small_model"] = json!(format!("troupe/{model_name}"));
                    config["provider"] = json!({"troupe": {
                        "npm": "@ai-sdk/openai-compatible",
                        "name": "troupe",
                        // Signed in (`opencode auth login`), its auth.json holds the key of
                        // provider `troupe`; otherwise the key comes from our variable.
                        "options": if login {
                            json!({"baseURL": endpoint})
                        } else {
                            json!({"baseURL": endpoint, "apiKey": format!("{{env:{KEY_VAR}}}")})
                        },
                        "models": {model_name.clone(): {"name": model_name, "tool_call": true,
                            "limit": {"context": 100_000, "output": 8000}}},
                    }});
                } else if let Some(model) = &model {
                    config["model"] = json!(model);
                }
                let path = home.join("opencode.json");
                write(path.clone(), config.to_string()).await?;
                env.extend(
                    [
                        ("OPENCODE_CONFIG", path.display().to_string()),
                        ("OPENCODE_DISABLE_MODELS_FETCH", "1".to_owned()),
                        ("OPENCODE_DISABLE_AUTOUPDATE", "1".to_owned()),
                    ]
                    .map(|(k, v)| (k.to_owned(), v)),
                );
                if spec.read_only {
                    // `--agent plan` still lets bash write files; denying the permissions
                    // removes write, edit and bash from the tool list.
                    env.push((
                        "OPENCODE_PERMISSION".to_owned(),
                        json!({"edit": "deny", "bash": "deny", "webfetch": "deny"}).to_string(),
                    ));
                }
                args.extend(["run", "--format", "json"].map(str::to_owned));
                if let Some(id) = &resume {
                    args.extend(["--session".to_owned(), id.clone()]);
                }
            }
        }
        Ok((args, env))
    }

    #[tracing::instrument(name = "troupe.backend.run", skip_all, fields(backend = self.kind.name(), worktree = %spec.worktree.display()))]
    async fn run_cli(
        &self,
        spec: RunSpec,
        cancel: &CancellationToken,
    ) -> Result<RunOutcome, BackendError> {
        let name = self.kind.name();
        let program = self.program();
        if troupe_process::which(&program).is_none() {
            return Err(BackendError::NotInstalled {
                backend: name.to_owned(),
                program,
            });
        }
        let credential = credential::resolve(self.kind, &self.config);
        if let Credential::Missing { reason } = &credential {
            // Fail before starting anything: the CLI would only say "not logged in".
            return Err(BackendError::Auth {
                backend: name.to_owned(),
                message: reason.clone(),
            });
        }
        let home = spec.home.clone().ok_or_else(|| BackendError::Internal {
            message: format!("backend `{name}` needs a home directory for its run"),
        })?;
        tokio::fs::create_dir_all(home.join("tmp"))
            .await
            .map_err(|err| internal("creating", &home, &err))?;
        if let Some(resume) = &spec.resume
            && let Some(from) = &resume.home
        {
            let (from, to) = (from.clone(), home.clone());
            tokio::task::spawn_blocking(move || copy_tree(&from, &to))
                .await
                .map_err(|err| BackendError::Internal {
                    message: format!("copying the parent session: {err}"),
                })?
                .map_err(|err| internal("copying the parent session into", &home, &err))?;
            if let Some(parent_cwd) = &resume.cwd {
                relocate(self.kind, &home, parent_cwd, &spec.worktree).map_err(|err| {
                    internal("moving the parent session to", &spec.worktree, &err)
                })?;
            }
        }
        // After the parent's home: the login in force now, not the parent's copy.
        let copied = match &credential {
            Credential::Login { files } => {
                let (files, to) = (files.clone(), home.clone());
                tokio::task::spawn_blocking(move || credential::install(&files, &to))
                    .await
                    .map_err(|err| BackendError::Internal {
                        message: format!("copying the login: {err}"),
                    })?
                    .map_err(|err| BackendError::Auth {
                        backend: name.to_owned(),
                        message: format!("cannot read its login: {err}"),
                    })?
            }
            _ => Vec::new(),
        };
        let (args, env) = self.prepare(&spec, &home, &credential).await?;
        // The caller's variables first: the endpoint, key and homes set from our own
        // configuration always win over them.
        let mut sandbox = spec.child_sandbox().write(&home);
        if let Some(port) = self
            .config
            .endpoint
            .as_deref()
            .and_then(crate::endpoint_port)
        {
            sandbox = sandbox.allow_port(port);
        }
        let mut cmd = Command::new(&program)
            .args(args)
            .sandbox(sandbox)
            .cwd(&spec.worktree)
            .stdin(spec.prompt.clone().into_bytes())
            .envs(spec.env.clone())
            .envs(env)
            .envs(self.config.env.clone())
            .max_output_bytes(8 * 1024 * 1024)
            .kill_grace(Duration::from_millis(500));
        for var in &self.config.env_allow {
            cmd = cmd.env_passthrough(var.clone());
        }
        if let Some(limit) = spec.timeout.or(self.config.timeout()) {
            cmd = cmd.timeout(limit);
        }
        let idle = spec.idle_timeout.or(self.config.idle_timeout());
        if let Some(limit) = idle {
            cmd = cmd.idle_timeout(limit);
        }
        if let Some(sink) = spec.usage_sink.clone() {
            // The same events the run's transcript is made of, parsed as they come, for the
            // usage so far.
            let parser = std::sync::Mutex::new(events::StreamParser::new(self.kind));
            cmd = cmd.on_stdout_line(troupe_process::LineObserver::new(move |line| {
                let usage = parser.lock().ok().and_then(|mut parser| parser.line(line));
                if let Some(usage) = usage {
                    sink.report(usage);
                }
            }));
        }
        let argv = cmd.argv();
        // fast_fail for CLIs that retry with no switch to stop them: stop at their first
        // failed model call, as their own log records it.
        let stop = cancel.child_token();
        let watched = self.first_error_log(&home);
        if let Some((dir, _)) = &watched {
            // A resumed run's home holds the parent's logs: only this run's count.
            let _ = tokio::fs::remove_dir_all(dir).await;
        }
        let watcher =
            watched.map(|(dir, needle)| tokio::spawn(watch_first_error(dir, needle, stop.clone())));
        let output = cmd.run(&stop).await;
        let first_error = match watcher {
            Some(task) => {
                task.abort();
                task.await.ok().flatten()
            }
            None => None,
        };
        // Written back whatever happened: a refresh before a failure is still a refresh.
        if !copied.is_empty() {
            let problems = tokio::task::spawn_blocking(move || credential::write_back(copied))
                .await
                .unwrap_or_default();
            for problem in problems {
                tracing::warn!(backend = name, %problem, "login not written back");
            }
        }
        let output = output.map_err(|err| match err {
            troupe_process::Error::NotFound { program } => BackendError::NotInstalled {
                backend: name.to_owned(),
                program,
            },
            troupe_process::Error::SandboxUnavailable { reason } => BackendError::SandboxDenied {
                backend: name.to_owned(),
                denied: format!("the child could not be confined: {reason}"),
                output_tail: String::new(),
            },
            other => BackendError::Internal {
                message: format!("running `{program}`: {other}"),
            },
        })?;
        let stdout = output.stdout_text();
        let stderr = output.stderr_text();
        if output.exit_code != Some(0)
            && output.termination == Termination::Exited
            && let Some(denied) = spec.sandbox_denied(&stderr)
        {
            return Err(BackendError::SandboxDenied {
                backend: name.to_owned(),
                denied,
                output_tail: troupe_process::tail(&stderr, TAIL_LINES, TAIL_CHARS),
            });
        }
        let transcript = events::parse(self.kind, &stdout);
        let stdout_tail = troupe_process::tail(&stdout, TAIL_LINES, TAIL_CHARS);
        let stderr_tail = troupe_process::tail(&stderr, TAIL_LINES, TAIL_CHARS);
        info!(termination = ?output.termination, exit_code = ?output.exit_code, session = ?transcript.session_id, duration_ms = output.duration.as_millis(), "cli finished");
        let evidence = || {
            if stderr_tail.is_empty() {
                stdout_tail.clone()
            } else {
                format!("{stdout_tail}\n--- stderr ---\n{stderr_tail}")
            }
        };
        match output.termination {
            Termination::Cancelled if !cancel.is_cancelled() => {
                let line = first_error.unwrap_or_default();
                let what = first_error_text(&line);
                return Err(classified(
                    name,
                    events::classify_message(what),
                    format!(
                        "stopped after its first failed model call (fast_fail): {}",
                        what.trim().chars().take(200).collect::<String>()
                    ),
                    None,
                    evidence(),
                ));
            }
            Termination::Cancelled => return Err(BackendError::Cancelled),
            Termination::TimedOut | Termination::IdleTimedOut => {
                let idle_fired = output.termination == Termination::IdleTimedOut;
                return Err(BackendError::Timeout {
                    backend: name.to_owned(),
                    limit: if idle_fired {
                        idle.unwrap_or_default()
                    } else {
                        spec.timeout.or(self.config.timeout()).unwrap_or_default()
                    },
                    idle: idle_fired,
                    output_tail: evidence(),
                });
            }
            Termination::Exited => {}
        }
        if let Some((kind, message)) = transcript.error.clone() {
            return Err(classified(
                name,
                kind,
                message,
                output.exit_code,
                evidence(),
            ));
        }
        if output.exit_code != Some(0) {
            // No JSON error: classify what stderr says (gemini also encodes the HTTP status
            // in its exit code).
            let kind = match (self.kind, output.exit_code) {
                (CliKind::Gemini, Some(145)) => ErrorKind::Auth,
                (CliKind::Gemini, Some(173)) => ErrorKind::RateLimited,
                (CliKind::Gemini, Some(41)) => ErrorKind::Auth,
                _ => events::classify_message(&stderr_tail),
            };
            let message = telling_lines(&stderr_tail, kind);
            return Err(classified(
                name,
                kind,
                message,
                output.exit_code,
                evidence(),
            ));
        }
        if !transcript.ended {
            return Err(BackendError::BadOutput {
                backend: name.to_owned(),
                message: format!(
                    "exited 0 without an end-of-run event ({} JSON event(s), {} other line(s))",
                    transcript.events.len(),
                    transcript.unparsed
                ),
            });
        }
        if !spec.read_only && transcript.all_denied() {
            // Exit 0, but the agent could do nothing it tried: not a success.
            return Err(BackendError::PermissionDenied {
                backend: name.to_owned(),
                denials: transcript.denials.clone(),
            });
        }
        Ok(RunOutcome {
            argv,
            exit_code: 0,
            stdout_tail,
            stderr_tail,
            duration: output.duration,
            native_session_id: transcript.session_id.clone(),
            usage: transcript.usage,
            model: self.model(),
            final_message: transcript.final_message.clone(),
            tool_calls: transcript.tool_calls().map(str::to_owned).collect(),
            events: transcript
                .events
                .into_iter()
                .filter(|e| !matches!(e, AgentEvent::Message(_)))
                .collect(),
        })
    }
}

/// What stderr says about a failure of `kind`: the last line that says it (gemini puts its
/// reason above a stack trace), else its last lines; terminal colours removed.
fn telling_lines(stderr: &str, kind: ErrorKind) -> String {
    let plain = regex::Regex::new("\x1b\\[[0-9;]*m").map_or_else(
        |_| stderr.to_owned(),
        |ansi| ansi.replace_all(stderr, "").into_owned(),
    );
    if kind != ErrorKind::Crash
        && let Some(line) = plain
            .lines()
            .rev()
            .find(|line| events::classify_message(line) == kind)
    {
        return line.trim().chars().take(400).collect();
    }
    troupe_process::tail(&plain, 3, 400)
}

impl CliBackend {
    /// Where a CLI that retries on its own with no switch to stop it logs a failed model call,
    /// and the text that marks one, when `fast_fail` asks troupe to stop it there.
    fn first_error_log(&self, home: &Path) -> Option<(PathBuf, &'static str)> {
        if !self.config.fast_fail {
            return None;
        }
        match self.kind {
            // `[RETRY] Attempt 1 failed with status 500. Retrying with backoff in 2s...`
            CliKind::Qwen => Some((home.join(".qwen/debug"), "[RETRY] Attempt")),
            // `level=ERROR ... message="stream error" ... error.error="AI_APICallError: ..."`
            CliKind::Opencode => Some((
                home.join(".local/share/opencode/log"),
                "message=\"stream error\"",
            )),
            CliKind::Codex | CliKind::Claude | CliKind::Gemini => None,
        }
    }
}

/// Polls the log files in `dir` for a line containing `needle`; once one appears, gives the
/// CLI [`FIRST_ERROR_GRACE`] to give up by itself, then cancels `stop`. Returns the line.
async fn watch_first_error(
    dir: PathBuf,
    needle: &'static str,
    stop: CancellationToken,
) -> Option<String> {
    // Only what each file gained since the last look is read: a long run's log grows.
    let mut seen = std::collections::HashMap::<PathBuf, u64>::new();
    let found = loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let dir = dir.clone();
        let (line, after) = tokio::task::spawn_blocking(move || {
            let line = new_lines(&dir, &mut seen)
                .into_iter()
                .find(|line| line.contains(needle));
            (line, seen)
        })
        .await
        .ok()?;
        seen = after;
        if let Some(line) = line {
            break line;
        }
    };
    tokio::time::sleep(FIRST_ERROR_GRACE).await;
    stop.cancel();
    Some(found)
}

/// What a CLI's first failed call says, from its log line. opencode: `... error.error="<what>"`;
/// qwen: from its `[RETRY]` marker on. Only that part is classified: the line's timestamp
/// (`…:16.401`) must not read as a status code.
fn first_error_text(line: &str) -> &str {
    line.split_once("error.error=\"").map_or_else(
        || line.find("[RETRY]").map_or(line, |at| &line[at..]),
        |(_, rest)| rest.trim_end_matches('"'),
    )
}

/// The complete lines the files in `dir` gained since the offsets in `seen` (updated).
fn new_lines(dir: &Path, seen: &mut std::collections::HashMap<PathBuf, u64>) -> Vec<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut lines = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        let from = seen.get(&path).copied().unwrap_or(0);
        let Ok(mut file) = std::fs::File::open(&path) else {
            continue;
        };
        let mut bytes = Vec::new();
        if file.seek(SeekFrom::Start(from)).is_err() || file.read_to_end(&mut bytes).is_err() {
            continue;
        }
        // A line still being written is read whole next time.
        let complete = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        seen.insert(path, from + complete as u64);
        lines.extend(
            String::from_utf8_lossy(&bytes[..complete])
                .lines()
                .map(str::to_owned),
        );
    }
    lines
}

fn classified(
    backend: &str,
    kind: ErrorKind,
    message: String,
    exit_code: Option<i32>,
    evidence: String,
) -> BackendError {
    let backend = backend.to_owned();
    let message = message.trim().to_owned();
    match kind {
        ErrorKind::Auth => BackendError::Auth { backend, message },
        ErrorKind::RateLimited => BackendError::RateLimited {
            retry_after: crate::events::retry_after_in(&message)
                .or_else(|| crate::events::retry_after_in(&evidence)),
            backend,
            message,
        },
        ErrorKind::Quota => BackendError::Quota {
            retry_after: crate::events::retry_after_in(&message)
                .or_else(|| crate::events::retry_after_in(&evidence)),
            backend,
            message,
        },
        ErrorKind::BadOutput => BackendError::BadOutput { backend, message },
        _ => BackendError::Crash {
            backend,
            reason: troupe_process::tail(&message, 1, 300),
            exit_code,
            signal: None,
            stderr_tail: evidence,
        },
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_first_error_is_classified_by_its_text_not_its_timestamp() {
        let opencode = "INFO  2026-11-26T14:45:12.401 +2ms service=llm message=\"stream error\" error.error=\"AI_APICallError: Rate limit reached for fake-model (fake 429)\"";
        let what = first_error_text(opencode);
        assert!(what.starts_with("AI_APICallError"), "{what}");
        assert_eq!(
            crate::events::classify_message(what),
            crate::ErrorKind::RateLimited
        );
        let qwen = "[2026-11-26T14:45:12.401Z] [DEBUG] [RETRY] Attempt 1 failed with status 429";
        assert!(first_error_text(qwen).starts_with("[RETRY]"));
    }
    use super::*;

    #[tokio::test]
    async fn probe_reports_missing_and_installed_tools_honestly() {
        let missing = CliBackend::new(
            CliKind::Codex,
            BackendConfig {
                command: Some("troupe-no-such-cli-xyz".to_owned()),
                ..BackendConfig::default()
            },
        )
        .probe()
        .await;
        assert!(!missing.available);
        assert_eq!(missing.version, None);
        assert!(
            missing.detail.contains("not found on PATH"),
            "{}",
            missing.detail
        );

        // `git` stands in for an installed CLI: the version is what it printed.
        let installed = CliBackend::new(
            CliKind::Codex,
            BackendConfig {
                command: Some("git".to_owned()),
                api_key_env: Some("TROUPE_TEST_UNSET_KEY_VAR".to_owned()),
                auth: crate::AuthMode::Key,
                ..BackendConfig::default()
            },
        )
        .probe()
        .await;
        // Installed, but without its key a task could only fail: not available, and why.
        assert!(!installed.available);
        assert!(
            installed
                .credential
                .contains("$TROUPE_TEST_UNSET_KEY_VAR (api_key_env) is not set"),
            "{}",
            installed.credential
        );
        assert!(installed.credential.starts_with("missing: "));
        let installed = CliBackend::new(
            CliKind::Codex,
            BackendConfig {
                command: Some("git".to_owned()),
                api_key: Some("k".to_owned()),
                ..BackendConfig::default()
            },
        )
        .probe()
        .await;
        assert!(installed.available);
        assert_eq!(installed.credential, "key: api_key in [backends.codex]");
        assert!(
            installed
                .version
                .as_deref()
                .is_some_and(|v| v.starts_with("git version"))
        );
    }

    #[test]
    fn log_watch_reads_only_complete_new_lines() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("s.txt");
        let mut seen = std::collections::HashMap::new();
        std::fs::write(&log, "one\ntw").expect("write");
        assert_eq!(new_lines(dir.path(), &mut seen), ["one"]);
        std::fs::write(&log, "one\ntwo\n[RETRY] Attempt 1 failed\n").expect("write");
        assert_eq!(
            new_lines(dir.path(), &mut seen),
            ["two", "[RETRY] Attempt 1 failed"]
        );
        assert!(new_lines(dir.path(), &mut seen).is_empty());
    }

    #[test]
    fn claude_project_keys_replace_punctuation() {
        assert_eq!(
            claude_project_key(Path::new("/data/wt/s1/IMPL-1_2.x")),
            "-data-wt-s1-IMPL-1-2-x"
        );
    }
}
