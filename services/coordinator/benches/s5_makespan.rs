//! S5 (performance.md §4, §6): DAG makespan of eager dispatch against the wave barrier, through
//! the real coordinator over gRPC.
//!
//! ```text
//! cargo bench -p troupe-coordinator --bench s5_makespan
//! cargo bench -p troupe-coordinator --bench s5_makespan -- --seeds 5 --mean-ms 200 --dist lognormal
//! ```
//!
//! Each shape is an agent-shaped DAG: one plan task, then `n` parallel chains of depth `d`, then
//! one validate task that waits for every chain. Task durations are drawn (seeded) from an
//! exponential or lognormal(σ = 1) distribution with mean `--mean-ms`. `m` concurrent workers
//! claim one task at a time, sleep for its duration and complete it. The same DAG and
//! durations run once with `"mode": "eager"` and once with `"mode": "waves"`. The makespan runs
//! from `CreateSession` to the last `CompleteTask`; the lower bound LB = max(CP, W/m) uses the
//! durations the workers observed (claim returned → complete sent), so dispatch overhead
//! shows up in makespan/LB. `eager/ends` divides by a tighter bound that counts the plan and
//! validate tasks whole (nothing runs beside them), which LB spreads over the m workers.
//!
//! `--estimates` says what the plan tells the scheduler about durations: `none` (it ranks ready
//! tasks by the length of their chain in tasks), `exact` (each task's `estimate_seconds` is its
//! real duration, a perfect planner) or `noisy` (the real duration times a lognormal(σ = 0.5)
//! error with mean 1, drawn from its own seed so the durations stay the same).
//!
//! `--roles mixed` gives the chains two kinds of work: odd chains are executors whose tasks take
//! 1.6 × the mean, even chains validators at 0.4 × (the plan task is an executor and the
//! validate task a validator, at the mean); the workers claim both roles. Counted in tasks every
//! chain is as long as the next, so without estimates only what the coordinator learned of
//! each role's durations (`--learn-from-sessions`, its default 10; 0 turns learning off) tells
//! the long chains from the short. `--warmup` first runs seed 0's DAG once, unmeasured, so the
//! first measured run has a history to learn from.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use troupe_proto::v1::{self as pb, Role};

#[derive(Debug, Parser)]
struct Args {
    /// `sqlite` or `postgres` (URL from TROUPE_BENCH_DATABASE_URL or TROUPE_TEST_DATABASE_URL).
    #[arg(long, default_value = "sqlite")]
    db: String,
    /// Mean task duration in milliseconds.
    #[arg(long, default_value_t = 200)]
    mean_ms: u64,
    /// `exponential` or `lognormal` (σ = 1).
    #[arg(long, default_value = "exponential")]
    dist: String,
    /// Seeds per shape (1, 2, ...).
    #[arg(long, default_value_t = 3)]
    seeds: u64,
    /// `none`, `exact` or `noisy`: the plan's `estimate_seconds` (see the module docs).
    #[arg(long, default_value = "none")]
    estimates: String,
    /// `executor` (every task) or `mixed` (see the module docs).
    #[arg(long, default_value = "executor")]
    roles: String,
    /// The coordinator's `--learn-from-sessions`.
    #[arg(long, default_value_t = 10)]
    learn_from_sessions: u32,
    /// Run seed 0's DAG once, eagerly and unmeasured, before the measured runs.
    #[arg(long)]
    warmup: bool,
    /// Shapes as `NxD@M` (chains × depth @ workers), comma-separated.
    #[arg(long, default_value = "4x3@4,8x4@8,8x4@4,3x5@3")]
    shapes: String,
    // `cargo bench` passes `--bench`; accept and ignore it.
    #[arg(long, hide = true)]
    bench: bool,
}

type Client = troupe_grpc::CoordinatorClient;

#[derive(Debug, Clone, Copy)]
struct Shape {
    chains: usize,
    depth: usize,
    workers: usize,
}

fn parse_shapes(text: &str) -> anyhow::Result<Vec<Shape>> {
    text.split(',')
        .map(|item| {
            let (dag, workers) = item.split_once('@').context("shape needs @M")?;
            let (chains, depth) = dag.split_once('x').context("shape needs NxD")?;
            Ok(Shape {
                chains: chains.trim().parse()?,
                depth: depth.trim().parse()?,
                workers: workers.trim().parse()?,
            })
        })
        .collect()
}

/// One task of the DAG: id, role, dependencies, duration in ms, and the plan's estimate of it.
#[derive(Debug, Clone)]
struct Node {
    id: String,
    role: &'static str,
    deps: Vec<String>,
    ms: u64,
    estimate_ms: Option<f64>,
}

/// A standard normal draw (Box-Muller).
fn normal(rng: &mut rand::rngs::StdRng) -> f64 {
    // 1 - u is in (0, 1]: ln never sees 0.
    let u: f64 = 1.0 - rng.random::<f64>();
    let v: f64 = rng.random::<f64>();
    (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
}

fn draw(rng: &mut rand::rngs::StdRng, dist: &str, mean_ms: f64) -> anyhow::Result<u64> {
    let value = match dist {
        // 1 - u is in (0, 1]: ln never sees 0.
        "exponential" => -mean_ms * (1.0 - rng.random::<f64>()).ln(),
        // The mean of lognormal(mu, 1) is exp(mu + 1/2).
        "lognormal" => (mean_ms.ln() - 0.5 + normal(rng)).exp(),
        other => bail!("unknown --dist {other}"),
    };
    // At least 1 ms, so every task really sleeps.
    Ok(value.max(1.0).round() as u64)
}

/// The DAG of `shape` with the durations of `seed`, as `args` asks.
fn dag(shape: Shape, seed: u64, args: &Args) -> anyhow::Result<Vec<Node>> {
    let (dist, mean_ms) = (args.dist.as_str(), args.mean_ms as f64);
    let mixed = match args.roles.as_str() {
        "executor" => false,
        "mixed" => true,
        other => bail!("unknown --roles {other} (executor or mixed)"),
    };
    // A chain's role and mean duration.
    let chain_kind = |chain: usize| match (mixed, chain % 2) {
        (false, _) => ("executor", mean_ms),
        (true, 1) => ("executor", mean_ms * 1.6),
        (true, _) => ("validator", mean_ms * 0.4),
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut nodes = vec![Node {
        id: "PLAN".to_owned(),
        role: "executor",
        deps: Vec::new(),
        ms: draw(&mut rng, dist, mean_ms)?,
        estimate_ms: None,
    }];
    let mut ends = Vec::new();
    for chain in 1..=shape.chains {
        let mut previous = "PLAN".to_owned();
        let (role, chain_mean) = chain_kind(chain);
        for step in 1..=shape.depth {
            let id = format!("IMPL-{chain}-{step}");
            nodes.push(Node {
                id: id.clone(),
                role,
                deps: vec![previous],
                ms: draw(&mut rng, dist, chain_mean)?,
                estimate_ms: None,
            });
            previous = id;
        }
        ends.push(previous);
    }
    nodes.push(Node {
        id: "VALIDATE".to_owned(),
        role: if mixed { "validator" } else { "executor" },
        deps: ends,
        ms: draw(&mut rng, dist, mean_ms)?,
        estimate_ms: None,
    });
    let mut errors = rand::rngs::StdRng::seed_from_u64(seed ^ 0x05ee_de57);
    for node in &mut nodes {
        node.estimate_ms = match args.estimates.as_str() {
            "none" => None,
            "exact" => Some(node.ms as f64),
            // lognormal(-σ²/2, σ = 0.5) has mean 1.
            "noisy" => Some(node.ms as f64 * (0.5 * normal(&mut errors) - 0.125).exp()),
            other => bail!("unknown --estimates {other} (none, exact or noisy)"),
        };
    }
    Ok(nodes)
}

/// The lower bounds of one run over `observed` durations (seconds).
struct Bounds {
    /// LB = max(critical path, total work / m), performance.md's bound.
    lb: f64,
    /// LB with the plan and validate tasks counted whole: every other task waits for the
    /// first and the last waits for every other, so no schedule beats
    /// first + (the rest of the work) / m + last.
    ends: f64,
}

fn bounds(nodes: &[Node], observed: &HashMap<String, f64>, workers: usize) -> Bounds {
    let took = |node: &Node| observed.get(&node.id).copied().unwrap_or(0.0);
    // Nodes are in topological order.
    let mut finish: HashMap<&str, f64> = HashMap::new();
    let mut total = 0.0;
    for node in nodes {
        total += took(node);
        let start = node
            .deps
            .iter()
            .map(|dep| finish.get(dep.as_str()).copied().unwrap_or(0.0))
            .fold(0.0, f64::max);
        finish.insert(&node.id, start + took(node));
    }
    let critical = finish.values().copied().fold(0.0, f64::max);
    let lb = critical.max(total / workers as f64);
    let (first, last) = match (nodes.first(), nodes.last()) {
        (Some(first), Some(last)) => (took(first), took(last)),
        _ => (0.0, 0.0),
    };
    Bounds {
        lb,
        ends: lb.max(first + last + (total - first - last) / workers as f64),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let shapes = parse_shapes(&args.shapes)?;
    let tuning = troupe_coordinator::Tuning {
        learn_from_sessions: args.learn_from_sessions,
        ..Default::default()
    };
    let bench = common::Bench::start(&args.db, tuning).await?;
    let (client, base_dir) = (bench.client.clone(), bench.base_dir.clone());

    println!(
        "S5 db={} dist={} mean={}ms seeds={} estimates={} roles={} learn-from-sessions={}{}",
        args.db,
        args.dist,
        args.mean_ms,
        args.seeds,
        args.estimates,
        args.roles,
        args.learn_from_sessions,
        if args.warmup { " warmup" } else { "" }
    );
    println!(
        "{:<10} {:>4} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11} {:>10}",
        "shape",
        "seed",
        "LB(s)",
        "eager(s)",
        "waves(s)",
        "eager/LB",
        "waves/LB",
        "waves/eager",
        "eager/ends"
    );
    if args.warmup
        && let Some(&shape) = shapes.first()
    {
        let nodes = dag(shape, 0, &args)?;
        run(&client, &base_dir, &nodes, shape.workers, "eager").await?;
    }
    for shape in shapes {
        let name = format!("{}x{}@{}", shape.chains, shape.depth, shape.workers);
        // Per run: eager/LB, waves/LB, waves/eager, eager/(the bound with the ends whole).
        let mut ratios: Vec<[f64; 4]> = Vec::new();
        for seed in 1..=args.seeds {
            let nodes = dag(shape, seed, &args)?;
            let eager = run(&client, &base_dir, &nodes, shape.workers, "eager").await?;
            let waves = run(&client, &base_dir, &nodes, shape.workers, "waves").await?;
            let eager_lb = bounds(&nodes, &eager.observed, shape.workers);
            let waves_lb = bounds(&nodes, &waves.observed, shape.workers);
            let row = [
                eager.makespan / eager_lb.lb,
                waves.makespan / waves_lb.lb,
                waves.makespan / eager.makespan,
                eager.makespan / eager_lb.ends,
            ];
            println!(
                "{name:<10} {seed:>4} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>11.3} {:>10.3}",
                eager_lb.lb, eager.makespan, waves.makespan, row[0], row[1], row[2], row[3]
            );
            ratios.push(row);
        }
        let mean = |at: usize| ratios.iter().map(|r| r[at]).sum::<f64>() / ratios.len() as f64;
        // Nearest rank: the smallest ratio at or above 95 % of the runs.
        let p95 = |at: usize| {
            let mut column: Vec<f64> = ratios.iter().map(|r| r[at]).collect();
            column.sort_by(f64::total_cmp);
            column[(column.len() * 95).div_ceil(100).max(1) - 1]
        };
        let max = ratios.iter().map(|r| r[0]).fold(0.0, f64::max);
        println!(
            "{name:<10} {:>4} {:>9} {:>9} {:>9} {:>9.3} {:>9.3} {:>11.3} {:>10.3}   (p95 eager/LB {:.3}, eager/ends {:.3}; max eager/LB {max:.3})",
            "mean",
            "",
            "",
            "",
            mean(0),
            mean(1),
            mean(2),
            mean(3),
            p95(0),
            p95(3),
        );
    }
    bench.stop().await
}

/// What one run measured.
struct Run {
    makespan: f64,
    /// Task id → seconds from claim returned to complete sent.
    observed: HashMap<String, f64>,
}

async fn run(
    client: &Client,
    base_dir: &str,
    nodes: &[Node],
    workers: usize,
    mode: &str,
) -> anyhow::Result<Run> {
    let tasks: Vec<Value> = nodes
        .iter()
        .map(|node| {
            let mut task = json!({"id": node.id, "title": node.id, "role": node.role,
                   "depends_on": node.deps, "sleep_ms": node.ms});
            if let Some(ms) = node.estimate_ms {
                task["estimate_seconds"] = json!(ms / 1000.0);
            }
            task
        })
        .collect();
    let plan = json!({"name": format!("s5-{mode}"), "mode": mode,
        "repos": {"app": {"path": "repo"}}, "tasks": tasks});
    let start = Instant::now();
    let session = common::create_session(client, base_dir, &plan).await?;
    let total = nodes.len();
    let observed = Arc::new(Mutex::new(HashMap::new()));
    let last_done = Arc::new(Mutex::new(start));
    let mut pool = tokio::task::JoinSet::new();
    for w in 0..workers {
        let mut client = client.clone();
        let observed = Arc::clone(&observed);
        let last_done = Arc::clone(&last_done);
        let session = session.clone();
        pool.spawn(async move {
            let worker = format!("s5-{w}");
            loop {
                if observed.lock().map(|o| o.len()).unwrap_or(total) >= total {
                    return anyhow::Ok(());
                }
                let claimed = client
                    .claim_tasks(pb::ClaimTasksRequest {
                        worker_id: worker.clone(),
                        roles: vec![Role::Executor as i32, Role::Validator as i32],
                        max_tasks: 1,
                        wait: prost_types::Duration::try_from(Duration::from_millis(250)).ok(),
                        lease_duration: prost_types::Duration::try_from(Duration::from_secs(60))
                            .ok(),
                        capabilities: Vec::new(),
                        ..Default::default()
                    })
                    .await?
                    .into_inner()
                    .tasks;
                for claimed in claimed {
                    let began = Instant::now();
                    let task = claimed.task.context("task")?;
                    if task.session_id != session {
                        bail!("claimed a task of another session: {}", task.session_id);
                    }
                    let ms = task
                        .spec
                        .as_ref()
                        .and_then(|spec| spec.fields.get("sleep_ms"))
                        .and_then(|value| match value.kind {
                            Some(prost_types::value::Kind::NumberValue(ms)) => Some(ms),
                            _ => None,
                        })
                        .context("sleep_ms")?;
                    tokio::time::sleep(Duration::from_millis(ms as u64)).await;
                    let took = began.elapsed().as_secs_f64();
                    client
                        .complete_task(pb::CompleteTaskRequest {
                            session_id: task.session_id.clone(),
                            task_id: task.id.clone(),
                            fencing_token: claimed.lease.context("lease")?.fencing_token,
                            result: Some(pb::TaskResult {
                                summary: "slept".to_owned(),
                                ..Default::default()
                            }),
                            claim_next: None,
                        })
                        .await?;
                    let now = Instant::now();
                    if let Ok(mut last) = last_done.lock() {
                        *last = (*last).max(now);
                    }
                    if let Ok(mut observed) = observed.lock() {
                        observed.insert(task.id, took);
                    }
                }
            }
        });
    }
    while let Some(result) = pool.join_next().await {
        result??;
    }
    let makespan = last_done
        .lock()
        .map(|last| last.duration_since(start).as_secs_f64())
        .unwrap_or(f64::NAN);
    common::expect_completed(client, session).await?;
    let observed = observed
        .lock()
        .map(|observed| observed.clone())
        .unwrap_or_default();
    Ok(Run { makespan, observed })
}
