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
//!
//! # Under faults
//!
//! - **A replica dies or hangs**: its lease lapses (Redis's clock) and the next script that
//!   judges the ledger purges its holds or slice.
//! - **Redis stalls** (`DEBUG SLEEP`, a paused process), however long: no live replica's lease
//!   lapses for it (the scripts move lease deadlines by the time Redis did not run: the
//!   `ns:clock` key in [`scripts`]).
//! - **Redis loses its data** (a restart without persistence, an emptied database): a replica
//!   finds out at its next contact (a renewal, or a reservation refused as unregistered) and
//!   puts back what it holds ([`scripts::REGISTER`]; a leased replica its installed slice). The
//!   first replica that knew the ledger and finds it gone opens a new epoch that admits nothing
//!   new for the recovery period ([`LedgerConfig::recovery_value`]: renewal period + retry
//!   period + two timeouts + 100 ms, within which every live replica renews, since a failed
//!   renewal is retried after the retry period): reservations meanwhile take the failure
//!   policy ([`UnavailableRejection::recovering`] says how long, and
//!   [`LedgerRefusal::retry_after`] gives it to a gateway's `Retry-After`), and no leased slice
//!   grows. So with fail closed nothing is admitted against a ledger missing a live replica's
//!   holds. A new ledger (no replica knew an epoch) opens at once. One gap remains: a process
//!   that never knew the ledger and joins first after a data loss opens the new epoch at once;
//!   the recovery starts only when a replica of the earlier epoch comes back (within its
//!   recovery period), and what the new process admitted before that was judged without the
//!   earlier replicas' holds. [`LedgerStats::leases_lost`], [`LedgerStats::reregistrations`]
//!   and [`LedgerStats::recovering`] count these events.
//! - **A leased replica cut off from Redis** stops admitting from its slice at its lease's
//!   local end: the lease less a tenth, on its own clock, counted from before it sent the
//!   renewal that Redis granted (a timer flips its local budget to the failure policy's: no
//!   check on the admission path). Redis counts the lease from when its script ran, on its own
//!   clock, so a replica whose clock runs at most 10% slower than Redis's stops before Redis
//!   can give its slice away. What it admitted before then still runs: once Redis purges the
//!   slice, another replica can be granted it while those calls finish, so the overshoot is at
//!   most the cut-off replica's tokens in flight at its lease end (at most its slice), for at
//!   most the longest call. With a clock slower than that, the replica admits past Redis's
//!   lease end for `lease x 0.9 / rate - lease` (rate < 0.9: at half speed, 0.8 leases).
//!
//! # Redis Cluster
//!
//! [`LedgerConfig::cluster`] runs a ledger on a Redis Cluster: its namespace must carry a hash
//! tag (`{gpt-4o}`), so every key of the ledger lives in one slot and every script runs on that
//! slot's master ([`ConfigError::NamespaceWithoutHashTag`] otherwise). When that master fails,
//! the ledger is unavailable until its replica is promoted (the failure policy applies), then
//! finds it by itself; a crash can lose the master's last writes (asynchronous replication),
//! and what each loss does (a lost lease or reservation is recounted within a renewal period,
//! a lost release is released within two: every renewal reconciles the replica's live holds
//! with Redis's) is set out at [`LedgerConfig::cluster`].
//!
//! # Rate windows across replicas
//!
//! A provider's per-minute limits (requests and tokens per minute) hold for the whole
//! deployment, not per replica. With [`LedgerConfig::rate_limits`] (the core crate's
//! [`RateLimits`](async_bulkhead_llm::rate::RateLimits)), [`ExactLedger`] charges every
//! admission to global windows in the same script that reserves its tokens, atomically:
//!
//! - **Semantics**: those of the core crate's windows (its `rate` module): each window is a
//!   GCRA kept as one timestamp (`tat`) counted in ticks of `window / limit`, so a call of `n`
//!   units costs exactly `n` ticks; `limit` units pass at once after a quiet window, and at
//!   most `limit * (t + window) / window` (plus one for the tick a span starts in) in any span
//!   `t`: a token bucket of `limit` refilled at `limit / window`, not a fixed or sliding
//!   window (right after a quiet window, one window can see up to twice the limit: the burst,
//!   then the refill). A call is charged 1 unit of the requests window and its reservation
//!   (input + maximum output) of the tokens window.
//! - **Clock**: Redis's (`TIME`, microseconds), so the replicas' clocks never matter. An idle
//!   window is anchored at the next call's own instant: a burst after a quiet window starts
//!   there, and the retry-after of the call that does not fit is exact on Redis's clock (five a
//!   second: the sixth is told 200 ms after the first call, less what Redis's clock moved
//!   since, in milliseconds rounded up).
//! - **Refusals**: the requests window is judged first, then the tokens window, then the
//!   budget; the windows are charged (and the hold taken) only when all three agree, so a
//!   refusal takes nothing: no hold, no charge. A window's refusal is
//!   [`LedgerRefusal::GlobalRate`] ([`RejectReason::RateLimit`](async_bulkhead_llm::RejectReason::RateLimit),
//!   HTTP 429, [`LedgerRefusal::retry_after`]: the wait until the call would fit if nothing else
//!   arrived; `None` for a call larger than the tokens window's limit, which never fits).
//! - **Usage**: a usage report beyond what the tokens window was charged for the call charges
//!   the overrun (without refusal: the tokens were used); the release (or drop) with the call's
//!   final usage (the usage given to [`GlobalPermit::release`], else the last reported) gives
//!   back what was charged beyond it, moving `tat` back by at most that, never below Redis's
//!   now. A call released without any usage keeps its reservation charged, as in the core
//!   crate. The give-back rides on the release, so it reaches Redis with it (within a few ms).
//! - **Agreement**: every replica of a namespace must enforce the same limits. The first
//!   replica to connect stores them (`ns:rate:limits`); a replica whose limits differ, or that
//!   has none while some are stored, is refused at connect with
//!   [`ConfigError::RateLimitsMismatch`] (nothing is written). If Redis loses them (a restart
//!   without persistence), the next reservation stores them again; a reservation that finds
//!   other limits stored changes nothing and fails as a store error
//!   ([`StoreError::RateLimitsMismatch`]: the failure policy applies). To change the limits,
//!   stop every replica and delete `ns:rate:limits` and `ns:rate`.
//! - **Keys**: `ns:rate` holds the windows (see [`scripts`]); its TTL is the time until every
//!   window is whole again plus one window, so an idle namespace costs nothing.
//! - **Bounds**: `window_us * limit` must be at most 2^53 (Lua numbers are doubles; see
//!   [`max_rate_limit`]): 150,119,987 per minute, 104,249 per day.
//! - **Redis unavailable**: the global windows cannot be charged. [`FailurePolicy::FailClosed`]
//!   refuses, as for the budget. [`FailurePolicy::LocalFloor`] admits within its floor of
//!   tokens in flight and charges no global window, during the outage or after it: what a
//!   replica lets through meanwhile is bounded only by its floor (its tokens in flight, so its
//!   rate is the floor over the calls' duration) and by the local bulkhead's own windows, if it
//!   has any (give each replica windows of its share of the provider's limits to bound an
//!   outage's rate). A reservation whose answer was lost (a timeout) keeps whatever it charged.
//! - **Leased mode** shares the windows instead of charging them in Redis: each replica
//!   installs, with its slice, local windows of the global limits times `slice / budget`
//!   (rounded down, at least 1), so admissions stay local. Replicas whose slices sum to at
//!   most the budget have shares that sum to at most each limit (plus one per replica whose
//!   share was rounded up to 1), and each local window is the core crate's GCRA: in any span
//!   the replicas together admit at most what one window of the global limits would, plus
//!   those ticks. When slices move, a shrinking replica's share keeps the units it already
//!   charged (up to its new limit) while the growing one's new room is there at once: a
//!   window can see up to the share moved more. The local bulkhead must be built with rate
//!   windows (any limits: they are replaced); [`LeasedLedger::start`] refuses one without
//!   ([`ConfigError::LocalRateWindowsMissing`]).
//!
//! ```no_run
//! use std::time::Duration;
//! use async_bulkhead_llm::rate::RateLimits;
//! use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, TokenBudget};
//! use async_bulkhead_llm_redis::{ExactLedger, LedgerConfig, LedgerRefusal};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let bulkhead = LlmBulkhead::builder("gpt-4o", 64)
//!     .token_budget(TokenBudget::new(100_000))
//!     .build()?;
//! let limits = RateLimits::per_minute().requests(500).tokens(200_000);
//! let config = LedgerConfig::new("redis://127.0.0.1:6379/", "{gpt-4o}", 200_000)
//!     .rate_limits(limits);
//! let ledger = ExactLedger::connect(bulkhead, config).await?;
//! let request = LlmRequest::new().max_tokens(500);
//! match ledger.try_acquire(&request, AcquireOptions::new()).await {
//!     Ok(permit) => drop(permit.release(None)),
//!     Err(refused) if refused.reason() == Some(RejectReason::RateLimit) => {
//!         // 429 with `Retry-After`, for every replica's windows at once.
//!         let _wait: Option<Duration> = refused.retry_after();
//!     }
//!     Err(other) => return Err(other.into()),
//! };
//! if let Some(status) = ledger.global_rate().await? {
//!     let _remaining = status.requests.map(|w| w.remaining);
//! }
//! # Ok(()) }
//! ```

// Refusals carry their capacity snapshot by value, as the core crate's `AcquireError` does:
// boxing it would allocate on every refusal.
#![allow(clippy::result_large_err)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod connection;
mod error;
mod exact;
mod health;
mod leased;
#[cfg(feature = "metrics")]
mod ledger_metrics;
pub mod scripts;
mod stats;
mod store;
mod trace;

pub use config::{FailurePolicy, LedgerConfig, max_rate_limit};
pub use error::{
    ConfigError, GlobalRateRejection, GlobalRejection, LedgerError, LedgerRefusal, StoreError,
    UnavailableRejection,
};
pub use exact::{ExactLedger, GlobalPermit};
pub use leased::LeasedLedger;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub use ledger_metrics::LedgerMetrics;
pub use stats::LedgerStats;
pub use store::{GlobalRateStatus, GlobalSnapshot, GlobalWindow};
