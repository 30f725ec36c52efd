//! A wave of agent tasks against a provider that allows a few model calls at once: the
//! coordinator and executors as separate processes, the `agent` backend talking to the
//! scripted model server in its limited mode (a call beyond the limit is answered 429 with
//! `retry-after`). Shared by the quota test (`quota.rs`) and the quota benchmark
//! (`benches/quota.rs`, which also runs it on main's binaries as the baseline).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::json;
use tokio::process::{Child, Command};
use troupe_modelserver::{ModelServer, Script};
use troupe_proto::v1::{
    CheckSessionRequest, CreateSessionRequest, GetSessionRequest, SessionState, TaskState,
    task_result::Detail,
};

/// What to run.
#[derive(Debug, Clone)]
pub(crate) struct Wave {
    /// Where `troupe-coordinator` and `troupe-executor` are.
    pub(crate) bin_dir: PathBuf,
    pub(crate) tasks: usize,
    /// Executor processes, one task at a time each.
    pub(crate) workers: usize,
    /// Model calls the provider allows at once.
    pub(crate) allowed: usize,
    /// `--quota agent=in_flight:N` on the coordinator (none: no quota configured).
    pub(crate) quota: Option<usize>,
    /// How long each model call takes (a task makes two).
    pub(crate) call_time: Duration,
}

/// What came of it.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    /// From the session's creation to its end.
    pub(crate) wall: Duration,
    pub(crate) completed: usize,
    /// Attempts beyond the first, over all tasks, plus tasks that did not complete.
    pub(crate) failed_attempts: u32,
    /// Backends the completed tasks' reports name as fallen back from.
    pub(crate) fallbacks: usize,
    /// The most model calls at once the server saw (refused ones included).
    pub(crate) peak: usize,
    /// Model calls answered 429.
    pub(crate) refused: usize,
    /// The median of the completed attempts' durations (claim to completion).
    pub(crate) task_time: Duration,
    /// Whether `CheckSession` showed tasks waiting on the agent quota while it ran.
    pub(crate) waits_seen: bool,
}

/// A child process killed when dropped.
struct Service {
    _child: Child,
    url: String,
}

fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

async fn spawn(
    bin: &Path,
    args: &[String],
    env: &[(&str, String)],
    log: &Path,
) -> anyhow::Result<Service> {
    let port = free_port()?;
    let mut command = Command::new(bin);
    command
        .args(args)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log)?)
        .kill_on_drop(true);
    for (name, value) in env {
        command.env(name, value);
    }
    let child = command
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let url = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let channel = troupe_grpc::Connector::default().channel(&url)?;
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
        if health
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .is_ok()
        {
            break;
        }
        if Instant::now() > deadline {
            bail!("{} did not start (log: {})", bin.display(), log.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(Service { _child: child, url })
}

/// Runs the wave and counts what happened.
pub(crate) async fn run(wave: &Wave) -> anyhow::Result<Outcome> {
    let mut script = Script::default().limited_to(wave.allowed, wave.call_time, 1);
    for i in 1..=wave.tasks {
        let path = format!("notes/t{i:03}.txt");
        script = script.rule(
            &path,
            vec![troupe_modelserver::Action::WriteFile {
                path: path.clone(),
                content: format!("note {i}\n"),
            }],
        );
    }
    let (model_url, model) = ModelServer::start(script).await?;
    let root = tempfile::tempdir()?;
    let config = root.path().join("executor.toml");
    // Today's policy for a 429: one retry after a backoff, no other backend to fall to.
    std::fs::write(
        &config,
        format!(
            "fallback = []\nretries = 1\nretry_backoff_ms = 500\n\n[backends.agent]\n\
             model = \"fake-model\"\nendpoint = \"{model_url}/v1\"\napi_key = \"fake-key\"\n\
             timeout_seconds = 120\n"
        ),
    )?;
    let plan_dir = root.path().join("plan");
    std::fs::create_dir_all(plan_dir.join("repo"))?;
    std::fs::write(plan_dir.join("repo/README.md"), "notes\n")?;
    let tasks: Vec<_> = (1..=wave.tasks)
        .map(|i| {
            json!({
                "id": format!("IMPL-{i:03}"),
                "title": format!("Write note {i}"),
                "description": format!("Create notes/t{i:03}.txt with the note."),
                "files": [{"path": format!("notes/t{i:03}.txt"), "action": "create"}],
                "agent": {"backend": "agent"}
            })
        })
        .collect();
    let plan =
        json!({"name": "quota-wave", "repos": {"app": {"template": "repo"}}, "tasks": tasks});

    let mut coordinator_args = vec![
        "--data-dir".to_owned(),
        root.path().join("coordinator").display().to_string(),
    ];
    if let Some(limit) = wave.quota {
        coordinator_args.push("--quota".to_owned());
        coordinator_args.push(format!("agent=in_flight:{limit}"));
    }
    let coordinator = spawn(
        &wave.bin_dir.join("troupe-coordinator"),
        &coordinator_args,
        &[],
        &root.path().join("coordinator.log"),
    )
    .await?;
    let mut executors = Vec::new();
    for n in 0..wave.workers {
        let args = vec![
            "--data-dir".to_owned(),
            root.path()
                .join(format!("executor-{n}"))
                .display()
                .to_string(),
            "--coordinator-url".to_owned(),
            coordinator.url.clone(),
            "--concurrency".to_owned(),
            "1".to_owned(),
            "--worker-id".to_owned(),
            format!("executor-{n}"),
        ];
        let env = [("TROUPE_EXECUTOR_CONFIG", config.display().to_string())];
        let log = root.path().join(format!("executor-{n}.log"));
        executors.push(spawn(&wave.bin_dir.join("troupe-executor"), &args, &env, &log).await?);
    }

    let mut client = troupe_grpc::Connector::default().coordinator_client(&coordinator.url)?;
    let started = Instant::now();
    let created = client
        .create_session(CreateSessionRequest {
            plan_json: plan.to_string(),
            base_dir: plan_dir.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let session_id = created.session.context("no session")?.id;
    let deadline = Instant::now() + Duration::from_secs(900);
    let mut waits_seen = false;
    let (done, wall) = loop {
        let check = client
            .check_session(CheckSessionRequest {
                session_id: session_id.clone(),
                ..Default::default()
            })
            .await?
            .into_inner();
        waits_seen |= check
            .quota_waits
            .iter()
            .any(|wait| wait.backend == "agent" && !wait.task_ids.is_empty());
        let state = check.session.as_ref().context("no session")?.state();
        if state != SessionState::Active {
            let wall = started.elapsed();
            let done = client
                .get_session(GetSessionRequest {
                    session_id: session_id.clone(),
                    ..Default::default()
                })
                .await?
                .into_inner();
            break (done, wall);
        }
        if Instant::now() > deadline {
            bail!("the wave did not end (logs in {})", root.path().display());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut completed = 0;
    let mut failed_attempts = 0;
    let mut fallbacks = 0;
    let mut times = Vec::new();
    for task in &done.tasks {
        if task.state() == TaskState::Completed {
            completed += 1;
            failed_attempts += task.attempt.saturating_sub(1);
            if let (Some(start), Some(end)) = (&task.started_at, &task.finished_at) {
                let ms = (end.seconds - start.seconds) * 1000
                    + i64::from(end.nanos - start.nanos) / 1_000_000;
                times.push(Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
            }
        } else {
            failed_attempts += task.attempt.max(1);
        }
        if let Some(Detail::Implementation(report)) =
            task.result.as_ref().and_then(|r| r.detail.as_ref())
        {
            fallbacks += report.fallbacks.len();
        }
    }
    times.sort();
    let task_time = times.get(times.len() / 2).copied().unwrap_or_default();
    drop(executors);
    drop(coordinator);
    Ok(Outcome {
        wall,
        completed,
        failed_attempts,
        fallbacks,
        peak: model.peak_concurrency(),
        refused: model.refused(),
        task_time,
        waits_seen,
    })
}
