//! The `agent` block: which backend runs a task's work and how.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;

use super::fields::{self, At, Line};
use crate::validate::Problems;

/// The backend that runs a plan's own program.
pub const COMMAND_BACKEND: &str = "command";

/// A task's `agent` object (also `test.fix.agent`, `test.gc.agent` and `gap_closure.agent`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentSpec {
    /// Backend name (lowercased, one of `troupe_backends::BACKEND_NAMES`); `None` leaves the
    /// choice to the worker (the `command` backend when `command` is set).
    pub backend: Option<String>,
    /// The `command` backend's argv template (placeholders fill whole elements).
    pub command: Option<Vec<String>>,
    /// Wall-clock limit of one run.
    pub timeout: Option<Duration>,
    /// Limit on a run that prints nothing.
    pub idle_timeout: Option<Duration>,
    /// Variables for the `command` backend only (see [`AgentSpec::env_allowed_for`]).
    pub env: BTreeMap<String, String>,
    /// Backends tried after a classified failure; `None` uses the worker's configured chain.
    pub fallback: Option<Vec<String>>,
}

impl AgentSpec {
    /// The backend this block names or implies (`command` when only `command` is set).
    pub fn chosen_backend(&self) -> Option<&str> {
        self.backend
            .as_deref()
            .or_else(|| self.command.as_ref().map(|_| COMMAND_BACKEND))
    }

    /// A plan's `agent.env` reaches the `command` backend (the plan's own program) only: an
    /// agent CLI's environment carries the worker's endpoint and key, and a variable such as
    /// `ANTHROPIC_BASE_URL` or `NODE_OPTIONS` from a plan would send that key, or run code,
    /// where the plan says. Refuses when any backend of `chain` is not `command`.
    pub fn env_allowed_for(&self, chain: &[String]) -> Result<(), String> {
        if self.env.is_empty() {
            return Ok(());
        }
        match chain.iter().find(|name| name.as_str() != COMMAND_BACKEND) {
            Some(name) => Err(format!(
                "`agent.env` is given to the `command` backend only; backend `{name}` gets its \
                 environment (endpoint, key, settings) from the worker's configuration, never \
                 from a plan"
            )),
            None => Ok(()),
        }
    }
}

/// Reads an `agent` object; `default_backend` is the backend a block without one runs
/// (`command` for `test.fix.agent`), `None` when the worker chooses.
pub(crate) fn parse(
    value: &Value,
    at: &At<'_>,
    default_backend: Option<&str>,
    problems: &mut Problems,
) -> Option<AgentSpec> {
    let agent = fields::object(Some(value), at, problems)?;
    let backend = match fields::present(agent.get("backend")) {
        Some(value) => fields::backend(Some(value), &at.field("backend"), problems),
        None => default_backend.map(str::to_owned),
    };
    let command = fields::argv(
        agent.get("command"),
        Line::NoShell,
        &at.field("command"),
        problems,
    );
    let fallback = fields::present(agent.get("fallback")).map(|value| {
        let at = at.field("fallback");
        fields::strings(Some(value), &at, problems)
            .iter()
            .enumerate()
            .filter_map(|(position, name)| {
                fields::backend(
                    Some(&Value::String(name.clone())),
                    &at.index(position),
                    problems,
                )
            })
            .collect()
    });
    let spec = AgentSpec {
        backend,
        command,
        timeout: fields::seconds(
            agent.get("timeout_seconds"),
            &at.field("timeout_seconds"),
            problems,
        ),
        idle_timeout: fields::seconds(
            agent.get("idle_timeout_seconds"),
            &at.field("idle_timeout_seconds"),
            problems,
        ),
        env: fields::string_map(agent.get("env"), &at.field("env"), problems),
        fallback,
    };
    let explicit_command = agent.get("command").is_some_and(|value| !value.is_null());
    if spec.backend.as_deref() == Some(COMMAND_BACKEND) && !explicit_command {
        at.field("command").invalid(
            problems,
            "is missing: the `command` backend runs the plan's own program, an argv array",
        );
    }
    if let Some(backend) = spec.backend.as_deref()
        && backend != COMMAND_BACKEND
        && !spec.env.is_empty()
    {
        at.field("env").invalid(
            problems,
            format_args!(
                "is given to the `command` backend only; backend `{backend}` gets its \
                 environment (endpoint, key, settings) from the worker's configuration"
            ),
        );
    }
    Some(spec)
}
