//! Separate processes: two `troupe-coordinator` processes on one PostgreSQL, `kill -9` of the
//! coordinator mid-session (SQLite and PostgreSQL), and `kill -9` of a worker process.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;
use troupe_proto::v1::{self as pb, Role, SessionState, TaskState};

use crate::support::{Db, db_tests, event_log, fresh_schema};

/// Env var that turns [`worker_process`] into a real worker (it is a no-op test otherwise).
const WORKER_URL_ENV: &str = "TROUPE_TEST_WORKER_URL";
/// Lease of the worker process in the worker-kill test.
const WORKER_LEASE: Duration = Duration::from_secs(2);

/// A free loopback port a moment ago.
fn free_addr() -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr")
}

/// A `troupe-coordinator` process on a fixed address (restartable on the same address).
struct CoordinatorProcess {
    child: Child,
    addr: std::net::SocketAddr,
}

impl CoordinatorProcess {
    async fn start(
        data_dir: &Path,
        database_url: Option<&str>,
        addr: std::net::SocketAddr,
    ) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_troupe-coordinator"));
        command
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--data-dir")
            .arg(data_dir)
            .env("RUST_LOG", "warn")
            .env_remove("TROUPE_DATABASE_URL")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        if let Some(url) = database_url {
            command.arg("--database-url").arg(url);
        }
        let child = command.spawn().expect("start troupe-coordinator");
        let process = Self { child, addr };
        let url = process.url();
        troupe_testkit::eventually("the coordinator process to answer", || {
            let url = url.clone();
            async move {
                let mut client = troupe_grpc::coordinator_client(&url).ok()?;
                client
                    .list_sessions(pb::ListSessionsRequest::default())
                    .await
                    .ok()
            }
        })
        .await;
        process
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Sends `signal` (SIGSTOP, SIGCONT) to the process.
    fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = self.child.id().expect("running");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid")),
            signal,
        )
        .expect("signal the coordinator");
    }

    /// `kill -9`: no shutdown, no flush.
    async fn kill9(mut self) {
        self.child.start_kill().expect("SIGKILL");
        self.child.wait().await.expect("reap");
    }
}

/// A plan of `n` independent executor tasks plus a chain of three, in a fresh git repo.
fn plan(dir: &Path, name: &str, n: usize) -> (String, String) {
    let base = dir.join("plan");
    troupe_testkit::git_repo(&base.join("repo"), &[("README.md", "hi\n")]).expect("git repo");
    let mut tasks: Vec<Value> = (1..=n)
        .map(|i| json!({"id": format!("IMPL-{i}"), "title": format!("task {i}")}))
        .collect();
    tasks.push(json!({"id": "VALIDATE-1", "title": "after 1", "depends_on": ["IMPL-1"], "role": "executor"}));
    tasks.push(json!({"id": "VALIDATE-2", "title": "after V1", "depends_on": ["VALIDATE-1"], "role": "executor"}));
    let plan = json!({"name": name, "repos": {"app": {"path": "repo"}}, "tasks": tasks});
    (plan.to_string(), base.display().to_string())
}

async fn create_session(url: &str, plan_json: String, base_dir: String) -> String {
    let mut client = troupe_grpc::coordinator_client(url).expect("client");
    client
        .create_session(pb::CreateSessionRequest {
            plan_json,
            base_dir,
            ..Default::default()
        })
        .await
        .expect("create session")
        .into_inner()
        .session
        .expect("session")
        .id
}

/// What the fake workers saw: every claim and every acknowledged completion.
#[derive(Default)]
struct Ledger {
    /// (task id, fencing token) of every claim handed out.
    claims: Vec<(String, u64)>,
    /// Task id -> result summaries whose CompleteTask was acknowledged.
    acked: HashMap<String, Vec<String>>,
    /// Task id -> summaries whose CompleteTask got no answer (the coordinator died).
    in_doubt: HashMap<String, Vec<String>>,
}

/// A fake worker: claims executor tasks from `urls` (round robin), completes each with a
/// summary naming itself, and records everything in `ledger`, until `stop`.
async fn fake_worker(
    name: String,
    urls: Vec<String>,
    lease: Duration,
    ledger: Arc<Mutex<Ledger>>,
    stop: CancellationToken,
) {
    let mut turn = 0usize;
    while !stop.is_cancelled() {
        let url = &urls[turn % urls.len()];
        turn += 1;
        let Ok(mut client) = troupe_grpc::coordinator_client(url) else {
            continue;
        };
        let claimed = client
            .claim_tasks(pb::ClaimTasksRequest {
                worker_id: name.clone(),
                roles: vec![Role::Executor as i32],
                max_tasks: 2,
                wait: Some(prost_types::Duration {
                    seconds: 0,
                    nanos: 200_000_000,
                }),
                lease_duration: prost_types::Duration::try_from(lease).ok(),
                capabilities: Vec::new(),
                ..Default::default()
            })
            .await;
        let claimed = match claimed {
            Ok(response) => response.into_inner().tasks,
            Err(_) => {
                // The coordinator is down or restarting.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        for task in claimed {
            let lease = task.lease.expect("lease");
            let task = task.task.expect("task");
            ledger
                .lock()
                .expect("ledger")
                .claims
                .push((task.id.clone(), lease.fencing_token));
            let summary = format!("{} by {name} token {}", task.id, lease.fencing_token);
            let outcome = client
                .complete_task(pb::CompleteTaskRequest {
                    session_id: task.session_id.clone(),
                    task_id: task.id.clone(),
                    fencing_token: lease.fencing_token,
                    result: Some(pb::TaskResult {
                        summary: summary.clone(),
                        ..Default::default()
                    }),
                    claim_next: None,
                })
                .await;
            let mut ledger = ledger.lock().expect("ledger");
            match outcome {
                Ok(_) => ledger.acked.entry(task.id).or_default().push(summary),
                Err(status) if status.code() == tonic::Code::FailedPrecondition => {}
                Err(_) => ledger.in_doubt.entry(task.id).or_default().push(summary),
            }
        }
    }
}

/// Reads the whole event log and counts transitions into `completed` per task.
async fn completions_in_log(url: &str, session: &str) -> BTreeMap<String, usize> {
    let mut client = troupe_grpc::coordinator_client(url).expect("client");
    let mut counts = BTreeMap::new();
    for event in event_log(&mut client, session).await {
        if let Some(pb::session_event::Kind::Task(change)) = event.kind
            && change.to() == TaskState::Completed
        {
            *counts.entry(change.task_id).or_insert(0) += 1;
        }
    }
    counts
}

async fn get(url: &str, session: &str) -> pb::GetSessionResponse {
    troupe_grpc::coordinator_client(url)
        .expect("client")
        .get_session(pb::GetSessionRequest {
            session_id: session.to_owned(),
            ..Default::default()
        })
        .await
        .expect("get session")
        .into_inner()
}

/// Asserts every task completed exactly once, with an acknowledged (or the one in-doubt)
/// result, and that no task was acknowledged twice.
fn assert_exactly_once(
    view: &pb::GetSessionResponse,
    log: &BTreeMap<String, usize>,
    ledger: &Ledger,
) {
    assert_eq!(
        view.session.as_ref().expect("session").state(),
        SessionState::Completed
    );
    for task in &view.tasks {
        assert_eq!(task.state(), TaskState::Completed, "{}", task.id);
        assert_eq!(
            log.get(&task.id),
            Some(&1),
            "{} completed once in the log",
            task.id
        );
        let summary = &task.result.as_ref().expect("result").summary;
        let acked = ledger.acked.get(&task.id).cloned().unwrap_or_default();
        assert!(
            acked.len() <= 1,
            "{} acknowledged twice: {acked:?}",
            task.id
        );
        match acked.first() {
            Some(expected) => assert_eq!(summary, expected, "{}", task.id),
            None => assert!(
                ledger
                    .in_doubt
                    .get(&task.id)
                    .is_some_and(|sent| sent.contains(summary)),
                "{}: result {summary} was never sent",
                task.id
            ),
        }
    }
}

async fn coordinator_kill9_mid_session_loses_and_repeats_nothing(db: Db) {
    let _log = troupe_testkit::trace_init();
    let dir = tempfile::tempdir().expect("tempdir");
    let database_url = db.database_url().await;
    let data_dir = dir.path().join("data");
    let addr = free_addr();
    let coordinator = CoordinatorProcess::start(&data_dir, database_url.as_deref(), addr).await;
    let url = coordinator.url();
    let (plan_json, base_dir) = plan(dir.path(), "crash", 40);
    let session = create_session(&url, plan_json, base_dir).await;

    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let stop = CancellationToken::new();
    let workers: Vec<_> = (0..4)
        .map(|i| {
            tokio::spawn(fake_worker(
                format!("worker-{i}"),
                vec![url.clone()],
                Duration::from_secs(2),
                Arc::clone(&ledger),
                stop.clone(),
            ))
        })
        .collect();
    troupe_testkit::eventually("a third of the tasks acknowledged", || {
        let ledger = Arc::clone(&ledger);
        async move { (ledger.lock().expect("ledger").acked.len() >= 14).then_some(()) }
    })
    .await;
    coordinator.kill9().await;
    let acked_at_kill = ledger.lock().expect("ledger").acked.len();
    assert!(acked_at_kill < 42, "the kill came mid-session");

    let coordinator = CoordinatorProcess::start(&data_dir, database_url.as_deref(), addr).await;
    troupe_testkit::eventually("the session to complete after the restart", || {
        let url = url.clone();
        let session = session.clone();
        async move {
            let view = get(&url, &session).await;
            (view.session.as_ref()?.state() == SessionState::Completed).then_some(())
        }
    })
    .await;
    stop.cancel();
    for worker in workers {
        worker.await.expect("worker");
    }
    let view = get(&url, &session).await;
    let log = completions_in_log(&url, &session).await;
    assert_eq!(view.tasks.len(), 42);
    assert_exactly_once(&view, &log, &ledger.lock().expect("ledger"));
    coordinator.kill9().await;
}

/// Several coordinators need a shared server database: PostgreSQL only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_coordinator_processes_never_hand_out_a_task_twice() {
    let Some(Db::Postgres(admin)) = Db::postgres() else {
        return;
    };
    let _log = troupe_testkit::trace_init();
    let dir = tempfile::tempdir().expect("tempdir");
    let database_url = fresh_schema(&admin).await;
    let first =
        CoordinatorProcess::start(&dir.path().join("a"), Some(&database_url), free_addr()).await;
    let second =
        CoordinatorProcess::start(&dir.path().join("b"), Some(&database_url), free_addr()).await;
    let (plan_json, base_dir) = plan(dir.path(), "ha", 80);
    let session = create_session(&first.url(), plan_json, base_dir).await;
    // The other coordinator serves the same session.
    assert_eq!(get(&second.url(), &session).await.tasks.len(), 82);

    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let stop = CancellationToken::new();
    let urls = vec![first.url(), second.url()];
    let workers: Vec<_> = (0..8)
        .map(|i| {
            // Half the workers start on each coordinator, then alternate.
            let mut urls = urls.clone();
            urls.rotate_left(i % 2);
            tokio::spawn(fake_worker(
                format!("worker-{i}"),
                urls,
                Duration::from_secs(60),
                Arc::clone(&ledger),
                stop.clone(),
            ))
        })
        .collect();
    let url = second.url();
    troupe_testkit::eventually("the session to complete through both coordinators", || {
        let url = url.clone();
        let session = session.clone();
        async move {
            let view = get(&url, &session).await;
            (view.session.as_ref()?.state() == SessionState::Completed).then_some(())
        }
    })
    .await;
    stop.cancel();
    for worker in workers {
        worker.await.expect("worker");
    }
    let view = get(&first.url(), &session).await;
    let log = completions_in_log(&first.url(), &session).await;
    {
        let ledger = ledger.lock().expect("ledger");
        let mut claims: BTreeMap<&str, usize> = BTreeMap::new();
        for (task, _) in &ledger.claims {
            *claims.entry(task.as_str()).or_insert(0) += 1;
        }
        let twice: Vec<_> = claims.iter().filter(|(_, n)| **n > 1).collect();
        assert!(twice.is_empty(), "claimed more than once: {twice:?}");
        assert_eq!(claims.len(), 82);
        assert_exactly_once(&view, &log, &ledger);
    }
    first.kill9().await;
    second.kill9().await;
}

/// Not a test on its own: with `TROUPE_TEST_WORKER_URL` set, this test binary becomes a
/// worker process (the real `troupe_grpc::worker` loop) whose tasks never finish.
#[tokio::test]
async fn worker_process() {
    let Ok(url) = std::env::var(WORKER_URL_ENV) else {
        return;
    };
    struct Forever;
    impl troupe_grpc::worker::TaskHandler for Forever {
        async fn handle(
            &self,
            _task: pb::ClaimedTask,
            ctx: troupe_grpc::worker::TaskContext,
        ) -> Result<pb::TaskResult, troupe_grpc::worker::TaskFailure> {
            ctx.progress("working slowly");
            ctx.cancelled().cancelled().await;
            Ok(pb::TaskResult::default())
        }
    }
    let config = troupe_grpc::worker::WorkerConfig {
        coordinator_url: url,
        worker_id: "doomed-worker".to_owned(),
        roles: vec![Role::Executor],
        concurrency: 1,
        lease: WORKER_LEASE,
        poll_wait: Duration::from_millis(500),
        drain_timeout: Duration::from_secs(1),
        rpc_timeout: Duration::from_secs(1),
        connector: troupe_grpc::Connector::default(),
        assets_dir: None,
        health: None,
        capabilities: Vec::new(),
        auto_backend: String::new(),
    };
    troupe_grpc::worker::run_worker(config, Arc::new(Forever), CancellationToken::new())
        .await
        .expect("worker loop");
}

async fn worker_kill9_task_is_redispatched_within_the_lease(db: Db) {
    let harness = crate::support::Harness::start(db).await;
    let created = harness
        .create(json!({"name": "doomed", "tasks": [{"id": "IMPL-1", "title": "slow"}]}))
        .await;
    let session = crate::support::session_id(&created);
    let mut worker = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "processes::worker_process", "--nocapture"])
        .env(WORKER_URL_ENV, harness.service.url())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start worker process");
    troupe_testkit::eventually(
        "the worker process to run IMPL-1 and report progress",
        || async {
            let view = harness.session(&session).await;
            let task = crate::support::task(&view.tasks, "IMPL-1");
            (task.state() == TaskState::Running && task.progress == "working slowly").then_some(())
        },
    )
    .await;
    worker.start_kill().expect("SIGKILL");
    let killed_at = Instant::now();
    worker.wait().await.expect("reap");
    let claimed = harness
        .claim_with(
            &[Role::Executor],
            1,
            WORKER_LEASE + Duration::from_secs(5),
            Duration::from_secs(30),
        )
        .await;
    let waited = killed_at.elapsed();
    assert_eq!(crate::support::ids(&claimed), vec!["IMPL-1"]);
    assert!(
        waited <= WORKER_LEASE + Duration::from_secs(1),
        "re-dispatched after {waited:?}, more than the lease plus one second"
    );
    let lease = claimed[0].lease.as_ref().expect("lease");
    assert_eq!(lease.attempt, 2);
    harness.stop().await;
}

/// What the probe handler saw of its lease.
#[derive(Debug)]
struct Observed {
    first: Result<tokio::time::Instant, troupe_grpc::worker::LeaseLost>,
    first_asked: tokio::time::Instant,
    fencing_token: u64,
    attempt: u32,
    second: Result<tokio::time::Instant, troupe_grpc::worker::LeaseLost>,
    second_answered: tokio::time::Instant,
    deadline: tokio::time::Instant,
    cancelled_at: tokio::time::Instant,
}

/// `TaskContext::confirm_lease` against a coordinator process, then with that process
/// stopped (`SIGSTOP`): the second confirmation gives up at the lease's local deadline
/// (unreachable) instead of hanging, the attempt's context is cancelled by then, and the
/// worker counts the attempt abandoned, not completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirm_lease_answers_by_the_deadline_when_the_coordinator_is_stopped() {
    use tokio::sync::{Notify, oneshot};
    use troupe_grpc::worker::{LeaseLost, TaskContext, TaskFailure, TaskHandler, WorkerConfig};

    const LEASE: Duration = Duration::from_secs(2);
    struct Probe {
        confirmed: Arc<Notify>,
        stopped: Arc<Notify>,
        seen: Mutex<Option<oneshot::Sender<Observed>>>,
    }
    impl TaskHandler for Probe {
        async fn handle(
            &self,
            _task: pb::ClaimedTask,
            ctx: TaskContext,
        ) -> Result<pb::TaskResult, TaskFailure> {
            let first_asked = tokio::time::Instant::now();
            let first = ctx.confirm_lease().await;
            self.confirmed.notify_one();
            self.stopped.notified().await;
            let second = ctx.confirm_lease().await;
            let second_answered = tokio::time::Instant::now();
            let deadline = ctx.lease_deadline();
            ctx.cancelled().cancelled().await;
            let observed = Observed {
                first,
                first_asked,
                fencing_token: ctx.fencing_token(),
                attempt: ctx.attempt(),
                second,
                second_answered,
                deadline,
                cancelled_at: tokio::time::Instant::now(),
            };
            if let Some(seen) = self.seen.lock().expect("seen").take() {
                let _ = seen.send(observed);
            }
            Ok(pb::TaskResult::default())
        }
    }

    let dir = tempfile::tempdir().expect("tempdir");
    let coordinator = CoordinatorProcess::start(&dir.path().join("data"), None, free_addr()).await;
    let (plan_json, base_dir) = plan(dir.path(), "confirm", 1);
    create_session(&coordinator.url(), plan_json, base_dir).await;
    let (seen, observed) = oneshot::channel();
    let probe = Arc::new(Probe {
        confirmed: Arc::new(Notify::new()),
        stopped: Arc::new(Notify::new()),
        seen: Mutex::new(Some(seen)),
    });
    let mut config = WorkerConfig::new(coordinator.url(), "probe", vec![Role::Executor]);
    config.lease = LEASE;
    config.rpc_timeout = Duration::from_millis(500);
    config.poll_wait = Duration::from_millis(500);
    config.drain_timeout = Duration::from_secs(1);
    let stop = CancellationToken::new();
    let worker = tokio::spawn(troupe_grpc::worker::run_worker(
        config,
        Arc::clone(&probe) as Arc<Probe>,
        stop.clone(),
    ));

    tokio::time::timeout(Duration::from_secs(30), probe.confirmed.notified())
        .await
        .expect("the probe confirmed its lease");
    coordinator.signal(nix::sys::signal::Signal::SIGSTOP);
    probe.stopped.notify_one();
    let seen = tokio::time::timeout(LEASE * 3, observed)
        .await
        .expect("the probe saw its lease end within the lease")
        .expect("observed");

    let first = seen
        .first
        .clone()
        .expect("confirmed while the coordinator ran");
    assert!(
        first >= seen.first_asked + LEASE
            && first <= seen.first_asked + LEASE + Duration::from_millis(500),
        "{seen:?}"
    );
    assert!(seen.fencing_token > 0 && seen.attempt == 1, "{seen:?}");
    assert!(
        matches!(seen.second, Err(LeaseLost::Unreachable { .. })),
        "{seen:?}"
    );
    let slack = Duration::from_millis(300);
    assert!(
        seen.second_answered <= seen.deadline + slack,
        "confirm_lease answered {:?} past the lease deadline",
        seen.second_answered - seen.deadline
    );
    assert!(
        seen.cancelled_at <= seen.deadline + slack,
        "the context was cancelled {:?} past the lease deadline",
        seen.cancelled_at - seen.deadline
    );

    // Stopping the worker does not wait for the stopped coordinator either.
    let stopping = Instant::now();
    stop.cancel();
    let stats = tokio::time::timeout(Duration::from_secs(5), worker)
        .await
        .expect("the worker stopped")
        .expect("join")
        .expect("worker loop");
    assert!(stopping.elapsed() < Duration::from_secs(5));
    assert_eq!((stats.completed, stats.abandoned), (0, 1), "{stats:?}");
    coordinator.signal(nix::sys::signal::Signal::SIGCONT);
    coordinator.kill9().await;
}

db_tests!(
    coordinator_kill9_mid_session_loses_and_repeats_nothing,
    worker_kill9_task_is_redispatched_within_the_lease,
);
