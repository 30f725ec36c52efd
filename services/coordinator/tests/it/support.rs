//! Fixtures: a running coordinator with a git repository, and plan/claim helpers, on SQLite or
//! on PostgreSQL (`TROUPE_TEST_DATABASE_URL`, a schema per test so tests run in parallel).

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Value, json};
use tempfile::TempDir;
use tonic::Code;
use troupe_proto::v1::{self as pb, Role, TaskState};
use troupe_testkit::TestService;

pub(crate) type Client = troupe_grpc::CoordinatorClient;

/// The database a test runs against.
#[derive(Debug, Clone)]
pub(crate) enum Db {
    /// `troupe.db` in the data directory (the default configuration).
    Sqlite,
    /// A fresh schema in the PostgreSQL database of this URL.
    Postgres(String),
}

impl Db {
    /// Returns the PostgreSQL of `TROUPE_TEST_DATABASE_URL`, or `None` (the test is skipped;
    /// see [`troupe_testkit::postgres_url`]).
    pub(crate) fn postgres() -> Option<Self> {
        troupe_testkit::postgres_url().map(Self::Postgres)
    }

    /// Returns the database URL for a coordinator config: `None` (the default SQLite file) or
    /// a URL naming a new, empty schema.
    pub(crate) async fn database_url(&self) -> Option<String> {
        match self {
            Self::Sqlite => None,
            Self::Postgres(url) => Some(fresh_schema(url).await),
        }
    }
}

/// Creates an empty schema and returns `url` with it as the search path.
pub(crate) async fn fresh_schema(url: &str) -> String {
    troupe_testkit::fresh_schema(url, "t").await
}

/// Runs each named `async fn(Db)` as two tests: `<name>::sqlite` and `<name>::postgres`.
macro_rules! db_tests {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn sqlite() {
                    super::$name(crate::support::Db::Sqlite).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    if let Some(db) = crate::support::Db::postgres() {
                        super::$name(db).await;
                    }
                }
            }
        )*
    };
}
pub(crate) use db_tests;

/// Starts a coordinator on `config`, with a client of it.
async fn spawn(
    config: troupe_coordinator::Config,
    tuning: troupe_coordinator::Tuning,
) -> (TestService, Client) {
    let service = TestService::spawn(move |listener, shutdown| {
        troupe_coordinator::run_tuned(config, tuning, listener, shutdown)
    })
    .await;
    let client = troupe_grpc::coordinator_client(&service.url()).expect("client");
    (service, client)
}

/// A coordinator running on its own data directory, next to a sample repository.
pub(crate) struct Harness {
    pub(crate) client: Client,
    pub(crate) service: TestService,
    pub(crate) dir: TempDir,
    /// Base directory of plans: holds `repo/` (a git work tree) and `sample/` (a template).
    pub(crate) base_dir: PathBuf,
    pub(crate) base_commit: String,
    /// The coordinator's database URL (`None`: SQLite in the data directory).
    pub(crate) database_url: Option<String>,
    _log: tracing::subscriber::DefaultGuard,
}

impl Harness {
    pub(crate) async fn start(db: Db) -> Self {
        Self::start_tuned(db, troupe_coordinator::Tuning::default()).await
    }

    pub(crate) async fn start_tuned(db: Db, tuning: troupe_coordinator::Tuning) -> Self {
        Self::start_with(db, tuning, |_| {}).await
    }

    /// [`Harness::start_tuned`] with `edit` applied to the coordinator's configuration.
    pub(crate) async fn start_with(
        db: Db,
        tuning: troupe_coordinator::Tuning,
        edit: impl FnOnce(&mut troupe_coordinator::Config),
    ) -> Self {
        let log = troupe_testkit::trace_init();
        let dir = tempfile::tempdir().expect("tempdir");
        let base_dir = dir.path().join("plan");
        let base_commit =
            troupe_testkit::git_repo(&base_dir.join("repo"), &[("README.md", "hello\n")])
                .expect("git repo");
        std::fs::create_dir_all(base_dir.join("sample/src")).expect("sample dir");
        std::fs::write(base_dir.join("sample/src/app.py"), "print('hi')\n").expect("sample file");
        let database_url = db.database_url().await;
        let mut config = troupe_coordinator::Config::new(dir.path().join("data"));
        config.database_url.clone_from(&database_url);
        edit(&mut config);
        let (service, client) = spawn(config, tuning).await;
        Self {
            client,
            service,
            dir,
            base_dir,
            base_commit,
            database_url,
            _log: log,
        }
    }

    /// Stops this coordinator, runs `between` on its configuration while it is down, and
    /// starts a new one on the same data directory and database.
    pub(crate) async fn restart(
        self,
        between: impl AsyncFnOnce(&troupe_coordinator::Config),
    ) -> Self {
        let config = self.config();
        self.service.stop().await;
        between(&config).await;
        let (service, client) = spawn(config, troupe_coordinator::Tuning::default()).await;
        Self {
            client,
            service,
            ..self
        }
    }

    /// Returns the configuration of this harness's coordinator (same data dir and database).
    pub(crate) fn config(&self) -> troupe_coordinator::Config {
        let mut config = troupe_coordinator::Config::new(self.dir.path().join("data"));
        config.database_url.clone_from(&self.database_url);
        config
    }

    pub(crate) fn client(&self) -> Client {
        self.client.clone()
    }

    /// The session's whole event log, oldest first.
    pub(crate) async fn events(&self, session_id: &str) -> Vec<pb::SessionEvent> {
        event_log(&mut self.client(), session_id).await
    }

    /// The session's whole event log, after checking that its sequence numbers run from 1 to
    /// its `last_sequence`, each once.
    pub(crate) async fn gap_free_events(&self, session: &pb::Session) -> Vec<pb::SessionEvent> {
        let events = self.events(&session.id).await;
        let sequences: Vec<u64> = events.iter().map(|event| event.sequence).collect();
        let expected: Vec<u64> = (1..=session.last_sequence).collect();
        assert_eq!(sequences, expected, "gap-free event sequence");
        events
    }

    pub(crate) async fn stop(self) {
        self.service.stop().await;
    }

    /// Creates a session from `plan` (with `repos` defaulting to `repo/`).
    pub(crate) async fn create(&self, mut plan: Value) -> pb::CreateSessionResponse {
        if plan.get("repos").is_none() {
            plan["repos"] = json!({"app": {"path": "repo"}});
        }
        self.try_create(&plan).await.expect("create session")
    }

    pub(crate) async fn try_create(
        &self,
        plan: &Value,
    ) -> Result<pb::CreateSessionResponse, tonic::Status> {
        self.client()
            .create_session(pb::CreateSessionRequest {
                plan_json: plan.to_string(),
                base_dir: self.base_dir.display().to_string(),
                ..Default::default()
            })
            .await
            .map(tonic::Response::into_inner)
    }

    pub(crate) async fn session(&self, session_id: &str) -> pb::GetSessionResponse {
        self.client()
            .get_session(pb::GetSessionRequest {
                session_id: session_id.to_owned(),
                ..Default::default()
            })
            .await
            .expect("get session")
            .into_inner()
    }

    /// The session itself, as `GetSession` reports it.
    pub(crate) async fn summary(&self, session_id: &str) -> pb::Session {
        self.session(session_id).await.session.expect("session")
    }

    pub(crate) async fn state_of(&self, session_id: &str, task_id: &str) -> TaskState {
        task(&self.session(session_id).await.tasks, task_id).state()
    }

    /// Claims at once (no wait) with the default lease.
    pub(crate) async fn claim(&self, roles: &[Role], max: u32) -> Vec<pb::ClaimedTask> {
        self.claim_with(roles, max, Duration::ZERO, Duration::from_secs(30))
            .await
    }

    /// Returns the session's status (`CheckSession`).
    pub(crate) async fn check(&self, session_id: &str) -> pb::CheckSessionResponse {
        self.client()
            .check_session(pb::CheckSessionRequest {
                session_id: session_id.to_owned(),
                ..Default::default()
            })
            .await
            .expect("check session")
            .into_inner()
    }

    /// Returns the session's messages of one type.
    pub(crate) async fn messages(&self, session_id: &str, kind: &str) -> Vec<pb::Message> {
        self.client()
            .list_messages(pb::ListMessagesRequest {
                session_id: session_id.to_owned(),
                r#type: kind.to_owned(),
                last: 100,
                ..Default::default()
            })
            .await
            .expect("list messages")
            .into_inner()
            .messages
    }

    pub(crate) async fn claim_with(
        &self,
        roles: &[Role],
        max: u32,
        wait: Duration,
        lease: Duration,
    ) -> Vec<pb::ClaimedTask> {
        self.client()
            .claim_tasks(pb::ClaimTasksRequest {
                worker_id: "worker-test".to_owned(),
                roles: roles.iter().map(|role| *role as i32).collect(),
                max_tasks: max,
                wait: Some(prost_types::Duration::try_from(wait).expect("duration")),
                lease_duration: Some(prost_types::Duration::try_from(lease).expect("duration")),
                capabilities: Vec::new(),
                ..Default::default()
            })
            .await
            .expect("claim")
            .into_inner()
            .tasks
    }

    pub(crate) async fn complete(
        &self,
        claimed: &pb::ClaimedTask,
        summary: &str,
    ) -> Result<pb::Task, tonic::Status> {
        self.complete_with_token(claimed, token(claimed), summary)
            .await
    }

    pub(crate) async fn complete_with_token(
        &self,
        claimed: &pb::ClaimedTask,
        fencing_token: u64,
        summary: &str,
    ) -> Result<pb::Task, tonic::Status> {
        let task = claimed.task.as_ref().expect("task");
        self.client()
            .complete_task(pb::CompleteTaskRequest {
                session_id: task.session_id.clone(),
                task_id: task.id.clone(),
                fencing_token,
                result: Some(pb::TaskResult {
                    summary: summary.to_owned(),
                    files_modified: vec![format!("{}.txt", task.id)],
                    ..Default::default()
                }),
                claim_next: None,
            })
            .await
            .map(|response| response.into_inner().task.expect("task"))
    }

    /// Completes `claimed` and claims the next `max` executor tasks in the same call
    /// (`claimNext`), as worker-test.
    pub(crate) async fn complete_and_claim(
        &self,
        claimed: &pb::ClaimedTask,
        max: u32,
    ) -> Vec<pb::ClaimedTask> {
        self.complete_claiming(claimed, None, "worker-test", max)
            .await
    }

    /// Completes `claimed` as worker number `n` (its summary says so) and claims that worker's
    /// next task with it (`claimNext`).
    pub(crate) async fn complete_as_worker(
        &self,
        claimed: &pb::ClaimedTask,
        n: usize,
    ) -> Vec<pb::ClaimedTask> {
        let id = id_of(claimed);
        let result = pb::TaskResult {
            summary: format!("{id} by worker {n}"),
            ..Default::default()
        };
        self.complete_claiming(claimed, Some(result), &format!("worker-{n}"), 1)
            .await
    }

    /// Completes `claimed` with `result` and claims `worker`'s next `max` executor tasks.
    async fn complete_claiming(
        &self,
        claimed: &pb::ClaimedTask,
        result: Option<pb::TaskResult>,
        worker: &str,
        max: u32,
    ) -> Vec<pb::ClaimedTask> {
        let task = claimed.task.as_ref().expect("task");
        self.client()
            .complete_task(pb::CompleteTaskRequest {
                session_id: task.session_id.clone(),
                task_id: task.id.clone(),
                fencing_token: token(claimed),
                result,
                claim_next: Some(pb::ClaimTasksRequest {
                    worker_id: worker.to_owned(),
                    roles: vec![Role::Executor as i32],
                    max_tasks: max,
                    ..Default::default()
                }),
            })
            .await
            .expect("complete and claim")
            .into_inner()
            .next
    }

    pub(crate) async fn fail(
        &self,
        claimed: &pb::ClaimedTask,
        retryable: bool,
    ) -> pb::FailTaskResponse {
        let task = claimed.task.as_ref().expect("task");
        self.client()
            .fail_task(pb::FailTaskRequest {
                session_id: task.session_id.clone(),
                task_id: task.id.clone(),
                fencing_token: token(claimed),
                error: Some(pb::TaskError {
                    kind: pb::ErrorKind::CheckFailed as i32,
                    message: "verification failed".to_owned(),
                    retryable,
                    details: vec!["exit 1".to_owned()],
                    ..Default::default()
                }),
                partial_result: None,
            })
            .await
            .expect("fail task")
            .into_inner()
    }
}

/// How many of `events` are a task's move to `to`.
pub(crate) fn moves_to(events: &[pb::SessionEvent], to: TaskState) -> usize {
    events
        .iter()
        .filter(|event| {
            matches!(&event.kind, Some(pb::session_event::Kind::Task(moved)) if moved.to() == to)
        })
        .count()
}

pub(crate) fn token(claimed: &pb::ClaimedTask) -> u64 {
    claimed.lease.as_ref().expect("lease").fencing_token
}

pub(crate) fn id_of(claimed: &pb::ClaimedTask) -> &str {
    &claimed.task.as_ref().expect("task").id
}

pub(crate) fn ids(claimed: &[pb::ClaimedTask]) -> Vec<&str> {
    claimed.iter().map(id_of).collect()
}

pub(crate) fn task<'a>(tasks: &'a [pb::Task], id: &str) -> &'a pb::Task {
    tasks
        .iter()
        .find(|task| task.id == id)
        .unwrap_or_else(|| panic!("task {id} missing"))
}

pub(crate) fn session_id(created: &pb::CreateSessionResponse) -> String {
    created.session.as_ref().expect("session").id.clone()
}

pub(crate) fn t(id: &str, deps: &[&str]) -> Value {
    json!({"id": id, "title": format!("do {id}"), "depends_on": deps})
}

pub(crate) fn assert_code(
    result: Result<impl std::fmt::Debug, tonic::Status>,
    code: Code,
    needle: &str,
) -> String {
    match result {
        Ok(value) => panic!("expected {code:?}, got {value:?}"),
        Err(status) => {
            assert_eq!(status.code(), code, "{}", status.message());
            assert!(
                status.message().contains(needle),
                "`{needle}` not in: {}",
                status.message()
            );
            status.message().to_owned()
        }
    }
}

/// Returns a task's plan object as JSON.
pub(crate) fn spec_json(task: &pb::Task) -> Value {
    Value::Object(troupe_proto::json::struct_to_object(
        task.spec.as_ref().expect("spec"),
    ))
}

/// A session's whole event log, oldest first (`WatchSession` from the start, not following).
pub(crate) async fn event_log(client: &mut Client, session_id: &str) -> Vec<pb::SessionEvent> {
    let mut stream = client
        .watch_session(pb::WatchSessionRequest {
            session_id: session_id.to_owned(),
            after_sequence: 0,
            follow: false,
        })
        .await
        .expect("watch")
        .into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.expect("event") {
        events.push(event);
    }
    events
}
