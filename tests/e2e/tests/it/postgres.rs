//! PostgreSQL for end-to-end tests: a fresh schema per test in `TROUPE_TEST_DATABASE_URL`
//! (scripts/setup/20-postgres.sh starts a server). Without it a test prints a notice and
//! passes, except under CI, where it fails (see [`troupe_testkit::postgres_url`]).

/// A URL naming a new, empty schema, or `None` (after the notice) without a server.
pub(crate) async fn fresh_schema() -> Option<String> {
    let url = troupe_testkit::postgres_url()?;
    Some(troupe_testkit::fresh_schema(&url, "e2e").await)
}
