//! The schema: migrations, applied in order at open and recorded in `schema_migrations`.

use super::{Dialect, Store};
use crate::Error;

/// Schema migrations, applied in order and recorded in `schema_migrations`.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "init", include_str!("migrations/0001_init.sql")),
    (2, "workers", include_str!("migrations/0002_workers.sql")),
    (
        3,
        "superseded",
        include_str!("migrations/0003_superseded.sql"),
    ),
    (
        4,
        "claim order",
        include_str!("migrations/0004_claim_order.sql"),
    ),
    (
        5,
        "convergence",
        include_str!("migrations/0005_convergence.sql"),
    ),
    (6, "path ms", include_str!("migrations/0006_path_ms.sql")),
    (
        7,
        "repo urls",
        include_str!("migrations/0007_repo_urls.sql"),
    ),
    (
        8,
        "plan assets",
        include_str!("migrations/0008_plan_assets.sql"),
    ),
    (
        9,
        "task deps",
        include_str!("migrations/0009_task_deps.sql"),
    ),
    // 9 is taken by the task dependency index.
    (10, "gates", include_str!("migrations/0010_gates.sql")),
    (11, "routing", include_str!("migrations/0011_routing.sql")),
    (
        12,
        "session plans",
        include_str!("migrations/0012_session_plans.sql"),
    ),
    (
        13,
        "intake foreign keys",
        include_str!("migrations/0013_intake_foreign_keys.sql"),
    ),
    (
        14,
        "dependents due",
        include_str!("migrations/0014_dependents_due.sql"),
    ),
    (
        15,
        "state position",
        include_str!("migrations/0015_state_position.sql"),
    ),
    (
        16,
        "partial reaper indexes",
        include_str!("migrations/0016_partial_reaper_indexes.sql"),
    ),
    (
        17,
        "partial ready index",
        include_str!("migrations/0017_partial_ready_index.sql"),
    ),
    (
        18,
        "partial session ready index",
        include_str!("migrations/0018_partial_session_ready_index.sql"),
    ),
];

/// The second step of migration 9: the dependency rows of tasks stored before it, read out of
/// their JSON lists (which the two databases spell apart).
fn backfill_task_deps(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::Sqlite => {
            "INSERT INTO task_deps (session_id, task_id, dep_id) \
             SELECT t.session_id, t.id, j.value FROM tasks t, json_each(t.depends_on) j WHERE true \
             ON CONFLICT DO NOTHING"
        }
        Dialect::Postgres => {
            "INSERT INTO task_deps (session_id, task_id, dep_id) \
             SELECT t.session_id, t.id, j FROM tasks t, json_array_elements_text(t.depends_on::json) j WHERE true \
             ON CONFLICT DO NOTHING"
        }
    }
}

/// The second step of migration 13: PostgreSQL drops the foreign keys of `tasks` and `events`
/// on `sessions` (see the migration's file); SQLite keeps them.
fn drop_intake_foreign_keys(dialect: Dialect) -> Option<&'static str> {
    match dialect {
        Dialect::Sqlite => None,
        Dialect::Postgres => Some(
            "ALTER TABLE tasks DROP CONSTRAINT IF EXISTS tasks_session_id_fkey; \
             ALTER TABLE events DROP CONSTRAINT IF EXISTS events_session_id_fkey",
        ),
    }
}

/// Returns a migration in a dialect: the files are written for SQLite with portable types; the
/// only PostgreSQL difference is the binary type (`BLOB` is `BYTEA`).
fn dialect_sql(sql: &str, dialect: Dialect) -> String {
    match dialect {
        Dialect::Sqlite => sql.to_owned(),
        Dialect::Postgres => sql.replace(" BLOB", " BYTEA"),
    }
}

/// Serialises concurrent migrations of coordinators starting together on one PostgreSQL.
const MIGRATION_LOCK: i64 = 0x7472_6f75_7065;

impl Store {
    pub(super) async fn migrate(&self) -> Result<(), Error> {
        self.migrate_through(i64::MAX).await
    }

    /// Applies the migrations up to version `last` that are not applied yet.
    pub(super) async fn migrate_through(&self, last: i64) -> Result<(), Error> {
        let mut tx = self.begin().await?;
        if self.dialect == Dialect::Postgres {
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(MIGRATION_LOCK)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version BIGINT PRIMARY KEY, name TEXT NOT NULL, applied_at BIGINT NOT NULL)",
        )
        .execute(&mut *tx)
        .await?;
        for (version, name, sql) in MIGRATIONS.iter().filter(|(version, ..)| *version <= last) {
            let applied = sqlx::query("SELECT version FROM schema_migrations WHERE version = $1")
                .bind(version)
                .fetch_optional(&mut *tx)
                .await?;
            if applied.is_some() {
                continue;
            }
            let sql = dialect_sql(sql, self.dialect);
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&mut *tx)
                .await?;
            if *version == 9 {
                sqlx::query(backfill_task_deps(self.dialect))
                    .execute(&mut *tx)
                    .await?;
            }
            if *version == 13
                && let Some(sql) = drop_intake_foreign_keys(self.dialect)
            {
                sqlx::raw_sql(sql).execute(&mut *tx).await?;
            }
            sqlx::query(
                "INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, $2, $3)",
            )
            .bind(version)
            .bind(*name)
            .bind(crate::convert::now_ms())
            .execute(&mut *tx)
            .await?;
            tracing::info!(version, name, "applied migration");
        }
        tx.commit().await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use sqlx::Row as _;
    use sqlx::sqlite::SqliteConnectOptions;

    use super::Store;

    /// Migration 12 moves the plans of sessions stored before it out of `sessions`, whole.
    #[tokio::test]
    async fn migration_12_keeps_the_plans_of_existing_sessions() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("troupe.db");
        let old = Store::open_sqlite_through(SqliteConnectOptions::new().filename(&path), 11)
            .await
            .unwrap();
        let plan = format!("{{\"tasks\": [{}]}}", "{\"id\": \"T\"},".repeat(20_000));
        sqlx::query(
            "INSERT INTO sessions (id, name, description, state, mode, on_failure, plan_json, plan_dir, created_at, updated_at) \
             VALUES ('S', 'old', '', 1, 'eager', 'stop', $1, '', 1, 1)",
        )
        .bind(&plan)
        .execute(&mut *old.autocommit().await.unwrap())
        .await
        .unwrap();
        old.close().await;

        let store = Store::open_file(&path).await.unwrap();
        let moved: String =
            sqlx::query_scalar("SELECT plan_json FROM session_plans WHERE session_id = 'S'")
                .fetch_one(&store.reader)
                .await
                .unwrap();
        assert_eq!(moved, plan);
        let row = sqlx::query("SELECT * FROM sessions WHERE id = 'S'")
            .fetch_one(&store.reader)
            .await
            .unwrap();
        assert_eq!(row.try_get::<String, _>("name").unwrap(), "old");
        assert!(
            row.try_get::<String, _>("plan_json").is_err(),
            "the column is gone"
        );
    }
}
