//! Goal-backward verification (VERIFY-* tasks): the properties every upstream task promised
//! must hold at the session head. Gaps are collected the way CCW's verifier writes them
//! (`verification.md`, ccw-reference §2.6) so the coordinator can plan fix tasks.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;
use troupe_proto::names;
use troupe_proto::v1::{CheckResult, CheckStatus, GapType, GoalVerification, VerificationGap};

use crate::Error;

/// The gap for one check of upstream task `task` that did not pass, if it is one.
pub(crate) fn gap(task: &str, check: &CheckResult) -> Option<VerificationGap> {
    if matches!(check.status(), CheckStatus::Pass | CheckStatus::Skipped) {
        return None;
    }
    let (kind, expected) = match check.kind() {
        troupe_proto::v1::CheckKind::File => (GapType::File, file_expectation(&check.evidence)),
        troupe_proto::v1::CheckKind::Verification => (
            GapType::VerificationCommand,
            "Command exits with code 0".to_owned(),
        ),
        _ => (
            GapType::Criterion,
            "Criterion verified with evidence".to_owned(),
        ),
    };
    let actual = format!(
        "{:?}: {}",
        check.status(),
        check
            .evidence
            .lines()
            .take(3)
            .collect::<Vec<_>>()
            .join(" | ")
    );
    Some(VerificationGap {
        task: task.to_owned(),
        r#type: kind as i32,
        item: if check.subject.is_empty() {
            check.name.clone()
        } else {
            check.subject.clone()
        },
        expected,
        actual: actual.chars().take(400).collect(),
        ..VerificationGap::default()
    })
}

fn file_expectation(evidence: &str) -> String {
    if evidence.starts_with("create") {
        "File exists and is not empty".to_owned()
    } else if evidence.starts_with("modify") {
        "File exists and was changed".to_owned()
    } else if evidence.starts_with("delete") {
        "File is absent".to_owned()
    } else {
        "File is in the state the task promised".to_owned()
    }
}

fn quoted(text: &str) -> String {
    // A JSON string is a valid YAML double-quoted scalar.
    serde_json::to_string(text).unwrap_or_else(|_| "\"\"".to_owned())
}

/// What `verification.md` says.
#[derive(Debug)]
pub(crate) struct Summary<'a> {
    pub(crate) task_id: &'a str,
    pub(crate) session_id: &'a str,
    pub(crate) phase: Option<&'a Value>,
    pub(crate) commit: &'a str,
    /// Per upstream task: id and its checks.
    pub(crate) tasks: &'a [(String, Vec<CheckResult>)],
    pub(crate) result: &'a GoalVerification,
}

/// Renders `verification.md`: CCW's frontmatter, then a table per task and the gaps.
pub(crate) fn render(summary: &Summary<'_>) -> String {
    let r = summary.result;
    let mut md = String::from("---\n");
    match summary.phase {
        // Protobuf Structs carry every number as a double: 1.0 is phase 1.
        Some(Value::Number(n)) if n.as_f64().is_some_and(|f| f.fract() == 0.0) => {
            let _ = writeln!(md, "phase: {}", n.as_f64().unwrap_or_default() as i64);
        }
        Some(Value::Null) | None => {}
        Some(phase) => {
            let _ = writeln!(md, "phase: {phase}");
        }
    }
    let _ = writeln!(md, "task: {}", quoted(summary.task_id));
    let _ = writeln!(md, "session: {}", quoted(summary.session_id));
    let _ = writeln!(md, "commit: {}", quoted(summary.commit));
    let _ = writeln!(md, "status: {}", names::name(r.status()));
    let _ = writeln!(md, "tasks_checked: {}", r.tasks_checked);
    let _ = writeln!(md, "tasks_passed: {}", r.tasks_passed);
    if r.gaps.is_empty() {
        md.push_str("gaps: []\n");
    } else {
        md.push_str("gaps:\n");
        for g in &r.gaps {
            let _ = writeln!(md, "  - task: {}", quoted(&g.task));
            let _ = writeln!(md, "    type: {}", quoted(names::name(g.r#type())));
            let _ = writeln!(md, "    item: {}", quoted(&g.item));
            let _ = writeln!(md, "    expected: {}", quoted(&g.expected));
            let _ = writeln!(md, "    actual: {}", quoted(&g.actual));
        }
    }
    md.push_str("---\n\n");
    let _ = writeln!(md, "# Verification: {}\n", summary.task_id);
    let _ = writeln!(
        md,
        "Goal-backward check at `{}`: {} of {} upstream tasks hold every property they promised.\n",
        summary.commit.get(..12).unwrap_or(summary.commit),
        r.tasks_passed,
        r.tasks_checked
    );
    for (task, checks) in summary.tasks {
        let _ = writeln!(
            md,
            "## {task}\n\n| check | status | evidence |\n|---|---|---|"
        );
        for c in checks {
            let evidence = c.evidence.lines().next().unwrap_or("").replace('|', "\\|");
            let _ = writeln!(
                md,
                "| {} | {:?} | {} |",
                c.name.replace('|', "\\|"),
                c.status(),
                evidence
            );
        }
        md.push('\n');
    }
    md
}

/// Writes `verification.md` under `<data_dir>/verify/<session>/<task>/`.
pub(crate) async fn write(
    data_dir: &Path,
    session: &str,
    task: &str,
    text: &str,
) -> Result<PathBuf, Error> {
    let safe = |s: &str| s.replace(['/', '\\'], "_").replace("..", "_");
    let dir = data_dir.join("verify").join(safe(session)).join(safe(task));
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(|source| Error::Io {
            path: dir.clone(),
            source,
        })?;
    let path = dir.join("verification.md");
    tokio::fs::write(&path, text)
        .await
        .map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use troupe_proto::v1::VerificationStatus;

    use super::*;

    #[test]
    fn frontmatter_has_ccw_fields_and_gaps() {
        let failing = CheckResult {
            name: "IMPL-002/verification".into(),
            kind: troupe_proto::v1::CheckKind::Verification as i32,
            status: CheckStatus::Fail as i32,
            evidence: "exit 1 in 0.1s\nboom".into(),
            subject: "npx vitest run".into(),
            ..CheckResult::default()
        };
        let g = gap("IMPL-002", &failing).expect("a gap");
        assert_eq!(g.r#type(), GapType::VerificationCommand);
        assert_eq!(g.expected, "Command exits with code 0");
        assert!(g.actual.contains("exit 1"), "{}", g.actual);
        let result = GoalVerification {
            status: VerificationStatus::GapsFound as i32,
            tasks_checked: 2,
            tasks_passed: 1,
            gaps: vec![g],
            ..GoalVerification::default()
        };
        let phase = Value::from(2);
        let md = render(&Summary {
            task_id: "VERIFY-001",
            session_id: "s1",
            phase: Some(&phase),
            commit: "abc",
            tasks: &[("IMPL-002".to_owned(), vec![failing])],
            result: &result,
        });
        assert!(
            md.starts_with("---\nphase: 2\ntask: \"VERIFY-001\"\n"),
            "{md}"
        );
        assert!(md.contains("status: gaps_found\ntasks_checked: 2\ntasks_passed: 1\ngaps:\n  - task: \"IMPL-002\"\n    type: \"verification_command\"\n    item: \"npx vitest run\"\n"), "{md}");
        assert!(
            md.contains("| IMPL-002/verification | Fail | exit 1 in 0.1s |"),
            "{md}"
        );
    }
}
