//! The project's own environment and build steps: the allow-listed `env`, the `setup`
//! commands run in the worktree before the suite, and the generated files a checkout has but a
//! fresh worktree lacks (gitignored build output such as a setuptools-scm version file or
//! compiled `.mo` catalogues).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use troupe_process::{Command, Termination};
use troupe_proto::v1::SetupStep;

use crate::Error;

/// Checks a run's `env` against the allow-list; every refused name is listed.
pub(crate) fn check_env(env: &BTreeMap<String, String>) -> Result<(), Error> {
    let refused: Vec<&str> = env
        .keys()
        .map(String::as_str)
        .filter(|name| !troupe_plan::spec::test_env_allowed(name))
        .collect();
    if refused.is_empty() {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "env names not allowed: {} (allowed: {}, and names starting with {})",
        refused.join(", "),
        troupe_plan::spec::TEST_ENV_ALLOWED.join(", "),
        troupe_plan::spec::TEST_ENV_ALLOWED_PREFIXES.join(", ")
    )))
}

/// Checks `setup` commands: each a non-empty argv.
pub(crate) fn check_setup(setup: &[Vec<String>]) -> Result<(), Error> {
    for (index, argv) in setup.iter().enumerate() {
        if argv.first().is_none_or(|p| p.trim().is_empty()) {
            return Err(Error::InvalidArgument(format!(
                "setup command {} is empty (each is an argv: [program, args...])",
                index + 1
            )));
        }
    }
    Ok(())
}

/// Checks a repo-relative `workdir`: no absolute path, no `..`.
pub(crate) fn check_workdir(workdir: &str) -> Result<(), Error> {
    let path = Path::new(workdir);
    if path.is_absolute()
        || path
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(Error::InvalidArgument(format!(
            "workdir must be a path inside the repository, got {workdir:?}"
        )));
    }
    Ok(())
}

/// Runs the setup commands in order in `cwd`; stops at the first that fails. Returns the
/// steps and whether all succeeded.
pub(crate) async fn run_setup(
    setup: &[Vec<String>],
    cwd: &Path,
    env: &BTreeMap<String, String>,
    limit: Duration,
    sandbox: &troupe_process::Sandbox,
    cancel: &CancellationToken,
) -> Result<(Vec<SetupStep>, bool), Error> {
    let mut steps = Vec::new();
    for argv in setup {
        let output = Command::from_argv(argv)
            .map_err(|source| Error::process(&argv[0], source))?
            .cwd(cwd)
            .envs(env.clone())
            .env("CI", "true")
            .timeout(limit)
            .max_output_bytes(256 * 1024)
            .sandbox(sandbox.clone())
            .run(cancel)
            .await;
        let output = match output {
            Ok(output) => output,
            // A program that is not there is this step failing, not the service.
            Err(troupe_process::Error::NotFound { program }) => {
                steps.push(SetupStep {
                    argv: argv.clone(),
                    exit_code: -1,
                    duration_ms: 0,
                    output_tail: format!("program `{program}` not found"),
                });
                return Ok((steps, false));
            }
            Err(source) => return Err(Error::process(&argv[0], source)),
        };
        if output.termination == Termination::Cancelled {
            return Err(Error::Cancelled);
        }
        let ok = output.termination == Termination::Exited && output.success();
        let mut tail = troupe_process::tail(
            &format!("{}\n{}", output.stdout_text(), output.stderr_text()),
            20,
            4000,
        );
        if matches!(
            output.termination,
            Termination::TimedOut | Termination::IdleTimedOut
        ) {
            tail = format!("timed out after {}s\n{tail}", limit.as_secs());
        } else if !ok && let Some(denied) = sandbox.denied(&tail, Some(cwd)) {
            tail = format!("{}{denied}\n{tail}", crate::sandbox::DENIED);
        }
        steps.push(SetupStep {
            argv: argv.clone(),
            exit_code: output.exit_code.unwrap_or(-1),
            duration_ms: u64::try_from(output.duration.as_millis()).unwrap_or(u64::MAX),
            output_tail: tail,
        });
        if !ok {
            return Ok((steps, false));
        }
    }
    Ok((steps, true))
}

/// Paths that are never build output worth mentioning: installs, caches, editor files.
fn noise(path: &str) -> bool {
    let parts: Vec<&str> = path.trim_end_matches('/').split('/').collect();
    let name = parts.last().copied().unwrap_or("");
    parts.iter().any(|p| {
        matches!(
            *p,
            "node_modules"
                | ".git"
                | ".venv"
                | "venv"
                | "env"
                | ".tox"
                | ".nox"
                | "__pycache__"
                | ".pytest_cache"
                | ".mypy_cache"
                | ".ruff_cache"
                | ".cache"
                | ".idea"
                | ".vscode"
                | "coverage"
                | ".nyc_output"
                | "htmlcov"
                | ".troupe"
                | ".yarn"
                | ".pnpm-store"
                | ".next"
                | ".turbo"
        )
    }) || name.ends_with(".pyc")
        || name.ends_with(".log")
        || name.ends_with(".swp")
        || name.starts_with(".coverage")
        || name == ".DS_Store"
        || name == ".env"
        || name.ends_with(".egg-info")
}

/// Gitignored files (or directories) the checkout has and the worktree lacks, repo-relative:
/// build output the suite may need. `git ls-files --others --ignored --directory` lists them
/// in the checkout, without descending into ignored directories.
pub(crate) async fn missing_generated(
    checkout: &Path,
    worktree: &Path,
    cancel: &CancellationToken,
) -> Vec<String> {
    let output = Command::new("git")
        .args([
            "ls-files",
            "--others",
            "--ignored",
            "--exclude-standard",
            "--directory",
            "-z",
        ])
        .cwd(checkout)
        .timeout(Duration::from_secs(60))
        .run(cancel)
        .await;
    let Ok(output) = output else {
        return Vec::new();
    };
    if !output.success() {
        return Vec::new();
    }
    let mut missing: Vec<String> = output
        .stdout_text()
        .split('\0')
        .filter(|p| !p.is_empty() && !noise(p))
        .filter(|p| std::fs::symlink_metadata(worktree.join(p.trim_end_matches('/'))).is_err())
        .map(|p| p.trim_end_matches('/').to_owned())
        .collect();
    missing.sort();
    missing
}

/// Skips that look caused by missing files: the reason names one of `missing`, or says a
/// file, module or resource is missing.
pub(crate) fn skips_for_missing(reasons: &BTreeMap<String, u32>, missing: &[String]) -> u32 {
    let names: Vec<&str> = missing
        .iter()
        .filter_map(|p| Path::new(p).file_name()?.to_str())
        .collect();
    reasons
        .iter()
        .filter(|(reason, _)| {
            let lower = reason.to_ascii_lowercase();
            names.iter().any(|n| reason.contains(n))
                || [
                    "no such file",
                    "not found",
                    "missing",
                    "could not import",
                    "not available",
                    "not installed",
                    "not built",
                    "not compiled",
                ]
                .iter()
                .any(|k| lower.contains(k))
        })
        .map(|(_, count)| *count)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_is_allow_listed() {
        let ok: BTreeMap<String, String> =
            [("TZ", "UTC"), ("LC_ALL", "C"), ("NODE_OPTIONS", "--x")]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
        check_env(&ok).expect("allowed");
        let bad: BTreeMap<String, String> = [("PATH", "/evil"), ("AWS_SECRET", "x"), ("TZ", "UTC")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        let err = check_env(&bad).expect_err("refused").to_string();
        assert!(err.contains("AWS_SECRET, PATH"), "{err}");
        assert!(check_workdir("packages/a").is_ok());
        assert!(check_workdir("../x").is_err());
        assert!(check_workdir("/abs").is_err());
        assert!(check_setup(&[vec![]]).is_err());
    }

    #[test]
    fn counts_skips_for_missing_files() {
        let reasons: BTreeMap<String, u32> = [
            ("messages.mo not compiled".to_owned(), 140),
            ("needs network".to_owned(), 3),
            ("could not import 'numpy'".to_owned(), 4),
        ]
        .into_iter()
        .collect();
        assert_eq!(
            skips_for_missing(&reasons, &["locale/de/messages.mo".to_owned()]),
            144
        );
        assert!(noise("node_modules/"));
        assert!(noise("src/pkg/__pycache__/"));
        assert!(!noise("src/pkg/_version.py"));
    }
}
