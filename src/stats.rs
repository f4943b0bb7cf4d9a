//! Statistics: the public snapshot types, and the sharded counters behind them.
//!
//! Live figures (slots and tokens in flight, closed) are read from the admission word itself.
//! Cumulative counters live in per-thread shards: every thread that uses the crate holds a
//! small *slot* number (see `crate::local`), and each bulkhead keeps one shard per slot, so a
//! shard has exactly one writer at a time, which bumps it with a plain load and store, no locked
//! instruction and no shared cache line. `stats()` sums the shards. Slots are reused when
//! threads exit, and a shard keeps its counts across owners, so the number of shards stays at
//! the number of threads that used the crate at once.

use std::sync::OnceLock;

use crossbeam_utils::CachePadded;

use crate::admission_id::{self, IdParts};
use crate::limits::Limits;
use crate::rejection::RejectReason;
use crate::sync::unmodeled::{self, AtomicU64, Mutex, MutexGuard, Ordering};

/// Everything a [`LlmBulkhead`](crate::LlmBulkhead) can tell about itself, read at one moment.
///
/// Live figures come from one reading of the admission word; cumulative counters are summed
/// from per-thread shards and may lag a call that is completing on another thread at that
/// very moment. Once every thread that used the bulkhead is joined (or otherwise synchronised
/// with the reader), every figure is exact.
///
/// The JavaScript original reports a base-gate block and an LLM block because its slot gate and
/// its token check are separate steps; here one decision takes both, so the two blocks agree
/// and are one: `in_flight`, `pending`, `closed`, `admitted`, `released`, `rejected` and
/// `rejected_by_reason` (with `aborted` and `timeout` among the reasons) cover both, the limits
/// (`max_concurrent`, `max_queue`) are in `limits`, and `listener_panics` is the original's
/// `hookErrors` (which it never incremented).
///
/// With the `serde` feature it serializes as a plain JSON object (for a `/stats` endpoint).
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget, TokenUsage};
///
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 4).token_budget(TokenBudget::new(10_000)).build()?;
/// let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
/// let permit = bulkhead.try_acquire(&LlmRequest::new(), opts)?;
/// permit.release(Some(TokenUsage::new(20, 5)?));
///
/// let stats = bulkhead.stats();
/// assert_eq!((stats.admitted, stats.released, stats.in_flight), (1, 1, 0));
/// let tokens = stats.token_budget.unwrap();
/// assert_eq!((tokens.total_reserved, tokens.total_consumed, tokens.total_refunded), (1100, 25, 1075));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Stats {
    /// The limits in force.
    pub limits: Limits,
    /// Whether `close()` has been called.
    pub closed: bool,
    /// Admissions holding a slot.
    pub in_flight: u64,
    /// Calls waiting in the queue.
    pub pending: u64,
    /// Successful admissions so far.
    pub admitted: u64,
    /// Settled admissions so far (released or dropped).
    pub released: u64,
    /// Refusals so far, all reasons.
    pub rejected: u64,
    /// Refusals so far, by reason.
    pub rejected_by_reason: RejectionCounts,
    /// Token accounting, present iff the bulkhead has a token budget.
    pub token_budget: Option<TokenBudgetStats>,
    /// Panics of event listeners, caught and counted.
    pub listener_panics: u64,
    /// Panics of the estimator's [`observe`](crate::Estimator::observe), caught and counted
    /// (the release that called it completed: its capacity was returned first).
    pub estimator_panics: u64,
}

/// Refusal counts by reason.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason};
///
/// let bulkhead = LlmBulkhead::builder("m", 0).build()?;
/// let _ = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new());
/// let counts = bulkhead.stats().rejected_by_reason;
/// assert_eq!(counts.get(RejectReason::ConcurrencyLimit), 1);
/// assert_eq!(counts.total(), 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct RejectionCounts {
    /// Refused because the bulkhead was closed.
    pub shutdown: u64,
    /// Refused for lack of a slot.
    pub concurrency_limit: u64,
    /// Refused for lack of tokens.
    pub budget_limit: u64,
    /// Refused because the queue was full.
    pub queue_limit: u64,
    /// Gave up waiting in the queue.
    pub timeout: u64,
    /// Cancelled while waiting in the queue.
    pub aborted: u64,
}

impl RejectionCounts {
    /// The count for `reason`.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{RejectReason, RejectionCounts};
    ///
    /// assert_eq!(RejectionCounts::default().get(RejectReason::Timeout), 0);
    /// ```
    pub fn get(&self, reason: RejectReason) -> u64 {
        match reason {
            RejectReason::Shutdown => self.shutdown,
            RejectReason::ConcurrencyLimit => self.concurrency_limit,
            RejectReason::BudgetLimit => self.budget_limit,
            RejectReason::QueueLimit => self.queue_limit,
            RejectReason::Timeout => self.timeout,
            RejectReason::Aborted => self.aborted,
        }
    }

    /// The sum over all reasons.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::RejectionCounts::default().total(), 0);
    /// ```
    pub fn total(&self) -> u64 {
        RejectReason::ALL
            .iter()
            .fold(0u64, |sum, &r| sum.saturating_add(self.get(r)))
    }
}

/// Token accounting of a bulkhead with a token budget.
///
/// Cumulative totals saturate at `u64::MAX` instead of wrapping.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{LlmBulkhead, TokenBudget};
///
/// let bulkhead = LlmBulkhead::builder("m", 1)
///     .token_budget(TokenBudget::new(5000).high_priority_reserve(1000))
///     .build()?;
/// let t = bulkhead.stats().token_budget.unwrap();
/// assert_eq!((t.budget, t.high_priority_reserve, t.in_flight_tokens, t.available), (5000, 1000, 0, 5000));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct TokenBudgetStats {
    /// The budget in force.
    pub budget: u64,
    /// The high-priority reserve in force.
    pub high_priority_reserve: u64,
    /// Tokens held by admitted calls.
    pub in_flight_tokens: u64,
    /// `budget - in_flight_tokens`, at least 0 (not adjusted for priority).
    pub available: u64,
    /// Sum of the reservations of all admissions.
    pub total_reserved: u64,
    /// Sum of the usage reported when admissions were settled.
    pub total_consumed: u64,
    /// Tokens returned to the budget before their admission's reservation ended: removed from
    /// holds by usage reports and at settlement (a hold above the usage), net of tokens a later
    /// report or the final usage took back below the reservation.
    pub total_refunded: u64,
    /// Tokens ever held above admissions' original reservations (output beyond the
    /// reservation, input above the estimate, a final usage above the hold): only tokens above
    /// the reservation count (the original counted any increase of a hold). Gross: a hold that
    /// rises above its reservation and falls back books the rise here and the fall as a
    /// refund, so `total_reserved + total_overrun == total_consumed + total_refunded` once
    /// every admission has settled with usage.
    pub total_overrun: u64,
}

/// One cumulative counter of a shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Counter {
    Admitted,
    Reserved,
    Consumed,
    /// Tokens removed from holds (gross).
    Refunded,
    /// Tokens added to holds above their reservations.
    Overrun,
    /// Tokens added back to holds below their reservations (subtracted from the refunds).
    Reheld,
    /// Slots the queue handed to waiters.
    HandedOut,
    /// Hand-offs their waiters consumed (picked up, or gave back).
    HandedBack,
    Rejected(RejectReason),
}

impl Counter {
    const COUNT: usize = 8 + RejectReason::ALL.len();

    #[inline]
    fn index(self) -> usize {
        match self {
            Counter::Admitted => 0,
            Counter::Reserved => 1,
            Counter::Consumed => 2,
            Counter::Refunded => 3,
            Counter::Overrun => 4,
            Counter::Reheld => 5,
            Counter::HandedOut => 6,
            Counter::HandedBack => 7,
            Counter::Rejected(reason) => 8 + reason as usize,
        }
    }
}

/// One slot's counters for one bulkhead. Its admission count is also the sequence of the
/// admission ids it mints (see `crate::admission_id`).
#[derive(Debug)]
pub(crate) struct Shard(CachePadded<ShardCells>);

#[derive(Debug)]
struct ShardCells {
    counts: [AtomicU64; Counter::COUNT],
    /// This shard's id tag (immutable).
    tag: u64,
}

impl Default for Shard {
    fn default() -> Shard {
        Shard(CachePadded::new(ShardCells {
            counts: Default::default(),
            tag: admission_id::new_tag(),
        }))
    }
}

impl Shard {
    /// Counts an admission of `reserved` tokens and mints its id. Single-writer, like `bump`.
    #[inline]
    pub(crate) fn admit(&self, reserved: u64) -> IdParts {
        let admitted = &self.0.counts[Counter::Admitted.index()];
        let seq = admitted.load(Ordering::Relaxed);
        admitted.store(seq + 1, Ordering::Release);
        if reserved > 0 {
            self.bump(Counter::Reserved, reserved);
        }
        IdParts::new(self.0.tag, seq)
    }

    /// Adds `by` to `counter`, saturating.
    ///
    /// Single-writer: only the thread the shard is attached to (or a holder of the hub's
    /// fallback lock) calls this, so the plain load and store cannot lose an update. The load
    /// is `Relaxed` (the writer reads its own latest value). The store is `Release` so that a
    /// reader whose `Acquire` load sees a count also sees the admission-word update that came
    /// before it (see `LlmBulkhead::stats`); on x86-64 both are plain moves.
    #[inline]
    pub(crate) fn bump(&self, counter: Counter, by: u64) {
        let cell = &self.0.counts[counter.index()];
        cell.store(
            cell.load(Ordering::Relaxed).saturating_add(by),
            Ordering::Release,
        );
    }
}

/// Shards per chunk of a hub.
const CHUNK: usize = 64;
/// Chunks per hub: slots `0..CHUNK * CHUNKS` have a shard of their own.
const CHUNKS: usize = 64;
/// The number of slots with a shard of their own; threads beyond it share the locked fallback.
pub(crate) const SLOTS: u32 = (CHUNK * CHUNKS) as u32;

/// All shards of one bulkhead: one per slot, allocated a chunk at a time when a slot of the
/// chunk first counts something, and read without a lock.
#[derive(Debug)]
pub(crate) struct Hub {
    chunks: [OnceLock<Box<[Shard; CHUNK]>>; CHUNKS],
    /// Used (under its lock) by threads without a slot (their thread-local state is being
    /// torn down, or more than `SLOTS` threads use the crate at once).
    fallback: Mutex<Shard>,
}

impl Default for Hub {
    fn default() -> Hub {
        Hub {
            chunks: core::array::from_fn(|_| OnceLock::new()),
            fallback: Mutex::default(),
        }
    }
}

impl Hub {
    /// The shard of `slot`, if its chunk exists (`None` for slots without a shard).
    #[inline]
    pub(crate) fn shard(&self, slot: u32) -> Option<&Shard> {
        let slot = slot as usize;
        let chunk = self.chunks.get(slot / CHUNK)?.get()?;
        Some(&chunk[slot % CHUNK])
    }

    /// The shard of `slot`, allocating its chunk if needed (`None` for slots without one).
    #[cold]
    pub(crate) fn shard_or_init(&self, slot: u32) -> Option<&Shard> {
        let slot = slot as usize;
        let chunk = self
            .chunks
            .get(slot / CHUNK)?
            .get_or_init(|| Box::new(core::array::from_fn(|_| Shard::default())));
        Some(&chunk[slot % CHUNK])
    }

    /// The shared fallback shard, locked.
    pub(crate) fn fallback(&self) -> MutexGuard<'_, Shard> {
        unmodeled::lock(&self.fallback)
    }

    /// Every counter summed over every shard, in one pass.
    pub(crate) fn totals(&self) -> Totals {
        let mut totals = Totals([0; Counter::COUNT]);
        let mut add = |shard: &Shard| {
            for (total, cell) in totals.0.iter_mut().zip(shard.0.counts.iter()) {
                *total = total.saturating_add(cell.load(Ordering::Acquire));
            }
        };
        add(&self.fallback());
        for chunk in self.chunks.iter().filter_map(OnceLock::get) {
            chunk.iter().for_each(&mut add);
        }
        totals
    }
}

/// Counter sums at one moment.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Totals([u64; Counter::COUNT]);

impl Totals {
    pub(crate) fn get(&self, counter: Counter) -> u64 {
        self.0[counter.index()]
    }

    pub(crate) fn rejections(&self) -> RejectionCounts {
        let get = |reason| self.get(Counter::Rejected(reason));
        RejectionCounts {
            shutdown: get(RejectReason::Shutdown),
            concurrency_limit: get(RejectReason::ConcurrencyLimit),
            budget_limit: get(RejectReason::BudgetLimit),
            queue_limit: get(RejectReason::QueueLimit),
            timeout: get(RejectReason::Timeout),
            aborted: get(RejectReason::Aborted),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn every_slot_below_the_limit_has_its_own_shard_and_the_rest_share_the_fallback() {
        let hub = Hub::default();
        assert!(hub.shard(0).is_none(), "chunks are allocated on first use");
        for slot in [0, 63, 64, SLOTS - 1] {
            hub.shard_or_init(slot).unwrap().bump(Counter::Consumed, 1);
            assert!(hub.shard(slot).is_some());
        }
        assert!(hub.shard(SLOTS).is_none() && hub.shard_or_init(SLOTS).is_none());
        assert!(hub.shard_or_init(u32::MAX).is_none());
        hub.fallback().bump(Counter::Consumed, 10);
        assert_eq!(hub.totals().get(Counter::Consumed), 14);
        // Distinct shards, distinct id tags.
        let a = hub.shard(0).unwrap().admit(0);
        let b = hub
            .shard(1)
            .unwrap_or_else(|| hub.shard_or_init(1).unwrap())
            .admit(0);
        assert_ne!(a.id(), b.id());
        assert_eq!(hub.totals().get(Counter::Admitted), 2);
    }
}
