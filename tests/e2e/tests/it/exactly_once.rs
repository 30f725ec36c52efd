//! Exactly once, for real: the coordinator, several executors and their agents as separate
//! processes against a real git repository (a local remote), killed (`kill -9`), stopped
//! (`SIGSTOP`) and cut off (a network namespace whose link goes down) while agents edit files
//! and executors land commits. Each scenario then counts what reached the session branch: every
//! task's commit exactly once, no task lost, no agent process left behind.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use nix::sys::signal::Signal;
use serde_json::json;
use troupe_proto::v1::{GetSessionResponse, SessionState, TaskState};

use crate::lease::{running, session};
use crate::support::{ChildService, free_addr};

/// The agent: records its run (pid, parent pid) and starts a background grandchild (a sleep
/// that would outlive it), holds while `<control>/<task>.hold` exists, then works for
/// `millis` in steps (appending to a progress file in the worktree) and writes `<task>.txt`.
/// Argv: worktree, control dir, task id, millis.
const AGENT: &str = r#"
import os, pathlib, subprocess, sys, time
sys.stdin.read()
worktree, control, task, millis = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
child = subprocess.Popen(["sleep", "300"])
with open(control / f"{task}.runs", "a") as runs:
    runs.write(f"{os.getpid()} {os.getppid()} {child.pid}\n")
hold = control / f"{task}.hold"
deadline = time.time() + 600
while hold.exists() and time.time() < deadline:
    time.sleep(0.05)
steps = max(1, millis // 50)
for step in range(steps):
    with open(worktree / f"{task}.progress", "a") as progress:
        progress.write(f"{step}\n")
    time.sleep(0.05)
(worktree / f"{task}.txt").write_text(f"{task} by {os.getpid()}\n")
child.kill()
print(f"{task} done")
"#;

/// A scene: an agent script, a repository and a plan of tasks, with a control directory.
struct Scene {
    dir: tempfile::TempDir,
    tasks: Vec<String>,
}

/// One run of an agent, as it recorded itself.
#[derive(Debug, Clone, Copy)]
struct Run {
    pid: i32,
    executor: i32,
    grandchild: i32,
}

impl Scene {
    /// `tasks` as (id, dependencies, agent millis).
    fn new(name: &str, tasks: &[(String, Vec<String>, u64)]) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let plan_dir = dir.path().join("plan");
        std::fs::create_dir_all(plan_dir.join("control"))?;
        std::fs::write(plan_dir.join("agent.py"), AGENT)?;
        troupe_testkit::git_repo(&plan_dir.join("repo"), &[("README.md", "hello\n")])?;
        let control = plan_dir.join("control").display().to_string();
        let specs: Vec<_> = tasks
            .iter()
            .map(|(id, deps, millis)| {
                json!({"id": id, "title": format!("write {id}.txt"), "depends_on": deps,
                    "max_attempts": 5,
                    "agent": {"backend": "command",
                        "command": ["python3", "{plan_dir}/agent.py", "{worktree}", control, id,
                            millis.to_string()]}})
            })
            .collect();
        let plan = json!({"name": name, "repos": {"app": {"path": "repo"}}, "tasks": specs});
        std::fs::write(plan_dir.join("plan.json"), plan.to_string())?;
        Ok(Self {
            dir,
            tasks: tasks.iter().map(|(id, _, _)| id.clone()).collect(),
        })
    }

    fn plan_dir(&self) -> PathBuf {
        self.dir.path().join("plan")
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn control(&self, file: &str) -> PathBuf {
        self.plan_dir().join("control").join(file)
    }

    fn hold(&self, task: &str) -> anyhow::Result<()> {
        std::fs::write(self.control(&format!("{task}.hold")), "")?;
        Ok(())
    }

    fn release(&self, task: &str) -> anyhow::Result<()> {
        std::fs::remove_file(self.control(&format!("{task}.hold")))?;
        Ok(())
    }

    /// Every run of `task`'s agent so far.
    fn runs(&self, task: &str) -> Vec<Run> {
        std::fs::read_to_string(self.control(&format!("{task}.runs")))
            .unwrap_or_default()
            .lines()
            .filter_map(|line| {
                let mut fields = line.split_whitespace().map(str::parse::<i32>);
                Some(Run {
                    pid: fields.next()?.ok()?,
                    executor: fields.next()?.ok()?,
                    grandchild: fields.next()?.ok()?,
                })
            })
            .collect()
    }

    async fn started(&self, task: &str, runs: usize) -> Run {
        troupe_testkit::eventually(&format!("{task}'s agent to start (run {runs})"), || async {
            self.runs(task).get(runs - 1).copied()
        })
        .await
    }

    async fn create(&self, url: &str) -> anyhow::Result<String> {
        let plan_json = std::fs::read_to_string(self.plan_dir().join("plan.json"))?;
        let created = troupe_grpc::coordinator_client(url)?
            .create_session(troupe_proto::v1::CreateSessionRequest {
                plan_json,
                base_dir: self.plan_dir().display().to_string(),
                ..Default::default()
            })
            .await?
            .into_inner();
        Ok(created.session.context("no session")?.id)
    }
}

/// Where the coordinator keeps its state for a scenario: SQLite in its data dir, or a fresh
/// PostgreSQL schema.
#[derive(Clone, Debug)]
struct Store {
    data: PathBuf,
    database_url: Option<String>,
}

impl Store {
    async fn new(scene: &Scene, postgres: bool) -> Option<Self> {
        let database_url = if postgres {
            Some(crate::postgres::fresh_schema().await?)
        } else {
            None
        };
        Some(Self {
            data: scene.path("coordinator"),
            database_url,
        })
    }

    async fn start(&self, listen: SocketAddr) -> ChildService {
        let data = self.data.display().to_string();
        let mut args = vec!["--data-dir", data.as_str()];
        if let Some(url) = &self.database_url {
            args.extend(["--database-url", url.as_str()]);
        }
        if !listen.ip().is_loopback() {
            // A test network of this machine's own: no credentials needed.
            args.push("--insecure");
        }
        ChildService::start_at("troupe-coordinator", listen, &args, &[], None)
            .await
            .expect("start troupe-coordinator")
    }
}

/// Starts an executor worker with its own data dir (`<name>`), a 3 s lease and 2 s calls.
async fn executor(scene: &Scene, name: &str, url: &str, concurrency: usize) -> ChildService {
    let data = scene.path(name).display().to_string();
    let log = scene.path(&format!("{name}.log"));
    let concurrency = concurrency.to_string();
    // The (confined) agents record their runs in the scene's control dir.
    let control = scene.plan_dir().join("control").display().to_string();
    ChildService::start_at(
        "troupe-executor",
        free_addr(),
        &[
            "--sandbox-write-path",
            &control,
            "--data-dir",
            &data,
            "--coordinator-url",
            url,
            "--concurrency",
            &concurrency,
            "--worker-id",
            name,
            "--lease-seconds",
            "3",
            "--rpc-timeout-seconds",
            "2",
        ],
        &[],
        Some(&log),
    )
    .await
    .expect("start troupe-executor")
}

/// Polls the session until it ends (riding out coordinator restarts) and returns it.
async fn finished(url: &str, id: &str, within: Duration) -> GetSessionResponse {
    let deadline = Instant::now() + within;
    let mut last = None;
    loop {
        if let Ok(view) = session(url, id).await {
            let state = view.session.as_ref().map(|s| s.state());
            if matches!(
                state,
                Some(SessionState::Completed | SessionState::Failed | SessionState::Cancelled)
            ) {
                return view;
            }
            last = Some(view);
        }
        assert!(
            Instant::now() < deadline,
            "session {id} did not finish within {within:?}:\n{}",
            last.as_ref()
                .map(troupe::report::final_report)
                .unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What reached the session branch: per task, its non-merge commits' attempt trailers.
fn landed(view: &GetSessionResponse) -> (PathBuf, String, Vec<(String, String)>) {
    let session = view.session.as_ref().expect("session");
    let repo = &session.repos[0];
    let path = PathBuf::from(&repo.path);
    let log = troupe_testkit::git(
        &path,
        &[
            "log",
            "--no-merges",
            "--format=%(trailers:key=Troupe-Task,valueonly,separator=)%x09%(trailers:key=Troupe-Attempt,valueonly,separator=)",
            &format!("{}..{}", repo.base_commit, repo.branch),
        ],
    )
    .expect("git log");
    let commits = log
        .lines()
        .filter_map(|line| {
            let (task, attempt) = line.split_once('\t')?;
            let task = task.rsplit('/').next()?.trim().to_owned();
            Some((task, attempt.trim().to_owned()))
        })
        .collect();
    (path, repo.branch.clone(), commits)
}

/// Asserts the session completed, every task is on its branch exactly once with the file its
/// agent wrote, and returns the landed attempt of each task.
fn assert_each_landed_once(scene: &Scene, view: &GetSessionResponse) -> Vec<(String, String)> {
    let report = troupe::report::final_report(view);
    let session = view.session.as_ref().expect("session");
    assert_eq!(
        session.state(),
        SessionState::Completed,
        "the session did not complete:\n{report}"
    );
    let (path, branch, commits) = landed(view);
    let mut attempts = Vec::new();
    for id in &scene.tasks {
        let task = view.tasks.iter().find(|t| &t.id == id).expect("task");
        assert_eq!(task.state(), TaskState::Completed, "{id}:\n{report}");
        let of_task: Vec<_> = commits.iter().filter(|(task, _)| task == id).collect();
        assert_eq!(
            of_task.len(),
            1,
            "{id} must land exactly once on {branch}, found {of_task:?}:\n{report}"
        );
        let file = troupe_testkit::git(&path, &["show", &format!("{branch}:{id}.txt")])
            .unwrap_or_else(|err| panic!("{id}.txt is not on {branch}: {err}"));
        assert!(file.starts_with(&format!("{id} by ")), "{file}");
        attempts.push((id.clone(), of_task[0].1.clone()));
    }
    assert_eq!(
        commits.len(),
        scene.tasks.len(),
        "commits of no task on {branch}: {commits:?}"
    );
    attempts
}

/// Asserts no agent process (nor its background grandchild) of any run is still alive.
async fn assert_no_agent_left(scene: &Scene) {
    troupe_testkit::eventually("every agent process to be gone", || async {
        let alive: Vec<i32> = scene
            .tasks
            .iter()
            .flat_map(|task| scene.runs(task))
            .flat_map(|run| [run.pid, run.grandchild])
            .filter(|pid| running(*pid))
            .collect();
        alive.is_empty().then_some(())
    })
    .await;
}

/// 40 tasks in 8 chains of 5 (each task depends on the one before it in its chain).
fn chains() -> Vec<(String, Vec<String>, u64)> {
    let mut tasks = Vec::new();
    for chain in 0..8u64 {
        for link in 0..5u64 {
            let n = chain * 5 + link + 1;
            let deps = if link == 0 {
                Vec::new()
            } else {
                vec![format!("IMPL-{:03}", n - 1)]
            };
            tasks.push((format!("IMPL-{n:03}"), deps, 200 + 150 * ((n * 7) % 5)));
        }
    }
    tasks
}

/// kill -9 of the coordinator 10 times during a 40-task session, then once for longer than a
/// lease while the executors keep working: every task lands exactly once, none is lost.
async fn coordinator_storm(postgres: bool) -> anyhow::Result<()> {
    let scene = Scene::new("storm", &chains())?;
    let Some(store) = Store::new(&scene, postgres).await else {
        return Ok(());
    };
    let addr = free_addr();
    let mut coordinator = store.start(addr).await;
    let url = coordinator.url();
    let mut executors = Vec::new();
    for name in ["executor-a", "executor-b", "executor-c"] {
        executors.push(executor(&scene, name, &url, 2).await);
    }
    let id = scene.create(&url).await?;
    let mut rng = 0x9e37_79b9_u64;
    let mut next = |bound: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % bound
    };
    for kill in 0..11 {
        tokio::time::sleep(Duration::from_millis(400 + next(900))).await;
        coordinator.kill9().await?;
        // The last outage outlasts the 3 s lease while agents keep working.
        let down = if kill == 10 {
            Duration::from_secs(5)
        } else {
            Duration::from_millis(100 + next(900))
        };
        tokio::time::sleep(down).await;
        coordinator = store.start(addr).await;
    }
    let view = finished(&url, &id, Duration::from_secs(240)).await;
    let attempts = assert_each_landed_once(&scene, &view);
    let retried = attempts.iter().filter(|(_, a)| a != "1").count();
    eprintln!(
        "storm on {}: 40 tasks landed once each; {retried} landed by a later attempt",
        if postgres { "PostgreSQL" } else { "SQLite" }
    );
    for executor in executors {
        executor.terminate(Duration::from_secs(20)).await?;
    }
    assert_no_agent_left(&scene).await;
    coordinator.terminate(Duration::from_secs(20)).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinator_killed_eleven_times_lands_every_task_once_on_sqlite() -> anyhow::Result<()> {
    coordinator_storm(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinator_killed_eleven_times_lands_every_task_once_on_postgres() -> anyhow::Result<()> {
    coordinator_storm(true).await
}

/// The executor running the task whose agent is `run`.
fn running_it(executors: &mut Vec<ChildService>, run: Run) -> ChildService {
    let at = executors
        .iter()
        .position(|e| e.child.id().and_then(|p| i32::try_from(p).ok()) == Some(run.executor))
        .expect("the agent's parent is one of the executors");
    executors.remove(at)
}

/// kill -9 of the executor mid-task: its agent and the agent's own child die with it, the
/// task completes on the other executor with exactly one commit, and nothing of the dead
/// attempt lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_killed_mid_task_lands_once_elsewhere_and_leaves_no_orphan()
-> anyhow::Result<()> {
    let scene = Scene::new("killed", &[("IMPL-001".to_owned(), Vec::new(), 300)])?;
    scene.hold("IMPL-001")?;
    let store = Store::new(&scene, false).await.expect("sqlite");
    let coordinator = store.start(free_addr()).await;
    let url = coordinator.url();
    let mut executors = vec![
        executor(&scene, "executor-a", &url, 1).await,
        executor(&scene, "executor-b", &url, 1).await,
    ];
    let id = scene.create(&url).await?;
    let first = scene.started("IMPL-001", 1).await;
    running_it(&mut executors, first).kill9().await?;
    let killed = Instant::now();
    troupe_testkit::eventually("the dead executor's agent and its child to die", || async {
        (!running(first.pid) && !running(first.grandchild)).then_some(())
    })
    .await;
    eprintln!("agent group gone {:?} after kill -9", killed.elapsed());
    assert!(
        killed.elapsed() < Duration::from_secs(2),
        "the agent outlived its executor"
    );

    scene.release("IMPL-001")?;
    let view = finished(&url, &id, Duration::from_secs(60)).await;
    let attempts = assert_each_landed_once(&scene, &view);
    assert_eq!(attempts, [("IMPL-001".to_owned(), "2".to_owned())]);
    let runs = scene.runs("IMPL-001");
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert_ne!(runs[1].executor, first.executor);
    for executor in executors {
        executor.terminate(Duration::from_secs(20)).await?;
    }
    assert_no_agent_left(&scene).await;
    coordinator.terminate(Duration::from_secs(20)).await?;
    Ok(())
}

/// An executor stopped (`SIGSTOP`) past its lease while its agent finishes the work, then
/// continued (`SIGCONT`) after the task landed from another executor: its late commit never
/// reaches the branch and its late result is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_stopped_past_its_lease_never_lands_late() -> anyhow::Result<()> {
    let scene = Scene::new("stopped", &[("IMPL-001".to_owned(), Vec::new(), 300)])?;
    scene.hold("IMPL-001")?;
    let store = Store::new(&scene, false).await.expect("sqlite");
    let coordinator = store.start(free_addr()).await;
    let url = coordinator.url();
    let mut executors = vec![
        executor(&scene, "executor-a", &url, 1).await,
        executor(&scene, "executor-b", &url, 1).await,
    ];
    let id = scene.create(&url).await?;
    let first = scene.started("IMPL-001", 1).await;
    // Whichever executor claimed first is the one frozen; its log says what it did.
    let stopped_log = [("executor-a", &executors[0]), ("executor-b", &executors[1])]
        .into_iter()
        .find(|(_, e)| e.child.id().and_then(|p| i32::try_from(p).ok()) == Some(first.executor))
        .map(|(name, _)| scene.path(&format!("{name}.log")))
        .expect("the agent's parent is one of the executors");
    let stopped = running_it(&mut executors, first);
    stopped.signal(Signal::SIGSTOP)?;
    // The first agent finishes its edit while its executor is frozen; the second run (on the
    // other executor, once the lease lapsed) does the same.
    scene.release("IMPL-001")?;
    let view = finished(&url, &id, Duration::from_secs(60)).await;
    let attempts = assert_each_landed_once(&scene, &view);
    assert_eq!(attempts, [("IMPL-001".to_owned(), "2".to_owned())]);
    let (path, branch, _) = landed(&view);
    let head = troupe_testkit::git(&path, &["rev-parse", &branch])?;

    stopped.signal(Signal::SIGCONT)?;
    let log = stopped_log;
    troupe_testkit::eventually("the continued executor to give its attempt up", || async {
        std::fs::read_to_string(&log)
            .ok()
            .filter(|text| text.contains("attempt abandoned"))
            .map(drop)
    })
    .await;
    // Long enough for anything late to land, were it able to.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(troupe_testkit::git(&path, &["rev-parse", &branch])?, head);
    let view = session(&url, &id).await?;
    assert_each_landed_once(&scene, &view);
    let file = troupe_testkit::git(&path, &["show", &format!("{branch}:IMPL-001.txt")])?;
    let second = scene.runs("IMPL-001")[1];
    assert_eq!(
        file,
        format!("IMPL-001 by {}", second.pid),
        "the second run's edit landed"
    );

    executors.push(stopped);
    for executor in executors {
        executor.terminate(Duration::from_secs(20)).await?;
    }
    assert_no_agent_left(&scene).await;
    coordinator.terminate(Duration::from_secs(20)).await?;
    Ok(())
}

/// A worker in its own network namespace, cut off from the coordinator (its veth link down for
/// longer than the lease, then up again): it stops its agent and abandons the attempt, the
/// task lands once from a worker that can still reach the coordinator, and nothing of the
/// cut-off attempt lands after the link comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_worker_abandons_and_the_task_lands_once() -> anyhow::Result<()> {
    let Some(net) = crate::netns::Partition::create()? else {
        return Ok(());
    };
    let scene = Scene::new("partitioned", &[("IMPL-001".to_owned(), Vec::new(), 300)])?;
    scene.hold("IMPL-001")?;
    let store = Store::new(&scene, false).await.expect("sqlite");
    let port = free_addr().port();
    // Both sides reach the coordinator: the host on loopback, the namespace over the veth.
    let coordinator = store.start(SocketAddr::from(([0, 0, 0, 0], port))).await;
    let host_url = format!("http://127.0.0.1:{port}");
    let ns_url = format!("http://{}:{port}", net.host_ip());

    let cut_off = net
        .start_executor(
            "troupe-executor",
            &[
                "--sandbox-write-path",
                &scene.plan_dir().join("control").display().to_string(),
                "--data-dir",
                &scene.path("executor-ns").display().to_string(),
                "--coordinator-url",
                &ns_url,
                "--concurrency",
                "1",
                "--worker-id",
                "executor-ns",
                "--lease-seconds",
                "3",
                "--rpc-timeout-seconds",
                "2",
            ],
            &scene.path("executor-ns.log"),
        )
        .await?;
    let id = scene.create(&host_url).await?;
    let first = scene.started("IMPL-001", 1).await;
    assert_eq!(
        Some(first.executor),
        cut_off.child.id().and_then(|p| i32::try_from(p).ok())
    );
    let other = executor(&scene, "executor-host", &host_url, 1).await;

    net.link(false)?;
    let cut = Instant::now();
    troupe_testkit::eventually("the cut-off worker to stop its agent", || async {
        (!running(first.pid) && !running(first.grandchild)).then_some(())
    })
    .await;
    eprintln!(
        "cut-off agent stopped {:?} after the link went down",
        cut.elapsed()
    );
    scene.release("IMPL-001")?;
    let view = finished(&host_url, &id, Duration::from_secs(60)).await;
    let attempts = assert_each_landed_once(&scene, &view);
    assert_eq!(attempts, [("IMPL-001".to_owned(), "2".to_owned())]);
    let log = std::fs::read_to_string(scene.path("executor-ns.log"))?;
    assert!(log.contains("attempt abandoned"), "{log}");

    net.link(true)?;
    let (path, branch, _) = landed(&view);
    let head = troupe_testkit::git(&path, &["rev-parse", &branch])?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(troupe_testkit::git(&path, &["rev-parse", &branch])?, head);
    assert_each_landed_once(&scene, &session(&host_url, &id).await?);

    other.terminate(Duration::from_secs(20)).await?;
    cut_off.terminate(Duration::from_secs(20)).await?;
    assert_no_agent_left(&scene).await;
    coordinator.terminate(Duration::from_secs(20)).await?;
    drop(net);
    Ok(())
}
