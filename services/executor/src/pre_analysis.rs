//! `pre_analysis[]` (ccw-reference §1.B.4, §2.1): context-gathering steps run in the task's
//! worktree before the agent, whose outputs fill `[placeholders]` in later steps and in the
//! handoff prompt.
//!
//! Each step is `{step, action, commands[] | command, output_to, on_error, timeout_seconds}`.
//! A command string names a tool: `Read(path)`, `bash(cmd)`, `Search(pattern,path)`,
//! `Glob(pattern)`; a string without a tool is `bash`; an argv array runs as is. `mcp__*` tools
//! are not available outside Claude Code and fail the step. Paths are confined to the worktree.
//! `bash` never interpolates text into a shell: a command without shell syntax is split into
//! argv and placeholders fill whole elements; one with shell syntax runs verbatim under
//! `sh -c` and may not use placeholders.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use tokio_util::sync::CancellationToken;
use troupe_plan::spec::{OnError, PreAnalysisStep};

/// How a step ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StepReport {
    pub(crate) step: String,
    pub(crate) output_to: Option<String>,
    /// `ok`, `continued after error` or `skipped after error`.
    pub(crate) status: &'static str,
    pub(crate) output: String,
}

/// Outputs of every step, by `output_to`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PreAnalysis {
    pub(crate) vars: BTreeMap<String, String>,
    pub(crate) steps: Vec<StepReport>,
}

/// Characters kept of one step's output (the agent can read files itself).
const OUTPUT_CHARS: usize = 8000;
/// Matches kept by `Search` and `Glob`.
const MAX_MATCHES: usize = 200;
const DEFAULT_STEP_TIMEOUT: Duration = Duration::from_secs(120);

/// Replaces `[name]` with the value of every known variable.
pub(crate) fn fill(text: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = text.to_owned();
    for (name, value) in vars {
        out = out.replace(&format!("[{name}]"), value);
    }
    out
}

fn clip(text: &str) -> String {
    if text.chars().count() <= OUTPUT_CHARS {
        text.to_owned()
    } else {
        let kept: String = text.chars().take(OUTPUT_CHARS).collect();
        format!("{kept}\n... (truncated)")
    }
}

/// `Tool(args)` → (tool, args); a bare string is `bash`.
fn split_tool(command: &str) -> (&str, &str) {
    let trimmed = command.trim();
    if let Some(open) = trimmed.find('(')
        && trimmed.ends_with(')')
    {
        let tool = &trimmed[..open];
        if !tool.is_empty() && tool.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return (tool, &trimmed[open + 1..trimmed.len() - 1]);
        }
    }
    ("bash", trimmed)
}

/// Runs the steps in order in `worktree`. `Err` is the message of a step whose `on_error` is
/// `fail`.
pub(crate) async fn run(
    steps: &[PreAnalysisStep],
    worktree: &Path,
    sandbox: &troupe_process::Sandbox,
    cancel: &CancellationToken,
) -> Result<PreAnalysis, String> {
    let root = worktree
        .canonicalize()
        .map_err(|err| format!("cannot resolve the worktree: {err}"))?;
    let mut result = PreAnalysis::default();
    for step in steps {
        let mut outputs = Vec::new();
        let mut error = None;
        for command in &step.commands {
            let timeout = step.timeout.unwrap_or(DEFAULT_STEP_TIMEOUT);
            match run_command(command, &root, &result.vars, timeout, sandbox, cancel).await {
                Ok(output) => outputs.push(output),
                Err(err) => {
                    error = Some(err);
                    break;
                }
            }
        }
        let (status, output) = match (error, step.on_error) {
            (None, _) => ("ok", outputs.join("\n")),
            (Some(err), OnError::Fail) => {
                return Err(format!("pre_analysis step `{}` failed: {err}", step.name));
            }
            (Some(err), OnError::Continue) => {
                outputs.push(format!("[error] {err}"));
                ("continued after error", outputs.join("\n"))
            }
            (Some(err), OnError::Skip) => {
                tracing::info!(step = %step.name, error = %err, "pre_analysis step skipped");
                ("skipped after error", String::new())
            }
        };
        let output = clip(&output);
        if let Some(var) = &step.output_to {
            result.vars.insert(var.clone(), output.clone());
        }
        result.steps.push(StepReport {
            step: step.name.clone(),
            output_to: step.output_to.clone(),
            status,
            output,
        });
    }
    Ok(result)
}

async fn run_command(
    command: &Value,
    root: &Path,
    vars: &BTreeMap<String, String>,
    timeout: Duration,
    sandbox: &troupe_process::Sandbox,
    cancel: &CancellationToken,
) -> Result<String, String> {
    match command {
        Value::Array(items) => {
            let argv: Option<Vec<String>> = items
                .iter()
                .map(|v| v.as_str().map(|s| fill(s, vars)))
                .collect();
            let argv = argv.ok_or("an argv command must hold only strings")?;
            run_argv(&argv, root, timeout, sandbox, cancel).await
        }
        Value::String(line) => {
            let (tool, args) = split_tool(line);
            match tool {
                "Read" => {
                    let path = confined(root, &fill(args.trim(), vars))?;
                    let text = tokio::fs::read_to_string(&path)
                        .await
                        .map_err(|err| format!("cannot read {}: {err}", args.trim()))?;
                    Ok(text)
                }
                "Glob" => {
                    let pattern = fill(args.trim(), vars);
                    let re = glob_regex(&pattern)?;
                    let root = root.to_path_buf();
                    let found = tokio::task::spawn_blocking(move || {
                        let mut out = Vec::new();
                        walk(&root, &root, &mut |relative, _| {
                            if re.is_match(relative) {
                                out.push(relative.to_owned());
                            }
                            out.len() < MAX_MATCHES
                        });
                        out
                    })
                    .await
                    .map_err(|err| format!("glob failed: {err}"))?;
                    if found.is_empty() {
                        Err(format!("no file matches {pattern}"))
                    } else {
                        Ok(found.join("\n"))
                    }
                }
                "Search" => {
                    let (pattern, path) = match args.rsplit_once(',') {
                        Some((pattern, path)) if !path.trim().contains(' ') => {
                            (pattern, path.trim())
                        }
                        _ => (args, "."),
                    };
                    let re = regex::Regex::new(&fill(pattern, vars))
                        .map_err(|err| format!("bad search pattern: {err}"))?;
                    let base = confined(root, &fill(path, vars))?;
                    let root = root.to_path_buf();
                    let found = tokio::task::spawn_blocking(move || search(&root, &base, &re))
                        .await
                        .map_err(|err| format!("search failed: {err}"))?;
                    if found.is_empty() {
                        Err(format!("no match for {}", pattern.trim()))
                    } else {
                        Ok(found.join("\n"))
                    }
                }
                "bash" | "Bash" => {
                    let argv = bash_argv(args, vars)?;
                    run_argv(&argv, root, timeout, sandbox, cancel).await
                }
                other if other.starts_with("mcp__") => Err(format!(
                    "MCP tool `{other}` is not available to troupe's executor"
                )),
                other => Err(format!(
                    "unknown pre_analysis tool `{other}` (use Read, bash, Search or Glob)"
                )),
            }
        }
        _ => Err("a command must be a string or an argv array".to_owned()),
    }
}

fn confined(root: &Path, path: &str) -> Result<PathBuf, String> {
    troupe_backends::confine(root, if path.is_empty() { "." } else { path })
}

/// A bash step as argv: placeholders fill whole argv elements of a plain command; a command
/// with shell syntax runs verbatim and may not use placeholders.
fn bash_argv(line: &str, vars: &BTreeMap<String, String>) -> Result<Vec<String>, String> {
    // Stand-ins that no shell word splitting touches, so `[var]` is not taken for a glob.
    let mut marked = line.to_owned();
    let mut used = Vec::new();
    for (i, name) in vars.keys().enumerate() {
        let token = format!("\u{1}{i}\u{1}");
        let placeholder = format!("[{name}]");
        if marked.contains(&placeholder) {
            marked = marked.replace(&placeholder, &token);
            used.push((token, name));
        }
    }
    let argv = troupe_process::command_line_to_argv(&marked).map_err(|err| err.to_string())?;
    if argv.len() == 3 && argv[0] == "sh" && argv[1] == "-c" && argv[2] == marked && line != "sh" {
        if !used.is_empty() {
            return Err(
                "a bash step with shell syntax cannot use [placeholders] (troupe never interpolates into a shell); write it without shell syntax"
                    .to_owned(),
            );
        }
        return Ok(vec!["sh".to_owned(), "-c".to_owned(), line.to_owned()]);
    }
    Ok(argv
        .into_iter()
        .map(|mut arg| {
            for (token, name) in &used {
                arg = arg.replace(token.as_str(), &vars[*name]);
            }
            arg
        })
        .collect())
}

async fn run_argv(
    argv: &[String],
    root: &Path,
    timeout: Duration,
    sandbox: &troupe_process::Sandbox,
    cancel: &CancellationToken,
) -> Result<String, String> {
    let command = troupe_process::Command::from_argv(argv)
        .map_err(|err| err.to_string())?
        .sandbox(sandbox.clone())
        .cwd(root)
        .timeout(timeout)
        .max_output_bytes(256 * 1024);
    let output = command.run(cancel).await.map_err(|err| err.to_string())?;
    match output.termination {
        troupe_process::Termination::Exited if output.success() => Ok(output.stdout_text()),
        troupe_process::Termination::Exited => Err(format!(
            "`{}` exited with {}: {}",
            argv.join(" "),
            output
                .exit_code
                .map_or_else(|| "a signal".to_owned(), |c| c.to_string()),
            troupe_process::tail(&output.stderr_text(), 10, 2000).trim()
        )),
        troupe_process::Termination::TimedOut | troupe_process::Termination::IdleTimedOut => {
            Err(format!(
                "`{}` timed out after {} s",
                argv.join(" "),
                timeout.as_secs()
            ))
        }
        troupe_process::Termination::Cancelled => Err("cancelled".to_owned()),
    }
}

/// Glob → anchored regex over `/`-separated relative paths (`**` crosses directories).
fn glob_regex(pattern: &str) -> Result<regex::Regex, String> {
    let pattern = pattern.trim().trim_start_matches("./");
    if pattern.starts_with('/') || pattern.split('/').any(|part| part == "..") {
        return Err(format!("glob {pattern} leaves the worktree"));
    }
    let mut re = String::from("^");
    let mut chars = pattern.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '*' if chars.peek() == Some(&'*') => {
                chars.next();
                if chars.peek() == Some(&'/') {
                    chars.next();
                    re.push_str("(?:.*/)?");
                } else {
                    re.push_str(".*");
                }
            }
            '*' => re.push_str("[^/]*"),
            '?' => re.push_str("[^/]"),
            other => re.push_str(&regex::escape(&other.to_string())),
        }
    }
    re.push('$');
    regex::Regex::new(&re).map_err(|err| format!("bad glob {pattern}: {err}"))
}

/// Visits files under `dir` (sorted, `.git` and symlinks left out) until `visit` says stop.
fn walk(root: &Path, dir: &Path, visit: &mut dyn FnMut(&str, &Path) -> bool) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return true;
    };
    let mut entries: Vec<_> = entries.flatten().collect();
    entries.sort_by_key(std::fs::DirEntry::file_name);
    for entry in entries {
        if entry.file_name() == ".git" {
            continue;
        }
        let path = entry.path();
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_dir() {
            if !walk(root, &path, visit) {
                return false;
            }
        } else if kind.is_file() {
            let relative = path.strip_prefix(root).unwrap_or(&path).to_string_lossy();
            if !visit(&relative, &path) {
                return false;
            }
        }
    }
    true
}

fn search(root: &Path, base: &Path, re: &regex::Regex) -> Vec<String> {
    let mut out = Vec::new();
    let mut scan = |relative: &str, path: &Path| {
        if let Ok(text) = std::fs::read_to_string(path) {
            for (i, line) in text.lines().enumerate() {
                if re.is_match(line) {
                    out.push(format!("{relative}:{}: {line}", i + 1));
                    if out.len() >= MAX_MATCHES {
                        return false;
                    }
                }
            }
        }
        true
    };
    if base.is_file() {
        let relative = base.strip_prefix(root).unwrap_or(base).to_string_lossy();
        scan(&relative, base);
    } else {
        walk(root, base, &mut scan);
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// The steps of a `pre_analysis` block, read as the executor reads a claimed task.
    fn steps(value: serde_json::Value) -> Vec<PreAnalysisStep> {
        troupe_plan::TaskSpec::from_object(
            json!({"id": "IMPL-1", "pre_analysis": value})
                .as_object()
                .expect("object"),
            None,
        )
        .expect("valid steps")
        .blocks
        .pre_analysis
    }

    fn worktree() -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("src/auth")).expect("mkdir");
        std::fs::write(
            dir.path().join("src/auth/token.py"),
            "class TokenRepo:\n    pass\n",
        )
        .expect("write");
        std::fs::write(
            dir.path().join("src/users.py"),
            "class UserRepo:\n    pass\n",
        )
        .expect("write");
        dir
    }

    #[tokio::test]
    async fn steps_fill_placeholders_in_later_steps() {
        let dir = worktree();
        let block = json!([
            {"step": "find", "commands": ["Glob(src/**/*.py)"], "output_to": "py_files"},
            {"step": "read", "command": "Read(src/auth/token.py)", "output_to": "token"},
            {"step": "grep", "commands": ["Search(class .*Repo,src)"], "output_to": "repos"},
            {"step": "first", "command": "bash(head -n 1 src/users.py)", "output_to": "first_line"},
            {"step": "echo", "command": ["echo", "seen: [first_line]"], "output_to": "echoed"},
            {"step": "shell", "command": "bash(ls src | wc -l)", "output_to": "count"},
        ]);
        let out = run(
            &steps(block),
            dir.path(),
            &troupe_process::Sandbox::off(),
            &CancellationToken::new(),
        )
        .await
        .expect("runs");
        assert_eq!(out.vars["py_files"], "src/auth/token.py\nsrc/users.py");
        assert!(out.vars["token"].starts_with("class TokenRepo:"));
        assert_eq!(
            out.vars["repos"],
            "src/auth/token.py:1: class TokenRepo:\nsrc/users.py:1: class UserRepo:"
        );
        assert_eq!(out.vars["first_line"], "class UserRepo:\n");
        assert_eq!(out.vars["echoed"], "seen: class UserRepo:\n\n");
        assert_eq!(out.vars["count"].trim(), "2");
        assert_eq!(
            fill("use [token] and [unknown]", &out.vars),
            format!("use {} and [unknown]", out.vars["token"])
        );
    }

    #[tokio::test]
    async fn on_error_fail_continue_and_skip() {
        let dir = worktree();
        let cancel = CancellationToken::new();
        let failing = |on_error: &str| json!([{"step": "missing", "command": "Read(nope.txt)", "output_to": "x", "on_error": on_error}]);
        let err = run(
            &steps(failing("fail")),
            dir.path(),
            &troupe_process::Sandbox::off(),
            &cancel,
        )
        .await
        .expect_err("fails");
        assert!(
            err.contains("step `missing` failed: cannot read nope.txt"),
            "{err}"
        );
        let cont = run(
            &steps(failing("continue")),
            dir.path(),
            &troupe_process::Sandbox::off(),
            &cancel,
        )
        .await
        .expect("continues");
        assert!(cont.vars["x"].starts_with("[error] cannot read nope.txt"));
        assert_eq!(cont.steps[0].status, "continued after error");
        let skip = run(
            &steps(failing("skip_optional")),
            dir.path(),
            &troupe_process::Sandbox::off(),
            &cancel,
        )
        .await
        .expect("skips");
        assert_eq!(skip.vars["x"], "");

        let bad = json!([{"step": "s", "command": "bash(python3 -c 'raise SystemExit(4)')", "on_error": "fail"}]);
        let err = run(
            &steps(bad),
            dir.path(),
            &troupe_process::Sandbox::off(),
            &cancel,
        )
        .await
        .expect_err("exit 4");
        assert!(err.contains("exited with 4"), "{err}");
        let mcp = json!([{"step": "m", "command": "mcp__ace__search(x)"}]);
        let err = run(
            &steps(mcp),
            dir.path(),
            &troupe_process::Sandbox::off(),
            &cancel,
        )
        .await
        .expect_err("mcp");
        assert!(err.contains("not available"), "{err}");
        let refused = troupe_plan::TaskSpec::from_object(
            json!({"id": "IMPL-1", "pre_analysis": [{"step": "s", "command": "Read(a)", "on_error": "maybe"}]})
                .as_object()
                .expect("object"),
            None,
        );
        assert!(refused.is_err());
    }

    #[tokio::test]
    async fn paths_and_shells_are_confined() {
        let dir = worktree();
        let cancel = CancellationToken::new();
        for command in [
            "Read(../secret)",
            "Read(/etc/passwd)",
            "Glob(../*)",
            "Search(x,../)",
        ] {
            let block = json!([{"step": "s", "command": command}]);
            let err = run(
                &steps(block),
                dir.path(),
                &troupe_process::Sandbox::off(),
                &cancel,
            )
            .await
            .expect_err(command);
            assert!(
                err.contains("outside") || err.contains("escapes") || err.contains("leaves"),
                "{command}: {err}"
            );
        }
        // A placeholder never reaches a shell: its value is one argv element.
        let vars = BTreeMap::from([("v".to_owned(), "$(touch pwned); x".to_owned())]);
        assert_eq!(
            bash_argv("echo [v]", &vars).expect("argv"),
            ["echo", "$(touch pwned); x"]
        );
        assert!(bash_argv("echo [v] | wc -c", &vars).is_err());
        assert_eq!(
            bash_argv("ls src | wc -l", &vars).expect("verbatim"),
            ["sh", "-c", "ls src | wc -l"]
        );
    }
}
