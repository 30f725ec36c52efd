//! `node_modules` for a Jest/Vitest run in a fresh worktree (test-frameworks.md §5.9, §6).
//!
//! A worktree never has `node_modules` (it is not committed). In order: the worktree's own
//! `node_modules/.bin/<tool>`; the source checkout's installed `node_modules` (linked into the
//! worktree, nothing installed); with `install`, a cached install under
//! `<data_dir>/node/<sha256 of package.json + lockfile>` made with `npm ci`, falling back to
//! `npm install` when npm rejects its own lockfile with EUSAGE, then linked. Only npm installs
//! are implemented; pnpm, yarn and bun projects must bring their own `node_modules`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use troupe_process::{Command, Termination};

use crate::Error;

/// Time allowed for one npm install.
const NPM_TIMEOUT: Duration = Duration::from_secs(20 * 60);
/// Written last into a cached install; one without it is rebuilt.
const COMPLETE_MARKER: &str = ".troupe-complete";

/// The package manager a JS project uses (§6).
pub(crate) fn package_manager(root: &Path) -> &'static str {
    let declared = std::fs::read_to_string(root.join("package.json"))
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|p| p.get("packageManager")?.as_str().map(str::to_owned));
    if let Some(declared) = declared {
        for name in ["pnpm", "yarn", "bun", "npm"] {
            if declared.starts_with(&format!("{name}@")) {
                return name;
            }
        }
    }
    if root.join("pnpm-lock.yaml").is_file() {
        "pnpm"
    } else if root.join("yarn.lock").is_file() {
        "yarn"
    } else if root.join("bun.lock").is_file() || root.join("bun.lockb").is_file() {
        "bun"
    } else {
        "npm"
    }
}

/// The tool's binary, ready to run in `worktree`, plus notes for the report.
pub(crate) async fn ensure_tool(
    worktree: &Path,
    source_checkout: &Path,
    tool: &str,
    install: bool,
    cache_root: &Path,
    cancel: &CancellationToken,
) -> Result<(PathBuf, Vec<String>), Error> {
    let bin = worktree.join("node_modules").join(".bin").join(tool);
    if bin.is_file() {
        return Ok((bin, Vec::new()));
    }
    let checkout_modules = source_checkout.join("node_modules");
    // Already installed in the checkout: nothing to install, even when asked to.
    if checkout_modules.join(".bin").join(tool).is_file() {
        link(&checkout_modules, &worktree.join("node_modules")).await?;
        return Ok((
            bin,
            vec![format!(
                "using the node_modules installed in {}",
                source_checkout.display()
            )],
        ));
    }
    if !install {
        return Err(Error::NotInstalled(format!(
            "`node_modules/.bin/{tool}` is not installed in {}; install the project's dependencies there or run with install",
            source_checkout.display()
        )));
    }
    let manager = package_manager(worktree);
    if manager != "npm" {
        return Err(Error::Unimplemented(format!(
            "installing {manager} projects is not implemented; install node_modules in {} and run without install",
            source_checkout.display()
        )));
    }
    let (modules, built) = cached_install(worktree, cache_root, cancel).await?;
    link(&modules, &worktree.join("node_modules")).await?;
    if !bin.is_file() {
        return Err(Error::NotInstalled(format!(
            "`npm install` did not provide `node_modules/.bin/{tool}`; add {tool} to the devDependencies"
        )));
    }
    let note = if built {
        format!("installed node_modules with npm into {}", modules.display())
    } else {
        format!("reused the node_modules cached at {}", modules.display())
    };
    Ok((bin, vec![note]))
}

async fn link(target: &Path, at: &Path) -> Result<(), Error> {
    tokio::fs::symlink(target, at)
        .await
        .map_err(|source| Error::Io {
            path: at.to_owned(),
            source,
        })
}

/// Installs the worktree's `package.json` + lockfile once into the cache; returns its
/// `node_modules` and whether this call built it.
async fn cached_install(
    worktree: &Path,
    cache_root: &Path,
    cancel: &CancellationToken,
) -> Result<(PathBuf, bool), Error> {
    let mut hasher = Sha256::new();
    let mut files = Vec::new();
    for name in ["package.json", "package-lock.json", "npm-shrinkwrap.json"] {
        let path = worktree.join(name);
        match tokio::fs::read(&path).await {
            Ok(bytes) => {
                hasher.update(name.as_bytes());
                hasher.update([0]);
                hasher.update(&bytes);
                files.push((name, bytes));
            }
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(Error::Io { path, source }),
        }
    }
    let key: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dir = cache_root.join(&key);
    let modules = dir.join("node_modules");
    if dir.join(COMPLETE_MARKER).is_file() {
        return Ok((modules, false));
    }
    if dir.exists() {
        tokio::fs::remove_dir_all(&dir)
            .await
            .map_err(|source| Error::Io {
                path: dir.clone(),
                source,
            })?;
    }
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(|source| Error::Io {
            path: dir.clone(),
            source,
        })?;
    for (name, bytes) in &files {
        let path = dir.join(name);
        tokio::fs::write(&path, bytes)
            .await
            .map_err(|source| Error::Io { path, source })?;
    }
    let has_lock = files.iter().any(|(name, _)| *name != "package.json");
    let ci = if has_lock {
        Some(npm(&dir, "ci", cancel).await?)
    } else {
        None
    };
    match ci {
        Some(Ok(())) => {}
        Some(Err(text)) if !text.contains("EUSAGE") => {
            return Err(Error::Install {
                step: "npm ci".to_owned(),
                detail: text,
            });
        }
        // npm rejected its own lockfile, or there is none: `npm install` it is.
        Some(Err(_)) | None => {
            if let Err(text) = npm(&dir, "install", cancel).await? {
                return Err(Error::Install {
                    step: "npm install".to_owned(),
                    detail: text,
                });
            }
        }
    }
    let marker = dir.join(COMPLETE_MARKER);
    tokio::fs::write(&marker, "")
        .await
        .map_err(|source| Error::Io {
            path: marker,
            source,
        })?;
    Ok((modules, true))
}

/// Runs `npm <verb>`; the inner error is the output tail.
async fn npm(
    dir: &Path,
    verb: &str,
    cancel: &CancellationToken,
) -> Result<Result<(), String>, Error> {
    let output = Command::new("npm")
        .args([verb, "--no-audit", "--no-fund", "--prefer-offline"])
        .cwd(dir)
        .timeout(NPM_TIMEOUT)
        .run(cancel)
        .await
        .map_err(|source| Error::process("npm", source))?;
    match output.termination {
        Termination::Cancelled => Err(Error::Cancelled),
        Termination::TimedOut | Termination::IdleTimedOut => {
            Ok(Err(format!("timed out after {}s", NPM_TIMEOUT.as_secs())))
        }
        Termination::Exited if output.success() => Ok(Ok(())),
        Termination::Exited => Ok(Err(format!(
            "exit {:?}: {}",
            output.exit_code,
            troupe_process::tail(
                &format!("{}\n{}", output.stdout_text(), output.stderr_text()),
                15,
                3000
            )
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_package_managers() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("package.json"), "{}").expect("write");
        assert_eq!(package_manager(dir.path()), "npm");
        std::fs::write(dir.path().join("yarn.lock"), "").expect("write");
        assert_eq!(package_manager(dir.path()), "yarn");
        std::fs::write(dir.path().join("pnpm-lock.yaml"), "").expect("write");
        assert_eq!(package_manager(dir.path()), "pnpm");
        std::fs::write(
            dir.path().join("package.json"),
            r#"{"packageManager": "bun@1.1.0"}"#,
        )
        .expect("write");
        assert_eq!(package_manager(dir.path()), "bun");
    }
}
