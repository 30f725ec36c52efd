//! Running the external tools checks need (tsc, node, python, cargo, ruff, flake8, npm, the
//! commands criteria name): argv only, in the checked worktree, own process group, timeout,
//! with the validator's tool directories in front of `PATH`.

use std::path::{Path, PathBuf};
use std::sync::LazyLock;
use std::time::Duration;

use regex::Regex;
use tokio_util::sync::CancellationToken;
use troupe_process::{Command, Output, Termination};
use troupe_proto::v1::CheckStatus;

use crate::Error;

/// Where tools are looked up, and the `PATH` children get.
#[derive(Debug, Clone, Default)]
pub struct Tools {
    dirs: Vec<PathBuf>,
    /// The sandbox every tool runs under (see [`Tools::confined`]); `None`: not confined.
    sandbox: Option<troupe_process::Sandbox>,
}

/// How a tool run ended, already classified for a check.
#[derive(Debug)]
pub(crate) enum Ran {
    /// The tool ran to an exit (code or signal).
    Exited(Output),
    /// The program is not installed.
    Missing(String),
    /// It hit the time limit and its group was killed.
    TimedOut(Output),
}

impl Tools {
    /// Tools looked up in `dirs` first, then on `PATH`.
    pub fn new(dirs: Vec<PathBuf>) -> Self {
        Self {
            dirs,
            sandbox: None,
        }
    }

    /// These tools, also allowed to write `path` (which must exist), when confined.
    pub(crate) fn granting_write(&self, path: &Path) -> Self {
        Self {
            dirs: self.dirs.clone(),
            sandbox: self.sandbox.clone().map(|sandbox| sandbox.write(path)),
        }
    }

    /// These tools, run under `sandbox` (checks of one worktree: read-only on it).
    pub(crate) fn confined(&self, sandbox: troupe_process::Sandbox) -> Self {
        Self {
            dirs: self.dirs.clone(),
            sandbox: Some(sandbox),
        }
    }

    /// `PATH` for children: the tool directories, then ours.
    fn path_var(&self) -> String {
        let inherited = std::env::var_os("PATH").unwrap_or_default();
        let dirs = self
            .dirs
            .iter()
            .cloned()
            .chain(std::env::split_paths(&inherited));
        std::env::join_paths(dirs)
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_else(|_| inherited.to_string_lossy().into_owned())
    }

    /// The absolute path of `program`, if installed (a path with `/` is taken as given,
    /// relative to `cwd`).
    pub(crate) fn find(&self, program: &str, cwd: &Path) -> Option<PathBuf> {
        if program.contains('/') {
            let path = cwd.join(program);
            return path.is_file().then_some(path);
        }
        self.dirs
            .iter()
            .map(|dir| dir.join(program))
            .find(|candidate| candidate.is_file())
            .or_else(|| troupe_process::which(program))
    }

    /// Runs `argv` in `cwd` with `timeout`. Only supervision failures are errors; a missing
    /// program or a timeout is a [`Ran`] the caller turns into an ERROR check.
    pub(crate) async fn run(
        &self,
        argv: &[String],
        cwd: &Path,
        timeout: Duration,
        stdin: Option<Vec<u8>>,
        cancel: &CancellationToken,
    ) -> Result<Ran, Error> {
        let Some(program) = argv.first() else {
            return Ok(Ran::Missing(String::new()));
        };
        let Some(resolved) = self.find(program, cwd) else {
            return Ok(Ran::Missing(program.clone()));
        };
        let mut command = Command::new(resolved.display().to_string())
            .args(argv.iter().skip(1).cloned())
            .cwd(cwd)
            .env("PATH", self.path_var())
            .env("CI", "true")
            .env("NO_COLOR", "1")
            .env("FORCE_COLOR", "0")
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env_passthrough("CARGO_HOME")
            .env_passthrough("RUSTUP_HOME")
            .env_passthrough("RUSTUP_TOOLCHAIN")
            .timeout(timeout)
            .max_output_bytes(256 * 1024);
        if let Some(bytes) = stdin {
            command = command.stdin(bytes);
        }
        if let Some(sandbox) = &self.sandbox {
            // The worktree is read-only: caches that tools keep beside the code go to the
            // tool's own home (`py_compile` writes `__pycache__`, ruff `.ruff_cache`).
            if let Some(home) = sandbox.home_dir() {
                command = command
                    .env(
                        "PYTHONPYCACHEPREFIX",
                        home.join("pycache").display().to_string(),
                    )
                    .env(
                        "RUFF_CACHE_DIR",
                        home.join("ruff-cache").display().to_string(),
                    );
            }
            command = command.sandbox(sandbox.clone());
        }
        match command.run(cancel).await {
            Ok(mut output) => {
                // A refusal of the sandbox is said first, so evidence names it.
                if !output.success()
                    && let Some(denied) = self
                        .sandbox
                        .as_ref()
                        .and_then(|sandbox| sandbox.denied(&combined(&output), Some(cwd)))
                {
                    let mut stderr =
                        format!("{}{denied}\n", crate::validate::SANDBOX_DENIED).into_bytes();
                    stderr.extend_from_slice(&output.stderr);
                    output.stderr = stderr;
                }
                match output.termination {
                    Termination::Cancelled => Err(Error::Cancelled),
                    Termination::TimedOut | Termination::IdleTimedOut => Ok(Ran::TimedOut(output)),
                    Termination::Exited => Ok(Ran::Exited(output)),
                }
            }
            Err(troupe_process::Error::NotFound { program }) => Ok(Ran::Missing(program)),
            Err(err) => Err(Error::Process(err)),
        }
    }
}

/// Stdout then stderr, for evidence.
pub(crate) fn combined(output: &Output) -> String {
    let (out, err) = (output.stdout_text(), output.stderr_text());
    match (out.trim().is_empty(), err.trim().is_empty()) {
        (_, true) => out,
        (true, false) => err,
        (false, false) => format!("{out}\n{err}"),
    }
}

/// A check's status and evidence for a tool run where exit 0 passes: the locations the tool
/// named (`file:line`) first, then the tail of its output.
pub(crate) fn judge_exit(ran: Ran, what: &str, worktree: &Path) -> (CheckStatus, String) {
    match ran {
        Ran::Missing(program) => (
            CheckStatus::Error,
            format!("{what}: `{program}` is not installed"),
        ),
        Ran::TimedOut(output) => (
            CheckStatus::Error,
            format!(
                "{what}: timed out after {:.0}s; its process group was killed\n{}",
                output.duration.as_secs_f64(),
                troupe_process::tail(&combined(&output), 20, 3000)
            ),
        ),
        Ran::Exited(output) => {
            let text = strip_prefix(&combined(&output), worktree);
            let tail = troupe_process::tail(&text, 30, 3000);
            let secs = output.duration.as_secs_f64();
            match output.exit_code {
                Some(0) => (
                    CheckStatus::Pass,
                    format!("{what}: exit 0 in {secs:.1}s\n{tail}")
                        .trim_end()
                        .to_owned(),
                ),
                code => {
                    let places = locations(&text);
                    let at = if places.is_empty() {
                        String::new()
                    } else {
                        format!(" at {}", places.join(", "))
                    };
                    (
                        CheckStatus::Fail,
                        format!(
                            "{what}: exit {}{at} in {secs:.1}s\n{tail}",
                            code.map_or_else(|| "by signal".to_owned(), |c| c.to_string())
                        ),
                    )
                }
            }
        }
    }
}

/// Removes the worktree's absolute path so evidence names repo-relative files.
pub(crate) fn strip_prefix(text: &str, worktree: &Path) -> String {
    let prefix = format!("{}/", worktree.display());
    text.replace(&prefix, "")
}

static LOCATION: LazyLock<Vec<Regex>> = LazyLock::new(|| {
    [
        // tsc: `src/a.ts(3,7): error TS2322`
        r"(?m)^([\w./@-]+\.[A-Za-z]+)\((\d+),\d+\)",
        // python tracebacks and PyYAML: `File "a.py", line 3` / `in "a.yaml", line 3`
        r#""([^"]+)", line (\d+)"#,
        // gcc-style, cargo short, ruff, flake8, node: `a.py:3:1:` / `a.js:3`
        r"(?m)(?:^|\s|-->\s)([\w./@-]+\.[A-Za-z]+):(\d+)",
    ]
    .iter()
    .map(|re| Regex::new(re).expect("location patterns are valid"))
    .collect()
});

/// `file:line` places a tool's output names, in order, without duplicates (at most 10).
pub(crate) fn locations(text: &str) -> Vec<String> {
    let mut found: Vec<(usize, String)> = Vec::new();
    for re in LOCATION.iter() {
        for caps in re.captures_iter(text) {
            let (Some(whole), Some(file), Some(line)) = (caps.get(0), caps.get(1), caps.get(2))
            else {
                continue;
            };
            let place = format!("{}:{}", file.as_str(), line.as_str());
            if !found.iter().any(|(_, p)| *p == place) {
                found.push((whole.start(), place));
            }
        }
    }
    found.sort_by_key(|(at, _)| *at);
    found.into_iter().take(10).map(|(_, p)| p).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_locations_in_tool_output() {
        assert_eq!(
            locations("src/a.ts(3,7): error TS2322: Type 'string'"),
            ["src/a.ts:3"]
        );
        assert_eq!(
            locations("  File \"pkg/m.py\", line 4\n    def f(:\nSyntaxError"),
            ["pkg/m.py:4"]
        );
        assert_eq!(
            locations("bad.js:2\nfunction (\n\nSyntaxError: Unexpected token"),
            ["bad.js:2"]
        );
        assert_eq!(
            locations("src/lib.rs:3:5: error[E0308]: mismatched types"),
            ["src/lib.rs:3"]
        );
        assert!(locations("all good").is_empty());
    }
}
