//! A worker's own view of the lease it holds on a task.
//!
//! The coordinator's clock decides when a lease lapses, and it lapses `length` after the
//! coordinator took the claim or the last heartbeat. The worker never reads that clock: it
//! counts from the instant it *sent* the claim or the heartbeat that the coordinator then
//! confirmed, which is no later than the instant the coordinator stamped. So the local
//! deadline (`sent + length`) never passes after the coordinator's: until it, the lease is
//! surely this attempt's; after it, another attempt may hold the task, and this one stops.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use troupe_proto::v1::{HeartbeatRequest, WorkProgress};

use super::{RECONNECT, duration_proto};
use crate::{CoordinatorClient, is_transient, timed, within};

/// The shortest and longest lease the coordinator grants (`ClaimTasksRequest.lease_duration`
/// documents them); it clamps what a worker asks for into this range.
const MIN_LEASE: Duration = Duration::from_secs(1);
const MAX_LEASE: Duration = Duration::from_secs(600);

/// Heartbeats never come closer together than this, however short the lease.
const MIN_BEAT: Duration = Duration::from_millis(100);

/// Why an attempt does not (or no longer) surely hold its lease.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseLost {
    /// The coordinator refused the fencing token (FAILED_PRECONDITION): another attempt holds
    /// the task now, or it is no longer running.
    #[error("stale fencing token: {message}")]
    StaleToken {
        /// The coordinator's explanation.
        message: String,
    },
    /// The coordinator cancelled the task or its session.
    #[error("the task was cancelled")]
    Cancelled,
    /// The local lease deadline passed without a confirmation from the coordinator.
    #[error("the lease expired without a confirmation from the coordinator")]
    Expired,
    /// The coordinator could not be reached before the lease deadline.
    #[error("the coordinator was unreachable until the lease deadline: {message}")]
    Unreachable {
        /// The last error of the transport or the coordinator.
        message: String,
    },
    /// The coordinator refused the heartbeat for another reason than the token (an unknown
    /// session or task, an invalid request, an internal error).
    #[error("the coordinator refused the heartbeat ({code:?}): {message}")]
    Refused {
        /// The status code.
        code: tonic::Code,
        /// The coordinator's explanation.
        message: String,
    },
}

impl LeaseLost {
    /// The reason a non-transient heartbeat error gives.
    pub(crate) fn from_refusal(status: &tonic::Status) -> Self {
        match status.code() {
            tonic::Code::FailedPrecondition => Self::StaleToken {
                message: status.message().to_owned(),
            },
            code => Self::Refused {
                code,
                message: status.message().to_owned(),
            },
        }
    }
}

/// The lease length the coordinator grants for a request of `requested`.
pub(crate) fn granted(requested: Duration) -> Duration {
    requested.clamp(MIN_LEASE, MAX_LEASE)
}

/// The local lease clock: the instant of the last confirmation and the lease length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LeaseClock {
    length: Duration,
    confirmed_at: Instant,
}

impl LeaseClock {
    /// A lease of `length` confirmed by a call sent at `sent`.
    pub(crate) fn new(sent: Instant, length: Duration) -> Self {
        Self {
            length,
            confirmed_at: sent,
        }
    }

    /// Moves the clock to a confirmation sent at `sent`; an older one changes nothing (two
    /// heartbeats may answer out of order).
    pub(crate) fn confirm(&mut self, sent: Instant) {
        self.confirmed_at = self.confirmed_at.max(sent);
    }

    /// The instant until which the lease is surely this attempt's.
    pub(crate) fn deadline(&self) -> Instant {
        self.confirmed_at + self.length
    }

    /// How long the lease surely lasts from `now`, or `None` once it may have lapsed.
    pub(crate) fn remaining(&self, now: Instant) -> Option<Duration> {
        Some(self.deadline().checked_duration_since(now)?).filter(|left| !left.is_zero())
    }

    /// The lease length.
    pub(crate) fn length(&self) -> Duration {
        self.length
    }

    /// Time between heartbeats: a third of the lease, so two can fail before it lapses.
    pub(crate) fn beat(&self) -> Duration {
        (self.length / 3).max(MIN_BEAT)
    }

    /// When the next regular heartbeat is due.
    pub(crate) fn next_beat(&self) -> Instant {
        self.confirmed_at + self.beat()
    }
}

/// What one heartbeat came to.
#[derive(Debug)]
pub(crate) enum Beat {
    /// The coordinator extended the lease (`cancel` false) or asked the task to stop.
    Answered { cancel: bool },
    /// It did not answer usefully this time; the lease still holds until its deadline.
    Transient(tonic::Status),
    /// The attempt has lost its lease.
    Lost(LeaseLost),
}

/// One attempt's lease, shared by the worker loop's heartbeats and the task's
/// [`super::TaskContext`].
#[derive(Debug)]
pub(crate) struct LeaseState {
    client: CoordinatorClient,
    session_id: String,
    task_id: String,
    fencing_token: u64,
    attempt: u32,
    /// What each heartbeat asks for (the coordinator may clamp it, see [`granted`]).
    requested: Duration,
    rpc_timeout: Duration,
    inner: Mutex<Inner>,
    /// Fires once the lease is lost, with the reason in `inner.lost`.
    lost: CancellationToken,
}

#[derive(Debug)]
struct Inner {
    clock: LeaseClock,
    lost: Option<LeaseLost>,
}

/// What identifies a lease and how to keep it.
#[derive(Debug)]
pub(crate) struct LeaseSpec {
    pub(crate) client: CoordinatorClient,
    pub(crate) session_id: String,
    pub(crate) task_id: String,
    pub(crate) fencing_token: u64,
    pub(crate) attempt: u32,
    pub(crate) requested: Duration,
    pub(crate) rpc_timeout: Duration,
    /// When the call that granted the lease was sent.
    pub(crate) sent: Instant,
}

impl LeaseState {
    pub(crate) fn new(spec: LeaseSpec) -> Self {
        Self {
            inner: Mutex::new(Inner {
                clock: LeaseClock::new(spec.sent, granted(spec.requested)),
                lost: None,
            }),
            client: spec.client,
            session_id: spec.session_id,
            task_id: spec.task_id,
            fencing_token: spec.fencing_token,
            attempt: spec.attempt,
            requested: spec.requested,
            rpc_timeout: spec.rpc_timeout,
            lost: CancellationToken::new(),
        }
    }

    pub(crate) fn fencing_token(&self) -> u64 {
        self.fencing_token
    }

    pub(crate) fn attempt(&self) -> u32 {
        self.attempt
    }

    pub(crate) fn rpc_timeout(&self) -> Duration {
        self.rpc_timeout
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Nothing panics while holding the lock; a poisoned one still holds valid data.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn clock(&self) -> LeaseClock {
        self.inner().clock
    }

    pub(crate) fn deadline(&self) -> Instant {
        self.clock().deadline()
    }

    /// Completes once the lease is lost.
    pub(crate) async fn lost(&self) -> LeaseLost {
        self.lost.cancelled().await;
        self.inner().lost.clone().unwrap_or(LeaseLost::Expired)
    }

    /// Records that the lease is lost (the first reason wins) and returns the reason.
    pub(crate) fn mark_lost(&self, reason: LeaseLost) -> LeaseLost {
        let reason = self.inner().lost.get_or_insert(reason).clone();
        self.lost.cancel();
        reason
    }

    /// Why the lease is lost, if it is: recorded earlier, or its deadline has passed now.
    pub(crate) fn check(&self) -> Option<LeaseLost> {
        let expired = {
            let inner = self.inner();
            if let Some(lost) = &inner.lost {
                return Some(lost.clone());
            }
            inner.clock.remaining(Instant::now()).is_none()
        };
        expired.then(|| self.mark_lost(LeaseLost::Expired))
    }

    /// Sends one heartbeat with `progress`, bounded by the RPC timeout and the lease.
    pub(crate) async fn heartbeat(&self, progress: String, figures: Option<WorkProgress>) -> Beat {
        if let Some(lost) = self.check() {
            return Beat::Lost(lost);
        }
        let sent = Instant::now();
        let Some(left) = self.clock().remaining(sent) else {
            return Beat::Lost(self.mark_lost(LeaseLost::Expired));
        };
        self.beat_once((progress, figures), sent, self.rpc_timeout.min(left))
            .await
    }

    /// One `Heartbeat` call sent at `sent`, waiting at most `timeout`; a confirmation moves
    /// the clock to `sent`.
    async fn beat_once(
        &self,
        (progress, work_progress): (String, Option<WorkProgress>),
        sent: Instant,
        timeout: Duration,
    ) -> Beat {
        let request = HeartbeatRequest {
            work_progress,
            session_id: self.session_id.clone(),
            task_id: self.task_id.clone(),
            fencing_token: self.fencing_token,
            progress,
            lease_duration: Some(duration_proto(self.requested)),
        };
        let mut client = self.client.clone();
        match within(timeout, client.heartbeat(timed(request, timeout))).await {
            // A cancelled task's lease is not extended: the coordinator wants it to stop.
            Ok(answer) if answer.cancel_requested => Beat::Answered { cancel: true },
            Ok(_) => {
                let mut inner = self.inner();
                if inner.lost.is_some() {
                    // Lost meanwhile (another call was refused): a late answer revives nothing.
                    return Beat::Lost(inner.lost.clone().unwrap_or(LeaseLost::Expired));
                }
                inner.clock.confirm(sent);
                Beat::Answered { cancel: false }
            }
            Err(status) if is_transient(&status) => Beat::Transient(status),
            Err(status) => Beat::Lost(self.mark_lost(LeaseLost::from_refusal(&status))),
        }
    }

    /// Confirms a lease whose claim answered late, before any work starts under it.
    ///
    /// The local clock starts when the claim was sent, so a claim answered after a third of
    /// the lease or more (a long-poll that waited, a stopped coordinator that answered once it
    /// ran again) leaves little or no local lease, although the coordinator granted a full
    /// one when it answered. Nothing has run under the lease yet, so a heartbeat can safely
    /// restart the clock. Transient failures are retried for one lease length from now, by
    /// when the coordinator's lease has surely lapsed.
    pub(crate) async fn revalidate(&self) -> Result<(), LeaseLost> {
        let give_up = Instant::now() + self.clock().length();
        let mut backoff = RECONNECT.retries();
        loop {
            let sent = Instant::now();
            let Some(left) = give_up
                .checked_duration_since(sent)
                .filter(|l| !l.is_zero())
            else {
                return Err(self.mark_lost(LeaseLost::Expired));
            };
            match self
                .beat_once((String::new(), None), sent, self.rpc_timeout.min(left))
                .await
            {
                Beat::Answered { cancel: false } => return Ok(()),
                Beat::Answered { cancel: true } => return Err(self.mark_lost(LeaseLost::Cancelled)),
                Beat::Lost(lost) => return Err(lost),
                Beat::Transient(status) => {
                    let delay = backoff.next_delay().min(left);
                    tracing::warn!(code = ?status.code(), error = %status.message(), retry_in = ?delay, "confirming a late claim failed, retrying");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    /// Confirms the lease with the coordinator now, retrying transient errors while the lease
    /// lasts; see [`super::TaskContext::confirm_lease`].
    pub(crate) async fn confirm(&self, cancel: &CancellationToken) -> Result<Instant, LeaseLost> {
        let mut backoff = RECONNECT.retries();
        let mut last_error = None;
        loop {
            match self.heartbeat(String::new(), None).await {
                Beat::Answered { cancel: false } => return Ok(self.deadline()),
                Beat::Answered { cancel: true } => {
                    cancel.cancel();
                    return Err(LeaseLost::Cancelled);
                }
                // It lapsed while the coordinator could not be reached: say why.
                Beat::Lost(LeaseLost::Expired) if last_error.is_some() => {
                    return Err(LeaseLost::Unreachable {
                        message: last_error.unwrap_or_default(),
                    });
                }
                Beat::Lost(lost) => return Err(lost),
                Beat::Transient(status) => {
                    let left = self.clock().remaining(Instant::now()).unwrap_or_default();
                    let delay = backoff.next_delay().min(left);
                    tracing::warn!(code = ?status.code(), error = %status.message(), retry_in = ?delay, "confirming the lease failed, retrying");
                    last_error = Some(format!("{:?}: {}", status.code(), status.message()));
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_counts_from_the_last_confirmation_sent() {
        let start = Instant::now();
        let mut clock = LeaseClock::new(start, Duration::from_secs(30));
        assert_eq!(clock.deadline(), start + Duration::from_secs(30));
        assert_eq!(clock.next_beat(), start + Duration::from_secs(10));
        clock.confirm(start + Duration::from_secs(10));
        assert_eq!(clock.deadline(), start + Duration::from_secs(40));
        // An answer to an older heartbeat that arrives late moves nothing back.
        clock.confirm(start + Duration::from_secs(5));
        assert_eq!(clock.deadline(), start + Duration::from_secs(40));
    }

    #[test]
    fn remaining_ends_at_the_deadline() {
        let start = Instant::now();
        let clock = LeaseClock::new(start, Duration::from_secs(3));
        assert_eq!(clock.remaining(start), Some(Duration::from_secs(3)));
        assert_eq!(
            clock.remaining(start + Duration::from_secs(2)),
            Some(Duration::from_secs(1))
        );
        assert_eq!(clock.remaining(start + Duration::from_secs(3)), None);
        assert_eq!(clock.remaining(start + Duration::from_secs(4)), None);
    }

    #[test]
    fn short_leases_beat_no_faster_than_the_floor() {
        let clock = LeaseClock::new(Instant::now(), Duration::from_millis(150));
        assert_eq!(clock.beat(), MIN_BEAT);
    }

    #[test]
    fn granted_lengths_follow_the_coordinators_bounds() {
        assert_eq!(granted(Duration::from_millis(10)), MIN_LEASE);
        assert_eq!(granted(Duration::from_secs(30)), Duration::from_secs(30));
        assert_eq!(granted(Duration::from_secs(3600)), MAX_LEASE);
    }

    #[test]
    fn refusals_name_their_reason() {
        let stale = LeaseLost::from_refusal(&tonic::Status::failed_precondition("token 3 < 4"));
        assert_eq!(
            stale,
            LeaseLost::StaleToken {
                message: "token 3 < 4".into()
            }
        );
        let gone = LeaseLost::from_refusal(&tonic::Status::not_found("no session s1"));
        assert!(
            matches!(
                gone,
                LeaseLost::Refused {
                    code: tonic::Code::NotFound,
                    ..
                }
            ),
            "{gone:?}"
        );
        assert_eq!(
            gone.to_string(),
            "the coordinator refused the heartbeat (NotFound): no session s1"
        );
    }
}
