//! The reviewer (REVIEW-* tasks): CCW 1.D.7's four dimensions with concrete, line-based
//! detectors over the changed files, each finding with file, line and severity.
//!
//! | dimension | rule | severity |
//! |---|---|---|
//! | quality | `empty-catch` (JS/TS `catch {}`), `bare-except-pass` (Python `except: pass`) | high |
//! | quality | `any-in-export` (`any` in an exported TS signature), `ts-ignore` | medium |
//! | quality | `console-log` | low |
//! | security | `hardcoded-secret` (key/token/password patterns), `sql-concatenation` | critical |
//! | security | `eval-exec` (`eval(`, `exec(`, `new Function(`), `inner-html` | high |
//! | architecture | `circular-import` (between changed modules) | high |
//! | architecture | `deep-parent-import` (`../../../`, Python `from ....`) | medium |
//! | architecture | `long-file` (over 500 lines) | low |
//! | requirements | a criterion, file or verification check that failed or errored | high |
//! | requirements | a criterion that needs manual review | medium |
//!
//! Detectors look only at what they are about (crate::lexer masks comments and strings per
//! language family): code patterns see code, not comments or string contents; `sql-concatenation`
//! and `deep-parent-import` see code and strings; `ts-ignore` sees comments; `hardcoded-secret`
//! sees everything (a key in a comment is leaked too). Lines are those of the file.
//!
//! Verdict: BLOCK on any critical finding, CONDITIONAL on high or medium ones, else APPROVE.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use std::sync::LazyLock;

use regex::Regex;
use troupe_proto::v1::{
    CheckKind, CheckResult, CheckStatus, ReviewDimension, ReviewFinding, ReviewReport,
    ReviewVerdict, Severity,
};

use crate::lexer::{self, Family};

/// Lines above which a file is flagged.
pub const LONG_FILE_LINES: usize = 500;

fn re(pattern: &str) -> Regex {
    Regex::new(pattern).expect("review patterns are valid")
}

struct Rule {
    dimension: ReviewDimension,
    name: &'static str,
    severity: Severity,
    message: &'static str,
    /// Which files it applies to.
    lang: Lang,
    /// What part of the text it looks at.
    view: View,
    pattern: Regex,
}

/// The part of a source file a detector looks at (crate::lexer).
#[derive(Clone, Copy, PartialEq, Eq)]
enum View {
    /// Code only: comments and string contents blanked.
    Code,
    /// Code and string literals, comments blanked.
    CodeAndStrings,
    /// Comments only.
    Comments,
    /// The whole text: a secret is leaked wherever it is written.
    Raw,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Lang {
    Js,
    Ts,
    Py,
    JsPy,
    Any,
}

static RULES: LazyLock<Vec<Rule>> = LazyLock::new(|| {
    use Severity::{Critical, High, Low, Medium};
    let rule = |dimension, name, severity, lang, message, pattern: &str| Rule {
        dimension,
        name,
        severity,
        lang,
        view: match name {
            "ts-ignore" => View::Comments,
            "hardcoded-secret" => View::Raw,
            "sql-concatenation" | "deep-parent-import" => View::CodeAndStrings,
            _ => View::Code,
        },
        message,
        pattern: re(pattern),
    };
    vec![
        rule(
            ReviewDimension::Quality,
            "empty-catch",
            High,
            Lang::Js,
            "empty catch block swallows errors",
            r"catch\s*(?:\([^)]*\))?\s*\{\s*\}",
        ),
        rule(
            ReviewDimension::Quality,
            "bare-except-pass",
            High,
            Lang::Py,
            "`except: pass` swallows every error",
            r"(?m)^[ \t]*except(?:\s+(?:Exception|BaseException))?\s*:\s*(?:#[^\n]*)?\n?[ \t]*pass\b",
        ),
        rule(
            ReviewDimension::Quality,
            "any-in-export",
            Medium,
            Lang::Ts,
            "`any` in an exported signature",
            r"(?m)^[ \t]*export\b[^\n]*(?::\s*any\b|<any>|\bany\[\])",
        ),
        rule(
            ReviewDimension::Quality,
            "ts-ignore",
            Medium,
            Lang::Js,
            "`@ts-ignore` hides a type error",
            r"@ts-ignore",
        ),
        rule(
            ReviewDimension::Quality,
            "console-log",
            Low,
            Lang::Js,
            "`console.log` left in code",
            r"\bconsole\.log\s*\(",
        ),
        rule(
            ReviewDimension::Security,
            "hardcoded-secret",
            Critical,
            Lang::Any,
            "hard-coded secret",
            r#"(?i)(?:AKIA[0-9A-Z]{16}|-----BEGIN (?:RSA |EC |OPENSSH |DSA )?PRIVATE KEY-----|\bgh[pousr]_[A-Za-z0-9]{36}\b|\bsk-[A-Za-z0-9_-]{20,}|\bxox[baprs]-[A-Za-z0-9-]{10,}|\b(?:password|passwd|pwd|secret|api[_-]?key|access[_-]?token|auth[_-]?token|private[_-]?key)\b["']?\s*[:=]\s*["'][^"'\s]{8,}["'])"#,
        ),
        rule(
            ReviewDimension::Security,
            "sql-concatenation",
            Critical,
            Lang::JsPy,
            "SQL built from strings (injection risk); use parameters",
            &sql_pattern(),
        ),
        rule(
            ReviewDimension::Security,
            "eval-exec",
            High,
            Lang::JsPy,
            "dynamic code execution",
            r"(?:^|[^\w.])(?:eval|exec)\s*\(|\bnew\s+Function\s*\(",
        ),
        rule(
            ReviewDimension::Security,
            "inner-html",
            High,
            Lang::Js,
            "HTML injection sink",
            r"\.(?:inner|outer)HTML\s*=[^=]|dangerouslySetInnerHTML",
        ),
        rule(
            ReviewDimension::Architecture,
            "deep-parent-import",
            Medium,
            Lang::JsPy,
            "import reaches more than 2 levels up",
            r#"(?:from\s+|require\s*\(\s*|import\s*\(?\s*)["'](?:\.\./){3,}|(?m)^\s*from\s+\.{4,}"#,
        ),
    ]
});

/// A string literal holding SQL that is concatenated, %-formatted, `.format`ted or
/// interpolated (f-strings, template literals), per quote character.
fn sql_pattern() -> String {
    let keywords = |q: &str| {
        format!(
            r"\b(?:select\b[^{q}\n]*\bfrom|insert\s+into|update\b[^{q}\n]*\bset|delete\s+from)\b"
        )
    };
    let mut alternatives = Vec::new();
    for q in ["\"", "'"] {
        let kw = keywords(q);
        alternatives.push(format!(
            r"{q}[^{q}\n]*{kw}[^{q}\n]*{q}\s*(?:\+|%\s*[\w(]|\.format\()"
        ));
        alternatives.push(format!(r"\bf{q}[^{q}\n]*{kw}[^{q}\n]*\{{"));
        alternatives.push(format!(r"\+\s*{q}[^{q}\n]*\b(?:where|values|from)\b"));
    }
    let kw = keywords("`");
    alternatives.push(format!(r"`[^`\n]*{kw}[^`\n]*\$\{{"));
    format!("(?i)(?:{})", alternatives.join("|"))
}

fn lang_of(path: &str) -> Option<Lang> {
    match Path::new(path)
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
    {
        "ts" | "tsx" | "mts" | "cts" => Some(Lang::Ts),
        "js" | "jsx" | "mjs" | "cjs" => Some(Lang::Js),
        "py" => Some(Lang::Py),
        _ => None,
    }
}

fn applies(rule: Lang, file: Option<Lang>) -> bool {
    matches!(
        (rule, file),
        (Lang::Any, _)
            | (Lang::Js, Some(Lang::Js | Lang::Ts))
            | (Lang::Ts, Some(Lang::Ts))
            | (Lang::Py, Some(Lang::Py))
            | (Lang::JsPy, Some(_))
    )
}

fn skip_for_secrets(path: &str) -> bool {
    let name = Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("");
    name.ends_with(".lock") || name == "package-lock.json" || name.ends_with(".min.js")
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset].matches('\n').count() + 1
}

fn excerpt(text: &str, line: usize, secret: bool) -> String {
    let content = text
        .lines()
        .nth(line.saturating_sub(1))
        .unwrap_or("")
        .trim();
    let content: String = content.chars().take(160).collect();
    if secret {
        // Keep the shape, not the secret.
        let visible: String = content.chars().take(12).collect();
        format!("{visible}... (masked)")
    } else {
        content
    }
}

fn finding(
    dimension: ReviewDimension,
    rule: &str,
    severity: Severity,
    file: &str,
    line: usize,
    message: String,
    excerpt: String,
) -> ReviewFinding {
    ReviewFinding {
        dimension: dimension as i32,
        rule: rule.to_owned(),
        severity: severity as i32,
        file: file.to_owned(),
        line: u32::try_from(line).unwrap_or(u32::MAX),
        message,
        excerpt,
        ..Default::default()
    }
}

/// Reviews `files` (repo-relative, present in `worktree`) and the task's checks.
pub(crate) fn review(worktree: &Path, files: &[String], checks: &[CheckResult]) -> ReviewReport {
    let mut findings = Vec::new();
    let mut reviewed = Vec::new();
    let mut sources: BTreeMap<String, String> = BTreeMap::new();
    for file in files {
        let Ok(bytes) = std::fs::read(worktree.join(file)) else {
            continue;
        };
        if bytes.contains(&0) {
            continue; // binary
        }
        let text = String::from_utf8_lossy(&bytes).into_owned();
        reviewed.push(file.clone());
        let lang = lang_of(file);
        let views = lang.map(|l| {
            lexer::views(
                &text,
                if l == Lang::Py {
                    Family::Python
                } else {
                    Family::Js
                },
            )
        });
        for rule in RULES.iter() {
            if !applies(rule.lang, lang)
                || (rule.name == "hardcoded-secret" && skip_for_secrets(file))
            {
                continue;
            }
            // Views keep every byte offset, so lines and excerpts come from the real text.
            let seen = match (&views, rule.view) {
                (None, _) | (_, View::Raw) => &text,
                (Some(v), View::Code) => &v.code,
                (Some(v), View::CodeAndStrings) => &v.code_and_strings,
                (Some(v), View::Comments) => &v.comments,
            };
            for m in rule.pattern.find_iter(seen) {
                // A pattern may begin with the character before its subject (`[^\w.]eval`),
                // which can be the previous line's newline: count from the first visible byte.
                let line = line_of(&text, m.end() - m.as_str().trim_start().len());
                findings.push(finding(
                    rule.dimension,
                    rule.name,
                    rule.severity,
                    file,
                    line,
                    rule.message.to_owned(),
                    excerpt(&text, line, rule.name == "hardcoded-secret"),
                ));
            }
        }
        let lines = text.lines().count();
        if lang.is_some() && lines > LONG_FILE_LINES {
            findings.push(finding(
                ReviewDimension::Architecture,
                "long-file",
                Severity::Low,
                file,
                0,
                format!("{lines} lines (over {LONG_FILE_LINES}); consider splitting it"),
                String::new(),
            ));
        }
        // Imports are read from code (JS import paths are strings; comments never count).
        match (lang, views) {
            (Some(Lang::Py), Some(v)) => {
                sources.insert(file.clone(), v.code);
            }
            (Some(_), Some(v)) => {
                sources.insert(file.clone(), v.code_and_strings);
            }
            _ => {}
        }
    }
    findings.extend(cycles(&sources));
    for check in checks {
        let (severity, what) = match check.status() {
            CheckStatus::Fail | CheckStatus::Error => (Severity::High, "not met"),
            CheckStatus::ManualReview if check.kind() == CheckKind::Criterion => {
                (Severity::Medium, "not verified")
            }
            _ => continue,
        };
        if !matches!(
            check.kind(),
            CheckKind::Criterion | CheckKind::File | CheckKind::Verification
        ) {
            continue;
        }
        findings.push(finding(
            ReviewDimension::Requirements,
            &format!(
                "{}-{}",
                troupe_proto::names::name(check.kind()),
                what.replace(' ', "-")
            ),
            severity,
            "",
            0,
            format!("{} {what}: {}", check.name, check.subject),
            troupe_process::tail(&check.evidence, 3, 300),
        ));
    }
    findings.sort_by(|a, b| {
        (a.file.as_str(), a.line, &a.rule).cmp(&(b.file.as_str(), b.line, &b.rule))
    });
    ReviewReport {
        verdict: verdict(&findings) as i32,
        findings,
        files_reviewed: reviewed,
    }
}

/// BLOCK on any critical finding, CONDITIONAL on high or medium, else APPROVE.
pub(crate) fn verdict(findings: &[ReviewFinding]) -> ReviewVerdict {
    let has = |s: Severity| findings.iter().any(|f| f.severity() == s);
    if has(Severity::Critical) {
        ReviewVerdict::Block
    } else if has(Severity::High) || has(Severity::Medium) {
        ReviewVerdict::Conditional
    } else {
        ReviewVerdict::Approve
    }
}

static JS_IMPORT: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r#"(?m)(?:^\s*import\b[^'"\n]*?(?:from\s*)?|^\s*export\b[^'"\n]*?from\s*|require\s*\(\s*|import\s*\(\s*)["'](\.{1,2}/[^"']*)["']"#,
    )
});
static PY_IMPORT: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?m)^[ \t]*(?:from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+([\w, \t]+)|import[ \t]+([\w.]+))")
});

/// Normalizes `a/./b/../c` without touching the file system; `None` if it escapes the root.
fn normalize(path: &Path) -> Option<String> {
    let mut parts: Vec<String> = Vec::new();
    for c in path.components() {
        match c {
            Component::Normal(p) => parts.push(p.to_string_lossy().into_owned()),
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::CurDir => {}
            _ => return None,
        }
    }
    Some(parts.join("/"))
}

/// Changed modules each changed module imports, with the import's line.
fn imports(file: &str, text: &str, known: &BTreeSet<&str>) -> Vec<(String, usize)> {
    let dir = Path::new(file).parent().unwrap_or(Path::new(""));
    let mut out = Vec::new();
    match lang_of(file) {
        Some(Lang::Py) => {
            let package: Vec<&str> = file.split('/').collect();
            let package = &package[..package.len().saturating_sub(1)];
            for caps in PY_IMPORT.captures_iter(text) {
                let line = line_of(text, caps.get(0).map_or(0, |m| m.start()));
                let mut candidates = Vec::new();
                if let Some(module) = caps.get(3) {
                    candidates.push(module.as_str().replace('.', "/"));
                } else if let Some(from) = caps.get(1) {
                    let from = from.as_str();
                    let dots = from.chars().take_while(|c| *c == '.').count();
                    let rest = from[dots..].replace('.', "/");
                    let base = if dots == 0 {
                        String::new()
                    } else {
                        let keep = package.len().checked_sub(dots - 1);
                        let Some(keep) = keep else { continue };
                        package[..keep].join("/")
                    };
                    let module = [base.as_str(), rest.as_str()]
                        .iter()
                        .filter(|s| !s.is_empty())
                        .copied()
                        .collect::<Vec<_>>()
                        .join("/");
                    candidates.push(module.clone());
                    // `from pkg import mod` may name a submodule.
                    for name in caps.get(2).map_or("", |m| m.as_str()).split(',') {
                        let name = name.trim();
                        if !name.is_empty() {
                            candidates.push(
                                [module.as_str(), name]
                                    .iter()
                                    .filter(|s| !s.is_empty())
                                    .copied()
                                    .collect::<Vec<_>>()
                                    .join("/"),
                            );
                        }
                    }
                }
                for module in candidates {
                    for path in [format!("{module}.py"), format!("{module}/__init__.py")] {
                        if path != file && known.contains(path.as_str()) {
                            out.push((path, line));
                        }
                    }
                }
            }
        }
        Some(_) => {
            for caps in JS_IMPORT.captures_iter(text) {
                let line = line_of(text, caps.get(0).map_or(0, |m| m.start()));
                let Some(target) = caps.get(1).and_then(|m| normalize(&dir.join(m.as_str())))
                else {
                    continue;
                };
                let stem = target.trim_end_matches(".js").to_owned();
                for ext in [
                    "",
                    ".ts",
                    ".tsx",
                    ".js",
                    ".jsx",
                    ".mjs",
                    ".cjs",
                    "/index.ts",
                    "/index.js",
                ] {
                    for base in [&target, &stem] {
                        let path = format!("{base}{ext}");
                        if path != file && known.contains(path.as_str()) {
                            out.push((path, line));
                        }
                    }
                }
            }
        }
        None => {}
    }
    out.sort();
    out.dedup_by(|a, b| a.0 == b.0);
    out
}

/// One `circular-import` finding per cycle among the changed modules.
fn cycles(sources: &BTreeMap<String, String>) -> Vec<ReviewFinding> {
    let known: BTreeSet<&str> = sources.keys().map(String::as_str).collect();
    let graph: BTreeMap<&str, Vec<(String, usize)>> = sources
        .iter()
        .map(|(file, text)| (file.as_str(), imports(file, text, &known)))
        .collect();
    let mut reported: BTreeSet<Vec<String>> = BTreeSet::new();
    let mut findings = Vec::new();
    for start in graph.keys() {
        // Depth-first search for paths that come back to `start`.
        let mut stack: Vec<(String, Vec<String>)> =
            vec![((*start).to_owned(), vec![(*start).to_owned()])];
        while let Some((node, path)) = stack.pop() {
            for (next, _) in graph.get(node.as_str()).into_iter().flatten() {
                if next == start {
                    let mut key = path.clone();
                    key.sort();
                    if reported.insert(key) {
                        let line = graph[*start]
                            .iter()
                            .find(|(n, _)| {
                                *n == path.get(1).cloned().unwrap_or_else(|| (*start).to_owned())
                            })
                            .map_or(0, |(_, l)| *l);
                        let mut cycle = path.clone();
                        cycle.push((*start).to_owned());
                        findings.push(finding(
                            ReviewDimension::Architecture,
                            "circular-import",
                            Severity::High,
                            start,
                            line,
                            format!("circular import: {}", cycle.join(" -> ")),
                            String::new(),
                        ));
                    }
                } else if !path.contains(next) && path.len() < 16 {
                    let mut longer = path.clone();
                    longer.push(next.clone());
                    stack.push((next.clone(), longer));
                }
            }
        }
    }
    findings
}

/// Paths under `root` (files only, repo-relative, `.git` and `node_modules` skipped), for a
/// review with no base commit.
pub(crate) fn all_files(root: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path: PathBuf = entry.path();
            let name = entry.file_name();
            if name == ".git" || name == "node_modules" || name == "target" {
                continue;
            }
            if path.is_dir() {
                walk(root, &path, out);
            } else if let Ok(rel) = path.strip_prefix(root) {
                out.push(rel.display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules_hit(file: &str, text: &str) -> Vec<(String, u32)> {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(file);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(&path, text).expect("write");
        review(dir.path(), &[file.to_owned()], &[])
            .findings
            .into_iter()
            .map(|f| (f.rule, f.line))
            .collect()
    }

    #[test]
    fn detectors_report_rule_and_line() {
        assert_eq!(
            rules_hit("a.ts", "let x = 1;\ntry { f() } catch (e) {}\n"),
            [("empty-catch".to_owned(), 2)]
        );
        assert_eq!(
            rules_hit("a.ts", "export function f(x: any): void {}\n"),
            [("any-in-export".to_owned(), 1)]
        );
        assert_eq!(rules_hit("a.ts", "function f(x: any) {}\n"), []);
        assert_eq!(
            rules_hit("a.py", "try:\n    f()\nexcept:\n    pass\n"),
            [("bare-except-pass".to_owned(), 3)]
        );
        assert_eq!(
            rules_hit("a.py", "API_KEY = \"abcd1234efgh5678\"\n"),
            [("hardcoded-secret".to_owned(), 1)]
        );
        assert_eq!(
            rules_hit("a.py", "q = \"SELECT * FROM users WHERE id = \" + uid\n"),
            [("sql-concatenation".to_owned(), 1)]
        );
        assert_eq!(
            rules_hit("a.py", "q = f\"SELECT * FROM users WHERE id = {uid}\"\n"),
            [("sql-concatenation".to_owned(), 1)]
        );
        assert_eq!(
            rules_hit(
                "a.py",
                "cur.execute(\"SELECT * FROM users WHERE id = ?\", (uid,))\n"
            ),
            []
        );
        assert_eq!(
            rules_hit("a.js", "el.innerHTML = html;\nconsole.log(1);\n"),
            [("inner-html".to_owned(), 1), ("console-log".to_owned(), 2)]
        );
        assert_eq!(
            rules_hit("a.js", "eval(code)\n"),
            [("eval-exec".to_owned(), 1)]
        );
        assert_eq!(
            rules_hit("a/b/c.js", "import x from '../../../x';\n"),
            [("deep-parent-import".to_owned(), 1)]
        );
        assert_eq!(rules_hit("a.js", "import x from '../x';\n"), []);
    }

    #[test]
    fn detectors_ignore_comments_and_strings_unless_they_are_about_them() {
        // In a comment or a string: no finding. The same in code: found, on its own line.
        assert_eq!(
            rules_hit(
                "a.js",
                "// eval(code) is dangerous
const help = \"never call eval(x) or console.log(y)\";
/* el.innerHTML = x;\n   eval(z) */
const t = `eval(${name})\nconsole.log(1)`;
const r = /eval\\(/;
eval(code);
"
            ),
            [("eval-exec".to_owned(), 8)]
        );
        assert_eq!(
            rules_hit(
                "a.py",
                "# exec(x) would be bad
DOC = \"\"\"\nexec(y)\neval(z)\n\"\"\"\nmsg = 'call eval(q)'\nexec(code)\n"
            ),
            [("eval-exec".to_owned(), 7)]
        );
        // `@ts-ignore` is about comments: a comment fires, a string does not.
        assert_eq!(
            rules_hit(
                "a.ts",
                "const s = \"@ts-ignore\";\n/*\n * @ts-ignore\n */\nf();\n"
            ),
            [("ts-ignore".to_owned(), 3)]
        );
        // A secret inside a string literal (even a template literal) still fires; one only
        // named in a comment-free string of prose does not.
        assert_eq!(
            rules_hit(
                "a.ts",
                "// set the API key from the environment\nconst key = `sk-live-0123456789abcdefghijkl`;\n"
            ),
            [("hardcoded-secret".to_owned(), 2)]
        );
        assert_eq!(
            rules_hit(
                "a.py",
                "def f():\n    token = \"ghp_0123456789abcdefghijklmnopqrstuvwxyz\"\n"
            ),
            [("hardcoded-secret".to_owned(), 2)]
        );
        // SQL built from strings is about strings and code together; in a comment it is not.
        assert_eq!(
            rules_hit(
                "a.py",
                "# q = \"SELECT * FROM t WHERE id = \" + uid\nq = \"SELECT * FROM t WHERE id = \" + uid\n"
            ),
            [("sql-concatenation".to_owned(), 2)]
        );
        // Commented-out imports do not make a cycle; deep imports in comments do not count.
        assert_eq!(
            rules_hit(
                "a/b/c.js",
                "// import x from '../../../x';\nimport y from '../y';\n"
            ),
            []
        );
        let sources: BTreeMap<String, String> = [
            ("s/a.ts".to_owned(), "import { b } from './b';\n".to_owned()),
            (
                "s/b.ts".to_owned(),
                "// import { a } from './a';\n".to_owned(),
            ),
        ]
        .into();
        let dir = tempfile::tempdir().expect("tempdir");
        for (file, text) in &sources {
            std::fs::create_dir_all(dir.path().join("s")).expect("mkdir");
            std::fs::write(dir.path().join(file), text).expect("write");
        }
        let files: Vec<String> = sources.keys().cloned().collect();
        assert!(review(dir.path(), &files, &[]).findings.is_empty());
    }

    #[test]
    fn finds_cycles_between_changed_modules() {
        let sources: BTreeMap<String, String> = [
            (
                "src/a.ts".to_owned(),
                "import { b } from './b';\n".to_owned(),
            ),
            (
                "src/b.ts".to_owned(),
                "\nimport { a } from \"./a\";\n".to_owned(),
            ),
            ("pkg/x.py".to_owned(), "from pkg import y\n".to_owned()),
            ("pkg/y.py".to_owned(), "from . import x\n".to_owned()),
            ("pkg/z.py".to_owned(), "import pkg.x\n".to_owned()),
        ]
        .into();
        let found = cycles(&sources);
        let messages: Vec<&str> = found.iter().map(|f| f.message.as_str()).collect();
        assert_eq!(found.len(), 2, "{messages:?}");
        assert!(
            messages
                .iter()
                .any(|m| m.contains("pkg/x.py -> pkg/y.py -> pkg/x.py")),
            "{messages:?}"
        );
        assert!(
            messages
                .iter()
                .any(|m| m.contains("src/a.ts -> src/b.ts -> src/a.ts")),
            "{messages:?}"
        );
        assert_eq!(found[1].line, 1);
    }

    #[test]
    fn verdicts_follow_severity() {
        let f = |s: Severity| ReviewFinding {
            severity: s as i32,
            ..ReviewFinding::default()
        };
        assert_eq!(verdict(&[]), ReviewVerdict::Approve);
        assert_eq!(verdict(&[f(Severity::Low)]), ReviewVerdict::Approve);
        assert_eq!(
            verdict(&[f(Severity::Low), f(Severity::Medium)]),
            ReviewVerdict::Conditional
        );
        assert_eq!(
            verdict(&[f(Severity::High), f(Severity::Critical)]),
            ReviewVerdict::Block
        );
    }
}
