//! Confined test suites, end to end: a hostile Pytest suite (its `conftest.py`, then its
//! tests), a hostile Jest test file and a hostile Vitest test file try to write outside their
//! worktree, read another session's worktree, read the store and read `~/.ssh`. The
//! test-runner runs as its own process with a fake `$HOME` and `--sandbox enforce`; the kernel
//! (Landlock) refuses every attempt, and `RunTests` reports SANDBOX_DENIED naming the path.
//! The same real fixture projects pass under `enforce` in the test-runner's own tests.

use std::path::{Path, PathBuf};
use std::time::Duration;

use troupe_proto::v1::test_runner_client::TestRunnerClient;
use troupe_proto::v1::{RunTestsRequest, TestFramework, TestOutcome, TestRunReport};

use super::test_runner_support::{fixture_repo, tools_python};
use crate::support::ChildService;

/// What the hostile code goes after.
struct Targets {
    outside: PathBuf,
    other: PathBuf,
    store: PathBuf,
    ssh: PathBuf,
}

impl Targets {
    fn reads(&self) -> [&Path; 3] {
        [&self.other, &self.store, &self.ssh]
    }
}

/// Commits `files` into the fixture repository at `repo`.
fn commit(repo: &Path, files: &[(&str, String)]) -> anyhow::Result<()> {
    for (path, text) in files {
        let path = repo.join(path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(path, text)?;
    }
    troupe_testkit::git(repo, &["add", "-A"])?;
    troupe_testkit::git(repo, &["commit", "-qm", "hostile tests"])?;
    Ok(())
}

async fn run(url: &str, request: RunTestsRequest) -> anyhow::Result<TestRunReport> {
    let mut client = TestRunnerClient::connect(url.to_owned()).await?;
    let response = tokio::time::timeout(Duration::from_secs(180), client.run_tests(request))
        .await??
        .into_inner();
    response.report.ok_or_else(|| anyhow::anyhow!("no report"))
}

/// The run was refused by the sandbox, names one of `paths`, and each of `paths` appears in a
/// failure message or the run's output next to the kernel's refusal.
fn assert_denied(what: &str, report: &TestRunReport, paths: &[&Path]) {
    assert_eq!(
        report.outcome(),
        TestOutcome::SandboxDenied,
        "{what}: {report:#?}"
    );
    assert!(
        paths
            .iter()
            .any(|p| report.sandbox_denied == p.display().to_string()),
        "{what}: sandbox_denied {:?} names none of {paths:?}",
        report.sandbox_denied
    );
    let said: String = report
        .failures
        .iter()
        .map(|f| f.message.as_str())
        .chain([report.stderr_tail.as_str()])
        .collect::<Vec<_>>()
        .join("\n");
    for path in paths {
        let path = path.display().to_string();
        assert!(
            said.lines().any(|line| line.contains(&path)
                && line.to_ascii_lowercase().contains("permission denied")),
            "{what}: no refusal of {path} in:\n{said}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_pytest_jest_and_vitest_suites_are_refused_by_the_kernel() -> anyhow::Result<()> {
    if troupe_process::sandbox::landlock_abi().is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI runs on a kernel with Landlock"
        );
        return Ok(());
    }
    let root = tempfile::tempdir()?;
    let root = root.path().canonicalize()?;
    let data = root.join("test-runner");
    let home = root.join("home");
    std::fs::create_dir_all(home.join(".ssh"))?;
    std::fs::write(home.join(".ssh/id_ed25519"), "PRIVATE KEY\n")?;
    let outside = root.join("outside");
    std::fs::create_dir_all(&outside)?;

    let runner = ChildService::start(
        "troupe-test-runner",
        &[
            "--data-dir",
            &data.display().to_string(),
            "--sandbox",
            "enforce",
        ],
        &[("HOME", home.to_str().unwrap_or_default())],
    )
    .await?;
    // Another session's worktree and a store in the same data dir (made after start: the
    // service clears its worktrees at boot).
    let other = data.join("worktrees/tasks/other-session/IMPL-9-1/secret.txt");
    std::fs::create_dir_all(other.parent().unwrap_or(&data))?;
    std::fs::write(&other, "another session's work\n")?;
    let store = data.join("troupe.db");
    std::fs::write(&store, "SQLite format 3\0")?;
    let targets = Targets {
        outside: outside.join("escaped.txt"),
        other,
        store,
        ssh: home.join(".ssh/id_ed25519"),
    };
    let url = runner.url();

    // Pytest: a conftest.py that writes outside as it is imported.
    let conftest_target = outside.join("from-conftest.txt");
    let repo = fixture_repo("pytest-proj", &[], &[], None);
    commit(
        repo.path(),
        &[(
            "conftest.py",
            format!(
                "open({:?}, 'w').write('pwned')\n",
                conftest_target.display().to_string()
            ),
        )],
    )?;
    let python = tools_python().display().to_string();
    let pytest = |repo: &Path| RunTestsRequest {
        repo_path: repo.display().to_string(),
        framework: TestFramework::Pytest as i32,
        python: python.clone(),
        ..RunTestsRequest::default()
    };
    let report = run(&url, pytest(repo.path())).await?;
    assert_denied("conftest.py", &report, &[&conftest_target]);
    assert!(!conftest_target.exists(), "conftest.py wrote outside");

    // Pytest: tests that go after each target.
    let quote = |p: &Path| format!("{:?}", p.display().to_string());
    let repo = fixture_repo("pytest-proj", &[], &[], None);
    let mut text = format!(
        "def test_write_outside():\n    open({}, 'w').write('pwned')\n",
        quote(&targets.outside)
    );
    for (n, path) in targets.reads().iter().enumerate() {
        text.push_str(&format!(
            "\n\ndef test_read_{n}():\n    print(open({}, 'rb').read())\n",
            quote(path)
        ));
    }
    commit(repo.path(), &[("tests/test_escape.py", text)])?;
    let report = run(&url, pytest(repo.path())).await?;
    let mut all: Vec<&Path> = vec![&targets.outside];
    all.extend(targets.reads());
    assert_denied("pytest tests", &report, &all);

    // Jest and Vitest: a test file per framework with one test per target.
    for (fixture, framework, file, header) in [
        (
            "jest-proj",
            TestFramework::Jest,
            "tests/escape.test.js",
            "const fs = require('fs');\n",
        ),
        (
            "vitest-proj",
            TestFramework::Vitest,
            "tests/escape.test.ts",
            "import { test } from 'vitest';\nimport * as fs from 'node:fs';\n",
        ),
    ] {
        let repo = fixture_repo(fixture, &[], &[], None);
        let mut text = format!(
            "{header}\ntest('writes outside', () => {{\n  fs.writeFileSync({}, 'pwned');\n}});\n",
            quote(&targets.outside)
        );
        for (n, path) in targets.reads().iter().enumerate() {
            text.push_str(&format!(
                "\ntest('reads {n}', () => {{\n  console.log(fs.readFileSync({}).toString());\n}});\n",
                quote(path)
            ));
        }
        commit(repo.path(), &[(file, text)])?;
        let report = run(
            &url,
            RunTestsRequest {
                repo_path: repo.path().display().to_string(),
                framework: framework as i32,
                ..RunTestsRequest::default()
            },
        )
        .await?;
        assert_denied(fixture, &report, &all);
    }

    // The kernel refused the side effects themselves, and nothing read reached a report.
    assert!(!targets.outside.exists(), "a write landed outside");
    let runs = std::fs::read_dir(data.join("test-runs"))?;
    for run in runs.flatten() {
        let text = std::fs::read_to_string(run.path().join("run-1.json")).unwrap_or_default();
        for secret in ["PRIVATE KEY", "another session's work", "SQLite format"] {
            assert!(!text.contains(secret), "{secret} reached a report");
        }
    }
    runner.terminate(Duration::from_secs(20)).await?;
    Ok(())
}
