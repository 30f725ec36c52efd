//! When the coordinator refreshes PostgreSQL's planner statistics itself: after intakes that
//! grew the tables a lot, instead of waiting for autovacuum (minutes). Until then the planner
//! guesses from the tables as they were, and every connection keeps the generic plan it made
//! (see `open_postgres`) until an `ANALYZE` invalidates it. Two cases measured:
//! - A session of 50,000 tasks: a list of 500 tasks by id walked the session's whole range of
//!   another index, 0.6 s, where the primary key takes 1 ms.
//! - 1,000 sessions taken in one after another: a claim's pick of a session (see
//!   `Store::pick_sessions`) probed the ready tasks of every active session and sorted them,
//!   10 ms a pick and most of the database's time, where the turn-order index stops at the
//!   first session with a ready task.
//!
//! It refreshes them too once as many tasks ended as half the tasks taken in: the states'
//! shares the planner goes by have moved. A flat session of 20,000 tasks analysed at intake
//! (all ready) and then burnt down had its page of ready tasks (`ListTasks` filtered by state)
//! walk the session's tasks from the page token and filter them, 5–13 ms each time, where the
//! index by state takes under 2 ms.
//!
//! A coordinator that opens a database counts the tasks and sessions already there (the
//! planner's estimates, see [`Growth::holding`]) as taken in before its last refresh.

use std::sync::{Mutex, PoisonError};

/// Tasks and sessions taken in since the last refresh, against what was there at it.
#[derive(Debug, Default)]
pub(super) struct Growth {
    state: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    tasks: Grown,
    sessions: Grown,
    /// Tasks that ended since the last refresh.
    ended: usize,
    /// A refresh is running: another is not started.
    running: bool,
}

/// What a table gained since the last refresh (`since`), and before it (`before`).
#[derive(Debug, Default)]
struct Grown {
    before: usize,
    since: usize,
}

impl Counts {
    /// When `due` and no refresh is running, counts a refresh as started (from here on
    /// everything counts towards the next) and returns true.
    fn start(&mut self, due: bool) -> bool {
        if !due || self.running {
            return false;
        }
        self.running = true;
        self.tasks.refreshed();
        self.sessions.refreshed();
        self.ended = 0;
        true
    }
}

impl Grown {
    /// Whether the table has at least doubled since the last refresh, by at least `least`: so a
    /// coordinator that takes in N rows refreshes about log₂(N) times.
    fn doubled(&self, least: usize) -> bool {
        self.since >= least.max(self.before)
    }

    fn refreshed(&mut self) {
        self.before += std::mem::take(&mut self.since);
    }
}

/// Tasks (taken in, or ended), and sessions taken in, before the first refresh.
const LEAST_TASKS: usize = 5_000;
const LEAST_SESSIONS: usize = 64;

impl Growth {
    /// The counts of a coordinator that opened a database already holding about `tasks` tasks
    /// and `sessions` sessions (the planner's own estimates): they count as taken in before
    /// the last refresh, so a restart on a large database neither refreshes after its first
    /// small intakes nor after every [`LEAST_TASKS`] tasks that end.
    pub(super) fn holding(tasks: usize, sessions: usize) -> Self {
        let counts = Counts {
            tasks: Grown {
                before: tasks,
                since: 0,
            },
            sessions: Grown {
                before: sessions,
                since: 0,
            },
            ..Counts::default()
        };
        Self {
            state: Mutex::new(counts),
        }
    }

    /// Counts an intake of `tasks` tasks (one session); true when the caller should refresh
    /// now (it then calls [`Growth::done`]).
    pub(super) fn took_in(&self, tasks: usize) -> bool {
        let mut counts = self.counts();
        counts.tasks.since += tasks;
        counts.sessions.since += 1;
        let due = counts.tasks.doubled(LEAST_TASKS) || counts.sessions.doubled(LEAST_SESSIONS);
        counts.start(due)
    }

    /// Counts `tasks` that ended; true when the caller should refresh now (it then calls
    /// [`Growth::done`]): as many ended since the last refresh as half the tasks taken in, at
    /// least [`LEAST_TASKS`].
    pub(super) fn ended(&self, tasks: usize) -> bool {
        let mut counts = self.counts();
        counts.ended += tasks;
        let held = counts.tasks.before + counts.tasks.since;
        let due = counts.ended >= LEAST_TASKS.max(held / 2);
        counts.start(due)
    }

    /// What counts as held before the last refresh: tasks, sessions.
    #[cfg(test)]
    fn held(&self) -> (usize, usize) {
        let counts = self.counts();
        (counts.tasks.before, counts.sessions.before)
    }

    /// A refresh ended.
    pub(super) fn done(&self) {
        self.counts().running = false;
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        // Counters only: a panic cannot leave them inconsistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refreshes_each_time_the_tables_doubled() {
        let growth = Growth::default();
        // One large intake: at once.
        assert!(growth.took_in(50_000));
        growth.done();
        assert!(!growth.took_in(20_000));
        assert!(growth.took_in(30_000));
        growth.done();
        // Many small sessions: each time their number doubled (their tasks never do first).
        let growth = Growth::default();
        let due: Vec<usize> = (1..=1_000)
            .filter(|_| {
                let due = growth.took_in(25);
                if due {
                    growth.done();
                }
                due
            })
            .collect();
        assert_eq!(due, vec![64, 128, 256, 512]);
    }

    #[test]
    fn refreshes_once_half_the_tasks_ended() {
        let growth = Growth::default();
        assert!(growth.took_in(20_000));
        growth.done();
        assert!(!growth.ended(9_999));
        assert!(growth.ended(1), "half of 20,000 ended");
        growth.done();
        // Counted afresh from the refresh; a refresh after an intake counts as one.
        assert!(!growth.ended(9_000));
        assert!(growth.took_in(20_000));
        growth.done();
        assert!(!growth.ended(19_999));
        assert!(growth.ended(1), "half of 40,000 ended");
        growth.done();
        // Small tables: at least `LEAST_TASKS`.
        let growth = Growth::default();
        assert!(!growth.ended(LEAST_TASKS - 1));
        assert!(growth.ended(1));
    }

    #[test]
    fn a_coordinator_opening_a_large_database_counts_what_it_holds() {
        let growth = Growth::holding(100_000, 2_000);
        // Ended: half of what is held, not the least.
        assert!(!growth.ended(LEAST_TASKS));
        assert!(!growth.ended(49_999 - LEAST_TASKS));
        assert!(growth.ended(1), "half of 100,000 ended");
        growth.done();
        // Taken in: once the tables doubled from what they held.
        let growth = Growth::holding(100_000, 2_000);
        assert!(!growth.took_in(99_999));
        assert!(growth.took_in(1), "100,000 more tasks");
        growth.done();
        let growth = Growth::holding(100_000, 2_000);
        let due = (1..=2_000).find(|_| growth.took_in(1));
        assert_eq!(due, Some(2_000), "the sessions doubled");
    }

    /// A coordinator opening a PostgreSQL database takes the planner's row counts as held
    /// (PostgreSQL only: `TROUPE_TEST_DATABASE_URL`, a schema of its own).
    #[tokio::test]
    async fn opening_postgres_counts_the_rows_its_statistics_know() {
        let Some(url) = troupe_testkit::postgres_url() else {
            return;
        };
        let url = troupe_testkit::fresh_schema(&url, "t").await;

        let store = crate::store::Store::open_url(&url).await.unwrap();
        assert_eq!(store.growth.held(), (0, 0), "nothing analysed yet");
        let dir = tempfile::tempdir().unwrap();
        let (store, coordinator) = crate::service::Coordinator::for_tests_on(store, dir.path());
        let tasks: Vec<serde_json::Value> = (0..30)
            .map(|i| serde_json::json!({"id": format!("IMPL-{i}"), "title": "t"}))
            .collect();
        for name in ["a", "b"] {
            let plan = serde_json::json!({"name": name, "repos": {"app": {"path": "repo"}},
                "tasks": tasks});
            coordinator
                .create_for_tests(&plan, &dir.path().join(name))
                .await;
        }
        sqlx::raw_sql("ANALYZE tasks, sessions")
            .execute(&store.reader)
            .await
            .unwrap();

        let reopened = crate::store::Store::open_url(&url).await.unwrap();
        assert_eq!(reopened.growth.held(), (60, 2));
    }

    #[test]
    fn one_refresh_at_a_time() {
        let growth = Growth::default();
        assert!(growth.took_in(10_000));
        // Due again, but the first is still running.
        assert!(!growth.took_in(10_000));
        growth.done();
        assert!(growth.took_in(10_000));
    }
}
