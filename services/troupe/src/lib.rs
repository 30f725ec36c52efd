//! The `troupe` CLI: `up` serves all four services in one process on one port, `run` runs a
//! plan end to end (in-process by default, or against a running server with `--connect`),
//! `status` / `watch` inspect a session on a running server, and `import` / `export` convert
//! CCW session folders to and from sessions.
//!
//! [`embedded`] is the all-in-one assembly `up` and `run` share; [`plan_file`] loads plans
//! (JSON or TOML); [`report`] renders progress and the final report; [`follow`] follows a
//! session across coordinator restarts; `troupe graph` draws with `troupe_view`, and
//! [`session_report`] accounts for its time and tokens.

pub mod assets;
pub mod ccw_export;
pub mod cli;
pub mod doctor;
pub mod embedded;
pub mod follow;
pub mod live;
pub mod plan_file;
pub mod report;
pub mod seed;
pub mod session_report;
