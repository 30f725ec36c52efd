//! Fixture repositories: a copy of `tests/fixtures/<name>` committed into a fresh git repo,
//! with the fixture's installed `node_modules` linked in (untracked, as in a real checkout).

use std::path::{Path, PathBuf};

use troupe_testkit::git;

/// `tests/fixtures/<name>`.
pub(crate) fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read fixture") {
        let entry = entry.expect("entry");
        let name = entry.file_name();
        if name == "node_modules" || name == "scenarios" {
            continue;
        }
        let target = to.join(&name);
        if entry.file_type().expect("type").is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
        }
    }
}

/// A git repo holding the fixture `name`; `scenarios` are `(scenario file, destination)` pairs
/// copied in before the commit (with `__PID_FILE__` replaced by `pid_file`), `remove` paths are
/// deleted first.
pub(crate) fn fixture_repo(
    name: &str,
    remove: &[&str],
    scenarios: &[(&str, &str)],
    pid_file: Option<&Path>,
) -> tempfile::TempDir {
    let src = fixture_dir(name);
    let dir = tempfile::tempdir().expect("tempdir");
    copy_tree(&src, dir.path());
    for path in remove {
        std::fs::remove_file(dir.path().join(path)).expect("remove fixture file");
    }
    for (scenario, dest) in scenarios {
        let text = std::fs::read_to_string(src.join("scenarios").join(scenario)).expect("scenario");
        let text = match pid_file {
            Some(pid) => text.replace("__PID_FILE__", &pid.display().to_string()),
            None => text,
        };
        std::fs::write(dir.path().join(dest), text).expect("write scenario");
    }
    std::fs::write(dir.path().join(".gitignore"), "node_modules\n").expect("gitignore");
    let modules = src.join("node_modules");
    if modules.is_dir() {
        std::os::unix::fs::symlink(&modules, dir.path().join("node_modules")).expect("link");
    }
    git(dir.path(), &["init", "-q", "-b", "main"]).expect("git init");
    git(dir.path(), &["add", "-A"]).expect("git add");
    git(
        dir.path(),
        &[
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-q",
            "-m",
            "fixture",
        ],
    )
    .expect("git commit");
    dir
}

/// A file of the run's output directory listed in the report.
pub(crate) fn report_file(report: &troupe_proto::v1::TestRunReport, suffix: &str) -> PathBuf {
    PathBuf::from(
        report
            .report_paths
            .iter()
            .find(|p| p.ends_with(suffix))
            .unwrap_or_else(|| panic!("{suffix} not in {:?}", report.report_paths)),
    )
}

/// Parses a JSON file.
pub(crate) fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("read json")).expect("json")
}

/// Whether `pid` is gone (or a zombie nobody reaped, which runs nothing).
pub(crate) fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}
