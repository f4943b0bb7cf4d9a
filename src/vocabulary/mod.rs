//! The vocabulary: plain values every layer shares, with no behaviour beyond validation and
//! formatting. Each file imports only the support layer and the vocabulary files named before
//! it below; nothing here knows the engine, a bulkhead or a request.
//!
//! - `priority`: [`Priority`](priority::Priority).
//! - `admission_id`: admission and shadow ids.
//! - `rate_limits`: requests and tokens per window.
//! - `admission_class`: class handles, a class's limits, what an admission borrowed.
//! - `rejection`: capacity refusals and their snapshot.
//! - `error`: the typed errors of input that can never succeed (and `AcquireError`, which
//!   carries a rejection).
//! - `reservation`: reservations, usage and the reports of usage and release.
//! - `limits`: versioned limits and what applying them did.
//! - `tenant_policy`: per-tenant limits as data, and why a policy was refused.
//! - `verdict`, `drain_report`: what an advisory check predicts; where a drain ended.

pub(crate) mod admission_class;
pub(crate) mod admission_id;
pub(crate) mod drain_report;
pub(crate) mod error;
pub(crate) mod limits;
pub(crate) mod priority;
pub(crate) mod rate_limits;
pub(crate) mod rejection;
pub(crate) mod reservation;
pub(crate) mod tenant_policy;
pub(crate) mod verdict;
