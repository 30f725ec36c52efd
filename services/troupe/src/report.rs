//! Text rendering of session progress and the final report.

use std::fmt::Write as _;

use troupe_proto::v1::{
    ConvergenceMet, GetSessionResponse, RepoAccess, Session, SessionEvent, SessionRepo,
    SessionState, TaskResult, TaskState, session_event, task_result,
};

/// Returns a lowercase name for a task state (`completed`, `timed_out`, ...; see
/// [`troupe_proto::names`]).
pub fn task_state_name(state: i32) -> String {
    TaskState::try_from(state).map_or_else(
        |_| format!("state#{state}"),
        |state| troupe_proto::names::task_state(state).to_owned(),
    )
}

/// Returns a lowercase name for a session state.
pub fn session_state_name(state: i32) -> String {
    SessionState::try_from(state).map_or_else(
        |_| format!("state#{state}"),
        |state| troupe_proto::names::session_state(state).to_owned(),
    )
}

/// Whether a session state is final.
pub fn is_terminal(state: i32) -> bool {
    matches!(
        SessionState::try_from(state),
        Ok(SessionState::Completed | SessionState::Failed | SessionState::Cancelled)
    )
}

/// One line for a session event, or `None` for events not worth printing.
pub fn event_line(event: &SessionEvent) -> Option<String> {
    let time = event
        .ts
        .as_ref()
        .and_then(|ts| {
            chrono::DateTime::from_timestamp(ts.seconds, u32::try_from(ts.nanos).unwrap_or(0))
        })
        .map(|ts| {
            ts.with_timezone(&chrono::Local)
                .format("%H:%M:%S")
                .to_string()
        })
        .unwrap_or_default();
    let body = match event.kind.as_ref()? {
        session_event::Kind::Task(transition) => {
            let from = if transition.from == TaskState::Unspecified as i32 {
                "new".to_owned()
            } else {
                task_state_name(transition.from)
            };
            let mut line = format!(
                "{:<14} {from:>9} -> {:<9}",
                transition.task_id,
                task_state_name(transition.to)
            );
            if transition.attempt > 0 {
                let _ = write!(line, " attempt {}", transition.attempt);
            }
            if !transition.worker_id.is_empty() {
                let _ = write!(line, " on {}", transition.worker_id);
            }
            if !transition.reason.is_empty() {
                let _ = write!(line, ": {}", first_line(&transition.reason));
            }
            line
        }
        session_event::Kind::Progress(progress) => {
            format!(
                "{:<14} progress: {}",
                progress.task_id,
                first_line(&progress.note)
            )
        }
        session_event::Kind::Message(message) => {
            format!(
                "message {} {} -> {} [{}] {}",
                message.id, message.from, message.to, message.r#type, message.summary
            )
        }
        session_event::Kind::Session(transition) => format!(
            "session {} -> {}{}",
            if transition.from == SessionState::Unspecified as i32 {
                "new".to_owned()
            } else {
                session_state_name(transition.from)
            },
            session_state_name(transition.to),
            if transition.reason.is_empty() {
                String::new()
            } else {
                format!(": {}", transition.reason)
            }
        ),
    };
    Some(format!("[{time}] {body}"))
}

/// The header printed when a session starts.
pub fn session_header(session: &Session, waves: u32) -> String {
    let tasks = session.counts.as_ref().map_or(0, |counts| counts.total);
    let mut text = format!(
        "session {} ({} tasks in {} waves, {} scheduling)\n",
        session.id,
        tasks,
        waves,
        troupe_proto::names::name(session.mode())
    );
    for repo in &session.repos {
        let _ = writeln!(
            text,
            "  repo {}: {} @ {} -> branch {}{}",
            repo.name,
            repo_location(repo),
            short(&repo.base_commit),
            repo.branch,
            if repo.access == RepoAccess::Read as i32 {
                " (read-only context)"
            } else {
                ""
            }
        );
    }
    text
}

/// Where a repository lives: its local path, else its URL.
fn repo_location(repo: &SessionRepo) -> &str {
    if repo.path.is_empty() {
        &repo.url
    } else {
        &repo.path
    }
}

/// The final report: one block per task with its outcome, then the session's verdict.
pub fn final_report(response: &GetSessionResponse) -> String {
    let mut text = String::new();
    let Some(session) = &response.session else {
        return "no session in the response\n".to_owned();
    };
    let _ = writeln!(text, "\nreport for session {}", session.id);
    let multi_repo = session.repos.len() > 1;
    for task in &response.tasks {
        let _ = writeln!(
            text,
            "  {:<14} {:<10} attempts {}/{}  {}{}",
            task.id,
            task_state_name(task.state),
            task.attempt,
            task.max_attempts,
            task.title,
            if multi_repo {
                format!(" [{}]", task.repo)
            } else {
                String::new()
            }
        );
        if let Some(result) = &task.result {
            render_result(&mut text, result);
        }
        if let Some(convergence) = &task.convergence {
            let verified: Vec<&str> = convergence
                .verified
                .iter()
                .map(|ok| if *ok { "yes" } else { "no" })
                .collect();
            let _ = writeln!(
                text,
                "      convergence {} (criteria verified: {}; checked by {})",
                troupe_proto::names::name(convergence.met()),
                verified.join(", "),
                convergence.checked_by
            );
        }
        if let Some(error) = task
            .last_error
            .as_ref()
            .filter(|_| task.state != TaskState::Completed as i32)
        {
            let _ = writeln!(text, "      error: {}", first_line(&error.message));
            for detail in error.details.iter().take(5) {
                let _ = writeln!(text, "        {}", first_line(detail));
            }
        }
    }
    let counts = session.counts.unwrap_or_default();
    if !response.next_page_token.is_empty() {
        // GetSession returns a bounded first page; the counts below cover every task.
        let _ = writeln!(
            text,
            "  … and {} more task(s), not listed",
            (counts.total as usize).saturating_sub(response.tasks.len())
        );
    }
    let _ = writeln!(
        text,
        "session {}: {} completed, {} failed, {} skipped, {} cancelled, {} timed out of {}",
        session_state_name(session.state),
        counts.completed,
        counts.failed,
        counts.skipped,
        counts.cancelled,
        counts.timed_out,
        counts.total
    );
    for repo in &session.repos {
        let counts = repo.counts.unwrap_or_default();
        let outcome = format!(
            "{} task(s): {} completed, {} failed, {} skipped",
            counts.total, counts.completed, counts.failed, counts.skipped
        );
        if repo.access == RepoAccess::Read as i32 {
            let _ = writeln!(
                text,
                "repo {} ({}) was read-only context at {}; {outcome}",
                repo.name,
                repo_location(repo),
                short(&repo.base_commit)
            );
        } else if repo.head.is_empty() {
            let _ = writeln!(
                text,
                "repo {} ({}): nothing landed on {} (base {}); {outcome}",
                repo.name,
                repo_location(repo),
                repo.branch,
                short(&repo.base_commit)
            );
        } else if repo.path.is_empty() {
            let _ = writeln!(
                text,
                "repo {}: branch {} of {} at {} (from {}); {outcome}",
                repo.name,
                repo.branch,
                repo.url,
                short(&repo.head),
                short(&repo.base_commit)
            );
        } else {
            let _ = writeln!(
                text,
                "commits are on branch {} of {} (git -C {} log --oneline {}..{}); {outcome}",
                repo.branch,
                repo.path,
                repo.path,
                short(&repo.base_commit),
                repo.branch
            );
        }
    }
    text
}

fn render_result(text: &mut String, result: &TaskResult) {
    if !result.summary.is_empty() {
        let _ = writeln!(text, "      {}", first_line(&result.summary));
    }
    if !result.commit.is_empty() {
        let _ = writeln!(text, "      commit {}", short(&result.commit));
    }
    if !result.files_modified.is_empty() {
        let _ = writeln!(text, "      files: {}", result.files_modified.join(", "));
    }
    for warning in &result.warnings {
        let _ = writeln!(text, "      warning: {}", first_line(warning));
    }
    match &result.detail {
        Some(task_result::Detail::Implementation(implementation)) => {
            let _ = writeln!(
                text,
                "      backend {} (exit {}, {} ms)",
                implementation.backend, implementation.exit_code, implementation.duration_ms
            );
            if !implementation.fallbacks.is_empty() {
                let _ = writeln!(
                    text,
                    "      fell back from {}",
                    implementation.fallbacks.join(", ")
                );
            }
            for denied in &implementation.permission_denials {
                let _ = writeln!(text, "      denied by {}: {denied}", implementation.backend);
            }
            // An EXEC phase: one line per sub-task, by wave.
            for phase_task in &implementation.phase_tasks {
                let met = match phase_task.convergence_met() {
                    ConvergenceMet::Unspecified => String::new(),
                    met => format!(", convergence {}", troupe_proto::names::name(met)),
                };
                // A completed task's summary repeats its commit; otherwise it says why.
                let what = if phase_task.state() == TaskState::Completed
                    && !phase_task.commit.is_empty()
                {
                    format!("commit {}", short(&phase_task.commit))
                } else {
                    first_line(&phase_task.summary).to_owned()
                };
                let _ = writeln!(
                    text,
                    "        wave {} {:<12} {:<9} {what}{met}",
                    phase_task.wave,
                    phase_task.task_id,
                    troupe_proto::names::name(phase_task.state()),
                );
            }
        }
        Some(task_result::Detail::Validation(validation)) => {
            let verdict = troupe_proto::names::name(validation.verdict());
            let _ = writeln!(
                text,
                "      verdict {verdict}, {} checks:",
                validation.checks.len()
            );
            for check in &validation.checks {
                let status = troupe_proto::names::name(check.status());
                let _ = writeln!(text, "        {status:<13} {}", check.name);
            }
        }
        Some(task_result::Detail::TestRun(run)) => {
            let outcome = troupe_proto::names::name(run.outcome());
            let totals = run.totals.unwrap_or_default();
            let _ = writeln!(
                text,
                "      tests {outcome}: {} passed, {} failed, {} skipped of {} (pass rate {:.1} %)",
                totals.passed,
                totals.failed,
                totals.skipped,
                totals.total,
                run.pass_rate * 100.0
            );
            if let Some(coverage) = run.coverage.as_ref().and_then(|c| c.overall) {
                let _ = writeln!(
                    text,
                    "      coverage {coverage:.1} % (target {:.0} %)",
                    run.coverage_target
                );
            }
            if let Some(fix_loop) = &run.fix_loop {
                let _ = writeln!(
                    text,
                    "      fix loop: {} iteration(s), {}{}",
                    fix_loop.iterations.len(),
                    if fix_loop.succeeded {
                        "succeeded"
                    } else {
                        "did not reach the target"
                    },
                    if fix_loop.flaky_tests.is_empty() {
                        String::new()
                    } else {
                        format!("; flaky: {}", fix_loop.flaky_tests.join(", "))
                    }
                );
                for step in &fix_loop.iterations {
                    let _ = writeln!(
                        text,
                        "        {} {} {} (pass rate {:.1} %){}",
                        step.iteration,
                        troupe_proto::names::name(step.strategy()),
                        troupe_proto::names::name(step.verdict()),
                        step.pass_rate * 100.0,
                        if step.commit.is_empty() {
                            String::new()
                        } else {
                            format!(" at {}", short(&step.commit))
                        }
                    );
                }
            }
            for failure in run.failures.iter().take(10) {
                let _ = writeln!(
                    text,
                    "        FAILED {} ({}:{}) {}",
                    failure.name,
                    failure.file,
                    failure.line,
                    first_line(&failure.message)
                );
            }
        }
        None => {}
    }
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or_default()
}

fn short(commit: &str) -> &str {
    commit.get(..10).unwrap_or(commit)
}

#[cfg(test)]
mod tests {
    use super::*;
    use troupe_proto::v1::Task;

    #[test]
    fn an_implementation_result_shows_its_fallbacks_and_denials() {
        let mut text = String::new();
        render_result(
            &mut text,
            &TaskResult {
                detail: Some(task_result::Detail::Implementation(
                    troupe_proto::v1::ImplementationReport {
                        backend: "claude".into(),
                        fallbacks: vec!["gemini".into()],
                        permission_denials: vec!["Bash: pytest -q".into()],
                        ..Default::default()
                    },
                )),
                ..Default::default()
            },
        );
        assert!(text.contains("      fell back from gemini\n"), "{text}");
        assert!(
            text.contains("      denied by claude: Bash: pytest -q\n"),
            "{text}"
        );
    }

    #[test]
    fn state_names_are_lowercase_without_prefix() {
        assert_eq!(task_state_name(TaskState::TimedOut as i32), "timed_out");
        assert_eq!(
            session_state_name(SessionState::Completed as i32),
            "completed"
        );
        assert!(is_terminal(SessionState::Failed as i32));
        assert!(!is_terminal(SessionState::Active as i32));
    }

    #[test]
    fn a_multi_repo_session_names_each_tasks_repo_and_each_repos_outcome() {
        let repo =
            |name: &str, url: &str, access: RepoAccess, head: &str, completed: u32| SessionRepo {
                name: name.into(),
                url: url.into(),
                branch: "troupe/s".into(),
                base_commit: "a".repeat(40),
                head: head.into(),
                access: access as i32,
                counts: Some(troupe_proto::v1::TaskCounts {
                    total: completed,
                    completed,
                    ..Default::default()
                }),
                ..Default::default()
            };
        let session = Session {
            id: "s".into(),
            state: SessionState::Completed as i32,
            repos: vec![
                repo(
                    "lib",
                    "git://h/lib.git",
                    RepoAccess::Write,
                    &"b".repeat(40),
                    2,
                ),
                repo("spec", "git://h/spec.git", RepoAccess::Read, "", 0),
            ],
            ..Default::default()
        };
        let header = session_header(&session, 0);
        assert!(
            header.contains(
                "repo spec: git://h/spec.git @ aaaaaaaaaa -> branch troupe/s (read-only context)"
            ),
            "{header}"
        );
        let text = final_report(&GetSessionResponse {
            next_page_token: String::new(),
            session: Some(session),
            tasks: vec![Task {
                id: "IMPL-1".into(),
                repo: "lib".into(),
                state: TaskState::Completed as i32,
                ..Default::default()
            }],
        });
        assert!(
            text.contains("IMPL-1         completed  attempts 0/0   [lib]"),
            "{text}"
        );
        assert!(
            text.contains("repo lib: branch troupe/s of git://h/lib.git at bbbbbbbbbb (from aaaaaaaaaa); 2 task(s): 2 completed"),
            "{text}"
        );
        assert!(
            text.contains("repo spec (git://h/spec.git) was read-only context at aaaaaaaaaa"),
            "{text}"
        );
    }

    #[test]
    fn a_failed_task_shows_its_error() {
        let response = GetSessionResponse {
            next_page_token: String::new(),
            session: Some(Session {
                id: "s".into(),
                state: SessionState::Failed as i32,
                ..Default::default()
            }),
            tasks: vec![Task {
                id: "IMPL-001".into(),
                state: TaskState::Failed as i32,
                attempt: 2,
                max_attempts: 2,
                last_error: Some(troupe_proto::v1::TaskError {
                    message: "agent exited with code 3".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }],
        };
        let text = final_report(&response);
        assert!(
            text.contains("IMPL-001       failed     attempts 2/2"),
            "{text}"
        );
        assert!(text.contains("error: agent exited with code 3"), "{text}");
        assert!(text.contains("session failed"), "{text}");
    }

    #[test]
    fn a_phase_lists_its_tasks_and_a_task_its_written_back_convergence() {
        use troupe_proto::v1::{ImplementationReport, PhaseTaskOutcome, TaskConvergence};
        let phase_task = |id: &str, wave: u32, state: TaskState| PhaseTaskOutcome {
            task_id: id.into(),
            wave,
            state: state as i32,
            summary: format!("{id} {}", troupe_proto::names::name(state)),
            commit: "0123456789abcdef".into(),
            convergence_met: if state == TaskState::Completed {
                ConvergenceMet::Pass as i32
            } else {
                ConvergenceMet::Unspecified as i32
            },
            ..Default::default()
        };
        let response = GetSessionResponse {
            next_page_token: String::new(),
            session: Some(Session {
                id: "s".into(),
                state: SessionState::Completed as i32,
                ..Default::default()
            }),
            tasks: vec![
                Task {
                    id: "EXEC-001".into(),
                    state: TaskState::Completed as i32,
                    result: Some(TaskResult {
                        detail: Some(task_result::Detail::Implementation(ImplementationReport {
                            backend: "command".into(),
                            phase_tasks: vec![
                                phase_task("IMPL-101", 1, TaskState::Completed),
                                phase_task("IMPL-103", 2, TaskState::Skipped),
                            ],
                            ..Default::default()
                        })),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                Task {
                    id: "IMPL-001".into(),
                    state: TaskState::Completed as i32,
                    convergence: Some(TaskConvergence {
                        verified: vec![true, false],
                        met: ConvergenceMet::Fail as i32,
                        checked_by: "VALIDATE-001".into(),
                        commit: "abc".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            ],
        };
        let text = final_report(&response);
        assert!(
            text.contains("wave 1 IMPL-101     completed commit 0123456789, convergence pass"),
            "{text}"
        );
        assert!(
            text.contains("wave 2 IMPL-103     skipped   IMPL-103 skipped\n"),
            "{text}"
        );
        assert!(
            text.contains("convergence fail (criteria verified: yes, no; checked by VALIDATE-001)"),
            "{text}"
        );
    }
}
