//! Plan-level execution hints (CCW `plan.json`: `recommended_execution`, `complexity`), which
//! the executor weighs when a task names no backend (ccw-reference §1.B.3).
//!
//! They are read once, at intake, from the plan document (its top level, else the `ccw.plan`
//! section a CCW import keeps) and travel in each executor task's stored spec under
//! [`PLAN_HINTS`], so no worker reads the plan's directory for them.

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::{Plan, Role};

/// The key of an executor task's spec that holds its plan's execution hints.
pub const PLAN_HINTS: &str = "plan_hints";

/// The hint fields, in the order they are looked for.
const FIELDS: [&str; 2] = ["recommended_execution", "complexity"];

#[derive(Deserialize)]
struct Document {
    #[serde(default)]
    recommended_execution: Option<Value>,
    #[serde(default)]
    complexity: Option<Value>,
    #[serde(default)]
    ccw: Option<Ccw>,
}

#[derive(Deserialize)]
struct Ccw {
    #[serde(default)]
    plan: Option<Map<String, Value>>,
}

/// The execution hints of the plan document `plan_json` (string values only), or `None` when
/// it gives none.
pub fn hints(plan_json: &str) -> Option<Map<String, Value>> {
    let document: Document = serde_json::from_str(plan_json).ok()?;
    let ccw = document.ccw.and_then(|ccw| ccw.plan).unwrap_or_default();
    let top = [document.recommended_execution, document.complexity];
    let mut out = Map::new();
    for (field, value) in FIELDS.into_iter().zip(top) {
        let value = value.or_else(|| ccw.get(field).cloned());
        if let Some(Value::String(text)) = value
            && !text.trim().is_empty()
        {
            out.insert(field.to_owned(), Value::String(text));
        }
    }
    (!out.is_empty()).then_some(out)
}

/// Gives every executor task of `plan` the hints of its document `plan_json` (see
/// [`PLAN_HINTS`]); a task's own value, if it has one, is left as written.
pub fn attach(plan: &mut Plan, plan_json: &str) {
    let Some(hints) = hints(plan_json) else {
        return;
    };
    for task in &mut plan.tasks {
        if task.role == Role::Executor && !task.spec.contains_key(PLAN_HINTS) {
            task.spec
                .insert(PLAN_HINTS.to_owned(), Value::Object(hints.clone()));
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn hints_come_from_the_top_level_else_the_ccw_plan() {
        let document = json!({"name": "p", "recommended_execution": "Agent",
            "ccw": {"plan": {"recommended_execution": "Codex", "complexity": "Low"}},
            "tasks": [{"id": "IMPL-1", "title": "a"}, {"id": "VALIDATE-1", "title": "b"}]});
        let text = document.to_string();
        let expected = json!({"recommended_execution": "Agent", "complexity": "Low"});
        assert_eq!(hints(&text), expected.as_object().cloned());
        let mut plan = Plan::from_json(&text).expect("plan");
        attach(&mut plan, &text);
        assert_eq!(plan.tasks[0].spec[PLAN_HINTS], expected);
        assert!(!plan.tasks[1].spec.contains_key(PLAN_HINTS));
        assert_eq!(hints(r#"{"name": "p", "complexity": 3}"#), None);
    }
}
