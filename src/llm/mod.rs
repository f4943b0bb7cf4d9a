//! The LLM wing: everything that makes the engine an LLM bulkhead.
//!
//! - `request`, `request_json`: the request model ([`LlmRequest`](crate::LlmRequest)) and its
//!   provider JSON forms.
//! - `estimate`: the [`Estimator`](crate::estimate::Estimator) trait and the built-in estimators.
//! - `shared`: [`LlmCore`](shared::LlmCore), the engine paired with the model, the estimator and
//!   the listeners; every admission goes through its doors (`try_admit`, `admit_in_place`,
//!   `admit`).
//! - `admission`, `usage`: the record of one admitted call and its usage ledger (reports,
//!   settlement, bookings).
//! - `observe`, `bypass`: observe mode's records and counters, and its execution (a bypassed
//!   call's start, usage reports and end).
//! - `dedup`, `canonical`: in-flight deduplication's keys, registry and shared calls; the
//!   canonical form of a request its default key digests.
//! - `bulkhead`, `builder`, `options`, `permit`, `acquire`, `run`, `context`, `run_shared`:
//!   the public face ([`LlmBulkhead`](crate::LlmBulkhead) and what its methods take and return).
//! - `tenants`: [`Tenants`](crate::tenants::Tenants), a keyed family of bulkheads (one per tenant),
//!   over the public face.
//! - `learn`: [`LimitLearner`](crate::rate::LimitLearner), rate windows adapted to what the
//!   provider states, over the public face (`apply_limits`).
//! - `within`: a tenant's bulkhead within a global one, decided together
//!   ([`TenantPermit`](crate::tenants::TenantPermit)), over the engine's provisional admissions.
//!
//! The wing imports the engine and the plain vocabulary below it, never the other way round.

pub(crate) mod acquire;
pub(crate) mod admission;
pub(crate) mod builder;
pub(crate) mod bulkhead;
mod bypass;
mod canonical;
pub(crate) mod context;
pub(crate) mod dedup;
pub(crate) mod estimate;
pub(crate) mod learn;
pub(crate) mod observe;
pub(crate) mod options;
pub(crate) mod permit;
pub(crate) mod request;
#[cfg(feature = "serde")]
mod request_json;
pub(crate) mod run;
pub(crate) mod run_shared;
pub(crate) mod shared;
pub(crate) mod tenants;
mod usage;
pub(crate) mod within;
