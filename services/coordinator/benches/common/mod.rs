//! What every coordinator benchmark starts from: a coordinator on a port-0 listener (or, with
//! [`Bench::spawn`], the `troupe-coordinator` binary as a process of its own), on SQLite or a
//! fresh schema of the PostgreSQL named by TROUPE_BENCH_DATABASE_URL (or
//! TROUPE_TEST_DATABASE_URL), next to a one-commit git repository under `<dir>/plan/repo`.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A running coordinator and its client.
pub(crate) struct Bench {
    pub(crate) client: troupe_grpc::CoordinatorClient,
    /// The plans' base directory: holds `repo/`.
    pub(crate) base_dir: String,
    server: Server,
    /// PostgreSQL: the server's URL and the run's schema, dropped by [`Bench::stop`].
    schema: Option<(String, String)>,
    _dir: tempfile::TempDir,
}

/// Where the coordinator runs.
enum Server {
    /// In this process, on a runtime of its own.
    InProcess {
        shutdown: CancellationToken,
        server: JoinHandle<Result<(), troupe_coordinator::Error>>,
        runtime: Option<tokio::runtime::Runtime>,
    },
    /// The `troupe-coordinator` binary as a child process (killed if the bench fails).
    #[allow(dead_code)] // Not every benchmark spawns it.
    Child(tokio::process::Child),
}

/// The database of one run: the coordinator's URL for it (`None`: SQLite in the data
/// directory), and for PostgreSQL the server's URL and the run's schema.
async fn database(db: &str) -> anyhow::Result<(Option<String>, Option<(String, String)>)> {
    match db {
        "sqlite" => Ok((None, None)),
        "postgres" => {
            let url = std::env::var("TROUPE_BENCH_DATABASE_URL")
                .or_else(|_| std::env::var("TROUPE_TEST_DATABASE_URL"))
                .context(
                    "set TROUPE_BENCH_DATABASE_URL (or source scripts/setup/20-postgres.sh)",
                )?;
            let schema = fresh_schema(&url).await?;
            Ok((Some(in_schema(&url, &schema)), Some((url, schema))))
        }
        other => bail!("unknown --db {other}"),
    }
}

impl Bench {
    /// Starts a coordinator on `db` (`sqlite` or `postgres`) with `tuning`.
    pub(crate) async fn start(
        db: &str,
        tuning: troupe_coordinator::Tuning,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let mut config = troupe_coordinator::Config::new(dir.path().join("data"));
        let (database_url, schema) = database(db).await?;
        config.database_url = database_url;
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let url = format!("http://{}", listener.local_addr()?);
        let shutdown = CancellationToken::new();
        // The coordinator gets a runtime of its own, as in its own process: the benchmark's
        // workers do not queue its tasks behind theirs.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("coordinator")
            .build()?;
        let listener = {
            let _on = runtime.enter();
            tokio::net::TcpListener::from_std(listener)?
        };
        let server = runtime.spawn(troupe_coordinator::run_tuned(
            config,
            tuning,
            listener,
            shutdown.clone(),
        ));
        let base_dir = plan_repo(dir.path())?;
        Ok(Self {
            client: troupe_grpc::coordinator_client(&url)?,
            base_dir,
            server: Server::InProcess {
                shutdown,
                server,
                runtime: Some(runtime),
            },
            schema,
            _dir: dir,
        })
    }

    /// Starts the coordinator binary `bin` as a process of its own on `db`, listening on a
    /// loopback port that was free a moment ago, with its default tuning; returns once it
    /// answers.
    #[allow(dead_code)] // Not every benchmark spawns it.
    pub(crate) async fn spawn(db: &str, bin: &Path) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let (database_url, schema) = database(db).await?;
        let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let mut command = tokio::process::Command::new(bin);
        command
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .env_remove("TROUPE_DATABASE_URL")
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true);
        if let Some(url) = &database_url {
            command.arg("--database-url").arg(url);
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let client = troupe_grpc::coordinator_client(&format!("http://{addr}"))?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait()? {
                bail!("{} exited before it served: {status}", bin.display());
            }
            let probe = client
                .clone()
                .list_sessions(troupe_proto::v1::ListSessionsRequest::default())
                .await;
            match probe {
                Ok(_) => break,
                // Not listening yet.
                Err(_) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(status) => bail!("{} did not serve within 60 s: {status}", bin.display()),
            }
        }
        let base_dir = plan_repo(dir.path())?;
        Ok(Self {
            client,
            base_dir,
            server: Server::Child(child),
            schema,
            _dir: dir,
        })
    }

    /// The coordinator's resident set, peak (`VmHWM`) and current (`VmRSS`), from
    /// /proc/<pid>/status: the child's, or this process's when the coordinator runs in it.
    #[allow(dead_code)] // Not every benchmark reports it.
    pub(crate) fn memory(&self) -> String {
        let path = match &self.server {
            Server::Child(child) => child.id().map(|pid| format!("/proc/{pid}/status")),
            Server::InProcess { .. } => Some("/proc/self/status".to_owned()),
        };
        let status = path
            .and_then(|path| std::fs::read_to_string(path).ok())
            .unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|line| line.strip_prefix(name).map(|kb| kb_to_mb(kb.trim())))
                .unwrap_or_else(|| "unknown".to_owned())
        };
        format!("VmHWM {}, VmRSS {}", field("VmHWM:"), field("VmRSS:"))
    }

    /// The coordinator's process id when it runs as a process of its own.
    #[allow(dead_code)] // Not every benchmark spawns it.
    pub(crate) fn pid(&self) -> Option<u32> {
        match &self.server {
            Server::Child(child) => child.id(),
            Server::InProcess { .. } => None,
        }
    }

    /// Shuts the coordinator down and waits for it.
    pub(crate) async fn stop(mut self) -> anyhow::Result<()> {
        match &mut self.server {
            Server::InProcess {
                shutdown,
                server,
                runtime,
            } => {
                shutdown.cancel();
                server.await??;
                if let Some(runtime) = runtime.take() {
                    runtime.shutdown_background();
                }
            }
            Server::Child(child) => {
                let pid = child.id().context("the coordinator was already reaped")?;
                nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(i32::try_from(pid)?),
                    nix::sys::signal::Signal::SIGTERM,
                )?;
                let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
                    .await
                    .context("the coordinator did not stop within 60 s of SIGTERM")??;
                if !status.success() {
                    bail!("the coordinator exited {status}");
                }
            }
        }
        // Each run's tables would otherwise pile up in the benchmark database.
        if let Some((url, schema)) = self.schema.take() {
            use sqlx::Connection as _;
            let mut conn = sqlx::PgConnection::connect(&url).await?;
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
                .execute(&mut conn)
                .await?;
        }
        Ok(())
    }
}

/// `1234 kB` as `1.2 MB`.
fn kb_to_mb(kb: &str) -> String {
    kb.strip_suffix(" kB")
        .and_then(|n| n.trim().parse::<f64>().ok())
        .map(|n| format!("{:.0} MB", n / 1000.0))
        .unwrap_or_else(|| kb.to_owned())
}

/// Makes the one-commit repository the plans name (`repo`, relative to the returned base
/// directory) under `dir`.
fn plan_repo(dir: &Path) -> anyhow::Result<String> {
    let repo = dir.join("plan/repo");
    std::fs::create_dir_all(&repo)?;
    git(&repo, &["init", "-q"])?;
    std::fs::write(repo.join("README.md"), "bench\n")?;
    git(&repo, &["add", "."])?;
    git(
        &repo,
        &[
            "-c",
            "user.name=b",
            "-c",
            "user.email=b@b",
            "commit",
            "-qm",
            "init",
        ],
    )?;
    Ok(dir.join("plan").display().to_string())
}

fn git(dir: &std::path::Path, args: &[&str]) -> anyhow::Result<()> {
    let status = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .status()?;
    if !status.success() {
        bail!("git {args:?} failed");
    }
    Ok(())
}

/// Creates an empty schema for one run and returns its name.
async fn fresh_schema(url: &str) -> anyhow::Result<String> {
    use sqlx::Connection as _;
    let schema = format!("bench_{}", uuid::Uuid::new_v4().simple());
    let mut conn = sqlx::PgConnection::connect(url).await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&mut conn)
        .await?;
    Ok(schema)
}

/// `url` with `schema` as its search path.
fn in_schema(url: &str, schema: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}options=-c%20search_path%3D{schema}")
}

/// Fails unless the session ended completed (a benchmark that lost or failed a task measured
/// nothing).
pub(crate) async fn expect_completed(
    client: &troupe_grpc::CoordinatorClient,
    session_id: String,
) -> anyhow::Result<()> {
    let view = client
        .clone()
        .get_session(troupe_proto::v1::GetSessionRequest {
            session_id,
            ..Default::default()
        })
        .await?
        .into_inner();
    let state = view.session.context("session")?.state();
    if state != troupe_proto::v1::SessionState::Completed {
        bail!("session ended {state:?}");
    }
    Ok(())
}

/// Creates a session from `plan` (its repos relative to `base_dir`) and returns its id.
pub(crate) async fn create_session(
    client: &troupe_grpc::CoordinatorClient,
    base_dir: &str,
    plan: &serde_json::Value,
) -> anyhow::Result<String> {
    create_session_json(client, base_dir, plan.to_string()).await
}

/// [`create_session`] of a plan already serialised.
pub(crate) async fn create_session_json(
    client: &troupe_grpc::CoordinatorClient,
    base_dir: &str,
    plan_json: String,
) -> anyhow::Result<String> {
    let response = client
        .clone()
        .create_session(troupe_proto::v1::CreateSessionRequest {
            plan_json,
            base_dir: base_dir.to_owned(),
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(response.session.context("no session")?.id)
}

/// This process's peak resident set (`VmHWM` of /proc/self/status), as the kernel reports it.
#[allow(dead_code)] // Not every benchmark reports it.
pub(crate) fn peak_rss() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("VmHWM:").map(|kb| kb.trim().to_owned()))
        })
        .unwrap_or_else(|| "unknown".to_owned())
}
