//! `troupe run --connect` and `troupe watch` through coordinator restarts: a real coordinator
//! process is killed (`kill -9`) and later stopped gracefully (SIGTERM), each time restarted on
//! the same port and data directory mid-session. Both commands keep going, print every event
//! line exactly once, and exit 0 when the session completed.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use tokio::process::{Child, Command};
use tokio_stream::StreamExt;
use troupe_proto::v1::WatchSessionRequest;

use crate::lease::{Scene, assert_committed_once, completed, coordinator, executor};
use crate::support::{binary, free_addr};

/// Starts `troupe args...` with stdout and stderr in files under `dir`, named `name.out` and
/// `name.err`.
fn troupe(dir: &Path, name: &str, args: &[&str]) -> anyhow::Result<Child> {
    let out = std::fs::File::create(dir.join(format!("{name}.out")))?;
    let err = std::fs::File::create(dir.join(format!("{name}.err")))?;
    Ok(Command::new(binary("troupe"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()?)
}

fn read(dir: &Path, file: &str) -> String {
    std::fs::read_to_string(dir.join(file)).unwrap_or_default()
}

/// The event lines (`[hh:mm:ss] ...`) of a command's output.
fn event_lines(output: &str) -> Vec<String> {
    output
        .lines()
        .filter(|line| line.starts_with('['))
        .map(str::to_owned)
        .collect()
}

/// Every event of the session, rendered as the CLI renders it.
async fn expected_lines(url: &str, session: &str) -> anyhow::Result<Vec<String>> {
    let mut events = troupe_grpc::coordinator_client(url)?
        .watch_session(WatchSessionRequest {
            session_id: session.to_owned(),
            after_sequence: 0,
            follow: false,
        })
        .await?
        .into_inner();
    let mut lines = Vec::new();
    while let Some(event) = events.next().await {
        lines.extend(troupe::report::event_line(&event?));
    }
    Ok(lines)
}

async fn exit_code(name: &str, child: &mut Child, dir: &Path) -> anyhow::Result<i32> {
    let status = tokio::time::timeout(Duration::from_secs(90), child.wait())
        .await
        .with_context(|| {
            format!(
                "troupe {name} did not finish; stderr:\n{}",
                read(dir, &format!("{name}.err"))
            )
        })??;
    status.code().context("killed by a signal")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_connect_and_watch_survive_coordinator_restarts() -> anyhow::Result<()> {
    let scene = Scene::new(
        "reconnect",
        &[
            ("IMPL-1", &[]),
            ("IMPL-2", &["IMPL-1"]),
            ("IMPL-3", &["IMPL-2"]),
        ],
    )?;
    scene.hold("IMPL-2")?;
    scene.hold("IMPL-3")?;
    let addr = free_addr();
    let data = scene.path("coordinator");
    let first = coordinator(addr, &data).await;
    let url = first.url();
    let log = scene.path("executor.log");
    let executor = executor(&url, &scene.path("executor"), "30", "2", &log).await;
    let out = scene.dir.path();

    let plan = scene.plan_dir().join("plan.json").display().to_string();
    let reconnect = ["--connect", url.as_str(), "--reconnect-seconds", "60"];
    let mut run = troupe(
        out,
        "run",
        &[&["run", plan.as_str()][..], &reconnect].concat(),
    )?;
    let session = troupe_testkit::eventually("`troupe run` to print the session", || async {
        let text = read(out, "run.out");
        let header = text.lines().next()?.strip_prefix("session ")?;
        Some(header.split_whitespace().next()?.to_owned())
    })
    .await;
    let mut watch = troupe(
        out,
        "watch",
        &[&["watch", session.as_str()][..], &reconnect].concat(),
    )?;

    // kill -9 while IMPL-2 runs, back 1.5 s later on the same port and data.
    scene.agent_started("IMPL-2", 1).await;
    first.kill9().await?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let second = coordinator(addr, &data).await;
    scene.release("IMPL-2")?;

    // A graceful stop while IMPL-3 runs: the watch streams end cleanly mid-session.
    scene.agent_started("IMPL-3", 1).await;
    second.terminate(Duration::from_secs(20)).await?;
    let third = coordinator(addr, &data).await;
    scene.release("IMPL-3")?;

    assert_eq!(
        exit_code("run", &mut run, out).await?,
        0,
        "{}",
        read(out, "run.err")
    );
    assert_eq!(
        exit_code("watch", &mut watch, out).await?,
        0,
        "{}",
        read(out, "watch.err")
    );
    let view = completed(&url, &session, &log).await;
    assert_committed_once(&view, &[("IMPL-1", 1), ("IMPL-2", 1), ("IMPL-3", 1)]);

    let expected = expected_lines(&url, &session).await?;
    assert!(expected.len() > 10, "{expected:?}");
    for name in ["run", "watch"] {
        let printed = read(out, &format!("{name}.out"));
        assert_eq!(
            event_lines(&printed),
            expected,
            "troupe {name} printed other event lines than the session's events:\n{printed}"
        );
        let notices = read(out, &format!("{name}.err"));
        eprintln!("troupe {name} on stderr:\n{notices}");
        assert!(
            notices.contains("lost the coordinator") && notices.contains("resuming after event"),
            "troupe {name} said nothing of the restarts:\n{notices}"
        );
    }
    // The report still comes at the end.
    let printed = read(out, "run.out");
    assert!(
        printed.contains(&format!("report for session {session}")),
        "{printed}"
    );

    executor.terminate(Duration::from_secs(20)).await?;
    third.terminate(Duration::from_secs(20)).await?;
    Ok(())
}

/// A coordinator that stays away: `troupe watch` gives up after `--reconnect-seconds` with
/// exit code 69.
#[tokio::test]
async fn watch_exits_69_when_the_coordinator_stays_unreachable() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let url = format!("http://{}", free_addr());
    let started = std::time::Instant::now();
    let mut watch = troupe(
        dir.path(),
        "watch",
        &[
            "watch",
            "s-1",
            "--connect",
            &url,
            "--reconnect-seconds",
            "1",
        ],
    )?;
    assert_eq!(exit_code("watch", &mut watch, dir.path()).await?, 69);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(1) && waited < Duration::from_secs(10),
        "gave up after {waited:?}"
    );
    let notices = read(dir.path(), "watch.err");
    assert!(notices.contains("lost the coordinator"), "{notices}");
    assert!(notices.contains("--reconnect-seconds"), "{notices}");
    Ok(())
}
