//! PostgreSQL for end-to-end tests: a fresh schema per test in `TROUPE_TEST_DATABASE_URL`
//! (scripts/setup/20-postgres.sh starts a server). Without it a test prints a notice and
//! passes, except under `CI=true`, where it fails.

/// A URL naming a new, empty schema, or `None` (after the notice) without a server.
pub(crate) async fn fresh_schema() -> Option<String> {
    let Ok(url) = std::env::var("TROUPE_TEST_DATABASE_URL") else {
        assert!(
            std::env::var("CI").map_or(true, |v| v != "true"),
            "TROUPE_TEST_DATABASE_URL is unset under CI (scripts/setup/20-postgres.sh sets it)"
        );
        eprintln!("notice: TROUPE_TEST_DATABASE_URL is unset: PostgreSQL half skipped");
        return None;
    };
    let schema = format!("e2e_{}", uuid::Uuid::new_v4().simple());
    let pool = sqlx::PgPool::connect(&url)
        .await
        .expect("connect to PostgreSQL");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&pool)
        .await
        .expect("create schema");
    pool.close().await;
    let separator = if url.contains('?') { '&' } else { '?' };
    Some(format!(
        "{url}{separator}options=-c%20search_path%3D{schema}"
    ))
}
