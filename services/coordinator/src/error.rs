//! The crate's one error type; `grpc.rs` maps it to a `tonic::Status` once.

/// How many of a refused plan's problems the refusal lists in full.
pub(crate) const PROBLEMS_LISTED: usize = 20;

/// Errors of the coordinator.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The plan has problems; the message lists the first [`PROBLEMS_LISTED`] and counts the
    /// rest, so a refusal of a large plan stays well under gRPC's metadata limits.
    #[error("invalid plan:\n{}", .0.summary(PROBLEMS_LISTED))]
    InvalidPlan(#[from] troupe_plan::PlanError),
    /// A request field is missing or malformed.
    #[error("{0}")]
    InvalidArgument(String),
    /// No such session (or task).
    #[error("{0}")]
    NotFound(String),
    /// The call does not fit the current state (stale fencing token, task not running).
    #[error("{0}")]
    FailedPrecondition(String),
    /// A git operation failed.
    #[error("git: {0}")]
    Git(#[from] troupe_workspace::Error),
    /// The database failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// An optimistic write lost to another writer of the session, or needs a transaction;
    /// the group commit then runs under the session's lock, so callers do not see it.
    #[error("contended: {0}")]
    Contended(String),
    /// Stored data could not be decoded (a bug or a corrupted row).
    #[error("corrupt stored data: {0}")]
    Corrupt(String),
    /// File system error.
    #[error("i/o error on {path}: {source}")]
    Io {
        /// The path being worked on.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Serving gRPC failed.
    #[error(transparent)]
    Serve(#[from] troupe_grpc::Error),
}
