//! Integration tests: the executor against real git repositories and real agent processes.

mod clis;
mod credentials;
mod direct;
pub(crate) mod fixture;
mod phase;
mod session;

use serde_json::Value;

/// A plan directory with one agent script, `agent.py`, which applies the edits listed in its
/// arguments: `path=content` pairs, relative to the worktree given as the first argument.
/// `--fail` makes it exit 3 with a message on stderr; `--barrier DIR N` makes it wait until
/// N agents have reached the barrier (so concurrent tasks start from the same base);
/// `--keep-prompt` saves the prompt it read on stdin as `.prompt-seen`.
pub(crate) fn plan_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = r#"
import os, sys, time
args = sys.argv[1:]
worktree = args.pop(0)
prompt = sys.stdin.read()
keep_prompt = "--keep-prompt" in args
if keep_prompt:
    args.remove("--keep-prompt")
if "--fail" in args:
    print("agent is unhappy", file=sys.stderr)
    sys.exit(3)
if "--barrier" in args:
    i = args.index("--barrier")
    barrier, count = args[i + 1], int(args[i + 2])
    del args[i:i + 3]
    open(os.path.join(barrier, str(os.getpid())), "w").close()
    deadline = time.time() + 20
    while len(os.listdir(barrier)) < count:
        if time.time() > deadline:
            sys.exit("barrier timeout")
        time.sleep(0.02)
for edit in args:
    path, content = edit.split("=", 1)
    full = os.path.join(worktree, path)
    os.makedirs(os.path.dirname(full) or ".", exist_ok=True)
    with open(full, "w") as f:
        f.write(content + "\n")
if keep_prompt:
    with open(os.path.join(worktree, ".prompt-seen"), "w") as f:
        f.write(prompt)
print("edited", len(args), "files")
"#;
    std::fs::write(dir.path().join("agent.py"), script).expect("write agent");
    dir
}

/// A JSON object as a protobuf `Struct`.
pub(crate) fn to_struct(value: &Value) -> prost_types::Struct {
    troupe_proto::json::to_struct(value)
}

pub(crate) use fixture::show;
