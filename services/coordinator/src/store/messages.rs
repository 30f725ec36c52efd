//! The message bus (CCW's team_msg): the `messages` table and each role's state
//! (`role_state`), whose updates are messages too.

use std::collections::BTreeMap;

use serde_json::{Map, Value};
use sqlx::Row;
use sqlx::any::AnyRow;
use troupe_proto::v1::{self as pb, session_event::Kind};

use super::events::{insert_event, next_seq};
use super::sessions::{load_session, lock_session};
use super::{Store, Tx, corrupt, parse_object, to_i64};
use crate::Error;
use crate::convert::{json_to_struct, rfc3339, timestamp};

/// A message to append to a session's bus.
#[derive(Debug)]
pub(crate) struct NewMessage {
    pub(crate) from: String,
    pub(crate) to: String,
    pub(crate) kind: String,
    pub(crate) summary: String,
    pub(crate) data: Option<Map<String, Value>>,
    pub(crate) idempotency_key: Option<String>,
}

/// Filters of [`Store::list_messages`].
#[derive(Debug, Default)]
pub(crate) struct MessageFilter {
    pub(crate) from: Option<String>,
    pub(crate) to: Option<String>,
    pub(crate) kind: Option<String>,
    pub(crate) after_sequence: u64,
    pub(crate) last: u32,
}

impl Store {
    /// Appends a message (or returns the first one logged with the same idempotency key, and
    /// `false`).
    pub(crate) async fn log_message(
        &self,
        session_id: &str,
        message: NewMessage,
        now: i64,
    ) -> Result<(pb::Message, bool), Error> {
        let mut tx = self.begin().await?;
        lock_session(&mut tx, session_id, self.for_update()).await?;
        let before = load_session(&mut tx, session_id).await?.last_seq;
        let stored = insert_message(&mut tx, session_id, message, now).await?;
        tx.commit().await?;
        let created = stored.sequence > before;
        Ok((stored, created))
    }

    /// Lists messages matching `filter`, oldest first, with the cursor to continue from.
    pub(crate) async fn list_messages(
        &self,
        session_id: &str,
        filter: &MessageFilter,
    ) -> Result<(Vec<pb::Message>, u64), Error> {
        let mut tx = self.begin_read().await?;
        load_session(&mut tx, session_id).await?;
        let mut sql = String::from(
            "SELECT seq, msg_id, ts, sender, recipient, msg_type, summary, data FROM messages WHERE session_id = $1 AND seq > $2",
        );
        let mut binds: Vec<&str> = Vec::new();
        for (column, value) in [
            ("sender", &filter.from),
            ("recipient", &filter.to),
            ("msg_type", &filter.kind),
        ] {
            if let Some(value) = value {
                binds.push(value);
                sql.push_str(&format!(" AND {column} = ${}", binds.len() + 3));
            }
        }
        // Without a cursor, CCW's `list last=N`: the newest N. With one, page forward: the N
        // that follow it, so `next_sequence` never skips a message.
        let forward = filter.after_sequence > 0;
        sql.push_str(if forward {
            " ORDER BY seq ASC LIMIT $3"
        } else {
            " ORDER BY seq DESC LIMIT $3"
        });
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(session_id)
            .bind(to_i64(filter.after_sequence))
            .bind(i64::from(filter.last));
        for value in binds {
            query = query.bind(value);
        }
        let rows = query.fetch_all(&mut *tx).await?;
        tx.commit().await?;
        let mut messages = rows
            .iter()
            .map(message_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        if !forward {
            messages.reverse();
        }
        let next = messages
            .last()
            .map_or(filter.after_sequence, |message| message.sequence);
        Ok((messages, next))
    }

    /// Returns the role state of one role, or of all roles when `role` is empty.
    pub(crate) async fn get_state(
        &self,
        session_id: &str,
        role: &str,
    ) -> Result<BTreeMap<String, Map<String, Value>>, Error> {
        let mut tx = self.begin_read().await?;
        load_session(&mut tx, session_id).await?;
        let rows = if role.is_empty() {
            sqlx::query("SELECT role, state FROM role_state WHERE session_id = $1")
                .bind(session_id)
                .fetch_all(&mut *tx)
                .await?
        } else {
            sqlx::query("SELECT role, state FROM role_state WHERE session_id = $1 AND role = $2")
                .bind(session_id)
                .bind(role)
                .fetch_all(&mut *tx)
                .await?
        };
        tx.commit().await?;
        let mut out = BTreeMap::new();
        for row in rows {
            let role: String = row.try_get("role")?;
            let state: String = row.try_get("state")?;
            out.insert(role, parse_object(&state)?);
        }
        Ok(out)
    }

    /// Shallow-merges `data` into a role's state with `_updated_at`, and records the
    /// `state_update` message, atomically.
    pub(crate) async fn update_state(
        &self,
        session_id: &str,
        role: &str,
        data: Map<String, Value>,
        now: i64,
    ) -> Result<(Map<String, Value>, pb::Message), Error> {
        let mut tx = self.begin().await?;
        lock_session(&mut tx, session_id, self.for_update()).await?;
        let existing =
            sqlx::query("SELECT state FROM role_state WHERE session_id = $1 AND role = $2")
                .bind(session_id)
                .bind(role)
                .fetch_optional(&mut *tx)
                .await?;
        let mut state = match existing {
            Some(row) => parse_object(&row.try_get::<String, _>("state")?)?,
            None => Map::new(),
        };
        for (key, value) in &data {
            state.insert(key.clone(), value.clone());
        }
        state.insert("_updated_at".to_owned(), Value::String(rfc3339(now)));
        sqlx::query(
            "INSERT INTO role_state (session_id, role, state) VALUES ($1, $2, $3) \
             ON CONFLICT (session_id, role) DO UPDATE SET state = excluded.state",
        )
        .bind(session_id)
        .bind(role)
        .bind(Value::Object(state.clone()).to_string())
        .execute(&mut *tx)
        .await?;
        let message = insert_message(
            &mut tx,
            session_id,
            NewMessage {
                from: role.to_owned(),
                to: "coordinator".to_owned(),
                kind: "state_update".to_owned(),
                summary: format!("[{role}] state_update -> coordinator"),
                data: Some(data),
                idempotency_key: None,
            },
            now,
        )
        .await?;
        tx.commit().await?;
        Ok((state, message))
    }
}

pub(crate) async fn insert_message(
    tx: &mut Tx,
    session_id: &str,
    message: NewMessage,
    now: i64,
) -> Result<pb::Message, Error> {
    if let Some(key) = &message.idempotency_key {
        let existing = sqlx::query(
            "SELECT seq, msg_id, ts, sender, recipient, msg_type, summary, data FROM messages WHERE session_id = $1 AND idempotency_key = $2",
        )
        .bind(session_id)
        .bind(key)
        .fetch_optional(&mut **tx)
        .await?;
        if let Some(row) = existing {
            return message_from_row(&row);
        }
    }
    let counter_row = sqlx::query(
        "UPDATE sessions SET msg_counter = msg_counter + 1 WHERE id = $1 RETURNING msg_counter",
    )
    .bind(session_id)
    .fetch_one(&mut **tx)
    .await?;
    let counter: i64 = counter_row.try_get("msg_counter")?;
    let id = format!("MSG-{counter:03}");
    let sequence = next_seq(tx, session_id, now, 1).await?;
    let stored = pb::Message {
        id: id.clone(),
        sequence,
        ts: Some(timestamp(now)),
        from: message.from,
        to: message.to,
        r#type: message.kind,
        summary: message.summary,
        data: message.data.as_ref().map(json_to_struct),
    };
    sqlx::query(
        "INSERT INTO messages (session_id, seq, msg_id, ts, sender, recipient, msg_type, summary, data, idempotency_key) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(session_id)
    .bind(to_i64(sequence))
    .bind(&id)
    .bind(now)
    .bind(&stored.from)
    .bind(&stored.to)
    .bind(&stored.r#type)
    .bind(&stored.summary)
    .bind(message.data.map(|data| Value::Object(data).to_string()))
    .bind(message.idempotency_key)
    .execute(&mut **tx)
    .await?;
    insert_event(tx, session_id, sequence, now, Kind::Message(stored.clone())).await?;
    Ok(stored)
}

fn message_from_row(row: &AnyRow) -> Result<pb::Message, Error> {
    let data: Option<String> = row.try_get("data")?;
    let data = data.map(|text| parse_object(&text)).transpose()?;
    Ok(pb::Message {
        id: row.try_get("msg_id")?,
        sequence: u64::try_from(row.try_get::<i64, _>("seq")?).map_err(corrupt)?,
        ts: Some(timestamp(row.try_get("ts")?)),
        from: row.try_get("sender")?,
        to: row.try_get("recipient")?,
        r#type: row.try_get("msg_type")?,
        summary: row.try_get("summary")?,
        data: data.as_ref().map(json_to_struct),
    })
}
