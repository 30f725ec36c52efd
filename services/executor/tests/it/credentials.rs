//! The real CLIs signed in the way their users sign in (a login file, no API key) or with a
//! key, against the scripted model server, which refuses any call that does not carry the
//! credential it expects; and what each CLI may do in write and read-only mode.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;
use troupe_backends::AuthMode;
use troupe_modelserver::{Action, ModelServer, Script};
use troupe_proto::v1::{BackendInfo, ErrorKind, ListBackendsRequest};
use troupe_testkit::git;

use crate::clis::{Fixture, config_for, fixture, report, task, task_error};
use crate::show;

/// A JWT-shaped id token (codex reads the account and plan from its claims; unsigned is fine
/// offline).
fn id_token() -> String {
    use base64::Engine as _;
    let b64 = |v: serde_json::Value| {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
    };
    format!(
        "{}.{}.sig",
        b64(json!({"alg": "none", "typ": "JWT"})),
        b64(json!({"email": "dev@example.com", "exp": 4_102_444_800u64,
            "https://api.openai.com/auth": {"chatgpt_plan_type": "plus", "chatgpt_account_id": "acc-1"}}))
    )
}

/// Writes `backend`'s login files, as its own sign-in leaves them, into `dir` (by file name,
/// as a mounted Secret holds them), with `token` as the credential it sends.
fn write_login(backend: &str, dir: &Path, token: &str) {
    let far = 4_102_444_800_000u64;
    let files: Vec<(&str, serde_json::Value)> = match backend {
        "codex" => vec![(
            "auth.json",
            json!({"OPENAI_API_KEY": null, "last_refresh": "2099-01-01T00:00:00Z",
                "tokens": {"id_token": id_token(), "access_token": token,
                    "refresh_token": "rt-unused", "account_id": "acc-1"}}),
        )],
        "claude" => vec![(
            ".credentials.json",
            json!({"claudeAiOauth": {"accessToken": token, "refreshToken": "rt-unused",
                "expiresAt": far, "scopes": ["user:inference", "user:profile"],
                "subscriptionType": "pro"}}),
        )],
        // `opencode auth login` for the provider troupe defines (`troupe`).
        "opencode" => vec![(
            "auth.json",
            json!({"troupe": {"type": "api", "key": token}}),
        )],
        "gemini" => vec![
            (
                "oauth_creds.json",
                json!({"access_token": token, "refresh_token": "rt-unused", "token_type": "Bearer",
                    "scope": "https://www.googleapis.com/auth/cloud-platform", "expiry_date": far}),
            ),
            (
                "google_accounts.json",
                json!({"active": "dev@example.com", "old": []}),
            ),
        ],
        "qwen" => vec![(
            "oauth_creds.json",
            json!({"access_token": token, "refresh_token": "rt-unused", "token_type": "Bearer",
                "resource_url": "portal.qwen.ai", "expiry_date": far}),
        )],
        other => panic!("no login for {other}"),
    };
    for (name, value) in files {
        std::fs::write(dir.join(name), value.to_string()).expect("login file");
    }
}

async fn listed(f: &mut Fixture, backend: &str) -> BackendInfo {
    f.client
        .list_backends(ListBackendsRequest { probe: false })
        .await
        .expect("lists")
        .into_inner()
        .backends
        .into_iter()
        .find(|b| b.name == backend)
        .expect("listed")
}

/// Every file under `dir` whose bytes contain `needle`.
fn files_containing(dir: &Path, needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            match entry.file_type() {
                Ok(kind) if kind.is_dir() => stack.push(path),
                Ok(kind)
                    if kind.is_file()
                        && std::fs::read(&path).is_ok_and(|b| {
                            b.windows(needle.len()).any(|w| w == needle.as_bytes())
                        }) =>
                {
                    found.push(path.display().to_string());
                }
                _ => {}
            }
        }
    }
    found
}

/// Signed in by a login file only (no key anywhere): the task runs, every model call carries
/// the login's token, `ListBackends` names the file, and no copy of it stays behind.
async fn runs_signed_in(backend: &str) {
    let token = format!("login-token-{backend}-{}", std::process::id());
    let script =
        Script::write_file("notes/hello.txt", "notes/hello.txt", "signed in").requiring_key(&token);
    let (url, server) = ModelServer::start(script).await.expect("model server");
    let login = tempfile::tempdir().expect("tempdir");
    write_login(backend, login.path(), &token);
    let mut config = config_for(&[(backend, &url)]);
    let settings = config.backends.get_mut(backend).expect("configured");
    settings.api_key = None;
    settings.login_dir = Some(login.path().to_path_buf());
    let mut f = fixture(config).await;
    let info = listed(&mut f, backend).await;
    let file = if backend == "claude" {
        ".credentials.json"
    } else {
        "auth.json"
    };
    assert_eq!(
        info.credential,
        format!("login: {}", login.path().join(file).display())
    );
    assert!(info.available, "{info:?}");
    let result = f
        .execute(task("IMPL-L", backend, "notes/hello.txt"))
        .await
        .unwrap_or_else(|s| panic!("{backend}: {s:?}\n{:#?}", server.requests()));
    assert_eq!(
        show(&f.repo, &result.commit, "notes/hello.txt")
            .map(|t| t.trim_end().to_owned())
            .as_deref(),
        Some("signed in")
    );
    let calls: Vec<_> = server
        .requests()
        .into_iter()
        .filter(|r| r.api != "other")
        .collect();
    assert!(!calls.is_empty());
    for call in &calls {
        assert_eq!(
            call.api_key
                .as_deref()
                .map(|k| k.trim_start_matches("Bearer ")),
            Some(token.as_str()),
            "{backend}: {} carried another credential",
            call.path
        );
    }
    // The copy in the run's home was removed after the run; the login itself is untouched.
    assert_eq!(files_containing(&f.data, &token), Vec::<String>::new());
    assert!(login.path().join(file).is_file());
    f.service.stop().await;
}

#[tokio::test]
async fn codex_runs_signed_in_with_its_login_file() {
    runs_signed_in("codex").await;
}

#[tokio::test]
async fn claude_runs_signed_in_with_its_login_file() {
    runs_signed_in("claude").await;
}

#[tokio::test]
async fn opencode_runs_signed_in_with_its_login_file() {
    runs_signed_in("opencode").await;
}

/// Gemini validates a Google sign-in against Google (tokeninfo) before any model call, and
/// qwen 0.24.4 no longer accepts its OAuth login: both fail at once as AUTH, saying so, and
/// no request reaches the endpoint.
#[tokio::test]
async fn gemini_and_qwen_logins_fail_at_once_as_auth() {
    for backend in ["gemini", "qwen"] {
        let token = format!("login-token-{backend}");
        let (url, server) = ModelServer::start(
            Script::write_file("notes/hello.txt", "notes/hello.txt", "x").requiring_key(&token),
        )
        .await
        .expect("model server");
        let login = tempfile::tempdir().expect("tempdir");
        write_login(backend, login.path(), &token);
        let mut config = config_for(&[(backend, &url)]);
        let settings = config.backends.get_mut(backend).expect("configured");
        settings.api_key = None;
        settings.auth = AuthMode::Login;
        settings.login_dir = Some(login.path().to_path_buf());
        let mut f = fixture(config).await;
        assert!(
            listed(&mut f, backend)
                .await
                .credential
                .starts_with("login: ")
        );
        let started = Instant::now();
        let status = f
            .execute(task("IMPL-G", backend, "notes/hello.txt"))
            .await
            .expect_err("the login cannot be used");
        let error = task_error(&status);
        eprintln!(
            "{backend} login: {:?} in {:?}: {}",
            error.kind(),
            started.elapsed(),
            error.message
        );
        assert_eq!(
            error.kind(),
            ErrorKind::Auth,
            "{backend}: {}",
            error.message
        );
        assert!(started.elapsed() < Duration::from_secs(60));
        let fix = if backend == "gemini" {
            "GEMINI_API_KEY"
        } else {
            "/auth"
        };
        assert!(error.message.contains(fix), "{backend}: {}", error.message);
        assert!(
            server.requests().iter().all(|r| r.api == "other"),
            "{backend}: {:?}",
            server.requests()
        );
        f.service.stop().await;
    }
}

/// Each CLI with a key (and a login beside it, which `auto` leaves alone): the key is what
/// the endpoint receives and what `ListBackends` names.
#[tokio::test]
async fn every_cli_runs_with_a_key_and_says_so() {
    for &backend in crate::clis::CLIS {
        let key = format!("key-{backend}");
        let script = Script::write_file("notes/hello.txt", "notes/hello.txt", "with a key")
            .requiring_key(&key);
        let (url, server) = ModelServer::start(script).await.expect("model server");
        let login = tempfile::tempdir().expect("tempdir");
        write_login(backend, login.path(), "the-login-token");
        let mut config = config_for(&[(backend, &url)]);
        let settings = config.backends.get_mut(backend).expect("configured");
        settings.api_key = Some(key.clone());
        settings.login_dir = Some(login.path().to_path_buf());
        let mut f = fixture(config).await;
        assert_eq!(
            listed(&mut f, backend).await.credential,
            format!("key: api_key in [backends.{backend}]")
        );
        f.execute(task("IMPL-K", backend, "notes/hello.txt"))
            .await
            .unwrap_or_else(|s| panic!("{backend}: {s:?}"));
        assert!(
            server
                .requests()
                .iter()
                .filter(|r| r.api != "other")
                .all(|r| r.api_key.as_deref().is_some_and(|k| k.ends_with(&key))),
            "{backend}"
        );
        f.service.stop().await;
    }
}

/// No key and no login: the task fails at once as AUTH with the fix in the message, nothing
/// is started, and `ListBackends` shows the backend unusable and why.
#[tokio::test]
async fn no_credential_fails_at_once_as_auth_with_the_fix() {
    let (url, server) = ModelServer::start(Script::write_file(
        "notes/hello.txt",
        "notes/hello.txt",
        "x",
    ))
    .await
    .expect("model server");
    let empty = tempfile::tempdir().expect("tempdir");
    let mut config = config_for(&[("codex", &url)]);
    let settings = config.backends.get_mut("codex").expect("configured");
    settings.api_key = None;
    settings.login_dir = Some(empty.path().to_path_buf());
    let mut f = fixture(config).await;
    let info = listed(&mut f, "codex").await;
    assert!(!info.available);
    assert!(
        info.credential
            .starts_with("missing: no credential for `codex`"),
        "{}",
        info.credential
    );
    let started = Instant::now();
    let status = f
        .execute(task("IMPL-N", "codex", "notes/hello.txt"))
        .await
        .expect_err("no credential");
    let error = task_error(&status);
    assert_eq!(error.kind(), ErrorKind::Auth);
    for fix in ["`codex login`", "api_key_env", "login_dir"] {
        assert!(error.message.contains(fix), "{}", error.message);
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert!(server.requests().is_empty());
    f.service.stop().await;
}

/// The command claude is asked to run: not one of the few acceptEdits approves by itself.
const COMMAND: &str = "python3 -c \"open('ran.txt', 'w').write('ran by the agent')\"";

fn shell_script() -> Script {
    Script::default().rule(
        "notes/hello.txt",
        vec![Action::Shell {
            command: COMMAND.to_owned(),
        }],
    )
}

/// Write mode: claude's Bash runs the command (the transcript shows the call and no denial);
/// read-only: the same call is denied, nothing runs, and the denial is on the report.
#[tokio::test]
async fn claude_runs_commands_in_write_mode_and_reports_denials_in_read_only() {
    let (url, server) = ModelServer::start(shell_script())
        .await
        .expect("model server");
    let mut f = fixture(config_for(&[("claude", &url)])).await;
    let mut spec = task("IMPL-B", "claude", "notes/hello.txt");
    spec["files"] = json!(["ran.txt"]);
    let result = f.execute(spec).await.expect("write mode");
    assert_eq!(
        show(&f.repo, &result.commit, "ran.txt").as_deref(),
        Some("ran by the agent")
    );
    let written = report(&result);
    assert!(
        written.permission_denials.is_empty(),
        "{:?}",
        written.permission_denials
    );
    // The tool result that went back to the model is the command's, not a refusal.
    let bodies: Vec<String> = server.requests().iter().map(|r| r.body_text()).collect();
    assert!(bodies.iter().any(|b| b.contains("tool_result")));
    assert!(
        !bodies.iter().any(|b| b.contains("haven't granted")),
        "denied"
    );

    let mut spec = task("IMPL-R", "claude", "notes/hello.txt");
    spec["mode"] = json!("analysis");
    let result = f.execute(spec).await.expect("read-only mode");
    assert!(result.files_modified.is_empty());
    assert_eq!(
        result.commit,
        git(&f.repo, &["rev-parse", "main"]).expect("main")
    );
    let analysed = report(&result);
    assert_eq!(analysed.permission_denials, [format!("Bash: {COMMAND}")]);
    f.service.stop().await;
}

/// Write mode, but everything the agent tries is refused (a write outside its worktree):
/// exit 0 is not a success.
#[tokio::test]
async fn claude_run_with_every_action_denied_fails() {
    let outside = tempfile::tempdir().expect("tempdir");
    let target = outside.path().join("outside.txt");
    let script = Script::default().rule(
        "notes/hello.txt",
        vec![Action::WriteFile {
            path: target.display().to_string(),
            content: "x".into(),
        }],
    );
    let (url, _server) = ModelServer::start(script).await.expect("model server");
    let mut f = fixture(config_for(&[("claude", &url)])).await;
    let status = f
        .execute(task("IMPL-D", "claude", "notes/hello.txt"))
        .await
        .expect_err("every action denied");
    let error = task_error(&status);
    assert_eq!(
        error.kind(),
        ErrorKind::PermissionDenied,
        "{}",
        error.message
    );
    assert!(
        error.message.contains(&target.display().to_string()),
        "{}",
        error.message
    );
    assert!(!target.exists());
    f.service.stop().await;
}
