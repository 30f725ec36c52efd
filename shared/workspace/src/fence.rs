//! Exactly-once integration: each task's fence on the remote, moved only under the attempt's
//! fencing token.
//!
//! The coordinator's fencing token says which attempt of a task is current, but git cannot
//! ask the coordinator. So every task has a fence ref on the remote,
//! `refs/troupe/fence/<session>/<task>`, pointing at a small marker commit (empty tree) whose
//! trailers name the attempt and its token:
//!
//! 1. **Claim.** Before an attempt does any work it moves the fence to a `claimed` marker of
//!    its own token, by compare-and-swap. A fence already at a higher token means the attempt
//!    is stale ([`Error::Superseded`]); a fence at an `integrated` marker means an earlier
//!    attempt already landed the task (its completion was lost): the new attempt reports that
//!    instead of running again ([`Claim::Landed`]).
//! 2. **Publish.** The attempt's commit lands with one atomic push: the session branch moves
//!    from the head the merge was built on (compare-and-swap), the task branch is set, and the
//!    fence moves from the attempt's own marker to an `integrated` marker naming the commit and
//!    the new head. If a newer attempt claimed the fence meanwhile, the push is refused as a
//!    whole and nothing of the stale attempt reaches the branch; if another task moved the
//!    session branch, the merge is rebuilt on the new head and pushed again.
//!
//! The push is checked by the remote itself (receive-pack verifies every old value under its
//! ref locks), so this holds for a worker paused or cut off at any moment, on a local path
//! remote as on a URL. A caller additionally confirms its lease with the coordinator just
//! before publishing and bounds the push by the lease, so a worker whose lease lapsed does not
//! publish unless no newer attempt has begun; then its commit lands once and the next attempt
//! adopts it.
//!
//! An EXEC phase lands several parts under one lease: each part's marker (`part`) records its
//! name, so a retried phase skips the parts an earlier attempt landed.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, info};

use crate::{Error, Integration, Mirror, Oid, parse_oid};

/// Where the fences live on the remote.
pub const FENCE_PREFIX: &str = "refs/troupe/fence/";

/// How often a claim or a publication is tried after losing a race.
const RACE_ATTEMPTS: usize = 32;

/// The fence ref of a task.
pub fn fence_ref(session: &str, task: &str) -> String {
    format!("{FENCE_PREFIX}{session}/{task}")
}

/// One attempt of one task, as the coordinator leased it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// Session id.
    pub session: String,
    /// Task id.
    pub task: String,
    /// Attempt number (1-based).
    pub attempt: u32,
    /// The lease's fencing token.
    pub token: u64,
}

impl Attempt {
    /// The task's fence ref on the remote.
    pub fn fence_ref(&self) -> String {
        fence_ref(&self.session, &self.task)
    }

    /// `Troupe-Task` and `Troupe-Attempt` trailers for commits of this attempt.
    pub fn trailers(&self) -> String {
        format!(
            "Troupe-Task: {}/{}\nTroupe-Attempt: {}",
            self.session, self.task, self.attempt
        )
    }
}

/// The coordinator's lease on an attempt, as publishing needs it: confirmed right before each
/// push, whose time it then bounds.
pub trait Lease: Send + Sync + std::fmt::Debug {
    /// Confirms with the coordinator, now, that the attempt still holds its lease; returns the
    /// local instant until which it surely does, or why it does not.
    fn confirm(&self) -> Pin<Box<dyn Future<Output = Result<Instant, String>> + Send + '_>>;
}

/// A lease confirmed by a closure, such as one calling the worker loop's
/// `TaskContext::confirm_lease`.
pub struct ConfirmWith<F>(pub F);

impl<F> std::fmt::Debug for ConfirmWith<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConfirmWith")
    }
}

impl<F, Fut> Lease for ConfirmWith<F>
where
    F: Fn() -> Fut + Send + Sync,
    Fut: Future<Output = Result<Instant, String>> + Send + 'static,
{
    fn confirm(&self) -> Pin<Box<dyn Future<Output = Result<Instant, String>> + Send + '_>> {
        Box::pin((self.0)())
    }
}

/// Outside any coordinator lease (a direct run, a tool): always confirmed.
#[derive(Debug, Clone, Copy, Default)]
pub struct Unleased;

impl Lease for Unleased {
    fn confirm(&self) -> Pin<Box<dyn Future<Output = Result<Instant, String>> + Send + '_>> {
        Box::pin(async { Ok(Instant::now() + Duration::from_secs(3600)) })
    }
}

/// What a fence marker records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Claimed,
    Integrated,
    Part,
}

impl State {
    fn as_str(self) -> &'static str {
        match self {
            Self::Claimed => "claimed",
            Self::Integrated => "integrated",
            Self::Part => "part",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        match text {
            "claimed" => Some(Self::Claimed),
            "integrated" => Some(Self::Integrated),
            "part" => Some(Self::Part),
            _ => None,
        }
    }
}

/// A marker commit, read back.
#[derive(Debug, Clone)]
struct Marker {
    oid: Oid,
    token: u64,
    attempt: u32,
    state: State,
    commit: Option<Oid>,
    head: Option<Oid>,
    part: Option<String>,
}

impl Marker {
    fn landed(&self) -> Option<Landed> {
        Some(Landed {
            head: self.head.clone()?,
            commit: self.commit.clone()?,
            attempt: self.attempt,
        })
    }
}

/// A change that is on the session branch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Landed {
    /// The session branch's head right after it landed.
    pub head: Oid,
    /// The task's own commit.
    pub commit: Oid,
    /// The attempt that landed it.
    pub attempt: u32,
}

/// What claiming a task's fence found.
#[derive(Debug)]
pub enum Claim {
    /// This attempt holds the fence and may publish.
    Held(Held),
    /// An earlier attempt already landed the task; report this instead of running again.
    Landed(Landed),
}

/// An attempt's hold on its task's fence.
#[derive(Debug, Clone)]
pub struct Held {
    attempt: Attempt,
    marker: Oid,
    parts: BTreeMap<String, Landed>,
}

impl Held {
    /// The attempt holding the fence.
    pub fn attempt(&self) -> &Attempt {
        &self.attempt
    }

    /// A part (EXEC phase task) that this or an earlier attempt already landed.
    pub fn landed_part(&self, part: &str) -> Option<&Landed> {
        self.parts.get(part)
    }
}

/// A commit to land on a session branch.
#[derive(Debug, Clone, Copy)]
pub struct Publication<'a> {
    /// The session branch, `troupe/<session>`.
    pub session_branch: &'a str,
    /// Where the session branch starts when it does not exist on the remote yet.
    pub base: &'a Oid,
    /// The task's commit.
    pub commit: &'a Oid,
    /// Branch that keeps the task's own commit (`troupe-task/<session>/<task>`), if any.
    pub task_branch: Option<&'a str>,
    /// First lines of a merge commit, when one is needed (trailers are added).
    pub message: &'a str,
    /// The EXEC phase part this commit is, if any.
    pub part: Option<&'a str>,
}

impl Mirror {
    /// Claims `attempt`'s task fence on the remote (see the module docs).
    #[tracing::instrument(skip_all, fields(task = %attempt.task, attempt = attempt.attempt, token = attempt.token))]
    pub async fn claim(&self, attempt: &Attempt) -> Result<Claim, Error> {
        let fence = attempt.fence_ref();
        for _ in 0..RACE_ATTEMPTS {
            self.fetch_session(&attempt.session).await?;
            let history = self.fence_history(attempt).await?;
            let parts = landed_parts(&history);
            let current = history.first();
            if let Some(current) = current {
                if current.token > attempt.token {
                    return Err(superseded(attempt, current.token));
                }
                if current.state == State::Integrated {
                    let landed = current.landed().ok_or_else(|| corrupt(&fence))?;
                    info!(landed_by = landed.attempt, head = %landed.head, "task already landed");
                    return Ok(Claim::Landed(landed));
                }
                if current.token == attempt.token {
                    return Ok(Claim::Held(Held {
                        attempt: attempt.clone(),
                        marker: current.oid.clone(),
                        parts,
                    }));
                }
            }
            let parent = current.map(|m| &m.oid);
            let marker = self
                .marker(attempt, parent, State::Claimed, None, None, None)
                .await?;
            let expected = parent.map(Oid::to_string).unwrap_or_default();
            let pushed = self
                .push(
                    &[format!("{marker}:{fence}")],
                    &[format!("--force-with-lease={fence}:{expected}")],
                    std::time::Duration::from_secs(120),
                )
                .await?;
            if pushed {
                debug!(%marker, "claimed the fence");
                return Ok(Claim::Held(Held {
                    attempt: attempt.clone(),
                    marker,
                    parts,
                }));
            }
        }
        Err(Error::Contended {
            branch: fence,
            attempts: RACE_ATTEMPTS,
        })
    }

    /// Lands `publication` on the session branch under `held` (see the module docs). The lease
    /// is confirmed before every push and bounds it. Fails with [`Error::Superseded`] when a
    /// newer attempt took the fence, [`Error::Conflict`] on a real merge conflict and
    /// [`Error::LeaseExpired`] when the lease cannot be confirmed.
    #[tracing::instrument(skip_all, fields(task = %held.attempt.task, attempt = held.attempt.attempt, commit = %publication.commit))]
    pub async fn publish(
        &self,
        held: &mut Held,
        publication: &Publication<'_>,
        lease: &dyn Lease,
    ) -> Result<Integration, Error> {
        let attempt = held.attempt.clone();
        let fence = attempt.fence_ref();
        let branch_ref = self
            .repo()
            .check_branch_name(publication.session_branch)
            .await?;
        let state = if publication.part.is_some() {
            State::Part
        } else {
            State::Integrated
        };
        for round in 1..=RACE_ATTEMPTS {
            self.fetch_session_branch(&attempt.session, publication.session_branch)
                .await?;
            let current = self.repo().ref_head(&fence).await?;
            if current.as_ref() != Some(&held.marker) {
                if let Some(landed) = self.moved_fence(held, publication, state).await? {
                    return Ok(landed);
                }
                continue;
            }
            let head = self.repo().ref_head(&branch_ref).await?;
            let old = head.clone().unwrap_or_else(|| publication.base.clone());
            self.ensure_commit(&old, Some(&attempt.session)).await?;
            let commit = publication.commit;
            let (new, fast_forward) = if self.repo().is_ancestor(commit, &old).await? {
                (old.clone(), true)
            } else if self.repo().is_ancestor(&old, commit).await? {
                (commit.clone(), true)
            } else {
                let message = format!("{}\n\n{}", publication.message, attempt.trailers());
                (
                    self.repo().merge_commit(&old, commit, &message).await?,
                    false,
                )
            };
            let marker = self
                .marker(
                    &attempt,
                    Some(&held.marker),
                    state,
                    Some(commit),
                    Some(&new),
                    publication.part,
                )
                .await?;
            let mut refspecs = vec![format!("{marker}:{fence}")];
            let mut leases = vec![format!("--force-with-lease={fence}:{}", held.marker)];
            if head.as_ref() != Some(&new) {
                refspecs.push(format!("{new}:{branch_ref}"));
                let expected = head.as_ref().map(Oid::to_string).unwrap_or_default();
                leases.push(format!("--force-with-lease={branch_ref}:{expected}"));
            }
            if let Some(task_branch) = publication.task_branch {
                let task_ref = self.repo().check_branch_name(task_branch).await?;
                refspecs.push(format!("+{commit}:{task_ref}"));
            }
            let until = lease.confirm().await.map_err(|why| Error::LeaseExpired {
                task: format!("{} ({why})", attempt.task),
            })?;
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::LeaseExpired {
                    task: attempt.task.clone(),
                });
            }
            if self.push(&refspecs, &leases, left).await? {
                info!(head = %new, fast_forward, round, "landed on the session branch");
                held.marker = marker;
                if let Some(part) = publication.part {
                    held.parts.insert(
                        part.to_owned(),
                        Landed {
                            head: new.clone(),
                            commit: commit.clone(),
                            attempt: attempt.attempt,
                        },
                    );
                }
                return Ok(Integration {
                    commit: new,
                    fast_forward,
                });
            }
            debug!(round, "publication lost a race; reading the remote again");
        }
        Err(Error::Contended {
            branch: publication.session_branch.to_owned(),
            attempts: RACE_ATTEMPTS,
        })
    }

    /// The fence moved away from `held`'s marker. Moved by this attempt itself (another part of
    /// its phase, or this very publication whose answer was lost): the landing when it is this
    /// publication's, else `None` after following the fence. Moved by another attempt: that
    /// attempt is newer, so this one is superseded.
    async fn moved_fence(
        &self,
        held: &mut Held,
        publication: &Publication<'_>,
        state: State,
    ) -> Result<Option<Integration>, Error> {
        let attempt = &held.attempt;
        let history = self.fence_history(attempt).await?;
        let Some(top) = history.first() else {
            return Err(corrupt(&attempt.fence_ref()));
        };
        if top.token != attempt.token {
            return Err(superseded(attempt, top.token));
        }
        held.marker = top.oid.clone();
        held.parts.extend(landed_parts(&history));
        let ours = top.state == state
            && top.commit.as_ref() == Some(publication.commit)
            && top.part.as_deref() == publication.part;
        if !ours {
            return Ok(None);
        }
        let landed = top.landed().ok_or_else(|| corrupt(&attempt.fence_ref()))?;
        info!(head = %landed.head, "an earlier push of this attempt had landed");
        Ok(Some(Integration {
            fast_forward: &landed.head == publication.commit,
            commit: landed.head,
        }))
    }

    /// The fence's markers, newest first (empty when the task has no fence yet).
    async fn fence_history(&self, attempt: &Attempt) -> Result<Vec<Marker>, Error> {
        let fence = attempt.fence_ref();
        if self.repo().ref_head(&fence).await?.is_none() {
            return Ok(Vec::new());
        }
        let text = self
            .git()
            .ok(&[
                "log",
                "--first-parent",
                "--format=%H%x1f%B%x1e",
                &fence,
                "--",
            ])
            .await?;
        let expected_task = format!("{}/{}", attempt.session, attempt.task);
        text.split('\x1e')
            .map(str::trim)
            .filter(|record| !record.is_empty())
            .map(|record| parse_marker(record, &expected_task).ok_or_else(|| corrupt(&fence)))
            .collect()
    }

    /// Writes a marker commit (empty tree) and returns its id.
    async fn marker(
        &self,
        attempt: &Attempt,
        parent: Option<&Oid>,
        state: State,
        commit: Option<&Oid>,
        head: Option<&Oid>,
        part: Option<&str>,
    ) -> Result<Oid, Error> {
        let empty_tree = self
            .git()
            .ok(&["hash-object", "-t", "tree", "-w", "/dev/null"])
            .await?;
        let mut message = format!(
            "troupe fence: {} attempt {} {}\n\n{}\nTroupe-Fence: {}\nTroupe-State: {}",
            attempt.task,
            attempt.attempt,
            state.as_str(),
            attempt.trailers(),
            attempt.token,
            state.as_str()
        );
        if let Some(commit) = commit {
            message.push_str(&format!("\nTroupe-Commit: {commit}"));
        }
        if let Some(head) = head {
            message.push_str(&format!("\nTroupe-Integrated: {head}"));
        }
        if let Some(part) = part {
            message.push_str(&format!("\nTroupe-Part: {part}"));
        }
        let mut args = vec!["commit-tree", empty_tree.as_str()];
        let parent_text = parent.map(Oid::to_string);
        if let Some(parent) = &parent_text {
            args.extend(["-p", parent.as_str()]);
        }
        args.extend(["-m", message.as_str()]);
        let oid = self.git().ok(&args).await?;
        parse_oid(&oid, "git commit-tree")
    }
}

fn superseded(attempt: &Attempt, theirs: u64) -> Error {
    Error::Superseded {
        task: attempt.task.clone(),
        ours: attempt.token,
        theirs,
    }
}

fn corrupt(fence: &str) -> Error {
    Error::Git {
        command: format!("read {fence}"),
        code: Some(0),
        stderr: "the fence holds a commit troupe did not write".to_owned(),
    }
}

/// Parts landed by any attempt, by name (the newest landing of each).
fn landed_parts(history: &[Marker]) -> BTreeMap<String, Landed> {
    let mut parts = BTreeMap::new();
    for marker in history.iter().rev() {
        if marker.state == State::Part
            && let (Some(part), Some(landed)) = (&marker.part, marker.landed())
        {
            parts.insert(part.clone(), landed);
        }
    }
    parts
}

/// Reads one `%H%x1f%B` record of a marker for `expected_task`.
fn parse_marker(record: &str, expected_task: &str) -> Option<Marker> {
    let (oid, body) = record.split_once('\x1f')?;
    let oid = Oid::parse(oid)?;
    let trailer = |key: &str| {
        body.lines()
            .rev()
            .find_map(|line| line.strip_prefix(key)?.strip_prefix(": "))
            .map(str::trim)
    };
    if trailer("Troupe-Task")? != expected_task {
        return None;
    }
    Some(Marker {
        oid,
        token: trailer("Troupe-Fence")?.parse().ok()?,
        attempt: trailer("Troupe-Attempt")?.parse().ok()?,
        state: State::parse(trailer("Troupe-State")?)?,
        commit: trailer("Troupe-Commit").and_then(Oid::parse),
        head: trailer("Troupe-Integrated").and_then(Oid::parse),
        part: trailer("Troupe-Part").map(str::to_owned),
    })
}
