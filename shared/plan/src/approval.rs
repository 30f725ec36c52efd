//! A task's approval gate: `"approval": true`, or a prompt saying what the approver should
//! check. The coordinator holds such a task in `waiting_approval` once its dependencies
//! complete, until a person approves or rejects it.

use serde_json::{Map, Value};

use crate::validate::{ProblemKind, Problems};

/// The prompt of a task's gate (empty for `true`), or `None` when it runs without approval.
pub fn approval_prompt(spec: &Map<String, Value>) -> Option<String> {
    match spec.get("approval")? {
        Value::Bool(true) => Some(String::new()),
        Value::String(prompt) if !prompt.trim().is_empty() => Some(prompt.trim().to_owned()),
        _ => None,
    }
}

/// Checks the `approval` field of a task.
pub(crate) fn check(object: &Map<String, Value>, owner: &str, problems: &mut Problems) {
    match object.get("approval") {
        None | Some(Value::Null | Value::Bool(_)) => {}
        Some(Value::String(prompt)) if !prompt.trim().is_empty() => {}
        Some(other) => problems.push(
            ProblemKind::InvalidValue,
            format!(
                "{owner}: `approval` must be true, false or what the approver should check, not {other}"
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gate_is_true_or_a_prompt() {
        let spec = |value: Value| {
            let mut map = Map::new();
            map.insert("approval".to_owned(), value);
            map
        };
        assert_eq!(
            approval_prompt(&spec(Value::Bool(true))),
            Some(String::new())
        );
        assert_eq!(
            approval_prompt(&spec(Value::String(" check the schema ".into()))),
            Some("check the schema".to_owned())
        );
        assert_eq!(approval_prompt(&spec(Value::Bool(false))), None);
        assert_eq!(approval_prompt(&Map::new()), None);
    }

    #[test]
    fn a_bad_gate_is_refused_at_intake() {
        let err = crate::Plan::from_json(
            r#"{"tasks": [{"id": "IMPL-1", "title": "t", "approval": 3},
                          {"id": "IMPL-2", "title": "u", "approval": ""}]}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("IMPL-1: `approval` must be true"), "{err}");
        assert!(err.contains("IMPL-2: `approval` must be true"), "{err}");
    }
}
