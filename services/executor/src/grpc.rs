//! The `troupe.v1.Executor` adapter: tonic types stop here.

use std::path::PathBuf;
use std::sync::Arc;

use prost::Message;
use tokio_util::sync::CancellationToken;
use tonic::metadata::MetadataValue;
use tonic::{Code, Request, Response, Status};
use troupe_proto::v1::executor_server::Executor as ExecutorRpc;
use troupe_proto::v1::{
    BackendInfo, ErrorKind, ExecuteTaskRequest, ExecuteTaskResponse, ListBackendsRequest,
    ListBackendsResponse,
};

use crate::{Error, Executor, Job, Target, struct_to_json};

/// Binary metadata key carrying the encoded `troupe.v1.TaskError` of a failed `ExecuteTask`.
pub const TASK_ERROR_METADATA: &str = "troupe-task-error-bin";

impl From<Error> for Status {
    fn from(err: Error) -> Self {
        let message = err.to_string();
        match err {
            Error::InvalidArgument(_) => Status::invalid_argument(message),
            Error::BranchExists { .. } => Status::already_exists(message),
            Error::Task(failure) => {
                let kind =
                    ErrorKind::try_from(failure.error.kind).unwrap_or(ErrorKind::Unspecified);
                let code = match kind {
                    ErrorKind::InvalidTask => Code::InvalidArgument,
                    ErrorKind::NotInstalled
                    | ErrorKind::Auth
                    | ErrorKind::OutOfScope
                    | ErrorKind::SandboxDenied
                    | ErrorKind::PermissionDenied
                    | ErrorKind::Superseded
                    | ErrorKind::Rejected => Code::FailedPrecondition,
                    ErrorKind::Repository => Code::Unavailable,
                    ErrorKind::RateLimited | ErrorKind::Quota => Code::ResourceExhausted,
                    ErrorKind::Timeout => Code::DeadlineExceeded,
                    ErrorKind::Crash
                    | ErrorKind::BadOutput
                    | ErrorKind::CheckFailed
                    | ErrorKind::MergeConflict => Code::Aborted,
                    ErrorKind::Internal | ErrorKind::Unspecified => Code::Internal,
                };
                let kind_name = troupe_proto::names::name(kind);
                let mut status = Status::new(code, format!("{kind_name}: {message}"));
                // The typed error travels as metadata so clients can tell kinds apart exactly.
                status.metadata_mut().insert_bin(
                    TASK_ERROR_METADATA,
                    MetadataValue::from_bytes(&failure.error.encode_to_vec()),
                );
                status
            }
            Error::Workspace(inner) => troupe_grpc::status::workspace(&inner),
            Error::Config(_) => Status::failed_precondition(message),
            Error::Io { .. } | Error::Grpc(_) | Error::Children(_) => {
                troupe_grpc::status::internal(&message)
            }
        }
    }
}

/// Serves `ExecuteTask` and `ListBackends` with a shared [`Executor`].
#[derive(Debug, Clone)]
pub(crate) struct ExecutorService {
    executor: Arc<Executor>,
}

impl ExecutorService {
    pub(crate) fn new(executor: Arc<Executor>) -> Self {
        Self { executor }
    }
}

fn job_from_request(request: ExecuteTaskRequest) -> Result<Job, Error> {
    let remote = troupe_workspace::Remote::parse(&request.repo_path).map_err(|err| {
        Error::InvalidArgument(format!(
            "repo_path must be an absolute path or a git URL: {err}"
        ))
    })?;
    let spec = request
        .task
        .as_ref()
        .map(struct_to_json)
        .ok_or_else(|| Error::InvalidArgument("task is required".to_owned()))?;
    if spec
        .get("id")
        .and_then(serde_json::Value::as_str)
        .is_none_or(|id| id.trim().is_empty())
    {
        return Err(Error::InvalidArgument("task.id is required".to_owned()));
    }
    // A task the plan's rules refuse is an INVALID_TASK failure, typed like any other.
    let spec = crate::spec::parse(&spec).map_err(|problems| {
        Error::Task(Box::new(troupe_grpc::worker::TaskFailure::new(
            ErrorKind::InvalidTask,
            format!("invalid task: {problems}"),
            false,
        )))
    })?;
    let task_id = spec.id.clone();
    let branch = if request.branch.is_empty() {
        format!("troupe/direct/{task_id}")
    } else {
        request.branch
    };
    let plan_dir = (!request.base_dir.is_empty()).then(|| PathBuf::from(&request.base_dir));
    if plan_dir.as_ref().is_some_and(|dir| !dir.is_absolute()) {
        return Err(Error::InvalidArgument(
            "base_dir must be an absolute path".to_owned(),
        ));
    }
    Ok(Job {
        spec,
        repo_name: remote.name().to_owned(),
        remote,
        session_id: "direct".to_owned(),
        task_id: Some(task_id),
        attempt: 1,
        plan_dir,
        upstream: Vec::new(),
        target: Target::Direct {
            base_ref: request.base_ref,
            branch,
        },
        lease: None,
        fencing_token: 0,
        context: Vec::new(),
        usage: None,
    })
}

#[tonic::async_trait]
impl ExecutorRpc for ExecutorService {
    #[tracing::instrument(skip_all, fields(repo = %request.get_ref().repo_path, base_ref = %request.get_ref().base_ref))]
    async fn execute_task(
        &self,
        request: Request<ExecuteTaskRequest>,
    ) -> Result<Response<ExecuteTaskResponse>, Status> {
        let job = job_from_request(request.into_inner())?;
        // Run in its own task: a client hanging up cancels the agent (the guard fires when this
        // future is dropped) while the worktree clean-up still runs to the end.
        let cancel = CancellationToken::new();
        let _guard = cancel.clone().drop_guard();
        let executor = Arc::clone(&self.executor);
        let result = tokio::spawn(async move { executor.execute_direct(job, &cancel).await })
            .await
            .map_err(|err| {
                troupe_grpc::status::internal(&format!("execute task failed: {err}"))
            })??;
        Ok(Response::new(ExecuteTaskResponse {
            result: Some(result),
        }))
    }

    async fn list_backends(
        &self,
        request: Request<ListBackendsRequest>,
    ) -> Result<Response<ListBackendsResponse>, Status> {
        let infos = self.executor.probe().await;
        let live = if request.into_inner().probe {
            let usable: Vec<String> = infos
                .iter()
                .filter(|info| info.available)
                .map(|info| info.name.clone())
                .collect();
            self.executor.probe_live(&usable).await
        } else {
            Vec::new()
        };
        let backends = infos
            .into_iter()
            .map(|info| BackendInfo {
                probe: live
                    .iter()
                    .find(|(name, _)| *name == info.name)
                    .map(|(_, result)| result.clone())
                    .unwrap_or_default(),
                name: info.name,
                available: info.available,
                version: info.version.unwrap_or_default(),
                detail: info.detail,
                credential: info.credential,
            })
            .collect();
        Ok(Response::new(ListBackendsResponse { backends }))
    }
}
