//! Which backend runs a task, and why (CCW executor execution-mode resolution, ccw-reference
//! §1.B.3), plus the backends to fall back to and the native session to continue (§3.6).

use serde_json::{Map, Value};
use troupe_backends::{BackendsConfig, ErrorKind};
use troupe_plan::{AutoPick, BackendChoice, TaskSpec};

/// The chosen backend and the reason, as recorded in `ImplementationReport.backend_reason`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Resolved {
    pub(crate) backend: String,
    pub(crate) reason: String,
}

/// Resolves the backend: the task's choice ([`troupe_plan::backend::choose`], the one
/// implementation the coordinator routes by too), an auto choice filled from `config` (its
/// `auto_backend`, or the first of its fallback chain).
pub(crate) fn resolve(spec: &TaskSpec, config: &BackendsConfig) -> Resolved {
    match troupe_plan::backend::choose(spec) {
        BackendChoice::Named { backend, reason } => Resolved { backend, reason },
        BackendChoice::Auto { pick, reason } => {
            let backend = match pick {
                AutoPick::FirstFallback => config.fallback.first(),
                AutoPick::AutoBackend => None,
            };
            Resolved {
                backend: backend.unwrap_or(&config.auto_backend).clone(),
                reason: if backend.is_none() && pick == AutoPick::FirstFallback {
                    format!("{reason} (empty: the auto backend)")
                } else {
                    reason
                },
            }
        }
    }
}

/// Backends to try in order: the resolved one, then the task's `agent.fallback`, else the
/// configured chain (never for `command`, whose argv is the plan author's own program).
pub(crate) fn candidates(
    resolved: &str,
    fallback: Option<&[String]>,
    config: &BackendsConfig,
) -> Vec<String> {
    troupe_backends::chain::candidates(resolved, fallback, config)
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

    fn spec(v: Value) -> TaskSpec {
        TaskSpec::from_object(&obj(v), Some(troupe_plan::Role::Executor)).expect("task")
    }

    #[test]
    fn an_auto_choice_is_filled_from_the_config() {
        let mut config = BackendsConfig {
            auto_backend: "gemini".into(),
            fallback: vec!["qwen".into()],
            ..BackendsConfig::default()
        };
        let r = |v: Value, config: &BackendsConfig| resolve(&spec(v), config);
        assert_eq!(
            r(json!({"id": "IMPL-1", "complexity": "High"}), &config),
            Resolved {
                backend: "gemini".into(),
                reason: "auto: high complexity".into()
            }
        );
        let cli_auto = json!({"id": "IMPL-1", "meta": {"execution_config": {"method": "cli", "cli_tool": "auto"}}});
        assert_eq!(r(cli_auto.clone(), &config).backend, "qwen");
        config.fallback.clear();
        assert_eq!(r(cli_auto, &config).backend, "gemini");
        assert_eq!(
            r(
                json!({"id": "IMPL-1", "agent": {"backend": "claude"}}),
                &config
            ),
            Resolved {
                backend: "claude".into(),
                reason: "task agent.backend".into()
            }
        );
    }

    #[test]
    fn chains_and_strategies() {
        let config = BackendsConfig::default();
        assert_eq!(
            candidates("claude", None, &config),
            ["claude", "gemini", "qwen", "codex"]
        );
        assert_eq!(
            candidates("qwen", None, &config),
            ["qwen", "gemini", "codex"]
        );
        assert_eq!(
            candidates("claude", Some(&["codex".to_owned()]), &config),
            ["claude", "codex"]
        );
        assert_eq!(candidates("command", None, &config), ["command"]);
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
