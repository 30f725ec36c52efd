//! Workers that respect their lease, as separate processes: a real `troupe-coordinator`, a real
//! `troupe-executor` worker, and `command` agents (a Python script) that hold until the test
//! lets them go, then write a file the executor commits to the session branch. The coordinator
//! is stopped (`SIGSTOP`), killed (`kill -9`) and restarted under the running task.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use nix::sys::signal::Signal;
use serde_json::json;
use troupe_proto::v1::{
    CreateSessionRequest, GetSessionRequest, GetSessionResponse, SessionState, TaskState,
};

use crate::support::{ChildService, free_addr};

/// The agent: records its run and pid, holds while `<control>/<task>.hold` exists, then
/// writes `<task>.txt` in its worktree. Argv: worktree, control dir, task id.
const AGENT: &str = r#"
import os, pathlib, sys, time
sys.stdin.read()
worktree, control, task = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
with open(control / f"{task}.runs", "a") as runs:
    runs.write(f"{os.getpid()}\n")
(control / f"{task}.pid").write_text(str(os.getpid()))
hold = control / f"{task}.hold"
deadline = time.time() + 600
while hold.exists() and time.time() < deadline:
    time.sleep(0.05)
(worktree / f"{task}.txt").write_text(f"{task} was here\n")
print(f"{task} done")
"#;

/// A plan of agent tasks (id, dependencies) in a fresh repo, with its control directory.
pub(crate) struct Scene {
    pub(crate) dir: tempfile::TempDir,
}

impl Scene {
    /// Writes the agent, a git repo and `plan.json` for `tasks`; returns the scene.
    pub(crate) fn new(name: &str, tasks: &[(&str, &[&str])]) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let plan_dir = dir.path().join("plan");
        std::fs::create_dir_all(plan_dir.join("control"))?;
        std::fs::write(plan_dir.join("agent.py"), AGENT)?;
        troupe_testkit::git_repo(&plan_dir.join("repo"), &[("README.md", "hello\n")])?;
        let control = plan_dir.join("control").display().to_string();
        let tasks: Vec<_> = tasks
            .iter()
            .map(|(id, deps)| {
                json!({"id": id, "title": format!("write {id}.txt"), "depends_on": deps,
                    "agent": {"backend": "command",
                        "command": ["python3", "{plan_dir}/agent.py", "{worktree}", control, id]}})
            })
            .collect();
        let plan = json!({"name": name, "repos": {"app": {"path": "repo"}}, "tasks": tasks});
        std::fs::write(plan_dir.join("plan.json"), plan.to_string())?;
        Ok(Self { dir })
    }

    pub(crate) fn plan_dir(&self) -> PathBuf {
        self.dir.path().join("plan")
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn control(&self, file: &str) -> PathBuf {
        self.plan_dir().join("control").join(file)
    }

    /// Makes `task`'s agent hold until [`Scene::release`].
    pub(crate) fn hold(&self, task: &str) -> anyhow::Result<()> {
        std::fs::write(self.control(&format!("{task}.hold")), "")?;
        Ok(())
    }

    pub(crate) fn release(&self, task: &str) -> anyhow::Result<()> {
        std::fs::remove_file(self.control(&format!("{task}.hold")))?;
        Ok(())
    }

    /// How many times `task`'s agent started.
    pub(crate) fn runs(&self, task: &str) -> usize {
        std::fs::read_to_string(self.control(&format!("{task}.runs")))
            .map(|runs| runs.lines().count())
            .unwrap_or(0)
    }

    /// Waits until `task`'s agent has started `runs` times; returns the last one's pid.
    pub(crate) async fn agent_started(&self, task: &str, runs: usize) -> i32 {
        troupe_testkit::eventually(&format!("{task}'s agent to start (run {runs})"), || async {
            if self.runs(task) < runs {
                return None;
            }
            std::fs::read_to_string(self.control(&format!("{task}.pid")))
                .ok()?
                .trim()
                .parse()
                .ok()
        })
        .await
    }

    /// Creates the session on the coordinator at `url`; returns its id.
    pub(crate) async fn create(&self, url: &str) -> anyhow::Result<String> {
        let plan_json = std::fs::read_to_string(self.plan_dir().join("plan.json"))?;
        let created = troupe_grpc::coordinator_client(url)?
            .create_session(CreateSessionRequest {
                plan_json,
                base_dir: self.plan_dir().display().to_string(),
                ..Default::default()
            })
            .await?
            .into_inner();
        Ok(created.session.context("no session")?.id)
    }
}

/// Whether process `pid` still runs (a zombie has stopped running).
pub(crate) fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            // The state follows the parenthesised command name.
            let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
            Some(state != 'Z' && state != 'X')
        })
        .unwrap_or(false)
}

/// Starts a coordinator on `addr` with its data in `data`.
pub(crate) async fn coordinator(addr: std::net::SocketAddr, data: &Path) -> ChildService {
    ChildService::start_at(
        "troupe-coordinator",
        addr,
        &["--data-dir", &data.display().to_string()],
        &[],
        None,
    )
    .await
    .expect("start troupe-coordinator")
}

/// Starts one executor worker (one task at a time) with `lease` and `rpc_timeout` seconds,
/// logging to `log`.
pub(crate) async fn executor(
    coordinator_url: &str,
    data: &Path,
    lease: &str,
    rpc_timeout: &str,
    log: &Path,
) -> ChildService {
    // The (confined) agents record their runs in the control dir of the scene `data` is in.
    let control = data.with_file_name("plan").join("control");
    ChildService::start_at(
        "troupe-executor",
        free_addr(),
        &[
            "--sandbox-write-path",
            &control.display().to_string(),
            "--data-dir",
            &data.display().to_string(),
            "--coordinator-url",
            coordinator_url,
            "--concurrency",
            "1",
            "--worker-id",
            "executor-lease-test",
            "--lease-seconds",
            lease,
            "--rpc-timeout-seconds",
            rpc_timeout,
        ],
        &[],
        Some(log),
    )
    .await
    .expect("start troupe-executor")
}

pub(crate) async fn session(url: &str, session: &str) -> anyhow::Result<GetSessionResponse> {
    Ok(troupe_grpc::coordinator_client(url)?
        .get_session(GetSessionRequest {
            session_id: session.to_owned(),
            ..Default::default()
        })
        .await?
        .into_inner())
}

/// Waits until the session is completed and returns it; fails with its state and the
/// worker's log (`log`) otherwise.
pub(crate) async fn completed(url: &str, id: &str, log: &Path) -> GetSessionResponse {
    let deadline = Instant::now() + troupe_testkit::patience();
    loop {
        let view = session(url, id).await.ok();
        if let Some(view) = &view
            && view
                .session
                .as_ref()
                .is_some_and(|s| s.state() == SessionState::Completed)
        {
            return view.clone();
        }
        if Instant::now() > deadline {
            let report = view.as_ref().map(troupe::report::final_report);
            panic!(
                "session {id} did not complete:\n{}\nworker log:\n{}",
                report.unwrap_or_default(),
                log_text(log)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Asserts each task completed with `attempts[i]` attempts and has exactly one commit on the
/// session branch, holding the file its agent wrote.
pub(crate) fn assert_committed_once(view: &GetSessionResponse, attempts: &[(&str, u32)]) {
    let report = troupe::report::final_report(view);
    let repo = &view.session.as_ref().expect("session").repos[0];
    let repo_path = Path::new(&repo.path);
    let log = troupe_testkit::git(
        repo_path,
        &[
            "log",
            "--no-merges",
            "--format=%s",
            &format!("{}..{}", repo.base_commit, repo.branch),
        ],
    )
    .expect("git log");
    for (id, attempt) in attempts {
        let task = view.tasks.iter().find(|task| task.id == *id).expect("task");
        assert_eq!(task.state(), TaskState::Completed, "{id}:\n{report}");
        assert_eq!(task.attempt, *attempt, "{id}'s attempts:\n{report}");
        let commits = log.lines().filter(|line| line.contains(id)).count();
        assert_eq!(commits, 1, "{id} commits on {}:\n{log}", repo.branch);
        let file = troupe_testkit::git(repo_path, &["show", &format!("{}:{id}.txt", repo.branch)])
            .expect("the agent's file is on the session branch");
        assert_eq!(file, format!("{id} was here"));
    }
}

fn log_text(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// A coordinator stopped (`SIGSTOP`) for longer than the lease: the worker stops its agent and
/// abandons the attempt by its local lease deadline, without waiting for a coordinator that
/// cannot answer; once the coordinator continues, the task runs again and lands once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_coordinator_gets_the_agent_stopped_by_the_lease_and_one_commit()
-> anyhow::Result<()> {
    const LEASE: Duration = Duration::from_secs(3);
    let scene = Scene::new("stopped", &[("IMPL-1", &[])])?;
    scene.hold("IMPL-1")?;
    let coordinator = coordinator(free_addr(), &scene.path("coordinator")).await;
    let url = coordinator.url();
    let log = scene.path("executor.log");
    let executor = executor(&url, &scene.path("executor"), "3", "2", &log).await;
    let id = scene.create(&url).await?;
    let agent = scene.agent_started("IMPL-1", 1).await;

    coordinator.signal(Signal::SIGSTOP)?;
    let stopped = Instant::now();
    // The last confirmed heartbeat was sent at most a third of the lease before the stop.
    troupe_testkit::eventually("the agent to be stopped", || async {
        (!running(agent)).then_some(())
    })
    .await;
    let gone = stopped.elapsed();
    eprintln!("the agent was stopped {gone:?} after SIGSTOP (lease {LEASE:?})");
    assert!(
        gone <= LEASE + Duration::from_millis(1500),
        "the agent ran {gone:?} after the coordinator stopped, past the {LEASE:?} lease"
    );
    assert!(
        gone >= LEASE / 2,
        "the agent was stopped {gone:?} after the stop, before its lease could have lapsed"
    );
    troupe_testkit::eventually("the executor to log the abandoned attempt", || async {
        let text = log_text(&log);
        (text.contains("attempt abandoned")
            && text.contains("the lease expired without a confirmation"))
        .then_some(())
    })
    .await;

    // Past the lease on the coordinator's own clock too, then let it go on.
    tokio::time::sleep((LEASE + Duration::from_secs(1)).saturating_sub(stopped.elapsed())).await;
    scene.release("IMPL-1")?;
    coordinator.signal(Signal::SIGCONT)?;
    let view = completed(&url, &id, &log).await;
    assert_committed_once(&view, &[("IMPL-1", 2)]);
    assert_eq!(scene.runs("IMPL-1"), 2);

    executor.terminate(Duration::from_secs(20)).await?;
    coordinator.terminate(Duration::from_secs(20)).await?;
    Ok(())
}

/// A coordinator killed (`kill -9`) while the task finishes, and back on the same port and
/// data 13 s later (longer than the old fixed report retries lasted) but within the lease: the
/// worker's report retries land, and the task completes on its first attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_restarted_within_the_lease_gets_the_report_and_no_second_attempt()
-> anyhow::Result<()> {
    const OUTAGE: Duration = Duration::from_secs(13);
    let scene = Scene::new("restarted", &[("IMPL-1", &[])])?;
    scene.hold("IMPL-1")?;
    let addr = free_addr();
    let data = scene.path("coordinator");
    let coordinator_process = coordinator(addr, &data).await;
    let url = coordinator_process.url();
    let log = scene.path("executor.log");
    // Heartbeats every 15 s: the last one before the kill leaves at least 30 s of lease.
    let executor = executor(&url, &scene.path("executor"), "45", "2", &log).await;
    let id = scene.create(&url).await?;
    scene.agent_started("IMPL-1", 1).await;

    coordinator_process.kill9().await?;
    let killed = Instant::now();
    scene.release("IMPL-1")?;
    // The agent finishes during the outage; the executor lands its commit only once it can
    // confirm the lease again, then reports.
    troupe_testkit::eventually("the executor to wait for the coordinator", || async {
        let text = log_text(&log);
        (text.contains("retrying while the lease lasts") || text.contains("confirming the lease"))
            .then_some(())
    })
    .await;
    tokio::time::sleep(OUTAGE.saturating_sub(killed.elapsed())).await;
    let coordinator_process = coordinator(addr, &data).await;

    let view = completed(&url, &id, &log).await;
    assert_committed_once(&view, &[("IMPL-1", 1)]);
    assert_eq!(scene.runs("IMPL-1"), 1);
    let text = log_text(&log);
    assert!(!text.contains("attempt abandoned"), "{text}");

    executor.terminate(Duration::from_secs(20)).await?;
    coordinator_process
        .terminate(Duration::from_secs(20))
        .await?;
    Ok(())
}

/// A heartbeat the coordinator refuses for good ends the attempt at once, long before its
/// lease would lapse: here the coordinator comes back on the same port with an empty store,
/// so it knows no such task (NOT_FOUND).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_heartbeat_stops_the_agent_before_the_lease_ends() -> anyhow::Result<()> {
    // Heartbeats every 5 s; the lease lasts at least 10 s past the kill.
    const LEASE_LEFT_AT_LEAST: Duration = Duration::from_secs(10);
    let scene = Scene::new("refused", &[("IMPL-1", &[])])?;
    scene.hold("IMPL-1")?;
    let addr = free_addr();
    let first = coordinator(addr, &scene.path("coordinator")).await;
    let url = first.url();
    let log = scene.path("executor.log");
    let executor = executor(&url, &scene.path("executor"), "15", "2", &log).await;
    scene.create(&url).await?;
    let agent = scene.agent_started("IMPL-1", 1).await;

    first.kill9().await?;
    let killed = Instant::now();
    let empty = coordinator(addr, &scene.path("another-coordinator")).await;
    troupe_testkit::eventually("the agent to be stopped", || async {
        (!running(agent)).then_some(())
    })
    .await;
    let gone = killed.elapsed();
    eprintln!("the agent was stopped {gone:?} after the kill");
    assert!(
        gone < LEASE_LEFT_AT_LEAST - Duration::from_secs(1),
        "the agent ran {gone:?} after the kill: the refusal did not end the attempt"
    );
    troupe_testkit::eventually("the executor to log why it gave up", || async {
        let text = log_text(&log);
        (text.contains("attempt abandoned")
            && text.contains("the coordinator refused the heartbeat (NotFound)"))
        .then_some(())
    })
    .await;
    assert_eq!(scene.runs("IMPL-1"), 1);

    executor.terminate(Duration::from_secs(20)).await?;
    empty.terminate(Duration::from_secs(20)).await?;
    Ok(())
}
