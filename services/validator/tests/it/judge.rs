//! The judge through troupe-backends' agent backends, read-only, against the scripted model
//! server: troupe's own `agent` loop (fast) and the real `codex` and `claude` CLIs (installed
//! by scripts/setup/50-agent-clis.sh). A cited pass is a pass, an uncited pass is manual
//! review, a judge that crashes or times out is an error that says so, no judge is manual
//! review.

use std::path::Path;

use serde_json::{Value, json};
use troupe_modelserver::{Action, ModelServer, Script, refused_url};
use troupe_proto::v1::{CheckResult, CheckStatus, ValidateRequest, Verdict};
use troupe_testkit::{git, git_repo, workspace_root};

use crate::{start, start_with_judge_config, validate};

const MODULE: &str = "def median(xs):\n    s = sorted(xs)\n    n = len(s)\n    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2\n";

const CITED: &str = "median averages the two middle values";
const UNCITED: &str = "median is fast enough";
const BAD_LINE: &str = "median handles empty input";

/// The scripted judge: the criterion in the prompt picks the answer.
fn script() -> Script {
    let mut script = Script::default()
        .rule(
            CITED,
            vec![Action::ReadFile {
                path: "stats.py".to_owned(),
            }],
        )
        .rule(UNCITED, Vec::new())
        .rule(BAD_LINE, Vec::new());
    script.rules[0].final_text = json!({
        "verdict": "pass",
        "evidence": [{"file": "stats.py", "line": 4}],
        "reason": "line 4 averages the middle pair for even lengths",
    })
    .to_string();
    script.rules[1].final_text =
        "Looks fine to me.\n{\"verdict\": \"pass\", \"evidence\": []}".to_owned();
    script.rules[2].final_text = format!(
        "```json\n{}\n```",
        json!({"verdict": "pass", "evidence": [{"file": "stats.py", "line": 2, "end_line": 40}]})
    );
    script
}

/// The CLI's program: on PATH, or where the setup script installs it.
fn cli_program(name: &str) -> String {
    if troupe_process::which(name).is_some() {
        return name.to_owned();
    }
    let installed = workspace_root().join("target/tools/npm/bin").join(name);
    assert!(
        installed.is_file(),
        "`{name}` is not installed: run scripts/setup/50-agent-clis.sh (scripts/test does)"
    );
    installed.display().to_string()
}

/// The validator's judge configuration (`--judge-config`) for `backend` against the model
/// server at `base`: where it connects and its key are the service's, never a plan's.
fn judge_config(backend: &str, base: &str, timeout_seconds: u64) -> String {
    toml::to_string(&judge_spec(backend, base, timeout_seconds)).expect("judge config as TOML")
}

/// What a plan or request names: the backend, and a time limit.
fn chosen(backend: &str, timeout_seconds: u64) -> Value {
    json!({"backend": backend, "timeout_seconds": timeout_seconds})
}

/// A judge object for `backend` against the model server at `base`.
fn judge_spec(backend: &str, base: &str, timeout_seconds: u64) -> Value {
    let (endpoint, model) = match backend {
        "codex" => (format!("{base}/v1"), "gpt-5.5"),
        "claude" => (base.to_owned(), "fake-model"),
        _ => (format!("{base}/v1"), "fake-model"),
    };
    let mut spec = json!({
        "backend": backend,
        "model": model,
        "endpoint": endpoint,
        "api_key": "fake-key",
        "fast_fail": true,
        "timeout_seconds": timeout_seconds,
    });
    if backend != "agent" {
        spec["command"] = json!(cli_program(backend));
    }
    spec
}

fn repo(dir: &Path) {
    git_repo(dir, &[("stats.py", MODULE), ("README.md", "stats\n")]).expect("repo");
}

fn check_for<'a>(checks: &'a [CheckResult], criterion: &str) -> &'a CheckResult {
    checks
        .iter()
        .find(|c| c.subject == criterion)
        .unwrap_or_else(|| panic!("no check for {criterion:?}: {checks:?}"))
}

/// Cited pass → PASS (labelled judged), uncited pass → MANUAL_REVIEW, a cited line range past
/// the end of the file → MANUAL_REVIEW; the worktree is left untouched.
async fn judges_with_citations(backend: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    repo(dir.path());
    let head = git(dir.path(), &["rev-parse", "HEAD"]).expect("head");
    let (url, server) = ModelServer::start(script()).await.expect("model server");
    let (service, _data) = start_with_judge_config(&judge_config(backend, &url, 120)).await;
    let report = validate(
        &service,
        ValidateRequest {
            repo_path: dir.path().display().to_string(),
            criteria: vec![CITED.into(), UNCITED.into(), BAD_LINE.into()],
            judge_spec: Some(troupe_proto::json::to_struct(&chosen(backend, 120))),
            ..ValidateRequest::default()
        },
    )
    .await
    .unwrap_or_else(|s| panic!("{backend}: {s:?}"));

    let cited = check_for(&report.checks, CITED);
    assert_eq!(
        cited.status(),
        CheckStatus::Pass,
        "{backend}: {}",
        cited.evidence
    );
    assert!(
        cited
            .evidence
            .starts_with(&format!("judged (not a typed check) by `{backend}")),
        "{backend}: {}",
        cited.evidence
    );
    assert!(
        cited
            .evidence
            .contains("cites stats.py:4: return s[n // 2]"),
        "{backend}: {}",
        cited.evidence
    );
    let uncited = check_for(&report.checks, UNCITED);
    assert_eq!(uncited.status(), CheckStatus::ManualReview, "{backend}");
    assert!(
        uncited.evidence.contains("said pass but cited no evidence"),
        "{backend}: {}",
        uncited.evidence
    );
    let bad = check_for(&report.checks, BAD_LINE);
    assert_eq!(bad.status(), CheckStatus::ManualReview, "{backend}");
    assert!(
        bad.evidence
            .contains("stats.py:2-40 does not exist (stats.py has 4 lines)"),
        "{backend}: {}",
        bad.evidence
    );
    assert_eq!(report.verdict(), Verdict::ManualReview);
    assert_eq!(report.convergence_verified, [true, false, false]);
    assert_eq!(
        troupe_proto::names::name(report.convergence_met()),
        "pending"
    );

    // The judge was asked the criterion, in analysis mode, and changed nothing.
    let asked = server
        .requests()
        .iter()
        .map(|r| r.body_text())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(asked.contains(CITED), "{backend} never saw the criterion");
    assert!(asked.contains("MODE: analysis (read only"), "{backend}");
    assert_eq!(
        git(dir.path(), &["status", "--porcelain"]).expect("status"),
        ""
    );
    assert_eq!(git(dir.path(), &["rev-parse", "HEAD"]).expect("head"), head);
    service.stop().await;
}

#[tokio::test]
async fn agent_loop_judge_must_cite_evidence() {
    judges_with_citations("agent").await;
}

#[tokio::test]
async fn codex_judge_must_cite_evidence() {
    judges_with_citations("codex").await;
}

#[tokio::test]
async fn claude_judge_must_cite_evidence() {
    judges_with_citations("claude").await;
}

/// A judge that cannot reach its model, or hangs past its limit, is an ERROR naming the judge
/// and the cause; with no judge at all the criterion is MANUAL_REVIEW.
#[tokio::test]
async fn judge_crash_timeout_and_absence() {
    let dir = tempfile::tempdir().expect("tempdir");
    repo(dir.path());
    let (url, _server) = ModelServer::start(script()).await.expect("model server");
    let refused = refused_url().await.expect("refused url");
    let ask = |config: Option<String>, judge: Option<Value>| {
        let request = ValidateRequest {
            repo_path: dir.path().display().to_string(),
            criteria: vec![CITED.into()],
            judge_spec: judge.map(|j| troupe_proto::json::to_struct(&j)),
            ..ValidateRequest::default()
        };
        async move {
            let (service, _data) = match config {
                Some(config) => start_with_judge_config(&config).await,
                None => start(None).await,
            };
            let report = validate(&service, request).await.expect("validate");
            service.stop().await;
            report
        }
    };

    let report = ask(
        Some(judge_config("agent", &refused, 60)),
        Some(chosen("agent", 60)),
    )
    .await;
    let check = &report.checks[0];
    assert_eq!(check.status(), CheckStatus::Error, "{}", check.evidence);
    assert!(
        check
            .evidence
            .starts_with("judge `agent (fake-model)` could not give a verdict: backend `agent`"),
        "{}",
        check.evidence
    );
    assert_eq!(report.verdict(), Verdict::Fail);
    assert_eq!(troupe_proto::names::name(report.convergence_met()), "fail");

    let started = std::time::Instant::now();
    let report = ask(
        Some(judge_config("agent", &format!("{url}/__hang"), 60)),
        Some(chosen("agent", 2)),
    )
    .await;
    let check = &report.checks[0];
    assert_eq!(check.status(), CheckStatus::Error, "{}", check.evidence);
    assert!(
        check
            .evidence
            .contains("could not give a verdict: backend `agent` timed out after 2s"),
        "{}",
        check.evidence
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(30));

    // A real CLI that cannot reach its endpoint.
    let report = ask(
        Some(judge_config("codex", &refused, 60)),
        Some(chosen("codex", 60)),
    )
    .await;
    let check = &report.checks[0];
    assert_eq!(check.status(), CheckStatus::Error, "{}", check.evidence);
    assert!(
        check
            .evidence
            .starts_with("judge `codex (gpt-5.5)` could not give a verdict: backend `codex`"),
        "{}",
        check.evidence
    );

    let report = ask(None, None).await;
    let check = &report.checks[0];
    assert_eq!(check.status(), CheckStatus::ManualReview);
    assert_eq!(check.evidence, troupe_validator::NO_CRITERION_CHECKER);
    assert_eq!(
        troupe_proto::names::name(report.convergence_met()),
        "pending"
    );

    // A judge object that names an unknown setting is refused up front.
    let (service, _data) = start(None).await;
    let mut bad = chosen("agent", 60);
    bad["modle"] = json!("x");
    let status = validate(
        &service,
        ValidateRequest {
            repo_path: dir.path().display().to_string(),
            criteria: vec![CITED.into()],
            judge_spec: Some(troupe_proto::json::to_struct(&bad)),
            ..ValidateRequest::default()
        },
    )
    .await
    .expect_err("invalid judge");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().contains("modle"), "{}", status.message());
    service.stop().await;
}

/// The attack of issue 19: a request's (or a VALIDATE task's) judge naming its own endpoint
/// and one of the validator's variables as the key. Refused before anything runs: the
/// attacker's server is never contacted, and the configured judge's key stays with it.
#[tokio::test]
async fn a_request_cannot_redirect_the_judges_endpoint_or_credentials() {
    let dir = tempfile::tempdir().expect("tempdir");
    repo(dir.path());
    let (url, server) = ModelServer::start(script()).await.expect("model server");
    let (attacker_url, attacker) = ModelServer::start(script()).await.expect("attacker");
    let (service, _data) = start_with_judge_config(&judge_config("agent", &url, 60)).await;
    for (key, value) in [
        ("endpoint", json!(format!("{attacker_url}/v1"))),
        ("api_key_env", json!("PATH")),
        ("api_key", json!("the-attackers-key")),
        ("env_allow", json!(["HOME"])),
        ("env", json!({"OPENAI_BASE_URL": attacker_url})),
        ("command", json!("/bin/sh")),
    ] {
        let mut spec = chosen("agent", 60);
        spec[key] = value;
        let status = validate(
            &service,
            ValidateRequest {
                repo_path: dir.path().display().to_string(),
                criteria: vec![CITED.into()],
                judge_spec: Some(troupe_proto::json::to_struct(&spec)),
                ..ValidateRequest::default()
            },
        )
        .await
        .expect_err(key);
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{key}");
        assert!(
            status.message().contains(&format!(
                "`judge_spec.{key}` is not a judge setting a plan may give: where a judge \
                 connects and what it is given come from the validator's configuration"
            )),
            "{key}: {}",
            status.message()
        );
    }
    assert!(
        attacker.requests().is_empty(),
        "the attacker's server was called"
    );
    // Naming the backend alone uses the configured endpoint and key.
    let report = validate(
        &service,
        ValidateRequest {
            repo_path: dir.path().display().to_string(),
            criteria: vec![CITED.into()],
            judge_spec: Some(troupe_proto::json::to_struct(&chosen("agent", 60))),
            ..ValidateRequest::default()
        },
    )
    .await
    .expect("validate");
    assert_eq!(
        report.checks[0].status(),
        CheckStatus::Pass,
        "{}",
        report.checks[0].evidence
    );
    assert!(!server.requests().is_empty());
    assert!(attacker.requests().is_empty());
    service.stop().await;
}
