//! The built-in `agent` backend: a tool-using loop against any OpenAI-compatible
//! `/chat/completions` endpoint.
//!
//! Tools: `read_file`, `list_dir`, `search`, `edit_file` (search and replace, exactly one
//! match), `write_file` and `run` (an argv whose program is on the allow-list; no shell). Every
//! path is resolved inside the worktree; a path that escapes it (`..`, an absolute path
//! elsewhere, a symlink pointing out) is refused. Turn and token budgets end runaway loops.

use crate::confine::confine;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};
use troupe_process::Command;

use crate::{
    AgentEvent, Backend, BackendConfig, BackendError, BackendInfo, BoxFuture, RunOutcome, RunSpec,
    Usage,
};

const NAME: &str = "agent";
const DEFAULT_MAX_TURNS: u32 = 40;
const DEFAULT_MAX_TOKENS: u64 = 400_000;
const DEFAULT_ALLOW: &[&str] = &[
    "ls", "cat", "grep", "git", "python3", "pytest", "cargo", "make", "npm", "node", "true",
];
const RUN_TIMEOUT: Duration = Duration::from_secs(300);
/// Characters of a tool result sent back to the model.
const RESULT_CHARS: usize = 16_000;

/// The loop, configured from the `[backends.agent]` section.
#[derive(Debug, Clone, Default)]
pub struct AgentLoopBackend {
    config: BackendConfig,
}

impl AgentLoopBackend {
    /// A loop with these settings (`endpoint`, `model`, key, budgets, `allow_commands`).
    pub fn new(config: BackendConfig) -> Self {
        Self { config }
    }
}

fn http_client() -> Result<reqwest::Client, BackendError> {
    static PROVIDER: OnceLock<()> = OnceLock::new();
    PROVIDER.get_or_init(|| {
        // reqwest is built without a default TLS provider; install ring once per process.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .build()
        .map_err(|err| BackendError::Internal {
            message: format!("building the http client: {err}"),
        })
}

impl Backend for AgentLoopBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn probe(&self) -> BoxFuture<'_, BackendInfo> {
        Box::pin(async move {
            let (available, detail) = match (&self.config.endpoint, &self.config.model) {
                (Some(endpoint), Some(model)) => {
                    (true, format!("tool loop with `{model}` at {endpoint}"))
                }
                _ => (
                    false,
                    "set [backends.agent] endpoint and model in the executor config".to_owned(),
                ),
            };
            BackendInfo {
                name: NAME.to_owned(),
                available,
                version: Some(env!("CARGO_PKG_VERSION").to_owned()),
                detail,
                // An OpenAI-compatible endpoint may need no key (a local server).
                credential: match (&self.config.api_key, &self.config.api_key_env) {
                    (Some(_), _) => "key: api_key in [backends.agent]".to_owned(),
                    (None, Some(var)) if std::env::var_os(var).is_some() => {
                        format!("key: ${var} (api_key_env)")
                    }
                    (None, Some(var)) => format!("none (${var} is not set)"),
                    (None, None) => "none".to_owned(),
                },
            }
        })
    }

    fn run<'a>(
        &'a self,
        spec: RunSpec,
        cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, Result<RunOutcome, BackendError>> {
        Box::pin(async move {
            let limit = spec.timeout.or(self.config.timeout());
            let run = self.run_loop(spec, cancel);
            match limit {
                Some(limit) => tokio::time::timeout(limit, run).await.unwrap_or_else(|_| {
                    Err(BackendError::Timeout {
                        backend: NAME.to_owned(),
                        limit,
                        idle: false,
                        output_tail: String::new(),
                    })
                }),
                None => run.await,
            }
        })
    }
}

fn tool(name: &str, description: &str, properties: Value, required: &[&str]) -> Value {
    json!({"type": "function", "function": {"name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}})
}

fn tools(read_only: bool, allow: &[String]) -> Vec<Value> {
    let path = json!({"type": "string", "description": "path relative to the worktree"});
    let mut tools = vec![
        tool("read_file", "Read a file", json!({"path": path}), &["path"]),
        tool(
            "list_dir",
            "List a directory",
            json!({"path": path}),
            &["path"],
        ),
        tool(
            "search",
            "Search files for a regular expression; returns path:line: text",
            json!({"pattern": {"type": "string"}, "path": path}),
            &["pattern"],
        ),
    ];
    if !read_only {
        tools.push(tool(
            "edit_file",
            "Replace the one occurrence of `search` in a file by `replace`",
            json!({"path": path, "search": {"type": "string"}, "replace": {"type": "string"}}),
            &["path", "search", "replace"],
        ));
        tools.push(tool(
            "write_file",
            "Create or overwrite a file",
            json!({"path": path, "content": {"type": "string"}}),
            &["path", "content"],
        ));
        tools.push(tool(
            "run",
            &format!(
                "Run a program (argv, no shell) in the worktree; allowed programs: {}",
                allow.join(", ")
            ),
            json!({"argv": {"type": "array", "items": {"type": "string"}}}),
            &["argv"],
        ));
    }
    tools
}

fn clip(text: &str) -> String {
    if text.chars().count() <= RESULT_CHARS {
        text.to_owned()
    } else {
        let kept: String = text.chars().take(RESULT_CHARS).collect();
        format!("{kept}\n... (truncated)")
    }
}

fn search_dir(dir: &Path, root: &Path, re: &regex::Regex, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.flatten().collect();
    entries.sort_by_key(std::fs::DirEntry::file_name);
    for entry in entries {
        if out.len() >= 200 {
            return;
        }
        let path = entry.path();
        if entry.file_name() == ".git" {
            continue;
        }
        match entry.file_type() {
            Ok(kind) if kind.is_dir() => search_dir(&path, root, re, out),
            Ok(kind) if kind.is_file() => {
                let Ok(text) = std::fs::read_to_string(&path) else {
                    continue;
                };
                let shown = path
                    .strip_prefix(root)
                    .unwrap_or(&path)
                    .display()
                    .to_string();
                for (i, line) in text.lines().enumerate() {
                    if re.is_match(line) {
                        out.push(format!("{shown}:{}: {line}", i + 1));
                    }
                }
            }
            _ => {}
        }
    }
}

struct Tools<'a> {
    root: PathBuf,
    allow: &'a [String],
    read_only: bool,
    cancel: &'a CancellationToken,
    /// What the `run` tool's children run under.
    sandbox: troupe_process::Sandbox,
}

impl Tools<'_> {
    /// Runs one tool; errors are returned to the model as text, not raised.
    async fn call(&self, name: &str, args: &Value) -> Result<String, String> {
        let arg = |key: &str| {
            args.get(key)
                .and_then(Value::as_str)
                .ok_or_else(|| format!("missing string argument `{key}`"))
        };
        let writes = matches!(name, "edit_file" | "write_file" | "run");
        if writes && self.read_only {
            return Err(format!("`{name}` is not available in read-only mode"));
        }
        match name {
            "read_file" => {
                let path = confine(&self.root, arg("path")?)?;
                tokio::fs::read_to_string(&path)
                    .await
                    .map(|t| clip(&t))
                    .map_err(|err| {
                        format!("cannot read {}: {err}", arg("path").unwrap_or_default())
                    })
            }
            "list_dir" => {
                let path = confine(
                    &self.root,
                    args.get("path").and_then(Value::as_str).unwrap_or("."),
                )?;
                let mut names = Vec::new();
                let mut dir = tokio::fs::read_dir(&path)
                    .await
                    .map_err(|err| format!("cannot list: {err}"))?;
                while let Ok(Some(entry)) = dir.next_entry().await {
                    let mut name = entry.file_name().to_string_lossy().into_owned();
                    if name == ".git" {
                        continue;
                    }
                    if entry.file_type().await.is_ok_and(|k| k.is_dir()) {
                        name.push('/');
                    }
                    names.push(name);
                }
                names.sort();
                Ok(names.join("\n"))
            }
            "search" => {
                let re = regex::Regex::new(arg("pattern")?)
                    .map_err(|err| format!("bad pattern: {err}"))?;
                let path = confine(
                    &self.root,
                    args.get("path").and_then(Value::as_str).unwrap_or("."),
                )?;
                let root = self.root.clone();
                let found = tokio::task::spawn_blocking(move || {
                    let mut out = Vec::new();
                    if path.is_file() {
                        if let Ok(text) = std::fs::read_to_string(&path) {
                            for (i, line) in text.lines().enumerate() {
                                if re.is_match(line) {
                                    out.push(format!(
                                        "{}:{}: {line}",
                                        path.strip_prefix(&root).unwrap_or(&path).display(),
                                        i + 1
                                    ));
                                }
                            }
                        }
                    } else {
                        search_dir(&path, &root, &re, &mut out);
                    }
                    out
                })
                .await
                .map_err(|err| format!("search failed: {err}"))?;
                Ok(if found.is_empty() {
                    "no matches".to_owned()
                } else {
                    clip(&found.join("\n"))
                })
            }
            "edit_file" => {
                let shown = arg("path")?;
                let path = confine(&self.root, shown)?;
                let (search, replace) = (arg("search")?, arg("replace")?);
                let text = tokio::fs::read_to_string(&path)
                    .await
                    .map_err(|err| format!("cannot read {shown}: {err}"))?;
                match text.matches(search).count() {
                    1 => {
                        tokio::fs::write(&path, text.replacen(search, replace, 1))
                            .await
                            .map_err(|err| format!("cannot write {shown}: {err}"))?;
                        Ok(format!("edited {shown}"))
                    }
                    0 => Err(format!("`search` text not found in {shown}")),
                    n => Err(format!(
                        "`search` text occurs {n} times in {shown}; make it unique"
                    )),
                }
            }
            "write_file" => {
                let shown = arg("path")?;
                let path = confine(&self.root, shown)?;
                if let Some(parent) = path.parent() {
                    tokio::fs::create_dir_all(parent)
                        .await
                        .map_err(|err| format!("cannot create {}: {err}", parent.display()))?;
                }
                tokio::fs::write(&path, arg("content")?)
                    .await
                    .map_err(|err| format!("cannot write {shown}: {err}"))?;
                Ok(format!("wrote {shown}"))
            }
            "run" => {
                let argv: Vec<String> = args
                    .get("argv")
                    .and_then(Value::as_array)
                    .map(|items| {
                        items
                            .iter()
                            .filter_map(Value::as_str)
                            .map(str::to_owned)
                            .collect()
                    })
                    .unwrap_or_default();
                let Some(program) = argv.first() else {
                    return Err("`argv` must be a non-empty array of strings".to_owned());
                };
                if !self.allow.iter().any(|a| a == program) {
                    return Err(format!(
                        "`{program}` is not allowed (allowed: {})",
                        self.allow.join(", ")
                    ));
                }
                let output = Command::from_argv(&argv)
                    .map_err(|err| err.to_string())?
                    .sandbox(self.sandbox.clone())
                    .cwd(&self.root)
                    .timeout(RUN_TIMEOUT)
                    .max_output_bytes(64 * 1024)
                    .run(self.cancel)
                    .await
                    .map_err(|err| err.to_string())?;
                // The model learns what the sandbox refused, so it can stay in bounds.
                let denied = (output.exit_code != Some(0))
                    .then(|| self.sandbox.denied(&output.stderr_text(), Some(&self.root)))
                    .flatten()
                    .map(|denied| format!("\ndenied by the sandbox: {denied}"))
                    .unwrap_or_default();
                Ok(clip(&format!(
                    "exit code: {:?}\nstdout:\n{}\nstderr:\n{}{denied}",
                    output.exit_code,
                    output.stdout_text(),
                    output.stderr_text()
                )))
            }
            other => Err(format!("unknown tool `{other}`")),
        }
    }
}

fn http_error(
    status: reqwest::StatusCode,
    retry_after: Option<Duration>,
    body: &str,
) -> BackendError {
    let backend = NAME.to_owned();
    let message = format!("{status}: {}", troupe_process::tail(body, 3, 400));
    let retry_after = retry_after.or_else(|| crate::events::retry_after_in(body));
    match status.as_u16() {
        401 | 403 => BackendError::Auth { backend, message },
        429 if body.contains("insufficient_quota") => BackendError::Quota {
            backend,
            message,
            retry_after,
        },
        429 => BackendError::RateLimited {
            backend,
            message,
            retry_after,
        },
        _ => BackendError::Crash {
            backend,
            reason: message.clone(),
            exit_code: None,
            signal: None,
            stderr_tail: message,
        },
    }
}

impl AgentLoopBackend {
    #[tracing::instrument(name = "troupe.backend.run", skip_all, fields(backend = NAME, worktree = %spec.worktree.display()))]
    async fn run_loop(
        &self,
        spec: RunSpec,
        cancel: &CancellationToken,
    ) -> Result<RunOutcome, BackendError> {
        let (Some(endpoint), Some(model)) = (&self.config.endpoint, &self.config.model) else {
            return Err(BackendError::NotInstalled {
                backend: NAME.to_owned(),
                program: "an OpenAI-compatible endpoint ([backends.agent] endpoint and model)"
                    .to_owned(),
            });
        };
        let started = std::time::Instant::now();
        let root = spec
            .worktree
            .canonicalize()
            .map_err(|err| BackendError::Internal {
                message: format!("worktree {}: {err}", spec.worktree.display()),
            })?;
        let allow: Vec<String> = self
            .config
            .allow_commands
            .clone()
            .unwrap_or_else(|| DEFAULT_ALLOW.iter().map(|s| (*s).to_owned()).collect());
        let toolset = Tools {
            root: root.clone(),
            allow: &allow,
            read_only: spec.read_only,
            cancel,
            sandbox: spec.child_sandbox(),
        };
        let max_turns = self.config.max_turns.unwrap_or(DEFAULT_MAX_TURNS);
        let max_tokens = self.config.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
        let client = http_client()?;
        let url = format!("{}/chat/completions", endpoint.trim_end_matches('/'));
        let key = self.config.key();
        let system = format!(
            "You are a coding agent working in a git worktree. Working directory: {}\n\
             Use the tools to inspect and change files; paths are relative to the worktree. \
             Do not commit. When the task is done, answer with a short summary and no tool call.",
            root.display()
        );
        let mut messages = vec![
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": spec.prompt}),
        ];
        let tool_defs = tools(spec.read_only, &allow);
        let mut usage = Usage::default();
        let mut events = Vec::new();
        let mut tool_calls = Vec::new();
        for turn in 1..=max_turns {
            let body = json!({"model": model, "messages": messages, "tools": tool_defs, "tool_choice": "auto"});
            let mut request = client.post(&url).json(&body);
            if let Some(key) = &key {
                request = request.bearer_auth(key);
            }
            let response = tokio::select! {
                () = cancel.cancelled() => return Err(BackendError::Cancelled),
                response = request.send() => response,
            };
            let response = response.map_err(|err| BackendError::Crash {
                backend: NAME.to_owned(),
                reason: format!("endpoint unreachable: {err}"),
                exit_code: None,
                signal: None,
                stderr_tail: String::new(),
            })?;
            let status = response.status();
            let retry_after = response
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|value| value.to_str().ok())
                .and_then(crate::events::retry_after_header);
            let text = tokio::select! {
                () = cancel.cancelled() => return Err(BackendError::Cancelled),
                text = response.text() => text.map_err(|err| BackendError::Crash {
                    backend: NAME.to_owned(), reason: String::new(), exit_code: None, signal: None,
                    stderr_tail: format!("reading the response: {err}"),
                })?,
            };
            if !status.is_success() {
                return Err(http_error(status, retry_after, &text));
            }
            let reply: Value =
                serde_json::from_str(&text).map_err(|err| BackendError::BadOutput {
                    backend: NAME.to_owned(),
                    message: format!("response is not JSON: {err}"),
                })?;
            usage.input_tokens += reply
                .pointer("/usage/prompt_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            usage.output_tokens += reply
                .pointer("/usage/completion_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            if let Some(sink) = &spec.usage_sink {
                sink.report(usage);
            }
            let message = reply
                .pointer("/choices/0/message")
                .cloned()
                .ok_or_else(|| BackendError::BadOutput {
                    backend: NAME.to_owned(),
                    message: "response has no choices[0].message".to_owned(),
                })?;
            let calls = message
                .get("tool_calls")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            if calls.is_empty() {
                let content = message
                    .get("content")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                info!(
                    turns = turn,
                    input_tokens = usage.input_tokens,
                    output_tokens = usage.output_tokens,
                    "agent loop finished"
                );
                events.push(AgentEvent::End { error: None });
                return Ok(RunOutcome {
                    argv: vec![NAME.to_owned(), model.clone(), url.clone()],
                    exit_code: 0,
                    stdout_tail: troupe_process::tail(&content, 40, 4000),
                    stderr_tail: String::new(),
                    duration: started.elapsed(),
                    native_session_id: None,
                    usage: Some(usage),
                    model: Some(model.clone()),
                    final_message: content,
                    tool_calls,
                    events,
                });
            }
            messages.push(message.clone());
            for call in calls {
                let id = call
                    .get("id")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                let name = call
                    .pointer("/function/name")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                let raw = call
                    .pointer("/function/arguments")
                    .and_then(Value::as_str)
                    .unwrap_or("{}");
                let args: Value = serde_json::from_str(raw).unwrap_or(Value::Null);
                debug!(tool = %name, "tool call");
                let result = match toolset.call(&name, &args).await {
                    Ok(text) => {
                        if matches!(name.as_str(), "write_file" | "edit_file")
                            && let Some(path) = args.get("path").and_then(Value::as_str)
                        {
                            events.push(AgentEvent::FileChange(path.to_owned()));
                        }
                        text
                    }
                    Err(err) => format!("error: {err}"),
                };
                events.push(AgentEvent::ToolCall {
                    name: name.clone(),
                    input: raw.to_owned(),
                });
                tool_calls.push(name);
                messages.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
            }
            if usage.input_tokens + usage.output_tokens > max_tokens {
                return Err(BackendError::BadOutput {
                    backend: NAME.to_owned(),
                    message: format!(
                        "token budget of {max_tokens} spent after {turn} turn(s) without a final answer"
                    ),
                });
            }
        }
        Err(BackendError::BadOutput {
            backend: NAME.to_owned(),
            message: format!("turn budget of {max_turns} spent without a final answer"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_stay_inside_the_worktree() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().canonicalize().expect("canonical");
        std::fs::create_dir_all(root.join("src")).expect("mkdir");
        assert_eq!(
            confine(&root, "src/a.py").expect("inside"),
            root.join("src/a.py")
        );
        assert_eq!(
            confine(&root, "./src/../b.txt").expect("inside"),
            root.join("b.txt")
        );
        let abs = root.join("src/x").display().to_string();
        assert!(confine(&root, &abs).is_ok());
        for bad in ["../x", "/etc/passwd", "src/../../x", ".git/config"] {
            assert!(confine(&root, bad).is_err(), "{bad} accepted");
        }
        std::os::unix::fs::symlink("/etc", root.join("out")).expect("symlink");
        assert!(confine(&root, "out/passwd").is_err());
    }

    #[tokio::test]
    async fn run_is_allow_listed_and_read_only_refuses_writes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().canonicalize().expect("canonical");
        let allow = vec!["true".to_owned()];
        let cancel = CancellationToken::new();
        let tools = Tools {
            root: root.clone(),
            allow: &allow,
            read_only: false,
            cancel: &cancel,
            sandbox: troupe_process::Sandbox::new(troupe_process::SandboxMode::Warn).write(&root),
        };
        let err = tools
            .call("run", &json!({"argv": ["rm", "-rf", "/"]}))
            .await
            .expect_err("refused");
        assert!(err.contains("not allowed"), "{err}");
        assert!(
            tools
                .call("run", &json!({"argv": ["true"]}))
                .await
                .expect("runs")
                .contains("exit code: Some(0)")
        );
        tools
            .call(
                "write_file",
                &json!({"path": "a.txt", "content": "one two"}),
            )
            .await
            .expect("write");
        tools
            .call(
                "edit_file",
                &json!({"path": "a.txt", "search": "two", "replace": "2"}),
            )
            .await
            .expect("edit");
        assert_eq!(
            std::fs::read_to_string(root.join("a.txt")).expect("read"),
            "one 2"
        );
        let found = tools
            .call("search", &json!({"pattern": "one"}))
            .await
            .expect("search");
        assert_eq!(found, "a.txt:1: one 2");
        let ro = Tools {
            root,
            allow: &allow,
            read_only: true,
            cancel: &cancel,
            sandbox: troupe_process::Sandbox::off(),
        };
        assert!(
            ro.call("write_file", &json!({"path": "b", "content": ""}))
                .await
                .is_err()
        );
    }
}
