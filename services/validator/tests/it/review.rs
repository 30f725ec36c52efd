//! Reviews through `Validate` with `review` set: findings with file and line, and the
//! APPROVE / CONDITIONAL / BLOCK verdict.

use troupe_proto::v1::{ReviewReport, ReviewVerdict, Severity, ValidateRequest};
use troupe_testkit::git_repo;

use crate::{commit, start, validate};

fn rules(review: &ReviewReport) -> Vec<(String, String, u32, Severity)> {
    review
        .findings
        .iter()
        .map(|f| (f.rule.clone(), f.file.clone(), f.line, f.severity()))
        .collect()
}

#[tokio::test]
async fn review_verdicts_follow_the_worst_finding() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = git_repo(dir.path(), &[("README.md", "app\n")]).expect("repo");
    // Only a console.log (low): APPROVE.
    let low = commit(
        dir.path(),
        &[(
            "src/log.ts",
            "export function hello(name: string): string {\n  console.log(name);\n  return `hi ${name}`;\n}\n",
        )],
        "low",
    );
    // @ts-ignore, an exported `any`, an import cycle and an empty catch: CONDITIONAL.
    let medium = commit(
        dir.path(),
        &[
            (
                "src/a.ts",
                "import { b } from './b';\n// @ts-ignore\nexport function a(x: any): number {\n  try { return b(); } catch (e) {}\n  return 0;\n}\n",
            ),
            (
                "src/b.ts",
                "import { a } from './a';\nexport function b(): number {\n  return 1;\n}\n",
            ),
        ],
        "medium",
    );
    // A hard-coded key and SQL built by concatenation: BLOCK.
    let critical = commit(
        dir.path(),
        &[(
            "app/db.py",
            "import sqlite3\n\nAPI_KEY = \"sk-live-0123456789abcdefghijkl\"\n\n\ndef find(conn, name):\n    try:\n        return conn.execute(\"SELECT * FROM users WHERE name = '\" + name + \"'\")\n    except:\n        pass\n",
        )],
        "critical",
    );
    let (service, _data) = start(None).await;
    let review = |from: String, to: String| {
        let service = &service;
        let repo = dir.path().display().to_string();
        async move {
            validate(
                service,
                ValidateRequest {
                    repo_path: repo,
                    r#ref: to,
                    base_ref: from,
                    review: true,
                    ..ValidateRequest::default()
                },
            )
            .await
            .expect("validate")
            .review
            .expect("a review")
        }
    };

    let r = review(root.clone(), low.clone()).await;
    assert_eq!(r.verdict(), ReviewVerdict::Approve, "{r:#?}");
    assert_eq!(
        rules(&r),
        [(
            "console-log".to_owned(),
            "src/log.ts".to_owned(),
            2,
            Severity::Low
        )]
    );
    assert_eq!(r.files_reviewed, ["src/log.ts"]);

    let r = review(low.clone(), medium.clone()).await;
    assert_eq!(r.verdict(), ReviewVerdict::Conditional, "{r:#?}");
    let found = rules(&r);
    for want in [
        ("circular-import", "src/a.ts", 1, Severity::High),
        ("ts-ignore", "src/a.ts", 2, Severity::Medium),
        ("any-in-export", "src/a.ts", 3, Severity::Medium),
        ("empty-catch", "src/a.ts", 4, Severity::High),
    ] {
        assert!(
            found.contains(&(want.0.to_owned(), want.1.to_owned(), want.2, want.3)),
            "missing {want:?} in {found:#?}"
        );
    }
    let cycle = r
        .findings
        .iter()
        .find(|f| f.rule == "circular-import")
        .expect("cycle");
    assert!(
        cycle.message.contains("src/a.ts -> src/b.ts -> src/a.ts"),
        "{}",
        cycle.message
    );

    let r = review(medium.clone(), critical.clone()).await;
    assert_eq!(r.verdict(), ReviewVerdict::Block, "{r:#?}");
    let found = rules(&r);
    for want in [
        ("hardcoded-secret", "app/db.py", 3, Severity::Critical),
        ("sql-concatenation", "app/db.py", 8, Severity::Critical),
        ("bare-except-pass", "app/db.py", 9, Severity::High),
    ] {
        assert!(
            found.contains(&(want.0.to_owned(), want.1.to_owned(), want.2, want.3)),
            "missing {want:?} in {found:#?}"
        );
    }
    let secret = r
        .findings
        .iter()
        .find(|f| f.rule == "hardcoded-secret")
        .expect("secret");
    assert!(
        !secret.excerpt.contains("0123456789abcdef"),
        "the secret is masked: {}",
        secret.excerpt
    );

    // Requirements: a failing criterion is a high finding.
    let report = validate(
        &service,
        ValidateRequest {
            repo_path: dir.path().display().to_string(),
            r#ref: low.clone(),
            base_ref: root.clone(),
            review: true,
            criteria: vec!["file: src/missing.ts exists".into()],
            ..ValidateRequest::default()
        },
    )
    .await
    .expect("validate");
    let r = report.review.expect("review");
    assert_eq!(r.verdict(), ReviewVerdict::Conditional);
    assert!(
        r.findings.iter().any(
            |f| f.dimension() == troupe_proto::v1::ReviewDimension::Requirements
                && f.severity() == Severity::High
                && f.message.contains("src/missing.ts")
        ),
        "{r:#?}"
    );
    service.stop().await;
}

/// Detectors see only what they are about: a pattern in a comment or a string (multi-line
/// ones included) does not fire, the same pattern in code does, on its own line; a secret in
/// a string literal still fires.
#[tokio::test]
async fn review_ignores_patterns_in_comments_and_strings() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = git_repo(dir.path(), &[("README.md", "app\n")]).expect("repo");
    let head = commit(
        dir.path(),
        &[
            (
                "web/app.js",
                "/* Never write el.innerHTML = input;\n   and never eval(input). */\nconst help = `usage:\n  console.log(x) prints; eval(y) runs`;\nconst q = 'eval(z)'; // eval(w)\nexport function run(code) {\n  return eval(code);\n}\n",
            ),
            (
                "tool/cli.py",
                "\"\"\"Runs things.\n\nDo not exec(user_input) here.\n\"\"\"\nTOKEN = \"ghp_0123456789abcdefghijklmnopqrstuvwxyz\"\n\n\ndef run(src):\n    # exec(src) was the old way\n    return exec(src)\n",
            ),
        ],
        "mixed",
    );
    let (service, _data) = start(None).await;
    let report = validate(
        &service,
        ValidateRequest {
            repo_path: dir.path().display().to_string(),
            r#ref: head,
            base_ref: root,
            review: true,
            ..ValidateRequest::default()
        },
    )
    .await
    .expect("validate");
    let review = report.review.expect("a review");
    assert_eq!(
        rules(&review),
        [
            (
                "hardcoded-secret".to_owned(),
                "tool/cli.py".to_owned(),
                5,
                Severity::Critical
            ),
            (
                "eval-exec".to_owned(),
                "tool/cli.py".to_owned(),
                10,
                Severity::High
            ),
            (
                "eval-exec".to_owned(),
                "web/app.js".to_owned(),
                7,
                Severity::High
            ),
        ]
    );
    assert_eq!(review.findings[2].excerpt, "return eval(code);");
    assert_eq!(review.verdict(), ReviewVerdict::Block);
    service.stop().await;
}
