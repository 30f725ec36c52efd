//! Provider quotas across the cluster (issue 24 item 4, docs/quotas.md): a wave of 40 agent
//! tasks over 4 executor processes against a model server that allows 3 calls at once, with
//! the coordinator's quota at 3; and a 429 a worker reports pausing its provider without
//! costing the task an attempt.

use std::time::Duration;

use anyhow::Context;
use serde_json::json;
use troupe_modelserver::{Action, ModelServer, Script};
use troupe_proto::v1::{
    CreateSessionRequest, GetSessionRequest, SessionState, TaskState, WatchSessionRequest,
    session_event,
};

use crate::quota_wave::{self, Wave};
use crate::support::{self, ChildService};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_of_three_runs_forty_tasks_over_four_workers_without_a_429() -> anyhow::Result<()> {
    let bin_dir = support::binary("troupe-coordinator")
        .parent()
        .context("binary dir")?
        .to_path_buf();
    let wave = Wave {
        bin_dir,
        tasks: 40,
        workers: 4,
        allowed: 3,
        quota: Some(3),
        call_time: Duration::from_millis(200),
    };
    let outcome = quota_wave::run(&wave).await?;
    assert_eq!(outcome.completed, 40, "{outcome:?}");
    assert_eq!(outcome.failed_attempts, 0, "{outcome:?}");
    assert_eq!(outcome.fallbacks, 0, "{outcome:?}");
    assert!(
        outcome.peak <= 3,
        "the server saw {} calls at once",
        outcome.peak
    );
    assert_eq!(outcome.refused, 0, "{outcome:?}");
    assert!(
        outcome.waits_seen,
        "CheckSession never showed the wait: {outcome:?}"
    );
    assert!(outcome.task_time > Duration::ZERO && outcome.wall > outcome.task_time);
    Ok(())
}

/// The metric `name` with `backend="agent"` at the coordinator's metrics endpoint.
async fn agent_metric(metrics: std::net::SocketAddr, name: &str) -> anyhow::Result<f64> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let text = reqwest::get(format!("http://{metrics}/metrics"))
        .await?
        .text()
        .await?;
    Ok(text
        .lines()
        .filter(|line| line.starts_with(name) && line.contains("backend=\"agent\""))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reported_429_pauses_the_provider_and_costs_no_attempt() -> anyhow::Result<()> {
    // One call at a time, each taking 1.5 s; a second call at once gets 429, retry-after 2.
    let script = Script::default()
        .limited_to(1, Duration::from_millis(1500), 2)
        .rule(
            "notes/a.txt",
            vec![Action::WriteFile {
                path: "notes/a.txt".into(),
                content: "a\n".into(),
            }],
        )
        .rule(
            "notes/b.txt",
            vec![Action::WriteFile {
                path: "notes/b.txt".into(),
                content: "b\n".into(),
            }],
        );
    let (model_url, model) = ModelServer::start(script).await?;
    let root = tempfile::tempdir()?;
    let config = root.path().join("executor.toml");
    // Retries and a fallback configured: a rate limit must use neither.
    std::fs::write(
        &config,
        format!(
            "fallback = [\"codex\"]\nretries = 2\nretry_backoff_ms = 10\n\n[backends.agent]\n\
             model = \"fake-model\"\nendpoint = \"{model_url}/v1\"\napi_key = \"fake-key\"\n\
             timeout_seconds = 120\n"
        ),
    )?;
    let plan_dir = root.path().join("plan");
    std::fs::create_dir_all(plan_dir.join("repo"))?;
    std::fs::write(plan_dir.join("repo/README.md"), "notes\n")?;
    let task = |id: &str, path: &str| {
        json!({"id": id, "title": format!("write {path}"),
               "description": format!("Create {path}."),
               "files": [{"path": path, "action": "create"}],
               "agent": {"backend": "agent"}})
    };
    let plan = json!({"name": "pause", "repos": {"app": {"template": "repo"}},
                      "tasks": [task("IMPL-001", "notes/a.txt"), task("IMPL-002", "notes/b.txt")]});

    // No quota configured: the pause alone holds the provider back.
    let coordinator_dir = root.path().join("coordinator").display().to_string();
    let metrics = support::free_addr();
    let metrics_arg = metrics.to_string();
    let coordinator = ChildService::start(
        "troupe-coordinator",
        &[
            "--data-dir",
            &coordinator_dir,
            "--metrics-listen",
            &metrics_arg,
        ],
        &[],
    )
    .await?;
    let url = coordinator.url();
    let config_text = config.display().to_string();
    let mut workers = Vec::new();
    for n in 0..2 {
        let dir = root
            .path()
            .join(format!("executor-{n}"))
            .display()
            .to_string();
        let id = format!("executor-{n}");
        workers.push(
            ChildService::start(
                "troupe-executor",
                &[
                    "--data-dir",
                    &dir,
                    "--coordinator-url",
                    &url,
                    "--concurrency",
                    "1",
                    "--worker-id",
                    &id,
                ],
                &[("TROUPE_EXECUTOR_CONFIG", config_text.as_str())],
            )
            .await?,
        );
    }
    let mut client = troupe_grpc::Connector::default().coordinator_client(&url)?;
    let session_id = client
        .create_session(CreateSessionRequest {
            plan_json: plan.to_string(),
            base_dir: plan_dir.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .session
        .context("no session")?
        .id;
    let mut events = client
        .watch_session(WatchSessionRequest {
            session_id: session_id.clone(),
            after_sequence: 0,
            follow: true,
        })
        .await?
        .into_inner();
    let mut log = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(300), async {
        while let Some(event) = events.message().await? {
            let ended = matches!(&event.kind, Some(session_event::Kind::Session(t))
                if t.to != SessionState::Active as i32);
            log.push(event);
            if ended {
                break;
            }
        }
        anyhow::Ok(())
    })
    .await;
    ended.context("the session did not end")??;
    let done = client
        .get_session(GetSessionRequest {
            session_id: session_id.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    for task in &done.tasks {
        assert_eq!(task.state(), TaskState::Completed, "{}", task.id);
        assert_eq!(task.attempt, 1, "{}: the 429 cost no attempt", task.id);
    }
    assert!(model.refused() >= 1, "the two calls never met");

    // The put-back: running -> ready with the pause in its reason, then claimed again no
    // sooner than the provider's retry-after.
    let millis = |event: &troupe_proto::v1::SessionEvent| {
        event
            .ts
            .as_ref()
            .map_or(0, |ts| ts.seconds * 1000 + i64::from(ts.nanos) / 1_000_000)
    };
    let transitions: Vec<_> = log
        .iter()
        .filter_map(|event| match &event.kind {
            Some(session_event::Kind::Task(t)) => Some((millis(event), t)),
            _ => None,
        })
        .collect();
    let (paused_at, put_back) = transitions
        .iter()
        .find(|(_, t)| t.from == TaskState::Running as i32 && t.to == TaskState::Ready as i32)
        .context("no task was put back to ready")?;
    assert!(
        put_back.reason.contains("agent") && put_back.reason.contains("paused"),
        "{}",
        put_back.reason
    );
    let reclaimed_at = transitions
        .iter()
        .filter(|(at, t)| {
            t.task_id == put_back.task_id && t.to == TaskState::Running as i32 && at > paused_at
        })
        .map(|(at, _)| *at)
        .next()
        .context("the put-back task was not claimed again")?;
    assert!(
        reclaimed_at - paused_at >= 1_900,
        "claimed again {} ms after the pause of 2 s: {transitions:?}",
        reclaimed_at - paused_at
    );
    // Neither the retry nor the fallback was used.
    for task in &done.tasks {
        if let Some(troupe_proto::v1::task_result::Detail::Implementation(report)) =
            task.result.as_ref().and_then(|r| r.detail.as_ref())
        {
            assert!(
                report.fallbacks.is_empty(),
                "{}: {:?}",
                task.id,
                report.fallbacks
            );
        }
    }
    let quota_lines = log
        .iter()
        .filter(|event| matches!(&event.kind, Some(session_event::Kind::Message(m)) if m.r#type == "quota"))
        .count();
    assert!(quota_lines >= 1, "no quota line for run/watch");
    assert!(agent_metric(metrics, "troupe_quota_pauses_total").await? >= 1.0);
    drop(workers);
    drop(coordinator);
    Ok(())
}
