//! Syntax and lint checks on the files a commit range changed, by language:
//! `tsc --noEmit` per tsconfig.json, `node --check`, `python3 -m py_compile`, `cargo check` per
//! Cargo.toml, JSON and TOML parsed in process, YAML through PyYAML; linters only where the
//! repository configures them (an npm `lint` script, ruff or flake8 config, clippy config).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use troupe_proto::v1::{CheckKind, CheckResult, CheckStatus};

use crate::Error;
use crate::tools::{Ran, Tools, judge_exit, locations};
use crate::validate::millis;

/// What syntax and lint checks need.
#[derive(Debug)]
pub(crate) struct SyntaxJob<'a> {
    pub(crate) tools: &'a Tools,
    pub(crate) worktree: &'a Path,
    /// Changed paths (repo-relative); deleted ones are ignored.
    pub(crate) changed: &'a [String],
    pub(crate) timeout: Duration,
    /// Where `cargo check` builds, so repeated checks reuse the build.
    pub(crate) cargo_target: PathBuf,
    pub(crate) cancel: &'a CancellationToken,
}

fn ext(path: &str) -> &str {
    Path::new(path)
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
}

fn result(
    name: String,
    kind: CheckKind,
    subject: String,
    (status, evidence): (CheckStatus, String),
    started: Instant,
) -> CheckResult {
    CheckResult {
        name,
        kind: kind as i32,
        status: status as i32,
        duration_ms: millis(started.elapsed()),
        evidence,
        subject,
        ..Default::default()
    }
}

/// The nearest directory at or above `file`'s (inside `root`) that holds `marker`.
fn nearest(root: &Path, file: &str, marker: &str) -> Option<PathBuf> {
    let mut dir = Path::new(file).parent().map(Path::to_path_buf);
    while let Some(d) = dir {
        if root.join(&d).join(marker).is_file() {
            return Some(d);
        }
        dir = d.parent().map(Path::to_path_buf);
    }
    None
}

/// Where cargo keeps the lockfile of the crate at `crate_dir`: an existing `Cargo.lock` at or
/// above it (inside the worktree), else beside the outermost `Cargo.toml` declaring a
/// `[workspace]`, else beside the crate's own.
fn cargo_lock(worktree: &Path, crate_dir: &Path) -> PathBuf {
    let dirs: Vec<&Path> = crate_dir
        .ancestors()
        .take_while(|dir| dir.starts_with(worktree))
        .collect();
    if let Some(dir) = dirs.iter().find(|dir| dir.join("Cargo.lock").is_file()) {
        return dir.join("Cargo.lock");
    }
    dirs.iter()
        .rev()
        .find(|dir| {
            std::fs::read_to_string(dir.join("Cargo.toml"))
                .is_ok_and(|text| text.lines().any(|l| l.trim() == "[workspace]"))
        })
        .unwrap_or(&crate_dir)
        .join("Cargo.lock")
}

fn rel_display(dir: &Path, file: &str) -> String {
    let joined = dir.join(file);
    let s = joined.display().to_string();
    s.trim_start_matches("./").to_owned()
}

impl SyntaxJob<'_> {
    fn present(&self) -> Vec<&str> {
        self.changed
            .iter()
            .map(String::as_str)
            .filter(|p| self.worktree.join(p).is_file())
            .collect()
    }

    async fn tool(
        &self,
        argv: Vec<String>,
        cwd: &Path,
        what: &str,
    ) -> Result<(CheckStatus, String), Error> {
        let ran = self
            .tools
            .run(&argv, cwd, self.timeout, None, self.cancel)
            .await?;
        Ok(judge_exit(ran, what, self.worktree))
    }

    /// One check per file or project that a syntax checker understands.
    pub(crate) async fn syntax(&self) -> Result<Vec<CheckResult>, Error> {
        let files = self.present();
        let mut checks = Vec::new();

        // TypeScript: one `tsc --noEmit` per tsconfig.json that covers a changed file.
        let mut projects: BTreeMap<PathBuf, Vec<&str>> = BTreeMap::new();
        for file in files
            .iter()
            .filter(|f| matches!(ext(f), "ts" | "tsx" | "mts" | "cts"))
        {
            match nearest(self.worktree, file, "tsconfig.json") {
                Some(dir) => projects.entry(dir).or_default().push(file),
                None => checks.push(result(
                    format!("syntax:{file}"),
                    CheckKind::Syntax,
                    (*file).to_owned(),
                    (
                        CheckStatus::Skipped,
                        format!(
                            "tsc: no tsconfig.json at or above {file}, so it is not type-checked"
                        ),
                    ),
                    Instant::now(),
                )),
            }
        }
        for (dir, covered) in projects {
            let started = Instant::now();
            let cwd = self.worktree.join(&dir);
            let local = cwd.join("node_modules/.bin/tsc");
            let program = if local.is_file() {
                local.display().to_string()
            } else {
                "tsc".to_owned()
            };
            let argv = vec![
                program,
                "--noEmit".into(),
                "--pretty".into(),
                "false".into(),
                "-p".into(),
                ".".into(),
            ];
            let outcome = self.tool(argv, &cwd, "tsc --noEmit").await?;
            checks.push(result(
                format!("syntax:tsc:{}", rel_display(&dir, "tsconfig.json")),
                CheckKind::Syntax,
                covered.join(", "),
                prefix_dir(outcome, &dir),
                started,
            ));
        }

        for file in &files {
            let started = Instant::now();
            let outcome = match ext(file) {
                "js" | "cjs" | "mjs" => Some(
                    self.tool(
                        vec!["node".into(), "--check".into(), (*file).to_owned()],
                        self.worktree,
                        "node --check",
                    )
                    .await?,
                ),
                "py" => Some(
                    self.tool(
                        vec![
                            "python3".into(),
                            "-m".into(),
                            "py_compile".into(),
                            (*file).to_owned(),
                        ],
                        self.worktree,
                        "py_compile",
                    )
                    .await?,
                ),
                "json" => Some(self.json(file).await),
                "toml" => Some(self.toml(file).await),
                "yaml" | "yml" => Some(self.yaml(file).await?),
                _ => None,
            };
            if let Some(outcome) = outcome {
                checks.push(result(
                    format!("syntax:{file}"),
                    CheckKind::Syntax,
                    (*file).to_owned(),
                    outcome,
                    started,
                ));
            }
        }

        // Rust: one `cargo check` per Cargo.toml covering a changed .rs or Cargo.toml.
        let mut crates: BTreeMap<PathBuf, Vec<&str>> = BTreeMap::new();
        for file in files
            .iter()
            .filter(|f| ext(f) == "rs" || f.ends_with("Cargo.toml"))
        {
            let dir = if file.ends_with("Cargo.toml") {
                Some(
                    Path::new(file)
                        .parent()
                        .map(Path::to_path_buf)
                        .unwrap_or_default(),
                )
            } else {
                nearest(self.worktree, file, "Cargo.toml")
            };
            if let Some(dir) = dir {
                crates.entry(dir).or_default().push(file);
            }
        }
        for (dir, covered) in crates {
            let started = Instant::now();
            let outcome = self.cargo(&dir, "check", &[]).await?;
            checks.push(result(
                format!("syntax:cargo:{}", rel_display(&dir, "Cargo.toml")),
                CheckKind::Syntax,
                covered.join(", "),
                outcome,
                started,
            ));
        }
        Ok(checks)
    }

    async fn cargo(
        &self,
        dir: &Path,
        sub: &str,
        extra: &[&str],
    ) -> Result<(CheckStatus, String), Error> {
        let mut argv: Vec<String> = vec![
            "cargo".into(),
            sub.into(),
            "--quiet".into(),
            "--message-format".into(),
            "short".into(),
            "--target-dir".into(),
            self.cargo_target.display().to_string(),
        ];
        argv.extend(extra.iter().map(|s| (*s).to_owned()));
        let cwd = self.worktree.join(dir);
        // The worktree is read-only to tools, but cargo writes `Cargo.lock` (creating it when
        // the commit has none): that one file is granted, made empty first when missing
        // (cargo fills an empty one in).
        let lock = cargo_lock(self.worktree, &cwd);
        if !lock.exists() && std::fs::write(&lock, "").is_err() {
            tracing::warn!(lock = %lock.display(), "cannot make an empty Cargo.lock");
        }
        let tools = self.tools.granting_write(&lock);
        let ran = tools
            .run(&argv, &cwd, self.timeout, None, self.cancel)
            .await?;
        let outcome = judge_exit(ran, &format!("cargo {sub}"), self.worktree);
        Ok(prefix_dir(outcome, dir))
    }

    async fn json(&self, file: &str) -> (CheckStatus, String) {
        let name = Path::new(file)
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("");
        if name.starts_with("tsconfig") || name == "jsconfig.json" || file.starts_with(".vscode/") {
            return (
                CheckStatus::Skipped,
                format!("{file} is JSON with comments (tsc and editors read it), not strict JSON"),
            );
        }
        match tokio::fs::read(self.worktree.join(file)).await {
            Err(err) => (CheckStatus::Error, format!("cannot read {file}: {err}")),
            Ok(bytes) => match serde_json::from_slice::<serde_json::Value>(&bytes) {
                Ok(_) => (CheckStatus::Pass, format!("{file} parses as JSON")),
                Err(err) => (
                    CheckStatus::Fail,
                    format!("{file}:{}: invalid JSON: {err}", err.line()),
                ),
            },
        }
    }

    async fn toml(&self, file: &str) -> (CheckStatus, String) {
        match tokio::fs::read_to_string(self.worktree.join(file)).await {
            Err(err) => (CheckStatus::Error, format!("cannot read {file}: {err}")),
            Ok(text) => match text.parse::<toml::Table>() {
                Ok(_) => (CheckStatus::Pass, format!("{file} parses as TOML")),
                Err(err) => {
                    let line = err.span().map_or(0, |span| {
                        text[..span.start.min(text.len())].matches('\n').count() + 1
                    });
                    (
                        CheckStatus::Fail,
                        format!("{file}:{line}: invalid TOML: {}", err.message()),
                    )
                }
            },
        }
    }

    async fn yaml(&self, file: &str) -> Result<(CheckStatus, String), Error> {
        const SCRIPT: &str =
            "import sys, yaml\nwith open(sys.argv[1]) as f:\n    list(yaml.safe_load_all(f))\n";
        let ran = self
            .tools
            .run(
                &[
                    "python3".into(),
                    "-c".into(),
                    SCRIPT.into(),
                    file.to_owned(),
                ],
                self.worktree,
                self.timeout,
                None,
                self.cancel,
            )
            .await?;
        if let Ran::Exited(output) = &ran
            && output.stderr_text().contains("No module named 'yaml'")
        {
            return Ok((
                CheckStatus::Error,
                "yaml: PyYAML is not installed for python3, so YAML cannot be parsed".to_owned(),
            ));
        }
        let (status, evidence) = judge_exit(ran, "yaml parse", self.worktree);
        Ok(match status {
            CheckStatus::Pass => (status, format!("{file} parses as YAML")),
            _ => (status, evidence),
        })
    }

    /// Linters the repository configures, over the changed files they cover; one SKIPPED
    /// check when none is configured.
    pub(crate) async fn lint(&self) -> Result<Vec<CheckResult>, Error> {
        let files = self.present();
        let root = self.worktree;
        let mut checks = Vec::new();
        let read = |name: &str| std::fs::read_to_string(root.join(name)).unwrap_or_default();

        let js = files.iter().any(|f| {
            matches!(
                ext(f),
                "js" | "cjs" | "mjs" | "jsx" | "ts" | "tsx" | "mts" | "cts"
            )
        });
        let package: serde_json::Value =
            serde_json::from_str(&read("package.json")).unwrap_or_default();
        if js
            && package
                .pointer("/scripts/lint")
                .and_then(|v| v.as_str())
                .is_some()
        {
            let started = Instant::now();
            let outcome = self
                .tool(
                    vec!["npm".into(), "run".into(), "--silent".into(), "lint".into()],
                    root,
                    "npm run lint",
                )
                .await?;
            checks.push(result(
                "lint:npm".into(),
                CheckKind::Lint,
                "package.json scripts.lint".into(),
                outcome,
                started,
            ));
        }

        let python: Vec<String> = files
            .iter()
            .filter(|f| ext(f) == "py")
            .map(|f| (*f).to_owned())
            .collect();
        if !python.is_empty() {
            let ruff = root.join("ruff.toml").is_file()
                || root.join(".ruff.toml").is_file()
                || read("pyproject.toml").contains("[tool.ruff");
            let flake8 = root.join(".flake8").is_file()
                || read("setup.cfg").contains("[flake8]")
                || read("tox.ini").contains("[flake8]");
            if ruff {
                let started = Instant::now();
                let mut argv = vec![
                    "ruff".into(),
                    "check".into(),
                    "--no-cache".into(),
                    "--output-format".into(),
                    "concise".into(),
                ];
                argv.extend(python.iter().cloned());
                let outcome = self.tool(argv, root, "ruff check").await?;
                checks.push(result(
                    "lint:ruff".into(),
                    CheckKind::Lint,
                    python.join(", "),
                    outcome,
                    started,
                ));
            }
            if flake8 {
                let started = Instant::now();
                let mut argv = vec!["flake8".into()];
                argv.extend(python.iter().cloned());
                let outcome = self.tool(argv, root, "flake8").await?;
                checks.push(result(
                    "lint:flake8".into(),
                    CheckKind::Lint,
                    python.join(", "),
                    outcome,
                    started,
                ));
            }
        }

        let mut crates: Vec<PathBuf> = files
            .iter()
            .filter(|f| ext(f) == "rs" || f.ends_with("Cargo.toml"))
            .filter_map(|f| {
                nearest(root, f, "Cargo.toml")
                    .or_else(|| f.ends_with("Cargo.toml").then(PathBuf::new))
            })
            .collect();
        crates.sort();
        crates.dedup();
        for dir in crates {
            let d = root.join(&dir);
            let configured = d.join("clippy.toml").is_file()
                || d.join(".clippy.toml").is_file()
                || std::fs::read_to_string(d.join("Cargo.toml"))
                    .unwrap_or_default()
                    .contains("lints.clippy]");
            if configured {
                let started = Instant::now();
                let outcome = self
                    .cargo(&dir, "clippy", &["--", "-D", "warnings"])
                    .await?;
                checks.push(result(
                    format!("lint:clippy:{}", rel_display(&dir, "Cargo.toml")),
                    CheckKind::Lint,
                    rel_display(&dir, "Cargo.toml"),
                    outcome,
                    started,
                ));
            }
        }
        if checks.is_empty() && !files.is_empty() {
            checks.push(result(
                "lint".into(),
                CheckKind::Lint,
                String::new(),
                (
                    CheckStatus::Skipped,
                    "no linter is configured for the changed files (npm `lint` script, ruff or flake8 config, clippy config)".into(),
                ),
                Instant::now(),
            ));
        }
        Ok(checks)
    }
}

/// Tools run inside a subdirectory name files relative to it; make the locations in the
/// evidence repo-relative.
fn prefix_dir((status, evidence): (CheckStatus, String), dir: &Path) -> (CheckStatus, String) {
    if dir.as_os_str().is_empty() {
        return (status, evidence);
    }
    let places: Vec<String> = locations(&evidence)
        .into_iter()
        .map(|p| rel_display(dir, &p))
        .collect();
    if places.is_empty() || status != CheckStatus::Fail {
        (status, evidence)
    } else {
        (
            status,
            format!("in {}: {}\n{evidence}", dir.display(), places.join(", ")),
        )
    }
}
