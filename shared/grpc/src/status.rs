//! The one mapping of failures to `Status` that every service shares.
//!
//! An internal failure (a bug, a broken disk, git misbehaving) is logged in full with a
//! correlation id, and the client gets a plain "internal error" naming that id: internal
//! error text (paths, SQL, git's stderr) stays in the service's log. Git's own failures map
//! by what they mean to the caller, the same in every service.

use std::fmt::Display;

use tonic::Status;

/// An `INTERNAL` status that hides `error` from the client: the log has it under the id the
/// message names.
pub fn internal(error: &dyn Display) -> Status {
    let id = correlation_id();
    tracing::error!(correlation_id = %id, error = %error, "internal error");
    Status::internal(format!(
        "internal error (correlation id {id}: the service's log has the details)"
    ))
}

/// The status for a git failure: the caller's mistake, a missing revision, an unreachable or
/// refusing remote, or (anything else) an internal error.
pub fn workspace(error: &troupe_workspace::Error) -> Status {
    use troupe_workspace::Error as E;
    let message = error.to_string();
    match error {
        E::NotARepo { .. }
        | E::InvalidRemote { .. }
        | E::InvalidBranchName { .. }
        | E::Credentials { .. } => Status::invalid_argument(message),
        E::UnknownRevision { .. } | E::BranchMissing { .. } => Status::not_found(message),
        E::Unreachable { .. } => Status::unavailable(message),
        E::PushRejected { .. } | E::BranchExists { .. } | E::Conflict { .. } => {
            Status::failed_precondition(message)
        }
        E::Contended { .. } | E::Superseded { .. } | E::LeaseExpired { .. } => {
            Status::aborted(message)
        }
        _ => internal(error),
    }
}

/// Twelve hex digits: enough to find one line in a day of logs.
fn correlation_id() -> String {
    format!("{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_errors_keep_their_text_out_of_the_status() {
        let status = internal(&"open /var/lib/troupe/store.db: disk I/O error");
        assert_eq!(status.code(), tonic::Code::Internal);
        assert!(
            !status.message().contains("store.db"),
            "{}",
            status.message()
        );
        let id = status
            .message()
            .split("correlation id ")
            .nth(1)
            .and_then(|rest| rest.split(':').next())
            .expect("an id");
        assert_eq!(id.len(), 12);
        assert!(id.chars().all(|c| c.is_ascii_hexdigit()));
    }

    #[test]
    fn git_failures_map_by_meaning() {
        let unreachable = troupe_workspace::Error::Unreachable {
            remote: "git://example/x".into(),
            detail: "connection refused".into(),
        };
        assert_eq!(workspace(&unreachable).code(), tonic::Code::Unavailable);
        let missing = troupe_workspace::Error::UnknownRevision { rev: "nope".into() };
        assert_eq!(workspace(&missing).code(), tonic::Code::NotFound);
        let git = troupe_workspace::Error::Git {
            command: "git merge".into(),
            code: Some(128),
            stderr: "fatal: secret detail".into(),
        };
        let status = workspace(&git);
        assert_eq!(status.code(), tonic::Code::Internal);
        assert!(!status.message().contains("secret detail"));
    }
}
