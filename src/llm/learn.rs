//! Rate limits learned from the provider: [`LimitLearner`] adapts a bulkhead's rate windows to
//! what the provider states ([`ProviderLimits`]: its limit headers, its 429 and 529 answers),
//! always within configured floors and ceilings, every change made through `apply_limits` (so
//! versioned, announced as a reconfigure event, visible in the limits and the metrics).
//!
//! The rule, per window (requests, tokens), and for the in-flight token budget when asked
//! (which no provider states: it follows the throttling answers alone):
//!
//! - the provider states its limit (OpenAI's `x-ratelimit-limit-*`, Anthropic's
//!   `anthropic-ratelimit-*-limit`): follow it, clamped to the floor and the ceiling;
//! - otherwise a throttling answer (429, 529) lowers the window multiplicatively (`decrease`,
//!   0.7 unless set), never below its floor; once per round of calls when the answer says
//!   which limits its call was admitted under ([`ProviderLimits::admitted_under`]): a 429 for a
//!   call admitted before the last decrease says nothing about the lowered limits (TCP's rule
//!   of one decrease per window of data), so a burst of 429s does not compound;
//! - otherwise every `increase_every` successful answers raise it additively (`increase`, 1%
//!   of its ceiling unless set), never above its ceiling.
//!
//! Latency is not used: an LLM call's latency grows with its output, so it says little about
//! the provider's load unless normalized per output token; the provider's own headers and
//! throttling answers are direct. A learner advances the limits' revision: a control plane that
//! also pushes limits reads `limits().revision` first (a snapshot not above it is stale).

use core::fmt;

use crate::support::sync::unmodeled::{AtomicU64, Ordering};
use crate::vocabulary::limits::{ApplyOutcome, Limits};
use crate::vocabulary::rate_limits::RateLimits;

use super::bulkhead::LlmBulkhead;

/// What one provider answer said about its limits.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::rate::ProviderLimits;
///
/// let seen = ProviderLimits::new().limit_tokens(90_000).remaining_tokens(12_000);
/// assert_eq!(seen.limit_tokens, Some(90_000));
/// assert!(!ProviderLimits::throttled().limit_tokens(1).is_success());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProviderLimits {
    /// The requests per window the provider states.
    pub limit_requests: Option<u64>,
    /// The tokens per window the provider states.
    pub limit_tokens: Option<u64>,
    /// The requests it says are left.
    pub remaining_requests: Option<u64>,
    /// The tokens it says are left.
    pub remaining_tokens: Option<u64>,
    /// It throttled the call (429, or Anthropic's 529 overloaded).
    pub throttled: bool,
    /// The limits' revision the call was admitted under (its permit's `limit_revision()`,
    /// from the bulkhead the learner learns), if known.
    pub admitted_under: Option<u64>,
}

impl ProviderLimits {
    /// A successful answer that stated nothing.
    pub fn new() -> ProviderLimits {
        ProviderLimits::default()
    }

    /// A throttling answer (429, 529).
    pub fn throttled() -> ProviderLimits {
        ProviderLimits {
            throttled: true,
            ..ProviderLimits::default()
        }
    }

    /// With a stated requests limit.
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn limit_requests(mut self, limit: u64) -> ProviderLimits {
        self.limit_requests = Some(limit);
        self
    }

    /// With a stated tokens limit.
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn limit_tokens(mut self, limit: u64) -> ProviderLimits {
        self.limit_tokens = Some(limit);
        self
    }

    /// With the stated requests left.
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn remaining_requests(mut self, remaining: u64) -> ProviderLimits {
        self.remaining_requests = Some(remaining);
        self
    }

    /// With the stated tokens left.
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn remaining_tokens(mut self, remaining: u64) -> ProviderLimits {
        self.remaining_tokens = Some(remaining);
        self
    }

    /// For a call admitted under the limits' revision `revision` (its permit's
    /// `limit_revision()`): a throttling answer for a call admitted before the learner's last
    /// decrease is then ignored (it was sent under the limits already lowered for it).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest};
    /// use async_bulkhead_llm::rate::{LearnBounds, LimitLearner, ProviderLimits, RateLimits};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 64)
    ///     .rate_limits(RateLimits::per_minute().requests(1_000))
    ///     .build()?;
    /// let learner = LimitLearner::new(bulkhead.clone()).requests(LearnBounds::new(10, 2_000));
    /// let calls: Vec<_> = (0..3)
    ///     .map(|_| bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()))
    ///     .collect::<Result<_, _>>()?;
    /// // Three 429s for calls sent under the same limits: one decrease, not three.
    /// for call in &calls {
    ///     learner.observe(ProviderLimits::throttled().admitted_under(call.limit_revision()));
    /// }
    /// assert_eq!(bulkhead.limits().rate.unwrap().requests, Some(700));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn admitted_under(mut self, revision: u64) -> ProviderLimits {
        self.admitted_under = Some(revision);
        self
    }

    /// Whether the call went through (not throttled).
    pub fn is_success(&self) -> bool {
        !self.throttled
    }
}

/// One window's bounds for a [`LimitLearner`]: it never goes below `floor` nor above
/// `ceiling`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LearnBounds {
    /// The lowest the window goes.
    pub floor: u64,
    /// The highest the window goes.
    pub ceiling: u64,
}

impl LearnBounds {
    /// A window kept within `floor..=ceiling`.
    pub const fn new(floor: u64, ceiling: u64) -> LearnBounds {
        LearnBounds { floor, ceiling }
    }

    fn clamp(&self, value: u64) -> u64 {
        value.clamp(self.floor.max(1), self.ceiling.max(self.floor.max(1)))
    }
}

/// Adapts a bulkhead's rate windows to what its provider states (see the `learn` module: the
/// rule, and why not latency).
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{LlmBulkhead, TokenBudget};
/// use async_bulkhead_llm::rate::{LearnBounds, LimitLearner, ProviderLimits, RateLimits};
///
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 64)
///     .token_budget(TokenBudget::new(1_000_000))
///     .rate_limits(RateLimits::per_minute().requests(1_000).tokens(400_000))
///     .build()?;
/// let learner = LimitLearner::new(bulkhead.clone())
///     .requests(LearnBounds::new(10, 5_000))
///     .tokens(LearnBounds::new(10_000, 2_000_000));
/// // The provider states its limits: followed.
/// learner.observe(ProviderLimits::new().limit_requests(500).limit_tokens(150_000));
/// let rate = bulkhead.limits().rate.unwrap();
/// assert_eq!((rate.requests, rate.tokens), (Some(500), Some(150_000)));
/// // A 429 without limits stated: both windows lowered by 30%.
/// learner.observe(ProviderLimits::throttled());
/// assert_eq!(bulkhead.limits().rate.unwrap().tokens, Some(105_000));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct LimitLearner {
    bulkhead: LlmBulkhead,
    requests: Option<LearnBounds>,
    tokens: Option<LearnBounds>,
    budget: Option<LearnBounds>,
    decrease: f64,
    increase: Option<u64>,
    increase_every: u64,
    /// Successful answers since the last throttling one (an increase every `increase_every`).
    /// A plain counter: nothing else is published through it (Relaxed).
    successes: AtomicU64,
    /// The revision the last decrease installed (0: none yet). Relaxed as `successes`: a stale
    /// read lets one more decrease through, never a wrong one.
    lowered_at: AtomicU64,
}

impl LimitLearner {
    /// A learner for `bulkhead` (which must have rate limits; a window it learns must be
    /// configured): no window learned until bounds are given.
    pub fn new(bulkhead: LlmBulkhead) -> LimitLearner {
        LimitLearner {
            bulkhead,
            requests: None,
            tokens: None,
            budget: None,
            decrease: 0.7,
            increase: None,
            increase_every: 10,
            successes: AtomicU64::new(0),
            lowered_at: AtomicU64::new(0),
        }
    }

    /// Learns the requests window, within `bounds`.
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn requests(mut self, bounds: LearnBounds) -> LimitLearner {
        self.requests = Some(bounds);
        self
    }

    /// Learns the tokens window, within `bounds`.
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn tokens(mut self, bounds: LearnBounds) -> LimitLearner {
        self.tokens = Some(bounds);
        self
    }

    /// Learns the in-flight token budget too, within `bounds`: lowered on a throttling answer,
    /// raised while calls succeed, as the windows without a stated limit are.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, TokenBudget};
    /// use async_bulkhead_llm::rate::{LearnBounds, LimitLearner, ProviderLimits, RateLimits};
    ///
    /// let bulkhead = LlmBulkhead::builder("gpt-4o", 64)
    ///     .token_budget(TokenBudget::new(100_000))
    ///     .rate_limits(RateLimits::per_minute().requests(1_000))
    ///     .build()?;
    /// let learner = LimitLearner::new(bulkhead.clone()).budget(LearnBounds::new(20_000, 200_000));
    /// learner.observe(ProviderLimits::throttled());
    /// assert_eq!(bulkhead.limits().token_budget.unwrap().budget, 70_000);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn budget(mut self, bounds: LearnBounds) -> LimitLearner {
        self.budget = Some(bounds);
        self
    }

    /// The factor a throttling answer multiplies a window by (clamped to 0.1..=0.99).
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn decrease(mut self, factor: f64) -> LimitLearner {
        self.decrease = factor.clamp(0.1, 0.99);
        self
    }

    /// How much a window grows after `every` successful answers (default: 1% of its ceiling
    /// every 10 answers).
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn increase(mut self, by: u64, every: u64) -> LimitLearner {
        self.increase = Some(by);
        self.increase_every = every.max(1);
        self
    }

    /// Takes one provider answer into account; the outcome of the `apply_limits` it made, if
    /// it changed anything (`None`: nothing to change, the bulkhead has no rate limits, or
    /// another answer's change landed first: answers observed at once from the same limits
    /// make one change, not one each, so a burst of 429s lowers the windows once). No lock of
    /// the learner is held while the limits are applied (their reconfigure listeners run then).
    pub fn observe(&self, seen: ProviderLimits) -> Option<ApplyOutcome> {
        let current = self.bulkhead.limits();
        let rate = current.rate?;
        let stated = seen.limit_requests.is_some() || seen.limit_tokens.is_some();
        let mut next = rate;
        let budget = current.token_budget.map(|b| b.budget);
        let mut next_budget = budget;
        if stated {
            if let (Some(bounds), Some(limit)) = (self.requests, seen.limit_requests) {
                next.requests = Some(bounds.clamp(limit));
            }
            if let (Some(bounds), Some(limit)) = (self.tokens, seen.limit_tokens) {
                next.tokens = Some(bounds.clamp(limit));
            }
        } else if seen.throttled {
            if seen
                .admitted_under
                .is_some_and(|revision| revision < self.lowered_at.load(Ordering::Relaxed))
            {
                // Sent under limits already lowered for this round: nothing new.
                return None;
            }
            self.successes.store(0, Ordering::Relaxed);
            next.requests = lower(rate.requests, self.requests, self.decrease);
            next.tokens = lower(rate.tokens, self.tokens, self.decrease);
            next_budget = lower(budget, self.budget, self.decrease);
            let outcome = self.install(current, next, next_budget);
            if let Some(ApplyOutcome::Applied { current, .. }) = &outcome {
                self.lowered_at
                    .fetch_max(current.revision, Ordering::Relaxed);
            }
            return outcome;
        } else {
            let successes = self.successes.fetch_add(1, Ordering::Relaxed) + 1;
            if !successes.is_multiple_of(self.increase_every) {
                return None;
            }
            next.requests = raise(rate.requests, self.requests, self.increase);
            next.tokens = raise(rate.tokens, self.tokens, self.increase);
            next_budget = raise(budget, self.budget, self.increase);
        }
        self.install(current, next, next_budget)
    }

    /// Whether this learner learns `bulkhead`'s limits (so its permits' revisions are the ones
    /// [`ProviderLimits::admitted_under`] compares).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::LlmBulkhead;
    /// use async_bulkhead_llm::rate::{LimitLearner, RateLimits};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 8)
    ///     .rate_limits(RateLimits::per_minute().requests(100))
    ///     .build()?;
    /// let learner = LimitLearner::new(bulkhead.clone());
    /// assert!(learner.learns(&bulkhead));
    /// assert!(!learner.learns(&LlmBulkhead::builder("m", 8).build()?));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn learns(&self, bulkhead: &LlmBulkhead) -> bool {
        crate::support::sync::Arc::ptr_eq(&self.bulkhead.core, &bulkhead.core)
    }

    /// Applies `next` (and the budget `next_budget`) as `current`'s successor, if it changes
    /// anything.
    fn install(
        &self,
        current: Limits,
        next: RateLimits,
        next_budget: Option<u64>,
    ) -> Option<ApplyOutcome> {
        let budget = current.token_budget.map(|b| b.budget);
        if current.rate == Some(next) && budget == next_budget {
            return None;
        }
        let mut limits = current;
        limits.revision += 1;
        limits.rate = Some(next);
        if let (Some(b), Some(next_budget)) = (limits.token_budget.as_mut(), next_budget) {
            b.budget = next_budget;
        }
        self.bulkhead
            .apply_limits(limits)
            .ok()
            .filter(ApplyOutcome::is_applied)
    }
}

fn lower(limit: Option<u64>, bounds: Option<LearnBounds>, factor: f64) -> Option<u64> {
    match (limit, bounds) {
        (Some(limit), Some(bounds)) => Some(bounds.clamp((limit as f64 * factor).round() as u64)),
        (limit, _) => limit,
    }
}

fn raise(limit: Option<u64>, bounds: Option<LearnBounds>, by: Option<u64>) -> Option<u64> {
    match (limit, bounds) {
        (Some(limit), Some(bounds)) => {
            let by = by.unwrap_or((bounds.ceiling / 100).max(1));
            Some(bounds.clamp(limit.saturating_add(by)))
        }
        (limit, _) => limit,
    }
}

impl fmt::Debug for LimitLearner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitLearner")
            .field("requests", &self.requests)
            .field("tokens", &self.tokens)
            .field("budget", &self.budget)
            .field("decrease", &self.decrease)
            .finish_non_exhaustive()
    }
}
