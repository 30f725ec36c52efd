//! The exec-phase example end to end: one EXEC task runs six IMPL task files in three waves
//! through the real coordinator, executor and validator in one process.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use troupe_proto::v1::{SessionState, TaskState, task_result::Detail};

/// `started=` and `finished=` of each task, from the agent output in its summary.
fn times(summary: &str) -> Option<(f64, f64)> {
    let field = |name: &str| -> Option<f64> {
        let start = summary.find(name)? + name.len();
        summary[start..].split_whitespace().next()?.parse().ok()
    };
    Some((field("started=")?, field("finished=")?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exec_phase_example_runs_three_waves_into_the_session_branch() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let shutdown = CancellationToken::new();
    let (embedded, url) = crate::support::start_embedded(data.path(), &shutdown).await?;

    let response = crate::support::run_example(&url, "exec-phase").await?;
    let session = response.session.as_ref().context("no session")?;
    let report = troupe::report::final_report(&response);
    assert_eq!(
        session.state,
        SessionState::Completed as i32,
        "session did not complete:\n{report}"
    );
    for task in &response.tasks {
        assert_eq!(
            task.state,
            TaskState::Completed as i32,
            "{} did not complete:\n{report}",
            task.id
        );
    }

    // The EXEC task's own result lists every phase task with its wave.
    let exec = response
        .tasks
        .iter()
        .find(|t| t.id == "EXEC-001")
        .context("no EXEC-001")?;
    let result = exec.result.as_ref().context("EXEC-001 has no result")?;
    let Some(Detail::Implementation(phase)) = &result.detail else {
        anyhow::bail!("EXEC-001 has no implementation report: {result:?}");
    };
    assert_eq!(phase.waves, 3);
    let waves: BTreeMap<&str, u32> = phase
        .phase_tasks
        .iter()
        .map(|o| (o.task_id.as_str(), o.wave))
        .collect();
    assert_eq!(
        waves,
        BTreeMap::from([
            ("IMPL-101", 1),
            ("IMPL-102", 1),
            ("IMPL-103", 2),
            ("IMPL-104", 2),
            ("IMPL-105", 3),
            ("IMPL-106", 3),
        ])
    );
    for outcome in &phase.phase_tasks {
        assert_eq!(
            outcome.state(),
            troupe_proto::v1::TaskState::Completed,
            "{outcome:?}"
        );
        // Self-validated through the validator mounted on the same server.
        assert_eq!(
            outcome.convergence_met(),
            troupe_proto::v1::ConvergenceMet::Pass,
            "{outcome:?}"
        );
    }
    assert_eq!(
        result.files_modified.len(),
        6,
        "{:?}",
        result.files_modified
    );

    // The files and the summaries are on the session branch; the checkout is untouched.
    let repo = session.repos.first().context("no repo")?;
    let repo_path = Path::new(&repo.path);
    assert_eq!(
        troupe_testkit::git(repo_path, &["rev-parse", &repo.branch])?,
        result.commit
    );
    let show =
        |path: &str| troupe_testkit::git(repo_path, &["show", &format!("{}:{path}", repo.branch)]);
    assert!(show("textkit/cli.py")?.contains("def main("));
    assert!(!repo_path.join("textkit/cli.py").exists());
    let mut spans = BTreeMap::new();
    for id in waves.keys() {
        let summary = show(&format!(".troupe-summaries/summary-{id}.md"))?;
        assert!(summary.starts_with("---\nphase: 1\n"), "{summary}");
        assert!(summary.contains("convergence-met: pass\n"), "{summary}");
        spans.insert(*id, times(&summary).context("no times in the summary")?);
    }
    // Waves in order: every task of a wave ends before any task of the next one starts.
    for (wave, next) in [(1, 2), (2, 3)] {
        let ends = waves
            .iter()
            .filter(|(_, w)| **w == wave)
            .map(|(id, _)| spans[id].1);
        let starts = waves
            .iter()
            .filter(|(_, w)| **w == next)
            .map(|(id, _)| spans[id].0);
        let last_end = ends.fold(f64::MIN, f64::max);
        let first_start = starts.fold(f64::MAX, f64::min);
        assert!(
            last_end <= first_start,
            "wave {next} started at {first_start} before wave {wave} ended at {last_end}"
        );
    }
    // Parallel inside a wave: the two tasks of each wave overlap.
    for pair in [
        ("IMPL-101", "IMPL-102"),
        ("IMPL-103", "IMPL-104"),
        ("IMPL-105", "IMPL-106"),
    ] {
        let (a, b) = (spans[pair.0], spans[pair.1]);
        assert!(
            a.0.max(b.0) < a.1.min(b.1),
            "{pair:?} did not overlap: {a:?} {b:?}"
        );
    }

    shutdown.cancel();
    embedded.wait().await?;
    Ok(())
}
