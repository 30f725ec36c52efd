//! Durability: a restarted coordinator on the same data directory carries on.

use serde_json::json;
use troupe_coordinator::{App, Config, Error};
use troupe_proto::v1::{self as pb, Role, TaskState};

use crate::support::{Db, Harness, db_tests, ids, session_id, t, token};

async fn a_restart_keeps_sessions_leases_and_sequences(db: Db) {
    let harness = Harness::start(db).await;
    let session = session_id(
        &harness
            .create(
                json!({"name": "restart", "tasks": [t("IMPL-1", &[]), t("IMPL-2", &["IMPL-1"])]}),
            )
            .await,
    );
    let claimed = harness.claim(&[Role::Executor], 1).await;
    let before = harness
        .session(&session)
        .await
        .session
        .expect("session")
        .last_sequence;
    let harness = harness.restart(async |_| {}).await;
    let mut client = harness.client();
    let view = client
        .get_session(pb::GetSessionRequest {
            session_id: session.clone(),
            ..Default::default()
        })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(view.session.expect("session").last_sequence, before);
    let task = claimed[0].task.clone().expect("task");
    // The lease survived the restart: the old worker can still complete its task.
    let done = client
        .complete_task(pb::CompleteTaskRequest {
            session_id: session.clone(),
            task_id: task.id,
            fencing_token: token(&claimed[0]),
            result: None,
            claim_next: None,
        })
        .await
        .expect("complete after restart")
        .into_inner()
        .task
        .expect("task");
    assert_eq!(done.state(), TaskState::Completed);
    let next = client
        .claim_tasks(pb::ClaimTasksRequest {
            worker_id: "w2".into(),
            roles: vec![Role::Executor as i32],
            ..Default::default()
        })
        .await
        .expect("claim")
        .into_inner()
        .tasks;
    assert_eq!(ids(&next), vec!["IMPL-2"]);
    harness.stop().await;
}

async fn a_database_from_before_estimates_upgrades_in_place(db: Db) {
    let harness = Harness::start(db).await;
    // IMPL-A comes first in plan order, IMPL-B has the longer chain: only the rank tells them
    // apart.
    let session = session_id(
        &harness
            .create(json!({"name": "upgrade", "tasks": [
                t("IMPL-A", &[]), t("IMPL-B", &[]), t("IMPL-C", &["IMPL-B"])
            ]}))
            .await,
    );
    // Put the schema back as migration 5 left it (no `path_ms`, the old claim indexes), so
    // migrations 6 and 17 (which replaced `tasks_claim`) run again.
    let statements = [
        "DROP INDEX tasks_ready",
        "DROP INDEX tasks_session_state",
        "ALTER TABLE tasks DROP COLUMN path_ms",
        "CREATE INDEX tasks_claim ON tasks (state, role, priority, critical_path DESC, created_at, session_id, position)",
        "CREATE INDEX tasks_session_state ON tasks (session_id, state, role, priority, critical_path DESC, created_at, position)",
        "DELETE FROM schema_migrations WHERE version IN (6, 17)",
    ];
    let downgrade = async |config: &troupe_coordinator::Config| {
        use sqlx::Connection as _;
        match &config.database_url {
            Some(url) => {
                let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
                for sql in statements {
                    sqlx::raw_sql(sql).execute(&mut conn).await.expect(sql);
                }
            }
            None => {
                let path = config.data_dir.join("troupe.db");
                let mut conn =
                    sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
                        .await
                        .expect("connect");
                for sql in statements {
                    sqlx::raw_sql(sql).execute(&mut conn).await.expect(sql);
                }
            }
        }
    };
    let harness = harness.restart(downgrade).await;
    let claimed = harness
        .client()
        .claim_tasks(pb::ClaimTasksRequest {
            worker_id: "w".into(),
            roles: vec![Role::Executor as i32],
            max_tasks: 2,
            ..Default::default()
        })
        .await
        .expect("claim after the upgrade")
        .into_inner()
        .tasks;
    assert_eq!(ids(&claimed), vec!["IMPL-B", "IMPL-A"]);
    assert!(
        claimed
            .iter()
            .all(|c| c.task.as_ref().expect("task").session_id == session)
    );
    harness.stop().await;
}

#[tokio::test]
async fn unsupported_database_urls_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = Config::new(dir.path());
    config.database_url = Some("mysql://localhost/troupe".into());
    let err = App::open(config).await.expect_err("mysql is not supported");
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");

    let mut config = Config::new(dir.path().join("data"));
    config.database_url = Some(format!(
        "sqlite://{}",
        dir.path().join("explicit.db").display()
    ));
    App::open(config).await.expect("sqlite url");
    assert!(dir.path().join("explicit.db").is_file());
}

db_tests!(
    a_restart_keeps_sessions_leases_and_sequences,
    a_database_from_before_estimates_upgrades_in_place,
);
