//! Permits: the RAII proof of an admission. Releasing one (explicitly with usage, or by dropping
//! it) returns its slot and its tokens exactly once.

use core::fmt;
use core::ops::Deref;

use crate::admission_class::AbandonCause;
use crate::error::UsageError;
use crate::reservation::{Progressive, ReleaseReport, TokenUsage, UsageReport};
use crate::sync::Arc;

use super::admission::Admission;
use super::core::LlmCore;

/// The bulkhead a permit settles with: borrowed (a [`Permit`] tied to the bulkhead's lifetime)
/// or shared ownership (an [`OwnedPermit`], which keeps the bulkhead alive).
enum CoreRef<'a> {
    Borrowed(&'a LlmCore),
    Owned(Arc<LlmCore>),
}

impl CoreRef<'_> {
    #[inline]
    fn get(&self) -> &LlmCore {
        match self {
            CoreRef::Borrowed(core) => core,
            CoreRef::Owned(core) => core,
        }
    }
}

/// An admission: holds one slot and its reserved tokens until it is released or dropped.
///
/// [`release`](Permit::release) consumes the permit, so nothing can be reported or released
/// twice; dropping it settles with the last reported usage, if any (else the whole hold is
/// returned, booked as returned unreported, not as consumed or refunded). A permit dereferences to its
/// [`Admission`] (id, limit revision, priority, reservation, hold, usage so far).
///
/// A `Permit<'a>` from [`try_acquire`](crate::LlmBulkhead::try_acquire) borrows the bulkhead;
/// an [`OwnedPermit`] (`Permit<'static>`) from the `_owned` methods keeps the bulkhead alive
/// itself, for response bodies and spawned tasks.
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
    core: CoreRef<'a>,
    /// Marked settled by `release` (see [`Admission::mark_settled`]), so that `Drop` settles
    /// only a permit that was not released. The mark lives in the admission's flags: a
    /// separate `bool` would push a permit past the 128 bytes the compiler copies inline.
    admission: Admission,
}

/// An admission that keeps its bulkhead alive: `'static`, so it can move into a spawned task or
/// a streaming response body. Returned by the `_owned` methods.
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
pub type OwnedPermit = Permit<'static>;

impl<'a> Permit<'a> {
    #[inline]
    pub(crate) fn borrowed(core: &'a LlmCore, admission: Admission) -> Permit<'a> {
        Permit {
            core: CoreRef::Borrowed(core),
            admission,
        }
    }

    /// The bulkhead and the admission, for a [`RunContext`](crate::RunContext) to report
    /// through.
    pub(crate) fn parts(&mut self) -> (&LlmCore, &mut Admission) {
        (self.core.get(), &mut self.admission)
    }

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
    /// [`UsageError`] when the clamped usage or the hold it implies cannot be represented;
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
        let (core, admission) = self.parts();
        core.report(admission, usage, None)
    }

    /// Reports cumulative usage with a progressive reconciliation: the hold becomes
    /// `remaining + safety margin + output beyond the reservation`, so processed input and
    /// generated output stop being held. Use it once prefill is known complete, with
    /// `remaining` from an authoritative output cap.
    ///
    /// # Errors
    ///
    /// [`UsageError::RemainingExceedsCap`] when `remaining` exceeds the reservation's maximum
    /// output, and the errors of [`report_usage`](Self::report_usage); nothing changes.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
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
        let (core, admission) = self.parts();
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
    /// [`BorrowedConcurrencyAbandonEvent`](crate::BorrowedConcurrencyAbandonEvent).
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
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
        let (core, admission) = self.parts();
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
        self.admission.mark_settled();
        self.core.get().settle(&self.admission, usage)
    }
}

impl Permit<'_> {
    /// Moves the admission out of the permit, which then settles nothing: the caller settles
    /// the admission itself (`run_shared`, whose context and future share it).
    pub(crate) fn into_admission(mut self) -> Admission {
        let admission = self.admission.duplicate();
        self.admission.mark_settled();
        admission
    }
}

impl Permit<'static> {
    #[inline]
    pub(crate) fn owned(core: Arc<LlmCore>, admission: Admission) -> OwnedPermit {
        Permit {
            core: CoreRef::Owned(core),
            admission,
        }
    }

    /// The shared core of an owned permit (for `bulkhead()`, in `bulkhead.rs`).
    pub(crate) fn owned_core(&self) -> Option<&Arc<LlmCore>> {
        match &self.core {
            CoreRef::Owned(core) => Some(core),
            CoreRef::Borrowed(_) => None,
        }
    }
}

impl Deref for Permit<'_> {
    type Target = Admission;

    #[inline]
    fn deref(&self) -> &Admission {
        &self.admission
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if !self.admission.is_settled() {
            self.core.get().settle_unused(&self.admission);
        }
    }
}

impl fmt::Debug for Permit<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.core {
            CoreRef::Borrowed(_) => "Permit",
            CoreRef::Owned(_) => "OwnedPermit",
        };
        f.debug_struct(name)
            .field("admission", &self.admission)
            .finish()
    }
}
