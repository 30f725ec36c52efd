//! The worker protocol (claim, heartbeat, complete, fail) and the background reaper with its
//! capability-gap scan.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use troupe_proto::v1 as pb;

use super::{
    Coordinator, DEFAULT_LEASE, GAP_SCAN_TICKS, MAX_CLAIM, MAX_PROGRESS_CHARS, MAX_WAIT,
    QUOTA_TICKS, duration, lease, millis, require,
};
use crate::Error;
use crate::check;
use crate::convert::now_ms;
use crate::lifecycle::{self, claim::ClaimRequest, claim::Claimed};
use crate::quota;
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
        self.quotas.release(
            &request.session_id,
            &request.task_id,
            request.fencing_token,
            now_ms(),
        );
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
        let backends = troupe_plan::backend::offered(&request.capabilities);
        self.touch_worker(&request.worker_id, &roles, backends.as_deref())
            .await;
        self.quotas
            .note_worker(&request.worker_id, request.auto_backend.trim());
        Ok(ClaimRequest {
            worker_id: request.worker_id.clone(),
            roles,
            backends,
            max,
            lease_ms,
            now: now_ms(),
            quotas: std::sync::Arc::clone(&self.quotas),
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
            ..pb::TaskError::default()
        });
        if let Some((backend, retry_after)) = quota::reported(&error) {
            let held = (
                request.session_id.as_str(),
                request.task_id.as_str(),
                request.fencing_token,
            );
            return self
                .put_back_rate_limited(held, error, backend, retry_after)
                .await;
        }
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
        self.quotas.release(
            &request.session_id,
            &request.task_id,
            request.fencing_token,
            now_ms(),
        );
        self.notify();
        let state = task.state;
        tracing::info!(
            attempt = task.attempt,
            state = task::state_name(state),
            "task attempt failed"
        );
        Ok((task, retry_at))
    }

    /// A worker's provider answered 429: claims of that backend pause cluster-wide until
    /// the time it named, and the task goes back to ready without counting the attempt.
    async fn put_back_rate_limited(
        &self,
        (session_id, task_id, token): (&str, &str, u64),
        error: pb::TaskError,
        backend: String,
        retry_after: Option<Duration>,
    ) -> Result<(Task, Option<i64>), Error> {
        let now = now_ms();
        let first_line = error.message.lines().next().unwrap_or_default().to_owned();
        // Paused first, so the task is not claimed again before the pause holds; released,
        // so its old attempt no longer counts in flight.
        let until = self.quotas.pause(&backend, retry_after, first_line, now);
        self.quotas.release(session_id, task_id, token, now);
        let reason = format!(
            "provider {backend} rate limited: claims of {backend} paused for {:.1}s; the attempt does not count",
            (until - now) as f64 / 1000.0
        );
        let task =
            lifecycle::fail::put_back(&self.store, session_id, task_id, token, error, &reason, now)
                .await?;
        let message = NewMessage {
            from: "coordinator".to_owned(),
            to: "user".to_owned(),
            kind: "quota".to_owned(),
            summary: format!(
                "[coordinator] quota: {reason} (task {}, worker report)",
                task.id
            ),
            data: None,
            idempotency_key: Some(format!("quota_pause:{backend}:{until}")),
        };
        self.log(session_id, message, now).await?;
        tracing::warn!(backend = %backend, paused_ms = until - now, task_id = %task.id, "provider rate limited, claims paused");
        self.notify();
        Ok((task, None))
    }

    /// Rebuilds the quota counts from the store's live tasks; logs a `quota` message per
    /// session whose ready tasks wait on one (once a minute per backend), and wakes parked
    /// claims while some wait (a pause ending or the minute moving on frees them).
    pub(crate) async fn rebuild_quotas(&self) -> Result<(), Error> {
        if !self.quotas.engaged() {
            return Ok(());
        }
        let now = now_ms();
        let live = self.store.live_tasks().await?;
        if !self.quotas.rebuild(&live, now) {
            return Ok(());
        }
        for (backend, session_id, count) in self.quotas.waiting() {
            let message = NewMessage {
                from: "coordinator".to_owned(),
                to: "user".to_owned(),
                kind: "quota".to_owned(),
                summary: format!(
                    "[coordinator] quota: {count} ready task(s) wait on {}",
                    self.quotas.summary(&backend, now)
                ),
                data: None,
                idempotency_key: Some(format!("quota_wait:{backend}:{}", now / 60_000)),
            };
            self.log(&session_id, message, now).await?;
        }
        self.notify();
        Ok(())
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
            if ticks.is_multiple_of(QUOTA_TICKS)
                && let Err(err) = self.rebuild_quotas().await
            {
                tracing::warn!(error = %err, "quota rebuild failed");
            }
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
        let mut out = BTreeMap::new();
        let seen = self.store.role_last_seen(0).await?;
        // Only the roles unserved for the threshold can have a role gap, and only routed tasks
        // no live worker offers a backend for a backend gap: a busy role's ready tasks (all of
        // a large session's, say) are not read every scan.
        let threshold = millis(self.capability_gap);
        let unserved: Vec<pb::Role> = <pb::Role as troupe_proto::names::Named>::ALL
            .iter()
            .copied()
            .filter(|role| {
                let last = seen.get(role).copied().unwrap_or(self.started_at);
                now - last.max(self.started_at) >= threshold
            })
            .collect();
        // What the workers seen within the gap threshold offer, per served role.
        let live_since = now - threshold;
        let mut offers = std::collections::HashMap::new();
        for role in <pb::Role as troupe_proto::names::Named>::ALL {
            if !unserved.contains(role) && *role != pb::Role::Unspecified {
                let live = self.store.offers(*role, live_since).await?;
                if !live.is_empty() {
                    offers.insert(*role, live);
                }
            }
        }
        let ready = self.store.ready_tasks(&unserved, &offers).await?;
        if ready.is_empty() {
            return Ok(out);
        }
        let mut by_session: BTreeMap<String, Vec<check::Ready>> = BTreeMap::new();
        for (session_id, task_id, role, routes) in ready {
            by_session
                .entry(session_id)
                .or_default()
                .push((task_id, role, routes));
        }
        for (session_id, ready) in by_session {
            let roles: Vec<(String, pb::Role)> = ready
                .iter()
                .map(|(id, role, _)| (id.clone(), *role))
                .collect();
            // Every ready task is listed here: the lists are their counts.
            let none = std::collections::HashMap::new();
            let mut gaps = check::capability_gaps(
                &roles,
                &none,
                &seen,
                self.started_at,
                now,
                self.capability_gap,
            );
            let unserved: Vec<pb::Role> = gaps.iter().map(pb::CapabilityGap::role).collect();
            gaps.extend(check::backend_gaps(
                &ready,
                &std::collections::HashMap::new(),
                &offers,
                &unserved,
            ));
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
                if !gap.backend.is_empty() {
                    data.insert("backend".into(), gap.backend.clone().into());
                }
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
                    idempotency_key: Some(if gap.backend.is_empty() {
                        format!("capability_gap:{role}:{since}")
                    } else {
                        // Once per backend, task set and session: no clock to age it by.
                        format!(
                            "capability_gap:{role}:{}:{}",
                            gap.backend,
                            gap.task_ids.join(",")
                        )
                    }),
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
