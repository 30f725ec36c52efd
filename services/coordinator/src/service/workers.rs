//! The worker protocol (claim, heartbeat, complete, fail) and the background reaper with its
//! capability-gap scan.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use troupe_proto::v1 as pb;

use super::{
    Coordinator, DEFAULT_LEASE, GAP_SCAN_TICKS, MAX_CLAIM, MAX_PROGRESS_CHARS, MAX_WAIT, duration,
    lease, millis, require,
};
use crate::Error;
use crate::check;
use crate::convert::now_ms;
use crate::lifecycle::{self, claim::ClaimRequest, claim::Claimed};
use crate::store::messages::NewMessage;
use crate::task::{self, Task};

impl Coordinator {
    #[tracing::instrument(skip_all, fields(worker_id = %request.worker_id))]
    pub(crate) async fn claim_tasks(
        &self,
        request: pb::ClaimTasksRequest,
    ) -> Result<Vec<Claimed>, Error> {
        let started = tokio::time::Instant::now();
        let claim = self.claim_request(&request).await?;
        let wait = duration(request.wait, "wait", Duration::ZERO)?.min(MAX_WAIT);
        let deadline = tokio::time::Instant::now() + wait;
        let mut changes = self.claimable.subscribe();
        let claimed = loop {
            changes.borrow_and_update();
            let claimed = self
                .group
                .claim(&ClaimRequest {
                    now: now_ms(),
                    ..claim.clone()
                })
                .await?;
            if !claimed.is_empty() || tokio::time::Instant::now() >= deadline {
                break claimed;
            }
            // Parked, a group that completes tasks may claim for it (see `GroupCommit::park`);
            // else a change wakes it to look again. Once a group took it, its answer counts
            // whatever woke it: what it claimed is leased to this caller.
            let mut parked = self.group.park(claim.clone());
            let (claimed, look_again) = tokio::select! {
                answer = parked.answered() => (answer?, true),
                changed = changes.changed() => (parked.withdraw().await?, changed.is_ok()),
                () = tokio::time::sleep_until(deadline) => (parked.withdraw().await?, false),
                () = self.stop.cancelled() => (parked.withdraw().await?, false),
            };
            if !claimed.is_empty() || !look_again {
                break claimed;
            }
        };
        if !claimed.is_empty() {
            self.notify_watchers();
        }
        crate::metrics::claimed(Some(started.elapsed()), &claimed);
        log_claimed(&claimed);
        Ok(claimed)
    }

    /// Extends a lease and records progress; returns the new expiry (unix ms) and whether the
    /// task was cancelled.
    pub(crate) async fn heartbeat(
        &self,
        request: pb::HeartbeatRequest,
    ) -> Result<(i64, bool), Error> {
        require(&request.session_id, "session_id")?;
        require(&request.task_id, "task_id")?;
        let lease_ms = match request.lease_duration {
            None => None,
            Some(value) => Some(millis(lease(Some(value), DEFAULT_LEASE)?)),
        };
        let progress: String = request.progress.chars().take(MAX_PROGRESS_CHARS).collect();
        let figures = request.work_progress;
        let carried = figures.is_some();
        let (expires_at, cancel_requested) = self
            .group
            .heartbeat(
                &request.session_id,
                &request.task_id,
                request.fencing_token,
                (&progress, figures.clone()),
                lease_ms,
                now_ms(),
            )
            .await?;
        if let Some(figures) = figures {
            self.keep_work_progress(
                (&request.session_id, &request.task_id),
                request.fencing_token,
                figures,
            );
        }
        if !progress.is_empty() || carried {
            self.notify_watchers();
        }
        Ok((expires_at, cancel_requested))
    }

    #[tracing::instrument(skip_all, fields(session_id = %request.session_id, task_id = %request.task_id))]
    pub(crate) async fn complete_task(
        &self,
        request: pb::CompleteTaskRequest,
    ) -> Result<(Task, Vec<Claimed>), Error> {
        require(&request.session_id, "session_id")?;
        require(&request.task_id, "task_id")?;
        let claim_next = match &request.claim_next {
            Some(claim) => Some(self.claim_request(claim).await?),
            None => None,
        };
        let result = request.result.unwrap_or_default();
        let (task, next) = self
            .group
            .complete(
                &request.session_id,
                &request.task_id,
                request.fencing_token,
                result,
                claim_next,
                now_ms(),
            )
            .await?;
        self.notify();
        tracing::info!(attempt = task.attempt, "task completed");
        crate::metrics::claimed(None, &next);
        log_claimed(&next);
        Ok((task, next))
    }

    /// Checks a claim's request and records its worker as seen.
    pub(super) async fn claim_request(
        &self,
        request: &pb::ClaimTasksRequest,
    ) -> Result<ClaimRequest, Error> {
        require(&request.worker_id, "worker_id")?;
        let roles: Vec<pb::Role> = request
            .roles()
            .filter(|role| *role != pb::Role::Unspecified)
            .collect();
        let max = match request.max_tasks {
            0 => 1,
            max => max.min(MAX_CLAIM),
        };
        let lease_ms = millis(lease(request.lease_duration, DEFAULT_LEASE)?);
        self.touch_worker(&request.worker_id, &roles).await;
        Ok(ClaimRequest {
            worker_id: request.worker_id.clone(),
            roles,
            max,
            lease_ms,
            now: now_ms(),
        })
    }

    #[tracing::instrument(skip_all, fields(session_id = %request.session_id, task_id = %request.task_id))]
    pub(crate) async fn fail_task(
        &self,
        request: pb::FailTaskRequest,
    ) -> Result<(Task, Option<i64>), Error> {
        require(&request.session_id, "session_id")?;
        require(&request.task_id, "task_id")?;
        let error = request.error.unwrap_or_else(|| pb::TaskError {
            kind: pb::ErrorKind::Unspecified as i32,
            message: "worker reported a failure without an error".to_owned(),
            retryable: false,
            details: Vec::new(),
        });
        // The attempt number is only known inside the transaction, so pass the policy in.
        let backoff_for = |attempt: u32| task::backoff(attempt, &mut rand::rng());
        let (task, retry_at) = lifecycle::fail::fail(
            &self.store,
            &request.session_id,
            &request.task_id,
            request.fencing_token,
            error,
            request.partial_result,
            backoff_for,
            now_ms(),
        )
        .await?;
        self.notify();
        let state = task.state;
        tracing::info!(
            attempt = task.attempt,
            state = task::state_name(state),
            "task attempt failed"
        );
        Ok((task, retry_at))
    }

    /// Returns expired leases and releases due retries until `shutdown`.
    pub(crate) async fn run_reaper(&self, interval: Duration, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut ticks: u32 = 0;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            match lifecycle::reap::reap(&self.store, now_ms()).await {
                Ok(0) => {}
                Ok(_) => self.notify(),
                Err(err) => tracing::warn!(error = %err, "reaper pass failed"),
            }
            ticks = ticks.wrapping_add(1);
            if ticks.is_multiple_of(GAP_SCAN_TICKS) {
                match self.report_capability_gaps(now_ms()).await {
                    Ok(0) => {}
                    Ok(_) => self.notify(),
                    Err(err) => tracing::warn!(error = %err, "capability gap scan failed"),
                }
            }
        }
    }

    /// Ready tasks grouped by session, and when each role was last served.
    pub(super) async fn gaps_by_session(
        &self,
        now: i64,
    ) -> Result<BTreeMap<String, Vec<pb::CapabilityGap>>, Error> {
        let ready = self.store.ready_tasks().await?;
        let mut out = BTreeMap::new();
        if ready.is_empty() {
            return Ok(out);
        }
        let seen = self.store.role_last_seen(0).await?;
        let mut by_session: BTreeMap<String, Vec<(String, pb::Role)>> = BTreeMap::new();
        for (session_id, task_id, role) in ready {
            by_session
                .entry(session_id)
                .or_default()
                .push((task_id, role));
        }
        for (session_id, ready) in by_session {
            let gaps =
                check::capability_gaps(&ready, &seen, self.started_at, now, self.capability_gap);
            if !gaps.is_empty() {
                out.insert(session_id, gaps);
            }
        }
        Ok(out)
    }

    /// Logs a `capability_gap` message per session and unserved role, once per gap (the
    /// idempotency key names the role and when it was last served, so coordinators sharing a
    /// database report it once too). Returns how many were new.
    async fn report_capability_gaps(&self, now: i64) -> Result<usize, Error> {
        let mut logged = 0;
        for (session_id, gaps) in self.gaps_by_session(now).await? {
            for gap in gaps {
                let unserved_ms = gap.unserved_for.map_or(0, |d| d.seconds * 1000);
                let since = (now - unserved_ms) / 10_000;
                let role = check::role_name(gap.role());
                let mut data = serde_json::Map::new();
                data.insert("role".into(), role.into());
                data.insert("task_ids".into(), gap.task_ids.clone().into());
                data.insert(
                    "covered_by".into(),
                    match gap.covered_by() {
                        pb::Role::Unspecified => serde_json::Value::Null,
                        other => check::role_name(other).into(),
                    },
                );
                let message = NewMessage {
                    from: "coordinator".to_owned(),
                    to: "user".to_owned(),
                    kind: "capability_gap".to_owned(),
                    summary: format!("[coordinator] capability_gap: {}", gap.message),
                    data: Some(data),
                    idempotency_key: Some(format!("capability_gap:{role}:{since}")),
                };
                let (_, created) = self.log(&session_id, message, now).await?;
                if created {
                    tracing::warn!(session_id = %session_id, role, "capability gap");
                    logged += 1;
                }
            }
        }
        Ok(logged)
    }
}

/// Logs each claimed task as claimed.
fn log_claimed(claimed: &[Claimed]) {
    for claimed in claimed {
        tracing::info!(session_id = %claimed.task.session_id, task_id = %claimed.task.id, attempt = claimed.task.attempt, "task claimed");
    }
}
