//! Export of a session to a CCW-compatible session folder, through the coordinator's gRPC API
//! only (`GetSession`, `ListMessages`, `GetState`; `WatchSession` for the messages of a session
//! with more than one `ListMessages` page after a cursor, see [`fetch`]).
//!
//! The folder holds what CCW's team-executor reads (`team-session.json`, `task-analysis.json`,
//! `role-specs/`), the task JSON of every task with its runtime status and result
//! (`.task/<ID>.json`), the message bus (`.msg/messages.jsonl`, `.msg/meta.json`), a
//! `summary-<ID>.md` per completed executor task and a `results/run-N.json` per test run.
//! `troupe_plan::ccw::import_session` reads it back; what CCW has no field for (plan name,
//! mode, repositories, task order) travels in a `troupe` block of `team-session.json`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{Map, Value, json};
use tokio_stream::StreamExt;
use troupe_plan::Role;
use troupe_proto::json::struct_to_object;
use troupe_proto::v1::{
    self as pb, CheckStatus, GetStateRequest, ListMessagesRequest, SessionState, TaskState,
    TestOutcome, Verdict, WatchSessionRequest, session_event, task_result::Detail,
};

impl ExportError {
    fn rpc(call: &'static str, status: &tonic::Status) -> Self {
        Self::Rpc {
            call,
            message: status.message().to_owned(),
            unreachable: troupe_grpc::is_transient(status),
        }
    }
}

/// Messages asked for per `ListMessages` call (the coordinator's maximum).
const PAGE: u32 = 1000;

/// Why an export failed.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The coordinator could not be reached or refused a call.
    #[error("{call} failed: {message}")]
    Rpc {
        /// The RPC.
        call: &'static str,
        /// The status message.
        message: String,
        /// Whether the coordinator could not be reached (a transient failure).
        unreachable: bool,
    },
    /// The coordinator's answer is incomplete.
    #[error("{0}")]
    Incomplete(String),
    /// The target folder exists and is not empty.
    #[error("{0} exists and is not empty; export into a new folder")]
    NotEmpty(PathBuf),
    /// Writing the folder failed.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Everything an export needs, read from the coordinator.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// The session.
    pub session: pb::Session,
    /// Its tasks, in topological order.
    pub tasks: Vec<pb::Task>,
    /// Every message on its bus, oldest first.
    pub messages: Vec<pb::Message>,
    /// `role_state` per role.
    pub role_state: BTreeMap<String, Map<String, Value>>,
}

/// What [`export`] wrote.
#[derive(Debug, Clone)]
pub struct ExportSummary {
    /// Files written, relative to the folder.
    pub files: Vec<PathBuf>,
    /// Tasks exported.
    pub tasks: usize,
    /// Messages exported.
    pub messages: usize,
}

/// Reads a session, its messages (every page) and its role state.
pub async fn fetch(
    client: &mut troupe_grpc::CoordinatorClient,
    session_id: &str,
) -> Result<Snapshot, ExportError> {
    let rpc = |call: &'static str| move |status: tonic::Status| ExportError::rpc(call, &status);
    // Every task, however many: a session's first page alone would cut the export short.
    let response = crate::follow::whole_session(client, session_id)
        .await
        .map_err(rpc("GetSession"))?;
    let session = response
        .session
        .ok_or_else(|| ExportError::Incomplete("GetSession returned no session".into()))?;

    let messages = match list_messages(client, session_id).await? {
        Some(messages) => messages,
        None => watch_messages(client, session_id, session.last_sequence).await?,
    };

    let role_state = client
        .get_state(GetStateRequest {
            session_id: session_id.to_owned(),
            role: String::new(),
        })
        .await
        .map_err(rpc("GetState"))?
        .into_inner()
        .role_state
        .into_iter()
        .map(|(role, state)| (role, struct_to_object(&state)))
        .collect();
    Ok(Snapshot {
        session,
        tasks: response.tasks,
        messages,
        role_state,
    })
}

/// Pages through `ListMessages`; `None` when a page came back full and skipped older messages
/// (`last` keeps the newest of a page), which happens past [`PAGE`] messages after a cursor.
async fn list_messages(
    client: &mut troupe_grpc::CoordinatorClient,
    session_id: &str,
) -> Result<Option<Vec<pb::Message>>, ExportError> {
    let mut messages: Vec<pb::Message> = Vec::new();
    let mut cursor = 0;
    loop {
        let page = client
            .list_messages(ListMessagesRequest {
                session_id: session_id.to_owned(),
                after_sequence: cursor,
                last: PAGE,
                ..Default::default()
            })
            .await
            .map_err(|status| ExportError::rpc("ListMessages", &status))?
            .into_inner();
        if page.messages.is_empty() {
            return Ok(Some(messages));
        }
        // Ids are MSG-NNN, each the previous maximum + 1: a full page must continue right
        // after the previous one.
        let previous = messages.last().and_then(|m| message_number(&m.id));
        let first = page.messages.first().and_then(|m| message_number(&m.id));
        if page.messages.len() == PAGE as usize
            && let Some(first) = first
            && first != previous.map_or(1, |n| n + 1)
        {
            return Ok(None);
        }
        cursor = page.next_sequence;
        messages.extend(page.messages);
    }
}

/// Reads every message from the session's event stream, up to `last_sequence` (the session's
/// head when it was read), so that an active session's stream is not followed forever.
async fn watch_messages(
    client: &mut troupe_grpc::CoordinatorClient,
    session_id: &str,
    last_sequence: u64,
) -> Result<Vec<pb::Message>, ExportError> {
    let rpc = |status: tonic::Status| ExportError::rpc("WatchSession", &status);
    let mut messages = Vec::new();
    if last_sequence == 0 {
        return Ok(messages);
    }
    let mut events = client
        .watch_session(WatchSessionRequest {
            session_id: session_id.to_owned(),
            after_sequence: 0,
            follow: false,
        })
        .await
        .map_err(rpc)?
        .into_inner();
    while let Some(event) = events.next().await {
        let event = event.map_err(rpc)?;
        let sequence = event.sequence;
        if let Some(session_event::Kind::Message(message)) = event.kind {
            messages.push(message);
        }
        if sequence >= last_sequence {
            break;
        }
    }
    Ok(messages)
}

/// Exports session `session_id` from the coordinator at `url`, called with `connector`'s
/// credentials, into `dir` (created; it must be absent or empty).
pub async fn export(
    connector: &troupe_grpc::Connector,
    url: &str,
    session_id: &str,
    dir: &Path,
) -> Result<ExportSummary, ExportError> {
    let mut client = connector
        .coordinator_client(url)
        .map_err(|err| ExportError::Rpc {
            call: "connect",
            message: err.to_string(),
            unreachable: false,
        })?;
    let snapshot = fetch(&mut client, session_id).await?;
    let files = render(&snapshot, Utc::now());
    write_folder(dir, &files)?;
    Ok(ExportSummary {
        files: files.into_iter().map(|(path, _)| path).collect(),
        tasks: snapshot.tasks.len(),
        messages: snapshot.messages.len(),
    })
}

/// Writes `files` (relative paths) under `dir`, which must be absent or empty.
pub fn write_folder(dir: &Path, files: &[(PathBuf, String)]) -> Result<(), ExportError> {
    let write_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ExportError::Write { path, source }
    };
    if dir.exists() {
        let mut entries = std::fs::read_dir(dir).map_err(write_err(dir))?;
        if entries.next().is_some() {
            return Err(ExportError::NotEmpty(dir.to_path_buf()));
        }
    }
    // Written beside the target and renamed into place, so a failed export leaves no half
    // folder that an import would read.
    let name = dir
        .file_name()
        .map_or_else(|| "export".into(), |name| name.to_string_lossy());
    let staging = dir.with_file_name(format!(".{name}.partial-{}", std::process::id()));
    let written = (|| {
        std::fs::create_dir_all(&staging).map_err(write_err(&staging))?;
        for (relative, text) in files {
            let path = staging.join(relative);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(write_err(parent))?;
            }
            std::fs::write(&path, text).map_err(write_err(&path))?;
        }
        if dir.exists() {
            std::fs::remove_dir(dir).map_err(write_err(dir))?;
        }
        std::fs::rename(&staging, dir).map_err(write_err(dir))
    })();
    if written.is_err() {
        // Best effort: the error being returned matters more than the cleanup.
        let _ = std::fs::remove_dir_all(&staging);
    }
    written
}

/// Renders the folder: (relative path, contents), in a stable order.
pub fn render(snapshot: &Snapshot, now: DateTime<Utc>) -> Vec<(PathBuf, String)> {
    let mut files = Vec::new();
    let pretty = |value: &Value| {
        let mut text = serde_json::to_string_pretty(value).unwrap_or_default();
        text.push('\n');
        text
    };
    let roles = roles_used(&snapshot.tasks);
    files.push((
        PathBuf::from("team-session.json"),
        pretty(&team_session(snapshot, &roles)),
    ));
    files.push((
        PathBuf::from("task-analysis.json"),
        pretty(&task_analysis(snapshot, &roles)),
    ));
    for (role, prefix) in &roles {
        files.push((
            PathBuf::from(format!("role-specs/{}.md", role.as_str())),
            role_spec(*role, prefix),
        ));
    }
    for task in &snapshot.tasks {
        files.push((
            PathBuf::from(format!(".task/{}.json", task.id)),
            pretty(&task_json(task)),
        ));
    }
    let mut lines = String::new();
    for message in &snapshot.messages {
        lines.push_str(&message_record(message).to_string());
        lines.push('\n');
    }
    files.push((PathBuf::from(".msg/messages.jsonl"), lines));
    files.push((
        PathBuf::from(".msg/meta.json"),
        pretty(&meta(snapshot, &roles, now)),
    ));
    for task in &snapshot.tasks {
        if task.role == pb::Role::Executor as i32 && task.state == TaskState::Completed as i32 {
            files.push((
                PathBuf::from(format!("summary-{}.md", task.id)),
                summary(task, &snapshot.tasks),
            ));
        }
    }
    let mut run = 0;
    for task in &snapshot.tasks {
        let report = task
            .result
            .as_ref()
            .and_then(|result| match &result.detail {
                Some(Detail::TestRun(report)) => Some(report),
                _ => None,
            });
        if let Some(report) = report {
            run += 1;
            files.push((
                PathBuf::from(format!("results/run-{run}.json")),
                pretty(&test_run(run, task, report)),
            ));
        }
    }
    files
}

/// Roles present in the session with the id prefix their tasks use most.
fn roles_used(tasks: &[pb::Task]) -> Vec<(Role, String)> {
    let mut prefixes: BTreeMap<Role, BTreeMap<String, usize>> = BTreeMap::new();
    for task in tasks {
        let Some(role) = pb::Role::try_from(task.role)
            .ok()
            .and_then(Role::from_proto)
        else {
            continue;
        };
        let prefix = troupe_plan::id_prefix(&task.id).to_ascii_uppercase();
        let counts = prefixes.entry(role).or_default();
        if troupe_plan::TaskKind::from_prefix(&prefix).map(troupe_plan::TaskKind::role)
            == Some(role)
        {
            *counts.entry(prefix).or_default() += 1;
        }
    }
    prefixes
        .into_iter()
        .map(|(role, counts)| {
            let prefix = counts
                .into_iter()
                .max_by_key(|(prefix, count)| (*count, std::cmp::Reverse(prefix.clone())))
                .map(|(prefix, _)| prefix)
                .unwrap_or_else(|| canonical_prefix(role).to_owned());
            (role, prefix)
        })
        .collect()
}

fn canonical_prefix(role: Role) -> &'static str {
    troupe_plan::TaskKind::of("", role).prefix()
}

fn responsibility(role: Role) -> &'static str {
    match role {
        Role::Executor => "code-gen",
        Role::Validator | Role::TestRunner => "validation",
    }
}

fn role_name(task: &pb::Task) -> &'static str {
    pb::Role::try_from(task.role)
        .ok()
        .and_then(Role::from_proto)
        .map_or("unspecified", Role::as_str)
}

fn state(task: &pb::Task) -> TaskState {
    TaskState::try_from(task.state).unwrap_or(TaskState::Unspecified)
}

/// CCW's task status for a troupe task state (§2.1 `status`).
fn ccw_status(state: TaskState) -> &'static str {
    match state {
        // CCW has no approval gate: a task waiting at one has not started.
        TaskState::Unspecified
        | TaskState::Pending
        | TaskState::Ready
        | TaskState::WaitingApproval => "pending",
        TaskState::Running => "in_progress",
        TaskState::Completed => "completed",
        TaskState::Failed | TaskState::TimedOut => "failed",
        TaskState::Skipped | TaskState::Cancelled => "skipped",
        TaskState::Blocked => "blocked",
    }
}

/// CCW's session status (active | paused | completed). A failed or cancelled troupe session is
/// `paused`: it stopped with work left that a resume may retry.
fn session_status(session: &pb::Session) -> &'static str {
    match SessionState::try_from(session.state).unwrap_or(SessionState::Unspecified) {
        SessionState::Completed => "completed",
        SessionState::Failed | SessionState::Cancelled | SessionState::Paused => "paused",
        SessionState::Active | SessionState::Unspecified => "active",
    }
}

fn to_utc(ts: Option<&prost_types::Timestamp>) -> Option<DateTime<Utc>> {
    let ts = ts?;
    DateTime::from_timestamp(ts.seconds, u32::try_from(ts.nanos).unwrap_or(0))
}

/// `2026-03-01T10:00:00Z`, as in `team-session.json`.
fn zulu(ts: Option<&prost_types::Timestamp>) -> Value {
    to_utc(ts).map_or(Value::Null, |ts| {
        json!(ts.to_rfc3339_opts(SecondsFormat::Secs, true))
    })
}

/// `2026-03-01T11:20:42.118+00:00`, as team_msg writes it (§1.F.5).
fn msg_time(ts: DateTime<Utc>) -> String {
    ts.to_rfc3339_opts(SecondsFormat::Millis, false)
}

fn message_number(id: &str) -> Option<u64> {
    id.strip_prefix("MSG-")?.parse().ok()
}

fn team_session(snapshot: &Snapshot, roles: &[(Role, String)]) -> Value {
    let session = &snapshot.session;
    let graph: Map<String, Value> = snapshot
        .tasks
        .iter()
        .map(|task| (task.id.clone(), json!(task.depends_on)))
        .collect();
    let completed: Vec<&str> = snapshot
        .tasks
        .iter()
        .filter(|task| state(task) == TaskState::Completed)
        .map(|task| task.id.as_str())
        .collect();
    let active_workers: Vec<Value> = snapshot
        .tasks
        .iter()
        .filter(|task| state(task) == TaskState::Running)
        .map(|task| {
            json!({"role": role_name(task), "task_id": task.id, "agent_name": task.worker_id,
                   "spawned_at": zulu(task.started_at.as_ref()), "resident": false})
        })
        .collect();
    // An array: the first repository is the plan's default.
    let repos: Vec<Value> = session
        .repos
        .iter()
        .map(|repo| {
            // A local repository by its path, a remote one by its URL; read-only kept.
            let mut entry = if repo.path.is_empty() {
                json!({"name": repo.name, "url": repo.url})
            } else {
                json!({"name": repo.name, "path": repo.path})
            };
            if repo.access == pb::RepoAccess::Read as i32 {
                entry["access"] = json!("read");
            }
            entry
        })
        .collect();
    let description = if session.description.is_empty() {
        &session.name
    } else {
        &session.description
    };
    json!({
        "session_id": session.id,
        "task_description": description,
        "status": session_status(session),
        "team_name": session.name,
        "roles": roles.iter().map(|(role, prefix)| json!({
            "name": role.as_str(),
            "prefix": prefix,
            "responsibility_type": responsibility(*role),
            "inner_loop": false,
            "role_spec": format!("role-specs/{}.md", role.as_str()),
        })).collect::<Vec<_>>(),
        "pipeline": {
            "dependency_graph": graph,
            "tasks_total": snapshot.tasks.len(),
            "tasks_completed": completed.len(),
        },
        "active_workers": active_workers,
        "completed_tasks": completed,
        "completion_action": "interactive",
        "created_at": zulu(session.created_at.as_ref()),
        "troupe": {
            "session_id": session.id,
            "plan_name": session.name,
            "state": crate::report::session_state_name(session.state),
            "mode": troupe_proto::names::name(session.mode()),
            "on_failure": troupe_proto::names::name(session.on_failure()),
            "max_attempts": plan_max_attempts(&snapshot.tasks),
            "repos": repos,
            "task_order": snapshot.tasks.iter().map(|task| task.id.as_str()).collect::<Vec<_>>(),
            "last_sequence": session.last_sequence,
            "commits": session.repos.iter().map(|repo| json!({
                "repo": repo.name, "branch": repo.branch, "base_commit": repo.base_commit,
            })).collect::<Vec<_>>(),
        },
    })
}

/// The plan-wide `max_attempts`: what a task without its own value got (`null` when every
/// task sets one, and then nothing depends on it).
fn plan_max_attempts(tasks: &[pb::Task]) -> Value {
    tasks
        .iter()
        .find(|task| {
            task.spec
                .as_ref()
                .is_none_or(|spec| !spec.fields.contains_key("max_attempts"))
        })
        .map_or(Value::Null, |task| json!(task.max_attempts))
}

fn task_analysis(snapshot: &Snapshot, roles: &[(Role, String)]) -> Value {
    let graph: Map<String, Value> = snapshot
        .tasks
        .iter()
        .map(|task| {
            (
                task.id.clone(),
                json!({"depends_on": task.depends_on, "role": role_name(task)}),
            )
        })
        .collect();
    let count = |role: Role| {
        snapshot
            .tasks
            .iter()
            .filter(|task| task.role == role.to_proto() as i32)
            .count()
    };
    let description = if snapshot.session.description.is_empty() {
        &snapshot.session.name
    } else {
        &snapshot.session.description
    };
    json!({
        "task_description": description,
        "capabilities": roles.iter().map(|(role, prefix)| json!({
            "name": role.as_str(),
            "prefix": prefix,
            "description": match role {
                Role::Executor => "implements code changes through an agent backend",
                Role::Validator => "checks files, syntax and convergence criteria",
                Role::TestRunner => "runs the test suite with coverage",
            },
            "artifact_type": match role {
                Role::Executor => "codebase",
                Role::Validator => "validation report",
                Role::TestRunner => "results/run-N.json",
            },
        })).collect::<Vec<_>>(),
        "dependency_graph": graph,
        "roles": roles.iter().map(|(role, prefix)| json!({
            "name": role.as_str(),
            "prefix": prefix,
            "responsibility_type": responsibility(*role),
            "task_count": count(*role),
            "inner_loop": false,
            "role_spec_metadata": {"additional_members": [], "message_types": message_types(*role)},
        })).collect::<Vec<_>>(),
        "complexity_score": snapshot.tasks.len(),
    })
}

fn message_types(role: Role) -> Value {
    match role {
        Role::Executor => {
            json!({"success": "impl_complete", "error": "impl_failed", "progress": "impl_progress"})
        }
        Role::Validator => json!({"success": "verify_passed", "error": "gaps_found"}),
        Role::TestRunner => json!({"success": "tests_passed", "error": "tests_failed"}),
    }
}

/// A role-spec with the frontmatter and phase headings CCW's team-executor checks (§1.E.2).
fn role_spec(role: Role, prefix: &str) -> String {
    let name = role.as_str();
    let mut text = String::new();
    let _ = writeln!(text, "---");
    let _ = writeln!(text, "role: {name}");
    let _ = writeln!(text, "prefix: {prefix}");
    let _ = writeln!(text, "inner_loop: false");
    let _ = writeln!(text, "message_types: {}", message_types(role));
    let _ = writeln!(text, "---");
    let _ = writeln!(text, "# {name}\n");
    let _ = writeln!(
        text,
        "Exported by troupe: the troupe {name} service runs these tasks.\n"
    );
    let _ = writeln!(text, "## Phase 2\n\nRead the task JSON under `.task/`.\n");
    let _ = writeln!(text, "## Phase 3\n\nDo the task.\n");
    let _ = writeln!(text, "## Phase 4\n\nReport the result on the message bus.");
    text
}

fn task_json(task: &pb::Task) -> Value {
    let mut spec = task.spec.as_ref().map(struct_to_object).unwrap_or_default();
    spec.insert("id".into(), json!(task.id));
    spec.insert("status".into(), json!(ccw_status(state(task))));
    if let Some(started) = task.started_at.as_ref() {
        spec.insert("executed_at".into(), zulu(Some(started)));
    }
    if task.result.is_some() || task.last_error.is_some() {
        let result = task.result.clone().unwrap_or_default();
        let error = task
            .last_error
            .as_ref()
            .filter(|_| state(task) != TaskState::Completed)
            .map_or(Value::Null, |error| json!(error.message));
        spec.insert(
            "result".into(),
            json!({
                "success": state(task) == TaskState::Completed,
                "files_modified": result.files_modified,
                "summary": result.summary,
                "error": error,
                "commit_hash": result.commit,
                // troupe's coordinator reads `commit` when it imports a completed task.
                "commit": result.commit,
            }),
        );
    }
    // One boolean per criterion, as a validator wrote them back onto the task.
    if let Some(convergence) = &task.convergence
        && let Some(Value::Object(result)) = spec.get_mut("result")
    {
        result.insert("convergence_verified".into(), json!(convergence.verified));
    }
    Value::Object(spec)
}

fn message_record(message: &pb::Message) -> Value {
    let mut record = Map::new();
    record.insert("id".into(), json!(message.id));
    record.insert(
        "ts".into(),
        to_utc(message.ts.as_ref()).map_or(Value::Null, |ts| json!(msg_time(ts))),
    );
    record.insert("from".into(), json!(message.from));
    record.insert("to".into(), json!(message.to));
    record.insert("type".into(), json!(message.r#type));
    record.insert("summary".into(), json!(message.summary));
    if let Some(data) = &message.data {
        record.insert("data".into(), Value::Object(struct_to_object(data)));
    }
    Value::Object(record)
}

fn meta(snapshot: &Snapshot, roles: &[(Role, String)], now: DateTime<Utc>) -> Value {
    let session = &snapshot.session;
    let status = if session.state == SessionState::Completed as i32 {
        "completed"
    } else {
        "active"
    };
    let updated = to_utc(session.updated_at.as_ref()).unwrap_or(now);
    let mut names = vec!["coordinator".to_owned()];
    names.extend(roles.iter().map(|(role, _)| role.as_str().to_owned()));
    json!({
        "status": status,
        "created_at": zulu(session.created_at.as_ref()),
        "updated_at": msg_time(updated),
        "pipeline_mode": troupe_proto::names::name(session.mode()),
        "pipeline_stages": roles.iter().map(|(role, _)| role.as_str()).collect::<Vec<_>>(),
        "team_name": session.name,
        "task_description": session.description,
        "roles": names,
        "role_state": snapshot.role_state,
    })
}

/// Every task `id` depends on, directly or not.
fn upstream_of<'a>(tasks: &'a [pb::Task], id: &str) -> BTreeSet<&'a str> {
    let by_id: HashMap<&str, &pb::Task> =
        tasks.iter().map(|task| (task.id.as_str(), task)).collect();
    let mut seen = BTreeSet::new();
    let mut stack: Vec<&str> = by_id
        .get(id)
        .map(|task| task.depends_on.iter().map(String::as_str).collect())
        .unwrap_or_default();
    while let Some(next) = stack.pop() {
        if let Some(task) = by_id.get(next)
            && seen.insert(task.id.as_str())
        {
            stack.extend(task.depends_on.iter().map(String::as_str));
        }
    }
    seen
}

/// `pass`, `fail` or `pending` for an executor task: from the validators downstream of it,
/// else from its own self-validation (§2.5 says the verifier should write this back).
fn convergence_met(task: &pb::Task, tasks: &[pb::Task]) -> (&'static str, Vec<pb::CheckResult>) {
    let mut verdicts = Vec::new();
    let mut checks = Vec::new();
    for validator in tasks
        .iter()
        .filter(|other| other.role == pb::Role::Validator as i32)
        .filter(|other| upstream_of(tasks, &other.id).contains(task.id.as_str()))
    {
        let report = validator.result.as_ref().and_then(|r| match &r.detail {
            Some(Detail::Validation(report)) => Some(report),
            _ => None,
        });
        match (state(validator), report) {
            (TaskState::Completed, Some(report)) => {
                verdicts.push(Verdict::try_from(report.verdict).unwrap_or(Verdict::Unspecified));
                checks.extend(report.checks.iter().cloned());
            }
            (TaskState::Completed, None) => verdicts.push(Verdict::Pass),
            (TaskState::Failed, _)
                if validator
                    .last_error
                    .as_ref()
                    .is_some_and(|error| error.kind == pb::ErrorKind::CheckFailed as i32) =>
            {
                verdicts.push(Verdict::Fail);
            }
            _ => verdicts.push(Verdict::Unspecified),
        }
    }
    if verdicts.is_empty() {
        let self_check = task.result.as_ref().and_then(|r| match &r.detail {
            Some(Detail::Implementation(report)) => report.self_validation.as_ref(),
            _ => None,
        });
        if let Some(report) = self_check {
            verdicts.push(Verdict::try_from(report.verdict).unwrap_or(Verdict::Unspecified));
            checks.extend(report.checks.iter().cloned());
        }
    }
    // A validator names its per-task checks `<task id>/...`; they speak for this task even when
    // the validator's own criteria still need a review.
    let prefix = format!("{}/", task.id);
    let own: Vec<&pb::CheckResult> = checks
        .iter()
        .filter(|check| check.name.starts_with(&prefix))
        .collect();
    let failed = |check: &&pb::CheckResult| {
        check.status == CheckStatus::Fail as i32 || check.status == CheckStatus::Error as i32
    };
    let passed = |check: &&pb::CheckResult| {
        check.status == CheckStatus::Pass as i32 || check.status == CheckStatus::Skipped as i32
    };
    // The results a validator wrote back onto the task itself are the final word.
    let written_back = task
        .convergence
        .as_ref()
        .map(pb::TaskConvergence::met)
        .filter(|met| *met != pb::ConvergenceMet::Unspecified)
        .map(troupe_proto::names::name);
    let met = if let Some(met) = written_back {
        met
    } else if own.iter().any(failed) || (own.is_empty() && verdicts.contains(&Verdict::Fail)) {
        "fail"
    } else if (!own.is_empty() && own.iter().all(passed))
        || (!verdicts.is_empty() && verdicts.iter().all(|v| *v == Verdict::Pass))
    {
        "pass"
    } else {
        "pending"
    };
    (met, checks)
}

/// `summary-<ID>.md` with §2.5 frontmatter (rendered by [`troupe_plan::ccw::summary`], which
/// the executor uses too).
fn summary(task: &pb::Task, tasks: &[pb::Task]) -> String {
    let typed = troupe_plan::TaskSpec::try_from(task).ok();
    let result = task.result.clone().unwrap_or_default();
    let implementation = match &result.detail {
        Some(Detail::Implementation(report)) => Some(report),
        _ => None,
    };
    let (met, checks) = convergence_met(task, tasks);
    // Intake typed the task by the same rules; a stored session holds nothing else.
    let criteria = typed
        .as_ref()
        .map(|typed| {
            typed
                .blocks
                .convergence
                .criteria
                .iter()
                .map(|criterion| {
                    let passed = checks.iter().any(|check| {
                        &check.subject == criterion && check.status == CheckStatus::Pass as i32
                    });
                    (criterion.clone(), passed)
                })
                .collect()
        })
        .unwrap_or_default();
    let duration_ms = implementation
        .map(|report| report.duration_ms)
        .filter(|ms| *ms > 0)
        .or_else(|| {
            let started = to_utc(task.started_at.as_ref())?;
            let finished = to_utc(task.finished_at.as_ref())?;
            u64::try_from((finished - started).num_milliseconds()).ok()
        });
    troupe_plan::ccw::summary::TaskSummary {
        phase: typed.as_ref().and_then(|typed| typed.phase().cloned()),
        task: task.id.clone(),
        title: task.title.clone(),
        requires: task.depends_on.clone(),
        affects: result.files_modified.clone(),
        key_files: task.files.iter().map(|file| file.path.clone()).collect(),
        commit: result.commit.clone(),
        convergence_met: met.to_owned(),
        duration_ms,
        completed: to_utc(task.finished_at.as_ref())
            .map(|finished| finished.format("%Y-%m-%dT%H:%M:%S").to_string()),
        result: result.summary.clone(),
        backend: implementation.map(|report| (report.backend.clone(), report.exit_code)),
        output_tail: implementation
            .map(|report| report.output_tail.clone())
            .unwrap_or_default(),
        criteria,
    }
    .render()
}

/// `results/run-N.json` (§2.4, with the proposed additions).
fn test_run(run: usize, task: &pb::Task, report: &pb::TestRunReport) -> Value {
    let totals = report.totals.unwrap_or_default();
    let outcome = TestOutcome::try_from(report.outcome).unwrap_or(TestOutcome::Unspecified);
    let framework = troupe_proto::names::name(report.framework());
    let coverage = report.coverage.as_ref().and_then(|c| c.overall);
    let failure_summary = if report.failures.is_empty() {
        String::new()
    } else {
        let first = &report.failures[0];
        format!(
            "{} failing: {} ({})",
            report.failures.len(),
            first.name,
            first.message.lines().next().unwrap_or_default()
        )
    };
    // Intake typed the task; the test-runner's default layer otherwise.
    let layer = troupe_plan::TaskSpec::try_from(task)
        .ok()
        .and_then(|typed| typed.blocks.test)
        .and_then(|test| test.layer)
        .unwrap_or_else(|| "L1-unit".to_owned());
    json!({
        "run_id": format!("run-{run:03}"),
        "task_id": task.id,
        "layer": layer,
        "framework": framework,
        "pass_rate": report.pass_rate,
        "coverage": coverage,
        "coverage_target": report.coverage_target,
        "iterations": task.attempt,
        "passed": outcome == TestOutcome::Passed,
        "outcome": troupe_proto::names::name(outcome),
        "failure_summary": failure_summary,
        "defect_patterns": [],
        "effective_patterns": [],
        "timestamp": zulu(task.finished_at.as_ref()),
        "total": totals.total,
        "tests_passed": totals.passed,
        "failed": totals.failed,
        "skipped": totals.skipped,
        "errors": totals.errors,
        "duration_ms": report.duration_ms,
        "command": report.command,
        "exit_code": report.exit_code,
        "report_path": report.report_paths.first(),
        "report_paths": report.report_paths,
        "commit": report.commit,
        "failures": report.failures.iter().map(|f| json!({
            "test": f.name, "error": f.message, "file": f.file, "line": f.line,
            "criticality": troupe_proto::names::name(f.criticality()),
        })).collect::<Vec<_>>(),
        "warnings": report.warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timestamp(seconds: i64, millis: i32) -> Option<prost_types::Timestamp> {
        Some(prost_types::Timestamp {
            seconds,
            nanos: millis * 1_000_000,
        })
    }

    #[test]
    fn message_times_use_an_explicit_utc_offset() {
        let ts = to_utc(timestamp(1_772_364_042, 118).as_ref()).unwrap();
        assert_eq!(msg_time(ts), "2026-03-01T11:20:42.118+00:00");
        assert_eq!(
            zulu(timestamp(1_772_359_200, 0).as_ref()),
            json!("2026-03-01T10:00:00Z")
        );
    }

    #[test]
    fn ccw_statuses_cover_every_state() {
        assert_eq!(ccw_status(TaskState::Ready), "pending");
        assert_eq!(ccw_status(TaskState::Running), "in_progress");
        assert_eq!(ccw_status(TaskState::TimedOut), "failed");
        assert_eq!(ccw_status(TaskState::Cancelled), "skipped");
        assert_eq!(ccw_status(TaskState::Blocked), "blocked");
    }

    fn spec(value: Value) -> Option<prost_types::Struct> {
        Some(troupe_proto::json::to_struct(&value))
    }

    /// A failed session: IMPL-001 done, its validator failed a check, a test run completed.
    fn snapshot() -> Snapshot {
        let implementation = pb::Task {
            id: "IMPL-001".into(),
            title: "Add median".into(),
            role: pb::Role::Executor as i32,
            state: TaskState::Completed as i32,
            attempt: 1,
            spec: spec(json!({"id": "IMPL-001", "title": "Add median", "phase": 2,
                "convergence": {"criteria": ["median works", "docs updated"]}})),
            files: vec![pb::FileChange {
                path: "stats/core.py".into(),
                ..Default::default()
            }],
            result: Some(pb::TaskResult {
                summary: "added median()".into(),
                commit: "abc123".into(),
                files_modified: vec!["stats/core.py".into()],
                detail: Some(Detail::Implementation(pb::ImplementationReport {
                    backend: "command".into(),
                    duration_ms: 125_000,
                    ..Default::default()
                })),
                ..Default::default()
            }),
            started_at: timestamp(1_772_359_200, 0),
            finished_at: timestamp(1_772_359_325, 0),
            ..Default::default()
        };
        let validation = pb::Task {
            id: "VALIDATE-001".into(),
            title: "Validate".into(),
            role: pb::Role::Validator as i32,
            state: TaskState::Failed as i32,
            depends_on: vec!["IMPL-001".into()],
            spec: spec(json!({"id": "VALIDATE-001", "title": "Validate"})),
            last_error: Some(pb::TaskError {
                kind: pb::ErrorKind::CheckFailed as i32,
                message: "1 check failed".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let test_run = pb::Task {
            id: "TESTRUN-001".into(),
            title: "Run tests".into(),
            role: pb::Role::TestRunner as i32,
            state: TaskState::Completed as i32,
            attempt: 2,
            depends_on: vec!["IMPL-001".into()],
            spec: spec(
                json!({"id": "TESTRUN-001", "title": "Run tests", "test": {"framework": "pytest"}}),
            ),
            result: Some(pb::TaskResult {
                detail: Some(Detail::TestRun(pb::TestRunReport {
                    framework: pb::TestFramework::Pytest as i32,
                    outcome: TestOutcome::Passed as i32,
                    command: vec!["python3".into(), "-m".into(), "pytest".into()],
                    totals: Some(pb::TestTotals {
                        total: 10,
                        passed: 10,
                        ..Default::default()
                    }),
                    pass_rate: 1.0,
                    coverage: Some(pb::Coverage {
                        overall: Some(91.5),
                        ..Default::default()
                    }),
                    coverage_target: 80.0,
                    ..Default::default()
                })),
                ..Default::default()
            }),
            ..Default::default()
        };
        Snapshot {
            session: pb::Session {
                id: "s-1".into(),
                name: "demo".into(),
                description: "demo session".into(),
                state: SessionState::Failed as i32,
                mode: pb::SessionMode::Eager as i32,
                on_failure: pb::OnFailure::Skip as i32,
                created_at: timestamp(1_772_359_000, 0),
                ..Default::default()
            },
            tasks: vec![implementation, validation, test_run],
            messages: vec![pb::Message {
                id: "MSG-001".into(),
                ts: timestamp(1_772_364_042, 118),
                from: "IMPL-001".into(),
                to: "coordinator".into(),
                r#type: "task_complete".into(),
                summary: "[IMPL-001] task_complete -> coordinator".into(),
                ..Default::default()
            }],
            role_state: BTreeMap::new(),
        }
    }

    #[test]
    fn renders_summaries_results_and_a_paused_session() {
        let files: BTreeMap<PathBuf, String> =
            render(&snapshot(), Utc::now()).into_iter().collect();
        let json =
            |path: &str| -> Value { serde_json::from_str(&files[&PathBuf::from(path)]).unwrap() };
        let team = json("team-session.json");
        assert_eq!(team["status"], "paused", "a failed session can be resumed");
        assert_eq!(team["troupe"]["state"], "failed");
        assert_eq!(team["completed_tasks"], json!(["IMPL-001", "TESTRUN-001"]));
        let roles: Vec<&str> = team["roles"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["executor", "validator", "test-runner"]);
        assert_eq!(json(".task/VALIDATE-001.json")["status"], "failed");
        assert_eq!(
            json(".task/VALIDATE-001.json")["result"]["error"],
            "1 check failed"
        );

        let summary = &files[&PathBuf::from("summary-IMPL-001.md")];
        assert!(summary.contains("phase: 2\n"), "{summary}");
        assert!(summary.contains("convergence-met: fail\n"), "{summary}");
        assert!(summary.contains("duration: 2m5s\n"), "{summary}");
        assert!(
            summary.contains("completed: 2026-03-01T10:02:05\n"),
            "{summary}"
        );
        assert!(summary.contains("- [ ] median works"), "{summary}");
        assert!(
            summary.contains("# Summary: IMPL-001 - Add median"),
            "{summary}"
        );
        assert!(!files.contains_key(&PathBuf::from("summary-TESTRUN-001.md")));

        let run = json("results/run-1.json");
        assert_eq!(run["run_id"], "run-001");
        assert_eq!(run["task_id"], "TESTRUN-001");
        assert_eq!(run["framework"], "pytest");
        assert_eq!(run["passed"], true);
        assert_eq!(run["coverage"], 91.5);
        assert_eq!(run["iterations"], 2);
        assert_eq!(run["total"], 10);

        let messages = &files[&PathBuf::from(".msg/messages.jsonl")];
        let record: Value = serde_json::from_str(messages.lines().next().unwrap()).unwrap();
        assert_eq!(record["ts"], "2026-03-01T11:20:42.118+00:00");
        assert!(record.get("data").is_none());
        assert_eq!(json(".msg/meta.json")["status"], "active");
    }

    #[test]
    fn a_folder_is_written_whole_into_an_empty_directory() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out");
        std::fs::create_dir(&target).unwrap();
        let files = [
            (PathBuf::from("team-session.json"), "{}".to_owned()),
            (PathBuf::from(".msg/messages.jsonl"), String::new()),
        ];
        write_folder(&target, &files).unwrap();
        assert_eq!(
            std::fs::read_to_string(target.join("team-session.json")).unwrap(),
            "{}"
        );
        assert!(target.join(".msg/messages.jsonl").is_file());
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 1, "no staging folder is left behind");
    }

    #[test]
    fn a_non_empty_folder_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("x"), "").unwrap();
        let err = write_folder(dir.path(), &[(PathBuf::from("a.json"), "{}".into())]).unwrap_err();
        assert!(matches!(err, ExportError::NotEmpty(_)), "{err}");
    }
}
