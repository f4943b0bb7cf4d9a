//! The general bulkhead: [`Bulkhead`] isolates one dependency (an API, a database, a pool of
//! workers) so that it cannot take every slot of a service, in the manner of Polly's
//! `BulkheadPolicy` and Resilience4j's `Bulkhead`. It is the crate's admission engine asked for
//! one slot and no tokens: the same lock-free fast path, strictly FIFO queue with hand-off (under
//! a short lock), versioned limits, close and drain as the LLM bulkhead, without requests,
//! estimators or events.
//!
//! - [`Bulkhead`]: the handle (cheap to clone); [`Bulkhead::builder`] and [`BulkheadBuilder`]
//!   configure it, with the defaults [`DEFAULT_MAX_QUEUE`] and [`DEFAULT_QUEUE_TIMEOUT`].
//! - [`BulkheadPermit`], [`OwnedBulkheadPermit`]: a slot, returned when dropped.
//! - [`WaitOptions`]: one call's own timeout and deadline.
//! - [`BulkheadError`] (with the [`BulkheadState`] it saw), [`BulkheadConfigError`].
//! - [`BulkheadLimits`], [`BulkheadStats`]: limits at run time; the statistics snapshot.
//! - [`BulkheadAcquire`], [`BulkheadAcquireOwned`]: the waiting futures.

// Layout (the general bulkhead imports the engine and the vocabulary, never the LLM wing):
// `face` is `Bulkhead` itself (fail-fast acquires, state, close, drain); `builder` its
// configuration and constructors; `shared` what every clone and permit shares (the engine,
// the queue timeout, the reject hook: refusals become `BulkheadError`s there); `acquire` the
// waiting futures, blocking acquires and `run`; `options`, `permit`, `limits`, `stats`,
// `error` as named.

mod acquire;
mod builder;
mod error;
mod face;
mod limits;
mod options;
mod permit;
mod shared;
mod stats;

pub use self::acquire::{BulkheadAcquire, BulkheadAcquireOwned};
pub use self::builder::{BulkheadBuilder, DEFAULT_MAX_QUEUE, DEFAULT_QUEUE_TIMEOUT};
pub use self::error::{BulkheadConfigError, BulkheadError, BulkheadState};
pub use self::face::Bulkhead;
pub use self::limits::BulkheadLimits;
pub use self::options::WaitOptions;
pub use self::permit::{BulkheadPermit, OwnedBulkheadPermit};
pub use self::stats::BulkheadStats;
