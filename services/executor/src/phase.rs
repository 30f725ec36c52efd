//! EXEC-* phases (CCW roadmap mode, ccw-reference §1.B.2, 11–16): an EXEC task runs the tasks
//! of its phase in waves. They come in the task itself, as `phase_tasks`: the coordinator reads
//! the plan's `phase-N/.task/IMPL-*.json` once, at intake, so no executor reads the plan's
//! directory. `troupe_plan::phase` validates them and computes the waves (wave 1: no
//! dependency inside the phase; wave N: every dependency in an earlier wave; dependencies
//! outside the phase are earlier phases' and count as met). Unlike CCW, which force-assigns a
//! task of a cycle to a wave, a cycle is an error and nothing runs. Waves run one after
//! another; a wave's tasks run at once up to the phase concurrency, each exactly like an IMPL
//! task (own worktree, self-validation, summary, integration into the session branch), with the
//! summaries of every earlier task of the phase (and the EXEC task's own upstream) as context.
//! Failed runs are retried as for any task (backend retries and fallbacks, CCW §1.B.16 "retry
//! once"); a task whose integration conflicts with a task of the same wave is run once more
//! from the new session head. A failed task does not stop its wave or later waves,
//! but every task depending on it (directly or not) is skipped; the phase then fails, naming
//! the failed and skipped tasks. Every task lands under the EXEC task's fence on the remote,
//! which records it as a part, so a retry of the EXEC task (on any executor) skips the tasks an
//! earlier attempt landed, and a stale attempt lands nothing once a newer one has begun.

// `TaskFailure` is the worker protocol's error; see execute.rs.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use futures::StreamExt;
use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use troupe_grpc::worker::TaskFailure;
use troupe_plan::phase::{self, Phase};
use troupe_plan::{TaskKind, execution::PLAN_HINTS};
use troupe_proto::v1::{
    ConvergenceMet, ErrorKind, ImplementationReport, PhaseTaskOutcome, TaskError, TaskResult,
    TaskState, Usage, ValidationReport, task_result,
};
use troupe_workspace::{Held, Landed, Mirror};

use crate::execute::{job_task_id, session_start};
use crate::{Executor, Job, Progress, Target, UpstreamNote};

/// The phase an EXEC task runs: its name (the directory its task files came from) and its
/// tasks, validated and in waves by `troupe-plan`.
#[derive(Debug)]
pub(crate) struct PhaseRun {
    pub(crate) name: String,
    pub(crate) phase: Phase,
}

/// The phase task `task_id` runs when it is an EXEC task with `phase_tasks` (which intake
/// fills in from the plan's `phase-N/.task/IMPL-*.json`); `None` for any other task.
pub(crate) fn phase_of(
    spec: &Map<String, Value>,
    task_id: &str,
    repo: &str,
) -> Option<Result<PhaseRun, String>> {
    if TaskKind::from_id(task_id) != Some(TaskKind::Exec) {
        return None;
    }
    let name = match phase::directory(spec) {
        None => None,
        Some(Ok(dir)) => Some(dir),
        Some(Err(message)) => return Some(Err(message)),
    };
    let specs = match spec.get(phase::PHASE_TASKS) {
        Some(Value::Array(specs)) => specs,
        Some(_) => {
            return Some(Err(format!(
                "`{}` must be an array of task objects",
                phase::PHASE_TASKS
            )));
        }
        None => {
            let dir = name?;
            return Some(Err(format!(
                "phase `{dir}` came without its tasks: the coordinator puts {dir}/.task/IMPL-*.json in the task's `{}` at intake, and an ExecuteTask call gives them there itself",
                phase::PHASE_TASKS
            )));
        }
    };
    Some(
        Phase::from_specs(task_id, repo, specs)
            .map(|phase| PhaseRun {
                name: name.unwrap_or_else(|| "phase".to_owned()),
                phase,
            })
            .map_err(|err| err.to_string()),
    )
}

fn invalid(message: String) -> TaskFailure {
    TaskFailure::new(ErrorKind::InvalidTask, message, false)
}

fn report_of(result: &TaskResult) -> Option<&ImplementationReport> {
    match &result.detail {
        Some(task_result::Detail::Implementation(report)) => Some(report),
        _ => None,
    }
}

fn add(total: &mut Usage, usage: Option<&Usage>) {
    if let Some(usage) = usage {
        total.input_tokens += usage.input_tokens;
        total.output_tokens += usage.output_tokens;
        total.cached_input_tokens += usage.cached_input_tokens;
    }
}

/// Status of each task of the phase, for the progress note.
struct Board {
    status: BTreeMap<String, &'static str>,
}

impl Board {
    fn note(&self, wave: usize, total: usize, ids: &[&str]) -> String {
        let parts: Vec<String> = ids
            .iter()
            .map(|id| {
                format!(
                    "{id} {}",
                    self.status.get(*id).copied().unwrap_or("pending")
                )
            })
            .collect();
        format!("wave {}/{total}: {}", wave + 1, parts.join(", "))
    }
}

impl Executor {
    /// The result of a part an earlier attempt of the EXEC task landed.
    async fn landed_part(
        &self,
        mirror: &Mirror,
        id: &str,
        branch: &str,
        landed: &Landed,
    ) -> Result<TaskResult, TaskFailure> {
        let mut result = self.adopt(mirror, id, branch, landed).await?;
        result.warnings.clear();
        result.commit = landed.commit.to_string();
        result.summary = format!(
            "{id}: {} file(s) changed, integrated into {branch} at {}",
            result.files_modified.len(),
            &landed.head.as_str()[..12]
        );
        Ok(result)
    }

    /// Runs an EXEC phase into the session branch `branch`.
    #[tracing::instrument(skip_all, fields(session_id = %job.session_id, task_id = job.task_id.as_deref().unwrap_or_default(), phase = %run.name))]
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn execute_phase(
        &self,
        job: Job,
        run: PhaseRun,
        branch: String,
        mirror: &Mirror,
        held: &Held,
        cancel: &CancellationToken,
        progress: Progress<'_>,
    ) -> Result<TaskResult, TaskFailure> {
        let started = std::time::Instant::now();
        let exec_id = job_task_id(&job);
        let waves = run.phase.waves();
        let tasks = &run.phase.tasks;
        let phase_value = job.spec.phase().cloned();
        let hints = job.spec.object.get(PLAN_HINTS).cloned();
        // Every task is typed before anything runs: a bad one fails the phase up front.
        let specs = tasks
            .iter()
            .map(|task| {
                let mut object = task.spec.clone();
                if let Some(phase) = &phase_value {
                    object.entry("phase").or_insert_with(|| phase.clone());
                }
                if let Some(hints) = &hints {
                    object.entry(PLAN_HINTS).or_insert_with(|| hints.clone());
                }
                crate::spec::parse(&object).map_err(invalid)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let session_base = match &job.target {
            Target::Session { base, .. } => base.clone(),
            Target::Direct { .. } => None,
        };
        let concurrency = self.options().phase_concurrency.max(1);
        let total = waves.len();
        info!(
            tasks = tasks.len(),
            waves = total,
            concurrency,
            "running phase"
        );

        let board = Mutex::new(Board {
            status: BTreeMap::new(),
        });
        let mut notes: Vec<UpstreamNote> = job.upstream.clone();
        let mut outcomes: Vec<PhaseTaskOutcome> = Vec::new();
        let mut failed: BTreeSet<String> = BTreeSet::new();
        let mut blocked: BTreeSet<String> = BTreeSet::new();
        let mut failures: Vec<(String, TaskError)> = Vec::new();
        let mut files: Vec<String> = Vec::new();
        let mut warnings: Vec<String> = Vec::new();
        let mut usage = Usage::default();
        let mut backends: Vec<String> = Vec::new();
        let mut fallbacks: Vec<String> = Vec::new();

        for (w, wave) in waves.iter().enumerate() {
            let ids: Vec<&str> = wave.iter().map(|&i| tasks[i].id.as_str()).collect();
            let mut runnable = Vec::new();
            for &i in wave {
                let task = &tasks[i];
                let bad: Vec<&String> = task
                    .depends_on
                    .iter()
                    .filter(|dep| failed.contains(*dep) || blocked.contains(*dep))
                    .collect();
                if bad.is_empty() {
                    runnable.push(i);
                } else {
                    blocked.insert(task.id.clone());
                    if let Ok(mut board) = board.lock() {
                        board.status.insert(task.id.clone(), "skipped");
                    }
                    outcomes.push(PhaseTaskOutcome {
                        task_id: task.id.clone(),
                        wave: u32::try_from(w + 1).unwrap_or(u32::MAX),
                        state: TaskState::Skipped as i32,
                        summary: format!(
                            "skipped: depends on {}, which did not complete",
                            bad.iter()
                                .map(|s| s.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                        ..PhaseTaskOutcome::default()
                    });
                }
            }
            if let Ok(board) = board.lock() {
                progress(board.note(w, total, &ids));
            }
            let context = notes.clone();
            let runs = futures::stream::iter(runnable.into_iter().map(|i| {
                let task = &tasks[i];
                let job = Job {
                    spec: specs[i].clone(),
                    remote: job.remote.clone(),
                    repo_name: job.repo_name.clone(),
                    session_id: job.session_id.clone(),
                    task_id: Some(task.id.clone()),
                    attempt: job.attempt.max(1) * 2 - 1,
                    plan_dir: job.plan_dir.clone(),
                    upstream: context.clone(),
                    target: Target::Session {
                        branch: branch.clone(),
                        base: session_base.clone(),
                    },
                    lease: job.lease.clone(),
                    fencing_token: job.fencing_token,
                    context: job.context.clone(),
                    usage: job.usage.clone(),
                };
                let board = &board;
                let ids = &ids;
                let branch = &branch;
                let session_base = session_base.as_ref();
                async move {
                    let id = task.id.clone();
                    let set = |status: &'static str| {
                        if let Ok(mut b) = board.lock() {
                            b.status.insert(id.clone(), status);
                            progress(b.note(w, total, ids));
                        }
                    };
                    if let Some(landed) = held.landed_part(&id) {
                        set("done");
                        let result = self.landed_part(mirror, &id, branch, landed).await;
                        return (i, result, true);
                    }
                    set("running");
                    // Each run starts from the session head as it is now, and lands under the
                    // EXEC task's fence (a clone: parts of one attempt follow each other's
                    // markers).
                    let run = |job: Job| {
                        let (id, mut held) = (id.clone(), held.clone());
                        async move {
                            let base =
                                session_start(mirror, &job.session_id, branch, session_base)
                                    .await?;
                            self.run_attempt(
                                job,
                                mirror,
                                &mut held,
                                Some(&id),
                                base,
                                cancel,
                                &|_| {},
                            )
                            .await
                        }
                    };
                    let mut result = run(job.clone()).await;
                    // Crashes, timeouts and rate limits were already retried by the backend
                    // loop; a merge conflict with a task of the same wave is what a fresh
                    // attempt from the new session head fixes.
                    if let Err(err) = &result
                        && err.error.kind() == ErrorKind::MergeConflict
                        && !cancel.is_cancelled()
                    {
                        warn!(task_id = %id, error = %err.error.message, "phase task conflicted; retrying once from the new head");
                        set("retrying");
                        let retry = Job {
                            attempt: job.attempt + 1,
                            ..job
                        };
                        result = run(retry).await;
                    }
                    set(if result.is_ok() { "done" } else { "failed" });
                    (i, result, false)
                }
            }))
            .buffer_unordered(concurrency)
            .collect::<Vec<_>>()
            .await;
            let mut runs = runs;
            runs.sort_by_key(|(i, _, _)| *i);
            for (i, result, earlier) in runs {
                let task = &tasks[i];
                let wave_number = u32::try_from(w + 1).unwrap_or(u32::MAX);
                match result {
                    Ok(result) => {
                        let report = report_of(&result);
                        add(&mut usage, report.and_then(|r| r.usage.as_ref()));
                        if let Some(report) = report {
                            if !report.backend.is_empty() && !backends.contains(&report.backend) {
                                backends.push(report.backend.clone());
                            }
                            for fallback in &report.fallbacks {
                                if !fallbacks.contains(fallback) {
                                    fallbacks.push(fallback.clone());
                                }
                            }
                        }
                        for file in &result.files_modified {
                            if !files.contains(file) {
                                files.push(file.clone());
                            }
                        }
                        warnings
                            .extend(result.warnings.iter().map(|w| format!("{}: {w}", task.id)));
                        let convergence_met = report
                            .and_then(|r| r.self_validation.as_ref())
                            .map(ValidationReport::convergence_met)
                            .unwrap_or_default();
                        let summary = if earlier {
                            format!("{} (landed by an earlier attempt)", result.summary)
                        } else {
                            result.summary.clone()
                        };
                        notes.push(UpstreamNote {
                            task_id: task.id.clone(),
                            summary: if convergence_met == ConvergenceMet::Unspecified {
                                summary.clone()
                            } else {
                                format!(
                                    "{summary}; convergence-met: {}",
                                    troupe_proto::names::name(convergence_met)
                                )
                            },
                            files: result.files_modified.clone(),
                        });
                        outcomes.push(PhaseTaskOutcome {
                            task_id: task.id.clone(),
                            wave: wave_number,
                            state: TaskState::Completed as i32,
                            summary,
                            commit: result.commit.clone(),
                            files_modified: result.files_modified.clone(),
                            backend: report.map(|r| r.backend.clone()).unwrap_or_default(),
                            usage: report.and_then(|r| r.usage),
                            convergence_met: convergence_met as i32,
                            error: None,
                            ..PhaseTaskOutcome::default()
                        });
                    }
                    Err(failure) => {
                        failed.insert(task.id.clone());
                        let partial = failure.partial.clone().unwrap_or_default();
                        let report = report_of(&partial);
                        add(&mut usage, report.and_then(|r| r.usage.as_ref()));
                        outcomes.push(PhaseTaskOutcome {
                            task_id: task.id.clone(),
                            wave: wave_number,
                            state: TaskState::Failed as i32,
                            summary: failure.error.message.clone(),
                            files_modified: partial.files_modified.clone(),
                            backend: report.map(|r| r.backend.clone()).unwrap_or_default(),
                            usage: report.and_then(|r| r.usage),
                            error: Some(failure.error.clone()),
                            ..PhaseTaskOutcome::default()
                        });
                        failures.push((task.id.clone(), failure.error));
                    }
                }
            }
        }

        let head = match mirror.fetch_session_branch(&job.session_id, &branch).await {
            Ok(()) => mirror.repo().branch_head(&branch).await.ok().flatten(),
            Err(_) => None,
        };
        let completed = outcomes
            .iter()
            .filter(|o| o.state() == TaskState::Completed)
            .count();
        let lines: Vec<String> = outcomes
            .iter()
            .map(|o| format!("wave {} {} {}: {}", o.wave, o.task_id, o.state, o.summary))
            .collect();
        let report = ImplementationReport {
            backend: backends.join(","),
            backend_reason: format!(
                "EXEC phase {}: {} task(s) in {total} wave(s), up to {concurrency} at once",
                run.name,
                tasks.len()
            ),
            fallbacks,
            usage: Some(usage),
            output_tail: lines.join("\n"),
            duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            phase_tasks: outcomes,
            waves: u32::try_from(total).unwrap_or(u32::MAX),
            ..ImplementationReport::default()
        };
        let branch_depth = match &head {
            Some(head) => mirror.repo().first_parent_depth(head).await.unwrap_or(0),
            None => 0,
        };
        let mut result = TaskResult {
            branch_depth,
            summary: format!(
                "{exec_id}: phase {} ran {} task(s) in {total} wave(s): {completed} completed, {} failed, {} skipped",
                run.name.rsplit('/').next().unwrap_or_default(),
                tasks.len(),
                failed.len(),
                blocked.len()
            ),
            commit: head.map(|h| h.to_string()).unwrap_or_default(),
            task_branch: String::new(),
            files_modified: files,
            warnings,
            detail: Some(task_result::Detail::Implementation(report)),
        };
        if failures.is_empty() {
            return Ok(result);
        }
        let (first_id, first) = &failures[0];
        let names: Vec<String> = failures
            .iter()
            .map(|(id, err)| format!("{id} ({})", err.message))
            .collect();
        let mut message = format!("phase task(s) failed: {}", names.join("; "));
        if !blocked.is_empty() {
            message.push_str(&format!(
                "; skipped because a dependency failed: {}",
                blocked.iter().cloned().collect::<Vec<_>>().join(", ")
            ));
        }
        result.summary = format!("{}; {first_id} failed first", result.summary);
        let kind = ErrorKind::try_from(first.kind).unwrap_or(ErrorKind::Internal);
        // Completed tasks are remembered, so another attempt only redoes what failed.
        let retryable = failures.iter().any(|(_, e)| e.retryable);
        Err(TaskFailure::new(kind, message, retryable)
            .with_details(
                failures
                    .iter()
                    .flat_map(|(id, e)| e.details.iter().map(move |d| format!("{id}: {d}"))),
            )
            .with_partial(result))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn run(spec: Value) -> Option<Result<PhaseRun, String>> {
        let spec = spec.as_object().cloned().expect("object");
        let id = spec["id"].as_str().expect("id").to_owned();
        phase_of(&spec, &id, "app")
    }

    #[test]
    fn exec_tasks_run_the_phase_they_carry() {
        let task = |id: &str, deps: &[&str]| json!({"id": id, "title": id, "depends_on": deps});
        let spec = json!({"id": "EXEC-1", "phase": 2, "phase_tasks": [
            task("IMPL-1", &[]), task("IMPL-2", &["IMPL-1"])
        ]});
        let phase = run(spec).expect("a phase").expect("valid");
        assert_eq!(phase.name, "phase-2");
        assert_eq!(phase.phase.waves(), [vec![0], vec![1]]);

        assert!(run(json!({"id": "IMPL-1", "phase": 1})).is_none());
        assert!(run(json!({"id": "EXEC-1"})).is_none());
        let err = run(json!({"id": "EXEC-1", "phase": 1}))
            .expect("a phase")
            .expect_err("no tasks");
        assert!(
            err.contains("phase `phase-1` came without its tasks"),
            "{err}"
        );
        let err = run(json!({"id": "EXEC-1", "phase": "../x", "phase_tasks": []}))
            .expect("a phase")
            .expect_err("escapes");
        assert!(err.contains("inside the plan directory"), "{err}");
        let cyclic = json!({"id": "EXEC-1", "phase_tasks": [task("IMPL-2", &["IMPL-3"]), task("IMPL-3", &["IMPL-2"])]});
        let err = run(cyclic).expect("a phase").expect_err("cycle");
        assert!(
            err.contains("dependency cycle: IMPL-2 -> IMPL-3 -> IMPL-2"),
            "{err}"
        );
    }
}
