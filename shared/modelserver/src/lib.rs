//! A scripted model server for tests that drive real coding-agent CLIs.
//!
//! It speaks the minimal surfaces those CLIs use (measured for docs/agent-clis.md): OpenAI Responses
//! (codex), OpenAI Chat Completions (qwen, opencode, troupe's own `agent` loop), Anthropic
//! Messages (claude) and Gemini `generateContent` / `streamGenerateContent` (gemini), streaming
//! as SSE over chunked HTTP/1.1.
//!
//! Answers are decided statelessly from the conversation in each request, never from a request
//! counter, because retries, resumes, title calls and side agents all hit the same endpoint:
//! the last user turn picks a [`Rule`] (the first whose trigger it contains), the number of tool
//! results since that turn picks the rule's next [`Action`], and once the actions are used up the
//! answer is the final text. The tool is chosen from the request's own `tools` list, so the same
//! script makes `codex` apply a patch, `claude` call `Write`, `gemini`/`qwen` call `write_file`
//! and `opencode` call `write`.
//!
//! Faults are injected per request by a path prefix in the base URL: `/__401/`, `/__429/`
//! (with `retry-after`), `/__500/`, `/__529/`, `/__hang/` (accept, never answer);
//! [`ServerHandle::close`] or [`refused_url`] give connection refused.
//!
//! A provider's limits are played by [`Script::limited_to`]: each model call takes a set time,
//! and a call beyond the allowed number at once is answered 429 with `retry-after`; the
//! handle counts the peak of calls at once and the calls refused.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, Response, StatusCode, Uri};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// Token counts reported for every model call.
pub const INPUT_TOKENS: u64 = 123;
/// Output tokens reported for every model call.
pub const OUTPUT_TOKENS: u64 = 45;

/// One step the scripted model asks the agent to take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Write `content` to `path` (relative to the working directory named in the request).
    WriteFile {
        /// Relative path.
        path: String,
        /// Whole new content.
        content: String,
    },
    /// Read a file (troupe's `agent` loop: `read_file`; CLIs: `Read`/`read_file`/`read`).
    ReadFile {
        /// Relative path.
        path: String,
    },
    /// Replace `search` by `replace` in `path` (troupe's `agent` loop: `edit_file`).
    Edit {
        /// Relative path.
        path: String,
        /// Text to find.
        search: String,
        /// Replacement.
        replace: String,
    },
    /// Run a shell command (codex `exec_command`, claude `Bash`, gemini/qwen
    /// `run_shell_command`, opencode `bash`, troupe's `agent` loop `run` with an argv).
    Shell {
        /// The command line, or for the `agent` loop's `run` tool the argv joined by spaces.
        command: String,
    },
}

/// A trigger and what to do when the last user turn contains it.
#[derive(Debug, Clone)]
pub struct Rule {
    /// Substring of the last user turn that selects this rule.
    pub trigger: String,
    /// Tool calls, one per model call, in order.
    pub actions: Vec<Action>,
    /// The final message once the actions are done.
    pub final_text: String,
}

/// What the scripted model does.
#[derive(Debug, Clone, Default)]
pub struct Script {
    /// Rules, first match wins.
    pub rules: Vec<Rule>,
    /// When set, a model call must carry this credential (`authorization: Bearer <it>`,
    /// `x-api-key` or `x-goog-api-key`), or it gets a 401.
    pub required_key: Option<String>,
    /// Model calls allowed at once; a call beyond them is answered 429 with `retry-after`
    /// [`Script::retry_after`] (none: no limit).
    pub max_concurrent: Option<usize>,
    /// How long each model call takes before it is answered.
    pub call_time: Duration,
    /// The `retry-after` (whole seconds) of a 429 for calls beyond `max_concurrent`.
    pub retry_after: u64,
}

impl Script {
    /// One rule: when the prompt contains `trigger`, write `content` to `path`, then say done.
    pub fn write_file(trigger: &str, path: &str, content: &str) -> Self {
        Self::default().rule(
            trigger,
            vec![Action::WriteFile {
                path: path.to_owned(),
                content: content.to_owned(),
            }],
        )
    }

    /// Answers 401 to any model call that does not carry `key` (as a bearer or API key).
    pub fn requiring_key(mut self, key: &str) -> Self {
        self.required_key = Some(key.to_owned());
        self
    }

    /// Plays a provider's limits: each model call takes `call_time`, and at most `max` are
    /// served at once; beyond that a call is answered 429 with `retry-after: retry_after`.
    pub fn limited_to(mut self, max: usize, call_time: Duration, retry_after: u64) -> Self {
        self.max_concurrent = Some(max);
        self.call_time = call_time;
        self.retry_after = retry_after;
        self
    }

    /// Each model call takes `call_time` (no limit on calls at once).
    pub fn taking(mut self, call_time: Duration) -> Self {
        self.call_time = call_time;
        self
    }

    /// Adds a rule with a default final text.
    pub fn rule(mut self, trigger: &str, actions: Vec<Action>) -> Self {
        self.rules.push(Rule {
            trigger: trigger.to_owned(),
            final_text: format!("done: {trigger}"),
            actions,
        });
        self
    }
}

/// A request the server received.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// HTTP method.
    pub method: String,
    /// Path and query as received (with any fault prefix).
    pub path: String,
    /// Which surface answered: `responses`, `chat`, `anthropic`, `gemini`, `other`.
    pub api: &'static str,
    /// The JSON body (`Null` when empty or not JSON).
    pub body: Value,
    /// `authorization` / `x-api-key` / `x-goog-api-key`, whichever came.
    pub api_key: Option<String>,
}

impl Recorded {
    /// The body as text, for substring assertions.
    pub fn body_text(&self) -> String {
        self.body.to_string()
    }
}

#[derive(Debug)]
struct State {
    script: Script,
    requests: Mutex<Vec<Recorded>>,
    stop: CancellationToken,
    /// Model calls being answered now.
    active: AtomicUsize,
    /// The most model calls at once so far (refused ones included).
    peak: AtomicUsize,
    /// Model calls answered 429 for being beyond `max_concurrent`.
    refused: AtomicUsize,
}

/// One model call in progress; leaving (answered, or the client gone) frees its place.
struct InCall<'a>(&'a AtomicUsize);

impl Drop for InCall<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A running server. Dropping it stops the server.
#[derive(Debug)]
pub struct ServerHandle {
    state: Arc<State>,
    addr: SocketAddr,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// The scripted model server.
#[derive(Debug, Clone, Copy)]
pub struct ModelServer;

impl ModelServer {
    /// Starts a server on `127.0.0.1:0`; returns its base URL (`http://127.0.0.1:PORT`, no
    /// path) and the handle that records requests and stops it.
    pub async fn start(script: Script) -> std::io::Result<(String, ServerHandle)> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            script,
            requests: Mutex::new(Vec::new()),
            stop: CancellationToken::new(),
            active: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            refused: AtomicUsize::new(0),
        });
        let shared = Arc::clone(&state);
        let app = axum::Router::new().fallback(
            move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
                let state = Arc::clone(&shared);
                async move { handle(&state, &method, &uri, &headers, &body).await }
            },
        );
        let stop = state.stop.clone();
        let task = tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned());
            let _ = serve.await;
        });
        Ok((
            format!("http://{addr}"),
            ServerHandle {
                state,
                addr,
                task: Some(task),
            },
        ))
    }
}

impl ServerHandle {
    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.state
            .requests
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }

    /// The most model calls that were in progress at once (refused ones included).
    pub fn peak_concurrency(&self) -> usize {
        self.state.peak.load(Ordering::SeqCst)
    }

    /// Model calls answered 429 for going beyond [`Script::limited_to`]'s limit.
    pub fn refused(&self) -> usize {
        self.state.refused.load(Ordering::SeqCst)
    }

    /// Stops listening (later connections are refused) and ends hung answers.
    pub async fn close(&mut self) {
        self.state.stop.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.state.stop.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A base URL where nothing listens: connections are refused.
pub async fn refused_url() -> std::io::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    drop(listener);
    Ok(format!("http://{addr}"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Responses,
    Chat,
    Anthropic,
    Gemini { stream: bool },
    CountTokens,
    Models,
    Other,
}

impl Api {
    fn name(self) -> &'static str {
        match self {
            Self::Responses => "responses",
            Self::Chat => "chat",
            Self::Anthropic | Self::CountTokens => "anthropic",
            Self::Gemini { .. } => "gemini",
            Self::Models | Self::Other => "other",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Status(u16),
    Hang,
}

fn classify(path: &str) -> (Api, Option<Fault>, Option<String>) {
    let mut fault = None;
    let mut forced_tool = None;
    for segment in path.split('/') {
        match segment {
            "__401" => fault = Some(Fault::Status(401)),
            "__429" => fault = Some(Fault::Status(429)),
            "__500" => fault = Some(Fault::Status(500)),
            "__529" => fault = Some(Fault::Status(529)),
            "__hang" => fault = Some(Fault::Hang),
            other => {
                if let Some(tool) = other.strip_prefix("__tool_") {
                    forced_tool = Some(tool.to_owned());
                }
            }
        }
    }
    let api = if path.ends_with("/responses") {
        Api::Responses
    } else if path.ends_with("/chat/completions") {
        Api::Chat
    } else if path.ends_with("/messages/count_tokens") {
        Api::CountTokens
    } else if path.ends_with("/messages") {
        Api::Anthropic
    } else if path.ends_with(":streamGenerateContent") {
        Api::Gemini { stream: true }
    } else if path.ends_with(":generateContent") {
        Api::Gemini { stream: false }
    } else if path.ends_with("/models") {
        Api::Models
    } else {
        Api::Other
    };
    (api, fault, forced_tool)
}

async fn handle(
    state: &State,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
) -> Response<Body> {
    let path = uri.path();
    let (api, fault, forced_tool) = classify(path);
    let body: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let api_key = ["authorization", "x-api-key", "x-goog-api-key"]
        .iter()
        .find_map(|h| headers.get(*h))
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if let Ok(mut requests) = state.requests.lock() {
        requests.push(Recorded {
            method: method.to_string(),
            path: uri
                .path_and_query()
                .map_or_else(|| path.to_owned(), ToString::to_string),
            api: api.name(),
            body: body.clone(),
            api_key,
        });
    }
    let presented = ["authorization", "x-api-key", "x-goog-api-key"]
        .iter()
        .filter_map(|h| headers.get(*h))
        .filter_map(|v| v.to_str().ok())
        .map(|v| v.strip_prefix("Bearer ").unwrap_or(v).to_owned())
        .collect::<Vec<_>>();
    let refused = state
        .script
        .required_key
        .as_ref()
        .is_some_and(|key| !presented.contains(key));
    let fault = if refused && !matches!(api, Api::Other) {
        Some(Fault::Status(401))
    } else {
        fault
    };
    match fault {
        Some(Fault::Hang) => {
            state.stop.cancelled().await;
            return plain(StatusCode::SERVICE_UNAVAILABLE, "server closed");
        }
        Some(Fault::Status(code)) => return error_response(api, code),
        None => {}
    }
    match api {
        Api::Models => json_response(json!({"object": "list", "data": [
            {"id": "fake-model", "object": "model", "owned_by": "troupe"}
        ]})),
        Api::CountTokens => json_response(json!({"input_tokens": INPUT_TOKENS})),
        Api::Other => plain(StatusCode::NOT_FOUND, "not found"),
        _ => {
            let now = state.active.fetch_add(1, Ordering::SeqCst) + 1;
            let _in_call = InCall(&state.active);
            state.peak.fetch_max(now, Ordering::SeqCst);
            if state.script.max_concurrent.is_some_and(|max| now > max) {
                state.refused.fetch_add(1, Ordering::SeqCst);
                return limited_response(api, state.script.retry_after);
            }
            if !state.script.call_time.is_zero() {
                tokio::select! {
                    () = state.stop.cancelled() => return plain(StatusCode::SERVICE_UNAVAILABLE, "server closed"),
                    () = tokio::time::sleep(state.script.call_time) => {}
                }
            }
            let convo = conversation(api, &body);
            let reply = decide(&state.script, &convo, forced_tool.as_deref(), &body);
            render(api, &body, &reply)
        }
    }
}

fn plain(status: StatusCode, text: &'static str) -> Response<Body> {
    let mut response = Response::new(Body::from(text));
    *response.status_mut() = status;
    response
}

fn json_response(value: Value) -> Response<Body> {
    let mut response = Response::new(Body::from(value.to_string()));
    response.headers_mut().insert(
        "content-type",
        axum::http::HeaderValue::from_static("application/json"),
    );
    response
}

fn error_response(api: Api, code: u16) -> Response<Body> {
    let (oa_type, an_type, g_status, text) = match code {
        401 => (
            "invalid_request_error",
            "authentication_error",
            "UNAUTHENTICATED",
            "Incorrect API key provided: fake-key.",
        ),
        429 => (
            "rate_limit_exceeded",
            "rate_limit_error",
            "RESOURCE_EXHAUSTED",
            "Rate limit reached for fake-model",
        ),
        529 => (
            "server_error",
            "overloaded_error",
            "UNAVAILABLE",
            "Overloaded",
        ),
        _ => (
            "server_error",
            "api_error",
            "INTERNAL",
            "The server had an error",
        ),
    };
    let message = format!("{text} (fake {code})");
    let body = match api {
        Api::Anthropic | Api::CountTokens => {
            json!({"type": "error", "error": {"type": an_type, "message": message}})
        }
        Api::Gemini { .. } => {
            json!({"error": {"code": code, "message": format!("fake {code} ({g_status})"), "status": g_status}})
        }
        _ => json!({"error": {"message": message, "type": oa_type, "code": oa_type}}),
    };
    let mut response = json_response(body);
    *response.status_mut() =
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if code == 429 {
        response
            .headers_mut()
            .insert("retry-after", axum::http::HeaderValue::from_static("1"));
    }
    response
}

/// A 429 for a call beyond the limit, with `retry-after: seconds`.
fn limited_response(api: Api, seconds: u64) -> Response<Body> {
    let mut response = error_response(api, 429);
    if let Ok(value) = axum::http::HeaderValue::from_str(&seconds.to_string()) {
        response.headers_mut().insert("retry-after", value);
    }
    response
}

/// What a request's conversation looks like, whatever the surface.
#[derive(Debug, Default)]
struct Conversation {
    /// Text of the trailing user turn (empty when the last message is a tool result).
    last_user: String,
    /// Tool results after the last user text message.
    tool_results: usize,
    /// User text messages in the whole conversation.
    user_turns: usize,
    /// Tools offered: name → parameter property names (`custom` tools have none).
    tools: Vec<(String, Vec<String>, bool)>,
    /// User-side messages in order: `(is_tool_result, text)`.
    items: Vec<(bool, String)>,
}

fn text_of(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Array(items) => items
            .iter()
            .filter_map(|item| {
                item.get("text")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
                    .or_else(|| item.as_str().map(str::to_owned))
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

fn props(schema: Option<&Value>) -> Vec<String> {
    schema
        .and_then(|s| s.get("properties"))
        .and_then(Value::as_object)
        .map(|p| p.keys().cloned().collect())
        .unwrap_or_default()
}

/// `items` are the user-side messages in order: `(is_tool_result, text)`. Tool results at the
/// end count as steps taken; the user text messages right before them form the last turn
/// (codex sends its environment context and the prompt as two adjacent user messages).
fn tally(conv: &mut Conversation, items: &[(bool, String)]) {
    conv.user_turns = items.iter().filter(|(tool, _)| !tool).count();
    let results = items.iter().rev().take_while(|(tool, _)| *tool).count();
    let mut turn: Vec<&str> = items
        .iter()
        .rev()
        .skip(results)
        .take_while(|(tool, _)| !tool)
        .map(|(_, text)| text.as_str())
        .collect();
    turn.reverse();
    conv.last_user = turn.join("\n");
    conv.tool_results = results;
}

fn conversation(api: Api, body: &Value) -> Conversation {
    let mut conv = Conversation::default();
    // (is_tool_result, text) for user-side messages, in order; assistant messages are skipped.
    let mut items: Vec<(bool, String)> = Vec::new();
    let empty = Vec::new();
    match api {
        Api::Responses => {
            for item in body
                .get("input")
                .and_then(Value::as_array)
                .unwrap_or(&empty)
            {
                let kind = item
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("message");
                if kind.ends_with("_output") {
                    items.push((true, String::new()));
                } else if kind == "message"
                    && item.get("role").and_then(Value::as_str) == Some("user")
                {
                    items.push((false, text_of(item.get("content").unwrap_or(&Value::Null))));
                }
            }
            for tool in body
                .get("tools")
                .and_then(Value::as_array)
                .unwrap_or(&empty)
            {
                let name = tool.get("name").and_then(Value::as_str).unwrap_or_default();
                let custom = tool.get("type").and_then(Value::as_str) == Some("custom");
                conv.tools
                    .push((name.to_owned(), props(tool.get("parameters")), custom));
            }
        }
        Api::Chat => {
            for msg in body
                .get("messages")
                .and_then(Value::as_array)
                .unwrap_or(&empty)
            {
                match msg.get("role").and_then(Value::as_str) {
                    Some("tool") => items.push((true, String::new())),
                    Some("user") => {
                        items.push((false, text_of(msg.get("content").unwrap_or(&Value::Null))));
                    }
                    _ => {}
                }
            }
            for tool in body
                .get("tools")
                .and_then(Value::as_array)
                .unwrap_or(&empty)
            {
                let f = tool.get("function").unwrap_or(tool);
                let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
                conv.tools
                    .push((name.to_owned(), props(f.get("parameters")), false));
            }
        }
        Api::Anthropic => {
            for msg in body
                .get("messages")
                .and_then(Value::as_array)
                .unwrap_or(&empty)
            {
                if msg.get("role").and_then(Value::as_str) != Some("user") {
                    continue;
                }
                let content = msg.get("content").unwrap_or(&Value::Null);
                let results = content.as_array().map_or(0, |blocks| {
                    blocks
                        .iter()
                        .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
                        .count()
                });
                // Claude Code sends the results of consecutive tool calls in one user message:
                // each result is a step taken.
                items.push((results > 0, text_of(content)));
                for _ in 1..results {
                    items.push((true, String::new()));
                }
            }
            for tool in body
                .get("tools")
                .and_then(Value::as_array)
                .unwrap_or(&empty)
            {
                let name = tool.get("name").and_then(Value::as_str).unwrap_or_default();
                conv.tools
                    .push((name.to_owned(), props(tool.get("input_schema")), false));
            }
        }
        Api::Gemini { .. } => {
            for content in body
                .get("contents")
                .and_then(Value::as_array)
                .unwrap_or(&empty)
            {
                if content.get("role").and_then(Value::as_str) == Some("model") {
                    continue;
                }
                let parts = content
                    .get("parts")
                    .and_then(Value::as_array)
                    .unwrap_or(&empty);
                let has_result = parts.iter().any(|p| p.get("functionResponse").is_some());
                items.push((has_result, text_of(&Value::Array(parts.clone()))));
            }
            for tool in body
                .get("tools")
                .and_then(Value::as_array)
                .unwrap_or(&empty)
            {
                for decl in tool
                    .get("functionDeclarations")
                    .and_then(Value::as_array)
                    .unwrap_or(&empty)
                {
                    let name = decl.get("name").and_then(Value::as_str).unwrap_or_default();
                    let schema = decl
                        .get("parametersJsonSchema")
                        .or_else(|| decl.get("parameters"));
                    conv.tools.push((name.to_owned(), props(schema), false));
                }
            }
        }
        Api::CountTokens | Api::Models | Api::Other => {}
    }
    tally(&mut conv, &items);
    conv.items = items;
    conv
}

/// What to answer.
#[derive(Debug)]
enum Reply {
    Text(String),
    /// Tool name, JSON arguments (or freeform input for custom tools), custom?
    Tool {
        name: String,
        input: Value,
        custom: bool,
    },
}

fn working_dir(body: &Value) -> Option<String> {
    let text = body.to_string();
    let re = regex::Regex::new(r#"(?i)working directory:\s*(/[^\s<`'"\\]+)"#).ok()?;
    // The last mention wins: a resumed conversation still carries the earlier prompts.
    let found = re.captures_iter(&text).last()?.get(1)?.as_str();
    Some(found.trim_end_matches(['.', ',', ')']).to_owned())
}

fn absolute(cwd: Option<&str>, path: &str) -> String {
    match cwd {
        Some(dir) if !path.starts_with('/') => format!("{}/{path}", dir.trim_end_matches('/')),
        _ => path.to_owned(),
    }
}

fn pick<'a>(
    tools: &'a [(String, Vec<String>, bool)],
    names: &[&str],
    forced: Option<&str>,
) -> Option<&'a (String, Vec<String>, bool)> {
    if let Some(forced) = forced {
        return tools.iter().find(|(n, _, _)| n == forced);
    }
    names
        .iter()
        .find_map(|want| tools.iter().find(|(n, _, _)| n == want))
}

fn arg_name<'a>(props: &'a [String], candidates: &[&'a str]) -> &'a str {
    candidates
        .iter()
        .copied()
        .find(|c| props.iter().any(|p| p == c))
        .unwrap_or(candidates[0])
}

fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

fn tool_call(action: &Action, conv: &Conversation, forced: Option<&str>, body: &Value) -> Reply {
    let cwd = working_dir(body);
    let cwd = cwd.as_deref();
    let shell_names = [
        "exec_command",
        "Bash",
        "run_shell_command",
        "bash",
        "run",
        "shell",
    ];
    let shell = |command: &str| -> Reply {
        let Some((name, props, _)) = pick(&conv.tools, &shell_names, forced) else {
            return Reply::Text(format!("no shell tool offered; wanted to run {command}"));
        };
        let input = match name.as_str() {
            "exec_command" => json!({"cmd": command}),
            "run" => json!({"argv": command.split_whitespace().collect::<Vec<_>>()}),
            "bash" => json!({"command": command, "description": "run a command"}),
            _ => {
                let key = arg_name(props, &["command", "cmd"]);
                json!({ key: command })
            }
        };
        Reply::Tool {
            name: name.clone(),
            input,
            custom: false,
        }
    };
    match action {
        Action::WriteFile { path, content } => {
            let write_names = ["apply_patch", "Write", "write_file", "write"];
            match pick(&conv.tools, &write_names, forced) {
                Some((name, _, true)) if name == "apply_patch" => {
                    let mut patch = format!("*** Begin Patch\n*** Add File: {path}\n");
                    for line in content.lines() {
                        patch.push('+');
                        patch.push_str(line);
                        patch.push('\n');
                    }
                    patch.push_str("*** End Patch\n");
                    Reply::Tool {
                        name: name.clone(),
                        input: Value::String(patch),
                        custom: true,
                    }
                }
                Some((name, props, _)) if name != "apply_patch" => {
                    let key = arg_name(props, &["file_path", "filePath", "path"]);
                    let value = if key == "path"
                        && name == "write_file"
                        && !props.contains(&"file_path".to_owned())
                    {
                        path.clone()
                    } else {
                        absolute(cwd, path)
                    };
                    Reply::Tool {
                        name: name.clone(),
                        input: json!({ key: value, "content": content }),
                        custom: false,
                    }
                }
                _ => shell(&format!(
                    "printf %s {} > {}",
                    shell_quote(content),
                    shell_quote(path)
                )),
            }
        }
        Action::ReadFile { path } => {
            let names = ["read_file", "Read", "read"];
            match pick(&conv.tools, &names, forced) {
                Some((name, props, _)) => {
                    let key = arg_name(props, &["file_path", "filePath", "path", "absolute_path"]);
                    let value = if key == "path" {
                        path.clone()
                    } else {
                        absolute(cwd, path)
                    };
                    Reply::Tool {
                        name: name.clone(),
                        input: json!({ key: value }),
                        custom: false,
                    }
                }
                None => shell(&format!("cat {}", shell_quote(path))),
            }
        }
        Action::Edit {
            path,
            search,
            replace,
        } => {
            let names = ["edit_file", "Edit", "replace", "edit"];
            match pick(&conv.tools, &names, forced) {
                Some((name, props, _)) => {
                    let key = arg_name(props, &["file_path", "filePath", "path"]);
                    let value = if key == "path" {
                        path.clone()
                    } else {
                        absolute(cwd, path)
                    };
                    let (old, new) = if props.iter().any(|p| p == "oldString") {
                        ("oldString", "newString")
                    } else if props.iter().any(|p| p == "old_string") {
                        ("old_string", "new_string")
                    } else {
                        ("search", "replace")
                    };
                    Reply::Tool {
                        name: name.clone(),
                        input: json!({ key: value, old: search, new: replace }),
                        custom: false,
                    }
                }
                None => Reply::Text(format!("no edit tool offered for {path}")),
            }
        }
        Action::Shell { command } => shell(command),
    }
}

/// Walks back to the latest user message that triggers a rule; the tool results after it are
/// the steps already taken. Other user text in between (reminders, interruptions) is ignored.
fn decide(script: &Script, conv: &Conversation, forced: Option<&str>, body: &Value) -> Reply {
    let mut steps = 0;
    let mut found = None;
    for (is_tool, text) in conv.items.iter().rev() {
        if *is_tool {
            steps += 1;
            continue;
        }
        if let Some(rule) = script
            .rules
            .iter()
            .find(|rule| text.contains(&rule.trigger))
        {
            found = Some(rule);
            break;
        }
    }
    // A trailing turn split over several messages (codex: context, then prompt) also counts.
    let found = found.or_else(|| {
        script
            .rules
            .iter()
            .find(|rule| conv.tool_results == 0 && conv.last_user.contains(&rule.trigger))
    });
    let Some(rule) = found else {
        return Reply::Text(format!(
            "nothing to do (scripted model; user_turns={})",
            conv.user_turns
        ));
    };
    match rule.actions.get(steps) {
        Some(action) if !conv.tools.is_empty() => tool_call(action, conv, forced, body),
        _ => Reply::Text(format!(
            "{} (scripted model; user_turns={})",
            rule.final_text, conv.user_turns
        )),
    }
}

fn sse(events: Vec<(Option<&str>, Value)>, done: bool) -> Response<Body> {
    let mut chunks: Vec<Result<Bytes, std::io::Error>> = events
        .into_iter()
        .map(|(event, data)| {
            let text = match event {
                Some(name) => format!("event: {name}\ndata: {data}\n\n"),
                None => format!("data: {data}\n\n"),
            };
            Ok(Bytes::from(text))
        })
        .collect();
    if done {
        chunks.push(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
    }
    let mut response = Response::new(Body::from_stream(futures::stream::iter(chunks)));
    let headers = response.headers_mut();
    headers.insert(
        "content-type",
        axum::http::HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(
        "cache-control",
        axum::http::HeaderValue::from_static("no-cache"),
    );
    response
}

fn call_id() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    format!(
        "call_{:08x}",
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

/// A value shaped like `schema` (for gemini's router and other structured side calls).
fn example(schema: &Value) -> Value {
    if let Some(first) = schema
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|e| e.first())
    {
        return first.clone();
    }
    let kind = schema
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("object")
        .to_ascii_lowercase();
    match kind.as_str() {
        "string" => Value::String("simple".to_owned()),
        "integer" | "number" => json!(1),
        "boolean" => Value::Bool(false),
        "array" => Value::Array(Vec::new()),
        _ => Value::Object(
            schema
                .get("properties")
                .and_then(Value::as_object)
                .map(|p| p.iter().map(|(k, v)| (k.clone(), example(v))).collect())
                .unwrap_or_default(),
        ),
    }
}

fn render(api: Api, body: &Value, reply: &Reply) -> Response<Body> {
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    match api {
        Api::Responses => render_responses(reply),
        Api::Chat => render_chat(reply, stream),
        Api::Anthropic => render_anthropic(reply, stream),
        Api::Gemini { stream } => render_gemini(body, reply, stream),
        _ => plain(StatusCode::NOT_FOUND, "not found"),
    }
}

fn render_responses(reply: &Reply) -> Response<Body> {
    let item = match reply {
        Reply::Text(text) => {
            json!({"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]})
        }
        Reply::Tool {
            name,
            input,
            custom: true,
        } => {
            json!({"type": "custom_tool_call", "id": "ctc_1", "status": "completed", "call_id": call_id(), "name": name,
            "input": input.as_str().unwrap_or_default()})
        }
        Reply::Tool { name, input, .. } => {
            json!({"type": "function_call", "id": "fc_1", "status": "completed", "call_id": call_id(),
            "name": name, "arguments": input.to_string()})
        }
    };
    let mut added = item.clone();
    if let Some(obj) = added.as_object_mut() {
        obj.insert("status".to_owned(), json!("in_progress"));
    }
    let mut events = vec![
        (
            Some("response.created"),
            json!({"type": "response.created", "response": {"id": "resp_1", "status": "in_progress", "output": []}}),
        ),
        (
            Some("response.output_item.added"),
            json!({"type": "response.output_item.added", "output_index": 0, "item": added}),
        ),
    ];
    if let Reply::Text(text) = reply {
        events.push((
            Some("response.output_text.delta"),
            json!({"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": text}),
        ));
    }
    events.push((
        Some("response.output_item.done"),
        json!({"type": "response.output_item.done", "output_index": 0, "item": item}),
    ));
    events.push((
        Some("response.completed"),
        json!({"type": "response.completed", "response": {"id": "resp_1", "status": "completed", "output": [item],
            "usage": {"input_tokens": INPUT_TOKENS, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": OUTPUT_TOKENS, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": INPUT_TOKENS + OUTPUT_TOKENS}}}),
    ));
    sse(events, false)
}

fn chat_usage() -> Value {
    json!({"prompt_tokens": INPUT_TOKENS, "completion_tokens": OUTPUT_TOKENS, "total_tokens": INPUT_TOKENS + OUTPUT_TOKENS})
}

fn render_chat(reply: &Reply, stream: bool) -> Response<Body> {
    let base = json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "fake-model"});
    let with = |choices: Value, usage: Option<Value>| {
        let mut chunk = base.clone();
        if let Some(obj) = chunk.as_object_mut() {
            obj.insert("choices".to_owned(), choices);
            if let Some(usage) = usage {
                obj.insert("usage".to_owned(), usage);
            }
        }
        chunk
    };
    let (message, finish) = match reply {
        Reply::Text(text) => (json!({"role": "assistant", "content": text}), "stop"),
        Reply::Tool { name, input, .. } => (
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": call_id(), "type": "function", "function": {"name": name, "arguments": input.to_string()}}
            ]}),
            "tool_calls",
        ),
    };
    if !stream {
        return json_response(json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "fake-model",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": chat_usage(),
        }));
    }
    let mut events = vec![(
        None,
        with(
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]),
            None,
        ),
    )];
    match reply {
        Reply::Text(text) => events.push((
            None,
            with(
                json!([{"index": 0, "delta": {"content": text}, "finish_reason": null}]),
                None,
            ),
        )),
        Reply::Tool { .. } => {
            let call = &message["tool_calls"][0];
            let args = call["function"]["arguments"]
                .as_str()
                .unwrap_or("{}")
                .to_owned();
            events.push((
                None,
                with(
                    json!([{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                        "function": {"name": call["function"]["name"], "arguments": ""}}]}, "finish_reason": null}]),
                    None,
                ),
            ));
            // Arguments arrive in fragments, as real servers send them.
            let mid = args.len() / 2;
            let split = (mid..args.len())
                .find(|i| args.is_char_boundary(*i))
                .unwrap_or(args.len());
            for part in [&args[..split], &args[split..]] {
                events.push((
                    None,
                    with(
                        json!([{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": part}}]}, "finish_reason": null}]),
                        None,
                    ),
                ));
            }
        }
    }
    events.push((
        None,
        with(
            json!([{"index": 0, "delta": {}, "finish_reason": finish}]),
            None,
        ),
    ));
    events.push((None, with(json!([]), Some(chat_usage()))));
    sse(events, true)
}

fn render_anthropic(reply: &Reply, stream: bool) -> Response<Body> {
    let (block, stop) = match reply {
        Reply::Text(text) => (json!({"type": "text", "text": text}), "end_turn"),
        Reply::Tool { name, input, .. } => (
            json!({"type": "tool_use", "id": format!("toolu_{}", call_id()), "name": name, "input": input}),
            "tool_use",
        ),
    };
    let usage = json!({"input_tokens": INPUT_TOKENS, "output_tokens": OUTPUT_TOKENS,
        "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0});
    if !stream {
        return json_response(
            json!({"id": "msg_1", "type": "message", "role": "assistant", "model": "fake-model",
            "content": [block], "stop_reason": stop, "stop_sequence": null, "usage": usage}),
        );
    }
    let (start, delta) = match reply {
        Reply::Text(text) => (
            json!({"type": "text", "text": ""}),
            json!({"type": "text_delta", "text": text}),
        ),
        Reply::Tool { input, .. } => {
            let mut start = block.clone();
            if let Some(obj) = start.as_object_mut() {
                obj.insert("input".to_owned(), json!({}));
            }
            (
                start,
                json!({"type": "input_json_delta", "partial_json": input.to_string()}),
            )
        }
    };
    let events = vec![
        (
            Some("message_start"),
            json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
                "model": "fake-model", "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": INPUT_TOKENS, "output_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}}),
        ),
        (
            Some("content_block_start"),
            json!({"type": "content_block_start", "index": 0, "content_block": start}),
        ),
        (
            Some("content_block_delta"),
            json!({"type": "content_block_delta", "index": 0, "delta": delta}),
        ),
        (
            Some("content_block_stop"),
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            Some("message_delta"),
            json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null},
                "usage": {"output_tokens": OUTPUT_TOKENS}}),
        ),
        (Some("message_stop"), json!({"type": "message_stop"})),
    ];
    sse(events, false)
}

fn render_gemini(body: &Value, reply: &Reply, stream: bool) -> Response<Body> {
    let config = body.get("generationConfig");
    let schema = config.and_then(|c| {
        c.get("responseJsonSchema")
            .or_else(|| c.get("responseSchema"))
    });
    let part = match (schema, reply) {
        (Some(schema), _) => json!({"text": example(schema).to_string()}),
        (None, Reply::Text(text)) => json!({"text": text}),
        (None, Reply::Tool { name, input, .. }) => {
            json!({"functionCall": {"name": name, "args": input}})
        }
    };
    let chunk = json!({
        "candidates": [{"content": {"role": "model", "parts": [part]}, "finishReason": "STOP", "index": 0}],
        "usageMetadata": {"promptTokenCount": INPUT_TOKENS, "candidatesTokenCount": OUTPUT_TOKENS,
            "totalTokenCount": INPUT_TOKENS + OUTPUT_TOKENS},
        "modelVersion": "fake-model",
    });
    if stream {
        sse(vec![(None, chunk)], false)
    } else {
        json_response(chunk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailing_tool_results_pick_the_next_action() {
        let body = json!({"messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "please write hello.txt. Working directory: /w/x"},
            {"role": "assistant", "content": null},
            {"role": "tool", "content": "ok"},
        ], "tools": [{"type": "function", "function": {"name": "write", "parameters": {"properties": {"filePath": {}, "content": {}}}}}]});
        let conv = conversation(Api::Chat, &body);
        assert_eq!(conv.tool_results, 1);
        assert!(conv.last_user.contains("hello.txt"));
        let script = Script::write_file("hello.txt", "hello.txt", "hi").rule("two", vec![]);
        assert!(
            matches!(decide(&script, &conv, None, &body), Reply::Text(t) if t.contains("done: hello.txt"))
        );

        let body = json!({"messages": [{"role": "user", "content": "please write hello.txt. Working directory: /w/x"}],
            "tools": body["tools"].clone()});
        let conv = conversation(Api::Chat, &body);
        match decide(&script, &conv, None, &body) {
            Reply::Tool { name, input, .. } => {
                assert_eq!(name, "write");
                assert_eq!(
                    input,
                    json!({"filePath": "/w/x/hello.txt", "content": "hi"})
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn faults_and_apis_come_from_the_path() {
        assert_eq!(
            classify("/__429/v1/chat/completions"),
            (Api::Chat, Some(Fault::Status(429)), None)
        );
        assert_eq!(
            classify("/__hang/v1beta/models/m:streamGenerateContent"),
            (Api::Gemini { stream: true }, Some(Fault::Hang), None)
        );
        assert_eq!(
            classify("/__tool_Bash/v1/messages").2.as_deref(),
            Some("Bash")
        );
        assert_eq!(
            example(
                &json!({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}})
            ),
            json!({"a": "simple", "b": 1})
        );
    }
}
