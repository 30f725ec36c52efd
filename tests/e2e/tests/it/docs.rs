//! The documentation's links resolve: every relative link and anchor in the README,
//! CONTRIBUTING.md, the services' READMEs and `docs/*.md` names an existing file, and an anchor
//! names a heading of its page (GitHub's anchors).

use pulldown_cmark::{CodeBlockKind, Event, Options, Parser, Tag, TagEnd};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

fn parser(text: &str) -> Parser<'_> {
    Parser::new_ext(text, Options::ENABLE_TABLES | Options::ENABLE_STRIKETHROUGH)
}

/// The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to `-`,
/// and `-1`, `-2` … on repeats.
pub(crate) fn anchors(text: &str) -> HashSet<String> {
    let mut seen = HashSet::new();
    let mut heading: Option<String> = None;
    for event in parser(text) {
        match event {
            Event::Start(Tag::Heading { .. }) => heading = Some(String::new()),
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                let base = slug(&heading.take().unwrap_or_default());
                let mut anchor = base.clone();
                let mut n = 0;
                while seen.contains(&anchor) {
                    n += 1;
                    anchor = format!("{base}-{n}");
                }
                seen.insert(anchor);
            }
            _ => {}
        }
    }
    seen
}

fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every link and image target of a page, outside code.
fn targets(text: &str) -> Vec<String> {
    parser(text)
        .filter_map(|event| match event {
            Event::Start(Tag::Link { dest_url, .. })
            | Event::Start(Tag::Image { dest_url, .. }) => Some(dest_url.to_string()),
            _ => None,
        })
        .collect()
}

/// The text of every fenced code block of `lang`, in order.
pub(crate) fn code_blocks(text: &str, lang: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for event in parser(text) {
        match event {
            Event::Start(Tag::CodeBlock(CodeBlockKind::Fenced(info))) if info.as_ref() == lang => {
                current = Some(String::new());
            }
            Event::Text(t) => {
                if let Some(block) = current.as_mut() {
                    block.push_str(&t);
                }
            }
            Event::End(TagEnd::CodeBlock) => blocks.extend(current.take()),
            _ => {}
        }
    }
    blocks
}

/// The broken links of one page, as `page: target (why)`.
fn broken_links(page: &Path) -> anyhow::Result<(usize, Vec<String>)> {
    let text = std::fs::read_to_string(page)?;
    let dir = page.parent().expect("a page has a directory");
    let mut checked = 0;
    let mut broken = Vec::new();
    for target in targets(&text) {
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        checked += 1;
        let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
        let file = if path.is_empty() {
            page.to_path_buf()
        } else {
            dir.join(path)
        };
        if !file.exists() {
            broken.push(format!("{}: {target} (no such file)", page.display()));
            continue;
        }
        if anchor.is_empty() {
            continue;
        }
        if file.extension().is_none_or(|ext| ext != "md") {
            broken.push(format!(
                "{}: {target} (an anchor into a non-markdown file)",
                page.display()
            ));
            continue;
        }
        if !anchors(&std::fs::read_to_string(&file)?).contains(anchor) {
            broken.push(format!("{}: {target} (no such heading)", page.display()));
        }
    }
    Ok((checked, broken))
}

fn pages() -> anyhow::Result<Vec<PathBuf>> {
    let root = troupe_testkit::workspace_root();
    let mut pages = vec![root.join("README.md"), root.join("CONTRIBUTING.md")];
    for dir in ["docs", "services"] {
        for entry in std::fs::read_dir(root.join(dir))? {
            let path = entry?.path();
            if path.extension().is_some_and(|ext| ext == "md") {
                pages.push(path);
            } else if path.join("README.md").exists() {
                pages.push(path.join("README.md"));
            }
        }
    }
    pages.sort();
    Ok(pages)
}

#[test]
fn every_relative_link_and_anchor_in_the_docs_resolves() -> anyhow::Result<()> {
    let readme = troupe_testkit::workspace_root().join("README.md");
    let mut broken = Vec::new();
    for page in pages()? {
        let (checked, mut bad) = broken_links(&page)?;
        // The README indexes every page of docs/: finding few links there means the parser
        // saw nothing.
        if page == readme {
            assert!(
                checked >= 20,
                "only {checked} relative links found in the README"
            );
        }
        broken.append(&mut bad);
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    Ok(())
}

#[test]
fn the_readme_stays_short_and_links_every_docs_page() -> anyhow::Result<()> {
    let root = troupe_testkit::workspace_root();
    let readme = std::fs::read_to_string(root.join("README.md"))?;
    assert!(
        readme.len() <= 12 * 1024,
        "README.md is {} bytes",
        readme.len()
    );
    let linked: HashSet<String> = targets(&readme).into_iter().collect();
    for entry in std::fs::read_dir(root.join("docs"))? {
        let entry = entry?;
        // Pages, not the folder of pictures they show.
        if entry.file_type()?.is_dir() {
            continue;
        }
        let name = entry.file_name().to_string_lossy().into_owned();
        assert!(
            linked.contains(&format!("docs/{name}")),
            "README.md does not link docs/{name}"
        );
    }
    for service in std::fs::read_dir(root.join("services"))? {
        let readme = service?.path().join("README.md");
        if readme.exists() {
            let lines = std::fs::read_to_string(&readme)?.lines().count();
            assert!(lines <= 40, "{} has {lines} lines", readme.display());
        }
    }
    Ok(())
}

#[test]
fn the_link_check_finds_a_broken_file_and_a_broken_anchor() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::write(
        dir.path().join("other.md"),
        "# Other page\n\n## CCW sessions: import and export\n",
    )?;
    let page = dir.path().join("page.md");
    std::fs::write(
        &page,
        "# Page\n\n[ok](other.md#ccw-sessions-import-and-export) [self](#page) `[code](nowhere.md)`\n\n\
         | a | b |\n|---|---|\n| [gone](gone.md) | [bad](other.md#nothing) |\n\n[web](https://example.com/x)\n",
    )?;
    let (checked, broken) = broken_links(&page)?;
    assert_eq!(checked, 4, "{broken:?}");
    assert_eq!(
        broken,
        [
            format!("{}: gone.md (no such file)", page.display()),
            format!("{}: other.md#nothing (no such heading)", page.display()),
        ]
    );
    Ok(())
}

#[test]
fn anchors_follow_github() {
    let page = "# troupe\n## Workers and their leases\n## `tasks[].test.gc`\n## Run across machines\n## Run across machines\n";
    let anchors = anchors(page);
    for anchor in [
        "troupe",
        "workers-and-their-leases",
        "taskstestgc",
        "run-across-machines",
        "run-across-machines-1",
    ] {
        assert!(anchors.contains(anchor), "{anchor} not in {anchors:?}");
    }
}
