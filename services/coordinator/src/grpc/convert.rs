//! The wire forms of what the domain returns: tasks, sessions, claims, a session's check.
//! Only the adapter ([`super`]) builds responses; the domain works on [`Task`],
//! [`SessionRow`] and the other stored forms.

use troupe_proto::v1 as pb;

use crate::Error;
use crate::check;
use crate::convert::{json_to_struct, opt_timestamp, timestamp};
use crate::lifecycle::claim::Claimed;
use crate::service::page_token;
use crate::service::{Created, SessionCheck};
use crate::store::sessions::{SessionPage, SessionRow, SessionSummary, SessionView, add_count};
use crate::task::Task;

/// The wire form of claimed tasks.
pub(super) fn claimed_protos(claimed: Vec<Claimed>) -> Vec<pb::ClaimedTask> {
    claimed
        .into_iter()
        .map(|claimed| pb::ClaimedTask {
            // Each attempt is a trace of its own, opened here and joined by its worker.
            traceparent: troupe_telemetry::spans::claim_span(troupe_telemetry::spans::AttemptIds {
                session_id: &claimed.task.session_id,
                task_id: &claimed.task.id,
                attempt: claimed.task.attempt,
                role: crate::check::role_name(claimed.task.role),
            }),
            lease: Some(pb::Lease {
                fencing_token: claimed.task.fencing_token,
                expires_at: opt_timestamp(claimed.task.lease_expires_at),
                attempt: claimed.task.attempt,
            }),
            task: Some(task_proto(&claimed.task)),
            repo: claimed.repo,
            repos: claimed.repos,
            assets_digest: claimed.assets_digest,
            upstream: claimed
                .upstream
                .iter()
                .map(|dep| pb::UpstreamResult {
                    repo: dep.repo.clone(),
                    spec: (!dep.spec.is_empty()).then(|| json_to_struct(&dep.spec)),
                    task_id: dep.id.clone(),
                    role: dep.role as i32,
                    files: dep.files.clone(),
                    result: dep.result.as_deref().cloned(),
                })
                .collect(),
            plan_dir: claimed.plan_dir,
        })
        .collect()
}

/// Returns the wire form of a stored task.
pub(super) fn task_proto(row: &Task) -> pb::Task {
    pb::Task {
        session_id: row.session_id.clone(),
        id: row.id.clone(),
        title: row.title.clone(),
        description: row.description.clone(),
        role: row.role as i32,
        state: row.state as i32,
        priority: row.priority as i32,
        depends_on: row.depends_on.clone(),
        repo: row.repo.clone(),
        attempt: row.attempt,
        max_attempts: row.max_attempts,
        wave: row.wave,
        spec: Some(json_to_struct(&row.spec)),
        files: row.files.clone(),
        result: row.result.as_deref().cloned(),
        last_error: row.last_error.clone(),
        worker_id: row.worker_id.clone(),
        created_at: Some(timestamp(row.created_at)),
        started_at: opt_timestamp(row.started_at),
        finished_at: opt_timestamp(row.finished_at),
        progress: row.progress.clone(),
        superseded_by: row.superseded_by.clone(),
        convergence: row.convergence.clone(),
        // Filled from the coordinator's memory where the caller has it (`GetSession`,
        // `ListTasks`).
        work_progress: None,
    }
}

fn session_proto(
    session: &SessionRow,
    repos: Vec<pb::SessionRepo>,
    counts: pb::TaskCounts,
) -> pb::Session {
    pb::Session {
        id: session.id.clone(),
        name: session.name.clone(),
        description: session.description.clone(),
        state: session.state as i32,
        repos,
        counts: Some(counts),
        created_at: Some(timestamp(session.created_at)),
        updated_at: Some(timestamp(session.updated_at)),
        last_sequence: session.last_seq,
        mode: session.mode.to_proto() as i32,
        on_failure: session.on_failure.to_proto() as i32,
    }
}

fn counts_of(tasks: &[Task]) -> pb::TaskCounts {
    let mut counts = pb::TaskCounts::default();
    for task in tasks {
        add_count(&mut counts, task.state, 1);
    }
    counts
}

pub(super) fn view_proto(view: SessionView) -> (pb::Session, Vec<pb::Task>) {
    let counts = counts_of(&view.tasks);
    let mut repos = view.repos;
    for repo in &mut repos {
        let tasks: Vec<&Task> = view.tasks.iter().filter(|t| t.repo == repo.name).collect();
        let mut counts = pb::TaskCounts::default();
        for task in &tasks {
            add_count(&mut counts, task.state, 1);
        }
        repo.counts = Some(counts);
        // The deepest landing is the branch's head: every landing deepens the branch.
        repo.head = tasks
            .iter()
            .filter_map(|t| t.result.as_ref())
            .filter(|r| r.branch_depth > 0)
            .max_by_key(|r| r.branch_depth)
            .map(|r| r.commit.clone())
            .unwrap_or_default();
    }
    let session = session_proto(&view.session, repos, counts);
    (session, view.tasks.iter().map(task_proto).collect())
}

/// The wire form of a session's page (`GetSession`).
pub(super) fn page_proto(page: SessionPage) -> pb::GetSessionResponse {
    pb::GetSessionResponse {
        session: Some(session_proto(&page.session, page.repos, page.counts)),
        tasks: page.tasks.iter().map(task_proto).collect(),
        next_page_token: page.next.map(page_token).unwrap_or_default(),
    }
}

/// The wire form of `CreateSession`'s answer: the session with its counts and a page of tasks.
pub(super) fn created_proto(created: Created) -> pb::CreateSessionResponse {
    match created {
        Created::DryRun { view, max, waves } => {
            let (session, mut tasks) = view_proto(view);
            tasks.truncate(max);
            pb::CreateSessionResponse {
                session: Some(session),
                tasks,
                next_page_token: String::new(),
                waves,
            }
        }
        Created::Stored { page, waves } => {
            let page = page_proto(page);
            pb::CreateSessionResponse {
                session: page.session,
                tasks: page.tasks,
                next_page_token: page.next_page_token,
                waves,
            }
        }
    }
}

/// The wire form of a session with its repositories and task counts.
pub(super) fn summary_proto(summary: SessionSummary) -> pb::Session {
    session_proto(&summary.session, summary.repos, summary.counts)
}

/// The wire form of CCW's `check` of a session (see [`check::status`]).
pub(super) fn check_proto(check: SessionCheck) -> pb::CheckSessionResponse {
    let rows = check.rows;
    let session = session_proto(&rows.session, rows.repos.clone(), rows.counts);
    let mut response = check::status(
        session,
        &rows,
        check.blockers,
        &check.progress,
        check.gaps,
        check.now,
    );
    response.quota_waits = check.quota_waits;
    response
}

/// The plan assets stored under `digest`: the bundle is their encoded wire form.
pub(super) fn plan_assets_proto(
    digest: &str,
    bundle: &[u8],
) -> Result<pb::GetPlanAssetsResponse, Error> {
    prost::Message::decode(bundle)
        .map_err(|err| Error::Corrupt(format!("plan assets {digest}: {err}")))
}
