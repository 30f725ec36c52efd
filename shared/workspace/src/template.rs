//! Copying a sample project into a new repository.

use std::fs;
use std::path::Path;

use crate::Error;

/// Directories that are never part of a template: VCS data, caches, installed dependencies.
const SKIPPED: &[&str] = &[".git", "__pycache__", "node_modules", ".venv"];

/// Copies `src` into `dest` recursively (symlinks as symlinks), skipping [`SKIPPED`].
pub(crate) fn copy_tree(src: &Path, dest: &Path) -> Result<(), Error> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    fs::create_dir_all(dest).map_err(io(dest))?;
    for entry in fs::read_dir(src).map_err(io(src))? {
        let entry = entry.map_err(io(src))?;
        let name = entry.file_name();
        if SKIPPED.iter().any(|skip| name == *skip) {
            continue;
        }
        let from = entry.path();
        let to = dest.join(&name);
        let kind = entry.file_type().map_err(io(&from))?;
        if kind.is_dir() {
            copy_tree(&from, &to)?;
        } else if kind.is_symlink() {
            let target = fs::read_link(&from).map_err(io(&from))?;
            std::os::unix::fs::symlink(target, &to).map_err(io(&to))?;
        } else {
            fs::copy(&from, &to).map_err(io(&from))?;
        }
    }
    Ok(())
}
