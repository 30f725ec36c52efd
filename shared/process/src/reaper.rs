//! The reaper: a small `/bin/sh` process that kills this process's child groups when this
//! process dies, however it dies.
//!
//! It reads `+<pgid>` and `-<pgid>` lines from a pipe whose only write end stays in this
//! process (close-on-exec, so no child inherits it). When every write end is gone the read
//! returns end-of-file, which the kernel guarantees even after SIGKILL, and the reaper sends
//! SIGKILL to every group still registered, then exits.
//!
//! Why a separate process and not `PR_SET_PDEATHSIG` on each child: the death signal reaches
//! only the direct child (an agent's grandchildren survive), and it fires when the *thread*
//! that spawned the child exits, so a child spawned from a tokio blocking-pool thread would be
//! killed when that thread retires after 10 s idle, while the service is healthy. It would also
//! need a `pre_exec` hook, which forces every spawn from `posix_spawn` back to `fork`.
//!
//! Why `/bin/sh` with a fixed script and not a `fork` of this process: a forked copy of a
//! multi-threaded service may only make raw async-signal-safe calls, needs `unsafe` (which the
//! workspace forbids), and keeps a copy-on-write image of the service's memory for its whole
//! life. `sh` is already required for command lines with shell syntax, costs about a megabyte,
//! and the script is a constant: nothing is ever interpolated into it.
//!
//! The reaper runs in its own process group (so a terminal's Ctrl-C, which goes to the
//! foreground group, does not reach it) and ignores SIGHUP, SIGINT and SIGQUIT; it never
//! outlives this process by more than the moment it takes to kill the groups. A thread here
//! waits for it, so it never lingers as a zombie, and starts another (throttled) if it dies
//! early; the new one is told every live group.

use std::io::{self, PipeWriter, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Stdio};

use nix::fcntl::{FcntlArg, OFlag, fcntl};

/// The reaper's program. Groups are kept as a space-separated list; anything that is not a
/// `+` or `-` followed by digits is ignored.
const SCRIPT: &str = r#"trap '' HUP INT QUIT
groups=' '
while read -r line; do
  id=${line#?}
  case $id in ''|*[!0-9]*) continue ;; esac
  case $line in
    +*) groups="$groups$id " ;;
    -*) case $groups in *" $id "*) groups="${groups%% $id *} ${groups#* $id }" ;; esac ;;
  esac
done
for id in $groups; do kill -s KILL -- "-$id" 2>/dev/null; done
"#;

/// What the reaper shows as its name (`argv[0]`), in `ps` and `/proc/<pid>/cmdline`.
pub(crate) const NAME: &str = "troupe-reaper";

/// This process's end of the pipe to a running reaper.
#[derive(Debug)]
pub(crate) struct Link {
    writer: PipeWriter,
    /// Bytes the pipe did not take yet (the reaper is slow or stopped); sent before anything
    /// newer, so the order of `+` and `-` never changes.
    pending: Vec<u8>,
    pid: u32,
}

/// Starts a reaper; the caller must wait for the returned child.
pub(crate) fn spawn() -> io::Result<(Link, Child)> {
    // Both ends are close-on-exec: only the reaper's stdin (a dup) survives its exec.
    let (reader, writer) = io::pipe()?;
    // A stopped reaper must not block a spawn: unsent lines wait in `pending`.
    fcntl(&writer, FcntlArg::F_SETFL(OFlag::O_NONBLOCK)).map_err(io::Error::from)?;
    let child = std::process::Command::new("/bin/sh")
        .arg0(NAME)
        .arg("-c")
        .arg(SCRIPT)
        .env_clear()
        .current_dir("/")
        .stdin(Stdio::from(reader))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()?;
    let pid = child.id();
    Ok((
        Link {
            writer,
            pending: Vec::new(),
            pid,
        },
        child,
    ))
}

impl Link {
    /// The reaper's pid.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// What `/proc` calls our end of the pipe (`pipe:[<inode>]`); both ends share the name.
    #[cfg(test)]
    pub(crate) fn pipe_name(&self) -> String {
        use std::os::fd::AsRawFd;
        std::fs::read_link(format!("/proc/self/fd/{}", self.writer.as_raw_fd()))
            .expect("our fd is in /proc")
            .display()
            .to_string()
    }

    /// Tells the reaper to kill `pgid` when this process dies.
    pub(crate) fn add(&mut self, pgid: i32) {
        self.send(format!("+{pgid}\n").as_bytes());
    }

    /// Tells the reaper that `pgid` is gone.
    pub(crate) fn remove(&mut self, pgid: i32) {
        self.send(format!("-{pgid}\n").as_bytes());
    }

    fn send(&mut self, line: &[u8]) {
        self.pending.extend_from_slice(line);
        while !self.pending.is_empty() {
            match self.writer.write(&self.pending) {
                Ok(n) => {
                    self.pending.drain(..n);
                }
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return,
                Err(err) => {
                    // The reaper is gone (EPIPE): its watcher starts another and tells it
                    // every live group, so nothing queued here is needed any more.
                    tracing::debug!(error = %err, "writing to the reaper failed");
                    self.pending.clear();
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the reaper script on `input` with `kill` recorded instead of performed.
    fn script_kills(input: &str) -> String {
        let script = SCRIPT.replace("kill -s KILL -- \"-$id\" 2>/dev/null", "echo \"$id\"");
        let out = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(&script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                child
                    .stdin
                    .take()
                    .expect("piped stdin")
                    .write_all(input.as_bytes())?;
                child.wait_with_output()
            })
            .expect("runs sh");
        String::from_utf8(out.stdout).expect("utf-8")
    }

    #[test]
    fn script_tracks_adds_and_removes() {
        assert_eq!(
            script_kills("+12\n+2\n+123\n-2\n+7\n-12\n"),
            "123\n7\n",
            "a removal takes out that id only, not ids that contain it"
        );
        assert_eq!(script_kills("+5\n-5\n-9\n"), "");
        assert_eq!(script_kills("+4\nxx\n+a b\n-\n+\n+8;\n+6\n"), "4\n6\n");
    }

    #[test]
    fn reaper_exits_when_the_write_end_closes() {
        let (link, mut child) = spawn().expect("reaper starts");
        drop(link);
        let status = child.wait().expect("waits");
        assert!(status.success(), "{status}");
    }
}
