//! The parts of a plan task object (`Task.spec`) the executor reads.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Map, Value};

/// A wall-clock limit when neither the agent nor the task sets one: CCW's executors give a
/// CLI agent one hour.
pub const DEFAULT_AGENT_TIMEOUT: Duration = Duration::from_secs(3600);

/// What to do with changes outside a task's `files[]` and `focus_paths`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScopePolicy {
    /// Report them as warnings (default).
    Warn,
    /// Fail the attempt with OUT_OF_SCOPE.
    Refuse,
}

/// One entry of `files[]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FileEntry {
    pub(crate) path: String,
    pub(crate) action: String,
    pub(crate) change: String,
}

/// The task's `agent` object.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct AgentSpec {
    pub(crate) backend: Option<String>,
    pub(crate) command: Option<Vec<String>>,
    pub(crate) timeout: Option<Duration>,
    pub(crate) idle_timeout: Option<Duration>,
    pub(crate) env: BTreeMap<String, String>,
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
    /// The raw `pre_analysis[]` block (validated here, run in the worktree).
    pub(crate) pre_analysis: Option<Value>,
}

impl TaskSpec {
    /// A plan's `agent.env` reaches the `command` backend (the plan's own program) only: an
    /// agent CLI's environment carries the executor's endpoint and key, and a variable such as
    /// `ANTHROPIC_BASE_URL` or `NODE_OPTIONS` from a plan would send that key, or run code,
    /// where the plan says. Refuses the task when any backend of `chain` is not `command`.
    pub(crate) fn env_allowed_for(&self, chain: &[String]) -> Result<(), String> {
        if self.agent.env.is_empty() {
            return Ok(());
        }
        match chain.iter().find(|name| name.as_str() != "command") {
            Some(name) => Err(format!(
                "`agent.env` is given to the `command` backend only; backend `{name}` gets its \
                 environment (endpoint, key, settings) from the executor's configuration \
                 (--config), never from a plan"
            )),
            None => Ok(()),
        }
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
                        action: String::new(),
                        change: String::new(),
                    }),
                    Value::Object(file) => match file.get("path").and_then(Value::as_str) {
                        Some(path) => Some(FileEntry {
                            path: path.to_owned(),
                            action: file
                                .get("action")
                                .and_then(Value::as_str)
                                .unwrap_or_default()
                                .to_owned(),
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

        let (scope_policy, scope_paths) = match (object.get("scope_policy"), object.get("scope")) {
            (Some(policy), _) => (
                parse_policy(policy, "scope_policy", &mut problems),
                scope_list(object.get("scope")),
            ),
            (None, Some(Value::String(s))) if s == "warn" || s == "refuse" => (
                parse_policy(&Value::String(s.clone()), "scope", &mut problems),
                Vec::new(),
            ),
            (None, scope) => (ScopePolicy::Warn, scope_list(scope)),
        };

        let convergence = object.get("convergence").and_then(Value::as_object);
        let criteria = convergence
            .map(|c| string_list(c.get("criteria")))
            .unwrap_or_default();
        let definition_of_done = convergence
            .and_then(|c| c.get("definition_of_done"))
            .and_then(Value::as_str)
            .map(str::to_owned);

        let verification = match convergence.and_then(|c| c.get("verification")) {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(line)) if line.trim().is_empty() => Vec::new(),
            Some(Value::String(line)) => match troupe_process::command_line_to_argv(line) {
                Ok(argv) => argv,
                Err(err) => {
                    problems.push(format!("`convergence.verification`: {err}"));
                    Vec::new()
                }
            },
            Some(Value::Array(items)) => {
                let argv: Option<Vec<String>> = items
                    .iter()
                    .map(|v| v.as_str().map(str::to_owned))
                    .collect();
                argv.unwrap_or_else(|| {
                    problems.push("`convergence.verification` must hold only strings".to_owned());
                    Vec::new()
                })
            }
            Some(_) => {
                problems.push(
                    "`convergence.verification` must be a command string or an argv array"
                        .to_owned(),
                );
                Vec::new()
            }
        };
        let pre_analysis = object.get("pre_analysis").filter(|v| !v.is_null()).cloned();
        if let Err(problem) = crate::pre_analysis::validate(pre_analysis.as_ref()) {
            problems.push(problem);
        }

        let agent = match object.get("agent") {
            None | Some(Value::Null) => AgentSpec::default(),
            Some(Value::Object(agent)) => parse_agent(agent, &mut problems),
            Some(_) => {
                problems.push("`agent` is not an object".to_owned());
                AgentSpec::default()
            }
        };

        let spec = Self {
            title: text("title"),
            description: text("description"),
            files,
            focus_paths: string_list(object.get("focus_paths")),
            scope_paths,
            excludes: string_list(object.get("excludes")),
            implementation: implementation_steps(object.get("implementation")),
            criteria,
            definition_of_done,
            reference: reference_lines(object.get("reference")),
            approach: object
                .get("rationale")
                .and_then(|r| r.get("chosen_approach"))
                .and_then(Value::as_str)
                .map(str::to_owned),
            risks: risk_lines(object.get("risks")),
            agent,
            timeout: seconds(
                object.get("timeout_seconds"),
                "timeout_seconds",
                &mut problems,
            ),
            scope_policy,
            allow_empty: object
                .get("allow_empty")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            verification,
            depends_on: string_list(object.get("depends_on")),
            phase: object
                .get("phase")
                .filter(|v| v.is_number() || v.is_string())
                .cloned(),
            pre_analysis,
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

fn parse_policy(value: &Value, key: &str, problems: &mut Vec<String>) -> ScopePolicy {
    match value.as_str() {
        Some("warn") => ScopePolicy::Warn,
        Some("refuse") => ScopePolicy::Refuse,
        _ => {
            problems.push(format!("`{key}` must be \"warn\" or \"refuse\""));
            ScopePolicy::Warn
        }
    }
}

fn scope_list(value: Option<&Value>) -> Vec<String> {
    match value {
        Some(Value::String(s)) => vec![s.clone()],
        other => string_list(other),
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

fn parse_agent(agent: &Map<String, Value>, problems: &mut Vec<String>) -> AgentSpec {
    let command = match agent.get("command") {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => {
            let argv: Option<Vec<String>> = items
                .iter()
                .map(|v| v.as_str().map(str::to_owned))
                .collect();
            match argv {
                Some(argv) if !argv.is_empty() => Some(argv),
                Some(_) => {
                    problems.push("`agent.command` is empty".to_owned());
                    None
                }
                None => {
                    problems.push("`agent.command` must hold only strings".to_owned());
                    None
                }
            }
        }
        Some(Value::String(line)) => match troupe_process::command_line_to_argv(line) {
            // Placeholders are substituted into argv elements; substituting them into a shell
            // script would be interpolation into a shell, which troupe never does.
            Ok(argv)
                if argv.first().map(String::as_str) == Some("sh") && argv.get(2) == Some(line) =>
            {
                problems.push(
                    "`agent.command` uses shell syntax; write it as an argv array".to_owned(),
                );
                None
            }
            Ok(argv) => Some(argv),
            Err(err) => {
                problems.push(format!("`agent.command`: {err}"));
                None
            }
        },
        Some(_) => {
            problems.push("`agent.command` must be an argv array".to_owned());
            None
        }
    };
    let env = match agent.get("env") {
        None | Some(Value::Null) => BTreeMap::new(),
        Some(Value::Object(vars)) => vars
            .iter()
            .filter_map(|(k, v)| match v {
                Value::String(s) => Some((k.clone(), s.clone())),
                _ => {
                    problems.push(format!("`agent.env.{k}` must be a string"));
                    None
                }
            })
            .collect(),
        Some(_) => {
            problems.push("`agent.env` must be an object".to_owned());
            BTreeMap::new()
        }
    };
    AgentSpec {
        backend: agent
            .get("backend")
            .and_then(Value::as_str)
            .map(str::to_owned),
        command,
        timeout: seconds(
            agent.get("timeout_seconds"),
            "agent.timeout_seconds",
            problems,
        ),
        idle_timeout: seconds(
            agent.get("idle_timeout_seconds"),
            "agent.idle_timeout_seconds",
            problems,
        ),
        env,
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
                .contains("pre_analysis step `s` has no command")
        );
        assert_eq!(
            ok.agent.command.expect("argv"),
            ["python3", "agent.py", "{worktree}"]
        );
    }
}
