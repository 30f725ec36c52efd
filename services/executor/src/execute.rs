//! One attempt of one task: worktree, backend, commit, scope check, integration.

// `TaskFailure` is the worker protocol's error (a proto message with an optional partial
// result); it is built once per failed attempt, so boxing it would buy nothing.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use troupe_backends::{Backend, BackendError, RunSpec};
use troupe_grpc::worker::TaskFailure;
use troupe_proto::v1::{ErrorKind, ImplementationReport, TaskResult, task_result};
use troupe_workspace::{Oid, Repo, Worktree};

use crate::Error;
use crate::prompt::{UpstreamNote, handoff_prompt};
use crate::spec::{DEFAULT_AGENT_TIMEOUT, ScopePolicy, TaskSpec};

/// Where an attempt's commit goes.
#[derive(Debug, Clone)]
pub enum Target {
    /// Start from the session branch's current head, commit on the task branch
    /// (`troupe-task/<session>/<task>`), integrate into the session branch.
    Session {
        /// The session branch, `troupe/<session>`.
        branch: String,
    },
    /// Start from `base_ref`, commit on `branch` (which must not exist); no integration.
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
    /// The plan task object.
    pub spec: Map<String, Value>,
    /// Repository path.
    pub repo_path: PathBuf,
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
}

/// Runs tasks in worktrees under a data directory.
#[derive(Debug, Clone)]
pub struct Executor {
    data_dir: PathBuf,
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

fn workspace_failure(err: troupe_workspace::Error) -> TaskFailure {
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
        B::Internal | B::Cancelled => ErrorKind::Internal,
    }
}

/// Keeps a path component to `[A-Za-z0-9._-]`.
fn path_component(text: &str) -> String {
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

/// Which backend runs the task, and why.
fn resolve_backend(spec: &TaskSpec) -> Result<(Arc<dyn Backend>, String), TaskFailure> {
    let (name, reason) = match (&spec.agent.backend, &spec.agent.command) {
        (Some(name), _) => (name.clone(), "task agent.backend".to_owned()),
        (None, Some(_)) => ("command".to_owned(), "task agent.command".to_owned()),
        (None, None) => {
            return Err(failure(
                ErrorKind::InvalidTask,
                "task names no agent: set agent.backend or agent.command (CCW Executor:/meta.execution_config resolution is issue #4)",
                false,
            ));
        }
    };
    let backend = troupe_backends::by_name(&name).ok_or_else(|| {
        failure(
            ErrorKind::InvalidTask,
            format!(
                "unknown backend `{name}` (known: {})",
                troupe_backends::BACKEND_NAMES.join(", ")
            ),
            false,
        )
    })?;
    Ok((backend, reason))
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
    backend: Arc<dyn Backend>,
    backend_reason: String,
    repo: Repo,
    base: Oid,
    /// The branch checked out in the worktree.
    branch: String,
    /// `<session>/<task>-<attempt>` under `worktrees/` and `attempts/`.
    run_key: PathBuf,
    placeholders: BTreeMap<String, String>,
    upstream: Vec<UpstreamNote>,
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
        Self {
            data_dir: data_dir.into(),
        }
    }

    /// Runs one attempt of a session task: worktree on the task branch from the session
    /// branch head, backend, commit, scope check, integration into the session branch.
    #[tracing::instrument(skip_all, fields(session_id = %job.session_id, task_id = job.task_id.as_deref().unwrap_or_default(), attempt = job.attempt))]
    pub async fn execute(
        &self,
        job: Job,
        cancel: &CancellationToken,
        progress: Progress<'_>,
    ) -> Result<TaskResult, TaskFailure> {
        let Target::Session {
            branch: session_branch,
        } = job.target.clone()
        else {
            return Err(failure(
                ErrorKind::Internal,
                "execute() needs a session target",
                false,
            ));
        };
        let repo = Repo::open(&job.repo_path)
            .await
            .map_err(workspace_failure)?;
        let base = repo
            .branch_head(&session_branch)
            .await
            .map_err(workspace_failure)?
            .ok_or_else(|| {
                failure(
                    ErrorKind::InvalidTask,
                    format!("session branch `{session_branch}` does not exist"),
                    false,
                )
            })?;
        let prepared = self.prepare(job, repo, base, |_, task_id, session| {
            task_branch(session, task_id)
        })?;
        let produced = self.produce(&prepared, cancel, progress).await?;
        let Prepared {
            spec,
            task_id,
            repo,
            base,
            branch,
            ..
        } = prepared;

        let Some(commit) = produced.commit else {
            return Ok(TaskResult {
                summary: format!("{task_id}: the agent made no changes (allowed by allow_empty)"),
                commit: base.to_string(),
                task_branch: branch,
                files_modified: Vec::new(),
                warnings: produced.warnings,
                detail: Some(task_result::Detail::Implementation(produced.report)),
            });
        };
        progress(format!("integrating into {session_branch}"));
        let message = format!("troupe: integrate {task_id} ({})", spec.title);
        let integration = match repo.integrate(&session_branch, &commit, &message).await {
            Ok(integration) => integration,
            Err(err) => {
                let summary = format!(
                    "{task_id}: committed {} on {branch} but could not integrate",
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
        info!(commit = %integration.commit, fast_forward = integration.fast_forward, files = produced.files.len(), "task integrated");
        Ok(TaskResult {
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

    /// Runs a task outside any session: creates `branch` at `base_ref`, commits the agent's
    /// change there, and integrates nothing. A failed run leaves no branch behind.
    #[tracing::instrument(skip_all, fields(repo = %job.repo_path.display()))]
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
        let repo = Repo::open(&job.repo_path).await?;
        let base_ref = if base_ref.is_empty() {
            "HEAD".to_owned()
        } else {
            base_ref
        };
        let base = repo.resolve(&base_ref).await?;
        if let Some(current) = repo.branch_head(&branch).await? {
            return Err(Error::BranchExists {
                branch,
                current: current.to_string(),
            });
        }
        let prepared = self
            .prepare(job, repo, base, move |_, _, _| branch.clone())
            .map_err(|f| Error::Task(Box::new(f)))?;
        let produced = match self.produce(&prepared, cancel, &|_| {}).await {
            Ok(produced) => produced,
            Err(failure) => {
                // The branch was ours; leave the repository as we found it.
                if let Ok(Some(current)) = prepared.repo.branch_head(&prepared.branch).await
                    && let Err(err) = prepared
                        .repo
                        .delete_branch(&prepared.branch, &current)
                        .await
                {
                    warn!(branch = %prepared.branch, error = %err, "could not delete the branch of a failed run");
                }
                return Err(Error::Task(Box::new(failure)));
            }
        };
        let commit = produced
            .commit
            .clone()
            .unwrap_or_else(|| prepared.base.clone());
        Ok(TaskResult {
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

    fn prepare(
        &self,
        job: Job,
        repo: Repo,
        base: Oid,
        branch_for: impl FnOnce(&TaskSpec, &str, &str) -> String,
    ) -> Result<Prepared, TaskFailure> {
        let spec = TaskSpec::parse(&job.spec).map_err(|problems| {
            failure(
                ErrorKind::InvalidTask,
                format!("invalid task: {problems}"),
                false,
            )
        })?;
        let task_id = job
            .task_id
            .clone()
            .filter(|id| !id.is_empty())
            .unwrap_or_else(|| spec.id.clone());
        let (backend, backend_reason) = resolve_backend(&spec)?;
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
        Ok(Prepared {
            spec,
            task_id,
            backend,
            backend_reason,
            repo,
            base,
            branch,
            run_key,
            placeholders,
            upstream: job.upstream,
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
        let worktree_path = self.data_dir.join("worktrees").join(&p.run_key);
        tokio::fs::create_dir_all(&attempt_dir)
            .await
            .map_err(|err| io_failure(&attempt_dir, &err))?;
        if let Some(parent) = worktree_path.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|err| io_failure(parent, &err))?;
        }
        let prompt = handoff_prompt(&p.spec, &p.upstream);
        let prompt_file = attempt_dir.join("prompt.md");
        tokio::fs::write(&prompt_file, &prompt)
            .await
            .map_err(|err| io_failure(&prompt_file, &err))?;

        // A crashed earlier run may have left this exact worktree behind.
        p.repo
            .remove_worktree(&worktree_path)
            .await
            .map_err(workspace_failure)?;
        progress(format!("creating worktree on {}", p.branch));
        let worktree = p
            .repo
            .add_worktree(&worktree_path, &p.branch, &p.base)
            .await
            .map_err(workspace_failure)?;
        let result = self
            .run_in(p, &worktree, prompt, prompt_file, cancel, progress)
            .await;
        if let Err(err) = p.repo.remove_worktree(&worktree_path).await {
            warn!(path = %worktree_path.display(), error = %err, "could not remove worktree");
        }
        result
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
        let run = RunSpec {
            worktree: worktree.path().to_path_buf(),
            prompt,
            prompt_file,
            placeholders: p.placeholders.clone(),
            command: spec.agent.command.clone().unwrap_or_default(),
            timeout: Some(
                spec.agent
                    .timeout
                    .or(spec.timeout)
                    .unwrap_or(DEFAULT_AGENT_TIMEOUT),
            ),
            idle_timeout: spec.agent.idle_timeout,
            env: spec.agent.env.clone(),
        };
        progress(format!("running backend {}", p.backend.name()));
        let started = std::time::Instant::now();
        let outcome = p.backend.run(run, cancel).await;
        let mut report = ImplementationReport {
            backend: p.backend.name().to_owned(),
            backend_reason: p.backend_reason.clone(),
            duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            ..ImplementationReport::default()
        };
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(err) => {
                report.exit_code = match &err {
                    BackendError::Crash {
                        exit_code: Some(code),
                        ..
                    } => *code,
                    _ => -1,
                };
                report.output_tail = err.details().join("\n");
                let message = match err {
                    BackendError::Cancelled => "attempt cancelled".to_owned(),
                    ref other => other.to_string(),
                };
                let retryable =
                    err.retryable() || err.kind() == troupe_backends::ErrorKind::Cancelled;
                warn!(kind = ?err.kind(), error = %message, "backend failed");
                return Err(
                    failure(backend_kind(err.kind()), message.clone(), retryable)
                        .with_details(err.details())
                        .with_partial(partial(&report, format!("{}: {message}", p.task_id))),
                );
            }
        };
        report.exit_code = outcome.exit_code;
        report.output_tail = outcome.output_tail();
        report.native_session_id = outcome.native_session_id.clone().unwrap_or_default();

        let title = if spec.title.is_empty() {
            p.task_id.clone()
        } else {
            spec.title.clone()
        };
        let commit = worktree
            .commit_all(&format!("{}: {title}", p.task_id))
            .await
            .map_err(workspace_failure)?;
        let Some(commit) = commit else {
            if spec.allow_empty {
                return Ok(Produced {
                    commit: None,
                    files: Vec::new(),
                    warnings: Vec::new(),
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
        let files = p
            .repo
            .changed_paths(&p.base, &commit)
            .await
            .map_err(workspace_failure)?;

        let mut warnings = Vec::new();
        match spec.out_of_scope(&files) {
            None => {
                warnings.push("task lists no files or focus_paths; scope not checked".to_owned())
            }
            Some(outside) if outside.is_empty() => {}
            Some(outside) => match spec.scope_policy {
                ScopePolicy::Warn => {
                    warnings.push(format!(
                        "changed outside the task's files/focus_paths: {}",
                        outside.join(", ")
                    ));
                }
                ScopePolicy::Refuse => {
                    let result = TaskResult {
                        task_branch: p.branch.clone(),
                        files_modified: files.clone(),
                        ..partial(
                            &report,
                            format!("{}: refused, changes outside the task's scope", p.task_id),
                        )
                    };
                    return Err(failure(
                        ErrorKind::OutOfScope,
                        format!(
                            "agent changed files outside the task's scope: {}",
                            outside.join(", ")
                        ),
                        false,
                    )
                    .with_details(outside)
                    .with_partial(result));
                }
            },
        }
        Ok(Produced {
            commit: Some(commit),
            files,
            warnings,
            report,
        })
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
