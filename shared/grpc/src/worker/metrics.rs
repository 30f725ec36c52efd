//! The worker side's metric families, for every worker service (see `docs/operating.md`,
//! "Metrics"): what each attempt took and how it ended, by role and backend, with the tokens
//! its backend reported and, for test runs, the last pass rate and coverage. Counted from the
//! handler's result, so every worker service reports them the same way.

use std::sync::OnceLock;
use std::time::Duration;

use troupe_proto::v1::{ErrorKind, Role, Task, TaskResult, task_result::Detail};
use troupe_telemetry::metrics::{
    self, Counter, Family, FloatGauge, HistogramFamily, Labels, labels,
};

struct Metrics {
    duration: HistogramFamily,
    attempts: Family<Labels, Counter>,
    failures: Family<Labels, Counter>,
    tokens: Family<Labels, Counter>,
    cost: Family<Labels, Counter<f64>>,
    pass_rate: Family<Labels, FloatGauge>,
    coverage: Family<Labels, FloatGauge>,
}

fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(|| Metrics {
        duration: metrics::seconds_histogram(
            "troupe_task_duration",
            "Wall time of a task attempt in a worker, by role, backend and outcome.",
            metrics::duration_buckets,
        ),
        attempts: metrics::counter(
            "troupe_task_attempts",
            "Task attempts a worker finished, by role and outcome (completed, failed, abandoned).",
        ),
        failures: metrics::counter(
            "troupe_task_failures",
            "Failed task attempts, by role and error kind.",
        ),
        tokens: metrics::counter(
            "troupe_tokens",
            "Model tokens the backends reported, by backend, model and kind (input, output, cached_input).",
        ),
        cost: metrics::counter_in(
            "troupe_cost",
            "What the backends' tokens cost by the configured price table, by backend and model.",
            "usd",
        ),
        pass_rate: metrics::float_gauge(
            "troupe_test_pass_rate",
            "Pass rate (0..1) of this test-runner's last test run, by framework.",
        ),
        coverage: metrics::float_gauge(
            "troupe_test_coverage_percent",
            "Overall coverage in percent of this test-runner's last test run that measured it, by framework.",
        ),
    })
}

/// Registers the families, so a scrape shows them before the first task.
pub(crate) fn register() {
    metrics();
    metrics::sandbox_denials();
}

/// The label of a role.
pub(crate) fn role_name(role: Role) -> &'static str {
    match role {
        Role::Executor => "executor",
        Role::Validator => "validator",
        Role::TestRunner => "test-runner",
        Role::Unspecified => "worker",
    }
}

/// A metric label for an error kind: `timeout`, `rate_limited`, ...
pub(crate) fn kind_label(kind: ErrorKind) -> String {
    troupe_proto::names::name(kind).to_owned()
}

/// How an attempt ended.
pub(crate) enum Outcome<'a> {
    Completed(&'a TaskResult),
    Failed(ErrorKind, Option<&'a TaskResult>),
    /// Its lease was lost: nothing was reported.
    Abandoned,
}

/// Records one finished attempt of `task` that ran for `took`.
pub(crate) fn attempt(task: &Task, took: Duration, outcome: &Outcome<'_>) {
    let metrics = metrics();
    let role = role_name(task.role());
    let (name, result) = match outcome {
        Outcome::Completed(result) => ("completed", Some(*result)),
        Outcome::Failed(kind, partial) => {
            metrics
                .failures
                .get_or_create(&labels([("role", role), ("kind", &kind_label(*kind))]))
                .inc();
            ("failed", *partial)
        }
        Outcome::Abandoned => ("abandoned", None),
    };
    metrics
        .attempts
        .get_or_create(&labels([("role", role), ("outcome", name)]))
        .inc();
    let mut backend = "none";
    match result.and_then(|result| result.detail.as_ref()) {
        Some(Detail::Implementation(report)) => {
            if !report.backend.is_empty() {
                backend = &report.backend;
            }
            let model = if report.model.is_empty() {
                "unknown"
            } else {
                report.model.as_str()
            };
            if let Some(usage) = &report.usage {
                for (kind, count) in [
                    ("input", usage.input_tokens),
                    ("output", usage.output_tokens),
                    ("cached_input", usage.cached_input_tokens),
                ] {
                    metrics
                        .tokens
                        .get_or_create(&labels([
                            ("backend", backend),
                            ("model", model),
                            ("kind", kind),
                        ]))
                        .inc_by(count);
                }
                if let Some(cost) = super::prices::current().cost(&report.model, usage) {
                    metrics
                        .cost
                        .get_or_create(&labels([("backend", backend), ("model", model)]))
                        .inc_by(cost);
                }
            }
        }
        Some(Detail::TestRun(report)) => {
            let framework = troupe_proto::names::name(report.framework());
            metrics
                .pass_rate
                .get_or_create(&labels([("framework", framework)]))
                .set(report.pass_rate);
            if let Some(overall) = report.coverage.as_ref().and_then(|c| c.overall) {
                metrics
                    .coverage
                    .get_or_create(&labels([("framework", framework)]))
                    .set(overall);
            }
        }
        Some(Detail::Validation(_)) | None => {}
    }
    if !matches!(outcome, Outcome::Abandoned) {
        metrics
            .duration
            .get_or_create(&labels([
                ("role", role),
                ("backend", backend),
                ("outcome", name),
            ]))
            .observe(took.as_secs_f64());
    }
}
