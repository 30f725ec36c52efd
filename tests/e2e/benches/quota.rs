//! Provider quotas, measured (issue 24 item 4): 40 agent tasks over 4 executor processes
//! against a model server that allows 3 calls at once (each call a set time, two per task),
//! with the coordinator's quota at 3, and without one. With `TROUPE_BASELINE_BIN` naming a
//! directory of main's `troupe-coordinator` and `troupe-executor`, today's behaviour (each
//! worker retrying and failing on 429 by itself) runs in the same invocation as the baseline.
//!
//! `cargo bench -p troupe-e2e --bench quota` (after `cargo build --workspace --bins`);
//! `QUOTA_TASKS`, `QUOTA_CALL_MS` change the size. Figures: docs/performance.md.

use std::path::PathBuf;
use std::time::Duration;

#[allow(dead_code)]
#[path = "../tests/it/quota_wave.rs"]
mod quota_wave;

use quota_wave::{Outcome, Wave};

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// One run's line; `reference` is one task's time with no 429 (the quota run's median).
fn line(name: &str, wave: &Wave, outcome: &Outcome, reference: Duration) {
    let ideal = reference.as_secs_f64() * wave.tasks as f64 / wave.allowed as f64;
    println!(
        "{name:<24} wall {:>6.1}s  {:>4.2}x of {ideal:.1}s  median task {:.2}s  completed {}/{}  \
         failed attempts {}  fallbacks {}  peak calls {}  429s {}",
        outcome.wall.as_secs_f64(),
        outcome.wall.as_secs_f64() / ideal,
        outcome.task_time.as_secs_f64(),
        outcome.completed,
        wave.tasks,
        outcome.failed_attempts,
        outcome.fallbacks,
        outcome.peak,
        outcome.refused,
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; nothing else to read.
    let exe = std::env::current_exe()?;
    let bin_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(PathBuf::from)
        .ok_or_else(|| anyhow::anyhow!("bench binary outside target/<profile>/deps"))?;
    // The benches build in the bench profile; the services under test are the debug builds.
    let bin_dir = std::env::var_os("TROUPE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            bin_dir
                .parent()
                .map_or(bin_dir.clone(), |t| t.join("debug"))
        });
    let tasks = usize::try_from(env_number("QUOTA_TASKS", 40))?;
    let call_time = Duration::from_millis(env_number("QUOTA_CALL_MS", 500));
    let wave = |bin_dir: PathBuf, quota: Option<usize>| Wave {
        bin_dir,
        tasks,
        workers: 4,
        allowed: 3,
        quota,
        call_time,
    };
    println!(
        "{tasks} tasks, 4 workers of 1 slot, provider allows 3 calls at once, {} ms a call, 2 calls a task",
        call_time.as_millis()
    );
    // The quota run first: its median task (no 429, no retry) is the reference duration.
    let quota_wave = wave(bin_dir.clone(), Some(3));
    let quota = quota_wave::run(&quota_wave).await?;
    let reference = quota.task_time;
    println!(
        "reference: {tasks}/3 x {:.2}s (the quota run's median task) = {:.1}s",
        reference.as_secs_f64(),
        reference.as_secs_f64() * tasks as f64 / 3.0
    );
    if let Some(baseline) = std::env::var_os("TROUPE_BASELINE_BIN") {
        let w = wave(PathBuf::from(baseline), None);
        line("main, no quota", &w, &quota_wave::run(&w).await?, reference);
    }
    let w = wave(bin_dir, None);
    line(
        "this branch, no quota",
        &w,
        &quota_wave::run(&w).await?,
        reference,
    );
    line("this branch, quota 3", &quota_wave, &quota, reference);
    Ok(())
}
