//! OpenTelemetry end to end, against a real OTLP/gRPC receiver (an in-process
//! `TraceService`): `troupe up` exports its spans, a caller's W3C `traceparent` becomes the
//! parent of the server span, and a worker's calls carry the attempt's trace; with the four
//! services as separate processes, each task attempt of the quickstart is one trace across
//! every service it touched, linked to its session's span, and the log lines name it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::metrics::v1::{Metric, metric, number_data_point};
use opentelemetry_proto::tonic::trace::v1::Span;
use troupe_proto::v1::{
    CreateSessionRequest, ListSessionsRequest, SessionState, WatchSessionRequest,
};

use crate::support::ChildService;

/// One metrics export: its resource's `service.name` and its metrics.
type Export = (String, Vec<Metric>);

#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<(String, Span)>>>,
    metrics: Arc<Mutex<Vec<Export>>>,
}

fn service_name(resource: Option<&opentelemetry_proto::tonic::resource::v1::Resource>) -> String {
    resource
        .iter()
        .flat_map(|resource| &resource.attributes)
        .find(|attribute| attribute.key == "service.name")
        .and_then(|attribute| attribute.value.as_ref()?.value.as_ref())
        .map(|value| match value {
            Value::StringValue(name) => name.clone(),
            other => format!("{other:?}"),
        })
        .unwrap_or_default()
}

#[async_trait::async_trait]
impl MetricsService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        let mut exports = self.metrics.lock().expect("collector lock");
        for resource_metrics in request.into_inner().resource_metrics {
            let service = service_name(resource_metrics.resource.as_ref());
            let metrics = resource_metrics
                .scope_metrics
                .into_iter()
                .flat_map(|scope| scope.metrics)
                .collect();
            exports.push((service, metrics));
        }
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
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

/// Starts the collector on a free port; returns its URL and what stops it.
async fn start_collector() -> anyhow::Result<(
    Collector,
    String,
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
)> {
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let stop = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn({
        let collector = collector.clone();
        let stop = stop.clone();
        async move {
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(collector.clone()))
                .add_service(MetricsServiceServer::new(collector))
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(listener),
                    stop.cancelled_owned(),
                )
                .await
        }
    });
    Ok((collector, url, stop, task))
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes.iter().find(|a| a.key == key).and_then(|a| {
        match a.value.as_ref()?.value.as_ref()? {
            Value::StringValue(value) => Some(value.clone()),
            _ => None,
        }
    })
}

fn int_attribute(span: &Span, key: &str) -> Option<i64> {
    span.attributes.iter().find(|a| a.key == key).and_then(|a| {
        match a.value.as_ref()?.value.as_ref()? {
            Value::IntValue(value) => Some(*value),
            _ => None,
        }
    })
}

/// The span's `rpc.service`/`rpc.method`, as its name spells them.
fn rpc(span: &Span) -> Option<String> {
    Some(format!(
        "{}/{}",
        attribute(span, "rpc.service")?,
        attribute(span, "rpc.method")?
    ))
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
    let (collector, endpoint, stop_collector, collector_task) = start_collector().await?;

    let plan_dir = tempfile::tempdir()?;
    std::fs::create_dir(plan_dir.path().join("repo"))?;
    std::fs::write(plan_dir.path().join("repo/README.md"), "traced\n")?;
    let data = tempfile::tempdir()?;
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
        span.name == "troupe.v1.Coordinator/ListSessions"
            && hex(&span.trace_id) == caller_trace
            && attribute(span, "rpc.system").as_deref() == Some("grpc")
            && rpc(span).as_deref() == Some("troupe.v1.Coordinator/ListSessions")
            && int_attribute(span, "rpc.grpc.status_code") == Some(0)
    });
    assert!(joined, "no ListSessions server span in the caller's trace");

    let task_traces: Vec<String> = spans
        .iter()
        .filter(|(_, span)| span.name == "troupe.task.attempt")
        .map(|(_, span)| hex(&span.trace_id))
        .collect();
    assert!(!task_traces.is_empty(), "the worker exported no task span");
    let complete_in_task_trace = spans.iter().any(|(_, span)| {
        rpc(span).as_deref() == Some("troupe.v1.Coordinator/CompleteTask")
            && task_traces.contains(&hex(&span.trace_id))
    });
    assert!(
        complete_in_task_trace,
        "CompleteTask's server span is not in the worker's task trace"
    );
    // Self-validation: the executor's call to the validator joins the task's trace too.
    let validate_in_task_trace = spans.iter().any(|(_, span)| {
        rpc(span).as_deref() == Some("troupe.v1.Validator/Validate")
            && task_traces.contains(&hex(&span.trace_id))
    });
    assert!(
        validate_in_task_trace,
        "the self-validation's Validate server span is not in the task's trace: {:?}",
        spans
            .iter()
            .filter_map(|(_, span)| rpc(span))
            .collect::<Vec<_>>()
    );
    Ok(())
}

/// One task whose agent fails every attempt, and a plan of it.
const FAILING_PLAN: &str = r#"{
  "name": "failing",
  "repos": {"app": {"template": "repo"}},
  "max_attempts": 2,
  "tasks": [{
    "id": "IMPL-001", "title": "fail on purpose",
    "files": [{"path": "never.txt", "action": "create"}],
    "agent": {"backend": "command", "command": ["python3", "-c", "import sys; sys.exit('no way')"]}
  }]
}"#;

/// Creates a session of `plan_json` (its files in `base_dir`) and waits until it ends.
async fn run_plan(
    url: &str,
    plan_json: &str,
    base_dir: &std::path::Path,
) -> anyhow::Result<troupe_proto::v1::GetSessionResponse> {
    let mut client = troupe_grpc::coordinator_client(url)?;
    let created = client
        .create_session(CreateSessionRequest {
            plan_json: plan_json.to_owned(),
            base_dir: base_dir.display().to_string(),
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
    tokio::time::timeout(Duration::from_secs(240), async {
        while events.message().await?.is_some() {}
        anyhow::Ok(())
    })
    .await??;
    Ok(client
        .get_session(troupe_proto::v1::GetSessionRequest {
            session_id,
            ..Default::default()
        })
        .await?
        .into_inner())
}

/// What the spans of one trace are: `(service, span)`.
type Trace<'a> = Vec<&'a (String, Span)>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_task_attempt_is_one_trace_across_the_services_it_touched() -> anyhow::Result<()> {
    use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
    use troupe_proto::v1::Role;

    use crate::support::free_addr;

    let (collector, endpoint, stop_collector, collector_task) = start_collector().await?;
    let data = tempfile::tempdir()?;
    let dir = |name: &str| data.path().join(name).display().to_string();
    let log = |name: &str| data.path().join(format!("{name}.log"));
    let otlp = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "200"),
    ];
    // The coordinator is named by OTEL_SERVICE_NAME; the workers keep their binaries' names.
    let mut coordinator_env = otlp.to_vec();
    coordinator_env.push(("OTEL_SERVICE_NAME", "coordinator-a"));
    let coordinator_dir = dir("coordinator");
    let coordinator = ChildService::start_at(
        "troupe-coordinator",
        free_addr(),
        &["--data-dir", &coordinator_dir],
        &coordinator_env,
        Some(&log("coordinator")),
    )
    .await?;
    let url = coordinator.url();
    let mut workers = Vec::new();
    let validator_dir = dir("validator");
    let validator = ChildService::start_at(
        "troupe-validator",
        free_addr(),
        &["--data-dir", &validator_dir, "--coordinator-url", &url],
        &otlp,
        Some(&log("validator")),
    )
    .await?;
    let validator_url = validator.url();
    workers.push(validator);
    let executor_dir = dir("executor");
    workers.push(
        ChildService::start_at(
            "troupe-executor",
            free_addr(),
            &[
                "--data-dir",
                &executor_dir,
                "--coordinator-url",
                &url,
                "--validator-url",
                &validator_url,
            ],
            &otlp,
            Some(&log("executor")),
        )
        .await?,
    );
    let test_runner_dir = dir("test-runner");
    workers.push(
        ChildService::start_at(
            "troupe-test-runner",
            free_addr(),
            &["--data-dir", &test_runner_dir, "--coordinator-url", &url],
            &otlp,
            Some(&log("test-runner")),
        )
        .await?,
    );

    let quickstart = crate::support::run_quickstart(&url).await?;
    crate::support::assert_quickstart_completed(&quickstart)?;
    let plan_dir = tempfile::tempdir()?;
    std::fs::create_dir(plan_dir.path().join("repo"))?;
    std::fs::write(plan_dir.path().join("repo/README.md"), "failing\n")?;
    let failing = run_plan(&url, FAILING_PLAN, plan_dir.path()).await?;
    assert_eq!(
        failing.session.as_ref().map(|s| s.state()),
        Some(SessionState::Failed),
        "{failing:?}"
    );

    // SIGTERM flushes each process's batch exporter.
    for worker in workers {
        let status = worker.terminate(Duration::from_secs(30)).await?;
        assert!(status.success(), "a worker exited with {status}");
    }
    let status = coordinator.terminate(Duration::from_secs(30)).await?;
    assert!(status.success(), "the coordinator exited with {status}");
    let spans = collector.spans.lock().expect("collector lock").clone();
    stop_collector.cancel();
    collector_task.await??;

    let named = |name: &str| -> Vec<&(String, Span)> {
        spans.iter().filter(|(_, span)| span.name == name).collect()
    };
    let trace_of = |trace_id: &[u8]| -> Trace<'_> {
        spans
            .iter()
            .filter(|(_, span)| span.trace_id == trace_id)
            .collect()
    };
    let claims = named("troupe.task.claim");
    let mut attempts = 0;
    for (response, worker_of) in [(&quickstart, true), (&failing, false)] {
        let session = response.session.as_ref().expect("session");
        let session_spans: Vec<_> = named("troupe.session")
            .into_iter()
            .filter(|(_, span)| {
                attribute(span, "troupe.session.id").as_deref() == Some(&session.id)
            })
            .collect();
        assert_eq!(
            session_spans.len(),
            1,
            "one session span for {}",
            session.id
        );
        let (session_service, session_span) = session_spans[0];
        assert_eq!(session_service, "coordinator-a");
        for task in &response.tasks {
            let role = task.role();
            let (service, role_name) = match role {
                Role::Executor => ("troupe-executor", "executor"),
                Role::Validator => ("troupe-validator", "validator"),
                Role::TestRunner => ("troupe-test-runner", "test-runner"),
                Role::Unspecified => panic!("a task without a role: {task:?}"),
            };
            for attempt in 1..=task.attempt {
                attempts += 1;
                let what = format!("{} {} attempt {attempt}", session.id, task.id);
                let claim: Vec<_> = claims
                    .iter()
                    .filter(|(_, span)| {
                        attribute(span, "troupe.session.id").as_deref() == Some(&session.id)
                            && attribute(span, "troupe.task.id").as_deref() == Some(&task.id)
                            && int_attribute(span, "troupe.task.attempt")
                                == Some(i64::from(attempt))
                    })
                    .collect();
                assert_eq!(claim.len(), 1, "one claim span for {what}");
                let (claim_service, claim) = claim[0];
                assert_eq!(claim_service, "coordinator-a", "{what}");
                assert!(
                    claim.parent_span_id.is_empty(),
                    "the claim opens the trace: {what}"
                );
                assert_eq!(attribute(claim, "troupe.role").as_deref(), Some(role_name));
                assert!(
                    claim
                        .links
                        .iter()
                        .any(|link| link.trace_id == session_span.trace_id
                            && link.span_id == session_span.span_id),
                    "the claim of {what} links to its session span"
                );
                let trace = trace_of(&claim.trace_id);
                let services: std::collections::BTreeSet<&str> =
                    trace.iter().map(|(service, _)| service.as_str()).collect();
                let attempt_span: Vec<_> = trace
                    .iter()
                    .filter(|(_, span)| span.name == "troupe.task.attempt")
                    .collect();
                assert_eq!(
                    attempt_span.len(),
                    1,
                    "one attempt span in the trace of {what}"
                );
                let (attempt_service, attempt_span) = attempt_span[0];
                assert_eq!(attempt_service, service, "{what}");
                assert_eq!(attempt_span.parent_span_id, claim.span_id, "{what}");
                let status = attempt_span.status.as_ref().map_or(0, |s| s.code);
                let report = |name: &str| {
                    trace.iter().find(|(service, span)| {
                        service == "coordinator-a"
                            && span.name == format!("troupe.v1.Coordinator/{name}")
                            && attribute(span, "rpc.system").as_deref() == Some("grpc")
                            && attribute(span, "rpc.service").as_deref()
                                == Some("troupe.v1.Coordinator")
                            && attribute(span, "rpc.method").as_deref() == Some(name)
                            && int_attribute(span, "rpc.grpc.status_code") == Some(0)
                    })
                };
                if worker_of {
                    assert_eq!(
                        attribute(attempt_span, "troupe.outcome").as_deref(),
                        Some("completed"),
                        "{what}"
                    );
                    assert_ne!(status, StatusCode::Error as i32, "{what}");
                    assert!(
                        report("CompleteTask").is_some(),
                        "CompleteTask in {what}'s trace: {services:?}"
                    );
                } else {
                    assert_eq!(
                        attribute(attempt_span, "troupe.outcome").as_deref(),
                        Some("failed"),
                        "{what}"
                    );
                    assert_eq!(status, StatusCode::Error as i32, "{what}: {attempt_span:?}");
                    assert!(
                        attribute(attempt_span, "troupe.error.kind").is_some(),
                        "{what}"
                    );
                    assert!(
                        report("FailTask").is_some(),
                        "FailTask in {what}'s trace: {services:?}"
                    );
                }
                let mut expected = vec!["coordinator-a", service];
                if role == Role::Executor {
                    assert_eq!(
                        attribute(attempt_span, "troupe.backend").as_deref(),
                        Some("command"),
                        "{what}"
                    );
                    let in_trace = |name: &str, from: &str| {
                        trace
                            .iter()
                            .any(|(service, span)| span.name == name && service == from)
                    };
                    assert!(
                        in_trace("troupe.backend.run", "troupe-executor"),
                        "backend run in {what}"
                    );
                    if worker_of {
                        // The failing agent never gets as far as self-validation.
                        assert!(
                            in_trace("troupe.self_validation", "troupe-executor"),
                            "{what}"
                        );
                        assert!(
                            in_trace("troupe.v1.Validator/Validate", "troupe-validator"),
                            "the validator's Validate in {what}'s trace"
                        );
                        expected.push("troupe-validator");
                    }
                }
                if task.id.starts_with("TESTRUN") {
                    // The quickstart repairs a wrong test through the fix loop.
                    assert!(
                        trace
                            .iter()
                            .any(|(service, span)| service == "troupe-test-runner"
                                && span.name == "troupe.fix.iteration"),
                        "fix iterations in {what}'s trace"
                    );
                }
                for want in expected {
                    assert!(
                        services.contains(want),
                        "{want} missing from {what}'s trace: {services:?}"
                    );
                }
            }
        }
    }
    assert_eq!(
        claims.len(),
        attempts,
        "one claim, so one trace, per attempt"
    );
    assert!(
        failing.tasks.iter().all(|task| task.attempt == 2),
        "{failing:?}"
    );

    // Log lines inside an attempt carry its trace and span ids.
    let attempt_traces: std::collections::BTreeSet<String> =
        claims.iter().map(|(_, span)| hex(&span.trace_id)).collect();
    for name in ["executor", "validator", "test-runner"] {
        let text = std::fs::read_to_string(log(name))?;
        let traced = text
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|line| {
                line["trace_id"]
                    .as_str()
                    .is_some_and(|id| attempt_traces.contains(id))
                    && line["span_id"].as_str().is_some_and(|id| id.len() == 16)
            })
            .count();
        assert!(traced > 0, "no {name} log line names an attempt's trace");
    }
    Ok(())
}

/// The value of the last pushed data point of `name` whose attributes include `labels` (a
/// histogram's: its count).
fn pushed(exports: &[Export], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let matches = |attributes: &[opentelemetry_proto::tonic::common::v1::KeyValue]| {
        labels.iter().all(|(key, want)| {
            attributes.iter().any(|a| {
                a.key == *key
                    && matches!(a.value.as_ref().and_then(|v| v.value.as_ref()),
                        Some(Value::StringValue(v)) if v == want)
            })
        })
    };
    let metric = exports
        .last()?
        .1
        .iter()
        .find(|metric| metric.name == name)?;
    let number =
        |point: &opentelemetry_proto::tonic::metrics::v1::NumberDataPoint| match point.value {
            Some(number_data_point::Value::AsDouble(v)) => Some(v),
            Some(number_data_point::Value::AsInt(v)) => Some(v as f64),
            None => None,
        };
    match metric.data.as_ref()? {
        metric::Data::Gauge(gauge) => gauge
            .data_points
            .iter()
            .find(|p| matches(&p.attributes))
            .and_then(number),
        metric::Data::Sum(sum) => sum
            .data_points
            .iter()
            .find(|p| matches(&p.attributes))
            .and_then(number),
        metric::Data::Histogram(histogram) => histogram
            .data_points
            .iter()
            .find(|p| matches(&p.attributes))
            .map(|p| p.count as f64),
        _ => None,
    }
}

/// The coordinator alone, pushing OTLP metrics every 300 ms: the ready depth of a new session
/// and the claim a worker then makes arrive as the same values `/metrics` serves, under the
/// coordinator's `service.name`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_pushed_over_otlp_as_served_on_metrics() -> anyhow::Result<()> {
    use troupe_proto::v1::{ClaimTasksRequest, Role, TaskState};

    let (collector, endpoint, stop_collector, collector_task) = start_collector().await?;
    let data = tempfile::tempdir()?;
    let data_dir = data.path().display().to_string();
    let metrics_addr = crate::support::free_addr().to_string();
    let coordinator = ChildService::start(
        "troupe-coordinator",
        &["--data-dir", &data_dir, "--metrics-listen", &metrics_addr],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_METRIC_EXPORT_INTERVAL", "300"),
        ],
    )
    .await?;
    let url = coordinator.url();
    let plan_dir = crate::support::quickstart_dir();
    let mut client = troupe_grpc::coordinator_client(&url)?;
    let created = client
        .create_session(CreateSessionRequest {
            plan_json: std::fs::read_to_string(plan_dir.join("plan.json"))?,
            base_dir: plan_dir.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let ready = created
        .tasks
        .iter()
        .filter(|task| task.role() == Role::Executor && task.state() == TaskState::Ready)
        .count() as f64;
    assert!(
        ready > 0.0,
        "the quickstart starts with ready executor tasks"
    );
    let wait_for = |name: &'static str, labels: Vec<(&'static str, &'static str)>, want: f64| {
        let collector = collector.clone();
        async move {
            troupe_testkit::eventually(&format!("{name} {labels:?} pushed as {want}"), || {
                let collector = collector.clone();
                let labels = labels.clone();
                async move {
                    let exports = collector.metrics.lock().expect("lock").clone();
                    (pushed(&exports, name, &labels) == Some(want)).then_some(())
                }
            })
            .await;
        }
    };
    wait_for("troupe_tasks_ready", vec![("role", "executor")], ready).await;

    let claimed = client
        .claim_tasks(ClaimTasksRequest {
            worker_id: "otlp-test".to_owned(),
            roles: vec![Role::Executor as i32],
            max_tasks: 1,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(claimed.tasks.len(), 1);
    wait_for(
        "troupe_tasks_ready",
        vec![("role", "executor")],
        ready - 1.0,
    )
    .await;
    wait_for(
        "troupe_claim_duration_seconds",
        vec![("outcome", "claimed")],
        1.0,
    )
    .await;
    wait_for(
        "troupe_task_pickup_seconds",
        vec![("role", "executor")],
        1.0,
    )
    .await;
    wait_for(
        "troupe_tasks",
        vec![("role", "executor"), ("state", "running")],
        1.0,
    )
    .await;

    coordinator.terminate(Duration::from_secs(20)).await?;
    stop_collector.cancel();
    collector_task.await??;
    let exports = collector.metrics.lock().expect("lock").clone();
    assert!(
        exports
            .iter()
            .all(|(service, _)| service == "troupe-coordinator"),
        "service.name of the pushed metrics"
    );
    Ok(())
}
