//! EXEC phases and pre_analysis through `Executor.ExecuteTask` and `Executor::execute` on a
//! real executor. The phase's tasks come inline as `phase_tasks`, as intake stores them
//! (tests/e2e has the self-validation tests, which need a validator, and the claimed EXEC task).

use serde_json::{Value, json};
use tonic::Code;
use troupe_proto::v1::ErrorKind;
use troupe_testkit::git;

use crate::fixture::{Fixture, executor_logging_to, exists, report, show, task_error};

async fn fixture() -> Fixture {
    Fixture::start(None, None).await
}

#[tokio::test]
async fn exec_phase_runs_waves_in_order_in_parallel_and_integrates_everything() {
    let mut f = fixture().await;
    // Wave 1: 101, 102 (both wait for each other: they must run at once).
    f.phase_task("IMPL-101", &[], &["--barrier", "2", "--wave", "1"], "a.txt");
    f.phase_task("IMPL-102", &[], &["--barrier", "2", "--wave", "1"], "b.txt");
    // Wave 2: 103 needs 101, 104 needs 101 and 102; 104 crashes once and is retried.
    f.phase_task(
        "IMPL-103",
        &["IMPL-101"],
        &["--barrier", "2", "--wave", "2"],
        "c.txt",
    );
    f.phase_task(
        "IMPL-104",
        &["IMPL-101", "IMPL-102"],
        &["--fail-once", "--barrier", "2", "--wave", "2"],
        "d.txt",
    );
    // Wave 3; a dependency on an earlier phase's task counts as met.
    f.phase_task("IMPL-105", &["IMPL-103", "IMPL-004"], &[], "e.txt");
    f.phase_task("IMPL-106", &["IMPL-104"], &[], "f.txt");

    let task = json!({"id": "EXEC-1", "title": "phase 1", "phase": 1});
    let result = f.execute(task, "troupe/phase-1").await.expect("phase runs");
    let report = report(&result);
    assert_eq!(report.waves, 3);
    let outcomes: Vec<(&str, u32, &str)> = report
        .phase_tasks
        .iter()
        .map(|o| {
            (
                o.task_id.as_str(),
                o.wave,
                troupe_proto::names::name(o.state()),
            )
        })
        .collect();
    assert_eq!(
        outcomes,
        [
            ("IMPL-101", 1, "completed"),
            ("IMPL-102", 1, "completed"),
            ("IMPL-103", 2, "completed"),
            ("IMPL-104", 2, "completed"),
            ("IMPL-105", 3, "completed"),
            ("IMPL-106", 3, "completed"),
        ]
    );
    assert_eq!(f.runs("IMPL-104"), 2, "a retryable failure is retried once");
    // Waves ran one after another.
    for (earlier, later) in [
        ("IMPL-101", "IMPL-103"),
        ("IMPL-102", "IMPL-103"),
        ("IMPL-101", "IMPL-104"),
        ("IMPL-103", "IMPL-105"),
        ("IMPL-104", "IMPL-105"),
        ("IMPL-104", "IMPL-106"),
    ] {
        assert!(
            f.time(earlier, "end") <= f.time(later, "start"),
            "{later} started before {earlier} ended"
        );
    }
    // Everything is on the branch, with a summary per task.
    let head = git(&f.repo, &["rev-parse", "troupe/phase-1"]).expect("branch");
    assert_eq!(result.commit, head);
    for (file, id) in [
        ("a.txt", "IMPL-101"),
        ("b.txt", "IMPL-102"),
        ("c.txt", "IMPL-103"),
        ("d.txt", "IMPL-104"),
        ("e.txt", "IMPL-105"),
        ("f.txt", "IMPL-106"),
    ] {
        assert_eq!(
            show(&f.repo, &head, file).as_deref(),
            Some(format!("{id} was here").as_str())
        );
        let summary = show(
            &f.repo,
            &head,
            &format!(".troupe-summaries/summary-{id}.md"),
        )
        .expect("summary on the branch");
        assert!(summary.starts_with("---\nphase: 1\n"), "{summary}");
        assert!(summary.contains(&format!("task: \"{id}\"")), "{summary}");
    }
    assert_eq!(
        result.files_modified,
        ["a.txt", "b.txt", "c.txt", "d.txt", "e.txt", "f.txt"]
    );
    // Later tasks see what earlier ones did.
    let prompt = std::fs::read_to_string(f.log.join("IMPL-105.prompt")).expect("prompt");
    for id in ["IMPL-101", "IMPL-102", "IMPL-103", "IMPL-104"] {
        assert!(
            prompt.contains(&format!("- {id}: {id}: 1 file(s) changed")),
            "{id} missing from\n{prompt}"
        );
    }
    assert!(
        result.summary.contains("6 completed, 0 failed, 0 skipped"),
        "{}",
        result.summary
    );
}

#[tokio::test]
async fn a_failed_phase_task_skips_its_dependents_and_fails_the_phase() {
    let mut f = fixture().await;
    f.phase_task("IMPL-201", &[], &["--fail"], "a.txt");
    f.phase_task("IMPL-202", &[], &[], "b.txt");
    f.phase_task("IMPL-203", &["IMPL-201"], &[], "c.txt");
    f.phase_task("IMPL-204", &["IMPL-202"], &[], "d.txt");
    f.phase_task("IMPL-205", &["IMPL-203"], &[], "e.txt");
    let task = json!({"id": "EXEC-2", "phase": "phase-1"});
    let status = f
        .execute(task, "troupe/phase-2")
        .await
        .expect_err("the phase fails");
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    let error = task_error(&status);
    assert_eq!(error.kind(), ErrorKind::Crash);
    assert!(
        error
            .message
            .starts_with("phase task(s) failed: IMPL-201 ("),
        "{}",
        error.message
    );
    assert!(
        error
            .message
            .ends_with("skipped because a dependency failed: IMPL-203, IMPL-205"),
        "{}",
        error.message
    );
    // The failing task ran twice (the backend's one retry); the independent chain still ran.
    assert_eq!(f.runs("IMPL-201"), 2);
    assert_eq!(f.runs("IMPL-204"), 1);
    assert_eq!(f.runs("IMPL-203"), 0);
    // A direct run leaves no branch behind when it fails.
    assert!(!exists(&f.repo, "refs/heads/troupe/phase-2"));
}

#[tokio::test]
async fn phase_cycles_and_bad_phases_run_nothing() {
    let mut f = fixture().await;
    f.phase_task("IMPL-301", &[], &[], "a.txt");
    f.phase_task("IMPL-302", &["IMPL-303"], &[], "b.txt");
    f.phase_task("IMPL-303", &["IMPL-302"], &[], "c.txt");
    let status = f
        .execute(json!({"id": "EXEC-3", "phase": 1}), "troupe/phase-3")
        .await
        .expect_err("cycle");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status
            .message()
            .contains("dependency cycle: IMPL-302 -> IMPL-303 -> IMPL-302"),
        "{}",
        status.message()
    );
    assert_eq!(f.runs("IMPL-301"), 0);
    assert!(!exists(&f.repo, "refs/heads/troupe/phase-3"));

    let status = f
        .execute(json!({"id": "EXEC-4", "phase": 9}), "troupe/phase-9")
        .await
        .expect_err("no such phase");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status
            .message()
            .contains("phase `phase-9` came without its tasks"),
        "{}",
        status.message()
    );
    let status = f
        .execute(json!({"id": "EXEC-5", "phase": "../elsewhere"}), "troupe/x")
        .await
        .expect_err("outside the plan");
    assert!(
        status
            .message()
            .contains("must stay inside the plan directory"),
        "{}",
        status.message()
    );
}

#[tokio::test]
async fn pre_analysis_outputs_fill_the_prompt_and_failures_follow_on_error() {
    let mut f = fixture().await;
    let task = json!({
        "id": "IMPL-501", "title": "Use the readme",
        "description": "The readme says: [readme]",
        "files": [{"path": "x.txt", "action": "create"}],
        "pre_analysis": [
            {"step": "read", "commands": ["Read(README.md)"], "output_to": "readme"},
            {"step": "files", "command": "Glob(*.md)", "output_to": "docs"},
            {"step": "optional", "command": "Read(missing.txt)", "output_to": "gone", "on_error": "skip_optional"},
            {"step": "count", "command": "bash(wc -l README.md)", "output_to": "lines", "on_error": "continue"},
        ],
        "implementation": ["Mention [lines] in x.txt"],
        "agent": f.agent("IMPL-501", &["x.txt=ok"]),
    });
    f.execute(task, "troupe/direct/IMPL-501")
        .await
        .expect("runs");
    let prompt = std::fs::read_to_string(f.log.join("IMPL-501.prompt")).expect("prompt");
    for needle in [
        "The readme says: app\n",
        "1. Mention 1 README.md\n in x.txt",
        "PRE-ANALYSIS CONTEXT:\n[readme]:\napp\n[docs]:\nREADME.md\n[gone] (skipped after error):\n",
    ] {
        assert!(prompt.contains(needle), "missing {needle:?} in\n{prompt}");
    }

    let task = json!({
        "id": "IMPL-502", "files": [{"path": "x.txt"}],
        "pre_analysis": [{"step": "escape", "command": "Read(../../etc/passwd)", "output_to": "x"}],
        "agent": f.agent("IMPL-502", &["x.txt=ok"]),
    });
    let status = f
        .execute(task, "troupe/direct/IMPL-502")
        .await
        .expect_err("on_error fail");
    let error = task_error(&status);
    assert_eq!(error.kind(), ErrorKind::CheckFailed);
    assert!(
        error
            .message
            .starts_with("pre_analysis step `escape` failed"),
        "{}",
        error.message
    );
    assert_eq!(f.runs("IMPL-502"), 0, "the agent never ran");
}

#[tokio::test]
async fn a_conflict_inside_a_wave_is_run_again_from_the_new_head() {
    let mut f = fixture().await;
    // Both write shared.txt from the same base, at the same time.
    f.phase_task(
        "IMPL-601",
        &[],
        &["--barrier", "2", "--wave", "1"],
        "shared.txt",
    );
    f.phase_task(
        "IMPL-602",
        &[],
        &["--barrier", "2", "--wave", "1"],
        "shared.txt",
    );
    let result = f
        .execute(json!({"id": "EXEC-6", "phase": 1}), "troupe/phase-6")
        .await
        .expect("the conflict is resolved by a second run");
    let runs = (f.runs("IMPL-601"), f.runs("IMPL-602"));
    assert!(runs == (1, 2) || runs == (2, 1), "{runs:?}");
    let last = if runs.0 == 2 { "IMPL-601" } else { "IMPL-602" };
    assert_eq!(
        show(&f.repo, &result.commit, "shared.txt"),
        Some(format!("{last} was here"))
    );
    assert!(
        report(&result)
            .phase_tasks
            .iter()
            .all(|o| o.state() == troupe_proto::v1::TaskState::Completed)
    );
}

/// A session job for `Executor::execute`, as the worker builds it from a claim.
fn session_job(f: &Fixture, spec: Value, attempt: u32) -> troupe_executor::Job {
    troupe_executor::Job {
        spec: troupe_plan::TaskSpec::from_object(
            f.with_phase_tasks(spec).as_object().expect("object"),
            None,
        )
        .expect("valid task"),
        remote: troupe_workspace::Remote::from_path(&f.repo).expect("remote"),
        repo_name: "app".to_owned(),
        session_id: "s1".to_owned(),
        task_id: None,
        attempt,
        plan_dir: Some(f.plan.clone()),
        upstream: Vec::new(),
        target: troupe_executor::Target::Session {
            branch: "troupe/s1".to_owned(),
            base: None,
        },
        lease: None,
        fencing_token: 0,
        context: Vec::new(),
        usage: None,
    }
}

#[tokio::test]
async fn phase_progress_names_the_wave_and_retries_redo_only_what_failed() {
    let f = fixture().await;
    git(&f.repo, &["branch", "troupe/s1", "main"]).expect("session branch");
    let data = f.log.parent().expect("root").join("direct-executor");
    let executor = executor_logging_to(data, &f.log);
    f.phase_task("IMPL-801", &[], &[], "a.txt");
    f.phase_task("IMPL-802", &[], &["--fail"], "b.txt");
    f.phase_task("IMPL-803", &["IMPL-801", "IMPL-802"], &[], "c.txt");
    let notes = std::sync::Mutex::new(Vec::<String>::new());
    let progress = |note: String| notes.lock().expect("notes").push(note);
    let cancel = tokio_util::sync::CancellationToken::new();
    let spec = json!({"id": "EXEC-8", "phase": 1});

    let failed = executor
        .execute(session_job(&f, spec.clone(), 1), &cancel, &progress)
        .await
        .expect_err("IMPL-802 fails");
    assert!(
        failed.error.message.contains("IMPL-802"),
        "{}",
        failed.error.message
    );
    assert!(
        failed.error.retryable,
        "a crash may pass on another attempt"
    );
    let partial = failed.partial.expect("partial result");
    let states: Vec<(&str, &str)> = report(&partial)
        .phase_tasks
        .iter()
        .map(|o| (o.task_id.as_str(), troupe_proto::names::name(o.state())))
        .collect();
    assert_eq!(
        states,
        [
            ("IMPL-801", "completed"),
            ("IMPL-802", "failed"),
            ("IMPL-803", "skipped")
        ]
    );
    {
        let notes = notes.lock().expect("notes");
        assert!(
            notes
                .iter()
                .any(|n| n.starts_with("wave 1/2: ") && n.contains("running")),
            "{notes:?}"
        );
        assert!(
            notes.contains(&"wave 1/2: IMPL-801 done, IMPL-802 failed".to_owned()),
            "{notes:?}"
        );
        assert_eq!(
            notes.last().map(String::as_str),
            Some("wave 2/2: IMPL-803 skipped")
        );
    }

    // IMPL-802 is fixed (a direct caller gives the phase's tasks anew); the EXEC task's next
    // attempt redoes only what did not complete.
    f.phase_task("IMPL-802", &[], &[], "b.txt");
    notes.lock().expect("notes").clear();
    let result = executor
        .execute(session_job(&f, spec, 2), &cancel, &progress)
        .await
        .expect("second attempt");
    assert_eq!(f.runs("IMPL-801"), 1, "completed by the first attempt");
    assert_eq!(f.runs("IMPL-803"), 1);
    let outcomes = &report(&result).phase_tasks;
    assert!(
        outcomes[0]
            .summary
            .ends_with("(landed by an earlier attempt)"),
        "{:?}",
        outcomes[0]
    );
    assert!(
        outcomes
            .iter()
            .all(|o| o.state() == troupe_proto::v1::TaskState::Completed),
        "{outcomes:?}"
    );
    for file in ["a.txt", "b.txt", "c.txt"] {
        assert!(show(&f.repo, "troupe/s1", file).is_some(), "{file}");
    }
    assert_eq!(
        notes.lock().expect("notes").last().map(String::as_str),
        Some("wave 2/2: IMPL-803 done")
    );
}
