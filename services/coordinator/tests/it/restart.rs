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
    // migrations 6, 17 and 18 (which replaced `tasks_claim` and `tasks_session_state`) run
    // again.
    let statements = [
        "DROP INDEX tasks_ready",
        "DROP INDEX tasks_session_ready",
        "ALTER TABLE tasks DROP COLUMN path_ms",
        "CREATE INDEX tasks_claim ON tasks (state, role, priority, critical_path DESC, created_at, session_id, position)",
        "CREATE INDEX tasks_session_state ON tasks (session_id, state, role, priority, critical_path DESC, created_at, position)",
        "DELETE FROM schema_migrations WHERE version IN (6, 17, 18)",
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

/// What a claim hands out about its session (repositories, assets digest) is the same from the
/// coordinator that took the plan in (which keeps it from the intake) and from one that reads
/// it back after a restart.
async fn claims_hand_out_the_same_repos_from_the_intake_and_after_a_restart(db: Db) {
    let harness = Harness::start(db).await;
    let url = format!("file://{}", harness.base_dir.join("repo").display());
    let plan = json!({"name": "fixed", "repos": {
        "app": {"path": "repo"},
        "lib": {"url": url}
    }, "tasks": [
        {"id": "IMPL-1", "title": "app", "repo": "app"},
        {"id": "IMPL-2", "title": "lib", "repo": "lib"},
    ]});
    let created = harness
        .client()
        .create_session(pb::CreateSessionRequest {
            plan_json: plan.to_string(),
            base_dir: harness.base_dir.display().to_string(),
            assets: vec![pb::PlanAsset {
                path: "notes.md".to_owned(),
                content: b"read me".to_vec(),
                executable: false,
            }],
            ..Default::default()
        })
        .await
        .expect("created")
        .into_inner();
    let session = session_id(&created);
    let handed = |claimed: &pb::ClaimedTask| {
        (
            claimed.repos.clone(),
            claimed.repo.clone(),
            claimed.assets_digest.clone(),
        )
    };
    let first = harness.claim(&[Role::Executor], 1).await;
    assert_eq!(ids(&first), ["IMPL-1"]);
    let (repos, repo, digest) = handed(&first[0]);
    assert_eq!(repos.len(), 2, "{repos:?}");
    assert_eq!(repo.as_ref().map(|repo| repo.name.as_str()), Some("app"));
    assert!(!digest.is_empty(), "the plan has assets");

    let harness = harness.restart(async |_| {}).await;
    let second = harness.claim(&[Role::Executor], 1).await;
    assert_eq!(ids(&second), ["IMPL-2"]);
    let after = handed(&second[0]);
    assert_eq!(after.0, repos, "repositories as stored");
    assert_eq!(after.2, digest);
    let lib = after.1.expect("the task's repo");
    assert_eq!((lib.name.as_str(), lib.url.as_str()), ("lib", url.as_str()));
    assert_eq!(second[0].task.as_ref().expect("task").session_id, session);
    harness.stop().await;
}

db_tests!(
    a_restart_keeps_sessions_leases_and_sequences,
    a_database_from_before_estimates_upgrades_in_place,
    claims_hand_out_the_same_repos_from_the_intake_and_after_a_restart,
);
