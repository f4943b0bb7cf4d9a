//! Statistics: the public snapshot types ([`Stats`] and its parts), filled from one reading of
//! the engine's figures (`crate::engine::Figures`): live figures from the admission word,
//! cumulative counters summed from the engine's per-thread shards.

use crate::engine::{ClassCounter, ClassFigures, ClassesFigures, Figures};
use crate::vocabulary::admission_class::{AbandonCause, AdmissionClass, ClassLimits};
use crate::vocabulary::limits::Limits;
use crate::vocabulary::rejection::RejectReason;

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
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Stats {
    /// The limits in force.
    pub limits: Limits,
    /// Whether `close()` has been called.
    pub closed: bool,
    /// Admissions holding a slot.
    pub in_flight: u64,
    /// Admissions that gave their borrowed slot back (see
    /// [`Permit::abandon_borrowed_concurrency`](crate::Permit::abandon_borrowed_concurrency))
    /// and have not settled: they hold tokens but no slot. `in_flight + abandoned_in_flight`
    /// is every admission not yet settled, what `drain` waits for.
    pub abandoned_in_flight: u64,
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
    /// Effective usage reports so far: reports that changed an admission's cumulative usage
    /// or its hold (the ones a usage event announces; a report that changed nothing is not
    /// counted). Settlement is not a report.
    pub usage_reports: u64,
    /// Token accounting, present iff the bulkhead has a token budget.
    pub token_budget: Option<TokenBudgetStats>,
    /// Panics of event listeners, caught and counted.
    pub listener_panics: u64,
    /// Panics of the estimator's [`observe`](crate::estimate::Estimator::observe), caught and counted
    /// (the release that called it completed: its capacity was returned first).
    pub estimator_panics: u64,
    /// Admissions that gave their borrowed slot back before settling, so far.
    pub borrowed_concurrency_abandoned: u64,
    /// The same, by cause.
    pub borrowed_concurrency_abandoned_by_cause: AbandonCounts,
    /// Per-class figures, present iff the bulkhead has admission classes.
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub admission_classes: Option<ClassesStats>,
    /// In-flight deduplication (only on a bulkhead built with
    /// [`deduplication`](crate::LlmBulkheadBuilder::deduplication)).
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub deduplication: Option<DedupStats>,
    /// Observe-mode bypasses (only once a call was bypassed).
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub observe: Option<ObserveStats>,
}

/// In-flight deduplication figures.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{dedup::Deduplication, LlmBulkhead};
///
/// let bulkhead = LlmBulkhead::builder("m", 4).deduplication(Deduplication::new()).build()?;
/// let dedup = bulkhead.stats().deduplication.unwrap();
/// assert_eq!((dedup.active, dedup.hits), (0, 0));
/// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct DedupStats {
    /// Keys with a call in flight now: a call registers when it leads and leaves the registry
    /// when it finishes (before its outcome is shared) or when all its waiters are gone.
    pub active: u64,
    /// Followers that joined a call in flight, since the bulkhead was built.
    pub hits: u64,
    /// Calls whose key function panicked (each ran without deduplication).
    pub key_panics: u64,
}

/// Observe-mode figures: calls the bulkhead would have refused, that ran anyway.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, observe::ShadowReasons};
///
/// # ::futures::executor::block_on(async {
/// let bulkhead = LlmBulkhead::builder("m", 0).build()?;
/// assert!(bulkhead.stats().observe.is_none()); // until the first bypass
/// let options = AcquireOptions::new().observe(ShadowReasons::ALL);
/// bulkhead.run(&LlmRequest::new(), options, async |_| Ok::<_, std::io::Error>(())).await?;
/// let observe = bulkhead.stats().observe.unwrap();
/// assert_eq!((observe.bypassed, observe.bypassed_by_reason.concurrency_limit), (1, 1));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct ObserveStats {
    /// Calls bypassed (run although refused).
    pub bypassed: u64,
    /// Of those, calls the advisory check would have admitted but the admission refused (a
    /// race, or a queue timeout).
    pub race_bypassed: u64,
    /// Bypasses by the refusal's reason.
    pub bypassed_by_reason: RejectionCounts,
    /// Bypassed calls that finished with a usage (reported or extracted from the result).
    pub usage_reported: u64,
    /// Input tokens of those usages.
    pub total_input_tokens: u64,
    /// Output tokens of those usages.
    pub total_output_tokens: u64,
}

/// Abandonments by cause.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct AbandonCounts {
    /// By `abandon_borrowed_concurrency`.
    pub manual: u64,
    /// By an expired `run` borrowed-slot deadline.
    pub deadline: u64,
}

impl AbandonCounts {
    fn from_array([manual, deadline]: [u64; AbandonCause::ALL.len()]) -> AbandonCounts {
        AbandonCounts { manual, deadline }
    }

    /// The sum over both causes.
    pub fn total(&self) -> u64 {
        self.manual.saturating_add(self.deadline)
    }
}

/// The admission classes' figures.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct ClassesStats {
    /// The class of calls that name none.
    #[cfg_attr(feature = "serde", serde(serialize_with = "serialize_class"))]
    pub default_class: AdmissionClass,
    /// The shared pool (capacity no class protects).
    pub shared: SharedStats,
    /// Each class, in configured order.
    pub classes: Vec<ClassStats>,
}

/// The shared pool in [`ClassesStats`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct SharedStats {
    /// `max_concurrent` minus the classes' floors (at least 0).
    pub max_concurrent: u64,
    /// Calls in flight beyond their classes' floors.
    pub in_flight: u64,
    /// `max_concurrent - in_flight`, at least 0.
    pub available_concurrent: u64,
    /// The tokens' shared pool, with a token budget (its capacity is the raw budget minus the
    /// classes' token floors, not adjusted for priority).
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub token_budget: Option<SharedTokenStats>,
}

/// The tokens' shared pool in [`SharedStats`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct SharedTokenStats {
    /// The budget minus the classes' token floors (at least 0).
    pub budget: u64,
    /// Tokens held beyond their classes' floors.
    pub in_flight_tokens: u64,
    /// `budget - in_flight_tokens`, at least 0.
    pub available: u64,
}

/// One admission class's figures.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct ClassStats {
    /// The class.
    #[cfg_attr(feature = "serde", serde(serialize_with = "serialize_class"))]
    pub class: AdmissionClass,
    /// Its limits in force (floors of 0 omitted).
    pub limits: ClassLimits,
    /// Its calls holding a slot.
    pub in_flight: u64,
    /// Of those, within its floor.
    pub protected_concurrent_in_use: u64,
    /// Of those, beyond its floor (borrowed from the shared pool).
    pub borrowed_concurrent: u64,
    /// Tokens its admissions hold.
    pub in_flight_tokens: u64,
    /// Of those, within its token floor.
    pub protected_tokens_in_use: u64,
    /// Of those, beyond its token floor.
    pub borrowed_in_flight_tokens: u64,
    /// Its admissions so far.
    pub admitted: u64,
    /// Its settled admissions so far.
    pub released: u64,
    /// Its admissions that gave their borrowed slot back before settling.
    pub borrowed_concurrency_abandoned: u64,
    /// The same, by cause.
    pub borrowed_concurrency_abandoned_by_cause: AbandonCounts,
    /// Its refusals so far.
    pub rejected: u64,
    /// Its refusals by reason.
    pub rejected_by_reason: RejectionCounts,
    /// Sum of its admissions' reservations. Its totals only grow, and with a token budget tie
    /// to its tokens as the bulkhead's do (see [`TokenBudgetStats`]), at the same instants:
    /// `in_flight_tokens == total_reserved + total_overrun + total_reheld - total_refunded -
    /// total_consumed - total_returned_unreported`.
    pub total_reserved: u64,
    /// Usage its admissions settled with (without a token budget too: then its admissions
    /// hold no tokens and the identity does not apply).
    pub total_consumed: u64,
    /// Tokens removed from its holds (gross; see [`TokenBudgetStats::total_refunded`](crate::stats::TokenBudgetStats::total_refunded)).
    pub total_refunded: u64,
    /// Tokens held above its reservations (see [`TokenBudgetStats::total_overrun`](crate::stats::TokenBudgetStats::total_overrun)).
    pub total_overrun: u64,
    /// Tokens added back to its holds below their reservations (see
    /// [`TokenBudgetStats::total_reheld`](crate::stats::TokenBudgetStats::total_reheld)).
    pub total_reheld: u64,
    /// Tokens of its holds returned by releases that knew no usage (see
    /// [`TokenBudgetStats::total_returned_unreported`](crate::stats::TokenBudgetStats::total_returned_unreported)).
    pub total_returned_unreported: u64,
    /// Admissions that borrowed their slot.
    pub total_borrowed_admissions: u64,
    /// Tokens admissions borrowed from the shared pool.
    pub total_borrowed_tokens_reserved: u64,
}

#[cfg(feature = "serde")]
fn serialize_class<S: serde::Serializer>(
    class: &AdmissionClass,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(class.id())
}

impl Stats {
    /// The snapshot of `figures`, with the panics counted outside the engine.
    pub(crate) fn new(figures: Figures, listener_panics: u64, estimator_panics: u64) -> Stats {
        let rejected_by_reason = RejectionCounts::from_array(figures.rejected);
        let abandoned = AbandonCounts::from_array(figures.abandoned);
        let budget = figures.limits.token_budget;
        Stats {
            borrowed_concurrency_abandoned: abandoned.total(),
            borrowed_concurrency_abandoned_by_cause: abandoned,
            admission_classes: figures
                .classes
                .map(|classes| ClassesStats::new(classes, budget.map(|b| b.budget))),
            limits: figures.limits.clone(),
            closed: figures.closed,
            in_flight: figures.in_flight,
            abandoned_in_flight: figures.abandoned_in_flight,
            pending: figures.pending,
            admitted: figures.admitted,
            released: figures.released,
            rejected: rejected_by_reason.total(),
            rejected_by_reason,
            usage_reports: figures.usage_reports,
            listener_panics,
            estimator_panics,
            deduplication: None,
            observe: None,
            token_budget: budget.map(|b| TokenBudgetStats {
                budget: b.budget,
                high_priority_reserve: b.high_priority_reserve,
                in_flight_tokens: figures.in_flight_tokens,
                available: b.budget.saturating_sub(figures.in_flight_tokens),
                total_reserved: figures.reserved,
                total_consumed: figures.consumed,
                total_refunded: figures.refunded,
                total_overrun: figures.overrun,
                total_reheld: figures.reheld,
                total_returned_unreported: figures.returned_unreported,
            }),
        }
    }
}

impl ClassesStats {
    fn new(figures: ClassesFigures, budget: Option<u64>) -> ClassesStats {
        ClassesStats {
            default_class: figures.default_class,
            shared: SharedStats {
                max_concurrent: figures.shared_capacity,
                in_flight: figures.shared_slots,
                available_concurrent: figures.shared_capacity.saturating_sub(figures.shared_slots),
                token_budget: budget.map(|budget| {
                    let capacity = budget.saturating_sub(figures.protected_tokens);
                    SharedTokenStats {
                        budget: capacity,
                        in_flight_tokens: figures.shared_tokens,
                        available: capacity.saturating_sub(figures.shared_tokens),
                    }
                }),
            },
            classes: figures.classes.iter().map(ClassStats::new).collect(),
        }
    }
}

impl ClassStats {
    fn new(f: &ClassFigures) -> ClassStats {
        let rejected =
            core::array::from_fn(|i| f.get(ClassCounter::Rejected(RejectReason::ALL[i])));
        let rejected_by_reason = RejectionCounts::from_array(rejected);
        let abandoned = AbandonCounts::from_array(core::array::from_fn(|i| {
            f.get(ClassCounter::Abandoned(AbandonCause::ALL[i]))
        }));
        ClassStats {
            class: f.class,
            limits: f.limits,
            in_flight: f.in_flight,
            protected_concurrent_in_use: f.in_flight.min(f.protected_concurrent),
            borrowed_concurrent: f.in_flight.saturating_sub(f.protected_concurrent),
            in_flight_tokens: f.in_flight_tokens,
            protected_tokens_in_use: f.in_flight_tokens.min(f.protected_tokens),
            borrowed_in_flight_tokens: f.in_flight_tokens.saturating_sub(f.protected_tokens),
            admitted: f.get(ClassCounter::Admitted),
            released: f.get(ClassCounter::Released),
            borrowed_concurrency_abandoned: abandoned.total(),
            borrowed_concurrency_abandoned_by_cause: abandoned,
            rejected: rejected_by_reason.total(),
            rejected_by_reason,
            total_reserved: f.get(ClassCounter::Reserved),
            total_consumed: f.get(ClassCounter::Consumed),
            total_refunded: f.get(ClassCounter::Refunded),
            total_overrun: f.get(ClassCounter::Overrun),
            total_reheld: f.get(ClassCounter::Reheld),
            total_returned_unreported: f.get(ClassCounter::ReturnedUnreported),
            total_borrowed_admissions: f.get(ClassCounter::BorrowedAdmissions),
            total_borrowed_tokens_reserved: f.get(ClassCounter::BorrowedTokensReserved),
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
    /// Refused by a rate window (requests or tokens per window).
    pub rate_limit: u64,
}

impl RejectionCounts {
    /// The counts of `counts`, indexed in [`RejectReason::ALL`]'s (declaration) order.
    pub(crate) fn from_array(counts: [u64; RejectReason::ALL.len()]) -> RejectionCounts {
        let [
            shutdown,
            concurrency_limit,
            budget_limit,
            queue_limit,
            timeout,
            aborted,
            rate_limit,
        ] = counts;
        RejectionCounts {
            shutdown,
            concurrency_limit,
            budget_limit,
            queue_limit,
            timeout,
            aborted,
            rate_limit,
        }
    }

    /// The count for `reason`.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{RejectReason, stats::RejectionCounts};
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
            RejectReason::RateLimit => self.rate_limit,
        }
    }

    /// The sum over all reasons.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::stats::RejectionCounts::default().total(), 0);
    /// ```
    pub fn total(&self) -> u64 {
        RejectReason::ALL
            .iter()
            .fold(0u64, |sum, &r| sum.saturating_add(self.get(r)))
    }
}

/// Token accounting of a bulkhead with a token budget.
///
/// Every `total_*` only ever grows (each can be exported as a counter); cumulative totals
/// saturate at `u64::MAX` instead of wrapping. They tie to the tokens in flight: at every
/// instant at which no call is between its update of the admission word and its counters (in
/// particular after any sequence of calls on one thread, and whenever the callers are quiet,
/// none of them a waiter the queue handed a slot it has not picked up yet),
///
/// `in_flight_tokens == total_reserved + total_overrun + total_reheld - total_refunded -
/// total_consumed - total_returned_unreported`
///
/// since each admission's hold is its reservation moved by its overruns, re-holds and refunds,
/// and a release either books its hold as consumed (its usage, after moving the hold to it)
/// or as returned unreported. Calls that hold no tokens (observe-mode bypasses, followers of
/// a deduplicated call) book nothing here.
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
///
/// The identity at every step of a call whose hold drops and rises again:
///
/// ```
/// use async_bulkhead_llm::*;
/// use async_bulkhead_llm::{usage::Progressive, stats::TokenBudgetStats};
///
/// let bulkhead = LlmBulkhead::builder("m", 1).token_budget(TokenBudget::new(5000)).build()?;
/// let balance = |t: TokenBudgetStats| {
///     t.total_reserved + t.total_overrun + t.total_reheld
///         - t.total_refunded - t.total_consumed - t.total_returned_unreported
/// };
/// let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
/// let mut permit = bulkhead.try_acquire(&LlmRequest::new(), opts)?;
/// permit.report_usage_progressive(TokenUsage::new(100, 300)?, Progressive::new(600))?; // 600
/// permit.report_usage_progressive(TokenUsage::new(100, 300)?, Progressive::new(800))?; // 800
/// let t = bulkhead.stats().token_budget.unwrap();
/// assert_eq!((t.in_flight_tokens, t.total_refunded, t.total_reheld), (800, 500, 200));
/// assert_eq!(balance(t), t.in_flight_tokens);
/// permit.release(Some(TokenUsage::new(100, 700)?));
/// let t = bulkhead.stats().token_budget.unwrap();
/// assert_eq!((t.in_flight_tokens, t.total_consumed, t.total_refunded), (0, 800, 500));
/// assert_eq!(balance(t), 0);
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
    /// Tokens held by admitted calls (see the identity above).
    pub in_flight_tokens: u64,
    /// `budget - in_flight_tokens`, at least 0 (not adjusted for priority).
    pub available: u64,
    /// Sum of the reservations of all admissions: the holds they started with.
    pub total_reserved: u64,
    /// Sum of the usage admissions were settled with (explicit, else their last report): the
    /// holds their releases returned after moving them to that usage. Reported usage always
    /// counts, even above a hold of 0.
    pub total_consumed: u64,
    /// Tokens removed from holds, by usage reports and at settlement (a hold above the
    /// usage): gross, never taken back. For every admission settled with usage,
    /// `reserved + overrun + reheld == consumed + refunded`.
    pub total_refunded: u64,
    /// Tokens ever held above admissions' original reservations (output beyond the
    /// reservation, input above the estimate, a final usage above the hold): only tokens above
    /// the reservation count (the original counted any increase of a hold). A hold that rises
    /// above its reservation and falls back books the rise here and the fall as a refund.
    pub total_overrun: u64,
    /// Tokens added back to holds below their reservations: a later report, or the final
    /// usage, raising a hold that had dropped (at most back to the reservation; above it is
    /// overrun). Each hold is `reserved + overrun + reheld - refunded` of its own bookings.
    pub total_reheld: u64,
    /// Tokens of holds returned by releases that knew no usage (no usage given, none
    /// reported: nobody said what they cost), booked neither as consumed nor as refunded.
    /// For every such admission `reserved + overrun + reheld == refunded + returned`.
    pub total_returned_unreported: u64,
}
