//! The executor's own metric family: backend fallbacks by the error that caused them (the
//! shared worker loop counts attempts, durations and tokens; see `docs/operating.md`).

use std::sync::OnceLock;

use troupe_backends::ErrorKind;
use troupe_telemetry::metrics::{self, Counter, Family, Labels, labels};

fn fallbacks() -> &'static Family<Labels, Counter> {
    static FALLBACKS: OnceLock<Family<Labels, Counter>> = OnceLock::new();
    FALLBACKS.get_or_init(|| {
        metrics::counter(
            "troupe_backend_fallbacks",
            "Backends given up for the next one in the fallback order, by the backend left and the error kind.",
        )
    })
}

/// Registers the family, so a scrape shows it before the first fallback.
pub(crate) fn register() {
    fallbacks();
}

/// Counts `backend` given up after an error of `kind`.
pub(crate) fn fell_back(backend: &str, kind: ErrorKind) {
    let kind = match kind {
        ErrorKind::NotInstalled => "not_installed",
        ErrorKind::Auth => "auth",
        ErrorKind::RateLimited => "rate_limited",
        ErrorKind::Quota => "quota",
        ErrorKind::Timeout => "timeout",
        ErrorKind::Crash => "crash",
        ErrorKind::BadOutput => "bad_output",
        ErrorKind::InvalidTask => "invalid_task",
        ErrorKind::Internal => "internal",
        ErrorKind::Cancelled => "cancelled",
        ErrorKind::SandboxDenied => "sandbox_denied",
        ErrorKind::PermissionDenied => "permission_denied",
    };
    fallbacks()
        .get_or_create(&labels([("backend", backend), ("kind", kind)]))
        .inc();
}
