//! The coordinator's web view in headless Chromium (driven over its DevTools protocol by
//! `tests/e2e/browser/cdp.py`): behind the API's tokens, a running session's DAG updates as its
//! tasks complete without a reload, a gate is approved with its button, a task's detail shows
//! its checks, and a screenshot is kept.

use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use crate::support::{ChildService, binary, free_addr};

const CLIENT: &str = "web-client-token-0123456789";
const WORKER: &str = "web-worker-token-0123456789";

/// One headless Chromium page, one command at a time.
struct Browser {
    child: Child,
    stdin: ChildStdin,
    stdout: tokio::io::Lines<BufReader<ChildStdout>>,
}

impl Browser {
    async fn start() -> anyhow::Result<Self> {
        let python = std::env::var("TROUPE_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
        let driver = troupe_testkit::workspace_root().join("tests/e2e/browser/cdp.py");
        let mut child = Command::new(python)
            .arg(driver)
            .arg("chromium")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting the Chromium driver (scripts/setup: chromium, websocket-client)")?;
        Ok(Self {
            stdin: child.stdin.take().context("stdin")?,
            stdout: BufReader::new(child.stdout.take().context("stdout")?).lines(),
            child,
        })
    }

    async fn send(&mut self, command: serde_json::Value) -> anyhow::Result<serde_json::Value> {
        self.stdin
            .write_all(format!("{command}\n").as_bytes())
            .await?;
        let line = tokio::time::timeout(Duration::from_secs(180), self.stdout.next_line())
            .await
            .context("the browser did not answer")??
            .context("the browser driver exited")?;
        let answer: serde_json::Value = serde_json::from_str(&line)?;
        anyhow::ensure!(answer["ok"] == true, "{command}: {}", answer["error"]);
        Ok(answer["value"].clone())
    }

    /// Ends the driver, which takes Chromium's whole process group down with it.
    async fn quit(mut self) -> anyhow::Result<()> {
        self.stdin.write_all(b"{\"cmd\": \"quit\"}\n").await?;
        tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await??;
        Ok(())
    }

    async fn goto(&mut self, url: &str) -> anyhow::Result<()> {
        self.send(serde_json::json!({"cmd": "goto", "url": url}))
            .await
            .map(drop)
    }

    async fn eval(&mut self, js: &str) -> anyhow::Result<serde_json::Value> {
        self.send(serde_json::json!({"cmd": "eval", "js": js}))
            .await
    }

    async fn wait(&mut self, js: &str, timeout: u64) -> anyhow::Result<serde_json::Value> {
        self.send(serde_json::json!({"cmd": "wait", "js": js, "timeout": timeout}))
            .await
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // SIGKILL: the driver's Chromium dies with it (PR_SET_PDEATHSIG), its helpers with the
        // browser; a driver that got `quit` has already taken the whole group down.
        let _ = self.child.start_kill();
    }
}

/// Three tasks whose command agents take a few seconds each; the third waits for the others,
/// then for a person's approval.
fn slow_plan() -> serde_json::Value {
    let agent = serde_json::json!({"backend": "command", "timeout_seconds": 120, "command": [
        "python3", "-c",
        "import pathlib, sys, time; time.sleep(4); pathlib.Path(sys.argv[1] + '.txt').write_text('done\\n')",
        "{task_id}"]});
    serde_json::json!({"name": "web", "repos": {"app": {"path": "repo"}}, "tasks": [
        {"id": "IMPL-1", "title": "first <b>bold</b>", "agent": agent},
        {"id": "IMPL-2", "title": "second", "agent": agent},
        {"id": "IMPL-3", "title": "third", "depends_on": ["IMPL-1", "IMPL-2"], "agent": agent,
         "approval": "both halves merged?"}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_web_view_follows_a_running_session_behind_the_api_tokens() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    troupe_testkit::git_repo(&data.path().join("repo"), &[("README.md", "hello\n")])?;
    std::fs::write(data.path().join("plan.json"), slow_plan().to_string())?;
    std::fs::write(data.path().join("client.token"), CLIENT)?;
    let web_addr = free_addr();
    let tokens = format!("client:{CLIENT} worker:{WORKER}");
    let up = ChildService::start(
        "troupe",
        &[
            "up",
            "--data-dir",
            &data.path().join("up").display().to_string(),
            "--web-listen",
            &web_addr.to_string(),
        ],
        &[("TROUPE_AUTH_TOKENS", tokens.as_str())],
    )
    .await?;
    let web = format!("http://{web_addr}");

    let mut browser = Browser::start().await?;
    // Without a token: refused, with the way in.
    browser.goto(&format!("{web}/")).await?;
    let refused = browser.eval("document.body.innerText").await?;
    assert!(
        refused.as_str().unwrap_or_default().contains("401"),
        "{refused}"
    );
    // A worker token may not read sessions, as over gRPC.
    browser.goto(&format!("{web}/login")).await?;
    browser
        .eval(&format!(
            "document.querySelector('input[name=token]').value = '{WORKER}'; \
             document.querySelector('form').submit(); true"
        ))
        .await?;
    browser
        .wait("document.readyState === 'complete' && document.body.innerText.includes('client or admin')", 30)
        .await?;

    // The plan starts; sign in with the client token and open its page while it runs.
    let mut run = Command::new(binary("troupe"))
        .args(["run", "--plain", "--connect", &up.url(), "--token-file"])
        .arg(data.path().join("client.token"))
        .arg(data.path().join("plan.json"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    browser.goto(&format!("{web}/login")).await?;
    browser
        .eval(&format!(
            "document.querySelector('input[name=token]').value = '{CLIENT}'; \
             document.querySelector('form').submit(); true"
        ))
        .await?;
    // Signed in: redirected to the sessions page.
    browser
        .wait(
            "location.pathname === '/' && document.readyState === 'complete' \
             && !!document.querySelector('#sessions')",
            30,
        )
        .await?;
    // The sessions page lists the run's session once `troupe run` has created it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let link = loop {
        browser.goto(&format!("{web}/")).await?;
        let link = browser
            .eval("document.querySelector('#sessions a') && document.querySelector('#sessions a').href")
            .await?;
        if let Some(link) = link.as_str() {
            break link.to_owned();
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "no session listed");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    browser.goto(&link).await?;
    // The page was loaded once; what changes below comes from the event stream.
    browser.eval("window.loadedOnce = true").await?;
    let first_state = browser
        .eval("document.querySelector('tr[data-task=\"IMPL-3\"]').dataset.state")
        .await?;
    assert_ne!(
        first_state, "completed",
        "the session ended before the page opened"
    );
    // The plan's markup is text, not HTML.
    let title = browser
        .eval("document.querySelector('tr[data-task=\"IMPL-1\"] td:nth-child(2)').innerText")
        .await?;
    assert_eq!(title, "first <b>bold</b>");
    // IMPL-3 reaches its gate: the page shows it waiting, with the buttons; approve it.
    browser
        .wait(
            "document.querySelector('tr[data-task=\"IMPL-3\"]').dataset.state === 'waiting_approval' \
             && !!document.querySelector('tr[data-task=\"IMPL-3\"] form.gate')",
            120,
        )
        .await?;
    assert_eq!(browser.eval("window.loadedOnce === true").await?, true);
    browser
        .eval(
            "const row = document.querySelector('tr[data-task=\"IMPL-3\"]'); \
             row.querySelector('input[name=note]').value = 'merged, go'; \
             row.querySelector('button.approve').click(); true",
        )
        .await?;
    browser
        .wait(
            "location.pathname.startsWith('/sessions/') && document.readyState === 'complete' \
             && !!document.querySelector('#live')",
            30,
        )
        .await?;
    browser.eval("window.loadedOnce = true").await?;
    browser
        .wait(
            "document.querySelector('tr[data-task=\"IMPL-3\"]').dataset.state === 'completed' \
             && document.querySelector('#session-state').dataset.state === 'completed'",
            120,
        )
        .await?;
    // The answer is the session's, with who gave it.
    let messages = tokio::process::Command::new(binary("troupe"))
        .args(["watch", "--plain", "--connect", &up.url(), "--token-file"])
        .arg(data.path().join("client.token"))
        .arg(link.rsplit('/').next().context("session id")?)
        .output()
        .await?;
    let events = String::from_utf8_lossy(&messages.stdout);
    assert!(
        events.contains("approved by token sha256:") && events.contains("merged, go"),
        "{events}"
    );
    assert_eq!(browser.eval("window.loadedOnce === true").await?, true);
    let svg = browser
        .eval("document.querySelector('#dag svg').textContent")
        .await?;
    let svg = svg.as_str().unwrap_or_default();
    for id in ["IMPL-1", "IMPL-2", "IMPL-3"] {
        assert!(svg.contains(id), "{id} not in the DAG: {svg}");
    }
    assert!(svg.contains("completed"), "{svg}");

    let artifacts = troupe_testkit::workspace_root().join("target/test-artifacts");
    std::fs::create_dir_all(&artifacts)?;
    let shot = artifacts.join("web-view-session.png");
    browser
        .send(serde_json::json!({"cmd": "screenshot", "path": shot}))
        .await?;
    assert!(std::fs::metadata(&shot)?.len() > 10_000);

    // A task's detail: its state, spec and result.
    browser
        .eval("document.querySelector('tr[data-task=\"IMPL-1\"] a').click(); true")
        .await?;
    let detail = browser
        .wait(
            "document.querySelector('#task-state') && document.body.innerText",
            30,
        )
        .await?;
    let detail = detail.as_str().unwrap_or_default();
    for expected in [
        "IMPL-1",
        "completed",
        "Implementation",
        "Backend command",
        "Spec",
    ] {
        assert!(detail.contains(expected), "{expected} missing:\n{detail}");
    }

    let status = tokio::time::timeout(Duration::from_secs(120), run.wait()).await??;
    assert!(status.success(), "troupe run: {status}");
    browser.quit().await?;
    up.terminate(Duration::from_secs(20)).await?;
    Ok(())
}
