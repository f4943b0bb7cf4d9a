//! Permits: the RAII proof of an admission. Releasing one (explicitly with usage, or by dropping
//! it) returns its slot and its tokens exactly once. [`Permit`] borrows its bulkhead;
//! [`OwnedPermit`] keeps it alive. Both are the engine's permit core over `LlmCore`, with the
//! same methods (written once, below).

use core::fmt;
use core::ops::Deref;

use crate::engine::permit::{Holder, PermitCore};
use crate::support::sync::Arc;
use crate::vocabulary::admission_class::AbandonCause;
use crate::vocabulary::error::UsageError;
use crate::vocabulary::reservation::{Progressive, ReleaseReport, TokenUsage, UsageReport};

use super::admission::Admission;
use super::shared::LlmCore;

impl Holder for LlmCore {
    type Held = Admission;

    #[inline]
    fn is_settled(admission: &Admission) -> bool {
        admission.is_settled()
    }

    fn settle_dropped(&self, admission: &Admission) {
        self.settle_unused(admission);
    }
}

/// An admission: holds one slot and its reserved tokens until it is released or dropped.
///
/// [`release`](Permit::release) consumes the permit, so nothing can be reported or released
/// twice; dropping it settles with the last reported usage, if any (else the whole hold is
/// returned, booked as returned unreported, not as consumed or refunded). A permit dereferences to its
/// [`Admission`](crate::admission::Admission) (id, limit revision, priority, reservation, hold, usage so far).
///
/// A `Permit<'a>` from [`try_acquire`](crate::LlmBulkhead::try_acquire) borrows the bulkhead;
/// an [`OwnedPermit`] from the `_owned` methods keeps the bulkhead alive itself, for response
/// bodies and spawned tasks. Both have the same methods.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest};
///
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 1).build()?;
/// {
///     let _permit = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
///     assert_eq!(bulkhead.stats().in_flight, 1);
/// } // dropped: released
/// assert_eq!(bulkhead.stats().in_flight, 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "dropping a permit releases its capacity immediately"]
#[clippy::has_significant_drop]
pub struct Permit<'a> {
    /// Settled by `release` (the mark lives in the admission's flags: a separate `bool` would
    /// push a permit past the 128 bytes the compiler copies inline).
    core: PermitCore<&'a LlmCore>,
}

/// An admission that keeps its bulkhead alive: `'static`, so it can move into a spawned task or
/// a streaming response body. Returned by the `_owned` methods; the same methods as a
/// [`Permit`], and [`bulkhead`](OwnedPermit::bulkhead) to reach the bulkhead it came from.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, OwnedPermit};
///
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 1).build()?;
/// let permit: OwnedPermit = bulkhead.try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())?;
/// let worker = std::thread::spawn(move || {
///     // ... stream the response ...
///     drop(permit);
/// });
/// worker.join().unwrap();
/// assert_eq!(bulkhead.stats().released, 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "dropping a permit releases its capacity immediately"]
#[clippy::has_significant_drop]
pub struct OwnedPermit {
    core: PermitCore<Arc<LlmCore>>,
}

impl<'a> Permit<'a> {
    #[inline]
    pub(crate) fn new(core: &'a LlmCore, admission: Admission) -> Permit<'a> {
        Permit {
            core: PermitCore::new(core, admission),
        }
    }

    /// The bulkhead and the admission, for a [`RunContext`](crate::RunContext) to report
    /// through.
    pub(crate) fn parts(&mut self) -> (&LlmCore, &mut Admission) {
        self.core.parts()
    }
}

impl OwnedPermit {
    #[inline]
    pub(crate) fn new(core: Arc<LlmCore>, admission: Admission) -> OwnedPermit {
        OwnedPermit {
            core: PermitCore::new(core, admission),
        }
    }

    /// Moves the admission out of the permit, which then settles nothing: the caller settles
    /// the admission itself (`run_shared`, whose context and future share it).
    pub(crate) fn into_admission(mut self) -> Admission {
        let (_, held) = self.core.parts();
        let admission = held.duplicate();
        held.mark_settled();
        admission
    }

    /// The shared core (for `bulkhead()`, in `bulkhead.rs`).
    pub(crate) fn shared_core(&self) -> &Arc<LlmCore> {
        self.core.core()
    }
}

/// The methods both permits have, written once.
macro_rules! permit_methods {
    ($($permit:tt)+) => {
        impl $($permit)+ {
            /// Reports the call's cumulative usage so far (for example from a streaming response's
            /// usage fields), moving the hold at once: an input over-estimate is refunded to the
            /// budget, output beyond the reservation expands the hold (and so holds back new
            /// admissions until release). Each field only grows: a stale or duplicate report changes
            /// nothing and emits nothing. Without a token budget the report is recorded (and settles
            /// the release) but holds nothing.
            ///
            /// A release without explicit usage (or a drop) settles with the last reported usage.
            ///
            /// # Errors
            ///
            /// [`UsageError`](crate::usage::UsageError) when the clamped usage or the hold it implies cannot be represented;
            /// nothing changes.
            ///
            /// # Examples
            ///
            /// ```
            /// # use async_bulkhead_llm::*;
            /// let bulkhead = LlmBulkhead::builder("m", 1).token_budget(TokenBudget::new(5000)).build()?;
            /// let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
            /// let mut permit = bulkhead.try_acquire(&LlmRequest::new(), opts)?;
            /// // The prompt was 20 tokens, not 100: 80 go back to the budget now.
            /// assert_eq!(permit.report_usage(TokenUsage::new(20, 5)?)?.held, 1020);
            /// // The output runs past the reservation: the hold grows with it.
            /// let report = permit.report_usage(TokenUsage::new(20, 1400)?)?;
            /// assert_eq!((report.held, report.sequence, report.over_reservation), (1420, 2, true));
            /// // A stale report changes nothing.
            /// assert_eq!(permit.report_usage(TokenUsage::new(10, 10)?)?.sequence, 2);
            /// assert_eq!(bulkhead.stats().token_budget.unwrap().in_flight_tokens, 1420);
            /// # Ok::<(), Box<dyn std::error::Error>>(())
            /// ```
            pub fn report_usage(&mut self, usage: TokenUsage) -> Result<UsageReport, UsageError> {
                let (core, admission) = self.core.parts();
                core.report(admission, usage, None)
            }

            /// Reports cumulative usage with a progressive reconciliation: the hold becomes
            /// `remaining + safety margin + output beyond the reservation`, so processed input and
            /// generated output stop being held. Use it once prefill is known complete, with
            /// `remaining` from an authoritative output cap.
            ///
            /// # Errors
            ///
            /// [`UsageError::RemainingExceedsCap`](crate::usage::UsageError::RemainingExceedsCap) when `remaining` exceeds the reservation's maximum
            /// output, and the errors of [`report_usage`](Self::report_usage); nothing changes.
            ///
            /// # Examples
            ///
            /// ```
            /// # use async_bulkhead_llm::*;
            /// # use async_bulkhead_llm::{usage::Progressive};
            /// let bulkhead = LlmBulkhead::builder("m", 1).token_budget(TokenBudget::new(5000)).build()?;
            /// let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
            /// let mut permit = bulkhead.try_acquire_owned(&LlmRequest::new(), opts)?;
            /// let progress = Progressive::new(900).safety_margin(50);
            /// assert_eq!(permit.report_usage_progressive(TokenUsage::new(20, 100)?, progress)?.held, 950);
            /// let progress = Progressive::new(600).safety_margin(50);
            /// assert_eq!(permit.report_usage_progressive(TokenUsage::new(20, 400)?, progress)?.held, 650);
            /// assert_eq!(bulkhead.stats().token_budget.unwrap().total_refunded, 450);
            /// let too_much = Progressive::new(1001);
            /// assert!(permit.report_usage_progressive(TokenUsage::new(20, 400)?, too_much).is_err());
            /// # Ok::<(), Box<dyn std::error::Error>>(())
            /// ```
            pub fn report_usage_progressive(
                &mut self,
                usage: TokenUsage,
                progressive: Progressive,
            ) -> Result<UsageReport, UsageError> {
                let (core, admission) = self.core.parts();
                core.report(admission, usage, Some(progressive))
            }

            /// Gives the call's slot back now, before the call ends, if it was borrowed from the
            /// shared pool (see [`resources`](Admission::resources)) and is still held: the slot goes
            /// to the queue's head at once, while the tokens stay held (and usage can still be
            /// reported) until the permit is released or dropped. Returns whether it did anything
            /// (always `false` without admission classes, for a slot within the class's floor, and for
            /// a second call; also while 4,095 admissions of the bulkhead have abandoned their slot
            /// and not settled yet, the most its admission word counts: the slot then stays held until
            /// the permit settles).
            ///
            /// Use it when a call that borrowed capacity turns out to run long (a slow stream, a
            /// tool loop): the concurrency it borrowed returns to other classes without cutting the
            /// call. Counted in [`Stats::borrowed_concurrency_abandoned`](crate::Stats) (cause
            /// `manual`) and announced as a
            /// [`BorrowedConcurrencyAbandonEvent`](crate::events::BorrowedConcurrencyAbandonEvent).
            ///
            /// # Examples
            ///
            /// ```
            /// # use async_bulkhead_llm::*;
            /// # use async_bulkhead_llm::{classes::AdmissionClasses, classes::ClassLimits};
            /// let bulkhead = LlmBulkhead::builder("m", 2)
            ///     .token_budget(TokenBudget::new(1000))
            ///     .admission_classes(
            ///         AdmissionClasses::new("batch")
            ///             .class("premium", ClassLimits::new().protected_concurrent(1))
            ///             .class("batch", ClassLimits::new()),
            ///     )
            ///     .build()?;
            /// let opts = AcquireOptions::new().reservation(Reservation::new(100, 200)?);
            /// let mut batch = bulkhead.try_acquire(&LlmRequest::new(), opts)?; // the one shared slot
            /// assert!(bulkhead.try_acquire(&LlmRequest::new(), opts).is_err());
            ///
            /// assert!(batch.abandon_borrowed_concurrency());
            /// assert!(!batch.abandon_borrowed_concurrency()); // once
            /// let stats = bulkhead.stats();
            /// assert_eq!((stats.in_flight, stats.abandoned_in_flight), (0, 1));
            /// assert_eq!(stats.token_budget.unwrap().in_flight_tokens, 300); // still held
            ///
            /// let next = bulkhead.try_acquire(&LlmRequest::new(), opts)?; // the slot is free again
            /// batch.release(Some(TokenUsage::new(100, 50)?)); // settles the tokens
            /// assert_eq!(bulkhead.stats().token_budget.unwrap().in_flight_tokens, 300);
            /// # drop(next);
            /// # Ok::<(), Box<dyn std::error::Error>>(())
            /// ```
            pub fn abandon_borrowed_concurrency(&mut self) -> bool {
                let (core, admission) = self.core.parts();
                core.abandon(admission, AbandonCause::Manual)
            }

            /// Settles the admission: returns its slot and its whole hold, and books `usage` (else
            /// the last reported usage, if any) as consumed, the unused part of the hold as refunded
            /// and usage beyond the hold and the reservation as overrun.
            ///
            /// Consuming the permit makes reporting after release impossible:
            ///
            /// ```compile_fail
            /// # use async_bulkhead_llm::*;
            /// # let bulkhead = LlmBulkhead::builder("m", 1).build().unwrap();
            /// let mut permit = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).unwrap();
            /// permit.release(None);
            /// permit.report_usage(TokenUsage::new(1, 1).unwrap()); // error: use of moved value
            /// ```
            ///
            /// # Examples
            ///
            /// ```
            /// use async_bulkhead_llm::*;
            ///
            /// let bulkhead = LlmBulkhead::builder("m", 1).token_budget(TokenBudget::new(5000)).build()?;
            /// let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
            /// let permit = bulkhead.try_acquire(&LlmRequest::new(), opts)?;
            /// let report = permit.release(Some(TokenUsage::new(100, 1400)?));
            /// assert_eq!(report.refunded_tokens, 0); // usage above the hold refunds nothing
            /// let t = bulkhead.stats().token_budget.unwrap();
            /// assert_eq!((t.in_flight_tokens, t.total_consumed), (0, 1500));
            ///
            /// let permit = bulkhead.try_acquire_owned(&LlmRequest::new(), opts)?;
            /// let report = permit.release(None); // no usage known: the hold returns, nothing booked
            /// assert_eq!((report.held_tokens, report.refunded_tokens), (1100, 0));
            /// # Ok::<(), Box<dyn std::error::Error>>(())
            /// ```
            pub fn release(mut self, usage: Option<TokenUsage>) -> ReleaseReport {
                self.release_in_place(usage)
            }

            /// [`release`](Self::release) where the permit is (a tenant's permit releases
            /// both levels without moving them out): settled here, its drop then only lets
            /// the bulkhead go.
            #[inline]
            pub(crate) fn release_in_place(&mut self, usage: Option<TokenUsage>) -> ReleaseReport {
                let (core, admission) = self.core.parts();
                admission.mark_settled();
                core.settle(admission, usage)
            }
        }

        impl Deref for $($permit)+ {
            type Target = Admission;

            #[inline]
            fn deref(&self) -> &Admission {
                self.core.held()
            }
        }
    };
}

permit_methods!(Permit<'_>);
permit_methods!(OwnedPermit);

impl fmt::Debug for Permit<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("admission", self.core.held())
            .finish()
    }
}

impl fmt::Debug for OwnedPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedPermit")
            .field("admission", self.core.held())
            .finish()
    }
}
