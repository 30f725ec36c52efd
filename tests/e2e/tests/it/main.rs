//! End-to-end tests: real services, real git, real SQLite, real pytest, real grpcurl.

mod agent_children;
mod auth;
mod bad_plan;
mod distributed;
mod docs;
mod exactly_once;
mod exec_phase;
mod grpcurl;
mod hosts;
mod lease;
mod metrics;
mod netns;
mod otlp;
mod pause;
mod postgres;
mod quickstart;
mod reconnect;
mod remotes;
mod shutdown;
mod support;
mod tour;
