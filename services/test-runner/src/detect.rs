//! Which test framework a repository uses (test-frameworks.md §6).
//!
//! The package manager is `node::package_manager`; JS workspaces whose root names no tool are
//! detected from their packages.
//!
//! JavaScript: `scripts.test` naming jest or vitest (the strongest sign), then the
//! dependencies, then config files. Python: pytest configuration (`pytest.ini`,
//! `[tool.pytest.ini_options]`, `[tool:pytest]`, tox's `[pytest]`, a root `conftest.py`),
//! pytest in a requirements file, then `test_*.py` / `*_test.py` files in the root or `tests/`.

use std::path::Path;

use troupe_proto::v1::TestFramework;

use crate::Error;

/// Detects the framework of the repository checked out at `root`.
pub(crate) fn detect(root: &Path) -> Result<TestFramework, Error> {
    let js = detect_js(root).or_else(|| detect_workspace_packages(root));
    let python = python_signal(root);
    match (js, python) {
        (Some((framework, js_strength)), Some(py_strength)) => {
            if js_strength == py_strength {
                Err(Error::InvalidArgument(format!(
                    "the repository shows both {} and pytest; set the framework explicitly",
                    troupe_proto::names::name(framework)
                )))
            } else if js_strength > py_strength {
                Ok(framework)
            } else {
                Ok(TestFramework::Pytest)
            }
        }
        (Some((framework, _)), None) => Ok(framework),
        (None, Some(_)) => Ok(TestFramework::Pytest),
        (None, None) => Err(Error::InvalidArgument(
            "no test framework detected (no jest, vitest or pytest configuration or tests); set the framework explicitly"
                .to_owned(),
        )),
    }
}

/// Signal strengths: 3 = what the project says it runs / its config, 2 = a dependency,
/// 1 = test files only.
fn detect_js(root: &Path) -> Option<(TestFramework, u8)> {
    let package: Option<serde_json::Value> = std::fs::read_to_string(root.join("package.json"))
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok());
    if let Some(script) = package
        .as_ref()
        .and_then(|p| p.pointer("/scripts/test"))
        .and_then(|v| v.as_str())
    {
        if has_word(script, "vitest") {
            return Some((TestFramework::Vitest, 3));
        }
        if has_word(script, "jest") {
            return Some((TestFramework::Jest, 3));
        }
    }
    let exists_any = |stem: &str, exts: &[&str]| {
        exts.iter()
            .any(|ext| root.join(format!("{stem}.{ext}")).is_file())
    };
    if exists_any("vitest.config", &["ts", "mts", "cts", "js", "mjs", "cjs"]) {
        return Some((TestFramework::Vitest, 3));
    }
    if exists_any(
        "jest.config",
        &["js", "ts", "mjs", "cjs", "cts", "mts", "json"],
    ) || package.as_ref().is_some_and(|p| p.get("jest").is_some())
    {
        return Some((TestFramework::Jest, 3));
    }
    let has_dep = |dep: &str| {
        package.as_ref().is_some_and(|p| {
            ["dependencies", "devDependencies"]
                .iter()
                .any(|section| p.get(section).and_then(|s| s.get(dep)).is_some())
        })
    };
    if has_dep("vitest") {
        return Some((TestFramework::Vitest, 2));
    }
    if has_dep("jest") {
        return Some((TestFramework::Jest, 2));
    }
    None
}

/// A JS monorepo (package.json `workspaces` or `pnpm-workspace.yaml`) whose root names no
/// test tool: the first framework found in `packages/*` or `apps/*`, one signal weaker than the
/// package's own (the run still happens at the root, where hoisted binaries live).
fn detect_workspace_packages(root: &Path) -> Option<(TestFramework, u8)> {
    let workspace = root.join("pnpm-workspace.yaml").is_file()
        || std::fs::read_to_string(root.join("package.json"))
            .ok()
            .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
            .is_some_and(|p| p.get("workspaces").is_some());
    if !workspace {
        return None;
    }
    let mut packages: Vec<_> = ["packages", "apps"]
        .iter()
        .filter_map(|dir| std::fs::read_dir(root.join(dir)).ok())
        .flat_map(|entries| entries.flatten().map(|e| e.path()))
        .collect();
    packages.sort();
    packages
        .iter()
        .find_map(|dir| detect_js(dir))
        .map(|(framework, strength)| (framework, strength.saturating_sub(1).max(1)))
}

fn has_word(text: &str, word: &str) -> bool {
    text.split(|c: char| !c.is_ascii_alphanumeric() && c != '-' && c != '_')
        .any(|token| token == word)
}

fn python_signal(root: &Path) -> Option<u8> {
    let read = |name: &str| std::fs::read_to_string(root.join(name)).ok();
    let configured = root.join("pytest.ini").is_file()
        || root.join("conftest.py").is_file()
        || read("pyproject.toml").is_some_and(|t| {
            t.contains("[tool.pytest.ini_options]") || t.contains("[tool.pytest]")
        })
        || read("setup.cfg").is_some_and(|t| t.contains("[tool:pytest]"))
        || read("tox.ini").is_some_and(|t| t.contains("[pytest]"));
    if configured {
        return Some(3);
    }
    let listed = crate::venv::REQUIREMENT_FILES
        .iter()
        .filter_map(|name| read(name))
        .chain(read("pyproject.toml"))
        .any(|text| {
            text.lines()
                .any(|line| line.trim_start().starts_with("pytest") || line.contains("\"pytest"))
        });
    if listed {
        return Some(2);
    }
    let has_tests = [root.to_path_buf(), root.join("tests"), root.join("test")]
        .iter()
        .any(|dir| {
            std::fs::read_dir(dir).is_ok_and(|entries| {
                entries.flatten().any(|entry| {
                    let name = entry.file_name();
                    let name = name.to_string_lossy();
                    name.ends_with(".py")
                        && (name.starts_with("test_") || name.ends_with("_test.py"))
                })
            })
        });
    has_tests.then_some(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        for (path, content) in files {
            let path = dir.path().join(path);
            std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
            std::fs::write(path, content).expect("write");
        }
        dir
    }

    #[test]
    fn detects_each_framework() {
        let py = repo(&[("tests/test_a.py", "def test_a(): pass\n")]);
        assert_eq!(detect(py.path()).expect("pytest"), TestFramework::Pytest);
        let jest = repo(&[("package.json", r#"{"scripts": {"test": "jest --ci"}}"#)]);
        assert_eq!(detect(jest.path()).expect("jest"), TestFramework::Jest);
        let vitest = repo(&[(
            "package.json",
            r#"{"devDependencies": {"vitest": "4.1.12"}}"#,
        )]);
        assert_eq!(
            detect(vitest.path()).expect("vitest"),
            TestFramework::Vitest
        );
        // A JS tool repo with a helper Python test file: the package's own test script wins.
        let mixed = repo(&[
            ("package.json", r#"{"scripts": {"test": "vitest run"}}"#),
            ("test_tool.py", ""),
        ]);
        assert_eq!(detect(mixed.path()).expect("vitest"), TestFramework::Vitest);
        // A workspace root without a test tool: the packages say which.
        let mono = repo(&[
            (
                "package.json",
                r#"{"private": true, "workspaces": ["packages/*"]}"#,
            ),
            (
                "packages/a/package.json",
                r#"{"devDependencies": {"vitest": "4.1.12"}}"#,
            ),
        ]);
        assert_eq!(detect(mono.path()).expect("vitest"), TestFramework::Vitest);
        let empty = repo(&[("README.md", "hi")]);
        assert!(matches!(
            detect(empty.path()),
            Err(Error::InvalidArgument(_))
        ));
    }
}
