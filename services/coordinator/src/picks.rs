//! Picks on SQLite: which session a claim goes to (on PostgreSQL every pick reads, see
//! `GroupCommit::clusters`). [`Store::pick_sessions`] reads the active sessions with a ready
//! task for a claim's roles in turn order (served least recently first). One read answers the
//! picks that follow it for [`FRESH_FOR`]: each worker gets the first session of the read it
//! has not had from it yet. So workers that pick together go to the same session, and their
//! claims share a group's write instead of spreading each group's write over as many sessions
//! as there are workers (1,000 sessions burned at 0.84 × the rate of one that way, 0.98 × this
//! way: docs/performance.md, "nineteenth run"); one worker picking again and again still goes
//! round the sessions. A session its copy shows dry (see `GroupCommit::runs_dry`) or whose
//! visit is over (see [`crate::turns`]), or where a claim came back empty, is passed over.
//! Once a worker had every session of the read, its next pick reads again, unless the read
//! named every session there was: then it goes round them again (so one session's workers do
//! not read at every turn's end).
//!
//! [`Store::pick_sessions`]: crate::store::Store::pick_sessions

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use troupe_proto::v1 as pb;

use crate::lifecycle::routing::Filter;

/// Sessions one read names.
pub(crate) const PER_READ: usize = 4;

/// How long a read's order stands: a session that became ready since is picked in its turn
/// from the next read on.
const FRESH_FOR: Duration = Duration::from_millis(20);

/// Filters remembered; beyond that it starts over.
const MAX_FILTERS: usize = 1024;

/// A filter, owned.
type Key = (Vec<pb::Role>, Option<Vec<String>>);

/// The last read for each filter.
#[derive(Debug, Default)]
pub(crate) struct Picks {
    reads: Mutex<HashMap<Key, Read>>,
}

#[derive(Debug)]
struct Read {
    at: Instant,
    /// In turn order, each with the workers it went to.
    sessions: Vec<(String, HashSet<String>)>,
    /// Whether it named every session there was (fewer than [`PER_READ`]).
    whole: bool,
}

fn key((roles, offer): Filter<'_>) -> Key {
    (roles.to_vec(), offer.map(<[String]>::to_vec))
}

impl Picks {
    fn reads(&self) -> MutexGuard<'_, HashMap<Key, Read>> {
        // Names and sets of names: a panic cannot leave them half-changed.
        self.reads.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The first session of the last read for `filter`, while fresh, that `worker` has not had
    /// from it and is not `leaving` (the session whose turn the worker ends); sessions `dry`
    /// says have nothing ready are dropped.
    pub(crate) fn next(
        &self,
        filter: Filter<'_>,
        worker: &str,
        leaving: Option<&str>,
        dry: impl Fn(&str) -> bool,
    ) -> Option<String> {
        let mut reads = self.reads();
        let read = reads.get_mut(&key(filter))?;
        if read.at.elapsed() > FRESH_FOR {
            read.sessions.clear();
        }
        read.sessions.retain(|(session, _)| !dry(session));
        let fresh = |(session, workers): &&mut (String, HashSet<String>)| {
            Some(session.as_str()) != leaving && !workers.contains(worker)
        };
        if let Some((session, workers)) = read.sessions.iter_mut().find(fresh) {
            workers.insert(worker.to_owned());
            return Some(session.clone());
        }
        if !read.whole {
            return None;
        }
        // The read named every session with a ready task, and the worker had them all: it
        // goes round them again (and stays where it is when that is all there is), with no
        // read.
        for (_, workers) in &mut read.sessions {
            workers.remove(worker);
        }
        let at = read
            .sessions
            .iter()
            .position(|(session, _)| Some(session.as_str()) != leaving)
            .unwrap_or(0);
        let (session, workers) = read.sessions.get_mut(at)?;
        workers.insert(worker.to_owned());
        Some(session.clone())
    }

    /// Keeps a read for `filter` made at `at`, its first session gone to `worker`.
    pub(crate) fn keep(&self, filter: Filter<'_>, at: Instant, worker: &str, sessions: &[String]) {
        let mut reads = self.reads();
        if reads.len() >= MAX_FILTERS {
            reads.clear();
        }
        let sessions: Vec<(String, HashSet<String>)> = sessions
            .iter()
            .enumerate()
            .map(|(i, session)| {
                let workers = if i == 0 {
                    HashSet::from([worker.to_owned()])
                } else {
                    HashSet::new()
                };
                (session.clone(), workers)
            })
            .collect();
        let whole = sessions.len() < PER_READ;
        reads.insert(
            key(filter),
            Read {
                at,
                sessions,
                whole,
            },
        );
    }

    /// Drops `session_id` from every read: a claim there came back empty.
    pub(crate) fn emptied(&self, session_id: &str) {
        for read in self.reads().values_mut() {
            read.sessions.retain(|(session, _)| session != session_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter() -> Filter<'static> {
        (&[], None)
    }

    fn read(picks: &Picks, worker: &str, sessions: &[&str]) {
        let sessions: Vec<String> = sessions.iter().map(|s| (*s).to_owned()).collect();
        picks.keep(filter(), Instant::now(), worker, &sessions);
    }

    #[test]
    fn workers_share_a_read_and_each_goes_round_it() {
        let picks = Picks::default();
        read(&picks, "w1", &["a", "b", "c", "d"]);
        let next = |worker| picks.next(filter(), worker, None, |_| false);
        // Workers picking together go where the first went.
        assert_eq!(next("w2").as_deref(), Some("a"));
        assert_eq!(next("w3").as_deref(), Some("a"));
        // One worker picking again goes on in turn order, then reads again.
        assert_eq!(next("w1").as_deref(), Some("b"));
        assert_eq!(next("w1").as_deref(), Some("c"));
        assert_eq!(next("w1").as_deref(), Some("d"));
        assert_eq!(next("w1"), None);
        // Another filter has a read of its own.
        let roles = [pb::Role::Validator];
        assert_eq!(picks.next((&roles, None), "w2", None, |_| false), None);
    }

    #[test]
    fn a_worker_leaving_a_session_and_dry_or_emptied_sessions_are_passed_over() {
        let picks = Picks::default();
        read(&picks, "w1", &["a", "b", "c", "d"]);
        assert_eq!(
            picks.next(filter(), "w2", Some("a"), |_| false).as_deref(),
            Some("b")
        );
        assert_eq!(
            picks.next(filter(), "w3", None, |s| s == "a").as_deref(),
            Some("b")
        );
        picks.emptied("b");
        assert_eq!(
            picks.next(filter(), "w3", None, |_| false).as_deref(),
            Some("c"),
            "a was dropped as dry, b as emptied"
        );
    }

    #[test]
    fn a_read_of_every_session_goes_round_again_without_reading() {
        let picks = Picks::default();
        read(&picks, "w1", &["a", "b"]);
        let next = |leaving| picks.next(filter(), "w1", leaving, |_| false);
        assert_eq!(next(Some("a")).as_deref(), Some("b"));
        assert_eq!(next(Some("b")).as_deref(), Some("a"), "round again");
        // One session: a worker leaving it stays.
        read(&picks, "w1", &["a"]);
        assert_eq!(next(Some("a")).as_deref(), Some("a"));
        assert_eq!(picks.next(filter(), "w1", Some("a"), |_| true), None, "dry");
    }

    #[test]
    fn a_stale_read_answers_nothing() {
        let picks = Picks::default();
        let sessions = vec!["a".to_owned()];
        let old = Instant::now() - FRESH_FOR - Duration::from_millis(1);
        picks.keep(filter(), old, "w1", &sessions);
        assert_eq!(picks.next(filter(), "w2", None, |_| false), None);
    }
}
