//! Display names of the wire's enums: lowercase, without the type prefix
//! (`TASK_STATE_TIMED_OUT` → `timed_out`). The one spelling logs, messages, events, reports,
//! summaries and exports use, the same as the enum's JSON name (grpcurl) once its prefix is
//! dropped; [`parse`] reads it back.

use crate::v1::{
    CheckKind, CheckStatus, ConvergenceMet, ErrorKind, FixScope, FixStrategy, FixVerdict, GapType,
    GraphStatus, OnFailure, ReviewDimension, ReviewVerdict, Role, SessionMode, SessionState,
    Severity, TaskState, TestFramework, TestOutcome, Verdict, VerificationStatus,
};

/// An enum of the wire with a display name.
pub trait Named: Sized + Copy + 'static {
    /// The wire name's prefix (`TASK_STATE_`).
    const PREFIX: &'static str;
    /// Every value, `UNSPECIFIED` first.
    const ALL: &'static [Self];
    /// The wire name (`TASK_STATE_TIMED_OUT`).
    fn wire_name(self) -> &'static str;
}

macro_rules! named {
    ($($ty:ident => $prefix:literal [$($value:ident),+ $(,)?]),+ $(,)?) => {
        $(impl Named for $ty {
            const PREFIX: &'static str = $prefix;
            const ALL: &'static [Self] = &[$($ty::$value),+];
            fn wire_name(self) -> &'static str {
                self.as_str_name()
            }
        })+
    };
}

named! {
    TaskState => "TASK_STATE_" [Unspecified, Pending, Ready, Running, Completed, Failed, Skipped, Cancelled, TimedOut, Blocked, WaitingApproval],
    SessionState => "SESSION_STATE_" [Unspecified, Active, Completed, Failed, Cancelled, Paused],
    ConvergenceMet => "CONVERGENCE_MET_" [Unspecified, Pass, Fail, Pending],
    VerificationStatus => "VERIFICATION_STATUS_" [Unspecified, Passed, GapsFound],
    GapType => "GAP_TYPE_" [Unspecified, Criterion, File, VerificationCommand],
    FixStrategy => "FIX_STRATEGY_" [Unspecified, Conservative, Surgical, Aggressive],
    FixVerdict => "FIX_VERDICT_" [Unspecified, Kept, RevertedWorse, RevertedOutOfScope, NoChange, AgentFailed],
    ErrorKind => "ERROR_KIND_" [Unspecified, NotInstalled, Auth, RateLimited, Quota, Timeout, Crash, BadOutput, CheckFailed, MergeConflict, InvalidTask, Internal, OutOfScope, Superseded, Repository, SandboxDenied, PermissionDenied, Rejected],
    Severity => "SEVERITY_" [Unspecified, Low, Medium, High, Critical],
    SessionMode => "SESSION_MODE_" [Unspecified, Eager, Waves],
    OnFailure => "ON_FAILURE_" [Unspecified, Skip, Block],
    GraphStatus => "GRAPH_STATUS_" [Unspecified, Done, Running, Ready, Pending, Blocked, Failed, TimedOut, Skipped, Cancelled, WaitingApproval],
    TestOutcome => "TEST_OUTCOME_" [Unspecified, Passed, TestsFailed, LoadError, CollectionError, NoTests, Timeout, CoverageBelowTarget, RunnerCrashed, WrongSource, InstallFailed, SetupFailed, CoverageThreshold, SandboxDenied],
    TestFramework => "TEST_FRAMEWORK_" [Unspecified, Pytest, Jest, Vitest],
    CheckStatus => "CHECK_STATUS_" [Unspecified, Pass, Fail, ManualReview, Skipped, Error],
    Verdict => "VERDICT_" [Unspecified, Pass, Fail, ManualReview],
    ReviewVerdict => "REVIEW_VERDICT_" [Unspecified, Approve, Conditional, Block],
    FixScope => "FIX_SCOPE_" [Unspecified, Tests, Source, Both],
    Role => "ROLE_" [Unspecified, Executor, Validator, TestRunner],
    CheckKind => "CHECK_KIND_" [Unspecified, File, Syntax, Lint, Verification, Criterion],
    ReviewDimension => "REVIEW_DIMENSION_" [Unspecified, Quality, Security, Architecture, Requirements],
}

/// The display name of any named enum value (`timed_out`, `gaps_found`, `pass`).
pub fn name<T: Named>(value: T) -> &'static str {
    // Computed once per value: the wire name, prefix dropped, lowercased.
    static CACHE: std::sync::OnceLock<
        std::sync::Mutex<std::collections::HashMap<&'static str, &'static str>>,
    > = std::sync::OnceLock::new();
    let wire = value.wire_name();
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    cache.entry(wire).or_insert_with(|| {
        Box::leak(
            wire.trim_start_matches(T::PREFIX)
                .to_ascii_lowercase()
                .into_boxed_str(),
        )
    })
}

/// The value whose display name is `text` (case-insensitive; `-` and ` ` read as `_`), if any.
pub fn parse<T: Named>(text: &str) -> Option<T> {
    let wanted = text.trim().to_ascii_lowercase().replace(['-', ' '], "_");
    T::ALL.iter().copied().find(|value| name(*value) == wanted)
}

/// The display name of a task state.
pub fn task_state(state: TaskState) -> &'static str {
    name(state)
}

/// The display name of a session state.
pub fn session_state(state: SessionState) -> &'static str {
    name(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trips<T: Named + PartialEq + std::fmt::Debug + TryFrom<i32>>() {
        // Every value of the wire enum is listed, so `parse` knows it too.
        for number in 0..64 {
            if let Ok(value) = T::try_from(number) {
                assert!(
                    T::ALL.contains(&value),
                    "{value:?} missing from {}",
                    T::PREFIX
                );
            }
        }
        for value in T::ALL {
            let shown = name(*value);
            assert_eq!(
                shown,
                value
                    .wire_name()
                    .trim_start_matches(T::PREFIX)
                    .to_ascii_lowercase()
            );
            assert_eq!(parse::<T>(shown), Some(*value), "{shown}");
        }
    }

    #[test]
    fn names_are_the_wire_names_without_their_prefix() {
        round_trips::<TaskState>();
        round_trips::<SessionState>();
        round_trips::<ConvergenceMet>();
        round_trips::<VerificationStatus>();
        round_trips::<GapType>();
        round_trips::<FixStrategy>();
        round_trips::<FixVerdict>();
        round_trips::<ErrorKind>();
        round_trips::<Severity>();
        round_trips::<SessionMode>();
        round_trips::<OnFailure>();
        round_trips::<GraphStatus>();
        round_trips::<TestOutcome>();
        round_trips::<TestFramework>();
        round_trips::<CheckStatus>();
        round_trips::<Verdict>();
        round_trips::<ReviewVerdict>();
        round_trips::<FixScope>();
        round_trips::<Role>();
        round_trips::<CheckKind>();
        round_trips::<ReviewDimension>();
        assert_eq!(task_state(TaskState::TimedOut), "timed_out");
        assert_eq!(parse::<TaskState>("timed out"), Some(TaskState::TimedOut));
        assert_eq!(parse::<TaskState>("Timed-Out"), Some(TaskState::TimedOut));
        assert_eq!(parse::<ConvergenceMet>("maybe"), None);
    }
}
