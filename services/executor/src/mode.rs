//! Which backend runs a task, and why (CCW executor execution-mode resolution, ccw-reference
//! §1.B.3), plus the backends to fall back to and the native session to continue (§3.6).

use serde_json::{Map, Value};
use troupe_backends::{BACKEND_NAMES, BackendsConfig, ErrorKind};

/// The chosen backend and the reason, as recorded in `ImplementationReport.backend_reason`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Resolved {
    pub(crate) backend: String,
    pub(crate) reason: String,
}

fn known(name: &str) -> Option<String> {
    let name = name.trim().to_ascii_lowercase();
    BACKEND_NAMES.contains(&name.as_str()).then_some(name)
}

/// `Executor: codex` (or `Executor: Agent`) in the description.
fn executor_field(description: &str) -> Option<String> {
    description.lines().find_map(|line| {
        let rest = line.trim().strip_prefix("Executor:")?;
        let word = rest.split_whitespace().next()?;
        known(word.trim_matches(|c: char| !c.is_ascii_alphanumeric()))
    })
}

fn complexity(spec: &Map<String, Value>, plan: Option<&Value>) -> Option<String> {
    spec.get("complexity")
        .or_else(|| spec.get("meta").and_then(|m| m.get("complexity")))
        .or_else(|| plan.and_then(|p| p.get("complexity")))
        .and_then(Value::as_str)
        .map(str::to_ascii_lowercase)
}

/// Resolves the backend in CCW's priority order: the task (`Executor:` in the description,
/// `agent.backend`, `agent.command`) → `meta.execution_config` → the plan's
/// `recommended_execution` (`plan`: the task's `plan_hints`, from its plan at intake) → auto (Low complexity → `agent`, else the configured auto backend).
pub(crate) fn resolve(
    spec: &Map<String, Value>,
    plan: Option<&Value>,
    config: &BackendsConfig,
) -> Result<Resolved, String> {
    let pick = |backend: String, reason: &str| {
        Ok(Resolved {
            backend,
            reason: reason.to_owned(),
        })
    };
    let description = spec
        .get("description")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if let Some(name) = executor_field(description) {
        return pick(name, "task description `Executor:` field");
    }
    let agent = spec.get("agent");
    if let Some(name) = agent.and_then(|a| a.get("backend")).and_then(Value::as_str) {
        return match known(name) {
            Some(name) => pick(name, "task agent.backend"),
            None => Err(format!(
                "unknown backend `{name}` (known: {})",
                BACKEND_NAMES.join(", ")
            )),
        };
    }
    if agent
        .and_then(|a| a.get("command"))
        .is_some_and(|c| !c.is_null())
    {
        return pick("command".to_owned(), "task agent.command");
    }
    if let Some(exec) = spec
        .get("meta")
        .and_then(|m| m.get("execution_config"))
        .and_then(Value::as_object)
    {
        let method = exec
            .get("method")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let tool = exec
            .get("cli_tool")
            .and_then(Value::as_str)
            .unwrap_or("auto");
        match method.to_ascii_lowercase().as_str() {
            "agent" => return pick("agent".to_owned(), "meta.execution_config.method = agent"),
            "cli" => {
                if let Some(name) = known(tool) {
                    return pick(name, "meta.execution_config.cli_tool");
                }
                if let Some(first) = config.fallback.first() {
                    return pick(
                        first.clone(),
                        "meta.execution_config cli_tool auto: first of the fallback chain",
                    );
                }
            }
            _ => {}
        }
    }
    match plan
        .and_then(|p| p.get("recommended_execution"))
        .and_then(Value::as_str)
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        Some("agent") => return pick("agent".to_owned(), "plan recommended_execution = Agent"),
        Some("codex") => return pick("codex".to_owned(), "plan recommended_execution = Codex"),
        _ => {}
    }
    match complexity(spec, plan).as_deref() {
        Some("low") => pick("agent".to_owned(), "auto: low complexity"),
        Some(other) => pick(
            config.auto_backend.clone(),
            &format!("auto: {other} complexity"),
        ),
        None => pick(config.auto_backend.clone(), "auto: complexity not stated"),
    }
}

/// Backends to try in order: the resolved one, then the fallback chain (never for `command`,
/// whose argv is the plan author's own program).
pub(crate) fn candidates(resolved: &str, config: &BackendsConfig) -> Vec<String> {
    let mut out = vec![resolved.to_owned()];
    if resolved != "command" {
        for name in &config.fallback {
            if !out.contains(name) {
                out.push(name.clone());
            }
        }
    }
    out
}

/// Whether another backend may succeed where this one failed with `kind` (the policy the
/// test-runner's fix loop shares: `troupe_backends::chain`).
pub(crate) fn falls_back(kind: ErrorKind) -> bool {
    troupe_backends::chain::falls_back(kind)
}

/// Whether the same backend should be tried again (after a backoff) with `kind`.
pub(crate) fn retries_same(kind: ErrorKind) -> bool {
    troupe_backends::chain::retries_same(kind)
}

/// `cli_execution`: how this task's run relates to earlier runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct CliExecution {
    /// `new`, `resume`, `fork`, `merge_fork`.
    pub(crate) strategy: String,
    /// Task ids whose sessions to continue, first one natively.
    pub(crate) from: Vec<String>,
}

pub(crate) fn cli_execution(spec: &Map<String, Value>) -> Option<CliExecution> {
    let cli = spec.get("cli_execution")?.as_object()?;
    let strategy = cli
        .get("strategy")
        .and_then(Value::as_str)
        .unwrap_or("new")
        .to_ascii_lowercase();
    let mut from: Vec<String> = Vec::new();
    if let Some(parent) = cli.get("resume_from").and_then(Value::as_str) {
        from.push(parent.to_owned());
    }
    for parent in cli
        .get("merge_from")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
    {
        if !from.iter().any(|f| f == parent) {
            from.push(parent.to_owned());
        }
    }
    (strategy != "new" && !from.is_empty()).then_some(CliExecution { strategy, from })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().expect("object").clone()
    }

    #[test]
    fn ccw_priority_order() {
        let config = BackendsConfig::default();
        let r = |spec: Value, plan: Option<Value>| {
            resolve(&obj(spec), plan.as_ref(), &config).expect("resolves")
        };
        let exec = json!({"method": "cli", "cli_tool": "qwen"});
        assert_eq!(
            r(
                json!({"description": "do it\nExecutor: gemini", "agent": {"backend": "codex"}}),
                None
            )
            .backend,
            "gemini"
        );
        assert_eq!(
            r(
                json!({"agent": {"backend": "claude"}, "meta": {"execution_config": exec}}),
                None
            ),
            Resolved {
                backend: "claude".into(),
                reason: "task agent.backend".into()
            }
        );
        assert_eq!(
            r(
                json!({"meta": {"execution_config": exec}}),
                Some(json!({"recommended_execution": "Agent"}))
            )
            .backend,
            "qwen"
        );
        assert_eq!(
            r(
                json!({"meta": {"execution_config": {"method": "agent"}}}),
                None
            )
            .backend,
            "agent"
        );
        assert_eq!(
            r(json!({}), Some(json!({"recommended_execution": "Agent"}))).backend,
            "agent"
        );
        assert_eq!(
            r(
                json!({}),
                Some(json!({"recommended_execution": "Parallel", "complexity": "Low"}))
            )
            .reason,
            "auto: low complexity"
        );
        assert_eq!(
            r(json!({"complexity": "High"}), None),
            Resolved {
                backend: "codex".into(),
                reason: "auto: high complexity".into()
            }
        );
        assert!(resolve(&obj(json!({"agent": {"backend": "nope"}})), None, &config).is_err());
    }

    #[test]
    fn chains_and_strategies() {
        let config = BackendsConfig::default();
        assert_eq!(
            candidates("claude", &config),
            ["claude", "gemini", "qwen", "codex"]
        );
        assert_eq!(candidates("qwen", &config), ["qwen", "gemini", "codex"]);
        assert_eq!(candidates("command", &config), ["command"]);
        assert!(falls_back(ErrorKind::Auth) && !falls_back(ErrorKind::InvalidTask));
        assert!(!retries_same(ErrorKind::Auth));
        assert_eq!(
            cli_execution(&obj(
                json!({"cli_execution": {"strategy": "merge_fork", "merge_from": ["A", "B"]}})
            )),
            Some(CliExecution {
                strategy: "merge_fork".into(),
                from: vec!["A".into(), "B".into()]
            })
        );
        assert_eq!(
            cli_execution(&obj(json!({"cli_execution": {"strategy": "new"}}))),
            None
        );
    }
}
