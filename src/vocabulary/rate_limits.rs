//! Rate limits as a value: requests and tokens per window ([`RateLimits`]), on a bulkhead, a
//! class or a tenant.

use std::time::Duration;

/// Requests and tokens per window: the rate limits a provider bills and throttles by (OpenAI's
/// and Anthropic's requests and tokens per minute), decided in the same admission as the
/// limits in flight. A call is admitted only when it fits every window configured: one request
/// in `requests` per `window`, its reservation in `tokens` per `window` (input + maximum
/// output, corrected to its reported usage when it settles, so the window follows what the
/// provider bills).
///
/// Each window is a GCRA (generic cell rate algorithm, a token bucket kept as one timestamp):
/// `requests` per `window` at a steady pace, with bursts of up to a whole window's worth; a
/// call refused by it gets `rate_limit` and the exact wait after which it would fit if nothing
/// else arrived (`Rejection::retry_after`). See the `rate` module for the semantics and bounds.
///
/// With the `serde` feature it serializes as `{"window_ms": .., "requests": .., "tokens": ..}`.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use async_bulkhead_llm::rate::RateLimits;
///
/// let rate = RateLimits::per_minute().requests(500).tokens(200_000);
/// assert_eq!(rate.window, Duration::from_secs(60));
/// assert_eq!((rate.requests, rate.tokens), (Some(500), Some(200_000)));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct RateLimits {
    /// The window the limits are counted over (1 ms to 1 day).
    #[cfg_attr(feature = "serde", serde(rename = "window_ms", with = "window_ms"))]
    pub window: Duration,
    /// Requests per window (at least 1), or none.
    #[cfg_attr(feature = "serde", serde(default))]
    pub requests: Option<u64>,
    /// Tokens per window (at least 1; needs a token budget), or none.
    #[cfg_attr(feature = "serde", serde(default))]
    pub tokens: Option<u64>,
}

impl RateLimits {
    /// No limit yet, counted over `window`.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// let rate = async_bulkhead_llm::rate::RateLimits::new(Duration::from_secs(10)).requests(5);
    /// assert_eq!(rate.requests, Some(5));
    /// ```
    pub const fn new(window: Duration) -> RateLimits {
        RateLimits {
            window,
            requests: None,
            tokens: None,
        }
    }

    /// No limit yet, counted per minute (as providers state theirs).
    pub const fn per_minute() -> RateLimits {
        RateLimits::new(Duration::from_secs(60))
    }

    /// These limits with `requests` requests per window.
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn requests(mut self, requests: u64) -> RateLimits {
        self.requests = Some(requests);
        self
    }

    /// These limits with `tokens` tokens per window.
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn tokens(mut self, tokens: u64) -> RateLimits {
        self.tokens = Some(tokens);
        self
    }
}

/// `RateLimits::window` as whole milliseconds on the wire.
#[cfg(feature = "serde")]
mod window_ms {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(
        window: &Duration,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        serializer.serialize_u64(u64::try_from(window.as_millis()).unwrap_or(u64::MAX))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Duration, D::Error> {
        u64::deserialize(deserializer).map(Duration::from_millis)
    }
}
