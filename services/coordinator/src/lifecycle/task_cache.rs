//! A session's tasks in memory, for the group commit's batches (see [`crate::group_commit`]).
//!
//! An optimistic batch (see [`Store::optimistic`]) commits only if the session's sequence is
//! still where the batch found it, and every change to a session's tasks moves the sequence
//! (a lease-only heartbeat aside, which the group commit applies to the copy as well). So the
//! tasks as the previous batch of the session's lane left them are exactly what is stored as
//! long as the next write succeeds: the batch can work on them instead of reading, and its
//! one write is all it sends. When the write loses to messages only (they change no task),
//! the batch writes again on the same copy; otherwise the group drops the cache and runs
//! under the lock, and the next batch loads it again.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap, HashSet};

use troupe_proto::v1::{self as pb, TaskState};

use crate::Error;
use crate::store::sessions::{SessionRow, load_session};
use crate::store::tasks::{Gathered, load_tasks_up_to};
use crate::store::{Store, Tx};
use crate::task::{Task, claim_order};

/// Sessions with more tasks than this are not kept in memory; their batches read instead
/// (through indexes: what a batch reads does not grow with the session). With the bound on
/// all copies together (`CACHED_TASKS` in [`crate::group_commit`]) the copies' memory is
/// bounded however large and many the sessions.
const MAX_TASKS: i64 = 50_000;

/// A ready task's place in claim order, with its id.
type ClaimKey = ((i32, Reverse<u64>, i64, i64), String);

fn claim_key(task: &Task) -> ClaimKey {
    (claim_order(task), task.id.clone())
}

/// One session's tasks, with the indexes a batch needs.
#[derive(Debug)]
pub(crate) struct TaskCache {
    tasks: HashMap<String, Task>,
    /// Who names each task among its dependencies (fixed: tasks added later, by fix rounds,
    /// are written under the lock, which drops the cache).
    dependents: HashMap<String, Vec<String>>,
    ready: BTreeSet<ClaimKey>,
    /// Ready or running.
    live: HashSet<String>,
}

impl TaskCache {
    fn new(rows: Vec<Task>) -> Self {
        let mut cache = Self {
            tasks: HashMap::with_capacity(rows.len()),
            dependents: HashMap::new(),
            ready: BTreeSet::new(),
            live: HashSet::new(),
        };
        for task in rows {
            for dep in &task.depends_on {
                cache
                    .dependents
                    .entry(dep.clone())
                    .or_default()
                    .push(task.id.clone());
            }
            cache.put(task);
        }
        cache
    }

    /// How many tasks it holds.
    pub(crate) fn len(&self) -> usize {
        self.tasks.len()
    }

    /// Stores `task` as written.
    pub(super) fn put(&mut self, task: Task) {
        if let Some(old) = self.tasks.get(&task.id)
            && old.state == TaskState::Ready
        {
            self.ready.remove(&claim_key(old));
        }
        if task.state == TaskState::Ready {
            self.ready.insert(claim_key(&task));
        }
        if matches!(task.state, TaskState::Ready | TaskState::Running) {
            self.live.insert(task.id.clone());
        } else {
            self.live.remove(&task.id);
        }
        self.tasks.insert(task.id.clone(), task);
    }

    /// The tasks of `ids` that exist.
    pub(super) fn get_all(&self, ids: &[String]) -> HashMap<String, Task> {
        ids.iter()
            .filter_map(|id| self.tasks.get(id).map(|task| (id.clone(), task.clone())))
            .collect()
    }

    /// The states of the tasks of `ids` that exist.
    pub(super) fn states(&self, ids: &[String]) -> HashMap<String, TaskState> {
        ids.iter()
            .filter_map(|id| self.tasks.get(id).map(|task| (id.clone(), task.state)))
            .collect()
    }

    /// Each task's completed direct dependencies, in plan order: what
    /// [`crate::store::tasks::load_upstream`] reads for a task that is not a validator.
    pub(super) fn upstream(&self, tasks: &[Task]) -> HashMap<String, Vec<Task>> {
        tasks
            .iter()
            .map(|task| {
                let mut upstream: Vec<Task> = task
                    .depends_on
                    .iter()
                    .filter_map(|id| self.tasks.get(id))
                    .filter(|dep| dep.state == TaskState::Completed)
                    .cloned()
                    .collect();
                upstream.sort_by_key(|dep| dep.position);
                (task.id.clone(), upstream)
            })
            .collect()
    }

    /// What the database read of a batch ([`crate::store::tasks::read_batch`]) would return.
    pub(super) fn gather(
        &self,
        ids: &[String],
        (roles, offer): super::routing::Filter<'_>,
        wanted: usize,
    ) -> Gathered {
        let originals = self.get_all(ids);
        let mut dependents: Vec<Task> = Vec::new();
        for id in ids {
            for dependent in self.dependents.get(id).into_iter().flatten() {
                if let Some(task) = self.tasks.get(dependent)
                    && task.state == TaskState::Pending
                    && !dependents.iter().any(|known| known.id == task.id)
                {
                    dependents.push(task.clone());
                }
            }
        }
        dependents.sort_by_key(|task| task.position);
        let ready = self
            .ready
            .iter()
            .filter_map(|(_, id)| self.tasks.get(id))
            .filter(|task| !ids.contains(&task.id))
            .filter(|task| roles.is_empty() || roles.contains(&task.role))
            .filter(|task| super::routing::can_run(offer, &task.backends))
            .take(wanted)
            .cloned()
            .collect();
        let batch_live = ids.iter().filter(|id| self.live.contains(*id)).count();
        Gathered {
            originals,
            dependents,
            ready,
            busy: self.live.len() > batch_live,
        }
    }
}

/// A session's row and, when it is small enough to keep (at most [`MAX_TASKS`] and `room`
/// tasks), its tasks: consistent with the row's `last_seq` (read on both sides of the tasks;
/// `None` when it moved meanwhile).
pub(crate) async fn load_cached(
    store: &Store,
    session_id: &str,
    room: usize,
) -> Result<(SessionRow, Option<TaskCache>), Error> {
    // Each statement sees the latest commits (PostgreSQL's default isolation), so the two
    // reads of the session bracket the tasks' (under one snapshot they agree anyway).
    let mut tx: Tx = store.begin_read().await?;
    let session = load_session(&mut tx, session_id).await?;
    if session.state != pb::SessionState::Active {
        return Ok((session, None));
    }
    let Some(rows) = load_tasks_up_to(&mut tx, session_id, most(room)).await? else {
        return Ok((session, None));
    };
    let again = load_session(&mut tx, session_id).await?;
    let cache = (again.last_seq == session.last_seq).then(|| TaskCache::new(rows));
    Ok((session, cache))
}

/// The tasks of a session held locked in `tx` (so they are as of its `last_seq`), when it is
/// small enough to keep in memory (at most [`MAX_TASKS`] and `room` tasks).
pub(crate) async fn load_cache_in(
    tx: &mut Tx,
    session_id: &str,
    room: usize,
) -> Result<Option<TaskCache>, Error> {
    Ok(load_tasks_up_to(tx, session_id, most(room))
        .await?
        .map(TaskCache::new))
}

/// The most tasks a copy may have with `room` left among all copies.
fn most(room: usize) -> i64 {
    MAX_TASKS.min(i64::try_from(room).unwrap_or(i64::MAX))
}
