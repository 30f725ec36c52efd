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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use troupe_proto::v1::{self as pb, TaskState};

use crate::Error;
use crate::store::sessions::{SessionRow, load_session_sized};
use crate::store::tasks::{Gathered, count_tasks, load_tasks};
use crate::store::{Store, Tx};
use crate::task::{Task, Upstream, claim_order};

/// Sessions with more tasks than this are not kept in memory; their batches read instead
/// (through indexes: what a batch reads does not grow with the session). With the bound on
/// all copies together ([`Budget`]: `CACHED_TASKS` in [`crate::group_commit`]) the copies' memory is
/// bounded however large and many the sessions.
const MAX_TASKS: usize = 50_000;

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
    /// While a batch's write is held back (see [`TaskCache::journal`]): each task as it was
    /// before the batch's first change to it, `None` when the batch added it.
    journal: Option<Vec<(String, Option<Task>)>>,
    /// Its place in the bound on all copies.
    _share: Share,
}

impl TaskCache {
    /// Every task, in order of position.
    #[cfg(test)]
    pub(crate) fn tasks(&self) -> Vec<Task> {
        let mut tasks: Vec<Task> = self.tasks.values().cloned().collect();
        tasks.sort_by_key(|task| task.position);
        tasks
    }

    fn new(rows: Vec<Task>, share: Share) -> Self {
        let mut cache = Self {
            tasks: HashMap::with_capacity(rows.len()),
            dependents: HashMap::new(),
            ready: BTreeSet::new(),
            live: HashSet::new(),
            journal: None,
            _share: share,
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
        let id = task.id.clone();
        let old = self.tasks.insert(id.clone(), task);
        if let Some(journal) = &mut self.journal {
            journal.push((id, old));
        }
    }

    /// Keeps what the puts from here on replace, for [`TaskCache::undo`]: the batch's write is
    /// held back to go out with others (see `run_parts` in the group commit), so the copy
    /// changes before it is known to be written.
    pub(crate) fn journal(&mut self) {
        self.journal = Some(Vec::new());
    }

    /// The held-back write went out: the changes stay.
    pub(crate) fn forget(&mut self) {
        self.journal = None;
    }

    /// The held-back write did not go out: back to the tasks as they were before
    /// [`TaskCache::journal`].
    pub(crate) fn undo(&mut self) {
        let Some(journal) = self.journal.take() else {
            return;
        };
        for (id, old) in journal.into_iter().rev() {
            match old {
                Some(task) => self.put(task),
                None => {
                    if let Some(task) = self.tasks.remove(&id)
                        && task.state == TaskState::Ready
                    {
                        self.ready.remove(&claim_key(&task));
                    }
                    self.live.remove(&id);
                }
            }
        }
    }

    /// Whether no more than `queued` tasks are ready (claims queued will take them), and
    /// completing `task_id` (if any) readies nothing (no task waits for it).
    pub(crate) fn runs_dry(&self, task_id: Option<&str>, queued: usize) -> bool {
        self.ready.len() <= queued
            && task_id
                .and_then(|task_id| self.dependents.get(task_id))
                .is_none_or(|dependents| {
                    dependents.iter().all(|id| {
                        self.tasks
                            .get(id)
                            .is_none_or(|task| task.state != TaskState::Pending)
                    })
                })
    }

    /// How many tasks are ready, when no task depends on another: then that is all a claim
    /// can get, whatever completes.
    pub(crate) fn ready_alone(&self) -> Option<usize> {
        self.dependents.is_empty().then_some(self.ready.len())
    }

    /// The tasks of `ids` that exist.
    pub(super) fn get_all(&self, ids: &[String]) -> HashMap<String, Task> {
        ids.iter()
            .filter_map(|id| self.tasks.get(id).map(|task| (id.clone(), task.clone())))
            .collect()
    }

    /// Whether every task of the session is completed once `changed` (some of its tasks, as
    /// a batch is about to write them) are. Reads every task: only for the session's end.
    pub(super) fn all_completed(&self, changed: &[Task]) -> bool {
        let changed: HashMap<&str, TaskState> = changed
            .iter()
            .map(|task| (task.id.as_str(), task.state))
            .collect();
        self.tasks.values().all(|task| {
            changed.get(task.id.as_str()).copied().unwrap_or(task.state) == TaskState::Completed
        })
    }

    /// The state of the task `id`, when it exists.
    pub(super) fn state(&self, id: &str) -> Option<TaskState> {
        self.tasks.get(id).map(|task| task.state)
    }

    /// Whether the pending `task` stays pending whatever completing `completing` settles: it
    /// waits for a dependency that is ready or running (neither completes in this batch nor
    /// changes when it settles), and none of its dependencies failed (which would skip or
    /// block it).
    fn still_waits(&self, task: &Task, completing: &[String]) -> bool {
        let mut waits = false;
        for dep in &task.depends_on {
            if completing.contains(dep) {
                continue;
            }
            match self.tasks.get(dep).map(|dep| dep.state) {
                Some(TaskState::Ready | TaskState::Running) => waits = true,
                Some(state) if crate::task::fails_dependents(state) => return false,
                _ => {}
            }
        }
        waits
    }

    /// Each task's completed direct dependencies, in plan order: what
    /// [`crate::store::tasks::load_upstream`] reads for a task that is not a validator.
    pub(super) fn upstream(&self, tasks: &[&Task]) -> HashMap<String, Vec<Upstream>> {
        tasks
            .iter()
            .map(|task| {
                let mut upstream: Vec<Upstream> = task
                    .depends_on
                    .iter()
                    .filter_map(|id| self.tasks.get(id))
                    .filter(|dep| dep.state == TaskState::Completed)
                    .map(Upstream::from)
                    .collect();
                upstream.sort_by_key(|dep| dep.position);
                (task.id.clone(), upstream)
            })
            .collect()
    }

    /// What the database read of a batch ([`crate::store::tasks::read_batch`]) would return,
    /// less the pending dependents that the batch leaves as they are (see
    /// [`TaskCache::still_waits`]): the rest of the batch copies, compares and settles each.
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
                    && !self.still_waits(task, ids)
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

/// A session's row and, when it is small enough to keep (see [`load_cache_in`]), its tasks:
/// consistent with the row's `last_seq` (`None` when it moved between the two reads).
pub(crate) async fn load_cached(
    store: &Store,
    session_id: &str,
    budget: &Budget,
) -> Result<(SessionRow, Option<TaskCache>), Error> {
    // Two statements, no transaction: the tasks' read carries the session's sequence as of
    // its own snapshot, so when that is still the row's, the tasks are as of the row.
    let mut tx: Tx = store.read_latest().await?;
    let (session, count) = load_session_sized(&mut tx, session_id).await?;
    if session.state != pb::SessionState::Active {
        return Ok((session, None));
    }
    let Some(share) = budget.take(session_id, count) else {
        return Ok((session, None));
    };
    let (tasks, sequence) = load_tasks(&mut tx, session_id).await?;
    let current = sequence == Some(session.last_seq);
    Ok((session, current.then(|| TaskCache::new(tasks, share))))
}

/// Tests' read of a session as stored: its row and every task, in order of position.
#[cfg(test)]
pub(crate) async fn read_back(store: &Store, session_id: &str) -> (SessionRow, Vec<Task>) {
    let (row, Some(cache)) = load_cached(store, session_id, &Budget::new(MAX_TASKS))
        .await
        .unwrap()
    else {
        panic!("the session {session_id} reads back whole");
    };
    (row, cache.tasks())
}

/// A copy of a session's tasks as the caller just stored them, when it has at most
/// [`MAX_TASKS`] and they fit in `budget`.
pub(crate) fn stored(session_id: &str, tasks: Vec<Task>, budget: &Budget) -> Option<TaskCache> {
    let share = budget.take(session_id, tasks.len())?;
    Some(TaskCache::new(tasks, share))
}

/// The tasks of a session as `tx` sees them (held locked, they are as of its `last_seq`),
/// when it has at most [`MAX_TASKS`] and they fit in `budget`, which they take a share of
/// before they are read.
pub(crate) async fn load_cache_in(
    tx: &mut Tx,
    session_id: &str,
    budget: &Budget,
) -> Result<Option<TaskCache>, Error> {
    let count = count_tasks(tx, session_id).await?;
    let Some(share) = budget.take(session_id, count) else {
        return Ok(None);
    };
    Ok(Some(TaskCache::new(
        load_tasks(tx, session_id).await?.0,
        share,
    )))
}

/// The tasks all copies hold together, at most `cap`: those kept between groups and those a
/// group is working on or loading (taken out of the group commit's map, they still count),
/// so however groups of different sessions interleave, no more than `cap` tasks are copied.
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    held: Arc<AtomicUsize>,
    cap: usize,
    /// Sessions refused a copy that would have fit had the others left room, with their
    /// sizes: they copy once there is room (a refusal is often brief: a session's first
    /// claim may come while its intake still builds the copy it will give up).
    waiting: Arc<Mutex<HashMap<String, usize>>>,
}

/// Sessions remembered as [`Budget::waiting`]; beyond that it starts over.
const MAX_WAITING: usize = 4096;

impl Budget {
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            held: Arc::new(AtomicUsize::new(0)),
            cap,
            waiting: Arc::default(),
        }
    }

    /// A share of `size` tasks for `session_id`'s copy, when a copy of that many is allowed
    /// and fits; a session refused only for want of room waits for it.
    fn take(&self, session_id: &str, size: usize) -> Option<Share> {
        if size > MAX_TASKS {
            return None;
        }
        let taken = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                (held + size <= self.cap).then_some(held + size)
            })
            .is_ok();
        let mut waiting = self.waiting();
        if !taken {
            if waiting.len() >= MAX_WAITING {
                waiting.clear();
            }
            waiting.insert(session_id.to_owned(), size);
            return None;
        }
        waiting.remove(session_id);
        Some(Share {
            held: Arc::clone(&self.held),
            size,
        })
    }

    /// Whether `session_id` was refused a copy for want of room that there is now.
    pub(crate) fn has_room_for(&self, session_id: &str) -> bool {
        self.waiting()
            .get(session_id)
            .is_some_and(|size| self.held.load(Ordering::Acquire) + size <= self.cap)
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        // A map of sizes: a panic cannot leave it half-changed.
        self.waiting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Tasks held now.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
}

/// A copy's share of its [`Budget`], given back when the copy is dropped.
#[derive(Debug)]
struct Share {
    held: Arc<AtomicUsize>,
    size: usize,
}

impl Drop for Share {
    fn drop(&mut self) {
        self.held.fetch_sub(self.size, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(id: &str, deps: &[&str], state: TaskState) -> Task {
        Task {
            id: id.to_owned(),
            depends_on: deps.iter().map(|dep| (*dep).to_owned()).collect(),
            state,
            ..Task::default()
        }
    }

    #[test]
    fn a_batch_gathers_only_the_dependents_it_may_settle() {
        use TaskState::{Completed, Failed, Pending, Running};
        let budget = Budget::new(100);
        let cache = |b: TaskState| {
            let rows = vec![
                task("A", &[], Running),
                task("B", &[], b),
                task("C", &["A", "B"], Pending),
                task("D", &["A"], Pending),
            ];
            TaskCache::new(rows, budget.take("s", 4).expect("fits"))
        };
        let gathered = |cache: &TaskCache, ids: &[&str]| -> Vec<String> {
            let ids: Vec<String> = ids.iter().map(|id| (*id).to_owned()).collect();
            let mut out: Vec<String> = cache
                .gather(&ids, (&[], None), 0)
                .dependents
                .into_iter()
                .map(|task| task.id)
                .collect();
            out.sort();
            out
        };
        // C still waits for B, running: completing A leaves it pending, so it is not copied.
        assert_eq!(gathered(&cache(Running), &["A"]), ["D"]);
        // Completing both readies it.
        assert_eq!(gathered(&cache(Running), &["A", "B"]), ["C", "D"]);
        assert_eq!(gathered(&cache(Completed), &["A"]), ["C", "D"]);
        // A failed dependency settles it (skipped or blocked).
        assert_eq!(gathered(&cache(Failed), &["A"]), ["C", "D"]);
        // A pending dependency may settle in the same batch: kept.
        assert_eq!(gathered(&cache(Pending), &["A"]), ["C", "D"]);
    }

    #[test]
    fn copies_share_one_budget_give_their_share_back_when_dropped_and_the_refused_wait() {
        let budget = Budget::new(100);
        let first = TaskCache::new(Vec::new(), budget.take("a", 60).expect("60 fit"));
        assert!(budget.take("b", 50).is_none(), "60 + 50 is over 100");
        let second = budget.take("c", 40).expect("40 fit beside");
        assert_eq!(budget.held(), 100);
        assert!(!budget.has_room_for("b"), "still no room for b");
        drop(first);
        assert_eq!(budget.held(), 40);
        assert!(budget.has_room_for("b"), "b waited for room, and there is");
        assert!(!budget.has_room_for("c"), "c was never refused");
        let b = budget.take("b", 50).expect("50 fit now");
        assert!(!budget.has_room_for("b"), "b has its copy");
        drop((b, second));
        assert_eq!(budget.held(), 0);
        let roomy = Budget::new(usize::MAX);
        assert!(
            roomy.take("big", MAX_TASKS + 1).is_none(),
            "over one session's bound"
        );
        assert!(
            !roomy.has_room_for("big"),
            "a session too large never waits"
        );
        assert_eq!(roomy.held(), 0);
    }
}
