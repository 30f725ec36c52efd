//! Claiming: ready tasks of a session go to workers under new leases, with what each needs
//! (its repositories and the results upstream of it).

use std::sync::Arc;

use troupe_proto::v1::{self as pb, SessionState, TaskState};

use super::task_cache::TaskCache;
use super::write_changes;
use crate::Error;
use crate::quota::Quotas;
use crate::store::sessions::SessionRow;
use crate::store::tasks::{load_claimable, load_upstream};
use crate::store::{Store, Tx};
use crate::task::{self, Task, Upstream};

/// One `ClaimTasks`, checked.
#[derive(Debug, Clone)]
pub(crate) struct ClaimRequest {
    pub(crate) worker_id: String,
    /// Any role when empty.
    pub(crate) roles: Vec<pb::Role>,
    /// The backends its worker can run (see [`super::routing`]).
    pub(crate) backends: super::routing::Offer,
    pub(crate) max: u32,
    pub(crate) lease_ms: i64,
    pub(crate) now: i64,
    /// The provider quotas every claim is held to (see [`crate::quota`]).
    pub(crate) quotas: Arc<Quotas>,
}

impl ClaimRequest {
    /// What it asks for: claims with the same filter share one read of ready tasks.
    pub(crate) fn filter(&self) -> super::routing::Filter<'_> {
        (&self.roles, self.backends.as_deref())
    }

    /// Whether this claim may take `task` under the provider quotas; counts it if so.
    pub(super) fn admits(&self, task: &Task) -> bool {
        self.quotas.admit(task, &self.worker_id, self.now)
    }

    /// How many ready tasks beyond those wanted a claim reads, so that tasks a quota holds
    /// back do not hide those behind them.
    pub(super) fn lookahead(&self) -> usize {
        if self.quotas.engaged() {
            QUOTA_LOOKAHEAD
        } else {
            0
        }
    }
}

/// See [`ClaimRequest::lookahead`].
const QUOTA_LOOKAHEAD: usize = 64;

/// A task a claim handed out.
#[derive(Debug)]
pub(crate) struct Claimed {
    pub(crate) task: Task,
    pub(crate) repo: Option<pb::SessionRepo>,
    /// Every repository of the session.
    pub(crate) repos: Vec<pb::SessionRepo>,
    /// The digest of the session's plan assets ('' for none).
    pub(crate) assets_digest: String,
    pub(crate) plan_dir: String,
    pub(crate) upstream: Vec<Upstream>,
}

/// Puts a ready task under a new lease for `claim`: the next attempt and fencing token.
pub(super) fn lease(task: &mut Task, claim: &ClaimRequest) -> pb::TaskTransition {
    task.attempt += 1;
    task.fencing_token += 1;
    task.worker_id = claim.worker_id.clone();
    task.lease_ms = claim.lease_ms;
    task.started_at = Some(claim.now);
    task.progress.clear();
    let transition = task::transition(task, TaskState::Running, "claimed", claim.now);
    task.lease_expires_at = Some(claim.now + claim.lease_ms);
    transition
}

/// Takes a session's best ready tasks for several claims at once, with the session locked
/// and loaded, inside a transaction the caller commits: for the claims that
/// [`super::complete::complete_eager`] does not serve (waves mode, a session no longer active, claims
/// of one group asking for different roles). Claims are served in the order given, each up
/// to its `max`; one query per distinct role filter, one update and one event append for
/// all. Returns each claim's tasks (none when the session is not active or ran dry).
pub(crate) async fn claim_in(
    store: &Store,
    tx: &mut Tx,
    session: &SessionRow,
    claims: &[ClaimRequest],
) -> Result<Vec<Vec<Claimed>>, Error> {
    let session_id = session.id.as_str();
    let mut taken: Vec<(usize, Task)> = Vec::new();
    if session.state == SessionState::Active {
        let mut filters: Vec<super::routing::Filter<'_>> = Vec::new();
        for claim in claims {
            if !filters.contains(&claim.filter()) {
                filters.push(claim.filter());
            }
        }
        for filter in filters {
            let serves: Vec<usize> = (0..claims.len())
                .filter(|&i| claims[i].filter() == filter)
                .collect();
            let wanted: usize = serves
                .iter()
                .map(|&i| claims[i].max as usize)
                .sum::<usize>()
                + claims[serves[0]].lookahead();
            // Tasks another filter already took are skipped, so ask for that many more.
            let ready: Vec<Task> = load_claimable(tx, session_id, filter, wanted + taken.len())
                .await?
                .into_iter()
                .filter(|task| !taken.iter().any(|(_, known)| known.id == task.id))
                .collect();
            let mut ready = ready.into_iter();
            for &i in &serves {
                let claim = &claims[i];
                for task in ready
                    .by_ref()
                    .filter(|task| claim.admits(task))
                    .take(claim.max as usize)
                {
                    taken.push((i, task));
                }
            }
        }
    }
    if taken.is_empty() {
        return Ok(claims.iter().map(|_| Vec::new()).collect());
    }
    let before: Vec<Task> = taken.iter().map(|(_, task)| task.clone()).collect();
    let transitions = taken
        .iter_mut()
        .map(|(i, task)| lease(task, &claims[*i]))
        .collect();
    let tasks: Vec<Task> = taken.iter().map(|(_, task)| task.clone()).collect();
    let now = claims
        .iter()
        .map(|claim| claim.now)
        .max()
        .unwrap_or_default();
    // A claim changes nothing else in the graph: no settling needed.
    write_changes(tx, session_id, &before, &tasks, transitions, now).await?;
    hand_out(store, tx, session, claims.len(), taken, None).await
}

/// What the claims get: each claimed task (`(claim, task)`, already written) with its
/// repository and upstream results, grouped per claim.
pub(super) async fn hand_out(
    store: &Store,
    tx: &mut Tx,
    session: &SessionRow,
    claims: usize,
    taken: Vec<(usize, Task)>,
    cache: Option<&TaskCache>,
) -> Result<Vec<Vec<Claimed>>, Error> {
    let mut out: Vec<Vec<Claimed>> = (0..claims).map(|_| Vec::new()).collect();
    if taken.is_empty() {
        return Ok(out);
    }
    let tasks: Vec<&Task> = taken.iter().map(|(_, task)| task).collect();
    let mut upstream_of = match cache {
        // The session's copy holds every result (a validator also reads its ancestors' specs,
        // which the copy does not keep): no read, so a dependent costs no more round trips
        // than a task without dependencies.
        Some(cache) if tasks.iter().all(|task| task.role != pb::Role::Validator) => {
            cache.upstream(&tasks)
        }
        _ => load_upstream(tx, &session.id, &tasks).await?,
    };
    let fixed = store.fixed(tx, &session.id).await?;
    for (i, task) in taken {
        let upstream = upstream_of.remove(&task.id).unwrap_or_default();
        let repo = fixed
            .repos
            .iter()
            .find(|repo| repo.name == task.repo)
            .cloned();
        out[i].push(Claimed {
            task,
            repo,
            repos: fixed.repos.clone(),
            assets_digest: fixed.assets_digest.clone(),
            plan_dir: session.plan_dir.clone(),
            upstream,
        });
    }
    Ok(out)
}
