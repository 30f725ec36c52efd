//! Intake's writes: a new session's tasks, their dependency rows and its first events, in as
//! few statements as the databases allow (multi-row `INSERT`s; on SQLite with anonymous
//! parameters, see [`values`]).

use troupe_proto::v1::{self as pb, session_event::Kind};

use super::events::{event_payload, next_seq};
use super::tasks::StoredFile;
use super::{Dialect, Tx, corrupt, to_i64};
use crate::Error;
use crate::task::Task;

/// Columns [`insert_tasks`] binds per row (the others take their defaults).
const INSERT_COLUMNS: [&str; 20] = [
    "session_id",
    "id",
    "position",
    "title",
    "description",
    "role",
    "priority",
    "repo",
    "wave",
    "critical_path",
    "path_ms",
    "depends_on",
    "files",
    "spec",
    "state",
    "max_attempts",
    "created_at",
    "finished_at",
    "result",
    "backends",
];

/// The most parameters one statement binds: SQLite's default limit is 32,766, PostgreSQL's
/// 65,535.
const MAX_PARAMS: usize = 32_000;

/// Rows per statement for rows of `width` parameters.
fn rows_per_statement(width: usize) -> usize {
    MAX_PARAMS / width
}

/// Stores new tasks and their dependency rows, a few statements for thousands of tasks.
pub(crate) async fn insert_tasks(tx: &mut Tx, tasks: &[Task]) -> Result<(), Error> {
    for chunk in tasks.chunks(rows_per_statement(INSERT_COLUMNS.len())) {
        let sql = format!(
            "INSERT INTO tasks ({}) VALUES {}",
            INSERT_COLUMNS.join(", "),
            values(tx.dialect, chunk.len(), INSERT_COLUMNS.len())
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for task in chunk {
            let files: Vec<StoredFile> = task
                .files
                .iter()
                .map(|file| StoredFile {
                    path: file.path.clone(),
                    action: file.action,
                    change: file.change.clone(),
                })
                .collect();
            query = query
                .bind(&task.session_id)
                .bind(&task.id)
                .bind(task.position)
                .bind(&task.title)
                .bind(&task.description)
                .bind(task.role as i32)
                .bind(task.priority as i32)
                .bind(&task.repo)
                .bind(i64::from(task.wave))
                .bind(i64::from(task.critical_path))
                .bind(i64::try_from(task.path_ms).unwrap_or(i64::MAX))
                .bind(serde_json::to_string(&task.depends_on).map_err(corrupt)?)
                .bind(serde_json::to_string(&files).map_err(corrupt)?)
                .bind(serde_json::to_string(&task.spec).map_err(corrupt)?)
                .bind(task.state as i32)
                .bind(i64::from(task.max_attempts))
                .bind(task.created_at)
                .bind(task.finished_at)
                .bind(task.result.as_ref().map(prost::Message::encode_to_vec))
                .bind(crate::lifecycle::routing::to_column(&task.backends));
        }
        query.execute(&mut **tx).await?;
    }
    insert_deps_of(tx, tasks).await
}

/// Stores the dependency rows of `tasks` (one per task and dependency).
pub(super) async fn insert_deps_of<'a>(
    tx: &mut Tx,
    tasks: impl IntoIterator<Item = &'a Task>,
) -> Result<(), Error> {
    let deps: Vec<(&str, &str, &str)> = tasks
        .into_iter()
        .flat_map(|task| {
            task.depends_on
                .iter()
                .map(|dep| (task.session_id.as_str(), task.id.as_str(), dep.as_str()))
        })
        .collect();
    insert_deps(tx, &deps).await
}

/// Appends a new session's task transitions to its events, after those held back in `tx`:
/// numbered at once, written a few thousand a statement.
pub(crate) async fn insert_transitions(
    tx: &mut Tx,
    session_id: &str,
    now: i64,
    transitions: Vec<pb::TaskTransition>,
) -> Result<(), Error> {
    if transitions.is_empty() {
        return Ok(());
    }
    let first = next_seq(tx, session_id, now, transitions.len()).await?;
    let mut sequence = first;
    let mut transitions = transitions.into_iter().peekable();
    while transitions.peek().is_some() {
        let chunk: Vec<pb::TaskTransition> =
            transitions.by_ref().take(rows_per_statement(4)).collect();
        let sql = format!(
            "INSERT INTO events (session_id, seq, ts, payload) VALUES {}",
            values(tx.dialect, chunk.len(), 4)
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for transition in chunk {
            query = query
                .bind(session_id)
                .bind(to_i64(sequence))
                .bind(now)
                .bind(event_payload(
                    session_id,
                    sequence,
                    now,
                    Kind::Task(transition),
                ));
            sequence += 1;
        }
        query.execute(&mut **tx).await?;
    }
    Ok(())
}

/// Stores dependency rows `(session, task, dependency)`.
pub(super) async fn insert_deps(tx: &mut Tx, deps: &[(&str, &str, &str)]) -> Result<(), Error> {
    for chunk in deps.chunks(rows_per_statement(3)) {
        let sql = format!(
            "INSERT INTO task_deps (session_id, task_id, dep_id) VALUES {} ON CONFLICT DO NOTHING",
            values(tx.dialect, chunk.len(), 3)
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for (session_id, task_id, dep_id) in chunk {
            query = query.bind(*session_id).bind(*task_id).bind(*dep_id);
        }
        query.execute(&mut **tx).await?;
    }
    Ok(())
}

/// The `VALUES` rows of a multi-row insert: `rows` rows of `width` parameters, numbered
/// from 1. SQLite gets anonymous `?` parameters: it looks each named or numbered one up in a
/// list when the statement is parsed and again per bind, which made large inserts quadratic.
pub(super) fn values(dialect: Dialect, rows: usize, width: usize) -> String {
    let mut out = String::with_capacity(rows * width * 6);
    for row in 0..rows {
        if row > 0 {
            out.push_str(", ");
        }
        out.push('(');
        for column in 0..width {
            if column > 0 {
                out.push_str(", ");
            }
            match dialect {
                Dialect::Sqlite => out.push('?'),
                Dialect::Postgres => {
                    use std::fmt::Write as _;
                    let _ = write!(out, "${}", row * width + column + 1);
                }
            }
        }
        out.push(')');
    }
    out
}
