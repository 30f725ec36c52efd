use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use super::*;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/ccw")
        .join(name)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// A writable copy of a fixture folder.
fn copy_of(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture(name), dir.path());
    dir
}

fn edit(path: &Path, change: impl FnOnce(&mut Value)) {
    let mut value: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    change(&mut value);
    std::fs::write(path, serde_json::to_string_pretty(&value).unwrap()).unwrap();
}

fn task<'a>(document: &'a Value, id: &str) -> &'a Value {
    document["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|task| task["id"] == id)
        .unwrap_or_else(|| panic!("no task {id} in {document:#}"))
}

fn messages(err: &PlanError) -> Vec<String> {
    err.problems.iter().map(|p| p.message.clone()).collect()
}

#[test]
fn imports_a_producer_shaped_session() {
    let document = import_session(&fixture("lifecycle")).expect("fixture imports");
    let plan = Plan::from_json(&document.to_string()).expect("a valid plan");
    assert_eq!(plan.name, "tc-auth-refresh");
    assert_eq!(
        plan.description,
        "Implement refresh-token rotation and cover it with tests"
    );
    let ids: Vec<&str> = plan.tasks.iter().map(|task| task.id.as_str()).collect();
    assert_eq!(ids, ["IMPL-001", "IMPL-002", "TEST-001", "REVIEW-001"]);

    // The planner has no troupe service but already finished: kept aside, and no longer a
    // dependency of IMPL-001.
    let elsewhere = document["ccw"]["completed_elsewhere"].as_array().unwrap();
    assert_eq!(elsewhere.len(), 1);
    assert_eq!(elsewhere[0]["id"], "PLAN-001");
    assert_eq!(
        plan.task("IMPL-001").unwrap().depends_on,
        Vec::<String>::new()
    );

    // Roles through prefixes; TEST is CCW's tester, which troupe's test-runner does.
    assert_eq!(plan.task("IMPL-002").unwrap().role, Role::Executor);
    assert_eq!(plan.task("TEST-001").unwrap().role, Role::TestRunner);
    assert_eq!(plan.task("REVIEW-001").unwrap().role, Role::Validator);
    let test = task(&document, "TEST-001");
    // The prefix implies the role, so the spec stays as written.
    assert_eq!(test["role"], Value::Null);
    assert_eq!(test["ccw_role"], "tester");
    assert_eq!(test["title"], "Replay test");
    assert_eq!(test["convergence"]["criteria"], json!(["suite green"]));
    assert_eq!(test["depends_on"], json!(["IMPL-002"]));
    // A task whose id prefix already names its role gets no `role` written.
    assert!(task(&document, "IMPL-002").get("role").is_none());

    // Completed from completed_tasks; an interrupted task's runtime status is dropped.
    assert_eq!(task(&document, "IMPL-001")["status"], "completed");
    assert!(task(&document, "IMPL-002").get("status").is_none());

    // Every task JSON field is kept, with on_error normalised.
    let impl2 = task(&document, "IMPL-002");
    for field in [
        "type",
        "action",
        "scope",
        "implementation",
        "reference",
        "rationale",
        "risks",
        "meta",
        "cli_execution",
    ] {
        assert!(impl2.get(field).is_some(), "IMPL-002 lost `{field}`");
    }
    assert_eq!(impl2["pre_analysis"][0]["on_error"], "fail");
    assert_eq!(impl2["pre_analysis"][1]["on_error"], "skip");
    assert_eq!(
        plan.task("IMPL-002").unwrap().priority,
        crate::Priority::P0,
        "high maps to P0"
    );
    assert_eq!(
        task(&document, "IMPL-001")["result"]["commit_hash"],
        "4f1c2e9"
    );

    // CCW-level data stays with the plan.
    let ccw = &document["ccw"];
    assert_eq!(ccw["session_id"], "TC-auth-refresh-2026-03-01");
    assert_eq!(ccw["plan"]["recommended_execution"], "Sequential");
    assert_eq!(ccw["plan"]["complexity"], "Medium");
    assert_eq!(ccw["task_analysis"]["complexity"]["level"], "medium");
    assert_eq!(
        ccw["task_analysis"]["dependency_graph"]["TEST-001"],
        json!({"depends_on": ["IMPL-002"]})
    );
}

#[test]
fn imports_an_executor_shaped_session_with_phases() {
    let document = import_session(&fixture("roadmap")).expect("fixture imports");
    let plan = Plan::from_json(&document.to_string()).expect("a valid plan");
    assert_eq!(plan.name, "roadmap-auth-api");
    let ids: Vec<&str> = plan.tasks.iter().map(|task| task.id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "IMPL-101",
            "IMPL-201",
            "IMPL-202",
            "TESTRUN-201",
            "VERIFY-201"
        ]
    );
    assert_eq!(task(&document, "IMPL-101")["status"], "completed");
    assert_eq!(task(&document, "IMPL-101")["phase"], 1);
    assert_eq!(task(&document, "IMPL-202")["phase"], 2);
    assert_eq!(
        task(&document, "IMPL-201")["pre_analysis"][0]["on_error"],
        "skip"
    );
    // Graph-only tasks get their role from the graph node's role (qa → TESTRUN prefix).
    assert_eq!(plan.task("TESTRUN-201").unwrap().role, Role::TestRunner);
    assert_eq!(task(&document, "TESTRUN-201")["ccw_role"], "qa");
    assert_eq!(plan.task("VERIFY-201").unwrap().role, Role::Validator);
    assert_eq!(
        plan.task("VERIFY-201").unwrap().depends_on,
        vec!["IMPL-202".to_owned()]
    );
    assert_eq!(document["ccw"]["plan"]["recommended_execution"], "Phased");
    assert_eq!(document["ccw"]["task_analysis"]["complexity_score"], 6);
    assert_eq!(document["ccw"]["status"], "paused");
}

#[test]
fn missing_required_fields_are_all_reported() {
    let dir = copy_of("lifecycle");
    edit(&dir.path().join("team-session.json"), |session| {
        let object = session.as_object_mut().unwrap();
        object.remove("session_id");
        object.insert("status".into(), json!("running"));
        object["roles"][1]
            .as_object_mut()
            .unwrap()
            .remove("role_spec");
    });
    edit(&dir.path().join("task-analysis.json"), |analysis| {
        analysis.as_object_mut().unwrap().remove("dependency_graph");
        analysis["roles"] = json!([]);
    });
    let err = import_session(dir.path()).expect_err("refused");
    let text = messages(&err).join("\n");
    for expected in [
        "team-session.json: missing required field `session_id`",
        "team-session.json: invalid status `running` (expected active, paused or completed)",
        "team-session.json: roles[1]: missing required field `role_spec`",
        "task-analysis.json: missing required field `dependency_graph`",
        "task-analysis.json: `roles` is empty",
    ] {
        assert!(text.contains(expected), "missing `{expected}` in:\n{text}");
    }
    assert!(text.contains("re-run team-coordinate"), "{text}");
    assert!(err.has(ProblemKind::MissingField));
    assert!(err.has(ProblemKind::InvalidValue));
}

#[test]
fn a_missing_session_file_is_named() {
    let dir = copy_of("roadmap");
    std::fs::remove_file(dir.path().join("team-session.json")).unwrap();
    let err = import_session(dir.path()).expect_err("refused");
    assert!(
        messages(&err)[0].starts_with("team-session.json: not found at"),
        "{err}"
    );
}

#[test]
fn a_cycle_is_reported_with_its_path() {
    let dir = copy_of("roadmap");
    edit(&dir.path().join("phase-1/.task/IMPL-101.json"), |task| {
        task["depends_on"] = json!(["IMPL-202"])
    });
    let err = import_session(dir.path()).expect_err("refused");
    assert!(err.has(ProblemKind::Cycle), "{err}");
    let cycle = messages(&err)
        .into_iter()
        .find(|message| message.starts_with("dependency cycle"))
        .unwrap();
    for id in ["IMPL-101", "IMPL-201", "IMPL-202"] {
        assert!(cycle.contains(id), "{cycle}");
    }
}

#[test]
fn an_unknown_role_is_reported_with_the_other_problems() {
    let dir = copy_of("lifecycle");
    edit(&dir.path().join("team-session.json"), |session| {
        session["roles"].as_array_mut().unwrap().push(json!(
            {"name": "designer", "prefix": "DESIGN", "role_spec": "role-specs/designer.md"}
        ));
        session["pipeline"]["dependency_graph"]["DESIGN-001"] = json!(["IMPL-002"]);
        // Unknown dependency at the same time.
        session["pipeline"]["dependency_graph"]["REVIEW-001"] = json!(["IMPL-009"]);
    });
    edit(&dir.path().join("task-analysis.json"), |analysis| {
        analysis["dependency_graph"]["DESIGN-001"] = json!({"depends_on": [], "role": "designer"});
    });
    let err = import_session(dir.path()).expect_err("refused");
    let text = messages(&err).join("\n");
    assert!(
        text.contains("task DESIGN-001: unknown role: CCW role `designer` (prefix DESIGN) has no troupe service"),
        "{text}"
    );
    assert!(
        text.contains("task REVIEW-001 depends on unknown task IMPL-009"),
        "{text}"
    );
    assert!(err.has(ProblemKind::UnknownRole));
    assert!(err.has(ProblemKind::UnknownDependency));
}

#[test]
fn broken_task_files_and_duplicates_are_reported() {
    let dir = copy_of("roadmap");
    std::fs::write(dir.path().join("phase-2/.task/IMPL-203.json"), "{\"id\": ").unwrap();
    std::fs::copy(
        dir.path().join("phase-1/.task/IMPL-101.json"),
        dir.path().join("phase-2/.task/IMPL-101-copy.json"),
    )
    .unwrap();
    edit(&dir.path().join("team-session.json"), |session| {
        session["completed_tasks"] = json!(["IMPL-101", "IMPL-999"]);
    });
    let err = import_session(dir.path()).expect_err("refused");
    let text = messages(&err).join("\n");
    assert!(
        text.contains("phase-2/.task/IMPL-203.json: malformed json"),
        "{text}"
    );
    assert!(
        text.contains("duplicate task id IMPL-101 (phase-1/.task/IMPL-101.json and phase-2/.task/IMPL-101-copy.json)"),
        "{text}"
    );
    assert!(
        text.contains(
            "completed_tasks lists IMPL-999, which no task file or dependency graph defines"
        ),
        "{text}"
    );
}

#[test]
fn prefixes_map_to_roles() {
    for (prefix, role) in [
        ("IMPL", Some(Role::Executor)),
        ("exec", Some(Role::Executor)),
        ("TEST", Some(Role::TestRunner)),
        ("TESTRUN", Some(Role::TestRunner)),
        ("REVIEW", Some(Role::Validator)),
        ("VERIFY", Some(Role::Validator)),
        ("VALIDATE", Some(Role::Validator)),
        ("PLAN", None),
    ] {
        assert_eq!(
            TaskKind::from_prefix(prefix).map(TaskKind::role),
            role,
            "{prefix}"
        );
    }
    assert_eq!(plan_name("TC auth/Refresh 2026"), "tc-auth-refresh-2026");
    assert_eq!(plan_name("???"), "ccw-import");
}

#[test]
fn troupe_repos_keep_their_default() {
    let dir = copy_of("roadmap");
    edit(&dir.path().join("team-session.json"), |session| {
        session["troupe"] = json!({
            "plan_name": "auth-api",
            "mode": "waves",
            "on_failure": "block",
            "max_attempts": 3,
            "repos": [{"name": "web", "path": "/srv/web"}, {"name": "api", "path": "/srv/api"}],
        });
    });
    let document = import_session(dir.path()).expect("imports");
    let plan = Plan::from_json(&document.to_string()).expect("a valid plan");
    assert_eq!(plan.name, "auth-api");
    assert_eq!(plan.mode, crate::Mode::Waves);
    assert_eq!(plan.on_failure, crate::OnFailure::Block);
    assert_eq!(plan.max_attempts, 3);
    assert_eq!(plan.repos.len(), 2);
    // `web` came first, so every task that named no repository still works in `web`.
    assert!(plan.tasks.iter().all(|task| task.repo == "web"), "{plan:?}");
}

#[test]
fn exported_urls_and_read_only_access_come_back() {
    let dir = copy_of("roadmap");
    edit(&dir.path().join("team-session.json"), |session| {
        session["troupe"] = json!({
            "repos": [{"name": "web", "url": "https://git.example.com/t/web.git"},
                      {"name": "spec", "url": "git://h/spec.git", "access": "read"}],
        });
    });
    let document = import_session(dir.path()).expect("imports");
    assert_eq!(
        document["repos"]["web"],
        json!({"url": "https://git.example.com/t/web.git"})
    );
    assert_eq!(
        document["repos"]["spec"],
        json!({"url": "git://h/spec.git", "access": "read"})
    );
    let plan = Plan::from_json(&document.to_string()).expect("a valid plan");
    assert_eq!(
        plan.repo("spec").map(|r| r.access),
        Some(crate::Access::Read)
    );
}

#[test]
fn exported_session_branches_become_repo_bases() {
    let dir = copy_of("roadmap");
    edit(&dir.path().join("team-session.json"), |session| {
        session["troupe"] = json!({
            "repos": [{"name": "web", "path": "/srv/web"}, {"name": "api", "path": "/srv/api"}],
            "commits": [
                {"repo": "web", "branch": "troupe/auth-20261121-abcdef", "base_commit": "1234"},
                {"repo": "api", "branch": "", "base_commit": "5678"},
            ],
        });
    });
    let document = import_session(dir.path()).expect("imports");
    assert_eq!(
        document["repos"]["web"],
        json!({"path": "/srv/web", "base": "troupe/auth-20261121-abcdef"})
    );
    assert_eq!(document["repos"]["api"], json!({"path": "/srv/api"}));
    let plan = Plan::from_json(&document.to_string()).expect("a valid plan");
    assert_eq!(
        plan.repo("web").and_then(|repo| repo.base.as_deref()),
        Some("troupe/auth-20261121-abcdef")
    );
}

#[test]
fn the_project_of_a_ccw_session_folder_is_found() {
    assert_eq!(
        project_root(Path::new("/src/app/.workflow/.team/TC-x-2026-03-01")),
        Some(PathBuf::from("/src/app"))
    );
    assert_eq!(project_root(Path::new("/tmp/export")), None);
    assert_eq!(project_root(Path::new("/src/.team/TC-x")), None);
}

#[test]
fn specs_without_dependencies_stay_as_written() {
    let dir = copy_of("roadmap");
    edit(&dir.path().join("phase-1/.task/IMPL-101.json"), |task| {
        task.as_object_mut().unwrap().remove("depends_on");
    });
    edit(&dir.path().join("phase-2/.task/IMPL-201.json"), |task| {
        task.as_object_mut().unwrap().remove("depends_on");
    });
    let document = import_session(dir.path()).expect("imports");
    assert!(task(&document, "IMPL-101").get("depends_on").is_none());
    // The graph still supplies IMPL-201's dependency.
    assert_eq!(
        task(&document, "IMPL-201")["depends_on"],
        json!(["IMPL-101"])
    );
}
