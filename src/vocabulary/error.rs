//! Errors for input that can never succeed: invalid configuration, invalid limit snapshots,
//! invalid per-call input and invalid usage. Each names the field and the value it refused.
//!
//! Capacity refusals ("not now") are not errors of this kind; they are
//! [`Rejection`](crate::Rejection)s.

use core::fmt;

use crate::vocabulary::admission_class::AdmissionClass;
use crate::vocabulary::rejection::Rejection;

/// The builder refused a configuration. Nothing was built.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{builder::ConfigError, LlmBulkhead, TokenBudget};
///
/// let err = LlmBulkhead::builder("  ", 4).build().unwrap_err();
/// assert_eq!(err, ConfigError::EmptyModel { model: "  ".into() });
///
/// let err = LlmBulkhead::builder("gpt-4o", 4)
///     .token_budget(TokenBudget::new(100).high_priority_reserve(101))
///     .build()
///     .unwrap_err();
/// assert_eq!(err.to_string(), "token_budget.high_priority_reserve (101) must be <= token_budget.budget (100)");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// `model` is empty or only whitespace.
    EmptyModel {
        /// The refused model name.
        model: String,
    },
    /// `max_concurrent` exceeds what the admission word can count
    /// ([`MAX_CONCURRENT`](crate::limits::MAX_CONCURRENT)).
    MaxConcurrentTooLarge {
        /// The refused value.
        value: usize,
        /// The largest accepted value.
        max: usize,
    },
    /// `max_queue` exceeds what the limits hold (`u32::MAX`).
    MaxQueueTooLarge {
        /// The refused value.
        value: usize,
        /// The largest accepted value.
        max: usize,
    },
    /// `initial_revision` exceeds the largest revision (2^53 - 1, so revisions survive JSON).
    InitialRevisionTooLarge {
        /// The refused value.
        value: u64,
        /// The largest accepted value.
        max: u64,
    },
    /// `token_budget.budget` exceeds what the admission word can count
    /// ([`MAX_BUDGET`](crate::limits::MAX_BUDGET)).
    BudgetTooLarge {
        /// The refused value.
        value: u64,
        /// The largest accepted value.
        max: u64,
    },
    /// `token_budget.high_priority_reserve` exceeds `token_budget.budget`.
    ReserveExceedsBudget {
        /// The refused reserve.
        reserve: u64,
        /// The configured budget.
        budget: u64,
    },
    /// The admission classes' default class id is empty or only whitespace.
    DefaultClassEmpty {
        /// The refused id.
        default_class: String,
    },
    /// Admission classes were configured without any class.
    NoClasses,
    /// A class's limits are invalid (see [`ClassLimitsError`](crate::classes::ClassLimitsError)).
    Class(ClassLimitsError),
    /// The default class names no configured class.
    UnknownDefaultClass {
        /// The refused id.
        default_class: String,
    },
    /// The classes' protected floors of concurrent calls add up to more than
    /// `max_concurrent`.
    ProtectedConcurrentSumTooLarge {
        /// The sum of the floors.
        sum: u64,
        /// The configured `max_concurrent`.
        max_concurrent: u32,
    },
    /// The classes' protected floors of tokens add up to more than the token budget.
    ProtectedTokensSumTooLarge {
        /// The sum of the floors.
        sum: u64,
        /// The configured budget.
        budget: u64,
    },
    /// The rate limits are invalid (one of the `Rate*` reasons of [`LimitsError`]).
    RateLimits(LimitsError),
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::RateLimits(error) => write!(f, "rate_limits: {error}"),
            ConfigError::EmptyModel { model } => {
                write!(f, "model must be a non-empty string (got {model:?})")
            }
            ConfigError::MaxConcurrentTooLarge { value, max } => {
                write!(f, "max_concurrent ({value}) must be <= {max}")
            }
            ConfigError::MaxQueueTooLarge { value, max } => {
                write!(f, "max_queue ({value}) must be <= {max}")
            }
            ConfigError::InitialRevisionTooLarge { value, max } => {
                write!(f, "initial_revision ({value}) must be <= {max}")
            }
            ConfigError::BudgetTooLarge { value, max } => {
                write!(f, "token_budget.budget ({value}) must be <= {max}")
            }
            ConfigError::ReserveExceedsBudget { reserve, budget } => write!(
                f,
                "token_budget.high_priority_reserve ({reserve}) must be <= token_budget.budget ({budget})"
            ),
            ConfigError::DefaultClassEmpty { default_class } => write!(
                f,
                "admission_classes.default_class must be a non-empty string (got {default_class:?})"
            ),
            ConfigError::NoClasses => {
                f.write_str("admission_classes must contain at least one class")
            }
            ConfigError::Class(error) => error.fmt_in("admission_classes.classes", f),
            ConfigError::UnknownDefaultClass { default_class } => write!(
                f,
                "admission_classes.default_class {default_class:?} must name a configured class"
            ),
            ConfigError::ProtectedConcurrentSumTooLarge {
                sum,
                max_concurrent,
            } => write!(
                f,
                "admission_classes protected_concurrent sum ({sum}) must be <= max_concurrent ({max_concurrent})"
            ),
            ConfigError::ProtectedTokensSumTooLarge { sum, budget } => write!(
                f,
                "admission_classes protected_in_flight_tokens sum ({sum}) must be <= token_budget.budget ({budget})"
            ),
        }
    }
}

impl std::error::Error for ConfigError {}

/// `apply_limits` or `set_budget` refused a snapshot. The limits in force did not change.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{limits::LimitsError, LlmBulkhead};
///
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 4).build()?;
/// let err = bulkhead.set_budget(10).unwrap_err();
/// assert_eq!(err, LimitsError::TokenBudgetNotConfigured);
/// assert_eq!(bulkhead.limits().revision, 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LimitsError {
    /// `revision` exceeds the largest revision (2^53 - 1).
    RevisionTooLarge {
        /// The refused value.
        value: u64,
        /// The largest accepted value.
        max: u64,
    },
    /// `max_concurrent` exceeds what the admission word can count.
    MaxConcurrentTooLarge {
        /// The refused value.
        value: u32,
        /// The largest accepted value.
        max: u32,
    },
    /// The budget exceeds what the admission word can count
    /// ([`MAX_BUDGET`](crate::limits::MAX_BUDGET)).
    BudgetTooLarge {
        /// The refused value.
        value: u64,
        /// The largest accepted value.
        max: u64,
    },
    /// The bulkhead was built with a token budget, and the snapshot has none.
    TokenBudgetRequired,
    /// The snapshot carries a token budget, or `set_budget` was called, on a bulkhead built
    /// without one.
    TokenBudgetNotConfigured,
    /// `set_budget` cannot advance the revision past 2^53 - 1.
    RevisionExhausted {
        /// The current revision.
        current: u64,
    },
    /// The bulkhead was built with admission classes, and the snapshot has none.
    AdmissionClassesRequired,
    /// The snapshot carries admission classes on a bulkhead built without them.
    AdmissionClassesNotConfigured,
    /// The snapshot's classes are not exactly the ids the bulkhead was built with.
    ClassIdsMismatch,
    /// A class's limits are invalid (see [`ClassLimitsError`](crate::classes::ClassLimitsError)).
    Class(ClassLimitsError),
    /// The classes' protected floors of concurrent calls add up to more than the snapshot's
    /// `max_concurrent`.
    ProtectedConcurrentSumTooLarge {
        /// The sum of the floors.
        sum: u64,
        /// The snapshot's `max_concurrent`.
        max_concurrent: u32,
    },
    /// The classes' protected floors of tokens add up to more than the snapshot's budget.
    ProtectedTokensSumTooLarge {
        /// The sum of the floors.
        sum: u64,
        /// The snapshot's budget.
        budget: u64,
    },
    /// The bulkhead was built with rate limits, and the snapshot has none.
    RateLimitsRequired,
    /// The snapshot carries rate limits on a bulkhead built without them.
    RateLimitsNotConfigured,
    /// A rate window must be 1 ms to 1 day long.
    RateWindowOutOfRange {
        /// The refused window.
        window: std::time::Duration,
    },
    /// Rate limits must limit requests or tokens (or both), each by at least 1.
    RateLimitsEmpty,
    /// A tokens window counts reservations: it needs a token budget.
    RateTokensNeedBudget,
    /// A rate limit may count at most one unit per nanosecond of its window.
    RateLimitTooHigh {
        /// The refused limit.
        limit: u64,
        /// Its window.
        window: std::time::Duration,
    },
}

impl fmt::Display for LimitsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimitsError::RevisionTooLarge { value, max } => {
                write!(f, "limits.revision ({value}) must be <= {max}")
            }
            LimitsError::MaxConcurrentTooLarge { value, max } => {
                write!(f, "limits.max_concurrent ({value}) must be <= {max}")
            }
            LimitsError::BudgetTooLarge { value, max } => {
                write!(f, "limits.token_budget.budget ({value}) must be <= {max}")
            }
            LimitsError::TokenBudgetRequired => f.write_str(
                "limits.token_budget is required because a token budget was configured at construction",
            ),
            LimitsError::TokenBudgetNotConfigured => f.write_str(
                "limits.token_budget must be omitted because no token budget was configured at construction",
            ),
            LimitsError::RevisionExhausted { current } => write!(
                f,
                "cannot advance the limit revision beyond {current} (the largest revision)"
            ),
            LimitsError::AdmissionClassesRequired => f.write_str(
                "limits.admission_classes is required because admission classes were configured at construction",
            ),
            LimitsError::AdmissionClassesNotConfigured => f.write_str(
                "limits.admission_classes must be omitted because no admission classes were configured at construction",
            ),
            LimitsError::ClassIdsMismatch => f.write_str(
                "limits.admission_classes must contain exactly the construction-time class ids",
            ),
            LimitsError::Class(error) => error.fmt_in("limits.admission_classes", f),
            LimitsError::ProtectedConcurrentSumTooLarge {
                sum,
                max_concurrent,
            } => write!(
                f,
                "limits.admission_classes protected_concurrent sum ({sum}) must be <= max_concurrent ({max_concurrent})"
            ),
            LimitsError::ProtectedTokensSumTooLarge { sum, budget } => write!(
                f,
                "limits.admission_classes protected_in_flight_tokens sum ({sum}) must be <= token_budget.budget ({budget})"
            ),
            LimitsError::RateLimitsRequired => f.write_str(
                "limits.rate is required because rate limits were configured at construction",
            ),
            LimitsError::RateLimitsNotConfigured => f.write_str(
                "limits.rate must be omitted because no rate limits were configured at construction",
            ),
            LimitsError::RateWindowOutOfRange { window } => write!(
                f,
                "limits.rate.window ({window:?}) must be from 1 ms to 1 day"
            ),
            LimitsError::RateLimitsEmpty => f.write_str(
                "limits.rate must limit requests or tokens, each by at least 1",
            ),
            LimitsError::RateTokensNeedBudget => f.write_str(
                "limits.rate.tokens needs a token budget (the window counts reservations)",
            ),
            LimitsError::RateLimitTooHigh { limit, window } => write!(
                f,
                "limits.rate limit ({limit}) must be at most one per nanosecond of its window ({window:?})"
            ),
        }
    }
}

impl std::error::Error for LimitsError {}

/// A call's input cannot be turned into a reservation. Nothing was reserved or counted.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::request::RequestError;
///
/// let err = RequestError::InputOverflow { text_tokens: 2, opaque_tokens: 0, extra_input_tokens: u64::MAX };
/// assert_eq!(
///     err.to_string(),
///     "estimated input (2 text tokens + 0 opaque-block tokens + 18446744073709551615 extra input tokens) does not fit in 64 bits",
/// );
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RequestError {
    /// `input + max_output` does not fit in a `u64`.
    ReservationOverflow {
        /// Input tokens.
        input: u64,
        /// Maximum output tokens.
        max_output: u64,
    },
    /// A reservation's `reserved` differs from `input + max_output`.
    ReservedMismatch {
        /// The stated total.
        reserved: u64,
        /// Input tokens.
        input: u64,
        /// Maximum output tokens.
        max_output: u64,
    },
    /// The estimated text tokens, opaque-block surcharge and `extra_input_tokens` do not sum
    /// within a `u64`.
    InputOverflow {
        /// `ceil(chars / ratio)`.
        text_tokens: u64,
        /// The opaque-block surcharge (`u64::MAX` when it overflows on its own).
        opaque_tokens: u64,
        /// The request's `extra_input_tokens`.
        extra_input_tokens: u64,
    },
    /// The text alone estimates to more tokens than a `u64` holds (a tiny chars-per-token
    /// ratio, or an adaptive correction of a huge estimate).
    TextTooLarge {
        /// Characters of text (UTF-16 code units).
        chars: u64,
    },
    /// An admission class was given to a bulkhead built without admission classes.
    ClassesNotConfigured {
        /// The class given.
        class: AdmissionClass,
    },
    /// The admission class belongs to another bulkhead.
    ForeignClass {
        /// The class given.
        class: AdmissionClass,
    },
    /// A `run`'s borrowed-slot deadline was zero.
    ZeroBorrowedConcurrencyDeadline,
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            RequestError::ReservationOverflow { input, max_output } => write!(
                f,
                "token reservation ({input} input + {max_output} max output) does not fit in 64 bits"
            ),
            RequestError::ReservedMismatch {
                reserved,
                input,
                max_output,
            } => write!(
                f,
                "reservation.reserved ({reserved}) must equal reservation.input + reservation.max_output ({})",
                u128::from(input) + u128::from(max_output)
            ),
            RequestError::InputOverflow {
                text_tokens,
                opaque_tokens,
                extra_input_tokens,
            } => write!(
                f,
                "estimated input ({text_tokens} text tokens + {opaque_tokens} opaque-block tokens + {extra_input_tokens} extra input tokens) does not fit in 64 bits"
            ),
            RequestError::TextTooLarge { chars } => write!(
                f,
                "estimated input for {chars} characters does not fit in 64 bits"
            ),
            RequestError::ClassesNotConfigured { class } => write!(
                f,
                "admission class {:?} requires admission classes to be configured",
                class.id()
            ),
            RequestError::ForeignClass { class } => write!(
                f,
                "admission class {:?} belongs to another bulkhead",
                class.id()
            ),
            RequestError::ZeroBorrowedConcurrencyDeadline => {
                f.write_str("borrowed_concurrency_deadline must be greater than zero")
            }
        }
    }
}

impl std::error::Error for RequestError {}

/// A usage figure cannot be represented.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{TokenUsage, usage::UsageError};
///
/// let err = TokenUsage::new(u64::MAX, u64::MAX).unwrap_err();
/// assert!(matches!(err, UsageError::TotalOverflow { .. }));
/// assert!(err.to_string().starts_with("token usage total"));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum UsageError {
    /// `input + output` does not fit in a `u64`.
    TotalOverflow {
        /// Prompt tokens.
        input: u64,
        /// Generated tokens.
        output: u64,
    },
    /// A progressive report's remaining output exceeds the reservation's maximum output.
    RemainingExceedsCap {
        /// The reported remaining output.
        remaining: u64,
        /// The reservation's maximum output.
        cap: u64,
    },
    /// The hold the report implies, or the tokens in flight with it, does not fit in a `u64`.
    HoldOverflow,
    /// The report came through the context of a [`run_shared`](crate::LlmBulkhead::run_shared)
    /// call that was already settled (the context was kept after the callback's future ended).
    Settled,
}

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            UsageError::TotalOverflow { input, output } => write!(
                f,
                "token usage total ({input} input + {output} output) does not fit in 64 bits"
            ),
            UsageError::RemainingExceedsCap { remaining, cap } => write!(
                f,
                "progressive reconciliation remaining_output_tokens ({remaining}) must not exceed the reserved output cap ({cap})"
            ),
            UsageError::HoldOverflow => {
                f.write_str("the hold this usage implies does not fit in 64 bits")
            }
            UsageError::Settled => {
                f.write_str("the call was already settled: its usage can no longer change")
            }
        }
    }
}

impl std::error::Error for UsageError {}

/// An estimator was configured with an invalid option. Nothing was built.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::estimate::ModelAwareEstimator;
///
/// let err = ModelAwareEstimator::builder().ratio("my-model", -1.0).build().unwrap_err();
/// assert_eq!(err.to_string(), "ratio override for \"my-model\" must be a finite number > 0 (got -1)");
/// ```
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum EstimatorError {
    /// A chars-per-token override is not a finite number above 0.
    InvalidRatio {
        /// The model the override is for.
        model: String,
        /// The refused ratio.
        ratio: f64,
    },
    /// `smoothing` is not a finite number in `(0, 1]`.
    Smoothing {
        /// The refused value.
        value: f64,
    },
    /// `min_samples` is 0.
    MinSamples {
        /// The refused value.
        value: u64,
    },
    /// `min_correction` is not a finite number above 0.
    MinCorrection {
        /// The refused value.
        value: f64,
    },
    /// `max_correction` is not a finite number at least `min_correction`.
    MaxCorrection {
        /// The refused value.
        value: f64,
        /// The configured `min_correction`.
        min: f64,
    },
    /// `max_models` is 0.
    MaxModels {
        /// The refused value.
        value: usize,
    },
}

impl fmt::Display for EstimatorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EstimatorError::InvalidRatio { model, ratio } => write!(
                f,
                "ratio override for {model:?} must be a finite number > 0 (got {ratio})"
            ),
            EstimatorError::Smoothing { value } => {
                write!(
                    f,
                    "smoothing must be a finite number in (0, 1] (got {value})"
                )
            }
            EstimatorError::MinSamples { value } => {
                write!(f, "min_samples must be a positive integer (got {value})")
            }
            EstimatorError::MinCorrection { value } => {
                write!(
                    f,
                    "min_correction must be a finite number > 0 (got {value})"
                )
            }
            EstimatorError::MaxCorrection { value, min } => write!(
                f,
                "max_correction must be a finite number >= min_correction ({min}) (got {value})"
            ),
            EstimatorError::MaxModels { value } => {
                write!(f, "max_models must be a positive integer (got {value})")
            }
        }
    }
}

impl std::error::Error for EstimatorError {}

/// Why an acquire did not produce a permit: the bulkhead refused it for capacity (retry later
/// or shed), or its input was invalid (fix the request).
///
/// One type for `try_acquire` and `acquire().await`, unlike tokio's `TryAcquireError` /
/// `AcquireError` split: tokio's two calls fail in different ways (no permit now vs closed), but
/// here both can be refused for every reason (a closed bulkhead, the budget, a class limit, a
/// full queue: `try_acquire` never queues, so it reports what `acquire` would have waited for as
/// `concurrency_limit`), and both can be handed an invalid request. The reason, in the
/// [`Rejection`], is what tells them apart. Non-exhaustive: match the variants you handle and
/// keep a wildcard arm.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, RejectReason};
///
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 0).build()?;
/// match bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()) {
///     Err(AcquireError::Rejected(rejection)) => {
///         assert_eq!(rejection.reason(), RejectReason::ConcurrencyLimit)
///     }
///     other => panic!("expected a rejection, got {other:?}"),
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AcquireError {
    /// Refused for capacity or shutdown; carries the capacity snapshot for a 429/503.
    Rejected(Rejection),
    /// The request or its options are invalid; nothing was counted.
    Invalid(RequestError),
}

impl AcquireError {
    /// The rejection, when this is one.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireError, request::RequestError};
    ///
    /// let invalid = AcquireError::Invalid(RequestError::ReservationOverflow { input: 1, max_output: u64::MAX });
    /// assert!(invalid.rejection().is_none());
    /// ```
    pub fn rejection(&self) -> Option<&Rejection> {
        match self {
            AcquireError::Rejected(rejection) => Some(rejection),
            AcquireError::Invalid(_) => None,
        }
    }
}

impl fmt::Display for AcquireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AcquireError::Rejected(rejection) => rejection.fmt(f),
            AcquireError::Invalid(error) => write!(f, "invalid request: {error}"),
        }
    }
}

// `Display` already shows the inner error, so `source` stays `None` (no duplicated messages in
// error chains).
impl std::error::Error for AcquireError {}

impl From<Rejection> for AcquireError {
    fn from(rejection: Rejection) -> AcquireError {
        AcquireError::Rejected(rejection)
    }
}

impl From<RequestError> for AcquireError {
    fn from(error: RequestError) -> AcquireError {
        AcquireError::Invalid(error)
    }
}

/// Which limit of an admission class an error is about.
///
/// # Examples
///
/// ```
/// assert_eq!(async_bulkhead_llm::classes::ClassField::MaxInFlightTokens.as_str(), "max_in_flight_tokens");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ClassField {
    /// [`ClassLimits::protected_concurrent`](crate::classes::ClassLimits::protected_concurrent).
    ProtectedConcurrent,
    /// [`ClassLimits::max_concurrent`](crate::classes::ClassLimits::max_concurrent).
    MaxConcurrent,
    /// [`ClassLimits::protected_in_flight_tokens`](crate::classes::ClassLimits::protected_in_flight_tokens).
    ProtectedInFlightTokens,
    /// [`ClassLimits::max_in_flight_tokens`](crate::classes::ClassLimits::max_in_flight_tokens).
    MaxInFlightTokens,
}

impl ClassField {
    /// The field's name.
    pub const fn as_str(self) -> &'static str {
        match self {
            ClassField::ProtectedConcurrent => "protected_concurrent",
            ClassField::MaxConcurrent => "max_concurrent",
            ClassField::ProtectedInFlightTokens => "protected_in_flight_tokens",
            ClassField::MaxInFlightTokens => "max_in_flight_tokens",
        }
    }
}

/// One admission class's limits are invalid, at build time
/// ([`ConfigError::Class`](crate::builder::ConfigError::Class)) or in a snapshot ([`LimitsError::Class`](crate::limits::LimitsError::Class)). Each names the class
/// and the field.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{classes::AdmissionClasses, classes::ClassField, classes::ClassLimits, classes::ClassLimitsError, builder::ConfigError, LlmBulkhead};
///
/// let err = LlmBulkhead::builder("m", 4)
///     .admission_classes(AdmissionClasses::new("a").class("a", ClassLimits::new().protected_concurrent(3).max_concurrent(2)))
///     .build()
///     .unwrap_err();
/// assert_eq!(
///     err,
///     ConfigError::Class(ClassLimitsError::ProtectedAboveMax {
///         class: "a".into(),
///         field: ClassField::ProtectedConcurrent,
///         protected: 3,
///         max: 2,
///     }),
/// );
/// assert_eq!(
///     err.to_string(),
///     "admission_classes.classes[\"a\"].protected_concurrent (3) must be <= admission_classes.classes[\"a\"].max_concurrent (2)",
/// );
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClassLimitsError {
    /// A class id is empty or only whitespace (ids are kept as given, not trimmed).
    EmptyId {
        /// The refused id.
        class: String,
    },
    /// A class id is configured twice.
    DuplicateId {
        /// The repeated id.
        class: String,
    },
    /// A field exceeds what the admission word can count (`MAX_CONCURRENT` for slots,
    /// `MAX_BUDGET` for tokens).
    TooLarge {
        /// The class.
        class: String,
        /// The field.
        field: ClassField,
        /// The refused value.
        value: u64,
        /// The largest accepted value.
        max: u64,
    },
    /// A protected floor exceeds the class's ceiling of the same dimension.
    ProtectedAboveMax {
        /// The class.
        class: String,
        /// The floor (`ProtectedConcurrent` or `ProtectedInFlightTokens`).
        field: ClassField,
        /// The floor's value.
        protected: u64,
        /// The ceiling's value.
        max: u64,
    },
    /// A token field is set on a bulkhead without a token budget.
    TokensWithoutBudget {
        /// The class.
        class: String,
        /// The field (`ProtectedInFlightTokens` or `MaxInFlightTokens`).
        field: ClassField,
    },
    /// The class's rate limits are invalid (the same checks as the bulkhead's own: a window of
    /// 1 ms to 1 day, at least one limit, each from 1 to one per nanosecond of the window, a
    /// tokens window only with a token budget), or the bulkhead keeps no rate windows.
    Rate {
        /// The class.
        class: String,
        /// What is wrong with them (a `LimitsError::Rate*`).
        error: Box<LimitsError>,
    },
}

impl ClassLimitsError {
    /// Writes the error with the classes' label (`admission_classes.classes` at build time,
    /// `limits.admission_classes` in a snapshot).
    fn fmt_in(&self, label: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClassLimitsError::EmptyId { class } => {
                write!(
                    f,
                    "{label} class id must be a non-empty string (got {class:?})"
                )
            }
            ClassLimitsError::DuplicateId { class } => {
                write!(f, "{label} class id {class:?} is configured more than once")
            }
            ClassLimitsError::TooLarge {
                class,
                field,
                value,
                max,
            } => write!(
                f,
                "{label}[{class:?}].{} ({value}) must be <= {max}",
                field.as_str()
            ),
            ClassLimitsError::ProtectedAboveMax {
                class,
                field,
                protected,
                max,
            } => {
                let ceiling = match field {
                    ClassField::ProtectedInFlightTokens => ClassField::MaxInFlightTokens,
                    _ => ClassField::MaxConcurrent,
                };
                write!(
                    f,
                    "{label}[{class:?}].{} ({protected}) must be <= {label}[{class:?}].{} ({max})",
                    field.as_str(),
                    ceiling.as_str()
                )
            }
            ClassLimitsError::TokensWithoutBudget { class, field } => write!(
                f,
                "{label}[{class:?}].{} requires a token budget to be configured",
                field.as_str()
            ),
            ClassLimitsError::Rate { class, error } => {
                write!(f, "{label}[{class:?}].rate: {error}")
            }
        }
    }
}

impl fmt::Display for ClassLimitsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fmt_in("admission_classes", f)
    }
}

impl std::error::Error for ClassLimitsError {}

/// [`LlmBulkhead::class`](crate::LlmBulkhead::class) found no such class. Nothing was created
/// or counted.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{classes::ClassLookupError, LlmBulkhead};
///
/// let bulkhead = LlmBulkhead::builder("m", 1).build()?;
/// assert_eq!(bulkhead.class("premium"), Err(ClassLookupError::NotConfigured));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClassLookupError {
    /// The bulkhead was built without admission classes.
    NotConfigured,
    /// No class has this id.
    Unknown {
        /// The id looked up.
        class: String,
    },
}

impl fmt::Display for ClassLookupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClassLookupError::NotConfigured => {
                f.write_str("admission_class requires admission classes to be configured")
            }
            ClassLookupError::Unknown { class } => write!(f, "unknown admission class {class:?}"),
        }
    }
}

impl std::error::Error for ClassLookupError {}
