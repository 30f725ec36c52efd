//! OTLP metrics: when `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is
//! set, the same registry `/metrics` serves is pushed over OTLP/gRPC every
//! `OTEL_METRIC_EXPORT_INTERVAL` milliseconds (default 60 000), and once more at shutdown.
//!
//! A bridge, not a second set of instruments: each push runs the refresh hooks, encodes the
//! registry as a scrape would, and sends what it reads as OTLP data points (counters as
//! cumulative monotonic sums, gauges as gauges, histograms as cumulative explicit-bucket
//! histograms), each series' labels as attributes, under the process's resource
//! (`service.name` and the rest, as its spans have).

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_client::MetricsServiceClient;
use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::{
    AggregationTemporality, Gauge, Histogram, HistogramDataPoint, Metric, NumberDataPoint,
    ResourceMetrics, ScopeMetrics, Sum, metric, number_data_point,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use prometheus_parse::{Scrape, Value};

use crate::metrics::Refresh;

/// Where and how often to push, from the environment; `None` when no endpoint is set.
pub(crate) struct Config {
    endpoint: String,
    interval: Duration,
}

impl Config {
    pub(crate) fn from_env() -> Option<Self> {
        let endpoint = [
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ]
        .iter()
        .filter_map(|name| std::env::var(name).ok())
        .map(|value| value.trim().to_owned())
        .find(|value| !value.is_empty())?;
        let interval = std::env::var("OTEL_METRIC_EXPORT_INTERVAL")
            .ok()
            .and_then(|ms| ms.trim().parse::<u64>().ok())
            .filter(|ms| *ms > 0)
            .map_or(Duration::from_secs(60), Duration::from_millis);
        Some(Self { endpoint, interval })
    }
}

/// Pushes every `config.interval` until `shutdown`, then once more.
pub(crate) async fn push_until(
    config: Config,
    refresh: Vec<Refresh>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let started = unix_nanos(SystemTime::now());
    let mut ticks = tokio::time::interval(config.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate: wait one interval before the first push.
    ticks.tick().await;
    tokio::pin!(shutdown);
    loop {
        let last = tokio::select! {
            _ = ticks.tick() => false,
            () = &mut shutdown => true,
        };
        if let Err(err) = push(&config.endpoint, &refresh, started).await {
            tracing::warn!(endpoint = %config.endpoint, error = %err, "OTLP metrics push failed");
        }
        if last {
            return;
        }
    }
}

async fn push(endpoint: &str, refresh: &[Refresh], started: u64) -> Result<(), String> {
    let text = crate::metrics::render(refresh).await?;
    let scrape = Scrape::parse(text.lines().map(|line| Ok(line.to_owned())))
        .map_err(|err| format!("reading the registry's own text: {err}"))?;
    let request = ExportMetricsServiceRequest {
        resource_metrics: vec![ResourceMetrics {
            resource: Some(resource()),
            scope_metrics: vec![ScopeMetrics {
                scope: Some(InstrumentationScope {
                    name: "troupe".to_owned(),
                    ..InstrumentationScope::default()
                }),
                metrics: metrics(&scrape, started, unix_nanos(SystemTime::now())),
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
    };
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
        .map_err(|err| format!("invalid endpoint: {err}"))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .map_err(|err| format!("connecting: {err}"))?;
    MetricsServiceClient::new(channel)
        .export(request)
        .await
        .map_err(|status| format!("export: {status}"))?;
    Ok(())
}

fn unix_nanos(at: SystemTime) -> u64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)
        })
}

fn text(key: &str, value: String) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(value)),
        }),
        ..KeyValue::default()
    }
}

fn resource() -> Resource {
    let name = crate::SERVICE_NAME.get().map_or("troupe", String::as_str);
    Resource {
        attributes: crate::resource(name)
            .iter()
            .map(|(key, value)| text(key.as_str(), value.to_string()))
            .collect(),
        ..Resource::default()
    }
}

/// The scrape's families as OTLP metrics, stamped `now`, cumulative since `started`.
fn metrics(scrape: &Scrape, started: u64, now: u64) -> Vec<Metric> {
    let pairs = |labels: &prometheus_parse::Labels| -> Vec<(String, String)> {
        let sorted: BTreeMap<&String, &String> = labels.iter().collect();
        sorted
            .into_iter()
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect()
    };
    let attributes = |labels: &prometheus_parse::Labels| -> Vec<KeyValue> {
        pairs(labels)
            .into_iter()
            .map(|(key, value)| text(&key, value))
            .collect()
    };
    // A histogram's `_sum` series, by name and labels.
    let sums: BTreeMap<(String, Vec<(String, String)>), f64> = scrape
        .samples
        .iter()
        .filter_map(|sample| {
            let base = sample.metric.strip_suffix("_sum")?;
            let Value::Untyped(sum) = sample.value else {
                return None;
            };
            Some(((base.to_owned(), pairs(&sample.labels)), sum))
        })
        .collect();
    let mut by_name: BTreeMap<&str, Metric> = BTreeMap::new();
    for sample in &scrape.samples {
        let point_attributes = attributes(&sample.labels);
        let number = |value: f64| NumberDataPoint {
            attributes: point_attributes.clone(),
            start_time_unix_nano: started,
            time_unix_nano: now,
            value: Some(number_data_point::Value::AsDouble(value)),
            ..NumberDataPoint::default()
        };
        let data = match &sample.value {
            Value::Counter(value) => metric::Data::Sum(Sum {
                data_points: vec![number(*value)],
                aggregation_temporality: AggregationTemporality::Cumulative as i32,
                is_monotonic: true,
            }),
            Value::Gauge(value) => metric::Data::Gauge(Gauge {
                data_points: vec![number(*value)],
            }),
            Value::Histogram(buckets) => {
                let count = buckets
                    .iter()
                    .find(|bucket| bucket.less_than.is_infinite())
                    .map_or(0.0, |bucket| bucket.count);
                let mut bounds = Vec::new();
                let mut counts = Vec::new();
                let mut below = 0.0;
                for bucket in buckets {
                    if !bucket.less_than.is_infinite() {
                        bounds.push(bucket.less_than);
                    }
                    counts.push(as_count(bucket.count - below));
                    below = bucket.count;
                }
                let sum = sums
                    .get(&(sample.metric.clone(), pairs(&sample.labels)))
                    .copied();
                metric::Data::Histogram(Histogram {
                    data_points: vec![HistogramDataPoint {
                        attributes: point_attributes.clone(),
                        start_time_unix_nano: started,
                        time_unix_nano: now,
                        count: as_count(count),
                        sum,
                        bucket_counts: counts,
                        explicit_bounds: bounds,
                        ..HistogramDataPoint::default()
                    }],
                    aggregation_temporality: AggregationTemporality::Cumulative as i32,
                })
            }
            // A histogram's `_sum` and `_count` are in its data point already.
            Value::Untyped(_) | Value::Summary(_) => continue,
        };
        let entry = by_name.entry(&sample.metric).or_insert_with(|| Metric {
            name: sample.metric.clone(),
            description: scrape.docs.get(&sample.metric).cloned().unwrap_or_default(),
            ..Metric::default()
        });
        match (&mut entry.data, data) {
            (None, data) => entry.data = Some(data),
            (Some(metric::Data::Sum(all)), metric::Data::Sum(one)) => {
                all.data_points.extend(one.data_points);
            }
            (Some(metric::Data::Gauge(all)), metric::Data::Gauge(one)) => {
                all.data_points.extend(one.data_points);
            }
            (Some(metric::Data::Histogram(all)), metric::Data::Histogram(one)) => {
                all.data_points.extend(one.data_points);
            }
            // One name never has two types in one registry.
            _ => {}
        }
    }
    by_name.into_values().collect()
}

/// A bucket count read back from text: a whole number.
fn as_count(value: f64) -> u64 {
    if value.is_finite() && value > 0.0 {
        // Counts far below 2^53: exact.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let count = value.round() as u64;
        count
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_gauges_and_histograms_become_otlp_points() {
        let exposition = "\
# HELP jobs_total Jobs done.
# TYPE jobs_total counter
jobs_total{role=\"a\"} 3
jobs_total{role=\"b\"} 4
# HELP depth Queue depth.
# TYPE depth gauge
depth 7
# HELP took_seconds Time taken.
# TYPE took_seconds histogram
took_seconds_bucket{role=\"a\",le=\"0.1\"} 1
took_seconds_bucket{role=\"a\",le=\"1.0\"} 3
took_seconds_bucket{role=\"a\",le=\"+Inf\"} 4
took_seconds_sum{role=\"a\"} 5.5
took_seconds_count{role=\"a\"} 4
";
        let scrape = Scrape::parse(exposition.lines().map(|l| Ok(l.to_owned()))).expect("parses");
        let metrics = metrics(&scrape, 1, 2);
        let find = |name: &str| {
            metrics
                .iter()
                .find(|m| m.name == name)
                .unwrap_or_else(|| panic!("no {name}: {metrics:?}"))
        };
        let Some(metric::Data::Sum(jobs)) = &find("jobs_total").data else {
            panic!("jobs_total is not a sum");
        };
        assert!(jobs.is_monotonic);
        assert_eq!(jobs.data_points.len(), 2);
        assert_eq!(find("jobs_total").description, "Jobs done.");
        let Some(metric::Data::Gauge(depth)) = &find("depth").data else {
            panic!("depth is not a gauge");
        };
        assert_eq!(
            depth.data_points[0].value,
            Some(number_data_point::Value::AsDouble(7.0))
        );
        let Some(metric::Data::Histogram(took)) = &find("took_seconds").data else {
            panic!("took_seconds is not a histogram");
        };
        let point = &took.data_points[0];
        assert_eq!(point.explicit_bounds, vec![0.1, 1.0]);
        assert_eq!(point.bucket_counts, vec![1, 2, 1]);
        assert_eq!((point.count, point.sum), (4, Some(5.5)));
        assert_eq!(point.attributes, vec![text("role", "a".to_owned())]);
        assert_eq!(metrics.len(), 3, "no separate _sum or _count metrics");
    }
}
