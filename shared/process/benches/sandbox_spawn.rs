//! What confinement costs per child: `true` run to completion through troupe-process, without
//! a sandbox and under an enforced Landlock ruleset (a fresh confined thread per spawn).
//!
//! `cargo bench -p troupe-process --bench sandbox_spawn` prints the median and mean wall time
//! per run for each, and the difference.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use troupe_process::{Command, Sandbox, SandboxMode};

const RUNS: usize = 300;

async fn measure(sandbox: Option<&Sandbox>) -> Vec<Duration> {
    let cancel = CancellationToken::new();
    let mut times = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let mut cmd = Command::new("true");
        if let Some(sandbox) = sandbox {
            cmd = cmd.sandbox(sandbox.clone());
        }
        let started = Instant::now();
        let output = cmd.run(&cancel).await.expect("runs");
        times.push(started.elapsed());
        assert!(output.success());
    }
    times.sort();
    times
}

fn summary(times: &[Duration]) -> (Duration, Duration) {
    let mean = times.iter().sum::<Duration>() / u32::try_from(times.len()).unwrap_or(1);
    (times[times.len() / 2], mean)
}

fn main() {
    if troupe_process::sandbox::landlock_abi().is_none() {
        eprintln!("no Landlock on this kernel: nothing to measure");
        return;
    }
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let worktree = tempfile::tempdir().expect("tempdir");
    let sandbox = Sandbox::new(SandboxMode::Enforce).write(worktree.path());
    runtime.block_on(async {
        // Warm up the reaper and the page cache.
        measure(None).await;
        let plain = summary(&measure(None).await);
        let confined = summary(&measure(Some(&sandbox)).await);
        println!("runs per case: {RUNS}");
        println!("unconfined: median {:?}, mean {:?}", plain.0, plain.1);
        println!("confined:   median {:?}, mean {:?}", confined.0, confined.1);
        println!(
            "overhead:   median {:?}",
            confined.0.saturating_sub(plain.0)
        );
    });
}
