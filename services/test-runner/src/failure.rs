//! Failure messages and their CCW criticality (critical, high, medium, low).

use std::sync::LazyLock;
use troupe_proto::v1::Severity;

use regex::Regex;

static ANSI: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\x1b\[[0-9;?]*[ -/]*[@-~]").expect("ansi escape pattern compiles")
});

/// Removes ANSI escape sequences (colours, cursor movement) from a message.
pub(crate) fn strip_ansi(text: &str) -> String {
    ANSI.replace_all(text, "").into_owned()
}

/// The exception type a message starts with (`KeyError: 'x'` → `KeyError`), if any.
pub(crate) fn leading_exception_type(message: &str) -> Option<&str> {
    let (head, _) = message.split_once(':')?;
    is_type_name(head).then_some(head)
}

/// Whether `name` looks like a (possibly dotted) Python exception type name.
pub(crate) fn is_type_name(name: &str) -> bool {
    !name.is_empty()
        && name.split('.').all(|part| {
            let mut chars = part.chars();
            chars
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
}

/// Joins an exception type and a message as `Type: message` unless the message already
/// starts with that type.
pub(crate) fn with_type(exception: Option<&str>, message: &str) -> String {
    match exception {
        Some(kind) if !message.starts_with(kind) && !message.is_empty() => {
            format!("{kind}: {message}")
        }
        Some(kind) if message.is_empty() => kind.to_owned(),
        _ => message.to_owned(),
    }
}

/// CCW 1.C.8 failure criticality from the exception type and message.
///
/// Critical: the code cannot even load or refers to something that is not there (syntax and
/// import errors, undefined names, attributes of `None`). High: assertions. Medium: timeouts and
/// everything else. Low: warnings turned into errors.
pub(crate) fn criticality(exception: Option<&str>, message: &str) -> Severity {
    let kind = exception
        .or_else(|| leading_exception_type(message))
        .map(|kind| kind.rsplit('.').next().unwrap_or(kind))
        .unwrap_or("");
    let lower = message.to_ascii_lowercase();
    match kind {
        "SyntaxError"
        | "IndentationError"
        | "TabError"
        | "ImportError"
        | "ModuleNotFoundError"
        | "NameError"
        | "UnboundLocalError" => Severity::Critical,
        "AttributeError" | "TypeError" if message.contains("NoneType") => Severity::Critical,
        // JavaScript: a module that is not there, or a property of undefined/null.
        _ if message.contains("Cannot find module")
            || message.contains("is not defined")
            || message.contains("of undefined")
            || message.contains("of null") =>
        {
            Severity::Critical
        }
        _ if lower.contains("timeout") || lower.contains("timed out") => Severity::Medium,
        "AssertionError" => Severity::High,
        // Jest's matchers throw a plain `Error: expect(received).toBe(expected)`.
        _ if message.contains("expect(") => Severity::High,
        _ if kind.ends_with("Warning") => Severity::Low,
        _ => Severity::Medium,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(exception: Option<&str>, message: &str) -> &'static str {
        troupe_proto::names::name(criticality(exception, message))
    }

    #[test]
    fn strips_colour_codes() {
        assert_eq!(
            strip_ansi("\x1b[31mred\x1b[0m and \x1b[1;32mgreen\x1b[m"),
            "red and green"
        );
    }

    #[test]
    fn finds_leading_exception_types() {
        assert_eq!(leading_exception_type("KeyError: 'name'"), Some("KeyError"));
        assert_eq!(
            leading_exception_type("Failed: Timeout (>2.0s) from pytest-timeout."),
            Some("Failed")
        );
        assert_eq!(leading_exception_type("assert 2.5 == 2"), None);
        assert_eq!(
            leading_exception_type("a.b.CustomError: x"),
            Some("a.b.CustomError")
        );
        assert_eq!(leading_exception_type("assert x == 1: nope"), None);
    }

    #[test]
    fn prefixes_the_type_once() {
        assert_eq!(
            with_type(Some("AssertionError"), "assert 1 == 2"),
            "AssertionError: assert 1 == 2"
        );
        assert_eq!(
            with_type(Some("KeyError"), "KeyError: 'a'"),
            "KeyError: 'a'"
        );
        assert_eq!(with_type(None, "boom"), "boom");
        assert_eq!(with_type(Some("SystemExit"), ""), "SystemExit");
    }

    #[test]
    fn classifies_like_ccw() {
        assert_eq!(
            shown(Some("ModuleNotFoundError"), "No module named 'x'"),
            "critical"
        );
        assert_eq!(shown(None, "SyntaxError: invalid syntax"), "critical");
        assert_eq!(
            shown(None, "NameError: name 'x' is not defined"),
            "critical"
        );
        assert_eq!(
            shown(
                Some("AttributeError"),
                "AttributeError: 'NoneType' object has no attribute 'x'"
            ),
            "critical"
        );
        assert_eq!(
            shown(
                Some("AttributeError"),
                "AttributeError: 'Foo' has no attribute 'x'"
            ),
            "medium"
        );
        assert_eq!(shown(Some("AssertionError"), "assert 2.5 == 2"), "high");
        assert_eq!(
            shown(
                Some("Failed"),
                "Failed: Timeout (>2.0s) from pytest-timeout."
            ),
            "medium"
        );
        assert_eq!(shown(Some("KeyError"), "KeyError: 'name'"), "medium");
        assert_eq!(
            shown(Some("DeprecationWarning"), "DeprecationWarning: old"),
            "low"
        );
    }
}
