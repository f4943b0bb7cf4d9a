//! Statistics: the public snapshot types ([`Stats`] and its parts), filled from one reading of
//! the engine's figures (`crate::engine::Figures`): live figures from the admission word,
//! cumulative counters summed from the engine's per-thread shards.

use crate::engine::Figures;
use crate::engine::limits::Limits;
use crate::rejection::RejectReason;

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

impl Stats {
    /// The snapshot of `figures`, with the panics counted outside the engine.
    pub(crate) fn new(figures: Figures, listener_panics: u64, estimator_panics: u64) -> Stats {
        let rejected_by_reason = RejectionCounts::from_array(figures.rejected);
        Stats {
            limits: figures.limits,
            closed: figures.closed,
            in_flight: figures.in_flight,
            pending: figures.pending,
            admitted: figures.admitted,
            released: figures.released,
            rejected: rejected_by_reason.total(),
            rejected_by_reason,
            listener_panics,
            estimator_panics,
            token_budget: figures.limits.token_budget.map(|b| TokenBudgetStats {
                budget: b.budget,
                high_priority_reserve: b.high_priority_reserve,
                in_flight_tokens: figures.in_flight_tokens,
                available: b.budget.saturating_sub(figures.in_flight_tokens),
                total_reserved: figures.reserved,
                total_consumed: figures.consumed,
                total_refunded: figures.refunded,
                total_overrun: figures.overrun,
            }),
        }
    }
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
    /// The counts of `counts`, indexed in [`RejectReason::ALL`]'s (declaration) order.
    fn from_array(counts: [u64; RejectReason::ALL.len()]) -> RejectionCounts {
        let [
            shutdown,
            concurrency_limit,
            budget_limit,
            queue_limit,
            timeout,
            aborted,
        ] = counts;
        RejectionCounts {
            shutdown,
            concurrency_limit,
            budget_limit,
            queue_limit,
            timeout,
            aborted,
        }
    }

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
