//! PostgreSQL for tests: the server of `TROUPE_TEST_DATABASE_URL` (scripts/setup/20-postgres.sh
//! starts a throwaway cluster), a fresh schema per test so tests run in parallel.

/// The URL of `TROUPE_TEST_DATABASE_URL`. When unset, fails under CI (`CI` set, not `false`)
/// and otherwise prints a notice and returns `None` (the test is skipped).
pub fn postgres_url() -> Option<String> {
    match std::env::var("TROUPE_TEST_DATABASE_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var_os("CI").is_some_and(|ci| !ci.is_empty() && ci != "false") => {
            panic!(
                "TROUPE_TEST_DATABASE_URL is not set but CI is: PostgreSQL tests must run in CI \
                 (source scripts/setup/20-postgres.sh to start a throwaway cluster)"
            )
        }
        _ => {
            eprintln!(
                "notice: skipping a PostgreSQL test: TROUPE_TEST_DATABASE_URL is not set \
                 (source scripts/setup/20-postgres.sh)"
            );
            None
        }
    }
}

/// Creates an empty schema (`prefix` and a random suffix) in the database at `url` and returns
/// `url` with it as the search path.
pub async fn fresh_schema(url: &str, prefix: &str) -> String {
    use sqlx::Connection as _;
    let schema = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
    let mut conn = sqlx::PgConnection::connect(url)
        .await
        .expect("connect to TROUPE_TEST_DATABASE_URL");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&mut conn)
        .await
        .expect("create schema");
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}options=-c%20search_path%3D{schema}")
}
