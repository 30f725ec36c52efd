//! Integration tests: the executor against real git repositories and real agent processes.

mod clis;
mod credentials;
mod direct;
mod phase;
mod session;

use std::path::Path;

use prost_types::value::Kind;
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
    let Value::Object(map) = value else {
        panic!("expected an object")
    };
    prost_types::Struct {
        fields: map.iter().map(|(k, v)| (k.clone(), to_value(v))).collect(),
    }
}

fn to_value(value: &Value) -> prost_types::Value {
    let kind = match value {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(*b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().expect("finite")),
        Value::String(s) => Kind::StringValue(s.clone()),
        Value::Array(items) => Kind::ListValue(prost_types::ListValue {
            values: items.iter().map(to_value).collect(),
        }),
        Value::Object(_) => Kind::StructValue(to_struct(value)),
    };
    prost_types::Value { kind: Some(kind) }
}

/// `git show <rev>:<path>`, or `None` when absent.
pub(crate) fn show(repo: &Path, rev: &str, path: &str) -> Option<String> {
    troupe_testkit::git(repo, &["show", &format!("{rev}:{path}")]).ok()
}
