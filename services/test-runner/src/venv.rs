//! Cached virtual environments for Pytest runs that ask for an install.
//!
//! A venv lives at `<data_dir>/venvs/<key>`, where the key is the SHA-256 of the base
//! interpreter and the repository's requirement files (`requirements-dev.txt`,
//! `requirements-test.txt`, `requirements.txt`, names and contents). It is built with
//! `python -m venv`, then `pip install -r` for each file present, then the pytest plugins
//! troupe needs (`pytest pytest-cov pytest-json-report`) when the requirements did not bring
//! them. A marker file written last says the venv is complete; one without it is rebuilt.
//! Builders of the same key serialise on a lock directory (`mkdir` is atomic), so parallel
//! runs, even from other processes, build each venv once.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use troupe_process::{Command, Termination};

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
}

/// The venv cache under one data directory.
#[derive(Debug, Clone)]
pub(crate) struct VenvCache {
    root: PathBuf,
    base_python: String,
}

impl VenvCache {
    pub(crate) fn new(root: PathBuf, base_python: String) -> Self {
        Self { root, base_python }
    }

    /// Returns the venv for the requirements in `worktree`, building it when needed.
    #[tracing::instrument(skip_all, fields(worktree = %worktree.display()))]
    pub(crate) async fn ensure(
        &self,
        worktree: &Path,
        cancel: &CancellationToken,
    ) -> Result<Venv, Error> {
        let requirements = present_requirements(worktree).await?;
        let key = self.key(&requirements);
        let dir = self.root.join(&key);
        let python = dir.join("bin").join("python");
        tokio::fs::create_dir_all(&self.root)
            .await
            .map_err(|source| Error::Io {
                path: self.root.clone(),
                source,
            })?;
        if dir.join(COMPLETE_MARKER).is_file() {
            return Ok(Venv {
                python,
                built: false,
            });
        }
        let lock = self.root.join(format!("{key}.lock"));
        let _guard = match acquire(&lock, &dir, cancel).await? {
            Acquired::Lock(guard) => guard,
            Acquired::BuiltByOther => {
                return Ok(Venv {
                    python,
                    built: false,
                });
            }
        };
        if dir.join(COMPLETE_MARKER).is_file() {
            return Ok(Venv {
                python,
                built: false,
            });
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
        let dir_text = dir.display().to_string();
        self.step(
            "create venv",
            Command::new(&self.base_python).args(["-m", "venv", &dir_text]),
            Duration::from_secs(300),
            cancel,
        )
        .await?;
        let python_text = python.display().to_string();
        for (name, _) in &requirements {
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
            self.step(&format!("pip install -r {name}"), pip, PIP_TIMEOUT, cancel)
                .await?;
        }
        let plugins = pytest::probe(&python_text, &self.root, cancel).await?;
        let missing = missing_tools(plugins);
        if !missing.is_empty() {
            let pip = Command::new(&python_text)
                .args(["-m", "pip", "install", "--disable-pip-version-check"])
                .args(missing.iter().copied())
                .cwd(worktree);
            self.step(
                &format!("pip install {}", missing.join(" ")),
                pip,
                PIP_TIMEOUT,
                cancel,
            )
            .await?;
        }
        let marker = serde_json::json!({
            "base_python": self.base_python,
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
        })
    }

    fn key(&self, requirements: &[(String, Vec<u8>)]) -> String {
        let mut hasher = Sha256::new();
        hasher.update(self.base_python.as_bytes());
        hasher.update([0]);
        for (name, content) in requirements {
            hasher.update(name.as_bytes());
            hasher.update([0]);
            hasher.update(content);
            hasher.update([0]);
        }
        hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    async fn step(
        &self,
        what: &str,
        command: Command,
        limit: Duration,
        cancel: &CancellationToken,
    ) -> Result<(), Error> {
        let command = PIP_ENV
            .iter()
            .fold(command, |cmd, key| cmd.env_passthrough(*key))
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .timeout(limit);
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
            Termination::Exited if output.success() => Ok(()),
            Termination::Exited => Err(Error::Install {
                step: what.to_owned(),
                detail: format!(
                    "exit {:?}: {}",
                    output.exit_code,
                    troupe_process::tail(
                        &format!("{}\n{}", output.stdout_text(), output.stderr_text()),
                        15,
                        3000
                    )
                ),
            }),
        }
    }
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
        let cache = VenvCache::new(PathBuf::from("/x"), "python3".into());
        let a = cache.key(&[("requirements.txt".into(), b"pytest\n".to_vec())]);
        let b = cache.key(&[("requirements.txt".into(), b"pytest==9.2.0\n".to_vec())]);
        assert_ne!(a, b);
        assert_eq!(
            a,
            cache.key(&[("requirements.txt".into(), b"pytest\n".to_vec())])
        );
        assert_eq!(a.len(), 64);
    }
}
