//! Fixture repositories: a copy of `tests/fixtures/<name>` committed into a fresh git repo,
//! with the fixture's installed `node_modules` linked in (untracked, as in a real checkout).

use std::path::{Path, PathBuf};

use troupe_testkit::git;

/// `services/test-runner/tests/fixtures/<name>`. Named from the workspace root: tests/e2e
/// (also two levels down) includes this module for its cross-service test-runner tests.
pub(crate) fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../services/test-runner/tests/fixtures")
        .join(name)
}

/// A fake fixing agent run by the `command` backend: applies `path old new` triples to the
/// worktree after checking it was given a fix prompt.
pub(crate) const EDIT_AGENT: &str = r#"import sys
worktree, edits = sys.argv[1], sys.argv[2:]
prompt = sys.stdin.read()
assert "PURPOSE: Fix failing tests" in prompt, prompt
for i in range(0, len(edits), 3):
    path, old, new = edits[i:i + 3]
    full = f"{worktree}/{path}"
    text = open(full).read()
    assert old in text, (path, old)
    open(full, "w").write(text.replace(old, new))
"#;

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

/// Commits `edits` (`(path, old, new)` replacements) on a new branch `branch` from `HEAD`,
/// through a temporary worktree: the repository's own checkout is not touched. Returns the
/// commit.
pub(crate) fn commit_on_branch(repo: &Path, branch: &str, edits: &[(&str, &str, &str)]) -> String {
    let scratch = tempfile::tempdir().expect("tempdir");
    let wt = scratch.path().join("wt");
    let wt_text = wt.display().to_string();
    git(
        repo,
        &["worktree", "add", "-q", "-b", branch, &wt_text, "HEAD"],
    )
    .expect("worktree");
    for (path, old, new) in edits {
        let file = wt.join(path);
        let text = std::fs::read_to_string(&file).expect("read");
        assert!(text.contains(old), "{path} has no {old:?}");
        std::fs::write(&file, text.replacen(old, new, 1)).expect("write");
    }
    git(&wt, &["commit", "-q", "-am", "task: a one-line change"]).expect("commit");
    let commit = git(&wt, &["rev-parse", "HEAD"]).expect("rev-parse");
    git(repo, &["worktree", "remove", "--force", &wt_text]).expect("remove worktree");
    commit.trim().to_owned()
}

/// A clean checkout of `rev` next to the repository (a detached worktree in a temp dir), for
/// running the framework directly at that commit.
pub(crate) fn checkout_of(repo: &Path, rev: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("co");
    git(
        repo,
        &[
            "worktree",
            "add",
            "-q",
            "--detach",
            &path.display().to_string(),
            rev,
        ],
    )
    .expect("worktree");
    dir
}

/// `node_modules` as npm lays it out for a workspace: the installed packages of `installed`
/// (each entry linked), plus relative workspace links such as `@fx/a -> ../../packages/a`,
/// which resolve into `dir` itself.
pub(crate) fn npm_like_modules(dir: &Path, installed: &Path, workspace: &[(&str, &str)]) {
    let modules = dir.join("node_modules");
    std::fs::create_dir_all(&modules).expect("mkdir node_modules");
    for entry in std::fs::read_dir(installed).expect("installed node_modules") {
        let entry = entry.expect("entry");
        std::os::unix::fs::symlink(entry.path(), modules.join(entry.file_name())).expect("link");
    }
    for (name, target) in workspace {
        let at = modules.join(name);
        std::fs::create_dir_all(at.parent().expect("scope")).expect("mkdir scope");
        std::os::unix::fs::symlink(target, &at).expect("workspace link");
    }
}

/// The Python with pytest and its plugins that scripts/setup/10-python-tools.sh installs.
pub(crate) fn tools_python() -> PathBuf {
    if let Ok(python) = std::env::var("TROUPE_TEST_PYTHON") {
        return PathBuf::from(python);
    }
    let fallback = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tools/venv/bin/python");
    assert!(
        fallback.is_file(),
        "run scripts/setup/10-python-tools.sh (or scripts/test) first: {} is missing",
        fallback.display()
    );
    fallback
}

/// Runs a fixture command (std::process is fine here) and returns its output.
pub(crate) fn run(
    program: &Path,
    args: &[&str],
    cwd: &Path,
    env: &[(&str, String)],
) -> std::process::Output {
    std::process::Command::new(program)
        .args(args)
        .current_dir(cwd)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap_or_else(|err| panic!("running {}: {err}", program.display()))
}

/// A user's interpreter: a venv on the tools Python (its packages visible through a `.pth`)
/// with `project` installed editable (`pip install -e`, setuptools' own editable install).
pub(crate) fn editable_interpreter(dir: &Path, project: &Path) -> PathBuf {
    let tools = tools_python();
    let venv = dir.join("user-venv");
    let out = run(
        &tools,
        &["-m", "venv", "--without-pip", &venv.display().to_string()],
        dir,
        &[],
    );
    assert!(out.status.success(), "venv: {out:?}");
    let python = venv.join("bin/python");
    let purelib = |python: &Path| {
        let out = run(
            python,
            &[
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ],
            dir,
            &[],
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let tools_site = purelib(&tools);
    let site = PathBuf::from(purelib(&python));
    std::fs::create_dir_all(&site).expect("site-packages");
    std::fs::write(site.join("troupe-tools.pth"), format!("{tools_site}\n")).expect("pth");
    let out = run(
        &python,
        &[
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-build-isolation",
            "-e",
            &project.display().to_string(),
        ],
        dir,
        &[],
    );
    assert!(out.status.success(), "pip install -e: {out:?}");
    python
}
