//! What each child of a test run may touch (Landlock; docs/sandbox.md).
//!
//! Installers, setup commands, interpreter probes and the suites run a project's code or its
//! dependencies' install scripts, so each runs confined:
//! - **installers** (the cached venv's `pip`/`uv`, the cached JS install's `npm`/`pnpm`/`yarn`/
//!   `bun`, the run's editable install) write the install they build, the package managers'
//!   download caches and a home of their own; they may connect to the registries' ports;
//! - **the run's children** (setup commands, probes, Jest/Vitest/Pytest) write the worktree,
//!   the run's own venv, its report directory and a home of their own, and read the install
//!   they run from: the venv and interpreter in use, and where `node_modules` really lives
//!   (its links resolved, as Node resolves them).
//!
//! Nothing else of the data dir is readable (other runs' worktrees, other installs, mirrors).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use troupe_process::Sandbox;
use troupe_proto::v1::{TestOutcome, TestRunReport};

/// What a run's children may touch outside their worktree besides the run's own directories:
/// the install they run from (read) and the few places in it tools insist on writing.
#[derive(Debug, Clone, Default)]
pub(crate) struct Access {
    pub(crate) read: Vec<PathBuf>,
    pub(crate) write: Vec<PathBuf>,
}

impl Access {
    /// Grants it on top of `sandbox`.
    pub(crate) fn grant(&self, mut sandbox: Sandbox) -> Sandbox {
        for path in &self.read {
            sandbox = sandbox.read(path);
        }
        for path in &self.write {
            sandbox = sandbox.write(path);
        }
        sandbox
    }
}

/// Vite bundles a TypeScript config into `<nearest node_modules>/.vite-temp/` when that
/// directory exists (else beside the config, in the worktree): it is made here, in each real
/// `node_modules` the worktree's links lead to, and granted write, so the outcome does not
/// depend on whether an earlier unconfined run made it. The files are transient bundles.
pub(crate) fn vite_temp_dirs(worktree: &Path, workdir: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for dir in [worktree.join(workdir), worktree.to_path_buf()] {
        let modules = dir.join("node_modules");
        let is_link =
            std::fs::symlink_metadata(&modules).is_ok_and(|meta| meta.file_type().is_symlink());
        let Ok(real) = std::fs::canonicalize(&modules) else {
            continue;
        };
        let temp = real.join(".vite-temp");
        if is_link && !dirs.contains(&temp) && std::fs::create_dir_all(&temp).is_ok() {
            dirs.push(temp);
        }
    }
    dirs
}

/// How an install step's or setup step's output starts when the sandbox refused it something.
pub(crate) const DENIED: &str = "denied by the sandbox: ";

/// What a step's output says the sandbox refused (the rest of the line after [`DENIED`]).
pub(crate) fn denial_in(text: &str) -> Option<String> {
    text.lines()
        .find_map(|line| {
            line.split_once(DENIED)
                .map(|(_, rest)| rest.trim().to_owned())
        })
        .filter(|denied| !denied.is_empty())
}

/// Download caches of the package managers: the variable that moves each, and its directory
/// under `<data_dir>/cache/` when the service's environment does not set the variable.
const CACHES: &[(&str, &str)] = &[
    ("npm_config_cache", "npm"),
    ("PIP_CACHE_DIR", "pip"),
    ("UV_CACHE_DIR", "uv"),
    ("YARN_CACHE_FOLDER", "yarn"),
    ("YARN_GLOBAL_FOLDER", "yarn-berry"),
    ("npm_config_store_dir", "pnpm-store"),
    ("COREPACK_HOME", "corepack"),
    ("BUN_INSTALL_CACHE_DIR", "bun"),
];

/// Variables naming a registry, an index or a proxy: installers may connect to their ports.
const REGISTRY_URLS: &[&str] = &[
    "npm_config_registry",
    "NPM_CONFIG_REGISTRY",
    "COREPACK_NPM_REGISTRY",
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "UV_INDEX_URL",
    "UV_DEFAULT_INDEX",
    "UV_EXTRA_INDEX_URL",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "http_proxy",
    "https_proxy",
];

/// The download caches installers use: each variable with its directory (the service's own
/// setting, else troupe's under `<data_dir>/cache/`). They are shared by every run of this
/// service, as the venv and `node_modules` caches are.
pub(crate) fn caches(data_dir: &Path) -> BTreeMap<String, PathBuf> {
    CACHES
        .iter()
        .map(|(name, dir)| {
            let path = std::env::var_os(name)
                .filter(|value| !value.is_empty())
                .map(PathBuf::from)
                .unwrap_or_else(|| data_dir.join("cache").join(dir));
            ((*name).to_owned(), path)
        })
        .collect()
}

/// The ports of the registries installers reach: HTTPS and HTTP, and those of every registry,
/// index and proxy URL in our environment.
pub(crate) fn registry_ports() -> Vec<u16> {
    let mut ports = vec![443, 80];
    for name in REGISTRY_URLS {
        let Ok(value) = std::env::var(name) else {
            continue;
        };
        for url in value.split_whitespace() {
            if let Some(port) = url_port(url)
                && !ports.contains(&port)
            {
                ports.push(port);
            }
        }
    }
    ports
}

/// The port a URL names, or its scheme's.
fn url_port(url: &str) -> Option<u16> {
    let uri: tonic::codegen::http::Uri = url.parse().ok()?;
    uri.port_u16().or(match uri.scheme_str() {
        Some("https") => Some(443),
        Some("http") => Some(80),
        _ => None,
    })
}

/// An installer's sandbox on top of `base`: the download caches writable (created first, so
/// the grant holds), `home` its own, the registries' ports reachable. The caller adds the
/// install's own directory.
pub(crate) fn installer(base: Sandbox, caches: &BTreeMap<String, PathBuf>, home: &Path) -> Sandbox {
    let mut sandbox = base.home(home);
    for dir in caches.values() {
        if let Err(err) = std::fs::create_dir_all(dir) {
            tracing::warn!(cache = %dir.display(), error = %err, "cannot create a download cache");
        }
        sandbox = sandbox.write(dir);
    }
    for port in registry_ports() {
        sandbox = sandbox.allow_port(port);
    }
    sandbox
}

/// A Python interpreter's installation: its prefix (`<prefix>/bin/python`) and, when it is a
/// link (a venv's `python`), the prefix of the interpreter it leads to.
pub(crate) fn python_prefixes(python: &Path) -> Vec<PathBuf> {
    let mut prefixes = Vec::new();
    let resolved = std::fs::canonicalize(python).ok();
    for path in std::iter::once(python.to_path_buf()).chain(resolved) {
        if let Some(prefix) = path.parent().and_then(Path::parent)
            && prefix.is_absolute()
            && !prefixes.iter().any(|p| p == prefix)
        {
            prefixes.push(prefix.to_path_buf());
        }
    }
    prefixes
}

/// Where the `node_modules` of `worktree` (the root's and each workspace package's) really
/// are: the link itself resolved, or, for a directory of links, where its entries lead (one
/// level, scopes and `.bin` included). Node resolves a module to its real path, so the suite
/// reads there, not through the worktree.
pub(crate) fn node_modules_sources(worktree: &Path, packages: &[PathBuf]) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = Vec::new();
    let mut add = |path: PathBuf| {
        if !path.starts_with(worktree) && !found.contains(&path) {
            found.push(path);
        }
    };
    let dirs = std::iter::once(PathBuf::new()).chain(packages.iter().cloned());
    for rel in dirs {
        let modules = worktree.join(rel).join("node_modules");
        let Ok(real) = std::fs::canonicalize(&modules) else {
            continue;
        };
        let is_link =
            std::fs::symlink_metadata(&modules).is_ok_and(|meta| meta.file_type().is_symlink());
        let mut entries = Vec::new();
        if is_link {
            add(real.clone());
        }
        list_links(&real, &mut entries);
        for entry in entries {
            if let Ok(target) = std::fs::canonicalize(&entry) {
                add(install_root(&target));
            }
        }
    }
    found
}

/// Of the places `node_modules` leads to, those a run may read: beneath the data dir only the
/// cached installs (`<data_dir>/node`), beneath the service's home only the user's checkout
/// (an install script could have linked a package to `~/.ssh`; the data dir holds other
/// runs' worktrees). Refused ones are logged.
pub(crate) fn readable_sources(
    found: Vec<PathBuf>,
    data_dir: &Path,
    checkout: &Path,
) -> Vec<PathBuf> {
    let real = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let data_dir = real(data_dir);
    let installs = data_dir.join("node");
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|h| real(Path::new(&h)));
    let checkout = (!checkout.as_os_str().is_empty()).then(|| real(checkout));
    found
        .into_iter()
        .filter(|path| {
            let refused = (path.starts_with(&data_dir) && !path.starts_with(&installs))
                || (home.as_ref().is_some_and(|home| path.starts_with(home))
                    && !checkout.as_ref().is_some_and(|c| path.starts_with(c)));
            if refused {
                tracing::warn!(path = %path.display(), "sandbox: node_modules leads into a protected place; not granting it");
            }
            !refused
        })
        .collect()
}

/// The outermost `node_modules` a resolved package lives in (its siblings and, for pnpm, the
/// `.pnpm` store they link to are beneath it), else the path itself.
fn install_root(target: &Path) -> PathBuf {
    let mut root = PathBuf::new();
    for component in target.components() {
        root.push(component);
        if component.as_os_str() == "node_modules" {
            return root;
        }
    }
    target.to_path_buf()
}

/// The symlinks among the entries of a `node_modules` directory (and of its scopes and `.bin`).
fn list_links(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        let name = entry.file_name().to_string_lossy().into_owned();
        if kind.is_symlink() {
            out.push(path);
        } else if kind.is_dir() && (name.starts_with('@') || name == ".bin") {
            list_links(&path, out);
        }
    }
}

/// Turns a run that did not pass into SANDBOX_DENIED when what it printed (`output`) or its
/// failure messages name something the sandbox refused (docs/sandbox.md, "How a denial is
/// reported"). A passing run is left alone: whatever it was refused, it coped.
pub(crate) fn mark_denied(report: &mut TestRunReport, sandbox: &Sandbox, output: &str, cwd: &Path) {
    if matches!(
        report.outcome(),
        TestOutcome::Passed | TestOutcome::CoverageBelowTarget | TestOutcome::CoverageThreshold
    ) {
        return;
    }
    let mut text = output.to_owned();
    for failure in &report.failures {
        text.push('\n');
        text.push_str(&failure.message);
    }
    if let Some(denied) = sandbox.denied(&text, Some(cwd)) {
        report.outcome = TestOutcome::SandboxDenied as i32;
        report
            .warnings
            .push(format!("the sandbox denied {denied} (docs/sandbox.md)"));
        report.sandbox_denied = denied;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_ports_come_from_urls() {
        assert_eq!(url_port("https://registry.npmjs.org/"), Some(443));
        assert_eq!(url_port("http://proxy.local:3128"), Some(3128));
        assert_eq!(url_port("http://10.0.0.1/simple"), Some(80));
        assert_eq!(url_port("not a url"), None);
    }

    #[test]
    fn node_modules_are_read_where_their_links_lead() {
        let root = tempfile::tempdir().expect("tempdir");
        let installed = root.path().join("cache/node_modules");
        std::fs::create_dir_all(installed.join("jest")).expect("mkdir");
        std::fs::create_dir_all(installed.join("@scope/pkg")).expect("mkdir");
        let tools = root.path().join("tools/node_modules/vitest");
        std::fs::create_dir_all(&tools).expect("mkdir");
        let worktree = root.path().join("wt");
        let shadow = worktree.join("node_modules");
        std::fs::create_dir_all(shadow.join("@scope")).expect("mkdir");
        std::os::unix::fs::symlink(installed.join("jest"), shadow.join("jest")).expect("link");
        std::os::unix::fs::symlink(installed.join("@scope/pkg"), shadow.join("@scope/pkg"))
            .expect("link");
        std::os::unix::fs::symlink(&tools, shadow.join("vitest")).expect("link");
        std::fs::create_dir_all(worktree.join("packages/a")).expect("mkdir");
        std::os::unix::fs::symlink(&installed, worktree.join("packages/a/node_modules"))
            .expect("link");
        let found = node_modules_sources(&worktree, &[PathBuf::from("packages/a")]);
        let real = |p: &Path| std::fs::canonicalize(p).expect("canonical");
        assert!(found.contains(&real(&installed)), "{found:?}");
        assert!(
            found.contains(&real(&root.path().join("tools/node_modules"))),
            "{found:?}"
        );
        assert!(!found.iter().any(|p| p.starts_with(real(&worktree))));
    }
}
