use serde_json::json;

use super::*;

fn plan(value: serde_json::Value) -> Result<Plan, PlanError> {
    Plan::from_json(&value.to_string())
}

fn task(id: &str, deps: &[&str]) -> serde_json::Value {
    json!({"id": id, "title": format!("do {id}"), "depends_on": deps})
}

fn problems_of(value: serde_json::Value) -> PlanError {
    plan(value).expect_err("plan should be refused")
}

fn messages(err: &PlanError) -> Vec<String> {
    err.problems.iter().map(|p| p.message.clone()).collect()
}

#[test]
fn parses_a_full_plan_with_defaults() {
    let plan = plan(json!({
        "name": "quickstart",
        "description": "demo",
        "repos": {"app": {"path": "repo"}},
        "tasks": [
            {"id": "IMPL-001", "title": "a", "files": [{"path": "src/x.py", "action": "create", "change": "new"}],
             "convergence": {"criteria": ["x exists"], "verification": "python -m pytest -q"}, "extra": {"kept": true}},
            {"id": "VALIDATE-001", "title": "b", "depends_on": ["IMPL-001"], "priority": "critical"},
            {"id": "TESTRUN-001", "title": "c", "depends_on": ["IMPL-001"], "max_attempts": 5, "timeout_seconds": 60},
            {"id": "DOC-001", "title": "d", "role": "executor", "priority": "low"}
        ]
    }))
    .expect("valid plan");
    assert_eq!(plan.name, "quickstart");
    assert_eq!(plan.mode, Mode::Eager);
    assert_eq!(plan.on_failure, OnFailure::Skip);
    assert_eq!(plan.max_attempts, DEFAULT_MAX_ATTEMPTS);
    assert_eq!(plan.default_repo().name, "app");
    assert_eq!(plan.default_repo().source, RepoSource::Path("repo".into()));
    let impl1 = plan.task("IMPL-001").expect("impl");
    assert_eq!(impl1.role, Role::Executor);
    assert_eq!(impl1.repo, "app");
    assert_eq!(impl1.priority, Priority::P1);
    assert_eq!(impl1.files[0].action, FileAction::Create);
    assert_eq!(impl1.spec.get("extra"), Some(&json!({"kept": true})));
    assert_eq!(impl1.max_attempts, 2);
    let validate = plan.task("VALIDATE-001").expect("validate");
    assert_eq!(validate.role.to_proto(), troupe_proto::v1::Role::Validator);
    assert_eq!(validate.priority, Priority::P0);
    let testrun = plan.task("TESTRUN-001").expect("testrun");
    assert_eq!(testrun.role, Role::TestRunner);
    assert_eq!(testrun.max_attempts, 5);
    assert_eq!(testrun.timeout_seconds, Some(60));
    assert_eq!(plan.task("DOC-001").expect("doc").priority, Priority::P2);
}

#[test]
fn first_repo_in_document_order_is_the_default() {
    let plan = Plan::from_json(
        r#"{"name":"p","repos":{"zeta":{"path":"z"},"alpha":{"template":"t"}},
            "tasks":[{"id":"IMPL-1","title":"t"}]}"#,
    )
    .expect("valid");
    assert_eq!(plan.repos[0].name, "zeta");
    assert_eq!(plan.repos[1].source, RepoSource::Template("t".into()));
    assert_eq!(plan.task("IMPL-1").expect("task").repo, "zeta");
}

#[test]
fn implicit_repo_when_none_declared() {
    let plan = plan(json!({"name": "p", "tasks": [task("IMPL-1", &[])]})).expect("valid");
    assert_eq!(plan.repos.len(), 1);
    assert_eq!(plan.default_repo().name, IMPLICIT_REPO);
}

#[test]
fn role_mapping_by_prefix_and_override() {
    for (id, role) in [
        ("IMPL-1", Role::Executor),
        ("EXEC-1", Role::Executor),
        ("FIX-1", Role::Executor),
        ("VALIDATE-1", Role::Validator),
        ("REVIEW-1", Role::Validator),
        ("VERIFY-1", Role::Validator),
        ("TESTRUN-1", Role::TestRunner),
        ("QARUN-1", Role::TestRunner),
    ] {
        assert_eq!(
            TaskKind::from_id(id).map(TaskKind::role),
            Some(role),
            "{id}"
        );
    }
    assert_eq!(TaskKind::from_id("DOC-1"), None);
    assert_eq!(TaskKind::from_id("test-2"), Some(TaskKind::TestRun));
    assert_eq!(TaskKind::of("DOC-1", Role::Executor), TaskKind::Impl);
    assert_eq!(TaskKind::of("REVIEW-1", Role::Validator), TaskKind::Review);
    assert_eq!(TaskKind::of("REVIEW-1", Role::Executor), TaskKind::Impl);
    let plan = plan(json!({"name": "p", "tasks": [
        {"id": "IMPL-1", "title": "t", "role": "test-runner"}
    ]}))
    .expect("valid");
    assert_eq!(plan.tasks[0].role, Role::TestRunner);
}

#[test]
fn malformed_json_reports_line_and_column() {
    let err = Plan::from_json("{\n  \"name\": \"x\",\n  \"tasks\": [,]\n}").expect_err("refused");
    assert_eq!(err.problems.len(), 1);
    assert_eq!(err.problems[0].kind, ProblemKind::MalformedJson);
    assert!(err.problems[0].message.contains("line 3"), "{err}");
    assert!(err.problems[0].message.contains("column"), "{err}");
    let err = Plan::from_json("[1]").expect_err("refused");
    assert!(err.has(ProblemKind::MalformedJson));
}

#[test]
fn missing_required_fields() {
    let err = problems_of(json!({}));
    assert!(messages(&err).iter().any(|m| m.contains("`name`")), "{err}");
    assert!(
        messages(&err).iter().any(|m| m.contains("`tasks`")),
        "{err}"
    );
    let err = problems_of(json!({"name": "", "tasks": []}));
    assert_eq!(
        err.problems
            .iter()
            .filter(|p| p.kind == ProblemKind::MissingField)
            .count(),
        2,
        "{err}"
    );
    let err = problems_of(
        json!({"name": "p", "tasks": [{"title": "x"}, {"id": "IMPL-2"}, {"id": "IMPL-3", "title": " "}]}),
    );
    let msgs = messages(&err);
    assert!(
        msgs.contains(&"tasks[0]: missing required field `id`".to_owned()),
        "{err}"
    );
    assert!(
        msgs.contains(&"task IMPL-2: missing required field `title`".to_owned()),
        "{err}"
    );
    assert!(
        msgs.contains(&"task IMPL-3: `title` is empty".to_owned()),
        "{err}"
    );
}

#[test]
fn invalid_name() {
    let err = problems_of(json!({"name": "Quick Start", "tasks": [task("IMPL-1", &[])]}));
    assert!(err.has(ProblemKind::InvalidValue), "{err}");
}

#[test]
fn duplicate_ids() {
    let err =
        problems_of(json!({"name": "p", "tasks": [task("IMPL-1", &[]), task("IMPL-1", &[])]}));
    assert_eq!(
        messages(&err),
        vec!["duplicate task id IMPL-1 (tasks[0] and tasks[1])".to_owned()]
    );
}

#[test]
fn unknown_and_self_dependencies() {
    let err = problems_of(
        json!({"name": "p", "tasks": [task("IMPL-1", &["IMPL-9"]), task("IMPL-2", &["IMPL-2"])]}),
    );
    assert_eq!(
        messages(&err),
        vec![
            "task IMPL-1 depends on unknown task IMPL-9".to_owned(),
            "task IMPL-2 depends on itself".to_owned(),
        ]
    );
    assert!(err.has(ProblemKind::UnknownDependency));
    assert!(err.has(ProblemKind::SelfDependency));
}

#[test]
fn cycles_report_their_path() {
    let err = problems_of(json!({"name": "p", "tasks": [
        task("IMPL-001", &["IMPL-002"]),
        task("IMPL-002", &["IMPL-001"]),
        task("IMPL-003", &["IMPL-005"]),
        task("IMPL-004", &["IMPL-003"]),
        task("IMPL-005", &["IMPL-004"]),
        task("IMPL-006", &["IMPL-001"]),
    ]}));
    assert_eq!(
        messages(&err),
        vec![
            "dependency cycle: IMPL-001 -> IMPL-002 -> IMPL-001".to_owned(),
            "dependency cycle: IMPL-003 -> IMPL-005 -> IMPL-004 -> IMPL-003".to_owned(),
        ]
    );
}

#[test]
fn unknown_roles() {
    let err = problems_of(json!({"name": "p", "tasks": [
        task("DOC-1", &[]),
        {"id": "IMPL-2", "title": "t", "role": "planner"}
    ]}));
    assert_eq!(
        err.problems
            .iter()
            .filter(|p| p.kind == ProblemKind::UnknownRole)
            .count(),
        2,
        "{err}"
    );
    assert!(messages(&err)[0].contains("DOC"), "{err}");
    assert!(messages(&err)[1].contains("planner"), "{err}");
}

#[test]
fn unknown_repo() {
    let err = problems_of(json!({"name": "p", "repos": {"app": {"path": "."}},
        "tasks": [{"id": "IMPL-1", "title": "t", "repo": "web"}]}));
    assert_eq!(
        messages(&err),
        vec!["task IMPL-1: unknown repo `web` (known: app)".to_owned()]
    );
}

#[test]
fn bad_repo_specs() {
    let err = problems_of(
        json!({"name": "p", "repos": {"a": {}, "b": {"path": "x", "template": "y"}, "c": {"template": "../t"}},
        "tasks": [task("IMPL-1", &[])]}),
    );
    assert!(err.has(ProblemKind::MissingField), "{err}");
    assert!(err.has(ProblemKind::InvalidValue), "{err}");
    assert!(err.has(ProblemKind::PathEscape), "{err}");
}

#[test]
fn repo_base_is_parsed_and_checked() {
    let plan = plan(json!({"name": "p", "repos": {"app": {"path": "r", "base": "troupe/old"}, "lib": {"path": "l"}},
        "tasks": [task("IMPL-1", &[])]}))
    .expect("valid");
    assert_eq!(
        plan.repo("app").and_then(|r| r.base.as_deref()),
        Some("troupe/old")
    );
    assert_eq!(plan.repo("lib").and_then(|r| r.base.as_deref()), None);
    let err = problems_of(
        json!({"name": "p", "repos": {"a": {"template": "t", "base": "main"}, "b": {"path": "x", "base": 3}},
        "tasks": [task("IMPL-1", &[])]}),
    );
    let text = messages(&err).join("\n");
    assert!(
        text.contains("repo `a`: `base` applies to `path` repositories"),
        "{text}"
    );
    assert!(
        text.contains("repo `b`: `base` must be a non-empty string"),
        "{text}"
    );
}

#[test]
fn paths_escaping_the_repo() {
    let err = problems_of(json!({"name": "p", "tasks": [{
        "id": "IMPL-1", "title": "t",
        "files": [{"path": "/etc/passwd"}, {"path": "a/../../b"}, {"path": "a/../b"}, {"path": "./ok"}],
        "focus_paths": ["src", "..", "C:\\x"]
    }]}));
    assert_eq!(
        messages(&err),
        vec![
            "task IMPL-1: files[0].path `/etc/passwd` escapes the repository root".to_owned(),
            "task IMPL-1: files[1].path `a/../../b` escapes the repository root".to_owned(),
            "task IMPL-1: focus_paths[1] `..` escapes the repository root".to_owned(),
            "task IMPL-1: focus_paths[2] `C:\\x` escapes the repository root".to_owned(),
        ]
    );
}

#[test]
fn bad_enum_values() {
    let err = problems_of(
        json!({"name": "p", "mode": "fast", "on_failure": "explode", "max_attempts": 0, "tasks": [{
            "id": "IMPL-1", "title": "t", "priority": "urgent", "files": [{"path": "a", "action": "rename"}]
        }]}),
    );
    let msgs = messages(&err);
    assert_eq!(msgs.len(), 5, "{err}");
    assert!(msgs.iter().all(|m| !m.is_empty()));
    assert!(
        err.problems
            .iter()
            .all(|p| p.kind == ProblemKind::InvalidValue),
        "{err}"
    );
    for needle in [
        "mode `fast`",
        "on_failure `explode`",
        "max_attempts 0",
        "priority `urgent`",
        "action `rename`",
    ] {
        assert!(
            msgs.iter().any(|m| m.contains(needle)),
            "missing {needle}: {err}"
        );
    }
}

#[test]
fn every_problem_is_collected_and_displayed_one_per_line() {
    let err = problems_of(json!({"name": "p", "tasks": [
        task("IMPL-1", &["IMPL-9"]),
        task("IMPL-1", &[]),
        task("DOC-1", &[]),
        {"id": "IMPL-3", "title": "t", "files": [{"path": "../x"}]},
    ]}));
    assert_eq!(err.problems.len(), 4, "{err}");
    assert_eq!(err.to_string().lines().count(), 4);
}

#[test]
fn waves_topological_order_and_critical_path() {
    // A diamond plus a tail and an independent task:
    // IMPL-1 -> {IMPL-2, IMPL-3} -> VALIDATE-1 -> TESTRUN-1; IMPL-4 alone.
    let plan = plan(json!({"name": "p", "mode": "waves", "tasks": [
        task("TESTRUN-1", &["VALIDATE-1"]),
        task("VALIDATE-1", &["IMPL-2", "IMPL-3"]),
        task("IMPL-3", &["IMPL-1"]),
        task("IMPL-2", &["IMPL-1"]),
        task("IMPL-1", &[]),
        task("IMPL-4", &[]),
    ]}))
    .expect("valid");
    assert_eq!(plan.mode, Mode::Waves);
    let waves = plan.waves();
    assert_eq!(waves["IMPL-1"], 1);
    assert_eq!(waves["IMPL-4"], 1);
    assert_eq!(waves["IMPL-2"], 2);
    assert_eq!(waves["IMPL-3"], 2);
    assert_eq!(waves["VALIDATE-1"], 3);
    assert_eq!(waves["TESTRUN-1"], 4);
    assert_eq!(
        plan.wave_groups(),
        vec![
            vec!["IMPL-1", "IMPL-4"],
            vec!["IMPL-3", "IMPL-2"],
            vec!["VALIDATE-1"],
            vec!["TESTRUN-1"]
        ]
    );
    let order: Vec<&str> = plan
        .topological_order()
        .iter()
        .map(|t| t.id.as_str())
        .collect();
    for task in plan.topological_order() {
        let position = order.iter().position(|id| *id == task.id).expect("present");
        for dep in &task.depends_on {
            assert!(order.iter().position(|id| id == dep).expect("dep") < position);
        }
    }
    let critical = plan.critical_paths();
    assert_eq!(critical["IMPL-1"], 4);
    assert_eq!(critical["IMPL-2"], 3);
    assert_eq!(critical["VALIDATE-1"], 2);
    assert_eq!(critical["TESTRUN-1"], 1);
    assert_eq!(critical["IMPL-4"], 1);
}

#[test]
fn estimates_weigh_the_critical_path() {
    // Two chains from IMPL-1: a long single task against two short ones. Counted in tasks the
    // short chain is longer; by estimate the long task is.
    let mut long = task("IMPL-2", &["IMPL-1"]);
    long["estimate_seconds"] = json!(600);
    let mut short = task("IMPL-3", &["IMPL-1"]);
    short["effort"] = json!("small");
    let mut tail = task("IMPL-4", &["IMPL-3"]);
    tail["estimate_seconds"] = json!(0.25);
    let plan = plan(json!({"name": "p", "tasks": [task("IMPL-1", &[]), long, short, tail]}))
        .expect("valid");
    let by_id = |id: &str| plan.task(id).expect("task").clone();
    assert_eq!(by_id("IMPL-2").estimate_ms, Some(600_000));
    assert_eq!(by_id("IMPL-3").estimate_ms, Some(300_000));
    assert_eq!(by_id("IMPL-4").estimate_ms, Some(250));
    assert_eq!(by_id("IMPL-1").estimate_ms, None);
    assert_eq!(by_id("IMPL-2").path_ms, 600_000);
    assert_eq!(by_id("IMPL-3").path_ms, 300_250);
    assert!(by_id("IMPL-2").path_ms > by_id("IMPL-3").path_ms);
    assert!(by_id("IMPL-2").critical_path < by_id("IMPL-3").critical_path);
    // IMPL-1 has no estimate: it weighs the mean of the three given ones.
    assert_eq!(
        by_id("IMPL-1").path_ms,
        (600_000 + 300_000 + 250) / 3 + 600_000
    );

    // Without any estimate every task weighs the default, so the order is the task count's.
    let plain = plan_of_chain();
    assert_eq!(
        plain.task("IMPL-1").expect("task").path_ms,
        2 * DEFAULT_ESTIMATE_MS
    );
}

#[test]
fn learned_role_durations_weigh_tasks_without_estimates() {
    // Three validators in a chain against two executors: counted in tasks (and with no
    // estimates, by the default weight) the validators' chain comes first; weighed by what
    // each role took lately, the executors' does.
    let mut chains = plan(json!({"name": "p", "tasks": [
        task("VALIDATE-1", &[]), task("VALIDATE-2", &["VALIDATE-1"]), task("VALIDATE-3", &["VALIDATE-2"]),
        task("IMPL-1", &[]), task("IMPL-2", &["IMPL-1"]),
    ]}))
    .expect("valid");
    let path = |plan: &Plan, id: &str| plan.task(id).expect("task").path_ms;
    assert!(path(&chains, "VALIDATE-1") > path(&chains, "IMPL-1"));
    chains.weigh_by_role(&HashMap::from([
        (Role::Validator, 2_000),
        (Role::Executor, 90_000),
    ]));
    assert_eq!(path(&chains, "VALIDATE-1"), 6_000);
    assert_eq!(path(&chains, "VALIDATE-3"), 2_000);
    assert_eq!(path(&chains, "IMPL-1"), 180_000);
    // A role nothing was learned for keeps the plan's weight; a task's own estimate wins.
    let mut mixed = plan_of_chain();
    let before = path(&mixed, "IMPL-1");
    mixed.weigh_by_role(&HashMap::from([(Role::TestRunner, 1)]));
    assert_eq!(path(&mixed, "IMPL-1"), before);
    let mut own = task("IMPL-1", &[]);
    own["estimate_seconds"] = json!(10);
    let mut estimated = plan(json!({"name": "p", "tasks": [own]})).expect("valid");
    estimated.weigh_by_role(&HashMap::from([(Role::Executor, 1)]));
    assert_eq!(path(&estimated, "IMPL-1"), 10_000);
}

fn plan_of_chain() -> Plan {
    plan(json!({"name": "p", "tasks": [task("IMPL-1", &[]), task("IMPL-2", &["IMPL-1"])]}))
        .expect("valid")
}

#[test]
fn bad_estimates_are_refused_together() {
    let mut negative = task("IMPL-1", &[]);
    negative["estimate_seconds"] = json!(-3);
    let mut text = task("IMPL-2", &[]);
    text["estimate_seconds"] = json!("10m");
    let mut effort = task("IMPL-3", &[]);
    effort["effort"] = json!("huge");
    let err = problems_of(json!({"name": "p", "tasks": [negative, text, effort]}));
    let messages = messages(&err);
    assert_eq!(messages.len(), 3, "{messages:?}");
    assert!(
        messages[0].contains("invalid estimate_seconds -3"),
        "{messages:?}"
    );
    assert!(
        messages[1].contains("invalid estimate_seconds \"10m\""),
        "{messages:?}"
    );
    assert!(
        messages[2].contains("invalid effort \"huge\" (expected small, medium or large)"),
        "{messages:?}"
    );
}

#[test]
fn wave_is_longest_path_not_shortest() {
    let plan = plan(json!({"name": "p", "tasks": [
        task("IMPL-1", &[]), task("IMPL-2", &["IMPL-1"]), task("IMPL-3", &["IMPL-1", "IMPL-2"])
    ]}))
    .expect("valid");
    assert_eq!(plan.waves()["IMPL-3"], 3);
    assert_eq!(plan.critical_paths()["IMPL-1"], 3);
}

#[test]
fn escape_check() {
    use crate::validate::escapes_root;
    assert!(!escapes_root("src/a.py"));
    assert!(!escapes_root("./a/./b/../c"));
    assert!(!escapes_root("a/.."));
    assert!(escapes_root("a/../.."));
    assert!(escapes_root("/abs"));
    assert!(escapes_root("..\\x"));
}

#[test]
fn priority_and_file_action_parsing() {
    assert_eq!(Priority::parse("P0"), Some(Priority::P0));
    assert_eq!(Priority::parse("high"), Some(Priority::P0));
    assert_eq!(Priority::parse("Medium"), Some(Priority::P1));
    assert_eq!(Priority::parse("low"), Some(Priority::P2));
    assert_eq!(Priority::parse("P3"), None);
    assert_eq!(FileAction::parse("Delete"), Some(FileAction::Delete));
    assert_eq!(
        FileSpec {
            path: "a".into(),
            action: FileAction::Create,
            change: String::new()
        }
        .to_proto()
        .action,
        troupe_proto::v1::FileAction::Create as i32
    );
}

#[test]
fn url_repositories_and_read_only_access() {
    let plan = plan(json!({"name": "p", "repos": {
            "app": {"url": "https://git.example.com/t/app.git"},
            "contract": {"url": "git://h/contract.git", "access": "read"}},
        "tasks": [task("IMPL-1", &[]),
            {"id": "VALIDATE-1", "title": "v", "repo": "contract", "depends_on": ["IMPL-1"]}]}))
    .expect("valid");
    let app = plan.repo("app").expect("app");
    assert_eq!(
        app.source,
        RepoSource::Url("https://git.example.com/t/app.git".to_owned())
    );
    assert_eq!(app.access, Access::Write);
    assert_eq!(plan.repo("contract").map(|r| r.access), Some(Access::Read));

    // Every problem at once: a password, a scheme, two sources, and work in a read-only repo.
    let err = problems_of(json!({"name": "p", "repos": {
            "a": {"url": "https://me:secret@h/a.git"},
            "b": {"url": "ftp://h/b.git"},
            "c": {"url": "git://h/c.git", "path": "c"},
            "d": {"path": "d", "access": "read"}},
        "tasks": [task("IMPL-1", &[]), {"id": "IMPL-2", "title": "x", "repo": "d"},
            {"id": "TESTRUN-1", "title": "t", "repo": "d"}]}));
    let text = messages(&err).join("\n");
    for expected in [
        "repo `a`: `url` must not carry a password",
        "repo `b`: `url` `ftp` must start with",
        "repo `c`: set one of `path`, `url` and `template`",
        "task IMPL-2: repo `d` is read-only",
        "task TESTRUN-1: repo `d` is read-only",
    ] {
        assert!(text.contains(expected), "{expected:?} not in:\n{text}");
    }
    assert!(!text.contains("secret"), "{text}");
}

#[test]
fn a_summary_lists_the_first_problems_and_counts_the_rest() {
    let tasks: Vec<_> = (0..100_003)
        .map(|i| json!({"id": format!("IMPL-{i}")}))
        .collect();
    let err = problems_of(json!({"name": "big", "tasks": tasks}));
    assert!(err.problems.len() >= 100_003, "{}", err.problems.len());
    let summary = err.summary(50);
    let lines: Vec<&str> = summary.lines().collect();
    assert_eq!(lines.len(), 51, "{summary}");
    assert_eq!(lines[0], err.problems[0].message);
    assert_eq!(
        lines[50],
        format!("… and {} more", thousands(err.problems.len() - 50))
    );
    assert!(summary.len() < 8 * 1024, "{} bytes", summary.len());
    assert_eq!(thousands(99_950), "99,950");
    assert_eq!(thousands(1_000_000), "1,000,000");
    assert_eq!(thousands(999), "999");
}
