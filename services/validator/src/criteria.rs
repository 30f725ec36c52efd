//! Typed convergence criteria: a small syntax inside criterion strings that a check can decide
//! with evidence. Anything else is free text and goes to the judge (or manual review).
//!
//! ```text
//! cmd: <command line> [=> <expectation>, ...]     expectations: exit <N> | exit nonzero |
//!                                                  stdout|stderr|output ~ /re/ | ... !~ /re/
//! `cmd: <command line>` [exits <N>]               the same, in backticks (default exit 0)
//! file: <path> exists | absent                     state at the checked commit
//! file: <path> contains /re/ | lacks /re/          a (multi-line) regex over its text
//! test: <test id> passes                           pytest node id, or a name in a test report
//! coverage >= <N>[%] [for <path>]                  overall, or one file's, line coverage
//! ```
//!
//! A criterion is typed only when the WHOLE string has one of these forms (optionally inside
//! one pair of backticks); a typed check decides the whole criterion or none of it. A regex is
//! written between slashes (`\/` for a slash inside it) and may end in `/i`.

use std::fmt;

use regex::Regex;

/// What a command criterion expects.
#[derive(Debug, Clone)]
pub(crate) enum Expect {
    /// This exit code.
    Exit(i32),
    /// Any exit code but 0.
    NonZero,
    /// A stream matches (`true`) or does not match (`false`) a regex.
    Output {
        stream: Stream,
        regex: Regex,
        matches: bool,
    },
}

/// Which output a pattern applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stream {
    Stdout,
    Stderr,
    Both,
}

impl fmt::Display for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Stdout => "stdout",
            Self::Stderr => "stderr",
            Self::Both => "output",
        })
    }
}

/// What a file criterion expects.
#[derive(Debug, Clone)]
pub(crate) enum FileExpect {
    Exists,
    Absent,
    Contains(Regex),
    Lacks(Regex),
}

/// A criterion a check can decide.
#[derive(Debug, Clone)]
pub(crate) enum Typed {
    /// Run a command (argv; `sh -c` only when the author wrote shell operators).
    Command {
        line: String,
        argv: Vec<String>,
        expect: Vec<Expect>,
    },
    /// A file's state at the commit.
    File { path: String, expect: FileExpect },
    /// A named test passed.
    Test { id: String },
    /// Line coverage is at least `min` percent, overall or for one file.
    Coverage { min: f64, file: Option<String> },
}

/// How a criterion string parses.
#[derive(Debug)]
pub(crate) enum Parsed {
    Typed(Typed),
    /// Free text. `hint` says why a string that looks typed is not.
    FreeText {
        hint: Option<String>,
    },
}

const PREFIXES: &[&str] = &["cmd:", "file:", "test:", "coverage"];

/// Parses one criterion string.
pub(crate) fn parse(criterion: &str) -> Parsed {
    let text = criterion.trim();
    let attempt = if let Some(rest) = text.strip_prefix('`') {
        // `` `cmd: npm test` exits 0 `` or `` `file: a.py exists` ``
        match rest.find('`') {
            Some(end) => {
                let inner = rest[..end].trim();
                let after = rest[end + 1..].trim();
                if after.is_empty() {
                    parse_typed(inner)
                } else if inner.starts_with("cmd:") {
                    parse_exits_suffix(after).and_then(|expect| {
                        parse_typed(inner).and_then(|typed| match typed {
                            Typed::Command { line, argv, .. } => {
                                Ok(Typed::Command { line, argv, expect })
                            }
                            _ => Err("only a `cmd:` may be followed by an expectation".to_owned()),
                        })
                    })
                } else {
                    Err(format!(
                        "text after the backticks ({after:?}) is not checked by a `{}` criterion",
                        inner.split(':').next().unwrap_or("")
                    ))
                }
            }
            None => Err("unterminated backtick".to_owned()),
        }
    } else {
        parse_typed(text)
    };
    match attempt {
        Ok(typed) => Parsed::Typed(typed),
        Err(reason) => {
            let inner = text.trim_start_matches('`');
            let looks_typed = PREFIXES.iter().any(|p| inner.starts_with(p));
            Parsed::FreeText {
                hint: looks_typed
                    .then(|| format!("looks like a typed criterion but does not parse: {reason}")),
            }
        }
    }
}

fn parse_typed(text: &str) -> Result<Typed, String> {
    if let Some(rest) = text.strip_prefix("cmd:") {
        parse_command(rest.trim())
    } else if let Some(rest) = text.strip_prefix("file:") {
        parse_file(rest.trim())
    } else if let Some(rest) = text.strip_prefix("test:") {
        let rest = rest.trim();
        let id = rest
            .strip_suffix("passes")
            .map(str::trim)
            .filter(|id| !id.is_empty() && !id.contains(char::is_whitespace))
            .ok_or("expected `test: <id> passes` (one id, no spaces)")?;
        Ok(Typed::Test { id: id.to_owned() })
    } else if let Some(rest) = text.strip_prefix("coverage") {
        parse_coverage(rest.trim())
    } else {
        Err("not a typed criterion".to_owned())
    }
}

fn parse_command(rest: &str) -> Result<Typed, String> {
    // The first ` => ` after which everything parses as expectations separates them; a
    // command may itself contain `=>` (JS arrows) as long as its expectations come last.
    let mut candidates: Vec<usize> = rest.match_indices(" => ").map(|(i, _)| i).collect();
    candidates.reverse();
    let mut last_err = None;
    for at in candidates {
        match parse_expectations(&rest[at + 4..]) {
            Ok(expect) => return command(rest[..at].trim(), expect),
            Err(err) => last_err = Some(err),
        }
    }
    if rest.contains(" => ") {
        return Err(last_err.unwrap_or_default());
    }
    command(rest, vec![Expect::Exit(0)])
}

fn command(line: &str, expect: Vec<Expect>) -> Result<Typed, String> {
    let argv = troupe_process::command_line_to_argv(line).map_err(|err| err.to_string())?;
    Ok(Typed::Command {
        line: line.to_owned(),
        argv,
        expect: if expect.is_empty() {
            vec![Expect::Exit(0)]
        } else {
            expect
        },
    })
}

/// `exits 0` / `exits nonzero` / `=> exit 0, stdout ~ /x/` after a backticked command.
fn parse_exits_suffix(after: &str) -> Result<Vec<Expect>, String> {
    if let Some(rest) = after.strip_prefix("=>") {
        return parse_expectations(rest);
    }
    let rest = after.strip_prefix("exits").ok_or_else(|| {
        format!("expected `exits <N>` or `=> ...` after the command, got {after:?}")
    })?;
    parse_expectations(&format!("exit {}", rest.trim()))
}

fn parse_expectations(text: &str) -> Result<Vec<Expect>, String> {
    let mut out = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("exit") {
            let r = r.trim_start();
            let end = r
                .find(|c: char| c == ',' || c.is_whitespace())
                .unwrap_or(r.len());
            let word = &r[..end];
            out.push(if word == "nonzero" {
                Expect::NonZero
            } else {
                Expect::Exit(
                    word.parse()
                        .map_err(|_| format!("`exit` needs a number or `nonzero`, got {word:?}"))?,
                )
            });
            rest = r[end..].trim_start();
        } else {
            let (stream, r) = if let Some(r) = rest.strip_prefix("stdout") {
                (Stream::Stdout, r)
            } else if let Some(r) = rest.strip_prefix("stderr") {
                (Stream::Stderr, r)
            } else if let Some(r) = rest.strip_prefix("output") {
                (Stream::Both, r)
            } else {
                return Err(format!("unknown expectation {rest:?}"));
            };
            let r = r.trim_start();
            let (matches, r) = if let Some(r) = r.strip_prefix("!~") {
                (false, r)
            } else if let Some(r) = r.strip_prefix('~') {
                (true, r)
            } else {
                return Err(format!("expected `~ /re/` or `!~ /re/` after {stream}"));
            };
            let (regex, r) = parse_regex(r.trim_start())?;
            out.push(Expect::Output {
                stream,
                regex,
                matches,
            });
            rest = r.trim_start();
        }
        if let Some(r) = rest.strip_prefix(',') {
            rest = r.trim_start();
        } else if !rest.is_empty() {
            return Err(format!("expected `,` between expectations, got {rest:?}"));
        }
    }
    if out.is_empty() {
        return Err("no expectation after `=>`".to_owned());
    }
    Ok(out)
}

/// `/re/` or `/re/i` at the start of `text`; returns the regex and what follows.
fn parse_regex(text: &str) -> Result<(Regex, &str), String> {
    let body = text
        .strip_prefix('/')
        .ok_or_else(|| format!("a pattern is written /like this/, got {text:?}"))?;
    let mut pattern = String::new();
    let mut chars = body.char_indices();
    let mut end = None;
    while let Some((i, c)) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some((_, '/')) => pattern.push('/'),
                Some((_, other)) => {
                    pattern.push('\\');
                    pattern.push(other);
                }
                None => pattern.push('\\'),
            },
            '/' => {
                end = Some(i);
                break;
            }
            other => pattern.push(other),
        }
    }
    let end = end.ok_or("unterminated /pattern/")?;
    let mut rest = &body[end + 1..];
    let mut builder = regex::RegexBuilder::new(&pattern);
    builder.multi_line(true);
    if let Some(r) = rest.strip_prefix('i')
        && !r.starts_with(|c: char| c.is_alphanumeric())
    {
        builder.case_insensitive(true);
        rest = r;
    }
    let regex = builder
        .build()
        .map_err(|err| format!("bad pattern /{pattern}/: {err}"))?;
    Ok((regex, rest))
}

fn parse_file(rest: &str) -> Result<Typed, String> {
    let (path, after) = if let Some(r) = rest.strip_prefix('"') {
        let end = r.find('"').ok_or("unterminated quoted path")?;
        (r[..end].to_owned(), r[end + 1..].trim())
    } else {
        let end = rest
            .find(char::is_whitespace)
            .ok_or("expected `file: <path> exists|absent|contains /re/|lacks /re/`")?;
        (rest[..end].to_owned(), rest[end..].trim())
    };
    let expect = match after {
        "exists" => FileExpect::Exists,
        "absent" | "does not exist" => FileExpect::Absent,
        _ => {
            let (contains, r) = if let Some(r) = after.strip_prefix("contains") {
                (true, r)
            } else if let Some(r) = after.strip_prefix("lacks") {
                (false, r)
            } else {
                return Err(format!(
                    "expected exists, absent, contains /re/ or lacks /re/ after the path, got {after:?}"
                ));
            };
            let (regex, tail) = parse_regex(r.trim())?;
            if !tail.trim().is_empty() {
                return Err(format!(
                    "unexpected text after the pattern: {:?}",
                    tail.trim()
                ));
            }
            if contains {
                FileExpect::Contains(regex)
            } else {
                FileExpect::Lacks(regex)
            }
        }
    };
    Ok(Typed::File {
        path: path.trim_start_matches("./").to_owned(),
        expect,
    })
}

fn parse_coverage(rest: &str) -> Result<Typed, String> {
    let r = rest
        .strip_prefix(">=")
        .ok_or("expected `coverage >= <N>[%] [for <path>]`")?
        .trim();
    let (number, file) = match r.split_once(" for ") {
        Some((n, f)) => (n.trim(), Some(f.trim().trim_start_matches("./").to_owned())),
        None => (r, None),
    };
    let min: f64 = number
        .trim_end_matches('%')
        .trim()
        .parse()
        .map_err(|_| format!("coverage floor must be a number, got {number:?}"))?;
    if !(0.0..=100.0).contains(&min) {
        return Err(format!("coverage floor must be 0-100, got {min}"));
    }
    if file
        .as_deref()
        .is_some_and(|f| f.is_empty() || f.contains(char::is_whitespace))
    {
        return Err("`for` needs one repo-relative path".to_owned());
    }
    Ok(Typed::Coverage { min, file })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn typed(text: &str) -> Typed {
        match parse(text) {
            Parsed::Typed(t) => t,
            Parsed::FreeText { hint } => panic!("{text:?} did not parse: {hint:?}"),
        }
    }

    #[test]
    fn commands_parse_to_argv_with_expectations() {
        match typed("cmd: python3 -c 'print(1)' => exit 0, stdout ~ /^1$/") {
            Typed::Command { argv, expect, .. } => {
                assert_eq!(argv, ["python3", "-c", "print(1)"]);
                assert!(matches!(expect[0], Expect::Exit(0)));
                assert!(matches!(
                    &expect[1],
                    Expect::Output { stream: Stream::Stdout, matches: true, regex } if regex.is_match("1")
                ));
            }
            other => panic!("{other:?}"),
        }
        match typed("`cmd: npm test -- tests/auth` exits 0") {
            Typed::Command { argv, expect, .. } => {
                assert_eq!(argv, ["npm", "test", "--", "tests/auth"]);
                assert!(matches!(expect[..], [Expect::Exit(0)]));
            }
            other => panic!("{other:?}"),
        }
        match typed("cmd: false => exit nonzero, output !~ /panic/i") {
            Typed::Command { expect, .. } => {
                assert!(matches!(expect[0], Expect::NonZero));
                assert!(
                    matches!(&expect[1], Expect::Output { stream: Stream::Both, matches: false, regex } if regex.is_match("PANIC"))
                );
            }
            other => panic!("{other:?}"),
        }
        // Shell operators written by the author run through sh -c, verbatim.
        match typed("cmd: make test && echo ok") {
            Typed::Command { argv, expect, .. } => {
                assert_eq!(argv, ["sh", "-c", "make test && echo ok"]);
                assert!(matches!(expect[..], [Expect::Exit(0)]));
            }
            other => panic!("{other:?}"),
        }
        // A JS arrow inside the command is not mistaken for the separator (`>` is shell
        // syntax, so the author's line runs verbatim under sh -c).
        match typed(r#"cmd: node -e "const f = x => x" => exit 0"#) {
            Typed::Command { argv, .. } => {
                assert_eq!(argv, ["sh", "-c", r#"node -e "const f = x => x""#]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn files_tests_and_coverage_parse() {
        assert!(
            matches!(typed("file: src/x.py exists"), Typed::File { path, expect: FileExpect::Exists } if path == "src/x.py")
        );
        assert!(
            matches!(typed("`file: ./old.py absent`"), Typed::File { path, expect: FileExpect::Absent } if path == "old.py")
        );
        assert!(
            matches!(typed(r"file: src/x.py contains /def median\(/"), Typed::File { expect: FileExpect::Contains(re), .. } if re.is_match("def median(xs):"))
        );
        assert!(matches!(
            typed(r"file: a/b.js lacks /console\.log/"),
            Typed::File {
                expect: FileExpect::Lacks(_),
                ..
            }
        ));
        assert!(
            matches!(typed(r#"file: "dir with space/a.txt" contains /a\/b/"#), Typed::File { path, expect: FileExpect::Contains(re) } if path == "dir with space/a.txt" && re.is_match("a/b"))
        );
        assert!(
            matches!(typed("test: tests/test_x.py::test_y passes"), Typed::Test { id } if id == "tests/test_x.py::test_y")
        );
        assert!(
            matches!(typed("coverage >= 80"), Typed::Coverage { min, file: None } if (min - 80.0).abs() < 1e-9)
        );
        assert!(
            matches!(typed("coverage >= 75.5% for stats/core.py"), Typed::Coverage { file: Some(f), .. } if f == "stats/core.py")
        );
    }

    #[test]
    fn free_text_and_near_misses_are_not_typed() {
        assert!(matches!(
            parse("median() returns the middle value"),
            Parsed::FreeText { hint: None }
        ));
        // Text after a backticked file criterion is not checked, so the criterion is free text.
        assert!(matches!(
            parse("`file: a.py exists` and is documented"),
            Parsed::FreeText { hint: Some(_) }
        ));
        for near in [
            "file: src/x.py frobs",
            "test: the login test passes",
            "coverage is good",
            "coverage >= lots",
            "cmd: true => exit maybe",
            "cmd: 'unterminated",
            "file: a.py contains /unterminated",
        ] {
            match parse(near) {
                Parsed::FreeText { hint: Some(hint) } => {
                    assert!(hint.contains("does not parse"), "{near}: {hint}");
                }
                other => panic!("{near:?} parsed as {other:?}"),
            }
        }
    }
}
