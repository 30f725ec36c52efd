//! The judge for free-text criteria: a configured `command` backend (troupe-backends) that
//! reads the criterion and the evidence gathered so far as JSON on stdin and answers JSON:
//!
//! ```json
//! {"verdict": "pass" | "fail",
//!  "evidence": [{"file": "src/a.py", "line": 3} | {"command": "pytest -q", "output": "3 passed"}],
//!  "reason": "optional one-liner"}
//! ```
//!
//! An answer that is not that JSON, cites no evidence, or cites a file:line that does not exist
//! in the checked commit is not a verdict: the criterion comes out MANUAL_REVIEW with the
//! reason. So does a judge that crashes or times out. A judged PASS is labelled as judged.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use troupe_backends::{Backend, CommandBackend, RunSpec};
use troupe_proto::v1::{CheckResult, CheckStatus};

use crate::validate::confined;

/// A configured judge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JudgeConfig {
    /// Argv template (troupe-backends placeholders such as `{worktree}` allowed).
    pub command: Vec<String>,
    /// Wall-clock limit per criterion.
    pub timeout: Duration,
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
    File { file: String, line: u64 },
    Command { command: String, output: String },
}

fn status_name(status: CheckStatus) -> &'static str {
    match status {
        CheckStatus::Pass => "pass",
        CheckStatus::Fail => "fail",
        CheckStatus::ManualReview => "manual_review",
        CheckStatus::Skipped => "skipped",
        CheckStatus::Error => "error",
        CheckStatus::Unspecified => "unspecified",
    }
}

/// Asks `judge` about `criterion` in `worktree`; never passes without existing evidence.
pub(crate) async fn ask(
    judge: &JudgeConfig,
    criterion: &str,
    worktree: &Path,
    scratch: &Path,
    context: &JudgeContext<'_>,
    cancel: &CancellationToken,
) -> (CheckStatus, String) {
    let prompt = json!({
        "criterion": criterion,
        "task": {"id": context.task_id, "title": context.title, "description": context.description},
        "commit": context.commit,
        "worktree": worktree.display().to_string(),
        "files_changed": context.changed,
        "checks": context.checks.iter().map(|c| json!({
            "name": c.name, "status": status_name(c.status()), "evidence": troupe_process::tail(&c.evidence, 10, 1500),
        })).collect::<Vec<_>>(),
        "answer_format": "one JSON object on stdout: {\"verdict\": \"pass\"|\"fail\", \"evidence\": [{\"file\": \"<repo-relative path>\", \"line\": <1-based>} or {\"command\": \"...\", \"output\": \"...\"}], \"reason\": \"...\"}; a verdict without evidence that exists is not accepted",
    })
    .to_string();
    let prompt_file = scratch.join(format!("judge-{}.json", uuid::Uuid::new_v4().simple()));
    if let Err(err) = tokio::fs::write(&prompt_file, &prompt).await {
        return (
            CheckStatus::ManualReview,
            format!("judge not asked: cannot write its prompt file: {err}"),
        );
    }
    let spec = RunSpec {
        worktree: worktree.to_path_buf(),
        prompt,
        prompt_file: prompt_file.clone(),
        placeholders: BTreeMap::from([("task_id".to_owned(), context.task_id.to_owned())]),
        command: judge.command.clone(),
        timeout: Some(judge.timeout),
        ..RunSpec::default()
    };
    let who = judge.command.join(" ");
    let outcome = CommandBackend.run(spec, cancel).await;
    // Best effort: the scratch directory is the validator's own.
    let _ = tokio::fs::remove_file(&prompt_file).await;
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(err) => {
            return (
                CheckStatus::ManualReview,
                format!(
                    "judge `{who}` gave no verdict: {err}\n{}",
                    err.details().join("\n")
                )
                .trim_end()
                .to_owned(),
            );
        }
    };
    let Some(answer) = parse_answer(&outcome.stdout_tail) else {
        return (
            CheckStatus::ManualReview,
            format!(
                "judge `{who}` did not answer the JSON contract ({{\"verdict\", \"evidence\"}}); its output:\n{}",
                troupe_process::tail(&outcome.output_tail(), 10, 1500)
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
    let mut cited = Vec::new();
    for item in &answer.evidence {
        match check_cited(item, worktree) {
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

/// The answer object: the whole stdout, or its last line that is a JSON object.
fn parse_answer(stdout: &str) -> Option<Answer> {
    if let Ok(answer) = serde_json::from_str::<Answer>(stdout.trim()) {
        return Some(answer);
    }
    stdout
        .lines()
        .rev()
        .map(str::trim)
        .filter(|l| l.starts_with('{'))
        .find_map(|l| serde_json::from_str::<Answer>(l).ok())
}

fn check_cited(item: &Cited, worktree: &Path) -> Result<String, String> {
    match item {
        Cited::File { file, line } => {
            let path = file.trim_start_matches("./");
            if !confined(path) {
                return Err(format!("{file:?} is outside the repository"));
            }
            let full: PathBuf = worktree.join(path);
            let text = std::fs::read_to_string(&full)
                .map_err(|_| format!("{path}:{line} does not exist at the checked commit"))?;
            let count = text.lines().count();
            let index = usize::try_from(*line).unwrap_or(usize::MAX);
            if index == 0 || index > count {
                return Err(format!(
                    "{path}:{line} does not exist ({path} has {count} lines)"
                ));
            }
            let content = text.lines().nth(index - 1).unwrap_or("").trim();
            Ok(format!("cites {path}:{line}: {}", truncate(content, 200)))
        }
        Cited::Command { command, output } => {
            if command.trim().is_empty() || output.trim().is_empty() {
                return Err("a cited command needs both `command` and `output`".to_owned());
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

/// A judge from a task spec's `judge` (argv array, command string, or
/// `{"command": [...], "timeout_seconds": N}`).
pub(crate) fn from_spec(
    value: &Value,
    default_timeout: Duration,
) -> Result<Option<JudgeConfig>, String> {
    let (command, timeout) = match value {
        Value::Null => return Ok(None),
        Value::Object(map) => (
            map.get("command").cloned().unwrap_or(Value::Null),
            map.get("timeout_seconds").and_then(Value::as_u64),
        ),
        other => (other.clone(), None),
    };
    let argv = match command {
        Value::String(line) => troupe_process::command_line_to_argv(&line)
            .map_err(|err| format!("judge command: {err}"))?,
        Value::Array(items) => items
            .iter()
            .map(|i| i.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .filter(|a| a.first().is_some_and(|p| !p.is_empty()))
            .ok_or("judge command must be a non-empty array of strings")?,
        _ => {
            return Err(
                "judge must be an argv array, a command string or {\"command\": [...]}".to_owned(),
            );
        }
    };
    Ok(Some(JudgeConfig {
        command: argv,
        timeout: timeout
            .filter(|s| *s > 0)
            .map_or(default_timeout, Duration::from_secs),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_parse_from_the_last_json_line() {
        let a = parse_answer(
            "thinking...\n{\"verdict\":\"pass\",\"evidence\":[{\"file\":\"a.py\",\"line\":1}]}",
        )
        .expect("answer");
        assert_eq!(a.verdict, "pass");
        assert!(matches!(&a.evidence[0], Cited::File { file, line: 1 } if file == "a.py"));
        assert!(parse_answer("yes, it passes").is_none());
    }

    #[test]
    fn judge_config_from_spec() {
        let d = Duration::from_secs(60);
        assert_eq!(from_spec(&Value::Null, d), Ok(None));
        let j = from_spec(
            &json!({"command": ["python3", "j.py"], "timeout_seconds": 5}),
            d,
        )
        .expect("ok")
        .expect("some");
        assert_eq!(j.command, ["python3", "j.py"]);
        assert_eq!(j.timeout, Duration::from_secs(5));
        assert_eq!(
            from_spec(&json!("judge --strict"), d)
                .expect("ok")
                .expect("some")
                .command,
            ["judge", "--strict"]
        );
        assert!(from_spec(&json!(42), d).is_err());
    }
}
