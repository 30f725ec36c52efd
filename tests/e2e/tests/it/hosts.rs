//! Services that share nothing on one machine: each runs as its own Unix user with a `0700`
//! data directory and home the others cannot read, and repositories live behind real git
//! remotes (`git daemon` on loopback, `file://` bare repositories, an HTTP server in front of
//! `git http-backend` that wants a token). Needs root to make the users (CI runs as root);
//! elsewhere the tests that use it print a notice and pass, except under `CI=true`.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, bail};
use tokio::process::{Child, Command};

use crate::support::{ChildService, binary, free_addr};

/// The group every test account belongs to (shared `file://` remotes are group-writable).
const GROUP: &str = "troupe-e2e";

/// A Unix account a service runs as.
#[derive(Debug, Clone)]
pub(crate) struct Account {
    pub(crate) name: String,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let output = std::process::Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    if !output.status.success() {
        bail!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// Whether this process may make accounts; prints the notice (or fails under CI) when not.
pub(crate) fn can_make_accounts() -> anyhow::Result<bool> {
    let root = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self")?) == 0;
    if root {
        return Ok(true);
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        bail!("the distributed tests need root (they run each service as its own user) under CI");
    }
    eprintln!("notice: not root, so no separate users: distributed test skipped");
    Ok(false)
}

/// The account `name` in the test group, made when missing.
pub(crate) fn account(name: &str) -> anyhow::Result<Account> {
    if run("getent", &["group", GROUP]).is_err() {
        // Another test process may make it at the same moment.
        let _ = run("groupadd", &["--system", GROUP]);
    }
    if run("id", &["-u", name]).is_err() {
        let _ = run(
            "useradd",
            &[
                "--system",
                "--no-create-home",
                "--gid",
                GROUP,
                "--shell",
                "/usr/sbin/nologin",
                name,
            ],
        );
    }
    Ok(Account {
        name: name.to_owned(),
        uid: run("id", &["-u", name])?.parse()?,
        gid: run("getent", &["group", GROUP])?
            .split(':')
            .nth(2)
            .context("group line")?
            .parse()?,
    })
}

/// Makes `dir` owned by `account`, mode `mode`.
pub(crate) fn own(dir: &Path, account: &Account, mode: u32) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::os::unix::fs::chown(dir, Some(account.uid), Some(account.gid))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// A service process running as its own account, with a private data dir and home.
#[derive(Debug)]
pub(crate) struct Host {
    pub(crate) account: Account,
    pub(crate) data: PathBuf,
    pub(crate) home: PathBuf,
    pub(crate) log: PathBuf,
}

impl Host {
    /// Private directories for `account` under `root/<name>`: data and home `0700`, the home's
    /// git configuration trusting repositories other users own (the shared `file://` remote),
    /// as an operator sets it for a shared repository.
    pub(crate) fn new(root: &Path, name: &str, account: Account) -> anyhow::Result<Self> {
        let base = root.join(name);
        std::fs::create_dir_all(&base)?;
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o755))?;
        let (data, home) = (base.join("data"), base.join("home"));
        own(&data, &account, 0o700)?;
        own(&home, &account, 0o700)?;
        std::fs::write(home.join(".gitconfig"), "[safe]\n\tdirectory = *\n")?;
        std::os::unix::fs::chown(
            home.join(".gitconfig"),
            Some(account.uid),
            Some(account.gid),
        )?;
        Ok(Self {
            account,
            data,
            home,
            log: base.join("service.log"),
        })
    }

    /// Starts service `binary` as this host's account on `addr`, with `args`, a clean
    /// environment (plus `env`) and its stderr in `self.log`; waits until it serves.
    pub(crate) async fn start(
        &self,
        name: &str,
        addr: SocketAddr,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<ChildService> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let mut command = Command::new(binary(name));
        command
            .args(args)
            .arg("--data-dir")
            .arg(&self.data)
            .arg("--listen")
            .arg(addr.to_string())
            .env_clear()
            .env("HOME", &self.home)
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("LANG", "C.UTF-8")
            .env("TROUPE_LOG_FORMAT", "json")
            .env("RUST_LOG", "info")
            .uid(self.account.uid)
            .gid(self.account.gid)
            .current_dir(&self.home)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        for (key, value) in env {
            command.env(key, value);
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting {name} as {}", self.account.name))?;
        let service = ChildService {
            name: name.to_owned(),
            addr,
            child,
            tls: None,
        };
        service.wait_serving("").await?;
        Ok(service)
    }

    /// What the service logged.
    pub(crate) fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// A bare repository with one commit holding `files`, made from a scratch checkout.
pub(crate) fn bare_repo(path: &Path, files: &[(&str, &str)]) -> anyhow::Result<String> {
    let scratch = tempfile::tempdir()?;
    let head = troupe_testkit::git_repo(scratch.path(), files)?;
    run(
        "git",
        &[
            "clone",
            "-q",
            "--bare",
            &scratch.path().display().to_string(),
            &path.display().to_string(),
        ],
    )?;
    Ok(head)
}

/// Lets every account of the test group read and write the bare repository at `path`.
pub(crate) fn share_with_group(path: &Path) -> anyhow::Result<()> {
    let path_text = path.display().to_string();
    run(
        "git",
        &["-C", &path_text, "config", "core.sharedRepository", "group"],
    )?;
    run("chgrp", &["-R", GROUP, &path_text])?;
    run("chmod", &["-R", "g+rwX", &path_text])?;
    run(
        "find",
        &[&path_text, "-type", "d", "-exec", "chmod", "g+s", "{}", "+"],
    )?;
    Ok(())
}

/// `git daemon` serving the bare repositories under `root` read-write on a loopback port.
/// `git daemon` forks the real daemon and its per-connection children: they share a process
/// group, which goes as a whole when this is dropped.
#[derive(Debug)]
pub(crate) struct GitDaemon {
    pub(crate) port: u16,
    child: Child,
}

impl Drop for GitDaemon {
    fn drop(&mut self) {
        if let Some(pid) = self.child.id().and_then(|pid| i32::try_from(pid).ok()) {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

impl GitDaemon {
    pub(crate) async fn start(root: &Path) -> anyhow::Result<Self> {
        let port = free_addr().port();
        let root_text = root.display().to_string();
        let child = Command::new("git")
            .args([
                "daemon",
                "--reuseaddr",
                &format!("--base-path={root_text}"),
                "--export-all",
                "--enable=receive-pack",
                "--listen=127.0.0.1",
                &format!("--port={port}"),
                &root_text,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .context("starting git daemon")?;
        let daemon = Self { port, child };
        troupe_testkit::eventually("git daemon to listen", || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
                .map(drop)
        })
        .await;
        Ok(daemon)
    }

    /// The URL of repository `name` (`<name>.git` under the root).
    pub(crate) fn url(&self, name: &str) -> String {
        format!("git://127.0.0.1:{}/{name}.git", self.port)
    }
}

/// An HTTP server in front of `git http-backend` that answers only requests carrying
/// `Authorization: Basic base64(x-access-token:<token>)`.
const HTTP_GIT: &str = r#"
import base64, http.server, os, subprocess, sys
root, port, token = sys.argv[1], int(sys.argv[2]), os.environ["E2E_HTTP_TOKEN"]
expected = "Basic " + base64.b64encode(("x-access-token:" + token).encode()).decode()
class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def do_GET(self):
        self.git()
    def do_POST(self):
        self.git()
    def git(self):
        if self.headers.get("Authorization", "") != expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="git"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path, _, query = self.path.partition("?")
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        env = {"GIT_PROJECT_ROOT": root, "GIT_HTTP_EXPORT_ALL": "1", "PATH_INFO": path,
               "QUERY_STRING": query, "REQUEST_METHOD": self.command, "REMOTE_USER": "troupe",
               "CONTENT_TYPE": self.headers.get("Content-Type", ""), "PATH": os.environ["PATH"],
               "CONTENT_LENGTH": str(len(body))}
        if self.headers.get("Content-Encoding"):
            env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
        out = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True).stdout
        head, _, rest = out.partition(b"\r\n\r\n")
        status, headers = 200, []
        for line in head.split(b"\r\n"):
            key, _, value = line.decode().partition(":")
            if key.lower() == "status":
                status = int(value.strip().split()[0])
            elif key:
                headers.append((key, value.strip()))
        self.send_response(status)
        for key, value in headers:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(rest)))
        self.end_headers()
        self.wfile.write(rest)
http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"#;

/// A token-protected HTTP git server over the bare repositories under `root`.
#[derive(Debug)]
pub(crate) struct HttpGit {
    pub(crate) port: u16,
    _child: Child,
}

impl HttpGit {
    pub(crate) async fn start(root: &Path, token: &str) -> anyhow::Result<Self> {
        let port = free_addr().port();
        let script = root.join("http_git.py");
        std::fs::write(&script, HTTP_GIT)?;
        let child = Command::new("python3")
            .arg(&script)
            .arg(root)
            .arg(port.to_string())
            .env("E2E_HTTP_TOKEN", token)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting the HTTP git server")?;
        let server = Self {
            port,
            _child: child,
        };
        troupe_testkit::eventually("the HTTP git server to listen", || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
                .map(drop)
        })
        .await;
        Ok(server)
    }

    pub(crate) fn url(&self, name: &str) -> String {
        format!("http://127.0.0.1:{}/{name}.git", self.port)
    }
}
