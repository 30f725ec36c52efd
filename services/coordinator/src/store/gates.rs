//! The `gates` table: the tasks a plan asks a person to approve before they run, and the
//! answer (who gave it, when, and why).

use std::collections::HashMap;

use sqlx::Row;

use super::Tx;
use crate::Error;

/// A gate's answer as stored (0, no answer yet, is the column's default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    Approved = 1,
    Rejected = 2,
}

/// Records the gates of a new session: `(task id, prompt)`.
pub(crate) async fn insert_gates(
    tx: &mut Tx,
    session_id: &str,
    gates: &[(String, String)],
) -> Result<(), Error> {
    for (task_id, prompt) in gates {
        sqlx::query("INSERT INTO gates (session_id, task_id, prompt) VALUES ($1, $2, $3)")
            .bind(session_id)
            .bind(task_id)
            .bind(prompt)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

/// The session's gates still waiting for an answer, by task id, with their prompts.
pub(crate) async fn waiting_gates(
    tx: &mut Tx,
    session_id: &str,
) -> Result<HashMap<String, String>, Error> {
    let rows =
        sqlx::query("SELECT task_id, prompt FROM gates WHERE session_id = $1 AND decision = 0")
            .bind(session_id)
            .fetch_all(&mut **tx)
            .await?;
    rows.iter()
        .map(|row| Ok((row.try_get("task_id")?, row.try_get("prompt")?)))
        .collect()
}

/// Records the answer to a waiting gate; false when the task has no waiting gate.
pub(crate) async fn decide(
    tx: &mut Tx,
    session_id: &str,
    task_id: &str,
    decision: Decision,
    (by, note): (&str, &str),
    now: i64,
) -> Result<bool, Error> {
    let done = sqlx::query(
        "UPDATE gates SET decision = $1, decided_by = $2, note = $3, decided_at = $4 \
         WHERE session_id = $5 AND task_id = $6 AND decision = 0",
    )
    .bind(decision as i32)
    .bind(by)
    .bind(note)
    .bind(now)
    .bind(session_id)
    .bind(task_id)
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Whether the session has a gate (answered or not) under `id`.
pub(crate) async fn has_gate(tx: &mut Tx, session_id: &str, id: &str) -> Result<bool, Error> {
    let row = sqlx::query("SELECT 1 AS one FROM gates WHERE session_id = $1 AND task_id = $2")
        .bind(session_id)
        .bind(id)
        .fetch_optional(&mut **tx)
        .await?;
    Ok(row.is_some())
}
