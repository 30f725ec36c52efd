//! Which backend runs a task (CCW executor execution-mode resolution, ccw-reference §1.B.3):
//! one implementation for the executor, which runs it, and the coordinator, which routes the
//! task at intake to workers that can run it.

use serde_json::{Map, Value};
use troupe_backends::BACKEND_NAMES;

use crate::TaskSpec;
use crate::execution::PLAN_HINTS;

/// What a task asks of its worker's backends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendChoice {
    /// This backend, for this reason (as recorded in `ImplementationReport.backend_reason`).
    Named {
        /// Backend name, one of `troupe_backends::BACKEND_NAMES`.
        backend: String,
        /// Why.
        reason: String,
    },
    /// The worker's own choice: any worker may run it.
    Auto {
        /// Which of the worker's configured backends.
        pick: AutoPick,
        /// Why.
        reason: String,
    },
}

/// The worker-side choice an [`BackendChoice::Auto`] task leaves open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AutoPick {
    /// The worker's configured auto backend (`auto_backend`).
    AutoBackend,
    /// The first backend of the worker's fallback chain (`execution_config.cli_tool = auto`).
    FirstFallback,
}

impl BackendChoice {
    /// The backend named, if any.
    pub fn named(&self) -> Option<&str> {
        match self {
            Self::Named { backend, .. } => Some(backend),
            Self::Auto { .. } => None,
        }
    }

    /// The reason, as recorded in a report.
    pub fn reason(&self) -> &str {
        match self {
            Self::Named { reason, .. } | Self::Auto { reason, .. } => reason,
        }
    }
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

fn text<'a>(object: Option<&'a Value>, field: &str) -> Option<&'a str> {
    object.and_then(|o| o.get(field)).and_then(Value::as_str)
}

/// Chooses an executor task's backend in CCW's priority order: the task (`Executor:` in the
/// description, `agent.backend`, `agent.command`) → `meta.execution_config` → its plan's
/// `recommended_execution` (the task's `plan_hints`, attached at intake) → auto (low
/// complexity → `agent`, else the worker's auto backend). `spec` was checked by
/// [`TaskSpec`]'s rules, so a named `agent.backend` is a known one.
pub fn choose(spec: &TaskSpec) -> BackendChoice {
    choose_from(&spec.description, spec.blocks.agent.as_ref(), &spec.object)
}

fn choose_from(
    description: &str,
    agent: Option<&crate::spec::AgentSpec>,
    object: &Map<String, Value>,
) -> BackendChoice {
    let named = |backend: String, reason: &str| BackendChoice::Named {
        backend,
        reason: reason.to_owned(),
    };
    if let Some(name) = executor_field(description) {
        return named(name, "task description `Executor:` field");
    }
    if let Some(agent) = agent {
        if let Some(name) = agent.backend.as_deref().and_then(known) {
            return named(name, "task agent.backend");
        }
        if agent.command.is_some() {
            return named(
                crate::spec::COMMAND_BACKEND.to_owned(),
                "task agent.command",
            );
        }
    }
    let exec = object
        .get("meta")
        .and_then(|m| m.get("execution_config"))
        .filter(|e| e.is_object());
    match text(exec, "method").map(str::to_ascii_lowercase).as_deref() {
        Some("agent") => return named("agent".to_owned(), "meta.execution_config.method = agent"),
        Some("cli") => {
            return match text(exec, "cli_tool").and_then(known) {
                Some(name) => named(name, "meta.execution_config.cli_tool"),
                None => BackendChoice::Auto {
                    pick: AutoPick::FirstFallback,
                    reason: "meta.execution_config cli_tool auto: first of the fallback chain"
                        .to_owned(),
                },
            };
        }
        _ => {}
    }
    let hints = object.get(PLAN_HINTS);
    match text(hints, "recommended_execution")
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        Some("agent") => return named("agent".to_owned(), "plan recommended_execution = Agent"),
        Some("codex") => return named("codex".to_owned(), "plan recommended_execution = Codex"),
        _ => {}
    }
    let auto = |reason: String| BackendChoice::Auto {
        pick: AutoPick::AutoBackend,
        reason,
    };
    match complexity(object, hints).as_deref() {
        Some("low") => named("agent".to_owned(), "auto: low complexity"),
        Some(other) => auto(format!("auto: {other} complexity")),
        None => auto("auto: complexity not stated".to_owned()),
    }
}

fn complexity(object: &Map<String, Value>, hints: Option<&Value>) -> Option<String> {
    object
        .get("complexity")
        .or_else(|| object.get("meta").and_then(|m| m.get("complexity")))
        .or_else(|| hints.and_then(|h| h.get("complexity")))
        .and_then(Value::as_str)
        .map(str::to_ascii_lowercase)
}

/// The backends a worker must be able to run (one of) to take `spec`, primary first: empty
/// when any worker may (an auto choice). An executor task's backend, then the fallbacks its
/// `agent.fallback` names: a worker's own configured chain is its configuration, so the
/// coordinator routes on what the task says. Validator and test-runner tasks are not routed:
/// their main work (checks, suites) needs no agent backend, and a judge or fixer backend is
/// only used for part of it, with the worker's own fallbacks.
pub fn routes(spec: &TaskSpec) -> Vec<String> {
    routes_from(spec.role, &spec.description, &spec.blocks, &spec.object)
}

/// [`routes`] of a plan's task, at intake.
pub fn plan_routes(task: &crate::PlanTask) -> Vec<String> {
    routes_from(task.role, &task.description, &task.blocks, &task.spec)
}

fn routes_from(
    role: crate::Role,
    description: &str,
    blocks: &crate::TaskBlocks,
    object: &Map<String, Value>,
) -> Vec<String> {
    if role != crate::Role::Executor {
        return Vec::new();
    }
    let agent = blocks.agent.as_ref();
    let Some(primary) = choose_from(description, agent, object)
        .named()
        .map(str::to_owned)
    else {
        return Vec::new();
    };
    let mut out = vec![primary];
    if out[0] != crate::spec::COMMAND_BACKEND {
        let fallback = agent.and_then(|a| a.fallback.as_ref());
        for name in fallback.into_iter().flatten() {
            if !out.contains(name) {
                out.push(name.clone());
            }
        }
    }
    out
}

/// How a worker names, among its claim's `capabilities`, a backend it can run here.
pub const CAPABILITY_PREFIX: &str = "backend:";

/// The capability a worker sends for backend `name` (`backend:claude`).
pub fn capability(name: &str) -> String {
    format!("{CAPABILITY_PREFIX}{name}")
}

/// The backends a claim's `capabilities` offer (lowercased, known names only, sorted), or
/// `None` when it names none: a worker that declares no backend may be given any task.
pub fn offered(capabilities: &[String]) -> Option<Vec<String>> {
    let mut out: Vec<String> = capabilities
        .iter()
        .filter_map(|c| c.trim().strip_prefix(CAPABILITY_PREFIX))
        .filter_map(known)
        .collect();
    let declared = capabilities
        .iter()
        .any(|c| c.trim().starts_with(CAPABILITY_PREFIX));
    out.sort();
    out.dedup();
    declared.then_some(out)
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::Role;

    fn spec(v: Value, role: Role) -> TaskSpec {
        TaskSpec::from_object(v.as_object().expect("object"), Some(role)).expect("task")
    }

    fn choice(v: Value) -> BackendChoice {
        choose(&spec(v, Role::Executor))
    }

    #[test]
    fn ccw_priority_order() {
        let exec = json!({"method": "cli", "cli_tool": "qwen"});
        let named = |backend: &str, reason: &str| BackendChoice::Named {
            backend: backend.into(),
            reason: reason.into(),
        };
        assert_eq!(
            choice(
                json!({"id": "IMPL-1", "description": "do it\nExecutor: gemini",
                "agent": {"backend": "codex"}})
            ),
            named("gemini", "task description `Executor:` field")
        );
        assert_eq!(
            choice(json!({"id": "IMPL-1", "agent": {"backend": "Claude"},
                "meta": {"execution_config": exec}})),
            named("claude", "task agent.backend")
        );
        assert_eq!(
            choice(json!({"id": "IMPL-1", "agent": {"command": ["true"]}})).named(),
            Some("command")
        );
        assert_eq!(
            choice(json!({"id": "IMPL-1", "meta": {"execution_config": exec},
                "plan_hints": {"recommended_execution": "Agent"}}))
            .named(),
            Some("qwen")
        );
        assert_eq!(
            choice(json!({"id": "IMPL-1", "meta": {"execution_config": {"method": "agent"}}}))
                .named(),
            Some("agent")
        );
        assert_eq!(
            choice(json!({"id": "IMPL-1", "plan_hints": {"recommended_execution": "Codex"}}))
                .named(),
            Some("codex")
        );
        assert_eq!(
            choice(json!({"id": "IMPL-1",
                "plan_hints": {"recommended_execution": "Parallel", "complexity": "Low"}})),
            named("agent", "auto: low complexity")
        );
        assert_eq!(
            choice(json!({"id": "IMPL-1", "complexity": "High"})),
            BackendChoice::Auto {
                pick: AutoPick::AutoBackend,
                reason: "auto: high complexity".into()
            }
        );
        assert_eq!(
            choice(json!({"id": "IMPL-1",
                "meta": {"execution_config": {"method": "cli", "cli_tool": "auto"}}})),
            BackendChoice::Auto {
                pick: AutoPick::FirstFallback,
                reason: "meta.execution_config cli_tool auto: first of the fallback chain".into()
            }
        );
        // An unknown name in the description is not a choice; in `agent.backend` the task
        // itself is refused (by the `TaskSpec`'s rules).
        assert_eq!(
            choice(json!({"id": "IMPL-1", "description": "Executor: nope"})).named(),
            None
        );
        assert!(
            TaskSpec::from_object(
                json!({"id": "IMPL-1", "agent": {"backend": "nope"}})
                    .as_object()
                    .expect("object"),
                Some(Role::Executor)
            )
            .is_err()
        );
    }

    #[test]
    fn offers_are_the_backend_capabilities() {
        let caps = |list: &[&str]| list.iter().map(|c| (*c).to_owned()).collect::<Vec<_>>();
        assert_eq!(offered(&caps(&["jest", "python"])), None);
        assert_eq!(
            offered(&caps(&[
                "backend:codex",
                "backend:Claude",
                "backend:codex",
                "jest"
            ])),
            Some(vec!["claude".to_owned(), "codex".to_owned()])
        );
        // Declared, but nothing known: the worker can run no named backend.
        assert_eq!(offered(&caps(&["backend:nope"])), Some(Vec::new()));
        assert_eq!(capability("claude"), "backend:claude");
    }

    #[test]
    fn routes_are_the_backend_then_the_tasks_own_fallbacks() {
        let routes_of = |v: Value, role: Role| routes(&spec(v, role));
        assert_eq!(
            routes_of(
                json!({"id": "IMPL-1", "agent": {"backend": "claude"}}),
                Role::Executor
            ),
            ["claude"]
        );
        assert_eq!(
            routes_of(
                json!({"id": "IMPL-1", "agent": {"backend": "claude",
                    "fallback": ["codex", "claude", "gemini"]}}),
                Role::Executor
            ),
            ["claude", "codex", "gemini"]
        );
        // `command` never falls back; an auto choice is any worker's.
        assert_eq!(
            routes_of(
                json!({"id": "IMPL-1", "agent": {"command": ["true"], "fallback": ["codex"]}}),
                Role::Executor
            ),
            ["command"]
        );
        assert!(routes_of(json!({"id": "IMPL-1"}), Role::Executor).is_empty());
        assert!(
            routes_of(
                json!({"id": "VALIDATE-1", "judge": {"backend": "claude"}}),
                Role::Validator
            )
            .is_empty()
        );
    }
}
