//! The `test` block of a test-runner task: framework, limits, environment, setup and the fix
//! loop.

use std::collections::BTreeMap;

use serde_json::Value;

use super::agent::{self, AgentSpec};
use super::fields::{self, At, Line};
use super::loops::{self, LoopConfig};
use crate::Role;
use crate::validate::{Problems, escapes_root};

/// Names a run's `test.env` may set. Everything else is refused: the suite must not get a way
/// to rewrite how troupe runs it (PATH, PYTHONPATH, NODE_PATH, HOME) or to leak credentials.
pub const TEST_ENV_ALLOWED: &[&str] = &[
    "TZ",
    "LANG",
    "LANGUAGE",
    "NODE_OPTIONS",
    "NODE_ENV",
    "CI",
    "PYTHONHASHSEED",
    "PYTHONWARNINGS",
    "PYTHONUTF8",
    "PYTEST_ADDOPTS",
    "DEBUG",
    "FORCE_COLOR",
    "NO_COLOR",
    "COLUMNS",
];
/// Prefixes a run's `test.env` may set.
pub const TEST_ENV_ALLOWED_PREFIXES: &[&str] = &["LC_", "JEST_", "VITEST_", "TEST_", "APP_"];

/// Whether `test.env` may set `name`.
pub fn test_env_allowed(name: &str) -> bool {
    TEST_ENV_ALLOWED.contains(&name)
        || TEST_ENV_ALLOWED_PREFIXES
            .iter()
            .any(|prefix| name.starts_with(prefix))
}

/// Most iterations a fix loop may ask for.
pub const MAX_FIX_ITERATIONS: u64 = 20;

/// The suite's framework.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TestFramework {
    /// Detected from the project (`auto`, empty or absent).
    #[default]
    Auto,
    /// pytest.
    Pytest,
    /// Jest.
    Jest,
    /// Vitest.
    Vitest,
}

/// Files a fix loop's agent may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FixScope {
    /// Test files only (the default).
    #[default]
    Tests,
    /// Source files only.
    Source,
    /// Both.
    Both,
}

/// `test.fix`: the test-fix loop run on a failing suite.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FixSpec {
    /// The fixing agent (its backend defaults to `command`).
    pub agent: AgentSpec,
    /// Iteration limit, if the plan sets one.
    pub max_iterations: Option<u32>,
    /// Files the agent may change.
    pub scope: FixScope,
}

/// A test-runner task's `test` object.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TestSpec {
    /// The framework.
    pub framework: TestFramework,
    /// Coverage target in percent (0 to 100), if set.
    pub coverage_target: Option<f64>,
    /// Whether to install the project's dependencies (default yes).
    pub install: Option<bool>,
    /// What coverage measures (a package or directory), if set.
    pub coverage_source: Option<String>,
    /// Limit of the whole run, in whole seconds.
    pub timeout_seconds: Option<u32>,
    /// Limit of one test, in whole seconds; 0 turns it off.
    pub test_timeout_seconds: Option<u32>,
    /// CCW layer name for the bus records.
    pub layer: Option<String>,
    /// The fix loop.
    pub fix: Option<FixSpec>,
    /// Allow-listed variables for the suite ([`test_env_allowed`]); numbers and booleans are
    /// written as text.
    pub env: BTreeMap<String, String>,
    /// Commands run in the worktree before the suite, each an argv.
    pub setup: Vec<Vec<String>>,
    /// Directory of the project inside the repository.
    pub workdir: Option<String>,
    /// Python interpreter to use.
    pub python: Option<String>,
    /// `test.gc`: the generator-critic loop when the run fails for good.
    pub gc: Option<LoopConfig>,
}

pub(crate) fn parse(
    value: &Value,
    at: &At<'_>,
    owner: &str,
    role: Option<Role>,
    problems: &mut Problems,
) -> TestSpec {
    let Some(test) = fields::object(Some(value), at, problems) else {
        return TestSpec::default();
    };
    let framework =
        match fields::string(test.get("framework"), &at.field("framework"), problems).as_deref() {
            None | Some("" | "auto") => TestFramework::Auto,
            Some("pytest") => TestFramework::Pytest,
            Some("jest") => TestFramework::Jest,
            Some("vitest") => TestFramework::Vitest,
            Some(other) => {
                at.field("framework").invalid(
                    problems,
                    format_args!("`{other}` is not one of auto, pytest, jest, vitest"),
                );
                TestFramework::Auto
            }
        };
    let coverage_target =
        fields::present(test.get("coverage_target")).and_then(|value| match value.as_f64() {
            Some(target) if (0.0..=100.0).contains(&target) => Some(target),
            _ => {
                at.field("coverage_target").invalid(
                    problems,
                    format_args!("must be a number from 0 to 100, got {value}"),
                );
                None
            }
        });
    let seconds = |key: &str, low: u64, problems: &mut Problems| {
        fields::whole(
            test.get(key),
            low..=u64::from(u32::MAX),
            &at.field(key),
            problems,
        )
        .and_then(|secs| u32::try_from(secs).ok())
    };
    let timeout_seconds = seconds("timeout_seconds", 1, problems);
    let test_timeout_seconds = seconds("test_timeout_seconds", 0, problems);
    let env = env(test.get("env"), &at.field("env"), problems);
    let setup = setup(test.get("setup"), &at.field("setup"), problems);
    let workdir = fields::string(test.get("workdir"), &at.field("workdir"), problems);
    if let Some(dir) = &workdir
        && escapes_root(dir)
    {
        at.field("workdir").invalid(
            problems,
            format_args!("`{dir}` must be a path inside the repository"),
        );
    }
    let fix =
        fields::present(test.get("fix")).and_then(|value| fix(value, &at.field("fix"), problems));
    let gc = fields::present(test.get("gc")).and_then(|value| {
        loops::parse(
            value,
            &at.field("gc"),
            owner,
            role,
            Role::TestRunner,
            problems,
        )
    });
    TestSpec {
        framework,
        coverage_target,
        install: fields::boolean(test.get("install"), &at.field("install"), problems),
        coverage_source: fields::string(
            test.get("coverage_source"),
            &at.field("coverage_source"),
            problems,
        ),
        timeout_seconds,
        test_timeout_seconds,
        layer: fields::string(test.get("layer"), &at.field("layer"), problems),
        fix,
        env,
        setup,
        workdir,
        python: fields::string(test.get("python"), &at.field("python"), problems),
        gc,
    }
}

fn env(value: Option<&Value>, at: &At<'_>, problems: &mut Problems) -> BTreeMap<String, String> {
    let Some(vars) = fields::object(value, at, problems) else {
        return BTreeMap::new();
    };
    let mut out = BTreeMap::new();
    for (name, value) in vars {
        let text = match value {
            Value::String(text) => text.clone(),
            Value::Number(number) => number.to_string(),
            Value::Bool(flag) => flag.to_string(),
            other => {
                at.field(name).invalid(
                    problems,
                    format_args!("must be a string, got {}", fields::kind_of(other)),
                );
                continue;
            }
        };
        if !test_env_allowed(name) {
            at.field(name).invalid(
                problems,
                format_args!(
                    "is not a variable a suite may get (allowed: {}, and names starting with {})",
                    TEST_ENV_ALLOWED.join(", "),
                    TEST_ENV_ALLOWED_PREFIXES.join(", ")
                ),
            );
            continue;
        }
        out.insert(name.clone(), text);
    }
    out
}

fn setup(value: Option<&Value>, at: &At<'_>, problems: &mut Problems) -> Vec<Vec<String>> {
    let items = match fields::present(value) {
        None => return Vec::new(),
        Some(Value::Array(items)) => items,
        Some(other) => {
            at.invalid(
                problems,
                format_args!("must be a list of argv arrays, got {other}"),
            );
            return Vec::new();
        }
    };
    items
        .iter()
        .enumerate()
        .filter_map(|(position, item)| {
            fields::argv(Some(item), Line::Refused, &at.index(position), problems)
        })
        .collect()
}

fn fix(value: &Value, at: &At<'_>, problems: &mut Problems) -> Option<FixSpec> {
    let fix = fields::object(Some(value), at, problems)?;
    let agent = match fields::present(fix.get("agent")) {
        Some(value) => agent::parse(
            value,
            &at.field("agent"),
            Some(agent::COMMAND_BACKEND),
            problems,
        ),
        None => {
            at.field("agent")
                .invalid(problems, "is missing: the fix loop needs an agent object");
            None
        }
    };
    let max_iterations = fields::whole(
        fix.get("max_iterations"),
        1..=MAX_FIX_ITERATIONS,
        &at.field("max_iterations"),
        problems,
    )
    .and_then(|count| u32::try_from(count).ok());
    let scope = match fields::string(fix.get("scope"), &at.field("scope"), problems).as_deref() {
        None | Some("tests") => FixScope::Tests,
        Some("source") => FixScope::Source,
        Some("both") => FixScope::Both,
        Some(other) => {
            at.field("scope").invalid(
                problems,
                format_args!("`{other}` is not one of tests, source, both"),
            );
            FixScope::Tests
        }
    };
    Some(FixSpec {
        agent: agent?,
        max_iterations,
        scope,
    })
}
