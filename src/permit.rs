//! Permits: the RAII proof of an admission. Releasing one (explicitly with usage, or by dropping
//! it) returns its slot and its tokens exactly once.

use core::fmt;
use core::ops::Deref;

use crate::admission_id::{AdmissionId, IdParts};
use crate::bulkhead::Inner;
use crate::error::UsageError;
use crate::estimate::Memo;
use crate::options::Priority;
use crate::reservation::{Reservation, TokenUsage};
use crate::sync::Arc;
use crate::usage::{Progressive, UsageReport};

/// What one admission holds. Shared by both permit types.
///
/// Kept compact (it is moved into every permit on the fast path): the optional parts are plain
/// values qualified by bits of `flags`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grant {
    pub(crate) id: IdParts,
    pub(crate) revision: u64,
    /// Tokens this admission currently contributes to the in-flight total.
    pub(crate) held: u64,
    /// The reservation admitted (meaningful with `HAS_RESERVATION`).
    reservation: Reservation,
    /// The estimator's memo (meaningful with `HAS_MEMO`).
    memo: Memo,
    /// Cumulative usage reported so far, per-field maximum (meaningful with `REPORTED`).
    reported: TokenUsage,
    /// Effective reports so far.
    pub(crate) sequence: u64,
    pub(crate) priority: Priority,
    flags: u8,
}

/// The admission has a reservation (the bulkhead has a token budget).
const HAS_RESERVATION: u8 = 1;
/// The bulkhead's estimator sized the admission (its memo goes back at settlement).
const HAS_MEMO: u8 = 1 << 1;
/// Usage was reported.
const REPORTED: u8 = 1 << 2;

impl Grant {
    #[inline]
    pub(crate) fn new(
        id: IdParts,
        revision: u64,
        priority: Priority,
        reservation: Option<Reservation>,
        memo: Option<Memo>,
        held: u64,
    ) -> Grant {
        let mut flags = 0;
        if reservation.is_some() {
            flags |= HAS_RESERVATION;
        }
        if memo.is_some() {
            flags |= HAS_MEMO;
        }
        Grant {
            id,
            revision,
            held,
            reservation: reservation.unwrap_or(Reservation::ZERO),
            memo: memo.unwrap_or(Memo::EMPTY),
            reported: TokenUsage::ZERO,
            sequence: 0,
            priority,
            flags,
        }
    }

    /// The reservation admitted, `None` without a token budget.
    #[inline]
    pub(crate) fn reservation(&self) -> Option<Reservation> {
        (self.flags & HAS_RESERVATION != 0).then_some(self.reservation)
    }

    /// The estimator's memo, when the bulkhead's estimator sized this admission.
    #[inline]
    pub(crate) fn memo(&self) -> Option<Memo> {
        (self.flags & HAS_MEMO != 0).then_some(self.memo)
    }

    /// The cumulative usage reported so far, if any.
    #[inline]
    pub(crate) fn reported(&self) -> Option<TokenUsage> {
        (self.flags & REPORTED != 0).then_some(self.reported)
    }

    /// Records the cumulative usage reported so far.
    #[inline]
    pub(crate) fn set_reported(&mut self, usage: TokenUsage) {
        self.reported = usage;
        self.flags |= REPORTED;
    }
}

/// What settling a permit did.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget, TokenUsage};
///
/// let bulkhead = LlmBulkhead::builder("m", 1).token_budget(TokenBudget::new(5000)).build()?;
/// let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
/// let report = bulkhead.try_acquire(&LlmRequest::new(), opts)?.release(Some(TokenUsage::new(20, 5)?));
/// assert_eq!((report.held_tokens, report.refunded_tokens), (1100, 1075));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReleaseReport {
    /// Tokens the admission held just before release (all returned to the budget now).
    pub held_tokens: u64,
    /// Part of the hold the usage did not consume: `held - usage`, or 0 when the usage reached
    /// the hold or no usage was known.
    pub refunded_tokens: u64,
    /// Part of the usage above both the hold and the reservation (booked as overrun).
    pub overrun_tokens: u64,
    /// The usage the release was settled with.
    pub usage: Option<TokenUsage>,
}

/// The shared body of both permit types: what was granted, and the bulkhead to settle it
/// with (borrowed or owned). Settles exactly once: by `release`, or else on drop.
struct Held<I: Deref<Target = Inner>> {
    inner: I,
    grant: Grant,
    settled: bool,
}

impl<I: Deref<Target = Inner>> Held<I> {
    fn new(inner: I, grant: Grant) -> Held<I> {
        Held {
            inner,
            grant,
            settled: false,
        }
    }

    fn release(mut self, usage: Option<TokenUsage>) -> ReleaseReport {
        self.settled = true;
        self.inner.settle(&self.grant, usage)
    }

    fn report(
        &mut self,
        usage: TokenUsage,
        progressive: Option<Progressive>,
    ) -> Result<UsageReport, UsageError> {
        self.inner.report(&mut self.grant, usage, progressive)
    }
}

impl<I: Deref<Target = Inner>> Drop for Held<I> {
    fn drop(&mut self) {
        if !self.settled {
            self.inner.settle_unused(&self.grant);
        }
    }
}

impl<I: Deref<Target = Inner>> fmt::Debug for Held<I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Held")
            .field("id", &self.grant.id.id())
            .field("limit_revision", &self.grant.revision)
            .field("priority", &self.grant.priority)
            .field("reservation", &self.grant.reservation())
            .field("held_tokens", &self.grant.held)
            .finish_non_exhaustive()
    }
}

macro_rules! permit_accessors {
    ($acquire:literal) => {
        /// Reports the call's cumulative usage so far (for example from a streaming response's
        /// usage fields), moving the hold at once: an input over-estimate is refunded to the
        /// budget, output beyond the reservation expands the hold (and so holds back new
        /// admissions until release). Each field only grows: a stale or duplicate report
        /// changes nothing and emits nothing. Without a token budget the report is recorded
        /// (and settles the release) but holds nothing.
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
        #[doc = concat!("let mut permit = bulkhead.", $acquire, "(&LlmRequest::new(), opts)?;")]
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
            self.held.report(usage, None)
        }

        /// Reports cumulative usage with a progressive reconciliation: the hold becomes
        /// `remaining + safety margin + output beyond the reservation`, so processed input
        /// and generated output stop being held. Use it once prefill is known complete, with
        /// `remaining` from an authoritative output cap.
        ///
        /// # Errors
        ///
        /// [`UsageError::RemainingExceedsCap`] when `remaining` exceeds the reservation's
        /// maximum output, and the errors of [`report_usage`](Self::report_usage); nothing
        /// changes.
        ///
        /// # Examples
        ///
        /// ```
        /// # use async_bulkhead_llm::*;
        /// let bulkhead = LlmBulkhead::builder("m", 1).token_budget(TokenBudget::new(5000)).build()?;
        /// let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
        #[doc = concat!("let mut permit = bulkhead.", $acquire, "(&LlmRequest::new(), opts)?;")]
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
            self.held.report(usage, Some(progressive))
        }

        /// The admission's unique id.
        ///
        /// # Examples
        ///
        /// ```
        /// # use async_bulkhead_llm::*;
        /// # let bulkhead = LlmBulkhead::builder("m", 2).build()?;
        #[doc = concat!("let a = bulkhead.", $acquire, "(&LlmRequest::new(), AcquireOptions::new())?;")]
        #[doc = concat!("let b = bulkhead.", $acquire, "(&LlmRequest::new(), AcquireOptions::new())?;")]
        /// assert_ne!(a.admission_id(), b.admission_id());
        /// # Ok::<(), Box<dyn std::error::Error>>(())
        /// ```
        pub fn admission_id(&self) -> AdmissionId {
            self.held.grant.id.id()
        }

        /// Revision of the limits that admitted this call. It never changes, even if newer
        /// limits are applied while the call runs.
        ///
        /// # Examples
        ///
        /// ```
        /// # use async_bulkhead_llm::*;
        /// let bulkhead = LlmBulkhead::builder("m", 2).initial_revision(4).build()?;
        #[doc = concat!("let permit = bulkhead.", $acquire, "(&LlmRequest::new(), AcquireOptions::new())?;")]
        /// bulkhead.apply_limits(Limits::new(5, 3))?;
        /// assert_eq!(permit.limit_revision(), 4);
        /// # Ok::<(), Box<dyn std::error::Error>>(())
        /// ```
        pub fn limit_revision(&self) -> u64 {
            self.held.grant.revision
        }

        /// The priority the call was admitted with.
        ///
        /// # Examples
        ///
        /// ```
        /// # use async_bulkhead_llm::*;
        /// # let bulkhead = LlmBulkhead::builder("m", 2).build()?;
        #[doc = concat!("let permit = bulkhead.", $acquire, "(&LlmRequest::new(), AcquireOptions::new().priority(Priority::High))?;")]
        /// assert_eq!(permit.priority(), Priority::High);
        /// # Ok::<(), Box<dyn std::error::Error>>(())
        /// ```
        pub fn priority(&self) -> Priority {
            self.held.grant.priority
        }

        /// The reservation admitted, or `None` when the bulkhead has no token budget.
        ///
        /// # Examples
        ///
        /// ```
        /// # use async_bulkhead_llm::*;
        /// let bulkhead = LlmBulkhead::builder("m", 2).token_budget(TokenBudget::new(10_000)).build()?;
        /// let request = LlmRequest::new().user("x".repeat(400)).max_tokens(100);
        #[doc = concat!("let permit = bulkhead.", $acquire, "(&request, AcquireOptions::new())?;")]
        /// assert_eq!(permit.reservation(), Some(Reservation::new(100, 100)?));
        /// # Ok::<(), Box<dyn std::error::Error>>(())
        /// ```
        pub fn reservation(&self) -> Option<Reservation> {
            self.held.grant.reservation()
        }

        /// Tokens this admission currently holds against the budget (0 without a budget).
        ///
        /// # Examples
        ///
        /// ```
        /// # use async_bulkhead_llm::*;
        /// let bulkhead = LlmBulkhead::builder("m", 2).token_budget(TokenBudget::new(10_000)).build()?;
        /// let opts = AcquireOptions::new().reservation(Reservation::new(10, 90)?);
        #[doc = concat!("let permit = bulkhead.", $acquire, "(&LlmRequest::new(), opts)?;")]
        /// assert_eq!(permit.held_tokens(), 100);
        /// # Ok::<(), Box<dyn std::error::Error>>(())
        /// ```
        pub fn held_tokens(&self) -> u64 {
            self.held.grant.held
        }
    };
}

/// A borrowed admission: holds one slot and its reserved tokens until it is released or
/// dropped.
///
/// [`release`](Permit::release) consumes the permit, so nothing can be reported or released
/// twice; dropping it releases without usage (the whole hold is returned, nothing is booked as
/// consumed or refunded). For a permit that must outlive the borrow (a response body, a
/// spawned task), use [`OwnedPermit`].
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
#[derive(Debug)]
pub struct Permit<'a> {
    held: Held<&'a Inner>,
}

impl<'a> Permit<'a> {
    pub(crate) fn new(inner: &'a Inner, grant: Grant) -> Permit<'a> {
        Permit {
            held: Held::new(inner, grant),
        }
    }

    permit_accessors!("try_acquire");

    /// The bulkhead and the grant, for a [`RunContext`](crate::RunContext) to report through.
    pub(crate) fn parts(&mut self) -> (&Inner, &mut Grant) {
        (self.held.inner, &mut self.held.grant)
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
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn release(self, usage: Option<TokenUsage>) -> ReleaseReport {
        self.held.release(usage)
    }
}

/// An owned admission: like [`Permit`], but keeps the bulkhead alive itself, so it is
/// `'static` and can move into a spawned task or a streaming response body.
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
#[derive(Debug)]
pub struct OwnedPermit {
    held: Held<Arc<Inner>>,
}

impl OwnedPermit {
    pub(crate) fn new(inner: Arc<Inner>, grant: Grant) -> OwnedPermit {
        OwnedPermit {
            held: Held::new(inner, grant),
        }
    }

    permit_accessors!("try_acquire_owned");

    /// Settles the admission; see [`Permit::release`].
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::*;
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 1).token_budget(TokenBudget::new(5000)).build()?;
    /// let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
    /// let permit = bulkhead.try_acquire_owned(&LlmRequest::new(), opts)?;
    /// let report = permit.release(None);
    /// assert_eq!((report.held_tokens, report.refunded_tokens), (1100, 0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn release(self, usage: Option<TokenUsage>) -> ReleaseReport {
        self.held.release(usage)
    }
}
