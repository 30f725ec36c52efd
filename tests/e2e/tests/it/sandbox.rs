//! Confined agents, end to end: one plan whose `command` agents, pre_analysis `bash` steps and
//! verification commands each try to leave their worktree (write outside, read another
//! session's worktree, read the coordinator's SQLite store, read `~/.ssh`, follow a symlink
//! committed in the repository, connect to a port that is not allowed). The services run as
//! their own processes with a fake `$HOME`; the kernel (Landlock) refuses every attempt and
//! each task fails as SANDBOX_DENIED naming what was refused.

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use troupe_proto::v1::{
    CreateSessionRequest, ErrorKind, GetSessionRequest, TaskState, WatchSessionRequest,
};

use crate::support::ChildService;
use tokio_stream::StreamExt;

/// One escape attempt: a bash script and what the failure must name.
struct Attack {
    name: &'static str,
    script: String,
    names: String,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_pre_analysis_and_verification_cannot_leave_their_worktree() -> anyhow::Result<()> {
    if troupe_process::sandbox::landlock_abi().unwrap_or(0) < 4 {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI runs on a kernel with Landlock ABI 4 or newer"
        );
        return Ok(());
    }
    let root = tempfile::tempdir()?;
    let root = root.path().canonicalize()?;
    let dir = |name: &str| root.join(name);
    let (coordinator_dir, executor_dir, validator_dir) =
        (dir("coordinator"), dir("executor"), dir("validator"));
    // The services' own home, with credentials an agent must never read.
    let home = dir("home");
    std::fs::create_dir_all(home.join(".ssh"))?;
    std::fs::write(home.join(".ssh/id_ed25519"), "PRIVATE KEY\n")?;
    let outside = dir("outside");
    std::fs::create_dir_all(&outside)?;
    let store = coordinator_dir.join("troupe.db");
    // A listener the agents must not reach (connections are allowed to 443 only).
    let forbidden = std::net::TcpListener::bind("127.0.0.1:0")?;
    forbidden.set_nonblocking(true)?;
    let port = forbidden.local_addr()?.port();

    // The repository commits a symlink to the store.
    let repo = dir("app");
    troupe_testkit::git_repo(&repo, &[("README.md", "app\n")])?;
    std::os::unix::fs::symlink(&store, repo.join("escape"))?;
    troupe_testkit::git(&repo, &["add", "escape"])?;
    troupe_testkit::git(&repo, &["commit", "-qm", "a link out"])?;

    let env = [("HOME", home.to_str().unwrap_or_default())];
    let sandbox = ["--sandbox", "enforce", "--sandbox-connect-ports", "443"];
    let coordinator = ChildService::start(
        "troupe-coordinator",
        &["--data-dir", &coordinator_dir.display().to_string()],
        &env,
    )
    .await?;
    let url = coordinator.url();
    let mut workers = Vec::new();
    for (name, data) in [
        ("troupe-executor", &executor_dir),
        ("troupe-validator", &validator_dir),
    ] {
        let data = data.display().to_string();
        let mut args = vec!["--data-dir", &data, "--coordinator-url", &url];
        args.extend(sandbox);
        workers.push(ChildService::start(name, &args, &env).await?);
    }
    // Another session's worktree on each worker (made after start: the executor clears its
    // worktrees at boot).
    let other_worktree = |data: &Path| -> anyhow::Result<std::path::PathBuf> {
        let other = data.join("worktrees/tasks/other-session/IMPL-9-1");
        std::fs::create_dir_all(&other)?;
        std::fs::write(other.join("secret.txt"), "another session's work\n")?;
        Ok(other.join("secret.txt"))
    };
    let other_executor = other_worktree(&executor_dir)?;
    let other_validator = other_worktree(&validator_dir)?;

    let attacks = |other: &Path| {
        vec![
            Attack {
                name: "write",
                script: format!("echo pwned > {}/escaped.txt", outside.display()),
                names: format!("{}/escaped.txt", outside.display()),
            },
            Attack {
                name: "other",
                script: format!("cat {}", other.display()),
                names: other.display().to_string(),
            },
            Attack {
                name: "store",
                script: format!("cat {}", store.display()),
                names: store.display().to_string(),
            },
            Attack {
                name: "ssh",
                script: format!("cat {}/.ssh/id_ed25519", home.display()),
                names: format!("{}/.ssh/id_ed25519", home.display()),
            },
            Attack {
                name: "symlink",
                script: "cat escape".to_owned(),
                names: format!("escape -> {}", store.display()),
            },
            Attack {
                name: "port",
                script: format!("exec 3<>/dev/tcp/127.0.0.1/{port}"),
                names: format!("tcp port {port}"),
            },
        ]
    };
    let mut tasks = Vec::new();
    let mut expected = Vec::new();
    for attack in attacks(&other_executor) {
        let id = format!("IMPL-AGENT-{}", attack.name.to_uppercase());
        tasks.push(json!({
            "id": id, "title": format!("agent: {}", attack.name),
            "description": "a hostile agent",
            "agent": {"backend": "command", "command": ["bash", "-c", attack.script]},
        }));
        expected.push((id, attack.names.clone()));
        let id = format!("IMPL-PRE-{}", attack.name.to_uppercase());
        tasks.push(json!({
            "id": id, "title": format!("pre_analysis: {}", attack.name),
            "description": "a hostile pre_analysis step",
            "pre_analysis": [{"step": "probe", "commands": [["bash", "-c", attack.script]],
                "on_error": "fail"}],
            "agent": {"backend": "command", "command": ["true"]},
        }));
        expected.push((id, attack.names));
    }
    for attack in attacks(&other_validator) {
        let id = format!("VALIDATE-{}", attack.name.to_uppercase());
        tasks.push(json!({
            "id": id, "title": format!("verification: {}", attack.name),
            "description": "a hostile verification command",
            "convergence": {"verification": ["bash", "-c", attack.script]},
        }));
        expected.push((id, attack.names));
    }
    let plan = json!({
        "name": "hostile", "description": "agents that try to get out",
        "on_failure": "skip", "max_attempts": 1,
        "repos": {"app": {"path": repo.display().to_string()}},
        "tasks": tasks,
    });

    let mut client = troupe_grpc::Connector::default().coordinator_client(&url)?;
    let created = client
        .create_session(CreateSessionRequest {
            plan_json: plan.to_string(),
            base_dir: root.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let session_id = created.session.expect("session").id;
    let mut events = client
        .watch_session(WatchSessionRequest {
            session_id: session_id.clone(),
            after_sequence: 0,
            follow: false,
        })
        .await?
        .into_inner();
    tokio::time::timeout(Duration::from_secs(240), async {
        while let Some(event) = events.next().await {
            event?;
        }
        anyhow::Ok(())
    })
    .await??;
    let session = client
        .get_session(GetSessionRequest {
            session_id,
            ..Default::default()
        })
        .await?
        .into_inner();

    let report = troupe::report::final_report(&session);
    for (id, names) in &expected {
        let task = session
            .tasks
            .iter()
            .find(|task| &task.id == id)
            .unwrap_or_else(|| panic!("no task {id}"));
        assert_eq!(task.state, TaskState::Failed as i32, "{id}:\n{report}");
        let error = task.last_error.as_ref().expect("an error");
        assert_eq!(error.kind(), ErrorKind::SandboxDenied, "{id}: {error:?}");
        assert!(
            error.message.contains(names.as_str()),
            "{id} must name {names}: {}",
            error.message
        );
    }
    // The kernel refused the side effects themselves.
    assert!(!outside.join("escaped.txt").exists(), "a write landed");
    assert!(
        matches!(forbidden.accept(), Err(err) if err.kind() == std::io::ErrorKind::WouldBlock),
        "a connection reached the forbidden port"
    );
    // What an agent reads never reaches a result either.
    let dump = format!("{session:?}");
    for secret in ["PRIVATE KEY", "another session's work"] {
        assert!(!dump.contains(secret), "{secret} leaked into the session");
    }

    for worker in workers {
        worker.terminate(Duration::from_secs(20)).await?;
    }
    coordinator.terminate(Duration::from_secs(20)).await?;
    Ok(())
}
