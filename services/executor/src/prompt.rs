//! The handoff prompt (CCW executor "CLI mode" layout: PURPOSE, TARGET FILES, IMPLEMENTATION
//! STEPS, REFERENCE, APPROACH, RISKS, DONE WHEN, MODE, CONSTRAINTS).

use std::fmt::Write as _;

use crate::pre_analysis::{PreAnalysis, fill};
use crate::spec::{Brief, TaskSpec};

/// What a dependency produced, for the prompt's context section.
#[derive(Debug, Clone, Default)]
pub struct UpstreamNote {
    pub(crate) task_id: String,
    pub(crate) summary: String,
    pub(crate) files: Vec<String>,
}

/// Builds the prompt an agent receives on stdin and in `{prompt_file}`. `[name]` placeholders
/// anywhere in the task's text take the pre-analysis output `name`.
pub(crate) fn handoff_prompt(
    spec: &TaskSpec,
    upstream: &[UpstreamNote],
    pre: &PreAnalysis,
) -> String {
    let brief = Brief::of(spec);
    let mut out = String::new();
    let title = if spec.title.is_empty() {
        spec.id.as_str()
    } else {
        spec.title.as_str()
    };
    let _ = writeln!(out, "PURPOSE: {title}");
    if !spec.description.is_empty() {
        let _ = writeln!(out, "{}", spec.description);
    }
    let _ = writeln!(out, "TASK: {}", spec.id);

    if !spec.files.is_empty() {
        let _ = writeln!(out, "\nTARGET FILES:");
        for file in &spec.files {
            let action = file.action;
            let change = if file.change.is_empty() {
                String::new()
            } else {
                format!(": {}", file.change)
            };
            let _ = writeln!(out, "- {} ({action}){change}", file.path);
        }
    }
    section(
        &mut out,
        "IMPLEMENTATION STEPS",
        brief
            .implementation
            .iter()
            .enumerate()
            .map(|(i, s)| format!("{}. {s}", i + 1)),
    );
    // Filled before the outputs themselves are added, which stay verbatim.
    let mut out = fill(&out, &pre.vars);
    if !pre.steps.is_empty() {
        let _ = writeln!(out, "\nPRE-ANALYSIS CONTEXT:");
        for step in &pre.steps {
            let name = step.output_to.as_deref().unwrap_or(&step.step);
            let status = if step.status == "ok" {
                String::new()
            } else {
                format!(" ({})", step.status)
            };
            let _ = writeln!(out, "[{name}]{status}:\n{}", step.output.trim_end());
        }
    }
    let mut rest = String::new();
    if !upstream.is_empty() {
        let _ = writeln!(rest, "\nCONTEXT FROM COMPLETED DEPENDENCIES:");
        for note in upstream {
            let files = if note.files.is_empty() {
                String::new()
            } else {
                format!(" (files: {})", note.files.join(", "))
            };
            let _ = writeln!(rest, "- {}: {}{files}", note.task_id, note.summary);
        }
    }
    section(
        &mut rest,
        "REFERENCE",
        brief.reference.iter().map(|r| format!("- {r}")),
    );
    if let Some(approach) = &brief.approach {
        let _ = writeln!(rest, "\nAPPROACH: {approach}");
    }
    section(
        &mut rest,
        "RISKS",
        brief.risks.iter().map(|r| format!("- {r}")),
    );
    let convergence = &spec.blocks.convergence;
    let mut done: Vec<String> = convergence
        .criteria
        .iter()
        .map(|c| format!("- [ ] {c}"))
        .collect();
    if let Some(dod) = &convergence.definition_of_done {
        done.push(format!("- [ ] {dod}"));
    }
    section(&mut rest, "DONE WHEN", done.into_iter());

    let _ = writeln!(rest, "\nMODE: write");
    let _ = writeln!(rest, "\nCONSTRAINTS:");
    let allowed = spec.allowed_paths();
    if allowed.is_empty() {
        let _ = writeln!(rest, "- Change only what the task needs");
    } else {
        let _ = writeln!(
            rest,
            "- Only change the listed files and paths under: {}",
            allowed.join(", ")
        );
    }
    if !spec.blocks.excludes.is_empty() {
        let _ = writeln!(rest, "- Do not touch: {}", spec.blocks.excludes.join(", "));
    }
    let _ = writeln!(rest, "- Follow the existing patterns of the code base");
    let _ = writeln!(
        rest,
        "- Do not commit; troupe commits your changes when you exit 0"
    );
    out.push_str(&fill(&rest, &pre.vars));
    out
}

fn section(out: &mut String, name: &str, lines: impl Iterator<Item = String>) {
    let mut lines = lines.peekable();
    if lines.peek().is_none() {
        return;
    }
    let _ = writeln!(out, "\n{name}:");
    for line in lines {
        let _ = writeln!(out, "{line}");
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn prompt_has_the_ccw_sections() {
        let spec = crate::spec::parse(
            json!({
                "id": "IMPL-1", "title": "Add median", "description": "So reports show a robust centre.",
                "files": [{"path": "stats/core.py", "action": "modify", "change": "add median()"}],
                "focus_paths": ["tests"],
                "implementation": ["write median", "export it"],
                "convergence": {"criteria": ["median([3,1,2]) == 2"]},
            })
            .as_object()
            .expect("object"),
        )
        .expect("valid");
        let upstream = [UpstreamNote {
            task_id: "IMPL-0".into(),
            summary: "added mean".into(),
            files: vec!["stats/core.py".into()],
        }];
        let prompt = handoff_prompt(&spec, &upstream, &PreAnalysis::default());
        for needle in [
            "PURPOSE: Add median\nSo reports show a robust centre.\nTASK: IMPL-1\n",
            "TARGET FILES:\n- stats/core.py (modify): add median()\n",
            "IMPLEMENTATION STEPS:\n1. write median\n2. export it\n",
            "- IMPL-0: added mean (files: stats/core.py)",
            "DONE WHEN:\n- [ ] median([3,1,2]) == 2\n",
            "MODE: write",
            "- Only change the listed files and paths under: stats/core.py, tests\n",
        ] {
            assert!(prompt.contains(needle), "missing {needle:?} in\n{prompt}");
        }
    }
}
