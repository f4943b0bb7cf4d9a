//! Token reservations (what an admission holds) and token usage (what a call really consumed),
//! both validated when they are built.

use core::fmt;

use crate::error::{RequestError, UsageError};

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
/// # Ok::<(), async_bulkhead_llm::RequestError>(())
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
    /// [`RequestError::ReservationOverflow`] when the sum does not fit in a `u64`.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{RequestError, Reservation};
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
    /// [`RequestError::ReservationOverflow`] when `input + max_output` overflows, and
    /// [`RequestError::ReservedMismatch`] when `reserved` differs from the sum.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{RequestError, Reservation};
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
/// # Ok::<(), async_bulkhead_llm::UsageError>(())
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
    /// [`UsageError::TotalOverflow`] when `input + output` does not fit in a `u64`.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{TokenUsage, UsageError};
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
