//! The executor's self-validation through a real validator: syntax errors go back to the
//! agent (a scripted command agent, and the built-in agent loop against the scripted model
//! server), convergence results fill the report and the summary.

use serde_json::json;
use troupe_modelserver::{Action, ModelServer, Script};
use troupe_proto::v1::{ErrorKind, Verdict};
use troupe_testkit::TestService;

use crate::executor_fixture::{Fixture, report, show, task_error};

/// An executor self-validating through a validator of its own, with the backend configuration
/// `backends_toml` when given.
async fn fixture(backends_toml: Option<String>) -> (Fixture, TestService) {
    let data = tempfile::tempdir().expect("tempdir");
    let config = troupe_validator::Config {
        listen: "127.0.0.1:0".parse().expect("addr"),
        data_dir: data.path().join("validator"),
        coordinator_url: None,
        worker_id: None,
        worker: Default::default(),
        concurrency: 1,
        security: Default::default(),
    };
    let validator = TestService::spawn(|listener, shutdown| async move {
        let _data = data;
        troupe_validator::run(config, listener, shutdown).await
    })
    .await;
    let fixture = Fixture::start(Some(validator.url()), backends_toml).await;
    (fixture, validator)
}

/// The `agent` backend against the scripted model server at `url`, failing fast.
fn agent_config(url: &str) -> String {
    format!(
        "fallback = []\nretries = 0\nretry_backoff_ms = 10\n\n[backends.agent]\nmodel = \"fake-model\"\nendpoint = \"{url}/v1\"\napi_key = \"fake-key\"\nfast_fail = true\ntimeout_seconds = 120\n"
    )
}

#[tokio::test]
async fn self_validation_feeds_syntax_errors_back_and_fills_convergence() {
    let (mut f, _validator) = fixture(None).await;
    let task = json!({
        "id": "IMPL-401", "title": "Add broken.py",
        "files": [{"path": "broken.py", "action": "create"}],
        "convergence": {
            "criteria": ["file: broken.py exists", "cmd: python3 -c \"import broken; assert broken.f() == 1\""],
            "verification": "python3 -c 'import broken'",
        },
        "agent": f.agent("IMPL-401", &["--broken-until-feedback"]),
    });
    let result = f
        .execute(task, "troupe/direct/IMPL-401")
        .await
        .expect("fixed");
    assert_eq!(f.runs("IMPL-401"), 2, "one feedback round");
    let prompt = std::fs::read_to_string(f.log.join("IMPL-401.prompt")).expect("prompt");
    assert!(
        prompt.contains("SELF-VALIDATION FAILED (retry 1 of 3)"),
        "{prompt}"
    );
    assert!(prompt.contains("syntax:broken.py"), "{prompt}");
    let report = report(&result);
    let validation = report.self_validation.as_ref().expect("validated");
    assert_eq!(validation.verdict(), Verdict::Pass, "{validation:?}");
    assert_eq!(validation.convergence_verified, [true, true]);
    assert_eq!(
        validation.convergence_met(),
        troupe_proto::v1::ConvergenceMet::Pass
    );
    assert!(
        result
            .warnings
            .iter()
            .any(|w| w.contains("syntax check failed 1 time(s)")),
        "{:?}",
        result.warnings
    );
    let summary = show(
        &f.repo,
        &result.commit,
        ".troupe-summaries/summary-IMPL-401.md",
    )
    .expect("summary");
    assert!(summary.contains("convergence-met: pass\n"), "{summary}");
    assert!(
        summary.contains("- [x] file: broken.py exists"),
        "{summary}"
    );

    // An agent that never fixes it fails after three retries, with the evidence.
    let task = json!({
        "id": "IMPL-402", "files": [{"path": "broken.py", "action": "create"}],
        "convergence": {"criteria": ["file: broken.py exists"]},
        "agent": f.agent("IMPL-402", &["--always-broken"]),
    });
    let status = f
        .execute(task, "troupe/direct/IMPL-402")
        .await
        .expect_err("never fixed");
    let error = task_error(&status);
    assert_eq!(error.kind(), ErrorKind::CheckFailed);
    assert!(
        error
            .message
            .starts_with("syntax check still failing after 3 retries"),
        "{}",
        error.message
    );
    assert_eq!(f.runs("IMPL-402"), 4);
}

#[tokio::test]
async fn the_agent_backend_gets_syntax_errors_back_as_context() {
    // The scripted model writes broken Python, and fixes it once told what the check said.
    let script = Script::default()
        .rule(
            "SELF-VALIDATION FAILED",
            vec![Action::WriteFile {
                path: "calc.py".to_owned(),
                content: "def add(a, b):\n    return a + b\n".to_owned(),
            }],
        )
        .rule(
            "calc.py",
            vec![Action::WriteFile {
                path: "calc.py".to_owned(),
                content: "def add(a, b)\n    return a + b\n".to_owned(),
            }],
        );
    let (url, server) = ModelServer::start(script).await.expect("model server");
    let (mut f, _validator) = fixture(Some(agent_config(&url))).await;
    let task = json!({
        "id": "IMPL-701", "title": "Add calc.add",
        "files": [{"path": "calc.py", "action": "create", "change": "add(a, b)"}],
        "convergence": {"criteria": ["cmd: python3 -c \"import calc; assert calc.add(2, 3) == 5\""]},
        "agent": {"backend": "agent"},
    });
    let result = f
        .execute(task, "troupe/direct/IMPL-701")
        .await
        .expect("fixed");
    assert_eq!(
        show(&f.repo, &result.commit, "calc.py").as_deref(),
        Some("def add(a, b):\n    return a + b")
    );
    let report = report(&result);
    assert_eq!(report.backend, "agent");
    let validation = report.self_validation.as_ref().expect("validated");
    assert_eq!(validation.convergence_verified, [true]);
    assert_eq!(
        validation.convergence_met(),
        troupe_proto::v1::ConvergenceMet::Pass
    );
    // Both agent runs are counted.
    let usage = report.usage.expect("usage");
    assert_eq!(usage.output_tokens % troupe_modelserver::OUTPUT_TOKENS, 0);
    assert!(
        usage.output_tokens >= 4 * troupe_modelserver::OUTPUT_TOKENS,
        "{usage:?}"
    );
    let feedback = server
        .requests()
        .iter()
        .filter(|r| {
            r.body_text()
                .contains("SELF-VALIDATION FAILED (retry 1 of 3)")
        })
        .count();
    assert!(feedback > 0, "the second run carried the syntax error");
}
