//! Paths a task may touch: inside its worktree, whatever the spelling. One rule for the
//! executor (pre_analysis, file edits), the agent loop's tools and the validator's checks.

use std::path::{Component, Path, PathBuf};

/// `path` as a relative path that stays inside its root, lexically: `.` dropped, `..` folded,
/// `None` when it is empty, absolute or climbs out.
#[must_use]
pub fn relative_inside(path: &str) -> Option<PathBuf> {
    let mut clean = PathBuf::new();
    for component in Path::new(path).components() {
        match component {
            Component::Normal(part) => clean.push(part),
            Component::CurDir => {}
            Component::ParentDir => {
                if !clean.pop() {
                    return None;
                }
            }
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    (!path.is_empty()).then_some(clean)
}

/// Resolves `path` inside `root` (canonical), refusing anything that escapes it (`..`, an
/// absolute path elsewhere, a symlink leading out) and the `.git` entry.
pub fn confine(root: &Path, path: &str) -> Result<PathBuf, String> {
    let relative = match Path::new(path).strip_prefix(root) {
        Ok(rest) => rest.display().to_string(),
        Err(_) if Path::new(path).is_absolute() => {
            return Err(format!("path {path} is outside the worktree"));
        }
        Err(_) => path.to_owned(),
    };
    let clean = if relative.is_empty() {
        PathBuf::new()
    } else {
        relative_inside(&relative).ok_or_else(|| format!("path {path} escapes the worktree"))?
    };
    let full = root.join(&clean);
    // A symlink inside the worktree must not lead out of it: check the deepest existing part.
    let mut existing = full.as_path();
    while !existing.exists() {
        match existing.parent() {
            Some(parent) => existing = parent,
            None => break,
        }
    }
    let real = existing
        .canonicalize()
        .map_err(|err| format!("cannot resolve {path}: {err}"))?;
    if !real.starts_with(root) {
        return Err(format!("path {path} leads outside the worktree"));
    }
    if clean.components().next() == Some(Component::Normal(".git".as_ref())) {
        return Err("the .git entry is off limits".to_owned());
    }
    Ok(full)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_stay_inside_lexically() {
        assert_eq!(
            relative_inside("./src/../a.py"),
            Some(PathBuf::from("a.py"))
        );
        assert_eq!(relative_inside("src/a.py"), Some(PathBuf::from("src/a.py")));
        assert_eq!(relative_inside("../a.py"), None);
        assert_eq!(relative_inside("src/../../a.py"), None);
        assert_eq!(relative_inside("/etc/passwd"), None);
        assert_eq!(relative_inside(""), None);
    }
}
