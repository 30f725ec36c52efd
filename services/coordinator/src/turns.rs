//! Turns: a worker that claims its next task with each completion (`claim_next`) stays in one
//! session for at most [`TURN`] tasks in a row; its next claim then goes to the session served
//! least recently (see `Store::pick_sessions`) when that is another one. On SQLite a
//! session's visit has a bound too: once [`VISIT`] `claim_next`s in a row (whoever's) stayed
//! in it, every worker there moves on, and picks pass it over until a new read of the turn
//! order puts it first. There workers that pick together go to the same session (see
//! [`crate::picks`]), so without that bound they would drain one session after the other:
//! sessions would still take turns, but each would wait for one turn and take it all. So with
//! many sessions active, busy workers go round them, and with one session nothing changes.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

/// Tasks a worker claims in a row from one session through `claim_next` before its turn ends.
pub(crate) const TURN: u32 = 5;

/// Tasks a session serves through `claim_next` in a row, whoever claims them, before its
/// visit ends.
pub(crate) const VISIT: u32 = 12;

/// Workers (and sessions) remembered; beyond that it starts over (a forgotten streak only
/// starts afresh).
const MAX_WORKERS: usize = 10_000;

/// Each worker's current streak: the session and how many tasks in a row it claimed there.
#[derive(Debug, Default)]
pub(crate) struct Turns {
    /// Whether sessions' visits have a bound (see [`VISIT`]; with the picks of
    /// [`crate::picks`], which send workers that pick together to one session).
    bounded: bool,
    streaks: Mutex<HashMap<String, (String, u32)>>,
    /// Each session's current visit: the tasks it served through `claim_next` since a read of
    /// the turn order last put it first.
    visits: Mutex<HashMap<String, u32>>,
}

impl Turns {
    /// `bounded`: whether sessions' visits have a bound (see [`VISIT`]).
    pub(crate) fn new(bounded: bool) -> Self {
        Self {
            bounded,
            ..Self::default()
        }
    }

    /// Counts one more `claim_next` of `worker` in `session`; true when that ends its turn
    /// there (the streak then starts over), or, bounded, once `session`'s visit is over.
    pub(crate) fn over(&self, worker: &str, session: &str) -> bool {
        let visit = self.bounded && {
            let mut visits = self.visits();
            if visits.len() >= MAX_WORKERS && !visits.contains_key(session) {
                visits.clear();
            }
            let visit = visits.entry(session.to_owned()).or_default();
            *visit += 1;
            *visit > VISIT
        };
        self.streak_over(worker, session) || visit
    }

    /// Whether `session`'s visit is over: picks pass it over.
    pub(crate) fn visited(&self, session: &str) -> bool {
        self.visits()
            .get(session)
            .is_some_and(|visit| *visit > VISIT)
    }

    /// A new read of the turn order put `session` first (see [`crate::picks`]): a new visit
    /// starts there.
    pub(crate) fn visit_begins(&self, session: &str) {
        if let Some(visit) = self.visits().get_mut(session) {
            *visit = 0;
        }
    }

    fn visits(&self) -> std::sync::MutexGuard<'_, HashMap<String, u32>> {
        // A map of counters: a panic cannot leave it half-changed.
        self.visits.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts one more `claim_next` of `worker` in `session`; true when that ends its turn.
    fn streak_over(&self, worker: &str, session: &str) -> bool {
        // A map of counters: a panic cannot leave it half-changed.
        let mut streaks = self.streaks.lock().unwrap_or_else(PoisonError::into_inner);
        if streaks.len() >= MAX_WORKERS && !streaks.contains_key(worker) {
            streaks.clear();
        }
        let streak = streaks
            .entry(worker.to_owned())
            .or_insert_with(|| (session.to_owned(), 0));
        if streak.0 != session {
            *streak = (session.to_owned(), 0);
        }
        streak.1 += 1;
        if streak.1 > TURN {
            streak.1 = 0;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_ends_after_turn_claims_in_one_session() {
        let turns = Turns::default();
        let ends: Vec<bool> = (0..2 * (TURN + 1)).map(|_| turns.over("w", "s")).collect();
        let expected: Vec<bool> = (0..2 * (TURN + 1))
            .map(|i| (i + 1) % (TURN + 1) == 0)
            .collect();
        assert_eq!(ends, expected);
        // Another session starts a new streak; another worker has its own.
        assert!(!turns.over("w", "t"));
        assert!(!turns.over("v", "s"));
    }

    #[test]
    fn a_visit_ends_after_visit_claims_in_one_session_whoever_claims() {
        let turns = Turns::new(true);
        // Workers taking turns of their own, one after the other, in one session.
        let ends: Vec<bool> = (0..VISIT + 2)
            .map(|i| turns.over(&format!("w{}", i % 3), "s"))
            .collect();
        assert!(ends[..VISIT as usize].iter().all(|end| !end), "{ends:?}");
        assert!(ends[VISIT as usize..].iter().all(|end| *end), "{ends:?}");
        assert!(turns.visited("s") && !turns.visited("t"));
        // Put first by a new read, it starts a new visit.
        turns.visit_begins("s");
        assert!(!turns.visited("s"));
        assert!(!turns.over("w9", "s"));
    }
}
