//! Observe (shadow) mode's records: [`Bypass`](crate::observe::Bypass), what a bypassed call's callback knows about the
//! refusal it runs past; the running record of one bypass ([`BypassCall`]: its usage so far);
//! and the observe counters behind [`Stats::observe`](crate::Stats::observe).
//!
//! A bypassed call holds nothing: no slot, no tokens, no class counts. Its usage reports are
//! validated and clamped as an admitted call's are (`LlmCore::report_bypass` in `usage.rs`),
//! and only counted here.

use crate::stats::{ObserveStats, RejectionCounts};
use crate::support::sync::unmodeled::{AtomicU64, Ordering};
use crate::vocabulary::admission_class::AdmissionClass;
use crate::vocabulary::admission_id::ShadowId;
use crate::vocabulary::priority::Priority;
use crate::vocabulary::rejection::{CapacityDetail, RejectReason};
use crate::vocabulary::reservation::{Reservation, TokenUsage};

/// An observe-mode call that the bulkhead refused and that runs anyway, holding no capacity:
/// what [`RunContext::bypass`](crate::RunContext::bypass) returns.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::*;
/// use async_bulkhead_llm::{observe::ShadowReasons};
///
/// # ::futures::executor::block_on(async {
/// let bulkhead = LlmBulkhead::builder("m", 4).token_budget(TokenBudget::new(1000)).build()?;
/// let options = AcquireOptions::new()
///     .reservation(Reservation::new(900, 600)?) // 1,500 tokens: more than the budget
///     .observe(ShadowReasons::ALL);
/// let bypass = bulkhead
///     .run(&LlmRequest::new(), options, async |ctx| Ok::<_, std::io::Error>(ctx.bypass()))
///     .await?
///     .expect("refused, so bypassed");
/// assert_eq!(bypass.reason, RejectReason::BudgetLimit);
/// assert_eq!(bypass.reservation, Some(Reservation::new(900, 600)?));
/// assert_eq!(bypass.detail.unwrap().token_budget.unwrap().requested, 1500);
/// assert!(!bypass.raced);
/// assert_eq!(bulkhead.stats().rejected, 0); // predicted: not counted as a rejection
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Bypass {
    /// The bypass's id (`shadow-…`): never an admission id.
    pub shadow_id: ShadowId,
    /// Why the bulkhead refused the call.
    pub reason: RejectReason,
    /// The capacity snapshot of the refusal (none for a deduplication follower whose own wait
    /// timed out).
    pub detail: Option<CapacityDetail>,
    /// Whether the advisory check said "admit" or "queue" and the admission then refused (a
    /// race, or a queue timeout).
    pub raced: bool,
    /// The reservation the call would have held (none without a token budget).
    pub reservation: Option<Reservation>,
    /// Revision of the limits that refused it.
    pub limit_revision: u64,
    /// The call's priority.
    pub priority: Priority,
    /// The call's admission class (with classes).
    pub class: Option<AdmissionClass>,
}

/// One bypass while it runs: the refusal and the usage reported so far.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BypassCall {
    pub(crate) bypass: Bypass,
    /// Cumulative usage reported so far (per-field maximum).
    pub(crate) reported: Option<TokenUsage>,
    /// Effective reports so far.
    pub(crate) sequence: u64,
}

impl BypassCall {
    pub(crate) fn new(bypass: Bypass) -> BypassCall {
        BypassCall {
            bypass,
            reported: None,
            sequence: 0,
        }
    }
}

/// The observe counters of one bulkhead. Bypasses are rare and slow (the call runs), so these
/// are plain shared atomics.
#[derive(Debug, Default)]
pub(crate) struct ObserveCounters {
    bypassed: AtomicU64,
    race_bypassed: AtomicU64,
    by_reason: [AtomicU64; RejectReason::ALL.len()],
    usage_reported: AtomicU64,
    input_tokens: AtomicU64,
    output_tokens: AtomicU64,
}

impl ObserveCounters {
    /// Counts the start of `bypass`.
    pub(crate) fn count_bypass(&self, bypass: &Bypass) {
        // Relaxed: statistics; `stats()` promises no ordering between its figures.
        self.by_reason[bypass.reason as usize].fetch_add(1, Ordering::Relaxed);
        if bypass.raced {
            self.race_bypassed.fetch_add(1, Ordering::Relaxed);
        }
        // Last, so that a reader that sees `bypassed` also sees the reason it counted.
        self.bypassed.fetch_add(1, Ordering::Release);
    }

    /// Counts the usage a bypassed call finished with.
    pub(crate) fn count_usage(&self, usage: TokenUsage) {
        self.input_tokens
            .fetch_add(usage.input(), Ordering::Relaxed);
        self.output_tokens
            .fetch_add(usage.output(), Ordering::Relaxed);
        self.usage_reported.fetch_add(1, Ordering::Relaxed);
    }

    /// The figures, once a call was bypassed.
    pub(crate) fn stats(&self) -> Option<ObserveStats> {
        let bypassed = self.bypassed.load(Ordering::Acquire);
        if bypassed == 0 {
            return None;
        }
        Some(ObserveStats {
            bypassed,
            race_bypassed: self.race_bypassed.load(Ordering::Relaxed),
            bypassed_by_reason: RejectionCounts::from_array(core::array::from_fn(|i| {
                self.by_reason[i].load(Ordering::Relaxed)
            })),
            usage_reported: self.usage_reported.load(Ordering::Relaxed),
            total_input_tokens: self.input_tokens.load(Ordering::Relaxed),
            total_output_tokens: self.output_tokens.load(Ordering::Relaxed),
        })
    }
}
