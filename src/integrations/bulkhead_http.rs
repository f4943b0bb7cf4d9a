//! The general bulkhead's refusals as HTTP answers, shared by axum's `IntoResponse` for
//! [`BulkheadError`] and the tower [`BulkheadLayer`](crate::BulkheadLayer): one status (503
//! Service Unavailable: the dependency behind the bulkhead is saturated or shut down, the
//! client did nothing wrong) and one small JSON body.

use serde::Serialize;

use crate::bulkhead::error::BulkheadError;

/// The status of every refusal: 503 Service Unavailable.
pub(crate) const STATUS: u16 = 503;

/// The content type of the body.
pub(crate) const CONTENT_TYPE: &str = "application/json";

#[derive(Serialize)]
struct Envelope<'a> {
    error: Detail<'a>,
}

/// Fields in this order: `type`, `message`, `active`, `queued`.
#[derive(Serialize)]
struct Detail<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    message: String,
    active: u64,
    queued: u64,
}

/// The JSON body of a refusal:
/// `{"error":{"type":"<as_str>","message":"<Display>","active":N,"queued":M}}`, the
/// occupancy being the one the refusal saw.
pub(crate) fn body(error: &BulkheadError) -> String {
    let state = error.state();
    let envelope = Envelope {
        error: Detail {
            kind: error.as_str(),
            message: error.to_string(),
            active: state.active,
            queued: state.queued,
        },
    };
    // A struct of strings and integers always serializes.
    serde_json::to_string(&envelope).unwrap_or_default()
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::body;
    use crate::bulkhead::error::{BulkheadError, BulkheadState};

    #[test]
    fn the_body_names_the_refusal_and_its_occupancy_in_order() {
        let error = BulkheadError::QueueFull {
            state: BulkheadState {
                active: 2,
                queued: 1,
            },
        };
        assert_eq!(
            body(&error),
            r#"{"error":{"type":"bulkhead_queue_full","message":"bulkhead queue full (2 active, 1 queued); the call was shed: do not retry it","active":2,"queued":1}}"#
        );
    }
}
