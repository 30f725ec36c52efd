//! Distributed for real: the coordinator, two executors, the validator and the test-runner as
//! separate processes, each its own Unix user with a `0700` data directory the others cannot
//! read, over repositories behind real remotes (`git daemon` on loopback and a `file://` bare
//! repository) that none of them owns. The plan's own directory is unreadable to every service:
//! its agent script reaches them only as a plan asset. See `hosts` for the set-up.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};
use troupe_proto::v1::{
    CheckStatus, CreateSessionRequest, GetSessionRequest, GetSessionResponse, RepoAccess,
    SessionState, TaskState, task_result::Detail,
};

use crate::hosts::{GitDaemon, Host, account, bare_repo, can_make_accounts, share_with_group};
use crate::support::{ChildService, free_addr};

/// The agent: writes `<out>` in its worktree naming its task (and, when given, the first line
/// of a file of a read-only context repository). Argv: worktree, task, out, [context file].
const AGENT: &str = r#"
import pathlib, sys, time
sys.stdin.read()
worktree, task, out = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
extra = pathlib.Path(sys.argv[4]).read_text().splitlines()[0] if len(sys.argv) > 4 else ""
time.sleep(0.2)
path = worktree / out
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(f"{task}\n{extra}\n")
"#;

/// The app's own test: every app task's file is there.
const APP_TEST: &str = "import pathlib\n\n\ndef test_every_app_task_wrote_its_file():\n    assert len(list(pathlib.Path(\"app\").glob(\"A*.txt\"))) == 12\n";

const DEV_REQUIREMENTS: &str =
    "pytest>=8\npytest-cov>=5\npytest-json-report>=1.5\npytest-timeout>=2.3\n";

/// The post-receive hook that holds a push of IMPL-L03's landing for a while after its refs
/// moved, so the test can kill the executor between its push and its `CompleteTask`.
fn hold_hook(marker: &Path) -> String {
    format!(
        "#!/bin/sh\nwhile read old new ref; do\n  case \"$ref\" in\n    refs/heads/troupe-task/*/IMPL-L03) touch '{}'; sleep 4;;\n  esac\ndone\n",
        marker.display()
    )
}

fn agent(task: &str, out: &str, context: bool) -> Value {
    let mut command = vec![
        json!("python3"),
        json!("{plan_dir}/agents/write.py"),
        json!("{worktree}"),
        json!(task),
        json!(out),
    ];
    if context {
        command.push(json!("{context:contract}/API.md"));
    }
    json!({"backend": "command", "command": command})
}

/// 12 lib tasks (pairs), 12 app tasks each after its lib task and reading the read-only
/// contract, then VALIDATE, TESTRUN and VERIFY in app: 39 tasks over 3 repositories.
fn plan(lib: &str, app: &str, contract: &str) -> Value {
    let mut tasks = Vec::new();
    for n in 1..=12 {
        let id = format!("IMPL-L{n:02}");
        let out = format!("lib/L{n:02}.txt");
        let deps: Vec<String> = if n % 2 == 0 {
            vec![format!("IMPL-L{:02}", n - 1)]
        } else {
            Vec::new()
        };
        tasks.push(
            json!({"id": id, "title": format!("write {out}"), "repo": "lib",
            "depends_on": deps, "max_attempts": 4,
            "files": [{"path": out, "action": "create"}], "agent": agent(&id, &out, false)}),
        );
    }
    for n in 1..=12 {
        let id = format!("IMPL-A{n:02}");
        let out = format!("app/A{n:02}.txt");
        tasks.push(
            json!({"id": id, "title": format!("write {out}"), "repo": "app",
            "depends_on": [format!("IMPL-L{n:02}")], "max_attempts": 4,
            "files": [{"path": out, "action": "create"}],
            "convergence": {"criteria": [format!("file: {out} contains /contract v1/")]},
            "agent": agent(&id, &out, true)}),
        );
    }
    let all_app: Vec<String> = (1..=12).map(|n| format!("IMPL-A{n:02}")).collect();
    let all_lib: Vec<String> = (1..=12).map(|n| format!("IMPL-L{n:02}")).collect();
    let everything = [all_app.clone(), all_lib].concat();
    tasks.push(
        json!({"id": "VALIDATE-001", "title": "validate both repositories", "repo": "app",
        "depends_on": everything}),
    );
    tasks.push(
        json!({"id": "TESTRUN-001", "title": "run the app's tests", "repo": "app",
        "depends_on": all_app,
        "test": {"framework": "pytest", "install": true, "coverage_target": 0,
                 "timeout_seconds": 600}}),
    );
    tasks.push(
        json!({"id": "VERIFY-001", "title": "verify every goal", "repo": "app",
        "depends_on": ["VALIDATE-001", "TESTRUN-001"]}),
    );
    json!({"name": "multi", "repos": {
        "lib": {"url": lib}, "app": {"url": app}, "contract": {"url": contract, "access": "read"}},
        "tasks": tasks})
}

/// Every task's commit on a repository's session branch: task id → attempts that landed.
fn landings(bare: &Path, branch: &str, base: &str) -> BTreeMap<String, Vec<String>> {
    let log = troupe_testkit::git(
        bare,
        &[
            "log",
            "--no-merges",
            "--format=%(trailers:key=Troupe-Task,valueonly,separator=)%x09%(trailers:key=Troupe-Attempt,valueonly,separator=)",
            &format!("{base}..{branch}"),
        ],
    )
    .unwrap_or_default();
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in log.lines() {
        if let Some((task, attempt)) = line.split_once('\t') {
            let task = task
                .rsplit('/')
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned();
            out.entry(task).or_default().push(attempt.trim().to_owned());
        }
    }
    out
}

/// An executor worker as `host`'s account: two tasks at once, a 3 s lease, self-validation.
async fn executor(
    host: &Host,
    name: &str,
    url: &str,
    validator_url: &str,
) -> anyhow::Result<ChildService> {
    host.start(
        "troupe-executor",
        free_addr(),
        &[
            "--coordinator-url",
            url,
            "--worker-id",
            name,
            "--concurrency",
            "2",
            "--lease-seconds",
            "3",
            "--rpc-timeout-seconds",
            "2",
            "--validator-url",
            validator_url,
        ],
        &[],
    )
    .await
}

async fn session(url: &str, id: &str) -> anyhow::Result<GetSessionResponse> {
    Ok(troupe_grpc::coordinator_client(url)?
        .get_session(GetSessionRequest {
            session_id: id.to_owned(),
            ..Default::default()
        })
        .await?
        .into_inner())
}

async fn finished(url: &str, id: &str, within: Duration, hosts: &[&Host]) -> GetSessionResponse {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(view) = session(url, id).await
            && view.session.as_ref().is_some_and(|s| {
                matches!(s.state(), SessionState::Completed | SessionState::Failed)
            })
        {
            return view;
        }
        if Instant::now() > deadline {
            let report = session(url, id)
                .await
                .map(|v| troupe::report::final_report(&v))
                .unwrap_or_default();
            let logs: Vec<String> = hosts
                .iter()
                .map(|h| {
                    let text = h.log_text();
                    format!(
                        "== {}\n{}",
                        h.account.name,
                        troupe_process::tail(&text, 30, 6000)
                    )
                })
                .collect();
            panic!(
                "session {id} did not finish:\n{report}\n{}",
                logs.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Services on separate accounts, three repositories behind two kinds of remote, 39 tasks with
/// dependencies across repositories. The executor landing IMPL-L03 is killed after its push
/// and before its `CompleteTask` (a hook on the remote holds the push's answer), and the
/// coordinator is killed mid-session; every task's commit is on its repository's remote session
/// branch exactly once, and nothing was read from another service's disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_repositories_across_users_land_every_task_once() -> anyhow::Result<()> {
    if !can_make_accounts()? {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let root = dir.path().to_path_buf();
    std::fs::set_permissions(&root, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;

    // Remotes: lib and contract behind git daemon, app as a shared file:// bare repository.
    let srv = root.join("srv");
    std::fs::create_dir_all(&srv)?;
    let lib_base = bare_repo(&srv.join("lib.git"), &[("README.md", "lib\n")])?;
    let contract_base = bare_repo(&srv.join("contract.git"), &[("API.md", "contract v1\n")])?;
    let marker = root.join("landed-L03");
    let hook = srv.join("lib.git/hooks/post-receive");
    std::fs::write(&hook, hold_hook(&marker))?;
    std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    for repo in ["lib.git", "contract.git"] {
        troupe_testkit::git(&srv.join(repo), &["config", "daemon.receivepack", "true"])?;
    }
    let daemon = GitDaemon::start(&srv).await?;
    let shared = root.join("shared");
    std::fs::create_dir_all(&shared)?;
    let app_bare = shared.join("app.git");
    let app_base = bare_repo(
        &app_bare,
        &[
            ("README.md", "app\n"),
            ("requirements-dev.txt", DEV_REQUIREMENTS),
            ("tests/test_app.py", APP_TEST),
        ],
    )?;
    share_with_group(&app_bare)?;

    // The plan: in a directory no service can read.
    let plan_dir = root.join("plan");
    std::fs::create_dir_all(plan_dir.join("agents"))?;
    std::fs::write(plan_dir.join("agents/write.py"), AGENT)?;
    std::fs::set_permissions(
        &plan_dir,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )?;
    let plan = plan(
        &daemon.url("lib"),
        &format!("file://{}", app_bare.display()),
        &daemon.url("contract"),
    );
    let plan_json = plan.to_string();
    let assets = troupe::assets::collect(&plan_json, &plan_dir).map_err(anyhow::Error::msg)?;
    assert_eq!(assets.len(), 1, "the agent travels with the plan");

    let hosts = [
        Host::new(&root, "coordinator", account("troupe-e2e-coord")?)?,
        Host::new(&root, "executor-a", account("troupe-e2e-exec-a")?)?,
        Host::new(&root, "executor-b", account("troupe-e2e-exec-b")?)?,
        Host::new(&root, "validator", account("troupe-e2e-val")?)?,
        Host::new(&root, "test-runner", account("troupe-e2e-test")?)?,
    ];
    let [coord_host, exec_a, exec_b, val_host, test_host] = &hosts;
    let coordinator_addr = free_addr();
    let mut coordinator = coord_host
        .start("troupe-coordinator", coordinator_addr, &[], &[])
        .await?;
    let url = coordinator.url();
    let validator = val_host
        .start(
            "troupe-validator",
            free_addr(),
            &[
                "--coordinator-url",
                &url,
                "--worker-id",
                "validator",
                "--concurrency",
                "2",
            ],
            &[],
        )
        .await?;
    let validator_url = validator.url();
    let mut executors = vec![
        (
            "executor-a",
            executor(exec_a, "executor-a", &url, &validator_url).await?,
        ),
        (
            "executor-b",
            executor(exec_b, "executor-b", &url, &validator_url).await?,
        ),
    ];
    let test_runner = test_host
        .start(
            "troupe-test-runner",
            free_addr(),
            &[
                "--coordinator-url",
                &url,
                "--worker-id",
                "test-runner",
                "--python",
                "/usr/bin/python3",
            ],
            &[],
        )
        .await?;

    let created = troupe_grpc::coordinator_client(&url)?
        .create_session(CreateSessionRequest {
            plan_json,
            base_dir: plan_dir.display().to_string(),
            assets,
            ..Default::default()
        })
        .await?
        .into_inner();
    let id = created.session.context("no session")?.id;

    // IMPL-L03's landing is on the remote, its push's answer held by the hook: kill the
    // executor that pushed it before it can report.
    troupe_testkit::eventually("IMPL-L03 to land on the remote", || async {
        marker.exists().then_some(())
    })
    .await;
    let view = session(&url, &id).await?;
    let worker = view
        .tasks
        .iter()
        .find(|t| t.id == "IMPL-L03")
        .map(|t| t.worker_id.clone())
        .context("IMPL-L03")?;
    let at = executors
        .iter()
        .position(|(name, _)| *name == worker)
        .with_context(|| format!("IMPL-L03 runs on {worker}"))?;
    let (name, killed) = executors.remove(at);
    killed.kill9().await?;
    eprintln!("killed {name} between its push of IMPL-L03 and its report");

    // And the coordinator once, mid-session; the killed executor comes back on its data dir.
    tokio::time::sleep(Duration::from_secs(2)).await;
    coordinator.kill9().await?;
    tokio::time::sleep(Duration::from_millis(800)).await;
    coordinator = coord_host
        .start("troupe-coordinator", coordinator_addr, &[], &[])
        .await?;
    let host = if name == "executor-a" { exec_a } else { exec_b };
    executors.push((name, executor(host, name, &url, &validator_url).await?));

    let view = finished(
        &url,
        &id,
        Duration::from_secs(420),
        &hosts.iter().collect::<Vec<_>>(),
    )
    .await;
    let report = troupe::report::final_report(&view);
    let state = view.session.as_ref().map(|s| s.state());
    assert_eq!(state, Some(SessionState::Completed), "{report}");
    for task in &view.tasks {
        assert_eq!(task.state(), TaskState::Completed, "{}:\n{report}", task.id);
    }

    // Exactly once per task, on each repository's remote session branch.
    let session_repos = &view.session.as_ref().context("session")?.repos;
    let branch = format!("troupe/{id}");
    let lib = landings(&srv.join("lib.git"), &branch, &lib_base);
    let app = landings(&app_bare, &branch, &app_base);
    for n in 1..=12 {
        let (l, a) = (format!("IMPL-L{n:02}"), format!("IMPL-A{n:02}"));
        assert_eq!(lib.get(&l).map(Vec::len), Some(1), "{l} on lib: {lib:?}");
        assert_eq!(app.get(&a).map(Vec::len), Some(1), "{a} on app: {app:?}");
    }
    assert_eq!(lib.len(), 12, "{lib:?}");
    assert_eq!(app.len(), 12, "{app:?}");
    // IMPL-L03 landed once, by its first attempt; the second adopted it.
    assert_eq!(lib["IMPL-L03"], ["1"]);
    let l03 = view
        .tasks
        .iter()
        .find(|t| t.id == "IMPL-L03")
        .context("L03")?;
    assert!(l03.attempt >= 2, "{report}");
    let warnings = &l03.result.as_ref().context("L03 result")?.warnings;
    assert!(
        warnings.iter().any(|w| w.contains("had already landed")),
        "{warnings:?}"
    );

    // The read-only repository: context for every app task, never changed.
    let contract = session_repos
        .iter()
        .find(|r| r.name == "contract")
        .context("contract")?;
    assert_eq!(contract.access(), RepoAccess::Read);
    assert!(
        troupe_testkit::git(
            &srv.join("contract.git"),
            &["rev-parse", "--verify", "-q", &branch]
        )
        .is_err(),
        "nothing landed on the read-only repository"
    );
    assert_eq!(
        troupe_testkit::git(&srv.join("contract.git"), &["rev-parse", "HEAD"])?,
        contract_base
    );
    let a07 = troupe_testkit::git(&app_bare, &["show", &format!("{branch}:app/A07.txt")])?;
    assert_eq!(a07, "IMPL-A07\ncontract v1", "the agent read its context");

    // Per repository: its URL, base, head (the remote's branch) and counts.
    for (name, bare) in [("lib", srv.join("lib.git")), ("app", app_bare.clone())] {
        let repo = session_repos
            .iter()
            .find(|r| r.name == name)
            .context("repo")?;
        let head = troupe_testkit::git(&bare, &["rev-parse", &branch])?;
        assert_eq!(repo.head, head, "{name}'s head");
        if name == "lib" {
            assert!(repo.url.starts_with("git://"), "{repo:?}");
            assert!(
                repo.path.is_empty(),
                "a network remote has no local path: {repo:?}"
            );
        } else {
            assert!(repo.url.starts_with("file://"), "{repo:?}");
            assert_eq!(
                Path::new(&repo.path),
                bare,
                "a file:// remote is local: {repo:?}"
            );
        }
        let counts = repo.counts.context("counts")?;
        assert_eq!(counts.completed, counts.total, "{name}: {counts:?}");
    }

    // The checkers saw the other repository's work and the tests ran on the final app branch.
    let detail = |id: &str| {
        view.tasks
            .iter()
            .find(|t| t.id == id)
            .and_then(|t| t.result.as_ref())
            .and_then(|r| r.detail.clone())
    };
    let Some(Detail::Validation(validation)) = detail("VALIDATE-001") else {
        panic!("VALIDATE-001 has no validation:\n{report}");
    };
    assert!(
        validation
            .checks
            .iter()
            .any(|c| c.name.starts_with("IMPL-L12/") && c.status() == CheckStatus::Pass),
        "lib's files were checked in lib: {:?}",
        validation.checks
    );
    let Some(Detail::TestRun(run)) = detail("TESTRUN-001") else {
        panic!("TESTRUN-001 has no report:\n{report}");
    };
    assert_eq!(
        run.totals.map(|t| (t.passed, t.failed)),
        Some((1, 0)),
        "{run:?}"
    );
    let Some(Detail::Validation(verify)) = detail("VERIFY-001") else {
        panic!("VERIFY-001 has no report:\n{report}");
    };
    let goals = verify.verification.context("goal verification")?;
    assert_eq!(
        (goals.tasks_checked, goals.gaps.len()),
        (24, 0),
        "{goals:?}"
    );

    // Nothing was shared: every service's data dir is its own and closed to the others.
    for host in &hosts {
        let meta = std::fs::metadata(&host.data)?;
        assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), host.account.uid);
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
            0o700
        );
    }

    for (_, executor) in executors {
        executor.terminate(Duration::from_secs(20)).await?;
    }
    test_runner.terminate(Duration::from_secs(20)).await?;
    validator.terminate(Duration::from_secs(20)).await?;
    coordinator.terminate(Duration::from_secs(20)).await?;
    drop(daemon);
    Ok(())
}

/// The quickstart with its workers elsewhere: the four services as separate users sharing no
/// files, its repository an empty remote behind `git daemon` that `troupe run` seeds from the
/// plan's template, its agents travelling as plan assets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quickstart_runs_with_workers_that_share_nothing() -> anyhow::Result<()> {
    if !can_make_accounts()? {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let root = dir.path().to_path_buf();
    std::fs::set_permissions(&root, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let srv = root.join("srv");
    std::fs::create_dir_all(&srv)?;
    troupe_testkit::git(&srv, &["init", "-q", "--bare", "app.git"])?;
    troupe_testkit::git(
        &srv.join("app.git"),
        &["config", "daemon.receivepack", "true"],
    )?;
    let daemon = GitDaemon::start(&srv).await?;

    let hosts = [
        Host::new(&root, "coordinator", account("troupe-e2e-coord")?)?,
        Host::new(&root, "executor", account("troupe-e2e-exec-a")?)?,
        Host::new(&root, "validator", account("troupe-e2e-val")?)?,
        Host::new(&root, "test-runner", account("troupe-e2e-test")?)?,
    ];
    let [coord_host, exec_host, val_host, test_host] = &hosts;
    let coordinator = coord_host
        .start("troupe-coordinator", free_addr(), &[], &[])
        .await?;
    let url = coordinator.url();
    let validator = val_host
        .start(
            "troupe-validator",
            free_addr(),
            &["--coordinator-url", &url],
            &[],
        )
        .await?;
    let executor = executor(exec_host, "executor", &url, &validator.url()).await?;
    let test_runner = test_host
        .start(
            "troupe-test-runner",
            free_addr(),
            &["--coordinator-url", &url, "--python", "/usr/bin/python3"],
            &[],
        )
        .await?;

    let remote = daemon.url("app");
    let output = tokio::process::Command::new(crate::support::binary("troupe"))
        .arg("run")
        .arg(crate::support::quickstart_dir())
        .args(["--connect", &url, "--repo", &format!("app={remote}")])
        .env_remove("RUST_LOG")
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let logs: Vec<String> = hosts
        .iter()
        .map(|h| {
            format!(
                "== {}\n{}",
                h.account.name,
                troupe_process::tail(&h.log_text(), 20, 4000)
            )
        })
        .collect();
    assert!(
        output.status.success(),
        "troupe run failed: {}\n{stdout}\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr),
        logs.join("\n")
    );
    for expected in [
        &format!("seeded {remote} with template repo"),
        "IMPL-001       completed",
        "TESTRUN-001    completed",
        "VERIFY-001     completed",
        "tests passed: 6 passed, 0 failed, 0 skipped of 6",
        "session completed: 6 completed",
        &format!("of {remote} at "),
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}"
        );
    }
    let bare = srv.join("app.git");
    let branch = troupe_testkit::git(
        &bare,
        &[
            "for-each-ref",
            "--format=%(refname:short)",
            "refs/heads/troupe/",
        ],
    )?;
    let summary = troupe_testkit::git(
        &bare,
        &["show", &format!("{}:stats/report.py", branch.trim())],
    )?;
    assert!(summary.contains("def summary("), "{summary}");

    for service in [executor, test_runner, validator, coordinator] {
        service.terminate(Duration::from_secs(20)).await?;
    }
    Ok(())
}
