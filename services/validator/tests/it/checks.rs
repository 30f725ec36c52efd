//! Syntax and lint checks by language on real small projects: a good commit passes every
//! check, a bad commit on top fails every one with the tool's file:line.

use troupe_proto::v1::{CheckStatus, ValidateRequest, Verdict};
use troupe_testkit::git_repo;

use crate::{by_name, commit, start, validate};

const TSCONFIG: &str = r#"{
  // comments are allowed here: tsc reads JSONC
  "compilerOptions": { "strict": true, "noEmit": true, "target": "es2020", "module": "commonjs" },
  "include": ["src"]
}
"#;

const PACKAGE: &str = r#"{"name": "fixture", "version": "1.0.0", "private": true, "scripts": {"lint": "node lint.js"}}
"#;

/// A linter the repo configures through `npm run lint`: no `var` in src/ and *.js.
const LINT_JS: &str = r#"const fs = require("fs");
let bad = 0;
for (const f of fs.readdirSync("src").map((n) => "src/" + n).concat(fs.readdirSync(".").filter((n) => n.endsWith(".js")))) {
  fs.readFileSync(f, "utf8").split("\n").forEach((line, i) => {
    if (/^\s*var /.test(line)) { console.log(`${f}:${i + 1}: use let or const, not var`); bad++; }
  });
}
process.exit(bad ? 1 : 0);
"#;

const CARGO_TOML: &str = r#"[package]
name = "fixture"
version = "0.1.0"
edition = "2021"

[workspace]

[lints.clippy]
all = "deny"
"#;

#[tokio::test]
async fn syntax_and_lint_pass_on_good_files_and_fail_on_bad_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = git_repo(
        dir.path(),
        &[
            ("README.md", "fixture\n"),
            ("tsconfig.json", TSCONFIG),
            ("package.json", PACKAGE),
            ("lint.js", LINT_JS),
            ("ruff.toml", "line-length = 100\n"),
            (".flake8", "[flake8]\nmax-line-length = 100\n"),
            ("crate/Cargo.toml", CARGO_TOML),
            ("crate/src/lib.rs", "pub fn one() -> u32 {\n    1\n}\n"),
        ],
    )
    .expect("repo");
    let good = commit(
        dir.path(),
        &[
            ("src/a.ts", "export const n: number = 1;\n"),
            ("good.js", "const x = 1;\nmodule.exports = { x };\n"),
            ("good.py", "def f(x):\n    return x + 1\n"),
            ("good.json", "{\"a\": [1, 2]}\n"),
            ("good.toml", "a = 1\n[b]\nc = \"d\"\n"),
            ("good.yaml", "a: [1, 2]\nb:\n  c: d\n"),
            (
                "crate/src/lib.rs",
                "pub fn one() -> u32 {\n    1\n}\n\npub fn two() -> u32 {\n    2\n}\n",
            ),
        ],
        "good",
    );
    let bad = commit(
        dir.path(),
        &[
            ("src/b.ts", "export const s: number = \"not a number\";\n"),
            ("bad.js", "var y = 1;\nfunction (\n"),
            ("bad.py", "import os\n\ndef f(:\n    pass\n"),
            ("lint_only.py", "import os\n"),
            ("bad.json", "{\"a\": }\n"),
            ("bad.toml", "a = 1\nb = \n"),
            ("bad.yaml", "a: [1, 2\nb: c\n"),
            (
                "crate/src/lib.rs",
                "pub fn one() -> u32 {\n    \"one\"\n}\n",
            ),
        ],
        "bad",
    );
    let (service, _data) = start(None).await;
    let repo = dir.path().display().to_string();

    let report = validate(
        &service,
        ValidateRequest {
            repo_path: repo.clone(),
            r#ref: good.clone(),
            base_ref: root.clone(),
            syntax: true,
            timeout_seconds: 240,
            ..ValidateRequest::default()
        },
    )
    .await
    .expect("validate good");
    let checks = by_name(&report);
    for name in [
        "syntax:tsc:tsconfig.json",
        "syntax:good.js",
        "syntax:good.py",
        "syntax:good.json",
        "syntax:good.toml",
        "syntax:good.yaml",
        "syntax:cargo:crate/Cargo.toml",
        "lint:npm",
        "lint:ruff",
        "lint:flake8",
        "lint:clippy:crate/Cargo.toml",
    ] {
        let check = checks
            .get(name)
            .unwrap_or_else(|| panic!("no check {name} in {report:#?}"));
        assert_eq!(
            check.status(),
            CheckStatus::Pass,
            "{name}: {}",
            check.evidence
        );
    }
    assert_eq!(report.verdict(), Verdict::Pass, "{report:#?}");

    let report = validate(
        &service,
        ValidateRequest {
            repo_path: repo.clone(),
            r#ref: bad.clone(),
            base_ref: good.clone(),
            syntax: true,
            timeout_seconds: 240,
            ..ValidateRequest::default()
        },
    )
    .await
    .expect("validate bad");
    let checks = by_name(&report);
    let expect_fail = |name: &str, place: &str| {
        let check = checks
            .get(name)
            .unwrap_or_else(|| panic!("no check {name} in {report:#?}"));
        assert_eq!(
            check.status(),
            CheckStatus::Fail,
            "{name}: {}",
            check.evidence
        );
        assert!(
            check.evidence.contains(place),
            "{name} should cite {place}: {}",
            check.evidence
        );
    };
    expect_fail("syntax:tsc:tsconfig.json", "src/b.ts:1");
    expect_fail("syntax:bad.js", "bad.js:2");
    expect_fail("syntax:bad.py", "bad.py\", line 3");
    expect_fail("syntax:bad.json", "bad.json:1");
    expect_fail("syntax:bad.toml", "bad.toml:2");
    expect_fail("syntax:bad.yaml", "bad.yaml\", line");
    expect_fail("syntax:cargo:crate/Cargo.toml", "src/lib.rs:2");
    expect_fail("lint:npm", "bad.js:1");
    expect_fail("lint:ruff", "lint_only.py:1");
    expect_fail("lint:flake8", "lint_only.py:1");
    expect_fail("lint:clippy:crate/Cargo.toml", "src/lib.rs:2");
    // lint_only.py is valid Python: only the linters object to it.
    assert_eq!(checks["syntax:lint_only.py"].status(), CheckStatus::Pass);
    assert_eq!(report.verdict(), Verdict::Fail);

    // Without a tsconfig a .ts file is skipped (with the reason), and nothing configures a
    // linter for a plain text change: one SKIPPED lint check.
    let plain = tempfile::tempdir().expect("tempdir");
    let base = git_repo(plain.path(), &[("README.md", "x\n")]).expect("repo");
    let head = commit(
        plain.path(),
        &[("x.ts", "export const a = 1;\n"), ("notes.txt", "hi\n")],
        "ts",
    );
    let report = validate(
        &service,
        ValidateRequest {
            repo_path: plain.path().display().to_string(),
            r#ref: head,
            base_ref: base,
            syntax: true,
            ..ValidateRequest::default()
        },
    )
    .await
    .expect("validate plain");
    let checks = by_name(&report);
    assert_eq!(checks["syntax:x.ts"].status(), CheckStatus::Skipped);
    assert!(checks["syntax:x.ts"].evidence.contains("no tsconfig.json"));
    assert_eq!(checks["lint"].status(), CheckStatus::Skipped);
    assert_eq!(report.verdict(), Verdict::Pass, "{report:#?}");
    service.stop().await;
}

/// A lint tool the repository brings (`npm run lint` runs its `lint.js`) runs confined: it
/// may read the worktree but write neither into it nor outside it (only its own home); the
/// kernel refuses both writes and the check's evidence names the refusal.
#[tokio::test]
async fn a_repository_lint_script_runs_read_only() {
    if troupe_process::sandbox::landlock_abi().is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI runs on a kernel with Landlock"
        );
        return;
    }
    let outside = tempfile::tempdir().expect("tempdir");
    let escaped = outside.path().join("escaped.txt");
    let dir = tempfile::tempdir().expect("tempdir");
    let lint = format!(
        r#"const fs = require("fs");
const os = require("os");
let refused = 0;
// Its own TMPDIR is writable.
fs.writeFileSync(os.tmpdir() + "/scratch.txt", "ok");
for (const path of ["written-by-lint.txt", {escaped:?}]) {{
  try {{
    fs.writeFileSync(path, "pwned");
    console.log("wrote " + path);
  }} catch (err) {{
    console.error(err.message);
    refused += 1;
  }}
}}
console.log(fs.readFileSync("index.js", "utf8").length > 0 ? "read the worktree" : "empty");
process.exit(refused > 0 ? 1 : 0);
"#,
        escaped = escaped.display().to_string()
    );
    let root = git_repo(dir.path(), &[("README.md", "x\n")]).expect("repo");
    let head = commit(
        dir.path(),
        &[
            ("package.json", PACKAGE),
            ("lint.js", &lint),
            ("index.js", "const a = 1;\nmodule.exports = a;\n"),
        ],
        "lint",
    );
    let (service, _data) = start(None).await;
    let report = validate(
        &service,
        ValidateRequest {
            repo_path: dir.path().display().to_string(),
            r#ref: head,
            base_ref: root,
            syntax: true,
            timeout_seconds: 120,
            ..ValidateRequest::default()
        },
    )
    .await
    .expect("validate");
    let checks = by_name(&report);
    let check = checks
        .get("lint:npm")
        .unwrap_or_else(|| panic!("no lint:npm check in {report:#?}"));
    assert_eq!(check.status(), CheckStatus::Fail, "{}", check.evidence);
    assert!(
        check.evidence.contains("denied by the sandbox: "),
        "{}",
        check.evidence
    );
    for path in ["written-by-lint.txt", &escaped.display().to_string()] {
        assert!(
            check
                .evidence
                .lines()
                .any(|l| l.contains(path) && l.contains("permission denied")),
            "no refusal of {path}: {}",
            check.evidence
        );
    }
    assert!(
        check.evidence.contains("read the worktree"),
        "{}",
        check.evidence
    );
    assert!(!escaped.exists(), "the lint script wrote outside");
    service.stop().await;
}
