use std::time::Duration;

use serde_json::{Value, json};
use troupe_proto::v1 as pb;

use crate::spec::{JudgeSpec, ScopePolicy};
use crate::{FileAction, ProblemKind, Role, TaskKind, TaskSpec};

fn object(value: Value) -> serde_json::Map<String, Value> {
    value.as_object().expect("object").clone()
}

fn claimed(id: &str, role: pb::Role, spec: Value) -> pb::Task {
    pb::Task {
        id: id.to_owned(),
        role: role as i32,
        spec: Some(troupe_proto::json::to_struct(&spec)),
        ..pb::Task::default()
    }
}

#[test]
fn a_claimed_task_is_typed_once_from_its_wire_fields_and_its_spec() {
    let task = pb::Task {
        title: "Add median".into(),
        description: "so reports can use it".into(),
        repo: "app".into(),
        depends_on: vec!["IMPL-0".into()],
        files: vec![pb::FileChange {
            path: "stats/core.py".into(),
            action: pb::FileAction::Create as i32,
            change: "median()".into(),
        }],
        ..claimed(
            "IMPL-1",
            pb::Role::Executor,
            json!({
                "id": "IMPL-1",
                "focus_paths": ["tests/"],
                "timeout_seconds": 90,
                "convergence": {"criteria": ["median works"], "verification": "pytest -q"},
                "agent": {"backend": "command", "command": ["python3", "agent.py"]},
                "phase": 2,
            }),
        )
    };
    let spec = TaskSpec::try_from(&task).expect("valid");
    assert_eq!((spec.kind, spec.role), (TaskKind::Impl, Role::Executor));
    assert_eq!(spec.title, "Add median");
    assert_eq!(spec.repo, "app");
    assert_eq!(spec.depends_on, ["IMPL-0"]);
    assert_eq!(spec.files.len(), 1);
    assert_eq!(spec.files[0].action, FileAction::Create);
    assert_eq!(spec.files[0].change, "median()");
    assert_eq!(spec.timeout, Some(Duration::from_secs(90)));
    assert_eq!(spec.blocks.convergence.criteria, ["median works"]);
    assert_eq!(
        spec.blocks.convergence.verification.as_deref(),
        Some(&["pytest".to_owned(), "-q".to_owned()][..])
    );
    assert_eq!(spec.phase(), Some(&json!(2)));
    assert_eq!(
        spec.allowed_paths(),
        ["stats/core.py".to_owned(), "tests".to_owned()]
    );
}

#[test]
fn every_problem_of_a_claimed_task_is_reported_at_once() {
    let task = claimed(
        "VALIDATE-1",
        pb::Role::Validator,
        json!({
            "files": [{"action": "create"}, {"path": "../x", "action": "rename"}, 3],
            "focus_paths": ["/etc"],
            "timeout_seconds": -1,
            "convergence": {"criteria": "x", "verification": [1]},
            "judge": {"backend": "codex", "endpoint": "http://evil"},
            "agent": {"env": {"K": 1}},
            "test": {"framework": "mocha"},
            "scope_policy": "maybe",
        }),
    );
    let err = TaskSpec::try_from(&task).expect_err("invalid");
    let text = err.to_string();
    for needle in [
        "files[0]: missing required field `path`",
        "files[1].path `../x` escapes the repository root",
        "invalid action `rename`",
        "files[2] must be a path or an object",
        "focus_paths[0] `/etc` escapes",
        "invalid timeout_seconds -1",
        "`convergence.criteria`",
        "`convergence.verification",
        "`judge.endpoint`",
        "`agent.env.K`",
        "`test",
        "`scope_policy` must be",
    ] {
        assert!(text.contains(needle), "{needle} missing from:\n{text}");
    }
    assert!(err.has(ProblemKind::PathEscape));
    assert!(
        err.problems
            .iter()
            .all(|problem| problem.message.starts_with("task VALIDATE-1")),
        "{text}"
    );
}

#[test]
fn the_role_comes_from_the_claim_then_the_object_then_the_prefix() {
    // A claim's role wins: a DOC- task run by an executor is a plain IMPL.
    let doc = TaskSpec::try_from(&claimed("DOC-1", pb::Role::Executor, json!({}))).expect("ok");
    assert_eq!((doc.kind, doc.role), (TaskKind::Impl, Role::Executor));
    // CCW's TEST- prefix is a test run.
    let test =
        TaskSpec::try_from(&claimed("TEST-1", pb::Role::Unspecified, json!({}))).expect("prefix");
    assert_eq!(
        (test.kind, test.role),
        (TaskKind::TestRun, Role::TestRunner)
    );
    let unknown = TaskSpec::try_from(&claimed("DOC-1", pb::Role::Unspecified, json!({})))
        .expect_err("no role");
    assert!(unknown.has(ProblemKind::UnknownRole), "{unknown}");
    // A direct call's object: the reader's role when nothing else names one.
    let direct = TaskSpec::from_object(&object(json!({"id": "x"})), Some(Role::Executor))
        .expect("reader's role");
    assert_eq!(direct.kind, TaskKind::Impl);
    let missing =
        TaskSpec::from_object(&object(json!({})), Some(Role::Executor)).expect_err("no id");
    assert!(missing.has(ProblemKind::MissingField), "{missing}");
}

#[test]
fn files_are_objects_or_bare_paths_by_one_rule() {
    let spec = TaskSpec::from_object(
        &object(json!({"id": "IMPL-1", "files": [
            "docs/x.md",
            {"path": "src/a.py", "action": "Create", "target": "fn a"},
            {"path": "src/b.py", "change": "b", "target": "ignored"},
        ]})),
        None,
    )
    .expect("valid");
    let files: Vec<(&str, FileAction, &str)> = spec
        .files
        .iter()
        .map(|f| (f.path.as_str(), f.action, f.change.as_str()))
        .collect();
    assert_eq!(
        files,
        [
            ("docs/x.md", FileAction::Modify, ""),
            ("src/a.py", FileAction::Create, "fn a"),
            ("src/b.py", FileAction::Modify, "b"),
        ]
    );
    // The plan reads them the same way at intake.
    let plan = crate::Plan::from_json(
        &json!({"name": "p", "tasks": [{"id": "IMPL-1", "title": "t", "files": ["docs/x.md"]}]})
            .to_string(),
    )
    .expect("plan");
    assert_eq!(plan.tasks[0].files, spec.files[..1]);
}

#[test]
fn an_upstream_task_reads_by_the_same_rules() {
    let upstream = pb::UpstreamResult {
        task_id: "IMPL-1".into(),
        role: pb::Role::Executor as i32,
        repo: "app".into(),
        spec: Some(troupe_proto::json::to_struct(
            &json!({"title": "t", "convergence": {"criteria": ["a"], "verification": ""}}),
        )),
        ..pb::UpstreamResult::default()
    };
    let spec = TaskSpec::try_from(&upstream).expect("valid");
    assert_eq!(spec.title, "t");
    assert_eq!(spec.repo, "app");
    assert_eq!(spec.blocks.convergence.criteria, ["a"]);
    // A blank verification line is none, as everywhere.
    assert_eq!(spec.blocks.convergence.verification, None);
}

#[test]
fn scope_checks_use_path_prefixes() {
    let spec = TaskSpec::from_object(
        &object(
            json!({"id": "IMPL-1", "files": [{"path": "src/a.py"}], "focus_paths": ["./tests/"],
                       "excludes": ["tests/golden"], "scope": "refuse",
                       "judge": ["python3", "judge.py"]}),
        ),
        None,
    )
    .expect("valid");
    assert_eq!(spec.blocks.scope_policy, ScopePolicy::Refuse);
    assert!(matches!(spec.blocks.judge, Some(JudgeSpec::Command { .. })));
    let changed = [
        "src/a.py",
        "src/a.pyc",
        "tests/t.py",
        "testsuite/x",
        "tests/golden/g.txt",
    ]
    .map(str::to_owned);
    assert_eq!(
        spec.out_of_scope(&changed),
        Some(
            ["src/a.pyc", "testsuite/x", "tests/golden/g.txt"]
                .map(str::to_owned)
                .to_vec()
        )
    );
    let unscoped = TaskSpec::from_object(&object(json!({"id": "IMPL-1"})), None).expect("ok");
    assert_eq!(unscoped.out_of_scope(&changed), None);
}
