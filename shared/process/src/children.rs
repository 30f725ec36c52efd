//! Child groups that must not outlive this process.
//!
//! Every group [`crate::Command::run`] starts is registered here for as long as it lives: with
//! the [reaper](crate::reaper), which kills it if this process dies, and as a record file in
//! every directory a service named with [`supervise_children`], so that when the reaper could
//! not act either (it was killed too, or the machine's OOM killer took both) the service's next
//! start kills what is left. The registry is process-global: several services in one process
//! share one reaper and one set of groups.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tracing::{debug, warn};

use crate::proc::{self, Stat};
use crate::reaper::{self, Link};
use crate::{Error, signal_group};

/// A reaper that dies earlier than this after its start is replaced only after the rest of
/// this interval, so something that keeps killing it cannot make us spin.
const RESPAWN_INTERVAL: Duration = Duration::from_secs(1);

/// How long [`supervise_children`] waits for killed orphans to disappear.
const KILL_PATIENCE: Duration = Duration::from_secs(5);

/// A process group left alive by a previous run and killed by [`supervise_children`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KilledGroup {
    /// The group id (the pid of the child that led it).
    pub pgid: i32,
    /// The program the group was started with (file name only).
    pub program: String,
    /// Processes of the group that were alive when it was killed.
    pub processes: usize,
}

/// Makes `dir` a record directory for this process's child groups, kills the groups a dead
/// process recorded there and left alive, and makes sure the reaper runs.
///
/// Call it at boot, before any child is started, with a directory of the service's own, such
/// as `<data_dir>/children`. A record names its group's leader and the process that started it
/// by pid, start time and boot id, so a group is killed only when it is provably the one
/// recorded and its starter is gone; records of groups that ended, of an earlier boot, or whose
/// pid now names an unrelated process are removed without killing anything, and the records of
/// a process that still runs (two services sharing a data dir) are left alone. Idempotent: a
/// second call with the same directory does nothing.
///
/// Returns the groups it killed, for a log line.
pub async fn supervise_children(dir: impl Into<PathBuf>) -> Result<Vec<KilledGroup>, Error> {
    let dir = dir.into();
    tokio::task::spawn_blocking(move || supervise_blocking(&dir))
        .await
        .map_err(|err| Error::Io(io::Error::other(err)))?
}

fn supervise_blocking(dir: &Path) -> Result<Vec<KilledGroup>, Error> {
    // One boot at a time: two services of one process naming the same directory must not both
    // judge its records.
    static BOOT: Mutex<()> = Mutex::new(());
    let _boot = BOOT.lock().unwrap_or_else(PoisonError::into_inner);
    let records_error = |source| Error::Records {
        path: dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(records_error)?;
    let dir = dir.canonicalize().map_err(records_error)?;

    {
        let mut registry = registry();
        if !matches!(registry.reaper, ReaperState::Running(_)) {
            registry.start_reaper().map_err(Error::Reaper)?;
        }
        if registry.dirs.contains(&dir) {
            return Ok(Vec::new());
        }
    }
    let killed = reclaim(&dir)?;

    let mut registry = registry();
    registry.dirs.push(dir.clone());
    let live: Vec<(i32, Record)> = registry
        .live
        .iter()
        .filter_map(|(pgid, record)| Some((*pgid, record.clone()?)))
        .collect();
    for (pgid, record) in live {
        if let Err(err) = record.write(&dir, pgid) {
            warn!(dir = %dir.display(), pgid, error = %err, "cannot record a child group");
        }
    }
    Ok(killed)
}

/// A live child group, registered until the run that started it ends. Dropping it without
/// [`Registration::end`] kills the group first.
#[derive(Debug)]
pub(crate) struct Registration {
    pgid: Pid,
    ended: bool,
}

/// Registers the group `pgid` just spawned for `program`: with the reaper, and in every
/// record directory.
pub(crate) fn register(pgid: Pid, program: &str) -> Registration {
    let record = Record::of(pgid.as_raw(), program);
    let mut registry = registry();
    if matches!(registry.reaper, ReaperState::NotStarted)
        && let Err(err) = registry.start_reaper()
    {
        warn!(error = %err, "cannot start the child reaper; children will not die with this process");
        registry.reaper = ReaperState::Failed;
    }
    if let ReaperState::Running(link) = &mut registry.reaper {
        link.add(pgid.as_raw());
    }
    if let Some(record) = &record {
        registry.record_everywhere(pgid.as_raw(), record);
    }
    registry.live.insert(pgid.as_raw(), record);
    Registration { pgid, ended: false }
}

impl Registration {
    /// Unregisters a group that is known to be dead or killed already.
    pub(crate) fn end(mut self) {
        self.ended = true;
        registry().unregister(self.pgid.as_raw());
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if !self.ended {
            signal_group(self.pgid, Signal::SIGKILL);
            registry().unregister(self.pgid.as_raw());
        }
    }
}

fn registry() -> MutexGuard<'static, Registry> {
    static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
        live: BTreeMap::new(),
        dirs: Vec::new(),
        reaper: ReaperState::NotStarted,
        reaper_started: None,
    });
    REGISTRY.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Debug)]
struct Registry {
    /// Live groups, with their record when `/proc` could describe the leader.
    live: BTreeMap<i32, Option<Record>>,
    /// Record directories, canonical.
    dirs: Vec<PathBuf>,
    reaper: ReaperState,
    reaper_started: Option<Instant>,
}

#[derive(Debug)]
enum ReaperState {
    NotStarted,
    Running(Link),
    Failed,
}

impl Registry {
    /// Starts a reaper, tells it every live group, and waits for it on a thread of its own.
    fn start_reaper(&mut self) -> io::Result<()> {
        let (link, child) = reaper::spawn()?;
        let pid = link.pid();
        self.adopt(link);
        std::thread::Builder::new()
            .name("troupe-reaper-wait".to_owned())
            .spawn(move || watch(child))?;
        debug!(pid, "child reaper started");
        Ok(())
    }

    fn adopt(&mut self, mut link: Link) {
        for pgid in self.live.keys() {
            link.add(*pgid);
        }
        self.reaper = ReaperState::Running(link);
        self.reaper_started = Some(Instant::now());
    }

    fn record_everywhere(&mut self, pgid: i32, record: &Record) {
        self.dirs.retain(|dir| match record.write(dir, pgid) {
            Ok(()) => true,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                // The service's data directory went away (a test's temporary one did).
                debug!(dir = %dir.display(), "record directory is gone; no longer recording there");
                false
            }
            Err(err) => {
                warn!(dir = %dir.display(), pgid, error = %err, "cannot record a child group");
                true
            }
        });
    }

    fn unregister(&mut self, pgid: i32) {
        self.live.remove(&pgid);
        if let ReaperState::Running(link) = &mut self.reaper {
            link.remove(pgid);
        }
        for dir in &self.dirs {
            match std::fs::remove_file(dir.join(pgid.to_string())) {
                Ok(()) => {}
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(err) => {
                    warn!(dir = %dir.display(), pgid, error = %err, "cannot remove a child record");
                }
            }
        }
    }
}

/// Reaps the reaper, and replaces it while this process lives.
fn watch(mut child: Child) {
    loop {
        let status = child.wait();
        let started = registry().reaper_started;
        warn!(
            pid = child.id(),
            ?status,
            "the child reaper exited; starting another"
        );
        if let Some(wait) = started.and_then(|at| RESPAWN_INTERVAL.checked_sub(at.elapsed())) {
            std::thread::sleep(wait);
        }
        let mut registry = registry();
        match reaper::spawn() {
            Ok((link, next)) => {
                registry.adopt(link);
                child = next;
            }
            Err(err) => {
                tracing::error!(error = %err, "cannot restart the child reaper; children will not die with this process");
                registry.reaper = ReaperState::Failed;
                return;
            }
        }
    }
}

/// What a record file says about the group it is named after and the process that started it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    start_time: u64,
    session: i32,
    boot_id: String,
    program: String,
    owner_pid: i32,
    owner_start_time: u64,
}

impl Record {
    /// Describes the leader `pid` from `/proc`.
    fn of(pid: i32, program: &str) -> Option<Self> {
        let stat = proc::stat(pid)?;
        let owner = proc::myself()?;
        let name = Path::new(program)
            .file_name()
            .map_or_else(|| program.into(), |name| name.to_string_lossy());
        Some(Self {
            start_time: stat.start_time,
            session: stat.session,
            boot_id: proc::boot_id()?.to_owned(),
            program: name
                .chars()
                .map(|c| if c.is_control() { '?' } else { c })
                .take(64)
                .collect(),
            owner_pid: owner.pid,
            owner_start_time: owner.start_time,
        })
    }

    fn to_text(&self) -> String {
        format!(
            "start_time={}\nsession={}\nboot_id={}\nprogram={}\nowner_pid={}\nowner_start_time={}\n",
            self.start_time,
            self.session,
            self.boot_id,
            self.program,
            self.owner_pid,
            self.owner_start_time
        )
    }

    fn parse(text: &str) -> Option<Self> {
        let mut fields: BTreeMap<&str, &str> = BTreeMap::new();
        for line in text.lines() {
            let (key, value) = line.split_once('=')?;
            fields.insert(key, value);
        }
        Some(Self {
            start_time: fields.get("start_time")?.parse().ok()?,
            session: fields.get("session")?.parse().ok()?,
            boot_id: (*fields.get("boot_id")?).to_owned(),
            program: fields
                .get("program")
                .copied()
                .unwrap_or_default()
                .to_owned(),
            owner_pid: fields.get("owner_pid")?.parse().ok()?,
            owner_start_time: fields.get("owner_start_time")?.parse().ok()?,
        })
    }

    /// Writes `<dir>/<pgid>` whole or not at all (a crash leaves only a dot-file).
    fn write(&self, dir: &Path, pgid: i32) -> io::Result<()> {
        let partial = dir.join(format!(".{pgid}.tmp"));
        std::fs::write(&partial, self.to_text())?;
        std::fs::rename(&partial, dir.join(pgid.to_string()))
    }
}

/// What became of a recorded group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// Recorded in another boot: every process of that run is gone.
    OtherBoot,
    /// The process that started the group still runs (another service sharing the
    /// directory): the group and its record are its business.
    OwnerAlive,
    /// No process of the group is alive.
    Ended,
    /// The pid or group now belongs to an unrelated process; the recorded group ended.
    Unrelated,
    /// The recorded group, with this many live processes.
    Alive(usize),
}

/// Decides whether the live processes in group `pgid` are the group `record` describes, and
/// whether they are orphans: only a group whose starter is dead is ours to kill.
///
/// The kernel never hands out a pid that is still some group's id, so while any process of
/// the recorded group lives, its leader's pid is not reused. If a process with that pid exists,
/// its start time says whether it is our leader (then the group is ours) or a newcomer (then
/// our group ended before the pid came free). If the leader is gone but the group has members,
/// they are ours only if they are in the recorded session (a group never leaves its session)
/// and started no earlier than the recorded leader.
fn judge(pgid: i32, record: &Record, boot_id: Option<&str>, procs: &[Stat]) -> Verdict {
    if boot_id != Some(record.boot_id.as_str()) {
        return Verdict::OtherBoot;
    }
    if procs
        .iter()
        .any(|p| p.pid == record.owner_pid && p.start_time == record.owner_start_time && !p.zombie)
    {
        return Verdict::OwnerAlive;
    }
    let members: Vec<&Stat> = procs
        .iter()
        .filter(|p| p.pgrp == pgid && !p.zombie)
        .collect();
    match procs.iter().find(|p| p.pid == pgid) {
        Some(leader) if leader.start_time != record.start_time => Verdict::Unrelated,
        _ if members.is_empty() => Verdict::Ended,
        Some(_) => Verdict::Alive(members.len()),
        None if members
            .iter()
            .all(|m| m.session == record.session && m.start_time >= record.start_time) =>
        {
            Verdict::Alive(members.len())
        }
        None => Verdict::Unrelated,
    }
}

/// Kills the recorded groups in `dir` whose starter died and that are still alive, and removes
/// every record whose starter died.
fn reclaim(dir: &Path) -> Result<Vec<KilledGroup>, Error> {
    let records_error = |source| Error::Records {
        path: dir.to_path_buf(),
        source,
    };
    let boot_id = proc::boot_id();
    let procs = proc::all();
    let mut doomed = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(records_error)? {
        let entry = entry.map_err(records_error)?;
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name.ends_with(".tmp") {
            remove(&path);
            continue;
        }
        let Some(pgid) = name.parse::<i32>().ok().filter(|pgid| *pgid > 1) else {
            warn!(path = %path.display(), "not a child record; left alone");
            continue;
        };
        let Some(record) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|text| Record::parse(&text))
        else {
            warn!(path = %path.display(), "unreadable child record; removed");
            remove(&path);
            continue;
        };
        match judge(pgid, &record, boot_id, &procs) {
            Verdict::OwnerAlive => {}
            Verdict::Alive(processes) => {
                signal_group(Pid::from_raw(pgid), Signal::SIGKILL);
                doomed.push((
                    path,
                    KilledGroup {
                        pgid,
                        program: record.program,
                        processes,
                    },
                ));
            }
            verdict => {
                debug!(pgid, ?verdict, "child record is stale; removed");
                remove(&path);
            }
        }
    }
    if doomed.is_empty() {
        return Ok(Vec::new());
    }

    // SIGKILL is delivered asynchronously; report the groups once they are really gone.
    let deadline = Instant::now() + KILL_PATIENCE;
    let survivors = loop {
        let procs = proc::all();
        let survivors: Vec<i32> = doomed
            .iter()
            .map(|(_, group)| group.pgid)
            .filter(|pgid| procs.iter().any(|p| p.pgrp == *pgid && !p.zombie))
            .collect();
        if survivors.is_empty() || Instant::now() >= deadline {
            break survivors;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    if !survivors.is_empty() {
        warn!(?survivors, "killed child groups are still alive");
    }
    Ok(doomed
        .into_iter()
        .map(|(path, group)| {
            remove(&path);
            group
        })
        .collect())
}

fn remove(path: &Path) {
    if let Err(err) = std::fs::remove_file(path)
        && err.kind() != io::ErrorKind::NotFound
    {
        warn!(path = %path.display(), error = %err, "cannot remove a child record");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Command;
    use tokio_util::sync::CancellationToken;

    /// The running reaper's pid and pipe name (starting one if needed).
    fn running_reaper() -> (u32, String) {
        let mut registry = registry();
        if !matches!(registry.reaper, ReaperState::Running(_)) {
            registry.start_reaper().expect("reaper starts");
        }
        match &registry.reaper {
            ReaperState::Running(link) => (link.pid(), link.pipe_name()),
            other => panic!("no reaper: {other:?}"),
        }
    }

    fn fds_of(pid: u32) -> Vec<String> {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .expect("fd dir")
            .filter_map(|fd| {
                Some(
                    std::fs::read_link(fd.ok()?.path())
                        .ok()?
                        .display()
                        .to_string(),
                )
            })
            .collect()
    }

    #[tokio::test]
    async fn neither_children_nor_the_reaper_hold_the_write_end() {
        let (reaper, pipe) = running_reaper();
        let listing = "for f in /proc/$$/fd/*; do readlink \"$f\"; done";
        let out = Command::new("sh")
            .args(["-c", listing])
            .run(&CancellationToken::new())
            .await
            .expect("runs");
        // The last entry may be the fd the glob listed the directory with, gone by then.
        let fds = out.stdout_text();
        assert!(
            fds.contains("pipe:["),
            "the child's stdout is a pipe: {fds}"
        );
        assert!(!fds.contains(&pipe), "a child inherited {pipe}: {fds}");
        // The reaper has the read end as stdin and nothing else of the pipe.
        let reaper_fds = fds_of(reaper);
        assert_eq!(
            reaper_fds.iter().filter(|fd| **fd == pipe).count(),
            1,
            "{reaper_fds:?}"
        );
        assert_eq!(
            std::fs::read_link(format!("/proc/{reaper}/fd/0")).expect("stdin"),
            Path::new(&pipe)
        );
    }

    #[tokio::test]
    async fn a_dead_reaper_is_replaced_and_told_every_live_group() {
        let before: Vec<i32> = registry().live.keys().copied().collect();
        let run = tokio::spawn(async {
            Command::new("sleep")
                .arg("1000")
                .run(&CancellationToken::new())
                .await
        });
        let pgid = loop {
            let new = registry()
                .live
                .keys()
                .copied()
                .find(|pgid| !before.contains(pgid));
            if let Some(pgid) = new {
                break pgid;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let (first, _) = running_reaper();
        signal_group(Pid::from_raw(first as i32), Signal::SIGKILL);
        let deadline = Instant::now() + Duration::from_secs(10);
        let second = loop {
            let (pid, _) = running_reaper();
            if pid != first {
                break pid;
            }
            assert!(Instant::now() < deadline, "no new reaper");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert!(proc::stat(second as i32).is_some_and(|s| !s.zombie));

        // Close our end as our death would: the new reaper must kill the group it was told of.
        let link = std::mem::replace(&mut registry().reaper, ReaperState::NotStarted);
        drop(link);
        let deadline = Instant::now() + Duration::from_secs(10);
        while proc::all().iter().any(|p| p.pgrp == pgid && !p.zombie) {
            assert!(
                Instant::now() < deadline,
                "the new reaper did not kill {pgid}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let output = run.await.expect("joins").expect("runs");
        assert_eq!(output.signal, Some(Signal::SIGKILL as i32));
    }

    fn record(start_time: u64, session: i32) -> Record {
        Record {
            start_time,
            session,
            boot_id: "boot-a".to_owned(),
            program: "sh".to_owned(),
            owner_pid: 50,
            owner_start_time: 400,
        }
    }

    fn process(pid: i32, pgrp: i32, session: i32, start_time: u64) -> Stat {
        Stat {
            pid,
            pgrp,
            session,
            start_time,
            zombie: false,
        }
    }

    #[test]
    fn record_round_trips() {
        let record = record(123, 45);
        assert_eq!(Record::parse(&record.to_text()), Some(record));
        assert_eq!(Record::parse("start_time=1\n"), None);
        let without_owner = "start_time=1\nsession=2\nboot_id=b\nprogram=sh\n";
        assert_eq!(Record::parse(without_owner), None);
        assert_eq!(Record::parse(""), None);
        assert_eq!(Record::parse("garbage"), None);
    }

    #[test]
    fn judges_the_leader_by_its_start_time() {
        let boot = Some("boot-a");
        let leader = process(100, 100, 9, 500);
        let grandchild = process(101, 100, 9, 510);
        assert_eq!(
            judge(100, &record(500, 9), boot, &[leader, grandchild]),
            Verdict::Alive(2)
        );
        // Same pid, another start time: the pid was reused, our group ended.
        assert_eq!(
            judge(100, &record(400, 9), boot, &[leader, grandchild]),
            Verdict::Unrelated
        );
        // Another boot: nothing of that run survives a reboot.
        assert_eq!(
            judge(100, &record(500, 9), Some("boot-b"), &[leader]),
            Verdict::OtherBoot
        );
        assert_eq!(judge(100, &record(500, 9), boot, &[]), Verdict::Ended);
        let zombie = Stat {
            zombie: true,
            ..leader
        };
        assert_eq!(judge(100, &record(500, 9), boot, &[zombie]), Verdict::Ended);
    }

    #[test]
    fn leaves_the_groups_of_a_live_starter_alone() {
        let boot = Some("boot-a");
        let owner = process(50, 50, 9, 400);
        let leader = process(100, 100, 9, 500);
        assert_eq!(
            judge(100, &record(500, 9), boot, &[owner, leader]),
            Verdict::OwnerAlive
        );
        // A dead (zombie) starter, or its pid taken by another process: orphans.
        let zombie = Stat {
            zombie: true,
            ..owner
        };
        assert_eq!(
            judge(100, &record(500, 9), boot, &[zombie, leader]),
            Verdict::Alive(1)
        );
        let newcomer = process(50, 50, 9, 450);
        assert_eq!(
            judge(100, &record(500, 9), boot, &[newcomer, leader]),
            Verdict::Alive(1)
        );
    }

    #[test]
    fn judges_a_leaderless_group_by_session_and_age() {
        let boot = Some("boot-a");
        let member = process(101, 100, 9, 510);
        assert_eq!(
            judge(100, &record(500, 9), boot, &[member]),
            Verdict::Alive(1)
        );
        // Another session, or older than our leader: not the group we started.
        assert_eq!(
            judge(100, &record(500, 8), boot, &[member]),
            Verdict::Unrelated
        );
        assert_eq!(
            judge(100, &record(520, 9), boot, &[member]),
            Verdict::Unrelated
        );
    }
}
