//! One attempt of one task: worktree, backend, commit, scope check, integration.

// `TaskFailure` is the worker protocol's error (a proto message with an optional partial
// result); it is built once per failed attempt, so boxing it would buy nothing.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use troupe_backends::{BackendError, BackendsConfig, ResumeFrom, RunOutcome, RunSpec};
use troupe_grpc::worker::TaskFailure;
use troupe_proto::v1::{ErrorKind, ImplementationReport, TaskResult, task_result};
use troupe_workspace::{
    Attempt, Claim, Held, Landed, Lease, Mirror, Mirrors, Oid, Publication, Remote, Unleased,
    Worktree,
};

use crate::Error;
use crate::mode::{self, CliExecution, Resolved};
use crate::pre_analysis::PreAnalysis;
use crate::prompt::{UpstreamNote, handoff_prompt};
use crate::spec::{DEFAULT_AGENT_TIMEOUT, ScopePolicy, TaskSpec};
use crate::validation;

/// Where an attempt's commit goes.
#[derive(Debug, Clone)]
pub enum Target {
    /// Start from the session branch's current head on the remote (or the session's base
    /// commit while the branch does not exist yet), commit, and land the commit on the session
    /// branch and the task branch (`troupe-task/<session>/<task>`) under the task's fence.
    Session {
        /// The session branch, `troupe/<session>`.
        branch: String,
        /// The commit the session started from.
        base: Option<Oid>,
    },
    /// Start from `base_ref`, push the commit to the new `branch` (which must not exist on the
    /// remote); no integration.
    Direct {
        /// Commit-ish to start from.
        base_ref: String,
        /// Branch to create.
        branch: String,
    },
}

/// Everything one attempt needs.
#[derive(Debug, Clone)]
pub struct Job {
    /// The task, typed once where the job was made (a claim, a direct call, a phase's task
    /// file).
    pub spec: TaskSpec,
    /// The repository's remote (a local path is a remote on this machine).
    pub remote: Remote,
    /// The plan's name for the repository (`{repo}`).
    pub repo_name: String,
    /// Session id (`direct` outside sessions).
    pub session_id: String,
    /// Task id; defaults to the spec's `id`.
    pub task_id: Option<String>,
    /// Attempt number, 1-based.
    pub attempt: u32,
    /// Plan directory (`{plan_dir}`, and where relative agent programs live).
    pub plan_dir: Option<PathBuf>,
    /// Results of completed dependencies, for the prompt.
    pub upstream: Vec<UpstreamNote>,
    /// Where the commit goes.
    pub target: Target,
    /// The coordinator's lease on this attempt, confirmed before publishing; `None` outside
    /// one (a direct run, a test).
    pub lease: Option<Arc<dyn Lease>>,
    /// The lease's fencing token; 0 outside a lease, where the attempt number serves.
    pub fencing_token: u64,
    /// The session's read-only repositories: checked out beside the task's worktree as
    /// context, and any change to them fails the task.
    pub context: Vec<ContextRepo>,
    /// Told the attempt's token usage as its backend runs report it (a worker's heartbeats
    /// carry it); `None` when nobody follows the attempt.
    pub usage: Option<troupe_backends::UsageMeter>,
}

/// A read-only repository given to a task as context.
#[derive(Debug, Clone)]
pub struct ContextRepo {
    /// Its name in the plan.
    pub name: String,
    /// Its remote.
    pub remote: Remote,
    /// Its session branch (its session head is what the task sees).
    pub branch: String,
    /// The commit its session started from, for when the branch does not exist.
    pub base: Option<Oid>,
}

impl Job {
    /// This job's attempt, as the task's fence knows it.
    fn fence(&self, task_id: &str) -> Attempt {
        let attempt = self.attempt.max(1);
        Attempt {
            session: self.session_id.clone(),
            task: task_id.to_owned(),
            attempt,
            token: if self.fencing_token > 0 {
                self.fencing_token
            } else {
                u64::from(attempt)
            },
        }
    }

    /// The lease to confirm before publishing.
    fn lease(&self) -> Arc<dyn Lease> {
        self.lease.clone().unwrap_or_else(|| Arc::new(Unleased))
    }
}

/// Runs tasks in worktrees under a data directory.
#[derive(Debug, Clone)]
pub struct Executor {
    data_dir: PathBuf,
    mirrors: Mirrors,
    config: Arc<BackendsConfig>,
    options: Arc<Options>,
}

/// Executor settings beyond the backends.
#[derive(Debug, Clone)]
pub struct Options {
    /// Validator service for self-validation; `None` skips it (and says so in the result).
    pub validator_url: Option<String>,
    /// Tasks of one EXEC phase wave run at once.
    pub phase_concurrency: usize,
    /// Repository directory that receives `summary-<ID>.md` on the task branch; `None`
    /// writes no summaries.
    pub summary_dir: Option<String>,
    /// Credentials of the calls to the validator.
    pub connector: troupe_grpc::Connector,
    /// Landlock confinement of agents and pre_analysis commands.
    pub sandbox: troupe_process::sandbox::SandboxArgs,
}

/// Where summaries go by default: a directory of the repository, so they travel with the
/// session branch.
pub const DEFAULT_SUMMARY_DIR: &str = ".troupe-summaries";

impl Default for Options {
    fn default() -> Self {
        Self {
            validator_url: None,
            phase_concurrency: 4,
            summary_dir: Some(DEFAULT_SUMMARY_DIR.to_owned()),
            connector: troupe_grpc::Connector::default(),
            sandbox: troupe_process::sandbox::SandboxArgs::default(),
        }
    }
}

/// What `<data_dir>/sessions/<session>/<task>/session.json` remembers of a task's last
/// successful run, so later tasks can resume or fork its native session.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct SavedSession {
    backend: String,
    native_session_id: String,
    /// The run's home (left in place: CLIs keep absolute paths into it).
    home: PathBuf,
    cwd: PathBuf,
    final_message: String,
    /// Usage as the CLI reported it (codex and qwen count the whole session).
    #[serde(default)]
    usage: (u64, u64, u64),
}

/// CLIs whose reported usage covers the whole session, not just this run (agent-clis.md).
fn cumulative_usage(backend: &str) -> bool {
    matches!(backend, "codex" | "qwen")
}

/// Whether `backend`'s sessions can only be resumed in the directory they ran in.
fn session_bound_to_directory(backend: &str) -> bool {
    troupe_backends::CliKind::from_name(backend)
        .is_some_and(troupe_backends::CliKind::session_bound_to_directory)
}

/// The native session a run continues, the context text of parents it cannot continue, and
/// why a parent that would have been continued natively was not.
struct Resumption {
    native: Option<ResumeFrom>,
    context: String,
    warning: Option<String>,
}

/// The branch a session task commits on. Not `troupe/<session>/<task>`: git cannot hold that
/// next to the session branch `troupe/<session>` (a ref cannot be both a file and a directory).
pub fn task_branch(session_id: &str, task_id: &str) -> String {
    format!("troupe-task/{session_id}/{task_id}")
}

/// A short progress sink (the worker forwards notes with its heartbeats).
pub type Progress<'a> = &'a (dyn Fn(String) + Send + Sync);

fn failure(kind: ErrorKind, message: impl Into<String>, retryable: bool) -> TaskFailure {
    TaskFailure::new(kind, message, retryable)
}

pub(crate) fn workspace_failure(err: troupe_workspace::Error) -> TaskFailure {
    use troupe_workspace::Error as W;
    match err {
        W::NotARepo { .. } | W::UnknownRevision { .. } | W::InvalidBranchName { .. } => {
            failure(ErrorKind::InvalidTask, err.to_string(), false)
        }
        W::Conflict { paths } => failure(
            ErrorKind::MergeConflict,
            format!("integration conflicts in {}", paths.join(", ")),
            true,
        )
        .with_details(paths),
        // The coordinator has already handed the task to the newer attempt.
        W::Superseded { .. } | W::LeaseExpired { .. } => {
            failure(ErrorKind::Superseded, err.to_string(), false)
        }
        W::Unreachable { .. } | W::PushRejected { .. } | W::InvalidRemote { .. } => {
            failure(ErrorKind::Repository, err.to_string(), true)
        }
        other => failure(ErrorKind::Internal, other.to_string(), true),
    }
}

fn io_failure(path: &Path, err: &std::io::Error) -> TaskFailure {
    failure(
        ErrorKind::Internal,
        format!("i/o error on {}: {err}", path.display()),
        true,
    )
}

fn backend_kind(kind: troupe_backends::ErrorKind) -> ErrorKind {
    use troupe_backends::ErrorKind as B;
    match kind {
        B::NotInstalled => ErrorKind::NotInstalled,
        B::Auth => ErrorKind::Auth,
        B::RateLimited => ErrorKind::RateLimited,
        B::Quota => ErrorKind::Quota,
        B::Timeout => ErrorKind::Timeout,
        B::Crash => ErrorKind::Crash,
        B::BadOutput => ErrorKind::BadOutput,
        B::InvalidTask => ErrorKind::InvalidTask,
        B::SandboxDenied => ErrorKind::SandboxDenied,
        B::PermissionDenied => ErrorKind::PermissionDenied,
        B::Internal | B::Cancelled => ErrorKind::Internal,
    }
}

/// Keeps a path component to `[A-Za-z0-9._-]`.
pub(crate) fn path_component(text: &str) -> String {
    let cleaned: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    match cleaned.trim_start_matches('.') {
        "" => "_".to_owned(),
        rest => rest.to_owned(),
    }
}

fn short(oid: &Oid) -> &str {
    &oid.as_str()[..12]
}

/// A unique enough name for one direct run (time and process).
fn uuid_like() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{nanos:x}-{}", std::process::id())
}

/// The task id of `job`: its own, else the spec's `id`.
pub(crate) fn job_task_id(job: &Job) -> String {
    job.task_id
        .clone()
        .filter(|id| !id.is_empty())
        .unwrap_or_else(|| job.spec.id.clone())
}

/// Where a session attempt starts: the session branch's head on the remote (the claim just
/// fetched it), else the session's base commit.
pub(crate) async fn session_start(
    mirror: &Mirror,
    session: &str,
    session_branch: &str,
    base: Option<&Oid>,
) -> Result<Oid, TaskFailure> {
    mirror
        .fetch_session_branch(session, session_branch)
        .await
        .map_err(workspace_failure)?;
    if let Some(head) = mirror
        .repo()
        .branch_head(session_branch)
        .await
        .map_err(workspace_failure)?
    {
        return Ok(head);
    }
    let Some(base) = base else {
        return Err(failure(
            ErrorKind::InvalidTask,
            format!(
                "session branch `{session_branch}` does not exist on {} and the claim names no base commit",
                mirror.remote()
            ),
            false,
        ));
    };
    mirror
        .ensure_commit(base, None)
        .await
        .map_err(workspace_failure)?;
    Ok(base.clone())
}

/// The read-only checkouts the agent changed, as `name: paths`; `None` when none.
async fn changed_context(contexts: &[(String, Worktree, Oid)]) -> Option<Vec<String>> {
    let mut changed = Vec::new();
    for (name, worktree, head) in contexts {
        let paths = match worktree.changes_since(head).await {
            Ok(paths) => paths,
            Err(err) => vec![format!("(could not tell: {err})")],
        };
        if !paths.is_empty() {
            changed.push(format!("{name}: {}", paths.join(", ")));
        }
    }
    (!changed.is_empty()).then_some(changed)
}

/// The files a landed commit changed against its first parent.
async fn landed_files(mirror: &Mirror, commit: &Oid) -> Result<Vec<String>, TaskFailure> {
    let parent = mirror
        .repo()
        .resolve(&format!("{commit}^"))
        .await
        .map_err(workspace_failure)?;
    mirror
        .repo()
        .changed_paths(&parent, commit)
        .await
        .map_err(workspace_failure)
}

/// What the agent produced in the worktree.
struct Produced {
    commit: Option<Oid>,
    files: Vec<String>,
    warnings: Vec<String>,
    report: ImplementationReport,
}

/// Resolved inputs of one attempt.
struct Prepared {
    spec: TaskSpec,
    task_id: String,
    session_id: String,
    resolved: Resolved,
    cli: Option<CliExecution>,
    read_only: bool,
    /// The worker's mirror of the remote, where worktrees and commits are made.
    mirror: Mirror,
    /// The remote, for the validator (which fetches the attempt's commit from it).
    remote: Remote,
    /// The fenced attempt (`None` for a direct run), for the commit's trailers.
    attempt: Option<Attempt>,
    /// Read-only context repositories and where each is checked out.
    context: Vec<(ContextRepo, PathBuf)>,
    base: Oid,
    /// The branch checked out in the worktree.
    branch: String,
    /// `<session>/<task>-<attempt>` under `worktrees/` and `attempts/`.
    run_key: PathBuf,
    placeholders: BTreeMap<String, String>,
    upstream: Vec<UpstreamNote>,
    usage: Option<troupe_backends::UsageMeter>,
}

impl Prepared {
    /// The ref that shares this attempt's commit with the validator before it lands.
    fn attempt_ref(&self) -> String {
        match &self.attempt {
            // Per task (an EXEC phase's parts share their EXEC task's attempt) and attempt.
            Some(attempt) => format!(
                "refs/troupe/attempt/{}/{}/{}",
                attempt.session, self.task_id, attempt.attempt
            ),
            None => format!("refs/troupe/attempt/direct/{}", self.branch),
        }
    }
}

fn partial(report: &ImplementationReport, summary: String) -> TaskResult {
    TaskResult {
        summary,
        detail: Some(task_result::Detail::Implementation(report.clone())),
        ..TaskResult::default()
    }
}

impl Executor {
    /// An executor keeping worktrees and attempt files under `data_dir` (absolute).
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self::with_config(data_dir, BackendsConfig::default())
    }

    /// An executor whose backends are configured by `config`.
    pub fn with_config(data_dir: impl Into<PathBuf>, config: BackendsConfig) -> Self {
        Self::with_options(data_dir, config, Options::default())
    }

    /// An executor with backends configured by `config` and the given [`Options`].
    pub fn with_options(
        data_dir: impl Into<PathBuf>,
        config: BackendsConfig,
        options: Options,
    ) -> Self {
        let data_dir = data_dir.into();
        Self {
            mirrors: Mirrors::new(data_dir.join("mirrors")),
            data_dir,
            config: Arc::new(config),
            options: Arc::new(options),
        }
    }

    /// Authenticates to private remotes with `credentials`.
    pub fn with_credentials(mut self, credentials: Arc<troupe_workspace::Credentials>) -> Self {
        self.mirrors = self.mirrors.with_credentials(credentials);
        self
    }

    /// Removes what a previous run of this executor left in its data directory: worktrees of
    /// attempts that died with it (their tasks are retried elsewhere or by this process, from
    /// the remote). Call once at start, while nothing runs.
    pub async fn recover(&self) -> Result<usize, Error> {
        let worktrees = self.worktrees();
        let mut removed = 0;
        if tokio::fs::try_exists(&worktrees).await.unwrap_or(false) {
            let mut sessions =
                tokio::fs::read_dir(&worktrees)
                    .await
                    .map_err(|source| Error::Io {
                        path: worktrees.clone(),
                        source,
                    })?;
            while let Ok(Some(entry)) = sessions.next_entry().await {
                removed += std::fs::read_dir(entry.path()).map_or(0, Iterator::count);
            }
            tokio::fs::remove_dir_all(&worktrees)
                .await
                .map_err(|source| Error::Io {
                    path: worktrees.clone(),
                    source,
                })?;
        }
        self.mirrors.prune_worktrees().await?;
        if removed > 0 {
            info!(removed, "removed worktrees left by an earlier run");
        }
        Ok(removed)
    }

    /// Where attempts' worktrees are made: `<data_dir>/worktrees/tasks/<session>/<task>-<n>`
    /// (the validator and test-runner keep theirs beside it when they share the data dir).
    fn worktrees(&self) -> PathBuf {
        self.data_dir.join("worktrees").join("tasks")
    }

    /// The sandbox of `p`'s children before the worktree and home are added: the service's
    /// settings (or `backend`'s own mode), tightened by the plan's `sandbox` for the task,
    /// with read access to the session's read-only context repositories.
    fn base_sandbox(&self, p: &Prepared, backend: Option<&str>) -> troupe_process::Sandbox {
        let mut sandbox = self.options.sandbox.base(&self.data_dir);
        if let Some(mode) = backend.and_then(|name| self.config.backend(name).sandbox_mode()) {
            sandbox = sandbox.with_mode(mode);
        }
        if let Some(mode) = p
            .spec
            .blocks
            .sandbox
            .and_then(|mode| mode.as_str().parse().ok())
        {
            sandbox = sandbox.tighten(mode);
        }
        for (_, path) in &p.context {
            sandbox = sandbox.read(path);
        }
        sandbox
    }

    /// The executor's options.
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// The phase `job` runs when it is an EXEC task carrying one.
    fn phase_of(job: &Job) -> Option<Result<crate::phase::PhaseRun, String>> {
        let id = job
            .task_id
            .as_deref()
            .filter(|id| !id.is_empty())
            .unwrap_or(&job.spec.id);
        crate::phase::phase_of(&job.spec.object, id, &job.repo_name)
    }

    /// The backend configuration.
    pub fn config(&self) -> &BackendsConfig {
        &self.config
    }

    /// Probes every backend with this executor's settings.
    pub async fn probe(&self) -> Vec<troupe_backends::BackendInfo> {
        troupe_backends::probe_all_with(&self.config).await
    }

    /// One tiny live call with each backend `probe` found usable (not `command`, whose argv
    /// comes with a task), one after another: `(name, "ok in 1.2s: OK" | the failure)`.
    pub async fn probe_live(&self, usable: &[String]) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for name in usable.iter().filter(|name| name.as_str() != "command") {
            if let Some(backend) = troupe_backends::by_name_with(name, &self.config) {
                let result = troupe_backends::probe_live(backend.as_ref()).await;
                out.push((
                    name.clone(),
                    result.unwrap_or_else(|err| format!("failed: {err}")),
                ));
            }
        }
        out
    }

    /// Runs one attempt of a session task: claims the task's fence on the remote, makes a
    /// worktree from the session branch's head, runs the backend, commits, checks scope, and
    /// lands the commit on the session branch exactly once. A task an earlier attempt already
    /// landed (its completion was lost) is reported from that landing, not run again.
    #[tracing::instrument(skip_all, fields(session_id = %job.session_id, task_id = job.task_id.as_deref().unwrap_or_default(), attempt = job.attempt))]
    pub async fn execute(
        &self,
        job: Job,
        cancel: &CancellationToken,
        progress: Progress<'_>,
    ) -> Result<TaskResult, TaskFailure> {
        let Target::Session {
            branch: session_branch,
            base,
        } = job.target.clone()
        else {
            return Err(failure(
                ErrorKind::Internal,
                "execute() needs a session target",
                false,
            ));
        };
        let mirror = self
            .mirrors
            .open(&job.remote)
            .await
            .map_err(workspace_failure)?;
        let task_id = job_task_id(&job);
        let phase = match Self::phase_of(&job) {
            Some(Err(message)) => return Err(failure(ErrorKind::InvalidTask, message, false)),
            Some(Ok(run)) => Some(run),
            None => None,
        };
        progress("claiming the task's fence".to_owned());
        let mut held = match mirror
            .claim(&job.fence(&task_id))
            .await
            .map_err(workspace_failure)?
        {
            Claim::Held(held) => held,
            Claim::Landed(landed) => {
                return self
                    .adopt(&mirror, &task_id, &session_branch, &landed)
                    .await;
            }
        };
        if let Some(run) = phase {
            return self
                .execute_phase(job, run, session_branch, &mirror, &held, cancel, progress)
                .await;
        }
        let base = session_start(&mirror, &job.session_id, &session_branch, base.as_ref()).await?;
        self.run_attempt(job, &mirror, &mut held, None, base, cancel, progress)
            .await
    }

    /// One attempt's work under `held`, from `base` to a landed commit. `part` names an EXEC
    /// phase's task when this is one.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn run_attempt(
        &self,
        job: Job,
        mirror: &Mirror,
        held: &mut Held,
        part: Option<&str>,
        base: Oid,
        cancel: &CancellationToken,
        progress: Progress<'_>,
    ) -> Result<TaskResult, TaskFailure> {
        let Target::Session {
            branch: session_branch,
            base: session_base,
        } = job.target.clone()
        else {
            return Err(failure(
                ErrorKind::Internal,
                "run_attempt() needs a session target",
                false,
            ));
        };
        let lease = job.lease();
        let attempt = held.attempt().clone();
        let prepared = self.prepare(
            job,
            mirror,
            base,
            Some(attempt.clone()),
            |_, task_id, session| task_branch(session, task_id),
        )?;
        let produced = self.produce(&prepared, cancel, progress).await?;
        let Prepared {
            spec,
            task_id,
            base,
            branch,
            ..
        } = prepared;

        let Some(commit) = produced.commit else {
            return Ok(TaskResult {
                branch_depth: 0,
                summary: format!("{task_id}: the agent made no changes (allowed by allow_empty)"),
                commit: base.to_string(),
                task_branch: branch,
                files_modified: Vec::new(),
                warnings: produced.warnings,
                detail: Some(task_result::Detail::Implementation(produced.report)),
            });
        };
        progress(format!("landing on {session_branch}"));
        let message = format!("troupe: integrate {task_id} ({})", spec.title);
        let publication = Publication {
            session_branch: &session_branch,
            base: session_base.as_ref().unwrap_or(&base),
            commit: &commit,
            task_branch: Some(&branch),
            message: &message,
            part,
        };
        let integration = match mirror.publish(held, &publication, lease.as_ref()).await {
            Ok(integration) => integration,
            Err(err) => {
                let summary = format!(
                    "{task_id}: committed {} but could not land it on {session_branch}",
                    short(&commit)
                );
                let result = TaskResult {
                    task_branch: branch.clone(),
                    files_modified: produced.files.clone(),
                    warnings: produced.warnings.clone(),
                    ..partial(&produced.report, summary)
                };
                return Err(workspace_failure(err).with_partial(result));
            }
        };
        info!(commit = %integration.commit, fast_forward = integration.fast_forward, files = produced.files.len(), attempt = attempt.attempt, "task landed");
        let branch_depth = mirror
            .repo()
            .first_parent_depth(&integration.commit)
            .await
            .map_err(workspace_failure)?;
        Ok(TaskResult {
            branch_depth,
            summary: format!(
                "{task_id}: {} file(s) changed by `{}`, integrated into {session_branch} at {} ({})",
                produced.files.len(),
                produced.report.backend,
                short(&integration.commit),
                if integration.fast_forward {
                    "fast-forward"
                } else {
                    "merge"
                }
            ),
            commit: integration.commit.to_string(),
            task_branch: branch,
            files_modified: produced.files,
            warnings: produced.warnings,
            detail: Some(task_result::Detail::Implementation(produced.report)),
        })
    }

    /// The result of a task an earlier attempt landed: what is on the branch, not a new run.
    pub(crate) async fn adopt(
        &self,
        mirror: &Mirror,
        task_id: &str,
        session_branch: &str,
        landed: &Landed,
    ) -> Result<TaskResult, TaskFailure> {
        let mut files = landed_files(mirror, &landed.commit).await?;
        // As a fresh run reports them: the agent's files, not troupe's summary.
        if let Some(dir) = self.options.summary_dir.as_deref() {
            let prefix = format!("{}/", dir.trim_end_matches('/'));
            files.retain(|file| !file.starts_with(&prefix));
        }
        let note = format!(
            "attempt {} had already landed this task at {} (its completion never reached the coordinator); not run again",
            landed.attempt,
            short(&landed.head)
        );
        info!(task_id, landed_by = landed.attempt, head = %landed.head, "adopting an earlier landing");
        let branch_depth = mirror
            .repo()
            .first_parent_depth(&landed.head)
            .await
            .map_err(workspace_failure)?;
        Ok(TaskResult {
            branch_depth,
            summary: format!(
                "{task_id}: {} file(s) changed, integrated into {session_branch} at {} by attempt {}",
                files.len(),
                short(&landed.head),
                landed.attempt
            ),
            commit: landed.head.to_string(),
            task_branch: String::new(),
            files_modified: files,
            warnings: vec![note],
            detail: Some(task_result::Detail::Implementation(ImplementationReport {
                backend_reason: "landed by an earlier attempt".to_owned(),
                ..ImplementationReport::default()
            })),
        })
    }

    /// Runs a task outside any session: creates `branch` on the remote at the agent's commit
    /// made from `base_ref`, and integrates nothing. A failed run leaves no branch behind.
    #[tracing::instrument(skip_all, fields(remote = %job.remote))]
    pub async fn execute_direct(
        &self,
        job: Job,
        cancel: &CancellationToken,
    ) -> Result<TaskResult, Error> {
        let Target::Direct { base_ref, branch } = job.target.clone() else {
            return Err(Error::InvalidArgument(
                "execute_direct() needs a direct target".to_owned(),
            ));
        };
        let mirror = self.mirrors.open(&job.remote).await?;
        let base_ref = if base_ref.is_empty() {
            "HEAD".to_owned()
        } else {
            base_ref
        };
        let full = format!("refs/heads/{branch}");
        if let Some(current) = mirror.remote_head(&full).await? {
            return Err(Error::BranchExists {
                branch,
                current: current.to_string(),
            });
        }
        let base = mirror.fetch_rev(&base_ref).await?;
        match Self::phase_of(&job) {
            Some(Err(message)) => return Err(Error::InvalidArgument(message)),
            Some(Ok(run)) => {
                return self
                    .execute_direct_phase(job, run, branch, &mirror, base, cancel)
                    .await;
            }
            None => {}
        }
        let prepared = self
            .prepare(job, &mirror, base, None, move |_, _, _| branch.clone())
            .map_err(|f| Error::Task(Box::new(f)))?;
        let produced = self
            .produce(&prepared, cancel, &|_| {})
            .await
            .map_err(|failure| Error::Task(Box::new(failure)))?;
        let commit = produced
            .commit
            .clone()
            .unwrap_or_else(|| prepared.base.clone());
        mirror.push_new_branch(&prepared.branch, &commit).await?;
        Ok(TaskResult {
            branch_depth: 0,
            summary: match &produced.commit {
                Some(commit) => format!(
                    "{}: {} file(s) changed by `{}`, committed on {} at {}",
                    prepared.task_id,
                    produced.files.len(),
                    produced.report.backend,
                    prepared.branch,
                    short(commit)
                ),
                None => format!(
                    "{}: the agent made no changes (allowed by allow_empty)",
                    prepared.task_id
                ),
            },
            commit: commit.to_string(),
            task_branch: prepared.branch,
            files_modified: produced.files,
            warnings: produced.warnings,
            detail: Some(task_result::Detail::Implementation(produced.report)),
        })
    }

    /// An EXEC phase outside any session: the new branch plays the session branch, and the
    /// phase's tasks land on it under a fence of this run alone, which is removed afterwards
    /// (as is the branch when the phase fails).
    async fn execute_direct_phase(
        &self,
        job: Job,
        run: crate::phase::PhaseRun,
        branch: String,
        mirror: &Mirror,
        base: Oid,
        cancel: &CancellationToken,
    ) -> Result<TaskResult, Error> {
        let task_id = job_task_id(&job);
        let session_job = Job {
            session_id: format!("direct-{}", uuid_like()),
            target: Target::Session {
                branch: branch.clone(),
                base: Some(base),
            },
            ..job
        };
        let fence = session_job.fence(&task_id);
        let held = match mirror.claim(&fence).await? {
            Claim::Held(held) => held,
            Claim::Landed(_) => {
                return Err(Error::InvalidArgument(format!(
                    "fence {} of a fresh run is already landed",
                    fence.fence_ref()
                )));
            }
        };
        let result = self
            .execute_phase(
                session_job,
                run,
                branch.clone(),
                mirror,
                &held,
                cancel,
                &|_| {},
            )
            .await;
        let mut leftovers = vec![fence.fence_ref()];
        if result.is_err() {
            leftovers.push(format!("refs/heads/{branch}"));
        }
        for full in leftovers {
            if let Err(err) = async {
                mirror.fetch(&[format!("+{full}:{full}")]).await?;
                match mirror.repo().ref_head(&full).await? {
                    Some(at) => mirror.delete_ref(&full, &at).await.map(drop),
                    None => Ok(()),
                }
            }
            .await
            {
                warn!(git_ref = %full, error = %err, "could not remove what a direct phase left");
            }
        }
        result.map_err(|f| Error::Task(Box::new(f)))
    }

    fn prepare(
        &self,
        job: Job,
        mirror: &Mirror,
        base: Oid,
        attempt: Option<Attempt>,
        branch_for: impl FnOnce(&TaskSpec, &str, &str) -> String,
    ) -> Result<Prepared, TaskFailure> {
        let spec = job.spec;
        let task_id = job
            .task_id
            .clone()
            .filter(|id| !id.is_empty())
            .unwrap_or_else(|| spec.id.clone());
        let resolved = mode::resolve(&spec, &self.config);
        let read_only = spec
            .object
            .get("mode")
            .or_else(|| spec.object.get("agent").and_then(|a| a.get("mode")))
            .and_then(Value::as_str)
            .is_some_and(|m| m.eq_ignore_ascii_case("analysis"));
        let cli = mode::cli_execution(&spec.object);
        let branch = branch_for(&spec, &task_id, &job.session_id);
        let run_key =
            match &job.target {
                Target::Session { .. } => PathBuf::from(path_component(&job.session_id)).join(
                    format!("{}-{}", path_component(&task_id), job.attempt.max(1)),
                ),
                Target::Direct { .. } => PathBuf::from("direct").join(path_component(&branch)),
            };
        let mut placeholders = BTreeMap::from([
            ("task_id".to_owned(), task_id.clone()),
            ("session_id".to_owned(), job.session_id.clone()),
            ("repo".to_owned(), job.repo_name.clone()),
        ]);
        if let Some(plan_dir) = &job.plan_dir {
            placeholders.insert("plan_dir".to_owned(), plan_dir.display().to_string());
        }
        // Beside the worktree, never inside it: nothing of the context is committed.
        let context_dir = self
            .worktrees()
            .join(format!("{}.context", run_key.display()));
        let context: Vec<(ContextRepo, PathBuf)> = job
            .context
            .iter()
            .map(|repo| (repo.clone(), context_dir.join(path_component(&repo.name))))
            .collect();
        for (repo, path) in &context {
            placeholders.insert(format!("context:{}", repo.name), path.display().to_string());
        }
        Ok(Prepared {
            spec,
            task_id,
            session_id: job.session_id.clone(),
            resolved,
            cli,
            read_only,
            mirror: mirror.clone(),
            remote: job.remote,
            attempt,
            context,
            base,
            branch,
            run_key,
            placeholders,
            upstream: job.upstream,
            usage: job.usage,
        })
    }

    /// Worktree, prompt, backend, commit, scope check; the worktree is always removed.
    async fn produce(
        &self,
        p: &Prepared,
        cancel: &CancellationToken,
        progress: Progress<'_>,
    ) -> Result<Produced, TaskFailure> {
        let attempt_dir = self.data_dir.join("attempts").join(&p.run_key);
        let mut worktree_path = self.worktrees().join(&p.run_key);
        tokio::fs::create_dir_all(&attempt_dir)
            .await
            .map_err(|err| io_failure(&attempt_dir, &err))?;
        // Resuming: work where the parent worked. Gemini, qwen and opencode find sessions by
        // directory, and the parent's worktree is gone once its run ended. Creating the
        // directory claims it: of two children of one parent at once (a fork), only one gets
        // it; the other works in its own worktree and `resume_for` gives it the parent's
        // result as context instead of the native session.
        let mut claimed = false;
        if let Some(cli) = &p.cli
            && let Some(parent) = cli.from.first()
            && let Some((saved, _)) = self.load_session(&p.session_id, parent)
            && saved.cwd.starts_with(self.worktrees())
            && let Some(above) = saved.cwd.parent()
        {
            tokio::fs::create_dir_all(above)
                .await
                .map_err(|err| io_failure(above, &err))?;
            if tokio::fs::create_dir(&saved.cwd).await.is_ok() {
                worktree_path = saved.cwd;
                claimed = true;
            }
        }
        progress(format!("creating worktree at {}", short(&p.base)));
        // Detached: a worktree of a dead attempt never holds a branch another attempt needs.
        let repo = p.mirror.repo();
        let (attempt_dir, worktree_path) = (attempt_dir.as_path(), worktree_path.as_path());
        let work = |worktree: Worktree| async move {
            self.work_in(p, &worktree, worktree_path, attempt_dir, cancel, progress)
                .await
        };
        let outcome = if claimed {
            repo.in_claimed_detached_worktree(worktree_path, &p.base, work)
                .await
        } else {
            // A crashed earlier run may have left this exact worktree behind: it is replaced.
            repo.in_detached_worktree(worktree_path, &p.base, work)
                .await
        };
        outcome.map_err(workspace_failure)?
    }

    /// The attempt's work in its worktree: read-only context checkouts, pre_analysis, the
    /// prompt, the backend; a change to a read-only repository fails it whatever else happened.
    async fn work_in(
        &self,
        p: &Prepared,
        worktree: &Worktree,
        worktree_path: &Path,
        attempt_dir: &Path,
        cancel: &CancellationToken,
        progress: Progress<'_>,
    ) -> Result<Produced, TaskFailure> {
        let contexts = match self.check_out_context(p, progress).await {
            Ok(contexts) => contexts,
            Err(failure) => {
                self.remove_context(p).await;
                return Err(failure);
            }
        };
        let result = async {
            let pre = if !p.spec.blocks.pre_analysis.is_empty() {
                progress("running pre_analysis".to_owned());
                let mut sandbox = self
                    .base_sandbox(p, None)
                    .write(worktree.path())
                    .git_worktree(worktree.path())
                    .home(attempt_dir.join("home-pre-analysis"));
                if let Some(plan_dir) = p.placeholders.get("plan_dir") {
                    sandbox = sandbox.read(plan_dir);
                }
                crate::pre_analysis::run(
                    &p.spec.blocks.pre_analysis,
                    worktree.path(),
                    &sandbox,
                    cancel,
                )
                .await
                .map_err(|message| {
                    match sandbox.denied(&message, Some(worktree.path())) {
                        Some(denied) => failure(
                            ErrorKind::SandboxDenied,
                            format!("pre_analysis was denied by the sandbox: {denied} ({message})"),
                            false,
                        ),
                        None => failure(ErrorKind::CheckFailed, message, false),
                    }
                })?
            } else {
                PreAnalysis::default()
            };
            let mut prompt = handoff_prompt(&p.spec, &p.upstream, &pre);
            if p.read_only {
                prompt = prompt.replace(
                    "\nMODE: write\n",
                    "\nMODE: analysis (read only: change nothing)\n",
                );
            }
            // Agents that need absolute paths (claude, qwen, opencode) take them from here.
            prompt.push_str(&format!(
                "\nWorking directory: {}\n",
                worktree_path.display()
            ));
            if !p.context.is_empty() {
                prompt.push_str("\nREAD-ONLY CONTEXT (other repositories of this session; read them, change nothing in them):\n");
                for (repo, path) in &p.context {
                    prompt.push_str(&format!("- {}: {}\n", repo.name, path.display()));
                }
            }
            let prompt_file = attempt_dir.join("prompt.md");
            tokio::fs::write(&prompt_file, &prompt)
                .await
                .map_err(|err| io_failure(&prompt_file, &err))?;
            self.run_in(p, worktree, prompt, prompt_file, cancel, progress)
                .await
        }
        .await;
        let result = match (result, changed_context(&contexts).await) {
            (Ok(_), Some(changed)) | (Err(_), Some(changed)) => Err(failure(
                ErrorKind::OutOfScope,
                format!(
                    "the agent changed read-only repositories: {}",
                    changed.join(", ")
                ),
                false,
            )
            .with_details(changed)),
            (result, None) => result,
        };
        self.remove_context(p).await;
        result
    }

    /// Checks out each read-only context repository at its session head, beside the task's
    /// worktree; returns each checkout with the commit it shows.
    async fn check_out_context(
        &self,
        p: &Prepared,
        progress: Progress<'_>,
    ) -> Result<Vec<(String, Worktree, Oid)>, TaskFailure> {
        let mut out = Vec::new();
        for (repo, path) in &p.context {
            progress(format!("checking out read-only {}", repo.name));
            let mirror = self
                .mirrors
                .open(&repo.remote)
                .await
                .map_err(workspace_failure)?;
            let head =
                session_start(&mirror, &p.session_id, &repo.branch, repo.base.as_ref()).await?;
            mirror
                .repo()
                .remove_worktree(path)
                .await
                .map_err(workspace_failure)?;
            let worktree = mirror
                .repo()
                .add_detached_worktree(path, &head)
                .await
                .map_err(workspace_failure)?;
            out.push((repo.name.clone(), worktree, head));
        }
        Ok(out)
    }

    /// Removes the context checkouts of `p`.
    async fn remove_context(&self, p: &Prepared) {
        for (repo, path) in &p.context {
            let removed = async {
                let mirror = self.mirrors.open(&repo.remote).await?;
                mirror.repo().remove_worktree(path).await
            }
            .await;
            if let Err(err) = removed {
                warn!(path = %path.display(), error = %err, "could not remove a context checkout");
            }
        }
    }

    fn session_dir(&self, session_id: &str, task_id: &str) -> PathBuf {
        self.data_dir
            .join("sessions")
            .join(path_component(session_id))
            .join(path_component(task_id))
    }

    fn load_session(&self, session_id: &str, task_id: &str) -> Option<(SavedSession, PathBuf)> {
        let dir = self.session_dir(session_id, task_id);
        let text = std::fs::read_to_string(dir.join("session.json")).ok()?;
        let saved: SavedSession = serde_json::from_str(&text).ok()?;
        let home = saved.home.clone();
        Some((saved, home))
    }

    /// The usage recorded by the parent run whose home is `home`.
    fn parent_usage(&self, p: &Prepared, home: &Path) -> Option<(u64, u64, u64)> {
        let cli = p.cli.as_ref()?;
        cli.from.iter().find_map(|parent| {
            let (saved, parent_home) = self.load_session(&p.session_id, parent)?;
            (parent_home == home).then_some(saved.usage)
        })
    }

    /// Keeps a successful run's home and session id under the task, for resume and fork.
    async fn save_session(
        &self,
        p: &Prepared,
        backend: &str,
        home: &Path,
        worktree: &Path,
        outcome: &RunOutcome,
    ) {
        // Saved even without a native id: its final message still serves as context.
        let native = outcome.native_session_id.clone().unwrap_or_default();
        let dir = self.session_dir(&p.session_id, &p.task_id);
        let saved = SavedSession {
            backend: backend.to_owned(),
            native_session_id: native,
            home: home.to_path_buf(),
            cwd: worktree.to_path_buf(),
            final_message: outcome.final_message.clone(),
            usage: outcome.usage.map_or((0, 0, 0), |u| {
                (u.input_tokens, u.output_tokens, u.cached_input_tokens)
            }),
        };
        let result = async {
            if tokio::fs::try_exists(&dir).await? {
                tokio::fs::remove_dir_all(&dir).await?;
            }
            tokio::fs::create_dir_all(&dir).await?;
            let json = serde_json::to_vec_pretty(&saved).map_err(std::io::Error::other)?;
            tokio::fs::write(dir.join("session.json"), json).await
        }
        .await;
        if let Err(err) = result {
            warn!(dir = %dir.display(), error = %err, "could not keep the native session");
        }
    }

    /// The native session to continue with `backend` in `worktree`, and context text from
    /// parents that cannot be continued natively (other backend, the 2nd+ parent of a merge,
    /// or a directory-bound session whose directory this run could not have).
    fn resume_for(&self, p: &Prepared, backend: &str, worktree: &Path) -> Resumption {
        let Some(cli) = &p.cli else {
            return Resumption {
                native: None,
                context: String::new(),
                warning: None,
            };
        };
        let mut native = None;
        let mut context = String::new();
        let mut warning = None;
        for parent in &cli.from {
            let Some((saved, home)) = self.load_session(&p.session_id, parent) else {
                context.push_str(&format!(
                    "- {parent}: no earlier session is recorded here\n"
                ));
                continue;
            };
            let continuable =
                native.is_none() && saved.backend == backend && !saved.native_session_id.is_empty();
            let elsewhere = session_bound_to_directory(backend) && saved.cwd != worktree;
            if continuable && !elsewhere {
                native = Some(ResumeFrom {
                    native_session_id: saved.native_session_id,
                    home: Some(home),
                    cwd: Some(saved.cwd),
                });
                continue;
            }
            if continuable && warning.is_none() {
                // Passing the resume anyway fails (gemini, qwen) or hangs (opencode).
                let why = if saved.cwd.starts_with(self.worktrees()) {
                    "is in use"
                } else {
                    "is outside this executor's worktrees"
                };
                warning = Some(format!(
                    "native resume of {parent} unavailable: its directory {} {why}; resumed from its result as context",
                    saved.cwd.display()
                ));
            }
            context.push_str(&format!(
                "- {parent} ({}): {}\n",
                saved.backend,
                troupe_process::tail(&saved.final_message, 40, 4096)
            ));
        }
        if !context.is_empty() {
            context = format!(
                "\nCONTEXT FROM EARLIER SESSIONS ({}):\n{context}",
                cli.strategy
            );
        }
        Resumption {
            native,
            context,
            warning,
        }
    }

    /// Puts the worktree back to its commit after a failed backend (before another one runs).
    async fn reset_worktree(worktree: &Path) {
        for args in [
            ["reset", "--hard", "HEAD"].as_slice(),
            ["clean", "-fdq"].as_slice(),
        ] {
            let cmd = troupe_process::Command::new("git")
                .args(args.iter().copied())
                .cwd(worktree)
                .timeout(std::time::Duration::from_secs(60));
            if let Err(err) = cmd.run(&CancellationToken::new()).await {
                warn!(worktree = %worktree.display(), error = %err, "could not reset the worktree");
            }
        }
    }

    /// Runs the resolved backend, retrying with backoff and falling back along the chain on
    /// classified failures. Also returns why a parent's native session was not continued.
    async fn run_backends(
        &self,
        p: &Prepared,
        worktree: &Worktree,
        prompt: String,
        prompt_file: PathBuf,
        cancel: &CancellationToken,
        progress: Progress<'_>,
    ) -> Result<(RunOutcome, ImplementationReport, Option<String>), TaskFailure> {
        let spec = &p.spec;
        let no_agent = troupe_plan::spec::AgentSpec::default();
        let agent = spec.blocks.agent.as_ref().unwrap_or(&no_agent);
        let started = std::time::Instant::now();
        let attempt_dir = prompt_file
            .parent()
            .map_or_else(|| self.data_dir.clone(), Path::to_path_buf);
        let chain = mode::candidates(&p.resolved.backend, agent.fallback.as_deref(), &self.config);
        spec.blocks
            .agent
            .as_ref()
            .map_or(Ok(()), |agent| agent.env_allowed_for(&chain))
            .map_err(|message| failure(ErrorKind::InvalidTask, message, false))?;
        let mut fallbacks: Vec<String> = Vec::new();
        let mut last: Option<BackendError> = None;
        let mut failures: Vec<String> = Vec::new();
        let mut runs = 0u32;
        // The backend whose error `last` is; it becomes a fallback only once another runs.
        let mut tried: Option<String> = None;
        for name in &chain {
            let Some(backend) = troupe_backends::by_name_with(name, &self.config) else {
                continue;
            };
            if let Some(previous) = tried.take() {
                if let Some(err) = &last {
                    crate::metrics::fell_back(&previous, err.kind());
                }
                fallbacks.push(previous);
            }
            tried = Some(name.clone());
            let settings = self.config.backend(name);
            let Resumption {
                native: resume,
                context,
                warning,
            } = self.resume_for(p, name, worktree.path());
            if let Some(warning) = &warning {
                warn!(backend = %name, warning = %warning, "continuing without the native session");
            }
            let prompt = format!("{prompt}{context}");
            let mut attempt = 0u32;
            loop {
                runs += 1;
                let home = attempt_dir.join(format!("home-{name}-{runs}"));
                let run = RunSpec {
                    worktree: worktree.path().to_path_buf(),
                    prompt: prompt.clone(),
                    prompt_file: prompt_file.clone(),
                    placeholders: p.placeholders.clone(),
                    command: agent.command.clone().unwrap_or_default(),
                    timeout: Some(
                        agent
                            .timeout
                            .or(spec.timeout)
                            .or(settings.timeout())
                            .unwrap_or(DEFAULT_AGENT_TIMEOUT),
                    ),
                    idle_timeout: agent.idle_timeout.or(settings.idle_timeout()),
                    env: agent.env.clone(),
                    home: Some(home.clone()),
                    read_only: p.read_only,
                    resume: resume.clone(),
                    sandbox: self.base_sandbox(p, Some(name)),
                    usage_sink: p.usage.as_ref().map(|meter| meter.run_sink(name)),
                };
                progress(format!("running backend {name}"));
                match backend.run(run, cancel).await {
                    Ok(mut outcome) => {
                        self.save_session(p, name, &home, worktree.path(), &outcome)
                            .await;
                        // Report this run's tokens, not the resumed session's running total.
                        if cumulative_usage(name)
                            && let (Some(usage), Some(parent)) = (
                                outcome.usage.as_mut(),
                                resume.as_ref().and_then(|r| r.home.as_deref()),
                            )
                            && let Some(before) = self.parent_usage(p, parent)
                        {
                            usage.input_tokens = usage.input_tokens.saturating_sub(before.0);
                            usage.output_tokens = usage.output_tokens.saturating_sub(before.1);
                            usage.cached_input_tokens =
                                usage.cached_input_tokens.saturating_sub(before.2);
                        }
                        let mut reason = p.resolved.reason.clone();
                        if !fallbacks.is_empty() {
                            reason.push_str(&format!(
                                "; fell back from {} to {name}",
                                fallbacks.join(", ")
                            ));
                        }
                        let report = ImplementationReport {
                            backend: name.clone(),
                            backend_reason: reason,
                            fallbacks: fallbacks.clone(),
                            duration_ms: u64::try_from(started.elapsed().as_millis())
                                .unwrap_or(u64::MAX),
                            ..ImplementationReport::default()
                        };
                        return Ok((outcome, report, warning));
                    }
                    Err(err) => {
                        let kind = err.kind();
                        warn!(backend = %name, ?kind, error = %err, "backend failed");
                        failures.push(err.to_string());
                        if matches!(
                            kind,
                            troupe_backends::ErrorKind::Cancelled
                                | troupe_backends::ErrorKind::InvalidTask
                                | troupe_backends::ErrorKind::Internal
                        ) {
                            last = Some(err);
                            break;
                        }
                        Self::reset_worktree(worktree.path()).await;
                        // The coordinator owns rate limits: it pauses the provider for every
                        // worker and puts the task back without counting the attempt, so
                        // neither a retry here nor a fallback spends the wait.
                        if err.rate_limit().is_some() {
                            last = Some(err);
                            break;
                        }
                        if mode::retries_same(kind) && attempt < self.config.retries {
                            let backoff = self
                                .config
                                .retry_backoff_ms
                                .saturating_mul(1 << attempt.min(10));
                            attempt += 1;
                            progress(format!("retrying {name} in {backoff} ms after {err}"));
                            tokio::select! {
                                () = cancel.cancelled() => { last = Some(BackendError::Cancelled); break; }
                                () = tokio::time::sleep(std::time::Duration::from_millis(backoff)) => {}
                            }
                            continue;
                        }
                        last = Some(err);
                        break;
                    }
                }
            }
            let Some(err) = &last else { break };
            if !mode::falls_back(err.kind()) || err.rate_limit().is_some() {
                break;
            }
        }
        let err = last.unwrap_or_else(|| BackendError::Internal {
            message: "no backend could run".to_owned(),
        });
        let mut report = ImplementationReport {
            // The backend the error belongs to; `fallbacks` are those left for another.
            backend: tried.unwrap_or_else(|| p.resolved.backend.clone()),
            backend_reason: p.resolved.reason.clone(),
            fallbacks: fallbacks.clone(),
            duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            ..ImplementationReport::default()
        };
        report.exit_code = match &err {
            BackendError::Crash {
                exit_code: Some(code),
                ..
            } => *code,
            _ => -1,
        };
        report.output_tail = err.details().join("\n");
        let mut message = match err {
            BackendError::Cancelled => "attempt cancelled".to_owned(),
            ref other => other.to_string(),
        };
        if failures.len() > 1 {
            // The last error is the headline; the earlier ones say why each backend was left.
            message.push_str(&format!(
                " (earlier: {})",
                failures[..failures.len() - 1].join("; ")
            ));
        }
        let retryable = err.retryable() || err.kind() == troupe_backends::ErrorKind::Cancelled;
        let mut failure = failure(backend_kind(err.kind()), message.clone(), retryable)
            .with_details(err.details())
            .with_partial(partial(&report, format!("{}: {message}", p.task_id)));
        if let Some((backend, retry_after)) = err.rate_limit() {
            failure = failure.with_rate_limit(backend, retry_after);
        }
        Err(failure)
    }

    async fn run_in(
        &self,
        p: &Prepared,
        worktree: &Worktree,
        prompt: String,
        prompt_file: PathBuf,
        cancel: &CancellationToken,
        progress: Progress<'_>,
    ) -> Result<Produced, TaskFailure> {
        let spec = &p.spec;
        let started = std::time::Instant::now();
        let (outcome, mut report, resume_warning) = self
            .run_backends(
                p,
                worktree,
                prompt.clone(),
                prompt_file.clone(),
                cancel,
                progress,
            )
            .await?;
        absorb(&mut report, &outcome);

        let title = if spec.title.is_empty() {
            p.task_id.clone()
        } else {
            spec.title.clone()
        };
        let mut warnings: Vec<String> = resume_warning.into_iter().collect();
        let mut commit: Option<Oid> = None;
        let mut round = 0u32;
        let (commit, files, validation) = loop {
            let message = match &p.attempt {
                Some(attempt) => format!("{}: {title}\n\n{}", p.task_id, attempt.trailers()),
                None => format!("{}: {title}", p.task_id),
            };
            let made = worktree
                .commit_all(&message)
                .await
                .map_err(workspace_failure)?;
            // A feedback round that changed nothing keeps the previous commit.
            let Some(current) = made.or_else(|| commit.clone()) else {
                if spec.blocks.allow_empty || p.read_only {
                    return Ok(Produced {
                        commit: None,
                        files: Vec::new(),
                        warnings,
                        report,
                    });
                }
                return Err(failure(ErrorKind::BadOutput, "agent made no changes", true)
                    .with_details(
                        [report.output_tail.clone()]
                            .into_iter()
                            .filter(|t| !t.is_empty()),
                    )
                    .with_partial(partial(
                        &report,
                        format!("{}: the agent exited 0 but changed nothing", p.task_id),
                    )));
            };
            commit = Some(current.clone());
            let files = p
                .mirror
                .repo()
                .changed_paths(&p.base, &current)
                .await
                .map_err(workspace_failure)?;
            if p.read_only {
                // An analysis run that changed files broke its contract: keep nothing of it.
                return Err(failure(
                    ErrorKind::OutOfScope,
                    format!(
                        "analysis (read-only) run changed files: {}",
                        files.join(", ")
                    ),
                    false,
                )
                .with_details(files)
                .with_partial(partial(
                    &report,
                    format!("{}: read-only run wrote files", p.task_id),
                )));
            }
            self.check_scope(p, &files, &report, &mut warnings)?;

            let Some(url) = &self.options.validator_url else {
                warnings.push(
                    "self-validation skipped: no validator configured (--validator-url / TROUPE_VALIDATOR_URL)"
                        .to_owned(),
                );
                break (current, files, None);
            };
            progress("self-validating through the validator".to_owned());
            // The validator reads the commit from the remote, as any other worker would.
            let shared = p
                .mirror
                .push_ref(&p.attempt_ref(), &current)
                .await
                .map_err(workspace_failure);
            let checked = match shared {
                Ok(()) => {
                    validation::validate(
                        &self.options.connector,
                        url,
                        p.remote.as_str(),
                        current.as_str(),
                        p.base.as_str(),
                        spec,
                    )
                    .await
                }
                Err(failure) => Err(failure.error.message),
            };
            let checked = match checked {
                Ok(checked) => checked,
                Err(err) => {
                    warn!(task_id = %p.task_id, error = %err, "self-validation could not run");
                    warnings.push(format!("self-validation could not run: {err}"));
                    break (current, files, None);
                }
            };
            let syntax = validation::syntax_failures(&checked);
            if syntax.is_empty() {
                break (current, files, Some(checked));
            }
            if round >= validation::MAX_SYNTAX_RETRIES {
                let message = format!(
                    "syntax check still failing after {round} retr{} with the errors as context: {}",
                    if round == 1 { "y" } else { "ies" },
                    syntax.join("; ")
                );
                report.self_validation = Some(checked);
                let result = TaskResult {
                    task_branch: p.branch.clone(),
                    files_modified: files,
                    warnings,
                    ..partial(&report, format!("{}: {message}", p.task_id))
                };
                return Err(failure(ErrorKind::CheckFailed, message, true)
                    .with_details(syntax)
                    .with_partial(result));
            }
            round += 1;
            progress(format!(
                "syntax check failed; retry {round}/{} with the errors as context",
                validation::MAX_SYNTAX_RETRIES
            ));
            let retry_prompt = validation::feedback_prompt(&prompt, round, &syntax);
            tokio::fs::write(&prompt_file, &retry_prompt)
                .await
                .map_err(|err| io_failure(&prompt_file, &err))?;
            // The same worktree and parents as the first run: its warning already says it.
            let (outcome, again, _) = self
                .run_backends(
                    p,
                    worktree,
                    retry_prompt,
                    prompt_file.clone(),
                    cancel,
                    progress,
                )
                .await?;
            let usage = add_usage(report.usage.take(), outcome.usage);
            report.backend = again.backend;
            report.backend_reason = again.backend_reason;
            for fallback in again.fallbacks {
                if !report.fallbacks.contains(&fallback) {
                    report.fallbacks.push(fallback);
                }
            }
            absorb(&mut report, &outcome);
            report.usage = usage;
        };
        if round > 0 {
            warnings.push(format!(
                "syntax check failed {round} time(s); the agent fixed it with the errors as context"
            ));
        }
        report.duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        report.self_validation = validation;
        let commit = self
            .write_summary(p, worktree, &commit, &files, &report)
            .await
            .unwrap_or_else(|err| {
                warnings.push(format!("summary not written: {err}"));
                commit
            });
        Ok(Produced {
            commit: Some(commit),
            files,
            warnings,
            report,
        })
    }

    /// Applies the scope policy to the changed files.
    fn check_scope(
        &self,
        p: &Prepared,
        files: &[String],
        report: &ImplementationReport,
        warnings: &mut Vec<String>,
    ) -> Result<(), TaskFailure> {
        match p.spec.out_of_scope(files) {
            None => {
                let note = "task lists no files or focus_paths; scope not checked".to_owned();
                if !warnings.contains(&note) {
                    warnings.push(note);
                }
                Ok(())
            }
            Some(outside) if outside.is_empty() => Ok(()),
            Some(outside) => match p.spec.blocks.scope_policy {
                ScopePolicy::Warn => {
                    let note = format!(
                        "changed outside the task's files/focus_paths: {}",
                        outside.join(", ")
                    );
                    if !warnings.contains(&note) {
                        warnings.push(note);
                    }
                    Ok(())
                }
                ScopePolicy::Refuse => {
                    let result = TaskResult {
                        task_branch: p.branch.clone(),
                        files_modified: files.to_vec(),
                        ..partial(
                            report,
                            format!("{}: refused, changes outside the task's scope", p.task_id),
                        )
                    };
                    Err(failure(
                        ErrorKind::OutOfScope,
                        format!(
                            "agent changed files outside the task's scope: {}",
                            outside.join(", ")
                        ),
                        false,
                    )
                    .with_details(outside)
                    .with_partial(result))
                }
            },
        }
    }

    /// Adds `<summary_dir>/summary-<ID>.md` (ccw-reference §2.5) to the task's commit, with
    /// `convergence-met` from the self-validation. Returns the amended commit.
    async fn write_summary(
        &self,
        p: &Prepared,
        worktree: &Worktree,
        commit: &Oid,
        files: &[String],
        report: &ImplementationReport,
    ) -> Result<Oid, String> {
        let Some(dir) = self.options.summary_dir.as_deref() else {
            return Ok(commit.clone());
        };
        let relative =
            PathBuf::from(dir).join(format!("summary-{}.md", path_component(&p.task_id)));
        let path = troupe_backends::confine(worktree.path(), &relative.display().to_string())?;
        let validation = report.self_validation.as_ref();
        let criteria = p
            .spec
            .blocks
            .convergence
            .criteria
            .iter()
            .enumerate()
            .map(|(i, criterion)| {
                let verified = validation
                    .and_then(|v| v.convergence_verified.get(i).copied())
                    .unwrap_or(false);
                (criterion.clone(), verified)
            })
            .collect();
        let text = troupe_plan::ccw::summary::TaskSummary {
            phase: p.spec.phase().cloned(),
            task: p.task_id.clone(),
            title: if p.spec.title.is_empty() {
                p.task_id.clone()
            } else {
                p.spec.title.clone()
            },
            requires: p.spec.depends_on.clone(),
            affects: files.to_vec(),
            key_files: p.spec.files.iter().map(|f| f.path.clone()).collect(),
            // The summary goes into that very commit, which therefore cannot name itself.
            commit: String::new(),
            convergence_met: validation::convergence_met(validation).to_owned(),
            duration_ms: Some(report.duration_ms),
            completed: Some(chrono::Utc::now().format("%Y-%m-%dT%H:%M:%S").to_string()),
            result: format!(
                "{} file(s) changed by `{}` ({}).",
                files.len(),
                report.backend,
                report.backend_reason
            ),
            backend: Some((report.backend.clone(), report.exit_code)),
            output_tail: report.output_tail.clone(),
            criteria,
        }
        .render();
        if let Some(parent) = path.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|err| err.to_string())?;
        }
        tokio::fs::write(&path, text)
            .await
            .map_err(|err| err.to_string())?;
        // Folded into the task's commit: checks that measure a task by its commit's first
        // parent (VALIDATE-* `modify` checks) must still see the agent's whole change.
        worktree.amend_all().await.map_err(|err| err.to_string())
    }
}

/// Copies a run's exit code, output, session id, model and usage into the report.
fn absorb(report: &mut ImplementationReport, outcome: &RunOutcome) {
    report.exit_code = outcome.exit_code;
    report.output_tail = outcome.output_tail();
    report.native_session_id = outcome.native_session_id.clone().unwrap_or_default();
    report.permission_denials = outcome.permission_denials();
    report.model = outcome.model.clone().unwrap_or_default();
    if let Some(usage) = outcome.usage {
        report.usage = Some(troupe_proto::v1::Usage {
            input_tokens: usage.input_tokens,
            output_tokens: usage.output_tokens,
            cached_input_tokens: usage.cached_input_tokens,
        });
    }
}

/// Sums the usage of two runs (either may be unknown).
fn add_usage(
    before: Option<troupe_proto::v1::Usage>,
    run: Option<troupe_backends::Usage>,
) -> Option<troupe_proto::v1::Usage> {
    match (before, run) {
        (None, None) => None,
        (before, run) => {
            let before = before.unwrap_or_default();
            let run = run.unwrap_or_default();
            Some(troupe_proto::v1::Usage {
                input_tokens: before.input_tokens + run.input_tokens,
                output_tokens: before.output_tokens + run.output_tokens,
                cached_input_tokens: before.cached_input_tokens + run.cached_input_tokens,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_components_are_tame() {
        assert_eq!(path_component("IMPL-001"), "IMPL-001");
        assert_eq!(path_component("../x/y z"), "_x_y_z");
        assert_eq!(path_component(".."), "_");
    }

    #[test]
    fn task_branches_do_not_collide_with_session_branches() {
        assert_eq!(task_branch("s1", "IMPL-1"), "troupe-task/s1/IMPL-1");
        assert!(!task_branch("s1", "IMPL-1").starts_with("troupe/s1/"));
    }
}
