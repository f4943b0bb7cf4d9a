//! The token vocabulary, as plain values: reservations (what an admission holds), usage (what a
//! call really consumed), progressive reconciliations, and the reports of a usage report and of
//! a release. Reservations and usage are validated when they are built.

use core::fmt;

use crate::vocabulary::admission_id::{AdmissionId, ShadowId};
use crate::vocabulary::error::{RequestError, UsageError};

/// The default output ceiling when a request names none: 2048 tokens.
pub const DEFAULT_OUTPUT_CAP: u64 = 2048;

/// A token reservation: estimated input plus maximum output.
///
/// Every `Reservation` is consistent by construction: `reserved() == input() + max_output()`
/// and the sum fits in a `u64`. [`LlmBulkhead::estimate`](crate::LlmBulkhead::estimate)
/// returns one, and any `Reservation` can be passed back as a per-call override with
/// [`AcquireOptions::reservation`](crate::AcquireOptions::reservation), which skips the
/// estimator.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::Reservation;
///
/// let r = Reservation::new(100, 1000)?;
/// assert_eq!((r.input(), r.max_output(), r.reserved()), (100, 1000, 1100));
/// # Ok::<(), async_bulkhead_llm::request::RequestError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Reservation {
    input: u64,
    max_output: u64,
}

impl Reservation {
    /// The empty reservation (what a grant without a token budget stores).
    pub(crate) const ZERO: Reservation = Reservation {
        input: 0,
        max_output: 0,
    };

    /// A reservation of `input + max_output` tokens.
    ///
    /// # Errors
    ///
    /// [`RequestError::ReservationOverflow`](crate::request::RequestError::ReservationOverflow) when the sum does not fit in a `u64`.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{request::RequestError, Reservation};
    ///
    /// assert_eq!(Reservation::new(1, 2).unwrap().reserved(), 3);
    /// assert_eq!(
    ///     Reservation::new(u64::MAX, 1),
    ///     Err(RequestError::ReservationOverflow { input: u64::MAX, max_output: 1 }),
    /// );
    /// ```
    pub const fn new(input: u64, max_output: u64) -> Result<Reservation, RequestError> {
        match input.checked_add(max_output) {
            Some(_) => Ok(Reservation { input, max_output }),
            None => Err(RequestError::ReservationOverflow { input, max_output }),
        }
    }

    /// A reservation whose cached total is checked against its parts, for overrides that carry
    /// a `reserved` figure from elsewhere (a preview stored in a lease, a control plane).
    ///
    /// # Errors
    ///
    /// [`RequestError::ReservationOverflow`](crate::request::RequestError::ReservationOverflow) when `input + max_output` overflows, and
    /// [`RequestError::ReservedMismatch`](crate::request::RequestError::ReservedMismatch) when `reserved` differs from the sum.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{request::RequestError, Reservation};
    ///
    /// assert!(Reservation::with_reserved(100, 1000, 1100).is_ok());
    /// let err = Reservation::with_reserved(100, 1000, 999).unwrap_err();
    /// assert_eq!(err, RequestError::ReservedMismatch { reserved: 999, input: 100, max_output: 1000 });
    /// assert_eq!(
    ///     err.to_string(),
    ///     "reservation.reserved (999) must equal reservation.input + reservation.max_output (1100)",
    /// );
    /// ```
    pub const fn with_reserved(
        input: u64,
        max_output: u64,
        reserved: u64,
    ) -> Result<Reservation, RequestError> {
        match Reservation::new(input, max_output) {
            Ok(r) if r.reserved() == reserved => Ok(r),
            Ok(_) => Err(RequestError::ReservedMismatch {
                reserved,
                input,
                max_output,
            }),
            Err(e) => Err(e),
        }
    }

    /// Estimated input tokens.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::Reservation::new(7, 9).unwrap().input(), 7);
    /// ```
    pub const fn input(&self) -> u64 {
        self.input
    }

    /// Maximum output tokens.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::Reservation::new(7, 9).unwrap().max_output(), 9);
    /// ```
    pub const fn max_output(&self) -> u64 {
        self.max_output
    }

    /// The whole reservation, `input + max_output`.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::Reservation::new(7, 9).unwrap().reserved(), 16);
    /// ```
    pub const fn reserved(&self) -> u64 {
        // Cannot overflow: `new` checked the sum.
        self.input + self.max_output
    }
}

impl fmt::Display for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} tokens ({} input + {} max output)",
            self.reserved(),
            self.input,
            self.max_output
        )
    }
}

/// Tokens a call really used, as the provider reported them.
///
/// The total always fits in a `u64`: [`TokenUsage::new`] refuses a pair whose sum overflows,
/// so a settled usage can never be wrapped or truncated.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::TokenUsage;
///
/// let usage = TokenUsage::new(120, 380)?;
/// assert_eq!((usage.input(), usage.output(), usage.total()), (120, 380, 500));
/// # Ok::<(), async_bulkhead_llm::usage::UsageError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TokenUsage {
    input: u64,
    output: u64,
}

impl TokenUsage {
    /// No usage (what a grant stores before its first report).
    pub(crate) const ZERO: TokenUsage = TokenUsage {
        input: 0,
        output: 0,
    };

    /// Usage of `input` prompt tokens and `output` generated tokens.
    ///
    /// # Errors
    ///
    /// [`UsageError::TotalOverflow`](crate::usage::UsageError::TotalOverflow) when `input + output` does not fit in a `u64`.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{TokenUsage, usage::UsageError};
    ///
    /// assert!(TokenUsage::new(0, 0).is_ok());
    /// assert_eq!(
    ///     TokenUsage::new(u64::MAX, 1),
    ///     Err(UsageError::TotalOverflow { input: u64::MAX, output: 1 }),
    /// );
    /// ```
    pub const fn new(input: u64, output: u64) -> Result<TokenUsage, UsageError> {
        match input.checked_add(output) {
            Some(_) => Ok(TokenUsage { input, output }),
            None => Err(UsageError::TotalOverflow { input, output }),
        }
    }

    /// Prompt tokens.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::TokenUsage::new(3, 4).unwrap().input(), 3);
    /// ```
    pub const fn input(&self) -> u64 {
        self.input
    }

    /// Generated tokens.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::TokenUsage::new(3, 4).unwrap().output(), 4);
    /// ```
    pub const fn output(&self) -> u64 {
        self.output
    }

    /// `input + output`.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::TokenUsage::new(3, 4).unwrap().total(), 7);
    /// ```
    pub const fn total(&self) -> u64 {
        // Cannot overflow: `new` checked the sum.
        self.input + self.output
    }
}

/// A progressive reconciliation: how much output the provider may still generate, from an
/// authoritative source, plus a safety margin. Use it only once prefill is known complete.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::usage::Progressive;
///
/// let p = Progressive::new(600).safety_margin(50);
/// assert_eq!((p.remaining_output_tokens, p.safety_margin_tokens), (600, 50));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Progressive {
    /// Output tokens the call may still generate; at most the reservation's maximum output.
    pub remaining_output_tokens: u64,
    /// Extra tokens kept held for safety (default 0).
    pub safety_margin_tokens: u64,
}

impl Progressive {
    /// `remaining_output_tokens` still to come, no safety margin.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::usage::Progressive::new(10).safety_margin_tokens, 0);
    /// ```
    pub const fn new(remaining_output_tokens: u64) -> Progressive {
        Progressive {
            remaining_output_tokens,
            safety_margin_tokens: 0,
        }
    }

    /// This reconciliation with a safety margin.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::usage::Progressive::new(10).safety_margin(128).safety_margin_tokens, 128);
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn safety_margin(mut self, tokens: u64) -> Progressive {
        self.safety_margin_tokens = tokens;
        self
    }
}

/// What a usage report did, as the permit sees it afterwards.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::*;
///
/// let bulkhead = LlmBulkhead::builder("m", 1).token_budget(TokenBudget::new(5000)).build()?;
/// let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
/// let mut permit = bulkhead.try_acquire(&LlmRequest::new(), opts)?;
/// let report = permit.report_usage(TokenUsage::new(20, 5)?)?;
/// assert_eq!((report.sequence, report.reserved, report.held, report.consumed), (1, 1100, 1020, 25));
/// assert_eq!((report.output_cap, report.output_remaining, report.over_reservation), (Some(1000), Some(995), false));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct UsageReport {
    /// The admission's id.
    pub admission_id: AdmissionId,
    /// Revision of the limits that admitted it.
    pub limit_revision: u64,
    /// Effective reports so far (a stale or duplicate report does not count).
    pub sequence: u64,
    /// The original reservation (0 without a token budget).
    pub reserved: u64,
    /// The hold now (0 without a token budget).
    pub held: u64,
    /// Cumulative input + output reported.
    pub consumed: u64,
    /// The reservation's maximum output (`None` without a token budget).
    pub output_cap: Option<u64>,
    /// `output_cap - output`, at least 0 (`None` without a token budget).
    pub output_remaining: Option<u64>,
    /// Whether `consumed` exceeds the reservation (always false without a token budget).
    pub over_reservation: bool,
    /// For an observe-mode call that was bypassed: its shadow id (its `admission_id` is then
    /// that id's UUID, not an admission's). `None` for an admitted call.
    pub shadow_id: Option<ShadowId>,
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
/// assert_eq!((report.returned_tokens, report.returned_total_tokens), (1100, 1100));
///
/// // A report lowers the hold to 1,020 first (80 back to the budget then), and the release
/// // knows no usage beyond it: it returns the rest.
/// let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
/// let mut permit = bulkhead.try_acquire(&LlmRequest::new(), opts)?;
/// permit.report_usage(TokenUsage::new(20, 5)?)?;
/// let report = permit.release(None);
/// assert_eq!((report.held_tokens, report.refunded_tokens, report.overrun_tokens), (1020, 995, 0));
/// assert_eq!((report.returned_tokens, report.returned_total_tokens), (1020, 1100));
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
    /// Tokens this release returned to the budget: the whole hold, whether or not usage was
    /// known (always `held_tokens`; 0 without a token budget).
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// let bulkhead = LlmBulkhead::builder("m", 1).token_budget(TokenBudget::new(5000)).build()?;
    /// let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
    /// let report = bulkhead.try_acquire(&LlmRequest::new(), opts)?.release(None);
    /// assert_eq!((report.returned_tokens, report.refunded_tokens), (1100, 0)); // no usage known
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub returned_tokens: u64,
    /// Tokens the admission gave back to the budget over its whole life: what its usage
    /// reports removed from its hold (gross: tokens a later report held again are not taken
    /// off) plus [`returned_tokens`](ReleaseReport::returned_tokens).
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// # use async_bulkhead_llm::{usage::Progressive};
    /// let bulkhead = LlmBulkhead::builder("m", 1).token_budget(TokenBudget::new(5000)).build()?;
    /// let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
    /// let mut permit = bulkhead.try_acquire(&LlmRequest::new(), opts)?;
    /// let lower = Progressive::new(700).safety_margin(50); // holds 750: 350 back
    /// permit.report_usage_progressive(TokenUsage::new(100, 300)?, lower)?;
    /// let raise = Progressive::new(850).safety_margin(50); // holds 900 again
    /// permit.report_usage_progressive(TokenUsage::new(100, 300)?, raise)?;
    /// let report = permit.release(Some(TokenUsage::new(100, 950)?));
    /// assert_eq!((report.held_tokens, report.returned_tokens), (900, 900));
    /// assert_eq!(report.returned_total_tokens, 350 + 900);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub returned_total_tokens: u64,
    /// The usage the release was settled with.
    pub usage: Option<TokenUsage>,
}
