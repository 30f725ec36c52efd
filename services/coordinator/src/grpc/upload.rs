//! `UploadPlan`: a plan sent in pieces, put together before intake checks it whole.

use tonic::{Status, Streaming};
use troupe_proto::v1 as pb;

/// The largest plan an upload may bring (its JSON): the coordinator holds it whole while it
/// checks it, so this bounds what one upload can make it hold.
pub(super) const MAX_PLAN_BYTES: usize = 256 * 1024 * 1024;

/// The `CreateSession` request an upload amounts to: its first message's request with the
/// pieces of the plan put together. The plan's bytes are held once, as they arrive.
pub(super) async fn assemble(
    mut stream: Streaming<pb::PlanChunk>,
) -> Result<pb::CreateSessionRequest, Status> {
    let mut request: Option<pb::CreateSessionRequest> = None;
    let mut plan: Vec<u8> = Vec::new();
    let mut first = true;
    while let Some(chunk) = stream.message().await? {
        match (chunk.request, first) {
            (Some(given), true) if given.plan_json.is_empty() => request = Some(given),
            (Some(_), true) => {
                return Err(Status::invalid_argument(
                    "the upload's request carries plan_json: send the plan as the pieces' plan_json",
                ));
            }
            (Some(_), false) => {
                return Err(Status::invalid_argument(
                    "only the upload's first message carries the request",
                ));
            }
            (None, true) => {
                return Err(Status::invalid_argument(
                    "the upload's first message carries the request",
                ));
            }
            (None, false) => {}
        }
        first = false;
        if plan.len() + chunk.plan_json.len() > MAX_PLAN_BYTES {
            return Err(Status::out_of_range(format!(
                "the plan is over {MAX_PLAN_BYTES} bytes, the most an upload may bring"
            )));
        }
        plan.extend_from_slice(&chunk.plan_json);
    }
    let mut request = request.ok_or_else(|| {
        Status::invalid_argument("an empty upload: the first message carries the request")
    })?;
    request.plan_json = String::from_utf8(plan)
        .map_err(|err| Status::invalid_argument(format!("the plan is not UTF-8: {err}")))?;
    Ok(request)
}
