//! `troupe report`: where a session's time and tokens went, per task, per repo and per backend,
//! with the test pass rate and coverage of every fix iteration, as Markdown or JSON.
//!
//! Tokens and costs are grouped by backend and model (`codex/gpt-5`; the backend alone when its
//! configuration names no model). Costs come only from a price table the user gives
//! (`--prices`, keyed by model or backend): troupe does not guess a provider's prices, and a
//! backend without a price shows tokens and no cost.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};
use troupe_proto::v1::{GetSessionResponse, Role, Task, TaskState, Usage, task_result};

use troupe_view::graph::human_duration;

/// The output formats of `troupe report`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Markdown tables.
    Md,
    /// One JSON document (the same figures, machine-readable).
    Json,
}

/// Prices per million tokens of one backend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Per million uncached input tokens.
    #[serde(default)]
    pub input_per_mtok: f64,
    /// Per million output tokens.
    #[serde(default)]
    pub output_per_mtok: f64,
    /// Per million cached input tokens (default: the input price).
    #[serde(default)]
    pub cached_input_per_mtok: Option<f64>,
}

impl Price {
    fn cost(&self, tokens: &Tokens) -> f64 {
        let cached = tokens.cached_input.min(tokens.input);
        let uncached = tokens.input - cached;
        (uncached as f64 * self.input_per_mtok
            + cached as f64 * self.cached_input_per_mtok.unwrap_or(self.input_per_mtok)
            + tokens.output as f64 * self.output_per_mtok)
            / 1e6
    }
}

/// A price table: `[model]` or `[backend]` sections (TOML), e.g. `[claude] input_per_mtok =
/// 3.0`; a task's model's price wins over its backend's.
pub type Prices = BTreeMap<String, Price>;

/// Reads a price table file.
pub fn load_prices(path: &Path) -> anyhow::Result<Prices> {
    use anyhow::Context as _;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("parsing the price table {}", path.display()))
}

/// Token counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Tokens {
    pub input: u64,
    pub output: u64,
    pub cached_input: u64,
}

impl Tokens {
    fn add(&mut self, usage: Option<&Usage>) {
        if let Some(usage) = usage {
            self.input += usage.input_tokens;
            self.output += usage.output_tokens;
            self.cached_input += usage.cached_input_tokens;
        }
    }

    fn plus(mut self, other: &Tokens) -> Tokens {
        self.input += other.input;
        self.output += other.output;
        self.cached_input += other.cached_input;
        self
    }
}

/// One task's line of the report.
#[derive(Debug, Clone, Serialize)]
pub struct TaskLine {
    pub id: String,
    pub repo: String,
    pub role: &'static str,
    pub state: &'static str,
    pub attempts: u32,
    pub duration_ms: Option<u64>,
    /// The backend that did the work (executor tasks), `""` otherwise.
    pub backend: String,
    /// The model it was configured with, `""` when it names none.
    pub model: String,
    /// Backends tried after a failure, in order.
    pub fallbacks: Vec<String>,
    /// Tokens of the implementation (executor) or of the fix loop's agent (test runs).
    pub tokens: Tokens,
    pub cost: Option<f64>,
    /// Test pass rate (0 to 1) after each run of the suite: the first run, then each fix
    /// iteration.
    pub pass_rate_history: Vec<f64>,
    /// Coverage in percent after each run, when measured.
    pub coverage_history: Vec<f64>,
}

/// Totals of a group of tasks (a repo, or a backend).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Totals {
    pub tasks: usize,
    /// Tasks by final state name.
    pub states: BTreeMap<&'static str, usize>,
    pub attempts: u32,
    /// Sum of task run times (tasks run in parallel: not the session's wall time).
    pub duration_ms: u64,
    pub tokens: Tokens,
    pub cost: Option<f64>,
}

impl Totals {
    fn add(&mut self, line: &TaskLine) {
        self.tasks += 1;
        *self.states.entry(line.state).or_default() += 1;
        self.attempts += line.attempts;
        self.duration_ms += line.duration_ms.unwrap_or(0);
        self.tokens = self.tokens.plus(&line.tokens);
        if let Some(cost) = line.cost {
            self.cost = Some(self.cost.unwrap_or(0.0) + cost);
        }
    }
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub session: String,
    pub state: &'static str,
    pub tasks: Vec<TaskLine>,
    pub repos: BTreeMap<String, Totals>,
    pub backends: BTreeMap<String, Totals>,
    pub total: Totals,
}

fn task_line(task: &Task, prices: &Prices) -> TaskLine {
    let mut tokens = Tokens::default();
    let (mut backend, mut model, mut fallbacks) = (String::new(), String::new(), Vec::new());
    let (mut pass_rate_history, mut coverage_history) = (Vec::new(), Vec::new());
    match task
        .result
        .as_ref()
        .and_then(|result| result.detail.as_ref())
    {
        Some(task_result::Detail::Implementation(report)) => {
            tokens.add(report.usage.as_ref());
            backend.clone_from(&report.backend);
            model.clone_from(&report.model);
            fallbacks.clone_from(&report.fallbacks);
        }
        Some(task_result::Detail::TestRun(report)) => {
            match &report.fix_loop {
                Some(fix) if !fix.pass_rate_history.is_empty() => {
                    tokens.add(fix.usage.as_ref());
                    pass_rate_history.clone_from(&fix.pass_rate_history);
                    coverage_history.clone_from(&fix.coverage_history);
                }
                _ => {
                    pass_rate_history.push(report.pass_rate);
                    coverage_history.extend(report.coverage.as_ref().and_then(|c| c.overall));
                }
            }
            if tokens != Tokens::default() {
                backend = "fixer".to_owned();
            }
        }
        _ => {}
    }
    let started = task.started_at.as_ref();
    let finished = task.finished_at.as_ref();
    let duration_ms = match (started, finished) {
        (Some(start), Some(end)) => {
            let ms = (end.seconds - start.seconds) * 1000
                + i64::from(end.nanos - start.nanos) / 1_000_000;
            u64::try_from(ms).ok()
        }
        _ => None,
    };
    // A model's price when the table has one, else the backend's.
    let cost = prices
        .get(&model)
        .filter(|_| !model.is_empty())
        .or_else(|| prices.get(&backend))
        .map(|price| price.cost(&tokens));
    TaskLine {
        id: task.id.clone(),
        repo: task.repo.clone(),
        role: troupe_proto::names::name(Role::try_from(task.role).unwrap_or(Role::Unspecified)),
        state: troupe_proto::names::task_state(
            TaskState::try_from(task.state).unwrap_or(TaskState::Unspecified),
        ),
        attempts: task.attempt,
        duration_ms,
        backend,
        model,
        fallbacks,
        tokens,
        cost,
        pass_rate_history,
        coverage_history,
    }
}

/// Builds the report of a session.
pub fn build(response: &GetSessionResponse, prices: &Prices) -> Report {
    let tasks: Vec<TaskLine> = response
        .tasks
        .iter()
        .map(|task| task_line(task, prices))
        .collect();
    let (mut repos, mut backends, mut total) = (
        BTreeMap::<String, Totals>::new(),
        BTreeMap::<String, Totals>::new(),
        Totals::default(),
    );
    for line in &tasks {
        let repo = if line.repo.is_empty() {
            "default"
        } else {
            &line.repo
        };
        repos.entry(repo.to_owned()).or_default().add(line);
        if !line.backend.is_empty() {
            let key = if line.model.is_empty() {
                line.backend.clone()
            } else {
                format!("{}/{}", line.backend, line.model)
            };
            backends.entry(key).or_default().add(line);
        }
        total.add(line);
    }
    let session = response.session.as_ref();
    Report {
        session: session.map(|s| s.id.clone()).unwrap_or_default(),
        state: session
            .and_then(|s| troupe_proto::v1::SessionState::try_from(s.state).ok())
            .map_or("unspecified", troupe_proto::names::session_state),
        tasks,
        repos,
        backends,
        total,
    }
}

fn cell_duration(ms: Option<u64>) -> String {
    ms.map_or_else(
        || "-".to_owned(),
        |ms| human_duration(std::time::Duration::from_millis(ms)),
    )
}

fn cell_cost(cost: Option<f64>) -> String {
    cost.map_or_else(|| "-".to_owned(), |cost| format!("${cost:.4}"))
}

fn cell_tokens(tokens: &Tokens) -> String {
    format!(
        "{} / {} ({} cached)",
        tokens.input, tokens.output, tokens.cached_input
    )
}

/// `83.3% → 100.0%`; `scale` turns fractions into percents.
fn percents(values: &[f64], scale: f64) -> String {
    if values.is_empty() {
        return "-".to_owned();
    }
    values
        .iter()
        .map(|value| format!("{:.1}%", value * scale))
        .collect::<Vec<_>>()
        .join(" → ")
}

fn totals_table(out: &mut String, heading: &str, key: &str, groups: &BTreeMap<String, Totals>) {
    let _ = writeln!(out, "\n## {heading}\n");
    let _ = writeln!(
        out,
        "| {key} | tasks | states | attempts | task time | tokens in / out | cost |"
    );
    out.push_str("|---|---:|---|---:|---:|---|---:|\n");
    for (name, totals) in groups {
        let states: Vec<String> = totals
            .states
            .iter()
            .map(|(state, count)| format!("{count} {state}"))
            .collect();
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {} | {} | {} | {} |",
            totals.tasks,
            states.join(", "),
            totals.attempts,
            cell_duration(Some(totals.duration_ms)),
            cell_tokens(&totals.tokens),
            cell_cost(totals.cost)
        );
    }
}

/// Renders the report as Markdown.
pub fn markdown(report: &Report) -> String {
    let mut out = format!("# Session {} ({})\n", report.session, report.state);
    let mut total = BTreeMap::new();
    total.insert("all".to_owned(), report.total.clone());
    totals_table(&mut out, "Total", "session", &total);
    totals_table(&mut out, "By repo", "repo", &report.repos);
    totals_table(
        &mut out,
        "By backend and model",
        "backend/model",
        &report.backends,
    );
    out.push_str("\n## Tasks\n\n");
    out.push_str("| task | repo | role | state | attempts | time | backend | tokens in / out | cost | pass rate | coverage |\n");
    out.push_str("|---|---|---|---|---:|---:|---|---|---:|---|---|\n");
    for line in &report.tasks {
        let mut backend = line.backend.clone();
        if !line.fallbacks.is_empty() {
            let _ = write!(backend, " (after {})", line.fallbacks.join(", "));
        }
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            line.id,
            if line.repo.is_empty() {
                "default"
            } else {
                &line.repo
            },
            line.role,
            line.state,
            line.attempts,
            cell_duration(line.duration_ms),
            if backend.is_empty() { "-" } else { &backend },
            cell_tokens(&line.tokens),
            cell_cost(line.cost),
            percents(&line.pass_rate_history, 100.0),
            percents(&line.coverage_history, 1.0)
        );
    }
    out
}

/// Renders the report in `format`.
pub fn render(format: Format, report: &Report) -> anyhow::Result<String> {
    Ok(match format {
        Format::Md => markdown(report),
        Format::Json => serde_json::to_string_pretty(report)? + "\n",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_price_charges_cached_input_at_its_own_rate() {
        let price = Price {
            input_per_mtok: 3.0,
            output_per_mtok: 15.0,
            cached_input_per_mtok: Some(0.3),
        };
        let tokens = Tokens {
            input: 2_000_000,
            output: 100_000,
            cached_input: 1_000_000,
        };
        // 1M uncached at 3 + 1M cached at 0.3 + 0.1M out at 15.
        assert!((price.cost(&tokens) - 4.8).abs() < 1e-9);
    }

    #[test]
    fn a_price_table_refuses_unknown_keys() {
        let prices: Prices = toml::from_str("[claude]\ninput_per_mtok = 3.0\n").unwrap();
        assert_eq!(prices["claude"].input_per_mtok, 3.0);
        assert!(toml::from_str::<Prices>("[claude]\ninput_per_token = 3.0\n").is_err());
    }
}
