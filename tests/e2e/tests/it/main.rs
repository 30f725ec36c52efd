//! End-to-end tests: real services, real git, real SQLite, real pytest, real grpcurl.

mod agent_children;
mod auth;
mod bad_plan;
mod confined_suites;
mod deploy;
mod distributed;
mod docs;
mod exactly_once;
mod exec_phase;
// The executor's phase fixture, shared with its own tests rather than copied.
#[path = "../../../../services/executor/tests/it/fixture.rs"]
#[allow(dead_code)]
mod executor_fixture;
mod gates;
mod grpcurl;
mod hosts;
mod lease;
mod metrics;
mod netns;
mod otlp;
mod pause;
mod postgres;
mod quickstart;
mod quota;
mod quota_wave;
mod reconnect;
mod remotes;
mod routing;
mod sandbox;
mod secrets;
mod self_validation;
mod shutdown;
mod support;
// The test-runner's fixture helpers, shared with its own tests rather than copied.
#[path = "../../../../services/test-runner/tests/it/support.rs"]
#[allow(dead_code)]
mod test_runner_support;
mod testrun_task;
mod tour;
mod views;
mod web;
mod worker_health;
