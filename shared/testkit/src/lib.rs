//! Test support shared by troupe's integration tests (a dev-dependency only).
//!
//! - [`TestService`] runs a service's `run(config, listener, shutdown)` in-process on an
//!   ephemeral port, already accepting when it returns (no sleeps), and surfaces its error or
//!   panic on [`TestService::stop`].
//! - [`eventually`] polls an async condition with a bounded patience instead of sleeping.
//! - [`git_repo`] makes a real git repository with files and one commit.
//! - [`trace_init`] installs a thread-local log subscriber guard, never a global one.
//! - [`pki::Pki`] makes a throwaway CA, server and client certificates for TLS tests.
//! - [`postgres_url`] and [`fresh_schema`] give a test a PostgreSQL schema of its own, or skip
//!   it (failing under CI) without a server.
//!
//! It depends on no troupe service, so every service can use it without a dependency cycle.

pub mod pki;
mod postgres;

pub use postgres::{fresh_schema, postgres_url};

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A service running in-process on an ephemeral loopback port.
#[derive(Debug)]
pub struct TestService {
    /// Address the service listens on.
    pub addr: SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
}

impl TestService {
    /// Binds `127.0.0.1:0` and runs `run(listener, shutdown)` on it.
    pub async fn spawn<F, Fut, E>(run: F) -> Self
    where
        F: FnOnce(TcpListener, CancellationToken) -> Fut,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<anyhow::Error> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding an ephemeral loopback port works");
        let addr = listener
            .local_addr()
            .expect("a bound listener has an address");
        let shutdown = CancellationToken::new();
        let future = run(listener, shutdown.clone());
        let task = tokio::spawn(async move { future.await.map_err(Into::into) });
        Self {
            addr,
            shutdown,
            task,
        }
    }

    /// Returns `http://<addr>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Returns the token that stops the service.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Stops the service and fails the test if it returned an error or panicked.
    pub async fn stop(self) {
        self.shutdown.cancel();
        match tokio::time::timeout(Duration::from_secs(30), self.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(err))) => panic!("service returned an error: {err:#}"),
            Ok(Err(join)) => panic!("service task panicked: {join}"),
            Err(_) => panic!("service did not stop within 30s of shutdown"),
        }
    }
}

/// How long [`eventually`] waits: `RUST_TEST_PATIENCE_MS`, default 30 s.
pub fn patience() -> Duration {
    std::env::var("RUST_TEST_PATIENCE_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map_or(Duration::from_secs(30), Duration::from_millis)
}

/// Polls `probe` every 20 ms until it returns `Some`, failing after [`patience`].
pub async fn eventually<T, F, Fut>(what: &str, probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    eventually_within(what, patience(), probe).await
}

/// [`eventually`] with a limit of its own, for waits that do real work (a session of several
/// tasks over a git server) and may take longer than [`patience`] on a loaded machine.
pub async fn eventually_within<T, F, Fut>(what: &str, limit: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let limit = limit.max(patience());
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Installs a log subscriber for the current thread only; keep the guard alive.
pub fn trace_init() -> tracing::subscriber::DefaultGuard {
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .finish();
    tracing::subscriber::set_default(subscriber)
}

/// Runs `git` with `args` in `dir` under a fixed identity, failing on a non-zero exit, and
/// returns its trimmed stdout. For fixtures only: services use troupe-workspace.
pub fn git(dir: &Path, args: &[&str]) -> anyhow::Result<String> {
    // std::process is fine here: test fixtures, not service code.
    let output = std::process::Command::new("git")
        .args([
            "-c",
            "user.name=troupe-test",
            "-c",
            "user.email=test@troupe.invalid",
        ])
        .args([
            "-c",
            "init.defaultBranch=main",
            "-c",
            "commit.gpgsign=false",
        ])
        .args(args)
        .current_dir(dir)
        .env("GIT_TERMINAL_PROMPT", "0")
        .output()
        .with_context(|| format!("running git {args:?}"))?;
    if !output.status.success() {
        bail!(
            "git {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// Creates a git repository at `dir` holding `files` (path, contents) in one commit on
/// `main`, and returns the commit id.
pub fn git_repo(dir: &Path, files: &[(&str, &str)]) -> anyhow::Result<String> {
    std::fs::create_dir_all(dir)?;
    git(dir, &["init", "-q", "-b", "main"])?;
    for (path, contents) in files {
        let full = dir.join(path);
        if let Some(parent) = full.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(full, contents)?;
    }
    git(dir, &["add", "-A"])?;
    git(dir, &["commit", "-q", "--allow-empty", "-m", "fixture"])?;
    git(dir, &["rev-parse", "HEAD"])
}

/// Returns the repository root of the troupe workspace (for examples and fixtures).
///
/// Found from the working directory (cargo and nextest run tests in their package's directory)
/// first: the compile-time path is only a fallback, because cargo may reuse this crate's build
/// from another checkout of the same workspace, and that path would point there.
pub fn workspace_root() -> PathBuf {
    let is_root = |dir: &Path| dir.join("proto/troupe/v1/coordinator.proto").is_file();
    if let Ok(cwd) = std::env::current_dir()
        && let Some(root) = cwd.ancestors().find(|dir| is_root(dir))
    {
        return root.to_path_buf();
    }
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .ancestors()
        .nth(2)
        .expect("shared/testkit sits two levels below the workspace root")
        .to_path_buf()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn eventually_returns_the_first_some() {
        let mut calls = 0;
        let value = eventually("third call", || {
            calls += 1;
            let ready = calls >= 3;
            async move { ready.then_some(42) }
        })
        .await;
        assert_eq!(value, 42);
    }

    #[test]
    fn git_repo_makes_a_commit() {
        let dir = tempfile::tempdir().unwrap();
        let head = git_repo(dir.path(), &[("a.txt", "hello\n")]).unwrap();
        assert_eq!(head.len(), 40);
        assert_eq!(git(dir.path(), &["show", "HEAD:a.txt"]).unwrap(), "hello");
    }

    #[test]
    fn workspace_root_has_the_workspace_manifest() {
        assert!(
            workspace_root()
                .join("proto/troupe/v1/coordinator.proto")
                .exists()
        );
    }
}
