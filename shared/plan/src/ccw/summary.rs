//! `summary-<ID>.md`, the roadmap executor's per-task summary (ccw-reference §2.5), written by
//! the CCW export and by the executor after each task.

use std::fmt::Write as _;

use serde_json::Value;

/// What a summary says. Every field is plain data, so any writer can fill it in.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TaskSummary {
    /// The task's `phase` (number or string), when it has one.
    pub phase: Option<Value>,
    /// Task id (`IMPL-202`).
    pub task: String,
    /// Task title.
    pub title: String,
    /// Ids it depends on.
    pub requires: Vec<String>,
    /// Paths it changed.
    pub affects: Vec<String>,
    /// Paths its plan entry lists (`files[].path`).
    pub key_files: Vec<String>,
    /// The commit holding its work (no `commit:` line when empty).
    pub commit: String,
    /// `pass`, `fail` or `pending`.
    pub convergence_met: String,
    /// Wall time in milliseconds, when known.
    pub duration_ms: Option<u64>,
    /// Completion time, `YYYY-MM-DDTHH:MM:SS` (UTC), when known.
    pub completed: Option<String>,
    /// The result summary (body of `## Implementation Result`).
    pub result: String,
    /// Backend name and exit code, when an executor ran it.
    pub backend: Option<(String, i32)>,
    /// Last lines of the backend's output.
    pub output_tail: String,
    /// The convergence criteria and whether each was verified.
    pub criteria: Vec<(String, bool)>,
}

fn yaml_list(items: &[String]) -> String {
    serde_json::to_string(items).unwrap_or_else(|_| "[]".into())
}

/// `1234` ms as `1s`, `2m5s` or `250ms`.
pub fn duration_text(millis: u64) -> String {
    let seconds = millis / 1000;
    if seconds == 0 {
        format!("{millis}ms")
    } else if seconds >= 60 {
        format!("{}m{}s", seconds / 60, seconds % 60)
    } else {
        format!("{seconds}s")
    }
}

impl TaskSummary {
    /// The markdown file: §2.5 frontmatter, then `# Summary`, `## Implementation Result`,
    /// `## Files Affected` and `## Convergence Criteria` (checked when verified).
    pub fn render(&self) -> String {
        let quote = |text: &str| serde_json::to_string(text).unwrap_or_default();
        let mut text = String::from("---\n");
        if let Some(phase) = self
            .phase
            .as_ref()
            .filter(|v| v.is_number() || v.is_string())
        {
            let _ = writeln!(text, "phase: {phase}");
        }
        let _ = writeln!(text, "task: {}", quote(&self.task));
        let _ = writeln!(text, "title: {}", quote(&self.title));
        let _ = writeln!(text, "requires: {}", yaml_list(&self.requires));
        let _ = writeln!(
            text,
            "provides: {}",
            yaml_list(std::slice::from_ref(&self.task))
        );
        let _ = writeln!(text, "affects: {}", yaml_list(&self.affects));
        let _ = writeln!(text, "key-files: {}", yaml_list(&self.key_files));
        if !self.commit.is_empty() {
            let _ = writeln!(text, "commit: {}", quote(&self.commit));
        }
        let _ = writeln!(text, "convergence-met: {}", self.convergence_met);
        if let Some(duration) = self.duration_ms {
            let _ = writeln!(text, "duration: {}", duration_text(duration));
        }
        if let Some(completed) = &self.completed {
            let _ = writeln!(text, "completed: {completed}");
        }
        let _ = writeln!(text, "---\n");
        let _ = writeln!(text, "# Summary: {} - {}\n", self.task, self.title);
        let _ = writeln!(text, "## Implementation Result\n");
        let _ = writeln!(text, "{}", self.result.trim());
        if let Some((backend, exit_code)) = &self.backend {
            let _ = writeln!(text, "\nbackend {backend} (exit {exit_code})");
            if !self.output_tail.trim().is_empty() {
                let _ = writeln!(text, "\n```\n{}\n```", self.output_tail.trim_end());
            }
        }
        let _ = writeln!(text, "\n## Files Affected\n");
        for file in &self.affects {
            let _ = writeln!(text, "- {file}");
        }
        let _ = writeln!(text, "\n## Convergence Criteria\n");
        for (criterion, verified) in &self.criteria {
            let mark = if *verified { "x" } else { " " };
            let _ = writeln!(text, "- [{mark}] {criterion}");
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn renders_the_frontmatter_and_sections() {
        let text = TaskSummary {
            phase: Some(json!(2)),
            task: "IMPL-202".into(),
            title: "REST endpoints".into(),
            requires: vec!["IMPL-201".into()],
            affects: vec!["src/a.ts".into()],
            key_files: vec!["src/a.ts".into()],
            commit: "abc".into(),
            convergence_met: "pass".into(),
            duration_ms: Some(125_000),
            completed: Some("2026-03-01T11:20:41".into()),
            result: "done".into(),
            backend: Some(("command".into(), 0)),
            output_tail: "ok".into(),
            criteria: vec![("a works".into(), true), ("b works".into(), false)],
        }
        .render();
        for needle in [
            "---\nphase: 2\ntask: \"IMPL-202\"\n",
            "requires: [\"IMPL-201\"]\nprovides: [\"IMPL-202\"]\n",
            "convergence-met: pass\nduration: 2m5s\ncompleted: 2026-03-01T11:20:41\n---\n",
            "# Summary: IMPL-202 - REST endpoints\n",
            "backend command (exit 0)\n\n```\nok\n```\n",
            "## Files Affected\n\n- src/a.ts\n",
            "- [x] a works\n- [ ] b works\n",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
    }
}
