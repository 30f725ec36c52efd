//! The read-only web view (`--web-listen`): the sessions, a session's live DAG, a task's detail
//! and the messages, as server-rendered HTML with one small script and no CDN.
//!
//! Every page reads through the gRPC adapter's own methods, and is authorized as the RPC it
//! stands for (`/troupe.v1.Coordinator/GetSession` for a session's page): the same tokens and
//! scopes as the API ([`troupe_grpc::auth::authorize_as`]). A browser sends its token in an
//! `authorization: Bearer` header, or signs in once at `/login`, which keeps the token in an
//! HTTP-only cookie. The live DAG follows `WatchSession` through server-sent events.

mod pages;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Form, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use futures::{Stream, StreamExt};
use tonic::Request;
use troupe_grpc::auth::ServerAuth;
use troupe_proto::v1::{self as pb, coordinator_server::Coordinator as _};

use crate::grpc::Adapter;

/// Where the web view listens (off unless given).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct WebArgs {
    /// Serve the read-only web view (sessions, live DAG, task detail) on this address, behind
    /// the same tokens as the API.
    #[arg(long, env = "TROUPE_WEB_LISTEN", value_name = "ADDR")]
    pub web_listen: Option<SocketAddr>,
}

/// The most tasks a session's page draws (its DAG is laid out on each update).
const WEB_MAX_TASKS: u32 = 2_000;

/// The cookie `/login` sets: the bearer token, sent back on every page.
const COOKIE: &str = "troupe_token";

#[derive(Clone)]
struct Web {
    adapter: Adapter,
    auth: Arc<ServerAuth>,
}

/// Serves the web view on `listener` until `shutdown` completes.
pub(crate) async fn serve(
    adapter: Adapter,
    auth: ServerAuth,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let web = Web {
        adapter,
        auth: Arc::new(auth),
    };
    let app = axum::Router::new()
        .route("/", get(sessions))
        .route("/login", get(login_form).post(login))
        .route("/sessions/{session}", get(session))
        .route("/sessions/{session}/live", get(live))
        .route("/sessions/{session}/events", get(events))
        .route("/sessions/{session}/tasks/{task}", get(task))
        .route("/sessions/{session}/tasks/{task}/approve", post(approve))
        .route("/sessions/{session}/tasks/{task}/reject", post(reject))
        .route("/static/live.js", get(script))
        .with_state(web);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// A page's failure: the status and a short page saying why.
struct Failure(tonic::Status);

impl From<tonic::Status> for Failure {
    fn from(status: tonic::Status) -> Self {
        Self(status)
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let code = match self.0.code() {
            tonic::Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            tonic::Code::PermissionDenied => StatusCode::FORBIDDEN,
            tonic::Code::NotFound => StatusCode::NOT_FOUND,
            tonic::Code::InvalidArgument => StatusCode::BAD_REQUEST,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let signin = code == StatusCode::UNAUTHORIZED;
        (
            code,
            Html(pages::failure(code.as_u16(), self.0.message(), signin)),
        )
            .into_response()
    }
}

impl Web {
    /// Authorizes the browser's request as a call of `method` on the Coordinator service;
    /// returns who it is (`None` on a server without authentication).
    fn authorize(
        &self,
        method: &str,
        headers: &HeaderMap,
    ) -> Result<Option<troupe_grpc::auth::Principal>, Failure> {
        let mut headers = headers.clone();
        if !headers.contains_key(header::AUTHORIZATION)
            && let Some(token) = cookie(&headers, COOKIE)
            && let Ok(value) = HeaderValue::from_str(&format!("Bearer {token}"))
        {
            headers.insert(header::AUTHORIZATION, value);
        }
        Ok(troupe_grpc::auth::authorize_as(
            &self.auth,
            &format!("/troupe.v1.Coordinator/{method}"),
            &headers,
        )?)
    }

    async fn get_session(&self, session_id: String) -> Result<pb::GetSessionResponse, Failure> {
        Ok(self
            .adapter
            // The view draws at most this many tasks; `counts` still cover the session.
            .get_session(Request::new(pb::GetSessionRequest {
                session_id,
                max_tasks: WEB_MAX_TASKS,
            }))
            .await?
            .into_inner())
    }
}

fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value)
}

async fn sessions(State(web): State<Web>, headers: HeaderMap) -> Result<Html<String>, Failure> {
    web.authorize("ListSessions", &headers)?;
    let listed = web
        .adapter
        .list_sessions(Request::new(pb::ListSessionsRequest {
            state: 0,
            limit: 200,
        }))
        .await?
        .into_inner();
    Ok(Html(pages::sessions(&listed.sessions)))
}

async fn session(
    State(web): State<Web>,
    Path(session_id): Path<String>,
    headers: HeaderMap,
) -> Result<Html<String>, Failure> {
    web.authorize("GetSession", &headers)?;
    web.authorize("ListMessages", &headers)?;
    let view = web.get_session(session_id.clone()).await?;
    let held = web.adapter.held_at_checkpoints(&session_id).await?;
    let messages = web
        .adapter
        .list_messages(Request::new(pb::ListMessagesRequest {
            session_id,
            last: 100,
            ..Default::default()
        }))
        .await?
        .into_inner()
        .messages;
    Ok(Html(pages::session(&view, &held, &messages)))
}

/// The part of a session's page that changes: its DAG and task table.
async fn live(
    State(web): State<Web>,
    Path(session_id): Path<String>,
    headers: HeaderMap,
) -> Result<Html<String>, Failure> {
    web.authorize("GetSession", &headers)?;
    let held = web.adapter.held_at_checkpoints(&session_id).await?;
    let view = web.get_session(session_id).await?;
    Ok(Html(pages::live(&view, &held)))
}

/// `WatchSession` as server-sent events: one `task` event per transition (its data the task
/// id and new state), `session` when the session changes state.
async fn events(
    State(web): State<Web>,
    Path(session_id): Path<String>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, Failure> {
    web.authorize("WatchSession", &headers)?;
    let stream = web
        .adapter
        .watch_session(Request::new(pb::WatchSessionRequest {
            session_id,
            after_sequence: 0,
            follow: true,
        }))
        .await?
        .into_inner();
    let events = stream.filter_map(|event| async move {
        let event = event.ok()?;
        let sse = match event.kind? {
            pb::session_event::Kind::Task(transition) => {
                Event::default().event("task").data(format!(
                    "{} {}",
                    transition.task_id,
                    pb::TaskState::try_from(transition.to)
                        .map_or("unspecified", troupe_proto::names::task_state)
                ))
            }
            pb::session_event::Kind::Session(transition) => Event::default().event("session").data(
                pb::SessionState::try_from(transition.to)
                    .map_or("unspecified", troupe_proto::names::session_state),
            ),
            pb::session_event::Kind::Progress(progress) => {
                Event::default().event("progress").data(progress.task_id)
            }
            pb::session_event::Kind::Message(message) => {
                Event::default().event("message").data(message.id)
            }
        };
        Some(Ok(sse.id(event.sequence.to_string())))
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::default()))
}

async fn task(
    State(web): State<Web>,
    Path((session_id, task_id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Html<String>, Failure> {
    web.authorize("GetSession", &headers)?;
    let view = web.get_session(session_id).await?;
    let task = view
        .tasks
        .iter()
        .find(|task| task.id == task_id)
        .ok_or_else(|| tonic::Status::not_found(format!("no task {task_id} in this session")))?;
    Ok(Html(pages::task(&view, task)))
}

#[derive(serde::Deserialize)]
struct GateForm {
    #[serde(default)]
    note: String,
    /// Set on a task held at a role's checkpoint: the checkpoint is answered.
    #[serde(default)]
    checkpoint: String,
}

async fn approve(
    state: State<Web>,
    path: Path<(String, String)>,
    headers: HeaderMap,
    form: Form<GateForm>,
) -> Result<Redirect, Failure> {
    answer_gate(state, path, headers, form, true).await
}

async fn reject(
    state: State<Web>,
    path: Path<(String, String)>,
    headers: HeaderMap,
    form: Form<GateForm>,
) -> Result<Redirect, Failure> {
    answer_gate(state, path, headers, form, false).await
}

/// A gate's buttons: `ApproveTask` or `RejectTask` (for the task, or for the checkpoint the
/// form names) as the signed-in caller, then back to the session.
async fn answer_gate(
    State(web): State<Web>,
    Path((session_id, task_id)): Path<(String, String)>,
    headers: HeaderMap,
    Form(form): Form<GateForm>,
    approve: bool,
) -> Result<Redirect, Failure> {
    let method = if approve { "ApproveTask" } else { "RejectTask" };
    let principal = web.authorize(method, &headers)?;
    let back = format!("/sessions/{session_id}");
    let (task_id, checkpoint) = if form.checkpoint.is_empty() {
        (task_id, String::new())
    } else {
        (String::new(), form.checkpoint)
    };
    if approve {
        web.adapter
            .approve_task(as_caller(
                Request::new(pb::ApproveTaskRequest {
                    session_id,
                    task_id,
                    note: form.note,
                    checkpoint,
                }),
                principal,
            ))
            .await?;
    } else {
        web.adapter
            .reject_task(as_caller(
                Request::new(pb::RejectTaskRequest {
                    session_id,
                    task_id,
                    note: form.note,
                    checkpoint,
                }),
                principal,
            ))
            .await?;
    }
    Ok(Redirect::to(&back))
}

/// `request` as made by `principal`, as the auth layer marks a gRPC call.
fn as_caller<T>(
    mut request: Request<T>,
    principal: Option<troupe_grpc::auth::Principal>,
) -> Request<T> {
    if let Some(principal) = principal {
        request.extensions_mut().insert(principal);
    }
    request
}

async fn login_form() -> Html<String> {
    Html(pages::login(None))
}

#[derive(serde::Deserialize)]
struct Login {
    token: String,
}

/// Checks the token as a `ListSessions` call and, when it may, keeps it in a cookie.
async fn login(State(web): State<Web>, Form(form): Form<Login>) -> Response {
    let token = form.token.trim().to_owned();
    let mut headers = HeaderMap::new();
    let checked = HeaderValue::from_str(&format!("Bearer {token}"))
        .map_err(|_| Failure(tonic::Status::unauthenticated("a token is plain text")))
        .and_then(|value| {
            headers.insert(header::AUTHORIZATION, value);
            web.authorize("ListSessions", &headers)
        });
    match checked {
        Ok(_) => {
            let cookie = format!("{COOKIE}={token}; HttpOnly; SameSite=Lax; Path=/");
            let mut response = Redirect::to("/").into_response();
            if let Ok(value) = HeaderValue::from_str(&cookie) {
                response.headers_mut().insert(header::SET_COOKIE, value);
            }
            response
        }
        Err(Failure(status)) => (
            StatusCode::UNAUTHORIZED,
            Html(pages::login(Some(status.message()))),
        )
            .into_response(),
    }
}

async fn script() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("live.js"),
    )
}
