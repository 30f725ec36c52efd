//! What `/proc` says about processes: group, session and start time, to tell a child group this
//! process recorded from an unrelated process that reused its pid.

use std::sync::OnceLock;

/// The fields of `/proc/<pid>/stat` that identify a process over time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stat {
    pub(crate) pid: i32,
    pub(crate) pgrp: i32,
    pub(crate) session: i32,
    /// Clock ticks after boot; with the boot id it names one process for the machine's uptime.
    pub(crate) start_time: u64,
    /// Dead but not reaped: it holds its pid and group, but cannot do anything.
    pub(crate) zombie: bool,
}

/// Reads `/proc/<pid>/stat`; `None` when there is no such process.
pub(crate) fn stat(pid: i32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(pid, &text)
}

/// This process.
pub(crate) fn myself() -> Option<Stat> {
    static MYSELF: OnceLock<Option<Stat>> = OnceLock::new();
    *MYSELF.get_or_init(|| stat(i32::try_from(std::process::id()).ok()?))
}

/// Every process visible in `/proc`.
pub(crate) fn all() -> Vec<Stat> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(stat)
        .collect()
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`), when the kernel exposes one.
pub(crate) fn boot_id() -> Option<&'static str> {
    static BOOT_ID: OnceLock<Option<String>> = OnceLock::new();
    BOOT_ID
        .get_or_init(|| {
            std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
                .ok()
                .map(|id| id.trim().to_owned())
                .filter(|id| !id.is_empty())
        })
        .as_deref()
}

/// Parses a stat line. The command name (field 2) is in parentheses and may itself contain
/// spaces and parentheses, so fields are counted from the last `)`.
fn parse_stat(pid: i32, text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state): field N is fields[N - 3].
    Some(Stat {
        pid,
        zombie: matches!(*fields.first()?, "Z" | "X"),
        pgrp: fields.get(2)?.parse().ok()?,
        session: fields.get(3)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_with_spaces_and_parentheses() {
        let line = "4242 (a b) (c)) S 1 4242 77 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 987654 1 2 3";
        assert_eq!(
            parse_stat(4242, line),
            Some(Stat {
                pid: 4242,
                pgrp: 4242,
                session: 77,
                start_time: 987_654,
                zombie: false,
            })
        );
        let zombie = "7 (sh) Z 1 7 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 55 0 0";
        assert!(parse_stat(7, zombie).expect("parses").zombie);
        assert_eq!(parse_stat(7, "7 (sh) S 1"), None);
    }

    #[test]
    fn reads_this_process() {
        let me = stat(std::process::id() as i32).expect("our own stat");
        assert!(!me.zombie);
        assert!(me.start_time > 0);
        assert!(all().iter().any(|s| s == &me));
        assert!(boot_id().is_some_and(|id| id.len() >= 32));
    }
}
