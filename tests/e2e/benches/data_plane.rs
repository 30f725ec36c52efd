//! The data plane's cost: the same multi-repo session against local `path` repositories and
//! against the same repositories behind `git daemon`, each with cold mirrors (a fresh data
//! dir: every worker's first fetch is a clone) and warm ones (a second session on the same
//! data dir: fetches are incremental). All four services run in this process (`troupe up`'s
//! assembly), so the figures are git's and troupe's, not the network's.
//!
//! ```sh
//! cargo bench -p troupe-e2e --bench data_plane -- --tasks 30 --repos 3 --history 2000 --files 500
//! ```
//!
//! Each task is an IMPL task whose `command` agent writes one file; the executor claims its
//! fence, fetches, makes a worktree, commits, shares the commit with the validator
//! (self-validation), and lands it with the fenced push.

use std::path::Path;
use std::time::{Duration, Instant};

use std::os::unix::process::CommandExt;

use anyhow::Context;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use troupe::embedded::{Embedded, EmbeddedConfig};
use troupe_proto::v1::{CreateSessionRequest, GetSessionRequest, SessionState};

#[derive(Debug, Clone, Copy)]
struct Args {
    tasks: usize,
    repos: usize,
    history: usize,
    files: usize,
    rounds: usize,
}

fn args() -> Args {
    let mut args = Args {
        tasks: 30,
        repos: 3,
        history: 2000,
        files: 500,
        rounds: 2,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().and_then(|v| v.parse().ok()).unwrap_or(0);
        match flag.as_str() {
            "--tasks" => args.tasks = value(),
            "--repos" => args.repos = value(),
            "--history" => args.history = value(),
            "--files" => args.files = value(),
            "--rounds" => args.rounds = value(),
            _ => {}
        }
    }
    args
}

const AGENT: &str = "import pathlib, sys\nsys.stdin.read()\n(pathlib.Path(sys.argv[1]) / f\"out/{sys.argv[2]}.txt\").parent.mkdir(exist_ok=True)\n(pathlib.Path(sys.argv[1]) / f\"out/{sys.argv[2]}.txt\").write_text(sys.argv[2])\n";

fn git(dir: &Path, args: &[&str]) -> anyhow::Result<String> {
    troupe_testkit::git(dir, args)
}

/// A repository with `files` files and `history` commits, as a bare repository at `bare`.
fn make_repo(bare: &Path, files: usize, history: usize) -> anyhow::Result<()> {
    let scratch = tempfile::tempdir()?;
    let work = scratch.path();
    let initial: Vec<(String, String)> = (0..files)
        .map(|n| (format!("src/f{n:04}.txt"), format!("file {n}\n").repeat(20)))
        .collect();
    let refs: Vec<(&str, &str)> = initial
        .iter()
        .map(|(p, c)| (p.as_str(), c.as_str()))
        .collect();
    troupe_testkit::git_repo(work, &refs)?;
    // History through fast-import: thousands of commits in one process.
    let mut stream = String::new();
    for n in 0..history {
        let content = format!("change {n}\n");
        stream.push_str(&format!(
            "commit refs/heads/main\ncommitter bench <bench@localhost> {} +0000\ndata 9\nchange {:02}\n{}M 100644 inline history/h{:03}.txt\ndata {}\n{content}\n",
            1_700_000_000 + n,
            n % 100,
            if n == 0 { "from refs/heads/main^0\n" } else { "" },
            n % 500,
            content.len()
        ));
    }
    let mut child = std::process::Command::new("git")
        .args(["-C", &work.display().to_string(), "fast-import", "--quiet"])
        .stdin(std::process::Stdio::piped())
        .spawn()?;
    std::io::Write::write_all(child.stdin.as_mut().context("stdin")?, stream.as_bytes())?;
    drop(child.stdin.take());
    anyhow::ensure!(child.wait()?.success(), "fast-import failed");
    git(
        work,
        &["clone", "-q", "--bare", ".", &bare.display().to_string()],
    )?;
    git(bare, &["config", "daemon.receivepack", "true"])?;
    Ok(())
}

fn plan(locations: &[String], tasks: usize) -> serde_json::Value {
    let repos: serde_json::Map<String, serde_json::Value> = locations
        .iter()
        .enumerate()
        .map(|(i, location)| {
            let key = if location.contains("://") {
                "url"
            } else {
                "path"
            };
            (format!("r{i}"), json!({key: location}))
        })
        .collect();
    let tasks: Vec<_> = (0..tasks)
        .map(|n| {
            let id = format!("IMPL-{n:03}");
            json!({"id": id, "title": id, "repo": format!("r{}", n % locations.len()),
                "files": [{"path": format!("out/{id}.txt"), "action": "create"}],
                "agent": {"backend": "command",
                    "command": ["python3", "{plan_dir}/agent.py", "{worktree}", id]}})
        })
        .collect();
    json!({"name": "bench", "repos": repos, "tasks": tasks})
}

/// Runs one session to completion; returns its wall time.
async fn session(url: &str, plan: &serde_json::Value, plan_dir: &Path) -> anyhow::Result<Duration> {
    let mut client = troupe_grpc::coordinator_client(url)?;
    let started = Instant::now();
    let id = client
        .create_session(CreateSessionRequest {
            plan_json: plan.to_string(),
            base_dir: plan_dir.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .session
        .context("session")?
        .id;
    loop {
        let view = client
            .get_session(GetSessionRequest {
                session_id: id.clone(),
                ..Default::default()
            })
            .await?
            .into_inner();
        match view.session.as_ref().map(|s| s.state()) {
            Some(SessionState::Completed) => return Ok(started.elapsed()),
            Some(SessionState::Failed | SessionState::Cancelled) => {
                anyhow::bail!("session failed:\n{}", troupe::report::final_report(&view))
            }
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Cold then warm sessions against `locations`, each on a fresh data dir per round.
async fn measure(
    locations: &[String],
    args: Args,
    plan_dir: &Path,
) -> anyhow::Result<Vec<(Duration, Duration)>> {
    let mut out = Vec::new();
    for _ in 0..args.rounds {
        let data = tempfile::tempdir()?;
        let shutdown = CancellationToken::new();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let embedded = Embedded::start(
            EmbeddedConfig {
                data_dir: data.path().to_path_buf(),
                executor_concurrency: 4,
                python: "python3".into(),
                security: Default::default(),
            },
            listener,
            shutdown.clone(),
        )
        .await?;
        let url = troupe_grpc::url_for(embedded.addr());
        let plan = plan(locations, args.tasks);
        let cold = session(&url, &plan, plan_dir).await?;
        let warm = session(&url, &plan, plan_dir).await?;
        shutdown.cancel();
        embedded.wait().await?;
        out.push((cold, warm));
    }
    Ok(out)
}

fn median(mut values: Vec<Duration>) -> Duration {
    values.sort();
    values[values.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> anyhow::Result<()> {
    let args = args();
    let root = tempfile::tempdir()?;
    let srv = root.path().join("srv");
    std::fs::create_dir_all(&srv)?;
    let plan_dir = root.path().join("plan");
    std::fs::create_dir_all(&plan_dir)?;
    std::fs::write(plan_dir.join("agent.py"), AGENT)?;
    let mut paths: Vec<String> = Vec::new();
    for i in 0..args.repos {
        let bare = srv.join(format!("r{i}.git"));
        make_repo(&bare, args.files, args.history)?;
        paths.push(bare.display().to_string());
    }
    let size = git(&srv.join("r0.git"), &["count-objects", "-vH"])?;
    let size = size
        .lines()
        .find(|l| l.starts_with("size-pack"))
        .unwrap_or_default()
        .to_owned();
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.local_addr()?.port()
    };
    let mut daemon = std::process::Command::new("git")
        .args([
            "daemon",
            "--reuseaddr",
            &format!("--base-path={}", srv.display()),
            "--export-all",
            "--enable=receive-pack",
            "--listen=127.0.0.1",
            &format!("--port={port}"),
            &srv.display().to_string(),
        ])
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let urls: Vec<String> = (0..args.repos)
        .map(|i| format!("git://127.0.0.1:{port}/r{i}.git"))
        .collect();

    println!(
        "data plane: {} tasks over {} repos ({} files, {} commits each, {size}); {} round(s), median shown",
        args.tasks, args.repos, args.files, args.history, args.rounds
    );
    let mut rows = Vec::new();
    // Interleaved: path, daemon, path, daemon...
    let mut path_runs = Vec::new();
    let mut daemon_runs = Vec::new();
    for _ in 0..args.rounds {
        let one = Args { rounds: 1, ..args };
        path_runs.extend(measure(&paths, one, &plan_dir).await?);
        daemon_runs.extend(measure(&urls, one, &plan_dir).await?);
    }
    for (name, runs) in [("path (file)", &path_runs), ("git daemon", &daemon_runs)] {
        let cold = median(runs.iter().map(|r| r.0).collect());
        let warm = median(runs.iter().map(|r| r.1).collect());
        rows.push((name, cold, warm));
    }
    let per_task = |d: Duration| d.as_secs_f64() * 1000.0 / args.tasks as f64;
    println!("| remote | cold session | warm session | warm per task | warm saves |");
    println!("|---|---|---|---|---|");
    for (name, cold, warm) in &rows {
        println!(
            "| {name} | {:.2} s | {:.2} s | {:.0} ms | {:.2} s |",
            cold.as_secs_f64(),
            warm.as_secs_f64(),
            per_task(*warm),
            cold.as_secs_f64() - warm.as_secs_f64()
        );
    }
    let added = per_task(rows[1].2) - per_task(rows[0].2);
    println!("git daemon over path, warm: {added:+.0} ms per task");
    // The daemon forks: its whole process group goes.
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(i32::try_from(daemon.id())?),
        nix::sys::signal::Signal::SIGKILL,
    );
    let _ = daemon.wait();
    Ok(())
}
