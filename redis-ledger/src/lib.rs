//! One token budget across gateway replicas, on Redis, for
//! [`async-bulkhead-llm`](async_bulkhead_llm).
//!
//! A bulkhead guards one process; with N replicas each allowed the whole budget, the provider
//! sees N times the load the operator meant. This crate shares one global budget through
//! Redis, with the local bulkhead still deciding first:
//!
//! - [`ExactLedger`] (exact mode): every admission also reserves its tokens in one global
//!   ledger (one Lua script: the sum of live holds plus the request must fit the global
//!   budget), usage reports move the global hold by sequence number (a stale or duplicate
//!   update changes nothing), release removes it, riding on the replica's next reservation (one
//!   script releases what waits, then reserves) or sent by a background task within 2 ms. So
//!   one Redis round trip per admission.
//! - [`LeasedLedger`] (leased mode): the replica leases a slice of the global budget (a fair
//!   share plus what it has been using, rebalanced every renewal period) and installs it as
//!   its local budget, so admissions stay local and lock-free.
//!
//! In both, each replica holds a lease it renews in the background: a replica that crashes
//! or hangs loses its holds (or slice) when the lease expires, so the budget heals without an
//! operator. While Redis is unreachable or slower than the timeout, the [`FailurePolicy`]
//! decides: refuse (fail closed) or admit within a fixed local floor, never the replica's
//! full budget. Recovery is automatic.

// Refusals carry their capacity snapshot by value, as the core crate's `AcquireError` does:
// boxing it would allocate on every refusal.
#![allow(clippy::result_large_err)]

mod config;
mod error;
mod exact;
mod health;
mod leased;
pub mod scripts;
mod stats;
mod store;

pub use config::{FailurePolicy, LedgerConfig, max_rate_limit};
pub use error::{
    ConfigError, GlobalRateRejection, GlobalRejection, LedgerError, LedgerRefusal, RateWindow,
    StoreError, UnavailableRejection,
};
pub use exact::{ExactLedger, GlobalPermit};
pub use leased::LeasedLedger;
pub use stats::LedgerStats;
pub use store::{GlobalRateStatus, GlobalSnapshot, GlobalWindow};
