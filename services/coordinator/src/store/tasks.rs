//! The `tasks` table: a session's tasks, read whole, by id, as a batch's working set or in
//! claim order, and written back column by column.

use std::collections::HashMap;

use prost::Message as _;
use sqlx::any::AnyRow;
use sqlx::{Any, Row};
use troupe_plan::Role;
use troupe_proto::v1::{self as pb, SessionState, TaskState};

use super::intake::{insert_deps_of, values};
use super::{Store, Tx, corrupt, parse_object, to_i64, to_u32};
use crate::Error;
use crate::lifecycle::routing::{self, Filter};
use crate::task::{Task, Upstream};

const TASK_COLUMNS: &str = "session_id, id, position, title, description, role, priority, repo, \
     wave, critical_path, path_ms, depends_on, files, spec, state, attempt, max_attempts, fencing_token, \
     worker_id, lease_ms, lease_expires_at, not_before, created_at, started_at, finished_at, \
     progress, result, last_error, superseded_by, convergence, backends";

/// [`TASK_COLUMNS`] of a table named `t`.
pub(super) static QUALIFIED_COLUMNS: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    TASK_COLUMNS
        .split(", ")
        .map(|column| format!("t.{column}"))
        .collect::<Vec<_>>()
        .join(", ")
});

/// [`TASK_COLUMNS`] without `spec` (an empty object instead): for transactions that move the
/// graph without parsing every task's plan object; such rows are never written back whole
/// (the UPDATE leaves `spec` alone) nor sent to clients.
pub(crate) fn lite_columns() -> String {
    TASK_COLUMNS.replace(" spec,", " '{}' AS spec,")
}

/// A ready task of an active session: (session id, task id, role, its routes).
pub(crate) type ReadyTask = (String, String, pb::Role, Vec<String>);

/// JSON shape of a stored file change.
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct StoredFile {
    pub(super) path: String,
    pub(super) action: i32,
    pub(super) change: String,
}

pub(super) fn task_from_row(row: &AnyRow) -> Result<Task, Error> {
    let depends_on: String = row.try_get("depends_on")?;
    let files: String = row.try_get("files")?;
    let spec: String = row.try_get("spec")?;
    let files: Vec<StoredFile> = serde_json::from_str(&files).map_err(corrupt)?;
    let result: Option<Vec<u8>> = row.try_get("result")?;
    let last_error: Option<Vec<u8>> = row.try_get("last_error")?;
    let convergence: Option<Vec<u8>> = row.try_get("convergence")?;
    Ok(Task {
        session_id: row.try_get("session_id")?,
        id: row.try_get("id")?,
        position: row.try_get("position")?,
        title: row.try_get("title")?,
        description: row.try_get("description")?,
        role: pb::Role::try_from(row.try_get::<i32, _>("role")?).map_err(corrupt)?,
        priority: pb::Priority::try_from(row.try_get::<i32, _>("priority")?).map_err(corrupt)?,
        repo: row.try_get("repo")?,
        wave: to_u32(row.try_get("wave")?),
        critical_path: to_u32(row.try_get("critical_path")?),
        path_ms: u64::try_from(row.try_get::<i64, _>("path_ms")?).map_err(corrupt)?,
        depends_on: serde_json::from_str(&depends_on).map_err(corrupt)?,
        files: files
            .into_iter()
            .map(|file| pb::FileChange {
                path: file.path,
                action: file.action,
                change: file.change,
            })
            .collect(),
        spec: parse_object(&spec)?.into(),
        state: TaskState::try_from(row.try_get::<i32, _>("state")?).map_err(corrupt)?,
        attempt: to_u32(row.try_get("attempt")?),
        max_attempts: to_u32(row.try_get("max_attempts")?),
        fencing_token: u64::try_from(row.try_get::<i64, _>("fencing_token")?).map_err(corrupt)?,
        worker_id: row.try_get("worker_id")?,
        lease_ms: row.try_get("lease_ms")?,
        lease_expires_at: row.try_get("lease_expires_at")?,
        not_before: row.try_get("not_before")?,
        created_at: row.try_get("created_at")?,
        started_at: row.try_get("started_at")?,
        finished_at: row.try_get("finished_at")?,
        progress: row.try_get("progress")?,
        // Results stored before some closed sets were enums read as if written today.
        result: result
            .map(|bytes| pb::TaskResult::decode(bytes.as_slice()))
            .transpose()
            .map_err(corrupt)?
            .map(|mut result| {
                troupe_proto::legacy::upgrade_result(&mut result);
                Box::new(result)
            }),
        last_error: last_error
            .map(|bytes| pb::TaskError::decode(bytes.as_slice()))
            .transpose()
            .map_err(corrupt)?,
        superseded_by: row.try_get("superseded_by")?,
        convergence: convergence
            .map(|bytes| pb::TaskConvergence::decode(bytes.as_slice()))
            .transpose()
            .map_err(corrupt)?
            .map(|mut convergence| {
                troupe_proto::legacy::upgrade_convergence(&mut convergence);
                convergence
            }),
        backends: crate::lifecycle::routing::from_column(
            row.try_get::<Option<String>, _>("backends")?.as_deref(),
        ),
    })
}

pub(crate) async fn insert_task(tx: &mut Tx, task: &Task) -> Result<(), Error> {
    super::intake::insert_tasks(tx, std::slice::from_ref(task)).await
}

/// Replaces the dependency rows of tasks whose `depends_on` changed (a fix round re-points
/// the dependents of the task it supersedes).
pub(crate) async fn replace_deps(tx: &mut Tx, tasks: &[&Task]) -> Result<(), Error> {
    for task in tasks {
        tx.needs_lock("re-pointing dependencies")?;
        sqlx::query("DELETE FROM task_deps WHERE session_id = $1 AND task_id = $2")
            .bind(&task.session_id)
            .bind(&task.id)
            .execute(&mut **tx)
            .await?;
    }
    insert_deps_of(tx, tasks.iter().copied()).await
}

/// Writes a task's `convergence` (its criteria as a validator downstream checked them); false
/// when the session has no such task. Needs a transaction (not an optimistic write).
pub(crate) async fn set_convergence(
    tx: &mut Tx,
    session_id: &str,
    task_id: &str,
    convergence: &pb::TaskConvergence,
) -> Result<bool, Error> {
    tx.needs_lock("writing back convergence")?;
    let written =
        sqlx::query("UPDATE tasks SET convergence = $3 WHERE session_id = $1 AND id = $2")
            .bind(session_id)
            .bind(task_id)
            .bind(convergence.encode_to_vec())
            .execute(&mut **tx)
            .await?;
    Ok(written.rows_affected() > 0)
}

/// Writes a task's mutable columns.
pub(crate) async fn update_task(tx: &mut Tx, task: &Task) -> Result<(), Error> {
    update_tasks(tx, &[task]).await
}

/// The columns [`update_tasks`] writes, after `session_id` and `id`.
pub(super) const MUTABLE_COLUMNS: [&str; 16] = [
    "state",
    "attempt",
    "fencing_token",
    "worker_id",
    "lease_ms",
    "lease_expires_at",
    "not_before",
    "started_at",
    "finished_at",
    "progress",
    "result",
    "last_error",
    "max_attempts",
    "position",
    "depends_on",
    "superseded_by",
];

/// Writes the mutable columns of several tasks in one statement per chunk (an `UPDATE ...
/// FROM` a `VALUES` list, which both databases run): a group commit's transitions cost one
/// round trip, not one per task.
pub(super) async fn update_tasks(tx: &mut Tx, tasks: &[&Task]) -> Result<(), Error> {
    for chunk in tasks.chunks(TASK_ROWS) {
        tx.needs_lock("a task update without events")?;
        let sql = format!(
            "WITH v (session_id, id, {}) AS (VALUES {}) {}",
            MUTABLE_COLUMNS.join(", "),
            // Anonymous parameters on SQLite (see `values`): a session's first settling
            // updates every task.
            values(tx.dialect, chunk.len(), MUTABLE_COLUMNS.len() + 2),
            *UPDATE_FROM_V
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for task in chunk {
            query = bind_task(query, task)?;
        }
        query.execute(&mut **tx).await?;
    }
    Ok(())
}

/// Task rows per `UPDATE`: 18 parameters each, well below both databases' limits.
pub(super) const TASK_ROWS: usize = 200;

pub(super) type AnyQuery<'q> = sqlx::query::Query<'q, Any, sqlx::any::AnyArguments>;

/// `UPDATE tasks ... FROM v`, for a `v` of the session id, the id and [`MUTABLE_COLUMNS`].
pub(super) static UPDATE_FROM_V: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| update_from_v("", &[]));

/// The [`MUTABLE_COLUMNS`] that only a fix round or a resume changes (the graph's shape and
/// the retry budget): a worker's transitions leave them as they were.
const SHAPE_COLUMNS: [&str; 4] = ["max_attempts", "position", "depends_on", "superseded_by"];

/// [`UPDATE_FROM_V`] on SQLite inside a group's write, whose every failure rolls the whole
/// transaction back: `OR FAIL` spares SQLite the statement journal that a multi-row statement
/// which may abort keeps (a copy of every page it changes, to undo just that statement).
pub(super) static UPDATE_OR_FAIL_FROM_V: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| UPDATE_FROM_V.replacen("UPDATE tasks", "UPDATE OR FAIL tasks", 1));

/// [`UPDATE_OR_FAIL_FROM_V`] without [`SHAPE_COLUMNS`], for writes that change none of them:
/// SQLite rewrites the entries of every index on a column it sets, changed or not, and
/// `position` is in `tasks_position`.
pub(super) static UPDATE_OR_FAIL_FROM_V_LEAN: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| {
        update_from_v("", &SHAPE_COLUMNS).replacen("UPDATE tasks", "UPDATE OR FAIL tasks", 1)
    });

/// [`UPDATE_FROM_V`] joined with an optimistic write's `bump`, which vetoes every row when the
/// session's sequence moved (see `write_events`).
pub(super) static UPDATE_FROM_V_BUMP: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| update_from_v(", bump", &[]));

/// `UPDATE tasks ... FROM v{also}` (`also`: more from-items) of the [`MUTABLE_COLUMNS`] not
/// in `except`, built once per form above.
fn update_from_v(also: &str, except: &[&str]) -> String {
    format!(
        "UPDATE tasks SET {} FROM v{also} WHERE tasks.session_id = v.session_id AND tasks.id = v.id",
        MUTABLE_COLUMNS
            .iter()
            .filter(|column| !except.contains(column))
            .map(|column| format!("{column} = v.{column}"))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// Whether any of `changes` (a task's stored form, then the form to write) changed one of the
/// [`SHAPE_COLUMNS`].
pub(crate) fn reshaped<'a>(changes: impl IntoIterator<Item = (&'a Task, &'a Task)>) -> bool {
    changes.into_iter().any(|(old, new)| {
        old.max_attempts != new.max_attempts
            || old.position != new.position
            || old.depends_on != new.depends_on
            || old.superseded_by != new.superseded_by
    })
}

/// The `VALUES` rows of `rows` tasks for [`bind_task`], numbering parameters from `$first`.
pub(super) fn task_values(first: usize, rows: usize) -> String {
    super::intake::numbered(first, rows, MUTABLE_COLUMNS.len() + 2)
}

/// Binds a task's id and [`MUTABLE_COLUMNS`], in that order.
pub(super) fn bind_task<'q>(query: AnyQuery<'q>, task: &'q Task) -> Result<AnyQuery<'q>, Error> {
    Ok(query
        .bind(&task.session_id)
        .bind(&task.id)
        .bind(task.state as i32)
        .bind(i64::from(task.attempt))
        .bind(to_i64(task.fencing_token))
        .bind(&task.worker_id)
        .bind(task.lease_ms)
        .bind(task.lease_expires_at)
        .bind(task.not_before)
        .bind(task.started_at)
        .bind(task.finished_at)
        .bind(&task.progress)
        .bind(task.result.as_ref().map(prost::Message::encode_to_vec))
        .bind(task.last_error.as_ref().map(prost::Message::encode_to_vec))
        .bind(i64::from(task.max_attempts))
        .bind(task.position)
        .bind(serde_json::to_string(&task.depends_on).map_err(corrupt)?)
        .bind(&task.superseded_by))
}

/// Loads a session's tasks in topological order, with the session's `last_seq` as of the same
/// read (`None` when it has no task): every change to its tasks moves the sequence, so the
/// tasks are as of it. Writers call [`super::sessions::lock_session`] first: the session row
/// lock serialises every writer of a session, so what they read stays current.
pub(crate) async fn load_tasks(
    tx: &mut Tx,
    session_id: &str,
) -> Result<(Vec<Task>, Option<u64>), Error> {
    use futures::TryStreamExt as _;
    // The subquery does not depend on the row: both databases run it once.
    let sql = format!(
        "SELECT {TASK_COLUMNS}, (SELECT last_seq FROM sessions WHERE id = $1) AS session_seq \
         FROM tasks WHERE session_id = $1 ORDER BY position"
    );
    // Row by row: a session's rows and its tasks are never in memory together (the task
    // cache loads sessions of up to 50,000 tasks this way).
    let mut rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(session_id)
        .fetch(&mut **tx);
    let mut tasks = Vec::new();
    let mut sequence = None;
    while let Some(row) = rows.try_next().await? {
        if sequence.is_none() {
            let at: i64 = row.try_get("session_seq")?;
            sequence = Some(u64::try_from(at).map_err(corrupt)?);
        }
        tasks.push(task_from_row(&row)?);
    }
    Ok((tasks, sequence))
}

/// How many tasks a session has.
pub(crate) async fn count_tasks(tx: &mut Tx, session_id: &str) -> Result<usize, Error> {
    let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM tasks WHERE session_id = $1")
        .bind(session_id)
        .fetch_one(&mut **tx)
        .await?;
    usize::try_from(count).map_err(corrupt)
}

/// Loads a session's tasks without their `spec` (left empty): what write transactions need
/// to move the graph, without parsing every task's plan object. Never written back (the
/// UPDATE leaves `spec` alone) nor sent to clients.
pub(crate) async fn load_tasks_lite(tx: &mut Tx, session_id: &str) -> Result<Vec<Task>, Error> {
    let columns = lite_columns();
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {columns} FROM tasks WHERE session_id = $1 ORDER BY position"
    )))
    .bind(session_id)
    .fetch_all(&mut **tx)
    .await?;
    rows.iter().map(task_from_row).collect()
}

/// Loads up to `limit` ready tasks of `roles` (any when empty) of a session, best first (the
/// claim order).
pub(crate) async fn load_claimable(
    tx: &mut Tx,
    session_id: &str,
    (roles, offer): Filter<'_>,
    limit: usize,
) -> Result<Vec<Task>, Error> {
    let role_filter = role_filter("role", roles, 3);
    let (routing, patterns) = routing::sql_filter("backends", offer, 3 + roles.len());
    // The state is a constant in the statement (see `Store::pick_sessions`).
    let mut query = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {TASK_COLUMNS} FROM tasks WHERE session_id = $1 AND state = {}{role_filter}{routing} \
         ORDER BY priority, path_ms DESC, created_at, position LIMIT $2",
        TaskState::Ready as i32
    )))
    .bind(session_id)
    .bind(i64::try_from(limit).unwrap_or(i64::MAX));
    for role in roles {
        query = query.bind(*role as i32);
    }
    for pattern in patterns {
        query = query.bind(pattern);
    }
    let rows = query.fetch_all(&mut **tx).await?;
    rows.iter().map(task_from_row).collect()
}

pub(crate) async fn load_task(tx: &mut Tx, session_id: &str, task_id: &str) -> Result<Task, Error> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {TASK_COLUMNS} FROM tasks WHERE session_id = $1 AND id = $2"
    )))
    .bind(session_id)
    .bind(task_id)
    .fetch_optional(&mut **tx)
    .await?
    .ok_or_else(|| Error::NotFound(format!("task {task_id} not found in session {session_id}")))?;
    task_from_row(&row)
}

/// Loads tasks of a session by id (those that exist), with `columns` (all, or without `spec`),
/// in one query per chunk under the bind limits.
pub(crate) async fn load_tasks_by_id(
    tx: &mut Tx,
    session_id: &str,
    ids: &[String],
    columns: &str,
) -> Result<HashMap<String, Task>, Error> {
    let mut out = HashMap::with_capacity(ids.len());
    for chunk in ids.chunks(256) {
        let width = padded(chunk.len());
        let placeholders: Vec<String> = (0..width).map(|i| format!("${}", i + 2)).collect();
        let mut query = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {columns} FROM tasks WHERE session_id = $1 AND id IN ({})",
            placeholders.join(", ")
        )))
        .bind(session_id);
        for i in 0..width {
            query = query.bind(&chunk[i.min(chunk.len() - 1)]);
        }
        for row in query.fetch_all(&mut **tx).await? {
            let task = task_from_row(&row)?;
            out.insert(task.id.clone(), task);
        }
    }
    Ok(out)
}

/// The length an `IN (...)` list of `n` items is padded to (repeating its last item): a power
/// of two, so a few prepared statements serve every length instead of one per length (each
/// new one costs a prepare, and they crowd the connection's statement cache).
fn padded(n: usize) -> usize {
    n.next_power_of_two()
}

/// `AND <column> = $n` for one role (an equality keeps the claim index's order), `IN` for
/// several, nothing for any role; the roles bind from `$first` on.
pub(super) fn role_filter(column: &str, roles: &[pb::Role], first: usize) -> String {
    match roles.len() {
        0 => String::new(),
        1 => format!(" AND {column} = ${first}"),
        n => {
            let placeholders: Vec<String> = (first..first + n).map(|i| format!("${i}")).collect();
            format!(" AND {column} IN ({})", placeholders.join(", "))
        }
    }
}

/// Whether any of a session's tasks is in one of `states` (an index probe, not a count).
pub(crate) async fn any_task_in(
    tx: &mut Tx,
    session_id: &str,
    states: &[TaskState],
) -> Result<bool, Error> {
    // The states are written into the statement (see [`Store::pick_sessions`]).
    let states: Vec<String> = states
        .iter()
        .map(|state| (*state as i32).to_string())
        .collect();
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 AS found FROM tasks WHERE session_id = $1 AND state IN ({}) LIMIT 1",
        states.join(", ")
    )))
    .bind(session_id)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(row.is_some())
}

/// What a batch works on: the tasks it completes, their pending dependents, the best ready
/// tasks for its claims, and whether another task is ready or running.
#[derive(Debug, Default)]
pub(crate) struct Gathered {
    pub(crate) originals: HashMap<String, Task>,
    /// In plan order.
    pub(crate) dependents: Vec<Task>,
    /// In claim order.
    pub(crate) ready: Vec<Task>,
    pub(crate) busy: bool,
}

/// Reads what a batch completing `ids` and claiming `wanted` tasks of `roles` works on, in
/// one statement (per 128 ids).
pub(crate) async fn read_batch(
    tx: &mut Tx,
    session_id: &str,
    ids: &[String],
    (roles, offer): Filter<'_>,
    wanted: usize,
) -> Result<Gathered, Error> {
    let mut originals: HashMap<String, Task> = HashMap::with_capacity(ids.len());
    let mut dependents: Vec<Task> = Vec::new();
    let mut ready: Vec<Task> = Vec::new();
    // Per chunk of ids (the first also reads the ready tasks; with no ids, only that): the
    // tasks, the pending tasks naming one of them among their dependencies (found through
    // `task_deps`), the best ready tasks.
    let mut chunks: Vec<&[String]> = ids.chunks(128).collect();
    if chunks.is_empty() {
        chunks.push(&[]);
    }
    let single = chunks.len() == 1;
    // Some task outside the batch is ready or running (known with one chunk of ids).
    let mut busy = false;
    for (n, chunk) in chunks.into_iter().enumerate() {
        let read_ready = n == 0 && wanted > 0;
        if chunk.is_empty() && !read_ready {
            continue;
        }
        let mut parts = Vec::new();
        let mut next = 2;
        let mut param = || {
            let name = format!("${next}");
            next += 1;
            name
        };
        // Padded (see `padded`): the last id repeats.
        let width = padded(chunk.len());
        let repeat = |i: usize| &chunk[i.min(chunk.len().saturating_sub(1))];
        if !chunk.is_empty() {
            let these: Vec<String> = (0..width).map(|_| param()).collect();
            parts.push(format!(
                "SELECT {TASK_COLUMNS} FROM tasks WHERE session_id = $1 AND id IN ({})",
                these.join(", ")
            ));
            // Their pending dependents, through the dependency index. States are constants
            // in the statement (see `pick_sessions`).
            // From `task_deps` to the tasks (CROSS JOIN keeps that order on SQLite, whose
            // planner would otherwise walk every pending task of the session); a task waiting
            // on two of them comes twice, and is kept once below.
            parts.push(format!(
                "SELECT {} FROM task_deps d CROSS JOIN tasks t WHERE d.session_id = $1 \
                 AND d.dep_id IN ({}) AND t.session_id = d.session_id AND t.id = d.task_id \
                 AND t.state = {}",
                *QUALIFIED_COLUMNS,
                these.join(", "),
                TaskState::Pending as i32,
            ));
            if single {
                // Whether any other task is ready or running: then the session goes on
                // whatever this batch does, and needs no end check.
                parts.push(format!(
                    "SELECT * FROM (SELECT {TASK_COLUMNS} FROM tasks WHERE session_id = $1 \
                     AND state IN ({}, {}) AND id NOT IN ({}) LIMIT 1) o",
                    TaskState::Ready as i32,
                    TaskState::Running as i32,
                    these.join(", ")
                ));
            }
        }
        if read_ready {
            let state = TaskState::Ready as i32;
            let limit = param();
            let first_role: usize = next;
            let (routing, _) = routing::sql_filter("backends", offer, first_role + roles.len());
            parts.push(format!(
                "SELECT * FROM (SELECT {TASK_COLUMNS} FROM tasks WHERE session_id = $1 AND state = {state}{}{routing} \
                 ORDER BY priority, path_ms DESC, created_at, position LIMIT {limit}) r",
                role_filter("role", roles, first_role)
            ));
        }
        let mut query =
            sqlx::query(sqlx::AssertSqlSafe(parts.join(" UNION ALL "))).bind(session_id);
        if !chunk.is_empty() {
            for i in 0..width {
                query = query.bind(repeat(i));
            }
        }
        if read_ready {
            query = query.bind(i64::try_from(wanted).unwrap_or(i64::MAX));
            for role in roles {
                query = query.bind(*role as i32);
            }
            for pattern in routing::sql_filter("backends", offer, 0).1 {
                query = query.bind(pattern);
            }
        }
        for row in query.fetch_all(&mut **tx).await? {
            let task = task_from_row(&row)?;
            let completing = ids.contains(&task.id);
            busy |= !completing && matches!(task.state, TaskState::Ready | TaskState::Running);
            if completing {
                originals.insert(task.id.clone(), task);
            } else if task.state == TaskState::Ready {
                if !ready.iter().any(|known| known.id == task.id) {
                    ready.push(task);
                }
            } else if task.depends_on.iter().any(|dep| ids.contains(dep))
                && !dependents.iter().any(|known| known.id == task.id)
            {
                dependents.push(task);
            }
        }
    }
    dependents.sort_by_key(|task| task.position);
    Ok(Gathered {
        originals,
        dependents,
        ready,
        busy,
    })
}

/// How many completed tasks beyond its direct dependencies a checker's (validator's) claim
/// carries at most, nearest first (breadth-first up the graph).
pub(crate) const MAX_UPSTREAM: usize = 256;

/// The completed tasks upstream of each of `tasks`, in plan order: its direct dependencies;
/// for a checker (validator) also their completed ancestors, nearest first, up to
/// [`MAX_UPSTREAM`] in all (a VALIDATE task checks what the tasks before its test run
/// promised). Found through the primary key and `task_deps`, never by reading the session, so a
/// claim costs what it returns.
pub(crate) async fn load_upstream(
    tx: &mut Tx,
    session_id: &str,
    tasks: &[&Task],
) -> Result<HashMap<String, Vec<Upstream>>, Error> {
    let mut out = HashMap::new();
    if tasks.iter().all(|task| task.depends_on.is_empty()) {
        return Ok(out);
    }
    let mut wanted: Vec<String> = Vec::new();
    let mut per_task: Vec<(String, Vec<String>)> = Vec::new();
    for task in tasks {
        let mut ids: Vec<String> = task.depends_on.clone();
        if task.role == pb::Role::Validator {
            ancestors(tx, session_id, &mut ids).await?;
        }
        for id in &ids {
            if !wanted.contains(id) {
                wanted.push(id.clone());
            }
        }
        per_task.push((task.id.clone(), ids));
    }
    // Checkers read what their upstream tasks promised (criteria, verification) from the
    // upstream specs; other roles need only the results.
    let columns = if tasks.iter().any(|task| task.role == pb::Role::Validator) {
        TASK_COLUMNS.to_owned()
    } else {
        lite_columns()
    };
    let loaded = load_tasks_by_id(tx, session_id, &wanted, &columns).await?;
    for (task_id, ids) in per_task {
        let mut upstream: Vec<Upstream> = ids
            .iter()
            .filter_map(|id| loaded.get(id))
            .filter(|task| task.state == TaskState::Completed)
            .map(Upstream::from)
            .collect();
        upstream.sort_by_key(|task| task.position);
        out.insert(task_id, upstream);
    }
    Ok(out)
}

/// Extends `ids` (direct dependencies) with their ancestors, level by level through
/// `task_deps`, until [`MAX_UPSTREAM`] beyond the direct ones (one query per level).
async fn ancestors(tx: &mut Tx, session_id: &str, ids: &mut Vec<String>) -> Result<(), Error> {
    let limit = ids.len() + MAX_UPSTREAM;
    let mut seen: std::collections::HashSet<String> = ids.iter().cloned().collect();
    let mut level: Vec<String> = ids.clone();
    while !level.is_empty() && ids.len() < limit {
        let mut next = Vec::new();
        for chunk in level.chunks(256) {
            let width = padded(chunk.len());
            let placeholders: Vec<String> = (0..width).map(|i| format!("${}", i + 2)).collect();
            let mut query = sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT dep_id FROM task_deps WHERE session_id = $1 AND task_id IN ({}) \
                 ORDER BY task_id, dep_id",
                placeholders.join(", ")
            )))
            .bind(session_id);
            for i in 0..width {
                query = query.bind(&chunk[i.min(chunk.len() - 1)]);
            }
            for row in query.fetch_all(&mut **tx).await? {
                let dep: String = row.try_get("dep_id")?;
                if ids.len() < limit && seen.insert(dep.clone()) {
                    ids.push(dep.clone());
                    next.push(dep);
                }
            }
        }
        level = next;
    }
    Ok(())
}

/// How many of the newest completed tasks [`Store::learned_durations`] learns from.
const LEARNED_TASKS: u32 = 500;

/// How many completed tasks a role needs before its median counts.
const LEARNED_MIN: usize = 3;

impl Store {
    /// What each role's tasks took lately: the median, in milliseconds, of the last attempt
    /// (the one that succeeded) of the newest [`LEARNED_TASKS`] completed tasks in the
    /// `sessions` newest sessions, for roles with at least [`LEARNED_MIN`] of them.
    /// It reads only those sessions' tasks (through the sessions' creation index and the
    /// tasks' primary key), however long the history.
    pub(crate) async fn learned_durations(
        &self,
        sessions: u32,
    ) -> Result<HashMap<Role, u64>, Error> {
        if sessions == 0 {
            return Ok(HashMap::new());
        }
        let mut conn = self.reader.acquire().await?;
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT role, finished_at - started_at AS took FROM tasks \
             WHERE session_id IN (SELECT id FROM sessions ORDER BY created_at DESC LIMIT {sessions}) \
             AND state = $1 AND started_at IS NOT NULL AND finished_at IS NOT NULL \
             ORDER BY finished_at DESC LIMIT {LEARNED_TASKS}"
        )))
        .bind(TaskState::Completed as i32)
        .fetch_all(&mut *conn)
        .await?;
        let mut took: HashMap<Role, Vec<u64>> = HashMap::new();
        for row in rows {
            let role = pb::Role::try_from(row.try_get::<i32, _>("role")?).map_err(corrupt)?;
            let Some(role) = Role::from_proto(role) else {
                continue;
            };
            let ms = u64::try_from(row.try_get::<i64, _>("took")?).unwrap_or(0);
            took.entry(role).or_default().push(ms);
        }
        Ok(took
            .into_iter()
            .filter(|(_, took)| took.len() >= LEARNED_MIN)
            .map(|(role, mut took)| {
                took.sort_unstable();
                // At least 1 ms, so chains of a role that takes no time still rank by length.
                (role, took[took.len() / 2].max(1))
            })
            .collect())
    }

    /// How many tasks there are of each role and state, and whether their session is active
    /// (for the metrics): one grouped read of every session.
    pub(crate) async fn task_counts(&self) -> Result<Vec<(pb::Role, TaskState, bool, u64)>, Error> {
        let mut conn = self.reader.acquire().await?;
        let rows = sqlx::query(
            "SELECT t.role AS role, t.state AS state, s.state AS session_state, COUNT(*) AS n \
             FROM tasks t JOIN sessions s ON s.id = t.session_id \
             GROUP BY t.role, t.state, s.state",
        )
        .fetch_all(&mut *conn)
        .await?;
        drop(conn);
        rows.iter()
            .map(|row| {
                Ok((
                    pb::Role::try_from(row.try_get::<i32, _>("role")?).map_err(corrupt)?,
                    TaskState::try_from(row.try_get::<i32, _>("state")?).map_err(corrupt)?,
                    row.try_get::<i32, _>("session_state")? == SessionState::Active as i32,
                    u64::try_from(row.try_get::<i64, _>("n")?).map_err(corrupt)?,
                ))
            })
            .collect()
    }

    /// The sessions with a lease that expired before `now` or a retry due by then (for the
    /// reaper).
    pub(crate) async fn sessions_due(&self, now: i64) -> Result<Vec<String>, Error> {
        let mut conn = self.reader.acquire().await?;
        // The states are constants in the statement: each half is a range of its partial
        // index (`tasks_lease`, `tasks_due`), whose condition a parameter would not match.
        let sql = format!(
            "SELECT session_id FROM tasks WHERE state = {} AND lease_expires_at < $1 \
             UNION SELECT session_id FROM tasks WHERE state = {} AND not_before IS NOT NULL \
             AND not_before <= $1",
            TaskState::Running as i32,
            TaskState::Pending as i32,
        );
        let due = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(now)
            .fetch_all(&mut *conn)
            .await?;
        drop(conn);
        due.iter()
            .map(|row| Ok(row.try_get("session_id")?))
            .collect()
    }
}

/// Which of a session's tasks a listing wants (every filter given must hold).
#[derive(Debug, Default, Clone)]
pub(crate) struct TaskFilter {
    /// Any state when empty.
    pub(crate) states: Vec<TaskState>,
    /// Any role when empty.
    pub(crate) roles: Vec<pb::Role>,
    pub(crate) repo: Option<String>,
    pub(crate) id_prefix: Option<String>,
}

/// Up to `limit` tasks of a session matching `filter`, in plan order, after position `after`
/// (an index range of `tasks_position`, or of `tasks_state_position` for one state), and
/// whether more match.
pub(crate) async fn list_tasks(
    tx: &mut Tx,
    session_id: &str,
    filter: &TaskFilter,
    after: Option<i64>,
    limit: usize,
) -> Result<(Vec<Task>, bool), Error> {
    let mut next = 1;
    let mut param = || {
        next += 1;
        format!("${next}")
    };
    // Always bounded below (-1: the first page), so the page is a range of an index that
    // ends in `position` (`tasks_state_position` when filtered by state).
    let mut sql = format!(
        "SELECT {TASK_COLUMNS} FROM tasks WHERE session_id = $1 AND position > {}",
        param()
    );
    if !filter.states.is_empty() {
        // States and roles are enum numbers, written into the statement.
        let states: Vec<String> = filter
            .states
            .iter()
            .map(|state| (*state as i32).to_string())
            .collect();
        sql.push_str(&format!(" AND state IN ({})", states.join(", ")));
    }
    if !filter.roles.is_empty() {
        let roles: Vec<String> = filter
            .roles
            .iter()
            .map(|role| (*role as i32).to_string())
            .collect();
        sql.push_str(&format!(" AND role IN ({})", roles.join(", ")));
    }
    if filter.repo.is_some() {
        sql.push_str(&format!(" AND repo = {}", param()));
    }
    if let Some(prefix) = &filter.id_prefix {
        // substr, not LIKE: no wildcards to escape in the prefix.
        sql.push_str(&format!(
            " AND substr(id, 1, {}) = {}",
            prefix.chars().count(),
            param()
        ));
    }
    sql.push_str(&format!(" ORDER BY position LIMIT {}", param()));
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(session_id)
        .bind(after.unwrap_or(-1));
    if let Some(repo) = &filter.repo {
        query = query.bind(repo.clone());
    }
    if let Some(prefix) = &filter.id_prefix {
        query = query.bind(prefix.clone());
    }
    query = query.bind(i64::try_from(limit + 1).unwrap_or(i64::MAX));
    let rows = query.fetch_all(&mut **tx).await?;
    let more = rows.len() > limit;
    let tasks = rows
        .iter()
        .take(limit)
        .map(task_from_row)
        .collect::<Result<_, _>>()?;
    Ok((tasks, more))
}

/// Per repository of a session: its tasks' counts and the deepest commit landed on its
/// branch (from the results, read as a stream: memory stays bounded however many tasks).
pub(crate) async fn repo_stats(
    tx: &mut Tx,
    session_id: &str,
) -> Result<HashMap<String, (pb::TaskCounts, u64, String)>, Error> {
    use futures::TryStreamExt as _;
    let mut out: HashMap<String, (pb::TaskCounts, u64, String)> = HashMap::new();
    let mut rows = sqlx::query("SELECT repo, state, result FROM tasks WHERE session_id = $1")
        .bind(session_id)
        .fetch(&mut **tx);
    while let Some(row) = rows.try_next().await? {
        let repo: String = row.try_get("repo")?;
        let state = TaskState::try_from(row.try_get::<i32, _>("state")?).map_err(corrupt)?;
        let result: Option<Vec<u8>> = row.try_get("result")?;
        let entry = out.entry(repo).or_default();
        super::sessions::add_count(&mut entry.0, state, 1);
        if let Some(bytes) = result {
            let result = pb::TaskResult::decode(bytes.as_slice()).map_err(corrupt)?;
            if result.branch_depth > entry.1 {
                entry.1 = result.branch_depth;
                entry.2 = result.commit;
            }
        }
    }
    Ok(out)
}
