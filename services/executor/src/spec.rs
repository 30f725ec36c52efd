//! The parts of a plan task object (`Task.spec`) the executor reads.

use std::time::Duration;

use serde_json::{Map, Value};
use troupe_plan::{FileAction, Role};

/// A wall-clock limit when neither the agent nor the task sets one: CCW's executors give a
/// CLI agent one hour.
pub const DEFAULT_AGENT_TIMEOUT: Duration = Duration::from_secs(3600);

pub use troupe_plan::spec::ScopePolicy;
use troupe_plan::spec::{AgentSpec, PreAnalysisStep};

/// One entry of `files[]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FileEntry {
    pub(crate) path: String,
    /// `None` when the plan names no action (a bare path).
    pub(crate) action: Option<FileAction>,
    pub(crate) change: String,
}

/// The task fields the executor uses, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskSpec {
    pub(crate) id: String,
    pub(crate) title: String,
    pub(crate) description: String,
    pub(crate) files: Vec<FileEntry>,
    pub(crate) focus_paths: Vec<String>,
    /// CCW `scope` when it names paths rather than a policy.
    pub(crate) scope_paths: Vec<String>,
    pub(crate) excludes: Vec<String>,
    pub(crate) implementation: Vec<String>,
    pub(crate) criteria: Vec<String>,
    pub(crate) definition_of_done: Option<String>,
    pub(crate) reference: Vec<String>,
    pub(crate) approach: Option<String>,
    pub(crate) risks: Vec<String>,
    pub(crate) agent: AgentSpec,
    pub(crate) timeout: Option<Duration>,
    pub(crate) scope_policy: ScopePolicy,
    pub(crate) allow_empty: bool,
    /// `convergence.verification` as argv (a string is split without a shell, or runs under
    /// `sh -c` verbatim when it uses shell syntax).
    pub(crate) verification: Vec<String>,
    pub(crate) depends_on: Vec<String>,
    /// CCW `phase` (number or string), for the summary frontmatter and EXEC phases.
    pub(crate) phase: Option<Value>,
    /// `pre_analysis[]` steps, run in the worktree before the agent.
    pub(crate) pre_analysis: Vec<PreAnalysisStep>,
    /// The plan's `sandbox` for the task: it may tighten the executor's, never loosen it.
    pub(crate) sandbox: Option<troupe_process::SandboxMode>,
}

impl TaskSpec {
    /// Refuses `agent.env` unless every backend of `chain` is `command` (see
    /// [`AgentSpec::env_allowed_for`]).
    pub(crate) fn env_allowed_for(&self, chain: &[String]) -> Result<(), String> {
        self.agent.env_allowed_for(chain)
    }

    /// Parses a task object. Problems come back as one message listing all of them.
    pub fn parse(object: &Map<String, Value>) -> Result<Self, String> {
        let mut problems = Vec::new();
        let text = |key: &str| {
            object
                .get(key)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .trim()
                .to_owned()
        };
        let id = text("id");
        if id.is_empty() {
            problems.push("task has no `id`".to_owned());
        }

        let files = match object.get("files") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .filter_map(|(i, item)| match item {
                    Value::String(path) => Some(FileEntry {
                        path: path.clone(),
                        action: None,
                        change: String::new(),
                    }),
                    Value::Object(file) => match file.get("path").and_then(Value::as_str) {
                        Some(path) => Some(FileEntry {
                            path: path.to_owned(),
                            action: match file.get("action") {
                                None | Some(Value::Null) => None,
                                Some(action) => {
                                    let parsed = action.as_str().and_then(FileAction::parse);
                                    if parsed.is_none() {
                                        problems.push(format!(
                                            "files[{i}].action {action} is not create, modify or delete"
                                        ));
                                    }
                                    parsed
                                }
                            },
                            change: file
                                .get("change")
                                .and_then(Value::as_str)
                                .or_else(|| file.get("target").and_then(Value::as_str))
                                .unwrap_or_default()
                                .to_owned(),
                        }),
                        None => {
                            problems.push(format!("files[{i}] has no `path`"));
                            None
                        }
                    },
                    _ => {
                        problems.push(format!("files[{i}] is neither a path nor an object"));
                        None
                    }
                })
                .collect(),
            Some(_) => {
                problems.push("`files` is not an array".to_owned());
                Vec::new()
            }
        };

        // The blocks every worker reads by the plan's rules (the same as at intake).
        let blocks = match troupe_plan::TaskBlocks::from_object(object, Some(Role::Executor)) {
            Ok(blocks) => blocks,
            Err(err) => {
                problems.extend(err.problems.into_iter().map(|problem| problem.message));
                troupe_plan::TaskBlocks::default()
            }
        };
        let convergence = blocks.convergence;
        let spec = Self {
            title: text("title"),
            description: text("description"),
            files,
            focus_paths: string_list(object.get("focus_paths")),
            scope_paths: blocks.scope_paths,
            excludes: blocks.excludes,
            implementation: implementation_steps(object.get("implementation")),
            criteria: convergence.criteria,
            definition_of_done: convergence.definition_of_done,
            reference: reference_lines(object.get("reference")),
            approach: object
                .get("rationale")
                .and_then(|r| r.get("chosen_approach"))
                .and_then(Value::as_str)
                .map(str::to_owned),
            risks: risk_lines(object.get("risks")),
            agent: blocks.agent.unwrap_or_default(),
            timeout: seconds(
                object.get("timeout_seconds"),
                "timeout_seconds",
                &mut problems,
            ),
            scope_policy: blocks.scope_policy,
            allow_empty: blocks.allow_empty,
            verification: convergence.verification.unwrap_or_default(),
            depends_on: string_list(object.get("depends_on")),
            phase: object
                .get("phase")
                .filter(|v| v.is_number() || v.is_string())
                .cloned(),
            pre_analysis: blocks.pre_analysis,
            sandbox: blocks.sandbox.and_then(|mode| mode.as_str().parse().ok()),
            id,
        };
        if problems.is_empty() {
            Ok(spec)
        } else {
            Err(problems.join("; "))
        }
    }

    /// Paths the task may change: `files[].path`, `focus_paths` and CCW `scope` paths.
    pub(crate) fn allowed_paths(&self) -> Vec<String> {
        self.files
            .iter()
            .map(|f| f.path.clone())
            .chain(self.focus_paths.iter().cloned())
            .chain(self.scope_paths.iter().cloned())
            .map(|p| normalize(&p))
            .filter(|p| !p.is_empty())
            .collect()
    }

    /// Changed paths outside the task's scope (or inside its `excludes`). `None` when the task
    /// declares no scope at all, so nothing can be checked.
    pub(crate) fn out_of_scope(&self, changed: &[String]) -> Option<Vec<String>> {
        let allowed = self.allowed_paths();
        let excludes: Vec<String> = self
            .excludes
            .iter()
            .map(|p| normalize(p))
            .filter(|p| !p.is_empty())
            .collect();
        if allowed.is_empty() && excludes.is_empty() {
            return None;
        }
        Some(
            changed
                .iter()
                .filter(|path| {
                    let inside =
                        allowed.is_empty() || allowed.iter().any(|prefix| under(path, prefix));
                    let excluded = excludes.iter().any(|prefix| under(path, prefix));
                    !inside || excluded
                })
                .cloned()
                .collect(),
        )
    }
}

fn under(path: &str, prefix: &str) -> bool {
    path == prefix
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('/'))
}

fn normalize(path: &str) -> String {
    let path = path.trim();
    let path = path.strip_prefix("./").unwrap_or(path);
    path.trim_end_matches('/').to_owned()
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

fn seconds(value: Option<&Value>, key: &str, problems: &mut Vec<String>) -> Option<Duration> {
    match value {
        None | Some(Value::Null) => None,
        Some(value) => match value.as_f64() {
            Some(secs) if secs > 0.0 && secs.is_finite() => Some(Duration::from_secs_f64(secs)),
            _ => {
                problems.push(format!("`{key}` must be a positive number of seconds"));
                None
            }
        },
    }
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

/// Converts a protobuf `Struct` to a JSON object (see [`troupe_proto::json`]).
pub use troupe_proto::json::struct_to_object as struct_to_json;

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn parse(value: Value) -> Result<TaskSpec, String> {
        TaskSpec::parse(value.as_object().expect("object"))
    }

    #[test]
    fn parses_a_ccw_task_with_an_agent() {
        let spec = parse(json!({
            "id": "IMPL-1", "title": "t", "description": "d",
            "files": [{"path": "src/a.py", "action": "modify", "change": "add f"}, "docs/x.md"],
            "focus_paths": ["tests/"],
            "scope": "lib",
            "implementation": ["step one", {"step": 2, "title": "Two", "description": "do it", "modification_points": ["a.py: +f"]}],
            "convergence": {"criteria": ["f works"], "definition_of_done": "done"},
            "agent": {"backend": "command", "command": ["python3", "{plan_dir}/a.py"], "timeout_seconds": 60, "env": {"K": "v"}},
        }))
        .expect("valid");
        assert_eq!(spec.files.len(), 2);
        assert_eq!(
            spec.implementation,
            ["step one", "Two: do it (touch: a.py: +f)"]
        );
        assert_eq!(
            spec.agent.command.as_deref(),
            Some(&["python3".to_owned(), "{plan_dir}/a.py".to_owned()][..])
        );
        assert_eq!(spec.agent.timeout, Some(Duration::from_secs(60)));
        assert_eq!(spec.scope_policy, ScopePolicy::Warn);
        assert_eq!(
            spec.allowed_paths(),
            ["src/a.py", "docs/x.md", "tests", "lib"]
        );
    }

    #[test]
    fn scope_checks_use_path_prefixes() {
        let spec = parse(json!({"id": "IMPL-1", "files": [{"path": "src/a.py"}], "focus_paths": ["tests"], "excludes": ["tests/golden"], "scope": "refuse"}))
            .expect("valid");
        assert_eq!(spec.scope_policy, ScopePolicy::Refuse);
        let changed = [
            "src/a.py",
            "src/a.pyc",
            "tests/t.py",
            "testsuite/x",
            "tests/golden/g.txt",
            "README.md",
        ]
        .map(str::to_owned);
        assert_eq!(
            spec.out_of_scope(&changed),
            Some(
                [
                    "src/a.pyc",
                    "testsuite/x",
                    "tests/golden/g.txt",
                    "README.md"
                ]
                .map(str::to_owned)
                .to_vec()
            )
        );
        let unscoped = parse(json!({"id": "IMPL-1"})).expect("valid");
        assert_eq!(unscoped.out_of_scope(&changed), None);
    }

    #[test]
    fn rejects_malformed_fields_all_at_once() {
        let err = parse(json!({
            "files": [{"action": "create"}],
            "scope_policy": "maybe",
            "agent": {"command": "make && make install", "timeout_seconds": -1},
        }))
        .expect_err("invalid");
        for needle in [
            "no `id`",
            "files[0] has no `path`",
            "`scope_policy` must be",
            "shell syntax",
            "agent.timeout_seconds",
        ] {
            assert!(err.contains(needle), "{needle} missing from {err}");
        }
        let ok = parse(json!({"id": "x", "agent": {"command": "python3 agent.py '{worktree}'"}}))
            .expect("splits");
        // convergence.verification: argv as is, a plain string split, shell syntax verbatim.
        let verification = |v: Value| {
            parse(json!({"id": "x", "convergence": {"criteria": ["c"], "verification": v}}))
                .expect("valid")
                .verification
        };
        assert_eq!(verification(json!(["make", "test"])), ["make", "test"]);
        assert_eq!(
            verification(json!("pytest -q 'a b'")),
            ["pytest", "-q", "a b"]
        );
        assert_eq!(
            verification(json!("make && make test")),
            ["sh", "-c", "make && make test"]
        );
        assert!(
            parse(json!({"id": "x", "pre_analysis": [{"step": "s"}]}))
                .expect_err("no command")
                .contains("(step `s`) has no command")
        );
        assert_eq!(
            ok.agent.command.expect("argv"),
            ["python3", "agent.py", "{worktree}"]
        );
    }
}
