//! One test run end to end: resolve the commit, check it out in a detached worktree, pick the
//! interpreter (a cached venv on request), run the suite, write `run-N.json`, clean up.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use sha2::{Digest, Sha256};

use std::collections::BTreeMap;
use tokio_util::sync::CancellationToken;

use troupe_proto::v1::{
    ProjectReport, RunTestsRequest, TestFramework, TestOutcome, TestRunReport, TestTotals,
};
use troupe_workspace::{Oid, Remote};

use crate::Error;
use crate::detect;
use crate::js::{self, JsRun, Selection};
use crate::pytest::{self, CoverageSource, Plugins, PytestRun};
use crate::venv::VenvCache;

/// The home of a run's own children (setup, probes, the suite), in its report directory.
const RUN_HOME: &str = "home";
/// The home of a run's installers.
const INSTALL_HOME: &str = "install-home";

/// Wall-clock limit of a run when none is given.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// Per-test limit passed to pytest-timeout when none is given.
pub const DEFAULT_TEST_TIMEOUT_SECONDS: u32 = 60;
/// Longest kept failure message; a report must stay well under gRPC's message limit.
const MAX_MESSAGE_CHARS: usize = 4000;

/// What to run.
#[derive(Clone, Debug)]
pub struct RunSpec {
    /// The repository's remote (an absolute path is a remote on this machine): the commit
    /// under test is fetched from it into the runner's own mirror.
    pub remote: Remote,
    /// The user's checkout when the remote is a local path (its installed `node_modules` may
    /// be reused, its generated files are compared); empty for a URL.
    pub repo_path: PathBuf,
    /// Commit-ish to test.
    pub git_ref: String,
    /// Framework, or `Unspecified` to detect it.
    pub framework: TestFramework,
    /// Coverage target in percent (0 = none).
    pub coverage_target: f64,
    /// Build or reuse a venv with the repository's requirements.
    pub install: bool,
    /// Wall-clock limit of the run (install excluded).
    pub timeout: Duration,
    /// Per-test limit passed to the framework; 0 = none.
    pub test_timeout_seconds: u32,
    /// `--cov` source; empty = the repository's configuration, else `.`.
    pub coverage_source: String,
    /// Names the output directory `<data_dir>/test-runs/<run_id>`.
    pub run_id: String,
    /// N of the `run-N.json` written next to the reports.
    pub run_number: u32,
    /// The fix loop to run when the first run is below target.
    pub fix: Option<crate::fix::FixSpec>,
    /// Environment for the setup commands and the suite (allow-listed names only).
    pub env: std::collections::BTreeMap<String, String>,
    /// Argv commands run in the worktree before the suite.
    pub setup: Vec<Vec<String>>,
    /// Repo-relative directory to run the suite in (empty = the root).
    pub workdir: String,
    /// Python interpreter for pytest (empty = `requires-python`'s match, else the server's).
    pub python: String,
    /// Values for the fix agent's argv placeholders (`{plan_dir}`, `{session_id}`, `{task_id}`)
    /// when the run belongs to a session task; `{worktree}` and `{repo}` are always set.
    pub placeholders: std::collections::BTreeMap<String, String>,
    /// The plan's `sandbox` for this task: it may tighten the service's mode, never loosen it.
    pub sandbox: Option<troupe_process::SandboxMode>,
    /// Told each suite run of the fix loop as it finishes (the first run, then each
    /// iteration's), so a worker's heartbeats can carry the figures.
    pub iterations: Option<crate::fix::IterationSink>,
    /// Told the fix agents' token usage as it grows.
    pub usage: Option<troupe_backends::UsageMeter>,
}

impl RunSpec {
    /// Builds a spec from the RPC request, applying the documented defaults.
    pub fn from_request(request: RunTestsRequest) -> Result<Self, Error> {
        let framework = TestFramework::try_from(request.framework).map_err(|_| {
            Error::InvalidArgument(format!("unknown framework value {}", request.framework))
        })?;
        let remote = Remote::parse(&request.repo_path).map_err(|err| {
            Error::InvalidArgument(format!(
                "repo_path must be an absolute path or a git URL: {err}"
            ))
        })?;
        let spec = Self {
            repo_path: remote
                .local_path()
                .map(Path::to_path_buf)
                .unwrap_or_default(),
            remote,
            git_ref: if request.r#ref.is_empty() {
                "HEAD".to_owned()
            } else {
                request.r#ref
            },
            framework,
            coverage_target: request.coverage_target,
            install: request.install,
            timeout: match request.timeout_seconds {
                0 => DEFAULT_TIMEOUT,
                secs => Duration::from_secs(u64::from(secs)),
            },
            test_timeout_seconds: match request.test_timeout_seconds {
                _ if request.no_test_timeout => 0,
                0 => DEFAULT_TEST_TIMEOUT_SECONDS,
                secs => secs,
            },
            coverage_source: request.coverage_source,
            run_id: new_run_id(),
            run_number: 1,
            fix: match request.fix {
                None => None,
                Some(fix) => Some(crate::fix::FixSpec {
                    backend: if fix.backend.is_empty() {
                        "command".to_owned()
                    } else {
                        fix.backend.clone()
                    },
                    scope: fix.scope(),
                    fallback: (!fix.fallback.is_empty()).then(|| fix.fallback.clone()),
                    command: fix.command,
                    timeout: match fix.timeout_seconds {
                        0 => crate::fix::DEFAULT_AGENT_TIMEOUT,
                        secs => Duration::from_secs(u64::from(secs)),
                    },
                    max_iterations: match request.max_iterations {
                        0 => crate::fix::DEFAULT_MAX_ITERATIONS,
                        n => n,
                    },
                }),
            },
            env: request.env.into_iter().collect(),
            setup: request.setup.into_iter().map(|c| c.argv).collect(),
            workdir: request.workdir,
            python: request.python,
            placeholders: std::collections::BTreeMap::new(),
            sandbox: None,
            iterations: None,
            usage: None,
        };
        spec.validate()?;
        crate::setup::check_env(&spec.env)?;
        Ok(spec)
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if !self.repo_path.as_os_str().is_empty() && !self.repo_path.is_absolute() {
            return Err(Error::InvalidArgument(format!(
                "the checkout must be an absolute path, got {:?}",
                self.repo_path.display().to_string()
            )));
        }
        if !(0.0..=100.0).contains(&self.coverage_target) {
            return Err(Error::InvalidArgument(format!(
                "coverage_target must be between 0 and 100, got {}",
                self.coverage_target
            )));
        }
        if let Some(fix) = &self.fix {
            fix.validate()?;
        }
        crate::setup::check_setup(&self.setup)?;
        crate::setup::check_workdir(&self.workdir)?;
        let safe = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        if self.run_id.is_empty() || self.run_id.starts_with('.') || !self.run_id.chars().all(safe)
        {
            return Err(Error::InvalidArgument(format!(
                "invalid run id {:?}",
                self.run_id
            )));
        }
        Ok(())
    }
}

/// A fresh run id: UTC time plus a random suffix, sortable and unique.
pub(crate) fn new_run_id() -> String {
    let now = chrono::Utc::now().format("%Y%m%dT%H%M%S");
    let random = uuid::Uuid::new_v4().simple().to_string();
    format!("run-{now}-{}", &random[..8])
}

/// Runs test suites; shared by the gRPC service and the worker loop.
#[derive(Debug, Clone)]
pub struct Runner {
    data_dir: PathBuf,
    python: String,
    venvs: VenvCache,
    /// Worktree paths in use, so concurrent runs of one repository get distinct slots.
    slots: Arc<Mutex<BTreeSet<PathBuf>>>,
    /// Flags each Jest/Vitest binary accepts, by resolved path and version.
    flags: Arc<Mutex<FlagCache>>,
    /// The executor's backend configuration, for fix agents.
    backends: Arc<troupe_backends::BackendsConfig>,
    /// Python interpreters' versions, asked once.
    versions: Arc<crate::python::VersionCache>,
    /// How to reach private remotes.
    credentials: Arc<troupe_workspace::Credentials>,
    /// How setup commands are confined.
    sandbox: troupe_process::sandbox::SandboxArgs,
}

type FlagCache = std::collections::HashMap<(PathBuf, Option<String>), js::Capabilities>;

/// A framework made ready for a run.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub(crate) tool: Tool,
    pub(crate) notes: Vec<String>,
    pub(crate) installer: String,
    pub(crate) install_log: String,
    /// JS workspace package directories (repo-relative).
    pub(crate) packages: Vec<PathBuf>,
    /// The Python interpreter (pytest), else empty.
    pub(crate) python: String,
    /// Project packages that import from outside the worktree, as the probe found them.
    pub(crate) origins: Vec<String>,
}

/// A claimed worktree path; released on drop.
#[derive(Debug)]
struct Slot {
    path: PathBuf,
    slots: Arc<Mutex<BTreeSet<PathBuf>>>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.path);
    }
}

impl Runner {
    /// A runner keeping its worktrees, reports and venvs under `data_dir` (absolute).
    pub fn new(data_dir: PathBuf, python: String) -> Self {
        let venvs = VenvCache::new(&data_dir);
        Self {
            data_dir,
            python,
            venvs,
            slots: Arc::default(),
            flags: Arc::default(),
            backends: Arc::default(),
            versions: Arc::default(),
            credentials: Arc::default(),
            sandbox: troupe_process::sandbox::SandboxArgs::default(),
        }
    }

    /// Confines installers, setup commands and suites as `sandbox` says (see `sandbox`).
    #[must_use]
    pub fn with_sandbox(mut self, sandbox: troupe_process::sandbox::SandboxArgs) -> Self {
        self.sandbox = sandbox;
        self
    }

    /// The sandbox of a run's own children (setup commands, probes, the suite): the worktree,
    /// the run's own venv, its report directory and a home of its own writable; `access` (the
    /// interpreter and venvs in use, where `node_modules` leads) as it says.
    pub(crate) fn run_sandbox(
        &self,
        spec: &RunSpec,
        worktree: &Path,
        access: &crate::sandbox::Access,
    ) -> troupe_process::Sandbox {
        let out_dir = self.out_dir(&spec.run_id);
        let sandbox = self
            .sandbox
            .base(&self.data_dir)
            .tighten(spec.sandbox.unwrap_or(troupe_process::SandboxMode::Off))
            .write(worktree)
            .git_worktree(worktree)
            .write(crate::project_venv::dir_for(worktree))
            .write(&out_dir)
            .home(out_dir.join(RUN_HOME));
        access.grant(sandbox)
    }

    /// The sandbox of the interpreter probes that judge where the project imports from: the
    /// run's, plus read access to the user's checkout, so that an editable install of it is
    /// seen (and reported as WRONG_SOURCE) rather than hidden by the sandbox.
    fn probe_sandbox(
        &self,
        spec: &RunSpec,
        worktree: &Path,
        access: &crate::sandbox::Access,
    ) -> troupe_process::Sandbox {
        let sandbox = self.run_sandbox(spec, worktree, access);
        if spec.repo_path.as_os_str().is_empty() {
            sandbox
        } else {
            sandbox.read(&spec.repo_path)
        }
    }

    /// The sandbox of a run's installers, before the directory each builds is added.
    fn installer_sandbox(&self, spec: &RunSpec) -> troupe_process::Sandbox {
        crate::sandbox::installer(
            self.sandbox
                .base(&self.data_dir)
                .tighten(spec.sandbox.unwrap_or(troupe_process::SandboxMode::Off)),
            &crate::sandbox::caches(&self.data_dir),
            &self.out_dir(&spec.run_id).join(INSTALL_HOME),
        )
    }

    /// Builds fix agents from `config` (the executor's backend configuration).
    #[must_use]
    pub fn with_backends(mut self, config: troupe_backends::BackendsConfig) -> Self {
        self.backends = Arc::new(config);
        self
    }

    /// The backend configuration fix agents are built from.
    pub(crate) fn backends(&self) -> &troupe_backends::BackendsConfig {
        &self.backends
    }

    /// The first free worktree slot of a repository: `worktrees/test-runs/<repo hash>-<n>`.
    fn claim_slot(&self, repo: &Path) -> Slot {
        let digest = Sha256::digest(repo.as_os_str().as_encoded_bytes());
        let key: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
        let base = self.data_dir.join("worktrees").join("test-runs");
        let mut used = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let path = (0..)
            .map(|n| base.join(format!("{key}-{n}")))
            .find(|path| !used.contains(path))
            .unwrap_or_else(|| base.join(key));
        used.insert(path.clone());
        Slot {
            path,
            slots: Arc::clone(&self.slots),
        }
    }

    /// The runner's mirrors of remotes (`<data_dir>/mirrors`): commits under test come from
    /// them, fixes leave from them.
    pub fn mirrors(&self) -> troupe_workspace::Mirrors {
        troupe_workspace::Mirrors::new(self.data_dir.join("mirrors"))
            .with_credentials(Arc::clone(&self.credentials))
    }

    /// Authenticates to private remotes with `credentials`.
    pub fn with_credentials(mut self, credentials: Arc<troupe_workspace::Credentials>) -> Self {
        self.credentials = credentials;
        self
    }

    /// Pushes a direct run's fix commits to its remote: the final one on the branch
    /// `troupe-fix/<run id>` (named in the report), every iteration's under
    /// `refs/troupe/fix/<run id>/<n>`, so what the loop made outlives the runner's mirror.
    pub async fn share_fixes(
        &self,
        spec: &RunSpec,
        report: &mut TestRunReport,
    ) -> Result<(), Error> {
        let Some(fix) = report.fix_loop.as_mut() else {
            return Ok(());
        };
        let mirror = self.mirrors().open(&spec.remote).await?;
        for iteration in &fix.iterations {
            if let Some(commit) = Oid::parse(&iteration.commit) {
                let name = format!("refs/troupe/fix/{}/{}", spec.run_id, iteration.iteration);
                mirror.push_ref(&name, &commit).await?;
            }
        }
        if let Some(commit) = Oid::parse(&fix.final_commit) {
            let branch = format!("troupe-fix/{}", spec.run_id);
            mirror
                .push_ref(&format!("refs/heads/{branch}"), &commit)
                .await?;
            fix.branch = branch;
        }
        Ok(())
    }

    /// Where a run's reports go.
    pub fn out_dir(&self, run_id: &str) -> PathBuf {
        self.data_dir.join("test-runs").join(run_id)
    }

    /// Runs the suite once at `spec.git_ref` and reports what the structured reports say.
    #[tracing::instrument(skip_all, fields(repo = %spec.remote, git_ref = %spec.git_ref, run_id = %spec.run_id))]
    pub async fn run_tests(
        &self,
        spec: &RunSpec,
        cancel: &CancellationToken,
    ) -> Result<TestRunReport, Error> {
        spec.validate()?;
        let mirror = self.mirrors().open(&spec.remote).await?;
        let commit = mirror.fetch_rev(&spec.git_ref).await?;
        let repo = mirror.repo();
        let out_dir = self.out_dir(&spec.run_id);
        // A run id repeats only when a worker died mid-run; its stale reports must not be read
        // as this run's, and its worktree must go.
        if out_dir.exists() {
            tokio::fs::remove_dir_all(&out_dir)
                .await
                .map_err(|source| Error::Io {
                    path: out_dir.clone(),
                    source,
                })?;
        }
        tokio::fs::create_dir_all(&out_dir)
            .await
            .map_err(|source| Error::Io {
                path: out_dir.clone(),
                source,
            })?;
        // A stable path per repository (a slot), not per run: Jest's and Vitest's transform
        // caches are keyed by absolute path, so a fresh path per run would make every run cold.
        let slot = self.claim_slot(repo.path());
        let worktree = slot.path.clone();
        let result = repo
            .in_detached_worktree(&worktree, &commit, |_| {
                self.run_in(spec, &worktree, &out_dir, &commit, cancel)
            })
            .await?;
        // The run's own venv (`project_venv`), when it made one, and its children's homes.
        for dir in [
            crate::project_venv::dir_for(&worktree),
            out_dir.join(RUN_HOME),
            out_dir.join(INSTALL_HOME),
        ] {
            if let Err(err) = tokio::fs::remove_dir_all(&dir).await
                && err.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(dir = %dir.display(), error = %err, "cannot remove a run's own directory");
            }
        }
        result
    }

    async fn run_in(
        &self,
        spec: &RunSpec,
        worktree: &Path,
        out_dir: &Path,
        commit: &Oid,
        cancel: &CancellationToken,
    ) -> Result<TestRunReport, Error> {
        let workdir = Path::new(&spec.workdir);
        if !worktree.join(workdir).is_dir() {
            return Err(Error::InvalidArgument(format!(
                "workdir `{}` is not a directory at {}",
                spec.workdir,
                commit.as_str()
            )));
        }
        let prepared = match self.prepare(spec, worktree, cancel).await {
            Ok(prepared) => prepared,
            Err(Error::Install { step, detail }) => {
                // A failed install is its own outcome, with the installer's error as evidence.
                let framework = match spec.framework {
                    TestFramework::Unspecified => detect::detect(&worktree.join(workdir))
                        .unwrap_or(TestFramework::Unspecified),
                    other => other,
                };
                let denied = crate::sandbox::denial_in(&detail).unwrap_or_default();
                let report = TestRunReport {
                    framework: framework as i32,
                    outcome: if denied.is_empty() {
                        TestOutcome::InstallFailed as i32
                    } else {
                        TestOutcome::SandboxDenied as i32
                    },
                    sandbox_denied: denied,
                    commit: commit.to_string(),
                    coverage_target: spec.coverage_target,
                    installer: step.clone(),
                    install_log: detail.clone(),
                    workdir: spec.workdir.clone(),
                    env: spec.env.clone().into_iter().collect(),
                    warnings: vec![format!(
                        "install failed: `{step}`: {}",
                        crash_reason(&detail)
                    )],
                    ..TestRunReport::default()
                };
                return self.finish(report, spec, out_dir, spec.run_number).await;
            }
            Err(err) => return Err(err),
        };
        let Prepared {
            tool,
            notes,
            installer,
            install_log,
            packages,
            python,
            origins,
        } = prepared;
        let sandbox = self.run_sandbox(spec, worktree, tool.access());
        let run_env = tool.env().clone();
        let base = TestRunReport {
            framework: tool.framework() as i32,
            commit: commit.to_string(),
            coverage_target: spec.coverage_target,
            installer: installer.clone(),
            install_log: install_log.clone(),
            workdir: spec.workdir.clone(),
            env: run_env
                .clone()
                .into_iter()
                .filter(|(name, _)| name != "PATH")
                .collect(),
            python: python.clone(),
            framework_version: tool.version().unwrap_or_default(),
            ..TestRunReport::default()
        };
        // The project's build steps, with the run's environment (and its venv first on PATH),
        // confined as the suite is.
        let (steps, setup_ok) = crate::setup::run_setup(
            &spec.setup,
            &worktree.join(workdir),
            &run_env,
            spec.timeout,
            &sandbox,
            cancel,
        )
        .await?;
        if !setup_ok {
            let failed = steps.last().cloned().unwrap_or_default();
            let mut report = base;
            report.outcome = TestOutcome::SetupFailed as i32;
            if let Some(denied) = crate::sandbox::denial_in(&failed.output_tail) {
                report.outcome = TestOutcome::SandboxDenied as i32;
                report.sandbox_denied = denied;
            }
            report.warnings = notes;
            report.warnings.push(format!(
                "setup command `{}` failed (exit {}): {}",
                failed.argv.join(" "),
                failed.exit_code,
                crash_reason(&failed.output_tail)
            ));
            report.stderr_tail = failed.output_tail.clone();
            report.setup_steps = steps;
            return self.finish(report, spec, out_dir, spec.run_number).await;
        }
        let missing = if spec.repo_path.as_os_str().is_empty() {
            // A URL: no checkout on this machine to compare with.
            Vec::new()
        } else {
            crate::setup::missing_generated(&spec.repo_path, worktree, cancel).await
        };
        // Before anything runs: the code under test must resolve inside the worktree.
        let escaping = match &tool {
            Tool::Js { .. } => crate::source::escaping_workspace_links(worktree, &packages),
            // Without setup commands nothing changed since the probe.
            Tool::Pytest { .. } if spec.setup.is_empty() => origins,
            Tool::Pytest { python, .. } => {
                let names = crate::python::packages(&worktree.join(workdir));
                let others = crate::python::all_packages(worktree);
                crate::python::foreign_origins(
                    python,
                    &names,
                    &others,
                    &worktree.join(workdir),
                    worktree,
                    &run_env,
                    &self.probe_sandbox(spec, worktree, tool.access()),
                    cancel,
                )
                .await?
            }
        };
        let mut report = if escaping.is_empty() {
            let suite = Suite {
                tool: &tool,
                spec,
                worktree,
            };
            let mut report = self
                .run_suite(suite, out_dir, &Selection::All, cancel)
                .await?;
            report.commit = commit.to_string();
            report
        } else {
            let mut report = base.clone();
            report.outcome = TestOutcome::WrongSource as i32;
            report.warnings.push(crate::source::wrong_source_warning(
                "the project's code resolves",
                &escaping,
            ));
            report.outside_paths = escaping;
            report
        };
        report.installer = installer;
        report.install_log = install_log;
        report.workdir = spec.workdir.clone();
        report.env = run_env
            .into_iter()
            .filter(|(name, _)| name != "PATH")
            .collect();
        report.python = python;
        report.framework_version = base.framework_version.clone();
        report.setup_steps = steps;
        report.missing_generated = missing;
        if let Some(sink) = &spec.iterations {
            let max = spec.fix.as_ref().map_or(0, |fix| fix.max_iterations);
            sink.report(crate::fix::iteration_figures(0, max, &report));
        }
        if let Some(fix) = &spec.fix
            && crate::fix::needs_fixing(&report)
        {
            let first = report.clone();
            report = crate::fix::run_loop(
                crate::fix::FixContext {
                    runner: self,
                    tool: &tool,
                    spec,
                    fix,
                    worktree,
                    out_dir,
                },
                first,
                cancel,
            )
            .await?;
            // Keeps the fixes reachable (and easy to check out) after the worktree is gone.
            if let Some(fix) = report
                .fix_loop
                .as_ref()
                .filter(|f| !f.final_commit.is_empty())
            {
                let name = format!("refs/troupe/test-runs/{}", spec.run_id);
                let output = troupe_process::Command::new("git")
                    .args(["update-ref", &name, &fix.final_commit])
                    .cwd(worktree)
                    .timeout(Duration::from_secs(60))
                    .run(cancel)
                    .await
                    .map_err(|source| Error::process("git", source))?;
                if output.success() {
                    report.warnings.push(format!("fixes kept at {name}"));
                } else {
                    tracing::warn!(git_ref = %name, stderr = %output.stderr_text().trim(), "cannot keep the fix ref");
                }
            }
        }
        let mut notes = notes;
        if !report.missing_generated.is_empty() {
            let shown: Vec<&str> = report
                .missing_generated
                .iter()
                .take(10)
                .map(String::as_str)
                .collect();
            notes.push(format!(
                "generated files the checkout {} has are missing from the tested commit's worktree (gitignored build output; add the command that makes them to test.setup): {}{}",
                spec.repo_path.display(),
                shown.join(", "),
                if report.missing_generated.len() > shown.len() {
                    format!(" and {} more", report.missing_generated.len() - shown.len())
                } else {
                    String::new()
                }
            ));
        }
        let skipped_missing = crate::setup::skips_for_missing(
            &report.skip_reasons.clone().into_iter().collect(),
            &report.missing_generated,
        );
        if !report.skip_reasons.is_empty() {
            let mut reasons: Vec<(&String, &u32)> = report.skip_reasons.iter().collect();
            reasons.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
            let shown: Vec<String> = reasons
                .iter()
                .take(5)
                .map(|(reason, count)| format!("{count} × {reason}"))
                .collect();
            notes.push(format!(
                "skipped tests by reason: {}{}",
                shown.join("; "),
                if skipped_missing > 0 {
                    format!(" ({skipped_missing} of them for missing files or modules)")
                } else {
                    String::new()
                }
            ));
        }
        // Notes on how the tools were found apply to every run of the loop.
        report.warnings.splice(0..0, notes);
        self.finish(report, spec, out_dir, spec.run_number).await
    }

    /// Truncates messages, adds the CCW patterns and writes `run-N.json` next to the reports.
    pub(crate) async fn finish(
        &self,
        mut report: TestRunReport,
        spec: &RunSpec,
        out_dir: &Path,
        number: u32,
    ) -> Result<TestRunReport, Error> {
        for failure in &mut report.failures {
            truncate_chars(&mut failure.message, MAX_MESSAGE_CHARS);
        }
        report.defect_patterns = defect_patterns(&report)
            .into_iter()
            .map(str::to_owned)
            .collect();
        report.effective_patterns = effective_patterns(&report);
        let run_file = out_dir.join(format!("run-{number}.json"));
        let json = run_file_json(&report, spec, number);
        let text = serde_json::to_string_pretty(&json)
            .map_err(|err| Error::Internal(format!("run file: {err}")))?;
        tokio::fs::write(&run_file, text)
            .await
            .map_err(|source| Error::Io {
                path: run_file.clone(),
                source,
            })?;
        report.report_paths.push(run_file.display().to_string());
        tracing::info!(
            outcome = ?report.outcome(),
            total = report.totals.as_ref().map_or(0, |t| t.total),
            failures = report.failures.len(),
            "test run finished"
        );
        Ok(report)
    }

    /// Works out the framework and makes its tools ready (venv, plugins, node_modules).
    pub(crate) async fn prepare(
        &self,
        spec: &RunSpec,
        worktree: &Path,
        cancel: &CancellationToken,
    ) -> Result<Prepared, Error> {
        let workdir = Path::new(&spec.workdir);
        let root = worktree.join(workdir);
        let framework = match spec.framework {
            TestFramework::Unspecified => detect::detect(&root)?,
            other => other,
        };
        let mut env = spec.env.clone();
        let installs = self.installer_sandbox(spec);
        if framework != TestFramework::Pytest {
            let name = troupe_proto::names::name(framework);
            let caches = crate::sandbox::caches(&self.data_dir);
            let installed = crate::node::ensure_tool(
                worktree,
                workdir,
                &spec.repo_path,
                name,
                spec.install,
                &crate::node::Installer {
                    root: &self.data_dir.join("node"),
                    sandbox: &installs,
                    env: &caches,
                },
                cancel,
            )
            .await?;
            // Where node_modules really is, as Node resolves it; nothing outside the worktree
            // for node_modules the repository itself committed.
            let access = if installed.committed {
                crate::sandbox::Access::default()
            } else {
                crate::sandbox::Access {
                    read: crate::sandbox::readable_sources(
                        crate::sandbox::node_modules_sources(worktree, &installed.packages),
                        &self.data_dir,
                        &spec.repo_path,
                    ),
                    write: if framework == TestFramework::Vitest {
                        crate::sandbox::vite_temp_dirs(worktree, workdir)
                    } else {
                        Vec::new()
                    },
                }
            };
            let mut notes = installed.notes;
            if !notes.iter().any(|n| n.starts_with("package manager:")) {
                notes.push(format!(
                    "package manager: {}",
                    crate::node::package_manager(worktree).name()
                ));
            }
            // Vitest needs `@vitest/coverage-v8` at its own version (§5.8); Jest's is built in.
            let coverage = framework == TestFramework::Jest
                || [root.clone(), worktree.to_path_buf()].iter().any(|dir| {
                    dir.join("node_modules")
                        .join("@vitest")
                        .join("coverage-v8")
                        .is_dir()
                });
            let capabilities = self
                .capabilities(
                    framework,
                    &installed.bin,
                    &root,
                    &self.run_sandbox(spec, worktree, &access),
                    cancel,
                )
                .await;
            return Ok(Prepared {
                tool: Tool::Js {
                    framework,
                    bin: installed.bin,
                    coverage,
                    capabilities,
                    env,
                    packages: installed.packages.clone(),
                    access,
                },
                notes,
                installer: installed.installer,
                install_log: installed.log,
                packages: installed.packages,
                python: String::new(),
                origins: Vec::new(),
            });
        }
        let mut notes = Vec::new();
        let (base_python, chosen) = crate::python::choose_interpreter(
            Some(spec.python.as_str()),
            &self.python,
            &root,
            &self.versions,
            cancel,
        )
        .await?;
        notes.extend(chosen);
        let mut requirements_bin = None;
        let mut requirements_python: Option<String> = None;
        let (python, installer, install_log) = if spec.install {
            let venv = self
                .venvs
                .ensure(&root, &base_python, &installs, cancel)
                .await?;
            if venv.built {
                notes.push(format!("built a venv at {}", venv.python.display()));
            }
            requirements_bin = venv.python.parent().map(Path::to_path_buf);
            requirements_python = Some(venv.python.display().to_string());
            let (mut python, mut installer, mut log) =
                (venv.python.display().to_string(), venv.installer, venv.log);
            if crate::python::build_requirements(&root).is_some() {
                let own = crate::project_venv::dir_for(worktree);
                match crate::project_venv::install(
                    &self.venvs,
                    &venv.python,
                    &root,
                    &own,
                    &installs,
                    cancel,
                )
                .await
                {
                    Ok(installed) => {
                        python = installed.python.display().to_string();
                        installer.push_str(&format!(
                            "; the project installed editable (--no-deps) into the run's own venv {}",
                            own.display()
                        ));
                        log.push_str(&installed.log);
                    }
                    // The suite can still run from the source directories (PYTHONPATH below).
                    Err(Error::Install { step, detail }) => notes.push(format!(
                        "the project could not be installed into the run's venv (`{step}`: {}); it imports from its source directories only, without its installed metadata or entry points",
                        crash_reason(&detail)
                    )),
                    Err(err) => return Err(err),
                }
            }
            (python, installer, log)
        } else {
            (
                base_python.clone(),
                format!("no install: the interpreter {base_python} as it is"),
                String::new(),
            )
        };
        // The worktree's own code first: an editable install of another checkout (or a
        // released copy in site-packages) must not answer for the commit under test.
        let roots = crate::python::import_roots(&root);
        if !roots.is_empty() {
            let joined: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
            env.insert("PYTHONPATH".to_owned(), joined.join(":"));
            let shown: Vec<String> = roots
                .iter()
                .filter_map(|r| r.strip_prefix(worktree).ok())
                .map(|r| r.display().to_string())
                .collect();
            notes.push(format!(
                "PYTHONPATH={} (the worktree's own import roots go first)",
                shown.join(":")
            ));
        }
        // The venv's scripts first on PATH, for setup commands (`pip`, `msgfmt` wrappers).
        if let Some(bin) = Path::new(&python).parent().filter(|_| spec.install) {
            let mut path = std::env::var("PATH").unwrap_or_default();
            // The requirements' console scripts, after the run's own venv.
            if let Some(requirements) = requirements_bin.filter(|dir| dir != bin) {
                path = format!("{}:{path}", requirements.display());
            }
            env.insert("PATH".to_owned(), format!("{}:{path}", bin.display()));
            env.insert(
                "VIRTUAL_ENV".to_owned(),
                bin.parent().unwrap_or(bin).display().to_string(),
            );
        }
        // One interpreter start answers for the plugins, pytest's version and where the
        // project's packages import from (checked again after setup commands, which may
        // install).
        let names = crate::python::packages(&root);
        let others = crate::python::all_packages(worktree);
        let mut asked: Vec<String> = names.clone();
        asked.extend(others.iter().map(|(n, _)| n.clone()));
        asked.sort();
        asked.dedup();
        // The interpreters and venvs the suite runs on.
        let mut access = crate::sandbox::Access::default();
        for interpreter in [
            Some(python.as_str()),
            Some(base_python.as_str()),
            requirements_python.as_deref(),
        ]
        .into_iter()
        .flatten()
        {
            for prefix in crate::sandbox::python_prefixes(Path::new(interpreter)) {
                if !access.read.contains(&prefix) {
                    access.read.push(prefix);
                }
            }
        }
        let probe = pytest::probe(
            &python,
            &root,
            &env,
            &asked,
            &self.probe_sandbox(spec, worktree, &access),
            cancel,
        )
        .await?;
        if !probe.plugins.pytest {
            return Err(Error::NotInstalled(format!(
                "pytest is not importable by `{python}`; install it there or run with install to build a venv from the repository's requirements"
            )));
        }
        let origins = crate::python::judge(&probe.origins, &names, &others, worktree);
        let monorepo = pytest::monorepo_args(&root);
        if !monorepo.is_empty() {
            notes.push("several Python packages with tests: --import-mode=importlib".to_owned());
        }
        Ok(Prepared {
            tool: Tool::Pytest {
                python: python.clone(),
                plugins: probe.plugins,
                coverage_source: CoverageSource::choose(&spec.coverage_source, &root),
                extra_args: monorepo,
                version: probe.version,
                env,
                access,
            },
            notes,
            installer,
            install_log,
            packages: Vec::new(),
            python,
            origins,
        })
    }

    /// What a Jest/Vitest binary accepts, probed once per binary path and version.
    async fn capabilities(
        &self,
        framework: TestFramework,
        bin: &Path,
        cwd: &Path,
        sandbox: &troupe_process::Sandbox,
        cancel: &CancellationToken,
    ) -> js::Capabilities {
        let real = std::fs::canonicalize(bin).unwrap_or_else(|_| bin.to_path_buf());
        let version = js::version_of(framework, bin);
        let key = (real, version.clone());
        if let Some(found) = self
            .flags
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
        {
            return found.clone();
        }
        let found = js::capabilities(bin, version, cwd, sandbox, cancel).await;
        self.flags
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, found.clone());
        found
    }

    /// Runs (part of) the suite; when every test that ran hit the per-test timeout, raises the
    /// timeout and retries once (CCW 1.C.15).
    pub(crate) async fn run_suite(
        &self,
        suite: Suite<'_>,
        out_dir: &Path,
        selection: &Selection,
        cancel: &CancellationToken,
    ) -> Result<TestRunReport, Error> {
        let spec = suite.spec;
        let first = self
            .execute(suite, out_dir, selection, spec.test_timeout_seconds, cancel)
            .await?;
        // A framework that took no per-test timeout flag would only run out of time again.
        let flagged = first
            .command
            .iter()
            .any(|a| a.starts_with("--testTimeout=") || a.starts_with("--timeout="));
        if !every_test_timed_out(&first) || spec.test_timeout_seconds == 0 || !flagged {
            return Ok(first);
        }
        let raised = spec.test_timeout_seconds.saturating_mul(TIMEOUT_RAISE);
        tracing::info!(
            from = spec.test_timeout_seconds,
            to = raised,
            "every test timed out; retrying once"
        );
        let retry_dir = out_dir.join("timeout-retry");
        let mut report = self
            .execute(suite, &retry_dir, selection, raised, cancel)
            .await?;
        report.timeout_retried = true;
        report.warnings.push(format!(
            "every test timed out at {}s per test; retried once with {raised}s",
            spec.test_timeout_seconds
        ));
        Ok(report)
    }

    async fn execute(
        &self,
        suite: Suite<'_>,
        out_dir: &Path,
        selection: &Selection,
        test_timeout_seconds: u32,
        cancel: &CancellationToken,
    ) -> Result<TestRunReport, Error> {
        let Suite {
            tool,
            spec,
            worktree,
        } = suite;
        tokio::fs::create_dir_all(out_dir)
            .await
            .map_err(|source| Error::Io {
                path: out_dir.to_owned(),
                source,
            })?;
        let sandbox = self.run_sandbox(spec, worktree, tool.access());
        match tool {
            Tool::Js {
                framework,
                bin,
                coverage,
                capabilities,
                env,
                packages,
                ..
            } => {
                let (mut report, _, files) = js::run(
                    JsRun {
                        framework: *framework,
                        bin,
                        worktree,
                        out_dir,
                        coverage: *coverage,
                        coverage_target: spec.coverage_target,
                        timeout: spec.timeout,
                        test_timeout_seconds,
                        selection: selection.clone(),
                        env,
                        capabilities,
                        workdir: Path::new(&spec.workdir),
                        sandbox: &sandbox,
                    },
                    cancel,
                )
                .await?;
                let summary = out_dir.join("coverage").join("coverage-summary.json");
                let lines = std::fs::read_to_string(&summary)
                    .ok()
                    .and_then(|text| js::parse_line_counts(&text, worktree).ok())
                    .unwrap_or_default();
                report.projects = projects_of(&files, &lines, &report, worktree, packages);
                Ok(report)
            }
            Tool::Pytest {
                python,
                plugins,
                coverage_source,
                extra_args,
                version,
                env,
                ..
            } => {
                let mut extra = extra_args.clone();
                match selection {
                    Selection::All => {}
                    Selection::Files(files) => extra.extend(files.iter().cloned()),
                    // Callers map sources to tests first (an empty list would run everything).
                    Selection::Related(sources) => {
                        extra.extend(pytest_related(worktree, sources));
                    }
                }
                pytest::run(
                    PytestRun {
                        python,
                        worktree,
                        out_dir,
                        plugins: *plugins,
                        coverage_source: coverage_source.clone(),
                        coverage_target: spec.coverage_target,
                        timeout: spec.timeout,
                        test_timeout_seconds,
                        extra_args: extra,
                        workdir: Path::new(&spec.workdir),
                        env,
                        sandbox: &sandbox,
                    },
                    cancel,
                )
                .await
                .map(|mut report| {
                    report.framework_version = version.clone().unwrap_or_default();
                    report
                })
            }
        }
    }
}

/// One suite in one worktree: what [`Runner::run_suite`] runs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Suite<'a> {
    pub(crate) tool: &'a Tool,
    pub(crate) spec: &'a RunSpec,
    pub(crate) worktree: &'a Path,
}

/// How many times the per-test timeout is multiplied for the retry.
const TIMEOUT_RAISE: u32 = 4;

/// The framework's tools, ready to run.
#[derive(Debug, Clone)]
pub(crate) enum Tool {
    Js {
        framework: TestFramework,
        bin: PathBuf,
        coverage: bool,
        capabilities: js::Capabilities,
        /// The run's environment.
        env: BTreeMap<String, String>,
        /// Workspace package directories (repo-relative), for per-project counts.
        packages: Vec<PathBuf>,
        /// What the suite touches outside its worktree: where `node_modules` leads.
        access: crate::sandbox::Access,
    },
    Pytest {
        python: String,
        plugins: Plugins,
        coverage_source: CoverageSource,
        extra_args: Vec<String>,
        version: Option<String>,
        /// The run's environment, PYTHONPATH and the venv's PATH included.
        env: BTreeMap<String, String>,
        /// What the suite reads outside its worktree: the interpreters' and venvs' prefixes.
        access: crate::sandbox::Access,
    },
}

impl Tool {
    pub(crate) fn framework(&self) -> TestFramework {
        match self {
            Self::Js { framework, .. } => *framework,
            Self::Pytest { .. } => TestFramework::Pytest,
        }
    }

    pub(crate) fn env(&self) -> &BTreeMap<String, String> {
        match self {
            Self::Js { env, .. } | Self::Pytest { env, .. } => env,
        }
    }

    /// What the suite touches outside its worktree (see `sandbox`).
    pub(crate) fn access(&self) -> &crate::sandbox::Access {
        match self {
            Self::Js { access, .. } | Self::Pytest { access, .. } => access,
        }
    }

    pub(crate) fn version(&self) -> Option<String> {
        match self {
            Self::Js { capabilities, .. } => capabilities.version.clone(),
            Self::Pytest { version, .. } => version.clone(),
        }
    }
}

/// The reason of a crash in one line: the first lines of what the tool said that carry text
/// (not the bullet or banner lines alone), so `● Unrecognized CLI Parameter:` comes with the
/// parameter it is about.
pub(crate) fn crash_reason(text: &str) -> String {
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| l.trim_start_matches(['●', '×', '✖', '!', '>']).trim())
        .filter(|l| !l.is_empty())
        .take(3)
        .collect();
    let mut reason = lines.join(" ");
    if let Some((cut, _)) = reason.char_indices().nth(300) {
        reason.truncate(cut);
        reason.push('…');
    }
    reason
}

/// Counts per JS workspace package or Python package directory (`packages/*`), from the
/// failures and the per-file results, and each project's line coverage from the per-file
/// line counts `(covered, total)`; empty for a single project.
fn projects_of(
    files: &[(String, TestTotals)],
    lines: &BTreeMap<String, (u64, u64)>,
    report: &TestRunReport,
    worktree: &Path,
    packages: &[PathBuf],
) -> Vec<ProjectReport> {
    let mut roots: Vec<PathBuf> = packages.to_vec();
    if roots.is_empty()
        && let Ok(entries) = std::fs::read_dir(worktree.join("packages"))
    {
        roots.extend(
            entries
                .flatten()
                .filter(|e| e.path().is_dir())
                .map(|e| PathBuf::from("packages").join(e.file_name())),
        );
        roots.sort();
    }
    if roots.len() < 2 || files.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for root in roots {
        let prefix = format!("{}/", root.display());
        let mut totals = TestTotals::default();
        for (file, counts) in files {
            if file.starts_with(&prefix) {
                totals.total += counts.total;
                totals.passed += counts.passed;
                totals.failed += counts.failed;
                totals.skipped += counts.skipped;
                totals.errors += counts.errors;
            }
        }
        if totals.total == 0 && totals.errors == 0 {
            continue;
        }
        let failures = u32::try_from(
            report
                .failures
                .iter()
                .filter(|f| f.file.starts_with(&prefix))
                .count(),
        )
        .unwrap_or(u32::MAX);
        let name = std::fs::read_to_string(worktree.join(&root).join("package.json"))
            .ok()
            .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
            .and_then(|p| p.get("name")?.as_str().map(str::to_owned))
            .unwrap_or_else(|| root.display().to_string());
        let (covered, total) = lines
            .iter()
            .filter(|(file, _)| file.starts_with(&prefix))
            .fold((0, 0), |(c, t), (_, (covered, total))| {
                (c + covered, t + total)
            });
        // Rounded as istanbul rounds its own percentages (two decimals).
        #[allow(clippy::cast_precision_loss)]
        let line_coverage =
            (total > 0).then(|| (covered as f64 * 10_000.0 / total as f64).round() / 100.0);
        out.push(ProjectReport {
            name,
            root: root.display().to_string(),
            pass_rate: crate::pytest::pass_rate(&totals),
            totals: Some(totals),
            failures,
            line_coverage,
        });
    }
    out
}

/// Whether a failure message is a per-test timeout (Jest, Vitest, pytest-timeout).
pub(crate) fn is_timeout_message(message: &str) -> bool {
    message.contains("Exceeded timeout")
        || message.contains("timed out in")
        || message.contains("Timeout (>")
}

/// Every test that ran failed, and each failure is a per-test timeout.
fn every_test_timed_out(report: &TestRunReport) -> bool {
    let totals = report.totals.unwrap_or_default();
    totals.passed == 0
        && totals.failed > 0
        && report.failures.len() == totals.failed as usize
        && report
            .failures
            .iter()
            .all(|f| is_timeout_message(&f.message))
}

/// Pytest's affected tests: a changed test file itself, and for `x.py` the `test_x.py` and
/// `x_test.py` files anywhere in the repository.
pub(crate) fn pytest_related(root: &Path, changed: &[String]) -> Vec<String> {
    let mut wanted = Vec::new();
    let mut direct = Vec::new();
    for path in changed {
        let name = Path::new(path)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !name.ends_with(".py") {
            continue;
        }
        if crate::fix::is_test_path(path) {
            if root.join(path).is_file() {
                direct.push(path.clone());
            }
            continue;
        }
        let stem = name.trim_end_matches(".py");
        wanted.push(format!("test_{stem}.py"));
        wanted.push(format!("{stem}_test.py"));
    }
    let mut found = direct;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                if !name.starts_with('.') && name != "node_modules" && name != "__pycache__" {
                    stack.push(path);
                }
            } else if wanted.contains(&name)
                && let Ok(rel) = path.strip_prefix(root)
            {
                let rel = rel.display().to_string();
                if !found.contains(&rel) {
                    found.push(rel);
                }
            }
        }
    }
    found
}

fn truncate_chars(text: &mut String, max: usize) {
    if let Some((cut, _)) = text.char_indices().nth(max) {
        text.truncate(cut);
        text.push_str(" [truncated]");
    }
}

/// The verdict of a run that exited cleanly with no failing test, shared by every framework:
/// all tests skipped is "no tests"; otherwise the coverage target decides, and a target with
/// no coverage measured is never met.
pub(crate) fn clean_run_outcome(
    totals: &TestTotals,
    coverage: Option<f64>,
    target: f64,
    all_skipped: &str,
    mut warnings: Vec<String>,
) -> (TestOutcome, Vec<String>) {
    if totals.total == totals.skipped {
        warnings.push(all_skipped.to_owned());
        return (TestOutcome::NoTests, warnings);
    }
    if target > 0.0 {
        match coverage {
            None => {
                warnings.push(format!(
                    "coverage target {target}% set but no coverage was measured"
                ));
                return (TestOutcome::CoverageBelowTarget, warnings);
            }
            Some(pct) if pct < target => return (TestOutcome::CoverageBelowTarget, warnings),
            Some(_) => {}
        }
    }
    (TestOutcome::Passed, warnings)
}

/// One line summing up the failures, CCW's `failure_summary`.
pub(crate) fn failure_summary(report: &TestRunReport) -> String {
    if report.failures.is_empty() {
        return String::new();
    }
    let shown: Vec<String> = report
        .failures
        .iter()
        .take(3)
        .map(|f| format!("{} ({})", f.name, f.message.lines().next().unwrap_or("")))
        .collect();
    let more = report.failures.len().saturating_sub(shown.len());
    let tail = if more > 0 {
        format!("; and {more} more")
    } else {
        String::new()
    };
    format!(
        "{} failing: {}{tail}",
        report.failures.len(),
        shown.join("; ")
    )
}

/// CCW's keyword-based defect patterns (1.C.9) found in the failure messages.
pub(crate) fn defect_patterns(report: &TestRunReport) -> Vec<&'static str> {
    let mut patterns = Vec::new();
    let mut add = |p| {
        if !patterns.contains(&p) {
            patterns.push(p);
        }
    };
    for failure in &report.failures {
        let m = &failure.message;
        if m.contains("NoneType") || m.contains("null") || m.contains("undefined") {
            add("null_ref");
        }
        if m.to_ascii_lowercase().contains("timeout") || m.contains("timed out") {
            add("async_timing");
        }
        if m.contains("ImportError")
            || m.contains("ModuleNotFoundError")
            || m.contains("Cannot find module")
        {
            add("import");
        }
        if m.starts_with("TypeError") && !m.contains("undefined") && !m.contains("null") {
            add("type_mismatch");
        }
    }
    patterns
}

/// CCW's effective test patterns (1.C.9), recorded when the pass rate is above 0.8: the suite
/// exercises the happy path whenever tests pass; error-handling and edge-case tests are
/// recognised by name among the failures that remain.
fn effective_patterns(report: &TestRunReport) -> Vec<String> {
    let totals = report.totals.unwrap_or_default();
    if report.pass_rate <= 0.8 || totals.passed == 0 {
        return Vec::new();
    }
    let mut patterns = vec!["happy_path".to_owned()];
    let names = report
        .failures
        .iter()
        .map(|f| f.name.to_ascii_lowercase())
        .collect::<Vec<_>>();
    if names.iter().any(|n| {
        ["error", "throw", "raise", "invalid", "missing"]
            .iter()
            .any(|k| n.contains(k))
    }) {
        patterns.push("error_handling".to_owned());
    }
    if names.iter().any(|n| {
        ["edge", "empty", "zero", "boundary", "limit"]
            .iter()
            .any(|k| n.contains(k))
    }) {
        patterns.push("edge_cases".to_owned());
    }
    patterns
}

/// The `results/run-N.json` document (CCW §2.4 plus its proposed fields).
fn run_file_json(report: &TestRunReport, spec: &RunSpec, number: u32) -> serde_json::Value {
    let totals = report.totals.unwrap_or_default();
    let coverage = report.coverage.as_ref().and_then(|c| c.overall);
    let passed = report.outcome() == TestOutcome::Passed;
    let fix = report.fix_loop.as_ref();
    serde_json::json!({
        "run_id": format!("run-{number:03}"),
        "framework": troupe_proto::names::name(report.framework()),
        "outcome": troupe_proto::names::name(report.outcome()),
        "pass_rate": report.pass_rate,
        "coverage": coverage,
        "coverage_target": report.coverage_target,
        "coverage_source": if spec.coverage_source.is_empty() { "auto" } else { spec.coverage_source.as_str() },
        "coverage_detail": report.coverage.as_ref().map(|c| serde_json::json!({
            "lines": c.lines, "statements": c.statements, "branches": c.branches,
            "functions": c.functions, "files": c.files,
        })),
        "iterations": fix.map_or(1, |f| f.iterations.len() + 1),
        "passed": passed,
        "failure_summary": failure_summary(report),
        "defect_patterns": report.defect_patterns,
        "effective_patterns": report.effective_patterns,
        "timestamp": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        "total": totals.total,
        "tests_passed": totals.passed,
        "failed": totals.failed,
        "skipped": totals.skipped,
        "errors": totals.errors,
        "failures": report.failures.iter().map(|f| serde_json::json!({
            "test": f.name,
            "error": f.message,
            "file": f.file,
            "line": f.line,
            "test_line": f.test_line,
            "error_origin": f.error_origin,
            "criticality": troupe_proto::names::name(f.criticality()),
        })).collect::<Vec<_>>(),
        "duration_ms": report.duration_ms,
        "command": report.command,
        "exit_code": report.exit_code,
        "report_paths": report.report_paths,
        "commit": report.commit,
        "warnings": report.warnings,
        "framework_version": report.framework_version,
        "workdir": report.workdir,
        "env": report.env.iter().filter(|(k, _)| k.as_str() != "PATH").collect::<BTreeMap<_, _>>(),
        "python": report.python,
        "installer": report.installer,
        "install_log": report.install_log,
        "stderr_tail": report.stderr_tail,
        "crash_reason": if matches!(report.outcome(), TestOutcome::RunnerCrashed | TestOutcome::InstallFailed | TestOutcome::SetupFailed) {
            crash_reason(if report.stderr_tail.is_empty() { &report.install_log } else { &report.stderr_tail })
        } else {
            String::new()
        },
        "outside_paths": report.outside_paths,
        "sandbox_denied": report.sandbox_denied,
        "missing_generated": report.missing_generated,
        "skip_reasons": report.skip_reasons.iter().collect::<BTreeMap<_, _>>(),
        "setup": report.setup_steps.iter().map(|s| serde_json::json!({
            "argv": s.argv, "exit_code": s.exit_code, "duration_ms": s.duration_ms, "output_tail": s.output_tail,
        })).collect::<Vec<_>>(),
        "projects": report.projects.iter().map(|p| serde_json::json!({
            "name": p.name, "root": p.root, "pass_rate": p.pass_rate, "failures": p.failures,
            "total": p.totals.unwrap_or_default().total, "passed": p.totals.unwrap_or_default().passed,
            "failed": p.totals.unwrap_or_default().failed, "skipped": p.totals.unwrap_or_default().skipped,
            "line_coverage": p.line_coverage,
        })).collect::<Vec<_>>(),
        "test_timeout_seconds": report.test_timeout_seconds,
        "timeout_retried": report.timeout_retried,
        "coverage_history": fix.map_or_else(|| vec![coverage.unwrap_or(0.0)], |f| f.coverage_history.clone()),
        "pass_rate_history": fix.map_or_else(|| vec![report.pass_rate], |f| f.pass_rate_history.clone()),
        "fix_loop": fix.map(|f| serde_json::json!({
            "succeeded": f.succeeded,
            "scope": crate::fix::scope_name(f.scope()),
            "max_iterations": f.max_iterations,
            "final_commit": f.final_commit,
            "flaky_tests": f.flaky_tests,
            "usage": f.usage.map(|u| serde_json::json!({"input_tokens": u.input_tokens, "output_tokens": u.output_tokens, "cached_input_tokens": u.cached_input_tokens})),
            "iterations": f.iterations.iter().map(|i| serde_json::json!({
                "iteration": i.iteration, "strategy": troupe_proto::names::name(i.strategy()),
                "verdict": troupe_proto::names::name(i.verdict()),
                "commit": i.commit, "pass_rate": i.pass_rate, "coverage": i.coverage,
                "out_of_scope_paths": i.out_of_scope_paths, "new_failures": i.new_failures,
                "affected_command": i.affected_command, "detail": i.detail,
                "backend": i.backend, "fallbacks": i.fallbacks, "error_kind": match i.error_kind() {
                    troupe_proto::v1::ErrorKind::Unspecified => "",
                    kind => troupe_proto::names::name(kind),
                },
                "usage": i.usage.map(|u| serde_json::json!({"input_tokens": u.input_tokens, "output_tokens": u.output_tokens, "cached_input_tokens": u.cached_input_tokens})),
            })).collect::<Vec<_>>(),
        })),
        "troupe_run_id": spec.run_id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(path: &str) -> RunTestsRequest {
        RunTestsRequest {
            repo_path: path.to_owned(),
            ..RunTestsRequest::default()
        }
    }

    #[test]
    fn applies_defaults_and_refuses_bad_requests() {
        let spec = RunSpec::from_request(request("/repo")).expect("valid");
        assert_eq!(spec.git_ref, "HEAD");
        assert_eq!(spec.timeout, DEFAULT_TIMEOUT);
        assert_eq!(spec.test_timeout_seconds, DEFAULT_TEST_TIMEOUT_SECONDS);
        assert!(spec.run_id.starts_with("run-"));
        assert!(matches!(
            RunSpec::from_request(request("relative")),
            Err(Error::InvalidArgument(_))
        ));
        let mut bad = request("/repo");
        bad.coverage_target = 120.0;
        assert!(matches!(
            RunSpec::from_request(bad),
            Err(Error::InvalidArgument(_))
        ));
        let mut bad = request("/repo");
        bad.framework = 42;
        assert!(matches!(
            RunSpec::from_request(bad),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn a_crash_reason_keeps_the_line_after_the_banner() {
        // Jest 22 given --testTimeout, as it prints it.
        let stderr = "● Unrecognized CLI Parameter:\n\n  Unrecognized option \"testTimeout\".\n\n  CLI Options Documentation:\n  https://facebook.github.io/jest/docs/en/cli.html\n";
        assert_eq!(
            crash_reason(stderr),
            "Unrecognized CLI Parameter: Unrecognized option \"testTimeout\". CLI Options Documentation:"
        );
        assert_eq!(crash_reason(""), "");
    }

    #[test]
    fn a_plan_tightens_the_services_sandbox_but_never_loosens_it() {
        use troupe_process::SandboxMode;
        let data = tempfile::tempdir().expect("tempdir");
        let runner = |mode| {
            Runner::new(data.path().to_path_buf(), "python3".to_owned()).with_sandbox(
                troupe_process::sandbox::SandboxArgs {
                    mode,
                    ..Default::default()
                },
            )
        };
        let mut spec = RunSpec::from_request(request("/repo")).expect("valid");
        let worktree = data.path().join("worktrees/test-runs/x-0");
        let access = crate::sandbox::Access::default();
        spec.sandbox = Some(SandboxMode::Enforce);
        let mode = |runner: &Runner, spec: &RunSpec| {
            (
                runner.run_sandbox(spec, &worktree, &access).mode(),
                runner.installer_sandbox(spec).mode(),
            )
        };
        assert_eq!(
            mode(&runner(SandboxMode::Off), &spec),
            (SandboxMode::Enforce, SandboxMode::Enforce)
        );
        spec.sandbox = Some(SandboxMode::Off);
        assert_eq!(
            mode(&runner(SandboxMode::Warn), &spec),
            (SandboxMode::Warn, SandboxMode::Warn)
        );
        spec.sandbox = None;
        assert_eq!(
            mode(&runner(SandboxMode::Enforce), &spec),
            (SandboxMode::Enforce, SandboxMode::Enforce)
        );
    }

    #[test]
    fn truncates_on_char_boundaries() {
        let mut text = "é".repeat(10);
        truncate_chars(&mut text, 4);
        assert_eq!(text, "éééé [truncated]");
    }
}
