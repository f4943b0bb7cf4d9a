//! The HTTP mapping of refusals (`HttpRefusal`): every reason's status, the 413 of a call that
//! can never fit, the JSON error body, the `serde` output of rejections and ids, and (feature
//! `axum`) refusals as axum responses.

#[cfg(feature = "axum")]
mod axum_response;
mod body;
mod serialize;
mod status;
mod support;
