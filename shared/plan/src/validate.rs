//! Parsing and validation: walks the JSON value and collects every problem before giving up.

use std::collections::{HashMap, HashSet};
use std::fmt;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::{
    Access, DEFAULT_ESTIMATE_MS, DEFAULT_MAX_ATTEMPTS, EFFORT_SECONDS, IMPLICIT_REPO, Mode,
    OnFailure, Plan, PlanError, PlanTask, Priority, RepoSource, RepoSpec, Role,
};

/// Upper bound on attempts, so a typo cannot make a task retry forever.
const MAX_ATTEMPTS_LIMIT: u64 = 100;

/// What is wrong with a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// The document is not JSON (or not an object).
    MalformedJson,
    /// A required field is missing or empty.
    MissingField,
    /// Two tasks share an id.
    DuplicateId,
    /// A task depends on an id no task has.
    UnknownDependency,
    /// A task depends on itself.
    SelfDependency,
    /// The dependencies form a cycle.
    Cycle,
    /// A task's role is neither given nor implied by its id prefix, or is not a known role.
    UnknownRole,
    /// A task names a repository the plan does not declare.
    UnknownRepo,
    /// A path is absolute or climbs above the repository root.
    PathEscape,
    /// A field has a value of the wrong type or outside its allowed set.
    InvalidValue,
}

/// One problem found in a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Its kind.
    pub kind: ProblemKind,
    /// Human-readable description naming the task and field involved.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Collects every problem of a document, so a refusal can list them all at once.
#[derive(Default)]
pub(crate) struct Problems(pub(crate) Vec<Problem>);

impl Problems {
    pub(crate) fn push(&mut self, kind: ProblemKind, message: impl Into<String>) {
        self.0.push(Problem {
            kind,
            message: message.into(),
        });
    }
}

/// Records the document order of `repos` keys, which `serde_json::Map` (a `BTreeMap` without the
/// `preserve_order` feature) forgets; the first repository is the default.
#[derive(Deserialize)]
struct RepoOrder {
    #[serde(default)]
    repos: Option<OrderedKeys>,
}

struct OrderedKeys(Vec<String>);

impl<'de> Deserialize<'de> for OrderedKeys {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = OrderedKeys;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<OrderedKeys, A::Error> {
                let mut keys = Vec::new();
                while let Some((key, _)) = map.next_entry::<String, serde::de::IgnoredAny>()? {
                    keys.push(key);
                }
                Ok(OrderedKeys(keys))
            }
            // Any other shape is reported by the validator; here it only means "no order".
            fn visit_unit<E>(self) -> Result<OrderedKeys, E> {
                Ok(OrderedKeys(Vec::new()))
            }
        }
        deserializer
            .deserialize_any(Visitor)
            .or_else(|_: D::Error| Ok(OrderedKeys(Vec::new())))
    }
}

pub(crate) fn parse(text: &str) -> Result<Plan, PlanError> {
    let root: Value = serde_json::from_str(text).map_err(|err| PlanError {
        problems: vec![Problem {
            kind: ProblemKind::MalformedJson,
            message: format!(
                "malformed json at line {}, column {}: {err}",
                err.line(),
                err.column()
            ),
        }],
    })?;
    let Value::Object(root) = root else {
        return Err(PlanError {
            problems: vec![Problem {
                kind: ProblemKind::MalformedJson,
                message: "plan must be a json object".to_owned(),
            }],
        });
    };
    let repo_order = serde_json::from_str::<RepoOrder>(text)
        .ok()
        .and_then(|order| order.repos)
        .map(|keys| keys.0)
        .unwrap_or_default();

    let mut problems = Problems::default();
    let name = plan_name(&root, &mut problems);
    let description = optional_string(&root, "description", "plan", &mut problems);
    let mode = enum_field(
        &root,
        "mode",
        "plan",
        Mode::parse,
        "eager or waves",
        &mut problems,
    )
    .unwrap_or_default();
    let on_failure = enum_field(
        &root,
        "on_failure",
        "plan",
        OnFailure::parse,
        "skip or block",
        &mut problems,
    )
    .unwrap_or_default();
    let max_attempts =
        attempts(root.get("max_attempts"), "plan", &mut problems).unwrap_or(DEFAULT_MAX_ATTEMPTS);
    let repos = repos(&root, &repo_order, &mut problems);
    let sandbox = crate::spec::parse_sandbox(root.get("sandbox"), "plan", &mut problems);
    let mut tasks = tasks(&root, &repos, max_attempts, &mut problems);
    // A plan-level `sandbox` goes into each task that sets none: workers read it there.
    if let Some(mode) = sandbox {
        for task in tasks
            .iter_mut()
            .filter(|task| task.blocks.sandbox.is_none())
        {
            task.blocks.sandbox = Some(mode);
            task.spec
                .insert("sandbox".to_owned(), Value::from(mode.as_str()));
        }
    }

    let mut roles: Vec<Role> = tasks.iter().map(|task| task.role).collect();
    roles.dedup();
    let checkpoints = crate::checkpoint::parse(&root, &roles, &mut problems);

    if !problems.0.is_empty() {
        return Err(PlanError {
            problems: problems.0,
        });
    }
    Ok(Plan {
        checkpoints,
        name,
        description,
        mode,
        on_failure,
        max_attempts,
        repos,
        tasks,
        sandbox,
    })
}

fn plan_name(root: &Map<String, Value>, problems: &mut Problems) -> String {
    match root.get("name") {
        None | Some(Value::Null) => {
            problems.push(
                ProblemKind::MissingField,
                "plan: missing required field `name`",
            );
            String::new()
        }
        Some(Value::String(name)) if name.is_empty() => {
            problems.push(ProblemKind::MissingField, "plan: `name` is empty");
            String::new()
        }
        Some(Value::String(name)) => {
            let valid = name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !name.starts_with('-');
            if !valid {
                problems.push(
                    ProblemKind::InvalidValue,
                    format!("plan: name `{name}` must match [a-z0-9-]+ and not start with `-`"),
                );
            }
            name.clone()
        }
        Some(_) => {
            problems.push(ProblemKind::InvalidValue, "plan: `name` must be a string");
            String::new()
        }
    }
}

pub(crate) fn optional_string(
    object: &Map<String, Value>,
    field: &str,
    owner: &str,
    problems: &mut Problems,
) -> String {
    match object.get(field) {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(text)) => text.clone(),
        Some(_) => {
            problems.push(
                ProblemKind::InvalidValue,
                format!("{owner}: `{field}` must be a string"),
            );
            String::new()
        }
    }
}

pub(crate) fn enum_field<T>(
    object: &Map<String, Value>,
    field: &str,
    owner: &str,
    parse: fn(&str) -> Option<T>,
    expected: &str,
    problems: &mut Problems,
) -> Option<T> {
    match object.get(field) {
        None | Some(Value::Null) => None,
        Some(Value::String(text)) => {
            let parsed = parse(text);
            if parsed.is_none() {
                problems.push(
                    ProblemKind::InvalidValue,
                    format!("{owner}: invalid {field} `{text}` (expected {expected})"),
                );
            }
            parsed
        }
        Some(other) => {
            problems.push(
                ProblemKind::InvalidValue,
                format!("{owner}: invalid {field} {other} (expected {expected})"),
            );
            None
        }
    }
}

fn attempts(value: Option<&Value>, owner: &str, problems: &mut Problems) -> Option<u32> {
    let value = value.filter(|value| !value.is_null())?;
    match value.as_u64() {
        Some(count) if (1..=MAX_ATTEMPTS_LIMIT).contains(&count) => u32::try_from(count).ok(),
        _ => {
            problems.push(
                ProblemKind::InvalidValue,
                format!("{owner}: invalid max_attempts {value} (expected an integer from 1 to {MAX_ATTEMPTS_LIMIT})"),
            );
            None
        }
    }
}

fn valid_repo_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn repos(root: &Map<String, Value>, order: &[String], problems: &mut Problems) -> Vec<RepoSpec> {
    let declared = match root.get("repos") {
        None | Some(Value::Null) => {
            return vec![RepoSpec {
                name: IMPLICIT_REPO.to_owned(),
                source: RepoSource::Path(".".to_owned()),
                base: None,
                access: Access::Write,
            }];
        }
        Some(Value::Object(map)) => map,
        Some(_) => {
            problems.push(
                ProblemKind::InvalidValue,
                "plan: `repos` must be an object of name -> {path}, {url} or {template}",
            );
            return Vec::new();
        }
    };
    if declared.is_empty() {
        problems.push(ProblemKind::MissingField, "plan: `repos` is empty");
        return Vec::new();
    }
    let mut names: Vec<&String> = order
        .iter()
        .filter(|name| declared.contains_key(*name))
        .collect();
    for name in declared.keys() {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    let mut repos = Vec::new();
    for name in names {
        let owner = format!("repo `{name}`");
        if !valid_repo_name(name) {
            problems.push(
                ProblemKind::InvalidValue,
                format!("{owner}: name must use only letters, digits, `-`, `_` and `.` and not start with `.`"),
            );
        }
        let Some(Value::Object(spec)) = declared.get(name) else {
            problems.push(
                ProblemKind::InvalidValue,
                format!("{owner}: must be an object with `path`, `url` or `template`"),
            );
            continue;
        };
        let path = spec.get("path").filter(|value| !value.is_null());
        let template = spec.get("template").filter(|value| !value.is_null());
        let url = spec.get("url").filter(|value| !value.is_null());
        let source = match (path, template, url) {
            (None, None, Some(Value::String(url))) if !url.is_empty() => {
                if let Some(why) = bad_url(url) {
                    problems.push(ProblemKind::InvalidValue, format!("{owner}: `url` {why}"));
                }
                RepoSource::Url(url.clone())
            }
            (None, None, Some(_)) => {
                problems.push(
                    ProblemKind::InvalidValue,
                    format!("{owner}: `url` must be a non-empty string"),
                );
                continue;
            }
            (Some(Value::String(path)), None, None) if !path.is_empty() => {
                RepoSource::Path(path.clone())
            }
            (None, Some(Value::String(template)), None) if !template.is_empty() => {
                if escapes_root(template) {
                    problems.push(
                        ProblemKind::PathEscape,
                        format!("{owner}: template `{template}` must be a relative path inside the plan directory"),
                    );
                }
                RepoSource::Template(template.clone())
            }
            (None, None, None) => {
                problems.push(
                    ProblemKind::MissingField,
                    format!("{owner}: missing `path`, `url` or `template`"),
                );
                continue;
            }
            (path, template, url)
                if [path, template, url].iter().filter(|v| v.is_some()).count() > 1 =>
            {
                problems.push(
                    ProblemKind::InvalidValue,
                    format!("{owner}: set one of `path`, `url` and `template`"),
                );
                continue;
            }
            _ => {
                problems.push(
                    ProblemKind::InvalidValue,
                    format!("{owner}: `path`/`template` must be a non-empty string"),
                );
                continue;
            }
        };
        let base = match spec.get("base") {
            None | Some(Value::Null) => None,
            Some(Value::String(base)) if !base.is_empty() => {
                if matches!(source, RepoSource::Template(_)) {
                    problems.push(
                        ProblemKind::InvalidValue,
                        format!("{owner}: `base` applies to `path` repositories, not templates"),
                    );
                }
                Some(base.clone())
            }
            Some(_) => {
                problems.push(
                    ProblemKind::InvalidValue,
                    format!("{owner}: `base` must be a non-empty string (a commit, branch or tag)"),
                );
                None
            }
        };
        let access = match spec.get("access") {
            None | Some(Value::Null) => Access::Write,
            Some(Value::String(text)) if text == "write" => Access::Write,
            Some(Value::String(text)) if text == "read" => {
                if matches!(source, RepoSource::Template(_)) {
                    problems.push(
                        ProblemKind::InvalidValue,
                        format!("{owner}: a template repository is made to be written; `access: read` needs `path` or `url`"),
                    );
                }
                Access::Read
            }
            Some(other) => {
                problems.push(
                    ProblemKind::InvalidValue,
                    format!("{owner}: `access` must be \"write\" or \"read\", got {other}"),
                );
                Access::Write
            }
        };
        repos.push(RepoSpec {
            name: name.clone(),
            source,
            base,
            access,
        });
    }
    repos
}

/// Why `url` is not a repository URL troupe takes, if it is not.
fn bad_url(url: &str) -> Option<String> {
    const SCHEMES: &[&str] = &["file://", "git://", "ssh://", "http://", "https://"];
    let Some(scheme) = SCHEMES.iter().find(|scheme| url.starts_with(**scheme)) else {
        return Some(format!(
            "`{}` must start with file://, git://, ssh://, http:// or https://",
            url.split("://").next().unwrap_or(url)
        ));
    };
    let authority = url[scheme.len()..].split('/').next().unwrap_or_default();
    if let Some((userinfo, _)) = authority.split_once('@')
        && userinfo.contains(':')
    {
        return Some(
            "must not carry a password: credentials come from the coordinator's and workers' configuration"
                .to_owned(),
        );
    }
    (url.chars().any(char::is_control) || url.contains(' '))
        .then(|| "must not contain spaces or control characters".to_owned())
}

/// True when `path` is absolute or climbs above its root with `..`.
pub(crate) fn escapes_root(path: &str) -> bool {
    if path.starts_with('/') || path.starts_with('\\') {
        return true;
    }
    let bytes = path.as_bytes();
    if bytes.len() >= 2 && bytes[1] == b':' && bytes[0].is_ascii_alphabetic() {
        return true;
    }
    let mut depth: i64 = 0;
    for component in path.split(['/', '\\']) {
        match component {
            "" | "." => {}
            ".." => {
                depth -= 1;
                if depth < 0 {
                    return true;
                }
            }
            _ => depth += 1,
        }
    }
    false
}

fn valid_task_id(id: &str) -> bool {
    id.chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !id.starts_with('.')
}

/// A task after per-task checks, before graph checks.
struct Draft {
    task: PlanTask,
    /// False for a duplicate id: it takes no part in the graph.
    in_graph: bool,
}

fn tasks(
    root: &Map<String, Value>,
    repos: &[RepoSpec],
    plan_attempts: u32,
    problems: &mut Problems,
) -> Vec<PlanTask> {
    let list = match root.get("tasks") {
        None | Some(Value::Null) => {
            problems.push(
                ProblemKind::MissingField,
                "plan: missing required field `tasks`",
            );
            return Vec::new();
        }
        Some(Value::Array(list)) if list.is_empty() => {
            problems.push(ProblemKind::MissingField, "plan: `tasks` is empty");
            return Vec::new();
        }
        Some(Value::Array(list)) => list,
        Some(_) => {
            problems.push(ProblemKind::InvalidValue, "plan: `tasks` must be an array");
            return Vec::new();
        }
    };
    let default_repo = repos
        .first()
        .map(|repo| repo.name.clone())
        .unwrap_or_default();
    let repos_known = !repos.is_empty();
    let mut drafts: Vec<Draft> = Vec::new();
    let mut first_index: HashMap<String, usize> = HashMap::new();
    for (index, value) in list.iter().enumerate() {
        let Value::Object(object) = value else {
            problems.push(
                ProblemKind::InvalidValue,
                format!("tasks[{index}]: must be an object"),
            );
            continue;
        };
        let id = match object.get("id") {
            Some(Value::String(id)) if !id.is_empty() => id.clone(),
            Some(Value::String(_)) => {
                problems.push(
                    ProblemKind::MissingField,
                    format!("tasks[{index}]: `id` is empty"),
                );
                continue;
            }
            None | Some(Value::Null) => {
                problems.push(
                    ProblemKind::MissingField,
                    format!("tasks[{index}]: missing required field `id`"),
                );
                continue;
            }
            Some(other) => {
                problems.push(
                    ProblemKind::InvalidValue,
                    format!("tasks[{index}]: `id` must be a string, got {other}"),
                );
                continue;
            }
        };
        let owner = format!("task {id}");
        if !valid_task_id(&id) {
            problems.push(
                ProblemKind::InvalidValue,
                format!("{owner}: id must use only letters, digits, `-`, `_` and `.`"),
            );
        }
        let in_graph = match first_index.get(&id) {
            Some(first) => {
                problems.push(
                    ProblemKind::DuplicateId,
                    format!("duplicate task id {id} (tasks[{first}] and tasks[{index}])"),
                );
                false
            }
            None => {
                first_index.insert(id.clone(), index);
                true
            }
        };
        let task = task(
            object,
            id,
            index,
            &owner,
            repos,
            repos_known,
            &default_repo,
            plan_attempts,
            problems,
        );
        drafts.push(Draft { task, in_graph });
    }
    let mut tasks: Vec<PlanTask> = drafts
        .into_iter()
        .filter(|draft| draft.in_graph)
        .map(|draft| draft.task)
        .collect();
    let graph_ok = check_dependencies(&tasks, problems);
    if graph_ok {
        order(&mut tasks);
    }
    tasks
}

#[allow(clippy::too_many_arguments)]
fn task(
    object: &Map<String, Value>,
    id: String,
    index: usize,
    owner: &str,
    repos: &[RepoSpec],
    repos_known: bool,
    default_repo: &str,
    plan_attempts: u32,
    problems: &mut Problems,
) -> PlanTask {
    let title = match object.get("title") {
        Some(Value::String(title)) if !title.trim().is_empty() => title.clone(),
        Some(Value::String(_)) => {
            problems.push(
                ProblemKind::MissingField,
                format!("{owner}: `title` is empty"),
            );
            String::new()
        }
        None | Some(Value::Null) => {
            problems.push(
                ProblemKind::MissingField,
                format!("{owner}: missing required field `title`"),
            );
            String::new()
        }
        Some(_) => {
            problems.push(
                ProblemKind::InvalidValue,
                format!("{owner}: `title` must be a string"),
            );
            String::new()
        }
    };
    let crate::task::Common {
        role,
        description,
        depends_on,
        files,
        focus_paths,
        timeout_seconds,
        blocks,
    } = crate::task::common(object, &id, owner, None, problems);
    let priority = enum_field(
        object,
        "priority",
        owner,
        Priority::parse,
        "P0, P1, P2, critical, high, medium or low",
        problems,
    )
    .unwrap_or_default();
    let repo = match object.get("repo") {
        None | Some(Value::Null) => default_repo.to_owned(),
        Some(Value::String(name)) => {
            if repos_known && !repos.iter().any(|repo| &repo.name == name) {
                let known: Vec<&str> = repos.iter().map(|repo| repo.name.as_str()).collect();
                problems.push(
                    ProblemKind::UnknownRepo,
                    format!(
                        "{owner}: unknown repo `{name}` (known: {})",
                        known.join(", ")
                    ),
                );
            }
            name.clone()
        }
        Some(_) => {
            problems.push(
                ProblemKind::InvalidValue,
                format!("{owner}: `repo` must be a string"),
            );
            default_repo.to_owned()
        }
    };
    if matches!(role, Some(Role::Executor | Role::TestRunner))
        && repos
            .iter()
            .any(|spec| spec.name == repo && spec.access == Access::Read)
    {
        problems.push(
            ProblemKind::InvalidValue,
            format!("{owner}: repo `{repo}` is read-only (`access: read`): only validator tasks may work in it; other tasks get it as context"),
        );
    }
    crate::approval::check(object, owner, problems);
    let max_attempts =
        attempts(object.get("max_attempts"), owner, problems).unwrap_or(plan_attempts);
    let estimate_ms = estimate(object, owner, problems);
    PlanTask {
        id,
        title,
        description,
        depends_on,
        role: role.unwrap_or(Role::Executor),
        priority,
        repo,
        files,
        focus_paths,
        max_attempts,
        timeout_seconds,
        estimate_ms,
        wave: 0,
        critical_path: 0,
        path_ms: 0,
        plan_index: index,
        blocks,
        spec: object.clone(),
    }
}

/// Reads a task's expected run time: `estimate_seconds` (a positive number), else CCW's
/// `effort` (small, medium or large, see [`EFFORT_SECONDS`]).
fn estimate(object: &Map<String, Value>, owner: &str, problems: &mut Problems) -> Option<u64> {
    if let Some(value) = object
        .get("estimate_seconds")
        .filter(|value| !value.is_null())
    {
        // Up to a year: a longer estimate is a unit mistake, not a plan.
        return match value.as_f64() {
            Some(secs) if secs > 0.0 && secs <= 31_536_000.0 => Some((secs * 1000.0).ceil() as u64),
            _ => {
                problems.push(
                    ProblemKind::InvalidValue,
                    format!(
                        "{owner}: invalid estimate_seconds {value} (expected a positive number of seconds, at most a year)"
                    ),
                );
                None
            }
        };
    }
    match object.get("effort") {
        None | Some(Value::Null) => None,
        Some(value) => {
            let level = value.as_str().unwrap_or_default().to_ascii_lowercase();
            match EFFORT_SECONDS.iter().find(|(name, _)| *name == level) {
                Some((_, secs)) => Some(secs * 1000),
                None => {
                    problems.push(
                        ProblemKind::InvalidValue,
                        format!(
                            "{owner}: invalid effort {value} (expected small, medium or large)"
                        ),
                    );
                    None
                }
            }
        }
    }
}

pub(crate) fn string_list(
    object: &Map<String, Value>,
    field: &str,
    owner: &str,
    problems: &mut Problems,
) -> Vec<String> {
    match object.get(field) {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => {
            let mut out = Vec::new();
            for (position, item) in items.iter().enumerate() {
                match item {
                    Value::String(text) => out.push(text.clone()),
                    other => problems.push(
                        ProblemKind::InvalidValue,
                        format!("{owner}: {field}[{position}] must be a string, got {other}"),
                    ),
                }
            }
            out
        }
        Some(_) => {
            problems.push(
                ProblemKind::InvalidValue,
                format!("{owner}: `{field}` must be an array of strings"),
            );
            Vec::new()
        }
    }
}

/// Reports unknown dependencies, self-dependencies and cycles; true when the graph is a DAG.
fn check_dependencies(tasks: &[PlanTask], problems: &mut Problems) -> bool {
    let index: HashMap<&str, usize> = tasks
        .iter()
        .enumerate()
        .map(|(position, task)| (task.id.as_str(), position))
        .collect();
    let mut ok = true;
    let mut edges: Vec<Vec<usize>> = vec![Vec::new(); tasks.len()];
    for (position, task) in tasks.iter().enumerate() {
        for dep in &task.depends_on {
            if dep == &task.id {
                problems.push(
                    ProblemKind::SelfDependency,
                    format!("task {} depends on itself", task.id),
                );
                ok = false;
                continue;
            }
            match index.get(dep.as_str()) {
                Some(&target) => edges[position].push(target),
                None => {
                    problems.push(
                        ProblemKind::UnknownDependency,
                        format!("task {} depends on unknown task {dep}", task.id),
                    );
                    ok = false;
                }
            }
        }
    }
    for cycle in find_cycles(&edges) {
        let mut path: Vec<&str> = cycle.iter().map(|&node| tasks[node].id.as_str()).collect();
        path.push(tasks[cycle[0]].id.as_str());
        problems.push(
            ProblemKind::Cycle,
            format!("dependency cycle: {}", path.join(" -> ")),
        );
        ok = false;
    }
    ok
}

/// Returns one cycle per back edge found by a depth-first search in plan order; each cycle
/// lists its nodes along `depends_on` edges, starting at the node entered first.
fn find_cycles(edges: &[Vec<usize>]) -> Vec<Vec<usize>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Color {
        White,
        Grey,
        Black,
    }
    let mut color = vec![Color::White; edges.len()];
    let mut cycles = Vec::new();
    let mut seen: HashSet<Vec<usize>> = HashSet::new();
    for start in 0..edges.len() {
        if color[start] != Color::White {
            continue;
        }
        // Iterative DFS: (node, next edge index); `stack` doubles as the current path.
        let mut stack: Vec<(usize, usize)> = vec![(start, 0)];
        color[start] = Color::Grey;
        while let Some(&mut (node, ref mut next)) = stack.last_mut() {
            if let Some(&target) = edges[node].get(*next) {
                *next += 1;
                match color[target] {
                    Color::White => {
                        color[target] = Color::Grey;
                        stack.push((target, 0));
                    }
                    Color::Grey => {
                        let from = stack.iter().position(|&(n, _)| n == target).unwrap_or(0);
                        let cycle: Vec<usize> = stack[from..].iter().map(|&(n, _)| n).collect();
                        let mut key = cycle.clone();
                        key.sort_unstable();
                        if seen.insert(key) {
                            cycles.push(cycle);
                        }
                    }
                    Color::Black => {}
                }
            } else {
                color[node] = Color::Black;
                stack.pop();
            }
        }
    }
    cycles
}

/// Fills waves, critical paths and estimated paths, and sorts tasks topologically (by wave,
/// then plan order).
/// Requires an acyclic graph with only known dependencies.
fn order(tasks: &mut [PlanTask]) {
    let index: HashMap<String, usize> = tasks
        .iter()
        .enumerate()
        .map(|(position, task)| (task.id.clone(), position))
        .collect();
    let deps: Vec<Vec<usize>> = tasks
        .iter()
        .map(|task| {
            task.depends_on
                .iter()
                .filter_map(|dep| index.get(dep).copied())
                .collect()
        })
        .collect();
    let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); tasks.len()];
    for (node, node_deps) in deps.iter().enumerate() {
        for &dep in node_deps {
            dependents[dep].push(node);
        }
    }
    // Kahn's algorithm gives an order in which every dependency comes first.
    let mut remaining: Vec<usize> = deps.iter().map(Vec::len).collect();
    let mut queue: Vec<usize> = (0..tasks.len())
        .filter(|&node| remaining[node] == 0)
        .collect();
    let mut topo = Vec::with_capacity(tasks.len());
    while let Some(node) = queue.pop() {
        topo.push(node);
        for &dependent in &dependents[node] {
            remaining[dependent] -= 1;
            if remaining[dependent] == 0 {
                queue.push(dependent);
            }
        }
    }
    let mut wave = vec![1u32; tasks.len()];
    for &node in &topo {
        wave[node] = deps[node]
            .iter()
            .map(|&dep| wave[dep] + 1)
            .max()
            .unwrap_or(1);
    }
    let mut critical = vec![1u32; tasks.len()];
    for &node in topo.iter().rev() {
        critical[node] = dependents[node]
            .iter()
            .map(|&child| critical[child] + 1)
            .max()
            .unwrap_or(1);
    }
    for (node, task) in tasks.iter_mut().enumerate() {
        task.wave = wave[node];
        task.critical_path = critical[node];
    }
    tasks.sort_by_key(|task| (task.wave, task.plan_index));
    weigh(tasks, &HashMap::new());
}

/// Fills `path_ms` of tasks in topological order: a task weighs its own estimate, else what
/// tasks of its role took lately (`learned`), else the mean of the plan's estimates, else
/// [`DEFAULT_ESTIMATE_MS`].
pub(crate) fn weigh(tasks: &mut [PlanTask], learned: &HashMap<Role, u64>) {
    let estimated: Vec<u64> = tasks.iter().filter_map(|task| task.estimate_ms).collect();
    let unknown = if estimated.is_empty() {
        DEFAULT_ESTIMATE_MS
    } else {
        estimated.iter().sum::<u64>() / estimated.len() as u64
    };
    let index: HashMap<&str, usize> = tasks
        .iter()
        .enumerate()
        .map(|(position, task)| (task.id.as_str(), position))
        .collect();
    let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); tasks.len()];
    for (node, task) in tasks.iter().enumerate() {
        for dep in &task.depends_on {
            if let Some(&dep) = index.get(dep.as_str()) {
                dependents[dep].push(node);
            }
        }
    }
    // Dependents come after their dependencies, so theirs are known when a task's is summed.
    let mut path_ms = vec![0u64; tasks.len()];
    for node in (0..tasks.len()).rev() {
        let task = &tasks[node];
        let own = task
            .estimate_ms
            .or_else(|| learned.get(&task.role).copied())
            .unwrap_or(unknown);
        let tail = dependents[node].iter().map(|&child| path_ms[child]).max();
        path_ms[node] = own.saturating_add(tail.unwrap_or(0));
    }
    for (task, path) in tasks.iter_mut().zip(path_ms) {
        task.path_ms = path;
    }
}
