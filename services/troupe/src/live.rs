//! What `troupe run` and `troupe watch` show while a session runs: on a terminal, progress bars
//! (overall, per role, per wave) and a line per running task with its elapsed time, attempt,
//! worker, backend, tokens so far and last heartbeat note (and, under a test run, its latest
//! iteration's pass rate and coverage), with transitions scrolling above them; elsewhere (a
//! pipe, a file, `--plain`) one plain line per event.

use std::collections::{BTreeMap, HashMap};
use std::io::{IsTerminal as _, Write as _};
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use troupe_proto::v1::{
    Role, SessionEvent, Task, TaskState, TestIterationProgress, WorkProgress, session_event,
};

use crate::report;

/// Receives a session's events in order, each once.
pub trait View {
    /// One event.
    fn event(&mut self, event: &SessionEvent);
    /// The session ended (or following it stopped): leave the screen readable.
    fn finish(&mut self) {}
}

/// Whether [`for_stdout`] draws the live view: on a terminal, unless `plain`.
pub fn is_live(plain: bool) -> bool {
    !plain && std::io::stdout().is_terminal()
}

/// The view for this process's stdout: live on a terminal unless `plain` (drawn for `tasks`,
/// every task of the session), lines otherwise.
pub fn for_stdout(plain: bool, tasks: &[Task]) -> Box<dyn View> {
    if is_live(plain) {
        Box::new(Live::new(tasks, ProgressDrawTarget::stdout()))
    } else {
        Box::new(Lines)
    }
}

/// One line per event. A reader that went away (`| head`) stops the printing, not the run.
#[derive(Debug)]
pub struct Lines;

impl View for Lines {
    fn event(&mut self, event: &SessionEvent) {
        if let Some(line) = report::event_line(event) {
            let _ = writeln!(std::io::stdout().lock(), "{line}");
        }
    }
}

/// What the live view knows of a task.
#[derive(Debug)]
struct TaskView {
    state: TaskState,
    role: Role,
    wave: u32,
    attempt: u32,
    worker: String,
    note: String,
    /// The figures of the running attempt's latest heartbeat.
    figures: WorkProgress,
}

fn is_finished(state: TaskState) -> bool {
    matches!(
        state,
        TaskState::Completed
            | TaskState::Failed
            | TaskState::Skipped
            | TaskState::Cancelled
            | TaskState::TimedOut
    )
}

fn role_label(role: Role) -> &'static str {
    match role {
        Role::Executor => "executor",
        Role::Validator => "validator",
        Role::TestRunner => "test-runner",
        Role::Unspecified => "other",
    }
}

/// Bars and running-task lines drawn by indicatif.
#[derive(Debug)]
pub struct Live {
    multi: MultiProgress,
    tasks: HashMap<String, TaskView>,
    overall: ProgressBar,
    roles: BTreeMap<&'static str, ProgressBar>,
    waves: BTreeMap<u32, ProgressBar>,
    running: BTreeMap<String, ProgressBar>,
    /// The line under a running test task with its latest test iteration.
    tests: BTreeMap<String, ProgressBar>,
}

/// Bars after this many waves are summed into the last one shown, to keep the screen short.
const MAX_WAVE_BARS: u32 = 8;

impl Live {
    /// A view of `tasks` (the session's tasks when following began) drawn to `target`.
    pub fn new(tasks: &[Task], target: ProgressDrawTarget) -> Self {
        let multi = MultiProgress::with_draw_target(target);
        let style = ProgressStyle::with_template("{prefix:>12} [{bar:30}] {pos}/{len} {msg}")
            .expect("a valid template")
            .progress_chars("=> ");
        let bar = |prefix: String| {
            let bar = multi.add(ProgressBar::new(0).with_style(style.clone()));
            bar.set_prefix(prefix);
            bar
        };
        let overall = bar("all".to_owned());
        let mut live = Self {
            tasks: HashMap::new(),
            roles: BTreeMap::new(),
            waves: BTreeMap::new(),
            running: BTreeMap::new(),
            tests: BTreeMap::new(),
            overall,
            multi: multi.clone(),
        };
        let mut roles: Vec<&'static str> = tasks
            .iter()
            .map(|t| role_label(Role::try_from(t.role).unwrap_or(Role::Unspecified)))
            .collect();
        roles.sort_unstable();
        roles.dedup();
        for role in roles {
            live.roles.insert(role, bar(role.to_owned()));
        }
        let mut waves: Vec<u32> = tasks.iter().map(|t| wave_bucket(t.wave)).collect();
        waves.sort_unstable();
        waves.dedup();
        for wave in waves {
            let name = if wave == MAX_WAVE_BARS {
                format!("wave {wave}+")
            } else {
                format!("wave {wave}")
            };
            live.waves.insert(wave, bar(name));
        }
        for task in tasks {
            live.tasks.insert(
                task.id.clone(),
                TaskView {
                    state: TaskState::try_from(task.state).unwrap_or(TaskState::Unspecified),
                    role: Role::try_from(task.role).unwrap_or(Role::Unspecified),
                    wave: task.wave,
                    attempt: task.attempt,
                    worker: task.worker_id.clone(),
                    note: task.progress.clone(),
                    figures: task.work_progress.clone().unwrap_or_default(),
                },
            );
        }
        live.redraw();
        live
    }

    /// Recounts every bar from the tasks' states.
    fn redraw(&mut self) {
        let mut overall = (0, 0, 0, 0, 0);
        let mut roles: BTreeMap<&'static str, (u64, u64)> = BTreeMap::new();
        let mut waves: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
        for task in self.tasks.values() {
            let done = u64::from(is_finished(task.state));
            overall.0 += done;
            overall.1 += 1;
            overall.2 += u64::from(task.state == TaskState::Running);
            overall.3 += u64::from(matches!(
                task.state,
                TaskState::Failed | TaskState::TimedOut
            ));
            let role = roles.entry(role_label(task.role)).or_default();
            role.0 += done;
            role.1 += 1;
            let wave = waves.entry(wave_bucket(task.wave)).or_default();
            wave.0 += done;
            wave.1 += 1;
        }
        self.overall.set_length(overall.1);
        self.overall.set_position(overall.0);
        let mut message = format!("{} running, {} failed", overall.2, overall.3);
        if overall.4 > 0 {
            message.push_str(&format!(", {} waiting for approval", overall.4));
        }
        self.overall.set_message(message);
        for (role, (done, len)) in roles {
            if let Some(bar) = self.roles.get(role) {
                bar.set_length(len);
                bar.set_position(done);
            }
        }
        for (wave, (done, len)) in waves {
            if let Some(bar) = self.waves.get(&wave) {
                bar.set_length(len);
                bar.set_position(done);
            }
        }
        // A line per running task, in id order, below the bars.
        let running: Vec<String> = {
            let mut ids: Vec<&String> = self
                .tasks
                .iter()
                .filter(|(_, task)| task.state == TaskState::Running)
                .map(|(id, _)| id)
                .collect();
            ids.sort();
            ids.into_iter().cloned().collect()
        };
        for lines in [&mut self.running, &mut self.tests] {
            lines.retain(|id, bar| {
                let keep = running.contains(id);
                if !keep {
                    bar.finish_and_clear();
                }
                keep
            });
        }
        let style = ProgressStyle::with_template("{spinner} {prefix:<14} {elapsed:>4} {wide_msg}")
            .expect("a valid template");
        for id in running {
            let task = &self.tasks[&id];
            let bar = self.running.entry(id.clone()).or_insert_with(|| {
                let bar = self
                    .multi
                    .add(ProgressBar::new_spinner().with_style(style.clone()));
                bar.set_prefix(id.clone());
                bar.enable_steady_tick(Duration::from_millis(250));
                bar
            });
            bar.set_message(running_line(task));
            if let Some(test) = &task.figures.test {
                let bar = bar.clone();
                let line = self.tests.entry(id.clone()).or_insert_with(|| {
                    let style =
                        ProgressStyle::with_template("  {wide_msg}").expect("a valid template");
                    self.multi
                        .insert_after(&bar, ProgressBar::new_spinner().with_style(style))
                });
                line.set_message(test_line(test));
            }
        }
    }
}

/// `attempt 1 on w1 · codex · 1.2k in / 340 out tokens - note`.
fn running_line(task: &TaskView) -> String {
    let mut line = format!("attempt {}", task.attempt.max(1));
    if !task.worker.is_empty() {
        line.push_str(&format!(" on {}", task.worker));
    }
    if !task.figures.backend.is_empty() {
        line.push_str(&format!(" · {}", task.figures.backend));
    }
    if let Some(tokens) = &task.figures.tokens {
        line.push_str(&format!(
            " · {} in / {} out tokens",
            count(tokens.input_tokens),
            count(tokens.output_tokens)
        ));
    }
    if !task.note.is_empty() {
        line.push_str(&format!(" - {}", task.note));
    }
    line
}

/// `tests: first run: 6 tests, 2 failing, pass rate 66.7%, coverage 81.0%` or `tests: fix
/// iteration 1/3: ...`. No "passed" count: the figures do not say how many were skipped
/// (the total counts them, the pass rate does not), so `total - failing` would count a skipped
/// test as passing.
fn test_line(test: &TestIterationProgress) -> String {
    let which = if test.iteration == 0 {
        "first run".to_owned()
    } else {
        format!("fix iteration {}/{}", test.iteration, test.max_iterations)
    };
    let mut line = format!(
        "tests: {which}: {} tests, {} failing, pass rate {:.1}%",
        test.total,
        test.failing,
        test.pass_rate * 100.0
    );
    if let Some(coverage) = test.coverage {
        line.push_str(&format!(", coverage {coverage:.1}%"));
    }
    line
}

/// A token count, short: `950`, `12.3k`, `4.5M`.
fn count(n: u64) -> String {
    #[allow(clippy::cast_precision_loss)] // display only
    let f = n as f64;
    if n < 1_000 {
        n.to_string()
    } else if n < 1_000_000 {
        format!("{:.1}k", f / 1e3)
    } else {
        format!("{:.1}M", f / 1e6)
    }
}

fn wave_bucket(wave: u32) -> u32 {
    wave.min(MAX_WAVE_BARS)
}

impl View for Live {
    fn event(&mut self, event: &SessionEvent) {
        match &event.kind {
            Some(session_event::Kind::Task(transition)) => {
                let task = self
                    .tasks
                    .entry(transition.task_id.clone())
                    .or_insert_with(|| TaskView {
                        // A task the session gained after following began (a fix round).
                        state: TaskState::Unspecified,
                        role: Role::Unspecified,
                        wave: 0,
                        attempt: 0,
                        worker: String::new(),
                        note: String::new(),
                        figures: WorkProgress::default(),
                    });
                task.state = TaskState::try_from(transition.to).unwrap_or(TaskState::Unspecified);
                task.attempt = transition.attempt;
                task.worker.clone_from(&transition.worker_id);
                if task.state != TaskState::Running {
                    task.note.clear();
                }
                if task.state != TaskState::Running || transition.from != TaskState::Running as i32
                {
                    // A new attempt starts with no figures.
                    task.figures = WorkProgress::default();
                }
                // Transitions other than "started" scroll above the bars, as in the plain view.
                if task.state != TaskState::Running
                    && let Some(line) = report::event_line(event)
                {
                    let _ = self.multi.println(line);
                }
            }
            Some(session_event::Kind::Progress(progress)) => {
                if let Some(task) = self.tasks.get_mut(&progress.task_id) {
                    task.note = progress.note.lines().next().unwrap_or_default().to_owned();
                    if let Some(figures) = &progress.work_progress {
                        task.figures = figures.clone();
                    }
                }
            }
            Some(_) => {
                if let Some(line) = report::event_line(event) {
                    let _ = self.multi.println(line);
                }
            }
            None => {}
        }
        self.redraw();
    }

    fn finish(&mut self) {
        for bar in std::mem::take(&mut self.running)
            .into_values()
            .chain(std::mem::take(&mut self.tests).into_values())
        {
            bar.finish_and_clear();
        }
        self.overall.finish();
        for bar in self.roles.values().chain(self.waves.values()) {
            bar.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use troupe_proto::v1::TaskTransition;

    fn task(id: &str, role: Role, wave: u32) -> Task {
        Task {
            id: id.to_owned(),
            role: role as i32,
            wave,
            state: TaskState::Pending as i32,
            ..Default::default()
        }
    }

    fn moved(id: &str, to: TaskState) -> SessionEvent {
        SessionEvent {
            kind: Some(session_event::Kind::Task(TaskTransition {
                task_id: id.to_owned(),
                to: to as i32,
                attempt: 1,
                worker_id: "w1".to_owned(),
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    #[test]
    fn bars_count_finished_tasks_by_role_and_wave() {
        let tasks = [
            task("IMPL-1", Role::Executor, 1),
            task("IMPL-2", Role::Executor, 1),
            task("TEST-1", Role::TestRunner, 2),
        ];
        let mut live = Live::new(&tasks, ProgressDrawTarget::hidden());
        live.event(&moved("IMPL-1", TaskState::Running));
        assert_eq!(live.running.len(), 1);
        live.event(&moved("IMPL-1", TaskState::Completed));
        assert!(live.running.is_empty());
        assert_eq!(live.overall.position(), 1);
        assert_eq!(live.overall.length(), Some(3));
        assert_eq!(live.roles["executor"].position(), 1);
        assert_eq!(live.roles["executor"].length(), Some(2));
        assert_eq!(live.waves[&2].position(), 0);
        live.finish();
    }

    fn progress(id: &str, figures: WorkProgress) -> SessionEvent {
        SessionEvent {
            kind: Some(session_event::Kind::Progress(
                troupe_proto::v1::TaskProgress {
                    task_id: id.to_owned(),
                    note: "running backend agent".to_owned(),
                    worker_id: "w1".to_owned(),
                    work_progress: Some(figures),
                },
            )),
            ..Default::default()
        }
    }

    #[test]
    fn running_tasks_show_their_tokens_and_test_iterations() {
        let tasks = [
            task("IMPL-1", Role::Executor, 1),
            task("TEST-1", Role::TestRunner, 1),
        ];
        let mut live = Live::new(&tasks, ProgressDrawTarget::hidden());
        live.event(&moved("IMPL-1", TaskState::Running));
        live.event(&moved("TEST-1", TaskState::Running));
        live.event(&progress(
            "IMPL-1",
            WorkProgress {
                tokens: Some(troupe_proto::v1::Usage {
                    input_tokens: 12_345,
                    output_tokens: 678,
                    cached_input_tokens: 0,
                }),
                backend: "agent".to_owned(),
                test: None,
            },
        ));
        assert_eq!(
            live.running["IMPL-1"].message(),
            "attempt 1 on w1 · agent · 12.3k in / 678 out tokens - running backend agent"
        );
        assert!(!live.tests.contains_key("IMPL-1"));
        live.event(&progress(
            "TEST-1",
            WorkProgress {
                test: Some(TestIterationProgress {
                    iteration: 1,
                    max_iterations: 3,
                    pass_rate: 0.8,
                    coverage: Some(91.25),
                    failing: 1,
                    // 4 passed, 1 failed, 1 skipped: not "5/6 passing".
                    total: 6,
                }),
                ..WorkProgress::default()
            },
        ));
        assert_eq!(
            live.tests["TEST-1"].message(),
            "tests: fix iteration 1/3: 6 tests, 1 failing, pass rate 80.0%, coverage 91.2%"
        );
        // A new attempt forgets the last one's figures; a finished task loses its lines.
        live.event(&moved("TEST-1", TaskState::Completed));
        assert!(live.tests.is_empty());
        live.event(&moved("IMPL-1", TaskState::Ready));
        live.event(&moved("IMPL-1", TaskState::Running));
        assert_eq!(live.running["IMPL-1"].message(), "attempt 1 on w1");
        live.finish();
    }
}
