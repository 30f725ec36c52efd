//! Demand: the tasks that claims already queued on a session will take (completions'
//! `claim_next`s, and claims a pick sent there), for the next completion's `claim_next` to
//! tell whether its session has a ready task left for it (see `GroupCommit::complete`), and
//! for picks to pass over a session whose ready tasks are spoken for (see [`crate::picks`]).
//! Without it, completions that arrive together all stay in a session with one ready task
//! left: one gets it, the others come back empty-handed and their workers claim again (a
//! round trip and a pick each). In the bench's 1,000 sessions of 25 tasks, where workers often
//! meet at a session's last tasks, 1,537 of 25,000 completions came back empty that way; 47
//! with it. The claims a pick sends are counted on SQLite only, where workers that pick
//! together go to one session (see [`crate::picks`]).
//!
//! While a group works on a session its copy is out of reach, so the group leaves behind how
//! many tasks were ready when it took the copy, when the session's tasks depend on none
//! (completions then ready nothing, and the count is all there is to know).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Per session (only while something is queued on it or a group has its copy out).
#[derive(Debug, Default)]
pub(crate) struct Demand {
    sessions: Mutex<HashMap<String, Entry>>,
}

#[derive(Debug, Default)]
struct Entry {
    /// Tasks that queued `claim_next`s may take.
    queued: usize,
    /// Tasks ready when a group took the copy out, when that alone tells what is left.
    ready_out: Option<usize>,
}

impl Entry {
    fn is_empty(&self) -> bool {
        self.queued == 0 && self.ready_out.is_none()
    }
}

impl Demand {
    fn sessions(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        // Counters: a panic cannot leave them half-changed.
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a `claim_next` of up to `tasks` queued on `session_id` until the returned guard
    /// drops (when the claim is answered).
    pub(crate) fn queue(self: &Arc<Self>, session_id: &str, tasks: usize) -> Queued {
        self.sessions()
            .entry(session_id.to_owned())
            .or_default()
            .queued += tasks;
        Queued {
            demand: Arc::clone(self),
            session_id: session_id.to_owned(),
            tasks,
        }
    }

    /// The tasks the `claim_next`s queued on `session_id` may take, and the tasks that were
    /// ready when a group took its copy out (see [`Demand::take_out`]), if one has it.
    pub(crate) fn of(&self, session_id: &str) -> (usize, Option<usize>) {
        self.sessions()
            .get(session_id)
            .map_or((0, None), |entry| (entry.queued, entry.ready_out))
    }

    /// A group took the copy of `session_id` out, with `ready` tasks ready (`None` when that
    /// does not tell what is left: a completion may ready others), until the returned guard
    /// drops (when the group is over).
    pub(crate) fn take_out(
        self: &Arc<Self>,
        session_id: &str,
        ready: Option<usize>,
    ) -> Option<Out> {
        let ready = ready?;
        self.sessions()
            .entry(session_id.to_owned())
            .or_default()
            .ready_out = Some(ready);
        Some(Out {
            demand: Arc::clone(self),
            session_id: session_id.to_owned(),
        })
    }

    /// Applies `change` to the entry of `session_id`, if any, and drops the entry once it
    /// holds nothing.
    fn release(&self, session_id: &str, change: impl FnOnce(&mut Entry)) {
        let mut sessions = self.sessions();
        if let Some(entry) = sessions.get_mut(session_id) {
            change(entry);
            if entry.is_empty() {
                sessions.remove(session_id);
            }
        }
    }
}

/// A copy out with a group (see [`Demand::take_out`]); dropping it forgets what it told.
#[derive(Debug)]
pub(crate) struct Out {
    demand: Arc<Demand>,
    session_id: String,
}

impl Drop for Out {
    fn drop(&mut self) {
        self.demand
            .release(&self.session_id, |entry| entry.ready_out = None);
    }
}

/// A queued `claim_next`'s place in [`Demand`]; dropping it takes the claim out.
#[derive(Debug)]
pub(crate) struct Queued {
    demand: Arc<Demand>,
    session_id: String,
    tasks: usize,
}

impl Drop for Queued {
    fn drop(&mut self) {
        let tasks = self.tasks;
        self.demand.release(&self.session_id, |entry| {
            entry.queued = entry.queued.saturating_sub(tasks);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queued_claims_count_until_answered_and_entries_go_when_empty() {
        let demand = Arc::new(Demand::default());
        let first = demand.queue("s", 1);
        let second = demand.queue("s", 2);
        assert_eq!(demand.of("s"), (3, None));
        let out = demand.take_out("s", Some(4));
        assert_eq!(demand.of("s"), (3, Some(4)));
        drop(first);
        assert_eq!(demand.of("s"), (2, Some(4)));
        drop(out);
        assert_eq!(demand.of("s"), (2, None));
        drop(second);
        assert_eq!(demand.of("s"), (0, None));
        assert!(demand.sessions().is_empty());
        // A copy that does not tell leaves nothing behind.
        assert!(demand.take_out("t", None).is_none());
        assert!(demand.sessions().is_empty());
    }
}
