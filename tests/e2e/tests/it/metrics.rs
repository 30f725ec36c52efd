//! `/metrics` of the four services as separate processes, scraped before and after the
//! quickstart: the ready depth while no worker runs, and every count moved by exactly the
//! tasks the plan ran; after a coordinator restart the task gauges still tell the truth.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail};
use prometheus_parse::{Scrape, Value};
use troupe_proto::v1::{
    CreateSessionRequest, GetSessionRequest, GetSessionResponse, Role, SessionState, TaskState,
    task_result::Detail,
};

use crate::support::{self, ChildService};

const ROLES: [(Role, &str); 3] = [
    (Role::Executor, "executor"),
    (Role::Validator, "validator"),
    (Role::TestRunner, "test-runner"),
];

/// GETs `/metrics` at `addr` and parses it as Prometheus text.
async fn scrape(addr: SocketAddr) -> anyhow::Result<Scrape> {
    // reqwest is built without a default provider; the scrape is plain HTTP anyway.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let response = reqwest::get(format!("http://{addr}/metrics")).await?;
    let status = response.status();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let text = response.text().await?;
    if !status.is_success() {
        bail!("scrape of {addr} answered {status}: {text}");
    }
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "content type {content_type}"
    );
    Ok(Scrape::parse(text.lines().map(|line| Ok(line.to_owned())))?)
}

/// The value of the sample `metric` with exactly `labels` (a histogram: its count), 0 when
/// absent.
fn value(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|sample| sample.metric == metric)
        .filter(|sample| {
            labels
                .iter()
                .all(|(name, want)| sample.labels.get(name) == Some(*want))
        })
        .map(|sample| match &sample.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
            Value::Histogram(buckets) => buckets
                .iter()
                .find(|bucket| bucket.less_than.is_infinite())
                .map_or(0.0, |bucket| bucket.count),
            Value::Summary(_) => 0.0,
        })
        .sum()
}

async fn get_session(url: &str, session_id: &str) -> anyhow::Result<GetSessionResponse> {
    let mut client = troupe_grpc::Connector::default().coordinator_client(url)?;
    Ok(client
        .get_session(GetSessionRequest {
            session_id: session_id.to_owned(),
            ..Default::default()
        })
        .await?
        .into_inner())
}

fn start_args<'a>(args: &[&'a str], metrics: &'a str) -> Vec<&'a str> {
    let mut all = args.to_vec();
    all.extend(["--metrics-listen", metrics]);
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_exactly_the_tasks_a_plan_ran() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let dir = |name: &str| data.path().join(name).display().to_string();
    let coordinator_dir = dir("coordinator");
    let coordinator_metrics = support::free_addr();
    let coordinator_metrics_arg = coordinator_metrics.to_string();
    let coordinator_args = ["--data-dir", coordinator_dir.as_str()];
    let coordinator = ChildService::start(
        "troupe-coordinator",
        &start_args(&coordinator_args, &coordinator_metrics_arg),
        &[],
    )
    .await?;
    let url = coordinator.url();
    let before = scrape(coordinator_metrics).await?;
    for (_, role) in ROLES {
        assert_eq!(value(&before, "troupe_tasks_ready", &[("role", role)]), 0.0);
    }

    // The coordinator alone: the session's ready tasks wait, and the gauge shows them.
    let plan_dir = support::quickstart_dir();
    let mut client = troupe_grpc::Connector::default().coordinator_client(&url)?;
    let created = client
        .create_session(CreateSessionRequest {
            plan_json: std::fs::read_to_string(plan_dir.join("plan.json"))?,
            base_dir: plan_dir.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let session_id = created.session.context("no session")?.id;
    let waiting = get_session(&url, &session_id).await?;
    let waiting_scrape = scrape(coordinator_metrics).await?;
    let mut any_ready = false;
    for (role, name) in ROLES {
        let ready = waiting
            .tasks
            .iter()
            .filter(|task| task.role() == role && task.state() == TaskState::Ready)
            .count();
        any_ready |= ready > 0;
        assert_eq!(
            value(&waiting_scrape, "troupe_tasks_ready", &[("role", name)]),
            ready as f64,
            "ready {name} tasks"
        );
    }
    assert!(any_ready, "the quickstart starts with ready tasks");

    // Then the workers, each with its own endpoint.
    let mut workers = Vec::new();
    for name in ["troupe-executor", "troupe-validator", "troupe-test-runner"] {
        let worker_dir = dir(name);
        let metrics = support::free_addr();
        let metrics_arg = metrics.to_string();
        let args = ["--data-dir", worker_dir.as_str(), "--coordinator-url", &url];
        let service = ChildService::start(name, &start_args(&args, &metrics_arg), &[]).await?;
        workers.push((service, metrics));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
    let done = loop {
        let response = get_session(&url, &session_id).await?;
        let state = response.session.as_ref().context("no session")?.state();
        if !matches!(state, SessionState::Active) {
            break response;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the quickstart did not end"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    support::assert_quickstart_completed(&done)?;

    let after = scrape(coordinator_metrics).await?;
    let mut worker_scrapes = HashMap::new();
    for ((_, metrics), (_, role)) in workers.iter().zip(ROLES) {
        worker_scrapes.insert(role, scrape(*metrics).await?);
    }
    for (role, name) in ROLES {
        let tasks: Vec<_> = done
            .tasks
            .iter()
            .filter(|task| task.role() == role)
            .collect();
        assert!(!tasks.is_empty(), "the quickstart has {name} tasks");
        let completed = tasks.len() as f64;
        let attempts: f64 = tasks.iter().map(|task| f64::from(task.attempt)).sum();
        let completed_label = [("role", name), ("state", "completed")];
        assert_eq!(
            value(&after, "troupe_tasks", &completed_label)
                - value(&before, "troupe_tasks", &completed_label),
            completed,
            "completed {name} tasks in the store"
        );
        assert_eq!(value(&after, "troupe_tasks_ready", &[("role", name)]), 0.0);
        assert_eq!(
            value(&after, "troupe_task_pickup_seconds", &[("role", name)]),
            attempts,
            "{name} claims timed from ready"
        );
        let worker = &worker_scrapes[name];
        assert_eq!(
            value(
                worker,
                "troupe_task_attempts_total",
                &[("role", name), ("outcome", "completed")]
            ),
            completed,
            "{name} attempts the worker completed"
        );
        assert_eq!(
            value(worker, "troupe_task_duration_seconds", &[("role", name)]),
            attempts,
            "{name} attempts timed"
        );
    }
    assert!(
        value(
            &after,
            "troupe_claim_duration_seconds",
            &[("outcome", "claimed")]
        ) >= 1.0
    );
    // The executor's tasks ran the command backend; the test-runner's gauges are its report's.
    assert_eq!(
        value(
            &worker_scrapes["executor"],
            "troupe_task_duration_seconds",
            &[("role", "executor"), ("backend", "command")]
        ),
        done.tasks
            .iter()
            .filter(|task| task.role() == Role::Executor)
            .map(|task| f64::from(task.attempt))
            .sum::<f64>()
    );
    let test_run = done
        .tasks
        .iter()
        .find_map(|task| match task.result.as_ref()?.detail.as_ref()? {
            Detail::TestRun(report) => Some(report.clone()),
            _ => None,
        })
        .context("no test run report")?;
    let runner = &worker_scrapes["test-runner"];
    assert_eq!(
        value(runner, "troupe_test_pass_rate", &[("framework", "pytest")]),
        test_run.pass_rate
    );
    let coverage = test_run
        .coverage
        .as_ref()
        .and_then(|coverage| coverage.overall)
        .context("the quickstart measures coverage")?;
    assert_eq!(
        value(
            runner,
            "troupe_test_coverage_percent",
            &[("framework", "pytest")]
        ),
        coverage
    );

    for (worker, _) in workers {
        worker.terminate(Duration::from_secs(20)).await?;
    }
    // A restarted coordinator reads its task gauges from the store, not from memory.
    let addr = coordinator.addr;
    coordinator.terminate(Duration::from_secs(20)).await?;
    let restarted = ChildService::start_at(
        "troupe-coordinator",
        addr,
        &start_args(&coordinator_args, &coordinator_metrics_arg),
        &[],
        None,
    )
    .await?;
    let again = scrape(coordinator_metrics).await?;
    for (role, name) in ROLES {
        let label = [("role", name), ("state", "completed")];
        let completed = done.tasks.iter().filter(|task| task.role() == role).count();
        assert_eq!(value(&again, "troupe_tasks", &label), completed as f64);
        assert_eq!(value(&again, "troupe_tasks_ready", &[("role", name)]), 0.0);
    }
    restarted.terminate(Duration::from_secs(20)).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn troupe_up_serves_every_service_metrics_on_one_endpoint() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let data_dir = data.path().display().to_string();
    let metrics = support::free_addr();
    let metrics_arg = metrics.to_string();
    let up = ChildService::start(
        "troupe",
        &[
            "up",
            "--data-dir",
            &data_dir,
            "--metrics-listen",
            &metrics_arg,
        ],
        &[],
    )
    .await?;
    let done = support::run_quickstart(&up.url()).await?;
    support::assert_quickstart_completed(&done)?;
    let after = scrape(metrics).await?;
    for (role, name) in ROLES {
        let tasks: Vec<_> = done
            .tasks
            .iter()
            .filter(|task| task.role() == role)
            .collect();
        let attempts: f64 = tasks.iter().map(|task| f64::from(task.attempt)).sum();
        assert_eq!(
            value(
                &after,
                "troupe_tasks",
                &[("role", name), ("state", "completed")]
            ),
            tasks.len() as f64
        );
        assert_eq!(value(&after, "troupe_tasks_ready", &[("role", name)]), 0.0);
        assert_eq!(
            value(&after, "troupe_task_duration_seconds", &[("role", name)]),
            attempts
        );
    }
    up.terminate(Duration::from_secs(20)).await?;
    Ok(())
}

/// `troupe up` with the built-in agent backend on the scripted model server, a price table,
/// and a command agent the sandbox stops: the tokens count by backend and model exactly as the
/// report says, the cost is those tokens at the table's prices, and the denial counts once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_cost_and_sandbox_denials_count_exactly_what_ran() -> anyhow::Result<()> {
    use troupe_modelserver::{ModelServer, Script};
    use troupe_proto::v1::{ErrorKind, WatchSessionRequest};

    let (model_url, _model) = ModelServer::start(Script::write_file(
        "notes/hello.txt",
        "notes/hello.txt",
        "hello from the model\n",
    ))
    .await?;
    let root = tempfile::tempdir()?;
    let config = root.path().join("executor.toml");
    std::fs::write(
        &config,
        format!(
            "fallback = []\nretries = 0\n[backends.agent]\nmodel = \"fake-model\"\n\
             endpoint = \"{model_url}/v1\"\napi_key = \"fake-key\"\nfast_fail = true\n\
             timeout_seconds = 120\n"
        ),
    )?;
    let prices = root.path().join("prices.toml");
    std::fs::write(
        &prices,
        "[models.\"fake-model\"]\ninput = 3.0\noutput = 15.0\ncached_input = 0.3\n",
    )?;
    let outside = tempfile::tempdir()?;
    let plan_dir = root.path().join("plan");
    std::fs::create_dir_all(plan_dir.join("repo"))?;
    std::fs::write(plan_dir.join("repo/README.md"), "priced\n")?;
    let plan = serde_json::json!({
        "name": "priced", "repos": {"app": {"template": "repo"}},
        "tasks": [
            {"id": "IMPL-001", "title": "Create notes/hello.txt",
             "description": "Create the file notes/hello.txt with a greeting.",
             "files": [{"path": "notes/hello.txt", "action": "create", "change": "new file"}],
             "agent": {"backend": "agent"}},
            {"id": "IMPL-002", "title": "escape",
             "files": [{"path": "x.txt", "action": "create"}],
             "agent": {"backend": "command", "command": ["bash", "-c",
                 format!("echo pwned > {}/escaped.txt", outside.path().display())]}}
        ]
    });

    let data = root.path().join("data").display().to_string();
    let metrics = support::free_addr();
    let metrics_arg = metrics.to_string();
    let config_text = config.display().to_string();
    let prices_text = prices.display().to_string();
    let up = ChildService::start(
        "troupe",
        &["up", "--data-dir", &data, "--metrics-listen", &metrics_arg],
        &[
            ("TROUPE_EXECUTOR_CONFIG", config_text.as_str()),
            ("TROUPE_MODEL_PRICES", prices_text.as_str()),
        ],
    )
    .await?;
    let before = scrape(metrics).await?;
    let mut client = troupe_grpc::coordinator_client(&up.url())?;
    let created = client
        .create_session(CreateSessionRequest {
            plan_json: plan.to_string(),
            base_dir: plan_dir.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let session_id = created.session.context("no session")?.id;
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
    let done = get_session(&up.url(), &session_id).await?;
    let after = scrape(metrics).await?;
    up.terminate(Duration::from_secs(20)).await?;

    let task = |id: &str| {
        done.tasks
            .iter()
            .find(|task| task.id == id)
            .with_context(|| format!("no {id}"))
    };
    let priced = task("IMPL-001")?;
    assert_eq!(priced.state(), TaskState::Completed, "{priced:?}");
    let Some(Detail::Implementation(report)) = priced
        .result
        .as_ref()
        .and_then(|result| result.detail.as_ref())
    else {
        bail!("no implementation report: {priced:?}");
    };
    assert_eq!(
        (report.backend.as_str(), report.model.as_str()),
        ("agent", "fake-model")
    );
    let usage = report.usage.context("the agent reported no usage")?;
    assert!(
        usage.input_tokens > 0 && usage.output_tokens > 0,
        "{usage:?}"
    );
    let moved = |metric: &str, labels: &[(&str, &str)]| {
        value(&after, metric, labels) - value(&before, metric, labels)
    };
    let model = [("backend", "agent"), ("model", "fake-model")];
    for (kind, count) in [
        ("input", usage.input_tokens),
        ("output", usage.output_tokens),
        ("cached_input", usage.cached_input_tokens),
    ] {
        let labels = [model[0], model[1], ("kind", kind)];
        assert_eq!(
            moved("troupe_tokens_total", &labels),
            count as f64,
            "{kind} tokens"
        );
    }
    let cached = usage.cached_input_tokens as f64;
    let expected_cost = ((usage.input_tokens as f64 - cached) * 3.0
        + cached * 0.3
        + usage.output_tokens as f64 * 15.0)
        / 1e6;
    let cost = moved("troupe_cost_usd_total", &model);
    assert!(
        (cost - expected_cost).abs() < 1e-12,
        "cost {cost}, expected {expected_cost}"
    );
    // The command agent has no model and no tokens: nothing priced for it.
    assert_eq!(
        moved("troupe_cost_usd_total", &[("backend", "command")]),
        0.0
    );

    let denied = task("IMPL-002")?;
    let error = denied
        .last_error
        .as_ref()
        .with_context(|| format!("IMPL-002 has no error: {denied:?}"))?;
    assert_eq!(error.kind(), ErrorKind::SandboxDenied, "{error:?}");
    assert!(!outside.path().join("escaped.txt").exists());
    assert_eq!(
        moved("troupe_sandbox_denials_total", &[("kind", "path")]),
        f64::from(denied.attempt),
        "one denial per attempt"
    );
    assert_eq!(
        moved(
            "troupe_task_failures_total",
            &[("role", "executor"), ("kind", "sandbox_denied")]
        ),
        f64::from(denied.attempt)
    );
    Ok(())
}
