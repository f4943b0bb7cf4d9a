//! Integrations with other crates, each behind its own feature and built only over the
//! crate's public API: every item used here is public (at the root or in a public module),
//! imported from the module that defines it so that imports point down (nothing here reaches
//! into `llm/` or `engine/` internals). The one exception is `hold_times.rs`, which counts with
//! the support layer's unmodeled atomics.
//!
//! - `axum.rs` (feature `axum`): `IntoResponse` for refusals, from [`HttpRefusal`](crate::http::HttpRefusal), and for
//!   the general bulkhead's [`BulkheadError`] (its 503 and JSON body from `crate::http`).
//! - `tower.rs` (feature `tower`): the LLM layer, its service and its response body.
//! - `tower_bulkhead.rs` (feature `tower`): the general bulkhead's layer, its service and its
//!   response body.
//! - `hold_times.rs` (feature `tower`): the recent hold time behind both layers' opt-in
//!   `Retry-After` hint.
//!
//! - `metrics.rs` (feature `metrics`): `BulkheadMetrics`, a bulkhead's counters, gauges and
//!   histograms through the `metrics` facade (stats read when published, a sampled listener).
//! - `tracing.rs` (feature `tracing`): `trace_events`, a bulkhead's events as `tracing` debug
//!   events (the spans around queued waits and `run` are in `llm/`, where those are).
//!
//! [`HttpRefusal`]: crate::http::HttpRefusal
//! [`BulkheadError`]: crate::BulkheadError

#[cfg(feature = "axum")]
mod axum;
#[cfg(feature = "tower")]
mod hold_times;
#[cfg(feature = "metrics")]
pub(crate) mod metrics;
#[cfg(feature = "tower")]
pub(crate) mod tower;
#[cfg(feature = "tower")]
pub(crate) mod tower_bulkhead;
#[cfg(feature = "tracing")]
pub(crate) mod tracing;
