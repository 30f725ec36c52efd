//! Helpers for the end-to-end tests: binaries, free ports, child services, the quickstart.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::process::{Child, Command};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use troupe::embedded::{Embedded, EmbeddedConfig};
use troupe_proto::v1::{
    CreateSessionRequest, GetSessionRequest, GetSessionResponse, WatchSessionRequest,
};

/// Path of a binary built by this workspace (`cargo build --workspace` or nextest builds them).
pub(crate) fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary has a path");
    // target/debug/deps/it-<hash> -> target/debug/<name>
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is not built; run `cargo build --workspace` (scripts/test does)",
        path.display()
    );
    path
}

/// A loopback address that was free a moment ago, for binaries that take `--listen`.
pub(crate) fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener
        .local_addr()
        .expect("bound listener has an address")
}

/// The path of an agent CLI: on `PATH`, or where scripts/setup/50-agent-clis.sh installs it.
pub(crate) fn installed_cli(name: &str) -> String {
    if let Some(path) = troupe_process::which(name) {
        return path.display().to_string();
    }
    let installed = troupe_testkit::workspace_root()
        .join("target/tools/npm/bin")
        .join(name);
    assert!(
        installed.is_file(),
        "`{name}` is not installed: run scripts/setup/50-agent-clis.sh (scripts/test does)"
    );
    installed.display().to_string()
}

/// The quickstart example directory.
pub(crate) fn quickstart_dir() -> PathBuf {
    troupe_testkit::workspace_root().join("examples/quickstart")
}

/// A service binary running as a child process, killed if the test panics.
#[derive(Debug)]
pub(crate) struct ChildService {
    pub(crate) name: String,
    pub(crate) addr: SocketAddr,
    pub(crate) child: Child,
    /// For a TLS server: how to reach it (`https://`, its CA); `None` is plaintext.
    pub(crate) tls: Option<troupe_grpc::Connector>,
}

impl ChildService {
    /// Starts `binary args...` with `--listen <free port>` and waits until it answers health.
    pub(crate) async fn start(
        name: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        Self::start_at(name, free_addr(), args, env, None).await
    }

    /// Starts `binary args...` with `--listen addr` (a restart takes the address back), its
    /// stderr (JSON logs at info) appended to `log` when given, and waits until it answers
    /// health.
    pub(crate) async fn start_at(
        name: &str,
        addr: SocketAddr,
        args: &[&str],
        env: &[(&str, &str)],
        log: Option<&Path>,
    ) -> anyhow::Result<Self> {
        Self::spawn(name, addr, args, env, log, None).await
    }

    /// Starts a TLS server (`args` carry its certificate) like [`ChildService::start`]; its
    /// health is checked over `https://` with `ca`.
    pub(crate) async fn start_tls(
        name: &str,
        args: &[&str],
        env: &[(&str, &str)],
        ca: &Path,
    ) -> anyhow::Result<Self> {
        let connector = troupe_grpc::Connector::new(&troupe_grpc::auth::Credentials {
            tls_ca: Some(ca.to_path_buf()),
            ..Default::default()
        })
        .await?;
        Self::spawn(name, free_addr(), args, env, None, Some(connector)).await
    }

    async fn spawn(
        name: &str,
        addr: SocketAddr,
        args: &[&str],
        env: &[(&str, &str)],
        log: Option<&Path>,
        tls: Option<troupe_grpc::Connector>,
    ) -> anyhow::Result<Self> {
        let mut command = Command::new(binary(name));
        command
            .args(args)
            .arg("--listen")
            .arg(addr.to_string())
            .env("TROUPE_LOG_FORMAT", "json")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .kill_on_drop(true);
        match log {
            Some(path) => {
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .with_context(|| format!("opening {}", path.display()))?;
                command.stderr(file);
            }
            None => {
                command.stderr(Stdio::inherit());
            }
        }
        for (key, value) in env {
            command.env(key, value);
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        let service = Self {
            name: name.to_owned(),
            addr,
            child,
            tls,
        };
        service.wait_serving("").await?;
        Ok(service)
    }

    /// Sends `signal` to the process (SIGSTOP, SIGCONT, ...).
    pub(crate) fn signal(&self, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
        let pid = self.child.id().context("child already reaped")?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(i32::try_from(pid)?), signal)?;
        Ok(())
    }

    /// `kill -9`: no shutdown, no flush; waits until it is gone.
    pub(crate) async fn kill9(mut self) -> anyhow::Result<()> {
        self.child.start_kill()?;
        self.child.wait().await?;
        Ok(())
    }

    pub(crate) fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// Waits until the health service reports `service` as SERVING.
    pub(crate) async fn wait_serving(&self, service: &str) -> anyhow::Result<()> {
        let url = self.url();
        let service = service.to_owned();
        let connector = self.tls.clone().unwrap_or_default();
        troupe_testkit::eventually(&format!("{} to serve", self.name), || {
            let url = url.clone();
            let service = service.clone();
            let connector = connector.clone();
            async move {
                health_with(&connector, &url, &service)
                    .await
                    .ok()
                    .filter(|s| *s == ServingStatus::Serving)
            }
        })
        .await;
        Ok(())
    }

    /// Sends SIGTERM and returns the exit status, failing if it takes longer than `within`.
    pub(crate) async fn terminate(
        mut self,
        within: Duration,
    ) -> anyhow::Result<std::process::ExitStatus> {
        let pid = self.child.id().context("child already reaped")?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid)?),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        match tokio::time::timeout(within, self.child.wait()).await {
            Ok(status) => Ok(status?),
            Err(_) => bail!("{} did not exit within {within:?} of SIGTERM", self.name),
        }
    }
}

/// Asks the health service at `url` about `service` ("" = the whole server).
pub(crate) async fn health(url: &str, service: &str) -> anyhow::Result<ServingStatus> {
    health_with(&troupe_grpc::Connector::default(), url, service).await
}

/// [`health`] through `connector` (TLS).
pub(crate) async fn health_with(
    connector: &troupe_grpc::Connector,
    url: &str,
    service: &str,
) -> anyhow::Result<ServingStatus> {
    let mut client = HealthClient::new(connector.channel(url)?);
    let response = client
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await?
        .into_inner();
    Ok(ServingStatus::try_from(response.status)?)
}

/// `CreateSession` of `plan` at the coordinator at `url` (no credentials), its repositories'
/// paths relative to `base_dir`.
pub(crate) async fn create_session(
    url: &str,
    plan: &serde_json::Value,
    base_dir: &Path,
) -> anyhow::Result<troupe_proto::v1::CreateSessionResponse> {
    Ok(troupe_grpc::coordinator_client(url)?
        .create_session(troupe_proto::v1::CreateSessionRequest {
            plan_json: plan.to_string(),
            base_dir: base_dir.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner())
}

/// Starts every service in this process on a port-0 listener; returns the handle and its URL.
pub(crate) async fn start_embedded(
    data_dir: &Path,
    shutdown: &CancellationToken,
) -> anyhow::Result<(Embedded, String)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let embedded = Embedded::start(
        EmbeddedConfig {
            data_dir: data_dir.to_path_buf(),
            executor_concurrency: 2,
            python: "python3".into(),
            security: Default::default(),
        },
        listener,
        shutdown.clone(),
    )
    .await?;
    let url = troupe_grpc::url_for(embedded.addr());
    Ok((embedded, url))
}

/// Submits the quickstart plan to the coordinator at `url`, follows its events to the end and
/// returns the final session.
pub(crate) async fn run_quickstart(url: &str) -> anyhow::Result<GetSessionResponse> {
    run_example(url, "quickstart").await
}

/// Submits `examples/<name>/plan.json` to the coordinator at `url`, follows its events to the
/// end (checking their sequence has no gap or repeat) and returns the final session.
pub(crate) async fn run_example(url: &str, name: &str) -> anyhow::Result<GetSessionResponse> {
    run_example_with(&troupe_grpc::Connector::default(), url, name).await
}

/// [`run_example`] with `connector`'s credentials.
pub(crate) async fn run_example_with(
    connector: &troupe_grpc::Connector,
    url: &str,
    name: &str,
) -> anyhow::Result<GetSessionResponse> {
    let plan_dir = troupe_testkit::workspace_root().join("examples").join(name);
    let plan_json = std::fs::read_to_string(plan_dir.join("plan.json"))?;
    let mut client = connector.coordinator_client(url)?;
    let created = client
        .create_session(CreateSessionRequest {
            plan_json,
            base_dir: plan_dir.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let session_id = created.session.context("no session")?.id;
    let mut events = client
        .watch_session(WatchSessionRequest {
            session_id: session_id.clone(),
            after_sequence: 0,
            follow: false,
        })
        .await?
        .into_inner();
    let mut last_sequence = 0;
    let drain = async {
        while let Some(event) = events.next().await {
            let event = event?;
            assert_eq!(
                event.sequence,
                last_sequence + 1,
                "event sequence has a gap or repeat"
            );
            last_sequence = event.sequence;
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(Duration::from_secs(240), drain)
        .await
        .with_context(|| format!("the {name} example did not finish within 240 s"))??;
    Ok(client
        .get_session(GetSessionRequest {
            session_id,
            ..Default::default()
        })
        .await?
        .into_inner())
}

/// Asserts what a successful quickstart must show: every task completed, IMPL commits on the
/// session branch, the validator's checks and the test-runner's parsed totals and coverage.
pub(crate) fn assert_quickstart_completed(response: &GetSessionResponse) -> anyhow::Result<()> {
    use troupe_proto::v1::{SessionState, TaskState, TestOutcome, Verdict, task_result::Detail};

    let session = response.session.as_ref().context("no session")?;
    let report = troupe::report::final_report(response);
    assert_eq!(
        session.state,
        SessionState::Completed as i32,
        "session did not complete:\n{report}"
    );
    assert_eq!(response.tasks.len(), 6);
    for task in &response.tasks {
        assert_eq!(
            task.state,
            TaskState::Completed as i32,
            "{} did not complete:\n{report}",
            task.id
        );
    }
    let task = |id: &str| {
        response
            .tasks
            .iter()
            .find(|task| task.id == id)
            .unwrap_or_else(|| panic!("no task {id}"))
    };

    // The session branch holds both IMPL commits, on top of the base commit.
    let repo = session.repos.first().context("no repo")?;
    let repo_path = Path::new(&repo.path);
    let log = troupe_testkit::git(
        repo_path,
        &[
            "log",
            "--format=%s",
            &format!("{}..{}", repo.base_commit, repo.branch),
        ],
    )?;
    assert!(
        log.contains("IMPL-001"),
        "no IMPL-001 commit on {}:\n{log}",
        repo.branch
    );
    assert!(
        log.contains("IMPL-002"),
        "no IMPL-002 commit on {}:\n{log}",
        repo.branch
    );
    let report_py = troupe_testkit::git(
        repo_path,
        &["show", &format!("{}:stats/report.py", repo.branch)],
    )?;
    assert!(report_py.contains("def summary("));
    // The repo's own checkout is untouched: work happens on branches and worktrees only.
    assert!(!repo_path.join("stats/report.py").exists());

    let impl_2 = task("IMPL-002")
        .result
        .as_ref()
        .context("IMPL-002 has no result")?;
    assert!(
        impl_2.files_modified.iter().any(|f| f == "stats/report.py"),
        "{:?}",
        impl_2.files_modified
    );

    let validation = match task("VALIDATE-001")
        .result
        .as_ref()
        .and_then(|r| r.detail.as_ref())
    {
        Some(Detail::Validation(validation)) => validation,
        other => bail!("VALIDATE-001 has no validation report: {other:?}"),
    };
    assert_ne!(validation.verdict, Verdict::Fail as i32);
    assert!(
        validation
            .checks
            .iter()
            .any(|c| c.kind() == troupe_proto::v1::CheckKind::File),
        "no file checks: {:?}",
        validation.checks
    );
    assert!(
        validation
            .checks
            .iter()
            .any(|c| c.kind() == troupe_proto::v1::CheckKind::Verification),
        "no verification check"
    );

    // The validators wrote each IMPL task's own criterion results back onto its record.
    for id in ["IMPL-001", "IMPL-002"] {
        let convergence = task(id)
            .convergence
            .as_ref()
            .with_context(|| format!("{id} has no convergence written back"))?;
        assert_eq!(
            (
                convergence.verified.as_slice(),
                troupe_proto::names::name(convergence.met())
            ),
            (&[true, true][..], "pass"),
            "{id}: {convergence:?}"
        );
        assert!(
            ["VALIDATE-001", "VERIFY-001"].contains(&convergence.checked_by.as_str()),
            "{id}: {convergence:?}"
        );
    }

    let run = match task("TESTRUN-001")
        .result
        .as_ref()
        .and_then(|r| r.detail.as_ref())
    {
        Some(Detail::TestRun(run)) => run,
        other => bail!("TESTRUN-001 has no test report: {other:?}"),
    };
    assert_eq!(run.outcome, TestOutcome::Passed as i32, "{run:?}");
    let totals = run.totals.context("no totals")?;
    // 2 tests in the base repo, 3 from IMPL-001, 1 from IMPL-002.
    assert_eq!(
        (totals.total, totals.passed, totals.failed),
        (6, 6, 0),
        "{totals:?}"
    );
    let coverage = run
        .coverage
        .as_ref()
        .and_then(|c| c.lines)
        .context("no line coverage")?;
    assert!((coverage - 100.0).abs() < 1e-9, "line coverage {coverage}");

    // IMPL-002's agent wrote a wrong expectation; the fix loop repaired the test (tests only)
    // and integrated the fix into the session branch before VERIFY-001 looked at it.
    let fix_loop = run
        .fix_loop
        .as_ref()
        .context("TESTRUN-001 ran no fix loop")?;
    assert!(fix_loop.succeeded, "{fix_loop:?}");
    assert_eq!(fix_loop.iterations.len(), 1, "{fix_loop:?}");
    assert_eq!(
        troupe_proto::names::name(fix_loop.iterations[0].verdict()),
        "kept",
        "{fix_loop:?}"
    );
    assert!(fix_loop.flaky_tests.is_empty(), "{fix_loop:?}");
    let fixed_test = troupe_testkit::git(
        repo_path,
        &["show", &format!("{}:tests/test_report.py", repo.branch)],
    )?;
    assert!(
        fixed_test.contains("median=2.5"),
        "the fix is not on {}:\n{fixed_test}",
        repo.branch
    );

    let review = match task("REVIEW-001")
        .result
        .as_ref()
        .and_then(|r| r.detail.as_ref())
    {
        Some(Detail::Validation(validation)) => {
            validation.review.as_ref().context("no review report")?
        }
        other => bail!("REVIEW-001 has no validation report: {other:?}"),
    };
    assert_eq!(
        review.verdict,
        troupe_proto::v1::ReviewVerdict::Approve as i32,
        "{review:?}"
    );

    let verification = match task("VERIFY-001")
        .result
        .as_ref()
        .and_then(|r| r.detail.as_ref())
    {
        Some(Detail::Validation(validation)) => validation
            .verification
            .as_ref()
            .context("no goal verification")?,
        other => bail!("VERIFY-001 has no validation report: {other:?}"),
    };
    assert_eq!(
        troupe_proto::names::name(verification.status()),
        "passed",
        "{verification:?}"
    );
    assert_eq!(
        (verification.tasks_checked, verification.tasks_passed),
        (2, 2),
        "{verification:?}"
    );
    assert!(verification.gaps.is_empty(), "{verification:?}");
    assert!(
        Path::new(&verification.path).is_file(),
        "no verification.md at {}",
        verification.path
    );
    Ok(())
}
