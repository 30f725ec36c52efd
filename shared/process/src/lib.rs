//! Child processes for troupe, run the one safe way: an argv vector (never a shell command
//! line), in its own process group, with an allow-listed environment, optional stdin bytes,
//! a wall-clock timeout, an idle timeout and a cancellation token.
//!
//! When a run ends early (timeout, idle timeout, cancel, or the future being dropped) the whole
//! process group gets SIGTERM, then SIGKILL after a short grace, so grandchildren that an agent
//! started in the background die with it. Output is captured concurrently and only its tail is
//! kept, so a chatty child cannot exhaust memory.
//!
//! Children also die with the process that started them, however it dies (SIGKILL included):
//! every live group is registered with a reaper, a small `/bin/sh` process per process that
//! holds the read end of a pipe whose write end only we hold (close-on-exec), and SIGKILLs
//! every registered group when that pipe reports end-of-file. `PR_SET_PDEATHSIG` is not used:
//! it reaches only the direct child, not an agent's grandchildren, and fires when the spawning
//! *thread* exits, which a tokio blocking-pool thread does after 10 s idle. A service also calls
//! [`supervise_children`] at boot with a directory of its own: while a group lives it is
//! recorded there (`<pgid>` holding the leader's start time and session, the boot id, and the
//! starting process's pid and start time), and the next boot kills whatever a dead run left
//! alive when even the reaper could not act, without ever touching a process that merely
//! reused the pid, or the children of a live process that shares the directory.
//!
//! [`command_line_to_argv`] turns a plan author's command string into an argv vector, falling
//! back to `sh -c <line>` verbatim only when the line uses shell syntax.

mod argv;
mod children;
mod proc;
mod reaper;
pub mod sandbox;

use std::collections::BTreeMap;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

pub use argv::command_line_to_argv;
pub use children::{KilledGroup, supervise_children};
pub use sandbox::{Mode as SandboxMode, Sandbox};

/// Variables a child inherits from our environment by default; everything else must be given
/// explicitly (so API keys and tokens reach only the children that need them).
pub const DEFAULT_ENV_ALLOWLIST: &[&str] = &[
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ",
    "TERM",
];

/// Output kept per stream unless [`Command::max_output_bytes`] says otherwise.
pub const DEFAULT_MAX_OUTPUT_BYTES: usize = 1024 * 1024;

/// Time between SIGTERM and SIGKILL unless [`Command::kill_grace`] says otherwise.
pub const DEFAULT_KILL_GRACE: Duration = Duration::from_secs(2);

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The program is not installed (not on `PATH`, or the path does not exist).
    #[error("program `{program}` not found")]
    NotFound {
        /// The program as given.
        program: String,
    },
    /// The working directory does not exist or is not a directory.
    #[error("working directory {} does not exist", path.display())]
    WorkingDir {
        /// The directory as given.
        path: PathBuf,
    },
    /// The program exists but could not be started (permissions, exec format, limits).
    #[error("cannot start `{program}`: {source}")]
    Spawn {
        /// The program as given.
        program: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Waiting for or signalling the child failed.
    #[error("process i/o: {0}")]
    Io(#[from] io::Error),
    /// An empty argv vector or command line.
    #[error("empty command")]
    EmptyCommand,
    /// A command line that cannot be split (unterminated quote, trailing backslash).
    #[error("cannot parse command line: {0}")]
    Parse(String),
    /// The directory recording live child groups cannot be created or read.
    #[error("child records in {}: {source}", path.display())]
    Records {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The reaper that kills children when this process dies cannot be started.
    #[error("cannot start the child reaper (/bin/sh): {0}")]
    Reaper(#[source] io::Error),
    /// `sandbox = "enforce"` and the kernel cannot confine the child (no Landlock, or no TCP
    /// rules when ports are restricted): the child was not started.
    #[error(
        "cannot confine the child (sandbox = \"enforce\"): {reason}; set sandbox = \"warn\" or \"off\" to run unconfined"
    )]
    SandboxUnavailable {
        /// What the kernel or the ruleset refused.
        reason: String,
    },
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Termination {
    /// The child exited (or was killed by a signal someone else sent).
    Exited,
    /// The wall-clock timeout fired and the group was killed.
    TimedOut,
    /// No output arrived for the idle timeout and the group was killed.
    IdleTimedOut,
    /// The cancellation token fired and the group was killed.
    Cancelled,
}

/// What a finished child left behind.
#[derive(Debug, Clone)]
pub struct Output {
    /// Exit code, when the child exited normally.
    pub exit_code: Option<i32>,
    /// Signal that ended the child, when it was killed.
    pub signal: Option<i32>,
    /// The last bytes of stdout (at most the configured maximum).
    pub stdout: Vec<u8>,
    /// The last bytes of stderr (at most the configured maximum).
    pub stderr: Vec<u8>,
    /// Whether stdout was longer than what is kept.
    pub stdout_truncated: bool,
    /// Whether stderr was longer than what is kept.
    pub stderr_truncated: bool,
    /// Wall time from spawn to reap.
    pub duration: Duration,
    /// Why the run ended.
    pub termination: Termination,
}

impl Output {
    /// True when the child exited on its own with code 0.
    pub fn success(&self) -> bool {
        self.termination == Termination::Exited && self.exit_code == Some(0)
    }

    /// Stdout as text (invalid UTF-8 replaced).
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// Stderr as text (invalid UTF-8 replaced).
    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

/// The last `max_lines` lines of `text`, further cut to at most `max_chars` characters
/// (from the end), for error details and reports.
pub fn tail(text: &str, max_lines: usize, max_chars: usize) -> String {
    let trimmed = text.trim_end();
    let start = trimmed
        .rmatch_indices('\n')
        .nth(max_lines.saturating_sub(1))
        .map_or(0, |(i, _)| i + 1);
    let lines = &trimmed[start..];
    let count = lines.chars().count();
    if count <= max_chars {
        lines.to_owned()
    } else {
        lines.chars().skip(count - max_chars).collect()
    }
}

/// A child process to run: program, arguments and the limits it runs under.
#[derive(Debug, Clone)]
pub struct Command {
    program: String,
    args: Vec<String>,
    cwd: Option<PathBuf>,
    env: BTreeMap<String, String>,
    passthrough: Vec<String>,
    inherit_env: bool,
    stdin: Option<Vec<u8>>,
    timeout: Option<Duration>,
    idle_timeout: Option<Duration>,
    max_output_bytes: usize,
    kill_grace: Duration,
    sandbox: Option<Sandbox>,
    stdout_lines: Option<LineObserver>,
}

/// Called with each complete line of a child's stdout as it arrives (without the newline), for
/// callers that follow a long run (an agent CLI's JSON events); the output is still collected.
#[derive(Clone)]
pub struct LineObserver(Arc<dyn Fn(&str) + Send + Sync>);

impl LineObserver {
    /// An observer calling `f` with each line.
    pub fn new(f: impl Fn(&str) + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }
}

impl std::fmt::Debug for LineObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LineObserver")
    }
}

/// Longest line an observer is given; a longer one is cut (its tail is not passed on).
const MAX_OBSERVED_LINE: usize = 1024 * 1024;

impl Command {
    /// A command running `program` with no arguments.
    pub fn new(program: impl Into<String>) -> Self {
        Self {
            program: program.into(),
            args: Vec::new(),
            cwd: None,
            env: BTreeMap::new(),
            passthrough: Vec::new(),
            inherit_env: false,
            stdin: None,
            timeout: None,
            idle_timeout: None,
            max_output_bytes: DEFAULT_MAX_OUTPUT_BYTES,
            kill_grace: DEFAULT_KILL_GRACE,
            sandbox: None,
            stdout_lines: None,
        }
    }

    /// A command from an argv vector: the first element is the program.
    pub fn from_argv<S: AsRef<str>>(argv: &[S]) -> Result<Self, Error> {
        let (program, args) = argv.split_first().ok_or(Error::EmptyCommand)?;
        if program.as_ref().is_empty() {
            return Err(Error::EmptyCommand);
        }
        Ok(Self::new(program.as_ref()).args(args.iter().map(AsRef::as_ref)))
    }

    /// Appends one argument.
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Appends arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Working directory of the child.
    pub fn cwd(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cwd = Some(dir.into());
        self
    }

    /// Sets one environment variable for the child (wins over inherited values).
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    /// Sets several environment variables for the child.
    pub fn envs<I, K, V>(mut self, vars: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        self.env
            .extend(vars.into_iter().map(|(k, v)| (k.into(), v.into())));
        self
    }

    /// Also passes our value of `key` through, when we have one (on top of
    /// [`DEFAULT_ENV_ALLOWLIST`]).
    pub fn env_passthrough(mut self, key: impl Into<String>) -> Self {
        self.passthrough.push(key.into());
        self
    }

    /// Inherits our whole environment instead of the allow-list.
    pub fn inherit_env(mut self, inherit: bool) -> Self {
        self.inherit_env = inherit;
        self
    }

    /// Bytes written to the child's stdin, which is then closed. Without this, stdin is
    /// `/dev/null`.
    pub fn stdin(mut self, bytes: impl Into<Vec<u8>>) -> Self {
        self.stdin = Some(bytes.into());
        self
    }

    /// Wall-clock limit.
    pub fn timeout(mut self, limit: Duration) -> Self {
        self.timeout = Some(limit);
        self
    }

    /// Kills the child when neither stdout nor stderr produced anything for this long.
    pub fn idle_timeout(mut self, limit: Duration) -> Self {
        self.idle_timeout = Some(limit);
        self
    }

    /// Bytes of each stream to keep (the tail).
    pub fn max_output_bytes(mut self, bytes: usize) -> Self {
        self.max_output_bytes = bytes;
        self
    }

    /// Time between SIGTERM and SIGKILL when the group is stopped.
    pub fn kill_grace(mut self, grace: Duration) -> Self {
        self.kill_grace = grace;
        self
    }

    /// Calls `observer` with each line of stdout as it arrives.
    pub fn on_stdout_line(mut self, observer: LineObserver) -> Self {
        self.stdout_lines = Some(observer);
        self
    }

    /// Confines the child with Landlock (see [`sandbox`]).
    pub fn sandbox(mut self, sandbox: Sandbox) -> Self {
        self.sandbox = Some(sandbox);
        self
    }

    /// The PATH the child will see.
    fn child_path(&self) -> Option<String> {
        // PATH is always allow-listed.
        self.env
            .get("PATH")
            .cloned()
            .or_else(|| std::env::var("PATH").ok())
    }

    /// The working directory given with [`Command::cwd`].
    pub fn working_dir(&self) -> Option<&Path> {
        self.cwd.as_deref()
    }

    /// The program this command runs.
    pub fn program(&self) -> &str {
        &self.program
    }

    /// The full argv, program first (for logs and reports).
    pub fn argv(&self) -> Vec<String> {
        std::iter::once(self.program.clone())
            .chain(self.args.iter().cloned())
            .collect()
    }

    /// The program as the child's `PATH` finds it in an absolute directory (else as given).
    /// With a bare name and an environment of its own, the standard library searches the
    /// child's `PATH` itself, in a `fork`ed child: that copies this process's page tables, so
    /// every spawn costs more the more memory the service holds (a coordinator holding copies
    /// of 1,000 sessions took 15 ms more to create each, all of it in its `git` spawns). With a
    /// path it uses `posix_spawn`, a `vfork`, whose cost does not grow with this process.
    fn resolved_program(&self) -> PathBuf {
        let bare = PathBuf::from(&self.program);
        if self.program.contains('/') {
            return bare;
        }
        let Some(path) = self.child_path() else {
            return bare;
        };
        std::env::split_paths(&path)
            .filter(|dir| dir.is_absolute())
            .map(|dir| dir.join(&self.program))
            .find(|candidate| {
                use std::os::unix::fs::PermissionsExt as _;
                std::fs::metadata(candidate)
                    .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
            })
            .unwrap_or(bare)
    }

    fn build(&self) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(self.resolved_program());
        // The name it was given stays its `argv[0]` (a shell names itself by it in messages).
        cmd.arg0(&self.program);
        cmd.args(&self.args);
        if !self.inherit_env {
            cmd.env_clear();
            let names = DEFAULT_ENV_ALLOWLIST
                .iter()
                .copied()
                .chain(self.passthrough.iter().map(String::as_str));
            for name in names {
                if let Some(value) = std::env::var_os(name) {
                    cmd.env(name, value);
                }
            }
        }
        cmd.envs(&self.env);
        if let Some(dir) = &self.cwd {
            cmd.current_dir(dir);
        }
        cmd.stdin(if self.stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        // Last resort only: the group guard below is what takes grandchildren down.
        .kill_on_drop(true);
        cmd
    }

    /// Runs the child to completion, a timeout, or `cancel`.
    ///
    /// A child that exits non-zero is not an error: look at [`Output`]. Errors are only about
    /// starting and supervising the child.
    #[tracing::instrument(skip_all, fields(program = %self.program))]
    pub async fn run(mut self, cancel: &CancellationToken) -> Result<Output, Error> {
        if let Some(dir) = &self.cwd
            && !dir.is_dir()
        {
            return Err(Error::WorkingDir { path: dir.clone() });
        }
        if let Some(home) = self
            .sandbox
            .as_ref()
            .filter(|sandbox| sandbox.mode() != SandboxMode::Off)
            .and_then(|sandbox| sandbox.home_dir())
            .map(Path::to_path_buf)
        {
            let tmp = home.join("tmp");
            tokio::fs::create_dir_all(&tmp).await?;
            self.env
                .entry("HOME".to_owned())
                .or_insert_with(|| home.display().to_string());
            self.env
                .entry("TMPDIR".to_owned())
                .or_insert_with(|| tmp.display().to_string());
        }
        let spawned = match &self.sandbox {
            Some(sandbox) => sandbox::spawn(sandbox, self.build(), self.child_path())?,
            None => self.build().spawn(),
        };
        let mut child = spawned.map_err(|source| match source.kind() {
            io::ErrorKind::NotFound => Error::NotFound {
                program: self.program.clone(),
            },
            _ => Error::Spawn {
                program: self.program.clone(),
                source,
            },
        })?;
        let started = Instant::now();
        let pgid = child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .map(Pid::from_raw)
            .ok_or_else(|| io::Error::other("spawned child has no pid"))?;
        let mut guard = GroupGuard {
            pgid,
            grace: self.kill_grace,
            registration: Some(children::register(pgid, &self.program)),
        };

        if let (Some(bytes), Some(mut stdin)) = (self.stdin, child.stdin.take()) {
            tokio::spawn(async move {
                // A child that never reads stdin closes the pipe: that is its business, not an error.
                match stdin.write_all(&bytes).await {
                    Ok(()) => {}
                    Err(err) if err.kind() == io::ErrorKind::BrokenPipe => {}
                    Err(err) => debug!(error = %err, "writing child stdin failed"),
                }
                drop(stdin);
            });
        }

        let last_output = Arc::new(AtomicU64::new(0));
        let max = self.max_output_bytes;
        let observer = self.stdout_lines.take();
        let stdout = child.stdout.take().map(|out| {
            tokio::spawn(read_tail(
                out,
                max,
                Arc::clone(&last_output),
                started,
                observer,
            ))
        });
        let stderr = child
            .stderr
            .take()
            .map(|err| tokio::spawn(read_tail(err, max, Arc::clone(&last_output), started, None)));

        let wall = async {
            match self.timeout {
                Some(limit) => tokio::time::sleep_until(started + limit).await,
                None => std::future::pending().await,
            }
        };
        let idle = async {
            let Some(limit) = self.idle_timeout else {
                return std::future::pending().await;
            };
            loop {
                let last = Duration::from_millis(last_output.load(Ordering::Relaxed));
                let due = started + last + limit;
                if Instant::now() >= due {
                    return;
                }
                tokio::time::sleep_until(due).await;
            }
        };

        let (status, termination) = tokio::select! {
            status = child.wait() => (status?, Termination::Exited),
            () = wall => (stop_group(&mut child, pgid, self.kill_grace).await?, Termination::TimedOut),
            () = idle => (stop_group(&mut child, pgid, self.kill_grace).await?, Termination::IdleTimedOut),
            () = cancel.cancelled() => (stop_group(&mut child, pgid, self.kill_grace).await?, Termination::Cancelled),
        };
        if termination == Termination::Exited {
            // The leader is gone; anything it left running in its group goes too.
            reap_stragglers(pgid, self.kill_grace).await;
        }
        if let Some(registration) = guard.registration.take() {
            registration.end();
        }

        // A grandchild that escaped the group (setsid) may still hold the pipes open; do not
        // wait for it forever.
        let drain = self.kill_grace + Duration::from_secs(1);
        let stdout = collect(stdout, drain).await;
        let stderr = collect(stderr, drain).await;
        let duration = started.elapsed();
        debug!(?termination, code = ?status.code(), signal = ?status.signal(), ?duration, "child finished");

        Ok(Output {
            exit_code: status.code(),
            signal: status.signal(),
            stdout_truncated: stdout.truncated(),
            stderr_truncated: stderr.truncated(),
            stdout: stdout.into_bytes(),
            stderr: stderr.into_bytes(),
            duration,
            termination,
        })
    }
}

/// Kills the group if `run` is dropped before the child was reaped (the caller's task was
/// aborted or its future dropped).
struct GroupGuard {
    pgid: Pid,
    grace: Duration,
    /// Taken once the group is dead; dropping it kills the group (with SIGKILL) first.
    registration: Option<children::Registration>,
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        let Some(registration) = self.registration.take() else {
            return;
        };
        signal_group(self.pgid, Signal::SIGTERM);
        let grace = self.grace;
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                // If the runtime shuts down before the grace is over, the task is dropped
                // unrun and the registration still SIGKILLs the group.
                handle.spawn(async move {
                    tokio::time::sleep(grace).await;
                    drop(registration);
                });
            }
            Err(_) => drop(registration),
        }
    }
}

/// Sends `signal` to the group; a group that no longer exists is fine.
pub(crate) fn signal_group(pgid: Pid, signal: Signal) -> bool {
    match killpg(pgid, signal) {
        Ok(()) => true,
        Err(Errno::ESRCH) => false,
        Err(err) => {
            warn!(pgid = pgid.as_raw(), %signal, error = %err, "signalling process group failed");
            false
        }
    }
}

/// Whether any process (possibly a zombie) is still in the group.
fn group_alive(pgid: Pid) -> bool {
    matches!(killpg(pgid, None), Ok(()) | Err(Errno::EPERM))
}

/// SIGTERM to the group, SIGKILL after `grace`, and reap the leader.
async fn stop_group(
    child: &mut tokio::process::Child,
    pgid: Pid,
    grace: Duration,
) -> Result<ExitStatus, Error> {
    signal_group(pgid, Signal::SIGTERM);
    let status = match tokio::time::timeout(grace, child.wait()).await {
        Ok(status) => status?,
        Err(_) => {
            signal_group(pgid, Signal::SIGKILL);
            child.wait().await?
        }
    };
    // Members that ignored SIGTERM have had their grace (or the leader went down early and
    // took none): kill whatever is left.
    signal_group(pgid, Signal::SIGKILL);
    Ok(status)
}

/// After the leader exited on its own: SIGTERM what is left of the group, SIGKILL after
/// `grace`.
async fn reap_stragglers(pgid: Pid, grace: Duration) {
    if !signal_group(pgid, Signal::SIGTERM) {
        return;
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if !group_alive(pgid) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    signal_group(pgid, Signal::SIGKILL);
}

/// Keeps the last `max` bytes of a stream.
#[derive(Debug, Default)]
struct TailBuffer {
    buf: Vec<u8>,
    max: usize,
    total: u64,
}

impl TailBuffer {
    fn new(max: usize) -> Self {
        Self {
            buf: Vec::new(),
            max,
            total: 0,
        }
    }

    fn push(&mut self, chunk: &[u8]) {
        self.total += chunk.len() as u64;
        self.buf.extend_from_slice(chunk);
        // Trim in batches so a long stream costs amortised O(1) per byte.
        if self.buf.len() > self.max.saturating_mul(2).max(8192) {
            self.trim();
        }
    }

    fn trim(&mut self) {
        if self.buf.len() > self.max {
            let excess = self.buf.len() - self.max;
            self.buf.drain(..excess);
        }
    }

    fn truncated(&self) -> bool {
        self.total > self.max as u64
    }

    fn into_bytes(mut self) -> Vec<u8> {
        self.trim();
        self.buf
    }
}

async fn read_tail<R: AsyncRead + Unpin>(
    mut reader: R,
    max: usize,
    last_output: Arc<AtomicU64>,
    started: Instant,
    observer: Option<LineObserver>,
) -> TailBuffer {
    let mut tail = TailBuffer::new(max);
    let mut chunk = vec![0u8; 16 * 1024];
    let mut line: Vec<u8> = Vec::new();
    loop {
        match reader.read(&mut chunk).await {
            Ok(0) => break,
            Ok(n) => {
                let elapsed = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
                last_output.store(elapsed, Ordering::Relaxed);
                tail.push(&chunk[..n]);
                if let Some(observer) = &observer {
                    for piece in chunk[..n].split_inclusive(|b| *b == b'\n') {
                        if line.len() < MAX_OBSERVED_LINE {
                            let room = MAX_OBSERVED_LINE - line.len();
                            line.extend_from_slice(&piece[..piece.len().min(room)]);
                        }
                        if piece.ends_with(b"\n") {
                            (observer.0)(String::from_utf8_lossy(&line).trim_end());
                            line.clear();
                        }
                    }
                }
            }
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => {
                debug!(error = %err, "reading child output failed");
                break;
            }
        }
    }
    if let Some(observer) = &observer
        && !line.is_empty()
    {
        (observer.0)(String::from_utf8_lossy(&line).trim_end());
    }
    tail
}

async fn collect(task: Option<tokio::task::JoinHandle<TailBuffer>>, limit: Duration) -> TailBuffer {
    let Some(mut task) = task else {
        return TailBuffer::default();
    };
    match tokio::time::timeout(limit, &mut task).await {
        Ok(Ok(tail)) => tail,
        Ok(Err(err)) => {
            warn!(error = %err, "output reader task failed");
            TailBuffer::default()
        }
        Err(_) => {
            warn!("child output still open after the process group ended; giving up on it");
            task.abort();
            TailBuffer::default()
        }
    }
}

/// Resolves `program` against `PATH` the way a spawn would, for probes that want to say
/// "not installed" without running anything.
pub fn which(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        let path = Path::new(program);
        return path.is_file().then(|| path.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        Command::new("sh").arg("-c").arg(script)
    }

    async fn run(cmd: Command) -> Output {
        cmd.run(&CancellationToken::new()).await.expect("runs")
    }

    /// A bare program name is looked up in the child's `PATH` (absolute directories, files
    /// that may be executed), so the child is started with `posix_spawn`; what is not found
    /// stays a bare name and fails to start as before.
    #[tokio::test]
    async fn a_bare_program_is_found_in_the_child_s_path() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let tool = dir.path().join("troupe-probe-tool");
        std::fs::write(&tool, "#!/bin/sh\necho found\n").unwrap();
        let not_executable = dir.path().join("troupe-probe-data");
        std::fs::write(&not_executable, "").unwrap();
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = format!("relative:{}:/usr/bin:/bin", dir.path().display());
        let cmd = Command::new("troupe-probe-tool").env("PATH", &path);
        assert_eq!(cmd.resolved_program(), tool);
        assert_eq!(run(cmd).await.stdout, b"found\n");
        let data = Command::new("troupe-probe-data").env("PATH", &path);
        assert_eq!(data.resolved_program(), PathBuf::from("troupe-probe-data"));
        let missing = Command::new("troupe-no-such-program-xyz").env("PATH", &path);
        assert!(matches!(
            missing.run(&CancellationToken::new()).await,
            Err(Error::NotFound { .. })
        ));
        assert!(Command::new("sh").resolved_program().is_absolute());
    }

    /// Alive means present and not a zombie (PID 1 here may not reap orphans).
    fn process_alive(pid: i32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(stat) => {
                let state = stat
                    .rsplit(')')
                    .next()
                    .and_then(|rest| rest.split_whitespace().next());
                state != Some("Z")
            }
            Err(_) => false,
        }
    }

    /// Waits (bounded) for `pid` to die: SIGKILL is delivered asynchronously, so a process can
    /// still look alive for a moment after `run` returned.
    async fn assert_dies(pid: i32) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while process_alive(pid) {
            assert!(
                std::time::Instant::now() < deadline,
                "process {pid} survived"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn captures_exit_code_and_both_streams() {
        let out = run(sh("echo out; echo err >&2; exit 3")).await;
        assert_eq!(out.termination, Termination::Exited);
        assert_eq!(out.exit_code, Some(3));
        assert_eq!(out.signal, None);
        assert_eq!(out.stdout_text(), "out\n");
        assert_eq!(out.stderr_text(), "err\n");
        assert!(!out.success());
    }

    #[tokio::test]
    async fn a_stdout_observer_sees_each_line_as_it_comes() {
        let seen = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let sink = Arc::clone(&seen);
        // The first line is seen while the child still sleeps; a last line without its
        // newline is passed on at the end; stderr is not observed.
        let cmd = sh("echo one; printf 'tw'; printf 'o\\n'; echo err >&2; sleep 2; printf three")
            .on_stdout_line(LineObserver::new(move |line| {
                sink.lock().unwrap().push(line.to_owned());
            }));
        let running = tokio::spawn(run(cmd));
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        while seen.lock().unwrap().len() < 2 {
            assert!(std::time::Instant::now() < deadline, "lines not seen early");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let out = running.await.unwrap();
        assert_eq!(*seen.lock().unwrap(), ["one", "two", "three"]);
        assert_eq!(out.stdout_text(), "one\ntwo\nthree");
    }

    #[tokio::test]
    async fn passes_args_verbatim_without_a_shell() {
        let out = run(Command::new("printf").args(["%s|", "a b", "$HOME", "`x`"])).await;
        assert!(out.success());
        assert_eq!(out.stdout_text(), "a b|$HOME|`x`|");
    }

    #[tokio::test]
    async fn writes_stdin_and_tolerates_children_that_ignore_it() {
        let out = run(Command::new("cat").stdin("hello")).await;
        assert_eq!(out.stdout_text(), "hello");

        // 4 MiB into a child that exits at once: EPIPE must not surface.
        let out = run(Command::new("true").stdin(vec![b'x'; 4 << 20])).await;
        assert!(out.success());
    }

    #[tokio::test]
    async fn environment_is_allow_listed() {
        // set_var is unsafe in edition 2024; use a variable the test runner already sets.
        assert!(std::env::var_os("CARGO_PKG_NAME").is_some());
        let out = run(Command::new("env").env("TROUPE_X", "1")).await;
        let text = out.stdout_text();
        assert!(text.contains("TROUPE_X=1"));
        assert!(!text.contains("CARGO_PKG_NAME="), "{text}");
        assert!(text.contains("PATH="));

        let out = run(Command::new("env").env_passthrough("CARGO_PKG_NAME")).await;
        assert!(out.stdout_text().contains("CARGO_PKG_NAME=troupe-process"));

        let out = run(Command::new("env").inherit_env(true)).await;
        assert!(out.stdout_text().contains("CARGO_PKG_NAME="));
    }

    #[tokio::test]
    async fn runs_in_the_given_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = run(Command::new("pwd").cwd(dir.path())).await;
        let expected = dir.path().canonicalize().expect("canonical");
        assert_eq!(out.stdout_text().trim(), expected.to_str().expect("utf-8"));

        let err = Command::new("pwd")
            .cwd(dir.path().join("missing"))
            .run(&CancellationToken::new())
            .await
            .expect_err("missing cwd");
        assert!(matches!(err, Error::WorkingDir { .. }), "{err}");
    }

    #[tokio::test]
    async fn missing_program_is_not_found() {
        let err = Command::new("troupe-no-such-program-xyz")
            .run(&CancellationToken::new())
            .await
            .expect_err("not installed");
        assert!(
            matches!(err, Error::NotFound { ref program } if program == "troupe-no-such-program-xyz")
        );
        assert!(matches!(
            Command::from_argv::<&str>(&[]),
            Err(Error::EmptyCommand)
        ));
    }

    #[tokio::test]
    async fn timeout_kills_the_whole_group() {
        // The grandchild ignores SIGTERM, so only the SIGKILL after the grace stops it.
        let cmd = sh("(trap '' TERM; exec sleep 1000) & echo $!; wait")
            .timeout(Duration::from_millis(300))
            .kill_grace(Duration::from_millis(200));
        let out = run(cmd).await;
        assert_eq!(out.termination, Termination::TimedOut);
        assert!(out.signal.is_some() || out.exit_code.is_some());
        let pid: i32 = out.stdout_text().trim().parse().expect("grandchild pid");
        assert_dies(pid).await;
        assert!(out.duration < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn normal_exit_still_kills_background_leftovers() {
        let out = run(sh("sleep 1000 & echo $!").kill_grace(Duration::from_millis(200))).await;
        assert_eq!(out.termination, Termination::Exited);
        assert_eq!(out.exit_code, Some(0));
        let pid: i32 = out.stdout_text().trim().parse().expect("grandchild pid");
        assert_dies(pid).await;
    }

    #[tokio::test]
    async fn idle_timeout_fires_without_output_only() {
        let out = run(sh("echo start; sleep 1000").idle_timeout(Duration::from_millis(300))).await;
        assert_eq!(out.termination, Termination::IdleTimedOut);
        assert_eq!(out.stdout_text(), "start\n");

        // Steady output keeps an idle timeout from firing.
        let cmd = sh("for i in 1 2 3 4 5 6; do echo $i; sleep 0.1; done")
            .idle_timeout(Duration::from_millis(600));
        let out = run(cmd).await;
        assert_eq!(out.termination, Termination::Exited);
        assert!(out.success());
    }

    #[tokio::test]
    async fn cancel_kills_the_child() {
        let cancel = CancellationToken::new();
        let trigger = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            trigger.cancel();
        });
        let out = sh("sleep 1000").run(&cancel).await.expect("runs");
        assert_eq!(out.termination, Termination::Cancelled);
        assert_eq!(out.signal, Some(Signal::SIGTERM as i32));
    }

    #[tokio::test]
    async fn dropping_the_future_kills_the_group() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pid_file = dir.path().join("pid");
        let script = format!("sleep 1000 & echo $! > {}; wait", pid_file.display());
        let cmd = sh(&script).kill_grace(Duration::from_millis(100));
        let cancel = CancellationToken::new();
        let handle = tokio::spawn(async move { cmd.run(&cancel).await });
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let pid: i32 = loop {
            if let Some(pid) = std::fs::read_to_string(&pid_file)
                .ok()
                .and_then(|s| s.trim().parse().ok())
            {
                break pid;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "child never wrote its pid"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        handle.abort();
        assert_dies(pid).await;
    }

    #[tokio::test]
    async fn keeps_only_the_tail_of_long_output() {
        let out = run(sh("seq 1 100000").max_output_bytes(100)).await;
        assert!(out.stdout_truncated);
        assert_eq!(out.stdout.len(), 100);
        assert!(out.stdout_text().ends_with("99999\n100000\n"));
        assert!(!out.stderr_truncated);
    }

    #[test]
    fn tail_keeps_last_lines_and_chars() {
        assert_eq!(tail("a\nb\nc\n", 2, 100), "b\nc");
        assert_eq!(tail("a\nb\nc", 5, 100), "a\nb\nc");
        assert_eq!(tail("abcdef", 5, 3), "def");
        assert_eq!(tail("", 5, 3), "");
    }

    #[test]
    fn which_finds_installed_programs() {
        assert!(which("sh").is_some());
        assert!(which("troupe-no-such-program-xyz").is_none());
    }
}
