//! CCW's test-fix loop (ccw-reference.md §1.C.5–1.C.9) on a run's worktree.
//!
//! Failing tests are first re-run once: those that pass are flaky, reported and left alone.
//! Then, up to `max_iterations` times: pick a strategy (conservative / surgical / aggressive),
//! hand the failing tests' details to the fixing agent (troupe-backends), check the diff
//! against the fix scope (out-of-scope edits are reverted and refused), commit a checkpoint,
//! run the affected tests, then the full suite. An iteration that lowers the pass rate or
//! makes a passing test fail is reverted to the previous checkpoint.
//!
//! The loop starts whenever the suite ran and is not PASSED (a single failing test, a file that
//! failed to load, coverage under the target or the project's own threshold) and goes on until
//! the suite passes or the iterations run out; only then does CCW's criterion (pass rate ≥
//! 0.95 and coverage ≥ target) decide whether it succeeded. The agent is any backend of
//! troupe-backends, built from the executor's backend configuration, run with its retry and
//! fallback policy (`troupe_backends::chain`); each iteration records the backend that
//! produced the change, the ones that failed first, the classified error and the token usage.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use troupe_process::Command;
use troupe_proto::names;
use troupe_proto::v1::{
    ErrorKind, FixIteration, FixLoopReport, FixScope, FixStrategy, FixVerdict, Severity,
    TestIterationProgress, TestOutcome, TestRunReport,
};

use crate::Error;
use crate::js::Selection;
use crate::runner::{RunSpec, Runner, Suite, Tool};

/// CCW's pass-rate target.
pub const PASS_RATE_TARGET: f64 = 0.95;
/// Iterations when none are given (CCW team-testing).
pub const DEFAULT_MAX_ITERATIONS: u32 = 3;
/// Wall-clock limit of one agent run when none is given.
pub const DEFAULT_AGENT_TIMEOUT: Duration = Duration::from_secs(600);

/// How the fixing agent is run.
#[derive(Clone, Debug, PartialEq)]
pub struct FixSpec {
    /// Backend name (troupe-backends).
    pub backend: String,
    /// The `command` backend's argv template.
    pub command: Vec<String>,
    /// Backends tried after a classified failure; `None` = the configuration's chain.
    pub fallback: Option<Vec<String>>,
    /// Files the agent may change.
    pub scope: FixScope,
    /// Limit of one agent run.
    pub timeout: Duration,
    /// Iteration limit.
    pub max_iterations: u32,
}

impl FixSpec {
    /// Checks the backend exists and has what it needs.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        for name in std::iter::once(&self.backend).chain(self.fallback.iter().flatten()) {
            if troupe_backends::by_name(name).is_none() {
                return Err(Error::InvalidArgument(format!(
                    "unknown fix backend `{name}` (known: {})",
                    troupe_backends::BACKEND_NAMES.join(", ")
                )));
            }
        }
        if self.backend == "command" && self.command.is_empty() {
            return Err(Error::InvalidArgument(
                "the `command` fix backend needs a non-empty command argv".to_owned(),
            ));
        }
        if self.max_iterations == 0 || self.max_iterations > 20 {
            return Err(Error::InvalidArgument(format!(
                "max_iterations must be between 1 and 20, got {}",
                self.max_iterations
            )));
        }
        Ok(())
    }
}

/// The wire's kind of a classified backend error.
fn error_kind(kind: troupe_backends::ErrorKind) -> ErrorKind {
    use troupe_backends::ErrorKind as K;
    match kind {
        K::NotInstalled => ErrorKind::NotInstalled,
        K::Auth => ErrorKind::Auth,
        K::RateLimited => ErrorKind::RateLimited,
        K::Quota => ErrorKind::Quota,
        K::Timeout => ErrorKind::Timeout,
        K::Crash => ErrorKind::Crash,
        K::BadOutput => ErrorKind::BadOutput,
        K::InvalidTask => ErrorKind::InvalidTask,
        K::SandboxDenied => ErrorKind::SandboxDenied,
        K::PermissionDenied => ErrorKind::PermissionDenied,
        K::Internal | K::Cancelled => ErrorKind::Internal,
    }
}

/// Name of a scope as plans write it.
pub(crate) fn scope_name(scope: FixScope) -> &'static str {
    match scope {
        FixScope::Unspecified | FixScope::Tests => "tests",
        FixScope::Source => "source",
        FixScope::Both => "both",
    }
}

/// Whether a repo-relative path is a test file (the patterns the scope check uses).
pub(crate) fn is_test_path(path: &str) -> bool {
    let parts: Vec<&str> = path.split('/').collect();
    let name = parts.last().copied().unwrap_or("");
    let in_test_dir = parts[..parts.len().saturating_sub(1)]
        .iter()
        .any(|dir| matches!(*dir, "tests" | "test" | "__tests__" | "spec" | "__mocks__"));
    in_test_dir
        || name.contains(".test.")
        || name.contains(".spec.")
        || (name.starts_with("test_") && name.ends_with(".py"))
        || name.ends_with("_test.py")
        || name == "conftest.py"
}

fn in_scope(scope: FixScope, path: &str) -> bool {
    match scope {
        FixScope::Unspecified | FixScope::Tests => is_test_path(path),
        FixScope::Source => !is_test_path(path),
        FixScope::Both => true,
    }
}

/// Whether a report is worth a fix loop: the suite ran (or loaded) and did not pass.
pub(crate) fn needs_fixing(report: &TestRunReport) -> bool {
    matches!(
        report.outcome(),
        TestOutcome::TestsFailed
            | TestOutcome::CoverageBelowTarget
            | TestOutcome::LoadError
            | TestOutcome::CollectionError
            | TestOutcome::CoverageThreshold
    )
}

/// CCW's success criterion, applied after the loop: pass rate ≥ 0.95, coverage ≥ target, and
/// the suite actually ran.
pub(crate) fn meets_target(report: &TestRunReport, target: f64) -> bool {
    let ran = matches!(
        report.outcome(),
        TestOutcome::Passed
            | TestOutcome::TestsFailed
            | TestOutcome::CoverageBelowTarget
            | TestOutcome::CoverageThreshold
    );
    let coverage_ok = target <= 0.0
        || report
            .coverage
            .as_ref()
            .and_then(|c| c.overall)
            .is_some_and(|pct| pct >= target);
    ran && report.pass_rate >= PASS_RATE_TARGET && coverage_ok
}

/// CCW 1.C.6: aggressive when pass < 50 % or past iteration 7; conservative while early or
/// mostly passing; surgical for a handful of critical failures; aggressive otherwise.
pub(crate) fn strategy(iteration: u32, pass_rate: f64, critical: usize) -> FixStrategy {
    if pass_rate < 0.5 || iteration > 7 {
        FixStrategy::Aggressive
    } else if iteration <= 3 || pass_rate >= 0.8 {
        FixStrategy::Conservative
    } else if critical < 5 {
        FixStrategy::Surgical
    } else {
        FixStrategy::Aggressive
    }
}

/// Receives the figures of each suite run of the loop as it finishes.
#[derive(Clone)]
pub struct IterationSink(std::sync::Arc<dyn Fn(TestIterationProgress) + Send + Sync>);

impl IterationSink {
    /// A sink calling `f`.
    pub fn new(f: impl Fn(TestIterationProgress) + Send + Sync + 'static) -> Self {
        Self(std::sync::Arc::new(f))
    }

    /// Tells the figures of one suite run.
    pub fn report(&self, figures: TestIterationProgress) {
        (self.0)(figures);
    }
}

impl std::fmt::Debug for IterationSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IterationSink")
    }
}

/// The figures of one suite run: the first (`iteration` 0) or the one after fix iteration
/// `iteration`.
pub(crate) fn iteration_figures(
    iteration: u32,
    max_iterations: u32,
    report: &TestRunReport,
) -> TestIterationProgress {
    let totals = report.totals.unwrap_or_default();
    TestIterationProgress {
        iteration,
        max_iterations,
        pass_rate: report.pass_rate,
        coverage: report.coverage.as_ref().and_then(|c| c.overall),
        failing: totals.failed + totals.errors,
        total: totals.total,
    }
}

/// What the loop needs from the run.
#[derive(Debug)]
pub(crate) struct FixContext<'a> {
    pub(crate) runner: &'a Runner,
    pub(crate) tool: &'a Tool,
    pub(crate) spec: &'a RunSpec,
    pub(crate) fix: &'a FixSpec,
    pub(crate) worktree: &'a Path,
    pub(crate) out_dir: &'a Path,
}

impl FixContext<'_> {
    fn suite(&self) -> Suite<'_> {
        Suite {
            tool: self.tool,
            spec: self.spec,
            worktree: self.worktree,
        }
    }
}

fn failing_names(report: &TestRunReport) -> BTreeSet<String> {
    report.failures.iter().map(|f| f.name.clone()).collect()
}

/// Treats `flaky` tests as passed: they are reported, not fixed.
fn without_flaky(mut report: TestRunReport, flaky: &BTreeSet<String>) -> TestRunReport {
    let before = report.failures.len();
    report.failures.retain(|f| !flaky.contains(&f.name));
    let removed = u32::try_from(before - report.failures.len()).unwrap_or(u32::MAX);
    if removed == 0 {
        return report;
    }
    if let Some(totals) = report.totals.as_mut() {
        totals.failed = totals.failed.saturating_sub(removed);
        totals.passed += removed;
        report.pass_rate = crate::pytest::pass_rate(totals);
    }
    if report.outcome() == TestOutcome::TestsFailed && report.failures.is_empty() {
        let below = report.coverage_target > 0.0
            && report
                .coverage
                .as_ref()
                .and_then(|c| c.overall)
                .is_none_or(|pct| pct < report.coverage_target);
        report.outcome = if below {
            TestOutcome::CoverageBelowTarget
        } else {
            TestOutcome::Passed
        } as i32;
    }
    report
}

async fn git(worktree: &Path, args: &[&str], cancel: &CancellationToken) -> Result<String, Error> {
    let output = Command::new("git")
        .args([
            "-c",
            "user.name=troupe",
            "-c",
            "user.email=troupe@localhost",
        ])
        .args(args.iter().copied())
        .cwd(worktree)
        .timeout(Duration::from_secs(120))
        .run(cancel)
        .await
        .map_err(|source| Error::process("git", source))?;
    if !output.success() {
        return Err(Error::Internal(format!(
            "git {} failed: {}",
            args.join(" "),
            troupe_process::tail(&output.stderr_text(), 5, 1000)
        )));
    }
    // Not trimmed: `git status --porcelain` lines start with a space.
    Ok(output.stdout_text())
}

/// Puts the worktree back at `checkpoint`, keeping the linked `node_modules`.
async fn reset(worktree: &Path, checkpoint: &str, cancel: &CancellationToken) -> Result<(), Error> {
    git(worktree, &["reset", "-q", "--hard", checkpoint], cancel).await?;
    // The linked node_modules (the root's and each workspace package's) are not the agent's.
    git(
        worktree,
        &["clean", "-q", "-fd", "-e", "node_modules"],
        cancel,
    )
    .await?;
    Ok(())
}

/// Paths the agent changed (tracked and untracked), every `node_modules` excluded.
async fn changed_paths(worktree: &Path, cancel: &CancellationToken) -> Result<Vec<String>, Error> {
    let text = git(
        worktree,
        &[
            "status",
            "--porcelain",
            "--untracked-files=all",
            "--no-renames",
            "--",
            ".",
            ":(exclude)node_modules",
        ],
        cancel,
    )
    .await?;
    Ok(text
        .lines()
        .filter_map(|line| line.get(3..))
        .map(|p| p.trim_matches('"').to_owned())
        .filter(|p| !p.is_empty() && !p.split('/').any(|part| part == "node_modules"))
        .collect())
}

fn prompt(
    strategy: FixStrategy,
    report: &TestRunReport,
    scope: FixScope,
    target: f64,
    iteration: u32,
) -> String {
    let mut failures: Vec<_> = report.failures.iter().collect();
    // Most critical first (the enum counts up from LOW to CRITICAL).
    failures.sort_by_key(|f| std::cmp::Reverse(f.criticality()));
    let focus = match strategy {
        FixStrategy::Conservative => {
            "Fix ONE failure, the first one listed (the most critical), and nothing else."
                .to_owned()
        }
        FixStrategy::Surgical => {
            let pattern = crate::runner::defect_patterns(report)
                .first()
                .copied()
                .unwrap_or("the most common cause");
            format!("Fix one pattern everywhere it occurs: {pattern}.")
        }
        _ => "Fix every failure listed in one pass.".to_owned(),
    };
    let allowed = match scope {
        FixScope::Unspecified | FixScope::Tests => {
            "Change test files only (tests/, __tests__/, *.test.*, *.spec.*, test_*.py); never source files."
        }
        FixScope::Source => "Change source files only; never test files.",
        FixScope::Both => "You may change test and source files.",
    };
    let coverage = report
        .coverage
        .as_ref()
        .and_then(|c| c.overall)
        .map_or("not measured".to_owned(), |c| format!("{c:.1}%"));
    let mut text = format!(
        "PURPOSE: Fix failing tests (iteration {iteration}, strategy {}).\n\
         TASK: {focus}\n\
         MODE: write\n\
         CONSTRAINTS: {allowed} Do not skip or delete tests, no @ts-ignore, no `as any`.\n\
         EXPECTED: pass rate >= {:.0}% (now {:.1}%), coverage >= {target}% (now {coverage}).\n\
         CONTEXT: {} failing test(s):\n",
        names::name(strategy),
        PASS_RATE_TARGET * 100.0,
        report.pass_rate * 100.0,
        failures.len()
    );
    for f in failures {
        text.push_str(&format!(
            "- [{}] {} ({}:{}{}): {}\n",
            names::name(f.criticality()),
            f.name,
            f.file,
            f.line,
            if f.error_origin.is_empty() {
                String::new()
            } else {
                format!(", raised at {}", f.error_origin)
            },
            f.message.lines().take(6).collect::<Vec<_>>().join(" | ")
        ));
    }
    text
}

/// Runs the loop from the first report; returns the final report with `fix_loop` filled in.
#[tracing::instrument(name = "troupe.fix_loop", skip_all, fields(max = ctx.fix.max_iterations, scope = scope_name(ctx.fix.scope)))]
pub(crate) async fn run_loop(
    ctx: FixContext<'_>,
    base: TestRunReport,
    cancel: &CancellationToken,
) -> Result<TestRunReport, Error> {
    let target = ctx.spec.coverage_target;
    let mut record = FixLoopReport {
        scope: ctx.fix.scope as i32,
        max_iterations: ctx.fix.max_iterations,
        ..FixLoopReport::default()
    };
    let mut checkpoint = git(ctx.worktree, &["rev-parse", "HEAD"], cancel)
        .await?
        .trim()
        .to_owned();

    // Flaky detection: the failing tests' files once more.
    let mut flaky = BTreeSet::new();
    let failing_files: BTreeSet<String> = base
        .failures
        .iter()
        .filter(|f| f.name != f.file)
        .map(|f| f.file.clone())
        .collect();
    if base.outcome() == TestOutcome::TestsFailed && !failing_files.is_empty() {
        let rerun = ctx
            .runner
            .run_suite(
                ctx.suite(),
                &ctx.out_dir.join("flaky-rerun"),
                &Selection::Files(failing_files.into_iter().collect()),
                cancel,
            )
            .await?;
        if matches!(
            rerun.outcome(),
            TestOutcome::TestsFailed | TestOutcome::Passed | TestOutcome::CoverageBelowTarget
        ) {
            let still = failing_names(&rerun);
            flaky = failing_names(&base)
                .into_iter()
                .filter(|name| !still.contains(name))
                .collect();
        }
    }
    record.flaky_tests = flaky.iter().cloned().collect();
    let mut current = without_flaky(base, &flaky);
    if !flaky.is_empty() {
        current.warnings.push(format!(
            "flaky (failed, then passed on a re-run; not fixed): {}",
            record.flaky_tests.join(", ")
        ));
    }
    let coverage_of =
        |r: &TestRunReport| r.coverage.as_ref().and_then(|c| c.overall).unwrap_or(0.0);
    let tell = |iteration: u32, report: &TestRunReport| {
        if let Some(sink) = &ctx.spec.iterations {
            sink.report(iteration_figures(iteration, ctx.fix.max_iterations, report));
        }
    };
    tell(0, &current);
    record.coverage_history.push(coverage_of(&current));
    record.pass_rate_history.push(current.pass_rate);

    let config = ctx.runner.backends();
    let chain =
        troupe_backends::chain::candidates(&ctx.fix.backend, ctx.fix.fallback.as_deref(), config);
    let mut total_usage: Option<troupe_proto::v1::Usage> = None;
    let mut iteration = 0;
    // Until the suite passes: a pass rate already at 0.95 still has failures to fix.
    while current.outcome() != TestOutcome::Passed
        && needs_fixing(&current)
        && iteration < ctx.fix.max_iterations
    {
        iteration += 1;
        let critical = current
            .failures
            .iter()
            .filter(|f| f.criticality() == Severity::Critical)
            .count();
        let strategy = strategy(iteration, current.pass_rate, critical);
        let iter_dir = ctx.out_dir.join(format!("iteration-{iteration}"));
        tokio::fs::create_dir_all(&iter_dir)
            .await
            .map_err(|source| Error::Io {
                path: iter_dir.clone(),
                source,
            })?;
        let mut text = prompt(strategy, &current, ctx.fix.scope, target, iteration);
        // Agents that need absolute paths (claude, qwen, opencode) take them from here, as the
        // executor's prompt gives them.
        text.push_str(&format!(
            "\nWorking directory: {}\n",
            ctx.worktree.display()
        ));
        let prompt_file = iter_dir.join("prompt.md");
        tokio::fs::write(&prompt_file, &text)
            .await
            .map_err(|source| Error::Io {
                path: prompt_file.clone(),
                source,
            })?;
        let mut step = FixIteration {
            iteration,
            strategy: strategy as i32,
            ..FixIteration::default()
        };
        // The session task's own values (plan_dir, session_id, task_id) win over the defaults.
        let mut placeholders: BTreeMap<String, String> = [
            ("repo".to_owned(), ctx.spec.repo_path.display().to_string()),
            ("task_id".to_owned(), ctx.spec.run_id.clone()),
        ]
        .into_iter()
        .collect();
        placeholders.extend(ctx.spec.placeholders.clone());
        let settings = config.backend(&ctx.fix.backend);
        let (worktree, at) = (ctx.worktree, checkpoint.as_str());
        let chained = troupe_backends::chain::run_chain(
            &chain,
            config,
            |name, run| troupe_backends::RunSpec {
                worktree: ctx.worktree.to_owned(),
                prompt: text.clone(),
                prompt_file: prompt_file.clone(),
                placeholders: placeholders.clone(),
                command: ctx.fix.command.clone(),
                timeout: Some(ctx.fix.timeout),
                idle_timeout: config.backend(name).idle_timeout().or(settings.idle_timeout()),
                // CLI backends (codex, claude, ...) need a private HOME/TMPDIR per run.
                home: Some(iter_dir.join(format!("agent-home-{name}-{run}"))),
                usage_sink: ctx.spec.usage.as_ref().map(|meter| meter.run_sink(name)),
                ..troupe_backends::RunSpec::default()
            },
            move || async move {
                if let Err(err) = reset(worktree, at, cancel).await {
                    tracing::warn!(error = %err, "cannot reset the worktree after a failed agent run");
                }
            },
            cancel,
        )
        .instrument(tracing::info_span!(
            "troupe.fix.iteration",
            iteration,
            strategy = troupe_proto::names::name(strategy)
        ))
        .await;
        if cancel.is_cancelled() {
            return Err(Error::Cancelled);
        }
        step.backend = chained.backend.clone();
        step.fallbacks = chained.fallbacks.clone();
        let outcome = chained.result;
        if let Ok(done) = &outcome
            && let Some(usage) = done.usage
        {
            let usage = troupe_proto::v1::Usage {
                input_tokens: usage.input_tokens,
                output_tokens: usage.output_tokens,
                cached_input_tokens: usage.cached_input_tokens,
            };
            let sum = total_usage.get_or_insert_with(Default::default);
            sum.input_tokens += usage.input_tokens;
            sum.output_tokens += usage.output_tokens;
            sum.cached_input_tokens += usage.cached_input_tokens;
            step.usage = Some(usage);
        }
        if let Err(err) = outcome {
            step.verdict = FixVerdict::AgentFailed as i32;
            step.error_kind = error_kind(err.kind()) as i32;
            step.detail = if chained.errors.len() > 1 {
                format!(
                    "{err} (earlier: {})",
                    chained.errors[..chained.errors.len() - 1].join("; ")
                )
            } else {
                err.to_string()
            };
            reset(ctx.worktree, &checkpoint, cancel).await?;
            record.iterations.push(step);
            continue;
        }
        let changed = changed_paths(ctx.worktree, cancel).await?;
        if changed.is_empty() {
            step.verdict = FixVerdict::NoChange as i32;
            step.detail = "the agent changed nothing".to_owned();
            record.iterations.push(step);
            continue;
        }
        let outside: Vec<String> = changed
            .iter()
            .filter(|p| !in_scope(ctx.fix.scope, p))
            .cloned()
            .collect();
        if !outside.is_empty() {
            reset(ctx.worktree, &checkpoint, cancel).await?;
            step.verdict = FixVerdict::RevertedOutOfScope as i32;
            step.detail = format!(
                "refused: scope `{}` does not allow {}",
                scope_name(ctx.fix.scope),
                outside.join(", ")
            );
            step.out_of_scope_paths = outside;
            tracing::warn!(iteration, paths = ?step.out_of_scope_paths, "fix outside its scope reverted");
            record.iterations.push(step);
            continue;
        }
        // Exactly the paths found above: never the linked node_modules.
        let mut add = vec!["add", "-A", "--"];
        add.extend(changed.iter().map(String::as_str));
        git(ctx.worktree, &add, cancel).await?;
        git(
            ctx.worktree,
            &[
                "commit",
                "-q",
                "--no-verify",
                "-m",
                &format!(
                    "troupe: test fix iteration {iteration} ({})",
                    names::name(strategy)
                ),
            ],
            cancel,
        )
        .await?;
        let commit = git(ctx.worktree, &["rev-parse", "HEAD"], cancel)
            .await?
            .trim()
            .to_owned();
        step.commit = commit.clone();
        let before = failing_names(&current);
        // Affected tests first: a new failure there is enough to call the fix worse.
        let related = match ctx.tool {
            Tool::Pytest { .. } => {
                let files = crate::runner::pytest_related(ctx.worktree, &changed);
                (!files.is_empty()).then_some(Selection::Files(files))
            }
            Tool::Js { .. } => Some(Selection::Related(changed.clone())),
        };
        let mut new_in_affected = Vec::new();
        if let Some(selection) = related {
            let affected = ctx
                .runner
                .run_suite(ctx.suite(), &iter_dir.join("affected"), &selection, cancel)
                .await?;
            step.affected_command = affected.command.clone();
            step.affected_totals = affected.totals;
            new_in_affected = failing_names(&affected)
                .into_iter()
                .filter(|n| !before.contains(n) && !flaky.contains(n))
                .collect();
        }
        if !new_in_affected.is_empty() {
            reset(ctx.worktree, &checkpoint, cancel).await?;
            step.verdict = FixVerdict::RevertedWorse as i32;
            step.detail = "the affected tests show new failures".to_owned();
            step.new_failures = new_in_affected;
            record.iterations.push(step);
            continue;
        }
        let full = ctx
            .runner
            .run_suite(ctx.suite(), &iter_dir.join("full"), &Selection::All, cancel)
            .await?;
        let mut full = without_flaky(full, &flaky);
        full.commit = commit.clone();
        step.totals = full.totals;
        step.pass_rate = full.pass_rate;
        step.coverage = full.coverage.as_ref().and_then(|c| c.overall);
        tell(iteration, &full);
        let new_failures: Vec<String> = failing_names(&full)
            .into_iter()
            .filter(|n| !before.contains(n))
            .collect();
        let broke = !matches!(
            full.outcome(),
            TestOutcome::Passed | TestOutcome::TestsFailed | TestOutcome::CoverageBelowTarget
        ) && matches!(
            current.outcome(),
            TestOutcome::Passed | TestOutcome::TestsFailed | TestOutcome::CoverageBelowTarget
        );
        if full.pass_rate + 1e-9 < current.pass_rate || !new_failures.is_empty() || broke {
            reset(ctx.worktree, &checkpoint, cancel).await?;
            step.verdict = FixVerdict::RevertedWorse as i32;
            step.detail = format!(
                "pass rate {:.3} -> {:.3}{}; reverted to {}",
                current.pass_rate,
                full.pass_rate,
                if new_failures.is_empty() {
                    String::new()
                } else {
                    format!(", new failures: {}", new_failures.join(", "))
                },
                &checkpoint[..12.min(checkpoint.len())]
            );
            step.new_failures = new_failures;
            tracing::info!(iteration, detail = %step.detail, "fix made things worse");
            record.iterations.push(step);
            continue;
        }
        step.verdict = FixVerdict::Kept as i32;
        checkpoint = commit;
        record.final_commit = checkpoint.clone();
        record.coverage_history.push(coverage_of(&full));
        record.pass_rate_history.push(full.pass_rate);
        let warnings = std::mem::take(&mut current.warnings);
        current = full;
        current
            .warnings
            .extend(warnings.into_iter().filter(|w| w.starts_with("flaky")));
        record.iterations.push(step);
    }
    record.succeeded = meets_target(&current, target);
    record.usage = total_usage;
    let reverted = record
        .iterations
        .iter()
        .filter(|i| {
            matches!(
                i.verdict(),
                FixVerdict::RevertedWorse | FixVerdict::RevertedOutOfScope
            )
        })
        .count();
    if reverted > 0 {
        current.warnings.push(format!(
            "{reverted} fix iteration(s) reverted; see fix_loop.iterations"
        ));
    }
    current.fix_loop = Some(record);
    Ok(current)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_test_paths() {
        for path in [
            "tests/math.test.js",
            "src/__tests__/a.ts",
            "src/a.spec.ts",
            "pkg/test_x.py",
            "x_test.py",
            "conftest.py",
            "tests/helpers.py",
        ] {
            assert!(is_test_path(path), "{path}");
        }
        for path in [
            "src/math.js",
            "src/calc/strings.py",
            "package.json",
            "testing.md",
        ] {
            assert!(!is_test_path(path), "{path}");
        }
        assert!(in_scope(FixScope::Unspecified, "tests/a.test.js"));
        assert!(!in_scope(FixScope::Tests, "src/a.js"));
        assert!(!in_scope(FixScope::Source, "tests/a.test.js"));
        assert!(in_scope(FixScope::Both, "src/a.js"));
    }

    #[test]
    fn an_iterations_figures_come_from_its_report() {
        let report = TestRunReport {
            pass_rate: 0.75,
            totals: Some(troupe_proto::v1::TestTotals {
                total: 8,
                passed: 6,
                failed: 1,
                skipped: 0,
                errors: 1,
            }),
            coverage: Some(troupe_proto::v1::Coverage {
                overall: Some(82.5),
                ..Default::default()
            }),
            ..TestRunReport::default()
        };
        let figures = iteration_figures(2, 3, &report);
        assert_eq!(
            figures,
            TestIterationProgress {
                iteration: 2,
                max_iterations: 3,
                pass_rate: 0.75,
                coverage: Some(82.5),
                failing: 2,
                total: 8,
            }
        );
        // No coverage measured: absent, not 0 %.
        let bare = iteration_figures(0, 3, &TestRunReport::default());
        assert_eq!((bare.coverage, bare.failing, bare.total), (None, 0, 0));
    }

    #[test]
    fn chooses_strategies_like_ccw() {
        assert_eq!(strategy(1, 0.9, 0), FixStrategy::Conservative);
        assert_eq!(strategy(2, 0.3, 0), FixStrategy::Aggressive);
        assert_eq!(strategy(5, 0.7, 2), FixStrategy::Surgical);
        assert_eq!(strategy(5, 0.7, 9), FixStrategy::Aggressive);
        assert_eq!(strategy(8, 0.9, 0), FixStrategy::Aggressive);
    }

    #[test]
    fn flaky_tests_count_as_passed() {
        let report = TestRunReport {
            outcome: TestOutcome::TestsFailed as i32,
            totals: Some(troupe_proto::v1::TestTotals {
                total: 4,
                passed: 3,
                failed: 1,
                ..Default::default()
            }),
            pass_rate: 0.75,
            failures: vec![troupe_proto::v1::TestFailure {
                name: "flips".into(),
                ..Default::default()
            }],
            ..TestRunReport::default()
        };
        let flaky = ["flips".to_owned()].into_iter().collect();
        let report = without_flaky(report, &flaky);
        assert_eq!(report.outcome(), TestOutcome::Passed);
        assert!((report.pass_rate - 1.0).abs() < f64::EPSILON);
        assert!(meets_target(&report, 0.0));
    }
}
