//! Following a session on a coordinator that may restart.
//!
//! `run --connect`, `import --connect` and `watch` print a session's events until it ends.
//! When the coordinator goes away (killed, restarted, unreachable), the [`Follower`] prints a
//! short notice, reconnects with capped backoff and resumes the watch from its cursor (the
//! last sequence it printed), so every event is printed once and none is missed. It gives up
//! with [`Unreachable`] once the coordinator has been unreachable for the reconnect budget
//! without a break (`--reconnect-seconds`).

use std::future::Future;
use std::time::Duration;

use anyhow::Context;
use tokio::time::Instant;
use tokio_stream::StreamExt;
use troupe_grpc::{CoordinatorClient, is_transient, within};
use troupe_proto::v1::{
    CreateSessionRequest, CreateSessionResponse, GetSessionRequest, GetSessionResponse,
    WatchSessionRequest,
};

use crate::report;

/// Deadline of each unary call and of opening a watch: a stopped coordinator never answers.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Waits between reconnects, and between polls of a stream that ended early.
const RECONNECT: troupe_grpc::Backoff =
    troupe_grpc::Backoff::new(Duration::from_millis(200), Duration::from_secs(5));

/// The coordinator stayed unreachable for longer than the reconnect budget.
#[derive(Debug, thiserror::Error)]
#[error(
    "the coordinator at {url} was unreachable for {:.1} s (the reconnect budget, --reconnect-seconds): {last}",
    waited.as_secs_f64()
)]
pub struct Unreachable {
    /// The coordinator's URL.
    pub url: String,
    /// How long it was unreachable before giving up.
    pub waited: Duration,
    /// The last error.
    pub last: String,
}

/// A call the coordinator did not answer as asked, shown by the status message alone.
#[derive(Debug, thiserror::Error)]
#[error("{} ({:?})", .0.message(), .0.code())]
pub struct CallFailed(pub tonic::Status);

/// A period without the coordinator: when it began, and the next wait.
#[derive(Debug)]
struct Outage {
    since: Instant,
    retries: troupe_grpc::backoff::Retries,
}

/// Talks to one coordinator across its restarts (see the module docs).
#[derive(Debug)]
pub struct Follower {
    client: CoordinatorClient,
    url: String,
    budget: Duration,
    outage: Option<Outage>,
}

impl Follower {
    /// A follower of the coordinator at `url`, called with `connector`'s credentials, that
    /// reconnects for up to `budget` per outage.
    pub fn new(
        connector: &troupe_grpc::Connector,
        url: &str,
        budget: Duration,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            client: connector.coordinator_client(url)?,
            url: url.to_owned(),
            budget,
            outage: None,
        })
    }

    /// Records a transient failure and waits before the next try; fails once the outage
    /// would outlast the budget.
    async fn setback(&mut self, status: &tonic::Status) -> Result<(), Unreachable> {
        let now = Instant::now();
        let outage = self.outage.get_or_insert_with(|| {
            eprintln!(
                "troupe: lost the coordinator at {} ({}); reconnecting for up to {:.0} s",
                self.url,
                describe(status),
                self.budget.as_secs_f64()
            );
            Outage {
                since: now,
                retries: RECONNECT.retries(),
            }
        });
        let waited = now - outage.since;
        if waited >= self.budget {
            return Err(Unreachable {
                url: self.url.clone(),
                waited,
                last: describe(status),
            });
        }
        let delay = outage.retries.next_delay().min(self.budget - waited);
        tokio::time::sleep(delay).await;
        Ok(())
    }

    /// Ends an outage, if one was on, saying where the watch resumes.
    fn reconnected(&mut self, resume_after: Option<u64>) {
        if self.outage.take().is_some() {
            match resume_after {
                Some(cursor) => eprintln!(
                    "troupe: reconnected to {}, resuming after event {cursor}",
                    self.url
                ),
                None => eprintln!("troupe: reconnected to {}", self.url),
            }
        }
    }

    /// Runs a unary call until it succeeds, retrying what `retry` allows within the budget.
    async fn call<T, F, Fut>(
        &mut self,
        retry: fn(&tonic::Status) -> bool,
        mut call: F,
    ) -> anyhow::Result<T>
    where
        F: FnMut(CoordinatorClient) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        loop {
            match within(CALL_TIMEOUT, call(self.client.clone())).await {
                Ok(answer) => {
                    self.reconnected(None);
                    return Ok(answer);
                }
                Err(status) if retry(&status) => self.setback(&status).await?,
                Err(status) => return Err(CallFailed(status).into()),
            }
        }
    }

    /// `CreateSession`, retried only while the request cannot have reached the coordinator
    /// (no connection): a retry after a lost answer would create a second session. A refusal
    /// comes back as the [`CallFailed`] inside the error.
    pub async fn create_session(
        &mut self,
        request: CreateSessionRequest,
    ) -> anyhow::Result<CreateSessionResponse> {
        self.call(never_sent, |mut client| {
            let request = request.clone();
            async move { client.create_session(request).await }
        })
        .await
    }

    /// [`Self::create_session`] of a plan sent in pieces of [`PLAN_PIECE`] bytes
    /// (`UploadPlan`), for plans larger than one message should be; retried the same way.
    pub async fn upload_plan(
        &mut self,
        request: CreateSessionRequest,
    ) -> anyhow::Result<CreateSessionResponse> {
        let request = std::sync::Arc::new(request);
        self.call(never_sent, |mut client| {
            let pieces = plan_pieces(std::sync::Arc::clone(&request));
            async move { client.upload_plan(pieces).await }
        })
        .await
    }

    /// `GetSession`, retried through outages.
    pub async fn get_session(&mut self, session_id: &str) -> anyhow::Result<GetSessionResponse> {
        self.call(is_transient, |mut client| {
            let request = GetSessionRequest {
                session_id: session_id.to_owned(),
                ..Default::default()
            };
            async move { client.get_session(request).await }
        })
        .await
        .with_context(|| format!("reading session {session_id}"))
    }

    /// `tasks`, a session's first page (of `GetSession` or `CreateSession`), with every task
    /// after `page_token` (`ListTasks`, each page retried through outages): the live view
    /// needs them all to size its bars.
    pub async fn with_the_rest(
        &mut self,
        session_id: &str,
        mut tasks: Vec<troupe_proto::v1::Task>,
        mut page_token: String,
    ) -> anyhow::Result<Vec<troupe_proto::v1::Task>> {
        while !page_token.is_empty() {
            let request = troupe_proto::v1::ListTasksRequest {
                session_id: session_id.to_owned(),
                page_size: WHOLE_PAGE,
                page_token,
                ..Default::default()
            };
            let page = self
                .call(is_transient, |mut client| {
                    let request = request.clone();
                    async move { client.list_tasks(request).await }
                })
                .await
                .with_context(|| format!("listing the tasks of session {session_id}"))?;
            tasks.extend(page.tasks);
            page_token = page.next_page_token;
        }
        Ok(tasks)
    }

    /// Every task of a session, for the live view.
    pub async fn all_tasks(
        &mut self,
        session_id: &str,
    ) -> anyhow::Result<Vec<troupe_proto::v1::Task>> {
        let first = self.get_session(session_id).await?;
        self.with_the_rest(session_id, first.tasks, first.next_page_token)
            .await
    }

    /// Shows the session's events after `after` in `view` until the session ends, each exactly
    /// once across reconnects. Returns the last sequence shown (or `after`).
    pub async fn follow_events(
        &mut self,
        session_id: &str,
        after: u64,
        view: &mut dyn crate::live::View,
    ) -> anyhow::Result<u64> {
        let mut cursor = after;
        let mut ended_early = RECONNECT.retries();
        // The cursor at which a replay of an ended session was last asked for.
        let mut replayed_at = None;
        loop {
            let request = WatchSessionRequest {
                session_id: session_id.to_owned(),
                after_sequence: cursor,
                follow: false,
            };
            let mut client = self.client.clone();
            let opened = within(CALL_TIMEOUT, client.watch_session(request)).await;
            let mut events = match opened {
                Ok(events) => events,
                Err(status) if is_transient(&status) => {
                    self.setback(&status).await?;
                    continue;
                }
                Err(status) => {
                    return Err(anyhow::anyhow!(
                        "watching session {session_id}: {}",
                        status.message()
                    ));
                }
            };
            self.reconnected(Some(cursor));
            let broken = loop {
                match events.next().await {
                    Some(Ok(event)) => {
                        // The cursor makes a resumed stream start after it; this also keeps
                        // a replayed event from printing twice.
                        if event.sequence <= cursor {
                            continue;
                        }
                        cursor = event.sequence;
                        ended_early.reset();
                        view.event(&event);
                    }
                    Some(Err(status)) => break Some(status),
                    None => break None,
                }
            };
            match broken {
                Some(status) if is_transient(&status) => self.setback(&status).await?,
                Some(status) => {
                    return Err(anyhow::anyhow!(
                        "session {session_id} event stream failed: {}",
                        status.message()
                    ));
                }
                // The stream ends when the session has ended, or when the coordinator stops
                // (a graceful restart): only the session's state tells which.
                None => {
                    let view = self.get_session(session_id).await?;
                    if let Some(session) = view.session.as_ref()
                        && report::is_terminal(session.state)
                    {
                        // Over, and every event shown: done. A session that ended while the
                        // stream was down (a coordinator restarting) still has events after
                        // the cursor: the stream opens again at once and replays them (once:
                        // a replay that brings nothing new ends it).
                        if cursor >= session.last_sequence || replayed_at == Some(cursor) {
                            return Ok(cursor);
                        }
                        replayed_at = Some(cursor);
                        continue;
                    }
                    tokio::time::sleep(ended_early.next_delay()).await;
                }
            }
        }
    }
}

/// Whether a failed call surely never reached the server (no connection was made).
fn never_sent(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(err) = source {
        if err.is::<tonic::ConnectError>() {
            return true;
        }
        source = err.source();
    }
    false
}

/// A status in a few words, for notices.
fn describe(status: &tonic::Status) -> String {
    let message = status.message();
    if message.is_empty() {
        format!("{:?}", status.code())
    } else {
        format!("{:?}: {message}", status.code())
    }
}

/// Whether an error means the coordinator could not be reached (exit code 69).
pub fn is_unreachable(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause.is::<Unreachable>()
            || cause
                .downcast_ref::<tonic::Status>()
                .is_some_and(is_transient)
            || cause
                .downcast_ref::<CallFailed>()
                .is_some_and(|failed| is_transient(&failed.0))
            || matches!(
                cause.downcast_ref::<crate::ccw_export::ExportError>(),
                Some(crate::ccw_export::ExportError::Rpc {
                    unreachable: true,
                    ..
                })
            )
    })
}

/// Bytes of the plan per `UploadPlan` message.
pub const PLAN_PIECE: usize = 1024 * 1024;

/// An `UploadPlan` stream of `request`: the request without its plan, then the plan in
/// pieces, each copied out only as the stream is sent (no second whole copy of the plan).
pub fn plan_pieces(
    request: std::sync::Arc<CreateSessionRequest>,
) -> impl tokio_stream::Stream<Item = troupe_proto::v1::PlanChunk> + Send + 'static {
    let head = troupe_proto::v1::PlanChunk {
        // Field by field: cloning the request would copy the plan too.
        request: Some(CreateSessionRequest {
            plan_json: String::new(),
            base_dir: request.base_dir.clone(),
            repo_paths: request.repo_paths.clone(),
            dry_run: request.dry_run,
            assets: request.assets.clone(),
            max_tasks: request.max_tasks,
        }),
        plan_json: Vec::new(),
    };
    let len = request.plan_json.len();
    let pieces = (0..len)
        .step_by(PLAN_PIECE)
        .map(move |at| troupe_proto::v1::PlanChunk {
            request: None,
            plan_json: request.plan_json.as_bytes()[at..(at + PLAN_PIECE).min(len)].to_vec(),
        });
    tokio_stream::iter(std::iter::once(head).chain(pieces))
}

/// Tasks per page when a command reads a whole session (the coordinator's largest page).
const WHOLE_PAGE: u32 = 10_000;

/// Reads a session with every one of its tasks: `GetSession`'s first page, then `ListTasks`
/// pages until none is left (for the commands that need them all: `graph`, `report`, the CCW
/// export).
pub async fn whole_session(
    client: &mut troupe_grpc::CoordinatorClient,
    session_id: &str,
) -> Result<GetSessionResponse, tonic::Status> {
    const PAGE: u32 = WHOLE_PAGE;
    let mut response = client
        .get_session(GetSessionRequest {
            session_id: session_id.to_owned(),
            max_tasks: PAGE,
        })
        .await?
        .into_inner();
    let mut token = std::mem::take(&mut response.next_page_token);
    while !token.is_empty() {
        let page = client
            .list_tasks(troupe_proto::v1::ListTasksRequest {
                session_id: session_id.to_owned(),
                page_size: PAGE,
                page_token: token,
                ..Default::default()
            })
            .await?
            .into_inner();
        response.tasks.extend(page.tasks);
        token = page.next_page_token;
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreachable_errors_are_told_apart() {
        let gone = anyhow::Error::new(Unreachable {
            url: "http://h:1".into(),
            waited: Duration::from_secs(3),
            last: "Unavailable: tcp connect error".into(),
        });
        assert!(is_unreachable(&gone));
        assert!(gone.to_string().contains("unreachable for 3.0 s"), "{gone}");
        let down = anyhow::Error::new(tonic::Status::unavailable("down")).context("checking");
        assert!(is_unreachable(&down));
        let refused = anyhow::Error::new(tonic::Status::not_found("no session")).context("x");
        assert!(!is_unreachable(&refused));
        let failed = anyhow::Error::new(CallFailed(tonic::Status::unavailable("tcp connect")));
        assert!(is_unreachable(&failed));
        assert_eq!(failed.to_string(), "tcp connect (Unavailable)");
        assert!(!never_sent(&tonic::Status::unavailable("maybe sent")));
    }
}
