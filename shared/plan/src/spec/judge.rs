//! The `judge` block of a validator task: who reads free-text criteria.

use std::time::Duration;

use serde_json::Value;
use troupe_backends::BackendConfig;

use super::agent::COMMAND_BACKEND;
use super::fields::{self, At, Line};
use crate::PlanError;
use crate::validate::Problems;

/// What a plan may set for a judge run by an agent backend; where it connects and which
/// credentials it gets come from the validator's configuration only.
pub const JUDGE_PLAN_SETTINGS: [&str; 7] = [
    "backend",
    "model",
    "timeout_seconds",
    "idle_timeout_seconds",
    "max_turns",
    "max_tokens",
    "fast_fail",
];

/// A validator task's `judge`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JudgeSpec {
    /// The `command` backend: an argv reading the criterion on stdin.
    Command {
        /// The argv template.
        argv: Vec<String>,
        /// Limit of one run, if set.
        timeout: Option<Duration>,
    },
    /// An agent backend with the settings a plan may give ([`JUDGE_PLAN_SETTINGS`]).
    Backend {
        /// Backend name.
        backend: String,
        /// Model, limits and budgets.
        settings: Box<BackendConfig>,
    },
}

impl JudgeSpec {
    /// Reads a judge a `Validate` request names (`judge_spec`) by the rules of a task's
    /// `judge`; `Null` is no judge.
    pub fn from_value(value: &Value) -> Result<Option<Self>, PlanError> {
        let mut problems = Problems::default();
        let judge = parse(value, &At::new("request", "judge_spec"), &mut problems);
        if problems.0.is_empty() {
            Ok(judge)
        } else {
            Err(PlanError {
                problems: problems.0,
            })
        }
    }
}

pub(crate) fn parse(value: &Value, at: &At<'_>, problems: &mut Problems) -> Option<JudgeSpec> {
    let map = match fields::present(Some(value))? {
        Value::Object(map) => map,
        other => {
            return fields::argv(Some(other), Line::Shell, at, problems).map(|argv| {
                JudgeSpec::Command {
                    argv,
                    timeout: None,
                }
            });
        }
    };
    let backend = match fields::present(map.get("backend")) {
        None => COMMAND_BACKEND.to_owned(),
        Some(value) => fields::backend(Some(value), &at.field("backend"), problems)?,
    };
    if backend == COMMAND_BACKEND {
        for key in map.keys() {
            if !matches!(key.as_str(), "backend" | "command" | "timeout_seconds") {
                at.field(key).invalid(
                    problems,
                    "is not a setting of the `command` backend (command, timeout_seconds)",
                );
            }
        }
        let timeout = fields::whole(
            map.get("timeout_seconds"),
            1..=31_536_000,
            &at.field("timeout_seconds"),
            problems,
        )
        .map(Duration::from_secs);
        let argv = match fields::present(map.get("command")) {
            Some(command) => {
                fields::argv(Some(command), Line::Shell, &at.field("command"), problems)
            }
            None => {
                at.field("command")
                    .invalid(problems, "is missing: a `command` judge needs an argv");
                None
            }
        };
        return argv.map(|argv| JudgeSpec::Command { argv, timeout });
    }
    let mut refused = false;
    for key in map.keys() {
        if !JUDGE_PLAN_SETTINGS.contains(&key.as_str()) {
            refused = true;
            at.field(key).invalid(
                problems,
                format_args!(
                    "is not a judge setting a plan may give: where a judge connects and what it \
                     is given come from the validator's configuration (--judge-config); a plan \
                     may set {}",
                    JUDGE_PLAN_SETTINGS.join(", ")
                ),
            );
        }
    }
    if refused {
        return None;
    }
    let mut rest = map.clone();
    rest.remove("backend");
    match serde_json::from_value::<BackendConfig>(Value::Object(rest)) {
        Ok(settings) => Some(JudgeSpec::Backend {
            backend,
            settings: Box::new(settings),
        }),
        Err(err) => {
            at.invalid(problems, format_args!("has a bad setting: {err}"));
            None
        }
    }
}
