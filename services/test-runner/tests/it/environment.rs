//! The project's own environment: `setup` commands that build what the suite needs, generated
//! files the checkout has and the worktree lacks, skips counted by reason, the allow-listed
//! `env` (a suite that needs `TZ`), `workdir`, and a failed install as its own outcome.

use std::collections::HashMap;

use tonic::Code;
use troupe_proto::v1::{RunTestsRequest, SetupCommand, TestFramework, TestOutcome, TestTotals};
use troupe_testkit::git_repo;

use super::support::{fixture_dir, fixture_repo, tools_python};
use super::{run_tests, start};

const VERSION_PACKAGE: &[(&str, &str)] = &[
    (
        ".gitignore",
        "src/verpkg/_version.py\nlocale/*.bin\n__pycache__/\n",
    ),
    (
        "src/verpkg/__init__.py",
        "from verpkg._version import version\n",
    ),
    ("locale/messages.txt", "hello=hallo\n"),
    (
        "tests/test_version.py",
        "from verpkg import version\n\n\ndef test_version_is_set():\n    assert version == '1.2.3'\n",
    ),
    (
        "tests/test_messages.py",
        "import pathlib\n\nimport pytest\n\nCATALOGUE = pathlib.Path(__file__).parent.parent / 'locale' / 'messages.bin'\n\n\n\
@pytest.mark.skipif(not CATALOGUE.exists(), reason='messages.bin not compiled')\n\
@pytest.mark.parametrize('word', ['hello', 'bye', 'yes'])\n\
def test_catalogue_has(word):\n    assert CATALOGUE.read_text()\n\n\n\
def test_always():\n    assert True\n",
    ),
];

/// What a build (setuptools-scm, msgfmt) leaves in a checkout: gitignored, generated files.
const BUILD: &str = "import pathlib\n\
pathlib.Path('src/verpkg/_version.py').write_text(\"version = '1.2.3'\\n\")\n\
pathlib.Path('locale/messages.bin').write_text('compiled')\n";

#[tokio::test]
async fn setup_builds_what_the_worktree_lacks_and_skips_are_counted() {
    let repo = tempfile::tempdir().expect("tempdir");
    git_repo(repo.path(), VERSION_PACKAGE).expect("repo");
    let python = tools_python();
    // The developer built the project in the checkout: the generated files are there.
    let out = std::process::Command::new(&python)
        .args(["-c", BUILD])
        .current_dir(repo.path())
        .output()
        .expect("build");
    assert!(out.status.success(), "{out:?}");
    let service = start().await;
    let base = RunTestsRequest {
        repo_path: repo.path().display().to_string(),
        framework: TestFramework::Pytest as i32,
        python: python.display().to_string(),
        ..RunTestsRequest::default()
    };

    // Without setup: the worktree has no version file (a collection error) and no catalogue
    // (three silent skips), and troupe says which generated files are missing.
    let report = run_tests(&service, base.clone()).await.expect("run");
    assert_eq!(
        report.outcome(),
        TestOutcome::CollectionError,
        "{report:#?}"
    );
    assert_eq!(
        report.missing_generated,
        ["locale/messages.bin", "src/verpkg/_version.py"]
    );
    assert!(
        report
            .warnings
            .iter()
            .any(|w| w.starts_with("generated files") && w.contains("src/verpkg/_version.py")),
        "{:?}",
        report.warnings
    );
    assert_eq!(
        report.skip_reasons.get("messages.bin not compiled"),
        Some(&3)
    );
    assert!(
        report
            .warnings
            .iter()
            .any(|w| w.contains("3 × messages.bin not compiled")
                && w.contains("3 of them for missing files")),
        "{:?}",
        report.warnings
    );

    // With the build as a setup command: everything runs and passes, nothing is missing.
    let mut with_setup = base.clone();
    with_setup.setup = vec![SetupCommand {
        argv: vec![
            python.display().to_string(),
            "-c".to_owned(),
            BUILD.to_owned(),
        ],
    }];
    let report = run_tests(&service, with_setup).await.expect("run");
    assert_eq!(report.outcome(), TestOutcome::Passed, "{report:#?}");
    assert_eq!(
        report.totals,
        Some(TestTotals {
            total: 5,
            passed: 5,
            ..TestTotals::default()
        })
    );
    assert!(
        report.missing_generated.is_empty(),
        "{:?}",
        report.missing_generated
    );
    assert!(report.skip_reasons.is_empty());
    assert_eq!(report.setup_steps.len(), 1);
    assert_eq!(report.setup_steps[0].exit_code, 0);

    // A setup command that fails ends the run with its output, before any test.
    let mut failing = base.clone();
    failing.setup = vec![SetupCommand {
        argv: vec![
            python.display().to_string(),
            "-c".to_owned(),
            "import sys; sys.exit('msgfmt: cannot open messages.po')".to_owned(),
        ],
    }];
    let report = run_tests(&service, failing).await.expect("run");
    assert_eq!(report.outcome(), TestOutcome::SetupFailed, "{report:#?}");
    assert!(report.totals.is_none());
    assert_eq!(report.setup_steps[0].exit_code, 1);
    assert!(
        report.setup_steps[0]
            .output_tail
            .contains("msgfmt: cannot open messages.po")
    );
    let run_file: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            report
                .report_paths
                .iter()
                .find(|p| p.ends_with("run-1.json"))
                .expect("run file"),
        )
        .expect("read"),
    )
    .expect("json");
    assert_eq!(run_file["outcome"], "setup_failed");
    assert!(
        run_file["crash_reason"]
            .as_str()
            .expect("reason")
            .contains("msgfmt: cannot open messages.po"),
        "{run_file}"
    );
    service.stop().await;
}

#[tokio::test]
async fn env_sets_the_timezone_and_refuses_other_names() {
    let repo = tempfile::tempdir().expect("tempdir");
    git_repo(
        repo.path(),
        &[
            (".gitignore", "node_modules\n"),
            (
                "package.json",
                r#"{"private": true, "devDependencies": {"jest": "30.5.2"}, "jest": {"testEnvironment": "node"}}"#,
            ),
            (
                "packages/clock/clock.test.js",
                "test('the epoch is New Year\\'s Eve evening in New York', () => {\n  expect(new Date(0).getHours()).toBe(19);\n});\n\ntest('a ticket is still valid', () => {\n  expect(process.env.APP_TICKET).toBe('valid');\n});\n",
            ),
        ],
    )
    .expect("repo");
    std::os::unix::fs::symlink(
        fixture_dir("jest-proj").join("node_modules"),
        repo.path().join("node_modules"),
    )
    .expect("link");
    let service = start().await;
    let base = RunTestsRequest {
        repo_path: repo.path().display().to_string(),
        ..RunTestsRequest::default()
    };
    let mut utc = base.clone();
    utc.env = HashMap::from([("TZ".to_owned(), "UTC".to_owned())]);
    let report = run_tests(&service, utc).await.expect("run");
    assert_eq!(report.outcome(), TestOutcome::TestsFailed, "{report:#?}");
    assert_eq!(report.failures.len(), 2);

    let mut new_york = base.clone();
    new_york.env = HashMap::from([
        ("TZ".to_owned(), "America/New_York".to_owned()),
        ("APP_TICKET".to_owned(), "valid".to_owned()),
    ]);
    let report = run_tests(&service, new_york).await.expect("run");
    assert_eq!(report.outcome(), TestOutcome::Passed, "{report:#?}");
    assert_eq!(
        report.env.get("TZ").map(String::as_str),
        Some("America/New_York")
    );

    let mut bad = base.clone();
    bad.env = HashMap::from([
        ("PATH".to_owned(), "/tmp/evil".to_owned()),
        ("OPENAI_API_KEY".to_owned(), "sk-x".to_owned()),
    ]);
    let status = run_tests(&service, bad).await.expect_err("refused");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("OPENAI_API_KEY, PATH"),
        "{}",
        status.message()
    );
    assert!(!status.message().contains("sk-x"), "values never echo");
    let mut outside = base.clone();
    outside.workdir = "../elsewhere".to_owned();
    let status = run_tests(&service, outside).await.expect_err("refused");
    assert_eq!(status.code(), Code::InvalidArgument);
    service.stop().await;
}

#[tokio::test]
async fn workdir_runs_one_package_and_a_failed_install_is_its_own_outcome() {
    let repo = tempfile::tempdir().expect("tempdir");
    git_repo(
        repo.path(),
        &[
            ("packages/calc/src/calc/__init__.py", "def add(a, b):\n    return a + b\n"),
            (
                "packages/calc/tests/test_add.py",
                "from calc import add\n\n\ndef test_add():\n    assert add(2, 2) == 4\n",
            ),
            (
                "packages/calc/pyproject.toml",
                "[project]\nname = \"calc\"\nversion = \"0.1\"\n\n[tool.pytest.ini_options]\ntestpaths = [\"tests\"]\n",
            ),
            ("packages/broken/requirements.txt", "troupe-no-such-distribution-xyz==0.0.1\n"),
            ("packages/broken/tests/test_x.py", "def test_x():\n    pass\n"),
        ],
    )
    .expect("repo");
    let service = start().await;
    let report = run_tests(
        &service,
        RunTestsRequest {
            repo_path: repo.path().display().to_string(),
            workdir: "packages/calc".to_owned(),
            python: tools_python().display().to_string(),
            coverage_target: 90.0,
            ..RunTestsRequest::default()
        },
    )
    .await
    .expect("run");
    assert_eq!(report.framework(), TestFramework::Pytest);
    assert_eq!(report.outcome(), TestOutcome::Passed, "{report:#?}");
    assert_eq!(report.workdir, "packages/calc");
    // Files are repo-relative; the default coverage source is the package, not `.`.
    assert_eq!(
        report
            .coverage
            .clone()
            .expect("coverage")
            .files
            .keys()
            .collect::<Vec<_>>(),
        ["packages/calc/src/calc/__init__.py"]
    );
    assert!(
        report.command.iter().any(|a| a == "--cov=calc"),
        "{:?}",
        report.command
    );

    let report = run_tests(
        &service,
        RunTestsRequest {
            repo_path: repo.path().display().to_string(),
            workdir: "packages/broken".to_owned(),
            framework: TestFramework::Pytest as i32,
            install: true,
            ..RunTestsRequest::default()
        },
    )
    .await
    .expect("run");
    assert_eq!(report.outcome(), TestOutcome::InstallFailed, "{report:#?}");
    assert!(
        report.installer.contains("pip install -r requirements.txt"),
        "{}",
        report.installer
    );
    assert!(
        report
            .install_log
            .contains("troupe-no-such-distribution-xyz"),
        "{}",
        report.install_log
    );
    service.stop().await;
}

#[tokio::test]
async fn the_projects_own_coverage_threshold_is_its_own_outcome() {
    let repo = tempfile::tempdir().expect("tempdir");
    git_repo(
        repo.path(),
        &[
            (".gitignore", "node_modules\n"),
            (
                "package.json",
                r#"{"private": true, "devDependencies": {"jest": "30.5.2"},
                   "jest": {"testEnvironment": "node", "collectCoverageFrom": ["src/**/*.js"],
                            "coverageThreshold": {"global": {"lines": 95}}}}"#,
            ),
            (
                "src/ops.js",
                "exports.add = (a, b) => a + b;\nexports.sub = (a, b) => {\n  return a - b;\n};\n",
            ),
            (
                "tests/ops.test.js",
                "const { add } = require('../src/ops');\n\ntest('adds', () => {\n  expect(add(1, 2)).toBe(3);\n});\n",
            ),
        ],
    )
    .expect("repo");
    std::os::unix::fs::symlink(
        fixture_dir("jest-proj").join("node_modules"),
        repo.path().join("node_modules"),
    )
    .expect("link");
    let service = start().await;
    let report = run_tests(
        &service,
        RunTestsRequest {
            repo_path: repo.path().display().to_string(),
            ..RunTestsRequest::default()
        },
    )
    .await
    .expect("run");
    assert_eq!(
        report.outcome(),
        TestOutcome::CoverageThreshold,
        "{report:#?}"
    );
    assert_eq!(report.exit_code, 1);
    assert_eq!(report.totals.expect("totals").failed, 0);
    assert!(
        report.stderr_tail.contains("threshold (95%)"),
        "{}",
        report.stderr_tail
    );
    service.stop().await;
}

/// A `test.setup` command runs confined: it builds inside its worktree, but a write outside
/// it is refused by the kernel, the run ends as SANDBOX_DENIED naming the path, and so does
/// the step's output.
#[tokio::test]
async fn setup_commands_are_confined_to_their_worktree() {
    let outside = tempfile::tempdir().expect("tempdir");
    let target = outside.path().join("escaped.txt");
    let repo = fixture_repo("pytest-proj", &[], &[], None);
    // The service as every test starts it: its sandbox defaults to enforce.
    let service = start().await;
    let inside = vec![
        "python3".to_owned(),
        "-c".to_owned(),
        "open('built.txt', 'w').write('ok')".to_owned(),
    ];
    let escape = vec!["touch".to_owned(), target.display().to_string()];
    let report = run_tests(
        &service,
        RunTestsRequest {
            repo_path: repo.path().display().to_string(),
            install: true,
            setup: vec![SetupCommand { argv: inside }, SetupCommand { argv: escape }],
            ..RunTestsRequest::default()
        },
    )
    .await
    .expect("run");
    assert_eq!(report.outcome(), TestOutcome::SandboxDenied, "{report:#?}");
    assert_eq!(report.sandbox_denied, target.display().to_string());
    assert_eq!(report.setup_steps.len(), 2);
    assert_eq!(report.setup_steps[0].exit_code, 0, "{report:#?}");
    let denied = &report.setup_steps[1].output_tail;
    assert!(
        denied.starts_with(&format!("denied by the sandbox: {}", target.display())),
        "{denied}"
    );
    assert!(
        !target.exists(),
        "the setup step wrote outside its worktree"
    );
    service.stop().await;
}
