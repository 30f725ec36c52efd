//! Intake's writes: a new session's tasks, their dependency rows and its first events, in as
//! few statements as the databases allow (multi-row `INSERT`s; on SQLite with anonymous
//! parameters, see [`values`]).

use std::borrow::Cow;

use troupe_proto::v1::{self as pb, session_event::Kind};

use super::events::{event_payload, next_seq};
use super::tasks::StoredFile;
use super::{Dialect, Tx, corrupt, to_i64};
use crate::Error;
use crate::task::Task;

/// Columns [`insert_tasks`] writes per row (the others take their defaults), with the type
/// of their PostgreSQL array (see [`pg_arrays`]); [`task_cells`] gives the values.
const INSERT_COLUMNS: [(&str, &str); 20] = [
    ("session_id", "text"),
    ("id", "text"),
    ("position", "bigint"),
    ("title", "text"),
    ("description", "text"),
    ("role", "bigint"),
    ("priority", "bigint"),
    ("repo", "text"),
    ("wave", "bigint"),
    ("critical_path", "bigint"),
    ("path_ms", "bigint"),
    ("depends_on", "text"),
    ("files", "text"),
    ("spec", "text"),
    ("state", "bigint"),
    ("max_attempts", "bigint"),
    ("created_at", "bigint"),
    ("finished_at", "bigint"),
    ("result", "bytea"),
    ("backends", "text"),
];

/// The most parameters one statement binds: SQLite's default limit is 32,766, PostgreSQL's
/// 65,535.
const MAX_PARAMS: usize = 32_000;

/// Rows per statement for rows of `width` parameters.
fn rows_per_statement(width: usize) -> usize {
    MAX_PARAMS / width
}

/// Rows per statement on PostgreSQL, which takes them as one array per column.
const ARRAY_ROWS: usize = 10_000;

/// One value of a row that intake writes.
enum Cell<'a> {
    Text(Option<Cow<'a, str>>),
    Int(Option<i64>),
    Bytes(Option<Vec<u8>>),
}

/// A task's values of [`INSERT_COLUMNS`], in order.
fn task_cells(task: &Task) -> Result<[Cell<'_>; 20], Error> {
    fn text(value: &str) -> Cell<'_> {
        Cell::Text(Some(Cow::Borrowed(value)))
    }
    let json = |value: Result<String, serde_json::Error>| {
        value
            .map(|json| Cell::Text(Some(Cow::Owned(json))))
            .map_err(corrupt)
    };
    let int = |value: i64| Cell::Int(Some(value));
    let files: Vec<StoredFile> = task
        .files
        .iter()
        .map(|file| StoredFile {
            path: file.path.clone(),
            action: file.action,
            change: file.change.clone(),
        })
        .collect();
    Ok([
        text(&task.session_id),
        text(&task.id),
        int(task.position),
        text(&task.title),
        text(&task.description),
        int(task.role as i64),
        int(task.priority as i64),
        text(&task.repo),
        int(i64::from(task.wave)),
        int(i64::from(task.critical_path)),
        int(i64::try_from(task.path_ms).unwrap_or(i64::MAX)),
        json(serde_json::to_string(&task.depends_on))?,
        json(serde_json::to_string(&files))?,
        json(serde_json::to_string(&task.spec))?,
        int(task.state as i64),
        int(i64::from(task.max_attempts)),
        int(task.created_at),
        Cell::Int(task.finished_at),
        Cell::Bytes(task.result.as_ref().map(prost::Message::encode_to_vec)),
        Cell::Text(crate::lifecycle::routing::to_column(&task.backends).map(Cow::Owned)),
    ])
}

/// Stores new tasks and their dependency rows, a few statements for thousands of tasks.
pub(crate) async fn insert_tasks(tx: &mut Tx, tasks: &[Task]) -> Result<(), Error> {
    let names = INSERT_COLUMNS.map(|(name, _)| name).join(", ");
    match tx.dialect {
        Dialect::Sqlite => {
            for chunk in tasks.chunks(rows_per_statement(INSERT_COLUMNS.len())) {
                let sql = format!(
                    "INSERT INTO tasks ({names}) VALUES {}",
                    values(tx.dialect, chunk.len(), INSERT_COLUMNS.len())
                );
                let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
                for task in chunk {
                    for cell in task_cells(task)? {
                        query = match cell {
                            Cell::Text(text) => query.bind(text.map(Cow::into_owned)),
                            Cell::Int(int) => query.bind(int),
                            Cell::Bytes(bytes) => query.bind(bytes),
                        };
                    }
                }
                query.execute(&mut **tx).await?;
            }
        }
        Dialect::Postgres => {
            let sql = format!(
                "INSERT INTO tasks ({names}) SELECT * FROM UNNEST({})",
                unnest_params(1, &INSERT_COLUMNS.map(|(_, kind)| kind))
            );
            for chunk in tasks.chunks(ARRAY_ROWS) {
                let rows = chunk
                    .iter()
                    .map(task_cells)
                    .collect::<Result<Vec<_>, _>>()?;
                let mut query = sqlx::query(sqlx::AssertSqlSafe(sql.clone()));
                for array in pg_arrays(rows) {
                    query = query.bind(array);
                }
                query.execute(&mut **tx).await?;
            }
        }
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
    let rows = match tx.dialect {
        Dialect::Sqlite => rows_per_statement(4),
        Dialect::Postgres => ARRAY_ROWS,
    };
    while transitions.peek().is_some() {
        let chunk: Vec<pb::TaskTransition> = transitions.by_ref().take(rows).collect();
        let from = sequence;
        sequence += chunk.len() as u64;
        let payloads = (from..).zip(chunk).map(|(sequence, transition)| {
            event_payload(session_id, sequence, now, Kind::Task(transition))
        });
        match tx.dialect {
            Dialect::Sqlite => {
                let payloads: Vec<Vec<u8>> = payloads.collect();
                let sql = format!(
                    "INSERT INTO events (session_id, seq, ts, payload) VALUES {}",
                    values(tx.dialect, payloads.len(), 4)
                );
                let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
                for (n, payload) in payloads.into_iter().enumerate() {
                    query = query
                        .bind(session_id)
                        .bind(to_i64(from + n as u64))
                        .bind(now)
                        .bind(payload);
                }
                query.execute(&mut **tx).await?;
            }
            Dialect::Postgres => {
                let [payloads] = pg_arrays(payloads.map(|payload| [Cell::Bytes(Some(payload))]));
                sqlx::query(
                    "INSERT INTO events (session_id, seq, ts, payload) \
                     SELECT $1, $2 + n - 1, $3, payload FROM UNNEST($4::bytea[]) WITH ORDINALITY AS e (payload, n)",
                )
                .bind(session_id)
                .bind(to_i64(from))
                .bind(now)
                .bind(payloads)
                .execute(&mut **tx)
                .await?;
            }
        }
    }
    Ok(())
}

/// Stores dependency rows `(session, task, dependency)`.
pub(super) async fn insert_deps(tx: &mut Tx, deps: &[(&str, &str, &str)]) -> Result<(), Error> {
    if tx.dialect == Dialect::Postgres {
        for chunk in deps.chunks(ARRAY_ROWS) {
            let text = |value| Cell::Text(Some(Cow::Borrowed(value)));
            let rows = chunk.iter().map(|(session_id, task_id, dep_id)| {
                [text(session_id), text(task_id), text(dep_id)]
            });
            let [sessions, tasks, dep_ids] = pg_arrays(rows);
            sqlx::query(
                "INSERT INTO task_deps (session_id, task_id, dep_id) \
                 SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[]) ON CONFLICT DO NOTHING",
            )
            .bind(sessions)
            .bind(tasks)
            .bind(dep_ids)
            .execute(&mut **tx)
            .await?;
        }
        return Ok(());
    }
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
    match dialect {
        Dialect::Sqlite => {
            let row = format!("({})", vec!["?"; width].join(", "));
            vec![row; rows].join(", ")
        }
        Dialect::Postgres => numbered(1, rows, width),
    }
}

/// PostgreSQL's `VALUES` rows: `rows` rows of `width` parameters, numbered from `$first`.
pub(super) fn numbered(first: usize, rows: usize, width: usize) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(rows * width * 6);
    for row in 0..rows {
        out.push_str(if row > 0 { ", (" } else { "(" });
        for column in 0..width {
            if column > 0 {
                out.push_str(", ");
            }
            let _ = write!(out, "${}", first + row * width + column);
        }
        out.push(')');
    }
    out
}

/// `$first::type[], $next::type[], …`: the arrays of an `UNNEST`, one per type.
fn unnest_params(first: usize, types: &[&str]) -> String {
    let params: Vec<String> = (first..)
        .zip(types)
        .map(|(n, kind)| format!("${n}::{kind}[]"))
        .collect();
    params.join(", ")
}

/// Rows as one PostgreSQL array per column, in the arrays' text form (`{"a\"b",7,NULL}`), which
/// sqlx `Any` binds as text for a cast (it binds no arrays): a statement per few thousand rows
/// then parses a handful of parameters instead of 20 per row.
fn pg_arrays<'a, const N: usize>(rows: impl IntoIterator<Item = [Cell<'a>; N]>) -> [String; N] {
    let mut arrays = std::array::from_fn(|_| String::from("{"));
    for row in rows {
        for (array, cell) in arrays.iter_mut().zip(row) {
            if array.len() > 1 {
                array.push(',');
            }
            push_element(array, &cell);
        }
    }
    for array in &mut arrays {
        array.push('}');
    }
    arrays
}

/// Appends `cell` as an array element: text quoted with `"` and `\` escaped, bytes as quoted
/// hex (`"\\x0a"`), numbers bare, `NULL` for none.
fn push_element(array: &mut String, cell: &Cell<'_>) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    match cell {
        Cell::Text(None) | Cell::Int(None) | Cell::Bytes(None) => array.push_str("NULL"),
        Cell::Int(Some(int)) => {
            use std::fmt::Write as _;
            let _ = write!(array, "{int}");
        }
        Cell::Text(Some(text)) => {
            array.push('"');
            for c in text.chars() {
                if c == '"' || c == '\\' {
                    array.push('\\');
                }
                array.push(c);
            }
            array.push('"');
        }
        Cell::Bytes(Some(bytes)) => {
            array.push_str("\"\\\\x");
            for byte in bytes {
                array.push(char::from(HEX[usize::from(byte >> 4)]));
                array.push(char::from(HEX[usize::from(byte & 0xf)]));
            }
            array.push('"');
        }
    }
}
