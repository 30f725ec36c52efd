//! The judge for free-text criteria: any troupe-backends backend, run read-only (analysis
//! mode) in a checkout of the commit. The `command` backend reads the criterion and the
//! evidence gathered so far as JSON on stdin; agent backends (`codex`, `claude`, `gemini`,
//! `qwen`, `opencode`, `agent`) get the same as a prompt. Either answers (the command's stdout,
//! or the agent's final message) with:
//!
//! ```json
//! {"verdict": "pass" | "fail",
//!  "evidence": [{"file": "src/a.py", "line": 3, "end_line": 5} | {"command": "pytest -q", "output": "3 passed"}],
//!  "reason": "optional one-liner"}
//! ```
//!
//! A citation holds when the file and its line range exist in the checked commit, or when the
//! quoted output appears in what was actually seen (the checks that already ran, or the judge's
//! own transcript apart from its answer). An answer that is not that JSON, cites nothing, or
//! cites something that does not hold is not a verdict: MANUAL_REVIEW with the reason. A judge
//! that cannot run, crashes or times out is an ERROR that says so. A judged PASS is labelled as
//! judged.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use troupe_backends::{BACKEND_NAMES, BackendConfig, RunOutcome, RunSpec};
use troupe_plan::spec::JudgeSpec;
use troupe_proto::v1::{CheckResult, CheckStatus};

use crate::validate::confined;

/// A configured judge: a backend (`command` with an argv, or an agent backend with its
/// settings), run read-only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JudgeConfig {
    /// Backend name as in troupe-backends (`command`, `codex`, `claude`, `agent`, ...).
    pub backend: String,
    /// The `command` backend's argv template (placeholders such as `{worktree}` allowed);
    /// empty for agent backends.
    pub command: Vec<String>,
    /// Agent backends' settings, the executor's shape: program, model, endpoint, API key
    /// variable, env allow-list, idle timeout, budgets.
    pub settings: BackendConfig,
    /// Wall-clock limit per criterion.
    pub timeout: Duration,
}

impl JudgeConfig {
    /// A `command` backend judge running `argv`.
    pub fn command(argv: Vec<String>, timeout: Duration) -> Self {
        Self {
            backend: "command".to_owned(),
            command: argv,
            settings: BackendConfig::default(),
            timeout,
        }
    }

    /// How the judge is named in evidence.
    fn who(&self) -> String {
        if self.backend == "command" {
            self.command.join(" ")
        } else {
            match &self.settings.model {
                Some(model) => format!("{} ({model})", self.backend),
                None => self.backend.clone(),
            }
        }
    }

    /// Parses a judge: an argv array or a command string (the `command` backend), or an
    /// object `{"backend": "codex", "model": ..., "endpoint": ..., "env_allow": [...],
    /// "timeout_seconds": N, ...}` (the executor's backend settings; `command` is an argv for
    /// the `command` backend and the program for the others). `Null` is no judge.
    pub fn from_value(value: &Value, default_timeout: Duration) -> Result<Option<Self>, String> {
        let argv = |command: &Value| -> Result<Vec<String>, String> {
            match command {
                Value::String(line) => troupe_process::command_line_to_argv(line)
                    .map_err(|err| format!("judge command: {err}")),
                Value::Array(items) => items
                    .iter()
                    .map(|i| i.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
                    .filter(|a| a.first().is_some_and(|p| !p.is_empty()))
                    .ok_or_else(|| "judge command must be a non-empty array of strings".to_owned()),
                _ => Err(
                    "judge must be an argv array, a command string or an object with `backend` or `command`"
                        .to_owned(),
                ),
            }
        };
        let timeout_of = |secs: Option<u64>| {
            secs.filter(|s| *s > 0)
                .map_or(default_timeout, Duration::from_secs)
        };
        let map = match value {
            Value::Null => return Ok(None),
            Value::Object(map) => map,
            other => return Ok(Some(Self::command(argv(other)?, default_timeout))),
        };
        let backend = match map.get("backend") {
            None => "command",
            Some(Value::String(name)) => name.as_str(),
            Some(_) => return Err("judge `backend` must be a string".to_owned()),
        };
        if !BACKEND_NAMES.contains(&backend) {
            return Err(format!(
                "unknown judge backend `{backend}` (known: {})",
                BACKEND_NAMES.join(", ")
            ));
        }
        if backend == "command" {
            if let Some(key) = map
                .keys()
                .find(|k| !matches!(k.as_str(), "backend" | "command" | "timeout_seconds"))
            {
                return Err(format!(
                    "judge: `{key}` is not a setting of the `command` backend (command, timeout_seconds)"
                ));
            }
            let command = argv(map.get("command").unwrap_or(&Value::Null))?;
            let timeout = timeout_of(map.get("timeout_seconds").and_then(Value::as_u64));
            return Ok(Some(Self::command(command, timeout)));
        }
        let mut rest = map.clone();
        rest.remove("backend");
        let settings: BackendConfig = serde_json::from_value(Value::Object(rest))
            .map_err(|err| format!("judge backend `{backend}`: {err}"))?;
        // The judge's key reaches its CLI only; anywhere troupe writes, it is masked.
        if let Some(key) = settings.key() {
            troupe_telemetry::register_secret(key);
        }
        Ok(Some(Self {
            backend: backend.to_owned(),
            command: Vec::new(),
            timeout: timeout_of(settings.timeout_seconds),
            settings,
        }))
    }

    /// The judge a plan (a validator task's `judge`) or a `Validate` request
    /// (`judge_spec`) names, as `troupe-plan` typed it ([`JudgeSpec`]): the plan chooses the
    /// backend, the model, its time limits and budgets; where the judge connects and which
    /// credentials it gets (`endpoint`, `api_key_env`, `env_allow`, the program, ...) come
    /// from the validator's own configuration, `configured` (`--judge-config`), when it names
    /// the same backend, and are the backend's defaults otherwise. A `command` judge (an argv,
    /// run read-only like a verification command) is taken as it is.
    pub fn from_spec(
        spec: &JudgeSpec,
        default_timeout: Duration,
        configured: Option<&JudgeConfig>,
    ) -> Self {
        let (backend, chosen) = match spec {
            JudgeSpec::Command { argv, timeout } => {
                return Self::command(argv.clone(), timeout.unwrap_or(default_timeout));
            }
            JudgeSpec::Backend { backend, settings } => (backend, settings),
        };
        let mut settings = configured
            .filter(|configured| &configured.backend == backend)
            .map(|configured| configured.settings.clone())
            .unwrap_or_default();
        settings.model = chosen.model.clone().or(settings.model);
        settings.timeout_seconds = chosen.timeout_seconds.or(settings.timeout_seconds);
        settings.idle_timeout_seconds = chosen
            .idle_timeout_seconds
            .or(settings.idle_timeout_seconds);
        settings.max_turns = chosen.max_turns.or(settings.max_turns);
        settings.max_tokens = chosen.max_tokens.or(settings.max_tokens);
        settings.fast_fail |= chosen.fast_fail;
        Self {
            backend: backend.clone(),
            command: Vec::new(),
            timeout: settings
                .timeout_seconds
                .filter(|s| *s > 0)
                .map_or(default_timeout, Duration::from_secs),
            settings,
        }
    }

    /// Parses a judge configuration file (TOML, the same keys as [`JudgeConfig::from_value`]).
    pub fn from_toml(text: &str, default_timeout: Duration) -> Result<Self, String> {
        let table: toml::Table = toml::from_str(text).map_err(|err| err.to_string())?;
        let value = serde_json::to_value(table).map_err(|err| err.to_string())?;
        Self::from_value(&value, default_timeout)?.ok_or_else(|| "empty judge".to_owned())
    }
}

/// What the judge is told besides the criterion.
#[derive(Debug, Default)]
pub(crate) struct JudgeContext<'a> {
    pub(crate) task_id: &'a str,
    pub(crate) title: &'a str,
    pub(crate) description: &'a str,
    pub(crate) commit: &'a str,
    pub(crate) changed: &'a [String],
    pub(crate) checks: &'a [CheckResult],
}

#[derive(Debug, Deserialize)]
struct Answer {
    verdict: String,
    #[serde(default)]
    evidence: Vec<Cited>,
    #[serde(default)]
    reason: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Cited {
    File {
        file: String,
        line: u64,
        #[serde(default)]
        end_line: Option<u64>,
    },
    Command {
        command: String,
        output: String,
    },
}

const ANSWER_FORMAT: &str = "one JSON object: {\"verdict\": \"pass\"|\"fail\", \"evidence\": [{\"file\": \"<repo-relative path>\", \"line\": <1-based>, \"end_line\": <optional>} or {\"command\": \"<command that was run>\", \"output\": \"<text it printed, quoted exactly>\"}], \"reason\": \"...\"}; a verdict without evidence that exists is not accepted";

/// The prompt for an agent backend: the criterion, the context and the answer contract.
fn agent_prompt(criterion: &str, worktree: &Path, context: &JudgeContext<'_>) -> String {
    let mut prompt = format!(
        "You are a judge. MODE: analysis (read only: change nothing).\n\
         Decide whether this acceptance criterion holds for the code in the working directory \
         {} (commit {}):\n\nCRITERION: {criterion}\n\nTask {}: {}\n{}\n",
        worktree.display(),
        context.commit,
        context.task_id,
        context.title,
        context.description
    );
    if !context.changed.is_empty() {
        prompt.push_str(&format!(
            "\nFiles changed: {}\n",
            context.changed.join(", ")
        ));
    }
    if !context.checks.is_empty() {
        prompt.push_str("\nChecks already run:\n");
        for c in context.checks {
            prompt.push_str(&format!(
                "- {} [{}]: {}\n",
                c.name,
                troupe_proto::names::name(c.status()),
                troupe_process::tail(&c.evidence, 5, 600).replace('\n', "\n  ")
            ));
        }
    }
    prompt.push_str(&format!(
        "\nRead the files you need. End with {ANSWER_FORMAT}. Your final message must be only that JSON object.\n"
    ));
    prompt
}

/// Asks `judge` about `criterion` in `worktree`; never passes without existing evidence.
pub(crate) async fn ask(
    judge: &JudgeConfig,
    criterion: &str,
    worktree: &Path,
    scratch: &Path,
    context: &JudgeContext<'_>,
    sandbox: &troupe_process::Sandbox,
    cancel: &CancellationToken,
) -> (CheckStatus, String) {
    let who = judge.who();
    let Some(backend) = troupe_backends::by_name_with(
        &judge.backend,
        &troupe_backends::BackendsConfig {
            backends: BTreeMap::from([(judge.backend.clone(), judge.settings.clone())]),
            ..troupe_backends::BackendsConfig::default()
        },
    ) else {
        return (
            CheckStatus::Error,
            format!("judge backend `{}` is unknown", judge.backend),
        );
    };
    let prompt = if judge.backend == "command" {
        json!({
            "criterion": criterion,
            "task": {"id": context.task_id, "title": context.title, "description": context.description},
            "commit": context.commit,
            "worktree": worktree.display().to_string(),
            "files_changed": context.changed,
            "checks": context.checks.iter().map(|c| json!({
                "name": c.name, "status": troupe_proto::names::name(c.status()), "evidence": troupe_process::tail(&c.evidence, 10, 1500),
            })).collect::<Vec<_>>(),
            "answer_format": format!("on stdout, {ANSWER_FORMAT}"),
        })
        .to_string()
    } else {
        agent_prompt(criterion, worktree, context)
    };
    let run_dir = scratch.join(format!("judge-{}", uuid::Uuid::new_v4().simple()));
    let prompt_file = run_dir.join("prompt.txt");
    let written = async {
        tokio::fs::create_dir_all(&run_dir).await?;
        tokio::fs::write(&prompt_file, &prompt).await
    };
    if let Err(err) = written.await {
        return (
            CheckStatus::Error,
            format!("judge `{who}` not asked: cannot write its prompt file: {err}"),
        );
    }
    let spec = RunSpec {
        worktree: worktree.to_path_buf(),
        prompt,
        prompt_file,
        placeholders: BTreeMap::from([("task_id".to_owned(), context.task_id.to_owned())]),
        command: judge.command.clone(),
        timeout: Some(judge.timeout),
        idle_timeout: judge.settings.idle_timeout(),
        // A confined judge needs a home it may write (the service's is out of its reach).
        home: (judge.backend != "command" || sandbox.mode() != troupe_process::SandboxMode::Off)
            .then(|| run_dir.join("home")),
        read_only: true,
        sandbox: sandbox.clone(),
        ..RunSpec::default()
    };
    let outcome = backend.run(spec, cancel).await;
    // Best effort: the scratch directory is the validator's own.
    let _ = tokio::fs::remove_dir_all(&run_dir).await;
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(err) => {
            return (
                CheckStatus::Error,
                format!(
                    "judge `{who}` could not give a verdict: {err}\n{}",
                    err.details().join("\n")
                )
                .trim_end()
                .to_owned(),
            );
        }
    };
    judge_outcome(&who, &outcome, worktree, context.checks)
}

/// Turns what the judge said into a status: only an answer whose every citation holds is a
/// verdict.
fn judge_outcome(
    who: &str,
    outcome: &RunOutcome,
    worktree: &Path,
    checks: &[CheckResult],
) -> (CheckStatus, String) {
    let answer =
        parse_answer(&outcome.final_message).or_else(|| parse_answer(&outcome.stdout_tail));
    let Some(answer) = answer else {
        let said = if outcome.final_message.trim().is_empty() {
            outcome.output_tail()
        } else {
            outcome.final_message.clone()
        };
        return (
            CheckStatus::ManualReview,
            format!(
                "judge `{who}` did not answer the JSON contract ({{\"verdict\", \"evidence\"}}); it said:\n{}",
                troupe_process::tail(&said, 10, 1500)
            ),
        );
    };
    let status = match answer.verdict.as_str() {
        "pass" => CheckStatus::Pass,
        "fail" => CheckStatus::Fail,
        other => {
            return (
                CheckStatus::ManualReview,
                format!("judge `{who}` answered verdict {other:?}, not \"pass\" or \"fail\""),
            );
        }
    };
    if answer.evidence.is_empty() {
        return (
            CheckStatus::ManualReview,
            format!(
                "judge `{who}` said {} but cited no evidence, so it is not accepted",
                answer.verdict
            ),
        );
    }
    let seen = Seen::new(outcome, checks);
    let mut cited = Vec::new();
    for item in &answer.evidence {
        match check_cited(item, worktree, &seen) {
            Ok(text) => cited.push(text),
            Err(problem) => {
                return (
                    CheckStatus::ManualReview,
                    format!(
                        "judge `{who}` said {} but its evidence does not hold: {problem}",
                        answer.verdict
                    ),
                );
            }
        }
    }
    let reason = answer
        .reason
        .filter(|r| !r.trim().is_empty())
        .map(|r| format!("\nreason: {}", r.trim()))
        .unwrap_or_default();
    (
        status,
        format!(
            "judged (not a typed check) by `{who}`: {}\n{}{reason}",
            answer.verdict,
            cited.join("\n")
        ),
    )
}

/// Text the judge saw or produced besides its answer: the checks' evidence, and its own
/// transcript (every string inside its JSON-lines output, so tool output quoted in JSON is
/// found unescaped). Anything that holds the answer itself is left out, so an answer cannot
/// vouch for its own quotes.
#[derive(Debug)]
struct Seen {
    texts: Vec<String>,
}

impl Seen {
    fn new(outcome: &RunOutcome, checks: &[CheckResult]) -> Self {
        let mut texts: Vec<String> = checks.iter().map(|c| c.evidence.clone()).collect();
        for stream in [&outcome.stdout_tail, &outcome.stderr_tail] {
            // A line that carries the answer (raw, or quoted inside a JSON event) is no
            // evidence for it.
            for line in stream.lines().filter(|l| !l.contains("verdict")) {
                match serde_json::from_str::<Value>(line.trim()) {
                    Ok(value) => collect_strings(&value, &mut texts),
                    Err(_) => texts.push(line.to_owned()),
                }
            }
        }
        texts.retain(|t| !t.contains("\"verdict\"") && !t.trim().is_empty());
        Self { texts }
    }

    /// Whether every non-empty line of `output` appears in one text.
    fn contains(&self, output: &str) -> bool {
        let lines: Vec<&str> = output
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        !lines.is_empty()
            && self
                .texts
                .iter()
                .any(|text| lines.iter().all(|l| text.contains(l)))
    }
}

fn collect_strings(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::String(s) => out.push(s.clone()),
        Value::Array(items) => items.iter().for_each(|v| collect_strings(v, out)),
        Value::Object(map) => map.values().for_each(|v| collect_strings(v, out)),
        _ => {}
    }
}

/// The answer object: the whole text (code fences allowed), its last line that is a JSON
/// object, or the span from its first `{` to its last `}`.
fn parse_answer(text: &str) -> Option<Answer> {
    let trimmed = text.trim();
    let unfenced = trimmed
        .strip_prefix("```json")
        .or_else(|| trimmed.strip_prefix("```"))
        .and_then(|t| t.trim_end().strip_suffix("```"))
        .unwrap_or(trimmed)
        .trim();
    if let Ok(answer) = serde_json::from_str::<Answer>(unfenced) {
        return Some(answer);
    }
    let by_line = text
        .lines()
        .rev()
        .map(str::trim)
        .filter(|l| l.starts_with('{'))
        .find_map(|l| serde_json::from_str::<Answer>(l).ok());
    by_line.or_else(|| {
        let (start, end) = (text.find('{')?, text.rfind('}')?);
        (start < end)
            .then(|| serde_json::from_str::<Answer>(&text[start..=end]).ok())
            .flatten()
    })
}

fn check_cited(item: &Cited, worktree: &Path, seen: &Seen) -> Result<String, String> {
    match item {
        Cited::File {
            file,
            line,
            end_line,
        } => {
            let path = file.trim_start_matches("./");
            if !confined(path) {
                return Err(format!("{file:?} is outside the repository"));
            }
            let full: PathBuf = worktree.join(path);
            let text = std::fs::read_to_string(&full)
                .map_err(|_| format!("{path}:{line} does not exist at the checked commit"))?;
            let lines: Vec<&str> = text.lines().collect();
            let count = lines.len();
            let first = usize::try_from(*line).unwrap_or(usize::MAX);
            let last = end_line.map_or(first, |e| usize::try_from(e).unwrap_or(usize::MAX));
            let place = if last == first {
                format!("{path}:{line}")
            } else {
                format!("{path}:{line}-{last}")
            };
            if first == 0 || last < first || last > count {
                return Err(format!("{place} does not exist ({path} has {count} lines)"));
            }
            let content = lines[first - 1..last]
                .iter()
                .map(|l| l.trim())
                .collect::<Vec<_>>()
                .join(" | ");
            Ok(format!("cites {place}: {}", truncate(&content, 200)))
        }
        Cited::Command { command, output } => {
            if command.trim().is_empty() || output.trim().is_empty() {
                return Err("a cited command needs both `command` and `output`".to_owned());
            }
            if !seen.contains(output) {
                return Err(format!(
                    "the output it quotes for `{}` ({:?}) appears neither in the checks that ran nor in the judge's own transcript",
                    command.trim(),
                    truncate(output.trim(), 120)
                ));
            }
            Ok(format!(
                "cites `{}` -> {}",
                command.trim(),
                truncate(output.trim(), 300)
            ))
        }
    }
}

fn truncate(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_owned()
    } else {
        let cut: String = text.chars().take(max).collect();
        format!("{cut}...")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A judge as a plan or a request names it, typed by `troupe-plan`.
    fn requested(value: Value) -> Result<JudgeSpec, String> {
        JudgeSpec::from_value(&value)
            .map_err(|err| err.to_string())
            .map(|judge| judge.expect("a judge"))
    }

    /// The attack of issue 19: a plan's judge sending one of the validator's variables as a
    /// bearer token to the plan's URL.
    #[test]
    fn a_plan_cannot_choose_where_the_judge_connects_or_what_it_is_given() {
        for key in [
            "endpoint",
            "api_key",
            "api_key_env",
            "env_allow",
            "env",
            "command",
            "allow_commands",
        ] {
            let mut spec = json!({"backend": "agent", "model": "m"});
            spec[key] = json!("SECRET_DB_PASSWORD");
            let err = requested(spec).expect_err(key);
            assert!(
                err.contains(&format!("`judge_spec.{key}` is not a judge setting a plan may give: where a judge connects")),
                "{err}"
            );
        }
        let err = requested(json!({"backend": "agent", "modle": "m"})).expect_err("unknown key");
        assert!(
            err.contains("`judge_spec.modle` is not a judge setting"),
            "{err}"
        );
    }

    #[test]
    fn a_plan_picks_backend_and_model_and_the_configuration_supplies_the_rest() {
        let timeout = Duration::from_secs(60);
        let configured = JudgeConfig::from_value(
            &json!({"backend": "agent", "model": "configured", "endpoint": "http://model/v1",
                    "api_key_env": "JUDGE_KEY", "timeout_seconds": 30}),
            timeout,
        )
        .expect("valid")
        .expect("a judge");
        let spec = requested(json!({"backend": "agent", "model": "chosen", "max_turns": 3}))
            .expect("valid");
        let chosen = JudgeConfig::from_spec(&spec, timeout, Some(&configured));
        assert_eq!(chosen.settings.model.as_deref(), Some("chosen"));
        assert_eq!(chosen.settings.endpoint.as_deref(), Some("http://model/v1"));
        assert_eq!(chosen.settings.api_key_env.as_deref(), Some("JUDGE_KEY"));
        assert_eq!(chosen.settings.max_turns, Some(3));
        assert_eq!(chosen.timeout, Duration::from_secs(30));
        // Another backend than the configured one gets that backend's defaults only.
        let codex = requested(json!({"backend": "codex"})).expect("valid");
        let other = JudgeConfig::from_spec(&codex, timeout, Some(&configured));
        assert_eq!(other.settings, BackendConfig::default());
        // A command judge is an argv, as before.
        let argv = requested(json!(["python3", "judge.py"])).expect("valid");
        let command = JudgeConfig::from_spec(&argv, timeout, None);
        assert_eq!(command.backend, "command");
        assert_eq!(command.command, ["python3", "judge.py"]);
        assert_eq!(command.timeout, timeout);
    }

    #[test]
    fn answers_parse_from_the_last_json_line_or_a_fenced_block() {
        let a = parse_answer(
            "thinking...\n{\"verdict\":\"pass\",\"evidence\":[{\"file\":\"a.py\",\"line\":1}]}",
        )
        .expect("answer");
        assert_eq!(a.verdict, "pass");
        assert!(
            matches!(&a.evidence[0], Cited::File { file, line: 1, end_line: None } if file == "a.py")
        );
        let fenced = parse_answer(
            "```json\n{\"verdict\": \"fail\",\n \"evidence\": [{\"file\": \"a.py\", \"line\": 2, \"end_line\": 4}]}\n```",
        )
        .expect("fenced");
        assert!(matches!(
            &fenced.evidence[0],
            Cited::File {
                end_line: Some(4),
                ..
            }
        ));
        assert!(parse_answer("yes, it passes").is_none());
    }

    #[test]
    fn judge_config_from_spec() {
        let d = Duration::from_secs(60);
        assert_eq!(JudgeConfig::from_value(&Value::Null, d), Ok(None));
        let j = JudgeConfig::from_value(
            &json!({"command": ["python3", "j.py"], "timeout_seconds": 5}),
            d,
        )
        .expect("ok")
        .expect("some");
        assert_eq!(j.backend, "command");
        assert_eq!(j.command, ["python3", "j.py"]);
        assert_eq!(j.timeout, Duration::from_secs(5));
        assert_eq!(
            JudgeConfig::from_value(&json!("judge --strict"), d)
                .expect("ok")
                .expect("some")
                .command,
            ["judge", "--strict"]
        );
        assert!(JudgeConfig::from_value(&json!(42), d).is_err());

        let codex = JudgeConfig::from_value(
            &json!({"backend": "codex", "model": "gpt-5.5", "endpoint": "http://x/v1",
                    "env_allow": ["HTTPS_PROXY"], "api_key_env": "K", "timeout_seconds": 90}),
            d,
        )
        .expect("ok")
        .expect("some");
        assert_eq!(codex.backend, "codex");
        assert_eq!(codex.settings.model.as_deref(), Some("gpt-5.5"));
        assert_eq!(codex.settings.env_allow, ["HTTPS_PROXY"]);
        assert_eq!(codex.timeout, Duration::from_secs(90));
        assert_eq!(codex.who(), "codex (gpt-5.5)");
        let err = JudgeConfig::from_value(&json!({"backend": "codex", "modle": "x"}), d)
            .expect_err("typo");
        assert!(err.contains("modle"), "{err}");
        let err = JudgeConfig::from_value(&json!({"backend": "nope"}), d).expect_err("unknown");
        assert!(err.contains("unknown judge backend `nope`"), "{err}");
        let err = JudgeConfig::from_value(&json!({"command": ["j"], "model": "m"}), d)
            .expect_err("command takes no model");
        assert!(err.contains("`model`"), "{err}");

        let file = JudgeConfig::from_toml(
            "backend = \"agent\"\nmodel = \"m\"\nendpoint = \"http://x/v1\"\ntimeout_seconds = 7\n",
            d,
        )
        .expect("toml");
        assert_eq!(file.backend, "agent");
        assert_eq!(file.timeout, Duration::from_secs(7));
        let file = JudgeConfig::from_toml("command = [\"python3\", \"j.py\"]\n", d).expect("toml");
        assert_eq!(file.command, ["python3", "j.py"]);
    }

    fn outcome(stdout: &str, final_message: &str) -> RunOutcome {
        RunOutcome {
            argv: Vec::new(),
            exit_code: 0,
            stdout_tail: stdout.to_owned(),
            stderr_tail: String::new(),
            duration: Duration::ZERO,
            native_session_id: None,
            usage: None,
            model: None,
            final_message: final_message.to_owned(),
            tool_calls: Vec::new(),
            events: Vec::new(),
        }
    }

    #[test]
    fn quoted_output_must_have_been_seen_outside_the_answer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let answer =
            r#"{"verdict": "pass", "evidence": [{"command": "pytest -q", "output": "3 passed"}]}"#;
        // Only the answer mentions "3 passed": not evidence.
        let (status, evidence) = judge_outcome("j", &outcome(answer, ""), dir.path(), &[]);
        assert_eq!(status, CheckStatus::ManualReview, "{evidence}");
        assert!(evidence.contains("appears neither"), "{evidence}");
        // The judge's transcript (a JSON-lines tool result) shows it.
        let transcript = format!(
            "{}\n{answer}",
            json!({"type": "item.completed", "item": {"aggregated_output": "....\n3 passed in 0.1s\n"}})
        );
        let (status, evidence) = judge_outcome("j", &outcome(&transcript, answer), dir.path(), &[]);
        assert_eq!(status, CheckStatus::Pass, "{evidence}");
        // A check that already ran shows it.
        let check = CheckResult {
            evidence: "exit 0\n3 passed".to_owned(),
            ..CheckResult::default()
        };
        let (status, _) = judge_outcome("j", &outcome(answer, answer), dir.path(), &[check]);
        assert_eq!(status, CheckStatus::Pass);
    }
}
