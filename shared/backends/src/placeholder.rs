//! `{name}` placeholders in argv templates, substituted per element (never through a shell).

use std::collections::BTreeMap;

use crate::BackendError;

/// Placeholders a template may use.
pub const PLACEHOLDERS: &[&str] = &[
    "worktree",
    "plan_dir",
    "task_id",
    "session_id",
    "prompt_file",
    "repo",
];

/// The family of placeholders naming a read-only context repository's checkout:
/// `{context:<repo>}`.
pub(crate) const CONTEXT_PREFIX: &str = "context:";

/// Substitutes `{name}` in every element of `template` from `values`.
///
/// Only `{identifier}` and `{context:<repo>}` are placeholders; other braces are literal, and
/// `{{` / `}}` stand for a literal `{` / `}` (for an argument such as a Python f-string). An
/// identifier that is not in [`PLACEHOLDERS`], a context repository the session does not have,
/// or a placeholder without a value here, is an error rather than left in place.
pub fn substitute(
    template: &[String],
    values: &BTreeMap<String, String>,
) -> Result<Vec<String>, BackendError> {
    template
        .iter()
        .map(|element| substitute_one(element, values))
        .collect()
}

fn substitute_one(
    element: &str,
    values: &BTreeMap<String, String>,
) -> Result<String, BackendError> {
    let mut out = String::with_capacity(element.len());
    let mut rest = element;
    while let Some(pos) = rest.find(['{', '}']) {
        out.push_str(&rest[..pos]);
        let tail = &rest[pos..];
        if tail.starts_with("{{") || tail.starts_with("}}") {
            out.push_str(&tail[..1]);
            rest = &tail[2..];
            continue;
        }
        if tail.starts_with('{')
            && let Some(end) = tail.find('}')
        {
            let name = &tail[1..end];
            if let Some(repo) = name.strip_prefix(CONTEXT_PREFIX)
                && !repo.is_empty()
            {
                let value = values.get(name).ok_or_else(|| BackendError::InvalidTask {
                    message: format!(
                        "placeholder `{{{name}}}`: `{repo}` is not a read-only repository of this session"
                    ),
                })?;
                out.push_str(value);
                rest = &tail[end + 1..];
                continue;
            }
            if is_identifier(name) {
                if !PLACEHOLDERS.contains(&name) {
                    return Err(BackendError::InvalidTask {
                        message: format!(
                            "unknown placeholder `{{{name}}}` in agent command (known: {})",
                            PLACEHOLDERS.join(", ")
                        ),
                    });
                }
                let value = values.get(name).ok_or_else(|| BackendError::InvalidTask {
                    message: format!("placeholder `{{{name}}}` has no value for this run"),
                })?;
                out.push_str(value);
                rest = &tail[end + 1..];
                continue;
            }
        }
        out.push_str(&tail[..1]);
        rest = &tail[1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values() -> BTreeMap<String, String> {
        [
            ("worktree", "/w t"),
            ("task_id", "IMPL-1"),
            ("plan_dir", "/plan"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    fn run(template: &[&str]) -> Result<Vec<String>, BackendError> {
        let template: Vec<String> = template.iter().map(|s| (*s).to_owned()).collect();
        substitute(&template, &values())
    }

    #[test]
    fn context_placeholders_name_read_only_checkouts() {
        let mut values = values();
        values.insert("context:contract".to_owned(), "/ctx/contract".to_owned());
        let template = vec!["{context:contract}/API.md".to_owned()];
        assert_eq!(
            substitute(&template, &values).expect("ok"),
            ["/ctx/contract/API.md"]
        );
        let missing = vec!["{context:other}/x".to_owned()];
        let err = substitute(&missing, &values).expect_err("unknown repo");
        assert!(
            err.to_string()
                .contains("`other` is not a read-only repository"),
            "{err}"
        );
    }

    #[test]
    fn substitutes_per_element() {
        let argv = run(&[
            "python3",
            "{plan_dir}/agents/x.py",
            "{worktree}",
            "--id={task_id}",
        ])
        .expect("ok");
        // A value with a space stays one argument: there is no shell.
        assert_eq!(
            argv,
            ["python3", "/plan/agents/x.py", "/w t", "--id=IMPL-1"]
        );
    }

    #[test]
    fn literal_braces_survive() {
        let argv = run(&[
            "-c",
            "d = {}; e = {'a': 1}; print(f'{{x}}')",
            "{ worktree }",
        ])
        .expect("ok");
        assert_eq!(
            argv,
            ["-c", "d = {}; e = {'a': 1}; print(f'{x}')", "{ worktree }"]
        );
    }

    #[test]
    fn unknown_or_missing_placeholders_are_errors() {
        let err = run(&["x", "{workdir}"]).expect_err("unknown");
        assert!(
            err.to_string().contains("unknown placeholder `{workdir}`"),
            "{err}"
        );
        let err = run(&["x", "{session_id}"]).expect_err("no value");
        assert!(
            err.to_string().contains("`{session_id}` has no value"),
            "{err}"
        );
    }
}
