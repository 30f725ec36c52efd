//! A `poetry.lock` read as pinned requirements, so a poetry project installs exactly what its
//! lock says without poetry itself: each locked package of the main group and the test
//! groups (`test`, `tests`, `testing`, `dev`) becomes `name==version ; markers` (or a direct
//! reference for git, URL and path sources) for `pip install --no-deps`. Lock versions 1.x
//! (`category`) and 2.x (`groups`, markers per group) are read; optional packages (extras)
//! are left out.

use std::path::Path;

use crate::python::TEST_SELECTIONS;

/// What a lock gives the venv.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Locked {
    /// One requirement line per package.
    pub(crate) requirements: Vec<String>,
    /// The groups installed (`main`, `test`, ...).
    pub(crate) groups: Vec<String>,
}

/// The pinned requirements of `root/poetry.lock`; `None` without one, an error when it cannot
/// be read.
pub(crate) fn locked_requirements(root: &Path) -> Option<Result<Locked, String>> {
    let text = std::fs::read_to_string(root.join("poetry.lock")).ok()?;
    let own = project_name(root);
    Some(parse(&text, root, own.as_deref()))
}

fn project_name(root: &Path) -> Option<String> {
    let text = std::fs::read_to_string(root.join("pyproject.toml")).ok()?;
    let table: toml::Table = toml::from_str(&text).ok()?;
    let name = table
        .get("project")
        .and_then(|p| p.get("name"))
        .or_else(|| table.get("tool")?.get("poetry")?.get("name"))?;
    name.as_str().map(normalise)
}

fn normalise(name: &str) -> String {
    name.to_ascii_lowercase().replace(['_', '.'], "-")
}

fn parse(text: &str, root: &Path, own: Option<&str>) -> Result<Locked, String> {
    let table: toml::Table =
        toml::from_str(text).map_err(|err| format!("poetry.lock is not TOML: {err}"))?;
    let packages = table
        .get("package")
        .and_then(toml::Value::as_array)
        .cloned()
        .unwrap_or_default();
    let wanted = |group: &str| group == "main" || TEST_SELECTIONS.contains(&group);
    let mut requirements = Vec::new();
    let mut groups: Vec<String> = Vec::new();
    for package in &packages {
        let field = |key: &str| package.get(key).and_then(toml::Value::as_str);
        let (Some(name), Some(version)) = (field("name"), field("version")) else {
            return Err("poetry.lock has a package without a name or version".to_owned());
        };
        if package.get("optional").and_then(toml::Value::as_bool) == Some(true)
            || own == Some(normalise(name).as_str())
        {
            continue;
        }
        // Lock 2.x: `groups = [...]`; 1.x: `category = "main" | "dev"`.
        let package_groups: Vec<String> = match package.get("groups") {
            Some(toml::Value::Array(items)) => items
                .iter()
                .filter_map(|g| g.as_str().map(str::to_owned))
                .collect(),
            _ => vec![field("category").unwrap_or("main").to_owned()],
        };
        let chosen: Vec<&String> = package_groups.iter().filter(|g| wanted(g)).collect();
        if chosen.is_empty() {
            continue;
        }
        for group in &chosen {
            if !groups.contains(group) {
                groups.push((*group).clone());
            }
        }
        let marker = markers(package.get("markers"), &chosen);
        let source = package.get("source");
        let source_field = |key: &str| {
            source
                .and_then(|s| s.get(key))
                .and_then(toml::Value::as_str)
        };
        let reference = match source_field("type") {
            None | Some("legacy") => format!("{name}=={version}"),
            Some("git") => {
                let url = source_field("url").unwrap_or_default();
                let rev = source_field("resolved_reference")
                    .or_else(|| source_field("reference"))
                    .unwrap_or_default();
                format!("{name} @ git+{url}@{rev}")
            }
            Some("url") => format!("{name} @ {}", source_field("url").unwrap_or_default()),
            Some("directory" | "file") => {
                let path = root.join(source_field("url").unwrap_or_default());
                format!("{name} @ file://{}", path.display())
            }
            Some(other) => {
                return Err(format!(
                    "poetry.lock: {name} comes from a `{other}` source, which troupe cannot install"
                ));
            }
        };
        requirements.push(match marker {
            Some(marker) => format!("{reference} ; {marker}"),
            None => reference,
        });
    }
    groups.sort();
    Ok(Locked {
        requirements,
        groups,
    })
}

/// A package's environment markers for the chosen groups: a plain string applies to all; a
/// table (lock 2.1) has one per group, and a chosen group without one makes it unconditional.
fn markers(value: Option<&toml::Value>, chosen: &[&String]) -> Option<String> {
    match value? {
        toml::Value::String(marker) => Some(marker.clone()),
        toml::Value::Table(per_group) => {
            let mut parts = Vec::new();
            for group in chosen {
                match per_group.get(group.as_str()).and_then(toml::Value::as_str) {
                    Some(marker) => parts.push(format!("({marker})")),
                    None => return None,
                }
            }
            (!parts.is_empty()).then(|| parts.join(" or "))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_groups_markers_and_sources() {
        let lock = r#"
[[package]]
name = "attrs"
version = "25.4.0"
optional = false
groups = ["main"]

[[package]]
name = "tomli"
version = "2.5.0"
optional = false
groups = ["test"]
markers = "python_version < \"3.11\""

[[package]]
name = "sphinx"
version = "8.0.0"
optional = false
groups = ["docs"]

[[package]]
name = "ujson"
version = "5.0.0"
optional = true
groups = ["main"]

[[package]]
name = "both"
version = "1.0"
optional = false
groups = ["main", "dev"]
markers = {main = "sys_platform == \"linux\"", dev = "python_version >= \"3.9\""}

[[package]]
name = "fromgit"
version = "0.1"
optional = false
groups = ["dev"]
[package.source]
type = "git"
url = "https://example.com/x.git"
reference = "main"
resolved_reference = "abc123"

[[package]]
name = "My_Project"
version = "0.1"
optional = false
groups = ["main"]
"#;
        let locked = parse(lock, Path::new("/r"), Some("my-project")).expect("parses");
        assert_eq!(
            locked.requirements,
            [
                "attrs==25.4.0",
                "tomli==2.5.0 ; python_version < \"3.11\"",
                "both==1.0 ; (sys_platform == \"linux\") or (python_version >= \"3.9\")",
                "fromgit @ git+https://example.com/x.git@abc123",
            ]
        );
        assert_eq!(locked.groups, ["dev", "main", "test"]);
    }

    #[test]
    fn lock_1_categories_are_groups() {
        let lock =
            "[[package]]\nname = \"a\"\nversion = \"1\"\ncategory = \"dev\"\noptional = false\n";
        let locked = parse(lock, Path::new("/r"), None).expect("parses");
        assert_eq!(locked.requirements, ["a==1"]);
        assert_eq!(locked.groups, ["dev"]);
        assert!(parse("not toml [", Path::new("/r"), None).is_err());
    }
}
