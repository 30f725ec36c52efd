//! Turning a plan author's command line into an argv vector without a shell.

use crate::Error;

/// Substrings that only a shell can interpret. A line containing any of them runs as
/// `sh -c <line>` verbatim, because splitting it ourselves would silently change its meaning
/// (`a && b` would pass `&&` to `a` as an argument). `&` covers `&&`, `|` covers `||`; `$`
/// covers `$(` and variable expansion; `*`, `?` and `[` are globs.
const SHELL_SYNTAX: &[&str] = &["&", "|", ";", ">", "<", "$", "`", "\n", "*", "?", "["];

/// Splits `line` into an argv vector the way a POSIX shell splits words (single quotes,
/// double quotes, backslashes), without running a shell.
///
/// When the line uses shell syntax (control operators `&&` `||` `|` `;` `&`, redirections
/// `>` `<`, substitutions `$(` and backticks, variables `$`, globs, newlines) it is returned as
/// `["sh", "-c", line]` with the line untouched: nothing is ever interpolated into it.
pub fn command_line_to_argv(line: &str) -> Result<Vec<String>, Error> {
    let trimmed = line.trim();
    if trimmed.is_empty() {
        return Err(Error::EmptyCommand);
    }
    if SHELL_SYNTAX.iter().any(|op| trimmed.contains(op)) {
        return Ok(vec!["sh".to_owned(), "-c".to_owned(), line.to_owned()]);
    }
    split_words(trimmed)
}

/// POSIX-style word splitting: no expansion, no operators (the caller has ruled them out).
fn split_words(line: &str) -> Result<Vec<String>, Error> {
    #[derive(Clone, Copy, PartialEq)]
    enum Quote {
        None,
        Single,
        Double,
    }

    let mut words = Vec::new();
    let mut word = String::new();
    // Distinguishes an empty quoted word (`''`) from no word at all.
    let mut in_word = false;
    let mut quote = Quote::None;
    let mut chars = line.chars();

    while let Some(c) = chars.next() {
        match quote {
            Quote::Single => {
                if c == '\'' {
                    quote = Quote::None;
                } else {
                    word.push(c);
                }
            }
            Quote::Double => match c {
                '"' => quote = Quote::None,
                '\\' => match chars.next() {
                    // Inside double quotes a backslash escapes only these.
                    Some(next @ ('"' | '\\' | '$' | '`')) => word.push(next),
                    Some(next) => {
                        word.push('\\');
                        word.push(next);
                    }
                    None => return Err(Error::Parse("trailing backslash".to_owned())),
                },
                _ => word.push(c),
            },
            Quote::None => match c {
                '\'' => {
                    quote = Quote::Single;
                    in_word = true;
                }
                '"' => {
                    quote = Quote::Double;
                    in_word = true;
                }
                '\\' => match chars.next() {
                    Some(next) => {
                        word.push(next);
                        in_word = true;
                    }
                    None => return Err(Error::Parse("trailing backslash".to_owned())),
                },
                c if c.is_whitespace() => {
                    if in_word {
                        words.push(std::mem::take(&mut word));
                        in_word = false;
                    }
                }
                c => {
                    word.push(c);
                    in_word = true;
                }
            },
        }
    }
    match quote {
        Quote::None => {}
        Quote::Single => return Err(Error::Parse("unterminated single quote".to_owned())),
        Quote::Double => return Err(Error::Parse("unterminated double quote".to_owned())),
    }
    if in_word {
        words.push(word);
    }
    if words.is_empty() {
        return Err(Error::EmptyCommand);
    }
    Ok(words)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(line: &str) -> Vec<String> {
        command_line_to_argv(line).expect("parses")
    }

    #[test]
    fn splits_plain_words() {
        assert_eq!(
            argv("pytest -q tests/test_a.py"),
            ["pytest", "-q", "tests/test_a.py"]
        );
        assert_eq!(argv("  a   b\tc  "), ["a", "b", "c"]);
    }

    #[test]
    fn honours_quotes_and_backslashes() {
        assert_eq!(
            argv(r#"python3 -c 'import sys; print(1)'"#),
            // `;` inside the line sends it to sh, verbatim.
            ["sh", "-c", r#"python3 -c 'import sys; print(1)'"#]
        );
        assert_eq!(
            argv(r#"echo "a b" 'c d' e\ f"#),
            ["echo", "a b", "c d", "e f"]
        );
        assert_eq!(argv(r#"echo "say \"hi\" \n""#), ["echo", r#"say "hi" \n"#]);
        assert_eq!(argv(r#"echo '' x"#), ["echo", "", "x"]);
        assert_eq!(argv(r#"echo ab"cd"'ef'"#), ["echo", "abcdef"]);
    }

    #[test]
    fn shell_operators_run_verbatim_under_sh() {
        for line in [
            "make && make test",
            "a || b",
            "grep x f | wc -l",
            "a; b",
            "echo x > out",
            "sort < in",
            "echo $(date)",
            "echo `date`",
            "a\nb",
            "ls src/*.py",
            "echo $HOME",
        ] {
            assert_eq!(argv(line), ["sh", "-c", line], "{line}");
        }
    }

    #[test]
    fn rejects_empty_and_unterminated() {
        assert!(matches!(
            command_line_to_argv("   "),
            Err(Error::EmptyCommand)
        ));
        assert!(matches!(
            command_line_to_argv("echo 'a"),
            Err(Error::Parse(_))
        ));
        assert!(matches!(
            command_line_to_argv("echo \"a"),
            Err(Error::Parse(_))
        ));
        assert!(matches!(
            command_line_to_argv("echo a\\"),
            Err(Error::Parse(_))
        ));
    }
}
