//! EXEC phases, self-validation through a real validator, and pre_analysis, all through
//! `Executor.ExecuteTask` on real services.

use std::path::{Path, PathBuf};

use prost::Message;
use serde_json::{Value, json};
use tonic::Code;
use troupe_backends::BackendsConfig;
use troupe_executor::{Config, TASK_ERROR_METADATA};
use troupe_modelserver::{Action, ModelServer, Script};
use troupe_proto::v1::executor_client::ExecutorClient;
use troupe_proto::v1::{
    ErrorKind, ExecuteTaskRequest, ImplementationReport, TaskError, TaskResult, Verdict,
    task_result,
};
use troupe_testkit::{TestService, git, git_repo};

use crate::{show, to_struct};

/// Agent for these tests: `agent.py WORKTREE LOG TASK [flags] path=content...`. It logs
/// `<LOG>/<TASK>.start|.end` times and `<LOG>/<TASK>.prompt`, and counts its runs in
/// `<LOG>/<TASK>.runs`. Flags: `--barrier N` waits until N agents of the same wave started
/// (`<LOG>/barrier-<N>-<wave>`, wave from `--wave W`); `--fail-once` exits 3 on its first run;
/// `--fail` always exits 3; `--broken-until-feedback` writes `broken.py` with a syntax error
/// unless the prompt reports a failed self-validation; `--always-broken` always does;
/// `--sleep S` works for S seconds.
const AGENT: &str = r#"
import os, sys, time
args = sys.argv[1:]
worktree, log, task = args.pop(0), args.pop(0), args.pop(0)
prompt = sys.stdin.read()
def flag(name):
    if name in args:
        args.remove(name)
        return True
    return False
def value(name):
    if name in args:
        i = args.index(name)
        v = args[i + 1]
        del args[i:i + 2]
        return v
    return None
runs_file = os.path.join(log, task + ".runs")
runs = int(open(runs_file).read()) + 1 if os.path.exists(runs_file) else 1
open(runs_file, "w").write(str(runs))
open(os.path.join(log, task + ".start"), "w").write(repr(time.time()))
open(os.path.join(log, task + ".prompt"), "w").write(prompt)
barrier, wave = value("--barrier"), value("--wave")
pause = float(value("--sleep") or 0.05)
if barrier:
    d = os.path.join(log, "barrier-" + wave)
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, task), "w").close()
    deadline = time.time() + 20
    while len(os.listdir(d)) < int(barrier):
        if time.time() > deadline:
            sys.exit("barrier timeout")
        time.sleep(0.02)
if flag("--fail") or (flag("--fail-once") and runs == 1):
    print("agent is unhappy", file=sys.stderr)
    sys.exit(3)
feedback = "SELF-VALIDATION FAILED" in prompt
broken_until = flag("--broken-until-feedback")
if flag("--always-broken") or (broken_until and not feedback):
    args.append("broken.py=def f(:")
elif broken_until:
    args.append("broken.py=def f():\n    return 1")
for edit in args:
    path, content = edit.split("=", 1)
    full = os.path.join(worktree, path)
    os.makedirs(os.path.dirname(full) or ".", exist_ok=True)
    with open(full, "w") as f:
        f.write(content + "\n")
time.sleep(pause)
open(os.path.join(log, task + ".end"), "w").write(repr(time.time()))
print("edited", len(args), "files")
"#;

struct Fixture {
    _dirs: Vec<tempfile::TempDir>,
    repo: PathBuf,
    plan: PathBuf,
    log: PathBuf,
    client: ExecutorClient<tonic::transport::Channel>,
    _executor: TestService,
    _validator: Option<TestService>,
}

async fn fixture(with_validator: bool) -> Fixture {
    fixture_with(with_validator, None).await
}

async fn fixture_with(with_validator: bool, backends: Option<BackendsConfig>) -> Fixture {
    let root = tempfile::tempdir().expect("tempdir");
    let repo = root.path().join("app");
    git_repo(&repo, &[("README.md", "app\n")]).expect("repo");
    let plan = root.path().join("plan");
    let log = root.path().join("log");
    std::fs::create_dir_all(plan.join("agents")).expect("plan dir");
    std::fs::create_dir_all(&log).expect("log dir");
    std::fs::write(plan.join("agents/agent.py"), AGENT).expect("agent");
    let validator = if with_validator {
        #[derive(clap::Parser)]
        struct Args {
            #[command(flatten)]
            config: troupe_validator::Config,
        }
        let data = root.path().join("validator");
        let args = <Args as clap::Parser>::parse_from([
            "troupe-validator".to_owned(),
            "--data-dir".to_owned(),
            data.display().to_string(),
        ]);
        Some(
            TestService::spawn(|listener, shutdown| {
                troupe_validator::run(args.config, listener, shutdown)
            })
            .await,
        )
    } else {
        None
    };
    let config = Config {
        listen: "127.0.0.1:0".parse().expect("addr"),
        data_dir: root.path().join("executor"),
        coordinator_url: None,
        concurrency: 1,
        worker_id: None,
        worker: Default::default(),
        backends_config: backends.map(|config| {
            let file = root.path().join("executor.toml");
            std::fs::write(&file, crate::clis::to_toml(&config)).expect("config file");
            file
        }),
        validator_url: validator.as_ref().map(TestService::url),
        phase_concurrency: 4,
        summary_dir: troupe_executor::DEFAULT_SUMMARY_DIR.to_owned(),
        security: Default::default(),
        // The test agents count their runs in the log dir.
        sandbox: troupe_process::sandbox::SandboxArgs {
            write_paths: vec![log.clone()],
            ..Default::default()
        },
    };
    let executor =
        TestService::spawn(|listener, shutdown| troupe_executor::run(config, listener, shutdown))
            .await;
    let client = ExecutorClient::connect(executor.url())
        .await
        .expect("connect");
    Fixture {
        _dirs: vec![root],
        repo,
        plan,
        log,
        client,
        _executor: executor,
        _validator: validator,
    }
}

impl Fixture {
    fn agent(&self, task: &str, extra: &[&str]) -> Value {
        let mut argv = vec![
            "python3".to_owned(),
            "{plan_dir}/agents/agent.py".to_owned(),
            "{worktree}".to_owned(),
            self.log.display().to_string(),
            task.to_owned(),
        ];
        argv.extend(extra.iter().map(|s| (*s).to_owned()));
        json!({"backend": "command", "command": argv})
    }

    /// Writes `<plan>/phase-1/.task/<id>.json`.
    fn phase_task(&self, id: &str, deps: &[&str], extra: &[&str], file: &str) {
        let dir = self.plan.join("phase-1/.task");
        std::fs::create_dir_all(&dir).expect("task dir");
        let mut edits = extra.to_vec();
        let edit = format!("{file}={id} was here");
        edits.push(&edit);
        let task = json!({
            "id": id, "title": format!("task {id}"), "description": format!("Write {file}."),
            "depends_on": deps,
            "files": [{"path": file, "action": "create", "change": "new file"}],
            "convergence": {"criteria": [format!("file: {file} exists")]},
            "agent": self.agent(id, &edits),
        });
        std::fs::write(
            dir.join(format!("{id}.json")),
            serde_json::to_string_pretty(&task).expect("json"),
        )
        .expect("task file");
    }

    async fn execute(&mut self, task: Value, branch: &str) -> Result<TaskResult, tonic::Status> {
        self.client
            .execute_task(ExecuteTaskRequest {
                repo_path: self.repo.display().to_string(),
                base_ref: "main".to_owned(),
                branch: branch.to_owned(),
                task: Some(to_struct(&task)),
                base_dir: self.plan.display().to_string(),
            })
            .await
            .map(|r| r.into_inner().result.expect("result"))
    }

    fn time(&self, task: &str, what: &str) -> f64 {
        std::fs::read_to_string(self.log.join(format!("{task}.{what}")))
            .expect("logged")
            .parse()
            .expect("time")
    }

    fn runs(&self, task: &str) -> u32 {
        std::fs::read_to_string(self.log.join(format!("{task}.runs")))
            .map_or(0, |t| t.parse().expect("count"))
    }
}

fn report(result: &TaskResult) -> &ImplementationReport {
    match &result.detail {
        Some(task_result::Detail::Implementation(report)) => report,
        other => panic!("no implementation report: {other:?}"),
    }
}

fn task_error(status: &tonic::Status) -> TaskError {
    let bytes = status
        .metadata()
        .get_bin(TASK_ERROR_METADATA)
        .expect("typed error metadata")
        .to_bytes()
        .expect("binary metadata");
    TaskError::decode(bytes).expect("decodes")
}

fn exists(repo: &Path, rev: &str) -> bool {
    git(repo, &["rev-parse", "--verify", "--quiet", rev]).is_ok()
}

#[tokio::test]
async fn exec_phase_runs_waves_in_order_in_parallel_and_integrates_everything() {
    let mut f = fixture(false).await;
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
        .map(|o| (o.task_id.as_str(), o.wave, o.state.as_str()))
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
    let mut f = fixture(false).await;
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
    let mut f = fixture(false).await;
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
            .contains("cycle among IMPL-302, IMPL-303; nothing was run"),
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
        status.message().contains("phase-9/.task"),
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
async fn self_validation_feeds_syntax_errors_back_and_fills_convergence() {
    let mut f = fixture(true).await;
    let task = json!({
        "id": "IMPL-401", "title": "Add broken.py",
        "files": [{"path": "broken.py", "action": "create"}],
        "convergence": {
            "criteria": ["file: broken.py exists", "cmd: python3 -c \"import broken; assert broken.f() == 1\""],
            "verification": "python3 -c 'import broken'",
        },
        "agent": f.agent("IMPL-401", &["--broken-until-feedback"]),
    });
    let result = f
        .execute(task, "troupe/direct/IMPL-401")
        .await
        .expect("fixed");
    assert_eq!(f.runs("IMPL-401"), 2, "one feedback round");
    let prompt = std::fs::read_to_string(f.log.join("IMPL-401.prompt")).expect("prompt");
    assert!(
        prompt.contains("SELF-VALIDATION FAILED (retry 1 of 3)"),
        "{prompt}"
    );
    assert!(prompt.contains("syntax:broken.py"), "{prompt}");
    let report = report(&result);
    let validation = report.self_validation.as_ref().expect("validated");
    assert_eq!(validation.verdict(), Verdict::Pass, "{validation:?}");
    assert_eq!(validation.convergence_verified, [true, true]);
    assert_eq!(validation.convergence_met, "pass");
    assert!(
        result
            .warnings
            .iter()
            .any(|w| w.contains("syntax check failed 1 time(s)")),
        "{:?}",
        result.warnings
    );
    let summary = show(
        &f.repo,
        &result.commit,
        ".troupe-summaries/summary-IMPL-401.md",
    )
    .expect("summary");
    assert!(summary.contains("convergence-met: pass\n"), "{summary}");
    assert!(
        summary.contains("- [x] file: broken.py exists"),
        "{summary}"
    );

    // An agent that never fixes it fails after three retries, with the evidence.
    let task = json!({
        "id": "IMPL-402", "files": [{"path": "broken.py", "action": "create"}],
        "convergence": {"criteria": ["file: broken.py exists"]},
        "agent": f.agent("IMPL-402", &["--always-broken"]),
    });
    let status = f
        .execute(task, "troupe/direct/IMPL-402")
        .await
        .expect_err("never fixed");
    let error = task_error(&status);
    assert_eq!(error.kind(), ErrorKind::CheckFailed);
    assert!(
        error
            .message
            .starts_with("syntax check still failing after 3 retries"),
        "{}",
        error.message
    );
    assert_eq!(f.runs("IMPL-402"), 4);
}

#[tokio::test]
async fn pre_analysis_outputs_fill_the_prompt_and_failures_follow_on_error() {
    let mut f = fixture(false).await;
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
    let mut f = fixture(false).await;
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
            .all(|o| o.state == "completed")
    );
}

#[tokio::test]
async fn the_agent_backend_gets_syntax_errors_back_as_context() {
    // The scripted model writes broken Python, and fixes it once told what the check said.
    let script = Script::default()
        .rule(
            "SELF-VALIDATION FAILED",
            vec![Action::WriteFile {
                path: "calc.py".to_owned(),
                content: "def add(a, b):\n    return a + b\n".to_owned(),
            }],
        )
        .rule(
            "calc.py",
            vec![Action::WriteFile {
                path: "calc.py".to_owned(),
                content: "def add(a, b)\n    return a + b\n".to_owned(),
            }],
        );
    let (url, server) = ModelServer::start(script).await.expect("model server");
    let mut f = fixture_with(true, Some(crate::clis::config_for(&[("agent", &url)]))).await;
    let task = json!({
        "id": "IMPL-701", "title": "Add calc.add",
        "files": [{"path": "calc.py", "action": "create", "change": "add(a, b)"}],
        "convergence": {"criteria": ["cmd: python3 -c \"import calc; assert calc.add(2, 3) == 5\""]},
        "agent": {"backend": "agent"},
    });
    let result = f
        .execute(task, "troupe/direct/IMPL-701")
        .await
        .expect("fixed");
    assert_eq!(
        show(&f.repo, &result.commit, "calc.py").as_deref(),
        Some("def add(a, b):\n    return a + b")
    );
    let report = report(&result);
    assert_eq!(report.backend, "agent");
    let validation = report.self_validation.as_ref().expect("validated");
    assert_eq!(validation.convergence_verified, [true]);
    assert_eq!(validation.convergence_met, "pass");
    // Both agent runs are counted.
    let usage = report.usage.expect("usage");
    assert_eq!(usage.output_tokens % troupe_modelserver::OUTPUT_TOKENS, 0);
    assert!(
        usage.output_tokens >= 4 * troupe_modelserver::OUTPUT_TOKENS,
        "{usage:?}"
    );
    let feedback = server
        .requests()
        .iter()
        .filter(|r| {
            r.body_text()
                .contains("SELF-VALIDATION FAILED (retry 1 of 3)")
        })
        .count();
    assert!(feedback > 0, "the second run carried the syntax error");
}

/// A session job for `Executor::execute`, as the worker builds it from a claim.
fn session_job(f: &Fixture, spec: Value, attempt: u32) -> troupe_executor::Job {
    troupe_executor::Job {
        spec: spec.as_object().expect("object").clone(),
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
    }
}

/// An executor whose agents may write their run counts to `log`.
fn executor_logging_to(data: PathBuf, log: &Path) -> troupe_executor::Executor {
    let options = troupe_executor::Options {
        sandbox: troupe_process::sandbox::SandboxArgs {
            write_paths: vec![log.to_path_buf()],
            ..Default::default()
        },
        ..Default::default()
    };
    troupe_executor::Executor::with_options(data, Default::default(), options)
}

#[tokio::test]
async fn phase_progress_names_the_wave_and_retries_redo_only_what_failed() {
    let f = fixture(false).await;
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
        .map(|o| (o.task_id.as_str(), o.state.as_str()))
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

    // The plan is fixed; the EXEC task's next attempt redoes only what did not complete.
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
        outcomes.iter().all(|o| o.state == "completed"),
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_exec_task_reports_wave_progress_to_the_coordinator() {
    use std::sync::Arc;
    use std::time::Duration;

    use troupe_grpc::worker::{WorkerConfig, run_worker};
    use troupe_proto::v1::{
        CreateSessionRequest, GetSessionRequest, Role, TaskState, WatchSessionRequest,
        session_event,
    };

    let f = fixture(false).await;
    let coordinator_dir = f.log.parent().expect("root").join("coordinator");
    let coordinator = TestService::spawn(move |listener, shutdown| {
        troupe_coordinator::run(
            troupe_coordinator::Config::new(coordinator_dir),
            listener,
            shutdown,
        )
    })
    .await;
    // Short leases so heartbeats (a third of the lease) carry the notes of each wave.
    let mut worker = WorkerConfig::new(coordinator.url(), "executor-it", vec![Role::Executor]);
    worker.lease = Duration::from_millis(1500);
    worker.poll_wait = Duration::from_millis(200);
    let executor = Arc::new(executor_logging_to(
        f.log.parent().expect("root").join("worker"),
        &f.log,
    ));
    let stop = tokio_util::sync::CancellationToken::new();
    let worker_task = tokio::spawn(run_worker(
        worker,
        Arc::new(troupe_executor::ExecuteHandler::new(executor)),
        stop.clone(),
    ));

    f.phase_task("IMPL-901", &[], &["--sleep", "1.5"], "a.txt");
    f.phase_task("IMPL-902", &["IMPL-901"], &["--sleep", "1.5"], "b.txt");
    f.phase_task("IMPL-903", &["IMPL-902"], &["--sleep", "1.5"], "c.txt");
    let plan = json!({
        "name": "phase-progress",
        "repos": {"app": {"path": f.repo.display().to_string()}},
        "tasks": [{"id": "EXEC-9", "title": "phase 1", "description": "run phase 1", "depends_on": [], "phase": 1}],
    });
    let mut client = troupe_grpc::coordinator_client(&coordinator.url()).expect("client");
    let session_id = client
        .create_session(CreateSessionRequest {
            plan_json: plan.to_string(),
            base_dir: f.plan.display().to_string(),
            ..Default::default()
        })
        .await
        .expect("session")
        .into_inner()
        .session
        .expect("session")
        .id;
    let mut events = client
        .watch_session(WatchSessionRequest {
            session_id: session_id.clone(),
            after_sequence: 0,
            follow: false,
        })
        .await
        .expect("watch")
        .into_inner();
    let mut notes = Vec::new();
    let drain = async {
        use futures::StreamExt as _;
        while let Some(event) = events.next().await {
            if let Some(session_event::Kind::Progress(progress)) = event.expect("event").kind {
                notes.push(progress.note);
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(120), drain)
        .await
        .expect("the session ends");
    let session = client
        .get_session(GetSessionRequest {
            session_id,
            ..Default::default()
        })
        .await
        .expect("get")
        .into_inner();
    let exec = &session.tasks[0];
    assert_eq!(exec.state, TaskState::Completed as i32, "{exec:?}");
    // Each wave's note reached the coordinator, in order.
    let firsts: Vec<usize> = [
        "wave 1/3: IMPL-901 running",
        "wave 2/3: IMPL-902 running",
        "wave 3/3: IMPL-903 running",
    ]
    .iter()
    .map(|note| {
        notes
            .iter()
            .position(|n| n == note)
            .unwrap_or_else(|| panic!("{note:?} not in {notes:?}"))
    })
    .collect();
    assert!(firsts.windows(2).all(|w| w[0] < w[1]), "{notes:?}");
    let result = exec.result.as_ref().expect("result");
    assert_eq!(report(result).waves, 3);
    assert_eq!(result.files_modified, ["a.txt", "b.txt", "c.txt"]);
    stop.cancel();
    worker_task.await.expect("join").expect("worker");
}
