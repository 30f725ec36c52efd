//! What a Python project says about itself: its packages (src or flat layout), the
//! interpreter it needs (`requires-python`), and its test dependencies (`[project]
//! dependencies`, test extras, PEP 735 dependency groups), read from `pyproject.toml`.
//!
//! The packages serve the "commit under test" rule: the worktree's `src` goes first on
//! `PYTHONPATH` (an editable install of another checkout then loses), and before the suite
//! runs the interpreter is asked where it would import each package from; one that resolves
//! outside the worktree fails the run as WRONG_SOURCE.

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

/// Import roots of the project: `src` when it holds packages, else the root.
pub(crate) fn src_dir(root: &Path) -> Option<PathBuf> {
    let src = root.join("src");
    let has_packages = std::fs::read_dir(&src).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            let path = e.path();
            (path.is_dir() && !e.file_name().to_string_lossy().ends_with(".egg-info"))
                || path.extension().is_some_and(|x| x == "py")
        })
    });
    has_packages.then_some(src)
}

/// Top-level import names of the project's own code: packages (directories with
/// `__init__.py`) and modules in `src/` or, for a flat layout, in the root (tests, docs and
/// build helpers left out).
pub(crate) fn packages(root: &Path) -> Vec<String> {
    let base = src_dir(root).unwrap_or_else(|| root.to_path_buf());
    let flat = base == root;
    let skip = [
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
    let mut names = Vec::new();
    let Ok(entries) = std::fs::read_dir(&base) else {
        return names;
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
        if module
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !skip.contains(&module.as_str())
        {
            names.push(module);
        }
    }
    names.sort();
    names
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

/// The interpreter for a run: `explicit` when given; else `default` when it satisfies the
/// project's `requires-python`; else the first `python3.N` on PATH that does (newest first).
/// Returns the interpreter and a note when it is not the default.
pub(crate) async fn choose_interpreter(
    explicit: Option<&str>,
    default: &str,
    root: &Path,
    cancel: &CancellationToken,
) -> Result<(String, Option<String>), Error> {
    if let Some(python) = explicit.filter(|p| !p.trim().is_empty()) {
        if version_of(python, cancel).await.is_none() {
            return Err(Error::NotInstalled(format!(
                "the requested Python interpreter `{python}` cannot run here"
            )));
        }
        return Ok((
            python.to_owned(),
            Some(format!("python: {python} (requested)")),
        ));
    }
    let Some(spec) = requires_python(root) else {
        return Ok((default.to_owned(), None));
    };
    if let Some(version) = version_of(default, cancel).await
        && satisfies(&spec, version)
    {
        return Ok((default.to_owned(), None));
    }
    for minor in (6..=15).rev() {
        let candidate = format!("python3.{minor}");
        if satisfies(&spec, (3, minor))
            && let Some(found) = version_of(&candidate, cancel).await
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

const ORIGIN_PROBE: &str = "import importlib.util, json, sys\n\
out = {}\n\
for name in sys.argv[1:]:\n\
    try:\n\
        spec = importlib.util.find_spec(name)\n\
    except Exception as err:\n\
        out[name] = None\n\
        continue\n\
    if spec is None:\n\
        out[name] = None\n\
    elif spec.submodule_search_locations:\n\
        out[name] = list(spec.submodule_search_locations)\n\
    else:\n\
        out[name] = [spec.origin]\n\
print(json.dumps(out))";

/// Asks `python` (in `cwd`, with the run's environment) where each of `names` would be
/// imported from; returns the locations outside `worktree`, as `name: path`.
pub(crate) async fn foreign_origins(
    python: &str,
    names: &[String],
    cwd: &Path,
    worktree: &Path,
    env: &std::collections::BTreeMap<String, String>,
    cancel: &CancellationToken,
) -> Result<Vec<String>, Error> {
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let output = Command::new(python)
        .args(["-c", ORIGIN_PROBE])
        .args(names.iter().cloned())
        .cwd(cwd)
        .envs(env.clone())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .timeout(Duration::from_secs(60))
        .run(cancel)
        .await
        .map_err(|source| Error::process(python, source))?;
    if output.termination == Termination::Cancelled {
        return Err(Error::Cancelled);
    }
    let found: std::collections::BTreeMap<String, Option<Vec<String>>> =
        serde_json::from_str(output.stdout_text().trim()).unwrap_or_default();
    let root = std::fs::canonicalize(worktree).unwrap_or_else(|_| worktree.to_path_buf());
    let mut outside = Vec::new();
    for (name, locations) in found {
        for location in locations.unwrap_or_default() {
            let path =
                std::fs::canonicalize(&location).unwrap_or_else(|_| PathBuf::from(&location));
            if !path.starts_with(&root) && !path.starts_with(worktree) {
                outside.push(format!("{name}: {}", path.display()));
            }
        }
    }
    Ok(outside)
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
        assert_eq!(src_dir(root), Some(root.join("src")));
        assert_eq!(packages(root), ["calc", "single"]);
        assert_eq!(requires_python(root).as_deref(), Some(">=3.9"));
        let (requirements, selected) = test_requirements(root);
        assert_eq!(
            requirements,
            ["attrs>=23", "pytest-cov", "pytest>=7", "ruff"]
        );
        assert_eq!(selected, ["extra test", "group dev"]);
    }
}
