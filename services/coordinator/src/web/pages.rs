//! The web view's HTML. maud escapes everything it interpolates; the one raw insertion is the
//! DAG's SVG, which `troupe_view` draws and escapes itself.

use std::collections::HashMap;

use maud::{DOCTYPE, Markup, PreEscaped, html};
use troupe_proto::v1::{self as pb, task_result::Detail};
use troupe_view::graph::{self, Node, human_duration};

const STYLE: &str = "
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#212121}
nav{background:#263238;color:#fff;padding:8px 16px}nav a{color:#fff;text-decoration:none;margin-right:16px}
main{padding:16px}table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f5f5f5}.state{font-weight:600}.completed{color:#2e7d32}.failed,.timed_out{color:#c62828}
.running{color:#1565c0}pre{background:#f5f5f5;padding:8px;overflow:auto;max-height:400px}
#dag svg{max-width:100%;height:auto}.muted{color:#757575}";

fn layout(title: &str, body: Markup) -> String {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { (title) " · troupe" }
                style { (PreEscaped(STYLE)) }
            }
            body {
                nav { a href="/" { "troupe" } a href="/" { "sessions" } }
                main { (body) }
            }
        }
    }
    .into_string()
}

fn state_of_task(state: i32) -> &'static str {
    pb::TaskState::try_from(state).map_or("unspecified", troupe_proto::names::task_state)
}

fn state_of_session(state: i32) -> &'static str {
    pb::SessionState::try_from(state).map_or("unspecified", troupe_proto::names::session_state)
}

fn time(ts: Option<&prost_types::Timestamp>) -> String {
    ts.and_then(|ts| chrono::DateTime::from_timestamp(ts.seconds, 0))
        .map(|ts| ts.format("%Y-%m-%d %H:%M:%S UTC").to_string())
        .unwrap_or_default()
}

/// The list of sessions, newest first as the coordinator returns them.
pub(super) fn sessions(sessions: &[pb::Session]) -> String {
    layout(
        "sessions",
        html! {
            h1 { "Sessions" }
            @if sessions.is_empty() { p.muted { "No sessions yet." } }
            table #sessions {
                tr { th { "session" } th { "name" } th { "state" } th { "tasks" } th { "created" } }
                @for session in sessions {
                    @let counts = session.counts.unwrap_or_default();
                    tr {
                        td { a href={ "/sessions/" (session.id) } { (session.id) } }
                        td { (session.name) }
                        td.state.(state_of_session(session.state)) { (state_of_session(session.state)) }
                        td { (counts.completed) " / " (counts.total) " completed"
                            @if counts.failed > 0 { ", " (counts.failed) " failed" } }
                        td { (time(session.created_at.as_ref())) }
                    }
                }
            }
        },
    )
}

/// The DAG and the task table: what `/live` serves and the page refreshes.
fn live_markup(view: &pb::GetSessionResponse, held: &HashMap<String, String>) -> Markup {
    let session_id = view.session.as_ref().map(|s| s.id.as_str()).unwrap_or("");
    let now = chrono::Utc::now();
    let nodes: Vec<Node> = view
        .tasks
        .iter()
        .map(|task| Node::from_task(task, now))
        .collect();
    let svg = graph::render(graph::Format::Svg, session_id, &nodes);
    let state = view
        .session
        .as_ref()
        .map_or("unspecified", |s| state_of_session(s.state));
    html! {
        p #session-state data-state=(state) { "Session " span.state.(state) { (state) } }
        div #dag { (PreEscaped(svg)) }
        table #tasks {
            tr { th { "task" } th { "title" } th { "state" } th { "repo" } th { "wave" } th { "attempt" } th { "time" } th { "" } }
            @for task in &view.tasks {
                @let node = Node::from_task(task, now);
                tr data-task=(task.id) data-state=(state_of_task(task.state)) {
                    td { a href={ "/sessions/" (session_id) "/tasks/" (task.id) } { (task.id) } }
                    td { (task.title) }
                    td.state.(state_of_task(task.state)) { (state_of_task(task.state)) }
                    td { (task.repo) }
                    td { (task.wave) }
                    td { (task.attempt) " / " (task.max_attempts) }
                    td { (node.duration.map(human_duration).unwrap_or_default()) }
                    td {
                        @if task.state == pb::TaskState::WaitingApproval as i32 {
                            @let base = format!("/sessions/{session_id}/tasks/{}", task.id);
                            form.gate method="post" {
                                input type="text" name="note" placeholder="note";
                                @if let Some(checkpoint) = held.get(&task.id) {
                                    // Held at a role's checkpoint: the answer is the checkpoint's.
                                    input type="hidden" name="checkpoint" value=(checkpoint);
                                    " " button.approve type="submit" formaction={ (base) "/approve" } { "Approve checkpoint " (checkpoint) }
                                    " " button.reject type="submit" formaction={ (base) "/reject" } { "Reject checkpoint " (checkpoint) }
                                } @else {
                                    " " button.approve type="submit" formaction={ (base) "/approve" } { "Approve" }
                                    " " button.reject type="submit" formaction={ (base) "/reject" } { "Reject" }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The live part alone.
pub(super) fn live(view: &pb::GetSessionResponse, held: &HashMap<String, String>) -> String {
    live_markup(view, held).into_string()
}

/// A session: its live DAG and tasks, then its messages.
pub(super) fn session(
    view: &pb::GetSessionResponse,
    held: &HashMap<String, String>,
    messages: &[pb::Message],
) -> String {
    let session = view.session.clone().unwrap_or_default();
    layout(
        &session.id,
        html! {
            h1 { (session.name) " " span.muted { (session.id) } }
            @if !session.description.is_empty() { p { (session.description) } }
            div #live data-session=(session.id) { (live_markup(view, held)) }
            h2 { "Messages" }
            table #messages {
                tr { th { "#" } th { "from" } th { "to" } th { "type" } th { "summary" } }
                @for message in messages {
                    tr { td { (message.sequence) } td { (message.from) } td { (message.to) }
                         td { (message.r#type) } td { (message.summary) } }
                }
            }
            script src="/static/live.js" {}
        },
    )
}

fn usage(usage: Option<&pb::Usage>) -> Markup {
    let usage = usage.cloned().unwrap_or_default();
    html! { (usage.input_tokens) " in / " (usage.output_tokens) " out (" (usage.cached_input_tokens) " cached)" }
}

fn checks(report: &pb::ValidationReport) -> Markup {
    let verdict = pb::Verdict::try_from(report.verdict).map_or("unspecified", |v| {
        v.as_str_name().trim_start_matches("VERDICT_")
    });
    html! {
        p { "Verdict: " strong { (verdict) } }
        table.checks {
            tr { th { "check" } th { "kind" } th { "status" } th { "evidence" } }
            @for check in &report.checks {
                tr {
                    td { (check.name) } td { (troupe_proto::names::name(check.kind())) }
                    td { (pb::CheckStatus::try_from(check.status).map_or("unspecified", |s| s.as_str_name().trim_start_matches("CHECK_STATUS_"))) }
                    td { pre { (check.evidence) } }
                }
            }
        }
    }
}

fn result_detail(detail: &Detail) -> Markup {
    match detail {
        Detail::Implementation(report) => html! {
            h2 { "Implementation" }
            p { "Backend " strong { (report.backend) }
                @if !report.fallbacks.is_empty() { " after " (report.fallbacks.join(", ")) }
                " · exit " (report.exit_code) " · " (human_duration(std::time::Duration::from_millis(report.duration_ms))) }
            p { "Usage: " (usage(report.usage.as_ref())) }
            @if let Some(validation) = &report.self_validation { h3 { "Self-validation" } (checks(validation)) }
            @if !report.output_tail.is_empty() { h3 { "Output (tail)" } pre { (report.output_tail) } }
        },
        Detail::Validation(report) => html! { h2 { "Validation" } (checks(report)) },
        Detail::TestRun(report) => {
            let totals = report.totals.unwrap_or_default();
            html! {
                h2 { "Test run" }
                p { (totals.passed) " passed, " (totals.failed) " failed, " (totals.errors) " errors, "
                    (totals.skipped) " skipped of " (totals.total)
                    " · pass rate " (format!("{:.1}%", report.pass_rate * 100.0))
                    @if let Some(overall) = report.coverage.as_ref().and_then(|c| c.overall) {
                        " · coverage " (format!("{overall:.1}%"))
                    } }
                @if !report.failures.is_empty() {
                    table #failures {
                        tr { th { "test" } th { "where" } th { "message" } }
                        @for failure in &report.failures {
                            tr { td { (failure.name) } td { (failure.file) ":" (failure.line) } td { pre { (failure.message) } } }
                        }
                    }
                }
                @if let Some(fix) = &report.fix_loop {
                    h3 { "Fix loop" }
                    table {
                        tr { th { "iteration" } th { "strategy" } th { "verdict" } th { "pass rate" } th { "coverage" } }
                        @for iteration in &fix.iterations {
                            tr { td { (iteration.iteration) } td { (iteration.strategy) } td { (iteration.verdict) }
                                 td { (format!("{:.1}%", iteration.pass_rate * 100.0)) }
                                 td { (iteration.coverage.map(|c| format!("{c:.1}%")).unwrap_or_default()) } }
                        }
                    }
                    p { "Fixer usage: " (usage(fix.usage.as_ref())) }
                }
            }
        }
    }
}

/// One task: its spec, attempts, result and checks.
pub(super) fn task(view: &pb::GetSessionResponse, task: &pb::Task) -> String {
    let session_id = view.session.as_ref().map(|s| s.id.as_str()).unwrap_or("");
    let spec = task
        .spec
        .as_ref()
        .map(troupe_proto::json::from_struct)
        .and_then(|value| serde_json::to_string_pretty(&value).ok())
        .unwrap_or_default();
    layout(
        &task.id,
        html! {
            h1 { (task.id) " " span.muted { (task.title) } }
            p { a href={ "/sessions/" (session_id) } { "← session " (session_id) } }
            table {
                tr { th { "state" } td.state.(state_of_task(task.state)) #task-state { (state_of_task(task.state)) } }
                tr { th { "attempt" } td { (task.attempt) " of " (task.max_attempts) } }
                tr { th { "repo" } td { (task.repo) } }
                tr { th { "depends on" } td { (task.depends_on.join(", ")) } }
                tr { th { "worker" } td { (task.worker_id) } }
                tr { th { "started" } td { (time(task.started_at.as_ref())) } }
                tr { th { "finished" } td { (time(task.finished_at.as_ref())) } }
            }
            @if let Some(error) = &task.last_error {
                h2 { "Last error" }
                p { (pb::ErrorKind::try_from(error.kind).map_or("unspecified", |k| k.as_str_name().trim_start_matches("ERROR_KIND_"))) ": " (error.message) }
            }
            @if let Some(result) = &task.result {
                h2 { "Result" }
                p { (result.summary) }
                @if !result.commit.is_empty() { p { "Commit " code { (result.commit) } } }
                @if !result.files_modified.is_empty() { p { "Files: " (result.files_modified.join(", ")) } }
                @if let Some(detail) = &result.detail { (result_detail(detail)) }
            }
            h2 { "Spec" }
            pre #spec { (spec) }
        },
    )
}

/// The sign-in form; `error` says why the last token was refused.
pub(super) fn login(error: Option<&str>) -> String {
    layout(
        "sign in",
        html! {
            h1 { "Sign in" }
            @if let Some(error) = error { p.failed { (error) } }
            form method="post" action="/login" {
                label { "Token (scope client or admin) " input type="password" name="token" autocomplete="off"; }
                " " button type="submit" { "Sign in" }
            }
        },
    )
}

/// An error page.
pub(super) fn failure(code: u16, message: &str, signin: bool) -> String {
    layout(
        "error",
        html! {
            h1 { (code) }
            p { (message) }
            @if signin { p { a href="/login" { "Sign in with a token" } } }
        },
    )
}
