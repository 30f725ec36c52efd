//! The `troupe.v1.TestRunner` adapter: tonic types stop here.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use troupe_proto::v1::test_runner_server::TestRunner;
use troupe_proto::v1::{RunTestsRequest, RunTestsResponse};

use crate::{Error, RunSpec, Runner};

impl From<Error> for Status {
    fn from(err: Error) -> Self {
        let message = err.to_string();
        match err {
            Error::InvalidArgument(_) => Status::invalid_argument(message),
            Error::Unimplemented(_) => Status::unimplemented(message),
            Error::NotInstalled(_) | Error::Install { .. } => Status::failed_precondition(message),
            Error::Cancelled => Status::cancelled(message),
            Error::Workspace(inner) => troupe_grpc::status::workspace(&inner),
            Error::Process { .. }
            | Error::Io { .. }
            | Error::Grpc(_)
            | Error::Internal(_)
            | Error::Children(_) => troupe_grpc::status::internal(&message),
        }
    }
}

/// Serves `RunTests` with a shared [`Runner`].
#[derive(Debug, Clone)]
pub(crate) struct TestRunnerService {
    runner: Arc<Runner>,
}

impl TestRunnerService {
    pub(crate) fn new(runner: Arc<Runner>) -> Self {
        Self { runner }
    }
}

#[tonic::async_trait]
impl TestRunner for TestRunnerService {
    #[tracing::instrument(skip_all, fields(repo = %request.get_ref().repo_path, git_ref = %request.get_ref().r#ref))]
    async fn run_tests(
        &self,
        request: Request<RunTestsRequest>,
    ) -> Result<Response<RunTestsResponse>, Status> {
        let spec = RunSpec::from_request(request.into_inner())?;
        // The run goes on in its own task so that a client hanging up cancels it (the guard
        // fires when this future is dropped) and the worktree is still cleaned up.
        let cancel = CancellationToken::new();
        let _guard = cancel.clone().drop_guard();
        let runner = Arc::clone(&self.runner);
        let report = tokio::spawn(async move {
            let mut report = runner.run_tests(&spec, &cancel).await?;
            // Outside a session, fixes go back to the remote on a branch of their own.
            runner.share_fixes(&spec, &mut report).await?;
            Ok::<_, crate::Error>(report)
        })
        .await
        .map_err(|err| troupe_grpc::status::internal(&format!("test run task failed: {err}")))??;
        Ok(Response::new(RunTestsResponse {
            report: Some(report),
        }))
    }
}
