//! Integrations with other crates, each behind its own feature and built only over the
//! crate's public API (nothing here reaches into `llm/` or `engine/` internals).
//!
//! - `axum.rs` (feature `axum`): `IntoResponse` for refusals, from [`HttpRefusal`].
//! - `tower.rs` (feature `tower`): the LLM layer, its service and its response body.
//!
//! [`HttpRefusal`]: crate::HttpRefusal

#[cfg(feature = "axum")]
mod axum;
#[cfg(feature = "tower")]
pub(crate) mod tower;
