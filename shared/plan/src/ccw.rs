//! CCW session import: turns a CCW team session folder into a native plan document.
//!
//! This is the one module of the crate that reads files. It reads `team-session.json`,
//! `task-analysis.json` (both shapes CCW produces), every task JSON under `.task/` and
//! `phase-N/.task/`, and `plan/plan.json`, then builds a plan that [`Plan::from_json`] accepts.
//! Every problem in the folder is reported at once, and nothing is returned for a folder with
//! any problem.
//!
//! Mapping rules (CCW → troupe):
//! * roles map by prefix: `IMPL`/`EXEC`/`FIX` → executor, `TEST`/`TESTRUN`/`QARUN` →
//!   test-runner (CCW's tester runs suites), `REVIEW`/`VERIFY`/`VALIDATE` → validator; a role
//!   already named `executor`, `test-runner` or `validator` maps to itself;
//! * a task in `completed_tasks` (or whose task JSON says `"status": "completed"`) keeps
//!   `"status": "completed"`; any other runtime status is dropped, since a resumed CCW session
//!   resets interrupted work to pending (ccw-reference §4.3);
//! * a completed task whose role has no troupe service (a planner, say) is left out of the
//!   plan, its id is removed from its dependents' `depends_on`, and it is kept verbatim under
//!   `ccw.completed_elsewhere`; such a task that is not completed is a problem;
//! * `pre_analysis[].on_error: skip_optional` becomes `skip`;
//! * CCW-level data (session id, roles, pipeline, `plan/plan.json`, the analysis' complexity
//!   and capabilities) is kept under the plan's `ccw` field.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

pub mod summary;

use crate::validate::Problems;
use crate::{Plan, PlanError, ProblemKind, Role, TaskKind, id_prefix};

/// What to tell a user whose session folder is broken; CCW's team-executor never repairs a
/// session either.
const RECOVERY: &str = "re-run team-coordinate to regenerate the session";

/// Valid values of `team-session.json` `status`.
const SESSION_STATUSES: [&str; 3] = ["active", "paused", "completed"];

/// Returns the project a CCW session folder belongs to: CCW keeps sessions at
/// `<project>/.workflow/.team/<session-id>/`. `None` for a folder elsewhere.
pub fn project_root(session_dir: &Path) -> Option<PathBuf> {
    let team = session_dir.parent()?;
    let workflow = team.parent()?;
    (team.file_name()? == ".team" && workflow.file_name()? == ".workflow")
        .then(|| workflow.parent().map(Path::to_path_buf))
        .flatten()
}

/// Reads a JSON object file; `None` (with a problem when `required`) if absent or broken.
fn read_object(
    path: &Path,
    label: &str,
    required: bool,
    problems: &mut Problems,
) -> Option<Map<String, Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            if required {
                problems.push(
                    ProblemKind::MissingField,
                    format!("{label}: not found at {} ({RECOVERY})", path.display()),
                );
            }
            return None;
        }
        Err(err) => {
            problems.push(
                ProblemKind::MalformedJson,
                format!("{label}: cannot read {}: {err}", path.display()),
            );
            return None;
        }
    };
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(object)) => Some(object),
        Ok(_) => {
            problems.push(
                ProblemKind::MalformedJson,
                format!("{label}: must be a json object"),
            );
            None
        }
        Err(err) => {
            problems.push(
                ProblemKind::MalformedJson,
                format!(
                    "{label}: malformed json at line {}, column {}: {err} ({RECOVERY})",
                    err.line(),
                    err.column()
                ),
            );
            None
        }
    }
}

fn non_empty_string<'a>(object: &'a Map<String, Value>, field: &str) -> Option<&'a str> {
    object
        .get(field)
        .and_then(Value::as_str)
        .filter(|text| !text.trim().is_empty())
}

fn require_string(
    object: &Map<String, Value>,
    field: &str,
    owner: &str,
    problems: &mut Problems,
) -> Option<String> {
    match object.get(field) {
        None | Some(Value::Null) => {
            problems.push(
                ProblemKind::MissingField,
                format!("{owner}: missing required field `{field}` ({RECOVERY})"),
            );
            None
        }
        Some(Value::String(text)) if text.trim().is_empty() => {
            problems.push(
                ProblemKind::MissingField,
                format!("{owner}: `{field}` is empty ({RECOVERY})"),
            );
            None
        }
        Some(Value::String(text)) => Some(text.clone()),
        Some(other) => {
            problems.push(
                ProblemKind::InvalidValue,
                format!("{owner}: `{field}` must be a string, got {other}"),
            );
            None
        }
    }
}

/// A CCW role as declared by the session or the analysis.
#[derive(Debug, Clone)]
struct CcwRole {
    prefix: Option<String>,
}

/// Checks `team-session.json` as CCW's team-executor does (ccw-reference §1.E.2) and collects
/// its roles.
fn check_session(
    session: &Map<String, Value>,
    roles: &mut BTreeMap<String, CcwRole>,
    problems: &mut Problems,
) {
    let owner = "team-session.json";
    for field in ["session_id", "task_description", "team_name"] {
        require_string(session, field, owner, problems);
    }
    if let Some(status) = require_string(session, "status", owner, problems)
        && !SESSION_STATUSES.contains(&status.as_str())
    {
        problems.push(
            ProblemKind::InvalidValue,
            format!("{owner}: invalid status `{status}` (expected active, paused or completed)"),
        );
    }
    match session.get("roles") {
        Some(Value::Array(list)) if !list.is_empty() => {
            for (index, role) in list.iter().enumerate() {
                let where_ = format!("{owner}: roles[{index}]");
                let Value::Object(role) = role else {
                    problems.push(
                        ProblemKind::InvalidValue,
                        format!("{where_} must be an object with name, prefix and role_spec"),
                    );
                    continue;
                };
                let name = require_string(role, "name", &where_, problems);
                let prefix = require_string(role, "prefix", &where_, problems);
                require_string(role, "role_spec", &where_, problems);
                if let Some(name) = name {
                    roles.insert(name, CcwRole { prefix });
                }
            }
        }
        Some(Value::Array(_)) => problems.push(
            ProblemKind::MissingField,
            format!("{owner}: `roles` is empty ({RECOVERY})"),
        ),
        None | Some(Value::Null) => problems.push(
            ProblemKind::MissingField,
            format!("{owner}: missing required field `roles` ({RECOVERY})"),
        ),
        Some(_) => problems.push(
            ProblemKind::InvalidValue,
            format!("{owner}: `roles` must be an array"),
        ),
    }
}

/// One node of a normalised dependency graph.
#[derive(Debug, Clone, Default)]
struct GraphNode {
    depends_on: Vec<String>,
    role: Option<String>,
}

/// Normalises a `dependency_graph` in either CCW shape: `{id: [deps]}` or
/// `{id: {depends_on, role}}`.
fn read_graph(
    value: &Value,
    owner: &str,
    graph: &mut BTreeMap<String, GraphNode>,
    problems: &mut Problems,
) {
    let Value::Object(entries) = value else {
        problems.push(
            ProblemKind::InvalidValue,
            format!("{owner}: `dependency_graph` must be an object"),
        );
        return;
    };
    for (id, entry) in entries {
        let where_ = format!("{owner}: dependency_graph.{id}");
        let (deps, role) = match entry {
            Value::Array(deps) => (Some(deps), None),
            Value::Object(node) => {
                let deps = match node.get("depends_on") {
                    Some(Value::Array(deps)) => Some(deps),
                    None | Some(Value::Null) => None,
                    Some(_) => {
                        problems.push(
                            ProblemKind::InvalidValue,
                            format!("{where_}.depends_on must be an array of task ids"),
                        );
                        None
                    }
                };
                let role = match node.get("role") {
                    Some(Value::String(role)) if !role.is_empty() => Some(role.clone()),
                    None | Some(Value::Null) => None,
                    Some(other) => {
                        problems.push(
                            ProblemKind::InvalidValue,
                            format!("{where_}.role must be a role name, got {other}"),
                        );
                        None
                    }
                };
                (deps, role)
            }
            other => {
                problems.push(
                    ProblemKind::InvalidValue,
                    format!(
                        "{where_} must be an array of task ids or {{depends_on, role}}, got {other}"
                    ),
                );
                continue;
            }
        };
        let node = graph.entry(id.clone()).or_default();
        for dep in deps.into_iter().flatten() {
            match dep {
                Value::String(dep) => {
                    if !node.depends_on.contains(dep) {
                        node.depends_on.push(dep.clone());
                    }
                }
                other => problems.push(
                    ProblemKind::InvalidValue,
                    format!("{where_}: dependency {other} must be a task id string"),
                ),
            }
        }
        if node.role.is_none() {
            node.role = role;
        }
    }
}

/// Checks `task-analysis.json` (§1.E.2) and collects its graph, roles and capability tasks.
fn check_analysis(
    analysis: &Map<String, Value>,
    roles: &mut BTreeMap<String, CcwRole>,
    graph: &mut BTreeMap<String, GraphNode>,
    capability_tasks: &mut Vec<(String, Map<String, Value>)>,
    problems: &mut Problems,
) {
    let owner = "task-analysis.json";
    match analysis.get("capabilities") {
        Some(Value::Array(capabilities)) => {
            for (index, capability) in capabilities.iter().enumerate() {
                let Value::Object(capability) = capability else {
                    problems.push(
                        ProblemKind::InvalidValue,
                        format!("{owner}: capabilities[{index}] must be an object"),
                    );
                    continue;
                };
                let name = non_empty_string(capability, "name").map(str::to_owned);
                if let Some(name) = &name {
                    let prefix = non_empty_string(capability, "prefix").map(str::to_owned);
                    let entry = roles
                        .entry(name.clone())
                        .or_insert(CcwRole { prefix: None });
                    if entry.prefix.is_none() {
                        entry.prefix = prefix;
                    }
                }
                // Shape (a) lists the capability's tasks; shape (b) has none.
                let Some(tasks) = capability.get("tasks").filter(|value| !value.is_null()) else {
                    continue;
                };
                let Value::Array(tasks) = tasks else {
                    problems.push(
                        ProblemKind::InvalidValue,
                        format!("{owner}: capabilities[{index}].tasks must be an array"),
                    );
                    continue;
                };
                for (position, task) in tasks.iter().enumerate() {
                    match task {
                        Value::Object(task) if non_empty_string(task, "id").is_some() => {
                            capability_tasks
                                .push((name.clone().unwrap_or_default(), task.clone()));
                        }
                        _ => problems.push(
                            ProblemKind::MissingField,
                            format!("{owner}: capabilities[{index}].tasks[{position}] must be an object with an `id`"),
                        ),
                    }
                }
            }
        }
        None | Some(Value::Null) => problems.push(
            ProblemKind::MissingField,
            format!("{owner}: missing required field `capabilities` ({RECOVERY})"),
        ),
        Some(_) => problems.push(
            ProblemKind::InvalidValue,
            format!("{owner}: `capabilities` must be an array"),
        ),
    }
    match analysis.get("dependency_graph") {
        None | Some(Value::Null) => problems.push(
            ProblemKind::MissingField,
            format!("{owner}: missing required field `dependency_graph` ({RECOVERY})"),
        ),
        Some(value) => read_graph(value, owner, graph, problems),
    }
    match analysis.get("roles") {
        Some(Value::Array(list)) if !list.is_empty() => {
            for role in list {
                if let Value::Object(role) = role
                    && let Some(name) = non_empty_string(role, "name")
                {
                    let prefix = non_empty_string(role, "prefix").map(str::to_owned);
                    let entry = roles
                        .entry(name.to_owned())
                        .or_insert(CcwRole { prefix: None });
                    if entry.prefix.is_none() {
                        entry.prefix = prefix;
                    }
                }
            }
        }
        Some(Value::Array(_)) => problems.push(
            ProblemKind::MissingField,
            format!("{owner}: `roles` is empty ({RECOVERY})"),
        ),
        None | Some(Value::Null) => problems.push(
            ProblemKind::MissingField,
            format!("{owner}: missing required field `roles` ({RECOVERY})"),
        ),
        Some(_) => problems.push(
            ProblemKind::InvalidValue,
            format!("{owner}: `roles` must be an array"),
        ),
    }
}

/// A task JSON file found under `.task/` or `phase-N/.task/`.
struct TaskFile {
    label: String,
    phase: Option<u64>,
    object: Map<String, Value>,
}

/// Lists `*.json` files of `dir`, sorted by name; empty when the directory is absent.
fn json_files(dir: &Path, problems: &mut Problems) -> Vec<PathBuf> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(err) => {
            problems.push(
                ProblemKind::MalformedJson,
                format!("cannot list {}: {err}", dir.display()),
            );
            return Vec::new();
        }
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.is_file() && path.extension().is_some_and(|ext| ext == "json"))
        .collect();
    files.sort();
    files
}

/// Reads `.task/*.json` and then `phase-N/.task/*.json` in phase order.
fn read_task_files(dir: &Path, problems: &mut Problems) -> Vec<TaskFile> {
    let mut sources: Vec<(Option<u64>, PathBuf)> = vec![(None, dir.join(".task"))];
    let mut phases: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|entry| {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    let number = name.strip_prefix("phase-")?.parse::<u64>().ok()?;
                    entry
                        .path()
                        .is_dir()
                        .then(|| (number, entry.path().join(".task")))
                })
                .collect()
        })
        .unwrap_or_default();
    phases.sort();
    sources.extend(
        phases
            .into_iter()
            .map(|(number, path)| (Some(number), path)),
    );

    let mut files = Vec::new();
    for (phase, task_dir) in sources {
        for path in json_files(&task_dir, problems) {
            let label = path
                .strip_prefix(dir)
                .unwrap_or(&path)
                .display()
                .to_string();
            let Some(object) = read_object(&path, &label, true, problems) else {
                continue;
            };
            if non_empty_string(&object, "id").is_none() {
                problems.push(
                    ProblemKind::MissingField,
                    format!("{label}: missing required field `id`"),
                );
                continue;
            }
            files.push(TaskFile {
                label,
                phase,
                object,
            });
        }
    }
    files
}

/// Builds a task object from a shape-(a) capability task, which has no task JSON of its own.
fn task_from_capability(capability: &str, task: &Map<String, Value>) -> Map<String, Value> {
    let mut spec = Map::new();
    let id = non_empty_string(task, "id").unwrap_or_default();
    let goal = non_empty_string(task, "goal").unwrap_or(id);
    spec.insert("id".into(), json!(id));
    spec.insert("title".into(), json!(goal));
    let mut description = goal.to_owned();
    if let Some(constraints) = non_empty_string(task, "constraints") {
        description.push_str(&format!(" (constraints: {constraints})"));
    }
    spec.insert("description".into(), json!(description));
    if let Some(Value::Array(steps)) = task.get("steps") {
        spec.insert("implementation".into(), Value::Array(steps.clone()));
    }
    let key_files: Vec<Value> = match task.get("key_files") {
        Some(Value::Array(files)) => files
            .iter()
            .filter_map(Value::as_str)
            .map(|path| json!({"path": path}))
            .collect(),
        _ => Vec::new(),
    };
    if !key_files.is_empty() {
        spec.insert("files".into(), Value::Array(key_files));
    }
    if let Some(criteria) = non_empty_string(task, "success_criteria") {
        spec.insert("convergence".into(), json!({"criteria": [criteria]}));
    }
    // The capability task as written, so nothing of it is lost.
    spec.insert(
        "ccw_capability_task".into(),
        json!({"capability": capability, "task": task}),
    );
    spec
}

/// Resolves a CCW role name to a troupe role through its prefix, or its own name.
fn map_role_name(name: &str, roles: &BTreeMap<String, CcwRole>) -> Option<Role> {
    if let Some(role) = Role::parse(name) {
        return Some(role);
    }
    roles
        .get(name)
        .and_then(|role| role.prefix.as_deref())
        .and_then(TaskKind::from_prefix)
        .map(TaskKind::role)
}

/// Replaces `skip_optional` with troupe's `skip` in `pre_analysis[].on_error`.
fn normalise_on_error(spec: &mut Map<String, Value>) {
    if let Some(Value::Array(steps)) = spec.get_mut("pre_analysis") {
        for step in steps {
            if let Some(on_error) = step.get_mut("on_error")
                && on_error == "skip_optional"
            {
                *on_error = json!("skip");
            }
        }
    }
}

/// Makes a plan name (`[a-z0-9-]+`) out of a CCW team name.
fn plan_name(text: &str) -> String {
    let mut name = String::new();
    for c in text.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            name.push(c);
        } else if !name.is_empty() && !name.ends_with('-') {
            name.push('-');
        }
    }
    let name = name.trim_end_matches('-').to_owned();
    if name.is_empty() {
        "ccw-import".to_owned()
    } else {
        name
    }
}

fn string_set(value: Option<&Value>) -> Vec<String> {
    match value {
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect(),
        _ => Vec::new(),
    }
}

/// Restores the plan's repositories from troupe's export (`[{name, path | url, access?}]`, the
/// default first).
///
/// A JSON object forgets key order and the plan's first repository is its default, so tasks
/// that name no repository get the default written out when it would not sort first.
///
/// A repository whose export recorded the session branch (`troupe.commits[].branch`) gets it
/// as `base`, so the new session branch starts where the exported session had got to (with the
/// work of its completed tasks), not at the repository's HEAD. The coordinator refuses the plan
/// when that branch is not in the repository.
fn import_repos(
    repos: &[Value],
    commits: &[Value],
    document: &mut Map<String, Value>,
    tasks: &mut [Map<String, Value>],
    problems: &mut Problems,
) {
    let mut declared = Map::new();
    let mut default = None;
    for (index, repo) in repos.iter().enumerate() {
        let name = repo.get("name").and_then(Value::as_str);
        let path = repo.get("path").and_then(Value::as_str);
        let url = repo.get("url").and_then(Value::as_str);
        let (Some(name), Some((key, location))) =
            (name, path.map(|p| ("path", p)).or(url.map(|u| ("url", u))))
        else {
            problems.push(
                ProblemKind::InvalidValue,
                format!("team-session.json: troupe.repos[{index}] must have a `name` and a `path` or `url`"),
            );
            continue;
        };
        default.get_or_insert_with(|| name.to_owned());
        let mut entry = Map::new();
        entry.insert(key.into(), json!(location));
        if let Some(access) = repo.get("access") {
            entry.insert("access".into(), access.clone());
        }
        let branch = commits
            .iter()
            .filter(|commit| commit.get("repo").and_then(Value::as_str) == Some(name))
            .find_map(|commit| commit.get("branch").and_then(Value::as_str))
            .filter(|branch| !branch.is_empty());
        if let Some(branch) = branch {
            entry.insert("base".into(), json!(branch));
        }
        declared.insert(name.to_owned(), Value::Object(entry));
    }
    let Some(default) = default else {
        return;
    };
    if declared.keys().next() != Some(&default) {
        for task in tasks.iter_mut() {
            task.entry("repo").or_insert_with(|| json!(default));
        }
    }
    document.insert("repos".into(), Value::Object(declared));
}

/// Reads the CCW session folder `dir` and returns a native plan document (a JSON object that
/// [`Plan::from_json`] accepts), or every problem found.
pub fn import_session(dir: &Path) -> Result<Value, PlanError> {
    let mut problems = Problems::default();
    if !dir.is_dir() {
        problems.push(
            ProblemKind::MissingField,
            format!("ccw session folder {} does not exist", dir.display()),
        );
        return Err(PlanError {
            problems: problems.0,
        });
    }

    let mut roles: BTreeMap<String, CcwRole> = BTreeMap::new();
    let mut graph: BTreeMap<String, GraphNode> = BTreeMap::new();
    let mut capability_tasks: Vec<(String, Map<String, Value>)> = Vec::new();

    let session = read_object(
        &dir.join("team-session.json"),
        "team-session.json",
        true,
        &mut problems,
    );
    if let Some(session) = &session {
        check_session(session, &mut roles, &mut problems);
        if let Some(Value::Object(pipeline)) = session.get("pipeline")
            && let Some(value) = pipeline.get("dependency_graph").filter(|v| !v.is_null())
        {
            read_graph(
                value,
                "team-session.json: pipeline",
                &mut graph,
                &mut problems,
            );
        }
    }
    let analysis = read_object(
        &dir.join("task-analysis.json"),
        "task-analysis.json",
        true,
        &mut problems,
    );
    if let Some(analysis) = &analysis {
        check_analysis(
            analysis,
            &mut roles,
            &mut graph,
            &mut capability_tasks,
            &mut problems,
        );
    }
    let overview = read_object(
        &dir.join("plan").join("plan.json"),
        "plan/plan.json",
        false,
        &mut problems,
    );
    let task_files = read_task_files(dir, &mut problems);

    let empty = Map::new();
    let session_ref = session.as_ref().unwrap_or(&empty);
    // troupe's own export adds a `troupe` block with what CCW has no field for.
    let troupe = match session_ref.get("troupe") {
        Some(Value::Object(troupe)) => troupe.clone(),
        _ => Map::new(),
    };
    let mut completed: BTreeSet<String> = string_set(session_ref.get("completed_tasks"))
        .into_iter()
        .collect();

    // Every task, in a stable order: troupe's recorded order, then task files, then the
    // analysis' capability tasks, then ids only the graphs know.
    let mut specs: Vec<(String, Map<String, Value>, Option<u64>)> = Vec::new();
    let mut seen: HashMap<String, String> = HashMap::new();
    for file in task_files {
        let id = non_empty_string(&file.object, "id")
            .unwrap_or_default()
            .to_owned();
        if let Some(first) = seen.get(&id) {
            problems.push(
                ProblemKind::DuplicateId,
                format!("duplicate task id {id} ({first} and {})", file.label),
            );
            continue;
        }
        seen.insert(id.clone(), file.label.clone());
        specs.push((id, file.object, file.phase));
    }
    for (capability, task) in &capability_tasks {
        let id = non_empty_string(task, "id").unwrap_or_default().to_owned();
        if seen.contains_key(&id) {
            continue;
        }
        seen.insert(
            id.clone(),
            format!("task-analysis.json capability {capability}"),
        );
        let mut spec = task_from_capability(capability, task);
        if let Some(role) = Some(capability.as_str()).filter(|name| !name.is_empty()) {
            spec.insert("ccw_role".into(), json!(role));
        }
        specs.push((id, spec, None));
    }
    for id in graph.keys() {
        if seen.contains_key(id) {
            continue;
        }
        seen.insert(id.clone(), "dependency_graph".into());
        let mut spec = Map::new();
        spec.insert("id".into(), json!(id));
        spec.insert("title".into(), json!(id));
        specs.push((id.clone(), spec, None));
    }
    let order = string_set(troupe.get("task_order"));
    if !order.is_empty() {
        let rank: HashMap<&str, usize> = order
            .iter()
            .enumerate()
            .map(|(index, id)| (id.as_str(), index))
            .collect();
        specs.sort_by_key(|(id, _, _)| rank.get(id.as_str()).copied().unwrap_or(usize::MAX));
    }

    for (id, spec, _) in &specs {
        if spec.get("status").and_then(Value::as_str) == Some("completed") {
            completed.insert(id.clone());
        }
    }
    for id in &completed {
        if !seen.contains_key(id) {
            problems.push(
                ProblemKind::UnknownDependency,
                format!("team-session.json: completed_tasks lists {id}, which no task file or dependency graph defines"),
            );
        }
    }

    let mut tasks: Vec<Map<String, Value>> = Vec::new();
    let mut completed_elsewhere: Vec<Value> = Vec::new();
    let mut dropped: BTreeSet<String> = BTreeSet::new();
    for (id, mut spec, phase) in specs {
        let node = graph.get(&id);
        // Dependencies: the task JSON's own, then any the graphs add.
        let mut deps = string_set(spec.get("depends_on"));
        if let Some(node) = node {
            for dep in &node.depends_on {
                if !deps.contains(dep) {
                    deps.push(dep.clone());
                }
            }
        }
        // A spec without `depends_on` gets one only when a graph adds dependencies, so specs
        // that went through troupe's export come back as they were.
        let has_deps = spec.contains_key("depends_on");
        if spec.get("depends_on").is_none_or(Value::is_array) && (has_deps || !deps.is_empty()) {
            spec.insert("depends_on".into(), json!(deps));
        }

        // Role: a troupe role written on the task, else the CCW role of the task or graph
        // node through its prefix, else the id prefix.
        let written = spec.get("role").and_then(Value::as_str).map(str::to_owned);
        let ccw_role = written
            .clone()
            .filter(|name| Role::parse(name).is_none())
            .or_else(|| node.and_then(|node| node.role.clone()))
            .or_else(|| {
                spec.get("ccw_role")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            });
        let role = written
            .as_deref()
            .and_then(Role::parse)
            .or_else(|| {
                ccw_role
                    .as_deref()
                    .and_then(|name| map_role_name(name, &roles))
            })
            .or_else(|| TaskKind::from_id(&id).map(TaskKind::role));
        let is_completed = completed.contains(&id);
        let Some(role) = role else {
            if is_completed {
                dropped.insert(id.clone());
                completed_elsewhere.push(Value::Object(spec));
            } else {
                let named = ccw_role
                    .map(|name| {
                        let prefix = roles
                            .get(&name)
                            .and_then(|role| role.prefix.clone())
                            .unwrap_or_else(|| id_prefix(&id).to_owned());
                        format!("CCW role `{name}` (prefix {prefix})")
                    })
                    .unwrap_or_else(|| format!("id prefix `{}`", id_prefix(&id)));
                problems.push(
                    ProblemKind::UnknownRole,
                    format!("task {id}: unknown role: {named} has no troupe service (executor: IMPL/EXEC/FIX, test-runner: TEST/TESTRUN/QARUN, validator: REVIEW/VERIFY/VALIDATE)"),
                );
                // Kept in the (refused) document so the graph checks see the task.
                spec.insert("role".into(), json!(Role::Executor.as_str()));
                tasks.push(spec);
            }
            continue;
        };
        if let Some(name) = ccw_role.filter(|name| Role::parse(name) != Some(role)) {
            spec.insert("ccw_role".into(), json!(name));
        }
        // The id prefix decides the role when the task names none; write it only when that
        // would be wrong, so specs stay as written.
        if written.as_deref() != Some(role.as_str())
            && (written.is_some() || TaskKind::from_id(&id).map(TaskKind::role) != Some(role))
        {
            spec.insert("role".into(), json!(role.as_str()));
        }

        if is_completed {
            spec.insert("status".into(), json!("completed"));
        } else {
            spec.remove("status");
        }
        normalise_on_error(&mut spec);
        if let Some(phase) = phase {
            spec.entry("phase").or_insert(json!(phase));
        }
        tasks.push(spec);
    }
    if !dropped.is_empty() {
        for spec in &mut tasks {
            if let Some(Value::Array(deps)) = spec.get_mut("depends_on") {
                deps.retain(|dep| dep.as_str().is_none_or(|dep| !dropped.contains(dep)));
            }
        }
    }

    let team_name = non_empty_string(session_ref, "team_name")
        .or_else(|| non_empty_string(session_ref, "session_id"))
        .unwrap_or("ccw-import");
    let mut document = Map::new();
    document.insert(
        "name".into(),
        json!(
            non_empty_string(&troupe, "plan_name")
                .map(str::to_owned)
                .unwrap_or_else(|| plan_name(team_name))
        ),
    );
    if let Some(description) = non_empty_string(session_ref, "task_description") {
        document.insert("description".into(), json!(description));
    }
    for field in ["mode", "on_failure", "max_attempts"] {
        if let Some(value) = troupe.get(field).filter(|value| !value.is_null()) {
            document.insert(field.into(), value.clone());
        }
    }
    if let Some(Value::Array(repos)) = troupe.get("repos") {
        let commits = match troupe.get("commits") {
            Some(Value::Array(commits)) => commits.as_slice(),
            _ => &[],
        };
        import_repos(repos, commits, &mut document, &mut tasks, &mut problems);
    }

    let mut ccw = Map::new();
    for field in [
        "session_id",
        "team_name",
        "status",
        "roles",
        "pipeline",
        "completed_tasks",
        "completion_action",
        "created_at",
        "supervision",
        "gc_rounds",
    ] {
        if let Some(value) = session_ref.get(field) {
            ccw.insert(field.into(), value.clone());
        }
    }
    if let Some(analysis) = &analysis {
        let mut kept = analysis.clone();
        kept.insert(
            "dependency_graph".into(),
            Value::Object(
                graph
                    .iter()
                    .map(|(id, node)| {
                        let mut entry = Map::new();
                        entry.insert("depends_on".into(), json!(node.depends_on));
                        if let Some(role) = &node.role {
                            entry.insert("role".into(), json!(role));
                        }
                        (id.clone(), Value::Object(entry))
                    })
                    .collect(),
            ),
        );
        ccw.insert("task_analysis".into(), Value::Object(kept));
    }
    if let Some(overview) = overview {
        ccw.insert("plan".into(), Value::Object(overview));
    }
    if !completed_elsewhere.is_empty() {
        ccw.insert(
            "completed_elsewhere".into(),
            Value::Array(completed_elsewhere),
        );
    }
    document.insert("ccw".into(), Value::Object(ccw));
    document.insert(
        "tasks".into(),
        Value::Array(tasks.into_iter().map(Value::Object).collect()),
    );
    let document = Value::Object(document);

    // The plan's own checks (cycles, unknown dependencies, paths) complete the list.
    if let Err(err) = Plan::from_json(&document.to_string()) {
        for problem in err.problems {
            if !problems.0.contains(&problem) {
                problems.0.push(problem);
            }
        }
    }
    if problems.0.is_empty() {
        Ok(document)
    } else {
        Err(PlanError {
            problems: problems.0,
        })
    }
}

#[cfg(test)]
mod tests;
