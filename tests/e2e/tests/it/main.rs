//! End-to-end tests: real services, real git, real SQLite, real pytest, real grpcurl.

mod bad_plan;
mod exec_phase;
mod grpcurl;
mod lease;
mod otlp;
mod pause;
mod quickstart;
mod reconnect;
mod shutdown;
mod support;
mod tour;
