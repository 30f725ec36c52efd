//! The run's own venv: the project under test installed editable, layered on the cached venv.
//!
//! The cached venv (`venv`) holds the project's requirements and is shared by every commit
//! that has the same ones, so it must not hold the project itself. Each run makes a small
//! venv of its own beside its worktree (`python -m venv --without-pip`), whose
//! `site-packages` adds the cached venv's through a `.pth` file, and installs the worktree
//! into it with `pip install --no-deps --no-build-isolation --no-index -e` (the build system
//! is already in the cached venv). The project's metadata and entry points are then
//! installed (`importlib.metadata.version("pkg")`, console scripts) while its code still
//! imports from the worktree, the commit under test. The venv gets `pip` launchers of its
//! own, so a setup command's `pip install` lands there, never in the shared cache.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use troupe_process::{Command, Sandbox, Termination};

use crate::Error;
use crate::venv::VenvCache;

/// Time allowed for creating the venv and for the editable install.
const STEP_TIMEOUT: Duration = Duration::from_secs(600);

/// Asks an interpreter where its own and another prefix's packages go.
const SITE_DIRS: &str = "import sys, sysconfig
for prefix in (sys.prefix, sys.argv[1]):
    v = {'base': prefix, 'platbase': prefix}
    print(sysconfig.get_path('purelib', vars=v))
    print(sysconfig.get_path('platlib', vars=v))
";

/// A run's venv with the project installed.
#[derive(Debug)]
pub(crate) struct ProjectVenv {
    /// `<dir>/bin/python`.
    pub(crate) python: PathBuf,
    /// The install steps' output tails.
    pub(crate) log: String,
}

/// Where the run in `worktree` keeps its venv: beside the worktree, so nothing the suite
/// or coverage walks sees it, and the worktree's slot reuses the path.
pub(crate) fn dir_for(worktree: &Path) -> PathBuf {
    worktree.with_extension("venv")
}

/// Makes `dir` a venv layered on the cached venv of `cached_python` and installs `project`
/// into it editable. `dir` is replaced if it exists (the previous run's).
pub(crate) async fn install(
    cache: &VenvCache,
    cached_python: &Path,
    project: &Path,
    dir: &Path,
    sandbox: &Sandbox,
    cancel: &CancellationToken,
) -> Result<ProjectVenv, Error> {
    match tokio::fs::remove_dir_all(dir).await {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(Error::Io {
                path: dir.to_owned(),
                source,
            });
        }
    }
    // Made first: Landlock grants only paths that exist (`python -m venv` takes an empty one).
    tokio::fs::create_dir_all(dir)
        .await
        .map_err(|source| Error::Io {
            path: dir.to_owned(),
            source,
        })?;
    // Writes its venv and the project (an editable install leaves `*.egg-info` there); reads
    // the cached venv it layers on.
    let mut sandbox = sandbox.clone().write(dir).write(project);
    for prefix in crate::sandbox::python_prefixes(cached_python) {
        sandbox = sandbox.read(prefix);
    }
    let sandbox = &sandbox;
    let mut log = cache
        .step(
            "create the run's venv",
            Command::new(cached_python.display().to_string())
                .args(["-m", "venv", "--without-pip"])
                .arg(dir.display().to_string()),
            STEP_TIMEOUT,
            sandbox,
            cancel,
        )
        .await?;
    let (own, cached) = site_dirs(cached_python, dir, sandbox, cancel).await?;
    // `import` lines of a .pth file run at start-up; `addsitedir` also reads the cached
    // venv's own .pth files (editable dependencies, namespace packages).
    let lines: String = cached
        .iter()
        .map(|site| {
            format!(
                "import site; site.addsitedir({:?})\n",
                site.display().to_string()
            )
        })
        .collect();
    for site in &own {
        write(&site.join("_troupe_requirements.pth"), &lines, false).await?;
    }
    let python = dir.join("bin").join("python");
    let launcher = format!(
        "#!{}\nimport sys\nfrom pip._internal.cli.main import main\nsys.exit(main())\n",
        python.display()
    );
    for name in ["pip", "pip3"] {
        write(&dir.join("bin").join(name), &launcher, true).await?;
    }
    log.push_str(
        &cache
            .step(
                "pip install --no-deps -e . (the project, into the run's venv)",
                Command::new(python.display().to_string())
                    .args([
                        "-m",
                        "pip",
                        "install",
                        "--disable-pip-version-check",
                        "--no-deps",
                        "--no-build-isolation",
                        "--no-index",
                        "-e",
                    ])
                    .arg(project.display().to_string())
                    .cwd(project),
                STEP_TIMEOUT,
                sandbox,
                cancel,
            )
            .await?,
    );
    Ok(ProjectVenv { python, log })
}

/// The site directories of the new venv at `dir` and of the cached venv, deduplicated.
async fn site_dirs(
    cached_python: &Path,
    dir: &Path,
    sandbox: &Sandbox,
    cancel: &CancellationToken,
) -> Result<(Vec<PathBuf>, Vec<PathBuf>), Error> {
    let program = cached_python.display().to_string();
    // The cached venv's `.pth` files run at start-up: confined like the installs that made them.
    let output = Command::new(&program)
        .args(["-c", SITE_DIRS])
        .arg(dir.display().to_string())
        .cwd(dir)
        .timeout(Duration::from_secs(60))
        .sandbox(sandbox.clone())
        .run(cancel)
        .await
        .map_err(|source| Error::process(&program, source))?;
    if output.termination == Termination::Cancelled {
        return Err(Error::Cancelled);
    }
    let text = output.stdout_text();
    let lines: Vec<PathBuf> = text.lines().map(PathBuf::from).collect();
    if !output.success() || lines.len() != 4 {
        return Err(Error::Install {
            step: "locate site-packages".to_owned(),
            detail: format!("exit {:?}: {}", output.exit_code, output.stderr_text()),
        });
    }
    let dedup = |a: &PathBuf, b: &PathBuf| {
        let mut dirs = vec![a.clone()];
        if a != b {
            dirs.push(b.clone());
        }
        dirs
    };
    Ok((dedup(&lines[2], &lines[3]), dedup(&lines[0], &lines[1])))
}

async fn write(path: &Path, text: &str, executable: bool) -> Result<(), Error> {
    let io = |source| Error::Io {
        path: path.to_owned(),
        source,
    };
    if let Some(parent) = path.parent() {
        tokio::fs::create_dir_all(parent).await.map_err(io)?;
    }
    tokio::fs::write(path, text).await.map_err(io)?;
    if executable {
        use std::os::unix::fs::PermissionsExt;
        tokio::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
            .await
            .map_err(io)?;
    }
    Ok(())
}
