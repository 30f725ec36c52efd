//! Landlock confinement for children that run agent-written or plan-supplied code.
//!
//! A [`Sandbox`] is an allow-list: the child may read and execute the system paths and the
//! directories its `PATH` names, read and write its own worktree, home and temporary
//! directory, and nothing else. With connect ports given, it may open TCP connections to those
//! ports only (Landlock ABI 4). With ABI 6 it cannot signal processes outside its sandbox or
//! reach abstract unix sockets created outside it.
//!
//! The workspace forbids `unsafe`, so there is no `pre_exec` hook. Landlock confines the
//! calling *thread* and whatever it forks, so [`spawn`] creates a fresh thread, confines it,
//! spawns the child from it, and lets the thread end: the service's own threads stay free.
//!
//! Landlock answers a denied access with `EACCES`/`EPERM` and says nothing more, so
//! [`Sandbox::denied`] attributes a failure to the sandbox only when the child's output names
//! a path (or a `/dev/tcp/<host>/<port>` connection) next to "Permission denied" or "Operation
//! not permitted" that the ruleset does not grant.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Component, Path, PathBuf};
use std::str::FromStr;

use landlock::{
    ABI, Access, AccessFs, AccessNet, BitFlags, CompatLevel, Compatible, NetPort, PathBeneath,
    PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope,
};
use tracing::warn;

use crate::Error;

/// The Landlock ABI whose features we ask for; newer kernels enforce all of them, older ones
/// what they can (see [`Mode::Enforce`] for what is required).
const TARGET_ABI: ABI = ABI::V6;

/// Read and execute, never write: the system's programs, libraries and configuration.
const SYSTEM_READ: &[&str] = &[
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc",
    "/opt",
    "/proc",
    "/sys",
    "/run/systemd/resolve",
];

/// Device files a program may open for reading and writing. The rest of `/dev` (disks above
/// all: a root child could read the data dir's blocks) stays closed.
const DEVICES: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
    "/dev/ptmx",
    "/dev/pts",
    "/dev/shm",
];

/// How strictly a child is confined.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Mode {
    /// Confined; a kernel without Landlock (or without TCP rules when ports are configured)
    /// refuses to start the child.
    #[default]
    Enforce,
    /// Confined where the kernel can; otherwise runs unconfined and logs a warning.
    Warn,
    /// Not confined.
    Off,
}

impl Mode {
    /// The stricter of two modes (`enforce` > `warn` > `off`): a plan may tighten what the
    /// service allows, never loosen it.
    pub fn strictest(self, other: Self) -> Self {
        fn rank(mode: Mode) -> u8 {
            match mode {
                Mode::Off => 0,
                Mode::Warn => 1,
                Mode::Enforce => 2,
            }
        }
        if rank(other) > rank(self) {
            other
        } else {
            self
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Enforce => "enforce",
            Self::Warn => "warn",
            Self::Off => "off",
        })
    }
}

impl FromStr for Mode {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim().to_ascii_lowercase().as_str() {
            "enforce" => Ok(Self::Enforce),
            "warn" => Ok(Self::Warn),
            "off" => Ok(Self::Off),
            other => Err(format!(
                "unknown sandbox mode `{other}` (expected enforce, warn or off)"
            )),
        }
    }
}

/// The ruleset one child runs under. The default is [`Sandbox::off`]: a service builds its
/// base from [`SandboxArgs::base`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sandbox {
    mode: Mode,
    read: Vec<PathBuf>,
    write: Vec<PathBuf>,
    connect_ports: Option<BTreeSet<u16>>,
    protected: Vec<PathBuf>,
    home: Option<PathBuf>,
}

impl Default for Sandbox {
    fn default() -> Self {
        Self::off()
    }
}

impl Sandbox {
    /// A sandbox in `mode` granting the system paths only; add the child's own paths with
    /// [`Sandbox::write`] and [`Sandbox::read`]. The service's `$HOME` is protected (see
    /// [`Sandbox::protect`]).
    pub fn new(mode: Mode) -> Self {
        let mut sandbox = Self {
            mode,
            ..Self::off()
        };
        if let Some(home) = std::env::var_os("HOME").filter(|home| !home.is_empty()) {
            sandbox = sandbox.protect(home);
        }
        sandbox
    }

    /// No confinement.
    pub fn off() -> Self {
        Self {
            mode: Mode::Off,
            read: Vec::new(),
            write: Vec::new(),
            connect_ports: None,
            protected: Vec::new(),
            home: None,
        }
    }

    /// The mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Tightens the mode (never loosens it).
    pub fn tighten(mut self, mode: Mode) -> Self {
        self.mode = self.mode.strictest(mode);
        self
    }

    /// Replaces the mode (the service's per-backend setting).
    pub fn with_mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Grants read and execute beneath `path`.
    pub fn read(mut self, path: impl Into<PathBuf>) -> Self {
        self.read.push(path.into());
        self
    }

    /// Grants read, write and execute beneath `path`.
    pub fn write(mut self, path: impl Into<PathBuf>) -> Self {
        self.write.push(path.into());
        self
    }

    /// The child's own home: granted read and write, created with a `tmp/` inside, and given
    /// as `HOME` and `TMPDIR` unless the command sets them itself (the service's `$HOME` is
    /// out of a confined child's reach, and programs such as git fail on an unreadable one).
    pub fn home(mut self, path: impl Into<PathBuf>) -> Self {
        let path = path.into();
        self.home = Some(path.clone());
        self.write(path)
    }

    /// The home given with [`Sandbox::home`].
    pub fn home_dir(&self) -> Option<&Path> {
        self.home.as_deref()
    }

    /// Restricts TCP connections to these ports (`None`: not restricted).
    pub fn connect_ports(mut self, ports: Option<impl IntoIterator<Item = u16>>) -> Self {
        self.connect_ports = ports.map(|ports| ports.into_iter().collect());
        self
    }

    /// Allows one more TCP port, when connections are restricted at all.
    pub fn allow_port(mut self, port: u16) -> Self {
        if let Some(ports) = &mut self.connect_ports {
            ports.insert(port);
        }
        self
    }

    /// A path no grant may cover whole: any granted path that is `path` itself or one of its
    /// ancestors is dropped (with a warning). Grants beneath it (a worktree in the data dir)
    /// are fine.
    pub fn protect(mut self, path: impl Into<PathBuf>) -> Self {
        self.protected.push(path.into());
        self
    }

    /// Grants what a git worktree at `worktree` needs besides itself: read of the repository
    /// (its common git dir) and write of the worktree's own admin dir (index, HEAD).
    pub fn git_worktree(mut self, worktree: &Path) -> Self {
        let Ok(text) = std::fs::read_to_string(worktree.join(".git")) else {
            return self;
        };
        let Some(gitdir) = text.trim().strip_prefix("gitdir:").map(str::trim) else {
            return self;
        };
        let admin = worktree.join(gitdir);
        if let Ok(common) = std::fs::read_to_string(admin.join("commondir")) {
            self = self.read(admin.join(common.trim()));
        }
        self.write(admin)
    }

    /// The paths granted read (and execute), after dropping those that cover a protected
    /// path, with each directory of `path_var` (and its parent, when it is a `bin`: the tool's
    /// prefix, where its libraries live).
    fn grants(&self, path_var: Option<&str>) -> (Vec<PathBuf>, Vec<PathBuf>) {
        let mut read: Vec<PathBuf> = SYSTEM_READ.iter().map(PathBuf::from).collect();
        read.extend(self.read.iter().cloned());
        for dir in path_var.unwrap_or_default().split(':') {
            let dir = Path::new(dir);
            if !dir.is_absolute() {
                continue;
            }
            read.push(dir.to_path_buf());
            if dir.file_name().is_some_and(|name| name == "bin")
                && let Some(prefix) = dir.parent()
            {
                read.push(prefix.to_path_buf());
            }
            // `node_modules/.bin` holds links into its packages (`bun -> ../bun/bin/bun.exe`).
            if dir.file_name().is_some_and(|name| name == ".bin")
                && let Some(modules) = dir.parent()
                && modules
                    .file_name()
                    .is_some_and(|name| name == "node_modules")
            {
                read.push(modules.to_path_buf());
            }
        }
        let keep = |path: &PathBuf| {
            let path = normalize(path);
            let covers = self
                .protected
                .iter()
                .any(|protected| normalize(protected).starts_with(&path));
            if covers {
                warn!(path = %path.display(), "sandbox: not granting a path that covers a protected one");
            }
            !covers
        };
        let read = read.into_iter().filter(keep).collect();
        let write = self.write.iter().filter(|p| keep(p)).cloned().collect();
        (read, write)
    }

    /// Confines the calling thread (and what it forks afterwards). Returns whether the
    /// ruleset is in force; `Enforce` turns "not in force" into an error.
    fn restrict_current_thread(&self, path_var: Option<&str>) -> Result<bool, Error> {
        let unavailable = |reason: String| Error::SandboxUnavailable { reason };
        let (read, write) = self.grants(path_var);
        let fs_all = AccessFs::from_all(TARGET_ABI);
        let fs_read = AccessFs::from_read(TARGET_ABI);
        let mut ruleset = Ruleset::default()
            .handle_access(fs_all)
            .map_err(|err| unavailable(err.to_string()))?;
        if let Some(_ports) = &self.connect_ports {
            let level = if self.mode == Mode::Enforce {
                CompatLevel::HardRequirement
            } else {
                CompatLevel::BestEffort
            };
            ruleset = ruleset
                .set_compatibility(level)
                .handle_access(AccessNet::from_all(TARGET_ABI))
                .map_err(|err| {
                    unavailable(format!("TCP rules need Landlock ABI 4 or newer: {err}"))
                })?
                .set_compatibility(CompatLevel::BestEffort);
        }
        let mut created = ruleset
            .scope(Scope::from_all(TARGET_ABI))
            .map_err(|err| unavailable(err.to_string()))?
            .create()
            .map_err(|err| unavailable(err.to_string()))?;
        let mut rules: Vec<(PathBuf, BitFlags<AccessFs>)> = Vec::new();
        rules.extend(read.into_iter().map(|p| (p, fs_read)));
        rules.push((PathBuf::from("/dev"), AccessFs::ReadDir.into()));
        rules.extend(DEVICES.iter().map(|p| (PathBuf::from(p), fs_all)));
        rules.extend(write.into_iter().map(|p| (p, fs_all)));
        for (path, access) in rules {
            // A granted path that does not exist (no /lib32 here) grants nothing.
            let Ok(fd) = PathFd::new(&path) else {
                continue;
            };
            let access = if path.is_dir() {
                access
            } else {
                access & AccessFs::from_file(TARGET_ABI)
            };
            created = created
                .add_rule(PathBeneath::new(fd, access))
                .map_err(|err| unavailable(format!("rule for {}: {err}", path.display())))?;
        }
        for port in self.connect_ports.iter().flatten() {
            created = created
                .add_rule(NetPort::new(*port, AccessNet::ConnectTcp))
                .map_err(|err| unavailable(format!("rule for port {port}: {err}")))?;
        }
        let status = created
            .restrict_self()
            .map_err(|err| unavailable(err.to_string()))?;
        Ok(status.ruleset != RulesetStatus::NotEnforced)
    }

    /// Whether the ruleset grants `access` on `path` (made absolute against `cwd`).
    fn grants_path(&self, path: &Path, cwd: Option<&Path>, write: bool) -> bool {
        let path = match (path.is_absolute(), cwd) {
            (true, _) => normalize(path),
            (false, Some(cwd)) => normalize(&cwd.join(path)),
            (false, None) => return true,
        };
        // Symlinks are resolved by the kernel; resolve them too, up to the deepest part that
        // exists (a file created through a linked directory lands where the link leads).
        let resolved = resolve_existing(&path);
        let path_var = std::env::var("PATH").ok();
        let (read, written) = self.grants(path_var.as_deref());
        let beneath = |roots: &[PathBuf], p: &Path| {
            roots
                .iter()
                .any(|root| p.starts_with(normalize(root)) || p.starts_with(root))
        };
        let devices: Vec<PathBuf> = DEVICES.iter().map(PathBuf::from).collect();
        [path, resolved].iter().all(|p| {
            beneath(&written, p)
                || beneath(&devices, p)
                || (!write && (beneath(&read, p) || p == Path::new("/dev")))
        })
    }

    /// The denial this child's output reports, when it names something the ruleset does not
    /// grant next to a permission error: a path (`"/etc/x: Permission denied"`,
    /// `"cannot open '/x': Operation not permitted"`) or a `/dev/tcp/<host>/<port>`
    /// connection to a port that is not allowed. `None` when nothing points at the sandbox.
    ///
    /// Each denial found counts in `troupe_sandbox_denials_total` (by `kind`: `path` or
    /// `connect`): callers ask once per failed child.
    pub fn denied(&self, output: &str, cwd: Option<&Path>) -> Option<String> {
        let denied = self.find_denial(output, cwd)?;
        let kind = if denied.starts_with("tcp port ") {
            "connect"
        } else {
            "path"
        };
        troupe_telemetry::metrics::sandbox_denials()
            .get_or_create(&troupe_telemetry::metrics::labels([("kind", kind)]))
            .inc();
        Some(denied)
    }

    fn find_denial(&self, output: &str, cwd: Option<&Path>) -> Option<String> {
        if self.mode == Mode::Off {
            return None;
        }
        for line in output.lines() {
            let lower = line.to_ascii_lowercase();
            if !(lower.contains("permission denied") || lower.contains("operation not permitted")) {
                continue;
            }
            for token in path_tokens(line) {
                if let Some(port) = tcp_port(&token) {
                    let allowed = self
                        .connect_ports
                        .as_ref()
                        .is_none_or(|ports| ports.contains(&port));
                    if !allowed {
                        return Some(format!("tcp port {port}"));
                    }
                    continue;
                }
                let path = Path::new(&token);
                // Beneath a read-only grant, only a write can have been refused by Landlock;
                // when this process (same user, unconfined) may write there, file
                // permissions did not refuse it.
                if !self.grants_path(path, cwd, false)
                    || (!self.grants_path(path, cwd, true) && writable_by_us(path, cwd))
                {
                    return Some(name_with_target(&token, cwd));
                }
            }
        }
        None
    }
}

/// A service's sandbox settings (flags and environment), the base every confined child's
/// [`Sandbox`] starts from.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct SandboxArgs {
    /// Confinement of agent-written and plan-supplied children: `enforce` (refuse to run them
    /// where the kernel has no Landlock), `warn` (confine where possible, else log a warning)
    /// or `off`.
    #[arg(long = "sandbox", env = "TROUPE_SANDBOX", default_value = "enforce")]
    pub mode: Mode,
    /// Extra paths confined children may read and execute (`:`-separated in the variable):
    /// tool prefixes outside `PATH`, shared read-only caches.
    #[arg(
        long = "sandbox-read-path",
        env = "TROUPE_SANDBOX_READ_PATHS",
        value_delimiter = ':'
    )]
    pub read_paths: Vec<PathBuf>,
    /// Extra paths confined children may write (`:`-separated): package manager caches.
    #[arg(
        long = "sandbox-write-path",
        env = "TROUPE_SANDBOX_WRITE_PATHS",
        value_delimiter = ':'
    )]
    pub write_paths: Vec<PathBuf>,
    /// TCP ports confined children may connect to (`,`-separated; the backend's model endpoint
    /// port is added). Unset: TCP is not restricted.
    #[arg(
        long = "sandbox-connect-ports",
        env = "TROUPE_SANDBOX_CONNECT_PORTS",
        value_delimiter = ','
    )]
    pub connect_ports: Option<Vec<u16>>,
}

impl Default for SandboxArgs {
    fn default() -> Self {
        Self {
            mode: Mode::Enforce,
            read_paths: Vec::new(),
            write_paths: Vec::new(),
            connect_ports: None,
        }
    }
}

impl SandboxArgs {
    /// The settings the `TROUPE_SANDBOX*` variables give (for services started in-process,
    /// without flags of their own); invalid values are errors.
    pub fn from_env() -> Result<Self, String> {
        let mut args = Self::default();
        if let Ok(mode) = std::env::var("TROUPE_SANDBOX") {
            args.mode = mode.parse()?;
        }
        let paths = |name: &str| -> Vec<PathBuf> {
            std::env::var_os(name)
                .map(|value| std::env::split_paths(&value).collect())
                .unwrap_or_default()
        };
        args.read_paths = paths("TROUPE_SANDBOX_READ_PATHS");
        args.write_paths = paths("TROUPE_SANDBOX_WRITE_PATHS");
        if let Ok(ports) = std::env::var("TROUPE_SANDBOX_CONNECT_PORTS") {
            args.connect_ports = Some(
                ports
                    .split(',')
                    .filter(|p| !p.trim().is_empty())
                    .map(|p| {
                        p.trim()
                            .parse()
                            .map_err(|_| format!("TROUPE_SANDBOX_CONNECT_PORTS: bad port `{p}`"))
                    })
                    .collect::<Result<_, _>>()?,
            );
        }
        Ok(args)
    }

    /// The base sandbox of a service whose data dir is `data_dir`: the data dir and the
    /// service's `$HOME` are protected, the extra paths granted.
    pub fn base(&self, data_dir: &Path) -> Sandbox {
        let absolute = std::path::absolute(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
        let mut sandbox = Sandbox::new(self.mode)
            .protect(absolute)
            .connect_ports(self.connect_ports.clone());
        for path in &self.read_paths {
            sandbox = sandbox.read(path);
        }
        for path in &self.write_paths {
            sandbox = sandbox.write(path);
        }
        sandbox
    }
}

/// Spawns `cmd` confined by `sandbox` (through a fresh thread: see the module docs).
pub(crate) fn spawn(
    sandbox: &Sandbox,
    mut cmd: tokio::process::Command,
    path_var: Option<String>,
) -> Result<std::io::Result<tokio::process::Child>, Error> {
    if sandbox.mode == Mode::Off {
        return Ok(cmd.spawn());
    }
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| Error::SandboxUnavailable {
        reason: "a confined child must be started inside a tokio runtime".to_owned(),
    })?;
    let sandbox = sandbox.clone();
    let spawned = std::thread::scope(|scope| {
        scope
            .spawn(move || {
                let _runtime = runtime.enter();
                match sandbox.restrict_current_thread(path_var.as_deref()) {
                    Ok(true) => {}
                    Ok(false) if sandbox.mode == Mode::Warn => {
                        warn!("sandbox: Landlock is not available here; running the child unconfined (sandbox = \"warn\")");
                    }
                    Ok(false) => {
                        return Err(Error::SandboxUnavailable {
                            reason: "this kernel does not enforce Landlock".to_owned(),
                        });
                    }
                    Err(err) if sandbox.mode == Mode::Warn => {
                        warn!(error = %err, "sandbox: cannot confine the child; running it unconfined (sandbox = \"warn\")");
                    }
                    Err(err) => return Err(err),
                }
                Ok(cmd.spawn())
            })
            .join()
    });
    spawned.unwrap_or_else(|_| {
        Err(Error::SandboxUnavailable {
            reason: "the confining thread panicked".to_owned(),
        })
    })
}

/// The Landlock ABI this kernel offers (`None`: no Landlock), found by confining a throwaway
/// thread with a ruleset that still allows everything.
pub fn landlock_abi() -> Option<i32> {
    let probe = || -> Option<i32> {
        let status = Ruleset::default()
            .handle_access(AccessFs::Execute)
            .ok()?
            .create()
            .ok()?
            .add_rule(PathBeneath::new(PathFd::new("/").ok()?, AccessFs::Execute))
            .ok()?
            .restrict_self()
            .ok()?;
        match status.landlock {
            landlock::LandlockStatus::Available {
                effective_abi,
                kernel_abi,
            } => Some(kernel_abi.unwrap_or(effective_abi as i32)),
            _ => None,
        }
    };
    std::thread::scope(|scope| scope.spawn(probe).join().ok().flatten())
}

/// What this kernel's Landlock support means for `mode` (`troupe doctor`): whether `enforce`
/// can confine children, and whether TCP port rules (needed when `connect_ports` is set) and
/// signal/socket scoping are there. `abi` is [`landlock_abi`]'s answer.
pub fn support(abi: Option<i32>, mode: Mode, ports_restricted: bool) -> String {
    let Some(abi) = abi.filter(|abi| *abi > 0) else {
        let effect = match mode {
            Mode::Enforce => {
                "`enforce` refuses to start agents, suites and checks here; use a kernel with Landlock (and a container runtime whose seccomp profile allows the landlock_* calls), or --sandbox warn or off"
            }
            Mode::Warn => "`warn` runs children unconfined here, with a warning",
            Mode::Off => "children run unconfined (sandbox off)",
        };
        return format!("sandbox: no Landlock on this kernel: {effect} (mode: {mode})");
    };
    let tcp = if abi >= 4 {
        "TCP port rules: yes"
    } else {
        "TCP port rules: no (ABI 4)"
    };
    let scoping = if abi >= 6 {
        "signal and socket scoping: yes"
    } else {
        "signal and socket scoping: no (ABI 6)"
    };
    let effect = match mode {
        Mode::Enforce if ports_restricted && abi < 4 => {
            "`enforce` refuses to start children: connect ports are set and this kernel has no TCP rules"
        }
        Mode::Enforce => "`enforce` works",
        Mode::Warn => "`warn` confines children",
        Mode::Off => "children run unconfined (sandbox off); `enforce` would work",
    };
    format!("sandbox: Landlock ABI {abi} ({tcp}; {scoping}): {effect} (mode: {mode})")
}

/// `path` with its deepest existing ancestor resolved (symlinks followed) and the rest
/// appended as it is.
fn resolve_existing(path: &Path) -> PathBuf {
    for ancestor in path.ancestors() {
        if let Ok(real) = std::fs::canonicalize(ancestor) {
            let rest = path.strip_prefix(ancestor).unwrap_or(Path::new(""));
            return if rest.as_os_str().is_empty() {
                real
            } else {
                real.join(rest)
            };
        }
    }
    path.to_path_buf()
}

/// `..` and `.` resolved lexically (no filesystem access).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// Whether this process (unconfined, same user) could write `path`: then a child's write
/// denial there came from the sandbox, not from file permissions.
fn writable_by_us(path: &Path, cwd: Option<&Path>) -> bool {
    let path = match cwd {
        Some(cwd) if path.is_relative() => cwd.join(path),
        _ => path.to_path_buf(),
    };
    let target = if path.exists() {
        path
    } else {
        match path.parent() {
            Some(parent) => parent.to_path_buf(),
            None => return false,
        }
    };
    nix::unistd::access(&target, nix::unistd::AccessFlags::W_OK).is_ok()
}

/// Path-like words of a line: quoted strings and words starting with `/`, `./` or `../`,
/// without trailing punctuation (`"/x: Permission denied"` names `/x`).
fn path_tokens(line: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    for quote in ['\'', '"', '`', '‘', '’'] {
        let parts: Vec<&str> = line.split(quote).collect();
        for index in (1..parts.len()).step_by(2) {
            let (before, part) = (parts[index - 1], parts[index]);
            let pathlike =
                part.starts_with('/') || part.starts_with("./") || part.starts_with("../");
            // A bare relative name right after the refusal: Python's `Permission denied:
            // 'x'`, Node's `EACCES: permission denied, open 'x'`.
            let lower = before.to_ascii_lowercase();
            let named = !part.is_empty()
                && !part.contains(char::is_whitespace)
                && (lower.trim_end().ends_with("denied:")
                    || (lower.contains("denied, ")
                        && lower.ends_with(' ')
                        && lower
                            .trim_end()
                            .rsplit(' ')
                            .next()
                            .is_some_and(|word| word.chars().all(|c| c.is_ascii_lowercase()))));
            if pathlike || named {
                tokens.push(part.to_owned());
            }
        }
    }
    // `prog: NAME: Permission denied` names NAME even without a slash (`cat: link: ...`).
    let segments: Vec<&str> = line.split(": ").collect();
    for pair in segments.windows(2) {
        let lower = pair[1].to_ascii_lowercase();
        let name = pair[0].trim();
        // An errno name (`EACCES: permission denied, ...`) is not a file name.
        let errno = name
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit());
        if (lower.starts_with("permission denied") || lower.starts_with("operation not permitted"))
            && !errno
            && !name.is_empty()
            && !name.contains(char::is_whitespace)
            && !tokens.iter().any(|t| t == name)
        {
            tokens.push(name.to_owned());
        }
    }
    for word in line.split(|c: char| c.is_whitespace() || c == '\'' || c == '"' || c == '`') {
        let word = word.trim_end_matches([':', ',', ';', ')', '.']);
        let word = word.trim_start_matches('(');
        if (word.starts_with('/') || word.starts_with("./") || word.starts_with("../"))
            && word.len() > 1
            && !tokens.iter().any(|t| t == word)
        {
            tokens.push(word.to_owned());
        }
    }
    tokens
}

/// `token`, and where it leads when it is a symlink (`link -> /srv/data/store.db`).
fn name_with_target(token: &str, cwd: Option<&Path>) -> String {
    let path = match cwd {
        Some(cwd) => cwd.join(token),
        None => PathBuf::from(token),
    };
    let is_link = std::fs::symlink_metadata(&path).is_ok_and(|meta| meta.file_type().is_symlink());
    match std::fs::canonicalize(&path) {
        Ok(target) if is_link => format!("{token} -> {}", target.display()),
        _ => token.to_owned(),
    }
}

/// The port of a bash `/dev/tcp/<host>/<port>` path.
fn tcp_port(token: &str) -> Option<u16> {
    let rest = token.strip_prefix("/dev/tcp/")?;
    rest.rsplit('/').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_only_tighten() {
        assert_eq!("Enforce".parse::<Mode>(), Ok(Mode::Enforce));
        assert_eq!("off".parse::<Mode>(), Ok(Mode::Off));
        assert!("strict".parse::<Mode>().is_err());
        assert_eq!(Mode::Off.strictest(Mode::Enforce), Mode::Enforce);
        assert_eq!(Mode::Enforce.strictest(Mode::Off), Mode::Enforce);
        assert_eq!(
            Sandbox::new(Mode::Warn).tighten(Mode::Off).mode(),
            Mode::Warn
        );
    }

    #[test]
    fn a_new_file_through_a_linked_directory_is_judged_where_it_lands() {
        let root = tempfile::tempdir().expect("tempdir");
        let root = root.path().canonicalize().expect("canonical");
        let (work, elsewhere) = (root.join("work"), root.join("elsewhere"));
        std::fs::create_dir_all(&work).expect("mkdir");
        std::fs::create_dir_all(&elsewhere).expect("mkdir");
        std::os::unix::fs::symlink(&elsewhere, work.join("link")).expect("link");
        let sandbox = Sandbox::new(Mode::Enforce).write(&work);
        let line = format!(
            "EACCES: permission denied, open '{}/link/new.txt'",
            work.display()
        );
        assert!(
            sandbox.denied(&line, Some(&work)).is_some(),
            "a write through a link out of the worktree is not the worktree's"
        );
    }

    #[test]
    fn support_says_whether_enforce_works() {
        let without = support(None, Mode::Enforce, false);
        assert!(
            without.contains("no Landlock") && without.contains("refuses"),
            "{without}"
        );
        let full = support(Some(7), Mode::Enforce, true);
        assert!(
            full.contains("ABI 7") && full.contains("`enforce` works"),
            "{full}"
        );
        let old = support(Some(3), Mode::Enforce, true);
        assert!(old.contains("no TCP rules"), "{old}");
        assert!(support(Some(3), Mode::Enforce, false).contains("`enforce` works"));
    }

    #[test]
    fn grants_never_cover_a_protected_path() {
        let sandbox = Sandbox::new(Mode::Enforce)
            .protect("/srv/data")
            .read("/srv")
            .read("/srv/data/plans/p1")
            .write("/srv/data/work/t1");
        let (read, write) =
            sandbox.grants(Some("/srv/bin:/opt/node/bin:/t/node_modules/.bin:relative"));
        assert!(!read.contains(&PathBuf::from("/srv")), "{read:?}");
        assert!(read.contains(&PathBuf::from("/srv/bin")));
        assert!(read.contains(&PathBuf::from("/srv/data/plans/p1")));
        assert!(
            read.contains(&PathBuf::from("/opt/node")),
            "a bin's prefix: {read:?}"
        );
        assert!(
            read.contains(&PathBuf::from("/t/node_modules")),
            "the packages a node_modules/.bin links into: {read:?}"
        );
        assert!(!read.iter().any(|p| p == Path::new("relative")));
        assert_eq!(write, vec![PathBuf::from("/srv/data/work/t1")]);
    }

    #[test]
    fn denials_name_the_path_outside_the_ruleset() {
        let sandbox = Sandbox::new(Mode::Enforce)
            .write("/srv/data/work/t1")
            .connect_ports(Some([443]));
        let cwd = Some(Path::new("/srv/data/work/t1"));
        let denied = |line: &str| sandbox.denied(line, cwd);
        assert_eq!(
            denied("cat: /srv/data/store.db: Permission denied").as_deref(),
            Some("/srv/data/store.db")
        );
        assert_eq!(
            denied("sh: 1: cannot create ../t2/x: Permission denied").as_deref(),
            Some("../t2/x")
        );
        assert_eq!(
            denied("touch: cannot touch '/srv/elsewhere': Operation not permitted").as_deref(),
            Some("/srv/elsewhere")
        );
        // Bare relative names, as Node and Python print them, are judged against the cwd.
        assert_eq!(
            denied("Error: EACCES: permission denied, open '../t2/x'").as_deref(),
            Some("../t2/x")
        );
        assert_eq!(
            denied("PermissionError: [Errno 13] Permission denied: '../t2/x'").as_deref(),
            Some("../t2/x")
        );
        assert_eq!(denied("EACCES: permission denied, open 'x'"), None);
        assert_eq!(
            denied("bash: /dev/tcp/127.0.0.1/5432: Permission denied").as_deref(),
            Some("tcp port 5432")
        );
        assert_eq!(
            denied("bash: /dev/tcp/127.0.0.1/443: Permission denied"),
            None
        );
        assert_eq!(denied("cat: /srv/data/work/t1/x: Permission denied"), None);
        // Beneath a read-only grant: Landlock's when we (same user, unconfined) may write there.
        let we_may_write =
            nix::unistd::access("/usr/share", nix::unistd::AccessFlags::W_OK).is_ok();
        assert_eq!(
            denied("touch: cannot touch '/usr/share/x': Permission denied").as_deref(),
            we_may_write.then_some("/usr/share/x")
        );
        assert_eq!(
            denied("/srv/data/store.db: No such file or directory"),
            None
        );
        assert_eq!(
            Sandbox::off().denied("cat: /x: Permission denied", cwd),
            None
        );
    }
}
