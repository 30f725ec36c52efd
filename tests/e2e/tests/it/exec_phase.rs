//! EXEC phases end to end: the exec-phase example (one EXEC task runs six IMPL task files in
//! three waves through the real coordinator, executor and validator in one process), the same
//! plan with its directory deleted right after `troupe run`'s intake, and a claimed EXEC task's
//! wave notes reaching the coordinator.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use troupe_proto::v1::{SessionState, TaskState, task_result::Detail};

/// `started=` and `finished=` of each task, from the agent output in its summary.
fn times(summary: &str) -> Option<(f64, f64)> {
    let field = |name: &str| -> Option<f64> {
        let start = summary.find(name)? + name.len();
        summary[start..].split_whitespace().next()?.parse().ok()
    };
    Some((field("started=")?, field("finished=")?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exec_phase_example_runs_three_waves_into_the_session_branch() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let shutdown = CancellationToken::new();
    let (embedded, url) = crate::support::start_embedded(data.path(), &shutdown).await?;

    let response = crate::support::run_example(&url, "exec-phase").await?;
    let session = response.session.as_ref().context("no session")?;
    let report = troupe::report::final_report(&response);
    assert_eq!(
        session.state,
        SessionState::Completed as i32,
        "session did not complete:\n{report}"
    );
    for task in &response.tasks {
        assert_eq!(
            task.state,
            TaskState::Completed as i32,
            "{} did not complete:\n{report}",
            task.id
        );
    }

    // The EXEC task's own result lists every phase task with its wave.
    let exec = response
        .tasks
        .iter()
        .find(|t| t.id == "EXEC-001")
        .context("no EXEC-001")?;
    let result = exec.result.as_ref().context("EXEC-001 has no result")?;
    let Some(Detail::Implementation(phase)) = &result.detail else {
        anyhow::bail!("EXEC-001 has no implementation report: {result:?}");
    };
    assert_eq!(phase.waves, 3);
    let waves: BTreeMap<&str, u32> = phase
        .phase_tasks
        .iter()
        .map(|o| (o.task_id.as_str(), o.wave))
        .collect();
    assert_eq!(
        waves,
        BTreeMap::from([
            ("IMPL-101", 1),
            ("IMPL-102", 1),
            ("IMPL-103", 2),
            ("IMPL-104", 2),
            ("IMPL-105", 3),
            ("IMPL-106", 3),
        ])
    );
    for outcome in &phase.phase_tasks {
        assert_eq!(
            outcome.state(),
            troupe_proto::v1::TaskState::Completed,
            "{outcome:?}"
        );
        // Self-validated through the validator mounted on the same server.
        assert_eq!(
            outcome.convergence_met(),
            troupe_proto::v1::ConvergenceMet::Pass,
            "{outcome:?}"
        );
    }
    assert_eq!(
        result.files_modified.len(),
        6,
        "{:?}",
        result.files_modified
    );

    // The files and the summaries are on the session branch; the checkout is untouched.
    let repo = session.repos.first().context("no repo")?;
    let repo_path = Path::new(&repo.path);
    assert_eq!(
        troupe_testkit::git(repo_path, &["rev-parse", &repo.branch])?,
        result.commit
    );
    let show =
        |path: &str| troupe_testkit::git(repo_path, &["show", &format!("{}:{path}", repo.branch)]);
    assert!(show("textkit/cli.py")?.contains("def main("));
    assert!(!repo_path.join("textkit/cli.py").exists());
    let mut spans = BTreeMap::new();
    for id in waves.keys() {
        let summary = show(&format!(".troupe-summaries/summary-{id}.md"))?;
        assert!(summary.starts_with("---\nphase: 1\n"), "{summary}");
        assert!(summary.contains("convergence-met: pass\n"), "{summary}");
        spans.insert(*id, times(&summary).context("no times in the summary")?);
    }
    // Waves in order: every task of a wave ends before any task of the next one starts.
    for (wave, next) in [(1, 2), (2, 3)] {
        let ends = waves
            .iter()
            .filter(|(_, w)| **w == wave)
            .map(|(id, _)| spans[id].1);
        let starts = waves
            .iter()
            .filter(|(_, w)| **w == next)
            .map(|(id, _)| spans[id].0);
        let last_end = ends.fold(f64::MIN, f64::max);
        let first_start = starts.fold(f64::MAX, f64::min);
        assert!(
            last_end <= first_start,
            "wave {next} started at {first_start} before wave {wave} ended at {last_end}"
        );
    }
    // Parallel inside a wave: the two tasks of each wave overlap.
    for pair in [
        ("IMPL-101", "IMPL-102"),
        ("IMPL-103", "IMPL-104"),
        ("IMPL-105", "IMPL-106"),
    ] {
        let (a, b) = (spans[pair.0], spans[pair.1]);
        assert!(
            a.0.max(b.0) < a.1.min(b.1),
            "{pair:?} did not overlap: {a:?} {b:?}"
        );
    }

    shutdown.cancel();
    embedded.wait().await?;
    Ok(())
}

/// Copies `from` into `to`, recursively.
fn copy_tree(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// No worker reads the plan's directory: `troupe run` submits the exec-phase example (under
/// another file name than plan.json), the directory is deleted as soon as the session exists,
/// and only then do an executor and a validator start; the phase still runs its six tasks in
/// three waves and lands each task's commit on the session branch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_exec_phase_runs_with_the_plan_directory_deleted_after_intake() -> anyhow::Result<()> {
    use tokio::io::AsyncBufReadExt as _;
    use troupe_proto::v1::GetSessionRequest;
    use troupe_testkit::TestService;

    let root = tempfile::tempdir()?;
    let coordinator_dir = root.path().join("coordinator");
    let coordinator = TestService::spawn(move |listener, shutdown| {
        troupe_coordinator::run(
            troupe_coordinator::Config::new(coordinator_dir),
            listener,
            shutdown,
        )
    })
    .await;
    let url = coordinator.url();

    let plan_dir = root.path().join("plans/textkit");
    copy_tree(
        &troupe_testkit::workspace_root().join("examples/exec-phase"),
        &plan_dir,
    )?;
    std::fs::rename(plan_dir.join("plan.json"), plan_dir.join("my-plan.json"))?;
    let mut run = tokio::process::Command::new(crate::support::binary("troupe"))
        .args(["run", "--connect", &url])
        .arg(plan_dir.join("my-plan.json"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = tokio::io::BufReader::new(run.stdout.take().context("stdout")?).lines();
    let mut output = String::new();
    let session_id = loop {
        let line = lines
            .next_line()
            .await?
            .with_context(|| format!("troupe run ended before creating a session:\n{output}"))?;
        output.push_str(&line);
        output.push('\n');
        if let Some(rest) = line.strip_prefix("session ") {
            break rest.split_whitespace().next().context("no id")?.to_owned();
        }
    };
    // Intake is over: the plan's directory goes before any worker exists.
    std::fs::remove_dir_all(&plan_dir)?;

    let executor_config = troupe_executor::Config {
        listen: "127.0.0.1:0".parse()?,
        data_dir: root.path().join("executor"),
        coordinator_url: Some(url.clone()),
        concurrency: 1,
        worker_id: None,
        worker: Default::default(),
        backends_config: None,
        validator_url: None,
        phase_concurrency: 2,
        summary_dir: troupe_executor::DEFAULT_SUMMARY_DIR.to_owned(),
        security: Default::default(),
        sandbox: Default::default(),
    };
    let validator_config = troupe_validator::Config {
        listen: "127.0.0.1:0".parse()?,
        data_dir: root.path().join("validator"),
        coordinator_url: Some(url.clone()),
        worker_id: None,
        worker: Default::default(),
        concurrency: 1,
        security: Default::default(),
    };
    let validator = TestService::spawn(|listener, shutdown| {
        troupe_validator::run(validator_config, listener, shutdown)
    })
    .await;
    let executor = TestService::spawn(|listener, shutdown| {
        troupe_executor::run(executor_config, listener, shutdown)
    })
    .await;

    let rest = async {
        while let Some(line) = lines.next_line().await? {
            output.push_str(&line);
            output.push('\n');
        }
        anyhow::Ok(run.wait().await?)
    };
    let status = tokio::time::timeout(std::time::Duration::from_secs(240), rest)
        .await
        .context("troupe run did not finish within 240 s")??;
    assert!(status.success(), "troupe run failed ({status}):\n{output}");
    assert!(!plan_dir.exists());

    let response = troupe_grpc::coordinator_client(&url)?
        .get_session(GetSessionRequest {
            session_id,
            ..Default::default()
        })
        .await?
        .into_inner();
    let session = response.session.as_ref().context("no session")?;
    assert_eq!(session.state, SessionState::Completed as i32, "{output}");
    let exec = response
        .tasks
        .iter()
        .find(|t| t.id == "EXEC-001")
        .context("no EXEC-001")?;
    let result = exec.result.as_ref().context("EXEC-001 has no result")?;
    let Some(Detail::Implementation(phase)) = &result.detail else {
        anyhow::bail!("EXEC-001 has no implementation report: {result:?}");
    };
    let waves: BTreeMap<&str, u32> = phase
        .phase_tasks
        .iter()
        .map(|o| (o.task_id.as_str(), o.wave))
        .collect();
    assert_eq!(
        waves,
        BTreeMap::from([
            ("IMPL-101", 1),
            ("IMPL-102", 1),
            ("IMPL-103", 2),
            ("IMPL-104", 2),
            ("IMPL-105", 3),
            ("IMPL-106", 3),
        ])
    );
    // Each task's commit landed on the session branch, which holds the whole toolkit.
    let repo = session.repos.first().context("no repo")?;
    let repo_path = Path::new(&repo.path);
    for outcome in &phase.phase_tasks {
        assert_eq!(outcome.state(), TaskState::Completed, "{outcome:?}");
        assert!(!outcome.commit.is_empty(), "{outcome:?}");
        troupe_testkit::git(
            repo_path,
            &["merge-base", "--is-ancestor", &outcome.commit, &repo.branch],
        )
        .with_context(|| format!("{}'s commit is not on {}", outcome.task_id, repo.branch))?;
    }
    let show =
        |path: &str| troupe_testkit::git(repo_path, &["show", &format!("{}:{path}", repo.branch)]);
    assert!(show("textkit/cli.py")?.contains("def main("));
    assert!(show(".troupe-summaries/summary-IMPL-106.md")?.starts_with("---\nphase: 1\n"));

    executor.stop().await;
    validator.stop().await;
    coordinator.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_exec_task_reports_wave_progress_to_the_coordinator() {
    use std::sync::Arc;
    use std::time::Duration;

    use serde_json::json;
    use troupe_testkit::TestService;

    use crate::executor_fixture::{Fixture, executor_logging_to, report};

    use troupe_grpc::worker::{WorkerConfig, run_worker};
    use troupe_proto::v1::{
        CreateSessionRequest, GetSessionRequest, Role, TaskState, WatchSessionRequest,
        session_event,
    };

    let f = Fixture::start(None, None).await;
    let coordinator_dir = f.log.parent().expect("root").join("coordinator");
    let coordinator = TestService::spawn(move |listener, shutdown| {
        troupe_coordinator::run(
            troupe_coordinator::Config::new(coordinator_dir),
            listener,
            shutdown,
        )
    })
    .await;
    // Short leases so heartbeats (a third of the lease) carry the notes of each wave.
    let mut worker = WorkerConfig::new(coordinator.url(), "executor-it", vec![Role::Executor]);
    worker.lease = Duration::from_millis(1500);
    worker.poll_wait = Duration::from_millis(200);
    let executor = Arc::new(executor_logging_to(
        f.log.parent().expect("root").join("worker"),
        &f.log,
    ));
    let stop = tokio_util::sync::CancellationToken::new();
    let worker_task = tokio::spawn(run_worker(
        worker,
        Arc::new(troupe_executor::ExecuteHandler::new(executor)),
        stop.clone(),
    ));

    f.phase_task("IMPL-901", &[], &["--sleep", "1.5"], "a.txt");
    f.phase_task("IMPL-902", &["IMPL-901"], &["--sleep", "1.5"], "b.txt");
    f.phase_task("IMPL-903", &["IMPL-902"], &["--sleep", "1.5"], "c.txt");
    let plan = json!({
        "name": "phase-progress",
        "repos": {"app": {"path": f.repo.display().to_string()}},
        "tasks": [{"id": "EXEC-9", "title": "phase 1", "description": "run phase 1", "depends_on": [], "phase": 1}],
    });
    let mut client = troupe_grpc::coordinator_client(&coordinator.url()).expect("client");
    let session_id = client
        .create_session(CreateSessionRequest {
            plan_json: plan.to_string(),
            base_dir: f.plan.display().to_string(),
            ..Default::default()
        })
        .await
        .expect("session")
        .into_inner()
        .session
        .expect("session")
        .id;
    let mut events = client
        .watch_session(WatchSessionRequest {
            session_id: session_id.clone(),
            after_sequence: 0,
            follow: false,
        })
        .await
        .expect("watch")
        .into_inner();
    let mut notes = Vec::new();
    let drain = async {
        use tokio_stream::StreamExt as _;
        while let Some(event) = events.next().await {
            if let Some(session_event::Kind::Progress(progress)) = event.expect("event").kind {
                notes.push(progress.note);
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(120), drain)
        .await
        .expect("the session ends");
    let session = client
        .get_session(GetSessionRequest {
            session_id,
            ..Default::default()
        })
        .await
        .expect("get")
        .into_inner();
    let exec = &session.tasks[0];
    assert_eq!(exec.state, TaskState::Completed as i32, "{exec:?}");
    // Each wave's note reached the coordinator, in order.
    let firsts: Vec<usize> = [
        "wave 1/3: IMPL-901 running",
        "wave 2/3: IMPL-902 running",
        "wave 3/3: IMPL-903 running",
    ]
    .iter()
    .map(|note| {
        notes
            .iter()
            .position(|n| n == note)
            .unwrap_or_else(|| panic!("{note:?} not in {notes:?}"))
    })
    .collect();
    assert!(firsts.windows(2).all(|w| w[0] < w[1]), "{notes:?}");
    let result = exec.result.as_ref().expect("result");
    assert_eq!(report(result).waves, 3);
    assert_eq!(result.files_modified, ["a.txt", "b.txt", "c.txt"]);
    stop.cancel();
    worker_task.await.expect("join").expect("worker");
}
