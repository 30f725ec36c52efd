//! Installs as the project says: one Vitest workspace under pnpm, yarn classic, yarn berry
//! (through corepack) and bun, each with its frozen lockfile
//! (workspace links re-made inside the worktree), and a Python project's own test extras or
//! PEP 735 dependency groups from `pyproject.toml`. Each is compared with the framework run
//! directly at the same commit, with a one-line bug in a task's commit.

use troupe_proto::v1::{RunTestsRequest, TestFramework, TestOutcome};

use super::support::{checkout_of, commit_on_branch, fixture_repo, read_json, run};
use super::{data_dir, run_tests, start};

#[tokio::test]
async fn a_pnpm_workspace_installs_frozen_and_tests_the_task_commit() {
    workspace_installs_frozen_and_tests_the_task_commit(
        "pnpm-workspace",
        &["corepack", "pnpm", "install", "--frozen-lockfile"],
        "pnpm",
    )
    .await;
}

#[tokio::test]
async fn a_yarn_classic_workspace_installs_frozen_and_tests_the_task_commit() {
    workspace_installs_frozen_and_tests_the_task_commit(
        "yarn-workspace",
        &[
            "corepack",
            "yarn",
            "install",
            "--frozen-lockfile",
            "--non-interactive",
        ],
        "yarn",
    )
    .await;
}

#[tokio::test]
async fn a_yarn_berry_workspace_installs_frozen_and_tests_the_task_commit() {
    workspace_installs_frozen_and_tests_the_task_commit(
        "yarn-berry-workspace",
        &["corepack", "yarn", "install", "--immutable"],
        "yarn berry",
    )
    .await;
}

#[tokio::test]
async fn a_bun_workspace_installs_frozen_and_tests_the_task_commit() {
    workspace_installs_frozen_and_tests_the_task_commit(
        "bun-workspace",
        &["bun", "install", "--frozen-lockfile"],
        "bun",
    )
    .await;
}

/// The same two-package Vitest workspace under each package manager, with its committed
/// lockfile: installed by the manager itself at the task's commit (a one-line bug in package
/// a, caught by package b's test) and run directly, then through `RunTests`; the numbers must
/// agree, the install must be the frozen one, and a second run must reuse the cached install.
async fn workspace_installs_frozen_and_tests_the_task_commit(
    fixture: &str,
    install: &[&str],
    manager: &str,
) {
    let repo = fixture_repo(fixture, &[], &[], None);
    let task = commit_on_branch(
        repo.path(),
        "task",
        &[(
            "packages/a/src/index.js",
            "(100 - percent)",
            "(100 + percent)",
        )],
    );
    // Directly: a clean checkout of the task's commit, installed by the package manager itself.
    let direct = checkout_of(repo.path(), &task);
    let dir = direct.path().join("co");
    let program = std::path::PathBuf::from(install[0]);
    let env: Vec<(&str, String)> = ["COREPACK_HOME", "COREPACK_INTEGRITY_KEYS"]
        .iter()
        .filter_map(|k| std::env::var(k).ok().map(|v| (*k, v)))
        .chain([
            ("COREPACK_ENABLE_DOWNLOAD_PROMPT", "0".to_owned()),
            ("CI", "true".to_owned()),
        ])
        .collect();
    let out = run(&program, &install[1..], &dir, &env);
    assert!(
        out.status.success(),
        "{} (run scripts/setup/35-corepack.sh and 36-bun.sh first): {out:?}",
        install.join(" ")
    );
    let results = dir.join("results.json");
    let out = run(
        &dir.join("node_modules/.bin/vitest"),
        &[
            "run",
            "--reporter=json",
            &format!("--outputFile={}", results.display()),
        ],
        &dir,
        &[("CI", "true".to_owned())],
    );
    assert!(results.is_file(), "{out:?}");
    let direct = read_json(&results);
    assert_eq!(direct["numFailedTests"], 1, "{direct}");

    let service = start().await;
    let report = run_tests(
        &service,
        RunTestsRequest {
            repo_path: repo.path().display().to_string(),
            r#ref: task.clone(),
            install: true,
            ..RunTestsRequest::default()
        },
    )
    .await
    .expect("run");
    assert_eq!(report.framework(), TestFramework::Vitest);
    assert_eq!(report.outcome(), TestOutcome::TestsFailed, "{report:#?}");
    let totals = report.totals.expect("totals");
    assert_eq!(u64::from(totals.total), direct["numTotalTests"]);
    assert_eq!(u64::from(totals.failed), direct["numFailedTests"]);
    assert_eq!(report.failures[0].name, "a quarter off");
    assert_eq!(report.failures[0].file, "packages/b/test/checkout.test.js");
    assert!(
        report.installer.contains(&install.join(" ")),
        "{}",
        report.installer
    );
    assert!(
        report
            .warnings
            .iter()
            .any(|w| *w == format!("package manager: {manager}")),
        "{:?}",
        report.warnings
    );
    assert!(
        report.outside_paths.is_empty(),
        "{:?}",
        report.outside_paths
    );
    let projects: Vec<(&str, u32)> = report
        .projects
        .iter()
        .map(|p| (p.name.as_str(), p.failures))
        .collect();
    assert_eq!(projects, [("@fx/a", 0), ("@fx/b", 1)]);
    // Each project's own line coverage: package a holds the only covered source file, so its
    // figure is that file's, as the framework reported it; package b has no source.
    let coverage = report.coverage.clone().expect("coverage measured");
    let file = coverage.files.get("packages/a/src/index.js").copied();
    assert!(file.is_some(), "{:?}", coverage.files);
    assert_eq!(report.projects[0].line_coverage, file);
    assert_eq!(report.projects[1].line_coverage, None);
    // The second run reuses the install cached by lockfile hash.
    let again = run_tests(
        &service,
        RunTestsRequest {
            repo_path: repo.path().display().to_string(),
            r#ref: "main".to_owned(),
            install: true,
            ..RunTestsRequest::default()
        },
    )
    .await
    .expect("run");
    assert_eq!(again.outcome(), TestOutcome::Passed, "{again:#?}");
    assert!(
        again
            .warnings
            .iter()
            .any(|w| w.starts_with("reused the node_modules cached")),
        "{:?}",
        again.warnings
    );
    service.stop().await;
}

#[tokio::test]
async fn python_installs_the_projects_test_extras_or_dependency_groups() {
    let repo = fixture_repo("pysrc-proj", &[], &[], None);
    commit_on_branch(
        repo.path(),
        "groups",
        &[(
            "pyproject.toml",
            "[project.optional-dependencies]\ntest = [",
            "[dependency-groups]\ntest = [",
        )],
    );
    let service = start().await;
    for (rev, chosen) in [("main", "extra test"), ("groups", "group test")] {
        let report = run_tests(
            &service,
            RunTestsRequest {
                repo_path: repo.path().display().to_string(),
                r#ref: rev.to_owned(),
                install: true,
                ..RunTestsRequest::default()
            },
        )
        .await
        .expect("run");
        assert_eq!(report.outcome(), TestOutcome::Passed, "{rev}: {report:#?}");
        assert_eq!(report.totals.expect("totals").passed, 3);
        assert!(
            report
                .installer
                .contains(&format!("pyproject.toml dependencies with {chosen}")),
            "{rev}: {}",
            report.installer
        );
        assert!(
            report.python.ends_with(".venv/bin/python"),
            "{}",
            report.python
        );
        assert!(
            report.installer.contains("cached venv") || report.installer.contains("built venv")
        );
        assert!(!report.framework_version.is_empty());
    }
    service.stop().await;
}

/// The project itself is installed (its metadata and entry points exist) into a venv of the
/// run's own, editable from the worktree: the shared, cached venv never holds it, so two
/// commits in a row each test their own code.
#[tokio::test]
async fn python_installs_the_project_itself_into_the_runs_own_venv() {
    let repo = fixture_repo("pysrc-proj", &[], &[], None);
    let metadata_test = "import pytest\nimport importlib.metadata, pathlib\nimport pricing\n\n\n\
def test_the_project_is_installed_from_the_worktree():\n    \
assert importlib.metadata.version('pricing') == '0.1.0'\n    \
assert pathlib.Path(pricing.__file__).resolve().is_relative_to(pathlib.Path(__file__).resolve().parents[1])\n";
    commit_on_branch(
        repo.path(),
        "metadata",
        &[("tests/test_cart.py", "import pytest\n", metadata_test)],
    );
    // The same test on a commit whose code has a one-line bug: it must be seen.
    commit_on_branch(
        repo.path(),
        "bug",
        &[
            ("tests/test_cart.py", "import pytest\n", metadata_test),
            ("src/pricing/cart.py", "return sum(", "return 1 + sum("),
        ],
    );
    let service = start().await;
    for (rev, passed, failed) in [("metadata", 4, 0), ("bug", 3, 1), ("metadata", 4, 0)] {
        let report = run_tests(
            &service,
            RunTestsRequest {
                repo_path: repo.path().display().to_string(),
                r#ref: rev.to_owned(),
                install: true,
                ..RunTestsRequest::default()
            },
        )
        .await
        .expect("run");
        let totals = report.totals.expect("totals");
        assert_eq!(
            (totals.passed, totals.failed),
            (passed, failed),
            "{rev}: {report:#?}"
        );
        assert!(
            report
                .installer
                .contains("the project installed editable (--no-deps) into the run's own venv"),
            "{rev}: {}",
            report.installer
        );
        assert!(
            report.python.ends_with(".venv/bin/python"),
            "{}",
            report.python
        );
    }
    // The cached venvs hold the requirements and the build system, never the project.
    let venvs = data_dir().join("venvs");
    for venv in std::fs::read_dir(&venvs).expect("venvs").flatten() {
        let found = std::process::Command::new("find")
            .args([
                venv.path().as_os_str(),
                "-iname".as_ref(),
                "pricing*".as_ref(),
            ])
            .output()
            .expect("find");
        assert!(
            found.stdout.is_empty(),
            "the cached venv {} holds the project: {}",
            venv.path().display(),
            String::from_utf8_lossy(&found.stdout)
        );
    }
    service.stop().await;
}

/// A poetry project keeps its dependencies in `[tool.poetry]` and `poetry.lock` only: the
/// venv gets exactly the locked versions of the main and test groups (without poetry), the
/// project itself is installed through its poetry-core build system, and a bug in a task's
/// commit is seen.
#[tokio::test]
async fn a_poetry_project_installs_its_lock() {
    let repo = fixture_repo("poetry-proj", &[], &[], None);
    commit_on_branch(
        repo.path(),
        "bug",
        &[(
            "inventory/__init__.py",
            "item.count + amount",
            "item.count - amount",
        )],
    );
    let service = start().await;
    for (rev, passed, failed) in [("main", 2, 0), ("bug", 1, 1)] {
        let report = run_tests(
            &service,
            RunTestsRequest {
                repo_path: repo.path().display().to_string(),
                r#ref: rev.to_owned(),
                install: true,
                ..RunTestsRequest::default()
            },
        )
        .await
        .expect("run");
        let totals = report.totals.expect("totals");
        assert_eq!(
            (totals.passed, totals.failed, totals.errors),
            (passed, failed, 0),
            "{rev}: {report:#?}"
        );
        assert!(
            report
                .installer
                .contains("poetry.lock pinned, --no-deps (groups main, test)"),
            "{}",
            report.installer
        );
        assert!(
            report.installer.contains("the project installed editable"),
            "{}",
            report.installer
        );
        assert!(
            report.outside_paths.is_empty(),
            "{:?}",
            report.outside_paths
        );
    }
    // Exactly the locked versions.
    let venvs = data_dir().join("venvs");
    let attrs = std::fs::read_dir(&venvs)
        .expect("venvs")
        .flatten()
        .any(|venv| {
            let site = venv.path().join("lib");
            std::process::Command::new("find")
                .args([
                    site.as_os_str(),
                    "-name".as_ref(),
                    "attrs-25.4.0.dist-info".as_ref(),
                ])
                .output()
                .is_ok_and(|out| !out.stdout.is_empty())
        });
    assert!(attrs, "no venv holds the locked attrs 25.4.0");
    service.stop().await;
}
