//! Integrations with other crates, each behind its own feature and built only over the
//! crate's public API (nothing here reaches into `llm/` or `engine/` internals).
//!
//! - `axum.rs` (feature `axum`): `IntoResponse` for refusals, from [`HttpRefusal`], and for
//!   the general bulkhead's [`BulkheadError`] (from `bulkhead_http.rs`).
//! - `tower.rs` (feature `tower`): the LLM layer, its service and its response body.
//! - `tower_bulkhead.rs` (feature `tower`): the general bulkhead's layer, its service and its
//!   response body.
//! - `hold_times.rs` (feature `tower`): the recent hold time behind both layers' opt-in
//!   `Retry-After` hint.
//! - `bulkhead_http.rs` (`axum` or `tower`): the general bulkhead's refusals as 503 with a
//!   JSON body, shared by the axum response and the tower layer.
//!
//! [`HttpRefusal`]: crate::HttpRefusal
//! [`BulkheadError`]: crate::BulkheadError

#[cfg(feature = "axum")]
mod axum;
mod bulkhead_http;
#[cfg(feature = "tower")]
mod hold_times;
#[cfg(feature = "tower")]
pub(crate) mod tower;
#[cfg(feature = "tower")]
pub(crate) mod tower_bulkhead;
