//! Token estimation: the [`Estimator`](crate::estimate::Estimator) trait the bulkhead sizes reservations with, and the
//! built-in estimators of the JavaScript original.
//!
//! - [`NaiveEstimator`](crate::estimate::NaiveEstimator): `ceil(chars / 4)` input, flat.
//! - [`ModelAwareEstimator`](crate::estimate::ModelAwareEstimator): per-model-family chars-per-token ratios, overrides, an
//!   opaque-block surcharge (the bulkhead's default, seeded with its model).
//! - [`AdaptiveEstimator`](crate::estimate::AdaptiveEstimator): the model-aware estimate corrected per model by what providers
//!   really report.
//!
//! Characters are UTF-16 code units, as the original counts them, so its ratios mean the same
//! thing here. Estimates are approximate by design: a reservation only gates admission, and the
//! usage reported at release corrects the accounting.

mod adaptive;
mod model_aware;

use crate::support::sync::unmodeled::Arc;

pub use adaptive::{AdaptiveEstimator, AdaptiveEstimatorBuilder, Correction};
pub use model_aware::{ModelAwareEstimator, ModelAwareEstimatorBuilder, OpaqueBlockTokens};

use crate::llm::request::LlmRequest;
use crate::vocabulary::error::RequestError;
use crate::vocabulary::reservation::{DEFAULT_OUTPUT_CAP, Reservation, TokenUsage};

/// Sizes a request: its input tokens and its maximum output tokens.
///
/// The bulkhead calls [`estimate`](Estimator::estimate) once per admission that has no
/// reservation override (and for [`LlmBulkhead::estimate`](crate::LlmBulkhead::estimate) and
/// advisory checks). When such an admission later settles with reported usage, the bulkhead
/// hands the estimate back to [`observe`](Estimator::observe), so an estimator can learn from
/// the providers' figures (as [`AdaptiveEstimator`](crate::estimate::AdaptiveEstimator) does).
///
/// Any `Fn(&LlmRequest) -> TokenEstimate + Send + Sync` closure is an estimator.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{
///     LlmBulkhead, LlmRequest, Reservation, TokenBudget, estimate::TokenEstimate,
/// };
///
/// // A tokenizer-backed estimator would count real tokens here.
/// let bulkhead = LlmBulkhead::builder("my-model", 4)
///     .token_budget(TokenBudget::new(10_000))
///     .estimator(|request: &LlmRequest| TokenEstimate::new(request.text_len() / 3, 500))
///     .build()?;
/// let request = LlmRequest::new().user("x".repeat(300));
/// assert_eq!(bulkhead.estimate(&request)?, Some(Reservation::new(100, 500)?));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait Estimator: Send + Sync {
    /// The request's input and maximum output.
    ///
    /// # Errors
    ///
    /// A [`RequestError`](crate::request::RequestError) when the estimate cannot be represented.
    fn estimate(&self, request: &LlmRequest) -> Result<TokenEstimate, RequestError>;

    /// An admission sized by `estimate` settled with `usage`. Does nothing by default.
    fn observe(&self, estimate: &TokenEstimate, usage: TokenUsage) {
        let _ = (estimate, usage);
    }
}

impl<F> Estimator for F
where
    F: Fn(&LlmRequest) -> TokenEstimate + Send + Sync,
{
    fn estimate(&self, request: &LlmRequest) -> Result<TokenEstimate, RequestError> {
        Ok(self(request))
    }
}

impl<E: Estimator + ?Sized> Estimator for Arc<E> {
    fn estimate(&self, request: &LlmRequest) -> Result<TokenEstimate, RequestError> {
        (**self).estimate(request)
    }

    fn observe(&self, estimate: &TokenEstimate, usage: TokenUsage) {
        (**self).observe(estimate, usage);
    }
}

/// What an [`Estimator`](crate::estimate::Estimator) says about a request: input tokens and maximum output tokens, plus an
/// opaque [`Memo`](crate::estimate::Memo) the estimator gets back in [`Estimator::observe`](crate::estimate::Estimator::observe).
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{estimate::Memo, estimate::TokenEstimate};
///
/// let estimate = TokenEstimate::new(120, 512).with_memo(Memo::new(7, 9));
/// assert_eq!((estimate.input, estimate.max_output), (120, 512));
/// assert_eq!(estimate.memo().parts(), (7, 9));
/// assert_eq!(estimate.reservation()?.reserved(), 632);
/// # Ok::<(), async_bulkhead_llm::request::RequestError>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct TokenEstimate {
    /// Estimated input tokens.
    pub input: u64,
    /// Maximum output tokens.
    pub max_output: u64,
    memo: Memo,
}

impl TokenEstimate {
    /// An estimate of `input` input tokens and `max_output` output tokens, with an empty memo.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::estimate::TokenEstimate::new(1, 2).max_output, 2);
    /// ```
    pub const fn new(input: u64, max_output: u64) -> TokenEstimate {
        TokenEstimate {
            input,
            max_output,
            memo: Memo::EMPTY,
        }
    }

    /// This estimate carrying `memo` (for the estimator's own [`Estimator::observe`](crate::estimate::Estimator::observe)).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{estimate::Memo, estimate::TokenEstimate};
    ///
    /// assert_eq!(TokenEstimate::new(1, 2).with_memo(Memo::new(3, 4)).memo(), Memo::new(3, 4));
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn with_memo(mut self, memo: Memo) -> TokenEstimate {
        self.memo = memo;
        self
    }

    /// The memo.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{estimate::Memo, estimate::TokenEstimate};
    ///
    /// assert_eq!(TokenEstimate::new(1, 2).memo(), Memo::EMPTY);
    /// ```
    pub const fn memo(&self) -> Memo {
        self.memo
    }

    /// The reservation this estimate makes: `input + max_output`.
    ///
    /// # Errors
    ///
    /// [`RequestError::ReservationOverflow`](crate::request::RequestError::ReservationOverflow) when the sum does not fit in a `u64`.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::estimate::TokenEstimate;
    ///
    /// assert!(TokenEstimate::new(u64::MAX, 1).reservation().is_err());
    /// ```
    pub const fn reservation(&self) -> Result<Reservation, RequestError> {
        Reservation::new(self.input, self.max_output)
    }
}

/// Two words an estimator attaches to an estimate and receives back in
/// [`Estimator::observe`](crate::estimate::Estimator::observe) (the bulkhead keeps them with the admission, no allocation).
///
/// # Examples
///
/// ```
/// let memo = async_bulkhead_llm::estimate::Memo::new(1, 2);
/// assert_eq!(memo.parts(), (1, 2));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Memo(u64, u64);

impl Memo {
    /// The empty memo.
    pub const EMPTY: Memo = Memo(0, 0);

    /// A memo of two words.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_ne!(async_bulkhead_llm::estimate::Memo::new(0, 1), async_bulkhead_llm::estimate::Memo::EMPTY);
    /// ```
    pub const fn new(a: u64, b: u64) -> Memo {
        Memo(a, b)
    }

    /// The two words.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::estimate::Memo::EMPTY.parts(), (0, 0));
    /// ```
    pub const fn parts(self) -> (u64, u64) {
        (self.0, self.1)
    }
}

/// The flat estimate: `ceil(chars / 4)` input tokens plus `extra_input_tokens`, and the
/// request's output ceiling (or `output_cap`, 2048 by default) as maximum output. Opaque
/// blocks count nothing.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{estimate::Estimator, LlmRequest, estimate::NaiveEstimator, estimate::TokenEstimate};
///
/// let naive = NaiveEstimator::new();
/// let request = LlmRequest::new().user("x".repeat(401));
/// assert_eq!(naive.estimate(&request)?, TokenEstimate::new(101, 2048));
/// let with_system = LlmRequest::new().user("abcd").system("12345678").max_tokens(0);
/// assert_eq!(naive.estimate(&with_system)?, TokenEstimate::new(3, 0));
/// # Ok::<(), async_bulkhead_llm::request::RequestError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NaiveEstimator {
    output_cap: u64,
}

impl NaiveEstimator {
    /// The naive estimator with the default output cap (2048).
    ///
    /// # Examples
    ///
    /// ```
    /// let _ = async_bulkhead_llm::estimate::NaiveEstimator::new();
    /// ```
    pub const fn new() -> NaiveEstimator {
        NaiveEstimator {
            output_cap: DEFAULT_OUTPUT_CAP,
        }
    }

    /// This estimator with maximum output `output_cap` for requests that state none.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{estimate::Estimator, LlmRequest, estimate::NaiveEstimator};
    ///
    /// let e = NaiveEstimator::new().output_cap(100);
    /// assert_eq!(e.estimate(&LlmRequest::new())?.max_output, 100);
    /// # Ok::<(), async_bulkhead_llm::request::RequestError>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn output_cap(mut self, output_cap: u64) -> NaiveEstimator {
        self.output_cap = output_cap;
        self
    }
}

impl Default for NaiveEstimator {
    fn default() -> NaiveEstimator {
        NaiveEstimator::new()
    }
}

impl Estimator for NaiveEstimator {
    fn estimate(&self, request: &LlmRequest) -> Result<TokenEstimate, RequestError> {
        let text_tokens = request.text_len().div_ceil(4);
        let input = add_input(text_tokens, 0, request.extra_input_tokens.unwrap_or(0))?;
        Ok(TokenEstimate::new(
            input,
            request.output_ceiling().unwrap_or(self.output_cap),
        ))
    }
}

/// Runs `f` with `model` lowercased (Unicode-aware, as JavaScript's `toLowerCase`), without
/// allocating for short ASCII names.
pub(crate) fn with_lowercase<T>(model: &str, f: impl FnOnce(&str) -> T) -> T {
    if !model.bytes().any(|b| b.is_ascii_uppercase()) && model.is_ascii() {
        return f(model);
    }
    let mut buf = [0u8; 128];
    if model.is_ascii() && model.len() <= buf.len() {
        let lower = &mut buf[..model.len()];
        lower.copy_from_slice(model.as_bytes());
        lower.make_ascii_lowercase();
        return f(core::str::from_utf8(lower).expect("ASCII stays UTF-8"));
    }
    f(&model.to_lowercase())
}

/// `text + opaque + extra`, or the error naming all three.
pub(crate) fn add_input(text: u64, opaque: u64, extra: u64) -> Result<u64, RequestError> {
    text.checked_add(opaque)
        .and_then(|sum| sum.checked_add(extra))
        .ok_or(RequestError::InputOverflow {
            text_tokens: text,
            opaque_tokens: opaque,
            extra_input_tokens: extra,
        })
}

/// `ceil(chars / ratio)` as a token count, or an error if it does not fit in a `u64`.
pub(crate) fn text_tokens(chars: u64, ratio: f64) -> Result<u64, RequestError> {
    let tokens = (chars as f64 / ratio).ceil();
    // 2^64 is exactly representable; anything at or above it does not fit.
    if tokens.is_finite() && tokens < 18_446_744_073_709_551_616.0 {
        Ok(tokens as u64)
    } else {
        Err(RequestError::TextTooLarge { chars })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn chars(n: usize) -> LlmRequest {
        LlmRequest::new().user("x".repeat(n))
    }

    #[test]
    fn naive_rounds_up_and_defaults_the_output() {
        let e = NaiveEstimator::new();
        assert_eq!(
            e.estimate(&chars(400)).unwrap(),
            TokenEstimate::new(100, 2048)
        );
        assert_eq!(e.estimate(&chars(401)).unwrap().input, 101);
        assert_eq!(
            e.estimate(&LlmRequest::new()).unwrap(),
            TokenEstimate::new(0, 2048)
        );
        assert_eq!(
            e.estimate(&chars(4).extra_input_tokens(10)).unwrap().input,
            11
        );
    }

    #[test]
    fn naive_rejects_unrepresentable_sums() {
        let e = NaiveEstimator::new();
        assert_eq!(
            e.estimate(&chars(8).extra_input_tokens(u64::MAX)),
            Err(RequestError::InputOverflow {
                text_tokens: 2,
                opaque_tokens: 0,
                extra_input_tokens: u64::MAX
            })
        );
    }

    #[test]
    fn text_tokens_refuse_what_does_not_fit() {
        assert_eq!(text_tokens(390, 3.9), Ok(100));
        assert_eq!(text_tokens(380, 3.8), Ok(100));
        assert_eq!(text_tokens(370, 3.7), Ok(100));
        assert_eq!(
            text_tokens(1, 1e-300),
            Err(RequestError::TextTooLarge { chars: 1 })
        );
        assert_eq!(
            text_tokens(u64::MAX, 0.5),
            Err(RequestError::TextTooLarge { chars: u64::MAX })
        );
    }
}
