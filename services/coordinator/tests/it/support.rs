//! Fixtures: a running coordinator with a git repository, and plan/claim helpers.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Value, json};
use tempfile::TempDir;
use tonic::Code;
use troupe_proto::v1::{self as pb, Role, TaskState};
use troupe_testkit::TestService;

pub(crate) type Client = troupe_grpc::CoordinatorClient;

/// A coordinator running on its own data directory, next to a sample repository.
pub(crate) struct Harness {
    pub(crate) client: Client,
    pub(crate) service: TestService,
    pub(crate) dir: TempDir,
    /// Base directory of plans: holds `repo/` (a git work tree) and `sample/` (a template).
    pub(crate) base_dir: PathBuf,
    pub(crate) base_commit: String,
    _log: tracing::subscriber::DefaultGuard,
}

impl Harness {
    pub(crate) async fn start() -> Self {
        let log = troupe_testkit::trace_init();
        let dir = tempfile::tempdir().expect("tempdir");
        let base_dir = dir.path().join("plan");
        let base_commit =
            troupe_testkit::git_repo(&base_dir.join("repo"), &[("README.md", "hello\n")])
                .expect("git repo");
        std::fs::create_dir_all(base_dir.join("sample/src")).expect("sample dir");
        std::fs::write(base_dir.join("sample/src/app.py"), "print('hi')\n").expect("sample file");
        let config = troupe_coordinator::Config::new(dir.path().join("data"));
        let service = TestService::spawn(move |listener, shutdown| {
            troupe_coordinator::run(config, listener, shutdown)
        })
        .await;
        let client = troupe_grpc::coordinator_client(&service.url()).expect("client");
        Self {
            client,
            service,
            dir,
            base_dir,
            base_commit,
            _log: log,
        }
    }

    pub(crate) fn client(&self) -> Client {
        self.client.clone()
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
            })
            .await
            .expect("get session")
            .into_inner()
    }

    pub(crate) async fn state_of(&self, session_id: &str, task_id: &str) -> TaskState {
        task(&self.session(session_id).await.tasks, task_id).state()
    }

    /// Claims at once (no wait) with the default lease.
    pub(crate) async fn claim(&self, roles: &[Role], max: u32) -> Vec<pb::ClaimedTask> {
        self.claim_with(roles, max, Duration::ZERO, Duration::from_secs(30))
            .await
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
            })
            .await
            .map(|response| response.into_inner().task.expect("task"))
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
                }),
                partial_result: None,
            })
            .await
            .expect("fail task")
            .into_inner()
    }
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
