//! [`TaskSpec`]: one task, typed. Intake ([`crate::Plan::from_json`]) and the workers read a
//! task's fields with the same functions here, so a field means one thing everywhere: the
//! coordinator refuses what a worker would refuse, and a worker turns its claimed `pb::Task`
//! into a `TaskSpec` once ([`TryFrom`]) instead of reading JSON by rules of its own.

use std::time::Duration;

use serde_json::{Map, Value};
use troupe_proto::v1 as pb;

use crate::validate::{Problems, enum_field, escapes_root, optional_string, string_list};
use crate::{FileAction, FileSpec, PlanError, ProblemKind, Role, TaskBlocks, TaskKind};

/// One task as a worker runs it: identity, where it works, what it touches, and its typed
/// blocks (`agent`, `convergence`, `test`, `judge`, `gap_closure`, `pre_analysis`, scope).
#[derive(Debug, Clone, PartialEq)]
pub struct TaskSpec {
    /// Task id, such as `IMPL-001`.
    pub id: String,
    /// What it is: the id prefix's kind when it fits the role, else the role's plain kind.
    pub kind: TaskKind,
    /// The worker role that handles it.
    pub role: Role,
    /// Short title (may be empty outside a plan, such as a direct `ExecuteTask`).
    pub title: String,
    /// Goal and reason.
    pub description: String,
    /// Name of the plan repository it works in; empty when not known (a direct call).
    pub repo: String,
    /// Ids of the tasks that must complete first.
    pub depends_on: Vec<String>,
    /// Files it touches (`files[]`; a bare path means `modify`).
    pub files: Vec<FileSpec>,
    /// Paths it focuses on (`focus_paths`).
    pub focus_paths: Vec<String>,
    /// The plan's wall-clock limit of one attempt (`timeout_seconds`), if set.
    pub timeout: Option<Duration>,
    /// The typed blocks.
    pub blocks: TaskBlocks,
    /// The task object as written in the plan, for the prose fields only an agent's prompt
    /// reads (`implementation`, `reference`, `rationale`, `risks`, `phase`, ...).
    pub object: Map<String, Value>,
}

/// What intake and the workers read from a task object alike.
pub(crate) struct Common {
    pub(crate) role: Option<Role>,
    pub(crate) description: String,
    pub(crate) depends_on: Vec<String>,
    pub(crate) files: Vec<FileSpec>,
    pub(crate) focus_paths: Vec<String>,
    pub(crate) timeout_seconds: Option<u32>,
    pub(crate) blocks: TaskBlocks,
}

/// Reads the fields every reader of a task object shares; `role` is the role the reader
/// already knows (the claim's), else the object's `role`, else the id prefix's.
pub(crate) fn common(
    object: &Map<String, Value>,
    id: &str,
    owner: &str,
    role: Option<Role>,
    problems: &mut Problems,
) -> Common {
    let role = role.or_else(|| role_of(object, id, owner, problems));
    let mut depends_on: Vec<String> = Vec::new();
    for dep in string_list(object, "depends_on", owner, problems) {
        if !depends_on.contains(&dep) {
            depends_on.push(dep);
        }
    }
    let description = optional_string(object, "description", owner, problems);
    let files = files(object, owner, problems);
    let focus_paths = string_list(object, "focus_paths", owner, problems);
    for (position, path) in focus_paths.iter().enumerate() {
        if escapes_root(path) {
            problems.push(
                ProblemKind::PathEscape,
                format!("{owner}: focus_paths[{position}] `{path}` escapes the repository root"),
            );
        }
    }
    Common {
        description,
        depends_on,
        files,
        focus_paths,
        timeout_seconds: timeout_seconds(object, owner, problems),
        blocks: crate::spec::parse(object, owner, role, problems),
        role,
    }
}

/// The object's `role`, else the one its id prefix names; a problem when neither names one.
fn role_of(
    object: &Map<String, Value>,
    id: &str,
    owner: &str,
    problems: &mut Problems,
) -> Option<Role> {
    match object.get("role") {
        None | Some(Value::Null) => {
            let role = TaskKind::from_id(id).map(TaskKind::role);
            if role.is_none() {
                let prefix = crate::id_prefix(id);
                problems.push(
                    ProblemKind::UnknownRole,
                    format!(
                        "{owner}: unknown role: id prefix `{prefix}` names no role (use IMPL/EXEC/FIX, VALIDATE/REVIEW/VERIFY, TESTRUN/TEST/QARUN or set `role` to executor, validator or test-runner)"
                    ),
                );
            }
            role
        }
        Some(Value::String(text)) => {
            let role = Role::parse(text);
            if role.is_none() {
                problems.push(
                    ProblemKind::UnknownRole,
                    format!("{owner}: unknown role `{text}` (expected executor, validator or test-runner)"),
                );
            }
            role
        }
        Some(other) => {
            problems.push(
                ProblemKind::UnknownRole,
                format!(
                    "{owner}: unknown role {other} (expected executor, validator or test-runner)"
                ),
            );
            None
        }
    }
}

fn timeout_seconds(
    object: &Map<String, Value>,
    owner: &str,
    problems: &mut Problems,
) -> Option<u32> {
    let value = object
        .get("timeout_seconds")
        .filter(|value| !value.is_null())?;
    match value.as_u64().and_then(|secs| u32::try_from(secs).ok()) {
        Some(secs) if secs > 0 => Some(secs),
        _ => {
            problems.push(
                ProblemKind::InvalidValue,
                format!("{owner}: invalid timeout_seconds {value} (expected a positive integer)"),
            );
            None
        }
    }
}

/// `files[]`: objects `{path, action, change}` (CCW's `target` stands in for a missing
/// `change`), or bare paths, which mean `modify`.
pub(crate) fn files(
    object: &Map<String, Value>,
    owner: &str,
    problems: &mut Problems,
) -> Vec<FileSpec> {
    let items = match object.get("files") {
        None | Some(Value::Null) => return Vec::new(),
        Some(Value::Array(items)) => items,
        Some(_) => {
            problems.push(
                ProblemKind::InvalidValue,
                format!("{owner}: `files` must be an array"),
            );
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for (position, item) in items.iter().enumerate() {
        let where_ = format!("{owner}: files[{position}]");
        let (path, action, change) = match item {
            Value::String(path) if !path.is_empty() => {
                (path.clone(), FileAction::default(), String::new())
            }
            Value::Object(file) => {
                let path = match file.get("path") {
                    Some(Value::String(path)) if !path.is_empty() => path.clone(),
                    Some(Value::String(_)) | None | Some(Value::Null) => {
                        problems.push(
                            ProblemKind::MissingField,
                            format!("{where_}: missing required field `path`"),
                        );
                        continue;
                    }
                    Some(_) => {
                        problems.push(
                            ProblemKind::InvalidValue,
                            format!("{where_}: `path` must be a string"),
                        );
                        continue;
                    }
                };
                let action = enum_field(
                    file,
                    "action",
                    &where_,
                    FileAction::parse,
                    "create, modify or delete",
                    problems,
                )
                .unwrap_or_default();
                let field = if file.get("change").is_none_or(Value::is_null) {
                    "target"
                } else {
                    "change"
                };
                let change = optional_string(file, field, &where_, problems);
                (path, action, change)
            }
            _ => {
                problems.push(
                    ProblemKind::InvalidValue,
                    format!("{where_} must be a path or an object with `path`"),
                );
                continue;
            }
        };
        if escapes_root(&path) {
            problems.push(
                ProblemKind::PathEscape,
                format!("{owner}: files[{position}].path `{path}` escapes the repository root"),
            );
        }
        out.push(FileSpec {
            path,
            action,
            change,
        });
    }
    out
}

impl TaskSpec {
    /// Reads a task object by the plan's rules (a direct `ExecuteTask`'s task, a task file of
    /// an EXEC phase), with every problem listed. `role` is the reader's role, used when the
    /// object names none and its id prefix names none either.
    pub fn from_object(object: &Map<String, Value>, role: Option<Role>) -> Result<Self, PlanError> {
        let id = match object.get("id") {
            Some(Value::String(id)) => id.trim().to_owned(),
            _ => String::new(),
        };
        let mut problems = Problems::default();
        if id.is_empty() {
            problems.push(
                ProblemKind::MissingField,
                "task: missing required field `id`",
            );
        }
        let owner = if id.is_empty() {
            "task".to_owned()
        } else {
            format!("task {id}")
        };
        // The object's own role, else the prefix's, else the reader's.
        let known = match object.get("role") {
            None | Some(Value::Null) => TaskKind::from_id(&id).map(TaskKind::role).or(role),
            Some(_) => None,
        };
        let common = common(object, &id, &owner, known, &mut problems);
        let title = optional_string(object, "title", &owner, &mut problems);
        let repo = optional_string(object, "repo", &owner, &mut problems);
        finish(id, title, repo, None, common, object.clone(), problems)
    }

    /// CCW's `phase` (a number or a string), when set.
    pub fn phase(&self) -> Option<&Value> {
        self.object
            .get("phase")
            .filter(|value| value.is_number() || value.is_string())
    }

    /// Paths the task may change: `files[].path`, `focus_paths` and CCW `scope` paths,
    /// normalised (no `./`, no trailing `/`).
    pub fn allowed_paths(&self) -> Vec<String> {
        self.files
            .iter()
            .map(|file| file.path.as_str())
            .chain(self.focus_paths.iter().map(String::as_str))
            .chain(self.blocks.scope_paths.iter().map(String::as_str))
            .map(normalize)
            .filter(|path| !path.is_empty())
            .collect()
    }

    /// Changed paths outside the task's scope (or inside its `excludes`). `None` when the task
    /// declares no scope at all, so nothing can be checked.
    pub fn out_of_scope(&self, changed: &[String]) -> Option<Vec<String>> {
        let allowed = self.allowed_paths();
        let excludes: Vec<String> = self
            .blocks
            .excludes
            .iter()
            .map(|path| normalize(path))
            .filter(|path| !path.is_empty())
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

fn finish(
    id: String,
    title: String,
    repo: String,
    files: Option<Vec<FileSpec>>,
    common: Common,
    object: Map<String, Value>,
    problems: Problems,
) -> Result<TaskSpec, PlanError> {
    if !problems.0.is_empty() {
        return Err(PlanError {
            problems: problems.0,
        });
    }
    // A missing role was reported above.
    let role = common.role.unwrap_or(Role::Executor);
    Ok(TaskSpec {
        kind: TaskKind::of(&id, role),
        role,
        id,
        title,
        description: common.description,
        repo,
        depends_on: common.depends_on,
        files: files.unwrap_or(common.files),
        focus_paths: common.focus_paths,
        timeout: common
            .timeout_seconds
            .map(|secs| Duration::from_secs(u64::from(secs))),
        blocks: common.blocks,
        object,
    })
}

/// The wire's typed file list; an unspecified action is the plan's default (`modify`).
fn wire_files(files: &[pb::FileChange]) -> Vec<FileSpec> {
    files
        .iter()
        .map(|file| FileSpec {
            path: file.path.clone(),
            action: FileAction::from_proto(file.action()).unwrap_or_default(),
            change: file.change.clone(),
        })
        .collect()
}

/// A claimed task: its typed fields as the coordinator sent them (id, title, description,
/// role, repo, dependencies, files) and its blocks read from `Task.spec` by the plan's rules.
impl TryFrom<&pb::Task> for TaskSpec {
    type Error = PlanError;

    fn try_from(task: &pb::Task) -> Result<Self, PlanError> {
        let object = task
            .spec
            .as_ref()
            .map(troupe_proto::json::struct_to_object)
            .unwrap_or_default();
        let id = if task.id.is_empty() {
            object
                .get("id")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        } else {
            task.id.clone()
        };
        let mut problems = Problems::default();
        if id.is_empty() {
            problems.push(
                ProblemKind::MissingField,
                "task: missing required field `id`",
            );
        }
        let owner = format!("task {id}");
        let role = Role::from_proto(task.role());
        let mut common = common(&object, &id, &owner, role, &mut problems);
        if !task.depends_on.is_empty() {
            common.depends_on = task.depends_on.clone();
        }
        if !task.description.is_empty() {
            common.description = task.description.clone();
        }
        let text = |typed: &str, key: &str| {
            if typed.is_empty() {
                object
                    .get(key)
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned()
            } else {
                typed.to_owned()
            }
        };
        let (title, repo) = (text(&task.title, "title"), text(&task.repo, "repo"));
        let files = (!task.files.is_empty()).then(|| wire_files(&task.files));
        finish(id, title, repo, files, common, object, problems)
    }
}

/// An upstream task as a claim carries it: its id, role, repository and files typed, its
/// blocks read from its spec.
impl TryFrom<&pb::UpstreamResult> for TaskSpec {
    type Error = PlanError;

    fn try_from(upstream: &pb::UpstreamResult) -> Result<Self, PlanError> {
        let task = pb::Task {
            id: upstream.task_id.clone(),
            role: upstream.role,
            repo: upstream.repo.clone(),
            files: upstream.files.clone(),
            spec: upstream.spec.clone(),
            ..pb::Task::default()
        };
        Self::try_from(&task)
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

#[cfg(test)]
mod tests;
