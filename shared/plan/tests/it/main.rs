//! Integration tests of troupe-plan: `plan.schema.json` agrees with [`Plan::from_json`] on the
//! repository's plans (examples, the sample in docs/plans.md, imported CCW fixtures) and on plans
//! both must refuse.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use troupe_plan::Plan;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn workspace_root() -> PathBuf {
    crate_dir()
        .parent()
        .and_then(Path::parent)
        .expect("shared/plan sits two levels below the workspace root")
        .to_path_buf()
}

fn schema() -> Value {
    let text = std::fs::read_to_string(crate_dir().join("plan.schema.json")).expect("schema file");
    serde_json::from_str(&text).expect("schema is json")
}

fn validator() -> jsonschema::Validator {
    jsonschema::validator_for(&schema()).expect("schema compiles")
}

/// Schema errors of `plan`, one line each.
fn schema_errors(validator: &jsonschema::Validator, plan: &Value) -> Vec<String> {
    validator
        .iter_errors(plan)
        .map(|error| format!("{}: {error}", error.instance_path()))
        .collect()
}

/// Every `plan.json` under `dir`, recursively.
fn plan_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            plan_files(&path, out);
        } else if path.file_name().is_some_and(|name| name == "plan.json") {
            out.push(path);
        }
    }
}

fn assert_accepted(validator: &jsonschema::Validator, what: &str, plan: &Value) {
    let errors = schema_errors(validator, plan);
    assert!(errors.is_empty(), "{what}: schema refused it:\n{errors:#?}");
    if let Err(err) = Plan::from_json(&plan.to_string()) {
        panic!("{what}: the parser refused it:\n{err}");
    }
}

#[test]
fn the_schema_is_a_valid_draft_2020_12_schema() {
    let schema = schema();
    assert_eq!(
        schema["$schema"],
        "https://json-schema.org/draft/2020-12/schema"
    );
    if let Err(err) = jsonschema::meta::validate(&schema) {
        panic!("plan.schema.json is not a valid schema: {err}");
    }
}

#[test]
fn every_example_plan_validates() {
    let validator = validator();
    let mut files = Vec::new();
    plan_files(&workspace_root().join("examples"), &mut files);
    assert!(
        !files.is_empty(),
        "no examples/**/plan.json found under {}",
        workspace_root().display()
    );
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read plan");
        let plan: Value = serde_json::from_str(&text).expect("example is json");
        assert_accepted(&validator, &file.display().to_string(), &plan);
    }
}

#[test]
fn the_plan_format_pages_sample_plan_validates() {
    let page =
        std::fs::read_to_string(workspace_root().join("docs/plans.md")).expect("docs/plans.md");
    let block = page
        .split("```json\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("docs/plans.md starts with a json block");
    // The sample elides text with `…`, which is still valid JSON inside strings.
    let plan: Value = serde_json::from_str(block).expect("the docs/plans.md sample is json");
    assert_accepted(&validator(), "docs/plans.md sample", &plan);
}

#[test]
fn imported_ccw_fixtures_validate() {
    let validator = validator();
    let fixtures = crate_dir().join("tests/fixtures/ccw");
    let mut imported = 0;
    for entry in std::fs::read_dir(&fixtures).expect("fixtures").flatten() {
        let document = troupe_plan::ccw::import_session(&entry.path())
            .unwrap_or_else(|err| panic!("{} imports: {err}", entry.path().display()));
        assert_accepted(&validator, &entry.path().display().to_string(), &document);
        imported += 1;
    }
    assert!(imported >= 2, "only {imported} fixtures");
}

#[test]
fn plans_using_every_field_validate() {
    let validator = validator();
    let plans = [
        json!({"name": "minimal", "tasks": [{"id": "IMPL-1", "title": "one"}]}),
        json!({
            "$schema": "../../shared/plan/plan.schema.json",
            "name": "full-1", "description": "all fields", "mode": "waves", "on_failure": "block",
            "max_attempts": 3,
            "repos": {"app": {"path": "repo", "base": "main"}, "lib": {"template": "sample"},
                      "contract": {"url": "https://git.example.com/t/api.git", "base": "v1", "access": "read"},
                      "web": {"url": "git://127.0.0.1:9418/web.git", "access": "write"}},
            "tasks": [
                {"id": "IMPL-1", "title": "a", "description": "d", "priority": "critical",
                 "repo": "lib", "files": [{"path": "src/a.py", "action": "CREATE", "change": "new"}],
                 "focus_paths": ["src"], "max_attempts": 1, "timeout_seconds": 60, "estimate_seconds": 90.5,
                 "convergence": {"criteria": ["works"], "verification": "pytest -q && echo ok"},
                 "agent": {"backend": "command", "command": ["python3", "{plan_dir}/a.py"]},
                 "status": "completed", "extra": {"kept": true}},
                {"id": "build", "title": "b", "role": "validator", "depends_on": ["IMPL-1"],
                 "priority": "p2", "effort": "Medium", "convergence": {"verification": ["make", "check"]}},
                {"id": "QARUN-1", "title": "c", "depends_on": ["build"],
                 "test": {"framework": "pytest", "coverage_target": 80}},
                {"id": "x-1", "title": "d", "role": "test-runner", "priority": null,
                 "depends_on": null, "files": null, "repo": null},
            ]
        }),
    ];
    for plan in &plans {
        assert_accepted(&validator, &plan["name"].to_string(), plan);
    }
}

#[test]
fn malformed_plans_are_refused_by_schema_and_parser() {
    let validator = validator();
    let task = json!({"id": "IMPL-1", "title": "one"});
    let cases = [
        ("not an object", json!(["IMPL-1"])),
        ("no name", json!({"tasks": [task]})),
        ("bad name", json!({"name": "Quick Start", "tasks": [task]})),
        ("no tasks", json!({"name": "p"})),
        ("empty tasks", json!({"name": "p", "tasks": []})),
        (
            "tasks not an array",
            json!({"name": "p", "tasks": {"IMPL-1": {}}}),
        ),
        (
            "bad mode",
            json!({"name": "p", "mode": "fast", "tasks": [task]}),
        ),
        (
            "bad on_failure",
            json!({"name": "p", "on_failure": "explode", "tasks": [task]}),
        ),
        (
            "zero attempts",
            json!({"name": "p", "max_attempts": 0, "tasks": [task]}),
        ),
        (
            "empty repos",
            json!({"name": "p", "repos": {}, "tasks": [task]}),
        ),
        (
            "path and template",
            json!({"name": "p", "repos": {"a": {"path": "x", "template": "y"}}, "tasks": [task]}),
        ),
        (
            "repo without source",
            json!({"name": "p", "repos": {"a": {}}, "tasks": [task]}),
        ),
        (
            "absolute template",
            json!({"name": "p", "repos": {"a": {"template": "/etc"}}, "tasks": [task]}),
        ),
        (
            "url and path",
            json!({"name": "p", "repos": {"a": {"url": "git://h/a.git", "path": "x"}}, "tasks": [task]}),
        ),
        (
            "unsupported scheme",
            json!({"name": "p", "repos": {"a": {"url": "ftp://h/a.git"}}, "tasks": [task]}),
        ),
        (
            "password in the url",
            json!({"name": "p", "repos": {"a": {"url": "https://me:secret@h/a.git"}}, "tasks": [task]}),
        ),
        (
            "bad access",
            json!({"name": "p", "repos": {"a": {"path": "x", "access": "admin"}}, "tasks": [task]}),
        ),
        (
            "read-only template",
            json!({"name": "p", "repos": {"a": {"template": "t", "access": "read"}}, "tasks": [task]}),
        ),
        (
            "base on a template",
            json!({"name": "p", "repos": {"a": {"template": "t", "base": "main"}}, "tasks": [task]}),
        ),
        (
            "task without id",
            json!({"name": "p", "tasks": [{"title": "x"}]}),
        ),
        (
            "task without title",
            json!({"name": "p", "tasks": [{"id": "IMPL-1"}]}),
        ),
        (
            "blank title",
            json!({"name": "p", "tasks": [{"id": "IMPL-1", "title": "  "}]}),
        ),
        (
            "no role",
            json!({"name": "p", "tasks": [{"id": "PLAN-1", "title": "x"}]}),
        ),
        (
            "unknown role",
            json!({"name": "p", "tasks": [{"id": "IMPL-1", "title": "x", "role": "planner"}]}),
        ),
        (
            "bad priority",
            json!({"name": "p", "tasks": [{"id": "IMPL-1", "title": "x", "priority": "urgent"}]}),
        ),
        (
            "depends_on not strings",
            json!({"name": "p", "tasks": [{"id": "IMPL-1", "title": "x", "depends_on": [1]}]}),
        ),
        (
            "file without path",
            json!({"name": "p", "tasks": [{"id": "IMPL-1", "title": "x", "files": [{"action": "create"}]}]}),
        ),
        (
            "absolute file path",
            json!({"name": "p", "tasks": [{"id": "IMPL-1", "title": "x", "files": [{"path": "/etc/passwd"}]}]}),
        ),
        (
            "bad file action",
            json!({"name": "p", "tasks": [{"id": "IMPL-1", "title": "x", "files": [{"path": "a", "action": "rename"}]}]}),
        ),
        (
            "empty verification argv",
            json!({"name": "p", "tasks": [{"id": "IMPL-1", "title": "x", "convergence": {"verification": []}}]}),
        ),
        (
            "zero estimate",
            json!({"name": "p", "tasks": [{"id": "IMPL-1", "title": "x", "estimate_seconds": 0}]}),
        ),
        (
            "unknown effort",
            json!({"name": "p", "tasks": [{"id": "IMPL-1", "title": "x", "effort": "huge"}]}),
        ),
        (
            "zero timeout",
            json!({"name": "p", "tasks": [{"id": "IMPL-1", "title": "x", "timeout_seconds": 0}]}),
        ),
    ];
    for (what, plan) in &cases {
        assert!(
            !schema_errors(&validator, plan).is_empty(),
            "{what}: the schema accepted {plan}"
        );
        assert!(
            Plan::from_json(&plan.to_string()).is_err(),
            "{what}: the parser accepted {plan}"
        );
    }
}
