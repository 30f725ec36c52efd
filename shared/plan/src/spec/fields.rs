//! Readers for one field of a task block: each returns the typed value, or records a problem
//! naming the field's path (`task IMPL-1: agent.env.K ...`) and returns `None`, so a block is
//! read to the end and every problem of it is reported.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Map, Value};

use crate::ProblemKind;
use crate::validate::Problems;

/// Where a field lives: the task it belongs to and its dotted path inside it.
#[derive(Clone)]
pub(crate) struct At<'a> {
    owner: &'a str,
    path: String,
}

impl<'a> At<'a> {
    pub(crate) fn new(owner: &'a str, path: &str) -> Self {
        Self {
            owner,
            path: path.to_owned(),
        }
    }

    /// The path of a field of this object.
    pub(crate) fn field(&self, name: &str) -> Self {
        Self {
            owner: self.owner,
            path: format!("{}.{name}", self.path),
        }
    }

    /// The path of an element of this array.
    pub(crate) fn index(&self, position: usize) -> Self {
        Self {
            owner: self.owner,
            path: format!("{}[{position}]", self.path),
        }
    }

    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// Records `problem` about this field: `task X: <path> <problem>`.
    pub(crate) fn invalid(&self, problems: &mut Problems, problem: impl std::fmt::Display) {
        problems.push(
            ProblemKind::InvalidValue,
            format!("{}: `{}` {problem}", self.owner, self.path),
        );
    }
}

/// A value that is present: neither missing nor `null`.
pub(crate) fn present(value: Option<&Value>) -> Option<&Value> {
    value.filter(|value| !value.is_null())
}

/// An optional object.
pub(crate) fn object<'v>(
    value: Option<&'v Value>,
    at: &At<'_>,
    problems: &mut Problems,
) -> Option<&'v Map<String, Value>> {
    match present(value)? {
        Value::Object(map) => Some(map),
        other => {
            at.invalid(problems, format_args!("must be an object, got {other}"));
            None
        }
    }
}

/// An optional string.
pub(crate) fn string(
    value: Option<&Value>,
    at: &At<'_>,
    problems: &mut Problems,
) -> Option<String> {
    match present(value)? {
        Value::String(text) => Some(text.clone()),
        other => {
            at.invalid(problems, format_args!("must be a string, got {other}"));
            None
        }
    }
}

/// An optional boolean.
pub(crate) fn boolean(value: Option<&Value>, at: &At<'_>, problems: &mut Problems) -> Option<bool> {
    match present(value)? {
        Value::Bool(flag) => Some(*flag),
        other => {
            at.invalid(problems, format_args!("must be true or false, got {other}"));
            None
        }
    }
}

/// An optional array of strings.
pub(crate) fn strings(value: Option<&Value>, at: &At<'_>, problems: &mut Problems) -> Vec<String> {
    let items = match present(value) {
        None => return Vec::new(),
        Some(Value::Array(items)) => items,
        Some(other) => {
            at.invalid(
                problems,
                format_args!("must be an array of strings, got {other}"),
            );
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for (position, item) in items.iter().enumerate() {
        match item {
            Value::String(text) => out.push(text.clone()),
            other => at
                .index(position)
                .invalid(problems, format_args!("must be a string, got {other}")),
        }
    }
    out
}

/// An optional positive number of seconds (fractions allowed).
pub(crate) fn seconds(
    value: Option<&Value>,
    at: &At<'_>,
    problems: &mut Problems,
) -> Option<Duration> {
    let value = present(value)?;
    match value.as_f64() {
        // Up to a year: a longer limit is a unit mistake.
        Some(secs) if secs > 0.0 && secs <= 31_536_000.0 => Some(Duration::from_secs_f64(secs)),
        _ => {
            at.invalid(
                problems,
                format_args!("must be a positive number of seconds (at most a year), got {value}"),
            );
            None
        }
    }
}

/// An optional whole number in `range`.
pub(crate) fn whole(
    value: Option<&Value>,
    range: std::ops::RangeInclusive<u64>,
    at: &At<'_>,
    problems: &mut Problems,
) -> Option<u64> {
    let value = present(value)?;
    // `120.0` is a whole number too (JSON writers differ).
    let number = value.as_u64().or_else(|| {
        value
            .as_f64()
            .filter(|n| n.fract() == 0.0 && *n >= 0.0 && *n <= f64::from(u32::MAX))
            .map(|n| {
                // Checked above: a whole number in u32's range.
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let n = n as u64;
                n
            })
    });
    match number {
        Some(number) if range.contains(&number) => Some(number),
        _ => {
            at.invalid(
                problems,
                format_args!(
                    "must be a whole number from {} to {}, got {value}",
                    range.start(),
                    range.end()
                ),
            );
            None
        }
    }
}

/// An argv: a non-empty array of strings whose program is not empty, or (when `line` allows
/// it) a command line split without a shell. `shell` says whether a line with shell syntax
/// may run verbatim under `sh -c`; where placeholders are substituted it may not, since that
/// would interpolate text into a shell.
pub(crate) fn argv(
    value: Option<&Value>,
    line: Line,
    at: &At<'_>,
    problems: &mut Problems,
) -> Option<Vec<String>> {
    match present(value)? {
        Value::Array(items) => {
            let argv: Option<Vec<String>> = items
                .iter()
                .map(|item| item.as_str().map(str::to_owned))
                .collect();
            match argv {
                Some(argv)
                    if argv
                        .first()
                        .is_some_and(|program| !program.trim().is_empty()) =>
                {
                    Some(argv)
                }
                Some(argv) if argv.is_empty() => {
                    at.invalid(problems, "is empty: an argv needs at least the program");
                    None
                }
                Some(_) => {
                    at.invalid(problems, "names an empty program");
                    None
                }
                None => {
                    at.invalid(problems, "must hold only strings (an argv array)");
                    None
                }
            }
        }
        Value::String(text) if line != Line::Refused => {
            match troupe_process::command_line_to_argv(text) {
                Ok(argv) if argv.is_empty() => {
                    at.invalid(problems, "is an empty command line");
                    None
                }
                Ok(argv)
                    if line == Line::NoShell
                        && argv.first().map(String::as_str) == Some("sh")
                        && argv.get(2) == Some(text) =>
                {
                    at.invalid(problems, "uses shell syntax; write it as an argv array");
                    None
                }
                Ok(argv) => Some(argv),
                Err(err) => {
                    at.invalid(
                        problems,
                        format_args!("cannot be split into an argv: {err}"),
                    );
                    None
                }
            }
        }
        other => {
            let expected = match line {
                Line::Refused => "an argv array of strings",
                _ => "an argv array of strings or a command line",
            };
            at.invalid(problems, format_args!("must be {expected}, got {other}"));
            None
        }
    }
}

/// Whether an argv field also takes a command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Line {
    /// Only an array.
    Refused,
    /// A line without shell syntax (it is split into words).
    NoShell,
    /// Any line: one with shell syntax runs verbatim under `sh -c`.
    Shell,
}

/// An object whose values are all strings.
pub(crate) fn string_map(
    value: Option<&Value>,
    at: &At<'_>,
    problems: &mut Problems,
) -> BTreeMap<String, String> {
    let Some(map) = object(value, at, problems) else {
        return BTreeMap::new();
    };
    let mut out = BTreeMap::new();
    for (key, value) in map {
        match value {
            Value::String(text) => {
                out.insert(key.clone(), text.clone());
            }
            // The value is not echoed: environment values are where secrets live.
            other => at.field(key).invalid(
                problems,
                format_args!("must be a string, got {}", kind_of(other)),
            ),
        }
    }
    out
}

/// What kind of JSON value `value` is, for messages that must not echo it.
pub(crate) fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A backend name troupe-backends knows (case-insensitive), lowercased.
pub(crate) fn backend(
    value: Option<&Value>,
    at: &At<'_>,
    problems: &mut Problems,
) -> Option<String> {
    let name = string(value, at, problems)?;
    let lowered = name.trim().to_ascii_lowercase();
    if troupe_backends::BACKEND_NAMES.contains(&lowered.as_str()) {
        Some(lowered)
    } else {
        at.invalid(
            problems,
            format_args!(
                "names unknown backend `{name}` (known: {})",
                troupe_backends::BACKEND_NAMES.join(", ")
            ),
        );
        None
    }
}
