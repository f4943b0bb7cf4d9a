//! The tower layers (feature `tower`): [`LlmLayer`](llm::LlmLayer) admits each HTTP request
//! through an `LlmBulkhead` and reads the provider's usage from the response as it passes;
//! [`BulkheadLayer`](bulkhead::BulkheadLayer) puts a general `Bulkhead` in front of any
//! service. Both answer a refusal themselves and hold the call's permit in the response body
//! until it ends, fails or is dropped.
//!
//! - `body`: the response body both layers return ([`HeldBody`](body::HeldBody): the layer's
//!   own answer, or the inner body and what it holds) and the refusal response with its
//!   `Retry-After` hint;
//! - `error`: [`LayerError`](error::LayerError), a layer's configuration that cannot work, and [`BoxError`](error::BoxError);
//! - `grace`: [`Disconnect`](grace::Disconnect), what the LLM layer does when a client goes
//!   away, and the grace hold released by the crate's timer;
//! - `hold_times`: the recent hold time behind both layers' opt-in `Retry-After`;
//! - `llm`: the LLM layer, its service, its body and how it settles;
//! - `bulkhead`: the general bulkhead's layer, service and body;
//! - `usage`: the provider's usage read from server-sent events and JSON responses.

mod body;
pub(crate) mod bulkhead;
pub(crate) mod error;
pub(crate) mod grace;
mod hold_times;
pub(crate) mod llm;
pub(crate) mod usage;
