//! What a Python project says about itself: its packages (src or flat layout), the
//! interpreter it needs (`requires-python`), and its test dependencies (`[project]
//! dependencies`, test extras, PEP 735 dependency groups), read from `pyproject.toml`.
//!
//! The packages serve the "commit under test" rule: the worktree's import roots (`src`, or
//! what `pyproject.toml` names) go first on `PYTHONPATH` (an editable install of another
//! checkout then loses), and before the suite runs the interpreter is asked where it would
//! import each package from; one that resolves outside the worktree fails the run as
//! WRONG_SOURCE.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use troupe_process::{Command, Termination};

use crate::Error;

/// Extras and dependency groups installed with `install` when the project defines them.
pub(crate) const TEST_SELECTIONS: &[&str] = &["test", "tests", "testing", "dev"];

fn pyproject(root: &Path) -> Option<toml::Table> {
    std::fs::read_to_string(root.join("pyproject.toml"))
        .ok()
        .and_then(|text| toml::from_str::<toml::Table>(&text).ok())
}

/// Directories the project's packages are imported from, other than the root itself: `src`
/// when it holds code, and what `pyproject.toml` names (setuptools `package-dir` for the root
/// package and `packages.find.where`, hatch's wheel `sources`).
pub(crate) fn import_roots(root: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    let src = root.join("src");
    let has_code = std::fs::read_dir(&src).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            let path = e.path();
            (path.is_dir() && !e.file_name().to_string_lossy().ends_with(".egg-info"))
                || path.extension().is_some_and(|x| x == "py")
        })
    });
    if has_code {
        dirs.push(src);
    }
    if let Some(table) = pyproject(root) {
        let tool = table.get("tool");
        let setuptools = tool.and_then(|t| t.get("setuptools"));
        let mut named: Vec<String> = Vec::new();
        if let Some(dir) = setuptools
            .and_then(|s| s.get("package-dir"))
            .and_then(|d| d.get(""))
            .and_then(toml::Value::as_str)
        {
            named.push(dir.to_owned());
        }
        if let Some(wheres) = setuptools
            .and_then(|s| s.get("packages"))
            .and_then(|p| p.get("find"))
            .and_then(|f| f.get("where"))
            .and_then(toml::Value::as_array)
        {
            named.extend(wheres.iter().filter_map(|w| w.as_str().map(str::to_owned)));
        }
        if let Some(sources) = tool
            .and_then(|t| t.get("hatch"))
            .and_then(|h| h.get("build"))
            .and_then(|b| b.get("targets"))
            .and_then(|t| t.get("wheel"))
            .and_then(|w| w.get("sources"))
        {
            match sources {
                toml::Value::Array(items) => {
                    named.extend(items.iter().filter_map(|w| w.as_str().map(str::to_owned)));
                }
                toml::Value::Table(map) => named.extend(map.keys().cloned()),
                _ => {}
            }
        }
        for dir in named {
            let dir = dir.trim_matches('/');
            if dir.is_empty() || dir == "." || dir.contains("..") {
                continue;
            }
            let path = root.join(dir);
            if path.is_dir() && !dirs.contains(&path) {
                dirs.push(path);
            }
        }
    }
    dirs
}

const SKIP: &[&str] = &[
    "tests",
    "test",
    "testing",
    "docs",
    "doc",
    "examples",
    "scripts",
    "benchmarks",
    "build",
    "dist",
    "setup",
    "conftest",
    "noxfile",
    "tasks",
    "node_modules",
    "site-packages",
];

fn importable(name: &str) -> bool {
    !name.is_empty()
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && !SKIP.contains(&name)
}

/// Top-level import names of the project's own code: packages (directories with
/// `__init__.py`) and modules in its import roots, else packages in the root itself (tests,
/// docs and build helpers left out).
pub(crate) fn packages(root: &Path) -> Vec<String> {
    let roots = import_roots(root);
    let mut names = Vec::new();
    let flat = roots.is_empty();
    for base in if flat {
        vec![root.to_path_buf()]
    } else {
        roots
    } {
        let Ok(entries) = std::fs::read_dir(&base) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || name.starts_with('_') && flat {
                continue;
            }
            let module = if path.is_dir() && path.join("__init__.py").is_file() {
                name.clone()
            } else if !flat && path.is_file() && name.ends_with(".py") {
                name.trim_end_matches(".py").to_owned()
            } else {
                continue;
            };
            if importable(&module) {
                names.push(module);
            }
        }
    }
    names.sort();
    names.dedup();
    names
}

/// Every top-level package anywhere in the worktree (a directory with `__init__.py` whose
/// parent has none, at most four levels down), with its repo-relative path: the code of other
/// packages of a monorepo that the suite may import.
pub(crate) fn all_packages(worktree: &Path) -> Vec<(String, PathBuf)> {
    let mut found = Vec::new();
    let mut stack = vec![(PathBuf::new(), 0u32)];
    while let Some((rel, depth)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(worktree.join(&rel)) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.')
                || !entry.file_type().is_ok_and(|t| t.is_dir())
                || matches!(
                    name.as_str(),
                    "node_modules" | "__pycache__" | "venv" | "site-packages" | "build" | "dist"
                )
            {
                continue;
            }
            let child = rel.join(&name);
            if worktree.join(&child).join("__init__.py").is_file() {
                if importable(&name) {
                    found.push((name, child));
                }
            } else if depth < 4 {
                stack.push((child, depth + 1));
            }
        }
    }
    found.sort();
    found
}

/// `requires-python` of the project.
pub(crate) fn requires_python(root: &Path) -> Option<String> {
    pyproject(root)?
        .get("project")?
        .get("requires-python")?
        .as_str()
        .map(str::to_owned)
}

/// Whether `version` (major, minor) satisfies a `requires-python` specifier set (the clauses
/// that matter for choosing an interpreter: `>=`, `>`, `<`, `<=`, `==`, `!=`, `~=`, `.*`).
pub(crate) fn satisfies(spec: &str, version: (u32, u32)) -> bool {
    let parse = |text: &str| -> Option<(u32, u32)> {
        let mut parts = text.trim().trim_end_matches(".*").split('.');
        let major = parts.next()?.trim().parse().ok()?;
        let minor = parts.next().map_or(Some(0), |m| m.trim().parse().ok())?;
        Some((major, minor))
    };
    spec.split(',').all(|clause| {
        let clause = clause.trim();
        if clause.is_empty() {
            return true;
        }
        let ops = ["~=", "==", "!=", ">=", "<=", ">", "<"];
        let Some(op) = ops.iter().find(|op| clause.starts_with(**op)) else {
            return true;
        };
        let Some(bound) = parse(&clause[op.len()..]) else {
            return true;
        };
        let wildcard = clause.ends_with(".*");
        match *op {
            ">=" | "~=" => version >= bound,
            ">" => version > bound,
            "<" => version < bound,
            "<=" => version <= bound,
            "==" if wildcard || clause[2..].trim().split('.').count() <= 2 => version == bound,
            "==" => version == bound,
            "!=" => version != bound,
            _ => true,
        }
    })
}

async fn version_of(python: &str, cancel: &CancellationToken) -> Option<(u32, u32)> {
    let output = Command::new(python)
        .args([
            "-c",
            "import sys; print(sys.version_info[0], sys.version_info[1])",
        ])
        .timeout(Duration::from_secs(30))
        .run(cancel)
        .await
        .ok()?;
    if output.termination != Termination::Exited || !output.success() {
        return None;
    }
    let text = output.stdout_text();
    let mut parts = text.split_whitespace();
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Interpreter versions already asked for, by program (an interpreter's version does not
/// change under a running service; a run would otherwise pay one more Python start).
pub(crate) type VersionCache =
    std::sync::Mutex<std::collections::HashMap<String, Option<(u32, u32)>>>;

async fn cached_version(
    python: &str,
    cache: &VersionCache,
    cancel: &CancellationToken,
) -> Option<(u32, u32)> {
    let known = cache
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(python)
        .copied();
    if let Some(known) = known {
        return known;
    }
    let found = version_of(python, cancel).await;
    cache
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(python.to_owned(), found);
    found
}

/// The interpreter for a run: `explicit` when given (the probe that follows says whether it
/// runs); else `default` when it satisfies the project's `requires-python`; else the first
/// `python3.N` on PATH that does (newest first). Returns the interpreter and a note when it is
/// not the default.
pub(crate) async fn choose_interpreter(
    explicit: Option<&str>,
    default: &str,
    root: &Path,
    cache: &VersionCache,
    cancel: &CancellationToken,
) -> Result<(String, Option<String>), Error> {
    if let Some(python) = explicit.filter(|p| !p.trim().is_empty()) {
        return Ok((
            python.to_owned(),
            Some(format!("python: {python} (requested)")),
        ));
    }
    let Some(spec) = requires_python(root) else {
        return Ok((default.to_owned(), None));
    };
    if let Some(version) = cached_version(default, cache, cancel).await
        && satisfies(&spec, version)
    {
        return Ok((default.to_owned(), None));
    }
    for minor in (6..=15).rev() {
        let candidate = format!("python3.{minor}");
        if satisfies(&spec, (3, minor))
            && let Some(found) = cached_version(&candidate, cache, cancel).await
            && satisfies(&spec, found)
        {
            let note = format!("python: {candidate} (requires-python {spec})");
            return Ok((candidate, Some(note)));
        }
    }
    Err(Error::NotInstalled(format!(
        "no Python interpreter on PATH satisfies the project's requires-python `{spec}`; set test.python"
    )))
}

/// What building the project itself needs, when it is an installable package: its
/// `[build-system] requires` (PEP 518), or setuptools for a `setup.py`/`setup.cfg` project or
/// a `[project]` table without a build system (PEP 517's legacy default). `None` when the
/// directory holds no package to install (a `pyproject.toml` of tool settings only).
pub(crate) fn build_requirements(root: &Path) -> Option<Vec<String>> {
    let legacy = || vec!["setuptools>=64".to_owned(), "wheel".to_owned()];
    let table = pyproject(root);
    if let Some(build) = table.as_ref().and_then(|t| t.get("build-system")) {
        let requires = build
            .get("requires")
            .and_then(toml::Value::as_array)
            .map(|items| {
                items
                    .iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_else(legacy);
        return Some(with_wheel(requires));
    }
    let has_project = table.as_ref().is_some_and(|t| t.contains_key("project"));
    (has_project || root.join("setup.py").is_file() || root.join("setup.cfg").is_file())
        .then(legacy)
}

/// setuptools before 70.1 builds wheels (editable ones too) only with `wheel` installed,
/// which it asks for at build time (`get_requires_for_build_editable`): without build
/// isolation nothing would install it.
fn with_wheel(mut requires: Vec<String>) -> Vec<String> {
    let setuptools = requires
        .iter()
        .any(|r| normalise_name(requirement_name(r)) == "setuptools");
    if setuptools
        && !requires
            .iter()
            .any(|r| normalise_name(requirement_name(r)) == "wheel")
    {
        requires.push("wheel".to_owned());
    }
    requires
}

/// The project's test requirements from `pyproject.toml`: `[project] dependencies`, the test
/// extras, and the test dependency groups (PEP 735, `include-group` followed). Returns the
/// requirement strings and what was selected, e.g. `extra test`, `group dev`.
pub(crate) fn test_requirements(root: &Path) -> (Vec<String>, Vec<String>) {
    let Some(table) = pyproject(root) else {
        return (Vec::new(), Vec::new());
    };
    let strings = |value: Option<&toml::Value>| -> Vec<String> {
        value
            .and_then(toml::Value::as_array)
            .map(|items| {
                items
                    .iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut requirements = Vec::new();
    let mut selected = Vec::new();
    if let Some(project) = table.get("project") {
        requirements.extend(strings(project.get("dependencies")));
        if let Some(extras) = project
            .get("optional-dependencies")
            .and_then(toml::Value::as_table)
        {
            for name in TEST_SELECTIONS {
                if let Some(list) = extras.get(*name) {
                    selected.push(format!("extra {name}"));
                    requirements.extend(strings(Some(list)));
                }
            }
        }
    }
    if let Some(groups) = table
        .get("dependency-groups")
        .and_then(toml::Value::as_table)
    {
        for name in TEST_SELECTIONS {
            if groups.contains_key(*name) {
                selected.push(format!("group {name}"));
                group_requirements(groups, name, &mut requirements, 0);
            }
        }
    }
    // A project's own name among its extras' requirements (`pkg[test]` needing `pkg`) is the
    // project itself, which runs from the worktree.
    let own = table
        .get("project")
        .and_then(|p| p.get("name"))
        .and_then(toml::Value::as_str)
        .map(normalise_name);
    requirements.retain(|r| own.as_deref() != Some(normalise_name(requirement_name(r)).as_str()));
    requirements.sort();
    requirements.dedup();
    (requirements, selected)
}

fn group_requirements(groups: &toml::Table, name: &str, out: &mut Vec<String>, depth: u32) {
    if depth > 10 {
        return;
    }
    let Some(items) = groups.get(name).and_then(toml::Value::as_array) else {
        return;
    };
    for item in items {
        match item {
            toml::Value::String(requirement) => out.push(requirement.clone()),
            toml::Value::Table(table) => {
                if let Some(included) = table.get("include-group").and_then(toml::Value::as_str) {
                    group_requirements(groups, included, out, depth + 1);
                }
            }
            _ => {}
        }
    }
}

fn requirement_name(requirement: &str) -> &str {
    let end = requirement
        .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
        .unwrap_or(requirement.len());
    &requirement[..end]
}

fn normalise_name(name: &str) -> String {
    name.to_ascii_lowercase().replace(['_', '.'], "-")
}

const ORIGIN_PROBE: &str = r#"
import importlib.util, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        spec = None
    if spec is None:
        out[name] = None
    elif spec.submodule_search_locations:
        out[name] = list(spec.submodule_search_locations)
    else:
        out[name] = [spec.origin]
print(json.dumps(out))
"#;

/// Asks `python` (in `cwd`, with the run's environment) where the project's packages would be
/// imported from. A package of the tested project (`names`) found anywhere but the worktree is
/// wrong source; another package of the repository (`others`, with its repo-relative path) is
/// when it resolves to a copy of itself elsewhere (a path ending in its own repo-relative
/// path: another checkout of the same repository), while a released copy in site-packages of
/// a same-named third-party distribution is left alone. Returns `name: path` entries.
// One probe's inputs; a struct for them would only be unpacked here.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn foreign_origins(
    python: &str,
    names: &[String],
    others: &[(String, PathBuf)],
    cwd: &Path,
    worktree: &Path,
    env: &std::collections::BTreeMap<String, String>,
    sandbox: &troupe_process::Sandbox,
    cancel: &CancellationToken,
) -> Result<Vec<String>, Error> {
    let mut all: Vec<String> = names.to_vec();
    all.extend(others.iter().map(|(n, _)| n.clone()));
    all.sort();
    all.dedup();
    if all.is_empty() {
        return Ok(Vec::new());
    }
    let names_ref = &all;
    let output = Command::new(python)
        .args(["-c", ORIGIN_PROBE])
        .args(names_ref.iter().cloned())
        .cwd(cwd)
        .envs(env.clone())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .timeout(Duration::from_secs(60))
        .sandbox(sandbox.clone())
        .run(cancel)
        .await
        .map_err(|source| Error::process(python, source))?;
    if output.termination == Termination::Cancelled {
        return Err(Error::Cancelled);
    }
    // Only the standard library runs here: no answer means troupe cannot vouch for the source.
    let found: std::collections::BTreeMap<String, Option<Vec<String>>> =
        serde_json::from_str(output.stdout_text().trim()).map_err(|err| {
            Error::Internal(format!(
                "`{python}` did not say where the project's packages import from ({err}): {}",
                troupe_process::tail(&output.stderr_text(), 5, 1000)
            ))
        })?;
    Ok(judge(&found, names, others, worktree))
}

/// The packages of `found` (name → import locations) that come from outside `worktree`: any
/// of the tested project's `names`, and the repository's `others` when they resolve to a copy
/// of themselves. Returns `name: path` entries.
pub(crate) fn judge(
    found: &std::collections::BTreeMap<String, Option<Vec<String>>>,
    names: &[String],
    others: &[(String, PathBuf)],
    worktree: &Path,
) -> Vec<String> {
    let root = std::fs::canonicalize(worktree).unwrap_or_else(|_| worktree.to_path_buf());
    let mut outside = Vec::new();
    for (name, locations) in found {
        for location in locations.iter().flatten() {
            let path = std::fs::canonicalize(location).unwrap_or_else(|_| PathBuf::from(location));
            if path.starts_with(&root) || path.starts_with(worktree) {
                continue;
            }
            let own = names.contains(name);
            let copy = others
                .iter()
                .any(|(other, rel)| other == name && path.ends_with(rel));
            if own || copy {
                outside.push(format!("{name}: {}", path.display()));
            }
        }
    }
    outside.sort();
    outside.dedup();
    outside
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_specifiers() {
        assert!(satisfies(">=3.9", (3, 11)));
        assert!(!satisfies(">=3.12", (3, 11)));
        assert!(satisfies(">=3.8,<3.12", (3, 11)));
        assert!(!satisfies(">=3.8, <3.11", (3, 11)));
        assert!(satisfies("~=3.10", (3, 12)));
        assert!(satisfies("==3.11.*", (3, 11)));
        assert!(!satisfies("==3.11.*", (3, 12)));
        assert!(!satisfies("!=3.11.*", (3, 11)));
    }

    #[test]
    fn finds_packages_and_test_requirements() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        std::fs::create_dir_all(root.join("src/calc")).expect("mkdir");
        std::fs::write(root.join("src/calc/__init__.py"), "").expect("write");
        std::fs::create_dir_all(root.join("src/calc.egg-info")).expect("mkdir");
        std::fs::write(root.join("src/single.py"), "").expect("write");
        std::fs::create_dir_all(root.join("tests")).expect("mkdir");
        std::fs::write(
            root.join("pyproject.toml"),
            r#"[project]
name = "calc"
requires-python = ">=3.9"
dependencies = ["attrs>=23"]
[project.optional-dependencies]
test = ["pytest>=7", "calc[speed]"]
docs = ["sphinx"]
[dependency-groups]
lint = ["ruff"]
dev = ["pytest-cov", {include-group = "lint"}]
"#,
        )
        .expect("write");
        assert_eq!(import_roots(root), [root.join("src")]);
        assert_eq!(packages(root), ["calc", "single"]);
        let found: Vec<String> = all_packages(root)
            .iter()
            .map(|(n, p)| format!("{n}={}", p.display()))
            .collect();
        assert_eq!(found, ["calc=src/calc"]);
        assert_eq!(requires_python(root).as_deref(), Some(">=3.9"));
        let (requirements, selected) = test_requirements(root);
        assert_eq!(
            requirements,
            ["attrs>=23", "pytest-cov", "pytest>=7", "ruff"]
        );
        assert_eq!(selected, ["extra test", "group dev"]);
        // A `[project]` without a build system builds with setuptools (PEP 517's default).
        assert_eq!(
            build_requirements(root),
            Some(vec!["setuptools>=64".to_owned(), "wheel".to_owned()])
        );
    }

    #[test]
    fn build_requirements_come_from_the_build_system_or_not_at_all() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        assert_eq!(build_requirements(root), None);
        std::fs::write(root.join("pyproject.toml"), "[tool.pytest.ini_options]\n").expect("write");
        assert_eq!(build_requirements(root), None, "tool settings only");
        std::fs::write(
            root.join("pyproject.toml"),
            "[build-system]\nrequires = [\"hatchling\", \"hatch-vcs\"]\nbuild-backend = \"hatchling.build\"\n",
        )
        .expect("write");
        assert_eq!(
            build_requirements(root),
            Some(vec!["hatchling".to_owned(), "hatch-vcs".to_owned()])
        );
        std::fs::write(
            root.join("pyproject.toml"),
            "[build-system]\nrequires = [\"setuptools>=61\"]\n",
        )
        .expect("write");
        assert_eq!(
            build_requirements(root),
            Some(vec!["setuptools>=61".to_owned(), "wheel".to_owned()])
        );
        std::fs::remove_file(root.join("pyproject.toml")).expect("rm");
        std::fs::write(root.join("setup.py"), "").expect("write");
        assert!(build_requirements(root).is_some(), "a setup.py project");
    }
}
