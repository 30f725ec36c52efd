//! "Test exactly the commit asked for": what the suite imports must come from the run's
//! worktree, never from the user's checkout or another copy of the code.
//!
//! Two ways it goes wrong in practice, both seen on real projects: a workspace link in a
//! reused `node_modules` (`@scope/pkg -> ../../packages/pkg`) resolves into the checkout the
//! link was made in, and an editable install (`pip install -e .` of a src layout) makes the
//! interpreter import the checkout's package. troupe prevents both (workspace links are
//! re-made inside the worktree, the worktree's `src` goes first on `PYTHONPATH`) and checks
//! both: a workspace link that still leaves the worktree, a project package that imports from
//! elsewhere, or a covered file outside the worktree fails the run as WRONG_SOURCE, naming the
//! paths.

use std::path::{Component, Path, PathBuf};

/// Whether `path` has a `node_modules` component (an installed package, not project source).
fn in_node_modules(path: &Path) -> bool {
    path.components()
        .any(|c| matches!(c, Component::Normal(name) if name == "node_modules"))
}

/// Lexically normalised `path` (`..` and `.` removed), for links whose target may not exist.
fn normalise(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// Where the symlink at `link` points, absolute (its target resolved against its directory,
/// then through every symlink on the way when the target exists).
pub(crate) fn link_target(link: &Path) -> Option<PathBuf> {
    let target = std::fs::read_link(link).ok()?;
    let joined = if target.is_absolute() {
        target
    } else {
        link.parent()?.join(target)
    };
    Some(std::fs::canonicalize(&joined).unwrap_or_else(|_| normalise(&joined)))
}

/// Workspace links that leave `worktree`: symlinks in the worktree's `node_modules` trees (the
/// root's and each workspace package's, one scope level deep, `.bin` included) whose target is
/// project source (not inside a `node_modules`) outside the worktree. Returned as
/// `link -> target`.
pub(crate) fn escaping_workspace_links(worktree: &Path, package_dirs: &[PathBuf]) -> Vec<String> {
    let root = std::fs::canonicalize(worktree).unwrap_or_else(|_| worktree.to_path_buf());
    let mut found = Vec::new();
    let mut dirs = vec![worktree.to_path_buf()];
    dirs.extend(package_dirs.iter().map(|p| worktree.join(p)));
    for dir in dirs {
        let modules = dir.join("node_modules");
        let Ok(entries) = std::fs::read_dir(&modules) else {
            continue;
        };
        let mut candidates = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let path = entry.path();
            let is_dir = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
            if is_dir && (name.starts_with('@') || name == ".bin") {
                if let Ok(inner) = std::fs::read_dir(&path) {
                    candidates.extend(inner.flatten().map(|e| e.path()));
                }
            } else {
                candidates.push(path);
            }
        }
        for link in candidates {
            if !std::fs::symlink_metadata(&link).is_ok_and(|m| m.file_type().is_symlink()) {
                continue;
            }
            let Some(target) = link_target(&link) else {
                continue;
            };
            if !target.starts_with(&root) && !in_node_modules(&target) {
                found.push(format!("{} -> {}", link.display(), target.display()));
            }
        }
    }
    found.sort();
    found
}

/// Covered files that are not inside the worktree: absolute paths outside it, or relative
/// paths climbing out of it. `base` is what relative names are relative to.
pub(crate) fn outside_files<'a>(
    files: impl IntoIterator<Item = &'a String>,
    worktree: &Path,
    base: &Path,
) -> Vec<String> {
    let root = std::fs::canonicalize(worktree).unwrap_or_else(|_| worktree.to_path_buf());
    let mut outside: Vec<String> = files
        .into_iter()
        .filter_map(|name| {
            let path = Path::new(name);
            let full = if path.is_absolute() {
                path.to_path_buf()
            } else {
                base.join(path)
            };
            let full = std::fs::canonicalize(&full).unwrap_or_else(|_| normalise(&full));
            (!full.starts_with(&root) && !full.starts_with(worktree))
                .then(|| full.display().to_string())
        })
        .collect();
    outside.sort();
    outside.dedup();
    outside
}

/// The warning that goes with WRONG_SOURCE.
pub(crate) fn wrong_source_warning(what: &str, paths: &[String]) -> String {
    let shown: Vec<&str> = paths.iter().take(10).map(String::as_str).collect();
    let more = paths.len().saturating_sub(shown.len());
    format!(
        "wrong source: {what} outside the run's worktree, so the results would describe other code than the commit under test: {}{}",
        shown.join(", "),
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_links_into_another_checkout_only() {
        let checkout = tempfile::tempdir().expect("tempdir");
        let worktree = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(checkout.path().join("packages/a")).expect("mkdir");
        std::fs::create_dir_all(checkout.path().join("node_modules/jest")).expect("mkdir");
        let modules = worktree.path().join("node_modules");
        std::fs::create_dir_all(modules.join("@fx")).expect("mkdir");
        std::fs::create_dir_all(worktree.path().join("packages/b")).expect("mkdir");
        // Escapes: into the checkout's source.
        std::os::unix::fs::symlink(checkout.path().join("packages/a"), modules.join("@fx/a"))
            .expect("link");
        // Fine: inside the worktree, relative.
        std::os::unix::fs::symlink("../../packages/b", modules.join("@fx/b")).expect("link");
        // Fine: an installed package elsewhere.
        std::os::unix::fs::symlink(
            checkout.path().join("node_modules/jest"),
            modules.join("jest"),
        )
        .expect("link");
        let found = escaping_workspace_links(worktree.path(), &[]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("@fx/a ->"), "{found:?}");
    }

    #[test]
    fn files_outside_the_worktree_are_named() {
        let worktree = tempfile::tempdir().expect("tempdir");
        let files = [
            "src/a.py".to_owned(),
            format!("{}/src/b.js", worktree.path().display()),
            "/elsewhere/src/c.py".to_owned(),
            "../checkout/d.py".to_owned(),
        ];
        let outside = outside_files(&files, worktree.path(), worktree.path());
        assert_eq!(outside.len(), 2, "{outside:?}");
        assert!(outside.contains(&"/elsewhere/src/c.py".to_owned()));
    }
}
