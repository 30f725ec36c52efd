//! Pytest's built-in `--junitxml` report (test-frameworks.md §3.4), the fallback when
//! pytest-json-report is not installed.
//!
//! A deliberately small XML reader: pytest writes plain elements, attributes and escaped text
//! (no namespaces, no DTD), which is all this understands. With `-o junit_family=xunit1` each
//! `<testcase>` carries `file` and a 0-based `line`; a collection error is a testcase with an
//! empty `classname` and `<error message="collection failure">`.

use std::sync::LazyLock;

use regex::Regex;
use troupe_proto::v1::{TestFailure, TestTotals};

use super::{SuiteResults, collection_failure};
use crate::failure::{criticality, strip_ansi, with_type};

/// The report is not well-formed enough to read.
#[derive(Debug, thiserror::Error)]
#[error("malformed junit xml at byte {offset}: {reason}")]
pub(crate) struct JunitError {
    offset: usize,
    reason: &'static str,
}

#[derive(Debug, PartialEq)]
enum Event<'a> {
    Start {
        name: &'a str,
        attrs: Vec<(&'a str, String)>,
        empty: bool,
    },
    End(&'a str),
    Text(String),
}

fn events(xml: &str) -> Result<Vec<Event<'_>>, JunitError> {
    let mut out = Vec::new();
    let mut rest = xml;
    let offset = |rest: &str| xml.len() - rest.len();
    while !rest.is_empty() {
        let Some(lt) = rest.find('<') else {
            out.push(Event::Text(unescape(rest)));
            break;
        };
        if lt > 0 {
            out.push(Event::Text(unescape(&rest[..lt])));
        }
        rest = &rest[lt..];
        if let Some(body) = rest.strip_prefix("<![CDATA[") {
            let end = body.find("]]>").ok_or(JunitError {
                offset: offset(rest),
                reason: "unterminated cdata",
            })?;
            out.push(Event::Text(body[..end].to_owned()));
            rest = &body[end + 3..];
        } else if let Some(body) = rest.strip_prefix("<!--") {
            let end = body.find("-->").ok_or(JunitError {
                offset: offset(rest),
                reason: "unterminated comment",
            })?;
            rest = &body[end + 3..];
        } else if rest.starts_with("<?") || rest.starts_with("<!") {
            let end = rest.find('>').ok_or(JunitError {
                offset: offset(rest),
                reason: "unterminated declaration",
            })?;
            rest = &rest[end + 1..];
        } else if let Some(body) = rest.strip_prefix("</") {
            let end = body.find('>').ok_or(JunitError {
                offset: offset(rest),
                reason: "unterminated end tag",
            })?;
            out.push(Event::End(body[..end].trim()));
            rest = &body[end + 1..];
        } else {
            let (event, len) = start_tag(rest).ok_or(JunitError {
                offset: offset(rest),
                reason: "bad start tag",
            })?;
            out.push(event);
            rest = &rest[len..];
        }
    }
    Ok(out)
}

/// Parses `<name attr="v" ...>` or `<name .../>` at the start of `text`; returns the event and
/// the number of bytes consumed.
fn start_tag(text: &str) -> Option<(Event<'_>, usize)> {
    let inner = &text[1..];
    let name_len = inner.find(|c: char| c.is_whitespace() || c == '>' || c == '/')?;
    let name = &inner[..name_len];
    let mut pos = 1 + name_len;
    let mut attrs = Vec::new();
    loop {
        let rest = &text[pos..];
        let trimmed = rest.trim_start();
        pos += rest.len() - trimmed.len();
        if let Some(after) = trimmed.strip_prefix("/>") {
            let _ = after;
            return Some((
                Event::Start {
                    name,
                    attrs,
                    empty: true,
                },
                pos + 2,
            ));
        }
        if trimmed.starts_with('>') {
            return Some((
                Event::Start {
                    name,
                    attrs,
                    empty: false,
                },
                pos + 1,
            ));
        }
        let eq = trimmed.find('=')?;
        let key = trimmed[..eq].trim();
        let after_eq = trimmed[eq + 1..].trim_start();
        let quote = after_eq
            .chars()
            .next()
            .filter(|q| *q == '"' || *q == '\'')?;
        let value_start = &after_eq[1..];
        let close = value_start.find(quote)?;
        attrs.push((key, unescape(&value_start[..close])));
        let consumed = trimmed.len() - value_start[close + 1..].len();
        pos += consumed;
    }
}

fn unescape(text: &str) -> String {
    if !text.contains('&') {
        return text.to_owned();
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(amp) = rest.find('&') {
        out.push_str(&rest[..amp]);
        rest = &rest[amp..];
        let Some(semi) = rest.find(';').filter(|s| *s <= 10) else {
            out.push('&');
            rest = &rest[1..];
            continue;
        };
        let entity = &rest[1..semi];
        let decoded = match entity {
            "lt" => Some('<'),
            "gt" => Some('>'),
            "amp" => Some('&'),
            "quot" => Some('"'),
            "apos" => Some('\''),
            _ => entity
                .strip_prefix("#x")
                .and_then(|hex| u32::from_str_radix(hex, 16).ok())
                .or_else(|| entity.strip_prefix('#').and_then(|dec| dec.parse().ok()))
                .and_then(char::from_u32),
        };
        match decoded {
            Some(c) => {
                out.push(c);
                rest = &rest[semi + 1..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

#[derive(Debug, Default)]
struct Case {
    classname: String,
    name: String,
    file: Option<String>,
    line: Option<u32>,
    result: Option<CaseResult>,
}

#[derive(Debug, Default)]
struct CaseResult {
    kind: String,
    message: String,
    text: String,
}

fn attr<'a>(attrs: &'a [(&str, String)], key: &str) -> Option<&'a str> {
    attrs
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.as_str())
}

fn count(attrs: &[(&str, String)], key: &str) -> u32 {
    attr(attrs, key)
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Parses a pytest `junit.xml`. Collection errors are reported as failures but, as in
/// pytest-json-report's summary, not counted in the totals.
pub(crate) fn parse(xml: &str) -> Result<SuiteResults, JunitError> {
    let mut suite = TestTotals::default();
    let mut cases = Vec::new();
    let mut current: Option<Case> = None;
    let mut in_result = false;
    for event in events(xml)? {
        match event {
            Event::Start {
                name: "testsuite",
                attrs,
                ..
            } => {
                suite.total += count(&attrs, "tests");
                suite.failed += count(&attrs, "failures");
                suite.errors += count(&attrs, "errors");
                suite.skipped += count(&attrs, "skipped");
            }
            Event::Start {
                name: "testcase",
                attrs,
                empty,
            } => {
                let case = Case {
                    classname: attr(&attrs, "classname").unwrap_or("").to_owned(),
                    name: attr(&attrs, "name").unwrap_or("").to_owned(),
                    file: attr(&attrs, "file").map(str::to_owned),
                    line: attr(&attrs, "line").and_then(|l| l.parse().ok()),
                    result: None,
                };
                if empty {
                    cases.push(case);
                } else {
                    current = Some(case);
                }
            }
            Event::Start {
                name: kind @ ("failure" | "error" | "skipped"),
                attrs,
                empty,
            } => {
                if let Some(case) = current.as_mut() {
                    // A test that fails in call and errors in teardown has both; keep the first.
                    if case.result.is_none() {
                        case.result = Some(CaseResult {
                            kind: kind.to_owned(),
                            message: attr(&attrs, "message").unwrap_or("").to_owned(),
                            text: String::new(),
                        });
                        in_result = !empty;
                    }
                }
            }
            Event::Text(text) if in_result => {
                if let Some(result) = current.as_mut().and_then(|c| c.result.as_mut()) {
                    result.text.push_str(&text);
                }
            }
            Event::End("failure" | "error" | "skipped") => in_result = false,
            Event::End("testcase") => {
                if let Some(case) = current.take() {
                    cases.push(case);
                }
            }
            _ => {}
        }
    }
    let mut failures = Vec::new();
    let mut collection_errors = 0u32;
    for case in &cases {
        let Some(result) = case.result.as_ref().filter(|r| r.kind != "skipped") else {
            continue;
        };
        if case.classname.is_empty() && result.message == "collection failure" {
            collection_errors += 1;
            let file = case
                .file
                .clone()
                .unwrap_or_else(|| format!("{}.py", case.name.replace('.', "/")));
            failures.push(collection_failure(&file, &result.text));
        } else {
            failures.push(case_failure(case, result));
        }
    }
    let total = suite.total.saturating_sub(collection_errors);
    let errors = suite.errors.saturating_sub(collection_errors);
    let totals = TestTotals {
        total,
        passed: total.saturating_sub(suite.failed + errors + suite.skipped),
        failed: suite.failed,
        skipped: suite.skipped,
        errors,
    };
    Ok(SuiteResults {
        totals,
        failures,
        collection_errors,
        ..SuiteResults::default()
    })
}

static LOCATION: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(\S[^:]*):(\d+): ?(\S*)$").expect("location pattern compiles"));

fn case_failure(case: &Case, result: &CaseResult) -> TestFailure {
    let file = case
        .file
        .clone()
        .unwrap_or_else(|| file_from_classname(&case.classname));
    let module = file.trim_end_matches(".py").replace('/', ".");
    let class = case
        .classname
        .strip_prefix(&module)
        .and_then(|rest| rest.strip_prefix('.'))
        .filter(|c| !c.is_empty());
    let name = match class {
        Some(class) => format!("{file}::{}::{}", class.replace('.', "::"), case.name),
        None => format!("{file}::{}", case.name),
    };
    let text = strip_ansi(&result.text);
    let locations: Vec<(String, u32, String)> = text
        .lines()
        .filter_map(|line| {
            let caps = LOCATION.captures(line.trim_end())?;
            Some((
                caps[1].to_owned(),
                caps[2].parse().ok()?,
                caps[3].to_owned(),
            ))
        })
        .collect();
    let line = locations
        .iter()
        .rev()
        .find(|(path, _, _)| *path == file)
        .map(|(_, line, _)| *line)
        .or(case.line.map(|l| l + 1))
        .unwrap_or(0);
    let exception = locations
        .last()
        .map(|(_, _, kind)| kind.as_str())
        .filter(|k| !k.is_empty());
    let raw = strip_ansi(&result.message);
    // `<error message="failed on setup with &quot;...&quot;">` already names the exception.
    let message = if result.kind == "error" {
        raw.trim().to_owned()
    } else {
        with_type(exception, raw.trim())
    };
    let error_origin = locations
        .last()
        .filter(|(path, _, _)| !path.starts_with('/'))
        .map(|(path, line, _)| format!("{path}:{line}"))
        .unwrap_or_default();
    TestFailure {
        name,
        file,
        line,
        criticality: criticality(exception, &message) as i32,
        message,
        test_line: case.line.map_or(0, |l| l + 1),
        error_origin,
        ..TestFailure::default()
    }
}

/// Guesses the test file from a dotted classname (xunit2 has no `file`): module parts are
/// lowercase by convention, classes are not.
fn file_from_classname(classname: &str) -> String {
    let parts: Vec<&str> = classname
        .split('.')
        .take_while(|part| !part.starts_with(|c: char| c.is_ascii_uppercase()))
        .collect();
    format!("{}.py", parts.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    // A real pytest 9.2.0 junit.xml (xunit1), with the ImportError traceback trimmed.
    const XML: &str = r#"<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" errors="2" failures="2" skipped="1" tests="6" time="0.107" timestamp="2026-11-21T11:49:19.042672+00:00" hostname="vm"><testcase classname="" name="tests.test_imp" file="tests/test_imp.py" time="0.000"><error message="collection failure">ImportError while importing test module '/tmp/pyproj/tests/test_imp.py'.
tests/test_imp.py:1: in &lt;module&gt;
    from calc.missing import nothing
E   ModuleNotFoundError: No module named 'calc.missing'</error></testcase><testcase classname="tests.test_ops" name="test_add" file="tests/test_ops.py" line="4" time="0.001" /><testcase classname="tests.test_ops" name="test_divide_fails" file="tests/test_ops.py" line="8" time="0.001"><failure message="assert 2.5 == 2&#10; +  where 2.5 = divide(10, 4)">def test_divide_fails():
&gt;       assert divide(10, 4) == 2
E       assert 2.5 == 2
E        +  where 2.5 = divide(10, 4)

tests/test_ops.py:10: AssertionError</failure></testcase><testcase classname="tests.test_ops.TestParse" name="test_parse_raises" file="tests/test_ops.py" line="12" time="0.001"><failure message="KeyError: 'name'">def test_parse_raises():
&gt;       parse({})

tests/test_ops.py:14: 
_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ 

d = {}

    def parse(d):
&gt;       return d["name"]
E       KeyError: 'name'

calc/ops.py:12: KeyError</failure></testcase><testcase classname="tests.test_ops" name="test_skipped" file="tests/test_ops.py" line="16" time="0.000"><skipped type="pytest.skip" message="not now">/tmp/pyproj/tests/test_ops.py:17: not now</skipped></testcase><testcase classname="tests.test_ops" name="test_setup_error" file="tests/test_ops.py" line="26" time="0.000"><error message="failed on setup with &quot;RuntimeError: fixture exploded&quot;">@pytest.fixture
    def broken():
&gt;       raise RuntimeError("fixture exploded")
E       RuntimeError: fixture exploded

tests/test_ops.py:24: RuntimeError</error></testcase></testsuite></testsuites>"#;

    #[test]
    fn parses_a_real_report() {
        let parsed = parse(XML).expect("junit parses");
        assert_eq!(
            parsed.totals,
            TestTotals {
                total: 5,
                passed: 1,
                failed: 2,
                skipped: 1,
                errors: 1
            }
        );
        assert_eq!(parsed.collection_errors, 1);
        let f = &parsed.failures;
        assert_eq!(f.len(), 4);
        assert_eq!((f[0].name.as_str(), f[0].line), ("tests/test_imp.py", 1));
        assert_eq!(
            f[0].message,
            "ModuleNotFoundError: No module named 'calc.missing'"
        );
        assert_eq!(f[1].name, "tests/test_ops.py::test_divide_fails");
        assert_eq!(f[1].line, 10);
        assert_eq!(
            f[1].message,
            "AssertionError: assert 2.5 == 2\n +  where 2.5 = divide(10, 4)"
        );
        assert_eq!(troupe_proto::names::name(f[1].criticality()), "high");
        assert_eq!(f[2].name, "tests/test_ops.py::TestParse::test_parse_raises");
        assert_eq!(f[2].line, 14);
        assert_eq!(f[2].message, "KeyError: 'name'");
        assert_eq!(f[3].line, 24);
        assert_eq!(
            f[3].message,
            "failed on setup with \"RuntimeError: fixture exploded\""
        );
    }

    #[test]
    fn unescapes_entities() {
        assert_eq!(
            unescape("a &lt;b&gt; &amp; &quot;c&quot; &#10;&#x41; &bogus; & x"),
            "a <b> & \"c\" \nA &bogus; & x"
        );
    }

    #[test]
    fn refuses_truncated_documents() {
        assert!(parse("<testsuite tests=\"1\"><testcase name=\"a").is_err());
    }

    #[test]
    fn guesses_files_from_classnames() {
        assert_eq!(
            file_from_classname("tests.test_math.TestMath"),
            "tests/test_math.py"
        );
    }
}
