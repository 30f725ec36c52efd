//! What a task is, from its id prefix: the one place that maps prefixes to kinds and roles.

use std::fmt;

use crate::Role;

/// The kind of a task, named by its id prefix (the part before the first `-`,
/// case-insensitive).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaskKind {
    /// `IMPL-`: implement a change (executor).
    Impl,
    /// `EXEC-`: run a CCW phase's task files in waves (executor).
    Exec,
    /// `FIX-`: fix what a check found (executor).
    Fix,
    /// `VALIDATE-`: check a change against its criteria (validator).
    Validate,
    /// `REVIEW-`: review a change (validator).
    Review,
    /// `VERIFY-`: verify a phase's goals (validator).
    Verify,
    /// `TESTRUN-` (and CCW's `TEST-`): run a test suite (test-runner).
    TestRun,
    /// `QARUN-`: CCW's quality run (test-runner).
    QaRun,
}

impl TaskKind {
    /// Every kind, in role order.
    pub const ALL: [Self; 8] = [
        Self::Impl,
        Self::Exec,
        Self::Fix,
        Self::Validate,
        Self::Review,
        Self::Verify,
        Self::TestRun,
        Self::QaRun,
    ];

    /// The kind an id prefix names (`IMPL`, `test`, ...), if any.
    pub fn from_prefix(prefix: &str) -> Option<Self> {
        match prefix.to_ascii_uppercase().as_str() {
            "IMPL" => Some(Self::Impl),
            "EXEC" => Some(Self::Exec),
            "FIX" => Some(Self::Fix),
            "VALIDATE" => Some(Self::Validate),
            "REVIEW" => Some(Self::Review),
            "VERIFY" => Some(Self::Verify),
            // CCW's team-testing names its runs TEST-.
            "TESTRUN" | "TEST" => Some(Self::TestRun),
            "QARUN" => Some(Self::QaRun),
            _ => None,
        }
    }

    /// The kind a task id's prefix names, if any.
    pub fn from_id(id: &str) -> Option<Self> {
        Self::from_prefix(id_prefix(id))
    }

    /// The kind of a task of `role`: what its id prefix names when that fits the role, else
    /// the role's plain kind (a `DOC-1` task with `role: executor` is an [`TaskKind::Impl`]).
    pub fn of(id: &str, role: Role) -> Self {
        Self::from_id(id)
            .filter(|kind| kind.role() == role)
            .unwrap_or(match role {
                Role::Executor => Self::Impl,
                Role::Validator => Self::Validate,
                Role::TestRunner => Self::TestRun,
            })
    }

    /// The worker role that handles it.
    pub fn role(self) -> Role {
        match self {
            Self::Impl | Self::Exec | Self::Fix => Role::Executor,
            Self::Validate | Self::Review | Self::Verify => Role::Validator,
            Self::TestRun | Self::QaRun => Role::TestRunner,
        }
    }

    /// The canonical id prefix, without the `-`.
    pub fn prefix(self) -> &'static str {
        match self {
            Self::Impl => "IMPL",
            Self::Exec => "EXEC",
            Self::Fix => "FIX",
            Self::Validate => "VALIDATE",
            Self::Review => "REVIEW",
            Self::Verify => "VERIFY",
            Self::TestRun => "TESTRUN",
            Self::QaRun => "QARUN",
        }
    }
}

impl fmt::Display for TaskKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.prefix())
    }
}

/// The id prefix: the part before the first `-`.
pub fn id_prefix(id: &str) -> &str {
    id.split('-').next().unwrap_or_default()
}
