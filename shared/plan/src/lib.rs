//! The troupe plan model: parses the native JSON plan format, validates it completely (every
//! problem is reported, not just the first), and derives what the scheduler needs: roles, waves,
//! a topological order and each task's longest remaining critical path.
//!
//! The entry point is [`Plan::from_json`]. The crate does no I/O except [`ccw::import_session`],
//! which reads a CCW session folder: resolving repository paths and copying templates is the
//! coordinator's job.

#![warn(missing_docs)]

mod approval;
pub mod backend;
pub mod ccw;
pub mod checkpoint;
pub mod execution;
mod kind;
pub mod phase;
pub mod spec;
mod task;
mod validate;

use std::collections::HashMap;
use std::fmt;

use serde_json::{Map, Value};
use troupe_proto::v1 as pb;

pub use approval::approval_prompt;
pub use backend::{AutoPick, BackendChoice};
pub use kind::{TaskKind, id_prefix};
pub use spec::TaskBlocks;
pub use task::TaskSpec;
pub use validate::{Problem, ProblemKind};

/// Default number of attempts per task when neither the plan nor the task sets one.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 2;

/// What a task without `estimate_seconds` or `effort` is expected to take, in milliseconds,
/// when no task of its plan gives an estimate (otherwise such a task weighs their mean).
pub const DEFAULT_ESTIMATE_MS: u64 = 60_000;

/// What CCW's `effort` levels are taken to mean, in seconds: small, medium, large.
pub const EFFORT_SECONDS: [(&str, u64); 3] = [("small", 300), ("medium", 900), ("large", 1800)];

/// Name of the implicit repository of a plan that declares no `repos`.
pub const IMPLICIT_REPO: &str = "default";

/// A plan that failed validation, with every problem found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct PlanError {
    /// Every problem, in the order found.
    pub problems: Vec<Problem>,
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, problem) in self.problems.iter().enumerate() {
            if index > 0 {
                writeln!(f)?;
            }
            write!(f, "{problem}")?;
        }
        Ok(())
    }
}

impl PlanError {
    /// The first `first` problems, each on its own line (cut at [`PROBLEM_CHARS`]
    /// characters), then how many more there are (`… and 99,950 more`): a refusal that stays
    /// small however large the plan.
    pub fn summary(&self, first: usize) -> String {
        let mut out = String::new();
        for (index, problem) in self.problems.iter().take(first).enumerate() {
            if index > 0 {
                out.push('\n');
            }
            let text = problem.to_string();
            match text.char_indices().nth(PROBLEM_CHARS) {
                Some((cut, _)) => {
                    out.push_str(&text[..cut]);
                    out.push('…');
                }
                None => out.push_str(&text),
            }
        }
        let rest = self.problems.len().saturating_sub(first);
        if rest > 0 {
            out.push_str(&format!("\n… and {} more", thousands(rest)));
        }
        out
    }

    /// Returns true when some problem is of `kind`.
    pub fn has(&self, kind: ProblemKind) -> bool {
        self.problems.iter().any(|problem| problem.kind == kind)
    }
}

/// How much of one problem [`PlanError::summary`] keeps.
pub const PROBLEM_CHARS: usize = 400;

/// `n` with a comma every three digits (`99,950`).
fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

/// The kind of worker that handles a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// Implements code changes (IMPL-, EXEC-, FIX-; see [`TaskKind`]).
    Executor,
    /// Checks results (VALIDATE-, REVIEW-, VERIFY-).
    Validator,
    /// Runs test suites (TESTRUN-, TEST-, QARUN-).
    TestRunner,
}

impl Role {
    /// Parses the plan spelling: `executor`, `validator` or `test-runner`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "executor" => Some(Self::Executor),
            "validator" => Some(Self::Validator),
            "test-runner" => Some(Self::TestRunner),
            _ => None,
        }
    }

    /// Returns the plan spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Executor => "executor",
            Self::Validator => "validator",
            Self::TestRunner => "test-runner",
        }
    }

    /// Returns the wire enum.
    pub fn to_proto(self) -> pb::Role {
        match self {
            Self::Executor => pb::Role::Executor,
            Self::Validator => pb::Role::Validator,
            Self::TestRunner => pb::Role::TestRunner,
        }
    }

    /// Converts from the wire enum; `None` for unspecified.
    pub fn from_proto(role: pb::Role) -> Option<Self> {
        match role {
            pb::Role::Executor => Some(Self::Executor),
            pb::Role::Validator => Some(Self::Validator),
            pb::Role::TestRunner => Some(Self::TestRunner),
            pb::Role::Unspecified => None,
        }
    }
}

impl From<Role> for pb::Role {
    fn from(role: Role) -> Self {
        role.to_proto()
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Scheduling priority; P0 runs first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Priority {
    /// Highest (`P0`, `critical`, `high`).
    P0,
    /// Default (`P1`, `medium`).
    #[default]
    P1,
    /// Lowest (`P2`, `low`).
    P2,
}

impl Priority {
    /// Parses `P0|P1|P2` or CCW's `critical|high|medium|low` (case-insensitive).
    ///
    /// CCW has four levels and the wire has three: `critical` and `high` both map to P0 so that
    /// anything a planner marked important runs before the default.
    pub fn parse(text: &str) -> Option<Self> {
        match text.to_ascii_lowercase().as_str() {
            "p0" | "critical" | "high" => Some(Self::P0),
            "p1" | "medium" => Some(Self::P1),
            "p2" | "low" => Some(Self::P2),
            _ => None,
        }
    }

    /// Returns `P0`, `P1` or `P2`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::P0 => "P0",
            Self::P1 => "P1",
            Self::P2 => "P2",
        }
    }

    /// Returns the wire enum.
    pub fn to_proto(self) -> pb::Priority {
        match self {
            Self::P0 => pb::Priority::P0,
            Self::P1 => pb::Priority::P1,
            Self::P2 => pb::Priority::P2,
        }
    }
}

/// How tasks are released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// A task is ready as soon as its own dependencies completed.
    #[default]
    Eager,
    /// CCW barrier semantics: additionally, every task of earlier waves must be terminal.
    Waves,
}

impl Mode {
    /// Parses `eager` or `waves`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "eager" => Some(Self::Eager),
            "waves" => Some(Self::Waves),
            _ => None,
        }
    }

    /// Returns `eager` or `waves`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Eager => "eager",
            Self::Waves => "waves",
        }
    }

    /// Returns the wire enum.
    pub fn to_proto(self) -> pb::SessionMode {
        match self {
            Self::Eager => pb::SessionMode::Eager,
            Self::Waves => pb::SessionMode::Waves,
        }
    }
}

/// What happens downstream of a task that failed for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnFailure {
    /// Dependents become `skipped` (terminal).
    #[default]
    Skip,
    /// Dependents become `blocked` (a resume may retry them).
    Block,
}

impl OnFailure {
    /// Parses `skip` or `block`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "skip" => Some(Self::Skip),
            "block" => Some(Self::Block),
            _ => None,
        }
    }

    /// Returns `skip` or `block`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Skip => "skip",
            Self::Block => "block",
        }
    }

    /// Returns the wire enum.
    pub fn to_proto(self) -> pb::OnFailure {
        match self {
            Self::Skip => pb::OnFailure::Skip,
            Self::Block => pb::OnFailure::Block,
        }
    }
}

/// What a task does to a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FileAction {
    /// The file must exist and be non-empty afterwards.
    Create,
    /// The file must be changed (the default when a plan names none).
    #[default]
    Modify,
    /// The file must be absent afterwards.
    Delete,
}

impl FileAction {
    /// Parses `create`, `modify` or `delete` (case-insensitive).
    pub fn parse(text: &str) -> Option<Self> {
        match text.to_ascii_lowercase().as_str() {
            "create" => Some(Self::Create),
            "modify" => Some(Self::Modify),
            "delete" => Some(Self::Delete),
            _ => None,
        }
    }

    /// Returns `create`, `modify` or `delete`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Modify => "modify",
            Self::Delete => "delete",
        }
    }

    /// Returns the wire enum.
    pub fn to_proto(self) -> pb::FileAction {
        match self {
            Self::Create => pb::FileAction::Create,
            Self::Modify => pb::FileAction::Modify,
            Self::Delete => pb::FileAction::Delete,
        }
    }

    /// Converts from the wire enum; `None` for unspecified.
    pub fn from_proto(action: pb::FileAction) -> Option<Self> {
        match action {
            pb::FileAction::Create => Some(Self::Create),
            pb::FileAction::Modify => Some(Self::Modify),
            pb::FileAction::Delete => Some(Self::Delete),
            pb::FileAction::Unspecified => None,
        }
    }
}

impl fmt::Display for FileAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A file a task touches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSpec {
    /// Path relative to the repository root (checked not to escape it).
    pub path: String,
    /// What the task does to it.
    pub action: FileAction,
    /// Free-text description of the change.
    pub change: String,
}

impl FileSpec {
    /// Returns the wire message.
    pub fn to_proto(&self) -> pb::FileChange {
        pb::FileChange {
            path: self.path.clone(),
            action: self.action.to_proto() as i32,
            change: self.change.clone(),
        }
    }
}

/// Where a plan repository comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RepoSource {
    /// An existing git repository on the coordinator's machine (a local remote), relative to
    /// the plan's base directory unless absolute.
    Path(String),
    /// A directory (relative to the base directory) copied into a fresh repository once.
    Template(String),
    /// A remote by URL (`file://`, `git://`, `ssh://`, `http://`, `https://`), without
    /// credentials: those belong to the coordinator's and workers' configuration.
    Url(String),
}

/// What tasks may do to a repository.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Access {
    /// Tasks change it (the default).
    #[default]
    Write,
    /// Context only: checked out beside other repositories' tasks; any change is refused.
    Read,
}

/// One repository of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoSpec {
    /// Name tasks use in their `repo` field.
    pub name: String,
    /// Where it comes from.
    pub source: RepoSource,
    /// The git revision (commit, branch, tag) the session branch starts at, for a `path` or
    /// `url` repository; `None` starts at the remote's HEAD. `troupe import` sets it to the
    /// commit an exported session's branch had reached.
    pub base: Option<String>,
    /// Whether tasks may change it.
    pub access: Access,
}

/// One validated task.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanTask {
    /// Unique id, such as `IMPL-001`.
    pub id: String,
    /// Short title.
    pub title: String,
    /// Goal and reason.
    pub description: String,
    /// Ids of the tasks that must complete first (deduplicated, in plan order).
    pub depends_on: Vec<String>,
    /// Worker kind (explicit `role`, else from the id prefix).
    pub role: Role,
    /// Scheduling priority.
    pub priority: Priority,
    /// Repository name (the plan's default repository when the task names none).
    pub repo: String,
    /// Files the task touches.
    pub files: Vec<FileSpec>,
    /// Paths the task focuses on.
    pub focus_paths: Vec<String>,
    /// Attempts allowed (task value, else plan value, else [`DEFAULT_MAX_ATTEMPTS`]).
    pub max_attempts: u32,
    /// Wall-clock limit the plan sets for one attempt, if any.
    pub timeout_seconds: Option<u32>,
    /// What the plan expects one attempt to take, in milliseconds (`estimate_seconds`, else
    /// CCW's `effort`), if it says.
    pub estimate_ms: Option<u64>,
    /// 1-based wave: 1 for tasks without dependencies, else 1 + the deepest dependency's wave.
    pub wave: u32,
    /// Number of tasks on the longest dependency chain from this task to a task nothing
    /// depends on, this task included (1 for a sink).
    pub critical_path: u32,
    /// Expected milliseconds of the longest dependency chain from this task to a task nothing
    /// depends on, this task included: the scheduler's rank ("bottom level"). Tasks without an
    /// estimate weigh what their role took lately when known ([`Plan::weigh_by_role`]), else
    /// the mean of the plan's estimates, else [`DEFAULT_ESTIMATE_MS`].
    pub path_ms: u64,
    /// Index of the task in the plan's `tasks` array.
    pub plan_index: usize,
    /// The typed blocks (`agent`, `convergence`, `test`, `judge`, ...).
    pub blocks: TaskBlocks,
    /// The task object exactly as written in the plan.
    pub spec: Map<String, Value>,
}

/// A validated plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Plan name (`[a-z0-9-]+`).
    pub name: String,
    /// Free-text description.
    pub description: String,
    /// Scheduling mode.
    pub mode: Mode,
    /// Downstream failure policy.
    pub on_failure: OnFailure,
    /// Plan-wide default attempts per task.
    pub max_attempts: u32,
    /// Repositories in document order; the first is the default.
    pub repos: Vec<RepoSpec>,
    /// Tasks in topological order (by wave, then plan order).
    pub tasks: Vec<PlanTask>,
    /// `sandbox`: the plan's confinement for its tasks (copied into each task that sets none;
    /// workers apply the stricter of a task's and their own).
    pub sandbox: Option<spec::SandboxMode>,
    /// `checkpoints`: the roles' stages a person approves (see [`checkpoint`]).
    pub checkpoints: Vec<checkpoint::Checkpoint>,
}

impl Plan {
    /// Parses and validates a JSON plan, reporting every problem found.
    pub fn from_json(text: &str) -> Result<Self, PlanError> {
        validate::parse(text)
    }

    /// Weighs the tasks that give no estimate by what tasks of their role took lately, in
    /// milliseconds, where `learned` knows (the coordinator learns it from finished tasks),
    /// and recomputes every task's `path_ms`. Roles it does not know weigh as before.
    pub fn weigh_by_role(&mut self, learned: &HashMap<Role, u64>) {
        validate::weigh(&mut self.tasks, learned);
    }

    /// Returns the default repository (the first declared).
    pub fn default_repo(&self) -> &RepoSpec {
        // A validated plan always has at least one repository (an implicit one when the
        // document declares none).
        &self.repos[0]
    }

    /// Returns a repository by name.
    pub fn repo(&self, name: &str) -> Option<&RepoSpec> {
        self.repos.iter().find(|repo| repo.name == name)
    }

    /// Returns a task by id.
    pub fn task(&self, id: &str) -> Option<&PlanTask> {
        self.tasks.iter().find(|task| task.id == id)
    }

    /// Returns the tasks in topological order (dependencies before dependents).
    pub fn topological_order(&self) -> &[PlanTask] {
        &self.tasks
    }

    /// Returns the 1-based wave of every task, by id.
    pub fn waves(&self) -> HashMap<&str, u32> {
        self.tasks
            .iter()
            .map(|task| (task.id.as_str(), task.wave))
            .collect()
    }

    /// Returns the ids of each wave; index 0 holds wave 1.
    pub fn wave_groups(&self) -> Vec<Vec<&str>> {
        let count = self.tasks.iter().map(|task| task.wave).max().unwrap_or(0) as usize;
        let mut groups = vec![Vec::new(); count];
        for task in &self.tasks {
            groups[task.wave as usize - 1].push(task.id.as_str());
        }
        groups
    }

    /// Returns the longest remaining critical path of every task, by id.
    pub fn critical_paths(&self) -> HashMap<&str, u32> {
        self.tasks
            .iter()
            .map(|task| (task.id.as_str(), task.critical_path))
            .collect()
    }
}

#[cfg(test)]
mod tests;
