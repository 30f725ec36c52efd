//! The checks: files against a commit range, then in one detached worktree at the commit the
//! verification command, syntax and lint, criteria (typed, judged or manual review) and a
//! review. Every check carries its evidence; nothing passes by default.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use troupe_process::{Command, Sandbox, Termination};
use troupe_proto::v1::{
    CheckResult, CheckStatus, ConvergenceMet, FileAction, FileChange, ReviewReport, TestRunReport,
    ValidateRequest, ValidationReport, Verdict,
};
use troupe_workspace::{Mirror, Mirrors, Oid, Remote, Repo};

use crate::Error;
use crate::check::{CriteriaEnv, criteria_checks};
use crate::judge::{JudgeConfig, JudgeContext};
use crate::syntax::SyntaxJob;
use crate::tools::Tools;

/// Wall-clock limit of a verification command when none is given.
pub const DEFAULT_VERIFICATION_TIMEOUT: Duration = Duration::from_secs(300);

/// Evidence for a free-text criterion when no judge is configured.
pub const NO_CRITERION_CHECKER: &str =
    "no automatic check understands this criterion and no judge is configured";

/// A direct validation request with defaults applied.
#[derive(Clone, Debug)]
pub struct Validation {
    /// The repository's remote: an absolute path (a remote on this machine) or a git URL.
    pub remote: Remote,
    /// Commit-ish to check.
    pub git_ref: String,
    /// Commit-ish `modify` is measured against; `None` = the first parent of `git_ref`.
    pub base_ref: Option<String>,
    /// Files and their expected actions.
    pub files: Vec<FileChange>,
    /// Argv that must exit 0 in a worktree at `git_ref`; empty = none.
    pub verification: Vec<String>,
    /// Limit for the verification command (and each command a check runs).
    pub timeout: Duration,
    /// Convergence criteria.
    pub criteria: Vec<String>,
    /// Test-run results for `test:` and `coverage` criteria.
    pub test_runs: Vec<TestRunReport>,
    /// Judge for free-text criteria; `None` = the validator's default.
    pub judge: Option<JudgeConfig>,
    /// Review the changed files.
    pub review: bool,
    /// Syntax and lint checks on the changed files.
    pub syntax: bool,
}

impl Validation {
    /// Builds a validation from the RPC request. A judge it names takes its connection and
    /// credentials from `configured` (the validator's own), never from the request.
    pub fn from_request(
        request: ValidateRequest,
        configured: Option<&JudgeConfig>,
    ) -> Result<Self, Error> {
        let remote = Remote::parse(&request.repo_path).map_err(|err| {
            Error::InvalidArgument(format!(
                "repo_path must be an absolute path or a git URL: {err}"
            ))
        })?;
        if request.verification.first().is_some_and(String::is_empty) {
            return Err(Error::InvalidArgument(
                "verification argv starts with an empty program".to_owned(),
            ));
        }
        if request.judge.first().is_some_and(String::is_empty) {
            return Err(Error::InvalidArgument(
                "judge argv starts with an empty program".to_owned(),
            ));
        }
        let timeout = match request.timeout_seconds {
            0 => DEFAULT_VERIFICATION_TIMEOUT,
            secs => Duration::from_secs(u64::from(secs)),
        };
        let judge = match &request.judge_spec {
            Some(spec) => {
                troupe_plan::spec::JudgeSpec::from_value(&troupe_proto::json::from_struct(spec))
                    .map_err(|err| Error::InvalidArgument(err.to_string()))?
                    .map(|judge| JudgeConfig::from_spec(&judge, timeout, configured))
            }
            None if request.judge.is_empty() => None,
            None => Some(JudgeConfig::command(request.judge, timeout)),
        };
        Ok(Self {
            remote,
            git_ref: if request.r#ref.is_empty() {
                "HEAD".to_owned()
            } else {
                request.r#ref
            },
            base_ref: Some(request.base_ref).filter(|b| !b.is_empty()),
            files: request.files,
            verification: request.verification,
            timeout,
            criteria: request.criteria,
            test_runs: request.test_runs,
            judge,
            review: request.review,
            syntax: request.syntax,
        })
    }
}

/// The checks that need a checkout of the commit, shared by the RPC and the worker.
#[derive(Debug, Default)]
pub(crate) struct TreeJob<'a> {
    pub(crate) verification: Option<&'a [String]>,
    pub(crate) timeout: Duration,
    pub(crate) syntax: bool,
    pub(crate) review: bool,
    /// Changed paths for syntax, lint and review; `None` = every file at the commit.
    pub(crate) changed: Option<Vec<String>>,
    pub(crate) criteria: &'a [String],
    /// Prefix of the criteria checks' names (`IMPL-001/` for upstream tasks).
    pub(crate) prefix: &'a str,
    pub(crate) test_runs: &'a [TestRunReport],
    pub(crate) judge: Option<&'a JudgeConfig>,
    pub(crate) task_id: &'a str,
    pub(crate) title: &'a str,
    pub(crate) description: &'a str,
    /// The plan's `sandbox` for the task: it may tighten the service's mode, never loosen it.
    pub(crate) sandbox: Option<troupe_process::SandboxMode>,
}

/// Runs checks; shared by the gRPC service and the worker loop.
#[derive(Debug, Clone)]
pub struct Validator {
    data_dir: PathBuf,
    mirrors: Mirrors,
    tools: Tools,
    judge: Option<JudgeConfig>,
    sandbox: troupe_process::sandbox::SandboxArgs,
}

impl Validator {
    /// A validator keeping its worktrees under `<data_dir>/worktrees/validate/`.
    pub fn new(data_dir: PathBuf) -> Self {
        Self {
            mirrors: Mirrors::new(data_dir.join("mirrors")),
            data_dir,
            tools: Tools::default(),
            judge: None,
            sandbox: troupe_process::sandbox::SandboxArgs::default(),
        }
    }

    /// Confines verification commands with these settings (default: `enforce`).
    pub fn with_sandbox(mut self, sandbox: troupe_process::sandbox::SandboxArgs) -> Self {
        self.sandbox = sandbox;
        self
    }

    /// Looks tools up in these directories first (and puts them first on children's `PATH`).
    pub fn with_tools(mut self, tools: Tools) -> Self {
        self.tools = tools;
        self
    }

    /// The judge for free-text criteria when a task or request names none.
    pub fn with_judge(mut self, judge: Option<JudgeConfig>) -> Self {
        self.judge = judge;
        self
    }

    /// The validator's data directory.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// Authenticates to private remotes with `credentials`.
    pub fn with_credentials(
        mut self,
        credentials: std::sync::Arc<troupe_workspace::Credentials>,
    ) -> Self {
        self.mirrors = self.mirrors.with_credentials(credentials);
        self
    }

    /// Removes the checkouts a previous run left (it died while checking); call at start.
    pub async fn recover(&self) -> Result<(), Error> {
        let checkouts = self.data_dir.join("worktrees").join("validate");
        if tokio::fs::try_exists(&checkouts).await.unwrap_or(false) {
            tokio::fs::remove_dir_all(&checkouts)
                .await
                .map_err(|source| Error::Io {
                    path: checkouts.clone(),
                    source,
                })?;
        }
        self.mirrors.prune_worktrees().await?;
        Ok(())
    }

    /// This validator's mirror of `remote`.
    pub(crate) async fn mirror(&self, remote: &Remote) -> Result<Mirror, Error> {
        Ok(self.mirrors.open(remote).await?)
    }

    pub(crate) fn default_judge(&self) -> Option<&JudgeConfig> {
        self.judge.as_ref()
    }

    /// Checks the files, the verification command and the criteria of `validation` (and
    /// syntax, lint and a review when asked).
    #[tracing::instrument(skip_all, fields(repo = %validation.remote, git_ref = %validation.git_ref))]
    pub async fn validate(
        &self,
        validation: &Validation,
        cancel: &CancellationToken,
    ) -> Result<ValidationReport, Error> {
        let mirror = self.mirror(&validation.remote).await?;
        let repo = mirror.repo().clone();
        let commit = mirror.fetch_rev(&validation.git_ref).await?;
        let base = match &validation.base_ref {
            Some(base) => Some(mirror.fetch_rev(base).await?),
            None => first_parent(&repo, &commit).await?,
        };
        let checks = check_files(&repo, &commit, base.as_ref(), &validation.files, "").await?;
        let changed = match (&base, validation.syntax || validation.review) {
            (Some(base), true) => Some(repo.changed_paths(base, &commit).await?),
            _ => None,
        };
        let job = TreeJob {
            verification: (!validation.verification.is_empty())
                .then_some(validation.verification.as_slice()),
            timeout: validation.timeout,
            syntax: validation.syntax,
            review: validation.review,
            changed,
            criteria: &validation.criteria,
            prefix: "",
            test_runs: &validation.test_runs,
            judge: validation.judge.as_ref().or(self.judge.as_ref()),
            ..TreeJob::default()
        };
        let (checks, review) = self.in_tree(&repo, &commit, job, checks, cancel).await?;
        let mut report = report(commit, checks);
        report.review = review;
        Ok(report)
    }

    /// Runs the checks of `job` that need a checkout in one detached worktree at `commit`
    /// (created only when needed, always removed), appending to `checks`.
    pub(crate) async fn in_tree(
        &self,
        repo: &Repo,
        commit: &Oid,
        job: TreeJob<'_>,
        mut checks: Vec<CheckResult>,
        cancel: &CancellationToken,
    ) -> Result<(Vec<CheckResult>, Option<ReviewReport>), Error> {
        if job.verification.is_none() && !job.syntax && !job.review && job.criteria.is_empty() {
            return Ok((checks, None));
        }
        let worktree = self.checkout_path(commit);
        let review = repo
            .in_detached_worktree(&worktree, commit, |_| {
                self.in_worktree(&worktree, commit, job, &mut checks, cancel)
            })
            .await??;
        Ok((checks, review))
    }

    async fn in_worktree(
        &self,
        worktree: &Path,
        commit: &Oid,
        job: TreeJob<'_>,
        checks: &mut Vec<CheckResult>,
        cancel: &CancellationToken,
    ) -> Result<Option<ReviewReport>, Error> {
        let base = self
            .sandbox
            .base(&self.data_dir)
            .tighten(job.sandbox.unwrap_or(troupe_process::SandboxMode::Off));
        let name = worktree
            .file_name()
            .map_or_else(|| "checks".into(), |name| name.to_os_string());
        if let Some(argv) = job.verification {
            // A private home beside the worktrees, removed after the run.
            let home = self.data_dir.join("homes").join(&name);
            let sandbox = base
                .clone()
                .write(worktree)
                .git_worktree(worktree)
                .home(&home);
            let checked = verify_in(worktree, argv, job.timeout, &sandbox, cancel).await;
            if let Err(err) = tokio::fs::remove_dir_all(&home).await
                && err.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(home = %home.display(), error = %err, "cannot remove a verification home");
            }
            checks.push(checked?);
        }
        // Syntax and lint tools, criteria commands: read-only on the worktree, a home of their
        // own (their TMPDIR) and `cargo check`'s build directory writable.
        let cargo_target = self.data_dir.join("cargo-target");
        let tools_home = self
            .data_dir
            .join("homes")
            .join(format!("{}-tools", name.to_string_lossy()));
        if let Err(source) = tokio::fs::create_dir_all(&cargo_target).await {
            return Err(Error::Io {
                path: cargo_target,
                source,
            });
        }
        let mut confined = base
            .clone()
            .read(worktree)
            .git_worktree(worktree)
            .write(&cargo_target)
            .home(&tools_home);
        for dir in rust_toolchains() {
            confined = confined.read(dir);
        }
        let tools = self.tools.confined(confined);
        let checked = self
            .tool_checks(worktree, commit, &job, &tools, &base, checks, cancel)
            .await;
        if let Err(err) = tokio::fs::remove_dir_all(&tools_home).await
            && err.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(home = %tools_home.display(), error = %err, "cannot remove a tools home");
        }
        checked
    }

    /// The checks of `job` that run tools (syntax, lint, criteria and their judge) in
    /// `worktree`, confined by `tools` (the judge by `base`, to which its backend adds the
    /// worktree read-only).
    #[allow(clippy::too_many_arguments)]
    async fn tool_checks(
        &self,
        worktree: &Path,
        commit: &Oid,
        job: &TreeJob<'_>,
        tools: &Tools,
        base: &Sandbox,
        checks: &mut Vec<CheckResult>,
        cancel: &CancellationToken,
    ) -> Result<Option<ReviewReport>, Error> {
        let changed = match job.changed.clone() {
            Some(changed) => changed,
            None if job.syntax || job.review => crate::review::all_files(worktree),
            None => Vec::new(),
        };
        if job.syntax {
            let syntax = SyntaxJob {
                tools,
                worktree,
                changed: &changed,
                timeout: job.timeout,
                cargo_target: self.data_dir.join("cargo-target"),
                cancel,
            };
            checks.extend(syntax.syntax().await?);
            checks.extend(syntax.lint().await?);
        }
        if !job.criteria.is_empty() {
            let scratch = self.data_dir.join("scratch");
            tokio::fs::create_dir_all(&scratch)
                .await
                .map_err(|source| Error::Io {
                    path: scratch.clone(),
                    source,
                })?;
            let prior = checks.clone();
            let env = CriteriaEnv {
                tools,
                judge_sandbox: base,
                worktree,
                scratch: &scratch,
                timeout: job.timeout,
                test_runs: job.test_runs,
                judge: job.judge,
                context: JudgeContext {
                    task_id: job.task_id,
                    title: job.title,
                    description: job.description,
                    commit: commit.as_str(),
                    changed: &changed,
                    checks: &prior,
                },
                cancel,
            };
            checks.extend(criteria_checks(&env, job.criteria, job.prefix).await?);
        }
        Ok(job.review.then(|| {
            let present: Vec<String> = changed
                .iter()
                .filter(|p| worktree.join(p).is_file())
                .cloned()
                .collect();
            crate::review::review(worktree, &present, checks)
        }))
    }

    /// Where a check of `commit` gets its detached worktree: `<data_dir>/worktrees/validate/`,
    /// unique per call (parallel validations of one commit do not share it).
    fn checkout_path(&self, commit: &Oid) -> PathBuf {
        self.data_dir
            .join("worktrees")
            .join("validate")
            .join(format!(
                "{}-{}",
                &commit.as_str()[..12],
                uuid::Uuid::new_v4().simple()
            ))
    }
}

/// Rust's toolchains and registry (`RUSTUP_HOME`, `CARGO_HOME`, else `~/.rustup`, `~/.cargo`):
/// the `cargo` on `PATH` is often rustup's proxy, which reads them. Read only.
fn rust_toolchains() -> Vec<PathBuf> {
    let home = std::env::var_os("HOME")
        .filter(|home| !home.is_empty())
        .map(PathBuf::from);
    [("RUSTUP_HOME", ".rustup"), ("CARGO_HOME", ".cargo")]
        .into_iter()
        .filter_map(|(name, default)| {
            std::env::var_os(name)
                .filter(|value| !value.is_empty())
                .map(PathBuf::from)
                .or_else(|| home.as_ref().map(|home| home.join(default)))
        })
        .filter(|dir| dir.is_dir())
        .collect()
}

/// Runs `argv` in `worktree`: PASS on exit 0, FAIL on another exit, ERROR when it cannot run
/// or times out.
#[tracing::instrument(skip_all, fields(program = %argv.first().map_or("", String::as_str)))]
async fn verify_in(
    worktree: &Path,
    argv: &[String],
    timeout: Duration,
    sandbox: &Sandbox,
    cancel: &CancellationToken,
) -> Result<CheckResult, Error> {
    let started = Instant::now();
    let (status, evidence) = run_verification(worktree, argv, timeout, sandbox, cancel).await?;
    Ok(CheckResult {
        name: "verification".to_owned(),
        kind: troupe_proto::v1::CheckKind::Verification as i32,
        status: status as i32,
        duration_ms: millis(started.elapsed()),
        evidence,
        subject: argv.join(" "),
        ..Default::default()
    })
}

/// How a check's evidence starts when the sandbox denied its command something; the worker
/// fails the task with `SANDBOX_DENIED` then.
pub(crate) const SANDBOX_DENIED: &str = "denied by the sandbox: ";

async fn run_verification(
    worktree: &Path,
    argv: &[String],
    timeout: Duration,
    sandbox: &Sandbox,
    cancel: &CancellationToken,
) -> Result<(CheckStatus, String), Error> {
    let command = match Command::from_argv(argv) {
        Ok(command) => command,
        Err(err) => {
            return Ok((
                CheckStatus::Error,
                format!("cannot run the verification command: {err}"),
            ));
        }
    };
    let output = match command
        .sandbox(sandbox.clone())
        .cwd(worktree)
        .env("CI", "true")
        .env("NO_COLOR", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .timeout(timeout)
        .max_output_bytes(256 * 1024)
        .run(cancel)
        .await
    {
        Ok(output) => output,
        Err(troupe_process::Error::SandboxUnavailable { reason }) => {
            return Ok((
                CheckStatus::Error,
                format!("{SANDBOX_DENIED}the command could not be confined: {reason}"),
            ));
        }
        Err(
            err @ (troupe_process::Error::NotFound { .. }
            | troupe_process::Error::Spawn { .. }
            | troupe_process::Error::EmptyCommand),
        ) => {
            return Ok((
                CheckStatus::Error,
                format!("cannot run the verification command: {err}"),
            ));
        }
        Err(err) => return Err(Error::Process(err)),
    };
    let tail = troupe_process::tail(
        &format!("{}{}", output.stdout_text(), output.stderr_text()),
        30,
        4000,
    );
    let seconds = output.duration.as_secs_f64();
    if output.termination == Termination::Exited
        && output.exit_code != Some(0)
        && let Some(denied) = sandbox.denied(
            &format!("{}\n{}", output.stderr_text(), output.stdout_text()),
            Some(worktree),
        )
    {
        return Ok((
            CheckStatus::Fail,
            format!("{SANDBOX_DENIED}{denied}\n{tail}"),
        ));
    }
    Ok(match (output.termination, output.exit_code) {
        (Termination::Cancelled, _) => return Err(Error::Cancelled),
        (Termination::TimedOut | Termination::IdleTimedOut, _) => (
            CheckStatus::Error,
            format!(
                "timed out after {}s; its process group was killed\n{tail}",
                timeout.as_secs()
            ),
        ),
        (Termination::Exited, Some(0)) => (
            CheckStatus::Pass,
            format!("exit 0 in {seconds:.1}s\n{tail}"),
        ),
        (Termination::Exited, Some(code)) => (
            CheckStatus::Fail,
            format!("exit {code} in {seconds:.1}s\n{tail}"),
        ),
        (Termination::Exited, None) => (
            CheckStatus::Fail,
            format!(
                "killed by signal {} after {seconds:.1}s\n{tail}",
                output.signal.unwrap_or(0)
            ),
        ),
    })
}

/// The first parent of `commit`, `None` for a root commit.
pub(crate) async fn first_parent(repo: &Repo, commit: &Oid) -> Result<Option<Oid>, Error> {
    match repo.resolve(&format!("{commit}^")).await {
        Ok(parent) => Ok(Some(parent)),
        Err(troupe_workspace::Error::UnknownRevision { .. }) => Ok(None),
        Err(err) => Err(err.into()),
    }
}

/// A path that stays inside the repository (the shared rule: relative, not climbing out).
pub(crate) fn confined(path: &str) -> bool {
    troupe_backends::relative_inside(path).is_some()
}

fn short(oid: &Oid) -> &str {
    &oid.as_str()[..12]
}

/// Checks each file's expected action at `commit`; `modify` means changed between `base` and
/// `commit` (with no base, a root commit, every file present counts as changed). Check names
/// are `<prefix>file:<path>`.
pub(crate) async fn check_files(
    repo: &Repo,
    commit: &Oid,
    base: Option<&Oid>,
    files: &[FileChange],
    prefix: &str,
) -> Result<Vec<CheckResult>, Error> {
    let changed = match base {
        Some(base) if files.iter().any(|f| f.action() == FileAction::Modify) => {
            Some(repo.changed_paths(base, commit).await?)
        }
        _ => None,
    };
    let mut checks = Vec::with_capacity(files.len());
    for file in files {
        let started = Instant::now();
        let (status, evidence) = check_file(repo, commit, base, changed.as_deref(), file).await?;
        checks.push(CheckResult {
            name: format!("{prefix}file:{}", file.path),
            kind: troupe_proto::v1::CheckKind::File as i32,
            status: status as i32,
            duration_ms: millis(started.elapsed()),
            evidence,
            subject: file.path.clone(),
            ..Default::default()
        });
    }
    Ok(checks)
}

async fn check_file(
    repo: &Repo,
    commit: &Oid,
    base: Option<&Oid>,
    changed: Option<&[String]>,
    file: &FileChange,
) -> Result<(CheckStatus, String), Error> {
    let path = file.path.trim_start_matches("./");
    if !confined(path) {
        return Ok((
            CheckStatus::Error,
            format!("path {:?} escapes the repository root; refused", file.path),
        ));
    }
    let at = short(commit);
    let now = repo.read_file(commit, path).await?;
    Ok(match file.action() {
        FileAction::Unspecified => (
            CheckStatus::Error,
            "no action (create, modify or delete) given".to_owned(),
        ),
        FileAction::Create => match now {
            None => (
                CheckStatus::Fail,
                format!("create: {path} does not exist at {at}"),
            ),
            Some(bytes) if bytes.iter().all(u8::is_ascii_whitespace) => (
                CheckStatus::Fail,
                format!(
                    "create: {path} exists at {at} but is empty ({} bytes)",
                    bytes.len()
                ),
            ),
            Some(bytes) => (
                CheckStatus::Pass,
                format!(
                    "create: {path} exists at {at} ({} bytes, {} lines)",
                    bytes.len(),
                    line_count(&bytes)
                ),
            ),
        },
        FileAction::Modify => {
            let Some(bytes) = now else {
                return Ok((
                    CheckStatus::Fail,
                    format!("modify: {path} does not exist at {at}"),
                ));
            };
            match (base, changed) {
                (Some(base), Some(changed)) => {
                    let before = repo.read_file(base, path).await?;
                    let was = before.as_ref().map_or_else(
                        || "absent".to_owned(),
                        |b| format!("{} bytes, {} lines", b.len(), line_count(b)),
                    );
                    let is = format!("{} bytes, {} lines", bytes.len(), line_count(&bytes));
                    if changed.iter().any(|c| c == path) {
                        (
                            CheckStatus::Pass,
                            format!(
                                "modify: {path} changed between {} and {at} ({was} -> {is})",
                                short(base)
                            ),
                        )
                    } else {
                        (
                            CheckStatus::Fail,
                            format!(
                                "modify: {path} is unchanged between {} and {at} ({is})",
                                short(base)
                            ),
                        )
                    }
                }
                _ => (
                    CheckStatus::Pass,
                    format!(
                        "modify: {path} exists at {at}, a root commit, so it was added there ({} bytes)",
                        bytes.len()
                    ),
                ),
            }
        }
        FileAction::Delete => match now {
            Some(bytes) => (
                CheckStatus::Fail,
                format!(
                    "delete: {path} still exists at {at} ({} bytes)",
                    bytes.len()
                ),
            ),
            // Not a file, but something else is there: a directory is not "deleted".
            None if repo.path_exists(commit, path).await? => (
                CheckStatus::Fail,
                format!("delete: {path} still exists at {at} (as a directory)"),
            ),
            None => {
                let before = match base {
                    Some(base) => repo
                        .read_file(base, path)
                        .await?
                        .map(|b| format!(" (it had {} bytes at {})", b.len(), short(base))),
                    None => None,
                };
                (
                    CheckStatus::Pass,
                    format!(
                        "delete: {path} is absent at {at}{}",
                        before.unwrap_or_default()
                    ),
                )
            }
        },
    })
}

fn line_count(bytes: &[u8]) -> usize {
    let newlines = bytes.iter().filter(|b| **b == b'\n').count();
    if bytes.last().is_some_and(|b| *b != b'\n') {
        newlines + 1
    } else {
        newlines
    }
}

/// FAIL if any check failed or errored, else MANUAL_REVIEW if any needs review, else PASS.
/// An empty list needs review: nothing was checked, so nothing may pass.
pub fn verdict(checks: &[CheckResult]) -> Verdict {
    let has = |status: CheckStatus| checks.iter().any(|c| c.status() == status);
    if has(CheckStatus::Fail) || has(CheckStatus::Error) {
        Verdict::Fail
    } else if checks.is_empty() || has(CheckStatus::ManualReview) || has(CheckStatus::Unspecified) {
        Verdict::ManualReview
    } else {
        Verdict::Pass
    }
}

/// The report for `checks` at `commit`; with no checks at all it says so in one check.
pub(crate) fn report(commit: Oid, mut checks: Vec<CheckResult>) -> ValidationReport {
    if checks.is_empty() {
        checks.push(CheckResult {
            name: "nothing-to-check".to_owned(),
            kind: troupe_proto::v1::CheckKind::Criterion as i32,
            status: CheckStatus::ManualReview as i32,
            duration_ms: 0,
            evidence:
                "no files, verification command or criteria were given, so nothing was checked"
                    .to_owned(),
            subject: String::new(),
            ..Default::default()
        });
    }
    let (convergence_verified, convergence_met) = convergence(&checks);
    ValidationReport {
        verdict: verdict(&checks) as i32,
        checks,
        commit: commit.into(),
        convergence_verified,
        convergence_met: convergence_met as i32,
        ..ValidationReport::default()
    }
}

/// Per own criterion (checks named `criterion:<n>`), whether it passed, and the summary's
/// `convergence-met`: `pass` when all passed, `fail` when one failed or errored, else
/// `pending`; empty without criteria.
pub(crate) fn convergence(checks: &[CheckResult]) -> (Vec<bool>, ConvergenceMet) {
    convergence_of(checks, "")
}

/// [`convergence`] for the criteria checks named `<prefix>criterion:<n>` (an upstream task's,
/// with prefix `IMPL-001/`).
pub(crate) fn convergence_of(checks: &[CheckResult], prefix: &str) -> (Vec<bool>, ConvergenceMet) {
    let own: Vec<&CheckResult> = checks
        .iter()
        .filter(|c| {
            c.kind() == troupe_proto::v1::CheckKind::Criterion
                && c.name
                    .strip_prefix(prefix)
                    .is_some_and(|rest| rest.starts_with("criterion:"))
        })
        .collect();
    let verified: Vec<bool> = own
        .iter()
        .map(|c| c.status() == CheckStatus::Pass)
        .collect();
    let met = if own.is_empty() {
        ConvergenceMet::Unspecified
    } else if verified.iter().all(|v| *v) {
        ConvergenceMet::Pass
    } else if own
        .iter()
        .any(|c| matches!(c.status(), CheckStatus::Fail | CheckStatus::Error))
    {
        ConvergenceMet::Fail
    } else {
        ConvergenceMet::Pending
    };
    (verified, met)
}

pub(crate) fn millis(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(status: CheckStatus) -> CheckResult {
        CheckResult {
            status: status as i32,
            ..CheckResult::default()
        }
    }

    #[test]
    fn verdicts_never_pass_on_failures_or_reviews() {
        use CheckStatus::{Error as E, Fail, ManualReview, Pass, Skipped};
        assert_eq!(verdict(&[check(Pass), check(Skipped)]), Verdict::Pass);
        assert_eq!(
            verdict(&[check(Pass), check(ManualReview)]),
            Verdict::ManualReview
        );
        assert_eq!(verdict(&[check(ManualReview), check(Fail)]), Verdict::Fail);
        assert_eq!(verdict(&[check(Pass), check(E)]), Verdict::Fail);
        assert_eq!(verdict(&[]), Verdict::ManualReview);
    }

    #[test]
    fn convergence_met_is_pass_fail_or_pending() {
        let c = |name: &str, status: CheckStatus| CheckResult {
            name: name.to_owned(),
            kind: troupe_proto::v1::CheckKind::Criterion as i32,
            status: status as i32,
            ..CheckResult::default()
        };
        use CheckStatus::{Fail, ManualReview, Pass};
        assert_eq!(
            convergence(&[
                c("criterion:1", Pass),
                c("criterion:2", Pass),
                c("IMPL-1/criterion:1", Fail)
            ]),
            (vec![true, true], ConvergenceMet::Pass)
        );
        assert_eq!(
            convergence(&[c("criterion:1", Pass), c("criterion:2", ManualReview)]),
            (vec![true, false], ConvergenceMet::Pending)
        );
        assert_eq!(
            convergence(&[c("criterion:1", Fail), c("criterion:2", ManualReview)]),
            (vec![false, false], ConvergenceMet::Fail)
        );
        assert_eq!(convergence(&[]), (vec![], ConvergenceMet::Unspecified));
    }

    #[test]
    fn refuses_paths_outside_the_root() {
        assert!(confined("src/a.py"));
        assert!(confined("./src/a.py"));
        assert!(!confined("../a.py"));
        assert!(!confined("/etc/passwd"));
        assert!(!confined("src/../../a.py"));
        assert!(!confined(""));
    }

    #[test]
    fn counts_lines() {
        assert_eq!(line_count(b"a\nb\n"), 2);
        assert_eq!(line_count(b"a\nb"), 2);
        assert_eq!(line_count(b""), 0);
    }

    #[test]
    fn request_defaults() {
        let v = Validation::from_request(
            ValidateRequest {
                repo_path: "/r".into(),
                ..ValidateRequest::default()
            },
            None,
        )
        .expect("valid");
        assert_eq!(v.git_ref, "HEAD");
        assert_eq!(v.base_ref, None);
        assert_eq!(v.timeout, DEFAULT_VERIFICATION_TIMEOUT);
        assert!(
            Validation::from_request(
                ValidateRequest {
                    repo_path: "r".into(),
                    ..ValidateRequest::default()
                },
                None
            )
            .is_err()
        );
    }
}
