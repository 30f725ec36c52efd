//! An agent's processes never outlive its executor: `kill -9` of the executor binary mid-task
//! takes the agent's whole process group down (the reaper), and when even the reaper could not
//! act, the executor's next start on the same data dir kills the survivors (the records).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use troupe_proto::v1::ExecuteTaskRequest;
use troupe_proto::v1::executor_client::ExecutorClient;

use crate::support::ChildService;

/// The agent: a background grandchild and the leader itself keep appending to files until
/// they are killed. `$1` is the directory they write to. (No braces: the command backend
/// substitutes `{placeholders}` in argv.)
const AGENT: &str = r#"out=$1
( while :; do echo x >> "$out/grandchild.log"; sleep 0.02; done ) &
echo "$$ $!" > "$out/pids.partial" && mv "$out/pids.partial" "$out/pids"
while :; do echo x >> "$out/leader.log"; sleep 0.02; done"#;

#[derive(Debug, Clone, Copy)]
struct Stat {
    ppid: i32,
    pgrp: i32,
    zombie: bool,
}

fn stat(pid: i32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = text[text.rfind(')')? + 1..].split_whitespace().collect();
    Some(Stat {
        zombie: matches!(*fields.first()?, "Z" | "X"),
        ppid: fields.get(1)?.parse().ok()?,
        pgrp: fields.get(2)?.parse().ok()?,
    })
}

fn all_pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Live (non-zombie) processes in group `pgid`.
fn group_members(pgid: i32) -> Vec<i32> {
    all_pids()
        .into_iter()
        .filter(|pid| stat(*pid).is_some_and(|s| s.pgrp == pgid && !s.zombie))
        .collect()
}

fn alive(pid: i32) -> bool {
    stat(pid).is_some_and(|s| !s.zombie)
}

/// The reaper of the process `parent`: its child named `troupe-reaper`.
fn reaper_of(parent: i32) -> Option<i32> {
    all_pids().into_iter().find(|pid| {
        stat(*pid).is_some_and(|s| s.ppid == parent && !s.zombie)
            && std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|cmd| cmd.starts_with(b"troupe-reaper\0"))
    })
}

fn size(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// SIGKILLs the groups it holds when dropped, so a failing test leaks no agent.
struct KillGroups(Vec<i32>);

impl Drop for KillGroups {
    fn drop(&mut self) {
        for pgid in &self.0 {
            if !group_members(*pgid).is_empty() {
                let _ = nix::sys::signal::killpg(Pid::from_raw(*pgid), Signal::SIGKILL);
            }
        }
    }
}

struct Setup {
    _dirs: Vec<tempfile::TempDir>,
    repo: PathBuf,
    data: PathBuf,
    out: PathBuf,
}

fn setup() -> anyhow::Result<Setup> {
    let repo_dir = tempfile::tempdir()?;
    let data = tempfile::tempdir()?;
    let out = tempfile::tempdir()?;
    let repo = repo_dir.path().join("app");
    troupe_testkit::git_repo(&repo, &[("README.md", "app\n")])?;
    Ok(Setup {
        repo,
        data: data.path().to_path_buf(),
        out: out.path().to_path_buf(),
        _dirs: vec![repo_dir, data, out],
    })
}

/// The executor on `data`; its (confined) agents may write to `out`, where they report.
async fn start_executor(data: &Path, out: &Path) -> anyhow::Result<ChildService> {
    ChildService::start(
        "troupe-executor",
        &[
            "--data-dir",
            &data.display().to_string(),
            "--sandbox-write-path",
            &out.display().to_string(),
        ],
        &[],
    )
    .await
}

/// Starts task `id` on `executor` (the call is left running) and waits until its agent runs;
/// returns the agent's group id and its grandchild's pid.
async fn start_agent(
    executor: &ChildService,
    setup: &Setup,
    id: &str,
) -> anyhow::Result<(i32, i32, PathBuf)> {
    let out = setup.out.join(id);
    std::fs::create_dir_all(&out)?;
    let task = json!({
        "id": id,
        "title": "Keep writing",
        "agent": {"command": ["sh", "-c", AGENT, "agent", out.display().to_string()]},
    });
    let request = ExecuteTaskRequest {
        repo_path: setup.repo.display().to_string(),
        base_ref: "main".to_owned(),
        branch: String::new(),
        task: Some(troupe_proto::json::to_struct(&task)),
        base_dir: setup.repo.display().to_string(),
    };
    let mut client = ExecutorClient::new(troupe_grpc::channel(&executor.url())?);
    // Never answers: the executor is killed under it.
    tokio::spawn(async move { client.execute_task(request).await });
    let pids_file = out.join("pids");
    let pids = troupe_testkit::eventually(&format!("{id}'s agent to start"), || {
        let pids_file = pids_file.clone();
        async move { std::fs::read_to_string(&pids_file).ok() }
    })
    .await;
    let (leader, grandchild) = pids
        .split_once(' ')
        .and_then(|(a, b)| Some((a.parse().ok()?, b.trim().parse().ok()?)))
        .context("two pids")?;
    let log = out.join("grandchild.log");
    troupe_testkit::eventually("the grandchild to write", || {
        let log = log.clone();
        async move { (size(&log) > 0).then_some(()) }
    })
    .await;
    assert_eq!(stat(grandchild).context("grandchild")?.pgrp, leader);
    Ok((leader, grandchild, log))
}

/// Asserts that `log` no longer grows.
async fn assert_still(log: &Path) {
    let before = size(log);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(size(log), before, "{} still grows", log.display());
}

#[tokio::test]
async fn an_agent_dies_with_its_killed_executor_or_at_the_next_start() -> anyhow::Result<()> {
    let setup = setup()?;
    let mut groups = KillGroups(Vec::new());

    // kill -9 of the executor mid-run: the reaper takes the agent's whole group down.
    let mut executor = start_executor(&setup.data, &setup.out).await?;
    let executor_pid = i32::try_from(executor.child.id().context("executor pid")?)?;
    let (pgid, grandchild, log) = start_agent(&executor, &setup, "IMPL-001").await?;
    groups.0.push(pgid);
    let reaper = reaper_of(executor_pid).context("the executor runs a reaper")?;
    assert!(
        setup.data.join("children").join(pgid.to_string()).is_file(),
        "the live group is recorded"
    );
    let killed_at = Instant::now();
    executor.child.start_kill()?;
    executor.child.wait().await?;
    troupe_testkit::eventually(
        "the agent's group to die with its executor",
        move || async move { group_members(pgid).is_empty().then_some(()) },
    )
    .await;
    let gone_after = killed_at.elapsed();
    eprintln!("agent group gone {gone_after:?} after kill -9 of its executor");
    assert!(gone_after < Duration::from_secs(2), "{gone_after:?}");
    assert!(!alive(grandchild));
    assert!(!alive(reaper), "the reaper does not outlive its executor");
    assert_still(&log).await;

    // Now the reaper cannot act: stop the executor (so it cannot start another reaper), kill
    // the reaper, then the executor. The agent survives, recorded; the next start kills it.
    let mut executor = start_executor(&setup.data, &setup.out).await?;
    let executor_pid = i32::try_from(executor.child.id().context("executor pid")?)?;
    let (pgid, grandchild, log) = start_agent(&executor, &setup, "IMPL-002").await?;
    groups.0.push(pgid);
    let record = setup.data.join("children").join(pgid.to_string());
    let reaper = reaper_of(executor_pid).context("the executor runs a reaper")?;
    kill(Pid::from_raw(executor_pid), Signal::SIGSTOP)?;
    kill(Pid::from_raw(reaper), Signal::SIGKILL)?;
    troupe_testkit::eventually("the reaper to die", move || async move {
        (!alive(reaper)).then_some(())
    })
    .await;
    executor.child.start_kill()?;
    executor.child.wait().await?;
    let before = size(&log);
    troupe_testkit::eventually("the orphaned agent to keep writing", || {
        let log = log.clone();
        async move { (size(&log) > before).then_some(()) }
    })
    .await;
    assert!(alive(pgid) && alive(grandchild), "an orphan survives");
    assert!(record.is_file(), "and its record with it");

    // The executor kills it before it serves anything.
    let executor = start_executor(&setup.data, &setup.out).await?;
    let left = group_members(pgid);
    assert!(
        left.is_empty(),
        "the orphan was not killed at boot: {left:?}"
    );
    assert!(!record.exists(), "its record is removed");
    assert_still(&log).await;
    executor.terminate(Duration::from_secs(20)).await?;
    Ok(())
}
