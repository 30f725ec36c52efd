//! `pre_analysis[]`: context-gathering steps the executor runs in the worktree before the
//! agent (CCW). Checked here; run by the executor.

use std::time::Duration;

use serde_json::Value;

use super::fields::{self, At};
use crate::validate::Problems;

/// What one step's failure does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnError {
    /// The task fails before the agent runs (default).
    #[default]
    Fail,
    /// The error text becomes the step's output; later steps run.
    Continue,
    /// The step contributes nothing; later steps run.
    Skip,
}

/// One step.
#[derive(Debug, Clone, PartialEq)]
pub struct PreAnalysisStep {
    /// `step`, else `step N`.
    pub name: String,
    /// Commands in order: a tool call string (`Read(path)`, `bash(cmd)`, ...) or an argv.
    pub commands: Vec<Value>,
    /// Placeholder its output fills, if any.
    pub output_to: Option<String>,
    /// What its failure does.
    pub on_error: OnError,
    /// Limit of the step, if set.
    pub timeout: Option<Duration>,
}

pub(crate) fn parse(value: &Value, at: &At<'_>, problems: &mut Problems) -> Vec<PreAnalysisStep> {
    let items = match fields::present(Some(value)) {
        None => return Vec::new(),
        Some(Value::Array(items)) => items,
        Some(other) => {
            at.invalid(
                problems,
                format_args!("must be an array of steps, got {other}"),
            );
            return Vec::new();
        }
    };
    let mut steps = Vec::new();
    for (position, item) in items.iter().enumerate() {
        let at = at.index(position);
        let Some(step) = fields::object(Some(item), &at, problems) else {
            continue;
        };
        let name = fields::string(step.get("step"), &at.field("step"), problems)
            .unwrap_or_else(|| format!("step {}", position + 1));
        let commands = match (
            fields::present(step.get("commands")),
            fields::present(step.get("command")),
        ) {
            (Some(Value::Array(list)), _) => list.clone(),
            (Some(other), _) => {
                at.field("commands")
                    .invalid(problems, format_args!("must be an array, got {other}"));
                continue;
            }
            (None, Some(command)) => vec![command.clone()],
            (None, None) => {
                at.invalid(problems, format_args!("(step `{name}`) has no command"));
                continue;
            }
        };
        for (index, command) in commands.iter().enumerate() {
            let good = match command {
                Value::String(text) => !text.trim().is_empty(),
                Value::Array(argv) => !argv.is_empty() && argv.iter().all(Value::is_string),
                _ => false,
            };
            if !good {
                at.field("commands").index(index).invalid(
                    problems,
                    format_args!("must be a tool call string or an argv array, got {command}"),
                );
            }
        }
        let on_error = match fields::string(step.get("on_error"), &at.field("on_error"), problems)
            .as_deref()
        {
            None | Some("fail") => OnError::Fail,
            Some("continue") => OnError::Continue,
            Some("skip" | "skip_optional") => OnError::Skip,
            Some(other) => {
                at.field("on_error").invalid(
                    problems,
                    format_args!("`{other}` is not fail, continue or skip"),
                );
                OnError::Fail
            }
        };
        steps.push(PreAnalysisStep {
            name,
            commands,
            output_to: fields::string(step.get("output_to"), &at.field("output_to"), problems)
                .map(|text| text.trim().to_owned())
                .filter(|text| !text.is_empty()),
            on_error,
            timeout: fields::seconds(
                step.get("timeout_seconds"),
                &at.field("timeout_seconds"),
                problems,
            ),
        });
    }
    steps
}
