//! axum 0.8: refusals as responses. A handler that returns `Result<_, AcquireError>` (or a
//! [`Rejection`], a [`RequestError`](crate::request::RequestError), an [`HttpRefusal`](crate::http::HttpRefusal)) answers a refusal with the status of
//! [`HttpRefusal`](crate::http::HttpRefusal) (429, 413, 503, 499 or 400), `content-type: application/json`, and the
//! provider-shaped JSON error body of [`HttpRefusal::body`](crate::http::HttpRefusal::body). No `Retry-After` (see
//! [`HttpRefusal`](crate::http::HttpRefusal) for why).
//!
//! ```
//! use async_bulkhead_llm::{AcquireError, AcquireOptions, LlmBulkhead, LlmRequest};
//! use axum::response::IntoResponse;
//!
//! fn handle(bulkhead: &LlmBulkhead) -> Result<&'static str, AcquireError> {
//!     let _permit = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
//!     Ok("called the provider")
//! }
//!
//! let bulkhead = LlmBulkhead::builder("gpt-4o", 0).build()?;
//! let response = handle(&bulkhead).into_response();
//! assert_eq!(response.status(), 429);
//! assert_eq!(response.headers()["content-type"], "application/json");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The general bulkhead's [`BulkheadError`] answers 503 Service Unavailable with the JSON body
//! `{"error":{"type":"<as_str>","message":"<Display>","active":N,"queued":M}}` (the same
//! answer as the tower [`BulkheadLayer`](crate::tower::BulkheadLayer)'s, without its opt-in
//! `Retry-After`):
//!
//! ```
//! use async_bulkhead_llm::{Bulkhead, BulkheadError};
//! use axum::response::IntoResponse;
//!
//! fn handle(bulkhead: &Bulkhead) -> Result<&'static str, BulkheadError> {
//!     let _permit = bulkhead.try_acquire()?;
//!     Ok("called the dependency")
//! }
//!
//! let bulkhead = Bulkhead::new(1)?;
//! bulkhead.close();
//! let response = handle(&bulkhead).into_response();
//! assert_eq!(response.status(), 503);
//! assert_eq!(response.headers()["content-type"], "application/json");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use ::axum::http::{HeaderValue, StatusCode, header};
use ::axum::response::{IntoResponse, Response};

use crate::bulkhead::BulkheadError;
use crate::http::HttpRefusal;
use crate::vocabulary::error::AcquireError;
use crate::vocabulary::error::RequestError;
use crate::vocabulary::rejection::Rejection;

impl IntoResponse for HttpRefusal {
    fn into_response(self) -> Response {
        // Every status the mapping makes is valid; a caller's own edit may not be.
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let content_type = HeaderValue::from_static(HttpRefusal::CONTENT_TYPE);
        (status, [(header::CONTENT_TYPE, content_type)], self.body()).into_response()
    }
}

impl IntoResponse for Rejection {
    fn into_response(self) -> Response {
        HttpRefusal::from(self).into_response()
    }
}

impl IntoResponse for AcquireError {
    fn into_response(self) -> Response {
        HttpRefusal::from(self).into_response()
    }
}

impl IntoResponse for RequestError {
    fn into_response(self) -> Response {
        HttpRefusal::from(self).into_response()
    }
}

impl IntoResponse for BulkheadError {
    /// 503 Service Unavailable, `content-type: application/json`, and the JSON body naming the
    /// refusal (`type`, `message`) and the occupancy it saw (`active`, `queued`).
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.http_status()).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        let content_type = HeaderValue::from_static(HttpRefusal::CONTENT_TYPE);
        let body = self.http_body();
        (status, [(header::CONTENT_TYPE, content_type)], body).into_response()
    }
}
