//! `node_modules` for a Jest/Vitest run in a fresh worktree (test-frameworks.md §5.9, §6).
//!
//! A worktree never has `node_modules` (it is not committed). It gets one of two installs:
//! - the checkout's own, when the checkout's lockfile and manifests are the commit's (or when
//!   the run asks for no install: then with a warning if they differ);
//! - else, with `install`, a cached install under `<data_dir>/node/<manager>-<sha256 of every
//!   manifest>` made by the project's package manager (by `packageManager`, then lockfile):
//!   npm (`npm ci`, falling back to `npm install` when npm rejects its own lockfile with
//!   EUSAGE), pnpm and yarn (classic and berry, through corepack, berry with the
//!   `node-modules` linker) and bun, frozen lockfile first. Workspaces are installed whole:
//!   every workspace package's `package.json` is part of the install and of the key.
//!
//! Either way `node_modules` is not linked wholesale when it holds workspace links: the
//! worktree gets its own `node_modules` directories whose entries link to the installed
//! packages, while workspace links (`@scope/pkg -> ../../packages/pkg`) are re-made to point
//! at the worktree's packages. Linking the directory itself would resolve them into the
//! checkout (or the cache), and the suite would test other code than the commit's.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use troupe_process::{Command, Termination};

use crate::Error;

/// Time allowed for one install.
const INSTALL_TIMEOUT: Duration = Duration::from_secs(20 * 60);
/// Written last into a cached install; one without it is rebuilt.
const COMPLETE_MARKER: &str = ".troupe-complete";

/// Lockfiles, by manager.
const LOCKFILES: &[&str] = &[
    "package-lock.json",
    "npm-shrinkwrap.json",
    "pnpm-lock.yaml",
    "yarn.lock",
    "bun.lock",
    "bun.lockb",
];

/// Files beside the lockfile that change what an install produces.
const INSTALL_CONFIG: &[&str] = &[
    ".npmrc",
    ".yarnrc",
    ".yarnrc.yml",
    "pnpm-workspace.yaml",
    ".pnpmfile.cjs",
    "bunfig.toml",
];

/// Directories copied whole into a cached install (yarn berry's release and plugins, patches).
const INSTALL_DIRS: &[&str] = &[
    ".yarn/releases",
    ".yarn/plugins",
    ".yarn/patches",
    "patches",
];

/// A JS package manager (§6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Manager {
    Npm,
    Pnpm,
    /// Yarn 1.
    Yarn,
    /// Yarn 2+ (`.yarnrc.yml`, or `__metadata` in yarn.lock, or `packageManager: yarn@2+`).
    YarnBerry,
    Bun,
}

impl Manager {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Npm => "npm",
            Self::Pnpm => "pnpm",
            Self::Yarn => "yarn",
            Self::YarnBerry => "yarn berry",
            Self::Bun => "bun",
        }
    }
}

fn read_json(path: &Path) -> Option<serde_json::Value> {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
}

/// The package manager a JS project uses: `packageManager` first, then its lockfile.
pub(crate) fn package_manager(root: &Path) -> Manager {
    let declared = read_json(&root.join("package.json"))
        .and_then(|p| p.get("packageManager")?.as_str().map(str::to_owned));
    let berry_files = || {
        root.join(".yarnrc.yml").is_file()
            || std::fs::read_to_string(root.join("yarn.lock"))
                .is_ok_and(|text| text.contains("__metadata:"))
    };
    if let Some(declared) = declared {
        if let Some(version) = declared.strip_prefix("yarn@") {
            return if version.starts_with("1.") {
                Manager::Yarn
            } else {
                Manager::YarnBerry
            };
        }
        for (prefix, manager) in [
            ("pnpm@", Manager::Pnpm),
            ("bun@", Manager::Bun),
            ("npm@", Manager::Npm),
        ] {
            if declared.starts_with(prefix) {
                return manager;
            }
        }
    }
    if root.join("pnpm-lock.yaml").is_file() {
        Manager::Pnpm
    } else if root.join("yarn.lock").is_file() {
        if berry_files() {
            Manager::YarnBerry
        } else {
            Manager::Yarn
        }
    } else if root.join("bun.lock").is_file() || root.join("bun.lockb").is_file() {
        Manager::Bun
    } else {
        Manager::Npm
    }
}

/// Workspace package directories (repo-relative) from package.json `workspaces` and
/// `pnpm-workspace.yaml` `packages`: plain paths, `dir/*` and `dir/**`.
pub(crate) fn workspace_dirs(root: &Path) -> Vec<PathBuf> {
    let mut patterns: Vec<String> = Vec::new();
    if let Some(package) = read_json(&root.join("package.json")) {
        let list = match package.get("workspaces") {
            Some(serde_json::Value::Array(items)) => items.clone(),
            Some(serde_json::Value::Object(object)) => object
                .get("packages")
                .and_then(serde_json::Value::as_array)
                .cloned()
                .unwrap_or_default(),
            _ => Vec::new(),
        };
        patterns.extend(list.iter().filter_map(|v| v.as_str().map(str::to_owned)));
    }
    if let Ok(text) = std::fs::read_to_string(root.join("pnpm-workspace.yaml")) {
        // The `packages:` list: `  - 'packages/*'` lines (no YAML parser for one list).
        let mut inside = false;
        for line in text.lines() {
            if !line.starts_with(' ') && !line.starts_with('-') {
                inside = line.trim_end() == "packages:";
                continue;
            }
            if inside && let Some(item) = line.trim().strip_prefix('-') {
                patterns.push(item.trim().trim_matches(['\'', '"']).to_owned());
            }
        }
    }
    let mut dirs = Vec::new();
    for pattern in patterns {
        if pattern.starts_with('!') {
            continue;
        }
        let (base, depth) = if let Some(base) = pattern.strip_suffix("/**") {
            (base, 3)
        } else if let Some(base) = pattern.strip_suffix("/*") {
            (base, 1)
        } else {
            (pattern.as_str(), 0)
        };
        collect_packages(root, Path::new(base), depth, &mut dirs);
    }
    dirs.sort();
    dirs.dedup();
    dirs
}

fn collect_packages(root: &Path, rel: &Path, depth: u32, out: &mut Vec<PathBuf>) {
    let dir = root.join(rel);
    if dir.join("package.json").is_file() && !rel.as_os_str().is_empty() {
        out.push(rel.to_path_buf());
    }
    if depth == 0 {
        return;
    }
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name == "node_modules" || name.to_string_lossy().starts_with('.') {
            continue;
        }
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            collect_packages(root, &rel.join(&name), depth - 1, out);
        }
    }
}

/// Every file that decides what an install produces, repo-relative, with its bytes.
fn manifests(root: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files = Vec::new();
    let mut add = |rel: PathBuf| {
        if let Ok(bytes) = std::fs::read(root.join(&rel)) {
            files.push((rel, bytes));
        }
    };
    add(PathBuf::from("package.json"));
    for name in LOCKFILES.iter().chain(INSTALL_CONFIG) {
        add(PathBuf::from(name));
    }
    for dir in workspace_dirs(root) {
        add(dir.join("package.json"));
    }
    for dir in INSTALL_DIRS {
        let mut stack = vec![PathBuf::from(dir)];
        while let Some(rel) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(root.join(&rel)) else {
                continue;
            };
            let mut names: Vec<_> = entries.flatten().map(|e| e.file_name()).collect();
            names.sort();
            for name in names {
                let child = rel.join(name);
                if root.join(&child).is_dir() {
                    stack.push(child);
                } else {
                    add(child);
                }
            }
        }
    }
    files
}

fn manifest_hash(files: &[(PathBuf, Vec<u8>)]) -> String {
    let mut hasher = Sha256::new();
    for (path, bytes) in files {
        hasher.update(path.as_os_str().as_encoded_bytes());
        hasher.update([0]);
        hasher.update(bytes);
        hasher.update([0]);
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The tool's binary in `worktree` (the workdir's own, else hoisted to the root).
fn find_bin(worktree: &Path, workdir: &Path, tool: &str) -> Option<PathBuf> {
    [worktree.join(workdir), worktree.to_path_buf()]
        .into_iter()
        .map(|dir| dir.join("node_modules").join(".bin").join(tool))
        .find(|bin| bin.exists())
}

/// How the tools came to be, for the report.
#[derive(Debug, Default)]
pub(crate) struct Installed {
    pub(crate) bin: PathBuf,
    /// Notes for the report's warnings.
    pub(crate) notes: Vec<String>,
    /// One line: installer and source, for `installer`.
    pub(crate) installer: String,
    /// The installer's output tail, when it ran.
    pub(crate) log: String,
    /// Workspace package directories (repo-relative).
    pub(crate) packages: Vec<PathBuf>,
    /// Whether `node_modules` is the repository's own (committed): then nothing it links to
    /// outside the worktree is trusted.
    pub(crate) committed: bool,
}

/// The tool's binary, ready to run in `worktree`, plus how it got there.
pub(crate) async fn ensure_tool(
    worktree: &Path,
    workdir: &Path,
    source_checkout: &Path,
    tool: &str,
    install: bool,
    installer: &Installer<'_>,
    cancel: &CancellationToken,
) -> Result<Installed, Error> {
    let packages = workspace_dirs(worktree);
    if let Some(bin) = find_bin(worktree, workdir, tool) {
        return Ok(Installed {
            bin,
            installer: "node_modules committed in the repository".to_owned(),
            packages,
            committed: true,
            ..Installed::default()
        });
    }
    let wanted = manifests(worktree);
    let checkout_has_tool = find_bin(source_checkout, workdir, tool).is_some();
    let same =
        checkout_has_tool && manifest_hash(&manifests(source_checkout)) == manifest_hash(&wanted);
    if checkout_has_tool && (same || !install) {
        let mut notes = Vec::new();
        if !same {
            notes.push(format!(
                "the node_modules installed in {} were made for other manifests or lockfile than the commit's (and install is off); dependencies may differ from the commit's",
                source_checkout.display()
            ));
        }
        link_modules(source_checkout, worktree, &packages).await?;
        notes.push(format!(
            "using the node_modules installed in {}",
            source_checkout.display()
        ));
        let bin = find_bin(worktree, workdir, tool).ok_or_else(|| {
            Error::NotInstalled(format!(
                "`node_modules/.bin/{tool}` vanished from {}",
                source_checkout.display()
            ))
        })?;
        return Ok(Installed {
            bin,
            notes,
            installer: format!(
                "reused the node_modules of {}{}",
                source_checkout.display(),
                if same {
                    " (same lockfile and manifests)"
                } else {
                    ""
                }
            ),
            packages,
            ..Installed::default()
        });
    }
    if !install {
        return Err(Error::NotInstalled(format!(
            "`node_modules/.bin/{tool}` is not installed in {}; install the project's dependencies there or run with install",
            source_checkout.display()
        )));
    }
    let manager = package_manager(worktree);
    let cached = cached_install(manager, &wanted, installer.root, installer, cancel).await?;
    link_modules(&cached.dir, worktree, &packages).await?;
    let bin = find_bin(worktree, workdir, tool).ok_or_else(|| Error::Install {
        step: cached.command.clone(),
        detail: format!(
            "the install did not provide `node_modules/.bin/{tool}`; add {tool} to the devDependencies"
        ),
    })?;
    let note = if cached.built {
        format!(
            "installed node_modules with `{}` into {}",
            cached.command,
            cached.dir.display()
        )
    } else {
        format!(
            "reused the node_modules cached at {} (installed with `{}`)",
            cached.dir.display(),
            cached.command
        )
    };
    Ok(Installed {
        bin,
        notes: vec![note.clone(), format!("package manager: {}", manager.name())],
        installer: note,
        log: cached.log,
        packages,
        committed: false,
    })
}

/// Gives `worktree` the `node_modules` of `source` (the root's and each workspace package's):
/// a plain link when none holds a workspace link, else a directory of links in which workspace
/// links point at the worktree's own packages.
pub(crate) async fn link_modules(
    source: &Path,
    worktree: &Path,
    packages: &[PathBuf],
) -> Result<(), Error> {
    let source = source.to_owned();
    let worktree = worktree.to_owned();
    let packages = packages.to_vec();
    tokio::task::spawn_blocking(move || {
        let root = std::fs::canonicalize(&source).unwrap_or_else(|_| source.clone());
        let mut dirs = vec![PathBuf::new()];
        dirs.extend(packages);
        for rel in dirs {
            let from = source.join(&rel).join("node_modules");
            let to = worktree.join(&rel).join("node_modules");
            if !from.exists() || std::fs::symlink_metadata(&to).is_ok() {
                continue;
            }
            if let Some(parent) = to.parent() {
                std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
            }
            shadow(&from, &to, &root, &worktree)?;
        }
        Ok(())
    })
    .await
    .map_err(|err| Error::Internal(format!("linking node_modules: {err}")))?
}

fn io(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.to_owned(),
        source,
    }
}

/// Where a workspace link under `source_root` should point inside `worktree`, if `link` is one.
fn remapped(link: &Path, source_root: &Path, worktree: &Path) -> Option<PathBuf> {
    if !std::fs::symlink_metadata(link).is_ok_and(|m| m.file_type().is_symlink()) {
        return None;
    }
    let target = crate::source::link_target(link)?;
    let rel = target.strip_prefix(source_root).ok()?;
    let installed = rel.components().any(|c| c.as_os_str() == "node_modules");
    (!installed).then(|| worktree.join(rel))
}

/// One `node_modules` directory: linked whole when it has no workspace link, else rebuilt
/// entry by entry (scopes and `.bin` one level down).
fn shadow(from: &Path, to: &Path, source_root: &Path, worktree: &Path) -> Result<(), Error> {
    let entries = |dir: &Path| -> Result<Vec<PathBuf>, Error> {
        let mut list: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| io(dir, e))?
            .flatten()
            .map(|e| e.path())
            .collect();
        list.sort();
        Ok(list)
    };
    let is_group = |path: &Path| {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        (name.starts_with('@') || name == ".bin")
            && std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir())
    };
    let top = entries(from)?;
    let mut any_workspace_link = false;
    for entry in &top {
        let inner = if is_group(entry) {
            entries(entry)?
        } else {
            vec![entry.clone()]
        };
        if inner
            .iter()
            .any(|p| remapped(p, source_root, worktree).is_some())
        {
            any_workspace_link = true;
            break;
        }
    }
    if !any_workspace_link {
        return std::os::unix::fs::symlink(from, to).map_err(|e| io(to, e));
    }
    std::fs::create_dir(to).map_err(|e| io(to, e))?;
    let link_one = |entry: &Path, at: &Path| -> Result<(), Error> {
        let target = remapped(entry, source_root, worktree).unwrap_or_else(|| entry.to_path_buf());
        std::os::unix::fs::symlink(&target, at).map_err(|e| io(at, e))
    };
    for entry in top {
        let Some(name) = entry.file_name() else {
            continue;
        };
        let at = to.join(name);
        if is_group(&entry) {
            std::fs::create_dir(&at).map_err(|e| io(&at, e))?;
            for inner in entries(&entry)? {
                if let Some(inner_name) = inner.file_name() {
                    link_one(&inner, &at.join(inner_name))?;
                }
            }
        } else {
            link_one(&entry, &at)?;
        }
    }
    Ok(())
}

/// A finished cached install.
struct Cached {
    dir: PathBuf,
    built: bool,
    command: String,
    log: String,
}

/// The argv of an install, frozen first: `(frozen, fallback)`.
fn install_commands(
    manager: Manager,
    has_lock: bool,
) -> (Option<Vec<&'static str>>, Vec<&'static str>) {
    match manager {
        Manager::Npm => (
            has_lock.then(|| vec!["npm", "ci", "--no-audit", "--no-fund", "--prefer-offline"]),
            vec![
                "npm",
                "install",
                "--no-audit",
                "--no-fund",
                "--prefer-offline",
            ],
        ),
        Manager::Pnpm => (
            has_lock.then(|| vec!["corepack", "pnpm", "install", "--frozen-lockfile"]),
            vec!["corepack", "pnpm", "install", "--no-frozen-lockfile"],
        ),
        Manager::Yarn => (
            has_lock.then(|| {
                vec![
                    "corepack",
                    "yarn",
                    "install",
                    "--frozen-lockfile",
                    "--non-interactive",
                ]
            }),
            vec!["corepack", "yarn", "install", "--non-interactive"],
        ),
        Manager::YarnBerry => (
            has_lock.then(|| vec!["corepack", "yarn", "install", "--immutable"]),
            vec!["corepack", "yarn", "install", "--no-immutable"],
        ),
        Manager::Bun => (
            has_lock.then(|| vec!["bun", "install", "--frozen-lockfile"]),
            vec!["bun", "install"],
        ),
    }
}

/// Installs the manifests once into the cache; returns the install's root.
async fn cached_install(
    manager: Manager,
    files: &[(PathBuf, Vec<u8>)],
    cache_root: &Path,
    installer: &Installer<'_>,
    cancel: &CancellationToken,
) -> Result<Cached, Error> {
    let key = manifest_hash(files);
    let slug = manager.name().replace(' ', "-");
    let dir = cache_root.join(format!("{slug}-{}", &key[..32]));
    let (frozen, fallback) = install_commands(
        manager,
        files
            .iter()
            .any(|(p, _)| LOCKFILES.iter().any(|l| p == Path::new(l))),
    );
    if dir.join(COMPLETE_MARKER).is_file() {
        let command = std::fs::read_to_string(dir.join(COMPLETE_MARKER)).unwrap_or_default();
        return Ok(Cached {
            dir,
            built: false,
            command,
            log: String::new(),
        });
    }
    if dir.exists() {
        tokio::fs::remove_dir_all(&dir)
            .await
            .map_err(|e| io(&dir, e))?;
    }
    for (rel, bytes) in files {
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|e| io(parent, e))?;
        }
        tokio::fs::write(&path, bytes)
            .await
            .map_err(|e| io(&path, e))?;
    }
    let mut log = String::new();
    let mut used = String::new();
    let mut done = false;
    if let Some(argv) = &frozen {
        used = argv.join(" ");
        match install(manager, &dir, argv, installer, cancel).await? {
            Ok(tail) => {
                log = tail;
                done = true;
            }
            // npm 11 rejects some lockfiles it wrote itself (§5.9); the others' frozen
            // installs fail when the lockfile does not match package.json.
            // A refusal of the sandbox is not the lockfile's fault.
            Err(tail)
                if (manager != Manager::Npm || tail.contains("EUSAGE"))
                    && !tail.contains(crate::sandbox::DENIED) =>
            {
                log = format!("`{used}` failed, retrying without the frozen lockfile:\n{tail}\n");
            }
            Err(tail) => {
                return Err(Error::Install {
                    step: used,
                    detail: tail,
                });
            }
        }
    }
    if !done {
        used = fallback.join(" ");
        match install(manager, &dir, &fallback, installer, cancel).await? {
            Ok(tail) => log.push_str(&tail),
            Err(tail) => {
                return Err(Error::Install {
                    step: used,
                    detail: format!("{log}{tail}"),
                });
            }
        }
    }
    let marker = dir.join(COMPLETE_MARKER);
    tokio::fs::write(&marker, &used)
        .await
        .map_err(|e| io(&marker, e))?;
    Ok(Cached {
        dir,
        built: true,
        command: used,
        log,
    })
}

/// How installers run: confined (see `sandbox::installer`), with the download caches' variables.
#[derive(Debug, Clone)]
pub(crate) struct Installer<'a> {
    /// Where cached installs live (`<data_dir>/node`).
    pub(crate) root: &'a Path,
    pub(crate) sandbox: &'a troupe_process::Sandbox,
    pub(crate) env: &'a std::collections::BTreeMap<String, PathBuf>,
}

/// Runs one install argv in `dir`, confined to it (and the caches); the inner result is the
/// output tail.
async fn install(
    manager: Manager,
    dir: &Path,
    argv: &[&str],
    installer: &Installer<'_>,
    cancel: &CancellationToken,
) -> Result<Result<String, String>, Error> {
    let sandbox = installer.sandbox.clone().write(dir);
    let mut command = Command::from_argv(argv)
        .map_err(|source| Error::process(argv[0], source))?
        .cwd(dir)
        .env("CI", "true")
        .env("COREPACK_ENABLE_DOWNLOAD_PROMPT", "0")
        .envs(
            installer
                .env
                .iter()
                .map(|(name, path)| (name.clone(), path.display().to_string())),
        )
        .timeout(INSTALL_TIMEOUT)
        .sandbox(sandbox.clone());
    for name in [
        "COREPACK_NPM_REGISTRY",
        "COREPACK_INTEGRITY_KEYS",
        "NPM_CONFIG_REGISTRY",
        "npm_config_registry",
        "PNPM_HOME",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "SSL_CERT_FILE",
        "NODE_EXTRA_CA_CERTS",
    ] {
        command = command.env_passthrough(name);
    }
    if manager == Manager::YarnBerry {
        // Plug'n'Play has no node_modules for Jest or Vitest to run from.
        command = command.env("YARN_NODE_LINKER", "node-modules");
    }
    let output = command
        .run(cancel)
        .await
        .map_err(|source| Error::process(argv[0], source))?;
    let text = format!("{}\n{}", output.stdout_text(), output.stderr_text());
    let mut tail = troupe_process::tail(&text, 20, 4000);
    if !output.success()
        && let Some(denied) = sandbox.denied(&text, Some(dir))
    {
        tail = format!("{}{denied}\n{tail}", crate::sandbox::DENIED);
    }
    match output.termination {
        Termination::Cancelled => Err(Error::Cancelled),
        Termination::TimedOut | Termination::IdleTimedOut => Ok(Err(format!(
            "timed out after {}s",
            INSTALL_TIMEOUT.as_secs()
        ))),
        Termination::Exited if output.success() => Ok(Ok(tail)),
        Termination::Exited => Ok(Err(format!("exit {:?}: {tail}", output.exit_code))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_package_managers() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("package.json"), "{}").expect("write");
        assert_eq!(package_manager(dir.path()), Manager::Npm);
        std::fs::write(dir.path().join("yarn.lock"), "# yarn lockfile v1\n").expect("write");
        assert_eq!(package_manager(dir.path()), Manager::Yarn);
        std::fs::write(dir.path().join("yarn.lock"), "__metadata:\n  version: 8\n").expect("write");
        assert_eq!(package_manager(dir.path()), Manager::YarnBerry);
        std::fs::write(dir.path().join("pnpm-lock.yaml"), "").expect("write");
        assert_eq!(package_manager(dir.path()), Manager::Pnpm);
        std::fs::write(
            dir.path().join("package.json"),
            r#"{"packageManager": "bun@1.1.0"}"#,
        )
        .expect("write");
        assert_eq!(package_manager(dir.path()), Manager::Bun);
        std::fs::write(
            dir.path().join("package.json"),
            r#"{"packageManager": "yarn@1.22.22"}"#,
        )
        .expect("write");
        assert_eq!(package_manager(dir.path()), Manager::Yarn);
    }

    #[test]
    fn finds_workspace_packages() {
        let dir = tempfile::tempdir().expect("tempdir");
        for rel in ["packages/a", "packages/b", "apps/web", "tools/x"] {
            std::fs::create_dir_all(dir.path().join(rel)).expect("mkdir");
            std::fs::write(dir.path().join(rel).join("package.json"), "{}").expect("write");
        }
        std::fs::write(
            dir.path().join("package.json"),
            r#"{"workspaces": ["packages/*", "tools/x"]}"#,
        )
        .expect("write");
        std::fs::write(
            dir.path().join("pnpm-workspace.yaml"),
            "packages:\n  - 'apps/*'\n  - \"!apps/ignored\"\n",
        )
        .expect("write");
        let dirs = workspace_dirs(dir.path());
        let names: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        assert_eq!(names, ["apps/web", "packages/a", "packages/b", "tools/x"]);
    }
}
