//! The gRPC adapter: tonic types stop here. Each method unwraps the request, calls the domain
//! [`Coordinator`], builds the response from what it returns ([`convert`], the wire forms of
//! the domain's values) and maps [`Error`] to a status once (`From<Error> for Status`).

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use troupe_proto::v1::{self as pb, coordinator_server};

use crate::Error;
use crate::convert::{json_to_struct, opt_timestamp, timestamp};
use crate::service::Coordinator;

mod convert;
mod upload;

impl From<Error> for Status {
    fn from(err: Error) -> Self {
        let status = match &err {
            Error::InvalidPlan(_) | Error::InvalidArgument(_) => {
                Status::invalid_argument(err.to_string())
            }
            Error::NotFound(_) => Status::not_found(err.to_string()),
            Error::FailedPrecondition(_) => Status::failed_precondition(err.to_string()),
            Error::Database(sqlx::Error::PoolTimedOut | sqlx::Error::Io(_)) => {
                Status::unavailable(err.to_string())
            }
            // PostgreSQL deadlock or serialization failure: safe for the caller to retry.
            Error::Database(sqlx::Error::Database(db))
                if matches!(db.code().as_deref(), Some("40P01" | "40001")) =>
            {
                Status::unavailable(err.to_string())
            }
            // Group commit retries these under the lock; safe to retry should one get here.
            Error::Contended(_) => Status::aborted(err.to_string()),
            Error::Git(git) => troupe_grpc::status::workspace(git),
            Error::Database(_) | Error::Corrupt(_) | Error::Io { .. } | Error::Serve(_) => {
                troupe_grpc::status::internal(&err)
            }
        };
        bounded(status)
    }
}

/// Who made a request: the principal the auth layer found, or `anonymous` on a server
/// without authentication.
pub(crate) fn caller<T>(request: &Request<T>) -> String {
    request
        .extensions()
        .get::<troupe_grpc::auth::Principal>()
        .map_or_else(
            || "anonymous".to_owned(),
            |principal| principal.name.clone(),
        )
}

/// The most of a status message sent: it travels as a header (percent-encoded, up to three
/// times as long), and a client refuses headers over its limit (16 KiB by default) with
/// `RESOURCE_EXHAUSTED` instead of the reason.
const STATUS_MESSAGE_BYTES: usize = 4096;

/// `status` with its message cut to [`STATUS_MESSAGE_BYTES`], saying how much was cut.
fn bounded(status: Status) -> Status {
    let message = status.message();
    if message.len() <= STATUS_MESSAGE_BYTES {
        return status;
    }
    let mut cut = STATUS_MESSAGE_BYTES;
    while !message.is_char_boundary(cut) {
        cut -= 1;
    }
    let message = format!("{}… ({} more bytes)", &message[..cut], message.len() - cut);
    Status::new(status.code(), message)
}

/// Returns the tonic server for `coordinator`, accepting and sending messages up to
/// `max_message` bytes.
pub(crate) fn server(
    coordinator: Arc<Coordinator>,
    max_message: usize,
) -> coordinator_server::CoordinatorServer<Adapter> {
    coordinator_server::CoordinatorServer::new(Adapter { coordinator })
        .max_decoding_message_size(max_message)
        .max_encoding_message_size(max_message)
}

/// The adapter alone, for the web view, which calls its methods in-process.
pub(crate) fn adapter(coordinator: Arc<Coordinator>) -> Adapter {
    Adapter { coordinator }
}

impl Adapter {
    /// `ApproveTask` and `RejectTask`: one answer at a gate, the task as it then stands.
    async fn answer_gate(
        &self,
        session_id: &str,
        task_id: &str,
        approve: bool,
        by: &str,
        note: &str,
    ) -> Result<pb::Task, Status> {
        let task = self
            .coordinator
            .answer_gate((session_id, task_id), approve, (by, note))
            .await?;
        Ok(convert::task_proto(&task))
    }

    /// The session's tasks waiting at a role's checkpoint, with its id (for the web view).
    pub(crate) async fn held_at_checkpoints(
        &self,
        session_id: &str,
    ) -> Result<std::collections::HashMap<String, String>, Status> {
        Ok(self.coordinator.held_at_checkpoints(session_id).await?)
    }

    /// `ApproveTask` and `RejectTask` for one: a task's gate, or a role's checkpoint (the
    /// tasks it held, as they then stand, go in the second).
    async fn answer(
        &self,
        (session_id, task_id, checkpoint): (&str, &str, &str),
        approve: bool,
        by: &str,
        note: &str,
    ) -> Result<(Option<pb::Task>, Vec<pb::Task>), Status> {
        match (task_id.is_empty(), checkpoint.is_empty()) {
            (_, true) => Ok((
                Some(
                    self.answer_gate(session_id, task_id, approve, by, note)
                        .await?,
                ),
                Vec::new(),
            )),
            (true, false) => {
                let tasks = self
                    .coordinator
                    .answer_checkpoint((session_id, checkpoint), approve, (by, note))
                    .await?;
                Ok((None, tasks.iter().map(convert::task_proto).collect()))
            }
            (false, false) => Err(Status::invalid_argument(
                "give task_id or checkpoint, not both",
            )),
        }
    }
}

/// Implements the generated service trait over the domain coordinator.
#[derive(Debug, Clone)]
pub(crate) struct Adapter {
    coordinator: Arc<Coordinator>,
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::SessionEvent, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl coordinator_server::Coordinator for Adapter {
    async fn create_session(
        &self,
        request: Request<pb::CreateSessionRequest>,
    ) -> Result<Response<pb::CreateSessionResponse>, Status> {
        let created = self
            .coordinator
            .create_session(request.into_inner())
            .await?;
        Ok(Response::new(convert::created_proto(created)))
    }

    async fn upload_plan(
        &self,
        request: Request<tonic::Streaming<pb::PlanChunk>>,
    ) -> Result<Response<pb::CreateSessionResponse>, Status> {
        let request = upload::assemble(request.into_inner()).await?;
        let created = self.coordinator.create_session(request).await?;
        Ok(Response::new(convert::created_proto(created)))
    }

    async fn get_session(
        &self,
        request: Request<pb::GetSessionRequest>,
    ) -> Result<Response<pb::GetSessionResponse>, Status> {
        let page = self.coordinator.get_session(&request.into_inner()).await?;
        let figures = self.coordinator.work_progress_of(&page.tasks);
        let mut response = convert::page_proto(page);
        for (task, figures) in response.tasks.iter_mut().zip(figures) {
            task.work_progress = figures;
        }
        Ok(Response::new(response))
    }

    async fn list_tasks(
        &self,
        request: Request<pb::ListTasksRequest>,
    ) -> Result<Response<pb::ListTasksResponse>, Status> {
        let (tasks, next) = self.coordinator.list_tasks(&request.into_inner()).await?;
        let figures = self.coordinator.work_progress_of(&tasks);
        Ok(Response::new(pb::ListTasksResponse {
            tasks: tasks
                .iter()
                .zip(figures)
                .map(|(task, figures)| pb::Task {
                    work_progress: figures,
                    ..convert::task_proto(task)
                })
                .collect(),
            next_page_token: next.unwrap_or_default(),
        }))
    }

    async fn list_sessions(
        &self,
        request: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        let sessions = self.coordinator.list_sessions(request.into_inner()).await?;
        Ok(Response::new(pb::ListSessionsResponse {
            sessions: sessions.into_iter().map(convert::summary_proto).collect(),
        }))
    }

    async fn approve_task(
        &self,
        request: Request<pb::ApproveTaskRequest>,
    ) -> Result<Response<pb::ApproveTaskResponse>, Status> {
        let by = caller(&request);
        let request = request.into_inner();
        let (task, released) = self
            .answer(
                (&request.session_id, &request.task_id, &request.checkpoint),
                true,
                &by,
                &request.note,
            )
            .await?;
        Ok(Response::new(pb::ApproveTaskResponse { task, released }))
    }

    async fn reject_task(
        &self,
        request: Request<pb::RejectTaskRequest>,
    ) -> Result<Response<pb::RejectTaskResponse>, Status> {
        let by = caller(&request);
        let request = request.into_inner();
        let (task, released) = self
            .answer(
                (&request.session_id, &request.task_id, &request.checkpoint),
                false,
                &by,
                &request.note,
            )
            .await?;
        Ok(Response::new(pb::RejectTaskResponse { task, released }))
    }

    async fn cancel_session(
        &self,
        request: Request<pb::CancelSessionRequest>,
    ) -> Result<Response<pb::CancelSessionResponse>, Status> {
        let summary = self
            .coordinator
            .cancel_session(request.into_inner())
            .await?;
        Ok(Response::new(pb::CancelSessionResponse {
            session: Some(convert::summary_proto(summary)),
        }))
    }

    async fn claim_tasks(
        &self,
        request: Request<pb::ClaimTasksRequest>,
    ) -> Result<Response<pb::ClaimTasksResponse>, Status> {
        let claimed = self.coordinator.claim_tasks(request.into_inner()).await?;
        Ok(Response::new(pb::ClaimTasksResponse {
            tasks: convert::claimed_protos(claimed),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let (expires_at, cancel_requested) =
            self.coordinator.heartbeat(request.into_inner()).await?;
        Ok(Response::new(pb::HeartbeatResponse {
            expires_at: Some(timestamp(expires_at)),
            cancel_requested,
        }))
    }

    async fn complete_task(
        &self,
        request: Request<pb::CompleteTaskRequest>,
    ) -> Result<Response<pb::CompleteTaskResponse>, Status> {
        let (task, next) = self.coordinator.complete_task(request.into_inner()).await?;
        Ok(Response::new(pb::CompleteTaskResponse {
            task: Some(convert::task_proto(&task)),
            next: convert::claimed_protos(next),
        }))
    }

    async fn fail_task(
        &self,
        request: Request<pb::FailTaskRequest>,
    ) -> Result<Response<pb::FailTaskResponse>, Status> {
        let (task, retry_at) = self.coordinator.fail_task(request.into_inner()).await?;
        Ok(Response::new(pb::FailTaskResponse {
            task: Some(convert::task_proto(&task)),
            retry_at: opt_timestamp(retry_at),
        }))
    }

    async fn log_message(
        &self,
        request: Request<pb::LogMessageRequest>,
    ) -> Result<Response<pb::LogMessageResponse>, Status> {
        let message = self.coordinator.log_message(request.into_inner()).await?;
        Ok(Response::new(pb::LogMessageResponse {
            message: Some(message),
        }))
    }

    async fn list_messages(
        &self,
        request: Request<pb::ListMessagesRequest>,
    ) -> Result<Response<pb::ListMessagesResponse>, Status> {
        let (messages, next_sequence) =
            self.coordinator.list_messages(request.into_inner()).await?;
        Ok(Response::new(pb::ListMessagesResponse {
            messages,
            next_sequence,
        }))
    }

    async fn get_state(
        &self,
        request: Request<pb::GetStateRequest>,
    ) -> Result<Response<pb::GetStateResponse>, Status> {
        let states = self.coordinator.get_state(request.into_inner()).await?;
        Ok(Response::new(pb::GetStateResponse {
            role_state: states
                .into_iter()
                .map(|(role, state)| (role, json_to_struct(&state)))
                .collect(),
        }))
    }

    async fn update_state(
        &self,
        request: Request<pb::UpdateStateRequest>,
    ) -> Result<Response<pb::UpdateStateResponse>, Status> {
        let (state, message) = self.coordinator.update_state(request.into_inner()).await?;
        Ok(Response::new(pb::UpdateStateResponse {
            state: Some(json_to_struct(&state)),
            message: Some(message),
        }))
    }

    async fn check_session(
        &self,
        request: Request<pb::CheckSessionRequest>,
    ) -> Result<Response<pb::CheckSessionResponse>, Status> {
        let request = request.into_inner();
        let check = self
            .coordinator
            .check_session(&request.session_id, request.max_graph)
            .await?;
        Ok(Response::new(convert::check_proto(check)))
    }

    async fn resume_session(
        &self,
        request: Request<pb::ResumeSessionRequest>,
    ) -> Result<Response<pb::ResumeSessionResponse>, Status> {
        let (reconciled, check) = self
            .coordinator
            .resume_session(&request.into_inner().session_id)
            .await?;
        Ok(Response::new(pb::ResumeSessionResponse {
            reconciled,
            status: Some(convert::check_proto(check)),
        }))
    }

    type WatchSessionStream = EventStream;

    async fn watch_session(
        &self,
        request: Request<pb::WatchSessionRequest>,
    ) -> Result<Response<Self::WatchSessionStream>, Status> {
        let events = self.coordinator.watch_session(request.into_inner()).await?;
        Ok(Response::new(Box::pin(
            events.map(|event| event.map_err(Status::from)),
        )))
    }

    async fn pause_session(
        &self,
        request: Request<pb::PauseSessionRequest>,
    ) -> Result<Response<pb::PauseSessionResponse>, Status> {
        let paused = self.coordinator.pause_session(request.into_inner()).await?;
        Ok(Response::new(pb::PauseSessionResponse {
            session: Some(convert::summary_proto(paused.summary)),
            running_task_ids: paused.running,
        }))
    }

    async fn get_plan_assets(
        &self,
        request: Request<pb::GetPlanAssetsRequest>,
    ) -> Result<Response<pb::GetPlanAssetsResponse>, Status> {
        let digest = request.into_inner().digest;
        let bundle = self.coordinator.get_plan_assets(&digest).await?;
        Ok(Response::new(convert::plan_assets_proto(&digest, &bundle)?))
    }
}
