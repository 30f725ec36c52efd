//! The one place that runs the `git` binary.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use troupe_process::{Command, Output};

use crate::Error;

/// Long enough for a checkout of a large repository; git plumbing is otherwise quick.
const GIT_TIMEOUT: Duration = Duration::from_secs(300);

/// Fixed identity and safety settings for every git call: no hooks, no signing prompts, no
/// background gc racing with concurrent ref updates, and an identity that works on machines
/// without any git config.
const GIT_CONFIG: &[&str] = &[
    "-c",
    "core.hooksPath=/dev/null",
    "-c",
    "commit.gpgsign=false",
    "-c",
    "tag.gpgsign=false",
    "-c",
    "gc.auto=0",
    "-c",
    "maintenance.auto=false",
    "-c",
    "user.name=troupe",
    "-c",
    "user.email=troupe@localhost",
    "-c",
    "core.quotepath=false",
];

/// Runs git in one directory.
#[derive(Debug, Clone)]
pub(crate) struct Git {
    dir: PathBuf,
}

impl Git {
    pub(crate) fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Runs `git <args>` and returns its output whatever the exit code.
    pub(crate) async fn run(&self, args: &[&str]) -> Result<Output, Error> {
        self.run_for(args, GIT_TIMEOUT).await
    }

    /// Runs `git <args>` with a wall-clock limit of `timeout` (a push bounded by a lease).
    pub(crate) async fn run_for(&self, args: &[&str], timeout: Duration) -> Result<Output, Error> {
        self.run_with(args, &[], timeout).await
    }

    /// Runs `git <args>` with extra environment (a remote's credentials) within `timeout`.
    pub(crate) async fn run_with(
        &self,
        args: &[&str],
        env: &[(String, String)],
        timeout: Duration,
    ) -> Result<Output, Error> {
        let cmd = Command::new("git")
            .args(GIT_CONFIG.iter().copied())
            .args(args.iter().copied())
            .cwd(&self.dir)
            .env("GIT_TERMINAL_PROMPT", "0")
            // Commits made by troupe carry the same author and committer.
            .env("GIT_AUTHOR_NAME", "troupe")
            .env("GIT_AUTHOR_EMAIL", "troupe@localhost")
            .env("GIT_COMMITTER_NAME", "troupe")
            .env("GIT_COMMITTER_EMAIL", "troupe@localhost")
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .timeout(timeout)
            .max_output_bytes(16 * 1024 * 1024);
        let output = cmd.run(&CancellationToken::new()).await?;
        if output.termination != troupe_process::Termination::Exited {
            return Err(Error::Git {
                command: format!("git {}", args.join(" ")),
                code: None,
                stderr: format!("git did not finish ({:?})", output.termination),
            });
        }
        Ok(output)
    }

    /// Runs `git <args>`, requires exit 0 and returns stdout with trailing whitespace removed.
    pub(crate) async fn ok(&self, args: &[&str]) -> Result<String, Error> {
        let output = self.run(args).await?;
        if output.success() {
            Ok(output.stdout_text().trim_end().to_owned())
        } else {
            Err(failure(args, &output))
        }
    }
}

/// The error for a git call that exited non-zero.
pub(crate) fn failure(args: &[&str], output: &Output) -> Error {
    Error::Git {
        command: format!("git {}", args.join(" ")),
        code: output.exit_code,
        stderr: troupe_process::tail(&output.stderr_text(), 20, 4000),
    }
}
