//! The `command` backend: the task's own argv template, for scripted or deterministic agents.

use std::path::Path;

use tokio_util::sync::CancellationToken;
use tracing::info;
use troupe_process::{Command, Termination};

use crate::{Backend, BackendError, BackendInfo, BoxFuture, RunOutcome, RunSpec, substitute};

const NAME: &str = "command";
/// Lines and characters of output kept for reports and error details.
const TAIL_LINES: usize = 40;
const TAIL_CHARS: usize = 4000;

/// Runs `agent.command` with placeholders substituted per element, the prompt on stdin, and the
/// worktree as working directory. Exit 0 is success; anything else is a classified error.
#[derive(Debug, Clone, Copy, Default)]
pub struct CommandBackend;

impl Backend for CommandBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn probe(&self) -> BoxFuture<'_, BackendInfo> {
        Box::pin(async {
            BackendInfo {
                name: NAME.to_owned(),
                available: true,
                version: Some(env!("CARGO_PKG_VERSION").to_owned()),
                detail: "runs the task's agent.command argv with the prompt on stdin".to_owned(),
                credential: String::new(),
            }
        })
    }

    fn run<'a>(
        &'a self,
        spec: RunSpec,
        cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, Result<RunOutcome, BackendError>> {
        Box::pin(run(spec, cancel))
    }
}

#[tracing::instrument(name = "troupe.backend.run", skip_all, fields(backend = NAME, worktree = %spec.worktree.display()))]
async fn run(spec: RunSpec, cancel: &CancellationToken) -> Result<RunOutcome, BackendError> {
    if spec.command.is_empty() {
        return Err(BackendError::InvalidTask {
            message: "the `command` backend needs a non-empty agent.command argv".to_owned(),
        });
    }
    let mut values = spec.placeholders.clone();
    values.insert("worktree".to_owned(), spec.worktree.display().to_string());
    values.insert(
        "prompt_file".to_owned(),
        spec.prompt_file.display().to_string(),
    );
    let mut argv = substitute(&spec.command, &values)?;
    // A relative program path (`./agents/x.sh`) means the plan's directory, not the worktree.
    if let Some(plan_dir) = values.get("plan_dir")
        && argv[0].contains('/')
        && Path::new(&argv[0]).is_relative()
    {
        argv[0] = Path::new(plan_dir).join(&argv[0]).display().to_string();
    }

    let sandbox = spec.child_sandbox();
    let mut cmd = Command::from_argv(&argv)
        .map_err(|err| BackendError::InvalidTask {
            message: format!("agent command: {err}"),
        })?
        .sandbox(sandbox)
        .cwd(&spec.worktree)
        .stdin(spec.prompt.clone().into_bytes())
        .env("TROUPE_WORKTREE", values["worktree"].clone())
        .env("TROUPE_PROMPT_FILE", values["prompt_file"].clone());
    for (placeholder, var) in [
        ("task_id", "TROUPE_TASK_ID"),
        ("session_id", "TROUPE_SESSION_ID"),
        ("plan_dir", "TROUPE_PLAN_DIR"),
        ("repo", "TROUPE_REPO"),
    ] {
        if let Some(value) = values.get(placeholder) {
            cmd = cmd.env(var, value.clone());
        }
    }
    cmd = cmd.envs(spec.env.clone());
    if let Some(limit) = spec.timeout {
        cmd = cmd.timeout(limit);
    }
    if let Some(limit) = spec.idle_timeout {
        cmd = cmd.idle_timeout(limit);
    }

    let output = cmd.run(cancel).await.map_err(|err| match err {
        troupe_process::Error::NotFound { program } => BackendError::NotInstalled {
            backend: NAME.to_owned(),
            program,
        },
        troupe_process::Error::Spawn { program, source } => BackendError::Crash {
            backend: NAME.to_owned(),
            reason: String::new(),
            exit_code: None,
            signal: None,
            stderr_tail: format!("cannot start `{program}`: {source}"),
        },
        troupe_process::Error::SandboxUnavailable { reason } => BackendError::SandboxDenied {
            backend: NAME.to_owned(),
            denied: format!("the child could not be confined: {reason}"),
            output_tail: String::new(),
        },
        other => BackendError::Internal {
            message: format!("running agent command: {other}"),
        },
    })?;
    let stdout_tail = troupe_process::tail(&output.stdout_text(), TAIL_LINES, TAIL_CHARS);
    let stderr_tail = troupe_process::tail(&output.stderr_text(), TAIL_LINES, TAIL_CHARS);
    info!(termination = ?output.termination, exit_code = ?output.exit_code, duration_ms = output.duration.as_millis(), "agent command finished");

    match output.termination {
        Termination::Cancelled => return Err(BackendError::Cancelled),
        Termination::TimedOut | Termination::IdleTimedOut => {
            let idle = output.termination == Termination::IdleTimedOut;
            let limit = if idle {
                spec.idle_timeout
            } else {
                spec.timeout
            };
            return Err(BackendError::Timeout {
                backend: NAME.to_owned(),
                limit: limit.unwrap_or_default(),
                idle,
                output_tail: if stderr_tail.is_empty() {
                    stdout_tail
                } else {
                    stderr_tail
                },
            });
        }
        Termination::Exited => {}
    }
    if output.exit_code != Some(0)
        && let Some(denied) = spec.sandbox_denied(&format!(
            "{}\n{}",
            output.stderr_text(),
            output.stdout_text()
        ))
    {
        return Err(BackendError::SandboxDenied {
            backend: NAME.to_owned(),
            denied,
            output_tail: if stderr_tail.is_empty() {
                stdout_tail
            } else {
                stderr_tail
            },
        });
    }
    match output.exit_code {
        Some(0) => Ok(RunOutcome {
            argv,
            exit_code: 0,
            stdout_tail,
            stderr_tail,
            duration: output.duration,
            native_session_id: None,
            usage: None,
            model: None,
            final_message: String::new(),
            tool_calls: Vec::new(),
            events: Vec::new(),
        }),
        exit_code => Err(BackendError::Crash {
            backend: NAME.to_owned(),
            reason: String::new(),
            exit_code,
            signal: output.signal,
            stderr_tail: if stderr_tail.is_empty() {
                stdout_tail
            } else {
                stderr_tail
            },
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use super::*;
    use crate::ErrorKind;

    fn spec(dir: &Path, command: &[&str]) -> RunSpec {
        RunSpec {
            worktree: dir.to_path_buf(),
            prompt: "add a greeting".to_owned(),
            prompt_file: dir.join("prompt.md"),
            placeholders: BTreeMap::from([
                ("task_id".to_owned(), "IMPL-001".to_owned()),
                ("session_id".to_owned(), "s1".to_owned()),
                ("plan_dir".to_owned(), "/plans/p".to_owned()),
                ("repo".to_owned(), "app".to_owned()),
            ]),
            command: command.iter().map(|s| (*s).to_owned()).collect(),
            timeout: Some(Duration::from_secs(30)),
            ..RunSpec::default()
        }
    }

    async fn run_in(dir: &Path, command: &[&str]) -> Result<RunOutcome, BackendError> {
        CommandBackend
            .run(spec(dir, command), &CancellationToken::new())
            .await
    }

    #[tokio::test]
    async fn edits_files_in_the_worktree_with_prompt_and_placeholders() {
        let dir = tempfile::tempdir().expect("tempdir");
        let script = r#"
import os, sys
prompt = sys.stdin.read()
with open("hello.txt", "w") as f:
    f.write("|".join([sys.argv[1], sys.argv[2], prompt, os.environ["TROUPE_TASK_ID"]]) + "\n")
print("done")
"#;
        let out = run_in(
            dir.path(),
            &["python3", "-c", script, "{task_id}", "{{literal}}"],
        )
        .await
        .expect("runs");
        assert_eq!(out.exit_code, 0);
        assert_eq!(out.stdout_tail, "done");
        let written =
            std::fs::read_to_string(dir.path().join("hello.txt")).expect("agent wrote the file");
        assert_eq!(written, "IMPL-001|{literal}|add a greeting|IMPL-001\n");
        assert_eq!(out.argv[3], "IMPL-001");
    }

    #[tokio::test]
    async fn worktree_and_prompt_file_placeholders() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = run_in(dir.path(), &["echo", "{worktree}", "{prompt_file}"])
            .await
            .expect("runs");
        let expected = format!(
            "{} {}",
            dir.path().display(),
            dir.path().join("prompt.md").display()
        );
        assert_eq!(out.stdout_tail, expected);
    }

    #[tokio::test]
    async fn unknown_placeholder_is_an_invalid_task() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = run_in(dir.path(), &["echo", "{workdir}"])
            .await
            .expect_err("unknown");
        assert_eq!(err.kind(), ErrorKind::InvalidTask);
        assert!(!err.retryable());
        let err = run_in(dir.path(), &[]).await.expect_err("empty");
        assert_eq!(err.kind(), ErrorKind::InvalidTask);
    }

    #[tokio::test]
    async fn non_zero_exit_is_a_crash_with_the_stderr_tail() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = run_in(
            dir.path(),
            &["sh", "-c", "echo progress; echo 'it broke' >&2; exit 7"],
        )
        .await
        .expect_err("crash");
        match &err {
            BackendError::Crash {
                exit_code,
                stderr_tail,
                ..
            } => {
                assert_eq!(*exit_code, Some(7));
                assert_eq!(stderr_tail, "it broke");
            }
            other => panic!("expected a crash, got {other:?}"),
        }
        assert!(err.retryable());
    }

    #[tokio::test]
    async fn missing_program_is_not_installed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = run_in(dir.path(), &["troupe-no-such-agent-xyz"])
            .await
            .expect_err("missing");
        assert_eq!(err.kind(), ErrorKind::NotInstalled);
        assert!(
            err.to_string().contains("troupe-no-such-agent-xyz"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn timeout_kills_the_agent() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut spec = spec(dir.path(), &["sh", "-c", "sleep 1000 & wait"]);
        spec.timeout = Some(Duration::from_millis(300));
        let started = std::time::Instant::now();
        let err = CommandBackend
            .run(spec, &CancellationToken::new())
            .await
            .expect_err("timeout");
        assert_eq!(err.kind(), ErrorKind::Timeout);
        assert!(err.retryable());
        assert!(started.elapsed() < Duration::from_secs(10));

        let mut spec = self::spec(dir.path(), &["sleep", "1000"]);
        spec.idle_timeout = Some(Duration::from_millis(200));
        let err = CommandBackend
            .run(spec, &CancellationToken::new())
            .await
            .expect_err("idle");
        assert!(
            matches!(err, BackendError::Timeout { idle: true, .. }),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn cancel_is_reported_as_cancelled() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cancel = CancellationToken::new();
        cancel.cancel();
        let err = CommandBackend
            .run(spec(dir.path(), &["sleep", "1000"]), &cancel)
            .await
            .expect_err("cancelled");
        assert_eq!(err.kind(), ErrorKind::Cancelled);
    }
}
