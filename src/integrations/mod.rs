//! Integrations with other crates, each behind its own feature and built only over the
//! crate's public API: every item used here is public (at the root or in a public module),
//! imported from the module that defines it so that imports point down (nothing here reaches
//! into `llm/` or `engine/` internals). The exceptions: `tower/hold_times.rs`, which counts with
//! the support layer's unmodeled atomics, and `tower/grace.rs`, which waits on the engine's
//! timer (a permit released after a client's disconnect needs a timer and no runtime).
//!
//! - `axum.rs` (feature `axum`): `IntoResponse` for refusals, from [`HttpRefusal`](crate::http::HttpRefusal), and for
//!   the general bulkhead's [`BulkheadError`] (its 503 and JSON body from `crate::http`).
//! - `tower/` (feature `tower`): both tower layers over one response body (`tower/body.rs`):
//!   the LLM layer (`tower/llm.rs`, with the provider's usage read in `tower/usage.rs`) and
//!   the general bulkhead's (`tower/bulkhead.rs`), and the hold times behind their opt-in
//!   `Retry-After` hint (`tower/hold_times.rs`).
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
#[cfg(feature = "metrics")]
pub(crate) mod metrics;
#[cfg(feature = "tower")]
pub(crate) mod tower;
#[cfg(feature = "tracing")]
pub(crate) mod tracing;
