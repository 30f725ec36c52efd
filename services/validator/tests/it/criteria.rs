//! Typed criteria (cmd, file, test, coverage) with passing and failing cases, free text with
//! and without a judge, and the judge contract: no evidence, or evidence that does not exist,
//! is never a pass.

use std::path::Path;

use troupe_proto::v1::{
    CheckStatus, Coverage, TestFailure, TestRunReport, ValidateRequest, ValidationReport, Verdict,
};
use troupe_testkit::git_repo;

use crate::{argv, start, validate};

const MODULE: &str = "def median(xs):\n    s = sorted(xs)\n    n = len(s)\n    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2\n";
const TESTS: &str = "from stats import median\n\n\ndef test_odd():\n    assert median([3, 1, 2]) == 2\n\n\ndef test_wrong():\n    assert median([1, 2]) == 2\n";

fn python_repo(dir: &Path) -> String {
    git_repo(
        dir,
        &[
            ("stats.py", MODULE),
            ("tests/test_stats.py", TESTS),
            ("tests/__init__.py", ""),
        ],
    )
    .expect("repo")
}

fn statuses(report: &ValidationReport) -> Vec<(String, CheckStatus)> {
    report
        .checks
        .iter()
        .map(|c| (c.subject.clone(), c.status()))
        .collect()
}

#[tokio::test]
async fn typed_criteria_pass_and_fail_with_evidence() {
    let dir = tempfile::tempdir().expect("tempdir");
    python_repo(dir.path());
    let (service, data) = start(None).await;
    let json_report = data.path().join("report.json");
    std::fs::write(
        &json_report,
        r#"{"tests": [{"nodeid": "tests/test_stats.py::test_odd", "outcome": "passed"}, {"nodeid": "tests/test_stats.py::test_skipped", "outcome": "skipped"}]}"#,
    )
    .expect("write report");
    let run = TestRunReport {
        commit: "f".repeat(40),
        command: argv(&["python", "-m", "pytest"]),
        failures: vec![TestFailure {
            name: "tests/test_stats.py::test_wrong".into(),
            file: "tests/test_stats.py".into(),
            line: 9,
            message: "assert 1.5 == 2".into(),
            criticality: troupe_proto::v1::Severity::High as i32,
            ..TestFailure::default()
        }],
        report_paths: vec![json_report.display().to_string()],
        coverage: Some(Coverage {
            overall: Some(87.5),
            files: [("stats.py".to_owned(), 100.0)].into(),
            ..Coverage::default()
        }),
        ..TestRunReport::default()
    };
    let criteria = [
        // commands: exit codes and output patterns
        "cmd: python3 -c 'print(6 * 7)' => exit 0, stdout ~ /^42$/",
        "`cmd: python3 -c 'import stats'` exits 0",
        "cmd: python3 -c 'import sys; sys.exit(3)' => exit 3",
        "cmd: python3 -c 'print(41)' => exit 0, stdout ~ /^42$/",
        "cmd: python3 -c 'import nope'",
        "cmd: python3 -c 'import sys; print(\"oops\", file=sys.stderr)' => stderr !~ /oops/",
        // files
        "file: stats.py exists",
        "file: missing.py exists",
        "file: old.py absent",
        "file: stats.py absent",
        r"file: stats.py contains /def median\(/",
        "file: stats.py contains /def mean/",
        "file: stats.py lacks /print\\(/",
        "file: stats.py lacks /sorted/",
        // tests: from the run's failures, its json report, or run directly with pytest
        "test: tests/test_stats.py::test_wrong passes",
        "test: tests/test_stats.py::test_odd passes",
        "test: tests/test_stats.py::test_skipped passes",
        // coverage from the test run
        "coverage >= 80",
        "coverage >= 90%",
        "coverage >= 99 for stats.py",
        // free text, and a near miss: no judge, so manual review
        "median() handles an empty list gracefully",
        "file: stats.py is well documented",
    ];
    let report = validate(
        &service,
        ValidateRequest {
            repo_path: dir.path().display().to_string(),
            criteria: criteria.iter().map(|c| (*c).to_owned()).collect(),
            test_runs: vec![run],
            ..ValidateRequest::default()
        },
    )
    .await
    .expect("validate");
    use CheckStatus::{Fail, ManualReview, Pass};
    let expected = [
        Pass,
        Pass,
        Pass,
        Fail,
        Fail,
        Fail,
        Pass,
        Fail,
        Pass,
        Fail,
        Pass,
        Fail,
        Pass,
        Fail,
        Fail,
        Pass,
        Fail,
        Pass,
        Fail,
        Pass,
        ManualReview,
        ManualReview,
    ];
    let got = statuses(&report);
    assert_eq!(got.len(), expected.len(), "{report:#?}");
    for ((subject, status), want) in got.iter().zip(expected) {
        assert_eq!(
            *status,
            want,
            "{subject}: {:#?}",
            report.checks.iter().find(|c| &c.subject == subject)
        );
    }
    let e = |i: usize| report.checks[i].evidence.as_str();
    assert!(
        e(0).contains("ok exit 0") && e(0).contains("ok stdout ~ /^42$/"),
        "{}",
        e(0)
    );
    assert!(
        e(3).contains("NOT stdout ~ /^42$/") && e(3).contains("41"),
        "{}",
        e(3)
    );
    assert!(
        e(4).contains("exit 1") && e(4).contains("No module named"),
        "{}",
        e(4)
    );
    assert!(e(10).contains("stats.py:1: def median(xs):"), "{}", e(10));
    assert!(e(13).contains("stats.py:2:"), "{}", e(13));
    assert!(
        e(14).contains("tests/test_stats.py:9") && e(14).contains("assert 1.5 == 2"),
        "{}",
        e(14)
    );
    assert!(e(15).contains("report.json"), "{}", e(15));
    assert!(e(16).contains("skipped"), "{}", e(16));
    assert!(e(17).contains("87.5% >= 80%"), "{}", e(17));
    assert!(e(18).contains("87.5% < 90%"), "{}", e(18));
    assert_eq!(e(20), troupe_validator::NO_CRITERION_CHECKER);
    assert!(e(21).contains("does not parse"), "{}", e(21));
    assert_eq!(report.verdict(), Verdict::Fail);
    assert_eq!(troupe_proto::names::name(report.convergence_met()), "fail");
    assert_eq!(
        report.convergence_verified,
        expected.iter().map(|s| *s == Pass).collect::<Vec<_>>()
    );

    // Without test runs: a pytest id runs directly (pass and fail), coverage cannot be known.
    let report = validate(
        &service,
        ValidateRequest {
            repo_path: dir.path().display().to_string(),
            criteria: vec![
                "test: tests/test_stats.py::test_odd passes".into(),
                "test: tests/test_stats.py::test_wrong passes".into(),
                "test: tests/test_stats.py::test_absent passes".into(),
                "coverage >= 50".into(),
            ],
            ..ValidateRequest::default()
        },
    )
    .await
    .expect("validate");
    assert_eq!(
        statuses(&report)
            .into_iter()
            .map(|(_, s)| s)
            .collect::<Vec<_>>(),
        [Pass, Fail, Fail, CheckStatus::Error],
        "{report:#?}"
    );
    assert!(
        report.checks[0].evidence.contains("1 passed"),
        "{}",
        report.checks[0].evidence
    );
    assert!(
        report.checks[1].evidence.contains("test failed"),
        "{}",
        report.checks[1].evidence
    );
    assert!(
        report.checks[3].evidence.contains("no test-run result"),
        "{}",
        report.checks[3].evidence
    );

    // Every criterion typed and passing: convergence-met is pass.
    let report = validate(
        &service,
        ValidateRequest {
            repo_path: dir.path().display().to_string(),
            criteria: vec![
                "file: stats.py exists".into(),
                "cmd: python3 -c 'import stats'".into(),
            ],
            ..ValidateRequest::default()
        },
    )
    .await
    .expect("validate");
    assert_eq!(report.verdict(), Verdict::Pass);
    assert_eq!(report.convergence_verified, [true, true]);
    assert_eq!(troupe_proto::names::name(report.convergence_met()), "pass");
    service.stop().await;
}

/// A judge script: checks that stdin carries the criterion and the worktree, then prints
/// `answer` (a JSON text or anything else).
fn judge_script(dir: &Path, name: &str, answer: &str) -> String {
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!(
            "import json, os, sys\nq = json.load(sys.stdin)\nassert q['criterion'] and os.path.isdir(q['worktree']), q\nprint('thinking about', q['criterion'])\nprint({answer:?})\n"
        ),
    )
    .expect("write judge");
    path.display().to_string()
}

#[tokio::test]
async fn the_judge_must_cite_evidence_that_exists() {
    let dir = tempfile::tempdir().expect("tempdir");
    python_repo(dir.path());
    let judges = tempfile::tempdir().expect("judges");
    let j = |name: &str, answer: &str| {
        vec![
            "python3".to_owned(),
            judge_script(judges.path(), name, answer),
        ]
    };
    let cases = [
        (
            j(
                "ok.py",
                r#"{"verdict": "pass", "evidence": [{"file": "stats.py", "line": 4}, {"command": "echo thinking", "output": "thinking about median()"}], "reason": "even lengths average"}"#,
            ),
            CheckStatus::Pass,
            "stats.py:4: return s[n // 2]",
        ),
        (
            j(
                "selfquote.py",
                r#"{"verdict": "pass", "evidence": [{"command": "pytest -q", "output": "9 passed"}]}"#,
            ),
            CheckStatus::ManualReview,
            "appears neither in the checks that ran nor in the judge's own transcript",
        ),
        (
            j(
                "fail.py",
                r#"{"verdict": "fail", "evidence": [{"file": "stats.py", "line": 2}]}"#,
            ),
            CheckStatus::Fail,
            "cites stats.py:2",
        ),
        (
            j("bare.py", r#"{"verdict": "pass", "evidence": []}"#),
            CheckStatus::ManualReview,
            "cited no evidence",
        ),
        (
            j(
                "noline.py",
                r#"{"verdict": "pass", "evidence": [{"file": "stats.py", "line": 99}]}"#,
            ),
            CheckStatus::ManualReview,
            "stats.py:99 does not exist (stats.py has 4 lines)",
        ),
        (
            j(
                "nofile.py",
                r#"{"verdict": "pass", "evidence": [{"file": "ghost.py", "line": 1}]}"#,
            ),
            CheckStatus::ManualReview,
            "ghost.py:1 does not exist",
        ),
        (
            j("prose.py", "Looks good to me!"),
            CheckStatus::ManualReview,
            "did not answer the JSON contract",
        ),
        (
            j(
                "maybe.py",
                r#"{"verdict": "probably", "evidence": [{"file": "stats.py", "line": 1}]}"#,
            ),
            CheckStatus::ManualReview,
            "not \"pass\" or \"fail\"",
        ),
        (
            vec![
                "python3".to_owned(),
                "-c".to_owned(),
                "import sys; sys.exit(2)".to_owned(),
            ],
            CheckStatus::Error,
            "could not give a verdict: backend `command` exited with code 2",
        ),
    ];
    let (service, _data) = crate::start_reading(None, &[judges.path()]).await;
    for (judge, want, evidence) in cases {
        let report = validate(
            &service,
            ValidateRequest {
                repo_path: dir.path().display().to_string(),
                criteria: vec!["median() averages the two middle values".into()],
                judge: judge.clone(),
                ..ValidateRequest::default()
            },
        )
        .await
        .expect("validate");
        let check = &report.checks[0];
        assert_eq!(check.status(), want, "{judge:?}: {}", check.evidence);
        assert!(
            check.evidence.contains(evidence),
            "{judge:?}: {}",
            check.evidence
        );
        if want == CheckStatus::Pass {
            assert!(
                check.evidence.starts_with("judged (not a typed check)"),
                "{}",
                check.evidence
            );
            assert_eq!(troupe_proto::names::name(report.convergence_met()), "pass");
        } else {
            assert_ne!(report.verdict(), Verdict::Pass);
        }
    }
    service.stop().await;

    // A judge configured on the validator (--judge) applies when the request names none;
    // typed criteria never reach it.
    let ok = judge_script(
        judges.path(),
        "ok2.py",
        r#"{"verdict": "pass", "evidence": [{"file": "stats.py", "line": 1}]}"#,
    );
    let (service, _data) =
        crate::start_reading(Some(format!("python3 {ok}")), &[judges.path()]).await;
    let report = validate(
        &service,
        ValidateRequest {
            repo_path: dir.path().display().to_string(),
            criteria: vec!["median() exists".into(), "file: nothing.py exists".into()],
            ..ValidateRequest::default()
        },
    )
    .await
    .expect("validate");
    assert_eq!(
        report.checks[0].status(),
        CheckStatus::Pass,
        "{}",
        report.checks[0].evidence
    );
    assert_eq!(report.checks[1].status(), CheckStatus::Fail);
    assert_eq!(report.convergence_verified, [true, false]);
    service.stop().await;
}
