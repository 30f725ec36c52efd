//! The `convergence` block: what "done" means for a task and the command that checks it.

use serde_json::Value;

use super::fields::{self, At, Line};
use crate::validate::Problems;

/// A task's `convergence` object.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Convergence {
    /// Free-text criteria (a judge or a person checks them).
    pub criteria: Vec<String>,
    /// `verification` as argv: an array as is, a command line split without a shell, or
    /// `["sh", "-c", line]` verbatim when the line uses shell syntax. `None` when absent or
    /// blank.
    pub verification: Option<Vec<String>>,
    /// CCW's `definition_of_done`.
    pub definition_of_done: Option<String>,
}

pub(crate) fn parse(value: &Value, at: &At<'_>, problems: &mut Problems) -> Convergence {
    let Some(convergence) = fields::object(Some(value), at, problems) else {
        return Convergence::default();
    };
    let verification = match convergence.get("verification") {
        // A blank line is no verification (CCW writes "" for "none").
        Some(Value::String(line)) if line.trim().is_empty() => None,
        value => fields::argv(value, Line::Shell, &at.field("verification"), problems),
    };
    Convergence {
        criteria: fields::strings(convergence.get("criteria"), &at.field("criteria"), problems),
        verification,
        definition_of_done: fields::string(
            convergence.get("definition_of_done"),
            &at.field("definition_of_done"),
            problems,
        ),
    }
}
