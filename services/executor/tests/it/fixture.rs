//! A fixture for EXEC phase and self-validation tests through `Executor.ExecuteTask` on a real
//! executor: a repository, a plan directory with a logging agent, and phase task files. Kept
//! free of `crate::` paths, since tests/e2e includes it for the tests that need a validator.

use std::path::{Path, PathBuf};

use prost::Message;
use serde_json::{Value, json};
use troupe_executor::{Config, TASK_ERROR_METADATA};
use troupe_proto::v1::executor_client::ExecutorClient;
use troupe_proto::v1::{
    ExecuteTaskRequest, ImplementationReport, TaskError, TaskResult, task_result,
};
use troupe_testkit::{TestService, git, git_repo};

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

pub(crate) struct Fixture {
    _dirs: Vec<tempfile::TempDir>,
    pub(crate) repo: PathBuf,
    pub(crate) plan: PathBuf,
    pub(crate) log: PathBuf,
    pub(crate) client: ExecutorClient<tonic::transport::Channel>,
    _executor: TestService,
}

impl Fixture {
    /// Starts an executor that self-validates through `validator_url` when given, with the
    /// backend configuration file `backends_toml` when given.
    pub(crate) async fn start(
        validator_url: Option<String>,
        backends_toml: Option<String>,
    ) -> Self {
        let root = tempfile::tempdir().expect("tempdir");
        let repo = root.path().join("app");
        git_repo(&repo, &[("README.md", "app\n")]).expect("repo");
        let plan = root.path().join("plan");
        let log = root.path().join("log");
        std::fs::create_dir_all(plan.join("agents")).expect("plan dir");
        std::fs::create_dir_all(&log).expect("log dir");
        std::fs::write(plan.join("agents/agent.py"), AGENT).expect("agent");
        let config = Config {
            listen: "127.0.0.1:0".parse().expect("addr"),
            data_dir: root.path().join("executor"),
            coordinator_url: None,
            concurrency: 1,
            worker_id: None,
            worker: Default::default(),
            backends_config: backends_toml.map(|text| {
                let file = root.path().join("executor.toml");
                std::fs::write(&file, text).expect("config file");
                file
            }),
            validator_url,
            phase_concurrency: 4,
            summary_dir: troupe_executor::DEFAULT_SUMMARY_DIR.to_owned(),
            security: Default::default(),
            // The test agents count their runs in the log dir.
            sandbox: troupe_process::sandbox::SandboxArgs {
                write_paths: vec![log.clone()],
                ..Default::default()
            },
        };
        let executor = TestService::spawn(|listener, shutdown| {
            troupe_executor::run(config, listener, shutdown)
        })
        .await;
        let client = ExecutorClient::connect(executor.url())
            .await
            .expect("connect");
        Self {
            _dirs: vec![root],
            repo,
            plan,
            log,
            client,
            _executor: executor,
        }
    }

    pub(crate) fn agent(&self, task: &str, extra: &[&str]) -> Value {
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
    pub(crate) fn phase_task(&self, id: &str, deps: &[&str], extra: &[&str], file: &str) {
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

    /// `task` as intake stores it: an EXEC task naming a `phase` whose directory exists gets
    /// that directory's task files as `phase_tasks` (no executor reads the plan's directory).
    pub(crate) fn with_phase_tasks(&self, mut task: Value) -> Value {
        let object = task.as_object_mut().expect("object");
        let Some(Ok(dir)) = troupe_plan::phase::directory(object) else {
            return task;
        };
        let Ok(entries) = std::fs::read_dir(self.plan.join(&dir).join(".task")) else {
            return task;
        };
        let mut paths: Vec<PathBuf> = entries.flatten().map(|entry| entry.path()).collect();
        paths.sort();
        let specs: Vec<Value> = paths
            .iter()
            .map(|path| {
                serde_json::from_str(&std::fs::read_to_string(path).expect("task file"))
                    .expect("json")
            })
            .collect();
        object.insert(
            troupe_plan::phase::PHASE_TASKS.to_owned(),
            Value::Array(specs),
        );
        task
    }

    pub(crate) async fn execute(
        &mut self,
        task: Value,
        branch: &str,
    ) -> Result<TaskResult, tonic::Status> {
        let task = self.with_phase_tasks(task);
        self.client
            .execute_task(ExecuteTaskRequest {
                repo_path: self.repo.display().to_string(),
                base_ref: "main".to_owned(),
                branch: branch.to_owned(),
                task: Some(troupe_proto::json::to_struct(&task)),
                base_dir: self.plan.display().to_string(),
            })
            .await
            .map(|r| r.into_inner().result.expect("result"))
    }

    pub(crate) fn time(&self, task: &str, what: &str) -> f64 {
        std::fs::read_to_string(self.log.join(format!("{task}.{what}")))
            .expect("logged")
            .parse()
            .expect("time")
    }

    pub(crate) fn runs(&self, task: &str) -> u32 {
        std::fs::read_to_string(self.log.join(format!("{task}.runs")))
            .map_or(0, |t| t.parse().expect("count"))
    }
}

pub(crate) fn report(result: &TaskResult) -> &ImplementationReport {
    match &result.detail {
        Some(task_result::Detail::Implementation(report)) => report,
        other => panic!("no implementation report: {other:?}"),
    }
}

pub(crate) fn task_error(status: &tonic::Status) -> TaskError {
    let bytes = status
        .metadata()
        .get_bin(TASK_ERROR_METADATA)
        .expect("typed error metadata")
        .to_bytes()
        .expect("binary metadata");
    TaskError::decode(bytes).expect("decodes")
}

pub(crate) fn exists(repo: &Path, rev: &str) -> bool {
    git(repo, &["rev-parse", "--verify", "--quiet", rev]).is_ok()
}

/// `git show <rev>:<path>`, or `None` when absent.
pub(crate) fn show(repo: &Path, rev: &str, path: &str) -> Option<String> {
    git(repo, &["show", &format!("{rev}:{path}")]).ok()
}

/// An executor whose agents may write their run counts to `log`.
pub(crate) fn executor_logging_to(data: PathBuf, log: &Path) -> troupe_executor::Executor {
    let options = troupe_executor::Options {
        sandbox: troupe_process::sandbox::SandboxArgs {
            write_paths: vec![log.to_path_buf()],
            ..Default::default()
        },
        ..Default::default()
    };
    troupe_executor::Executor::with_options(data, Default::default(), options)
}
