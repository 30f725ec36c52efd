//! One agent run with the executor's failure policy: retries with a doubling backoff on
//! transient classified errors, then the next backend of the fallback chain.
//!
//! The policy (the same as the executor's): rate limits, crashes, timeouts and bad output are
//! retried with the same backend (`retries` times, from `retry_backoff_ms`); not installed,
//! auth, quota and the retryable kinds once their retries are spent move on to the next
//! backend; an invalid task, an internal error or a cancel stops at once. The `command`
//! backend never falls back: its argv is the caller's own program. Between attempts the
//! caller's `reset` puts the worktree back.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::{BackendError, BackendsConfig, ErrorKind, RunOutcome, RunSpec};

/// Whether another backend may succeed where one failed with `kind`.
pub fn falls_back(kind: ErrorKind) -> bool {
    matches!(
        kind,
        ErrorKind::NotInstalled
            | ErrorKind::Auth
            | ErrorKind::RateLimited
            | ErrorKind::Quota
            | ErrorKind::Crash
            | ErrorKind::Timeout
            | ErrorKind::BadOutput
            | ErrorKind::PermissionDenied
    )
}

/// Whether the same backend should be tried again (after a backoff) with `kind`.
pub fn retries_same(kind: ErrorKind) -> bool {
    matches!(
        kind,
        ErrorKind::RateLimited | ErrorKind::Crash | ErrorKind::Timeout | ErrorKind::BadOutput
    )
}

/// The backends to try: `first`, then `fallback` (or the configuration's chain when `None`),
/// never a fallback after `command`.
pub fn candidates(
    first: &str,
    fallback: Option<&[String]>,
    config: &BackendsConfig,
) -> Vec<String> {
    let mut out = vec![first.to_owned()];
    if first != "command" {
        for name in fallback.unwrap_or(&config.fallback) {
            if !out.contains(name) {
                out.push(name.clone());
            }
        }
    }
    out
}

/// What a chain run produced.
#[derive(Debug)]
pub struct ChainOutcome {
    /// The backend whose run is `result` (the last one tried).
    pub backend: String,
    /// Backends that failed first with a classified error, in order.
    pub fallbacks: Vec<String>,
    /// Every failed attempt's error, in order.
    pub errors: Vec<String>,
    /// The last run's outcome.
    pub result: Result<RunOutcome, BackendError>,
}

/// Runs `spec` with the first of `chain` that succeeds, under the configuration's retry policy.
/// `spec_for` adapts the spec per backend and attempt (its home directory, its timeout);
/// `reset` runs after a failed attempt, before the next.
pub async fn run_chain<F, R, Fut>(
    chain: &[String],
    config: &BackendsConfig,
    mut spec_for: F,
    mut reset: R,
    cancel: &CancellationToken,
) -> ChainOutcome
where
    F: FnMut(&str, u32) -> RunSpec,
    R: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut fallbacks = Vec::new();
    let mut errors = Vec::new();
    let mut last: Option<(String, BackendError)> = None;
    let mut runs = 0u32;
    for name in chain {
        let Some(backend) = crate::by_name_with(name, config) else {
            let err = BackendError::InvalidTask {
                message: format!("unknown backend `{name}`"),
            };
            errors.push(err.to_string());
            last = Some((name.clone(), err));
            break;
        };
        let mut attempt = 0u32;
        let err = loop {
            runs += 1;
            match backend.run(spec_for(name, runs), cancel).await {
                Ok(outcome) => {
                    return ChainOutcome {
                        backend: name.clone(),
                        fallbacks,
                        errors,
                        result: Ok(outcome),
                    };
                }
                Err(err) => {
                    errors.push(err.to_string());
                    let kind = err.kind();
                    if matches!(
                        kind,
                        ErrorKind::Cancelled | ErrorKind::InvalidTask | ErrorKind::Internal
                    ) {
                        return ChainOutcome {
                            backend: name.clone(),
                            fallbacks,
                            errors,
                            result: Err(err),
                        };
                    }
                    reset().await;
                    if retries_same(kind) && attempt < config.retries {
                        let backoff = config.retry_backoff_ms.saturating_mul(1 << attempt.min(10));
                        attempt += 1;
                        tokio::select! {
                            () = cancel.cancelled() => break BackendError::Cancelled,
                            () = tokio::time::sleep(Duration::from_millis(backoff)) => {}
                        }
                        continue;
                    }
                    break err;
                }
            }
        };
        let stop = !falls_back(err.kind());
        last = Some((name.clone(), err));
        if stop {
            break;
        }
        fallbacks.push(name.clone());
    }
    let (backend, err) = last.unwrap_or_else(|| {
        (
            chain.first().cloned().unwrap_or_default(),
            BackendError::Internal {
                message: "no backend to run".to_owned(),
            },
        )
    });
    // The last backend tried is the one the error belongs to, not a fallback.
    if fallbacks.last() == Some(&backend) {
        fallbacks.pop();
    }
    ChainOutcome {
        backend,
        fallbacks,
        errors,
        result: Err(err),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn command_never_falls_back() {
        let config = BackendsConfig::default();
        assert_eq!(candidates("command", None, &config), ["command"]);
        assert_eq!(
            candidates("codex", None, &config),
            ["codex", "gemini", "qwen"]
        );
        assert_eq!(
            candidates("claude", Some(&["codex".to_owned()]), &config),
            ["claude", "codex"]
        );
    }

    #[tokio::test]
    async fn a_missing_program_falls_back_and_a_crash_is_retried() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = BackendsConfig {
            retries: 1,
            retry_backoff_ms: 1,
            ..BackendsConfig::default()
        };
        // `codex` made to point at a program that is not there: not installed, so the chain
        // moves on to `command`-free fallbacks; here the chain is codex then claude, both absent.
        for name in ["codex", "claude"] {
            config.backends.insert(
                name.to_owned(),
                crate::BackendConfig {
                    command: Some(format!("/nonexistent/{name}")),
                    ..crate::BackendConfig::default()
                },
            );
        }
        let chain = candidates("codex", Some(&["claude".to_owned()]), &config);
        let mut resets = 0;
        let outcome = run_chain(
            &chain,
            &config,
            |_, _| RunSpec {
                worktree: dir.path().to_path_buf(),
                prompt: "hi".into(),
                prompt_file: dir.path().join("prompt.md"),
                home: Some(dir.path().join("home")),
                placeholders: BTreeMap::new(),
                ..RunSpec::default()
            },
            || {
                resets += 1;
                async {}
            },
            &CancellationToken::new(),
        )
        .await;
        let err = outcome.result.expect_err("nothing is installed");
        assert_eq!(err.kind(), ErrorKind::NotInstalled);
        assert_eq!(outcome.backend, "claude");
        assert_eq!(outcome.fallbacks, ["codex"]);
        assert_eq!(outcome.errors.len(), 2);
        assert_eq!(resets, 2);

        // A crashing command is retried once (retries = 1), then given up: no fallback.
        let outcome = run_chain(
            &["command".to_owned()],
            &config,
            |_, _| RunSpec {
                worktree: dir.path().to_path_buf(),
                prompt: "hi".into(),
                prompt_file: dir.path().join("prompt.md"),
                command: vec!["false".into()],
                ..RunSpec::default()
            },
            || async {},
            &CancellationToken::new(),
        )
        .await;
        assert_eq!(
            outcome.result.expect_err("false fails").kind(),
            ErrorKind::Crash
        );
        assert_eq!(outcome.errors.len(), 2);
        assert!(outcome.fallbacks.is_empty());
    }
}
