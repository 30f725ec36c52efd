//! Turns: a worker that claims its next task with each completion (`claim_next`) stays in one
//! session for at most [`TURN`] tasks in a row; its next claim then goes to the session served
//! least recently (see `Store::pick_session`) when that is another one. So with many sessions
//! active, busy workers go round them instead of draining one session after the other, and
//! with one session nothing changes.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

/// Tasks a worker claims in a row from one session through `claim_next` before its turn ends.
pub(crate) const TURN: u32 = 5;

/// Workers remembered; beyond that it starts over (a forgotten streak only starts afresh).
const MAX_WORKERS: usize = 10_000;

/// Each worker's current streak: the session and how many tasks in a row it claimed there.
#[derive(Debug, Default)]
pub(crate) struct Turns {
    streaks: Mutex<HashMap<String, (String, u32)>>,
}

impl Turns {
    /// Counts one more `claim_next` of `worker` in `session`; true when that ends its turn
    /// there (the streak then starts over).
    pub(crate) fn over(&self, worker: &str, session: &str) -> bool {
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
}
