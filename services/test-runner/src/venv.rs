//! Cached virtual environments for Pytest runs that ask for an install.
//!
//! A venv lives at `<data_dir>/venvs/<key>`, where the key is the SHA-256 of the base
//! interpreter, the repository's requirement files (`requirements-dev.txt`,
//! `requirements-test.txt`, `requirements.txt`, names and contents), its `uv.lock` or
//! `poetry.lock`, its build system and the
//! test requirements its `pyproject.toml` declares (`[project] dependencies`, the `test` /
//! `tests` / `testing` / `dev` extras and PEP 735 dependency groups). It is built with
//! `python -m venv`; then, with a `uv.lock` and `uv` on PATH, `uv sync --frozen
//! --no-install-project` with those extras and groups, else with a `poetry.lock` its pinned
//! packages (see `poetry`; `pip install --no-deps`), else `pip install` of the pyproject's
//! requirements; then `pip install -r` for each requirements file present; then the pytest
//! plugins troupe needs (`pytest pytest-cov pytest-json-report`) when nothing brought them.
//! The project's build system (`[build-system] requires`) goes in too; the project itself
//! never does, since the venv is shared by every commit with these requirements: each run
//! installs it editable into a venv of its own layered on this one (`project_venv`). A marker file written
//! last says the venv is complete; one without it is rebuilt.
//! Builders of the same key serialise on a lock directory (`mkdir` is atomic), so parallel
//! runs, even from other processes, build each venv once.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use troupe_process::{Command, Sandbox, Termination};

use crate::Error;
use crate::pytest::{self, Plugins};

/// Requirement files installed, in this order.
pub(crate) const REQUIREMENT_FILES: &[&str] = &[
    "requirements-dev.txt",
    "requirements-test.txt",
    "requirements.txt",
];

/// Marker written when a venv is complete.
const COMPLETE_MARKER: &str = ".troupe-complete";

/// A lock older than this belongs to a builder that died.
const STALE_LOCK: Duration = Duration::from_secs(45 * 60);

/// Time allowed for one `pip install`.
const PIP_TIMEOUT: Duration = Duration::from_secs(20 * 60);

/// Environment that pip needs to reach its index as configured on this machine.
const PIP_ENV: &[&str] = &[
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_FIND_LINKS",
    "PIP_CERT",
    "PIP_DEFAULT_TIMEOUT",
    "PIP_NO_INDEX",
    "PIP_CONFIG_FILE",
    "PIP_DISABLE_PIP_VERSION_CHECK",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
];

/// A ready venv.
#[derive(Debug)]
pub(crate) struct Venv {
    /// `<venv>/bin/python`.
    pub(crate) python: PathBuf,
    /// Whether this call built it (false: reused from the cache).
    pub(crate) built: bool,
    /// What went into it, one line (for the report's `installer`).
    pub(crate) installer: String,
    /// The install steps' output tails, when it was built.
    pub(crate) log: String,
}

/// The venv cache under one data directory.
#[derive(Debug, Clone)]
pub(crate) struct VenvCache {
    root: PathBuf,
    /// The service's data dir, where the download caches default to (`sandbox::caches`).
    data_dir: PathBuf,
}

/// What a venv is built from.
#[derive(Debug)]
struct Inputs {
    base_python: String,
    files: Vec<(String, Vec<u8>)>,
    pyproject: Vec<String>,
    selected: Vec<String>,
    uv_lock: Option<Vec<u8>>,
    /// The pinned requirements of a `poetry.lock` (when uv does not sync a `uv.lock`), with the
    /// lock's bytes for the key.
    poetry: Option<(Vec<u8>, crate::poetry::Locked)>,
    /// What building the project needs (`[build-system] requires`), so that the run's own
    /// venv can install it editable without build isolation (see `project_venv`).
    build: Vec<String>,
}

impl VenvCache {
    pub(crate) fn new(data_dir: &Path) -> Self {
        Self {
            root: data_dir.join("venvs"),
            data_dir: data_dir.to_path_buf(),
        }
    }

    /// Returns the venv (on `base_python`) for the requirements in `worktree`, building it
    /// when needed.
    #[tracing::instrument(skip_all, fields(worktree = %worktree.display()))]
    pub(crate) async fn ensure(
        &self,
        worktree: &Path,
        base_python: &str,
        sandbox: &Sandbox,
        cancel: &CancellationToken,
    ) -> Result<Venv, Error> {
        let requirements = present_requirements(worktree).await?;
        let (pyproject, selected) = crate::python::test_requirements(worktree);
        let uv_lock = std::fs::read(worktree.join("uv.lock")).ok();
        let use_uv = uv_lock.is_some() && troupe_process::which("uv").is_some();
        let poetry = match crate::poetry::locked_requirements(worktree).filter(|_| !use_uv) {
            Some(Ok(locked)) => std::fs::read(worktree.join("poetry.lock"))
                .ok()
                .map(|bytes| (bytes, locked)),
            Some(Err(detail)) => {
                return Err(Error::Install {
                    step: "read poetry.lock".to_owned(),
                    detail,
                });
            }
            None => None,
        };
        let inputs = Inputs {
            base_python: base_python.to_owned(),
            files: requirements,
            pyproject,
            selected,
            uv_lock: uv_lock.filter(|_| use_uv),
            poetry,
            build: crate::python::build_requirements(worktree).unwrap_or_default(),
        };
        let installer = describe(&inputs, worktree);
        let requirements = &inputs.files;
        let key = self.key(&inputs);
        let dir = self.root.join(&key);
        let python = dir.join("bin").join("python");
        tokio::fs::create_dir_all(&self.root)
            .await
            .map_err(|source| Error::Io {
                path: self.root.clone(),
                source,
            })?;
        let reused = |python: PathBuf| Venv {
            python,
            built: false,
            installer: format!("{installer} (cached venv {})", dir.display()),
            log: String::new(),
        };
        if dir.join(COMPLETE_MARKER).is_file() {
            return Ok(reused(python));
        }
        let lock = self.root.join(format!("{key}.lock"));
        let _guard = match acquire(&lock, &dir, cancel).await? {
            Acquired::Lock(guard) => guard,
            Acquired::BuiltByOther => return Ok(reused(python)),
        };
        if dir.join(COMPLETE_MARKER).is_file() {
            return Ok(reused(python));
        }
        tracing::info!(venv = %dir.display(), requirements = ?requirements.iter().map(|(n, _)| n).collect::<Vec<_>>(), "building venv");
        if dir.exists() {
            tokio::fs::remove_dir_all(&dir)
                .await
                .map_err(|source| Error::Io {
                    path: dir.clone(),
                    source,
                })?;
        }
        // The builders write the venv and the worktree (an `-e .` requirement builds there) and
        // read the interpreter.
        let mut sandbox = sandbox.clone().write(&dir).write(worktree);
        for prefix in crate::sandbox::python_prefixes(Path::new(base_python)) {
            sandbox = sandbox.read(prefix);
        }
        let sandbox = &sandbox;
        // Made first: Landlock grants only paths that exist (`python -m venv` takes an empty one).
        tokio::fs::create_dir_all(&dir)
            .await
            .map_err(|source| Error::Io {
                path: dir.clone(),
                source,
            })?;
        let dir_text = dir.display().to_string();
        let mut log = String::new();
        log.push_str(
            &self
                .step(
                    "create venv",
                    Command::new(base_python).args(["-m", "venv", &dir_text]),
                    Duration::from_secs(300),
                    sandbox,
                    cancel,
                )
                .await?,
        );
        let python_text = python.display().to_string();
        if inputs.uv_lock.is_some() {
            let mut args = vec![
                "sync".to_owned(),
                "--frozen".to_owned(),
                "--no-install-project".to_owned(),
                "--python".to_owned(),
                python_text.clone(),
            ];
            for choice in &inputs.selected {
                if let Some((kind, name)) = choice.split_once(' ') {
                    args.push(format!("--{kind}"));
                    args.push(name.to_owned());
                }
            }
            let uv = Command::new("uv")
                .args(args)
                .cwd(worktree)
                .env("UV_PROJECT_ENVIRONMENT", &dir_text)
                .env_passthrough("UV_CACHE_DIR")
                .env_passthrough("UV_INDEX_URL")
                .env_passthrough("UV_DEFAULT_INDEX");
            log.push_str(
                &self
                    .step("uv sync --frozen", uv, PIP_TIMEOUT, sandbox, cancel)
                    .await?,
            );
        } else if let Some((_, locked)) = &inputs.poetry {
            // The lock is complete (transitive dependencies included): no resolution.
            let file = dir.join("troupe-poetry-lock.txt");
            let mut text = locked.requirements.join("\n");
            text.push('\n');
            tokio::fs::write(&file, text)
                .await
                .map_err(|source| Error::Io {
                    path: file.clone(),
                    source,
                })?;
            let pip = Command::new(&python_text)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--disable-pip-version-check",
                    "--no-deps",
                    "-r",
                ])
                .arg(file.display().to_string())
                .cwd(worktree);
            log.push_str(
                &self
                    .step(
                        "pip install --no-deps (poetry.lock)",
                        pip,
                        PIP_TIMEOUT,
                        sandbox,
                        cancel,
                    )
                    .await?,
            );
        } else if !inputs.pyproject.is_empty() {
            let pip = Command::new(&python_text)
                .args(["-m", "pip", "install", "--disable-pip-version-check"])
                .args(inputs.pyproject.iter().cloned())
                .cwd(worktree);
            log.push_str(
                &self
                    .step(
                        "pip install (pyproject.toml requirements)",
                        pip,
                        PIP_TIMEOUT,
                        sandbox,
                        cancel,
                    )
                    .await?,
            );
        }
        if !inputs.build.is_empty() {
            let pip = Command::new(&python_text)
                .args(["-m", "pip", "install", "--disable-pip-version-check"])
                .args(inputs.build.iter().cloned())
                .cwd(worktree);
            log.push_str(
                &self
                    .step(
                        "pip install (the project's build system)",
                        pip,
                        PIP_TIMEOUT,
                        sandbox,
                        cancel,
                    )
                    .await?,
            );
        }
        for (name, _) in requirements {
            let pip = Command::new(&python_text)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--disable-pip-version-check",
                    "-r",
                    name,
                ])
                .cwd(worktree);
            log.push_str(
                &self
                    .step(
                        &format!("pip install -r {name}"),
                        pip,
                        PIP_TIMEOUT,
                        sandbox,
                        cancel,
                    )
                    .await?,
            );
        }
        let plugins = pytest::probe(
            &python_text,
            &dir,
            &std::collections::BTreeMap::new(),
            &[],
            sandbox,
            cancel,
        )
        .await?
        .plugins;
        let missing = missing_tools(plugins);
        if !missing.is_empty() {
            let pip = Command::new(&python_text)
                .args(["-m", "pip", "install", "--disable-pip-version-check"])
                .args(missing.iter().copied())
                .cwd(worktree);
            log.push_str(
                &self
                    .step(
                        &format!("pip install {}", missing.join(" ")),
                        pip,
                        PIP_TIMEOUT,
                        sandbox,
                        cancel,
                    )
                    .await?,
            );
        }
        let marker = serde_json::json!({
            "base_python": base_python,
            "requirements": requirements.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            "added": missing,
        });
        let marker_path = dir.join(COMPLETE_MARKER);
        tokio::fs::write(&marker_path, marker.to_string())
            .await
            .map_err(|source| Error::Io {
                path: marker_path,
                source,
            })?;
        Ok(Venv {
            python,
            built: true,
            installer: format!("{installer} (built venv {})", dir.display()),
            log: troupe_process::tail(&log, 30, 6000),
        })
    }

    fn key(&self, inputs: &Inputs) -> String {
        let mut hasher = Sha256::new();
        hasher.update(inputs.base_python.as_bytes());
        hasher.update([0]);
        for (name, content) in &inputs.files {
            hasher.update(name.as_bytes());
            hasher.update([0]);
            hasher.update(content);
            hasher.update([0]);
        }
        for requirement in inputs.pyproject.iter().chain(&inputs.selected) {
            hasher.update(requirement.as_bytes());
            hasher.update([1]);
        }
        for requirement in &inputs.build {
            hasher.update(requirement.as_bytes());
            hasher.update([2]);
        }
        if let Some(lock) = &inputs.uv_lock {
            hasher.update(b"uv.lock\0");
            hasher.update(lock);
        }
        if let Some((lock, _)) = &inputs.poetry {
            hasher.update(b"poetry.lock\0");
            hasher.update(lock);
        }
        hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Runs one install step; returns its output tail.
    pub(crate) async fn step(
        &self,
        what: &str,
        command: Command,
        limit: Duration,
        sandbox: &Sandbox,
        cancel: &CancellationToken,
    ) -> Result<String, Error> {
        let command = PIP_ENV
            .iter()
            .fold(command, |cmd, key| cmd.env_passthrough(*key))
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .envs(
                crate::sandbox::caches(&self.data_dir)
                    .into_iter()
                    .map(|(name, dir)| (name, dir.display().to_string())),
            )
            .timeout(limit)
            .sandbox(sandbox.clone());
        let cwd = command.working_dir().map(Path::to_path_buf);
        let program = command.program().to_owned();
        let output = command
            .run(cancel)
            .await
            .map_err(|source| Error::process(&program, source))?;
        match output.termination {
            Termination::Cancelled => Err(Error::Cancelled),
            Termination::TimedOut | Termination::IdleTimedOut => Err(Error::Install {
                step: what.to_owned(),
                detail: format!("timed out after {}s", limit.as_secs()),
            }),
            Termination::Exited if output.success() => Ok(format!(
                "$ {what}\n{}\n",
                troupe_process::tail(&output.stdout_text(), 5, 1000)
            )),
            Termination::Exited => {
                let text = format!("{}\n{}", output.stdout_text(), output.stderr_text());
                let tail = troupe_process::tail(&text, 15, 3000);
                let detail = match sandbox.denied(&text, cwd.as_deref()) {
                    Some(denied) => format!(
                        "{}{denied}\nexit {:?}: {tail}",
                        crate::sandbox::DENIED,
                        output.exit_code
                    ),
                    None => format!("exit {:?}: {tail}", output.exit_code),
                };
                Err(Error::Install {
                    step: what.to_owned(),
                    detail,
                })
            }
        }
    }
}

/// One line saying what a venv is built from.
fn describe(inputs: &Inputs, worktree: &Path) -> String {
    let mut parts = vec![format!("venv on {}", inputs.base_python)];
    if inputs.uv_lock.is_some() {
        parts.push("uv sync --frozen (uv.lock)".to_owned());
    } else if worktree.join("uv.lock").is_file() {
        parts.push("uv.lock present but uv is not on PATH: pip from pyproject.toml".to_owned());
    }
    if let Some((_, locked)) = &inputs.poetry {
        parts.push(format!(
            "poetry.lock pinned, --no-deps (groups {})",
            locked.groups.join(", ")
        ));
    } else if !inputs.pyproject.is_empty() || !inputs.selected.is_empty() {
        let chosen = if inputs.selected.is_empty() {
            String::new()
        } else {
            format!(" with {}", inputs.selected.join(", "))
        };
        parts.push(format!("pyproject.toml dependencies{chosen}"));
    }
    if !inputs.build.is_empty() {
        parts.push(format!("build system {}", inputs.build.join(" ")));
    }
    for (name, _) in &inputs.files {
        parts.push(format!("-r {name}"));
    }
    parts.join("; ")
}

/// The pip distributions to add for plugins the requirements did not provide.
fn missing_tools(plugins: Plugins) -> Vec<&'static str> {
    [
        (plugins.pytest, "pytest"),
        (plugins.pytest_cov, "pytest-cov"),
        (plugins.pytest_jsonreport, "pytest-json-report"),
    ]
    .into_iter()
    .filter(|(present, _)| !present)
    .map(|(_, name)| name)
    .collect()
}

async fn present_requirements(worktree: &Path) -> Result<Vec<(String, Vec<u8>)>, Error> {
    let mut found = Vec::new();
    for name in REQUIREMENT_FILES {
        let path = worktree.join(name);
        match tokio::fs::read(&path).await {
            Ok(content) => found.push(((*name).to_owned(), content)),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(Error::Io { path, source }),
        }
    }
    Ok(found)
}

/// Removes the lock directory when the builder is done (or fails).
#[derive(Debug)]
struct LockGuard(PathBuf);

impl Drop for LockGuard {
    fn drop(&mut self) {
        if let Err(err) = std::fs::remove_dir_all(&self.0) {
            tracing::warn!(lock = %self.0.display(), error = %err, "cannot remove venv lock");
        }
    }
}

enum Acquired {
    Lock(LockGuard),
    BuiltByOther,
}

/// Takes the build lock, or waits until another builder finishes the venv.
async fn acquire(lock: &Path, dir: &Path, cancel: &CancellationToken) -> Result<Acquired, Error> {
    loop {
        match tokio::fs::create_dir(lock).await {
            Ok(()) => {
                let owner = lock.join("owner");
                // Informational only: who holds the lock.
                let _ = tokio::fs::write(&owner, std::process::id().to_string()).await;
                return Ok(Acquired::Lock(LockGuard(lock.to_owned())));
            }
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(source) => {
                return Err(Error::Io {
                    path: lock.to_owned(),
                    source,
                });
            }
        }
        if dir.join(COMPLETE_MARKER).is_file() {
            return Ok(Acquired::BuiltByOther);
        }
        let age = tokio::fs::metadata(lock)
            .await
            .ok()
            .and_then(|m| m.modified().ok())
            .and_then(|t| SystemTime::now().duration_since(t).ok());
        if age.is_some_and(|age| age > STALE_LOCK) {
            tracing::warn!(lock = %lock.display(), "removing stale venv lock");
            let _ = tokio::fs::remove_dir_all(lock).await;
            continue;
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
            () = cancel.cancelled() => return Err(Error::Cancelled),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_only_missing_tools() {
        let none = Plugins::default();
        assert_eq!(
            missing_tools(none),
            ["pytest", "pytest-cov", "pytest-json-report"]
        );
        let all = Plugins {
            pytest: true,
            pytest_cov: true,
            pytest_jsonreport: true,
            pytest_timeout: false,
        };
        assert!(missing_tools(all).is_empty());
    }

    #[test]
    fn key_depends_on_requirement_contents() {
        let cache = VenvCache::new(Path::new("/x"));
        let inputs = |text: &[u8], python: &str, pyproject: &[&str]| Inputs {
            base_python: python.to_owned(),
            files: vec![("requirements.txt".into(), text.to_vec())],
            pyproject: pyproject.iter().map(|s| (*s).to_owned()).collect(),
            selected: Vec::new(),
            uv_lock: None,
            poetry: None,
            build: Vec::new(),
        };
        let a = cache.key(&inputs(b"pytest\n", "python3", &[]));
        assert_ne!(a, cache.key(&inputs(b"pytest==9.2.0\n", "python3", &[])));
        assert_ne!(a, cache.key(&inputs(b"pytest\n", "python3.12", &[])));
        assert_ne!(a, cache.key(&inputs(b"pytest\n", "python3", &["attrs"])));
        assert_eq!(a, cache.key(&inputs(b"pytest\n", "python3", &[])));
        assert_eq!(a.len(), 64);
    }
}
