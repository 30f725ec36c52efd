//! Coordinator benchmarks through the gRPC worker protocol (performance.md S1 and S2), on
//! SQLite (default settings: WAL, `synchronous=NORMAL`) and PostgreSQL.
//!
//! ```text
//! cargo bench -p troupe-coordinator --bench throughput -- --db sqlite
//! TROUPE_BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//!   cargo bench -p troupe-coordinator --bench throughput -- --db postgres --tasks 2000 --workers 8 --batch 8
//! ```
//!
//! S1 burn-down: one session of `--tasks` no-op tasks (independent, or in the dependency
//! `--shape` given: chains of 100, pairs, a layered DAG) drained by `--workers`
//! concurrent workers claiming up to `--batch` tasks per `ClaimTasks`, completing each with
//! `CompleteTask`; the rate is over the time from the first claim to the last completion.
//! S2 pickup latency: a worker long-polls `ClaimTasks` while a task it waits for is
//! completed; the sample is from sending `CompleteTask` to the long-poll returning the task
//! that became ready (it includes the CompleteTask round trip). `--s2-shape pairs` (the
//! default): each ready task has one dependency; `--s2-shape chain`: one chain, whose n-th
//! claim also carries the n-1 upstream results (so it grows with `--samples`).
//!
//! `--coordinator-bin PATH` (absolute: `cargo bench` runs in the package's directory) runs the
//! coordinator as a process of its own instead of in this one, so `--only memory` reads its
//! memory alone:
//!
//! ```text
//! cargo build --release -p troupe-coordinator --bin troupe-coordinator
//! cargo bench -p troupe-coordinator --bench throughput -- --db sqlite --only memory \
//!   --tasks 100000 --coordinator-bin "$PWD/target/release/troupe-coordinator"
//! ```

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use serde_json::json;
use troupe_proto::v1::{self as pb, Role};

#[derive(Debug, Parser)]
struct Args {
    /// `sqlite` or `postgres` (URL from TROUPE_BENCH_DATABASE_URL or TROUPE_TEST_DATABASE_URL).
    #[arg(long, default_value = "sqlite")]
    db: String,
    /// S1: tasks to burn down.
    #[arg(long, default_value_t = 1000)]
    tasks: usize,
    /// S1: the session's dependency shape: `flat` (independent tasks), `chains` (chains of
    /// 100), `pairs` (every second task waits for the one before it) or `layered` (layers of
    /// 100, each task waiting for 1 to 3 random tasks of the layer before).
    #[arg(long, default_value = "flat")]
    shape: String,
    /// S1, intake and memory: spread `--tasks` over this many sessions (each of `--shape`),
    /// all active at once; S1's report adds each session's time to its last completion (mean
    /// and slowest).
    #[arg(long, default_value_t = 1)]
    sessions: usize,
    /// S1: concurrent workers.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// S1: tasks per claim.
    #[arg(long, default_value_t = 1)]
    batch: u32,
    /// S1: each worker's last `CompleteTask` of a batch also claims its next batch
    /// (`claim_next`), instead of a separate `ClaimTasks`.
    #[arg(long)]
    claim_next: bool,
    /// S1: also log a message to the session every this many milliseconds while it burns
    /// down (a team's message bus next to its workers); 0 logs none.
    #[arg(long, default_value_t = 0)]
    message_every_ms: u64,
    /// S2: latency samples.
    #[arg(long, default_value_t = 300)]
    samples: usize,
    /// S2: `pairs` (each sample readies a task with one dependency) or `chain` (one chain, so
    /// the n-th claim also carries the n-1 completed tasks upstream of it).
    #[arg(long, default_value = "pairs")]
    s2_shape: String,
    /// Run only `s1`, `s2`, `intake` (S1's sessions created, then read: intake time,
    /// `CheckSession`, `GetSession`, a `ListTasks` page and the process's peak RSS; no
    /// burn-down) or `memory` (`--tasks` in `--sessions` uploaded over `UploadPlan`, one read,
    /// watched, `--burn` of its tasks done; the coordinator's VmHWM and VmRSS after intake and
    /// at the end).
    #[arg(long)]
    only: Option<String>,
    /// Run this `troupe-coordinator` binary as a process of its own (a free loopback port, its
    /// data directory in a temporary directory, `--database-url` for PostgreSQL) instead of the
    /// coordinator in this process.
    #[arg(long)]
    coordinator_bin: Option<std::path::PathBuf>,
    /// `--only memory`: tasks claimed and completed (by `--workers`, `--batch` a claim) while
    /// the rest of the session stays ready.
    #[arg(long, default_value_t = 1000)]
    burn: usize,
    // `cargo bench` passes `--bench`; accept and ignore it.
    #[arg(long, hide = true)]
    bench: bool,
}

type Client = troupe_grpc::CoordinatorClient;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let bench = match &args.coordinator_bin {
        Some(bin) => common::Bench::spawn(&args.db, bin).await?,
        None => common::Bench::start(&args.db, troupe_coordinator::Tuning::default()).await?,
    };
    let (client, base_dir) = (bench.client.clone(), bench.base_dir.clone());
    // Stopped either way: dropping a running bench would hide the error behind a panic.
    let result = async {
        match args.only.as_deref() {
            Some("intake") => intake(&client, &base_dir, &args).await?,
            Some("memory") => memory(&bench, &args).await?,
            Some("s1") => s1(&client, &base_dir, &args, bench.pid()).await?,
            Some("s2") => s2(&client, &base_dir, &args).await?,
            None => {
                s1(&client, &base_dir, &args, bench.pid()).await?;
                s2(&client, &base_dir, &args).await?;
            }
            Some(other) => bail!("unknown --only {other}"),
        }
        anyhow::Ok(())
    }
    .await;
    bench.stop().await?;
    result
}

async fn create(
    client: &Client,
    base_dir: &str,
    name: &str,
    tasks: Vec<serde_json::Value>,
) -> anyhow::Result<String> {
    let plan = json!({"name": name, "repos": {"app": {"path": "repo"}}, "tasks": tasks});
    common::create_session(client, base_dir, &plan).await
}

fn claim_request(worker: &str, max: u32, wait: Duration) -> pb::ClaimTasksRequest {
    claim_role(worker, Role::Executor, max, wait)
}

fn claim_role(worker: &str, role: Role, max: u32, wait: Duration) -> pb::ClaimTasksRequest {
    pb::ClaimTasksRequest {
        worker_id: worker.to_owned(),
        roles: vec![role as i32],
        max_tasks: max,
        wait: prost_types::Duration::try_from(wait).ok(),
        lease_duration: prost_types::Duration::try_from(Duration::from_secs(60)).ok(),
        capabilities: Vec::new(),
        ..Default::default()
    }
}

/// Completes a task; with `claim_next`, also claims the worker's next tasks and returns them.
async fn complete_then(
    client: &mut Client,
    claimed: &pb::ClaimedTask,
    claim_next: Option<pb::ClaimTasksRequest>,
) -> anyhow::Result<Vec<pb::ClaimedTask>> {
    let task = claimed.task.as_ref().context("task")?;
    let response = client
        .complete_task(pb::CompleteTaskRequest {
            session_id: task.session_id.clone(),
            task_id: task.id.clone(),
            fencing_token: claimed.lease.as_ref().context("lease")?.fencing_token,
            result: Some(pb::TaskResult {
                summary: "no-op".to_owned(),
                ..Default::default()
            }),
            claim_next,
        })
        .await?;
    Ok(response.into_inner().next)
}

async fn complete(client: &mut Client, claimed: &pb::ClaimedTask) -> anyhow::Result<()> {
    complete_then(client, claimed, None).await.map(drop)
}

/// The S1 plan's tasks in `shape` (see `--shape`).
fn s1_tasks(shape: &str, count: usize) -> anyhow::Result<Vec<serde_json::Value>> {
    // A fixed-seed generator (xorshift), so a shape is the same in every run.
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut random = move |below: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % below as u64) as usize
    };
    let id = |i: usize| format!("IMPL-{i}");
    (0..count)
        .map(|i| {
            let deps: Vec<String> = match shape {
                "flat" => Vec::new(),
                "chains" if i % 100 == 0 => Vec::new(),
                "chains" => vec![id(i - 1)],
                "pairs" if i % 2 == 0 => Vec::new(),
                "pairs" => vec![id(i - 1)],
                "layered" if i < 100 => Vec::new(),
                "layered" => {
                    let layer = i / 100 * 100;
                    let mut deps: Vec<String> = Vec::new();
                    for _ in 0..1 + random(3) {
                        let dep = id(layer - 100 + random(100));
                        if !deps.contains(&dep) {
                            deps.push(dep);
                        }
                    }
                    deps
                }
                other => bail!("unknown --shape {other}"),
            };
            Ok(json!({"id": id(i), "title": "no-op", "depends_on": deps}))
        })
        .collect()
}

/// Intake alone: S1's sessions created (the plan's JSON built before the clock starts), then
/// the reads of the first, and the peak RSS of this process, which runs the coordinator too
/// (so the figure includes the client's copy of each plan).
async fn intake(client: &Client, base_dir: &str, args: &Args) -> anyhow::Result<()> {
    let per_session = args.tasks / args.sessions.max(1);
    if per_session == 0 || per_session * args.sessions != args.tasks {
        bail!("--tasks must be a multiple of --sessions");
    }
    let mut took = Duration::ZERO;
    let mut sessions = Vec::with_capacity(args.sessions);
    let mut bytes = 0;
    for n in 0..args.sessions {
        let tasks = s1_tasks(&args.shape, per_session)?;
        let plan =
            json!({"name": format!("in-{n}"), "repos": {"app": {"path": "repo"}}, "tasks": tasks});
        let plan_json = plan.to_string();
        drop(plan);
        bytes += plan_json.len();
        let start = Instant::now();
        sessions.push(common::create_session_json(client, base_dir, plan_json).await?);
        took += start.elapsed();
    }
    let reads = reads(client, &sessions[0]).await?;
    println!(
        "intake db={} shape={} tasks={} sessions={} plan {:.1} MB: intake {:.2}s{reads}; peak RSS {}",
        args.db,
        args.shape,
        args.tasks,
        args.sessions,
        bytes as f64 / 1e6,
        took.as_secs_f64(),
        common::peak_rss()
    );
    Ok(())
}

/// `--only memory`: the coordinator's memory with `--tasks` active, in `--sessions` sessions
/// (one by default). Each plan goes in over `UploadPlan` in pieces of 1 MiB (as `troupe run` sends a plan over 1 MiB);
/// then the reads, one `WatchSession` of the whole event log, `--burn` tasks claimed and
/// completed by `--workers`, and the reads again. The coordinator's VmHWM and VmRSS are read
/// at the start, after intake, after the reads and the watch, after the burn and at the end (its own with `--coordinator-bin`; else this
/// process's, client included).
async fn memory(bench: &common::Bench, args: &Args) -> anyhow::Result<()> {
    let client = &bench.client;
    let started = bench.memory();
    let per_session = args.tasks / args.sessions.max(1);
    if per_session == 0 || per_session * args.sessions != args.tasks {
        bail!("--tasks must be a multiple of --sessions");
    }
    let mut bytes = 0;
    let mut sessions = Vec::with_capacity(args.sessions);
    let start = Instant::now();
    for n in 0..args.sessions {
        let plan = json!({"name": format!("memory-{n}"), "repos": {"app": {"path": "repo"}},
                          "tasks": s1_tasks(&args.shape, per_session)?});
        let plan_json = plan.to_string();
        drop(plan);
        bytes += plan_json.len();
        sessions.push(upload(client, &bench.base_dir, plan_json).await?);
    }
    let intake = start.elapsed();
    // The reads and the watch look at the first session; the workers claim from all.
    let session = sessions.swap_remove(0);
    let after_intake = bench.memory();
    let reads_active = reads(client, &session).await?;
    let (events, watched) = watch(client, &session).await?;
    let after_watch = bench.memory();
    let start = Instant::now();
    burn(client, args).await?;
    let burned = start.elapsed();
    let after_burn = bench.memory();
    let reads_after = reads(client, &session).await?;
    println!(
        "memory db={} shape={} tasks={} sessions={} plan {:.1} MB{}: start {started}; intake {:.2}s, after \
         intake {after_intake}{reads_active}; WatchSession {events} events {:.2}s, after the reads \
         and the watch {after_watch}; {} done by {} workers {:.2}s, after {after_burn}{reads_after}; end {}",
        args.db,
        args.shape,
        args.tasks,
        args.sessions,
        bytes as f64 / 1e6,
        if bench.pid().is_some() {
            " (coordinator alone)"
        } else {
            " (coordinator in the bench process)"
        },
        intake.as_secs_f64(),
        watched.as_secs_f64(),
        args.burn,
        args.workers,
        burned.as_secs_f64(),
        bench.memory(),
    );
    Ok(())
}

/// Creates a session over `UploadPlan`: the request, then the plan in pieces of 1 MiB, each
/// copied out as the stream is sent. Returns the session's id.
async fn upload(client: &Client, base_dir: &str, plan_json: String) -> anyhow::Result<String> {
    const PIECE: usize = 1024 * 1024;
    let head = pb::PlanChunk {
        request: Some(pb::CreateSessionRequest {
            base_dir: base_dir.to_owned(),
            ..Default::default()
        }),
        plan_json: Vec::new(),
    };
    let plan = Arc::new(plan_json.into_bytes());
    let pieces = (0..plan.len().div_ceil(PIECE)).map(move |i| pb::PlanChunk {
        request: None,
        plan_json: plan[i * PIECE..plan.len().min((i + 1) * PIECE)].to_vec(),
    });
    let stream = tokio_stream::iter(std::iter::once(head).chain(pieces));
    let created = client.clone().upload_plan(stream).await?.into_inner();
    Ok(created.session.context("no session")?.id)
}

/// The session's row (its counts and last sequence), without its tasks.
async fn session_of(client: &Client, session: &str) -> anyhow::Result<pb::Session> {
    client
        .clone()
        .get_session(pb::GetSessionRequest {
            session_id: session.to_owned(),
            max_tasks: 1,
        })
        .await?
        .into_inner()
        .session
        .context("session")
}

/// Reads the session's whole event log with `WatchSession` (up to its last sequence when the
/// watch began: the session stays active, so the stream would not end). Returns the events
/// read and the time taken.
async fn watch(client: &Client, session: &str) -> anyhow::Result<(u64, Duration)> {
    let start = Instant::now();
    let last = session_of(client, session).await?.last_sequence;
    let mut events = client
        .clone()
        .watch_session(pb::WatchSessionRequest {
            session_id: session.to_owned(),
            after_sequence: 0,
            follow: false,
        })
        .await?
        .into_inner();
    let mut read = 0;
    while let Some(event) = events.message().await? {
        read += 1;
        if event.sequence >= last {
            break;
        }
    }
    if read < last {
        bail!("WatchSession ended after {read} of {last} events");
    }
    Ok((read, start.elapsed()))
}

/// `--burn` tasks claimed (`--batch` a claim) and completed by `--workers` concurrent workers;
/// the rest of the session stays ready.
async fn burn(client: &Client, args: &Args) -> anyhow::Result<()> {
    let budget = args.burn;
    let taken = Arc::new(AtomicUsize::new(0));
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..args.workers {
        let mut client = client.clone();
        let taken = Arc::clone(&taken);
        let batch = args.batch as usize;
        workers.spawn(async move {
            let worker = format!("memory-{w}");
            loop {
                let before = taken.fetch_add(batch, Ordering::Relaxed);
                if before >= budget {
                    return anyhow::Ok(());
                }
                let max = u32::try_from(batch.min(budget - before))?;
                let claimed = client
                    .claim_tasks(claim_request(&worker, max, Duration::from_secs(5)))
                    .await?
                    .into_inner()
                    .tasks;
                if claimed.is_empty() {
                    bail!("{worker} claimed nothing from a session with ready tasks");
                }
                for task in &claimed {
                    complete(&mut client, task).await?;
                }
            }
        });
    }
    while let Some(result) = workers.join_next().await {
        result??;
    }
    Ok(())
}

async fn s1(client: &Client, base_dir: &str, args: &Args, pid: Option<u32>) -> anyhow::Result<()> {
    let per_session = args.tasks / args.sessions.max(1);
    if per_session == 0 || per_session * args.sessions != args.tasks {
        bail!("--tasks must be a multiple of --sessions");
    }
    let created = Instant::now();
    let mut sessions = Vec::with_capacity(args.sessions);
    for n in 0..args.sessions {
        let tasks = s1_tasks(&args.shape, per_session)?;
        sessions.push(create(client, base_dir, &format!("s1-{n}"), tasks).await?);
    }
    let intake = created.elapsed();
    // Per session: tasks completed, and when its last one completed.
    let progress: Arc<std::sync::Mutex<HashMap<String, (usize, Duration)>>> = Arc::default();
    let done = Arc::new(AtomicUsize::new(0));
    // The rate runs to the last completion, as graphile-worker's burn-down does (its queue
    // is empty): by then the other workers wait in a long poll that nothing will answer.
    let finished = Arc::new(OnceLock::new());
    let cpu_before = coordinator_cpu(pid);
    let start = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..args.workers {
        let mut client = client.clone();
        let (done, finished) = (Arc::clone(&done), Arc::clone(&finished));
        let total = args.tasks;
        let batch = args.batch;
        let claim_next = args.claim_next;
        let progress = Arc::clone(&progress);
        workers.spawn(async move {
            let worker = format!("bench-{w}");
            let mut next = Vec::new();
            while done.load(Ordering::Relaxed) < total {
                let claimed = if next.is_empty() {
                    client
                        .claim_tasks(claim_request(&worker, batch, Duration::from_millis(200)))
                        .await?
                        .into_inner()
                        .tasks
                } else {
                    std::mem::take(&mut next)
                };
                let last = claimed.len().saturating_sub(1);
                for (i, task) in claimed.iter().enumerate() {
                    // With --claim-next the last completion of a batch claims the next batch.
                    let then = (claim_next && i == last)
                        .then(|| claim_request(&worker, batch, Duration::ZERO));
                    next = complete_then(&mut client, task, then).await?;
                    let session = task.task.as_ref().context("task")?.session_id.clone();
                    {
                        let mut progress = progress.lock().expect("progress");
                        let entry = progress.entry(session).or_default();
                        entry.0 += 1;
                        entry.1 = start.elapsed();
                    }
                    if done.fetch_add(1, Ordering::Relaxed) + 1 == total {
                        finished.get_or_init(|| start.elapsed());
                    }
                }
            }
            anyhow::Ok(())
        });
    }
    let logger = (args.message_every_ms > 0).then(|| {
        let mut client = client.clone();
        let (done, total, session) = (Arc::clone(&done), args.tasks, sessions[0].clone());
        let every = Duration::from_millis(args.message_every_ms);
        tokio::spawn(async move {
            let mut logged = 0_u64;
            let mut tick = tokio::time::interval(every);
            while done.load(Ordering::Relaxed) < total {
                tick.tick().await;
                client
                    .log_message(pb::LogMessageRequest {
                        session_id: session.clone(),
                        from: "bench".to_owned(),
                        r#type: "progress".to_owned(),
                        summary: format!("note {logged}"),
                        ..Default::default()
                    })
                    .await?;
                logged += 1;
            }
            anyhow::Ok(logged)
        })
    });
    while let Some(result) = workers.join_next().await {
        result??;
    }
    let elapsed = *finished
        .get()
        .ok_or_else(|| anyhow::anyhow!("the workers stopped before the last completion"))?;
    let cpu = coordinator_cpu(pid).saturating_sub(cpu_before);
    let messages = match logger {
        Some(logger) => format!(" messages={}", logger.await??),
        None => String::new(),
    };
    for session in &sessions {
        common::expect_completed(client, session.clone()).await?;
    }
    let reads = if args.sessions == 1 {
        reads(client, &sessions[0]).await?
    } else {
        String::new()
    };
    let fairness = if args.sessions > 1 {
        let progress = progress.lock().expect("progress");
        let times: Vec<f64> = progress.values().map(|(_, at)| at.as_secs_f64()).collect();
        let mean = times.iter().sum::<f64>() / times.len() as f64;
        let slowest = times.iter().copied().fold(0.0, f64::max);
        format!(
            " sessions={}: per session to its last completion mean {:.2}s, slowest {:.2}s ({:.2}x the mean)",
            args.sessions,
            mean,
            slowest,
            slowest / mean
        )
    } else {
        String::new()
    };
    println!(
        "S1 db={} shape={} tasks={} workers={} batch={}{}: intake {:.2}s, {:.2}s, {:.0} tasks/s, coordinator CPU {:.2} ms/task{messages}{fairness}{reads}",
        args.db,
        args.shape,
        args.tasks,
        args.workers,
        args.batch,
        if args.claim_next { " claim-next" } else { "" },
        intake.as_secs_f64(),
        elapsed.as_secs_f64(),
        args.tasks as f64 / elapsed.as_secs_f64(),
        cpu.as_secs_f64() * 1000.0 / args.tasks as f64
    );
    Ok(())
}

/// CPU time (user and system) of the coordinator so far, from /proc: the whole process `pid`
/// when it runs alone, else this process's coordinator threads, its runtime's
/// (`coordinator`) and SQLite's connection threads (`sqlx-sqlite-*`). Less sensitive to a
/// loaded machine than the rate (PostgreSQL's server processes are not counted). Zero where
/// /proc is missing.
fn coordinator_cpu(pid: Option<u32>) -> Duration {
    if let Some(pid) = pid {
        let ticks = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| stat_ticks(&stat).map(|(_, ticks)| ticks))
            .unwrap_or(0);
        return Duration::from_millis(ticks * 10);
    }
    let Ok(threads) = std::fs::read_dir("/proc/self/task") else {
        return Duration::ZERO;
    };
    let mut ticks: u64 = 0;
    for thread in threads.flatten() {
        let Ok(stat) = std::fs::read_to_string(thread.path().join("stat")) else {
            continue;
        };
        let Some((name, used)) = stat_ticks(&stat) else {
            continue;
        };
        if name.starts_with("coordinator") || name.starts_with("sqlx-sqlite") {
            ticks += used;
        }
    }
    // USER_HZ, 100 on Linux.
    Duration::from_millis(ticks * 10)
}

/// The name and the user and system clock ticks of a /proc `stat` line.
fn stat_ticks(stat: &str) -> Option<(&str, u64)> {
    // `pid (comm) state ...`: the name may hold spaces, so split at the last ')'.
    let (open, close) = (stat.find('(')?, stat.rfind(')')?);
    let name = &stat[open + 1..close];
    // After the name: state is field 3, utime 14 and stime 15.
    let fields: Vec<&str> = stat.get(close + 2..)?.split(' ').collect();
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    Some((name, field(14).unwrap_or(0) + field(15).unwrap_or(0)))
}

/// The median of 5 timed calls of `call`, in milliseconds.
async fn median_ms<F, Fut, T>(mut call: F) -> anyhow::Result<f64>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let mut took = Vec::new();
    for _ in 0..5 {
        let start = Instant::now();
        call().await?;
        took.push(start.elapsed().as_secs_f64() * 1e3);
    }
    took.sort_by(f64::total_cmp);
    Ok(took[2])
}

/// How long the reads of a large session take (median of 5): `GetSession` (counts and the
/// first page), a `ListTasks` page of the default size (500) from the middle of the plan,
/// the same with a filter (ready tasks only), `CheckSession`.
async fn reads(client: &Client, session: &str) -> anyhow::Result<String> {
    let get = median_ms(|| {
        let mut client = client.clone();
        let request = pb::GetSessionRequest {
            session_id: session.to_owned(),
            ..Default::default()
        };
        async move { client.get_session(request).await }
    })
    .await?;
    let total = session_of(client, session)
        .await?
        .counts
        .map_or(0, |counts| counts.total);
    // A page token is `after:<position>`, a task's place in plan order.
    let middle = format!("after:{}", total / 2);
    let list = |states: Vec<i32>| {
        let middle = middle.clone();
        median_ms(move || {
            let mut client = client.clone();
            let request_unfiltered = states.is_empty();
            let request = pb::ListTasksRequest {
                session_id: session.to_owned(),
                page_token: middle.clone(),
                states: states.clone(),
                ..Default::default()
            };
            async move {
                let page = client.list_tasks(request).await?.into_inner();
                // A page from the middle of the session, unless the filter leaves none there.
                if page.tasks.is_empty() && request_unfiltered {
                    return Err(tonic::Status::internal("an empty ListTasks page"));
                }
                Ok(page)
            }
        })
    };
    let page = list(Vec::new()).await?;
    let ready = list(vec![pb::TaskState::Ready as i32]).await?;
    let check = median_ms(|| {
        let mut client = client.clone();
        let request = pb::CheckSessionRequest {
            session_id: session.to_owned(),
            ..Default::default()
        };
        async move { client.check_session(request).await }
    })
    .await?;
    Ok(format!(
        "; GetSession {get:.1} ms, ListTasks page {page:.1} ms, ready only {ready:.1} ms, \
         CheckSession {check:.1} ms"
    ))
}

async fn s2(client: &Client, base_dir: &str, args: &Args) -> anyhow::Result<()> {
    let samples = match args.s2_shape.as_str() {
        "pairs" => s2_pairs(client, base_dir, args.samples).await?,
        "chain" => s2_chain(client, base_dir, args.samples).await?,
        other => bail!("unknown --s2-shape {other}"),
    };
    report_s2(args, samples);
    Ok(())
}

/// Executor task `A-i` readies validator task `B-i`: the waiter long-polls as a validator, so
/// the ready `A-*` tasks never answer it, and each claim carries one upstream result.
async fn s2_pairs(client: &Client, base_dir: &str, count: usize) -> anyhow::Result<Vec<Duration>> {
    let tasks = (0..count)
        .flat_map(|i| {
            [
                json!({"id": format!("A-{i}"), "title": "first", "role": "executor"}),
                json!({"id": format!("B-{i}"), "title": "next", "role": "validator",
                       "depends_on": [format!("A-{i}")]}),
            ]
        })
        .collect();
    create(client, base_dir, "s2-pairs", tasks).await?;
    let mut holder = client.clone();
    let mut samples = Vec::with_capacity(count);
    for _ in 0..count {
        let held = holder
            .claim_tasks(claim_request("bench-holder", 1, Duration::from_secs(5)))
            .await?
            .into_inner()
            .tasks
            .pop()
            .context("an A task")?;
        let (sample, next) = pickup(client, &mut holder, &held, Role::Validator).await?;
        samples.push(sample);
        complete(&mut holder, &next).await?;
    }
    Ok(samples)
}

/// One S2 sample: a waiter long-polls for `role`; once it is parked, `holder` completes `held`,
/// which readies the waiter's task. Returns the time from sending the completion to the claim's
/// answer, and the task claimed.
async fn pickup(
    client: &Client,
    holder: &mut Client,
    held: &pb::ClaimedTask,
    role: Role,
) -> anyhow::Result<(Duration, pb::ClaimedTask)> {
    let mut waiter = client.clone();
    let poll = tokio::spawn(async move {
        let response = waiter
            .claim_tasks(claim_role("bench-waiter", role, 1, Duration::from_secs(10)))
            .await;
        (Instant::now(), response)
    });
    // Let the long poll park before the task becomes ready.
    tokio::time::sleep(Duration::from_millis(15)).await;
    let sent = Instant::now();
    complete(holder, held).await?;
    let (claimed_at, response) = poll.await?;
    let next = response?
        .into_inner()
        .tasks
        .pop()
        .context("the readied task")?;
    Ok((claimed_at - sent, next))
}

/// One chain `IMPL-0 → IMPL-1 → …`: the n-th claim also carries n-1 upstream results.
async fn s2_chain(client: &Client, base_dir: &str, count: usize) -> anyhow::Result<Vec<Duration>> {
    let tasks = (0..=count)
        .map(|i| {
            let deps: Vec<String> = if i == 0 {
                Vec::new()
            } else {
                vec![format!("IMPL-{}", i - 1)]
            };
            json!({"id": format!("IMPL-{i}"), "title": "step", "depends_on": deps})
        })
        .collect();
    create(client, base_dir, "s2", tasks).await?;
    let mut holder = client.clone();
    let mut held = holder
        .claim_tasks(claim_request("bench-holder", 1, Duration::from_secs(5)))
        .await?
        .into_inner()
        .tasks
        .pop()
        .context("first task")?;
    let mut samples = Vec::with_capacity(count);
    for _ in 0..count {
        let (sample, next) = pickup(client, &mut holder, &held, Role::Executor).await?;
        samples.push(sample);
        held = next;
    }
    complete(&mut holder, &held).await?;
    Ok(samples)
}

fn report_s2(args: &Args, mut samples: Vec<Duration>) {
    samples.sort();
    let pick = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    println!(
        "S2 db={} shape={} samples={}: p50 {:.2} ms, p95 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        args.db,
        args.s2_shape,
        samples.len(),
        pick(0.50).as_secs_f64() * 1e3,
        pick(0.95).as_secs_f64() * 1e3,
        pick(0.99).as_secs_f64() * 1e3,
        pick(1.0).as_secs_f64() * 1e3,
    );
}
