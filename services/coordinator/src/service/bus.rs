//! The message bus (CCW's team_msg: messages and role state) and the event stream
//! (`WatchSession`).

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::Stream;
use serde_json::{Map, Value};
use tokio::sync::mpsc;
use troupe_proto::v1 as pb;

use super::{Coordinator, EVENT_PAGE, require};
use crate::Error;
use crate::convert::{now_ms, struct_to_json};
use crate::store::messages::{MessageFilter, NewMessage};
use crate::task;

impl Coordinator {
    pub(crate) async fn log_message(
        &self,
        request: pb::LogMessageRequest,
    ) -> Result<pb::Message, Error> {
        require(&request.session_id, "session_id")?;
        require(&request.from, "from")?;
        let to = if request.to.is_empty() {
            "coordinator".to_owned()
        } else {
            request.to
        };
        let kind = if request.r#type.is_empty() {
            "message".to_owned()
        } else {
            request.r#type
        };
        let summary = if request.summary.is_empty() {
            format!("[{}] {kind} -> {to}", request.from)
        } else {
            request.summary
        };
        let message = NewMessage {
            from: request.from,
            to,
            kind,
            summary,
            data: request.data.as_ref().map(struct_to_json),
            idempotency_key: Some(request.idempotency_key).filter(|key| !key.is_empty()),
        };
        let (message, _) = self.log(&request.session_id, message, now_ms()).await?;
        self.notify();
        Ok(message)
    }

    /// Logs a message (or finds the one with its idempotency key, and `false`), and moves the
    /// group commit's copy of the session along with a new one (see
    /// [`crate::group_commit::GroupCommit::message_logged`]).
    pub(super) async fn log(
        &self,
        session_id: &str,
        message: NewMessage,
        now: i64,
    ) -> Result<(pb::Message, bool), Error> {
        let (message, created) = self.store.log_message(session_id, message, now).await?;
        if created {
            self.group.message_logged(session_id, message.sequence);
        }
        Ok((message, created))
    }

    /// The messages matching the request, oldest first, with the cursor to continue from.
    pub(crate) async fn list_messages(
        &self,
        request: pb::ListMessagesRequest,
    ) -> Result<(Vec<pb::Message>, u64), Error> {
        require(&request.session_id, "session_id")?;
        let non_empty = |text: String| Some(text).filter(|text| !text.is_empty());
        let filter = MessageFilter {
            from: non_empty(request.from),
            to: non_empty(request.to),
            kind: non_empty(request.r#type),
            after_sequence: request.after_sequence,
            last: match request.last {
                0 => 20,
                last => last.min(1000),
            },
        };
        self.store.list_messages(&request.session_id, &filter).await
    }

    /// The state of the request's role, or of every role when it names none.
    pub(crate) async fn get_state(
        &self,
        request: pb::GetStateRequest,
    ) -> Result<BTreeMap<String, Map<String, Value>>, Error> {
        require(&request.session_id, "session_id")?;
        self.store
            .get_state(&request.session_id, &request.role)
            .await
    }

    /// Merges the request's data into its role's state; returns the new state and the
    /// `state_update` message recorded with it.
    pub(crate) async fn update_state(
        &self,
        request: pb::UpdateStateRequest,
    ) -> Result<(Map<String, Value>, pb::Message), Error> {
        require(&request.session_id, "session_id")?;
        require(&request.role, "role")?;
        let data = request
            .data
            .as_ref()
            .map(struct_to_json)
            .unwrap_or_default();
        let (state, message) = self
            .store
            .update_state(&request.session_id, &request.role, data, now_ms())
            .await?;
        // Role state is not part of the copy either.
        self.group
            .message_logged(&request.session_id, message.sequence);
        self.notify();
        Ok((state, message))
    }

    /// Streams a session's events after `after_sequence`: first the stored ones, then live
    /// ones as they commit; ends once the session is terminal and everything was sent, unless
    /// `follow`.
    pub(crate) async fn watch_session(
        self: &Arc<Self>,
        request: pb::WatchSessionRequest,
    ) -> Result<impl Stream<Item = Result<pb::SessionEvent, Error>> + Send + 'static, Error> {
        require(&request.session_id, "session_id")?;
        // Fail the call itself (NOT_FOUND) rather than the stream when the session is unknown.
        self.store.session_head(&request.session_id).await?;
        let (sender, receiver) = mpsc::channel(64);
        let this = Arc::clone(self);
        tokio::spawn(async move {
            if let Err(err) = this.pump_events(&request, &sender).await {
                tracing::warn!(session_id = %request.session_id, error = %err, "event stream failed");
                let _ = sender.send(Err(err)).await;
            }
        });
        Ok(tokio_stream::wrappers::ReceiverStream::new(receiver))
    }

    async fn pump_events(
        &self,
        request: &pb::WatchSessionRequest,
        sender: &mpsc::Sender<Result<pb::SessionEvent, Error>>,
    ) -> Result<(), Error> {
        let session_id = &request.session_id;
        let mut cursor = request.after_sequence;
        let mut changes = self.changes.subscribe();
        loop {
            // Mark the generation seen before reading, so a commit after the read wakes us.
            changes.borrow_and_update();
            let (state, last_sequence) = self.store.session_head(session_id).await?;
            let events = self
                .store
                .events_after(session_id, cursor, EVENT_PAGE)
                .await?;
            let full_page = events.len() == EVENT_PAGE as usize;
            for event in events {
                cursor = event.sequence;
                if sender.send(Ok(event)).await.is_err() {
                    return Ok(());
                }
            }
            if full_page {
                continue;
            }
            if !request.follow && task::is_session_terminal(state) && cursor >= last_sequence {
                return Ok(());
            }
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return Ok(()) },
                () = sender.closed() => return Ok(()),
                () = self.stop.cancelled() => return Ok(()),
            }
        }
    }
}
