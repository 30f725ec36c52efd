//! What a person sees of a session through the CLI: `troupe graph` (parsed back: DOT by
//! graphviz's `dot`, Mermaid by structure, SVG as XML), `troupe report`, `troupe cancel`, the
//! live view of `troupe watch` on a real terminal (tmux), and print-only commands whose reader
//! goes away (`| head`).

use std::process::{Output, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;
use troupe_proto::v1::{CreateSessionRequest, GetSessionRequest, SessionState};

use crate::support::{self, ChildService, binary};

async fn troupe(args: &[&str]) -> anyhow::Result<Output> {
    Ok(tokio::process::Command::new(binary("troupe"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .await?)
}

fn stdout_of(output: &Output) -> String {
    assert!(
        output.status.success(),
        "troupe failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Runs `program args` with `input` on stdin and returns its stdout.
fn pipe_through(program: &str, args: &[&str], input: &str) -> anyhow::Result<String> {
    use std::io::Write as _;
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {program} (scripts/setup/25-system-tools.sh)"))?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(input.as_bytes())?;
    let output = child.wait_with_output()?;
    anyhow::ensure!(
        output.status.success(),
        "{program} {args:?} refused the input ({}): {}\n{input}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn graph_and_report_describe_a_finished_session() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let shutdown = CancellationToken::new();
    let (embedded, url) = support::start_embedded(data.path(), &shutdown).await?;
    let response = support::run_quickstart(&url).await?;
    support::assert_quickstart_completed(&response)?;
    let session = response.session.as_ref().context("session")?.id.clone();
    let ids: Vec<&str> = response.tasks.iter().map(|t| t.id.as_str()).collect();
    let dependencies: usize = response.tasks.iter().map(|t| t.depends_on.len()).sum();

    // DOT, laid out by graphviz itself: one node per task, one edge per dependency, and a
    // cluster per repo holding a cluster per wave.
    let dot = stdout_of(&troupe(&["graph", &session, "--connect", &url, "--format", "dot"]).await?);
    let laid_out: serde_json::Value =
        serde_json::from_str(&pipe_through("dot", &["-Tjson"], &dot)?)?;
    let objects = laid_out["objects"].as_array().context("objects")?;
    let names: Vec<&str> = objects.iter().filter_map(|o| o["name"].as_str()).collect();
    for id in &ids {
        assert!(names.contains(id), "{id} is not a node of\n{dot}");
        let node = objects.iter().find(|o| o["name"] == *id).unwrap();
        assert!(
            node["label"]
                .as_str()
                .unwrap_or_default()
                .contains("completed"),
            "{id}: {node}"
        );
    }
    let clusters = names
        .iter()
        .filter(|n| n.starts_with("cluster_r0_w"))
        .count();
    let waves: std::collections::BTreeSet<u32> = response.tasks.iter().map(|t| t.wave).collect();
    assert_eq!(clusters, waves.len(), "a cluster per wave:\n{dot}");
    assert!(names.contains(&"cluster_r0"), "{dot}");
    assert_eq!(
        laid_out["edges"].as_array().map_or(0, Vec::len),
        dependencies,
        "{dot}"
    );

    // Mermaid, by structure.
    let mermaid =
        stdout_of(&troupe(&["graph", &session, "--connect", &url, "--format", "mermaid"]).await?);
    let lines: Vec<&str> = mermaid.lines().map(str::trim).collect();
    assert_eq!(lines[0], "flowchart TD");
    let nodes = lines
        .iter()
        .filter(|l| l.starts_with('t') && l.contains("[\""))
        .count();
    assert_eq!(nodes, ids.len(), "{mermaid}");
    assert_eq!(
        lines.iter().filter(|l| l.contains(" --> ")).count(),
        dependencies
    );
    let opened = lines.iter().filter(|l| l.starts_with("subgraph ")).count();
    assert_eq!(opened, 1 + waves.len(), "{mermaid}");
    assert_eq!(lines.iter().filter(|l| **l == "end").count(), opened);

    // SVG: well-formed XML naming every task.
    let svg = stdout_of(&troupe(&["graph", &session, "--connect", &url, "--format", "svg"]).await?);
    pipe_through(
        "python3",
        &[
            "-c",
            "import sys, xml.etree.ElementTree as E; E.parse(sys.stdin)",
        ],
        &svg,
    )?;
    for id in &ids {
        assert!(svg.contains(id), "{id} missing from the SVG");
    }

    // The report: every task once, totals that add up, and costs from the price table.
    let prices = data.path().join("prices.toml");
    std::fs::write(
        &prices,
        "[command]\ninput_per_mtok = 1.0\noutput_per_mtok = 2.0\n",
    )?;
    let json = stdout_of(
        &troupe(&[
            "report",
            &session,
            "--connect",
            &url,
            "--format",
            "json",
            "--prices",
            prices.to_str().context("utf-8")?,
        ])
        .await?,
    );
    let report: serde_json::Value = serde_json::from_str(&json)?;
    assert_eq!(report["state"], "completed");
    assert_eq!(report["tasks"].as_array().map_or(0, Vec::len), ids.len());
    assert_eq!(report["total"]["tasks"], ids.len());
    assert_eq!(report["total"]["states"]["completed"], ids.len());
    assert_eq!(report["repos"]["app"]["tasks"], ids.len(), "{json}");
    let executors = response
        .tasks
        .iter()
        .filter(|t| t.role == troupe_proto::v1::Role::Executor as i32)
        .count();
    assert_eq!(report["backends"]["command"]["tasks"], executors, "{json}");
    assert!(report["backends"]["command"]["cost"].is_number(), "{json}");
    let testrun = report["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["role"] == "test_runner")
        .context("a test run")?;
    // The quickstart's test run repairs a wrong test: a failing run, then a passing one.
    let history = testrun["pass_rate_history"].as_array().context("history")?;
    assert!(history.len() >= 2, "{testrun}");
    assert_eq!(
        history.last().and_then(|v| v.as_f64()),
        Some(1.0),
        "{testrun}"
    );
    assert!(
        history[0].as_f64().is_some_and(|rate| rate < 1.0),
        "{testrun}"
    );
    let md = stdout_of(&troupe(&["report", &session, "--connect", &url]).await?);
    for heading in ["## By repo", "## By backend and model", "## Tasks"] {
        assert!(md.contains(heading), "{md}");
    }
    assert!(
        md.contains("| IMPL-001 | app | executor | completed |"),
        "{md}"
    );

    shutdown.cancel();
    embedded.wait().await?;
    Ok(())
}

#[tokio::test]
async fn troupe_cancel_cancels_a_session() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    troupe_testkit::git_repo(&data.path().join("repo"), &[("README.md", "hello\n")])?;
    let coord_dir = data.path().join("coord").display().to_string();
    let coordinator =
        ChildService::start("troupe-coordinator", &["--data-dir", &coord_dir], &[]).await?;
    let url = coordinator.url();
    let plan = serde_json::json!({"name": "cancel-cli", "repos": {"app": {"path": "repo"}},
        "tasks": [{"id": "IMPL-1", "title": "one"}]});
    let created = support::create_session(&url, &plan, data.path()).await?;
    let session = created.session.context("session")?.id;
    let out = stdout_of(
        &troupe(&[
            "cancel",
            &session,
            "--reason",
            "wrong plan",
            "--connect",
            &url,
        ])
        .await?,
    );
    assert_eq!(out.trim(), format!("session {session} is cancelled"));
    let view = troupe_grpc::coordinator_client(&url)?
        .get_session(GetSessionRequest {
            session_id: session.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(
        view.session.context("session")?.state,
        SessionState::Cancelled as i32
    );
    // An unknown session is an error with the coordinator's reason, not a success.
    let unknown = troupe(&["cancel", "no-such-session", "--connect", &url]).await?;
    assert_eq!(unknown.status.code(), Some(70));
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no-such-session"));
    Ok(())
}

#[tokio::test]
async fn troupe_doctor_answers_for_a_coordinator_and_for_troupe_up() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let coord_dir = data.path().join("coord").display().to_string();
    let coordinator =
        ChildService::start("troupe-coordinator", &["--data-dir", &coord_dir], &[]).await?;
    let out = stdout_of(&troupe(&["doctor", "--connect", &coordinator.url()]).await?);
    assert!(out.contains("coordinator  serving"), "{out}");
    assert!(out.contains("executor     not served here"), "{out}");
    assert!(
        out.contains("no executor here, so no backends to list"),
        "{out}"
    );

    let up_dir = data.path().join("up").display().to_string();
    let up = ChildService::start("troupe", &["up", "--data-dir", &up_dir], &[]).await?;
    let out = stdout_of(&troupe(&["doctor", "--connect", &up.url()]).await?);
    for service in ["coordinator", "executor", "validator", "test-runner"] {
        assert!(
            out.lines()
                .any(|l| l.trim_start().starts_with(service) && l.ends_with(" serving")),
            "{service}: {out}"
        );
    }
    assert!(
        out.lines()
            .any(|l| l.starts_with("command") && l.contains("yes")),
        "{out}"
    );
    Ok(())
}

#[tokio::test]
async fn output_into_a_closed_pipe_ends_quietly() -> anyhow::Result<()> {
    use std::os::unix::process::ExitStatusExt as _;
    let session = troupe_testkit::workspace_root().join("shared/plan/tests/fixtures/ccw/roadmap");
    // Stdout is a pipe whose reader is gone before anything is written (`| head` that has
    // read its lines): a print-only command ends by SIGPIPE as Unix tools do, not a panic.
    let (reader, writer) = std::io::pipe()?;
    drop(reader);
    // std's `output()` keeps a configured stdout (tokio's would replace it with a pipe).
    let output = std::process::Command::new(binary("troupe"))
        .args(["import", "--print"])
        .arg(&session)
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        output.status.signal(),
        Some(13),
        "{}: {stderr}",
        output.status
    );

    // `run` hosts the services in its own process: a closed stdout stops the printing, and the
    // plan still runs to the end.
    let data = tempfile::tempdir()?;
    let (reader, writer) = std::io::pipe()?;
    drop(reader);
    let mut run = std::process::Command::new(binary("troupe"));
    run.arg("run")
        .arg(support::quickstart_dir())
        .arg("--data-dir")
        .arg(data.path())
        .env_remove("RUST_LOG")
        .stdout(writer)
        .stderr(Stdio::piped());
    let output = tokio::task::spawn_blocking(move || run.output()).await??;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(output.status.success(), "{}: {stderr}", output.status);
    Ok(())
}

/// A plan of three tasks whose command agents each take a few seconds, so a terminal can show
/// them running.
fn slow_plan() -> serde_json::Value {
    let agent = serde_json::json!({"backend": "command", "timeout_seconds": 120, "command": [
        "python3", "-c",
        "import pathlib, sys, time; time.sleep(3); pathlib.Path(sys.argv[1] + '.txt').write_text('done\\n')",
        "{task_id}"]});
    serde_json::json!({"name": "slow", "repos": {"app": {"path": "repo"}}, "tasks": [
        {"id": "IMPL-1", "title": "first", "agent": agent},
        {"id": "IMPL-2", "title": "second", "agent": agent},
        {"id": "IMPL-3", "title": "third", "depends_on": ["IMPL-1", "IMPL-2"], "agent": agent}]})
}

/// Tmux on its own socket, so the test neither sees nor touches a user's sessions.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn command(&self, args: &[&str]) -> anyhow::Result<String> {
        let output = std::process::Command::new("tmux")
            .args(["-L", &self.socket, "-f", "/dev/null"])
            .args(args)
            .output()
            .context("running tmux (scripts/setup/25-system-tools.sh)")?;
        anyhow::ensure!(
            output.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// Starts `troupe watch SESSION` in a detached window `width` columns wide (40 rows) that
    /// stays on screen after it exits.
    fn watch(&self, session: &str, url: &str, width: u16) -> anyhow::Result<()> {
        let troupe_bin = binary("troupe").display().to_string();
        let width = width.to_string();
        self.command(&[
            "new-session",
            "-d",
            "-s",
            "watch",
            "-x",
            &width,
            "-y",
            "40",
            "--",
            &troupe_bin,
            "watch",
            session,
            "--connect",
            url,
            ";",
            "set-option",
            "-t",
            "watch",
            "remain-on-exit",
            "on",
        ])?;
        Ok(())
    }

    fn screen(&self) -> anyhow::Result<String> {
        self.command(&["capture-pane", "-p", "-t", "watch"])
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.command(&["kill-server"]);
    }
}

/// A session larger than `GetSession`'s first page (1,000 tasks): `troupe watch` sizes its
/// bars by every task, which it pages in with `ListTasks`. No worker runs, so nothing moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn troupe_watch_sizes_its_bars_by_every_task_of_a_large_session() -> anyhow::Result<()> {
    const TASKS: usize = 2_500;
    let data = tempfile::tempdir()?;
    troupe_testkit::git_repo(&data.path().join("repo"), &[("README.md", "hello\n")])?;
    let coordinator = ChildService::start(
        "troupe-coordinator",
        &["--data-dir", &data.path().display().to_string()],
        &[],
    )
    .await?;
    let tasks: Vec<serde_json::Value> = (0..TASKS)
        .map(|i| {
            // Two roles, so each role's bar is sized too: every tenth task validates the one before.
            if i % 10 == 9 {
                serde_json::json!({"id": format!("CHK-{i}"), "title": format!("check {i}"),
                    "role": "validator", "depends_on": [format!("IMPL-{}", i - 1)]})
            } else {
                serde_json::json!({"id": format!("IMPL-{i}"), "title": format!("task {i}")})
            }
        })
        .collect();
    let plan =
        serde_json::json!({"name": "large", "repos": {"app": {"path": "repo"}}, "tasks": tasks});
    let created = support::create_session(&coordinator.url(), &plan, data.path()).await?;
    anyhow::ensure!(
        created.tasks.len() < TASKS,
        "the first page holds {} tasks: the test needs a larger session",
        created.tasks.len()
    );
    let session = created.session.context("session")?.id;

    let tmux = Tmux {
        socket: format!("troupe-test-large-{}", std::process::id()),
    };
    tmux.watch(&session, &coordinator.url(), 160)?;
    // A bar's position and total after its brackets, e.g. `0/2500`.
    fn bar(screen: &str, prefix: &str) -> Option<String> {
        screen
            .lines()
            .find(|line| line.trim_start().starts_with(&format!("{prefix} [")))
            .and_then(|line| line.split(']').nth(1)?.split_whitespace().next())
            .map(str::to_owned)
    }
    // The bars show up before their totals are set: wait until every one has its total.
    let screen = troupe_testkit::eventually_within(
        "the live view's bars with their totals",
        Duration::from_secs(60),
        || async {
            let screen = tmux.screen().unwrap_or_default();
            ["all", "executor", "validator"]
                .iter()
                .all(|prefix| bar(&screen, prefix).is_some_and(|b| b != "0/0"))
                .then_some(screen)
        },
    )
    .await;
    let bar = |prefix: &str| bar(&screen, prefix);
    assert_eq!(bar("all").as_deref(), Some("0/2500"), "{screen}");
    assert_eq!(bar("executor").as_deref(), Some("0/2250"), "{screen}");
    assert_eq!(bar("validator").as_deref(), Some("0/250"), "{screen}");
    drop(tmux);
    coordinator.terminate(Duration::from_secs(10)).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn troupe_watch_on_a_terminal_draws_bars_and_running_tasks() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    troupe_testkit::git_repo(&data.path().join("repo"), &[("README.md", "hello\n")])?;
    let shutdown = CancellationToken::new();
    let (embedded, url) = support::start_embedded(&data.path().join("up"), &shutdown).await?;
    let created = support::create_session(&url, &slow_plan(), data.path()).await?;
    let session = created.session.context("session")?.id;

    let tmux = Tmux {
        socket: format!("troupe-test-{}", std::process::id()),
    };
    tmux.watch(&session, &url, 160)?;
    // While the first wave runs: the bars, and a line per running task with its attempt.
    let running = troupe_testkit::eventually_within(
        "the live view showing a running task",
        Duration::from_secs(60),
        || async {
            let screen = tmux.screen().unwrap_or_default();
            (screen.contains("all [") && screen.contains("wave 1") && screen.contains("attempt 1"))
                .then_some(screen)
        },
    )
    .await;
    assert!(running.contains("executor ["), "{running}");
    assert!(
        running
            .lines()
            .any(|l| l.contains("IMPL-1") && l.contains("attempt 1")),
        "{running}"
    );
    // At the end: every bar full, transitions printed above them, no running line left.
    // Waited for whole: the view redraws its lines one by one, and CI once captured the
    // screen with `all` at 3/3 while the wave bar and the running line were not redrawn yet.
    let running_line = |l: &str| l.contains("IMPL-") && !l.contains("->");
    let done = troupe_testkit::eventually_within(
        "the live view reaching 3/3 with no running task left",
        Duration::from_secs(120),
        || async {
            let screen = tmux.screen().unwrap_or_default();
            (screen.contains("3/3") && !screen.lines().any(running_line)).then_some(screen)
        },
    )
    .await;
    assert!(
        done.contains("IMPL-3") && done.contains("completed"),
        "{done}"
    );
    // Running-task lines (`IMPL-1  4s attempt 1 on …`) are gone; transitions (`->`) stay.
    assert!(!done.lines().any(running_line), "{done}");

    // Not a terminal: the same session as plain lines, no bars.
    let plain = stdout_of(&troupe(&["watch", &session, "--connect", &url]).await?);
    assert!(!plain.contains("all ["), "{plain}");
    assert!(
        plain
            .lines()
            .any(|l| l.contains("IMPL-3") && l.contains("-> completed")),
        "{plain}"
    );
    shutdown.cancel();
    embedded.wait().await?;
    Ok(())
}

/// A fixing agent for the `command` backend that takes its time, then applies one of its
/// edits per iteration (shared with `scripts/pictures.py`).
const SLOW_FIX_AGENT: &str = include_str!("../../fixtures/slow_fix.py");

/// `troupe watch` on a terminal while an `agent` task spends tokens on the scripted model
/// server and a Pytest run goes through its fix loop: the running task's line shows its backend
/// and tokens so far, the test task's line under it each test run's figures; `GetSession` and
/// the session's events carry the same figures, typed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn troupe_watch_shows_tokens_so_far_and_test_iterations() -> anyhow::Result<()> {
    use troupe_modelserver::{Action, INPUT_TOKENS, ModelServer, OUTPUT_TOKENS, Script};
    use troupe_proto::v1::{WatchSessionRequest, session_event::Kind};

    // One model call, then the agent sleeps 20 s in its `run` tool before writing the file.
    let (model_url, _model) = ModelServer::start(Script::default().rule(
        "notes/slow.txt",
        vec![
            Action::Shell {
                command: "sleep 20".to_owned(),
            },
            Action::WriteFile {
                path: "notes/slow.txt".to_owned(),
                content: "slow\n".to_owned(),
            },
        ],
    ))
    .await?;
    let root = tempfile::tempdir()?;
    let config = root.path().join("executor.toml");
    std::fs::write(
        &config,
        format!(
            "fallback = []\nretries = 0\n[backends.agent]\nmodel = \"fake-model\"\n\
             endpoint = \"{model_url}/v1\"\napi_key = \"fake-key\"\ntimeout_seconds = 120\n\
             allow_commands = [\"sleep\"]\n"
        ),
    )?;
    let repo = crate::test_runner_support::fixture_repo("pytest-proj", &[], &[], None);
    let agent = root.path().join("slow_fix.py");
    std::fs::write(&agent, SLOW_FIX_AGENT)?;
    let fix = [
        "python3",
        &agent.display().to_string(),
        "15",
        "{worktree}",
        "tests/test_mathops.py",
        "divide(10, 4) == 2\n",
        "divide(10, 4) == 2.5\n",
        "tests/test_strings.py",
        "    user = parse_user('{\"age\": 3}')\n    assert user[\"age\"] == 3",
        "    import pytest\n\n    with pytest.raises(KeyError):\n        parse_user('{\"age\": 3}')",
    ]
    .map(str::to_owned);
    let plan = serde_json::json!({"name": "figures", "repos": {"app": {"path": repo.path()}},
        "tasks": [
            {"id": "IMPL-1", "title": "Create notes/slow.txt",
             "description": "Create the file notes/slow.txt.",
             "files": [{"path": "notes/slow.txt", "action": "create", "change": "new file"}],
             "agent": {"backend": "agent"}},
            {"id": "TEST-1", "title": "Run the tests and fix them",
             "test": {"framework": "pytest", "coverage_target": 10,
                      "fix": {"agent": {"backend": "command", "command": fix},
                              "max_iterations": 3, "scope": "tests"}}}]});

    let data = root.path().join("up").display().to_string();
    let config_text = config.display().to_string();
    let up = ChildService::start(
        "troupe",
        &["up", "--data-dir", &data],
        &[("TROUPE_EXECUTOR_CONFIG", config_text.as_str())],
    )
    .await?;
    let url = up.url();
    let mut client = troupe_grpc::coordinator_client(&url)?;
    let session = client
        .create_session(CreateSessionRequest {
            plan_json: plan.to_string(),
            base_dir: root.path().display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .session
        .context("session")?
        .id;

    let tmux = Tmux {
        socket: format!("troupe-figures-{}", std::process::id()),
    };
    tmux.watch(&session, &url, 200)?;
    // One look at the screen every 200 ms until the session is done: the agent task's tokens
    // so far while its tool sleeps, and the test task's line after its first run (two failing)
    // and after fix iteration 1 (one left), each shown while the next fixing agent sleeps.
    let tokens = format!("{INPUT_TOKENS} in / {OUTPUT_TOKENS} out tokens");
    let (mut with_tokens, mut first, mut iteration) = (None, None, None);
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    let done = loop {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the session did not finish: {}",
            tmux.screen()?
        );
        let screen = tmux.screen()?;
        let line = |needle: &str| {
            screen
                .lines()
                .find(|l| l.contains(needle))
                .map(str::to_owned)
        };
        if with_tokens.is_none()
            && screen
                .lines()
                .any(|l| l.contains("IMPL-1") && l.contains(&tokens))
        {
            // The same figures, typed, from GetSession while the task runs.
            let view = client
                .get_session(GetSessionRequest {
                    session_id: session.clone(),
                    ..Default::default()
                })
                .await?
                .into_inner();
            let running = view.tasks.iter().find(|t| t.id == "IMPL-1");
            let figures = running.and_then(|t| t.work_progress.clone());
            with_tokens = Some((screen.clone(), figures));
        }
        if first.is_none() {
            first = line("tests: first run");
        }
        if iteration.is_none()
            && let Some(found) = line("tests: fix iteration 1/3")
        {
            let lines: Vec<&str> = screen.lines().collect();
            let at = lines
                .iter()
                .position(|l| l.contains("tests: fix iteration"));
            // The line sits right under its task's.
            let under = at.is_some_and(|at| at > 0 && lines[at - 1].contains("TEST-1"));
            iteration = Some((found, under, screen.clone()));
        }
        if screen.contains("2/2") {
            break screen;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let (screen, figures) = with_tokens.context("tokens so far never shown")?;
    assert!(
        screen
            .lines()
            .any(|l| l.contains("IMPL-1") && l.contains("· agent ·")),
        "{screen}"
    );
    let figures = figures.context("GetSession gave no figures for the running task")?;
    assert_eq!(
        figures.tokens.map(|t| (t.input_tokens, t.output_tokens)),
        Some((INPUT_TOKENS, OUTPUT_TOKENS)),
        "{figures:?}"
    );
    assert_eq!(figures.backend, "agent");
    let first = first.context("the first test run never shown")?;
    assert!(
        first.contains("2 failing") && first.contains("coverage "),
        "{first}"
    );
    let (line, under, screen) = iteration.context("fix iteration 1 never shown")?;
    assert!(
        line.contains("1 failing") && line.contains("coverage "),
        "{line}"
    );
    assert!(under, "{screen}");
    assert!(
        !done.lines().any(|l| l.trim_start().starts_with("tests: ")),
        "{done}"
    );

    // The session's events carry every test run's figures, in order.
    let mut events = client
        .watch_session(WatchSessionRequest {
            session_id: session.clone(),
            after_sequence: 0,
            follow: false,
        })
        .await?
        .into_inner();
    let mut iterations = Vec::new();
    while let Some(event) = events.message().await? {
        if let Some(Kind::Progress(p)) = event.kind
            && let Some(test) = p.work_progress.and_then(|w| w.test)
            && iterations.last() != Some(&(test.iteration, test.failing))
        {
            iterations.push((test.iteration, test.failing));
        }
    }
    // The last run's figures go out only if a heartbeat comes before the task completes.
    assert!(iterations.starts_with(&[(0, 2), (1, 1)]), "{iterations:?}");
    let view = client
        .get_session(GetSessionRequest {
            session_id: session.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert!(
        view.tasks.iter().all(|t| t.work_progress.is_none()),
        "figures are for running tasks only"
    );
    up.terminate(Duration::from_secs(20)).await?;
    Ok(())
}
