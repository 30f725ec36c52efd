//! A role's checkpoints: the plan-level `checkpoints` list, where a person approves a stage of
//! the work as CCW stops for a human between its phases:
//!
//! ```json
//! "checkpoints": [{"role": "executor", "when": "after", "approval": "check the build"}]
//! ```
//!
//! `before` holds every task of the role when it becomes ready, until the checkpoint is
//! approved; `after` holds the tasks that depend on one of the role's tasks (and are not of
//! that role) once they become ready, and is answered once every task of the role has finished.
//! The coordinator stores each checkpoint as a gate named `ROLE:WHEN`.

use serde_json::{Map, Value};

use crate::Role;
use crate::validate::{ProblemKind, Problems};

/// When a checkpoint stops the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum When {
    /// Before the role's first task starts.
    Before,
    /// After the role's last task finished, before the tasks downstream of it start.
    After,
}

impl When {
    /// The plan spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Before => "before",
            Self::After => "after",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        match text {
            "before" => Some(Self::Before),
            "after" => Some(Self::After),
            _ => None,
        }
    }
}

/// One checkpoint of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// The role whose stage it guards.
    pub role: Role,
    /// Before its first task, or after its last.
    pub when: When,
    /// What the approver should check (may be empty).
    pub prompt: String,
}

impl Checkpoint {
    /// Its id, `ROLE:WHEN` (`executor:after`): what `troupe approve --checkpoint` and the
    /// `checkpoint` field of `ApproveTask`/`RejectTask` name.
    pub fn id(&self) -> String {
        format!("{}:{}", self.role.as_str(), self.when.as_str())
    }

    /// The checkpoint an id names, if it is well formed.
    pub fn parse_id(id: &str) -> Option<(Role, When)> {
        let (role, when) = id.split_once(':')?;
        Some((Role::parse(role)?, When::parse(when)?))
    }
}

/// Reads and checks the plan's `checkpoints` against the roles its tasks have; every problem
/// goes to `problems`.
pub(crate) fn parse(
    root: &Map<String, Value>,
    roles: &[Role],
    problems: &mut Problems,
) -> Vec<Checkpoint> {
    let entries = match root.get("checkpoints") {
        None | Some(Value::Null) => return Vec::new(),
        Some(Value::Array(entries)) => entries,
        Some(other) => {
            problems.push(
                ProblemKind::InvalidValue,
                format!("plan: `checkpoints` must be a list, not {other}"),
            );
            return Vec::new();
        }
    };
    let mut checkpoints: Vec<Checkpoint> = Vec::new();
    for (index, entry) in entries.iter().enumerate() {
        let owner = format!("checkpoints[{index}]");
        let Value::Object(entry) = entry else {
            problems.push(
                ProblemKind::InvalidValue,
                format!("{owner}: must be an object with `role` and `when`, not {entry}"),
            );
            continue;
        };
        for key in entry.keys() {
            if !matches!(key.as_str(), "role" | "when" | "approval") {
                problems.push(
                    ProblemKind::InvalidValue,
                    format!("{owner}: unknown field `{key}` (expected role, when, approval)"),
                );
            }
        }
        let role = match entry.get("role") {
            None => {
                problems.push(
                    ProblemKind::MissingField,
                    format!("{owner}: missing required field `role`"),
                );
                None
            }
            Some(Value::String(name)) => match Role::parse(name) {
                Some(role) if roles.contains(&role) => Some(role),
                Some(role) => {
                    problems.push(
                        ProblemKind::InvalidValue,
                        format!("{owner}: no task of the plan has role `{}`", role.as_str()),
                    );
                    None
                }
                None => {
                    problems.push(
                        ProblemKind::UnknownRole,
                        format!(
                            "{owner}: `role` must be executor, validator or test-runner, not {name:?}"
                        ),
                    );
                    None
                }
            },
            Some(other) => {
                problems.push(
                    ProblemKind::InvalidValue,
                    format!("{owner}: `role` must be a string, not {other}"),
                );
                None
            }
        };
        let when = match entry.get("when") {
            None => {
                problems.push(
                    ProblemKind::MissingField,
                    format!("{owner}: missing required field `when` (before or after)"),
                );
                None
            }
            Some(Value::String(text)) => When::parse(text).or_else(|| {
                problems.push(
                    ProblemKind::InvalidValue,
                    format!("{owner}: `when` must be before or after, not {text:?}"),
                );
                None
            }),
            Some(other) => {
                problems.push(
                    ProblemKind::InvalidValue,
                    format!("{owner}: `when` must be before or after, not {other}"),
                );
                None
            }
        };
        let prompt = match entry.get("approval") {
            None | Some(Value::Null | Value::Bool(true)) => Some(String::new()),
            Some(Value::String(prompt)) if !prompt.trim().is_empty() => {
                Some(prompt.trim().to_owned())
            }
            Some(other) => {
                problems.push(
                    ProblemKind::InvalidValue,
                    format!(
                        "{owner}: `approval` must be true or what the approver should check, not {other}"
                    ),
                );
                None
            }
        };
        let (Some(role), Some(when), Some(prompt)) = (role, when, prompt) else {
            continue;
        };
        let checkpoint = Checkpoint { role, when, prompt };
        if checkpoints.iter().any(|c| c.role == role && c.when == when) {
            problems.push(
                ProblemKind::InvalidValue,
                format!("{owner}: checkpoint {} is given twice", checkpoint.id()),
            );
            continue;
        }
        checkpoints.push(checkpoint);
    }
    checkpoints
}

/// The checkpoints of a stored plan's JSON (already validated at intake): `(id, prompt)`.
pub fn checkpoints_of(plan_json: &str) -> Vec<(String, String)> {
    // Most plans have none: skip the parse.
    if !plan_json.contains("\"checkpoints\"") {
        return Vec::new();
    }
    let Ok(Value::Object(root)) = serde_json::from_str::<Value>(plan_json) else {
        return Vec::new();
    };
    let roles = [Role::Executor, Role::Validator, Role::TestRunner];
    parse(&root, &roles, &mut Problems::default())
        .into_iter()
        .map(|c| (c.id(), c.prompt))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoints_parse_and_name_themselves() {
        let root: Map<String, Value> = serde_json::from_str(
            r#"{"checkpoints": [{"role": "executor", "when": "after", "approval": " check the build "},
                                {"role": "test-runner", "when": "before"}]}"#,
        )
        .unwrap();
        let mut problems = Problems::default();
        let parsed = parse(&root, &[Role::Executor, Role::TestRunner], &mut problems);
        assert!(problems.0.is_empty(), "{:?}", problems.0);
        let ids: Vec<String> = parsed.iter().map(Checkpoint::id).collect();
        assert_eq!(ids, ["executor:after", "test-runner:before"]);
        assert_eq!(parsed[0].prompt, "check the build");
        assert_eq!(
            Checkpoint::parse_id("test-runner:before"),
            Some((Role::TestRunner, When::Before))
        );
        assert_eq!(Checkpoint::parse_id("executor:during"), None);
        assert_eq!(Checkpoint::parse_id("IMPL-1"), None);
    }

    #[test]
    fn every_bad_checkpoint_is_reported() {
        let root: Map<String, Value> = serde_json::from_str(
            r#"{"checkpoints": [{"role": "executor", "when": "later"},
                                {"when": "after"},
                                {"role": "validator", "when": "before"},
                                {"role": "coder", "when": "before", "colour": 1},
                                {"role": "executor", "when": "after", "approval": 3},
                                {"role": "executor", "when": "before"},
                                {"role": "executor", "when": "before"},
                                "executor"]}"#,
        )
        .unwrap();
        let mut problems = Problems::default();
        let parsed = parse(&root, &[Role::Executor], &mut problems);
        assert_eq!(parsed.len(), 1);
        let messages: Vec<&str> = problems.0.iter().map(|p| p.message.as_str()).collect();
        for expected in [
            "checkpoints[0]: `when` must be before or after, not \"later\"",
            "checkpoints[1]: missing required field `role`",
            "checkpoints[2]: no task of the plan has role `validator`",
            "checkpoints[3]: unknown field `colour`",
            "checkpoints[3]: `role` must be executor, validator or test-runner, not \"coder\"",
            "checkpoints[4]: `approval` must be true or what the approver should check",
            "checkpoints[6]: checkpoint executor:before is given twice",
            "checkpoints[7]: must be an object",
        ] {
            assert!(
                messages.iter().any(|m| m.starts_with(expected)),
                "{expected}: {messages:#?}"
            );
        }
        assert_eq!(messages.len(), 8, "{messages:#?}");
    }
}
