//! `troupe doctor`: where each backend's credential comes from, and `--probe`'s live call.

use troupe_modelserver::{ModelServer, Script};
use troupe_testkit::workspace_root;

/// The CLI's program: on PATH, or where scripts/setup/50-agent-clis.sh installs it.
fn cli(name: &str) -> String {
    if troupe_process::which(name).is_some() {
        return name.to_owned();
    }
    let installed = workspace_root().join("target/tools/npm/bin").join(name);
    assert!(
        installed.is_file(),
        "`{name}` is not installed: run scripts/setup/50-agent-clis.sh"
    );
    installed.display().to_string()
}

#[tokio::test]
async fn doctor_names_each_credential_source_and_probes_live() {
    let token = "doctor-login-token";
    let (url, server) = ModelServer::start(Script::default().requiring_key(token))
        .await
        .expect("model server");
    let dir = tempfile::tempdir().expect("tempdir");
    let login = dir.path().join("claude-login");
    std::fs::create_dir_all(&login).expect("login dir");
    std::fs::write(
        login.join(".credentials.json"),
        serde_json::json!({"claudeAiOauth": {"accessToken": token, "refreshToken": "rt",
            "expiresAt": 4_102_444_800_000u64, "scopes": ["user:inference"]}})
        .to_string(),
    )
    .expect("login file");
    let empty = dir.path().join("no-login");
    std::fs::create_dir_all(&empty).expect("empty");
    let config = dir.path().join("backends.toml");
    std::fs::write(
        &config,
        format!(
            "fallback = []\n\
             [backends.claude]\ncommand = {claude:?}\nendpoint = {url:?}\nmodel = \"fake-model\"\nlogin_dir = {login:?}\nfast_fail = true\n\
             [backends.codex]\ncommand = {codex:?}\nendpoint = \"{url}/v1\"\nmodel = \"gpt-5.5\"\napi_key = \"wrong-key\"\nfast_fail = true\n\
             [backends.qwen]\ncommand = {qwen:?}\nlogin_dir = {empty:?}\n",
            claude = cli("claude"),
            codex = cli("codex"),
            qwen = cli("qwen"),
        ),
    )
    .expect("config");
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(["doctor", "--probe", "--config"])
        .arg(&config)
        .env_remove("TROUPE_EXECUTOR_CONFIG")
        .output()
        .await
        .expect("doctor runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    let block = |name: &str| -> String {
        stdout
            .split('\n')
            .skip_while(|line| !line.starts_with(&format!("{name} ")))
            .take_while(|line| line.starts_with(name) || line.starts_with(' '))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let claude = block("claude");
    assert!(
        claude.contains(&format!(
            "credential login: {}",
            login.join(".credentials.json").display()
        )),
        "{claude}"
    );
    assert!(claude.contains("probe      ok in"), "{claude}");
    let codex = block("codex");
    assert!(
        codex.contains("credential key: api_key in [backends.codex]"),
        "{codex}"
    );
    // The endpoint refuses the key: the live call says so, and doctor exits non-zero.
    assert!(
        codex.contains("probe      failed: backend `codex` rejected its credentials"),
        "{codex}"
    );
    let qwen = block("qwen");
    assert!(
        qwen.contains("credential missing: no credential for `qwen`"),
        "{qwen}"
    );
    assert!(qwen.contains("`qwen` then `/auth`"), "{qwen}");
    assert!(!output.status.success());
    // The live calls reached the endpoint with each backend's own credential.
    let keys: Vec<String> = server
        .requests()
        .iter()
        .filter_map(|r| r.api_key.clone())
        .collect();
    assert!(keys.iter().any(|k| k.ends_with(token)), "{keys:?}");
    assert!(keys.iter().any(|k| k.ends_with("wrong-key")), "{keys:?}");
}
