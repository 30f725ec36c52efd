//! Repositories behind remotes that do not cooperate: unreachable, a ref that is not there,
//! credentials the server refuses, a server whose hook refuses the push. And a credential
//! given through the environment: it reaches git and nothing else.

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use troupe_proto::v1::{
    CreateSessionRequest, ErrorKind, GetSessionRequest, ListSessionsRequest, SessionState,
};

use crate::hosts::{GitDaemon, HttpGit, bare_repo};
use crate::support::{ChildService, free_addr};

const AGENT: &str = r#"
import pathlib, sys
sys.stdin.read()
worktree, task = pathlib.Path(sys.argv[1]), sys.argv[2]
(worktree / f"{task}.txt").write_text(f"{task}\n")
"#;

fn impl_task(id: &str) -> serde_json::Value {
    json!({"id": id, "title": format!("write {id}.txt"), "max_attempts": 1,
        "files": [{"path": format!("{id}.txt"), "action": "create"}],
        "agent": {"backend": "command",
            "command": ["python3", "{plan_dir}/agents/write.py", "{worktree}", id]}})
}

fn plan_dir(root: &Path) -> anyhow::Result<std::path::PathBuf> {
    let dir = root.join("plan");
    std::fs::create_dir_all(dir.join("agents"))?;
    std::fs::write(dir.join("agents/write.py"), AGENT)?;
    Ok(dir)
}

async fn create(
    url: &str,
    plan: &serde_json::Value,
    plan_dir: &Path,
) -> Result<String, tonic::Status> {
    let plan_json = plan.to_string();
    let assets = troupe::assets::collect(&plan_json, plan_dir).expect("assets");
    let created = troupe_grpc::coordinator_client(url)
        .expect("client")
        .create_session(CreateSessionRequest {
            plan_json,
            base_dir: plan_dir.display().to_string(),
            assets,
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(created.session.expect("session").id)
}

fn credentials(root: &Path, prefix: &str, variable: &str) -> anyhow::Result<String> {
    let path = root.join("git-credentials.toml");
    std::fs::write(
        &path,
        format!("[[remote]]\nprefix = \"{prefix}\"\ntoken_env = \"{variable}\"\n"),
    )?;
    Ok(path.display().to_string())
}

/// Every repository that cannot be used is named at intake, all at once, and nothing is
/// stored: an unreachable URL, a base that is not there, a server that refuses the
/// coordinator's token. A server that refuses the push fails the task, naming the remote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_repositories_are_refused_naming_them() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let root = dir.path();
    let srv = root.join("srv");
    std::fs::create_dir_all(&srv)?;
    bare_repo(&srv.join("app.git"), &[("README.md", "app\n")])?;
    bare_repo(&srv.join("guarded.git"), &[("README.md", "guarded\n")])?;
    let hook = srv.join("guarded.git/hooks/pre-receive");
    std::fs::write(
        &hook,
        "#!/bin/sh\necho 'troupe branches are not welcome here' >&2\nexit 1\n",
    )?;
    std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    for repo in ["app.git", "guarded.git"] {
        troupe_testkit::git(&srv.join(repo), &["config", "daemon.receivepack", "true"])?;
    }
    let daemon = GitDaemon::start(&srv).await?;
    let http = HttpGit::start(&srv, "the-right-token").await?;
    let prefix = format!("http://127.0.0.1:{}/", http.port);
    let creds = credentials(root, &prefix, "E2E_GIT_TOKEN")?;
    let coordinator = ChildService::start(
        "troupe-coordinator",
        &[
            "--data-dir",
            &root.join("coordinator").display().to_string(),
            "--git-credentials",
            &creds,
        ],
        &[("E2E_GIT_TOKEN", "a-wrong-token")],
    )
    .await?;
    let url = coordinator.url();
    let plan_dir = plan_dir(root)?;

    let plan = json!({"name": "bad", "repos": {
            "gone": {"url": "git://127.0.0.1:1/gone.git"},
            "app": {"url": daemon.url("app"), "base": "no-such-branch"},
            "private": {"url": http.url("app")}},
        "tasks": [impl_task("IMPL-1")]});
    let status = create(&url, &plan, &plan_dir).await.expect_err("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    let message = status.message();
    for expected in [
        "repo `gone`: repository git://127.0.0.1:1/gone.git is unreachable",
        "repo `app`: base `no-such-branch` does not name a commit",
        "repo `private`: repository http://127.0.0.1:",
    ] {
        assert!(
            message.contains(expected),
            "{expected:?} not in:\n{message}"
        );
    }
    assert!(!message.contains("a-wrong-token"), "{message}");
    let sessions = troupe_grpc::coordinator_client(&url)?
        .list_sessions(ListSessionsRequest::default())
        .await?
        .into_inner()
        .sessions;
    assert!(sessions.is_empty(), "nothing is stored: {sessions:?}");
    let branches = troupe_testkit::git(&srv.join("app.git"), &["branch", "--list", "troupe/*"])?;
    assert!(
        branches.is_empty(),
        "no session branch was made: {branches}"
    );

    // A remote whose hook refuses the push: the task fails with the remote's refusal.
    let executor = ChildService::start(
        "troupe-executor",
        &[
            "--data-dir",
            &root.join("executor").display().to_string(),
            "--coordinator-url",
            &url,
        ],
        &[],
    )
    .await?;
    let plan = json!({"name": "guarded", "repos": {"app": {"url": daemon.url("guarded")}},
        "tasks": [impl_task("IMPL-1")]});
    let id = create(&url, &plan, &plan_dir).await?;
    let task = troupe_testkit::eventually("the guarded task to fail", || {
        let url = url.clone();
        let id = id.clone();
        async move {
            let view = troupe_grpc::coordinator_client(&url)
                .ok()?
                .get_session(GetSessionRequest {
                    session_id: id,
                    ..Default::default()
                })
                .await
                .ok()?
                .into_inner();
            view.session
                .filter(|s| s.state() == SessionState::Failed)
                .and(view.tasks.into_iter().next())
        }
    })
    .await;
    let error = task.last_error.expect("an error");
    assert_eq!(error.kind(), ErrorKind::Repository, "{error:?}");
    assert!(
        error.message.contains(&daemon.url("guarded"))
            && error.message.contains("refused the push"),
        "{}",
        error.message
    );

    executor.terminate(Duration::from_secs(20)).await?;
    coordinator.terminate(Duration::from_secs(20)).await?;
    Ok(())
}

/// A token given to the services through the environment reaches the git server (a session
/// over a token-protected remote completes) and appears nowhere troupe writes: not in any
/// service's log, the store, the session's results or the remote's commits and refs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_git_token_from_the_environment_appears_nowhere() -> anyhow::Result<()> {
    const TOKEN: &str = "tok-9f1c2e7a-never-write-me";
    let dir = tempfile::tempdir()?;
    let root = dir.path();
    let srv = root.join("srv");
    std::fs::create_dir_all(&srv)?;
    bare_repo(&srv.join("app.git"), &[("README.md", "app\n")])?;
    let http = HttpGit::start(&srv, TOKEN).await?;
    let creds = credentials(
        root,
        &format!("http://127.0.0.1:{}/", http.port),
        "E2E_GIT_TOKEN",
    )?;
    let env = [("E2E_GIT_TOKEN", TOKEN), ("RUST_LOG", "debug")];
    let log = |name: &str| root.join(format!("{name}.log"));
    let data = |name: &str| root.join(name).display().to_string();
    let coordinator = ChildService::start_at(
        "troupe-coordinator",
        free_addr(),
        &[
            "--data-dir",
            &data("coordinator"),
            "--git-credentials",
            &creds,
        ],
        &env,
        Some(&log("coordinator")),
    )
    .await?;
    let url = coordinator.url();
    let validator = ChildService::start_at(
        "troupe-validator",
        free_addr(),
        &[
            "--data-dir",
            &data("validator"),
            "--coordinator-url",
            &url,
            "--git-credentials",
            &creds,
        ],
        &env,
        Some(&log("validator")),
    )
    .await?;
    let validator_url = validator.url();
    let executor = ChildService::start_at(
        "troupe-executor",
        free_addr(),
        &[
            "--data-dir",
            &data("executor"),
            "--coordinator-url",
            &url,
            "--validator-url",
            &validator_url,
            "--git-credentials",
            &creds,
        ],
        &env,
        Some(&log("executor")),
    )
    .await?;
    let plan_dir = plan_dir(root)?;
    let plan = json!({"name": "private", "repos": {"app": {"url": http.url("app")}},
        "tasks": [impl_task("IMPL-1"), impl_task("IMPL-2"),
            {"id": "VALIDATE-1", "title": "check", "depends_on": ["IMPL-1", "IMPL-2"]}]});
    let id = create(&url, &plan, &plan_dir).await?;
    // Three tasks over an HTTP git server: seconds alone, longer beside a full test run.
    let view = troupe_testkit::eventually_within(
        "the private session to complete",
        Duration::from_secs(120),
        || {
            let url = url.clone();
            let id = id.clone();
            async move {
                let view = troupe_grpc::coordinator_client(&url)
                    .ok()?
                    .get_session(GetSessionRequest {
                        session_id: id,
                        ..Default::default()
                    })
                    .await
                    .ok()?
                    .into_inner();
                view.session
                    .as_ref()
                    .is_some_and(|s| s.state() == SessionState::Completed)
                    .then_some(view)
            }
        },
    )
    .await;
    let landed = troupe_testkit::git(
        &srv.join("app.git"),
        &["log", "--oneline", &format!("troupe/{id}")],
    )?;
    assert!(landed.contains("IMPL-2"), "{landed}");

    executor.terminate(Duration::from_secs(20)).await?;
    validator.terminate(Duration::from_secs(20)).await?;
    coordinator.terminate(Duration::from_secs(20)).await?;

    // Logs, data dirs (the store, mirrors, attempts, worktrees), the results, the remote.
    let mut hits = Vec::new();
    for name in ["coordinator", "validator", "executor"] {
        scan(&log(name), TOKEN, &mut hits);
        scan(&root.join(name), TOKEN, &mut hits);
    }
    if format!("{view:?}").contains(TOKEN) {
        hits.push("GetSession".to_owned());
    }
    let remote = troupe_testkit::git(
        &srv.join("app.git"),
        &["log", "--all", "-p", "--format=%H%n%B"],
    )?;
    if remote.contains(TOKEN) {
        hits.push("the remote's commits".to_owned());
    }
    let refs = troupe_testkit::git(&srv.join("app.git"), &["for-each-ref"])?;
    if refs.contains(TOKEN) {
        hits.push("the remote's refs".to_owned());
    }
    assert!(hits.is_empty(), "the token leaked into: {hits:?}");
    Ok(())
}

/// Adds every file under `path` whose bytes contain `needle` to `hits`.
fn scan(path: &Path, needle: &str, hits: &mut Vec<String>) {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return;
    };
    if meta.is_dir() {
        for entry in std::fs::read_dir(path).into_iter().flatten().flatten() {
            scan(&entry.path(), needle, hits);
        }
    } else if meta.is_file()
        && let Ok(bytes) = std::fs::read(path)
        && bytes
            .windows(needle.len())
            .any(|window| window == needle.as_bytes())
    {
        hits.push(path.display().to_string());
    }
}
