//! Display names of the wire's state enums: lowercase, without the type prefix
//! (`TASK_STATE_TIMED_OUT` → `timed_out`). The one spelling logs, messages, events, reports
//! and exports use, the same as the enum's JSON name (grpcurl) once its prefix is dropped.

use crate::v1::{SessionState, TaskState};

/// The display name of a task state.
pub fn task_state(state: TaskState) -> &'static str {
    match state {
        TaskState::Unspecified => "unspecified",
        TaskState::Pending => "pending",
        TaskState::Ready => "ready",
        TaskState::Running => "running",
        TaskState::Completed => "completed",
        TaskState::Failed => "failed",
        TaskState::Skipped => "skipped",
        TaskState::Cancelled => "cancelled",
        TaskState::TimedOut => "timed_out",
        TaskState::Blocked => "blocked",
        TaskState::WaitingApproval => "waiting_approval",
    }
}

/// The display name of a session state.
pub fn session_state(state: SessionState) -> &'static str {
    match state {
        SessionState::Unspecified => "unspecified",
        SessionState::Active => "active",
        SessionState::Completed => "completed",
        SessionState::Failed => "failed",
        SessionState::Cancelled => "cancelled",
        SessionState::Paused => "paused",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_wire_names_without_their_prefix() {
        for state in [
            TaskState::Unspecified,
            TaskState::Pending,
            TaskState::Ready,
            TaskState::Running,
            TaskState::Completed,
            TaskState::Failed,
            TaskState::Skipped,
            TaskState::Cancelled,
            TaskState::TimedOut,
            TaskState::Blocked,
        ] {
            let wire = state.as_str_name().trim_start_matches("TASK_STATE_");
            assert_eq!(task_state(state), wire.to_ascii_lowercase());
        }
        for state in [
            SessionState::Unspecified,
            SessionState::Active,
            SessionState::Completed,
            SessionState::Failed,
            SessionState::Cancelled,
            SessionState::Paused,
        ] {
            let wire = state.as_str_name().trim_start_matches("SESSION_STATE_");
            assert_eq!(session_state(state), wire.to_ascii_lowercase());
        }
    }
}
