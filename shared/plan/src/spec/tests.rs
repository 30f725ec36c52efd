use serde_json::{Value, json};

use super::*;
use crate::Plan;

fn refused(tasks: Value) -> Vec<String> {
    let text = json!({"name": "p", "tasks": tasks}).to_string();
    Plan::from_json(&text)
        .expect_err("plan should be refused")
        .problems
        .into_iter()
        .map(|problem| problem.message)
        .collect()
}

fn assert_listed(messages: &[String], expected: &[&str]) {
    for needle in expected {
        assert!(
            messages.iter().any(|message| message.contains(needle)),
            "{needle:?} not listed in {messages:#?}"
        );
    }
}

#[test]
fn every_bad_block_of_every_task_is_listed_with_its_path() {
    let messages = refused(json!([
        {"id": "IMPL-1", "title": "a",
         "agent": {"backend": "nonesuch", "env": {"K": 1}, "command": [], "timeout_seconds": -3},
         "convergence": {"criteria": "one", "verification": []},
         "pre_analysis": [{"step": "s"}], "scope_policy": "maybe", "allow_empty": "yes"},
        {"id": "IMPL-2", "title": "b", "agent": {"backend": "command"}},
        {"id": "IMPL-3", "title": "c", "agent": {"backend": "codex", "env": {"K": "v"}, "command": "make && make install"}},
        {"id": "TESTRUN-1", "title": "d",
         "test": {"framework": "mocha", "coverage_target": 120, "env": {"PATH": "/evil"},
                  "setup": [[]], "workdir": "../up", "timeout_seconds": 0,
                  "fix": {"agent": {"backend": "command"}, "max_iterations": 50, "scope": "all"},
                  "gc": {"max_rounds": 0}}},
        {"id": "VALIDATE-1", "title": "e",
         "judge": {"backend": "claude", "endpoint": "http://evil", "model": "m"},
         "gap_closure": {"agent": {"backend": "qwen", "idle_timeout_seconds": "soon"}, "focus_paths": "src"}},
        {"id": "VALIDATE-2", "title": "f", "judge": {"command": []}, "test": {"gc": {"agent": {"command": ["fix"]}}}},
        {"id": "VALIDATE-3", "title": "g", "judge": {"backend": "codex", "max_turns": "many"}}
    ]));
    assert_listed(
        &messages,
        &[
            "task IMPL-1: `agent.backend` names unknown backend `nonesuch`",
            "task IMPL-1: `agent.env.K` must be a string, got a number",
            "task IMPL-1: `agent.command` is empty",
            "task IMPL-1: `agent.timeout_seconds` must be a positive number",
            "task IMPL-1: `convergence.criteria` must be an array of strings",
            "task IMPL-1: `convergence.verification` is empty",
            "task IMPL-1: `pre_analysis[0]` (step `s`) has no command",
            "task IMPL-1: `scope_policy` must be \"warn\" or \"refuse\"",
            "task IMPL-1: `allow_empty` must be true or false",
            "task IMPL-2: `agent.command` is missing",
            "task IMPL-3: `agent.env` is given to the `command` backend only",
            "task IMPL-3: `agent.command` uses shell syntax",
            "task TESTRUN-1: `test.framework` `mocha` is not one of",
            "task TESTRUN-1: `test.coverage_target` must be a number from 0 to 100",
            "task TESTRUN-1: `test.env.PATH` is not a variable a suite may get",
            "task TESTRUN-1: `test.setup[0]` is empty",
            "task TESTRUN-1: `test.workdir` `../up` must be a path inside the repository",
            "task TESTRUN-1: `test.timeout_seconds` must be a whole number from 1",
            "task TESTRUN-1: `test.fix.agent.command` is missing",
            "task TESTRUN-1: `test.fix.max_iterations` must be a whole number from 1 to 20",
            "task TESTRUN-1: `test.fix.scope` `all` is not one of tests, source, both",
            "task TESTRUN-1: `test.gc.agent` is missing",
            "task TESTRUN-1: `test.gc.max_rounds` must be a whole number from 1 to 100",
            "task VALIDATE-1: `judge.endpoint` is not a judge setting a plan may give",
            "task VALIDATE-1: `gap_closure.agent.idle_timeout_seconds` must be a positive number",
            "task VALIDATE-1: `gap_closure.focus_paths` must be an array of strings",
            "task VALIDATE-2: `judge.command` is empty",
            "task VALIDATE-2: `test.gc` needs a test-runner task",
            "task VALIDATE-3: `judge` has a bad setting",
        ],
    );
    assert_eq!(messages.len(), 29, "one problem each: {messages:#?}");
}

#[test]
fn good_blocks_are_typed() {
    let plan = Plan::from_json(
        &json!({"name": "p", "tasks": [
            {"id": "IMPL-1", "title": "a",
             "agent": {"backend": "Command", "command": "python3 agent.py '{worktree}'", "env": {"K": "v"}, "timeout_seconds": 1.5},
             "convergence": {"criteria": ["c"], "verification": "make && make test"},
             "scope": "refuse", "pre_analysis": [{"step": "s", "command": "Read(a.py)", "output_to": "a", "on_error": "skip_optional"}]},
            {"id": "TESTRUN-1", "title": "b",
             "test": {"framework": "pytest", "env": {"TZ": "UTC", "TEST_N": 3}, "setup": [["make"]],
                      "fix": {"agent": {"command": ["fix"]}, "scope": "both"},
                      "gc": {"agent": {"backend": "codex"}, "max_rounds": 2, "files": [{"path": "a.py"}]}}},
            {"id": "VALIDATE-1", "title": "c", "judge": ["judge", "{criterion}"]},
            {"id": "VALIDATE-2", "title": "d", "judge": {"backend": "claude", "model": "opus", "max_turns": 3}}
        ]})
        .to_string(),
    )
    .expect("valid plan");
    let blocks = |id: &str| &plan.task(id).expect("task").blocks;
    let agent = blocks("IMPL-1").agent.as_ref().expect("agent");
    assert_eq!(agent.chosen_backend(), Some("command"));
    assert_eq!(
        agent.command.as_deref(),
        Some(
            &[
                "python3".to_owned(),
                "agent.py".to_owned(),
                "{worktree}".to_owned()
            ][..]
        )
    );
    assert_eq!(
        blocks("IMPL-1").convergence.verification.as_deref(),
        Some(
            &[
                "sh".to_owned(),
                "-c".to_owned(),
                "make && make test".to_owned()
            ][..]
        )
    );
    assert_eq!(blocks("IMPL-1").scope_policy, ScopePolicy::Refuse);
    assert_eq!(blocks("IMPL-1").pre_analysis[0].on_error, OnError::Skip);
    let test = blocks("TESTRUN-1").test.as_ref().expect("test");
    assert_eq!(test.framework, TestFramework::Pytest);
    assert_eq!(test.env.get("TEST_N").map(String::as_str), Some("3"));
    let fix = test.fix.as_ref().expect("fix");
    assert_eq!(fix.agent.backend.as_deref(), Some(COMMAND_BACKEND));
    assert_eq!(fix.scope, FixScope::Both);
    assert_eq!(test.gc.as_ref().and_then(|gc| gc.max_rounds), Some(2));
    assert!(matches!(
        blocks("VALIDATE-1").judge,
        Some(JudgeSpec::Command { ref argv, timeout: None }) if argv == &["judge", "{criterion}"]
    ));
    let Some(JudgeSpec::Backend { backend, settings }) = &blocks("VALIDATE-2").judge else {
        panic!("a backend judge");
    };
    assert_eq!(backend, "claude");
    assert_eq!(settings.max_turns, Some(3));
}

#[test]
fn a_worker_reads_a_claimed_spec_by_the_same_rules() {
    let spec = json!({"id": "FIX-1", "agent": {"env": {"K": 1}}});
    let err =
        crate::TaskSpec::from_object(spec.as_object().expect("object"), None).expect_err("refused");
    assert_eq!(
        err.to_string(),
        "task FIX-1: `agent.env.K` must be a string, got a number"
    );
}

#[test]
fn a_plan_level_sandbox_reaches_each_task_that_sets_none() {
    let text = json!({"name": "p", "sandbox": "enforce", "tasks": [
        {"id": "IMPL-1", "title": "a"},
        {"id": "IMPL-2", "title": "b", "sandbox": "warn"},
    ]})
    .to_string();
    let plan = Plan::from_json(&text).expect("valid plan");
    assert_eq!(plan.sandbox, Some(SandboxMode::Enforce));
    let task = |id: &str| plan.tasks.iter().find(|task| task.id == id).expect("task");
    // Workers read the task's spec: the plan-level mode is copied into it.
    assert_eq!(task("IMPL-1").blocks.sandbox, Some(SandboxMode::Enforce));
    assert_eq!(sandbox_of(&task("IMPL-1").spec), Some(SandboxMode::Enforce));
    assert_eq!(task("IMPL-2").blocks.sandbox, Some(SandboxMode::Warn));
    assert_eq!(sandbox_of(&task("IMPL-2").spec), Some(SandboxMode::Warn));

    let plain = json!({"name": "p", "tasks": [{"id": "IMPL-1", "title": "a"}]}).to_string();
    let plain = Plan::from_json(&plain).expect("valid plan");
    assert_eq!(plain.sandbox, None);
    assert_eq!(plain.tasks[0].blocks.sandbox, None);
    assert!(!plain.tasks[0].spec.contains_key("sandbox"));
}

#[test]
fn a_bad_sandbox_is_refused_at_intake() {
    let text = json!({"name": "p", "sandbox": "strict", "tasks": [
        {"id": "IMPL-1", "title": "a", "sandbox": false},
    ]})
    .to_string();
    let messages: Vec<String> = Plan::from_json(&text)
        .expect_err("refused")
        .problems
        .into_iter()
        .map(|problem| problem.message)
        .collect();
    assert_listed(
        &messages,
        &[
            "plan: `sandbox` must be \"enforce\", \"warn\" or \"off\", got \"strict\"",
            "task IMPL-1: `sandbox` must be \"enforce\", \"warn\" or \"off\", got false",
        ],
    );
}
