//! Integration tests: the real service on a port-0 listener, real git repositories, real
//! pytest. The tools (pytest, pytest-cov, pytest-json-report, pytest-timeout) come from each
//! fixture's `requirements-dev.txt` through the runner's own install path; every test shares one
//! data directory, so that venv is built once (the build lock serialises the first runs).

use std::path::{Path, PathBuf};

use tonic::Code;
use troupe_proto::v1::test_runner_client::TestRunnerClient;
use troupe_proto::v1::{
    FixOptions, RunTestsRequest, TestFramework, TestOutcome, TestRunReport, TestTotals,
};
use troupe_testkit::{TestService, git_repo};

mod environment;
mod fixloop;
mod installs;
mod js;
mod pytest_fixture;
mod source;
mod support;
mod versions;

const REQUIREMENTS: &str = "pytest\npytest-cov\npytest-json-report\npytest-timeout\n";

const OPS: &str = "\
def add(a, b):
    return a + b


def divide(a, b):
    if b == 0:
        raise ZeroDivisionError('b is zero')
    return a / b


def parse(d):
    return d['name']
";

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("troupe-test-runner-it")
}

async fn start() -> TestService {
    start_granting(&[]).await
}

/// A service whose confined children may also write `paths` (a test's pid or marker files:
/// everything else outside a run's own directories is refused, docs/sandbox.md).
async fn start_granting(paths: &[&std::path::Path]) -> TestService {
    let sandbox = troupe_process::sandbox::SandboxArgs {
        write_paths: paths.iter().map(|p| p.to_path_buf()).collect(),
        ..Default::default()
    };
    let config = troupe_test_runner::Config {
        listen: "127.0.0.1:0".parse().expect("address"),
        data_dir: data_dir(),
        coordinator_url: None,
        python: "python3".to_owned(),
        worker_id: None,
        worker: Default::default(),
        concurrency: 1,
        backends_config: None,
        security: Default::default(),
        sandbox,
    };
    TestService::spawn(move |listener, shutdown| {
        troupe_test_runner::run(config, listener, shutdown)
    })
    .await
}

async fn run_tests(
    service: &TestService,
    request: RunTestsRequest,
) -> Result<TestRunReport, tonic::Status> {
    let mut client = TestRunnerClient::connect(service.url())
        .await
        .expect("connect");
    let response = client.run_tests(request).await?;
    Ok(response.into_inner().report.expect("a report"))
}

fn request(repo: &Path) -> RunTestsRequest {
    RunTestsRequest {
        repo_path: repo.display().to_string(),
        install: true,
        framework: TestFramework::Pytest as i32,
        ..RunTestsRequest::default()
    }
}

/// The run's output directory, from the run file's path.
fn run_dir(report: &TestRunReport) -> PathBuf {
    let run_file = report
        .report_paths
        .iter()
        .find(|p| p.ends_with("run-1.json"))
        .expect("run-1.json listed");
    Path::new(run_file).parent().expect("run dir").to_path_buf()
}

#[tokio::test]
async fn passing_suite_meets_its_coverage_target() {
    let dir = tempfile::tempdir().expect("tempdir");
    let commit = git_repo(
        dir.path(),
        &[
            ("requirements-dev.txt", REQUIREMENTS),
            ("calc/__init__.py", ""),
            ("calc/ops.py", "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"),
            (
                "tests/test_ops.py",
                "from calc.ops import add, sub\n\n\ndef test_add():\n    assert add(1, 2) == 3\n\n\ndef test_sub():\n    assert sub(3, 2) == 1\n",
            ),
        ],
    )
    .expect("fixture repo");
    let service = start().await;
    let mut req = request(dir.path());
    req.coverage_target = 80.0;
    req.coverage_source = "calc".to_owned();
    let report = run_tests(&service, req).await.expect("run");

    assert_eq!(report.outcome(), TestOutcome::Passed, "{report:#?}");
    assert_eq!(report.exit_code, 0);
    assert_eq!(report.commit, commit);
    assert_eq!(
        report.totals,
        Some(TestTotals {
            total: 2,
            passed: 2,
            failed: 0,
            skipped: 0,
            errors: 0
        })
    );
    assert!((report.pass_rate - 1.0).abs() < f64::EPSILON);
    let coverage = report.coverage.clone().expect("coverage measured");
    assert_eq!(coverage.overall, Some(100.0));
    assert_eq!(coverage.files.get("calc/ops.py"), Some(&100.0));
    assert!(report.failures.is_empty());
    assert!(report.command.iter().any(|a| a == "--cov=calc"));
    assert!(report.command.iter().any(|a| a == "--timeout=60"));

    // Every listed report exists, and the run file agrees with the report.
    for path in &report.report_paths {
        assert!(Path::new(path).is_file(), "missing {path}");
    }
    let run_dir = run_dir(&report);
    let run_file: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(run_dir.join("run-1.json")).expect("run file"),
    )
    .expect("json");
    assert_eq!(run_file["passed"], true);
    assert_eq!(run_file["total"], 2);
    assert_eq!(run_file["coverage"], 100.0);
    assert_eq!(run_file["coverage_target"], 80.0);
    assert_eq!(run_file["commit"], commit.as_str());
    // The worktree is gone and nothing was written into the repository itself.
    let run_id = run_dir.file_name().expect("run id");
    assert!(!data_dir().join("worktrees/test-runs").join(run_id).exists());
    assert!(!dir.path().join(".coverage").exists());
    assert!(!dir.path().join(".pytest_cache").exists());
    service.stop().await;
}

#[tokio::test]
async fn failures_are_counted_located_and_classified() {
    let dir = tempfile::tempdir().expect("tempdir");
    git_repo(
        dir.path(),
        &[
            ("requirements-dev.txt", REQUIREMENTS),
            ("calc/__init__.py", ""),
            ("calc/ops.py", OPS),
            (
                "tests/test_ops.py",
                "import pytest\n\
                 from calc.ops import add, divide, parse\n\
                 \n\
                 \n\
                 def test_add():\n\
                 \x20   assert add(1, 2) == 3\n\
                 \n\
                 \n\
                 def test_divide_assertion():\n\
                 \x20   assert divide(10, 4) == 2\n\
                 \n\
                 \n\
                 def test_parse_raises():\n\
                 \x20   parse({})\n\
                 \n\
                 \n\
                 @pytest.mark.skip(reason='not now')\n\
                 def test_skipped():\n\
                 \x20   pass\n",
            ),
        ],
    )
    .expect("fixture repo");
    let service = start().await;
    let mut req = request(dir.path());
    req.coverage_source = "calc".to_owned();
    let report = run_tests(&service, req).await.expect("run");

    assert_eq!(report.outcome(), TestOutcome::TestsFailed, "{report:#?}");
    assert_eq!(report.exit_code, 1);
    assert_eq!(
        report.totals,
        Some(TestTotals {
            total: 4,
            passed: 1,
            failed: 2,
            skipped: 1,
            errors: 0
        })
    );
    assert!(
        (report.pass_rate - 1.0 / 3.0).abs() < 1e-9,
        "{}",
        report.pass_rate
    );
    let failures: Vec<(&str, &str, u32)> = report
        .failures
        .iter()
        .map(|f| (f.name.as_str(), f.file.as_str(), f.line))
        .collect();
    assert_eq!(
        failures,
        [
            (
                "tests/test_ops.py::test_divide_assertion",
                "tests/test_ops.py",
                10
            ),
            (
                "tests/test_ops.py::test_parse_raises",
                "tests/test_ops.py",
                14
            ),
        ]
    );
    assert!(
        report.failures[0]
            .message
            .starts_with("AssertionError: assert 2.5 == 2"),
        "{}",
        report.failures[0].message
    );
    assert_eq!(
        troupe_proto::names::name(report.failures[0].criticality()),
        "high"
    );
    assert_eq!(report.failures[1].message, "KeyError: 'name'");
    assert_eq!(
        troupe_proto::names::name(report.failures[1].criticality()),
        "medium"
    );
    // Coverage is still measured on a failing run: 7 of 8 statements (the raise never runs),
    // and 1 of 2 branches.
    let coverage = report.coverage.clone().expect("coverage");
    assert_eq!(coverage.lines, Some(87.5));
    assert_eq!(coverage.branches, Some(50.0));
    service.stop().await;
}

#[tokio::test]
async fn import_error_is_a_collection_error_and_other_tests_still_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    git_repo(
        dir.path(),
        &[
            ("requirements-dev.txt", REQUIREMENTS),
            ("calc/__init__.py", ""),
            ("calc/ops.py", OPS),
            (
                "tests/test_ok.py",
                "from calc.ops import add\n\n\ndef test_add():\n    assert add(1, 1) == 2\n",
            ),
            (
                "tests/test_broken.py",
                "from calc.missing import nothing\n\n\ndef test_never():\n    pass\n",
            ),
        ],
    )
    .expect("fixture repo");
    let service = start().await;
    let report = run_tests(&service, request(dir.path())).await.expect("run");

    assert_eq!(
        report.outcome(),
        TestOutcome::CollectionError,
        "{report:#?}"
    );
    assert_eq!(
        report.totals,
        Some(TestTotals {
            total: 1,
            passed: 1,
            failed: 0,
            skipped: 0,
            errors: 0
        })
    );
    assert_eq!(report.failures.len(), 1);
    let failure = &report.failures[0];
    assert_eq!(
        (failure.name.as_str(), failure.file.as_str(), failure.line),
        ("tests/test_broken.py", "tests/test_broken.py", 1)
    );
    assert_eq!(
        failure.message,
        "ModuleNotFoundError: No module named 'calc.missing'"
    );
    assert_eq!(troupe_proto::names::name(failure.criticality()), "critical");
    service.stop().await;
}

#[tokio::test]
async fn a_repo_without_tests_reports_no_tests() {
    let dir = tempfile::tempdir().expect("tempdir");
    git_repo(
        dir.path(),
        &[
            ("requirements-dev.txt", REQUIREMENTS),
            ("calc/__init__.py", ""),
            ("calc/ops.py", OPS),
        ],
    )
    .expect("fixture repo");
    let service = start().await;
    let mut req = request(dir.path());
    req.coverage_target = 80.0;
    let report = run_tests(&service, req).await.expect("run");

    assert_eq!(report.outcome(), TestOutcome::NoTests, "{report:#?}");
    assert_eq!(report.exit_code, 5);
    assert_eq!(report.totals, Some(TestTotals::default()));
    assert!(report.pass_rate.abs() < f64::EPSILON);
    service.stop().await;
}

/// Whether `pid` is gone (or a zombie nobody reaped, which runs nothing).
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

#[tokio::test]
async fn a_hanging_suite_is_killed_at_the_wall_clock_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pids = tempfile::tempdir().expect("pid dir");
    let pid_file = pids.path().join("pids");
    let test = format!(
        "import os, subprocess, time\n\n\ndef test_hangs():\n    child = subprocess.Popen(['sleep', '600'])\n    \
         with open({:?}, 'w') as f:\n        f.write(f'{{os.getpid()}} {{child.pid}}')\n    while True:\n        time.sleep(0.1)\n",
        pid_file.display().to_string()
    );
    git_repo(
        dir.path(),
        &[
            ("requirements-dev.txt", REQUIREMENTS),
            ("tests/test_hang.py", &test),
        ],
    )
    .expect("fixture repo");
    let service = start_granting(&[pids.path()]).await;
    let mut req = request(dir.path());
    req.timeout_seconds = 3;
    req.test_timeout_seconds = 300;
    let report = run_tests(&service, req).await.expect("run");

    assert_eq!(report.outcome(), TestOutcome::Timeout, "{report:#?}");
    assert_eq!(report.exit_code, -1);
    assert!(report.duration_ms >= 3000, "{}", report.duration_ms);
    let text = std::fs::read_to_string(&pid_file).expect("the test started");
    let pids: Vec<u32> = text
        .split_whitespace()
        .map(|p| p.parse().expect("pid"))
        .collect();
    assert_eq!(pids.len(), 2);
    for pid in pids {
        assert!(gone(pid), "process {pid} survived the timeout");
    }
    service.stop().await;
}

#[tokio::test]
async fn bad_requests_are_refused_with_deliberate_codes() {
    let dir = tempfile::tempdir().expect("tempdir");
    git_repo(
        dir.path(),
        &[("package.json", r#"{"scripts": {"test": "jest"}}"#)],
    )
    .expect("fixture repo");
    let service = start().await;
    // Jest is detected, and a checkout without node_modules is refused before anything runs.
    let mut req = request(dir.path());
    req.framework = TestFramework::Unspecified as i32;
    req.install = false;
    let status = run_tests(&service, req)
        .await
        .expect_err("jest is not installed there");
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(
        status.message().contains("node_modules/.bin/jest"),
        "{}",
        status.message()
    );

    let status = run_tests(
        &service,
        RunTestsRequest {
            repo_path: "relative/path".into(),
            ..RunTestsRequest::default()
        },
    )
    .await
    .expect_err("relative paths are refused");
    assert_eq!(status.code(), Code::InvalidArgument);
    let mut req = request(dir.path());
    req.r#ref = "no-such-branch".to_owned();
    let status = run_tests(&service, req).await.expect_err("unknown ref");
    assert_eq!(status.code(), Code::NotFound);
    let mut req = request(dir.path());
    req.fix = Some(FixOptions {
        backend: "command".to_owned(),
        ..FixOptions::default()
    });
    let status = run_tests(&service, req)
        .await
        .expect_err("a command fix needs a command");
    assert_eq!(status.code(), Code::InvalidArgument);
    service.stop().await;
}

/// A venv with pytest alone (no pytest-cov, no pytest-json-report, no pytest-timeout), built
/// once per target directory; only the test below uses it.
fn bare_pytest_python() -> PathBuf {
    let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("pytest-only-venv");
    let marker = venv.join(".complete");
    if !marker.is_file() {
        let _ = std::fs::remove_dir_all(&venv);
        // std::process is fine in a fixture.
        let status = std::process::Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .expect("venv");
        assert!(status.success(), "python3 -m venv failed");
        let status = std::process::Command::new(venv.join("bin/python"))
            .args([
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "pytest",
            ])
            .status()
            .expect("pip");
        assert!(status.success(), "pip install pytest failed");
        std::fs::write(&marker, "").expect("marker");
    }
    venv.join("bin/python")
}

#[tokio::test]
async fn without_plugins_results_come_from_junit_and_coverage_is_not_claimed() {
    let python = bare_pytest_python();
    let dir = tempfile::tempdir().expect("tempdir");
    git_repo(
        dir.path(),
        &[
            ("calc/__init__.py", ""),
            ("calc/ops.py", OPS),
            (
                "tests/test_ops.py",
                "from calc.ops import add, divide\n\n\nclass TestOps:\n    def test_add(self):\n        assert add(1, 2) == 3\n\n    def test_divide(self):\n        assert divide(10, 4) == 2\n",
            ),
        ],
    )
    .expect("fixture repo");
    let config = troupe_test_runner::Config {
        listen: "127.0.0.1:0".parse().expect("address"),
        data_dir: data_dir(),
        coordinator_url: None,
        python: python.display().to_string(),
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
    let mut req = request(dir.path());
    req.install = false;
    req.coverage_target = 50.0;
    let report = run_tests(&service, req).await.expect("run");

    assert_eq!(report.outcome(), TestOutcome::TestsFailed, "{report:#?}");
    assert_eq!(
        report.totals,
        Some(TestTotals {
            total: 2,
            passed: 1,
            failed: 1,
            skipped: 0,
            errors: 0
        })
    );
    assert_eq!(report.failures.len(), 1);
    let failure = &report.failures[0];
    assert_eq!(failure.name, "tests/test_ops.py::TestOps::test_divide");
    assert_eq!(failure.line, 9);
    assert!(
        failure
            .message
            .starts_with("AssertionError: assert 2.5 == 2"),
        "{}",
        failure.message
    );
    assert!(report.coverage.is_none());
    assert!(
        !report
            .command
            .iter()
            .any(|a| a.starts_with("--cov") || a.starts_with("--json-report"))
    );
    assert!(
        report
            .warnings
            .iter()
            .any(|w| w.contains("pytest-cov is not installed")),
        "{:?}",
        report.warnings
    );
    assert!(
        report
            .warnings
            .iter()
            .any(|w| w.contains("pytest-json-report is not installed")),
        "{:?}",
        report.warnings
    );

    // Passing tests with a target and no coverage measured are not a pass.
    let passing = tempfile::tempdir().expect("tempdir");
    git_repo(
        passing.path(),
        &[("tests/test_ok.py", "def test_ok():\n    assert True\n")],
    )
    .expect("fixture repo");
    let mut req = request(passing.path());
    req.install = false;
    req.coverage_target = 50.0;
    let report = run_tests(&service, req).await.expect("run");
    assert_eq!(
        report.outcome(),
        TestOutcome::CoverageBelowTarget,
        "{report:#?}"
    );
    assert!(
        report
            .warnings
            .iter()
            .any(|w| w.contains("no coverage was measured")),
        "{:?}",
        report.warnings
    );
    service.stop().await;
}
