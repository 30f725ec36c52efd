//! A small lexer per language family the review detectors cover (JS/TS and Python) that tells
//! code, string literals and comments apart, so a detector can look at only what it is about:
//! `eval(` in a comment or a string is not code, `@ts-ignore` in a string is not a directive.
//!
//! Each view has exactly the bytes of the source with the parts it hides replaced by spaces
//! (newlines kept), so byte offsets and line numbers in a view are those of the file.
//!
//! JS/TS: `//` and `/* */` comments, `'` and `"` strings, template literals (multi-line, with
//! `${ ... }` lexed as code, nested), and regex literals (after an operator or `(`, `,`, `=`
//! and the like), treated as strings. Python: `#` comments, `'`/`"` strings with any prefix,
//! triple-quoted strings (multi-line). Unterminated single-line strings end at the line end.

/// What a byte of the source is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Code,
    /// A string literal's opening or closing quote (kept in the code view).
    Quote,
    /// Inside a string literal (or a JS regex literal).
    Str,
    Comment,
}

/// Which lexer applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    Js,
    Python,
}

/// Three views of one source text, byte for byte aligned with it.
#[derive(Debug)]
pub(crate) struct Views {
    /// Comments and string contents blanked (quotes kept): for code patterns.
    pub(crate) code: String,
    /// Comments blanked, strings kept: for patterns about what code does with strings
    /// (SQL built from strings, import paths).
    pub(crate) code_and_strings: String,
    /// Only comments kept: for patterns about comments (`@ts-ignore`).
    pub(crate) comments: String,
}

/// Lexes `text` as `family`.
pub(crate) fn views(text: &str, family: Family) -> Views {
    let bytes = text.as_bytes();
    let mut kinds = vec![Kind::Code; bytes.len()];
    match family {
        Family::Js => {
            js_code(bytes, 0, &mut kinds, false, 0);
        }
        Family::Python => python(bytes, &mut kinds),
    }
    let view = |hide: &dyn Fn(Kind) -> bool| -> String {
        let out: Vec<u8> = bytes
            .iter()
            .zip(&kinds)
            .map(|(b, k)| if *b != b'\n' && hide(*k) { b' ' } else { *b })
            .collect();
        // Every byte of a multi-byte character has the same kind (kinds only change at ASCII
        // bytes), so a character is either kept whole or turned into spaces whole.
        String::from_utf8(out)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    };
    Views {
        code: view(&|k| matches!(k, Kind::Str | Kind::Comment)),
        code_and_strings: view(&|k| k == Kind::Comment),
        comments: view(&|k| k != Kind::Comment),
    }
}

fn mark(kinds: &mut [Kind], from: usize, to: usize, kind: Kind) {
    let to = to.min(kinds.len());
    if from < to {
        kinds[from..to].fill(kind);
    }
}

/// Past the end of a quoted literal starting after its opening quote at `i`: the index of the
/// closing quote (or of the newline / end that cut it short).
fn quoted_end(b: &[u8], mut i: usize, quote: u8, multiline: bool) -> usize {
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            c if c == quote => return i,
            b'\n' if !multiline => return i,
            _ => i += 1,
        }
    }
    b.len()
}

/// Nesting of template literals inside `${}` beyond which the rest counts as a string.
const MAX_DEPTH: usize = 64;

/// Lexes JS/TS code from `i`; with `in_interpolation`, stops after the `}` that closes a
/// template's `${` and returns the index after it.
fn js_code(
    b: &[u8],
    mut i: usize,
    kinds: &mut [Kind],
    in_interpolation: bool,
    depth: usize,
) -> usize {
    let mut braces = 0usize;
    // The last significant code byte, for telling a regex literal from a division.
    let mut prev: Option<u8> = None;
    let mut prev_word_end = 0usize;
    while i < b.len() {
        let c = b[i];
        match c {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                let end = b[i..]
                    .iter()
                    .position(|x| *x == b'\n')
                    .map_or(b.len(), |p| i + p);
                mark(kinds, i, end, Kind::Comment);
                i = end;
                continue;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let end = find(b, i + 2, b"*/").map_or(b.len(), |p| p + 2);
                mark(kinds, i, end, Kind::Comment);
                i = end;
                continue;
            }
            b'/' if regex_allowed(b, prev, prev_word_end) => {
                let end = regex_end(b, i + 1);
                mark(kinds, i, i + 1, Kind::Quote);
                mark(kinds, i + 1, end, Kind::Str);
                if end < b.len() && b[end] == b'/' {
                    mark(kinds, end, end + 1, Kind::Quote);
                    i = end + 1;
                } else {
                    i = end;
                }
                prev = Some(b'/');
                continue;
            }
            b'\'' | b'"' => {
                let end = quoted_end(b, i + 1, c, false);
                mark(kinds, i, i + 1, Kind::Quote);
                mark(kinds, i + 1, end, Kind::Str);
                if end < b.len() && b[end] == c {
                    mark(kinds, end, end + 1, Kind::Quote);
                    i = end + 1;
                } else {
                    i = end;
                }
                prev = Some(c);
                continue;
            }
            b'`' => {
                mark(kinds, i, i + 1, Kind::Quote);
                i = template(b, i + 1, kinds, depth);
                prev = Some(b'`');
                continue;
            }
            b'{' => braces += 1,
            b'}' => {
                if braces == 0 && in_interpolation {
                    return i + 1;
                }
                braces = braces.saturating_sub(1);
            }
            _ => {}
        }
        if !c.is_ascii_whitespace() {
            prev = Some(c);
            if c.is_ascii_alphanumeric() || c == b'_' || c == b'$' {
                prev_word_end = i + 1;
            }
        }
        i += 1;
    }
    b.len()
}

/// Lexes a template literal's body from `i` (after the backtick); returns the index after the
/// closing backtick.
fn template(b: &[u8], mut i: usize, kinds: &mut [Kind], depth: usize) -> usize {
    let start = i;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'`' => {
                mark(kinds, start, i, Kind::Str);
                mark(kinds, i, i + 1, Kind::Quote);
                return i + 1;
            }
            b'$' if b.get(i + 1) == Some(&b'{') && depth < MAX_DEPTH => {
                mark(kinds, start, i, Kind::Str);
                let end = js_code(b, i + 2, kinds, true, depth + 1);
                return template(b, end, kinds, depth);
            }
            _ => i += 1,
        }
    }
    mark(kinds, start, b.len(), Kind::Str);
    b.len()
}

/// Whether a `/` here starts a regex literal rather than dividing: at the start, after an
/// operator or opening bracket, or after a keyword such as `return`.
fn regex_allowed(b: &[u8], prev: Option<u8>, prev_word_end: usize) -> bool {
    match prev {
        None => true,
        Some(p) if b"(,=:[!&|?{};+-*%<>~^".contains(&p) => true,
        Some(p) if p.is_ascii_alphanumeric() || p == b'_' || p == b'$' => {
            let start = b[..prev_word_end]
                .iter()
                .rposition(|c| !(c.is_ascii_alphanumeric() || *c == b'_' || *c == b'$'))
                .map_or(0, |p| p + 1);
            matches!(
                &b[start..prev_word_end],
                b"return"
                    | b"typeof"
                    | b"case"
                    | b"do"
                    | b"else"
                    | b"in"
                    | b"of"
                    | b"void"
                    | b"yield"
                    | b"await"
            )
        }
        Some(_) => false,
    }
}

/// The closing `/` of a regex literal body starting at `i` (a `/` inside `[...]` does not
/// close it), or the newline / end that cuts it short.
fn regex_end(b: &[u8], mut i: usize) -> usize {
    let mut class = false;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'[' => {
                class = true;
                i += 1;
            }
            b']' => {
                class = false;
                i += 1;
            }
            b'/' if !class => return i,
            b'\n' => return i,
            _ => i += 1,
        }
    }
    b.len()
}

fn find(b: &[u8], from: usize, needle: &[u8]) -> Option<usize> {
    b.get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| from + p)
}

fn python(b: &[u8], kinds: &mut [Kind]) {
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'#' => {
                let end = b[i..]
                    .iter()
                    .position(|x| *x == b'\n')
                    .map_or(b.len(), |p| i + p);
                mark(kinds, i, end, Kind::Comment);
                i = end;
            }
            q @ (b'\'' | b'"') => {
                let triple = b.get(i + 1) == Some(&q) && b.get(i + 2) == Some(&q);
                if triple {
                    let mut j = i + 3;
                    let close = loop {
                        match b.get(j) {
                            None => break b.len(),
                            Some(b'\\') => j += 2,
                            Some(c)
                                if *c == q
                                    && b.get(j + 1) == Some(&q)
                                    && b.get(j + 2) == Some(&q) =>
                            {
                                break j;
                            }
                            Some(_) => j += 1,
                        }
                    };
                    mark(kinds, i, i + 3, Kind::Quote);
                    mark(kinds, i + 3, close, Kind::Str);
                    mark(kinds, close, close + 3, Kind::Quote);
                    i = (close + 3).min(b.len());
                } else {
                    let end = quoted_end(b, i + 1, q, false);
                    mark(kinds, i, i + 1, Kind::Quote);
                    mark(kinds, i + 1, end, Kind::Str);
                    if end < b.len() && b[end] == q {
                        mark(kinds, end, end + 1, Kind::Quote);
                        i = end + 1;
                    } else {
                        i = end;
                    }
                }
            }
            _ => i += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn js_comments_strings_templates_and_regexes() {
        let src = "eval(a); // eval(b)\n/* eval(c)\n eval(d) */ x = 'eval(e)' + \"eval(f)\";\nconst t = `eval(g)\n${eval(h)} ${ {k: `eval(i)`}.k }`;\nconst r = /eval\\(j\\/\"/; y = a / b / c;\n";
        let v = views(src, Family::Js);
        assert_eq!(v.code.len(), src.len());
        assert_eq!(v.code.lines().count(), src.lines().count());
        let code_evals: Vec<usize> = v.code.match_indices("eval(").map(|(i, _)| i).collect();
        // eval(a) and the interpolated eval(h) are code; the rest are comments or strings.
        assert_eq!(
            code_evals,
            [0, src.find("eval(h)").expect("h")],
            "{}",
            v.code
        );
        assert!(
            v.code.contains("x = '       ' + \"       \";"),
            "{}",
            v.code
        );
        assert!(v.code_and_strings.contains("'eval(e)'"));
        assert!(!v.code_and_strings.contains("eval(b)"));
        assert!(v.comments.contains("// eval(b)") && v.comments.contains("eval(d) */"));
        assert!(!v.comments.contains("eval(a)"));
        // Division is code: `a / b / c` survives.
        assert!(v.code.contains("y = a / b / c;"), "{}", v.code);
    }

    #[test]
    fn python_comments_prefixes_and_triple_quotes() {
        let src = "exec(a)  # exec(b)\ns = '''exec(c)\n# not a comment\nexec(d)'''\nt = rb\"exec(e)\\\"\" + f'{exec(f)}'\nexec(g)\n";
        let v = views(src, Family::Python);
        let found: Vec<usize> = v
            .code
            .match_indices("exec(")
            .map(|(i, _)| src[..i].matches('\n').count() + 1)
            .collect();
        assert_eq!(found, [1, 6], "{}", v.code);
        assert!(v.code_and_strings.contains("# not a comment"));
        assert!(v.comments.contains("# exec(b)"));
        assert!(!v.comments.contains("not a comment"));
    }

    #[test]
    fn multibyte_text_keeps_offsets() {
        let src = "// héllo ✓\nx = \"ünïcode\"; eval(1)\n";
        let v = views(src, Family::Js);
        assert_eq!(v.code.len(), src.len());
        assert_eq!(v.code.find("eval("), src.find("eval("));
        assert!(v.comments.contains("héllo ✓"));
    }
}
