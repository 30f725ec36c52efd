//! Executor tasks claimed from the coordinator.

// `TaskFailure` is the worker protocol's error (a proto message with an optional partial
// result); it is built once per failed attempt, so boxing it would buy nothing.
#![allow(clippy::result_large_err)]

use std::path::PathBuf;
use std::sync::Arc;

use troupe_grpc::worker::{TaskContext, TaskFailure, TaskHandler};
use troupe_proto::v1::{ClaimedTask, ErrorKind, RepoAccess, TaskResult};

use crate::{ContextRepo, Executor, Job, Target, UpstreamNote};

/// Runs claimed executor tasks with a shared [`Executor`].
#[derive(Debug, Clone)]
pub struct ExecuteHandler {
    executor: Arc<Executor>,
}

impl ExecuteHandler {
    /// A handler running tasks with `executor`.
    pub fn new(executor: Arc<Executor>) -> Self {
        Self { executor }
    }
}

fn invalid(message: &str) -> TaskFailure {
    TaskFailure::new(ErrorKind::InvalidTask, message, false)
}

/// Builds the attempt's [`Job`] from a claim, typing its task once ([`troupe_plan::TaskSpec`]).
pub(crate) fn job_from_claim(claim: ClaimedTask) -> Result<Job, TaskFailure> {
    let task = claim
        .task
        .ok_or_else(|| invalid("claimed task has no task"))?;
    let repo = claim
        .repo
        .ok_or_else(|| invalid("claimed task has no repository"))?;
    // Typed once, by the plan's rules: the coordinator's typed fields (id, role, repo,
    // files) and the blocks of its spec.
    let spec = troupe_plan::TaskSpec::try_from(&task)
        .map_err(|err| invalid(&format!("invalid task: {err}")))?;
    let attempt = claim
        .lease
        .as_ref()
        .map_or(task.attempt, |lease| lease.attempt)
        .max(1);
    let branch = if repo.branch.is_empty() {
        format!("troupe/{}", task.session_id)
    } else {
        repo.branch
    };
    let remote = troupe_workspace::Remote::parse(if repo.url.is_empty() {
        &repo.path
    } else {
        &repo.url
    })
    .map_err(|err| invalid(&format!("repository {}: {err}", repo.name)))?;
    let base = troupe_workspace::Oid::parse(&repo.base_commit);
    let fencing_token = claim.lease.as_ref().map_or(0, |lease| lease.fencing_token);
    let context = claim
        .repos
        .iter()
        .filter(|other| other.access() == RepoAccess::Read && other.name != repo.name)
        .map(|other| {
            let address = if other.url.is_empty() {
                &other.path
            } else {
                &other.url
            };
            let remote = troupe_workspace::Remote::parse(address)
                .map_err(|err| invalid(&format!("repository {}: {err}", other.name)))?;
            Ok(ContextRepo {
                name: other.name.clone(),
                remote,
                branch: other.branch.clone(),
                base: troupe_workspace::Oid::parse(&other.base_commit),
            })
        })
        .collect::<Result<Vec<_>, TaskFailure>>()?;
    let upstream = claim
        .upstream
        .into_iter()
        .map(|up| {
            let (summary, files) = up
                .result
                .map(|r| (r.summary, r.files_modified))
                .unwrap_or_default();
            UpstreamNote {
                task_id: up.task_id,
                summary,
                files,
            }
        })
        .collect();
    Ok(Job {
        spec,
        remote,
        repo_name: repo.name,
        session_id: task.session_id,
        task_id: Some(task.id),
        attempt,
        plan_dir: (!claim.plan_dir.is_empty()).then(|| PathBuf::from(claim.plan_dir)),
        upstream,
        target: Target::Session { branch, base },
        lease: None,
        fencing_token,
        context,
        usage: None,
    })
}

impl TaskHandler for ExecuteHandler {
    async fn handle(&self, task: ClaimedTask, ctx: TaskContext) -> Result<TaskResult, TaskFailure> {
        let mut job = job_from_claim(task)?;
        // Publishing confirms the lease with the coordinator first and stays within it.
        let lease = ctx.clone();
        job.lease = Some(Arc::new(troupe_workspace::ConfirmWith(move || {
            let lease = lease.clone();
            async move { lease.confirm_lease().await.map_err(|lost| lost.to_string()) }
        })));
        let (figures, named) = (ctx.clone(), ctx.clone());
        job.usage = Some(
            troupe_backends::UsageMeter::new(move |usage| {
                figures.report_tokens(troupe_proto::v1::Usage {
                    input_tokens: usage.input_tokens,
                    output_tokens: usage.output_tokens,
                    cached_input_tokens: usage.cached_input_tokens,
                });
            })
            .with_backend(move |backend| named.report_backend(backend)),
        );
        let cancel = ctx.cancelled();
        let notes = ctx.clone();
        let progress = move |note: String| notes.progress(note);
        self.executor.execute(job, &cancel, &progress).await
    }
}

#[cfg(test)]
mod tests {
    use troupe_proto::v1::{FileAction, FileChange, Lease, SessionRepo, Task, UpstreamResult};

    use super::*;

    #[test]
    fn claims_become_session_jobs() {
        let claim = ClaimedTask {
            task: Some(Task {
                session_id: "s1".into(),
                id: "IMPL-2".into(),
                title: "Add report".into(),
                attempt: 1,
                files: vec![FileChange {
                    path: "r.py".into(),
                    action: FileAction::Create as i32,
                    change: "new".into(),
                }],
                ..Task::default()
            }),
            lease: Some(Lease {
                fencing_token: 7,
                expires_at: None,
                attempt: 3,
            }),
            repo: Some(SessionRepo {
                name: "app".into(),
                path: "/repos/app".into(),
                ..SessionRepo::default()
            }),
            upstream: vec![UpstreamResult {
                task_id: "IMPL-1".into(),
                result: Some(TaskResult {
                    summary: "added median".into(),
                    files_modified: vec!["core.py".into()],
                    ..TaskResult::default()
                }),
                ..UpstreamResult::default()
            }],
            plan_dir: "/plans/q".into(),
            ..ClaimedTask::default()
        };
        let job = job_from_claim(claim).expect("valid claim");
        assert_eq!(job.attempt, 3);
        assert_eq!(job.task_id.as_deref(), Some("IMPL-2"));
        assert_eq!(job.spec.id, "IMPL-2");
        assert_eq!(job.spec.title, "Add report");
        assert_eq!(job.spec.kind, troupe_plan::TaskKind::Impl);
        assert_eq!(
            job.spec.files,
            [troupe_plan::FileSpec {
                path: "r.py".into(),
                action: troupe_plan::FileAction::Create,
                change: "new".into(),
            }]
        );
        assert!(matches!(job.target, Target::Session { ref branch, .. } if branch == "troupe/s1"));
        assert_eq!(job.plan_dir, Some(PathBuf::from("/plans/q")));
        assert_eq!(job.upstream[0].task_id, "IMPL-1");
        assert_eq!(job.upstream[0].files, ["core.py"]);

        let err = job_from_claim(ClaimedTask::default()).expect_err("no task");
        assert_eq!(err.error.kind(), ErrorKind::InvalidTask);
        // A block the plan's rules refuse fails the claim, naming the field.
        let mut bad = claim_with_spec(serde_json::json!({"agent": {"env": {"K": 1}}}));
        bad.repo = Some(SessionRepo {
            name: "app".into(),
            path: "/repos/app".into(),
            ..SessionRepo::default()
        });
        let err = job_from_claim(bad).expect_err("bad agent");
        assert_eq!(err.error.kind(), ErrorKind::InvalidTask);
        assert!(
            err.error.message.contains("`agent.env.K`"),
            "{}",
            err.error.message
        );
    }

    fn claim_with_spec(spec: serde_json::Value) -> ClaimedTask {
        ClaimedTask {
            task: Some(Task {
                id: "IMPL-3".into(),
                spec: Some(troupe_proto::json::to_struct(&spec)),
                ..Task::default()
            }),
            ..ClaimedTask::default()
        }
    }
}
