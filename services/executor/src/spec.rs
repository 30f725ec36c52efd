//! What the executor reads of a task beyond [`TaskSpec`] (which `troupe-plan` owns): the
//! prose an agent's prompt quotes (`implementation`, `reference`, `rationale`, `risks`). These
//! are free text for a person or an agent, so they are rendered leniently, never checked.

use std::time::Duration;

use serde_json::Value;

pub use troupe_plan::TaskSpec;
pub use troupe_plan::spec::ScopePolicy;

/// A wall-clock limit when neither the agent nor the task sets one: CCW's executors give a
/// CLI agent one hour.
pub const DEFAULT_AGENT_TIMEOUT: Duration = Duration::from_secs(3600);

/// Converts a protobuf `Struct` to a JSON object (see [`troupe_proto::json`]).
pub use troupe_proto::json::struct_to_object as struct_to_json;

/// The prompt's prose sections of a task.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Brief {
    /// `implementation[]`: one line per step.
    pub(crate) implementation: Vec<String>,
    /// `reference`: pattern, files, examples.
    pub(crate) reference: Vec<String>,
    /// `rationale.chosen_approach`.
    pub(crate) approach: Option<String>,
    /// `risks[]`, with their mitigations.
    pub(crate) risks: Vec<String>,
}

impl Brief {
    /// The prose of `spec`'s task object.
    pub(crate) fn of(spec: &TaskSpec) -> Self {
        let object = &spec.object;
        Self {
            implementation: implementation_steps(object.get("implementation")),
            reference: reference_lines(object.get("reference")),
            approach: object
                .get("rationale")
                .and_then(|r| r.get("chosen_approach"))
                .and_then(Value::as_str)
                .map(str::to_owned),
            risks: risk_lines(object.get("risks")),
        }
    }
}

fn string_list(value: Option<&Value>) -> Vec<String> {
    value
        .and_then(Value::as_array)
        .map(|items| {
            items
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

fn implementation_steps(value: Option<&Value>) -> Vec<String> {
    let Some(items) = value.and_then(Value::as_array) else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|item| match item {
            Value::String(step) => Some(step.clone()),
            Value::Object(step) => {
                let title = step.get("title").and_then(Value::as_str);
                let description = step.get("description").and_then(Value::as_str);
                let mut line = match (title, description) {
                    (Some(t), Some(d)) => format!("{t}: {d}"),
                    (Some(t), None) => t.to_owned(),
                    (None, Some(d)) => d.to_owned(),
                    (None, None) => Value::Object(step.clone()).to_string(),
                };
                let points = string_list(step.get("modification_points"));
                if !points.is_empty() {
                    line.push_str(&format!(" (touch: {})", points.join("; ")));
                }
                Some(line)
            }
            _ => None,
        })
        .collect()
}

fn reference_lines(value: Option<&Value>) -> Vec<String> {
    let Some(reference) = value.and_then(Value::as_object) else {
        return Vec::new();
    };
    let mut lines = Vec::new();
    if let Some(pattern) = reference.get("pattern").and_then(Value::as_str) {
        lines.push(format!("pattern: {pattern}"));
    }
    let files = string_list(reference.get("files"));
    if !files.is_empty() {
        lines.push(format!("files: {}", files.join(", ")));
    }
    if let Some(examples) = reference.get("examples").and_then(Value::as_str) {
        lines.push(format!("examples: {examples}"));
    }
    lines
}

fn risk_lines(value: Option<&Value>) -> Vec<String> {
    let Some(items) = value.and_then(Value::as_array) else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|risk| match risk {
            Value::String(s) => Some(s.clone()),
            Value::Object(r) => {
                let description = r.get("description").and_then(Value::as_str)?;
                Some(match r.get("mitigation").and_then(Value::as_str) {
                    Some(m) => format!("{description} (mitigation: {m})"),
                    None => description.to_owned(),
                })
            }
            _ => None,
        })
        .collect()
}

/// Reads a task object as the executor does (the executor's role when nothing else names
/// one), with every problem in one message.
pub(crate) fn parse(object: &serde_json::Map<String, Value>) -> Result<TaskSpec, String> {
    TaskSpec::from_object(object, Some(troupe_plan::Role::Executor)).map_err(|err| {
        err.problems
            .into_iter()
            .map(|problem| problem.message)
            .collect::<Vec<_>>()
            .join("; ")
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_brief_renders_ccw_prose() {
        let spec = parse(
            json!({
                "id": "IMPL-1",
                "implementation": ["step one", {"step": 2, "title": "Two", "description": "do it", "modification_points": ["a.py: +f"]}],
                "reference": {"pattern": "repo", "files": ["a.py"], "examples": "see a"},
                "rationale": {"chosen_approach": "small"},
                "risks": ["r1", {"description": "r2", "mitigation": "m"}],
            })
            .as_object()
            .expect("object"),
        )
        .expect("valid");
        let brief = Brief::of(&spec);
        assert_eq!(
            brief.implementation,
            ["step one", "Two: do it (touch: a.py: +f)"]
        );
        assert_eq!(
            brief.reference,
            ["pattern: repo", "files: a.py", "examples: see a"]
        );
        assert_eq!(brief.approach.as_deref(), Some("small"));
        assert_eq!(brief.risks, ["r1", "r2 (mitigation: m)"]);
    }

    #[test]
    fn malformed_tasks_are_refused_with_every_problem() {
        let err = parse(
            json!({
                "files": [{"action": "create"}],
                "scope_policy": "maybe",
                "agent": {"command": "make && make install", "timeout_seconds": -1},
            })
            .as_object()
            .expect("object"),
        )
        .expect_err("invalid");
        for needle in [
            "missing required field `id`",
            "files[0]: missing required field `path`",
            "`scope_policy` must be",
            "shell syntax",
            "agent.timeout_seconds",
        ] {
            assert!(err.contains(needle), "{needle} missing from {err}");
        }
    }
}
