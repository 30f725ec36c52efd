//! Loads a plan from a file or a plan directory, as JSON for the coordinator.

use std::path::{Path, PathBuf};

/// A plan read from disk.
#[derive(Debug)]
pub struct PlanFile {
    /// The plan as JSON text (TOML plans are converted).
    pub json: String,
    /// The plan file's directory: relative repo paths and `{plan_dir}` resolve against it.
    pub base_dir: PathBuf,
    /// The file that was read.
    pub path: PathBuf,
}

/// Why a plan could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PlanFileError {
    /// Neither the path nor `plan.json` / `plan.toml` inside it exists.
    #[error("no plan at {0}: expected a plan file, or a directory holding plan.json or plan.toml")]
    NotFound(PathBuf),
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A TOML plan is malformed.
    #[error("{path} is not valid TOML: {message}")]
    Toml {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
}

/// Reads the plan at `path`: a `.json` or `.toml` file, or a directory holding `plan.json`
/// (preferred) or `plan.toml`.
pub fn load(path: &Path) -> Result<PlanFile, PlanFileError> {
    let file = if path.is_dir() {
        ["plan.json", "plan.toml"]
            .iter()
            .map(|name| path.join(name))
            .find(|candidate| candidate.is_file())
            .ok_or_else(|| PlanFileError::NotFound(path.to_path_buf()))?
    } else if path.is_file() {
        path.to_path_buf()
    } else {
        return Err(PlanFileError::NotFound(path.to_path_buf()));
    };
    let file = std::path::absolute(&file).map_err(|source| PlanFileError::Read {
        path: file.clone(),
        source,
    })?;
    let text = std::fs::read_to_string(&file).map_err(|source| PlanFileError::Read {
        path: file.clone(),
        source,
    })?;
    let json = if file.extension().is_some_and(|ext| ext == "toml") {
        let value: toml::Value = toml::from_str(&text).map_err(|err| PlanFileError::Toml {
            path: file.clone(),
            message: err.to_string(),
        })?;
        // TOML values map onto JSON one to one (dates become strings).
        serde_json::to_string(&value).map_err(|err| PlanFileError::Toml {
            path: file.clone(),
            message: err.to_string(),
        })?
    } else {
        // JSON is validated by the coordinator, which reports every problem at once.
        text
    };
    let base_dir = file
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    Ok(PlanFile {
        json,
        base_dir,
        path: file,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_resolves_to_its_plan_json() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("plan.json"), r#"{"name":"x"}"#).unwrap();
        let plan = load(dir.path()).unwrap();
        assert_eq!(plan.json, r#"{"name":"x"}"#);
        assert_eq!(plan.base_dir, std::path::absolute(dir.path()).unwrap());
    }

    #[test]
    fn toml_plans_become_json() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan.toml");
        std::fs::write(
            &path,
            "name = \"t\"\n[[tasks]]\nid = \"IMPL-001\"\ndepends_on = []\n",
        )
        .unwrap();
        let plan = load(&path).unwrap();
        let value: serde_json::Value = serde_json::from_str(&plan.json).unwrap();
        assert_eq!(value["name"], "t");
        assert_eq!(value["tasks"][0]["id"], "IMPL-001");
    }

    #[test]
    fn a_missing_plan_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = load(dir.path()).unwrap_err();
        assert!(err.to_string().contains("plan.json or plan.toml"), "{err}");
    }

    #[test]
    fn malformed_toml_is_reported_with_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan.toml");
        std::fs::write(&path, "name = \n").unwrap();
        let err = load(&path).unwrap_err();
        assert!(err.to_string().contains("plan.toml"), "{err}");
    }
}
