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
//! shows up in makespan/LB.

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

/// One task of the DAG: id, dependencies, duration in ms.
#[derive(Debug, Clone)]
struct Node {
    id: String,
    deps: Vec<String>,
    ms: u64,
}

fn draw(rng: &mut rand::rngs::StdRng, dist: &str, mean_ms: f64) -> anyhow::Result<u64> {
    // 1 - u is in (0, 1]: ln never sees 0.
    let u: f64 = 1.0 - rng.random::<f64>();
    let value = match dist {
        "exponential" => -mean_ms * u.ln(),
        "lognormal" => {
            // Box-Muller; mean of lognormal(mu, 1) is exp(mu + 1/2).
            let v: f64 = rng.random::<f64>();
            let z = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
            let mu = mean_ms.ln() - 0.5;
            (mu + z).exp()
        }
        other => bail!("unknown --dist {other}"),
    };
    // At least 1 ms, so every task really sleeps.
    Ok(value.max(1.0).round() as u64)
}

fn dag(shape: Shape, seed: u64, dist: &str, mean_ms: f64) -> anyhow::Result<Vec<Node>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut nodes = vec![Node {
        id: "PLAN".to_owned(),
        deps: Vec::new(),
        ms: draw(&mut rng, dist, mean_ms)?,
    }];
    let mut ends = Vec::new();
    for chain in 1..=shape.chains {
        let mut previous = "PLAN".to_owned();
        for step in 1..=shape.depth {
            let id = format!("IMPL-{chain}-{step}");
            nodes.push(Node {
                id: id.clone(),
                deps: vec![previous],
                ms: draw(&mut rng, dist, mean_ms)?,
            });
            previous = id;
        }
        ends.push(previous);
    }
    nodes.push(Node {
        id: "VALIDATE".to_owned(),
        deps: ends,
        ms: draw(&mut rng, dist, mean_ms)?,
    });
    Ok(nodes)
}

/// LB = max(critical path, total work / m) over `observed` durations (seconds).
fn lower_bound(nodes: &[Node], observed: &HashMap<String, f64>, workers: usize) -> f64 {
    // Nodes are in topological order.
    let mut finish: HashMap<&str, f64> = HashMap::new();
    let mut total = 0.0;
    for node in nodes {
        let took = observed.get(&node.id).copied().unwrap_or(0.0);
        total += took;
        let start = node
            .deps
            .iter()
            .map(|dep| finish.get(dep.as_str()).copied().unwrap_or(0.0))
            .fold(0.0, f64::max);
        finish.insert(&node.id, start + took);
    }
    let critical = finish.values().copied().fold(0.0, f64::max);
    critical.max(total / workers as f64)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let shapes = parse_shapes(&args.shapes)?;
    let bench = common::Bench::start(&args.db).await?;
    let (client, base_dir) = (bench.client.clone(), bench.base_dir.clone());

    println!(
        "S5 db={} dist={} mean={}ms seeds={}",
        args.db, args.dist, args.mean_ms, args.seeds
    );
    println!(
        "{:<10} {:>4} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11}",
        "shape", "seed", "LB(s)", "eager(s)", "waves(s)", "eager/LB", "waves/LB", "waves/eager"
    );
    for shape in shapes {
        let mut ratios = Vec::new();
        for seed in 1..=args.seeds {
            let nodes = dag(shape, seed, &args.dist, args.mean_ms as f64)?;
            let eager = run(&client, &base_dir, &nodes, shape.workers, "eager").await?;
            let waves = run(&client, &base_dir, &nodes, shape.workers, "waves").await?;
            let eager_lb = lower_bound(&nodes, &eager.observed, shape.workers);
            let waves_lb = lower_bound(&nodes, &waves.observed, shape.workers);
            let row = (
                eager.makespan / eager_lb,
                waves.makespan / waves_lb,
                waves.makespan / eager.makespan,
            );
            println!(
                "{:<10} {:>4} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>11.3}",
                format!("{}x{}@{}", shape.chains, shape.depth, shape.workers),
                seed,
                eager_lb,
                eager.makespan,
                waves.makespan,
                row.0,
                row.1,
                row.2
            );
            ratios.push(row);
        }
        let mean = |pick: fn(&(f64, f64, f64)) -> f64| {
            ratios.iter().map(pick).sum::<f64>() / ratios.len() as f64
        };
        let max = |pick: fn(&(f64, f64, f64)) -> f64| ratios.iter().map(pick).fold(0.0, f64::max);
        println!(
            "{:<10} {:>4} {:>9} {:>9} {:>9} {:>9.3} {:>9.3} {:>11.3}   (max eager/LB {:.3})",
            format!("{}x{}@{}", shape.chains, shape.depth, shape.workers),
            "mean",
            "",
            "",
            "",
            mean(|r| r.0),
            mean(|r| r.1),
            mean(|r| r.2),
            max(|r| r.0)
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
            json!({"id": node.id, "title": node.id, "role": "executor",
                   "depends_on": node.deps, "sleep_ms": node.ms})
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
                        roles: vec![Role::Executor as i32],
                        max_tasks: 1,
                        wait: prost_types::Duration::try_from(Duration::from_millis(250)).ok(),
                        lease_duration: prost_types::Duration::try_from(Duration::from_secs(60))
                            .ok(),
                        capabilities: Vec::new(),
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
