//! Children and the death of the process that started them, with real processes: a helper
//! process (this test binary, re-executed) starts a child group with a grandchild through
//! troupe-process and is then SIGKILLed.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio_util::sync::CancellationToken;
use troupe_process::{Command, KilledGroup, supervise_children};

/// Set in the helper's environment: the directory its child group writes its pids to.
const HELPER_OUT: &str = "TROUPE_PROCESS_TEST_HELPER_OUT";
/// Set in the helper's environment when it should record its children there.
const HELPER_RECORDS: &str = "TROUPE_PROCESS_TEST_HELPER_RECORDS";

/// The group the helper starts: a leader (`sh`) and a background grandchild (`sleep`), which
/// write their pids once both run.
const GROUP_SCRIPT: &str = r#"sleep 1000 &
echo "$$ $!" > "$1/pids.partial" && mv "$1/pids.partial" "$1/pids"
wait"#;

/// Not a test: the helper process, which the tests start with `--ignored`.
#[tokio::test]
#[ignore = "the helper process of the other tests"]
async fn helper_process() {
    let Some(out) = std::env::var_os(HELPER_OUT) else {
        return;
    };
    if let Some(records) = std::env::var_os(HELPER_RECORDS) {
        supervise_children(PathBuf::from(records))
            .await
            .expect("supervises");
    }
    let output = Command::new("sh")
        .args(["-c", GROUP_SCRIPT, "sh"])
        .arg(out.to_string_lossy())
        .run(&CancellationToken::new())
        .await;
    panic!("the helper's child ended before the helper was killed: {output:?}");
}

/// A running helper process and the group it started; everything is killed if a test fails.
struct Helper {
    child: std::process::Child,
    leader: i32,
    grandchild: i32,
    _out: tempfile::TempDir,
}

impl Helper {
    fn start(records: Option<&Path>) -> Self {
        let out = tempfile::tempdir().expect("tempdir");
        let mut command = std::process::Command::new(std::env::current_exe().expect("test exe"));
        command
            .args(["helper_process", "--exact", "--ignored", "--nocapture"])
            .env(HELPER_OUT, out.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(records) = records {
            command.env(HELPER_RECORDS, records);
        }
        let child = command.spawn().expect("helper starts");
        let pids_file = out.path().join("pids");
        let pids = eventually("the helper's group to start", || {
            std::fs::read_to_string(&pids_file).ok()
        });
        let (leader, grandchild) = pids
            .split_once(' ')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.trim().parse().ok()?)))
            .expect("two pids");
        let helper = Self {
            child,
            leader,
            grandchild,
            _out: out,
        };
        assert!(alive(leader) && alive(grandchild));
        assert_eq!(stat(grandchild).expect("grandchild stat").pgrp, leader);
        // The helper records its group once `spawn` returned, which may be after the group's
        // script wrote its pids (CI once looked in between).
        if let Some(records) = records {
            let record = records.join(leader.to_string());
            eventually("the helper's record of its group", || {
                record.is_file().then_some(())
            });
        }
        helper
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid fits")
    }

    /// The helper's reaper: its child named `troupe-reaper`.
    fn reaper(&self) -> i32 {
        let helper = self.pid();
        eventually("the helper's reaper", || {
            all_pids().into_iter().find(|pid| {
                stat(*pid).is_some_and(|s| s.ppid == helper)
                    && std::fs::read(format!("/proc/{pid}/cmdline"))
                        .is_ok_and(|cmd| cmd.starts_with(b"troupe-reaper\0"))
            })
        })
    }

    fn sigkill(&mut self) {
        self.child.kill().expect("SIGKILL the helper");
        self.child.wait().expect("reap the helper");
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for pid in [self.leader, self.grandchild] {
            if alive(pid) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct ProcStat {
    ppid: i32,
    pgrp: i32,
    session: i32,
    start_time: u64,
    zombie: bool,
}

fn stat(pid: i32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = text[text.rfind(')')? + 1..].split_whitespace().collect();
    Some(ProcStat {
        zombie: matches!(*fields.first()?, "Z" | "X"),
        ppid: fields.get(1)?.parse().ok()?,
        pgrp: fields.get(2)?.parse().ok()?,
        session: fields.get(3)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
    })
}

/// Present and not a zombie (PID 1 here may not reap orphans).
fn alive(pid: i32) -> bool {
    stat(pid).is_some_and(|s| !s.zombie)
}

fn all_pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// Polls `probe` every 10 ms until it gives a value, for at most 10 s.
fn eventually<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(value) = probe() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .expect("boot id")
        .trim()
        .to_owned()
}

/// Writes a record the way troupe-process does (`<dir>/<pgid>`), as left by a dead process
/// (no pid is ever that large).
fn write_record(dir: &Path, pgid: i32, start_time: u64, session: i32, boot_id: &str) {
    std::fs::write(
        dir.join(pgid.to_string()),
        format!(
            "start_time={start_time}\nsession={session}\nboot_id={boot_id}\nprogram=sleep\n\
             owner_pid=999999999\nowner_start_time=1\n"
        ),
    )
    .expect("write record");
}

#[test]
fn children_die_with_a_sigkilled_parent() {
    let mut helper = Helper::start(None);
    let reaper = helper.reaper();
    let killed_at = Instant::now();
    helper.sigkill();
    eventually("the whole group to die", || {
        (!alive(helper.leader) && !alive(helper.grandchild)).then_some(())
    });
    let gone_after = killed_at.elapsed();
    eventually("the reaper to exit", || (!alive(reaper)).then_some(()));
    eprintln!("group gone {gone_after:?} after SIGKILL of its parent");
    // A liveness bound, not a benchmark: the reaper reacts to end-of-file, it does not poll.
    assert!(gone_after < Duration::from_secs(2), "{gone_after:?}");
}

#[tokio::test]
async fn the_next_boot_kills_orphans_the_reaper_missed() {
    let records = tempfile::tempdir().expect("tempdir");
    let mut helper = Helper::start(Some(records.path()));
    let record = records.path().join(helper.leader.to_string());
    assert!(record.is_file(), "no record for the live group");

    // Freeze the helper so it cannot replace its reaper, kill the reaper, then the helper.
    let reaper = helper.reaper();
    kill(Pid::from_raw(helper.pid()), Signal::SIGSTOP).expect("SIGSTOP");
    kill(Pid::from_raw(reaper), Signal::SIGKILL).expect("SIGKILL the reaper");
    eventually("the reaper to die", || (!alive(reaper)).then_some(()));
    helper.sigkill();
    assert!(
        alive(helper.leader) && alive(helper.grandchild),
        "with no reaper the group outlives its parent"
    );
    assert!(record.is_file(), "the record outlives its writer");

    let killed = supervise_children(records.path())
        .await
        .expect("supervises");
    assert_eq!(
        killed,
        [KilledGroup {
            pgid: helper.leader,
            program: "sh".to_owned(),
            processes: 2,
        }]
    );
    assert!(!alive(helper.leader) && !alive(helper.grandchild));
    assert!(!record.exists(), "the record is removed");
    // Idempotent: a second boot in the same process finds nothing to do.
    assert_eq!(supervise_children(records.path()).await.expect("again"), []);
}

#[tokio::test]
async fn the_groups_of_a_live_process_sharing_the_directory_are_left_alone() {
    let records = tempfile::tempdir().expect("tempdir");
    let mut helper = Helper::start(Some(records.path()));
    let record = records.path().join(helper.leader.to_string());
    assert!(record.is_file());

    assert_eq!(
        supervise_children(records.path())
            .await
            .expect("supervises"),
        []
    );
    assert!(alive(helper.leader) && alive(helper.grandchild));
    assert!(record.is_file(), "a live process's record is its own");

    helper.sigkill();
    eventually("the group to die with the helper", || {
        (!alive(helper.leader) && !alive(helper.grandchild)).then_some(())
    });
}

#[tokio::test]
async fn a_group_whose_leader_is_gone_is_still_killed() {
    // Orphans of the helper become our children, so its group's leader can be reaped and
    // `/proc` no longer knows it: only the grandchild is left to judge by.
    nix::sys::prctl::set_child_subreaper(true).expect("subreaper");
    let records = tempfile::tempdir().expect("tempdir");
    let mut helper = Helper::start(Some(records.path()));
    let reaper = helper.reaper();
    kill(Pid::from_raw(helper.pid()), Signal::SIGSTOP).expect("SIGSTOP");
    kill(Pid::from_raw(reaper), Signal::SIGKILL).expect("SIGKILL the reaper");
    helper.sigkill();
    let leader = Pid::from_raw(helper.leader);
    kill(leader, Signal::SIGKILL).expect("SIGKILL the leader alone");
    eventually("the leader to be ours to reap", || {
        nix::sys::wait::waitpid(leader, None).ok()
    });
    // The reaper was reparented to us too.
    let _ = nix::sys::wait::waitpid(Pid::from_raw(reaper), None);
    assert!(stat(helper.leader).is_none(), "the leader is reaped");
    assert!(alive(helper.grandchild));

    let killed = supervise_children(records.path())
        .await
        .expect("supervises");
    assert_eq!(
        killed,
        [KilledGroup {
            pgid: helper.leader,
            program: "sh".to_owned(),
            processes: 1,
        }]
    );
    assert!(!alive(helper.grandchild));
}

/// SIGKILLs the processes it holds when dropped, so a failing test leaks nothing.
struct KillOnDrop(Vec<i32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for pid in &self.0 {
            if alive(*pid) {
                let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
            }
        }
    }
}

#[tokio::test]
async fn records_that_name_unrelated_processes_are_left_alone() {
    let records = tempfile::tempdir().expect("tempdir");
    let boot = boot_id();
    let mut started = KillOnDrop(Vec::new());

    // A live group leader that is not the one recorded: same pid, other start time.
    let mut reused = std::process::Command::new("sleep")
        .arg("1000")
        .process_group(0)
        .spawn()
        .expect("sleep");
    let reused_pid = i32::try_from(reused.id()).expect("pid");
    started.0.push(reused_pid);
    let reused_stat = stat(reused_pid).expect("stat");
    write_record(
        records.path(),
        reused_pid,
        reused_stat.start_time - 1,
        reused_stat.session,
        &boot,
    );

    // A live group recorded in another boot.
    let mut other_boot = std::process::Command::new("sleep")
        .arg("1000")
        .process_group(0)
        .spawn()
        .expect("sleep");
    let other_boot_pid = i32::try_from(other_boot.id()).expect("pid");
    started.0.push(other_boot_pid);
    let other_boot_stat = stat(other_boot_pid).expect("stat");
    write_record(
        records.path(),
        other_boot_pid,
        other_boot_stat.start_time,
        other_boot_stat.session,
        "00000000-0000-0000-0000-000000000000",
    );

    // A group whose leader exited, leaving a member in another session than the record's.
    let mut leader = std::process::Command::new("sh")
        .args(["-c", "sleep 1000 >/dev/null & echo $!"])
        .process_group(0)
        .stdout(Stdio::piped())
        .spawn()
        .expect("sh");
    let leaderless_pgid = i32::try_from(leader.id()).expect("pid");
    let mut out = String::new();
    std::io::Read::read_to_string(&mut leader.stdout.take().expect("stdout"), &mut out)
        .expect("read");
    leader.wait().expect("leader exits");
    let member: i32 = out.trim().parse().expect("member pid");
    started.0.push(member);
    let member_stat = stat(member).expect("member stat");
    assert_eq!(member_stat.pgrp, leaderless_pgid);
    write_record(
        records.path(),
        leaderless_pgid,
        0,
        member_stat.session + 1,
        &boot,
    );

    // And a record of a group that ended long ago.
    write_record(records.path(), 999_999_999, 1, 1, &boot);

    let killed = supervise_children(records.path())
        .await
        .expect("supervises");
    assert_eq!(killed, []);
    assert!(alive(reused_pid) && alive(other_boot_pid) && alive(member));
    let left: Vec<_> = std::fs::read_dir(records.path())
        .expect("records")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert!(left.is_empty(), "stale records are removed: {left:?}");

    drop(started);
    for child in [&mut reused, &mut other_boot] {
        child.wait().expect("reap");
    }
}
