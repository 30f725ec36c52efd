//! `test.gc` (a test-runner task) and `gap_closure` (a validator task): the loop that, when
//! the check fails for good, adds a FIX task for an executor agent and a re-run of the check.

use serde_json::Value;

use super::agent::{self, AgentSpec};
use super::fields::{self, At};
use crate::task::files;
use crate::validate::Problems;
use crate::{FileSpec, Role};

/// Most rounds a loop may ask for.
pub const MAX_LOOP_ROUNDS: u64 = 100;

/// A fix loop's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopConfig {
    /// The agent of each FIX task (an executor agent).
    pub agent: AgentSpec,
    /// Round limit, if the plan sets one.
    pub max_rounds: Option<u32>,
    /// Paths each FIX task focuses on.
    pub focus_paths: Vec<String>,
    /// Files each FIX task touches.
    pub files: Vec<FileSpec>,
}

pub(crate) fn parse(
    value: &Value,
    at: &At<'_>,
    owner: &str,
    role: Option<Role>,
    wanted: Role,
    problems: &mut Problems,
) -> Option<LoopConfig> {
    if role.is_some_and(|role| role != wanted) {
        at.invalid(problems, format_args!("needs a {wanted} task"));
    }
    let config = fields::object(Some(value), at, problems)?;
    let agent = match fields::present(config.get("agent")) {
        Some(value) => agent::parse(value, &at.field("agent"), None, problems),
        None => {
            at.field("agent").invalid(
                problems,
                "is missing: it must be an executor agent object, such as {\"backend\": \"command\", \"command\": [...]}",
            );
            None
        }
    };
    let max_rounds = fields::whole(
        config.get("max_rounds"),
        1..=MAX_LOOP_ROUNDS,
        &at.field("max_rounds"),
        problems,
    )
    .and_then(|rounds| u32::try_from(rounds).ok());
    let focus_paths = fields::strings(
        config.get("focus_paths"),
        &at.field("focus_paths"),
        problems,
    );
    let files = files(config, &format!("{owner}: {}", at.path()), problems);
    Some(LoopConfig {
        agent: agent?,
        max_rounds,
        focus_paths,
        files,
    })
}
