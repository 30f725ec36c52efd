//! The secret scan: `troupe up` with a distinctive API key (for a real codex CLI against the
//! scripted model server) and a distinctive bearer token (its clients' credential), exporting
//! spans to an in-process OTLP collector, runs a session (a codex edit and the quickstart's
//! command agent), which is then exported to a CCW folder. Neither value may appear in the log,
//! the spans, the store, the session's results and summaries, or the export, while the model
//! server proves the key did reach the CLI that needed it.

use std::path::Path;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use serde_json::json;
use troupe_modelserver::{ModelServer, Script};
use troupe_proto::v1::{CreateSessionRequest, GetSessionRequest, WatchSessionRequest};

use crate::support::{ChildService, free_addr};

/// Keeps every exported request, as text.
#[derive(Clone, Default)]
struct Collector {
    seen: Arc<Mutex<Vec<String>>>,
}

#[async_trait::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.seen
            .lock()
            .expect("collector lock")
            .push(format!("{:?}", request.into_inner()));
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// Every file under `dir`, as bytes, with its path.
fn files(dir: &Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_dir() {
            out.extend(files(&path));
        } else if kind.is_file()
            && let Ok(bytes) = std::fs::read(&path)
        {
            out.push((path, bytes));
        }
    }
    out
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle.as_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_key_or_token_reaches_logs_spans_store_results_or_exports() -> anyhow::Result<()> {
    let codex = crate::support::installed_cli("codex");
    let api_key = format!("sk-scan-{}", uuid::Uuid::new_v4().simple());
    let token = format!("tok-scan-{}", uuid::Uuid::new_v4().simple());

    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}", listener.local_addr()?);
    let stop_collector = tokio_util::sync::CancellationToken::new();
    tokio::spawn({
        let collector = collector.clone();
        let stop = stop_collector.clone();
        async move {
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(collector))
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(listener),
                    stop.cancelled_owned(),
                )
                .await
        }
    });
    let (model_url, model) = ModelServer::start(Script::write_file(
        "notes/hello.txt",
        "notes/hello.txt",
        "hello from the model",
    ))
    .await?;

    let root = tempfile::tempdir()?;
    let data = root.path().join("data");
    let config = root.path().join("executor.toml");
    std::fs::write(
        &config,
        format!(
            "fallback = []\nretries = 0\n[backends.codex]\ncommand = {codex:?}\nmodel = \"gpt-5.5\"\n\
             endpoint = \"{model_url}/v1\"\napi_key_env = \"SCAN_MODEL_KEY\"\nfast_fail = true\n\
             timeout_seconds = 120\n"
        ),
    )?;
    let plan_dir = root.path().join("plan");
    std::fs::create_dir_all(plan_dir.join("repo"))?;
    std::fs::write(plan_dir.join("repo/README.md"), "scan\n")?;
    let plan = json!({
        "name": "scan", "repos": {"app": {"template": "repo"}},
        "tasks": [
            {"id": "IMPL-001", "title": "Create notes/hello.txt",
             "description": "Create the file notes/hello.txt with a greeting.",
             "files": [{"path": "notes/hello.txt", "action": "create", "change": "new file"}],
             "agent": {"backend": "codex"}},
            {"id": "IMPL-002", "title": "print the environment",
             "description": "an agent that shows what it was given",
             "files": [{"path": "env.txt", "action": "create"}],
             "agent": {"backend": "command", "command": ["sh", "-c", "env > env.txt; env"]}}
        ]
    });

    let log = root.path().join("up.log");
    let tokens = format!("admin:{token}");
    let data_text = data.display().to_string();
    let config_text = config.display().to_string();
    let up = ChildService::start_at(
        "troupe",
        free_addr(),
        &["up", "--data-dir", &data_text],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "200"),
            ("TROUPE_EXECUTOR_CONFIG", config_text.as_str()),
            ("SCAN_MODEL_KEY", api_key.as_str()),
            ("TROUPE_AUTH_TOKENS", tokens.as_str()),
            ("RUST_LOG", "debug"),
        ],
        Some(&log),
    )
    .await?;
    let connector = troupe_grpc::Connector::default()
        .with_token(troupe_grpc::auth::Token::parse(&token).map_err(anyhow::Error::msg)?);
    let url = up.url();
    let mut client = connector.coordinator_client(&url)?;
    let created = client
        .create_session(CreateSessionRequest {
            plan_json: plan.to_string(),
            base_dir: plan_dir.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let session_id = created.session.map(|s| s.id).unwrap_or_default();
    let mut events = client
        .watch_session(WatchSessionRequest {
            session_id: session_id.clone(),
            after_sequence: 0,
            follow: false,
        })
        .await?
        .into_inner();
    while events.message().await?.is_some() {}
    let session = client
        .get_session(GetSessionRequest {
            session_id: session_id.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let report = troupe::report::final_report(&session);
    for task in &session.tasks {
        assert_eq!(
            task.state,
            troupe_proto::v1::TaskState::Completed as i32,
            "{} did not complete:\n{report}",
            task.id
        );
    }
    let export = root.path().join("export");
    troupe::ccw_export::export(&connector, &url, &session_id, &export).await?;
    up.terminate(std::time::Duration::from_secs(20)).await?;
    stop_collector.cancel();

    // The key did its job: the CLI sent it to the model server.
    assert!(
        model
            .requests()
            .iter()
            .any(|r| r.api_key.as_deref().is_some_and(|k| k.contains(&api_key))),
        "codex never sent the key"
    );
    // The command agent committed its environment: the allow-list, no key, no token.
    let repo = session
        .session
        .as_ref()
        .and_then(|s| s.repos.first())
        .map(|r| r.path.clone())
        .unwrap_or_default();
    let history = troupe_testkit::git(Path::new(&repo), &["log", "--all", "-p"])?;
    assert!(
        history.contains("PATH="),
        "env.txt was committed:\n{history}"
    );

    let mut places: Vec<(String, Vec<u8>)> = vec![
        ("log".to_owned(), std::fs::read(&log)?),
        (
            "spans".to_owned(),
            collector.seen.lock().expect("lock").join("\n").into_bytes(),
        ),
        ("session".to_owned(), format!("{session:?}").into_bytes()),
        ("report".to_owned(), report.into_bytes()),
        ("git history".to_owned(), history.into_bytes()),
    ];
    assert!(!places[1].1.is_empty(), "no spans were exported");
    for dir in [&data, &export] {
        // The data dir: the store (troupe.db and its WAL), results, summaries, worktrees.
        places.extend(
            files(dir)
                .into_iter()
                .map(|(path, bytes)| (path.display().to_string(), bytes)),
        );
    }
    assert!(
        places.iter().any(|(name, _)| name.ends_with("troupe.db")),
        "the store was scanned"
    );
    for (name, bytes) in &places {
        for secret in [&api_key, &token] {
            assert!(!contains(bytes, secret), "{name} holds a secret");
        }
    }
    Ok(())
}
