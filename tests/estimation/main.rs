//! Integration tests of token estimation: the request model (built in code and read from
//! OpenAI / Anthropic JSON bodies), UTF-16 character counting, the naive, model-aware and
//! adaptive estimators, and how the bulkhead sizes, previews and learns from admissions.
//!
//! Figures come from the original's behaviour (design §U1.3, §U3.1, §U3.7, §U13) and design
//! §D4 Q17 (override ratios must be finite and > 0, checked when built).
//!
//! Needs the `serde` feature (`required-features` in `Cargo.toml`).
//!
//! `§U..`, `§D..` and `Qn` refer to sections and quirks of `docs/design.md`.

mod support;

mod adaptive_estimator;
mod bulkhead_integration;
mod character_counting;
mod concurrency;
mod model_aware_estimator;
mod naive_estimator;
mod request_json;
