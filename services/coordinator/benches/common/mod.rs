//! What every coordinator benchmark starts from: a coordinator on a port-0 listener, on SQLite
//! or a fresh schema of the PostgreSQL named by TROUPE_BENCH_DATABASE_URL (or
//! TROUPE_TEST_DATABASE_URL), next to a one-commit git repository under `<dir>/plan/repo`.

use anyhow::{Context, bail};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A running coordinator and its client.
pub(crate) struct Bench {
    pub(crate) client: troupe_grpc::CoordinatorClient,
    /// The plans' base directory: holds `repo/`.
    pub(crate) base_dir: String,
    shutdown: CancellationToken,
    server: JoinHandle<Result<(), troupe_coordinator::Error>>,
    runtime: Option<tokio::runtime::Runtime>,
    /// PostgreSQL: the server's URL and the run's schema, dropped by [`Bench::stop`].
    schema: Option<(String, String)>,
    _dir: tempfile::TempDir,
}

impl Bench {
    /// Starts a coordinator on `db` (`sqlite` or `postgres`) with `tuning`.
    pub(crate) async fn start(
        db: &str,
        tuning: troupe_coordinator::Tuning,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let mut config = troupe_coordinator::Config::new(dir.path().join("data"));
        let schema = match db {
            "sqlite" => None,
            "postgres" => {
                let url = std::env::var("TROUPE_BENCH_DATABASE_URL")
                    .or_else(|_| std::env::var("TROUPE_TEST_DATABASE_URL"))
                    .context(
                        "set TROUPE_BENCH_DATABASE_URL (or source scripts/setup/20-postgres.sh)",
                    )?;
                let schema = fresh_schema(&url).await?;
                config.database_url = Some(in_schema(&url, &schema));
                Some((url, schema))
            }
            other => bail!("unknown --db {other}"),
        };
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
        let repo = dir.path().join("plan/repo");
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
        Ok(Self {
            client: troupe_grpc::coordinator_client(&url)?,
            base_dir: dir.path().join("plan").display().to_string(),
            shutdown,
            server,
            runtime: Some(runtime),
            schema,
            _dir: dir,
        })
    }

    /// Shuts the coordinator down and waits for it.
    pub(crate) async fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        (&mut self.server).await??;
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
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
