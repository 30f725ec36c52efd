//! The CLIs' JSON-lines output, parsed into typed events and a summary of the run
//! (docs/agent-clis.md).

use serde_json::Value;

use crate::{ErrorKind, Usage};

/// Which CLI printed the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CliKind {
    /// OpenAI Codex CLI (`codex exec --json`).
    Codex,
    /// Claude Code (`claude -p --output-format stream-json`).
    Claude,
    /// Gemini CLI (`gemini -o stream-json`).
    Gemini,
    /// Qwen Code (`qwen -o stream-json`).
    Qwen,
    /// opencode (`opencode run --format json`).
    Opencode,
}

impl CliKind {
    /// Backend name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Codex => "codex",
            Self::Claude => "claude",
            Self::Gemini => "gemini",
            Self::Qwen => "qwen",
            Self::Opencode => "opencode",
        }
    }

    /// The CLI of a backend name (`None` for `command` and `agent`).
    pub fn from_name(name: &str) -> Option<Self> {
        [
            Self::Codex,
            Self::Claude,
            Self::Gemini,
            Self::Qwen,
            Self::Opencode,
        ]
        .into_iter()
        .find(|kind| kind.name() == name)
    }

    /// Whether the CLI finds a session by the directory it ran in, not by its id alone
    /// (measured against the scripted model server): resumed from another directory, gemini
    /// exits 42 ("no previous sessions found for this project"), qwen exits 1 ("no saved
    /// session found"), and opencode keeps the session bound to the old directory and hangs
    /// until the timeout. Codex and claude resume by id from any directory. Such a session
    /// can only be resumed in its own directory.
    pub fn session_bound_to_directory(self) -> bool {
        matches!(self, Self::Gemini | Self::Qwen | Self::Opencode)
    }
}

/// One thing the agent did, as the CLI reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentEvent {
    /// The CLI's own session (thread) id.
    Session(String),
    /// A tool call, with its name and a short rendering of its input.
    ToolCall {
        /// Tool name as the CLI calls it.
        name: String,
        /// Input, as JSON text.
        input: String,
    },
    /// A file the agent created or changed (path as reported).
    FileChange(String),
    /// Assistant text.
    Message(String),
    /// A transient notice (reconnecting, retrying).
    Notice(String),
    /// An action the CLI's own permission rules refused (`Bash: pytest -q`).
    Denied(String),
    /// The run ended; `error` holds the classified failure when it failed.
    End {
        /// The classified failure, if any.
        error: Option<(ErrorKind, String)>,
    },
}

/// What a whole stream said.
#[derive(Debug, Clone, Default)]
pub struct Transcript {
    /// Events in order.
    pub events: Vec<AgentEvent>,
    /// The native session id.
    pub session_id: Option<String>,
    /// Token usage (as the CLI reports it; codex's and qwen's are cumulative on resume).
    pub usage: Option<Usage>,
    /// Final assistant message.
    pub final_message: String,
    /// Whether an end-of-run event was seen.
    pub ended: bool,
    /// The classified failure the stream reported.
    pub error: Option<(ErrorKind, String)>,
    /// Lines that were not JSON.
    pub unparsed: usize,
    /// Actions the CLI's own permission rules refused (`Bash: pytest -q`), in order.
    pub denials: Vec<String>,
}

impl Transcript {
    /// Tool calls made.
    pub fn tool_calls(&self) -> impl Iterator<Item = &str> {
        self.events.iter().filter_map(|e| match e {
            AgentEvent::ToolCall { name, .. } => Some(name.as_str()),
            _ => None,
        })
    }

    /// Files reported changed.
    pub fn file_changes(&self) -> impl Iterator<Item = &str> {
        self.events.iter().filter_map(|e| match e {
            AgentEvent::FileChange(path) => Some(path.as_str()),
            _ => None,
        })
    }

    fn deny(&mut self, tool: &str, input: &Value) {
        let what = ["command", "file_path", "filePath", "path"]
            .iter()
            .find_map(|key| input.get(*key).and_then(Value::as_str))
            .map_or_else(|| input.to_string(), str::to_owned);
        let what: String = what.chars().take(200).collect();
        let denial = if what.is_empty() || what == "null" {
            tool.to_owned()
        } else {
            format!("{tool}: {what}")
        };
        if !self.denials.contains(&denial) {
            self.denials.push(denial.clone());
            self.events.push(AgentEvent::Denied(denial));
        }
    }

    /// Whether the agent tried to act and every action was refused by the CLI's permissions.
    pub fn all_denied(&self) -> bool {
        !self.denials.is_empty() && self.denials.len() >= self.tool_calls().count()
    }

    fn push(&mut self, event: AgentEvent) {
        match &event {
            AgentEvent::Session(id) if self.session_id.is_none() => {
                self.session_id = Some(id.clone());
            }
            AgentEvent::Session(_) => return,
            AgentEvent::End { error } => {
                self.ended = true;
                if error.is_some() {
                    self.error.clone_from(error);
                }
            }
            _ => {}
        }
        self.events.push(event);
    }
}

fn s<'a>(value: &'a Value, pointer: &str) -> Option<&'a str> {
    value.pointer(pointer).and_then(Value::as_str)
}

fn n(value: &Value, pointer: &str) -> u64 {
    value.pointer(pointer).and_then(Value::as_u64).unwrap_or(0)
}

/// The wait an HTTP `retry-after` header names: delay seconds (`30`, `1.5`). An HTTP date
/// is not read (no provider troupe talks to sends one); `None` then.
pub(crate) fn retry_after_header(value: &str) -> Option<std::time::Duration> {
    let seconds: f64 = value.trim().parse().ok()?;
    std::time::Duration::try_from_secs_f64(seconds).ok()
}

/// The wait a rate-limit message names in its text, as the CLIs print it: `retry-after: 30`,
/// `Please retry in 41.2s`, `try again in 2 minutes`, `resets in 500ms`, `reset after 1h`
/// (seconds when no unit is given). `None` when it names none.
pub(crate) fn retry_after_in(text: &str) -> Option<std::time::Duration> {
    static PATTERN: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let pattern = PATTERN.get_or_init(|| {
        regex::Regex::new(
            r"(?i)(?:retry[- ]after|try again in|retry in|resets? in|resets? after)[:=\s]*(\d+(?:\.\d+)?)\s*(ms|milliseconds?|s|secs?|seconds?|m|mins?|minutes?|h|hrs?|hours?)?\b",
        )
        .expect("the retry-after pattern is valid")
    });
    let found = pattern.captures(text)?;
    let amount: f64 = found.get(1)?.as_str().parse().ok()?;
    let unit = found
        .get(2)
        .map_or("s", |unit| unit.as_str())
        .to_ascii_lowercase();
    let seconds = match unit.as_str() {
        "ms" | "millisecond" | "milliseconds" => amount / 1000.0,
        "m" | "min" | "mins" | "minute" | "minutes" => amount * 60.0,
        "h" | "hr" | "hrs" | "hour" | "hours" => amount * 3600.0,
        _ => amount,
    };
    std::time::Duration::try_from_secs_f64(seconds).ok()
}

/// Classifies an error message by its text (codex, qwen and the fallback for the others).
pub fn classify_message(message: &str) -> ErrorKind {
    let lower = message.to_ascii_lowercase();
    let has = |needles: &[&str]| needles.iter().any(|n| lower.contains(n));
    if has(&[
        "insufficient_quota",
        "exceeded your current quota",
        "quota exceeded",
    ]) {
        ErrorKind::Quota
    } else if has(&[
        "401",
        "unauthorized",
        "unauthenticated",
        "authentication",
        "api key",
        "not logged in",
        "missing environment variable",
        "invalid auth",
        // qwen: a sign-in it no longer accepts ("... discontinued ... run /auth").
        "run /auth",
        // gemini: a login it cannot use headless ("Manual authorization is required ...").
        "authorization is required",
    ]) {
        ErrorKind::Auth
    } else if has(&[
        "429",
        "too many requests",
        "rate limit",
        "resource_exhausted",
    ]) {
        ErrorKind::RateLimited
    } else {
        ErrorKind::Crash
    }
}

/// Parses a whole stdout.
pub fn parse(kind: CliKind, stdout: &str) -> Transcript {
    let mut parser = StreamParser::new(kind);
    for line in stdout.lines() {
        parser.line(line);
    }
    parser.finish()
}

/// Parses a stream line by line as the CLI prints it: [`parse`] for a run still going, which
/// tells the usage so far after each line.
#[derive(Debug)]
pub struct StreamParser {
    kind: CliKind,
    transcript: Transcript,
    text_parts: String,
}

impl StreamParser {
    /// A parser for `kind`'s stream.
    pub fn new(kind: CliKind) -> Self {
        Self {
            kind,
            transcript: Transcript::default(),
            text_parts: String::new(),
        }
    }

    /// Takes one line; returns the usage so far when this line changed it.
    pub fn line(&mut self, line: &str) -> Option<Usage> {
        let line = line.trim();
        if line.is_empty() {
            return None;
        }
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            self.transcript.unparsed += 1;
            return None;
        };
        let before = self.transcript.usage;
        let t = &mut self.transcript;
        match self.kind {
            CliKind::Codex => codex(t, &v),
            CliKind::Claude | CliKind::Qwen => claude_like(t, &v, self.kind),
            CliKind::Gemini => gemini(t, &v, &mut self.text_parts),
            CliKind::Opencode => opencode(t, &v),
        }
        (self.transcript.usage != before)
            .then_some(self.transcript.usage)
            .flatten()
    }

    /// The whole stream's transcript.
    pub fn finish(mut self) -> Transcript {
        if self.kind == CliKind::Gemini && self.transcript.final_message.is_empty() {
            self.transcript.final_message = self.text_parts;
        }
        self.transcript
    }
}

fn codex(t: &mut Transcript, v: &Value) {
    match s(v, "/type").unwrap_or_default() {
        "thread.started" => {
            if let Some(id) = s(v, "/thread_id") {
                t.push(AgentEvent::Session(id.to_owned()));
            }
        }
        "item.completed" => {
            let item = &v["item"];
            match s(item, "/type").unwrap_or_default() {
                "file_change" => {
                    for change in item["changes"].as_array().into_iter().flatten() {
                        if let Some(path) = s(change, "/path") {
                            t.push(AgentEvent::FileChange(path.to_owned()));
                        }
                    }
                    t.push(AgentEvent::ToolCall {
                        name: "apply_patch".to_owned(),
                        input: item["changes"].to_string(),
                    });
                }
                "command_execution" => t.push(AgentEvent::ToolCall {
                    name: "exec_command".to_owned(),
                    input: s(item, "/command").unwrap_or_default().to_owned(),
                }),
                "agent_message" => {
                    let text = s(item, "/text").unwrap_or_default().to_owned();
                    t.final_message.clone_from(&text);
                    t.push(AgentEvent::Message(text));
                }
                "error" => t.push(AgentEvent::Notice(
                    s(item, "/message").unwrap_or_default().to_owned(),
                )),
                _ => {}
            }
        }
        "turn.completed" => {
            t.usage = Some(Usage {
                input_tokens: n(v, "/usage/input_tokens"),
                output_tokens: n(v, "/usage/output_tokens"),
                cached_input_tokens: n(v, "/usage/cached_input_tokens"),
            });
            t.push(AgentEvent::End { error: None });
        }
        "turn.failed" => {
            let message = s(v, "/error/message").unwrap_or("turn failed").to_owned();
            t.push(AgentEvent::End {
                error: Some((classify_message(&message), message)),
            });
        }
        "error" => {
            // `Reconnecting...` is a transient notice; a real failure follows as turn.failed.
            t.push(AgentEvent::Notice(
                s(v, "/message").unwrap_or_default().to_owned(),
            ));
        }
        _ => {}
    }
}

fn claude_error_kind(v: &Value, message: &str) -> ErrorKind {
    match s(v, "/error") {
        Some("authentication_failed") => ErrorKind::Auth,
        Some("rate_limit") => ErrorKind::RateLimited,
        Some("billing_error") => ErrorKind::Quota,
        Some(_) => ErrorKind::Crash,
        None => classify_message(message),
    }
}

fn claude_like(t: &mut Transcript, v: &Value, kind: CliKind) {
    if let Some(id) = s(v, "/session_id") {
        t.push(AgentEvent::Session(id.to_owned()));
    }
    match s(v, "/type").unwrap_or_default() {
        "assistant" => {
            for block in v
                .pointer("/message/content")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                match s(block, "/type") {
                    Some("tool_use") => {
                        let name = s(block, "/name").unwrap_or_default().to_owned();
                        let input = &block["input"];
                        if matches!(
                            name.as_str(),
                            "Write" | "Edit" | "MultiEdit" | "write_file" | "edit" | "replace"
                        ) && let Some(path) = s(input, "/file_path")
                        {
                            t.push(AgentEvent::FileChange(path.to_owned()));
                        }
                        t.push(AgentEvent::ToolCall {
                            name,
                            input: input.to_string(),
                        });
                    }
                    Some("text") => {
                        t.push(AgentEvent::Message(
                            s(block, "/text").unwrap_or_default().to_owned(),
                        ));
                    }
                    _ => {}
                }
            }
            // Claude marks API failures on a synthetic assistant message.
            if kind == CliKind::Claude && v.get("error").is_some_and(|e| !e.is_null()) {
                let message = v
                    .pointer("/message/content/0/text")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                t.error = Some((claude_error_kind(v, &message), message));
            }
        }
        "system" => match s(v, "/subtype") {
            Some("api_retry" | "retry") => {
                t.push(AgentEvent::Notice(format!("retry: {}", v["error"])));
            }
            Some("permission_denied") => t.push(AgentEvent::Notice(format!(
                "permission denied: {}",
                s(v, "/message").unwrap_or_default()
            ))),
            _ => {}
        },
        "result" => {
            t.usage = Some(Usage {
                input_tokens: n(v, "/usage/input_tokens"),
                output_tokens: n(v, "/usage/output_tokens"),
                cached_input_tokens: n(v, "/usage/cache_read_input_tokens"),
            });
            // `[{tool_name, tool_use_id, tool_input}]`: what the permission mode refused.
            for denial in v["permission_denials"].as_array().into_iter().flatten() {
                let tool = s(denial, "/tool_name").unwrap_or("tool");
                t.deny(tool, &denial["tool_input"]);
            }
            let is_error = v["is_error"].as_bool().unwrap_or(false);
            let text = s(v, "/result")
                .or_else(|| s(v, "/error/message"))
                .unwrap_or_default()
                .to_owned();
            if is_error {
                let error = t
                    .error
                    .clone()
                    .map(|(kind, _)| (kind, text.clone()))
                    .unwrap_or_else(|| (classify_message(&text), text.clone()));
                t.push(AgentEvent::End { error: Some(error) });
            } else {
                t.final_message = text;
                t.push(AgentEvent::End { error: None });
            }
        }
        _ => {}
    }
}

fn gemini(t: &mut Transcript, v: &Value, text: &mut String) {
    match s(v, "/type").unwrap_or_default() {
        "init" => {
            if let Some(id) = s(v, "/session_id") {
                t.push(AgentEvent::Session(id.to_owned()));
            }
        }
        "tool_use" => {
            let name = s(v, "/tool_name").unwrap_or_default().to_owned();
            if matches!(name.as_str(), "write_file" | "replace")
                && let Some(path) = s(v, "/parameters/file_path")
            {
                t.push(AgentEvent::FileChange(path.to_owned()));
            }
            t.push(AgentEvent::ToolCall {
                name,
                input: v["parameters"].to_string(),
            });
        }
        "tool_result"
            if s(v, "/status") == Some("error")
                && s(v, "/error/type") == Some("policy_violation") =>
        {
            let id = s(v, "/tool_id").unwrap_or_default();
            let tool = id.split("__").next().unwrap_or(id).to_owned();
            t.deny(&tool, &Value::Null);
        }
        "message" if s(v, "/role") == Some("assistant") => {
            let part = s(v, "/content").unwrap_or_default();
            text.push_str(part);
            t.push(AgentEvent::Message(part.to_owned()));
        }
        "result" => {
            t.usage = Some(Usage {
                input_tokens: n(v, "/stats/input_tokens"),
                output_tokens: n(v, "/stats/output_tokens"),
                cached_input_tokens: n(v, "/stats/cached"),
            });
            let error = (s(v, "/status") == Some("error")).then(|| {
                let message = s(v, "/error/message").unwrap_or("gemini failed").to_owned();
                (classify_message(&message), message)
            });
            t.push(AgentEvent::End { error });
        }
        _ => {}
    }
}

fn opencode(t: &mut Transcript, v: &Value) {
    if let Some(id) = s(v, "/sessionID") {
        t.push(AgentEvent::Session(id.to_owned()));
    }
    match s(v, "/type").unwrap_or_default() {
        "tool_use" => {
            let name = s(v, "/part/tool").unwrap_or_default().to_owned();
            let state = &v["part"]["state"];
            if matches!(name.as_str(), "write" | "edit")
                && s(state, "/status") == Some("completed")
                && let Some(path) = s(state, "/input/filePath")
            {
                t.push(AgentEvent::FileChange(path.to_owned()));
            }
            // A permission rule's refusal comes back as the tool's error.
            if s(state, "/status") == Some("error")
                && s(state, "/error").is_some_and(|e| e.contains("rule which prevents you"))
            {
                t.deny(&name, &state["input"]);
            }
            t.push(AgentEvent::ToolCall {
                name,
                input: state["input"].to_string(),
            });
        }
        "text" => {
            let text = s(v, "/part/text").unwrap_or_default().to_owned();
            t.final_message.clone_from(&text);
            t.push(AgentEvent::Message(text));
        }
        "step_finish" => {
            // Tokens come per model call; there is no run total, so add them up.
            let usage = t.usage.get_or_insert_with(Usage::default);
            usage.input_tokens += n(v, "/part/tokens/input");
            usage.output_tokens += n(v, "/part/tokens/output");
            usage.cached_input_tokens += n(v, "/part/tokens/cache/read");
            if s(v, "/part/reason") == Some("stop") {
                t.push(AgentEvent::End { error: None });
            }
        }
        "error" => {
            let data = &v["error"]["data"];
            let message = s(data, "/message")
                .or_else(|| s(v, "/error/name"))
                .unwrap_or("opencode failed")
                .to_owned();
            let kind = match data.get("statusCode").and_then(Value::as_u64) {
                Some(401 | 403) => ErrorKind::Auth,
                Some(429) => classify_message(&message).max_rate(),
                Some(_) => ErrorKind::Crash,
                None => classify_message(&message),
            };
            t.push(AgentEvent::End {
                error: Some((kind, message)),
            });
        }
        _ => {}
    }
}

impl ErrorKind {
    /// A 429 is a rate limit unless its text says quota.
    fn max_rate(self) -> Self {
        if self == Self::Quota {
            Self::Quota
        } else {
            Self::RateLimited
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_kinds_round_trip_their_names_and_say_which_bind_sessions_to_directories() {
        for kind in [
            CliKind::Codex,
            CliKind::Claude,
            CliKind::Gemini,
            CliKind::Qwen,
            CliKind::Opencode,
        ] {
            assert_eq!(CliKind::from_name(kind.name()), Some(kind));
        }
        assert_eq!(CliKind::from_name("agent"), None);
        let bound: Vec<&str> = [
            CliKind::Codex,
            CliKind::Claude,
            CliKind::Gemini,
            CliKind::Qwen,
            CliKind::Opencode,
        ]
        .into_iter()
        .filter(|kind| kind.session_bound_to_directory())
        .map(CliKind::name)
        .collect();
        assert_eq!(bound, vec!["gemini", "qwen", "opencode"]);
    }

    #[test]
    fn a_stream_parsed_line_by_line_tells_the_usage_as_it_grows() {
        // opencode adds each step's tokens; the parser reports the sum after each step, and
        // nothing for lines that do not change it.
        let lines = [
            r#"{"type":"step_start","part":{"type":"step-start"}}"#,
            r#"{"type":"step_finish","part":{"type":"step-finish","tokens":{"input":100,"output":7,"cache":{"read":40}}}}"#,
            "not json",
            r#"{"type":"step_finish","part":{"type":"step-finish","tokens":{"input":20,"output":3,"cache":{"read":0}}}}"#,
        ];
        let mut parser = StreamParser::new(CliKind::Opencode);
        let seen: Vec<Option<Usage>> = lines.iter().map(|line| parser.line(line)).collect();
        let usage = |input, output, cached| Usage {
            input_tokens: input,
            output_tokens: output,
            cached_input_tokens: cached,
        };
        assert_eq!(
            seen,
            [
                None,
                Some(usage(100, 7, 40)),
                None,
                Some(usage(120, 10, 40))
            ]
        );
        let whole = parser.finish();
        assert_eq!(whole.usage, Some(usage(120, 10, 40)));
        assert_eq!(whole.unparsed, 1);
        // Codex reports its turn's usage once, at the end of the turn.
        let mut codex = StreamParser::new(CliKind::Codex);
        assert_eq!(
            codex.line(r#"{"type":"thread.started","thread_id":"t"}"#),
            None
        );
        assert_eq!(
            codex.line(r#"{"type":"turn.completed","usage":{"input_tokens":246,"cached_input_tokens":6,"output_tokens":90}}"#),
            Some(usage(246, 90, 6))
        );
    }

    #[test]
    fn codex_stream_gives_session_files_usage_and_errors() {
        let ok = r#"{"type":"thread.started","thread_id":"01a1"}
{"type":"turn.started"}
{"type":"item.completed","item":{"id":"item_0","type":"file_change","changes":[{"path":"/r/hello.txt","kind":"add"}],"status":"completed"}}
{"type":"item.completed","item":{"id":"item_1","type":"agent_message","text":"Created hello.txt"}}
{"type":"turn.completed","usage":{"input_tokens":246,"cached_input_tokens":0,"output_tokens":90}}"#;
        let t = parse(CliKind::Codex, ok);
        assert_eq!(t.session_id.as_deref(), Some("01a1"));
        assert_eq!(t.file_changes().collect::<Vec<_>>(), ["/r/hello.txt"]);
        assert_eq!(t.usage.map(|u| u.input_tokens), Some(246));
        assert_eq!(t.final_message, "Created hello.txt");
        assert!(t.ended && t.error.is_none());

        let failed = r#"{"type":"error","message":"unexpected status 401 Unauthorized: Incorrect API key"}
{"type":"turn.failed","error":{"message":"unexpected status 401 Unauthorized: Incorrect API key"}}"#;
        assert_eq!(
            parse(CliKind::Codex, failed).error.map(|e| e.0),
            Some(ErrorKind::Auth)
        );
        let limited = r#"{"type":"turn.failed","error":{"message":"exceeded retry limit, last status: 429 Too Many Requests"}}"#;
        assert_eq!(
            parse(CliKind::Codex, limited).error.map(|e| e.0),
            Some(ErrorKind::RateLimited)
        );
    }

    #[test]
    fn permission_denials_are_recorded_and_all_denied_is_told() {
        let claude = r#"{"type":"system","subtype":"init","session_id":"ab"}
{"type":"assistant","message":{"content":[{"type":"tool_use","id":"t1","name":"Bash","input":{"command":"pytest -q"}}]},"session_id":"ab"}
{"type":"result","subtype":"success","is_error":false,"result":"could not run it","session_id":"ab","usage":{},"permission_denials":[{"tool_name":"Bash","tool_use_id":"t1","tool_input":{"command":"pytest -q"}}]}"#;
        let t = parse(CliKind::Claude, claude);
        assert_eq!(t.denials, ["Bash: pytest -q"]);
        assert!(t.all_denied());
        assert!(
            t.events
                .contains(&AgentEvent::Denied("Bash: pytest -q".into()))
        );

        let opencode = r#"{"type":"tool_use","sessionID":"s","part":{"tool":"write","state":{"status":"error","input":{"filePath":"/w/a.txt"},"error":"The user has specified a rule which prevents you from using this specific tool call"}}}
{"type":"tool_use","sessionID":"s","part":{"tool":"read","state":{"status":"completed","input":{"filePath":"/w/b.txt"}}}}"#;
        let t = parse(CliKind::Opencode, opencode);
        assert_eq!(t.denials, ["write: /w/a.txt"]);
        assert!(!t.all_denied(), "the read went through");
        assert_eq!(
            classify_message(
                "Manual authorization is required but the current session is non-interactive."
            ),
            ErrorKind::Auth
        );
    }

    #[test]
    fn claude_opencode_and_gemini_errors_classify() {
        let claude = r#"{"type":"system","subtype":"init","session_id":"ab"}
{"type":"assistant","message":{"model":"<synthetic>","content":[{"type":"text","text":"API Error: Request rejected (429)"}]},"session_id":"ab","error":"rate_limit","api_error_status":429}
{"type":"result","subtype":"success","is_error":true,"result":"API Error: Request rejected (429) · fake 429 (rate_limit_error)","session_id":"ab","usage":{"input_tokens":0,"output_tokens":0}}"#;
        let t = parse(CliKind::Claude, claude);
        assert_eq!(t.session_id.as_deref(), Some("ab"));
        assert_eq!(t.error.map(|e| e.0), Some(ErrorKind::RateLimited));

        let opencode = r#"{"type":"error","sessionID":"ses_1","error":{"name":"APIError","data":{"message":"Incorrect API key provided","statusCode":401,"isRetryable":false}}}"#;
        let t = parse(CliKind::Opencode, opencode);
        assert_eq!(t.session_id.as_deref(), Some("ses_1"));
        assert_eq!(t.error.map(|e| e.0), Some(ErrorKind::Auth));

        let gemini = r#"{"type":"init","session_id":"g1","model":"m"}
{"type":"result","status":"error","error":{"type":"unknown","message":"[API Error: fake 429 (RESOURCE_EXHAUSTED)]\nPlease wait and try again later. To increase your limits, request a quota increase"}}"#;
        let t = parse(CliKind::Gemini, gemini);
        assert_eq!(t.error.map(|e| e.0), Some(ErrorKind::RateLimited));
    }

    #[test]
    fn rate_limit_messages_name_their_wait() {
        use std::time::Duration;
        assert_eq!(retry_after_header("2"), Some(Duration::from_secs(2)));
        assert_eq!(retry_after_header("Wed, 21 Oct 2015 07:28:00 GMT"), None);
        assert_eq!(
            retry_after_in("429 Too Many Requests. Please retry in 41.2s."),
            Some(Duration::from_millis(41_200))
        );
        assert_eq!(
            retry_after_in("rate limited, try again in 2 minutes"),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            retry_after_in("retry-after: 30"),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            retry_after_in("limit resets in 500ms"),
            Some(Duration::from_millis(500))
        );
        assert_eq!(
            retry_after_in("Rate limit reached for fake-model (fake 429)"),
            None
        );
    }
}
