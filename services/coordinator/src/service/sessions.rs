//! Sessions: intake (`CreateSession`), reading them, and CCW's session commands (`check`,
//! `resume`, `pause`, `cancel`).

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use rand::Rng;
use troupe_plan::Plan;
use troupe_proto::v1::{self as pb, SessionState, TaskState};

use super::{Coordinator, require};
use crate::Error;
use crate::convert::now_ms;
use crate::lifecycle::{self, pause::Paused};
use crate::store::messages::MessageFilter;
use crate::store::sessions::{NewSession, SessionPage, SessionRow, SessionSummary, SessionView};
use crate::store::tasks::TaskFilter;
use crate::task::{self, Task};

/// Tasks `GetSession` returns unless asked otherwise.
const DEFAULT_SESSION_TASKS: usize = 1_000;

/// Tasks a `ListTasks` page holds unless asked otherwise.
const DEFAULT_PAGE: usize = 500;

/// The most tasks one `GetSession` or `ListTasks` page holds.
const MAX_PAGE: usize = 10_000;

/// The token of the page after the task at `position` (plan order). Positions move only
/// when a fix round inserts its two tasks, so a listing across one may see a task twice.
pub(crate) fn page_token(position: i64) -> String {
    format!("after:{position}")
}

fn parse_page_token(token: &str) -> Result<i64, Error> {
    token
        .strip_prefix("after:")
        .and_then(|position| position.parse().ok())
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "page_token {token:?} is not one a listing returned"
            ))
        })
}

/// The most tasks a `CreateSession`, `GetSession` or `ListTasks` reply holds when `asked`
/// (0: `default`).
pub(crate) fn page_size(asked: u32, default: usize) -> usize {
    match asked {
        0 => default,
        max => (max as usize).min(MAX_PAGE),
    }
}

/// What `CreateSession` answers: the session with its counts, a bounded page of its tasks and
/// the plan's number of waves.
#[derive(Debug)]
pub(crate) enum Created {
    /// A dry run's session and every task (nothing is stored to page through): the reply
    /// counts them all and holds the first `max` (see [`page_size`]).
    DryRun {
        view: SessionView,
        max: usize,
        waves: u32,
    },
    /// The stored session's first page.
    Stored { page: SessionPage, waves: u32 },
}

/// A session's status as CCW's `check` reports it; the adapter builds the report
/// ([`crate::check::status`]).
#[derive(Debug)]
pub(crate) struct SessionCheck {
    /// What the store read (see [`crate::store::check`]).
    pub(crate) rows: crate::store::check::CheckRows,
    /// The newest `blocker` messages.
    pub(crate) blockers: Vec<pb::Message>,
    /// The newest `progress` messages, oldest first: each task's latest note.
    pub(crate) progress: Vec<pb::Message>,
    /// Roles whose ready tasks no worker claims (an active session's only).
    pub(crate) gaps: Vec<pb::CapabilityGap>,
    /// Provider quotas its ready tasks wait on (see [`crate::quota`]).
    pub(crate) quota_waits: Vec<pb::QuotaWait>,
    /// When the status was taken (unix ms).
    pub(crate) now: i64,
}

impl Coordinator {
    #[tracing::instrument(skip_all, fields(dry_run = request.dry_run))]
    pub(crate) async fn create_session(
        &self,
        mut request: pb::CreateSessionRequest,
    ) -> Result<Created, Error> {
        let max = page_size(request.max_tasks, DEFAULT_SESSION_TASKS);
        let mut plan = Plan::from_json(&request.plan_json)?;
        // What workers need of the plan's directory travels in the stored plan: EXEC phases'
        // task files and the plan-level execution hints (no worker reads that directory).
        let phase_files = phase_files(&plan, &request.assets, &request.base_dir).await;
        troupe_plan::phase::attach(&mut plan, |dir| {
            phase_files
                .get(dir)
                .cloned()
                .unwrap_or_else(|| Ok(Vec::new()))
        })?;
        troupe_plan::execution::attach(&mut plan, &request.plan_json);
        // The files the plan brings: checked here, stored with the session.
        let assets = match request.assets.len() {
            0 => None,
            _ => Some(
                troupe_grpc::assets::bundle(std::mem::take(&mut request.assets))
                    .map_err(|why| Error::InvalidArgument(format!("invalid plan:\n{why}")))?,
            ),
        };
        // Tasks without an estimate rank by what their role took lately (see
        // docs/plans.md), so a chain of quick checks does not go before slower work.
        plan.weigh_by_role(
            &self
                .store
                .learned_durations(self.learn_from_sessions)
                .await?,
        );
        // The submitting machine's plan directory: relative repositories resolve against it
        // when this machine can see it; across machines, repositories are URLs.
        let base_dir = match request.base_dir.as_str() {
            "" => None,
            dir => Some(
                tokio::fs::canonicalize(dir)
                    .await
                    .unwrap_or_else(|_| PathBuf::from(dir)),
            ),
        };
        let repos = crate::repos::Intake {
            base_dir: base_dir.as_deref(),
            overrides: &request.repo_paths,
            dry_run: request.dry_run,
            data_dir: &self.data_dir,
            credentials: &self.credentials,
        }
        .resolve(&plan)
        .await?;
        let now = now_ms();
        let plan_dir = base_dir
            .as_ref()
            .map(|dir| dir.display().to_string())
            .unwrap_or_default();

        if request.dry_run {
            let session_repos = repos.iter().map(|repo| repo.to_proto("")).collect();
            let session = SessionRow {
                id: String::new(),
                name: plan.name.clone(),
                description: plan.description.clone(),
                state: SessionState::Active,
                mode: plan.mode,
                on_failure: plan.on_failure,
                plan_dir,
                last_seq: 0,
                created_at: now,
                updated_at: now,
            };
            let waves = waves(&plan);
            let mut tasks = task_rows(std::mem::take(&mut plan.tasks), "", now);
            task::settle(&mut tasks, plan.mode, plan.on_failure, now);
            return Ok(Created::DryRun {
                view: SessionView {
                    session,
                    repos: session_repos,
                    tasks,
                },
                max,
                waves,
            });
        }

        let session_id = format!(
            "{}-{}-{:06x}",
            plan.name,
            chrono::Utc::now().format("%Y%m%d"),
            rand::rng().random_range(0..0x100_0000u32)
        );
        let branch = format!("troupe/{session_id}");
        let created = crate::repos::create_local_branches(&repos, &branch).await?;
        let session_repos = repos.iter().map(|repo| repo.to_proto(&branch)).collect();
        let (waves, task_count) = (waves(&plan), plan.tasks.len());
        let new = NewSession {
            session: SessionRow {
                id: session_id.clone(),
                name: plan.name.clone(),
                description: plan.description.clone(),
                state: SessionState::Active,
                mode: plan.mode,
                on_failure: plan.on_failure,
                plan_dir,
                last_seq: 0,
                created_at: now,
                updated_at: now,
            },
            plan_json: request.plan_json,
            repos: session_repos,
            assets,
            tasks: task_rows(std::mem::take(&mut plan.tasks), &session_id, now),
        };
        match lifecycle::create::create_session(&self.store, new, now).await {
            Ok((session, tasks)) => {
                // Off the reply's path: a copy of 50,000 tasks takes a few hundred
                // milliseconds to build, and a claim that comes first reads the session.
                let group = self.group.clone();
                tokio::task::spawn_blocking(move || group.seed(session, tasks));
            }
            Err(err) => {
                crate::repos::delete_branches(&created, &branch).await;
                return Err(err);
            }
        }
        self.notify();
        tracing::info!(session_id = %session_id, tasks = task_count, "session created");
        troupe_telemetry::spans::record_session(
            &session_id,
            vec![
                troupe_telemetry::spans::KeyValue::new("troupe.plan.name", plan.name.clone()),
                troupe_telemetry::spans::KeyValue::new(
                    "troupe.plan.tasks",
                    i64::try_from(task_count).unwrap_or(i64::MAX),
                ),
            ],
        );
        // The answer is a page, as `GetSession`'s: the whole session would be as large as the
        // plan, and as long to read back.
        Ok(Created::Stored {
            page: self.store.session_page(&session_id, max).await?,
            waves,
        })
    }

    /// The bundle of plan assets stored under `digest`, encoded.
    pub(crate) async fn get_plan_assets(&self, digest: &str) -> Result<Vec<u8>, Error> {
        require(digest, "digest")?;
        self.store
            .plan_assets(digest)
            .await?
            .ok_or_else(|| Error::NotFound(format!("no plan assets with digest {digest}")))
    }

    /// A session with its counts and its first `max_tasks` tasks (default
    /// [`DEFAULT_SESSION_TASKS`], at most [`MAX_PAGE`]).
    pub(crate) async fn get_session(
        &self,
        request: &pb::GetSessionRequest,
    ) -> Result<SessionPage, Error> {
        require(&request.session_id, "session_id")?;
        let max = page_size(request.max_tasks, DEFAULT_SESSION_TASKS);
        self.store.session_page(&request.session_id, max).await
    }

    /// A page of a session's tasks (`ListTasks`), and the token of the next page when more
    /// match.
    pub(crate) async fn list_tasks(
        &self,
        request: &pb::ListTasksRequest,
    ) -> Result<(Vec<Task>, Option<String>), Error> {
        require(&request.session_id, "session_id")?;
        let limit = page_size(request.page_size, DEFAULT_PAGE);
        let after = match request.page_token.as_str() {
            "" => None,
            token => Some(parse_page_token(token)?),
        };
        let filter = TaskFilter {
            states: request.states().collect(),
            roles: request.roles().collect(),
            repo: (!request.repo.is_empty()).then(|| request.repo.clone()),
            id_prefix: (!request.id_prefix.is_empty()).then(|| request.id_prefix.clone()),
        };
        let (tasks, next) = self
            .store
            .task_page(&request.session_id, &filter, after, limit)
            .await?;
        Ok((tasks, next.map(page_token)))
    }

    pub(crate) async fn list_sessions(
        &self,
        request: pb::ListSessionsRequest,
    ) -> Result<Vec<SessionSummary>, Error> {
        let state = match request.state() {
            SessionState::Unspecified => None,
            state => Some(state),
        };
        let limit = match request.limit {
            0 => 50,
            limit => limit.min(500),
        };
        self.store.list_sessions(state, limit).await
    }

    #[tracing::instrument(skip_all, fields(session_id = %request.session_id))]
    pub(crate) async fn cancel_session(
        &self,
        request: pb::CancelSessionRequest,
    ) -> Result<SessionSummary, Error> {
        require(&request.session_id, "session_id")?;
        let summary = lifecycle::cancel::cancel_session(
            &self.store,
            &request.session_id,
            &request.reason,
            now_ms(),
        )
        .await?;
        self.notify();
        Ok(summary)
    }

    /// A person's answer at a task's approval gate; `by` names them (their token's or
    /// certificate's name). Returns the task as it then stands.
    pub(crate) async fn answer_gate(
        &self,
        (session_id, task_id): (&str, &str),
        approve: bool,
        (by, note): (&str, &str),
    ) -> Result<crate::task::Task, Error> {
        require(session_id, "session_id")?;
        require(task_id, "task_id")?;
        let answer = lifecycle::gate::Answer { approve, by, note };
        let task =
            lifecycle::gate::answer(&self.store, session_id, task_id, answer, now_ms()).await?;
        self.notify();
        tracing::info!(session_id, task_id, approve, by, "gate answered");
        Ok(task)
    }

    /// A person's answer at a role's checkpoint (`ROLE:WHEN`); returns the tasks it held.
    pub(crate) async fn answer_checkpoint(
        &self,
        (session_id, checkpoint): (&str, &str),
        approve: bool,
        (by, note): (&str, &str),
    ) -> Result<Vec<crate::task::Task>, Error> {
        require(session_id, "session_id")?;
        let answer = lifecycle::gate::Answer { approve, by, note };
        let tasks = lifecycle::gate::answer_checkpoint(
            &self.store,
            session_id,
            checkpoint,
            answer,
            now_ms(),
        )
        .await?;
        self.notify();
        tracing::info!(session_id, checkpoint, approve, by, "checkpoint answered");
        Ok(tasks)
    }

    /// The session's tasks waiting at a role's checkpoint, with its id.
    pub(crate) async fn held_at_checkpoints(
        &self,
        session_id: &str,
    ) -> Result<std::collections::HashMap<String, String>, Error> {
        lifecycle::gate::held_at_checkpoints(&self.store, session_id).await
    }

    /// CCW `check`: the session's status, read-only.
    pub(crate) async fn check_session(
        &self,
        session_id: &str,
        max_graph: u32,
    ) -> Result<SessionCheck, Error> {
        require(session_id, "session_id")?;
        let now = now_ms();
        let max_graph = page_size(max_graph, DEFAULT_SESSION_TASKS);
        // No more task rows than the reply shows (issue 21).
        let rows = self.store.check_rows(session_id, max_graph, now).await?;
        let recent = |kind: &str, last: u32| MessageFilter {
            kind: Some(kind.to_owned()),
            last,
            ..MessageFilter::default()
        };
        let (blockers, _) = self
            .store
            .list_messages(session_id, &recent("blocker", 10))
            .await?;
        let (progress, _) = self
            .store
            .list_messages(session_id, &recent("progress", 50))
            .await?;
        let gaps = if rows.session.state == SessionState::Active && rows.counts.ready > 0 {
            self.gaps(session_id, now).await?
        } else {
            Vec::new()
        };
        let quota_waits = if rows.session.state == SessionState::Active {
            self.quotas.waits(session_id, now)
        } else {
            Vec::new()
        };
        Ok(SessionCheck {
            rows,
            blockers,
            progress,
            gaps,
            quota_waits,
            now,
        })
    }

    /// The capability and backend gaps of an active session's ready tasks, reading per role
    /// their count and, only for a role or route no live worker serves, the first
    /// [`crate::check::MAX_LISTED`] of them.
    async fn gaps(&self, session_id: &str, now: i64) -> Result<Vec<pb::CapabilityGap>, Error> {
        use crate::check::MAX_LISTED;
        let ready_roles = self.store.ready_roles(session_id).await?;
        let seen = self.store.role_last_seen(0).await?;
        let threshold = super::millis(self.capability_gap);
        let counts: HashMap<pb::Role, u32> = ready_roles.iter().copied().collect();
        let mut unserved_ready = Vec::new();
        for (role, _) in &ready_roles {
            let last = seen
                .get(role)
                .copied()
                .unwrap_or(self.started_at)
                .max(self.started_at);
            if now - last >= threshold {
                for (_, id) in self
                    .store
                    .ready_ids(session_id, *role, None, MAX_LISTED)
                    .await?
                {
                    unserved_ready.push((id, *role));
                }
            }
        }
        let mut gaps = crate::check::capability_gaps(
            &unserved_ready,
            &counts,
            &seen,
            self.started_at,
            now,
            self.capability_gap,
        );
        // Routed tasks no live worker of their role can run (see `routing`).
        let unserved: Vec<pb::Role> = gaps.iter().map(pb::CapabilityGap::role).collect();
        let live_since = now - threshold;
        let mut offers = HashMap::new();
        let mut routed: Vec<(i64, crate::check::Ready)> = Vec::new();
        let mut route_counts: HashMap<(pb::Role, String), u32> = HashMap::new();
        for (role, _) in &ready_roles {
            if unserved.contains(role) {
                continue;
            }
            let live = self.store.offers(*role, live_since).await?;
            if live.is_empty() {
                continue;
            }
            for (column, count) in self.store.ready_routes(session_id, *role).await? {
                let routes = crate::lifecycle::routing::from_column(column.as_deref());
                let (Some(primary), Some(column)) = (routes.first(), column.as_deref()) else {
                    continue;
                };
                if crate::lifecycle::routing::served(&live, &routes) {
                    continue;
                }
                *route_counts.entry((*role, primary.clone())).or_default() += count;
                for (position, id) in self
                    .store
                    .ready_ids(session_id, *role, Some(column), MAX_LISTED)
                    .await?
                {
                    routed.push((position, (id, *role, routes.clone())));
                }
            }
            offers.insert(*role, live);
        }
        // Plan order across routes, as if read in one pass.
        routed.sort_by_key(|(position, _)| *position);
        let routed: Vec<crate::check::Ready> = routed.into_iter().map(|(_, ready)| ready).collect();
        gaps.extend(crate::check::backend_gaps(
            &routed,
            &route_counts,
            &offers,
            &unserved,
        ));
        Ok(gaps)
    }

    /// CCW `resume`: reconcile, advance, then report the status.
    #[tracing::instrument(skip_all, fields(session_id = %session_id))]
    pub(crate) async fn resume_session(
        &self,
        session_id: &str,
    ) -> Result<(Vec<pb::TaskTransition>, SessionCheck), Error> {
        require(session_id, "session_id")?;
        let reconciled = lifecycle::resume::resume(&self.store, session_id, now_ms()).await?;
        self.notify();
        tracing::info!(reconciled = reconciled.len(), "session resumed");
        Ok((reconciled, self.check_session(session_id, 0).await?))
    }

    /// Pauses a session: no new claims until resumed; running tasks finish and are recorded.
    #[tracing::instrument(skip_all, fields(session_id = %request.session_id))]
    pub(crate) async fn pause_session(
        &self,
        request: pb::PauseSessionRequest,
    ) -> Result<Paused, Error> {
        require(&request.session_id, "session_id")?;
        let paused = lifecycle::pause::pause_session(
            &self.store,
            &request.session_id,
            &request.reason,
            now_ms(),
        )
        .await?;
        if paused.changed {
            self.notify();
            tracing::info!(running = paused.running.len(), "session paused");
        }
        Ok(paused)
    }
}

/// Returns a CCW runtime `status: "completed"` task's result: an imported session resumes
/// where it was. `None` for every other status (those tasks start pending).
fn imported_result(spec: &serde_json::Map<String, serde_json::Value>) -> Option<pb::TaskResult> {
    use serde_json::Value;
    if spec.get("status").and_then(Value::as_str) != Some("completed") {
        return None;
    }
    let strings = |value: Option<&Value>| -> Vec<String> {
        value
            .and_then(Value::as_array)
            .map(|items| {
                items
                    .iter()
                    .filter_map(|item| item.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut result = pb::TaskResult {
        summary: "imported as completed".to_owned(),
        ..Default::default()
    };
    match spec.get("result") {
        Some(Value::String(text)) => result.summary.clone_from(text),
        Some(Value::Object(object)) => {
            result.summary = match object.get("summary") {
                Some(Value::String(text)) => text.clone(),
                _ => Value::Object(object.clone()).to_string(),
            };
            if let Some(commit) = object.get("commit").and_then(Value::as_str) {
                commit.clone_into(&mut result.commit);
            }
            result.files_modified = strings(object.get("files_modified"));
            result.warnings = strings(object.get("warnings"));
        }
        Some(Value::Null) | None => {}
        Some(other) => result.summary = other.to_string(),
    }
    Some(result)
}

/// Builds the stored rows of a plan's tasks (topological order): pending, or completed when
/// the plan says so (CCW runtime `status`).
/// The task files of every phase directory an EXEC task of `plan` names without giving its
/// `phase_tasks` inline, by directory: from the plan's files when it brought some (`troupe run`
/// sends them), else from the submitting machine's `base_dir` when this machine can read it.
async fn phase_files(
    plan: &Plan,
    assets: &[pb::PlanAsset],
    base_dir: &str,
) -> HashMap<String, Result<Vec<(String, Vec<u8>)>, String>> {
    use troupe_plan::phase;
    let dirs: BTreeSet<String> = plan
        .tasks
        .iter()
        .filter(|task| {
            troupe_plan::TaskKind::from_id(&task.id) == Some(troupe_plan::TaskKind::Exec)
        })
        .filter(|task| !task.spec.contains_key(phase::PHASE_TASKS))
        .filter_map(|task| phase::directory(&task.spec)?.ok())
        .collect();
    let mut out = HashMap::new();
    for dir in dirs {
        let files = if !assets.is_empty() {
            let mut files: Vec<(String, Vec<u8>)> = assets
                .iter()
                .filter(|asset| phase::is_task_file(&dir, &asset.path))
                .map(|asset| (asset.path.clone(), asset.content.clone()))
                .collect();
            files.sort();
            Ok(files)
        } else if base_dir.is_empty() {
            Err("its task files did not come with the plan: send them as plan assets (`troupe run` does) or give a base_dir this coordinator can read".to_owned())
        } else {
            read_phase_dir(Path::new(base_dir), &dir).await
        };
        out.insert(dir, files);
    }
    out
}

/// Reads `<base_dir>/<dir>/.task/IMPL-*.json`, sorted by path.
async fn read_phase_dir(base_dir: &Path, dir: &str) -> Result<Vec<(String, Vec<u8>)>, String> {
    let task_dir = base_dir.join(dir).join(".task");
    let mut entries = tokio::fs::read_dir(&task_dir)
        .await
        .map_err(|err| format!("cannot read {}: {err}", task_dir.display()))?;
    let mut files = Vec::new();
    while let Some(entry) = entries
        .next_entry()
        .await
        .map_err(|err| format!("cannot read {}: {err}", task_dir.display()))?
    {
        let path = format!("{dir}/.task/{}", entry.file_name().to_string_lossy());
        if troupe_plan::phase::is_task_file(dir, &path) {
            let bytes = tokio::fs::read(entry.path())
                .await
                .map_err(|err| format!("cannot read {}: {err}", entry.path().display()))?;
            files.push((path, bytes));
        }
    }
    files.sort();
    Ok(files)
}

/// The plan's number of waves (the highest, as they are numbered from 1).
fn waves(plan: &Plan) -> u32 {
    plan.tasks.iter().map(|task| task.wave).max().unwrap_or(0)
}

/// How many plan tasks [`task_rows`] turns into rows between giving back the plan's memory.
const ROWS_BETWEEN_SHRINKS: usize = 4_096;

/// The stored rows of a plan's tasks, in plan order. The plan's tasks are consumed, their
/// strings and objects moved rather than copied, and the plan's buffer is shrunk as it
/// empties: a 100,000-task plan's tasks and their rows are each over 150 MB (a task is large
/// inline), so holding both whole would double intake's peak memory.
fn task_rows(mut tasks: Vec<troupe_plan::PlanTask>, session_id: &str, now: i64) -> Vec<Task> {
    let mut rows = Vec::with_capacity(tasks.len());
    // From the back, so the plan's buffer can shrink in place (a buffer this large is a
    // mapping of its own, which the allocator shortens); the rows are reversed at the end.
    while let Some(task) = tasks.pop() {
        rows.push(task_row(task, tasks.len(), session_id, now));
        if tasks.len().is_multiple_of(ROWS_BETWEEN_SHRINKS) {
            tasks.shrink_to_fit();
        }
    }
    rows.reverse();
    rows
}

/// The row of the plan's task at `position`.
fn task_row(task: troupe_plan::PlanTask, position: usize, session_id: &str, now: i64) -> Task {
    let imported = imported_result(&task.spec);
    let backends = troupe_plan::backend::plan_routes(&task);
    let files = task
        .files
        .iter()
        .map(troupe_plan::FileSpec::to_proto)
        .collect();
    Task {
        session_id: session_id.to_owned(),
        id: task.id,
        position: i64::try_from(position).unwrap_or(i64::MAX),
        title: task.title,
        description: task.description,
        role: task.role.to_proto(),
        priority: task.priority.to_proto(),
        repo: task.repo,
        wave: task.wave,
        critical_path: task.critical_path,
        path_ms: task.path_ms,
        depends_on: task.depends_on,
        files,
        spec: task.spec.into(),
        state: if imported.is_some() {
            TaskState::Completed
        } else {
            TaskState::Pending
        },
        attempt: 0,
        max_attempts: task.max_attempts,
        fencing_token: 0,
        worker_id: String::new(),
        lease_ms: 0,
        lease_expires_at: None,
        not_before: None,
        created_at: now,
        started_at: None,
        finished_at: imported.is_some().then_some(now),
        progress: String::new(),
        result: imported.map(Box::new),
        last_error: None,
        superseded_by: String::new(),
        convergence: None,
        backends,
    }
}

/// Unit tests' coordinator and intake.
#[cfg(test)]
impl Coordinator {
    /// A coordinator on a SQLite store in `dir`, with the store.
    pub(crate) async fn for_tests(dir: &std::path::Path) -> (crate::store::Store, Self) {
        let store = crate::store::Store::open_file(&dir.join("troupe.db"))
            .await
            .unwrap();
        Self::for_tests_on(store, dir)
    }

    /// [`Self::for_tests`] on a fresh schema of the PostgreSQL at `url` (see
    /// [`troupe_testkit::postgres_url`]), its data under `dir`.
    pub(crate) async fn for_tests_on_postgres(
        url: &str,
        dir: &std::path::Path,
    ) -> (crate::store::Store, Self) {
        let url = troupe_testkit::fresh_schema(url, "c").await;
        let store = crate::store::Store::open_url(&url).await.unwrap();
        Self::for_tests_on(store, dir)
    }

    /// [`Self::for_tests`] on `store` (PostgreSQL, say), its data under `dir`.
    pub(crate) fn for_tests_on(
        store: crate::store::Store,
        dir: &std::path::Path,
    ) -> (crate::store::Store, Self) {
        let coordinator = Self::new(
            store.clone(),
            dir.join("data"),
            std::sync::Arc::new(troupe_workspace::Credentials::none()),
            std::time::Duration::from_secs(60),
            0,
            std::sync::Arc::new(crate::quota::Quotas::new(
                Default::default(),
                std::time::Duration::from_secs(1),
            )),
        );
        (store, coordinator)
    }

    /// Takes in `plan`, whose repository `repo` is a new git repository under `base`; returns
    /// the session's id.
    pub(crate) async fn create_for_tests(
        &self,
        plan: &serde_json::Value,
        base: &std::path::Path,
    ) -> String {
        troupe_testkit::git_repo(&base.join("repo"), &[("README.md", "hello\n")]).unwrap();
        let created = self
            .create_session(pb::CreateSessionRequest {
                plan_json: plan.to_string(),
                base_dir: base.display().to_string(),
                ..Default::default()
            })
            .await
            .unwrap();
        let Created::Stored { page, .. } = created else {
            panic!("stored");
        };
        page.session.id.clone()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::Coordinator;
    use crate::lifecycle::task_cache;

    /// The copy of a session that its intake leaves for the group commit is what reading the
    /// session back gives: its row as of the intake's last event and every task field for
    /// field (imported results, dependencies, roles, gates, files and specs included). A
    /// difference would be written back by the session's first optimistic group.
    #[tokio::test]
    async fn the_intake_s_copy_of_a_session_is_what_reading_it_back_gives() {
        let dir = tempfile::tempdir().unwrap();
        let (store, coordinator) = Coordinator::for_tests(dir.path()).await;
        let plan = json!({"name": "copy", "repos": {"app": {"path": "repo"}}, "tasks": [
            {"id": "IMPL-1", "title": "done before", "status": "completed",
             "result": {"summary": "rotated tokens", "files_modified": ["src/auth.py"]}},
            {"id": "IMPL-2", "title": "next", "description": "d", "priority": "high",
             "depends_on": ["IMPL-1"], "files": [{"path": "src/a.py", "action": "modify"}],
             "max_attempts": 3},
            {"id": "IMPL-3", "title": "alone", "backends": ["codex"], "estimate_ms": 2000},
            {"id": "IMPL-4", "title": "ask", "approval": "ship it?", "depends_on": ["IMPL-3"]},
            {"id": "TEST-1", "title": "test", "role": "test-runner", "depends_on": ["IMPL-2", "IMPL-3"]},
            {"id": "VALIDATE-1", "title": "check", "role": "validator", "depends_on": ["TEST-1"]},
        ]});
        let id = coordinator
            .create_for_tests(&plan, &dir.path().join("plan"))
            .await;
        // Built off the reply's path.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let (session, tasks) = loop {
            match coordinator.group.copy_of(&id) {
                Some(copy) => break copy,
                None if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                None => panic!("no copy of the session"),
            }
        };
        let (read, cache) = task_cache::read_back(&store, &id).await;
        assert_eq!(session, read);
        assert!(session.last_seq > 6, "{}", session.last_seq);
        assert_eq!(tasks, cache);
        assert_eq!(tasks.len(), 6);
    }
}
