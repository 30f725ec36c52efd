//! The files a plan brings along to workers that cannot see its directory: what its tasks name
//! through `{plan_dir}` (an agent script, with the rest of its folder when it has one of its
//! own) and each EXEC task's phase directory. See `troupe_grpc::assets` for the way there.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use troupe_proto::v1::PlanAsset;

/// Folders that are never plan assets: version control, caches, installed dependencies.
const SKIPPED: &[&str] = &[".git", "node_modules", "__pycache__", ".venv", ".troupe"];

/// The files of `base_dir` that the plan `plan_json` refers to, checked against the limits.
pub fn collect(plan_json: &str, base_dir: &Path) -> Result<Vec<PlanAsset>, String> {
    let plan: Value = serde_json::from_str(plan_json).map_err(|err| err.to_string())?;
    let mut roots: Vec<PathBuf> = Vec::new();
    let mut strings = Vec::new();
    gather_strings(&plan, &mut strings);
    for text in strings {
        roots.extend(references(text, base_dir));
    }
    for task in plan["tasks"].as_array().into_iter().flatten() {
        let phase = match &task["phase"] {
            Value::Number(n) => Some(format!("phase-{n}")),
            Value::String(s) if !s.is_empty() && s.chars().all(|c| c.is_ascii_digit()) => {
                Some(format!("phase-{s}"))
            }
            Value::String(s) if !s.trim().is_empty() && !s.contains("..") => {
                Some(s.trim().to_owned())
            }
            _ => None,
        };
        if let Some(phase) = phase {
            roots.push(base_dir.join(phase));
        }
    }
    let mut files = BTreeMap::new();
    // Files brought along may name more (an EXEC phase's task files name their agents): follow
    // their references too, until nothing new turns up.
    let mut walked = std::collections::HashSet::new();
    while !roots.is_empty() {
        for root in std::mem::take(&mut roots) {
            if walked.insert(root.clone()) {
                walk(base_dir, &root, &mut files)?;
            }
        }
        for asset in files.values() {
            if let Ok(text) = std::str::from_utf8(&asset.content) {
                roots.extend(
                    references(text, base_dir)
                        .into_iter()
                        .filter(|root| !walked.contains(root)),
                );
            }
        }
    }
    let assets: Vec<PlanAsset> = files.into_values().collect();
    // The coordinator checks the same limits; say it here before sending megabytes.
    troupe_grpc::assets::bundle(assets.clone())?;
    Ok(assets)
}

/// What `text` names through `{plan_dir}/…`: each file, or its folder when it has one of its
/// own (a script may import its neighbours).
fn references(text: &str, base_dir: &Path) -> Vec<PathBuf> {
    let mut roots = Vec::new();
    for reference in text.split("{plan_dir}/").skip(1) {
        let relative: String = reference
            .chars()
            .take_while(|c| !c.is_whitespace() && !matches!(c, '"' | '\'' | ';' | '&' | '|' | ','))
            .collect();
        if relative.is_empty() || relative.split('/').any(|part| part == "..") {
            continue;
        }
        let path = base_dir.join(&relative);
        roots.push(match path.parent() {
            Some(parent) if path.is_file() && parent != base_dir => parent.to_path_buf(),
            _ => path,
        });
    }
    roots
}

fn gather_strings<'a>(value: &'a Value, out: &mut Vec<&'a str>) {
    match value {
        Value::String(text) => out.push(text),
        Value::Array(items) => items.iter().for_each(|item| gather_strings(item, out)),
        Value::Object(map) => map.values().for_each(|item| gather_strings(item, out)),
        _ => {}
    }
}

/// Adds `path` (a file, or a folder's files) to `files`, keyed by the path relative to
/// `base`; symbolic links and skipped folders are left out, and a missing path is the task's
/// own business (it fails as it would have on this machine).
fn walk(base: &Path, path: &Path, files: &mut BTreeMap<String, PlanAsset>) -> Result<(), String> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if meta.file_type().is_symlink() {
        return Ok(());
    }
    if meta.is_dir() {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if SKIPPED.contains(&name) && path != base {
            return Ok(());
        }
        let entries =
            std::fs::read_dir(path).map_err(|err| format!("{}: {err}", path.display()))?;
        for entry in entries.flatten() {
            walk(base, &entry.path(), files)?;
        }
        return Ok(());
    }
    let Ok(relative) = path.strip_prefix(base) else {
        return Ok(());
    };
    let Some(relative) = relative.to_str().map(str::to_owned) else {
        return Err(format!("{} is not a UTF-8 path", path.display()));
    };
    if files.contains_key(&relative) {
        return Ok(());
    }
    if files.len() >= troupe_grpc::assets::MAX_FILES {
        return Err(format!(
            "the plan refers to more than {} files through {{plan_dir}}; put the rest in a repository",
            troupe_grpc::assets::MAX_FILES
        ));
    }
    let content = std::fs::read(path).map_err(|err| format!("{}: {err}", path.display()))?;
    use std::os::unix::fs::PermissionsExt;
    files.insert(
        relative.clone(),
        PlanAsset {
            path: relative,
            content,
            executable: meta.permissions().mode() & 0o111 != 0,
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn referenced_scripts_their_folders_and_phases_travel() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path();
        for (path, text) in [
            ("agents/add.py", "import helper"),
            ("agents/helper.py", "x = 1"),
            ("agents/__pycache__/helper.pyc", "junk"),
            ("top.py", "print()"),
            ("phase-1/.task/IMPL-101.json", "{}"),
            ("unrelated/big.bin", "no"),
            ("repo/app.py", "template"),
        ] {
            let path = base.join(path);
            std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
            std::fs::write(path, text).expect("write");
        }
        let plan = serde_json::json!({"name": "p", "repos": {"app": {"template": "repo"}}, "tasks": [
            {"id": "IMPL-1", "agent": {"command": ["python3", "{plan_dir}/agents/add.py", "{worktree}"]}},
            {"id": "IMPL-2", "agent": {"command": ["python3", "{plan_dir}/top.py"]}},
            {"id": "EXEC-1", "phase": 1}
        ]});
        let assets = collect(&plan.to_string(), base).expect("collect");
        let paths: Vec<&str> = assets.iter().map(|a| a.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "agents/add.py",
                "agents/helper.py",
                "phase-1/.task/IMPL-101.json",
                "top.py"
            ]
        );
    }
}
