//! OpenTelemetry end to end: `troupe up` with `OTEL_EXPORTER_OTLP_ENDPOINT` exports its spans
//! to an OTLP collector (here an in-process one), a caller's W3C `traceparent` becomes the
//! parent of the server span, and a worker's calls to the coordinator carry the worker's trace.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use troupe_proto::v1::{
    CreateSessionRequest, ListSessionsRequest, SessionState, WatchSessionRequest,
};

use crate::support::ChildService;

#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<(String, Span)>>>,
}

#[async_trait::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().expect("collector lock");
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|resource| &resource.attributes)
                .find(|attribute| attribute.key == "service.name")
                .and_then(|attribute| attribute.value.as_ref()?.value.as_ref())
                .map(|value| match value {
                    Value::StringValue(name) => name.clone(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                spans.extend(scope.spans.into_iter().map(|span| (service.clone(), span)));
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes.iter().find(|a| a.key == key).and_then(|a| {
        match a.value.as_ref()?.value.as_ref()? {
            Value::StringValue(value) => Some(value.clone()),
            _ => None,
        }
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

const ONE_TASK_PLAN: &str = r#"{
  "name": "traced",
  "repos": {"app": {"template": "repo"}},
  "tasks": [{
    "id": "IMPL-001", "title": "write a file",
    "files": [{"path": "hello.txt", "action": "create"}],
    "agent": {"backend": "command", "command": ["python3", "-c", "open('hello.txt', 'w').write('hi\\n')"]}
  }]
}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_otlp_collector_with_propagated_trace_context() -> anyhow::Result<()> {
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let collector_addr = listener.local_addr()?;
    let stop_collector = tokio_util::sync::CancellationToken::new();
    let collector_task = tokio::spawn({
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

    let plan_dir = tempfile::tempdir()?;
    std::fs::create_dir(plan_dir.path().join("repo"))?;
    std::fs::write(plan_dir.path().join("repo/README.md"), "traced\n")?;
    let data = tempfile::tempdir()?;
    let endpoint = format!("http://{collector_addr}");
    let up = ChildService::start(
        "troupe",
        &["up", "--data-dir", &data.path().display().to_string()],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "200"),
        ],
    )
    .await?;

    // A call carrying our own trace: the server span must join it.
    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut client = troupe_grpc::coordinator_client(&up.url())?;
    let mut request = tonic::Request::new(ListSessionsRequest::default());
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{caller_trace}-00f067aa0ba902b7-01").parse()?,
    );
    client.list_sessions(request).await?;

    // A session run by the built-in executor: its CompleteTask call carries the worker's trace.
    let created = client
        .create_session(CreateSessionRequest {
            plan_json: ONE_TASK_PLAN.to_owned(),
            base_dir: plan_dir.path().display().to_string(),
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
        .get_session(troupe_proto::v1::GetSessionRequest {
            session_id,
            ..Default::default()
        })
        .await?
        .into_inner()
        .session
        .unwrap_or_default();
    assert_eq!(session.state, SessionState::Completed as i32, "{session:?}");

    // Shutdown flushes the batch exporter.
    let status = up.terminate(Duration::from_secs(20)).await?;
    assert!(status.success(), "troupe up exited with {status}");
    let spans = collector.spans.lock().expect("collector lock").clone();
    stop_collector.cancel();
    collector_task.await??;

    assert!(!spans.is_empty(), "no spans were exported");
    assert!(
        spans.iter().all(|(service, _)| service == "troupe"),
        "service.name is not troupe"
    );
    let joined = spans.iter().any(|(_, span)| {
        span.name == "grpc"
            && hex(&span.trace_id) == caller_trace
            && attribute(span, "rpc").as_deref() == Some("/troupe.v1.Coordinator/ListSessions")
    });
    assert!(joined, "no ListSessions server span in the caller's trace");

    let task_traces: Vec<String> = spans
        .iter()
        .filter(|(_, span)| span.name == "task")
        .map(|(_, span)| hex(&span.trace_id))
        .collect();
    assert!(!task_traces.is_empty(), "the worker exported no task span");
    let complete_in_task_trace = spans.iter().any(|(_, span)| {
        attribute(span, "rpc").as_deref() == Some("/troupe.v1.Coordinator/CompleteTask")
            && task_traces.contains(&hex(&span.trace_id))
    });
    assert!(
        complete_in_task_trace,
        "CompleteTask's server span is not in the worker's task trace"
    );
    // Self-validation: the executor's call to the validator joins the task's trace too.
    let validate_in_task_trace = spans.iter().any(|(_, span)| {
        attribute(span, "rpc").as_deref() == Some("/troupe.v1.Validator/Validate")
            && task_traces.contains(&hex(&span.trace_id))
    });
    assert!(
        validate_in_task_trace,
        "the self-validation's Validate server span is not in the task's trace: {:?}",
        spans
            .iter()
            .filter_map(|(_, span)| attribute(span, "rpc"))
            .collect::<Vec<_>>()
    );
    Ok(())
}
