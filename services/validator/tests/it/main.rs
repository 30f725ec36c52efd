//! Integration tests: the real validator on a port-0 listener, real git repositories, real
//! tools (tsc, node, python, cargo, ruff, flake8 from scripts/setup), through the `Validate`
//! RPC; the worker's VALIDATE / REVIEW / VERIFY handling through `ValidateHandler::check`.

mod checks;
mod criteria;
mod judge;
mod review;
mod worker;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tonic::Code;
use troupe_proto::v1::validator_client::ValidatorClient;
use troupe_proto::v1::{
    CheckResult, CheckStatus, FileAction, FileChange, ValidateRequest, ValidationReport, Verdict,
};
use troupe_testkit::{TestService, git, git_repo};

struct Fixture {
    _dir: tempfile::TempDir,
    _data: tempfile::TempDir,
    repo: String,
    base: String,
    head: String,
    service: TestService,
}

/// A repository with two commits: the second creates `new.py` and `empty.py`, modifies `a.py`
/// and deletes `c.py`; `b.py` is untouched.
async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = git_repo(
        dir.path(),
        &[
            ("a.py", "x = 1\n"),
            ("b.py", "y = 2\n"),
            ("c.py", "z = 3\n"),
            ("pkg/mod.py", "m = 0\n"),
        ],
    )
    .expect("repo");
    std::fs::write(dir.path().join("a.py"), "x = 1\nx += 1\n").expect("write");
    std::fs::write(dir.path().join("new.py"), "def f():\n    return 1\n").expect("write");
    std::fs::write(dir.path().join("empty.py"), "").expect("write");
    std::fs::remove_file(dir.path().join("c.py")).expect("rm");
    git(dir.path(), &["add", "-A"]).expect("add");
    git(dir.path(), &["commit", "-q", "-m", "change"]).expect("commit");
    let head = git(dir.path(), &["rev-parse", "HEAD"]).expect("head");
    let (service, data) = start(None).await;
    Fixture {
        repo: dir.path().display().to_string(),
        _dir: dir,
        _data: data,
        base,
        head,
        service,
    }
}

/// Where scripts/setup installs the check tools (tsc, ruff, flake8, a python with pytest).
pub(crate) fn tool_dirs() -> Vec<PathBuf> {
    let tools = troupe_testkit::workspace_root().join("target/tools");
    let dirs = vec![tools.join("node/node_modules/.bin"), tools.join("venv/bin")];
    for (dir, tool) in [(&dirs[0], "tsc"), (&dirs[1], "ruff"), (&dirs[1], "flake8")] {
        assert!(
            dir.join(tool).is_file(),
            "{tool} is not installed in {}: run scripts/setup/10-python-tools.sh and 40-validator-tools.sh (or scripts/test)",
            dir.display()
        );
    }
    dirs
}

/// A validator on a port-0 listener with the tool dirs and an optional default judge.
pub(crate) async fn start(judge: Option<String>) -> (TestService, tempfile::TempDir) {
    start_with(judge, None).await
}

/// A validator whose judge is configured by `judge_config` (the TOML of `--judge-config`).
pub(crate) async fn start_with_judge_config(
    judge_config: &str,
) -> (TestService, tempfile::TempDir) {
    start_with(None, Some(judge_config)).await
}

/// A validator whose confined children may also read `paths` (a test's judge scripts: the
/// sandbox refuses everything else outside the checkout, docs/sandbox.md).
pub(crate) async fn start_reading(
    judge: Option<String>,
    paths: &[&Path],
) -> (TestService, tempfile::TempDir) {
    start_with_reads(judge, None, paths).await
}

async fn start_with(
    judge: Option<String>,
    judge_config: Option<&str>,
) -> (TestService, tempfile::TempDir) {
    start_with_reads(judge, judge_config, &[]).await
}

async fn start_with_reads(
    judge: Option<String>,
    judge_config: Option<&str>,
    reads: &[&Path],
) -> (TestService, tempfile::TempDir) {
    let data = tempfile::tempdir().expect("data dir");
    let judge_config = judge_config.map(|text| {
        let path = data.path().join("judge.toml");
        std::fs::write(&path, text).expect("write the judge config");
        path
    });
    let config = troupe_validator::Config {
        listen: "127.0.0.1:0".parse().expect("address"),
        data_dir: data.path().to_path_buf(),
        coordinator_url: None,
        worker_id: None,
        worker: Default::default(),
        concurrency: 1,
        security: Default::default(),
    };
    let checks = troupe_validator::CheckConfig {
        tool_dirs: tool_dirs(),
        judge,
        judge_config,
        judge_timeout_seconds: 30,
        sandbox: troupe_process::sandbox::SandboxArgs {
            read_paths: reads.iter().map(|p| p.to_path_buf()).collect(),
            ..Default::default()
        },
    };
    let service = TestService::spawn(move |listener, shutdown| async move {
        let metrics = Default::default();
        troupe_validator::run_with(config, checks, &metrics, listener, shutdown).await
    })
    .await;
    (service, data)
}

/// `Validate` against `service`.
pub(crate) async fn validate(
    service: &TestService,
    request: ValidateRequest,
) -> Result<ValidationReport, tonic::Status> {
    let mut client = ValidatorClient::connect(service.url())
        .await
        .expect("connect");
    Ok(client
        .validate(request)
        .await?
        .into_inner()
        .report
        .expect("a report"))
}

/// Writes `files` into `dir` and commits them; returns the new commit.
pub(crate) fn commit(dir: &Path, files: &[(&str, &str)], message: &str) -> String {
    for (path, contents) in files {
        let full = dir.join(path);
        std::fs::create_dir_all(full.parent().expect("parent")).expect("mkdir");
        std::fs::write(full, contents).expect("write");
    }
    git(dir, &["add", "-A"]).expect("add");
    git(dir, &["commit", "-q", "--allow-empty", "-m", message]).expect("commit");
    git(dir, &["rev-parse", "HEAD"]).expect("head")
}

impl Fixture {
    async fn validate(&self, request: ValidateRequest) -> Result<ValidationReport, tonic::Status> {
        let mut client = ValidatorClient::connect(self.service.url())
            .await
            .expect("connect");
        let request = ValidateRequest {
            repo_path: self.repo.clone(),
            ..request
        };
        Ok(client
            .validate(request)
            .await?
            .into_inner()
            .report
            .expect("a report"))
    }

    fn worktrees_left(&self) -> usize {
        let dir = self._data.path().join("worktrees/validate");
        std::fs::read_dir(dir).map_or(0, |entries| entries.count())
    }
}

pub(crate) fn file(path: &str, action: FileAction) -> FileChange {
    FileChange {
        path: path.to_owned(),
        action: action as i32,
        change: String::new(),
    }
}

pub(crate) fn by_name(report: &ValidationReport) -> HashMap<&str, &CheckResult> {
    report.checks.iter().map(|c| (c.name.as_str(), c)).collect()
}

pub(crate) fn argv(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

#[tokio::test]
async fn file_checks_pass_and_fail_with_evidence() {
    let f = fixture().await;
    let report = f
        .validate(ValidateRequest {
            files: vec![
                file("new.py", FileAction::Create),
                file("empty.py", FileAction::Create),
                file("missing.py", FileAction::Create),
                file("a.py", FileAction::Modify),
                file("b.py", FileAction::Modify),
                file("gone.py", FileAction::Modify),
                file("c.py", FileAction::Delete),
                file("b.py", FileAction::Delete),
                file("pkg", FileAction::Delete),
                file("../outside.py", FileAction::Create),
            ],
            ..ValidateRequest::default()
        })
        .await
        .expect("validate");
    assert_eq!(report.commit, f.head);
    assert_eq!(report.verdict(), Verdict::Fail);
    let statuses: Vec<(&str, CheckStatus)> = report
        .checks
        .iter()
        .map(|c| (c.name.as_str(), c.status()))
        .collect();
    assert_eq!(
        statuses,
        [
            ("file:new.py", CheckStatus::Pass),
            ("file:empty.py", CheckStatus::Fail),
            ("file:missing.py", CheckStatus::Fail),
            ("file:a.py", CheckStatus::Pass),
            ("file:b.py", CheckStatus::Fail),
            ("file:gone.py", CheckStatus::Fail),
            ("file:c.py", CheckStatus::Pass),
            ("file:b.py", CheckStatus::Fail),
            ("file:pkg", CheckStatus::Fail),
            ("file:../outside.py", CheckStatus::Error),
        ]
    );
    let e = |i: usize| report.checks[i].evidence.as_str();
    assert!(
        e(0).contains("exists") && e(0).contains("2 lines"),
        "{}",
        e(0)
    );
    assert!(e(1).contains("empty"), "{}", e(1));
    assert!(e(2).contains("does not exist"), "{}", e(2));
    assert!(
        e(3).contains("changed between")
            && e(3).contains("1 lines -> ")
            && e(3).contains("2 lines"),
        "{}",
        e(3)
    );
    assert!(e(4).contains("unchanged"), "{}", e(4));
    assert!(
        e(6).contains("absent") && e(6).contains(&f.base[..12]),
        "{}",
        e(6)
    );
    assert!(e(7).contains("still exists"), "{}", e(7));
    assert!(e(8).contains("as a directory"), "{}", e(8));
    assert!(e(9).contains("escapes"), "{}", e(9));
    assert!(
        report
            .checks
            .iter()
            .all(|c| c.kind() == troupe_proto::v1::CheckKind::File)
    );

    // Against the first commit itself (a root commit) with an explicit base of HEAD: `a.py`
    // differs, `b.py` does not.
    let report = f
        .validate(ValidateRequest {
            r#ref: f.base.clone(),
            base_ref: f.head.clone(),
            files: vec![
                file("a.py", FileAction::Modify),
                file("b.py", FileAction::Modify),
            ],
            ..ValidateRequest::default()
        })
        .await
        .expect("validate");
    assert_eq!(report.commit, f.base);
    let checks = by_name(&report);
    assert_eq!(checks["file:a.py"].status(), CheckStatus::Pass);
    f.service.stop().await;
}

#[tokio::test]
async fn verification_runs_at_the_commit_and_reports_exit_codes() {
    let f = fixture().await;
    let verify = |r#ref: &str, command: Vec<String>, timeout_seconds: u32| ValidateRequest {
        r#ref: r#ref.to_owned(),
        verification: command,
        timeout_seconds,
        ..ValidateRequest::default()
    };

    // Exit 0 at HEAD, where new.py exists: the verdict is PASS with evidence.
    let report = f
        .validate(ValidateRequest {
            files: vec![file("new.py", FileAction::Create)],
            ..verify(
                "HEAD",
                argv(&["sh", "-c", "test -f new.py && echo found-it"]),
                0,
            )
        })
        .await
        .expect("validate");
    assert_eq!(report.verdict(), Verdict::Pass, "{report:#?}");
    let check = by_name(&report)["verification"];
    assert_eq!(check.status(), CheckStatus::Pass);
    assert!(
        check.evidence.starts_with("exit 0") && check.evidence.contains("found-it"),
        "{}",
        check.evidence
    );
    assert_eq!(check.subject, "sh -c test -f new.py && echo found-it");

    // The same command at the base commit, where new.py does not exist yet: exit 1, FAIL.
    let report = f
        .validate(verify(&f.base, argv(&["test", "-f", "new.py"]), 0))
        .await
        .expect("validate");
    assert_eq!(report.verdict(), Verdict::Fail);
    let check = by_name(&report)["verification"];
    assert_eq!(check.status(), CheckStatus::Fail);
    assert!(check.evidence.starts_with("exit 1"), "{}", check.evidence);

    // A command that outlives its limit is killed: ERROR, not FAIL, with evidence.
    let report = f
        .validate(verify("HEAD", argv(&["sleep", "30"]), 1))
        .await
        .expect("validate");
    let check = by_name(&report)["verification"];
    assert_eq!(check.status(), CheckStatus::Error);
    assert!(
        check.evidence.contains("timed out after 1s"),
        "{}",
        check.evidence
    );
    assert!(check.duration_ms < 10_000, "{}", check.duration_ms);
    assert_eq!(report.verdict(), Verdict::Fail);

    // A program that does not exist cannot run: ERROR.
    let report = f
        .validate(verify("HEAD", argv(&["troupe-no-such-program"]), 0))
        .await
        .expect("validate");
    let check = by_name(&report)["verification"];
    assert_eq!(check.status(), CheckStatus::Error);
    assert!(check.evidence.contains("not found"), "{}", check.evidence);

    // Every worktree was removed again.
    assert_eq!(f.worktrees_left(), 0);
    f.service.stop().await;
}

#[tokio::test]
async fn free_text_criteria_need_manual_review_and_never_pass() {
    let f = fixture().await;
    let report = f
        .validate(ValidateRequest {
            files: vec![file("new.py", FileAction::Create)],
            verification: argv(&["true"]),
            criteria: vec!["f() returns 1 for every input".to_owned()],
            ..ValidateRequest::default()
        })
        .await
        .expect("validate");
    assert_eq!(report.verdict(), Verdict::ManualReview);
    let check = by_name(&report)["criterion:1"];
    assert_eq!(check.status(), CheckStatus::ManualReview);
    assert_eq!(check.subject, "f() returns 1 for every input");
    assert_eq!(check.evidence, troupe_validator::NO_CRITERION_CHECKER);

    // Nothing to check at all is not a pass either.
    let report = f
        .validate(ValidateRequest::default())
        .await
        .expect("validate");
    assert_eq!(report.verdict(), Verdict::ManualReview);
    f.service.stop().await;
}

#[tokio::test]
async fn bad_requests_get_deliberate_codes() {
    let f = fixture().await;
    let mut client = ValidatorClient::connect(f.service.url())
        .await
        .expect("connect");
    let status = client
        .validate(ValidateRequest {
            repo_path: "relative".into(),
            ..ValidateRequest::default()
        })
        .await
        .expect_err("relative path");
    assert_eq!(status.code(), Code::InvalidArgument);
    let status = f
        .validate(ValidateRequest {
            r#ref: "no-such-branch".into(),
            ..ValidateRequest::default()
        })
        .await
        .expect_err("unknown ref");
    assert_eq!(status.code(), Code::NotFound);
    let not_a_repo = tempfile::tempdir().expect("tempdir");
    let status = client
        .validate(ValidateRequest {
            repo_path: not_a_repo.path().display().to_string(),
            ..ValidateRequest::default()
        })
        .await
        .expect_err("not a repo");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(Path::new(&f.repo).is_dir());
    f.service.stop().await;
}
