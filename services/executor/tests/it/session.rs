//! The session flow: task branches integrated into one session branch.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use troupe_executor::{Executor, Job, Target, task_branch};
use troupe_grpc::worker::TaskFailure;
use troupe_proto::v1::{ErrorKind, TaskResult};
use troupe_testkit::{git, git_repo};

use crate::{plan_dir, show};

struct Session {
    _dirs: Vec<tempfile::TempDir>,
    repo: PathBuf,
    plan: PathBuf,
    executor: Arc<Executor>,
}

fn session() -> Session {
    session_with(troupe_process::SandboxMode::Enforce)
}

/// A session whose executor confines agents with `mode`; the test agent's barrier files go to
/// the plan directory, which it may write.
fn session_with(mode: troupe_process::SandboxMode) -> Session {
    let repo_dir = tempfile::tempdir().expect("tempdir");
    let data = tempfile::tempdir().expect("tempdir");
    let plan = plan_dir();
    let repo = repo_dir.path().join("app");
    git_repo(&repo, &[("shared.txt", "base\n")]).expect("repo");
    git(&repo, &["branch", "troupe/s1", "main"]).expect("session branch");
    let options = troupe_executor::Options {
        sandbox: troupe_process::sandbox::SandboxArgs {
            mode,
            write_paths: vec![plan.path().to_path_buf()],
            ..Default::default()
        },
        ..Default::default()
    };
    let executor = Arc::new(Executor::with_options(
        data.path().canonicalize().expect("canonical"),
        Default::default(),
        options,
    ));
    Session {
        repo,
        plan: plan.path().to_path_buf(),
        executor,
        _dirs: vec![repo_dir, data, plan],
    }
}

impl Session {
    fn job(&self, id: &str, edits: &[&str]) -> Job {
        let mut command: Vec<Value> = ["python3", "{plan_dir}/agent.py", "{worktree}"]
            .iter()
            .map(|s| json!(s))
            .collect();
        command.extend(edits.iter().map(|e| json!(e)));
        let spec = json!({"id": id, "title": format!("task {id}"), "agent": {"command": command}});
        Job {
            spec: task(spec),
            remote: troupe_workspace::Remote::from_path(&self.repo).expect("remote"),
            repo_name: "app".to_owned(),
            session_id: "s1".to_owned(),
            task_id: None,
            attempt: 1,
            plan_dir: Some(self.plan.clone()),
            upstream: Vec::new(),
            target: Target::Session {
                branch: "troupe/s1".to_owned(),
                base: None,
            },
            lease: None,
            fencing_token: 0,
            context: Vec::new(),
            usage: None,
        }
    }

    async fn run(&self, job: Job) -> Result<TaskResult, TaskFailure> {
        self.executor
            .execute(job, &CancellationToken::new(), &|_| {})
            .await
    }

    fn head(&self) -> String {
        git(&self.repo, &["rev-parse", "troupe/s1"]).expect("session head")
    }
}

fn barrier(root: &Path) -> String {
    let dir = root.join(format!("barrier-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("barrier dir");
    dir.display().to_string()
}

#[tokio::test]
async fn two_tasks_integrate_into_the_session_branch() {
    let s = session();
    let first = s
        .run(s.job("IMPL-1", &["a.txt=from one"]))
        .await
        .expect("first");
    assert_eq!(first.commit, s.head());
    assert_eq!(first.task_branch, task_branch("s1", "IMPL-1"));
    assert!(first.summary.contains("fast-forward"), "{}", first.summary);
    // The task branch keeps the task's own commit.
    assert_eq!(
        git(&s.repo, &["rev-parse", &first.task_branch]).expect("task branch"),
        first.commit
    );

    // The second starts from the integrated head, so it sees the first task's file.
    let second = s
        .run(s.job("IMPL-2", &["b.txt=from two"]))
        .await
        .expect("second");
    let head = s.head();
    assert_eq!(second.commit, head);
    assert_eq!(show(&s.repo, &head, "a.txt").as_deref(), Some("from one"));
    assert_eq!(show(&s.repo, &head, "b.txt").as_deref(), Some("from two"));
    git(
        &s.repo,
        &["merge-base", "--is-ancestor", &first.commit, &head],
    )
    .expect("first task is in the session branch");
    // main and the checkout never moved.
    assert_eq!(show(&s.repo, "main", "a.txt"), None);
    assert!(!s.repo.join("a.txt").exists());

    // A retry of a task that already landed (its completion was lost) lands nothing again: it
    // reports the earlier landing, and the branch keeps one commit of the task.
    let mut retry = s.job("IMPL-1", &["a.txt=from one, again"]);
    retry.attempt = 2;
    let again = s.run(retry).await.expect("retry");
    assert_eq!(s.head(), head, "the session branch did not move");
    assert_eq!(again.files_modified, ["a.txt"]);
    assert!(
        again
            .warnings
            .iter()
            .any(|w| w.contains("had already landed")),
        "{:?}",
        again.warnings
    );
    let log = git(&s.repo, &["log", "--format=%s", "main..troupe/s1"]).expect("log");
    assert_eq!(log.matches("IMPL-1:").count(), 1, "{log}");
}

#[tokio::test]
async fn concurrent_tasks_merge_or_report_conflicts() {
    let s = session();
    // Different files, same base: both land, the second through a merge commit.
    let gate = barrier(&s.plan.join("ok"));
    let one = s.job("IMPL-1", &["--barrier", &gate, "2", "one.txt=1"]);
    let two = s.job("IMPL-2", &["--barrier", &gate, "2", "two.txt=2"]);
    let (a, b) = tokio::join!(s.run(one), s.run(two));
    let (a, b) = match (a, b) {
        (Ok(a), Ok(b)) => (a, b),
        (a, b) => panic!("both should land: {a:?} / {b:?}"),
    };
    let head = s.head();
    assert!(head == a.commit || head == b.commit);
    assert_eq!(show(&s.repo, &head, "one.txt").as_deref(), Some("1"));
    assert_eq!(show(&s.repo, &head, "two.txt").as_deref(), Some("2"));
    assert!(
        a.summary.contains("merge") || b.summary.contains("merge"),
        "{} / {}",
        a.summary,
        b.summary
    );

    // Same file, same base: one lands, the other is a retryable MERGE_CONFLICT naming it.
    let gate = barrier(&s.plan.join("clash"));
    let left = s.job("IMPL-3", &["--barrier", &gate, "2", "shared.txt=left"]);
    let right = s.job("IMPL-4", &["--barrier", &gate, "2", "shared.txt=right"]);
    let (l, r) = tokio::join!(s.run(left), s.run(right));
    let (landed, failed) = match (l, r) {
        (Ok(ok), Err(err)) | (Err(err), Ok(ok)) => (ok, err),
        (l, r) => panic!("expected one success and one conflict, got {l:?} and {r:?}"),
    };
    assert_eq!(s.head(), landed.commit);
    assert_eq!(failed.error.kind(), ErrorKind::MergeConflict);
    assert!(failed.error.retryable);
    assert!(
        failed.error.details.contains(&"shared.txt".to_owned()),
        "{:?}",
        failed.error.details
    );
    let partial = failed.partial.expect("partial result");
    assert!(partial.task_branch.starts_with("troupe-task/s1/IMPL-"));
    assert!(partial.files_modified.contains(&"shared.txt".to_owned()));
}

#[tokio::test]
async fn missing_session_branch_and_bad_specs_fail_cleanly() {
    let s = session();
    let mut job = s.job("IMPL-1", &["a.txt=x"]);
    job.target = Target::Session {
        branch: "troupe/nope".to_owned(),
        base: None,
    };
    let err = s.run(job).await.expect_err("no branch");
    assert_eq!(err.error.kind(), ErrorKind::InvalidTask);

    // An unknown backend never reaches a run: the task is refused where it is typed.
    let err = troupe_plan::TaskSpec::from_object(
        json!({"id": "IMPL-1", "agent": {"backend": "nope"}})
            .as_object()
            .expect("object"),
        None,
    )
    .expect_err("unknown backend");
    assert!(err.to_string().contains("`agent.backend`"), "{err}");
}

#[tokio::test]
async fn read_only_context_is_checked_out_beside_and_a_change_to_it_fails_the_task() {
    let s = session();
    let contract_dir = tempfile::tempdir().expect("tempdir");
    let contract = contract_dir.path().join("contract");
    let base = git_repo(&contract, &[("API.md", "contract v1\n")]).expect("repo");
    // Nothing lands on a read-only repository: its session starts (and stays) at its base.
    let context = vec![troupe_executor::ContextRepo {
        name: "contract".to_owned(),
        remote: troupe_workspace::Remote::from_path(&contract).expect("remote"),
        branch: "troupe/s1".to_owned(),
        base: troupe_workspace::Oid::parse(&base),
    }];

    // Reading the context is what it is for: the task lands, the context is untouched.
    let mut job = s.job("IMPL-1", &["a.txt=uses the contract"]);
    job.context = context.clone();
    job.spec = task(json!({"id": "IMPL-1", "title": "task IMPL-1",
        "agent": {"command": ["python3", "{plan_dir}/agent.py", "{worktree}", "--keep-prompt",
            "copy.txt={context:contract}"]}}));
    let done = s.run(job).await.expect("lands");
    let copy = show(&s.repo, &done.commit, "copy.txt").expect("copy.txt");
    assert!(copy.ends_with(".context/contract"), "{copy}");
    let prompt = show(&s.repo, &done.commit, ".prompt-seen").expect("prompt");
    assert!(prompt.contains("READ-ONLY CONTEXT"), "{prompt}");
    assert!(prompt.contains(&format!("- contract: {copy}")), "{prompt}");

    // Writing into it fails the task and lands nothing.
    let head = s.head();
    let mut job = s.job(
        "IMPL-2",
        &["b.txt=fine", "{context:contract}/API.md=patched"],
    );
    job.context = context.clone();
    // Confined, the kernel refuses the write itself.
    let err = s.run(job.clone()).await.expect_err("refused");
    assert_eq!(
        err.error.kind(),
        ErrorKind::SandboxDenied,
        "{:?}",
        err.error
    );
    assert!(
        err.error.message.contains(".context/contract/API.md"),
        "{}",
        err.error.message
    );
    assert_eq!(s.head(), head, "nothing landed");
    // Unconfined, the write happens and the scope check refuses the result.
    let free = session_with(troupe_process::SandboxMode::Off);
    let head = free.head();
    let mut job = free.job(
        "IMPL-2",
        &["b.txt=fine", "{context:contract}/API.md=patched"],
    );
    job.context = context;
    let err = free.run(job).await.expect_err("refused");
    assert_eq!(err.error.kind(), ErrorKind::OutOfScope, "{:?}", err.error);
    assert!(
        err.error
            .message
            .contains("read-only repositories: contract: API.md"),
        "{}",
        err.error.message
    );
    assert_eq!(free.head(), head, "nothing landed");
    assert_eq!(
        std::fs::read_to_string(contract.join("API.md")).expect("read"),
        "contract v1\n"
    );
}

/// A task object typed as a claim types it.
fn task(spec: Value) -> troupe_plan::TaskSpec {
    troupe_plan::TaskSpec::from_object(spec.as_object().expect("object"), None).expect("valid task")
}
