//! The typed blocks of a task: `agent`, `convergence`, `test`, `judge`, `gap_closure`,
//! `pre_analysis` and the scope settings. Each is read once, by the same rules at intake and
//! in the worker, and every problem names its task and field path (`task IMPL-1:
//! `agent.env.K` must be a string, got 1`).

mod agent;
mod convergence;
pub(crate) mod fields;
mod judge;
mod loops;
mod pre_analysis;
mod test;

use serde_json::{Map, Value};

pub use agent::{AgentSpec, COMMAND_BACKEND};
pub use convergence::Convergence;
pub use judge::{JUDGE_PLAN_SETTINGS, JudgeSpec};
pub use loops::{LoopConfig, MAX_LOOP_ROUNDS};
pub use pre_analysis::{OnError, PreAnalysisStep};
pub use test::{
    FixScope, FixSpec, MAX_FIX_ITERATIONS, TEST_ENV_ALLOWED, TEST_ENV_ALLOWED_PREFIXES,
    TestFramework, TestSpec, test_env_allowed,
};

use crate::Role;
use crate::validate::Problems;
use fields::At;

/// A plan's `sandbox` (plan-level or per task): how strictly the task's children are
/// confined. It can only tighten the worker's own setting (the strictest of the two applies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxMode {
    /// Confined; refuse to run where the kernel cannot confine.
    Enforce,
    /// Confined where the kernel can.
    Warn,
    /// No wish: the worker's setting applies.
    Off,
}

impl SandboxMode {
    /// Parses `enforce`, `warn` or `off`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "enforce" => Some(Self::Enforce),
            "warn" => Some(Self::Warn),
            "off" => Some(Self::Off),
            _ => None,
        }
    }

    /// The plan spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Enforce => "enforce",
            Self::Warn => "warn",
            Self::Off => "off",
        }
    }
}

/// The `sandbox` a task object carries (a plan-level one is copied into each task that sets
/// none at intake), for workers; a value intake would refuse reads as none.
pub fn sandbox_of(object: &Map<String, Value>) -> Option<SandboxMode> {
    object
        .get("sandbox")
        .and_then(Value::as_str)
        .and_then(SandboxMode::parse)
}

/// Checks a `sandbox` field (plan-level or a task's) at `owner`.
pub(crate) fn parse_sandbox(
    value: Option<&Value>,
    owner: &str,
    problems: &mut Problems,
) -> Option<SandboxMode> {
    let value = fields::present(value)?;
    let parsed = value.as_str().and_then(SandboxMode::parse);
    if parsed.is_none() {
        At::new(owner, "sandbox").invalid(
            problems,
            format_args!("must be \"enforce\", \"warn\" or \"off\", got {value}"),
        );
    }
    parsed
}

/// What to do with changes outside a task's `files[]`, `focus_paths` and `scope`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScopePolicy {
    /// Report them as warnings (the default).
    #[default]
    Warn,
    /// Fail the attempt.
    Refuse,
}

/// A task's typed blocks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TaskBlocks {
    /// `agent`: who does an executor task's work.
    pub agent: Option<AgentSpec>,
    /// `convergence` (empty when absent).
    pub convergence: Convergence,
    /// `test`: how a test-runner task runs the suite.
    pub test: Option<TestSpec>,
    /// `judge`: who reads a validator task's free-text criteria.
    pub judge: Option<JudgeSpec>,
    /// `gap_closure`: a validator task's fix loop.
    pub gap_closure: Option<crate::spec::LoopConfig>,
    /// `pre_analysis[]` steps.
    pub pre_analysis: Vec<PreAnalysisStep>,
    /// `scope_policy`, or CCW's `scope` when it names a policy.
    pub scope_policy: ScopePolicy,
    /// CCW's `scope` when it names paths.
    pub scope_paths: Vec<String>,
    /// `excludes`: paths the task must not change.
    pub excludes: Vec<String>,
    /// `allow_empty`: whether a run that changes nothing completes.
    pub allow_empty: bool,
    /// `sandbox`: the plan's confinement for the task (the plan-level one when the task sets
    /// none); workers apply the stricter of it and their own.
    pub sandbox: Option<SandboxMode>,
}

pub(crate) fn parse(
    object: &Map<String, Value>,
    owner: &str,
    role: Option<Role>,
    problems: &mut Problems,
) -> TaskBlocks {
    let at = |field: &str| At::new(owner, field);
    let agent = fields::present(object.get("agent"))
        .and_then(|value| agent::parse(value, &at("agent"), None, problems));
    let convergence = fields::present(object.get("convergence"))
        .map(|value| convergence::parse(value, &at("convergence"), problems))
        .unwrap_or_default();
    let test = fields::present(object.get("test"))
        .map(|value| test::parse(value, &at("test"), owner, role, problems));
    let judge = fields::present(object.get("judge"))
        .and_then(|value| judge::parse(value, &at("judge"), problems));
    let gap_closure = fields::present(object.get("gap_closure")).and_then(|value| {
        loops::parse(
            value,
            &at("gap_closure"),
            owner,
            role,
            Role::Validator,
            problems,
        )
    });
    let pre_analysis = fields::present(object.get("pre_analysis"))
        .map(|value| pre_analysis::parse(value, &at("pre_analysis"), problems))
        .unwrap_or_default();
    let policy = |value: &Value, field: &str, problems: &mut Problems| match value.as_str() {
        Some("warn") => ScopePolicy::Warn,
        Some("refuse") => ScopePolicy::Refuse,
        _ => {
            at(field).invalid(
                problems,
                format_args!("must be \"warn\" or \"refuse\", got {value}"),
            );
            ScopePolicy::Warn
        }
    };
    let scope = fields::present(object.get("scope"));
    let (scope_policy, scope_paths) = match (fields::present(object.get("scope_policy")), scope) {
        (None, Some(Value::String(text))) if text == "warn" || text == "refuse" => (
            policy(scope.unwrap_or(&Value::Null), "scope", problems),
            Vec::new(),
        ),
        (given, scope) => {
            let policy = given.map_or(ScopePolicy::Warn, |value| {
                policy(value, "scope_policy", problems)
            });
            let paths = match scope {
                Some(Value::String(path)) => vec![path.clone()],
                other => fields::strings(other, &at("scope"), problems),
            };
            (policy, paths)
        }
    };
    TaskBlocks {
        agent,
        convergence,
        test,
        judge,
        gap_closure,
        pre_analysis,
        scope_policy,
        scope_paths,
        excludes: fields::strings(object.get("excludes"), &at("excludes"), problems),
        allow_empty: fields::boolean(object.get("allow_empty"), &at("allow_empty"), problems)
            .unwrap_or(false),
        sandbox: parse_sandbox(object.get("sandbox"), owner, problems),
    }
}

#[cfg(test)]
mod tests;
