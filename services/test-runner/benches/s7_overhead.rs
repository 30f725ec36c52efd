//! S7 (performance.md): the test-runner's added wall time over running the same framework
//! command directly, for a small suite (the fixture projects, 6 tests) and a medium one (the
//! fixture plus 20 generated files of 10 tests each), for Jest, Vitest and Pytest.
//!
//! `cargo bench -p troupe-test-runner --bench s7_overhead [-- RUNS]` (default 5 runs each).
//! Needs scripts/setup/30-node-fixtures.sh and, for pytest, `TROUPE_TEST_PYTHON` (a python
//! with pytest, pytest-cov, pytest-json-report, pytest-timeout; scripts/setup/10-python-tools.sh).
//!
//! Through the runner = one `RunTests` call on a local server (detached worktree add/remove,
//! plugin probe for pytest, the run, report parsing, run-N.json). Directly = the exact argv the
//! runner reported, with the same environment, in the source checkout.

use std::path::{Path, PathBuf};
use std::time::Instant;

use troupe_proto::v1::test_runner_client::TestRunnerClient;
use troupe_proto::v1::{RunTestsRequest, TestFramework};
use troupe_testkit::{TestService, git};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read") {
        let entry = entry.expect("entry");
        let name = entry.file_name();
        if name == "node_modules" || name == "scenarios" {
            continue;
        }
        if entry.file_type().expect("type").is_dir() {
            copy_tree(&entry.path(), &to.join(&name));
        } else {
            std::fs::copy(entry.path(), to.join(&name)).expect("copy");
        }
    }
}

/// A committed copy of a fixture, with `extra` generated test files for the medium suite.
fn repo(name: &str, medium: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    copy_tree(&fixture(name), dir.path());
    if medium {
        for i in 0..20 {
            let (path, text) = match name {
                "jest-proj" => (
                    format!("tests/gen{i}.test.js"),
                    (0..10).fold(
                        "const { add } = require('../src/math');\n".to_owned(),
                        |acc, t| acc + &format!("test('gen {i} {t}', () => {{ expect(add({t}, 1)).toBe({}); }});\n", t + 1),
                    ),
                ),
                "vitest-proj" => (
                    format!("tests/gen{i}.test.ts"),
                    (0..10).fold(
                        "import { expect, test } from 'vitest';\nimport { add } from '../src/math';\n".to_owned(),
                        |acc, t| acc + &format!("test('gen {i} {t}', () => {{ expect(add({t}, 1)).toBe({}); }});\n", t + 1),
                    ),
                ),
                _ => (
                    format!("tests/test_gen{i}.py"),
                    (0..10).fold("from calc.mathops import add\n".to_owned(), |acc, t| {
                        acc + &format!("\n\ndef test_gen_{i}_{t}():\n    assert add({t}, 1) == {}\n", t + 1)
                    }),
                ),
            };
            std::fs::write(dir.path().join(path), text).expect("write");
        }
    }
    std::fs::write(dir.path().join(".gitignore"), "node_modules\n").expect("gitignore");
    let modules = fixture(name).join("node_modules");
    if modules.is_dir() {
        std::os::unix::fs::symlink(&modules, dir.path().join("node_modules")).expect("link");
    }
    git(dir.path(), &["init", "-q"]).expect("init");
    git(dir.path(), &["add", "-A"]).expect("add");
    git(dir.path(), &["commit", "-q", "-m", "bench"]).expect("commit");
    dir
}

fn stats(mut samples: Vec<f64>) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    // Nearest-rank p95.
    let rank = ((samples.len() as f64) * 0.95).ceil() as usize;
    (mean, samples[rank.clamp(1, samples.len()) - 1])
}

#[tokio::main]
async fn main() {
    let runs: usize = std::env::args()
        .filter_map(|a| a.parse().ok())
        .next()
        .unwrap_or(5);
    let python = std::env::var("TROUPE_TEST_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let data = tempfile::tempdir().expect("data dir");
    let config = troupe_test_runner::Config {
        listen: "127.0.0.1:0".parse().expect("address"),
        data_dir: data.path().to_path_buf(),
        coordinator_url: None,
        python: python.clone(),
        worker_id: None,
        worker: Default::default(),
        concurrency: 1,
        backends_config: None,
        security: Default::default(),
        sandbox: Default::default(),
    };
    let service = TestService::spawn(move |listener, shutdown| {
        troupe_test_runner::run(config, listener, shutdown)
    })
    .await;
    let mut client = TestRunnerClient::connect(service.url())
        .await
        .expect("connect");
    println!("S7 test-runner overhead, {runs} runs each (wall time, ms)");
    println!(
        "| suite | tests | direct mean | direct p95 | runner mean | runner p95 | added mean | added p95 |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (name, framework) in [
        ("jest-proj", TestFramework::Jest),
        ("vitest-proj", TestFramework::Vitest),
        ("pytest-proj", TestFramework::Pytest),
    ] {
        for medium in [false, true] {
            let dir = repo(name, medium);
            let request = RunTestsRequest {
                repo_path: dir.path().display().to_string(),
                framework: framework as i32,
                ..RunTestsRequest::default()
            };
            // Warm-up: transform caches, page cache, the argv to replay.
            let warm = client
                .run_tests(request.clone())
                .await
                .expect("run")
                .into_inner()
                .report
                .expect("report");
            let total = warm.totals.map_or(0, |t| t.total);
            let mut through = Vec::new();
            let mut direct = Vec::new();
            for _ in 0..runs {
                let started = Instant::now();
                let report = client
                    .run_tests(request.clone())
                    .await
                    .expect("run")
                    .into_inner()
                    .report
                    .expect("report");
                through.push(started.elapsed().as_secs_f64() * 1000.0);
                // Same argv, run in the checkout; worktree paths become checkout paths.
                let worktree_prefix = report.command[0]
                    .split("/node_modules/")
                    .next()
                    .filter(|_| framework != TestFramework::Pytest)
                    .map(str::to_owned);
                let argv: Vec<String> = report
                    .command
                    .iter()
                    .map(|a| match &worktree_prefix {
                        Some(prefix) => a.replace(prefix, &dir.path().display().to_string()),
                        None => a.clone(),
                    })
                    .collect();
                let out = tempfile::tempdir().expect("out");
                let started = Instant::now();
                // std::process: this is a benchmark harness, not service code.
                let status = std::process::Command::new(&argv[0])
                    .args(&argv[1..])
                    .current_dir(dir.path())
                    .env("CI", "true")
                    .env("NO_COLOR", "1")
                    .env("COVERAGE_FILE", out.path().join(".coverage"))
                    .env("PYTHONDONTWRITEBYTECODE", "1")
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .status()
                    .expect("direct run");
                direct.push(started.elapsed().as_secs_f64() * 1000.0);
                assert_eq!(status.code(), Some(report.exit_code), "{argv:?}");
            }
            let (d_mean, d_p95) = stats(direct.clone());
            let (t_mean, t_p95) = stats(through.clone());
            let added: Vec<f64> = through.iter().zip(&direct).map(|(t, d)| t - d).collect();
            let (a_mean, a_p95) = stats(added);
            println!(
                "| {} {} | {total} | {d_mean:.0} | {d_p95:.0} | {t_mean:.0} | {t_p95:.0} | {a_mean:+.0} | {a_p95:+.0} |",
                name.trim_end_matches("-proj"),
                if medium { "medium" } else { "small" },
            );
        }
    }
    service.stop().await;
}
