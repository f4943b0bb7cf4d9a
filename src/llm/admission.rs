//! [`Admission`]: the record of one admitted call, shared by both permit types and the run
//! context (they deref to it), so its accessors are written once. It pairs the engine's
//! [`Grant`] (id, revision, priority, hold) with the LLM wing's ledger (reservation, the
//! estimator's memo, the usage reported so far).

use core::fmt;

use crate::engine::Grant;
use crate::vocabulary::admission_class::{AdmissionClass, Resources};
use crate::vocabulary::admission_id::AdmissionId;
use crate::vocabulary::priority::Priority;
use crate::vocabulary::reservation::{Reservation, TokenUsage};

use super::estimate::Memo;

/// What one admitted call holds and has reported: read it through a [`Permit`](crate::Permit),
/// an [`OwnedPermit`](crate::OwnedPermit) or a [`RunContext`](crate::RunContext), which all
/// dereference to it.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Priority, Reservation, TokenBudget};
///
/// let bulkhead = LlmBulkhead::builder("m", 2)
///     .initial_revision(4)
///     .token_budget(TokenBudget::new(10_000))
///     .build()?;
/// let options = AcquireOptions::new()
///     .priority(Priority::High)
///     .reservation(Reservation::new(10, 90)?);
/// let permit = bulkhead.try_acquire(&LlmRequest::new(), options)?;
/// assert_eq!(permit.limit_revision(), 4);
/// assert_eq!(permit.priority(), Priority::High);
/// assert_eq!(permit.reservation(), Some(Reservation::new(10, 90)?));
/// assert_eq!(permit.held_tokens(), 100);
/// assert_eq!(permit.usage(), None);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Admission {
    grant: Grant,
    ledger: Ledger,
}

/// The LLM half of an admission. Kept compact (it is moved into every permit on the fast
/// path): the optional parts are plain values qualified by bits of `flags`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ledger {
    /// The reservation admitted (meaningful with `HAS_RESERVATION`).
    reservation: Reservation,
    /// The estimator's memo (meaningful with `HAS_MEMO`).
    memo: Memo,
    /// Cumulative usage reported so far, per-field maximum (meaningful with `REPORTED`).
    reported: TokenUsage,
    /// Effective reports so far (saturating; `u32` keeps a permit within 128 bytes, see
    /// `Grant`).
    sequence: u32,
    flags: u8,
    /// Tokens its usage reports removed from its hold so far (gross, saturating): what it
    /// gave back to the budget before its release.
    refunded: u64,
}

impl Ledger {
    /// The ledger of an admission of `reservation` (none without a token budget) as sized by
    /// the estimator (`memo`) or given by the caller (no memo), before anything is reported.
    #[inline]
    pub(crate) fn new(reservation: Option<Reservation>, memo: Option<Memo>) -> Ledger {
        let mut flags = 0;
        if reservation.is_some() {
            flags |= HAS_RESERVATION;
        }
        if memo.is_some() {
            flags |= HAS_MEMO;
        }
        Ledger {
            reservation: reservation.unwrap_or(Reservation::ZERO),
            memo: memo.unwrap_or(Memo::EMPTY),
            reported: TokenUsage::ZERO,
            sequence: 0,
            flags,
            refunded: 0,
        }
    }
}

/// The admission has a reservation (the bulkhead has a token budget).
const HAS_RESERVATION: u8 = 1;
/// The bulkhead's estimator sized the admission (its memo goes back at settlement).
const HAS_MEMO: u8 = 1 << 1;
/// Usage was reported.
const REPORTED: u8 = 1 << 2;
/// Its permit was released (so dropping it settles nothing more).
const SETTLED: u8 = 1 << 3;
/// Sampled listeners hear its events (see `crate::events`).
const SAMPLED: u8 = 1 << 4;

impl Admission {
    /// The record of `grant`, admitted with `ledger` (its reservation and memo, nothing
    /// reported yet: [`Ledger::new`]).
    #[inline]
    pub(crate) fn new(grant: Grant, ledger: Ledger) -> Admission {
        Admission { grant, ledger }
    }

    /// Marks the admission sampled: sampled listeners hear its later events.
    #[inline]
    pub(crate) fn mark_sampled(&mut self) {
        self.ledger.flags |= SAMPLED;
    }

    /// Whether sampled listeners hear this admission's events.
    #[inline]
    pub(crate) fn sampled(&self) -> bool {
        self.ledger.flags & SAMPLED != 0
    }

    /// The admission's unique id.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// # let bulkhead = LlmBulkhead::builder("m", 2).build()?;
    /// let a = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// let b = bulkhead.try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())?;
    /// assert_ne!(a.admission_id(), b.admission_id());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn admission_id(&self) -> AdmissionId {
        self.grant.id()
    }

    /// Revision of the limits that admitted this call. It never changes, even if newer
    /// limits are applied while the call runs.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// let bulkhead = LlmBulkhead::builder("m", 2).initial_revision(4).build()?;
    /// let permit = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// bulkhead.apply_limits(Limits::new(5, 3))?;
    /// assert_eq!(permit.limit_revision(), 4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn limit_revision(&self) -> u64 {
        self.grant.revision()
    }

    /// The priority the call was admitted with.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// # let bulkhead = LlmBulkhead::builder("m", 2).build()?;
    /// let options = AcquireOptions::new().priority(Priority::High);
    /// let permit = bulkhead.try_acquire_owned(&LlmRequest::new(), options)?;
    /// assert_eq!(permit.priority(), Priority::High);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn priority(&self) -> Priority {
        self.grant.priority()
    }

    /// The reservation admitted, or `None` when the bulkhead has no token budget.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// let bulkhead = LlmBulkhead::builder("m", 2).token_budget(TokenBudget::new(10_000)).build()?;
    /// let request = LlmRequest::new().user("x".repeat(400)).max_tokens(100);
    /// let permit = bulkhead.try_acquire(&request, AcquireOptions::new())?;
    /// assert_eq!(permit.reservation(), Some(Reservation::new(100, 100)?));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn reservation(&self) -> Option<Reservation> {
        (self.ledger.flags & HAS_RESERVATION != 0).then_some(self.ledger.reservation)
    }

    /// Tokens this admission currently holds against the budget (0 without a budget).
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// let bulkhead = LlmBulkhead::builder("m", 2).token_budget(TokenBudget::new(10_000)).build()?;
    /// let opts = AcquireOptions::new().reservation(Reservation::new(10, 90)?);
    /// let mut permit = bulkhead.try_acquire(&LlmRequest::new(), opts)?;
    /// assert_eq!(permit.held_tokens(), 100);
    /// permit.report_usage(TokenUsage::new(4, 1)?)?;
    /// assert_eq!(permit.held_tokens(), 94); // 4 input + the 90 output reserved
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn held_tokens(&self) -> u64 {
        self.grant.held()
    }

    /// The cumulative usage reported so far (the per-field maximum of every report), or
    /// `None` before the first report. A release without explicit usage settles with it.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// let bulkhead = LlmBulkhead::builder("m", 2).build()?;
    /// let mut permit = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// permit.report_usage(TokenUsage::new(10, 3)?)?;
    /// permit.report_usage(TokenUsage::new(8, 7)?)?; // input cannot go back
    /// assert_eq!(permit.usage(), Some(TokenUsage::new(10, 7)?));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn usage(&self) -> Option<TokenUsage> {
        (self.ledger.flags & REPORTED != 0).then_some(self.ledger.reported)
    }

    /// Effective usage reports so far (a stale or duplicate report does not count).
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// let bulkhead = LlmBulkhead::builder("m", 2).build()?;
    /// let mut permit = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// permit.report_usage(TokenUsage::new(10, 3)?)?;
    /// permit.report_usage(TokenUsage::new(10, 3)?)?; // a duplicate
    /// assert_eq!(permit.usage_sequence(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn usage_sequence(&self) -> u64 {
        u64::from(self.ledger.sequence)
    }

    /// The admission class the call was admitted in, on a bulkhead with admission classes.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// # use async_bulkhead_llm::{classes::AdmissionClasses, classes::ClassLimits};
    /// let bulkhead = LlmBulkhead::builder("m", 4)
    ///     .admission_classes(
    ///         AdmissionClasses::new("standard")
    ///             .class("premium", ClassLimits::new().protected_concurrent(2))
    ///             .class("standard", ClassLimits::new()),
    ///     )
    ///     .build()?;
    /// let premium = bulkhead.class("premium")?;
    /// let a = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new().class(premium))?;
    /// let b = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// assert_eq!(a.class().map(|c| c.id()), Some("premium"));
    /// assert_eq!(b.class().map(|c| c.id()), Some("standard")); // the default class
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn class(&self) -> Option<AdmissionClass> {
        self.grant.class()
    }

    /// What the call borrowed from the shared pool when it was admitted: whether its slot
    /// was beyond its class's protected floor, and how many of its reserved tokens were beyond
    /// the class's token floor. Always [`Resources::NONE`](crate::classes::Resources::NONE) without admission classes.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// # use async_bulkhead_llm::{classes::AdmissionClasses, classes::ClassLimits};
    /// let bulkhead = LlmBulkhead::builder("m", 4)
    ///     .admission_classes(
    ///         AdmissionClasses::new("standard")
    ///             .class("premium", ClassLimits::new().protected_concurrent(1))
    ///             .class("standard", ClassLimits::new()),
    ///     )
    ///     .build()?;
    /// let premium = AcquireOptions::new().class(bulkhead.class("premium")?);
    /// let first = bulkhead.try_acquire(&LlmRequest::new(), premium)?;
    /// let second = bulkhead.try_acquire(&LlmRequest::new(), premium)?;
    /// assert!(!first.resources().borrowed_concurrency); // within the floor of 1
    /// assert!(second.resources().borrowed_concurrency); // beyond it: from the shared pool
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn resources(&self) -> Resources {
        self.grant.resources()
    }

    /// Whether the call still holds its slot (`false` once it abandoned its borrowed slot;
    /// its tokens stay held until it settles).
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// # use async_bulkhead_llm::{classes::AdmissionClasses, classes::ClassLimits};
    /// let bulkhead = LlmBulkhead::builder("m", 2)
    ///     .admission_classes(AdmissionClasses::new("batch").class("batch", ClassLimits::new()))
    ///     .build()?;
    /// let mut permit = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// assert!(permit.holds_slot());
    /// assert!(permit.abandon_borrowed_concurrency()); // no floor: every slot is borrowed
    /// assert!(!permit.holds_slot());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn holds_slot(&self) -> bool {
        self.grant.holds_slot()
    }

    /// The tokens reserved at admission (0 without a token budget).
    #[inline]
    pub(crate) fn reserved_tokens(&self) -> u64 {
        self.reservation().map_or(0, |r| r.reserved())
    }

    /// The estimator's memo, when the bulkhead's estimator sized this admission.
    #[inline]
    pub(crate) fn memo(&self) -> Option<Memo> {
        (self.ledger.flags & HAS_MEMO != 0).then_some(self.ledger.memo)
    }

    #[inline]
    pub(crate) fn grant(&self) -> &Grant {
        &self.grant
    }

    #[inline]
    pub(crate) fn grant_mut(&mut self) -> &mut Grant {
        &mut self.grant
    }

    /// A second record of the same admission, for moving it out of a permit that is then
    /// marked settled (so exactly one of the two ever settles).
    #[inline]
    pub(crate) fn duplicate(&self) -> Admission {
        Admission {
            grant: self.grant,
            ledger: self.ledger,
        }
    }

    /// Marks the admission settled by its permit's `release`.
    #[inline]
    pub(crate) fn mark_settled(&mut self) {
        self.ledger.flags |= SETTLED;
    }

    /// Whether its permit's `release` settled it.
    #[inline]
    pub(crate) fn is_settled(&self) -> bool {
        self.ledger.flags & SETTLED != 0
    }

    /// Tokens its usage reports removed from its hold so far (see `ReleaseReport`).
    #[inline]
    pub(crate) fn refunded_tokens(&self) -> u64 {
        self.ledger.refunded
    }

    /// Books `tokens` a usage report removed from its hold.
    #[inline]
    pub(crate) fn add_refunded(&mut self, tokens: u64) {
        self.ledger.refunded = self.ledger.refunded.saturating_add(tokens);
    }

    /// Records the cumulative usage reported so far, and whether the report was effective.
    #[inline]
    pub(crate) fn record(&mut self, usage: TokenUsage, effective: bool) {
        self.ledger.reported = usage;
        self.ledger.flags |= REPORTED;
        if effective {
            self.ledger.sequence = self.ledger.sequence.saturating_add(1);
        }
    }
}

impl fmt::Debug for Admission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admission")
            .field("admission_id", &self.admission_id())
            .field("limit_revision", &self.limit_revision())
            .field("priority", &self.priority())
            .field("class", &self.class())
            .field("resources", &self.resources())
            .field("holds_slot", &self.holds_slot())
            .field("reservation", &self.reservation())
            .field("held_tokens", &self.held_tokens())
            .field("usage", &self.usage())
            .finish()
    }
}
