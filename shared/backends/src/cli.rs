//! The coding-agent CLIs (`codex`, `gemini`, `qwen`, `claude`, `opencode`) and the built-in
//! `agent` loop. Running them is issue #4; until then they report honestly what is installed
//! and refuse to run.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use troupe_process::Command;

use crate::{Backend, BackendError, BackendInfo, BoxFuture, RunOutcome, RunSpec};

/// CCW's tool probe limit (ccw-reference §3.4).
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

fn not_implemented(name: &str) -> BackendError {
    BackendError::InvalidTask {
        message: format!("backend `{name}` is not implemented yet (issue #4); use `command`"),
    }
}

/// A coding-agent CLI found on `PATH`.
#[derive(Debug, Clone)]
pub struct CliBackend {
    name: &'static str,
    program: &'static str,
}

impl CliBackend {
    /// The backend `name`, run through `program`.
    pub fn new(name: &'static str, program: &'static str) -> Self {
        Self { name, program }
    }
}

impl Backend for CliBackend {
    fn name(&self) -> &'static str {
        self.name
    }

    fn probe(&self) -> BoxFuture<'_, BackendInfo> {
        Box::pin(async move {
            let (version, installed) = probe_version(self.program).await;
            let detail = match (&installed, &version) {
                (Err(reason), _) => reason.clone(),
                (Ok(()), Some(version)) => format!(
                    "`{}` {version} is installed, but the `{}` backend is not implemented yet (issue #4)",
                    self.program, self.name
                ),
                (Ok(()), None) => format!(
                    "`{}` is installed, but the `{}` backend is not implemented yet (issue #4)",
                    self.program, self.name
                ),
            };
            BackendInfo {
                name: self.name.to_owned(),
                available: false,
                version,
                detail,
            }
        })
    }

    fn run<'a>(
        &'a self,
        _spec: RunSpec,
        _cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, Result<RunOutcome, BackendError>> {
        Box::pin(async move { Err(not_implemented(self.name)) })
    }
}

/// Runs `<program> --version`; returns the version line (if any) and whether the program is
/// installed (the error says why not).
async fn probe_version(program: &str) -> (Option<String>, Result<(), String>) {
    if troupe_process::which(program).is_none() {
        return (None, Err(format!("`{program}` not found on PATH")));
    }
    let cmd = Command::new(program)
        .arg("--version")
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
                .find(|l| !l.is_empty())
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

/// The built-in tool-using loop against an OpenAI-compatible endpoint (issue #4).
#[derive(Debug, Clone, Copy, Default)]
pub struct AgentLoopBackend;

impl Backend for AgentLoopBackend {
    fn name(&self) -> &'static str {
        "agent"
    }

    fn probe(&self) -> BoxFuture<'_, BackendInfo> {
        Box::pin(async {
            BackendInfo {
                name: "agent".to_owned(),
                available: false,
                version: None,
                detail: "the built-in `agent` loop is not implemented yet (issue #4)".to_owned(),
            }
        })
    }

    fn run<'a>(
        &'a self,
        _spec: RunSpec,
        _cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, Result<RunOutcome, BackendError>> {
        Box::pin(async { Err(not_implemented("agent")) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[tokio::test]
    async fn probe_reports_missing_and_installed_tools_honestly() {
        let missing = CliBackend::new("codex", "troupe-no-such-cli-xyz")
            .probe()
            .await;
        assert!(!missing.available);
        assert_eq!(missing.version, None);
        assert!(
            missing.detail.contains("not found on PATH"),
            "{}",
            missing.detail
        );

        // `git` stands in for an installed CLI: the version is real, yet it is not runnable.
        let installed = CliBackend::new("codex", "git").probe().await;
        assert!(!installed.available);
        assert!(
            installed
                .version
                .as_deref()
                .is_some_and(|v| v.starts_with("git version"))
        );
        assert!(
            installed.detail.contains("not implemented yet"),
            "{}",
            installed.detail
        );
    }

    #[tokio::test]
    async fn run_refuses_with_a_clear_error() {
        let err = CliBackend::new("gemini", "gemini")
            .run(RunSpec::default(), &CancellationToken::new())
            .await
            .expect_err("not implemented");
        assert_eq!(err.kind(), ErrorKind::InvalidTask);
        assert!(!err.retryable());
        assert_eq!(
            err.to_string(),
            "backend `gemini` is not implemented yet (issue #4); use `command`"
        );
        let err = AgentLoopBackend
            .run(RunSpec::default(), &CancellationToken::new())
            .await
            .expect_err("agent");
        assert!(err.to_string().contains("`agent` is not implemented yet"));
    }
}
