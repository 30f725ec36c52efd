//! The worker side: VALIDATE-*, REVIEW-* and VERIFY-* tasks as the coordinator hands them out
//! (a ClaimedTask with its session repo, upstream results and plan directory), run through
//! `ValidateHandler::check`, the function the worker loop calls.

use std::path::Path;
use std::sync::Arc;

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use troupe_grpc::worker::TaskFailure;
use troupe_proto::v1::{
    CheckStatus, ClaimedTask, Coverage, ErrorKind, FileAction, Role, SessionRepo, Task, TaskResult,
    TestRunReport, UpstreamConvergence, UpstreamResult, ValidationReport, task_result,
};
use troupe_testkit::{git, git_repo};
use troupe_validator::{Tools, ValidateHandler, Validator};

use crate::{commit, file, tool_dirs};

fn to_struct(value: &Value) -> prost_types::Struct {
    let Value::Object(map) = value else {
        panic!("not an object: {value}")
    };
    prost_types::Struct {
        fields: map.iter().map(|(k, v)| (k.clone(), to_value(v))).collect(),
    }
}

fn to_value(value: &Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match value {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(*b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().expect("number")),
        Value::String(s) => Kind::StringValue(s.clone()),
        Value::Array(items) => Kind::ListValue(prost_types::ListValue {
            values: items.iter().map(to_value).collect(),
        }),
        Value::Object(_) => Kind::StructValue(to_struct(value)),
    };
    prost_types::Value { kind: Some(kind) }
}

struct Session {
    dir: tempfile::TempDir,
    plan_dir: tempfile::TempDir,
    /// The plan; upstream results carry their task's spec from it, as the coordinator's do.
    plan: Value,
    data: tempfile::TempDir,
    base: String,
    impl1: String,
    impl2: String,
    handler: ValidateHandler,
}

fn impl_task(id: &str, files: Value, criteria: Value, verification: &str) -> Value {
    json!({
        "id": id, "title": format!("{id} title"), "description": "does a thing",
        "files": files,
        "convergence": {"criteria": criteria, "verification": verification},
        "agent": {"backend": "command", "command": ["true"]},
    })
}

/// A session: base, IMPL-001 (adds stats.py), IMPL-002 (adds report.py with an `eval`, but not
/// the tests/test_report.py it promised, nor `def summary`), and the plan in its directory.
fn session() -> Session {
    let dir = tempfile::tempdir().expect("repo");
    let base = git_repo(dir.path(), &[("README.md", "app\n")]).expect("repo");
    let impl1 = commit(
        dir.path(),
        &[(
            "stats.py",
            "def median(xs):\n    return sorted(xs)[len(xs) // 2]\n",
        )],
        "IMPL-001",
    );
    let impl2 = commit(
        dir.path(),
        &[(
            "report.py",
            "from stats import median\n\n\ndef report(xs):\n    return eval(\"median(xs)\")\n",
        )],
        "IMPL-002",
    );
    git(dir.path(), &["branch", "troupe/s1", &impl2]).expect("session branch");
    let plan_dir = tempfile::tempdir().expect("plan dir");
    let plan = json!({
        "name": "t", "repos": {"app": {"path": dir.path().display().to_string()}},
        "tasks": [
            impl_task("IMPL-001",
                json!([{"path": "stats.py", "action": "create", "change": "median"}]),
                json!(["file: stats.py contains /def median/", "cmd: python3 -c 'import stats'"]),
                "python3 -c 'import stats'"),
            impl_task("IMPL-002",
                json!([{"path": "report.py", "action": "create", "change": "report"},
                       {"path": "tests/test_report.py", "action": "create", "change": "test"}]),
                json!(["file: report.py contains /def summary/"]),
                "python3 -c 'import report'"),
            {"id": "VERIFY-001", "title": "verify", "description": "goal check", "depends_on": ["IMPL-001", "IMPL-002"]},
        ]
    });
    // No plan file anywhere: a checker reads what upstream tasks promised from the claim.
    let data = tempfile::tempdir().expect("data");
    let validator = Validator::new(data.path().to_path_buf()).with_tools(Tools::new(tool_dirs()));
    Session {
        dir,
        plan_dir,
        plan,
        data,
        base,
        impl1,
        impl2,
        handler: ValidateHandler::new(Arc::new(validator)),
    }
}

impl Session {
    fn upstream_impl(
        &self,
        id: &str,
        commit: &str,
        files: &[(&str, FileAction)],
    ) -> UpstreamResult {
        UpstreamResult {
            task_id: id.to_owned(),
            role: Role::Executor as i32,
            files: files.iter().map(|(p, a)| file(p, *a)).collect(),
            result: Some(TaskResult {
                commit: commit.to_owned(),
                ..TaskResult::default()
            }),
            repo: "app".into(),
            spec: self.plan["tasks"]
                .as_array()
                .and_then(|tasks| tasks.iter().find(|t| t["id"] == id))
                .map(to_struct),
        }
    }

    fn claimed(&self, id: &str, spec: Value, upstream: Vec<UpstreamResult>) -> ClaimedTask {
        ClaimedTask {
            task: Some(Task {
                session_id: "s1".into(),
                id: id.into(),
                title: format!("{id} title"),
                role: Role::Validator as i32,
                spec: Some(to_struct(&spec)),
                ..Task::default()
            }),
            repo: Some(SessionRepo {
                name: "app".into(),
                path: self.dir.path().display().to_string(),
                base_commit: self.base.clone(),
                branch: "troupe/s1".into(),
                ..SessionRepo::default()
            }),
            upstream,
            plan_dir: self.plan_dir.path().display().to_string(),
            ..ClaimedTask::default()
        }
    }

    async fn run(&self, claimed: ClaimedTask) -> Result<TaskResult, TaskFailure> {
        let notes = std::sync::Mutex::new(Vec::new());
        let progress = |note: String| notes.lock().expect("lock").push(note);
        let result = self
            .handler
            .check(claimed, &progress, &CancellationToken::new())
            .await;
        assert!(
            !notes.lock().expect("lock").is_empty(),
            "progress was reported"
        );
        result
    }
}

fn validation(result: &TaskResult) -> &ValidationReport {
    match &result.detail {
        Some(task_result::Detail::Validation(report)) => report,
        other => panic!("no validation report: {other:?}"),
    }
}

#[tokio::test]
async fn verify_finds_gaps_and_writes_verification_md() {
    let s = session();
    let upstream = vec![
        s.upstream_impl("IMPL-001", &s.impl1, &[("stats.py", FileAction::Create)]),
        s.upstream_impl(
            "IMPL-002",
            &s.impl2,
            &[
                ("report.py", FileAction::Create),
                ("tests/test_report.py", FileAction::Create),
            ],
        ),
    ];
    let failure = s
        .run(s.claimed("VERIFY-001", json!({"phase": 1}), upstream))
        .await
        .expect_err("gaps fail the task");
    assert_eq!(failure.error.kind(), ErrorKind::CheckFailed);
    assert!(!failure.error.retryable);
    let partial = failure.partial.expect("the report");
    let report = validation(&partial);
    let v = report.verification.as_ref().expect("verification");
    assert_eq!(troupe_proto::names::name(v.status()), "gaps_found");
    let entries: Vec<(&str, &[bool], &str)> = report
        .upstream_convergence
        .iter()
        .map(|u| {
            (
                u.task_id.as_str(),
                u.convergence_verified.as_slice(),
                troupe_proto::names::name(u.convergence_met()),
            )
        })
        .collect();
    assert_eq!(
        entries,
        [
            ("IMPL-001", &[true, true][..], "pass"),
            ("IMPL-002", &[false][..], "fail")
        ]
    );
    assert_eq!((v.tasks_checked, v.tasks_passed), (2, 1));
    let gaps: Vec<(&str, &str, &str)> = v
        .gaps
        .iter()
        .map(|g| {
            (
                g.task.as_str(),
                troupe_proto::names::name(g.r#type()),
                g.item.as_str(),
            )
        })
        .collect();
    assert_eq!(
        gaps,
        [
            ("IMPL-002", "file", "tests/test_report.py"),
            (
                "IMPL-002",
                "criterion",
                "file: report.py contains /def summary/"
            ),
        ],
        "{v:#?}"
    );
    // IMPL-001's properties hold: its files, verification and both typed criteria.
    for name in [
        "IMPL-001/file:stats.py",
        "IMPL-001/verification",
        "IMPL-001/criterion:1",
        "IMPL-001/criterion:2",
        "IMPL-002/verification",
    ] {
        let check = report
            .checks
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("{name}: {report:#?}"));
        assert_eq!(
            check.status(),
            CheckStatus::Pass,
            "{name}: {}",
            check.evidence
        );
    }
    let path = Path::new(&v.path);
    assert_eq!(
        path,
        s.data.path().join("verify/s1/VERIFY-001/verification.md")
    );
    let md = std::fs::read_to_string(path).expect("verification.md");
    assert!(
        md.starts_with("---\nphase: 1\ntask: \"VERIFY-001\"\n"),
        "{md}"
    );
    assert!(md.contains("status: gaps_found\ntasks_checked: 2\ntasks_passed: 1\ngaps:\n  - task: \"IMPL-002\"\n    type: \"file\"\n    item: \"tests/test_report.py\"\n    expected: \"File exists and is not empty\"\n"), "{md}");
    assert!(md.contains("## IMPL-001"), "{md}");
    assert!(
        failure
            .error
            .details
            .iter()
            .any(|d| d.contains("tests/test_report.py")),
        "{:?}",
        failure.error.details
    );

    // Only IMPL-001 upstream: nothing missing, the task completes.
    let done = s
        .run(s.claimed(
            "VERIFY-002",
            json!({}),
            vec![s.upstream_impl("IMPL-001", &s.impl1, &[("stats.py", FileAction::Create)])],
        ))
        .await
        .expect("passes");
    let v = validation(&done)
        .verification
        .clone()
        .expect("verification");
    assert_eq!(
        (
            troupe_proto::names::name(v.status()),
            v.tasks_checked,
            v.tasks_passed
        ),
        ("passed", 1, 1)
    );
    assert!(v.gaps.is_empty());
    assert!(
        std::fs::read_to_string(&v.path)
            .expect("md")
            .contains("status: passed\n")
    );

    // An upstream result without its spec: criteria cannot be read, which is a gap, not a pass.
    let mut upstream = s.upstream_impl("IMPL-001", &s.impl1, &[("stats.py", FileAction::Create)]);
    upstream.spec = None;
    let claimed = s.claimed("VERIFY-003", json!({}), vec![upstream]);
    let failure = s.run(claimed).await.expect_err("unverifiable");
    let report = validation(failure.partial.as_ref().expect("partial")).clone();
    let v = report.verification.expect("verification");
    assert_eq!(v.gaps.len(), 1, "{v:#?}");
    assert!(
        v.gaps[0].actual.contains("carries no spec"),
        "{:?}",
        v.gaps[0]
    );
}

#[tokio::test]
async fn review_tasks_approve_conditionally_or_block() {
    let s = session();
    // IMPL-002 brought an eval (high): CONDITIONAL completes with a warning.
    let done = s
        .run(s.claimed(
            "REVIEW-001",
            json!({"convergence": {"criteria": ["file: report.py exists"]}}),
            vec![],
        ))
        .await
        .expect("conditional completes");
    let review = validation(&done).review.clone().expect("review");
    assert_eq!(
        review.verdict(),
        troupe_proto::v1::ReviewVerdict::Conditional,
        "{review:#?}"
    );
    assert!(
        review
            .findings
            .iter()
            .any(|f| f.rule == "eval-exec" && f.file == "report.py" && f.line == 5),
        "{review:#?}"
    );
    assert!(
        done.warnings.iter().any(|w| w.contains("CONDITIONAL")),
        "{:?}",
        done.warnings
    );
    assert_eq!(
        troupe_proto::names::name(validation(&done).convergence_met()),
        "pass"
    );

    // A hard-coded password on the session branch: BLOCK fails the task.
    let head = commit(
        s.dir.path(),
        &[("settings.py", "password = \"hunter2hunter2\"\n")],
        "secret",
    );
    git(s.dir.path(), &["branch", "-f", "troupe/s1", &head]).expect("move branch");
    let failure = s
        .run(s.claimed("REVIEW-002", json!({}), vec![]))
        .await
        .expect_err("blocked");
    assert_eq!(failure.error.kind(), ErrorKind::CheckFailed);
    assert!(
        failure.error.message.contains("review blocked"),
        "{}",
        failure.error.message
    );
    assert!(
        failure
            .error
            .details
            .iter()
            .any(|d| d.contains("hardcoded-secret settings.py:1")),
        "{:?}",
        failure.error.details
    );
}

#[tokio::test]
async fn validate_tasks_use_upstream_test_runs_and_write_back_convergence() {
    let s = session();
    let testrun = UpstreamResult {
        repo: "app".into(),
        spec: None,
        task_id: "TESTRUN-001".into(),
        role: Role::TestRunner as i32,
        files: vec![],
        result: Some(TaskResult {
            commit: s.impl2.clone(),
            detail: Some(task_result::Detail::TestRun(TestRunReport {
                commit: s.impl2.clone(),
                coverage: Some(Coverage {
                    overall: Some(91.0),
                    ..Coverage::default()
                }),
                ..TestRunReport::default()
            })),
            ..TaskResult::default()
        }),
    };
    let upstream = vec![
        s.upstream_impl("IMPL-001", &s.impl1, &[("stats.py", FileAction::Create)]),
        testrun,
    ];
    let spec = json!({"convergence": {
        "criteria": ["coverage >= 80", "file: stats.py exists", "the report reads well"],
        "verification": ["python3", "-c", "import report"],
    }});
    let done = s
        .run(s.claimed("VALIDATE-001", spec, upstream))
        .await
        .expect("manual review completes");
    let report = validation(&done);
    assert_eq!(report.convergence_verified, [true, true, false]);
    assert_eq!(
        troupe_proto::names::name(report.convergence_met()),
        "pending"
    );
    assert!(
        done.summary.contains("convergence-met: pending"),
        "{}",
        done.summary
    );
    let status = |name: &str| {
        report
            .checks
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("{name}: {report:#?}"))
            .status()
    };
    assert_eq!(status("IMPL-001/file:stats.py"), CheckStatus::Pass);
    assert_eq!(status("verification"), CheckStatus::Pass);
    // Syntax of every file changed since the session base.
    assert_eq!(status("syntax:stats.py"), CheckStatus::Pass);
    assert_eq!(status("syntax:report.py"), CheckStatus::Pass);
    assert_eq!(status("criterion:1"), CheckStatus::Pass);
    assert_eq!(status("criterion:3"), CheckStatus::ManualReview);
    // IMPL-001's own criteria (from the plan) at the session head, for its record.
    assert_eq!(status("IMPL-001/criterion:1"), CheckStatus::Pass);
    assert_eq!(status("IMPL-001/criterion:2"), CheckStatus::Pass);
    assert_eq!(
        report.upstream_convergence,
        [UpstreamConvergence {
            task_id: "IMPL-001".into(),
            convergence_verified: vec![true, true],
            convergence_met: troupe_proto::v1::ConvergenceMet::Pass as i32,
            commit: s.impl2.clone(),
            ..UpstreamConvergence::default()
        }]
    );
    assert!(
        done.summary
            .contains("upstream convergence-met: IMPL-001 pass"),
        "{}",
        done.summary
    );

    // IMPL-002 promised `def summary` and did not deliver: its record gets [false] and
    // `fail`, and the validation fails. The test run is not an executor: no entry.
    let failure = s
        .run(s.claimed(
            "VALIDATE-003",
            json!({}),
            vec![
                s.upstream_impl("IMPL-001", &s.impl1, &[("stats.py", FileAction::Create)]),
                s.upstream_impl("IMPL-002", &s.impl2, &[("report.py", FileAction::Create)]),
            ],
        ))
        .await
        .expect_err("an upstream criterion failed");
    let report = validation(failure.partial.as_ref().expect("partial")).clone();
    let entries: Vec<(&str, &[bool], &str)> = report
        .upstream_convergence
        .iter()
        .map(|u| {
            (
                u.task_id.as_str(),
                u.convergence_verified.as_slice(),
                troupe_proto::names::name(u.convergence_met()),
            )
        })
        .collect();
    assert_eq!(
        entries,
        [
            ("IMPL-001", &[true, true][..], "pass"),
            ("IMPL-002", &[false][..], "fail")
        ]
    );
    assert!(report.convergence_verified.is_empty());
    assert_eq!(
        troupe_proto::names::name(report.convergence_met()),
        "unspecified"
    );

    // Without the upstream's spec there is nothing to read its criteria from: no entries,
    // and no failure for that alone.
    let mut upstream = s.upstream_impl("IMPL-001", &s.impl1, &[("stats.py", FileAction::Create)]);
    upstream.spec = None;
    let claimed = s.claimed("VALIDATE-004", json!({}), vec![upstream]);
    let done = s.run(claimed).await.expect("files pass");
    assert!(validation(&done).upstream_convergence.is_empty());

    // A failing typed criterion fails the task with convergence-met: fail.
    let failure = s
        .run(s.claimed(
            "VALIDATE-002",
            json!({"convergence": {"criteria": ["coverage >= 95"]}}),
            vec![],
        ))
        .await
        .expect_err("fails");
    let report = validation(failure.partial.as_ref().expect("partial")).clone();
    // No upstream test run: the coverage criterion cannot be checked.
    assert_eq!(
        report
            .checks
            .iter()
            .find(|c| c.name == "criterion:1")
            .map(|c| c.status()),
        Some(CheckStatus::Error)
    );
    assert_eq!(troupe_proto::names::name(report.convergence_met()), "fail");
}
