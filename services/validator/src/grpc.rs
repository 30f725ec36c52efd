//! The `troupe.v1.Validator` adapter: tonic types stop here.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use troupe_proto::v1::validator_server;
use troupe_proto::v1::{ValidateRequest, ValidateResponse};

use crate::{Error, Validation, Validator};

impl From<Error> for Status {
    fn from(err: Error) -> Self {
        let message = err.to_string();
        match err {
            Error::InvalidArgument(_) => Status::invalid_argument(message),
            Error::Cancelled => Status::cancelled(message),
            Error::Workspace(inner) => troupe_grpc::status::workspace(&inner),
            Error::Process(_) | Error::Io { .. } | Error::Grpc(_) => {
                troupe_grpc::status::internal(&message)
            }
        }
    }
}

/// Serves `Validate` with a shared [`Validator`].
#[derive(Debug, Clone)]
pub(crate) struct ValidatorService {
    validator: Arc<Validator>,
}

impl ValidatorService {
    pub(crate) fn new(validator: Arc<Validator>) -> Self {
        Self { validator }
    }
}

#[tonic::async_trait]
impl validator_server::Validator for ValidatorService {
    #[tracing::instrument(skip_all, fields(repo = %request.get_ref().repo_path, git_ref = %request.get_ref().r#ref))]
    async fn validate(
        &self,
        request: Request<ValidateRequest>,
    ) -> Result<Response<ValidateResponse>, Status> {
        let validation =
            Validation::from_request(request.into_inner(), self.validator.default_judge())?;
        // Own task + drop guard: a client hanging up cancels the verification command, and the
        // worktree is still removed.
        let cancel = CancellationToken::new();
        let _guard = cancel.clone().drop_guard();
        let validator = Arc::clone(&self.validator);
        let report = tokio::spawn(async move { validator.validate(&validation, &cancel).await })
            .await
            .map_err(|err| {
                troupe_grpc::status::internal(&format!("validation task failed: {err}"))
            })??;
        Ok(Response::new(ValidateResponse {
            report: Some(report),
        }))
    }
}
