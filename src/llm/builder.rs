//! Building a bulkhead: the validating builder, queueing profiles and the token-budget
//! configuration.

use crate::support::sync::unmodeled::Arc;
use core::fmt;
use std::time::Duration;

use super::bulkhead::LlmBulkhead;
use super::dedup::Deduplication;
use super::estimate::{Estimator, ModelAwareEstimator};
use super::shared::LlmCore;
use crate::engine::Engine;
use crate::engine::limits;
use crate::engine::rate::RateClock;
use crate::vocabulary::admission_class::ClassLimits;
use crate::vocabulary::error::{ClassLimitsError, ConfigError};
use crate::vocabulary::limits::{
    ClassLimitsTable, Limits, MAX_BUDGET, MAX_CONCURRENT, MAX_REVISION,
};
use crate::vocabulary::rate_limits::RateLimits;
use crate::vocabulary::reservation::DEFAULT_OUTPUT_CAP;

/// Token-budget configuration: the budget, the output cap the estimator assumes when a request
/// names no `max_tokens`, and the reserve kept for high-priority calls.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::TokenBudget;
///
/// let budget = TokenBudget::new(200_000).output_cap(4096).high_priority_reserve(40_000);
/// assert_eq!(budget.budget, 200_000);
/// assert_eq!(budget.output_cap, 4096);
/// assert_eq!(budget.high_priority_reserve, 40_000);
/// assert_eq!(TokenBudget::new(1).output_cap, 2048);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct TokenBudget {
    /// Tokens reserved by calls in flight at once, at most.
    pub budget: u64,
    /// Output tokens the default estimator reserves for a request without `max_tokens`.
    pub output_cap: u64,
    /// Tokens of the budget only high-priority calls may use (at most the budget).
    pub high_priority_reserve: u64,
}

impl TokenBudget {
    /// A budget of `budget` tokens in flight at once (0 is allowed: only 0-token calls fit),
    /// output cap 2048, no high-priority reserve.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::TokenBudget::new(0).budget, 0);
    /// ```
    pub const fn new(budget: u64) -> TokenBudget {
        TokenBudget {
            budget,
            output_cap: DEFAULT_OUTPUT_CAP,
            high_priority_reserve: 0,
        }
    }

    /// Sets the output tokens reserved for a request without `max_tokens`.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::TokenBudget::new(10).output_cap(0).output_cap, 0);
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn output_cap(mut self, output_cap: u64) -> TokenBudget {
        self.output_cap = output_cap;
        self
    }

    /// Sets the tokens only high-priority calls may use (at most the budget).
    ///
    /// # Examples
    ///
    /// ```
    /// let b = async_bulkhead_llm::TokenBudget::new(10).high_priority_reserve(4);
    /// assert_eq!(b.high_priority_reserve, 4);
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn high_priority_reserve(mut self, reserve: u64) -> TokenBudget {
        self.high_priority_reserve = reserve;
        self
    }
}

/// A queueing preset: how many calls may wait for a slot, and for how long by default.
///
/// Explicit [`LlmBulkheadBuilder::max_queue`] and [`LlmBulkheadBuilder::queue_timeout`] override
/// the profile's values, whatever the order of the calls. Profiles only affect waiting for a
/// slot; a token budget always refuses at once.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use async_bulkhead_llm::Profile;
///
/// assert_eq!((Profile::Interactive.max_queue(), Profile::Interactive.timeout()), (0, None));
/// assert_eq!((Profile::Batch.max_queue(), Profile::Batch.timeout()), (20, Some(Duration::from_secs(30))));
/// let custom = Profile::Custom { max_queue: 5, timeout: Some(Duration::from_secs(5)) };
/// assert_eq!(custom.max_queue(), 5);
/// assert_eq!(Profile::default(), Profile::Interactive);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Profile {
    /// Fail fast: no queue, no timeout (the default).
    #[default]
    Interactive,
    /// A short queue for background work: 20 places, 30 s timeout.
    Batch,
    /// Your own values.
    Custom {
        /// Places in the queue.
        max_queue: u32,
        /// Default queue timeout (`None`: wait until a slot frees or the bulkhead closes).
        timeout: Option<Duration>,
    },
}

impl Profile {
    /// The profile's queue length.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::Profile::Batch.max_queue(), 20);
    /// ```
    pub const fn max_queue(&self) -> u32 {
        match self {
            Profile::Interactive => 0,
            Profile::Batch => 20,
            Profile::Custom { max_queue, .. } => *max_queue,
        }
    }

    /// The profile's default queue timeout.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::Profile::Interactive.timeout(), None);
    /// ```
    pub const fn timeout(&self) -> Option<Duration> {
        match self {
            Profile::Interactive => None,
            Profile::Batch => Some(Duration::from_secs(30)),
            Profile::Custom { timeout, .. } => *timeout,
        }
    }
}

impl LlmBulkhead {
    /// Starts building a bulkhead for `model` with at most `max_concurrent` calls in flight
    /// (0 builds a fail-closed bulkhead that refuses everything until limits are raised).
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::LlmBulkhead::builder("gpt-4o", 16).build()?;
    /// assert_eq!(bulkhead.limits().max_concurrent, 16);
    /// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
    /// ```
    pub fn builder(model: impl Into<String>, max_concurrent: usize) -> LlmBulkheadBuilder {
        LlmBulkheadBuilder::new(model.into(), max_concurrent)
    }
}

/// Builds an [`LlmBulkhead`], validating everything before anything exists.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{LlmBulkhead, TokenBudget};
///
/// let bulkhead = LlmBulkhead::builder("claude-sonnet-4", 10)
///     .initial_revision(41)
///     .token_budget(TokenBudget::new(200_000))
///     .build()?;
/// assert_eq!(bulkhead.limits().revision, 41);
/// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
/// ```
#[derive(Clone)]
#[must_use = "a builder does nothing until `build()` is called"]
pub struct LlmBulkheadBuilder {
    model: String,
    max_concurrent: usize,
    profile: Profile,
    max_queue: Option<usize>,
    queue_timeout: Option<Duration>,
    initial_revision: u64,
    token_budget: Option<TokenBudget>,
    estimator: Option<Arc<dyn Estimator>>,
    admission_classes: Option<AdmissionClasses>,
    deduplication: Option<Deduplication>,
    name: String,
    tenant: String,
    rate: Option<RateLimits>,
    rate_clock: RateClock,
}

/// Admission classes for [`LlmBulkheadBuilder::admission_classes`]: the class of calls that
/// name none, and every class with its limits, in order (the order `limits()` and `stats()`
/// keep). Ids are kept as given (not trimmed); every call of a bulkhead with classes belongs
/// to one.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{classes::AdmissionClasses, classes::ClassLimits, LlmBulkhead, TokenBudget};
///
/// let bulkhead = LlmBulkhead::builder("claude-sonnet-4", 8)
///     .token_budget(TokenBudget::new(20_000))
///     .admission_classes(
///         AdmissionClasses::new("standard")
///             .class("premium", ClassLimits::new().protected_concurrent(3).protected_in_flight_tokens(6_000))
///             .class("standard", ClassLimits::new().max_concurrent(6))
///             .class("batch", ClassLimits::new().max_concurrent(2).max_in_flight_tokens(4_000)),
///     )
///     .build()?;
/// let ids: Vec<&str> = bulkhead.classes().iter().map(|c| c.id()).collect();
/// assert_eq!(ids, ["premium", "standard", "batch"]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[must_use = "admission classes do nothing until given to a builder"]
pub struct AdmissionClasses {
    default_class: String,
    classes: Vec<(String, ClassLimits)>,
}

impl AdmissionClasses {
    /// No class yet; calls that name none will go to `default_class` (which must be added).
    pub fn new(default_class: impl Into<String>) -> AdmissionClasses {
        AdmissionClasses {
            default_class: default_class.into(),
            classes: Vec::new(),
        }
    }

    /// Adds class `id` with `limits` (after the classes added so far).
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn class(mut self, id: impl Into<String>, limits: ClassLimits) -> AdmissionClasses {
        self.classes.push((id.into(), limits));
        self
    }

    /// Validates the classes in the original's order (`docs/design.md` §U6.1); returns the
    /// table and the default class's position.
    fn validate(
        self,
        max_concurrent: u32,
        budget: Option<u64>,
    ) -> Result<(ClassLimitsTable, usize), ConfigError> {
        if self.default_class.trim().is_empty() {
            return Err(ConfigError::DefaultClassEmpty {
                default_class: self.default_class,
            });
        }
        if self.classes.is_empty() {
            return Err(ConfigError::NoClasses);
        }
        let mut table = ClassLimitsTable::new();
        for (id, class) in &self.classes {
            if id.trim().is_empty() {
                return Err(ConfigError::Class(ClassLimitsError::EmptyId {
                    class: id.clone(),
                }));
            }
            if table.get(id).is_some() {
                return Err(ConfigError::Class(ClassLimitsError::DuplicateId {
                    class: id.clone(),
                }));
            }
            limits::validate_class(id, class, budget.is_some(), true)
                .map_err(ConfigError::Class)?;
            table.insert(id.clone(), *class);
        }
        let Some(default) = table.iter().position(|(id, _)| id == self.default_class) else {
            return Err(ConfigError::UnknownDefaultClass {
                default_class: self.default_class,
            });
        };
        let (slots, tokens) = limits::floor_sums(table.iter().map(|(_, class)| class));
        if slots > u64::from(max_concurrent) {
            return Err(ConfigError::ProtectedConcurrentSumTooLarge {
                sum: slots,
                max_concurrent,
            });
        }
        if let Some(budget) = budget
            && tokens > budget
        {
            return Err(ConfigError::ProtectedTokensSumTooLarge {
                sum: tokens,
                budget,
            });
        }
        Ok((table, default))
    }
}

impl LlmBulkheadBuilder {
    pub(crate) fn new(model: String, max_concurrent: usize) -> LlmBulkheadBuilder {
        LlmBulkheadBuilder {
            model,
            max_concurrent,
            profile: Profile::Interactive,
            max_queue: None,
            queue_timeout: None,
            initial_revision: 0,
            token_budget: None,
            estimator: None,
            admission_classes: None,
            deduplication: None,
            name: String::new(),
            tenant: String::new(),
            rate: None,
            rate_clock: RateClock::system(),
        }
    }

    /// Names the bulkhead in the crate's tracing (the `bulkhead` field of its spans and of
    /// [`trace_events`](crate::observability::trace_events)' lines) and in
    /// [`LlmBulkhead::name`](crate::LlmBulkhead::name). Default: empty.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::LlmBulkhead;
    ///
    /// let bulkhead = LlmBulkhead::builder("gpt-4o", 4).name("primary").tenant("acme").build()?;
    /// assert_eq!((bulkhead.name(), bulkhead.tenant()), ("primary", "acme"));
    /// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn name(mut self, name: impl Into<String>) -> LlmBulkheadBuilder {
        self.name = name.into();
        self
    }

    /// Names the tenant this bulkhead serves in the crate's tracing (the `tenant` field of its
    /// spans and trace lines) and in [`LlmBulkhead::tenant`](crate::LlmBulkhead::tenant), e.g.
    /// from a [`Tenants`](crate::tenants::Tenants) template's key. Default: empty.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants};
    ///
    /// let tenants = Tenants::builder(|key: &String| {
    ///     LlmBulkhead::builder("gpt-4o", 4).name("tenants").tenant(key.as_str())
    /// })
    /// .build()?;
    /// assert_eq!(tenants.get("acme")?.tenant(), "acme");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn tenant(mut self, tenant: impl Into<String>) -> LlmBulkheadBuilder {
        self.tenant = tenant.into();
        self
    }

    /// Deduplicates identical calls in flight: a [`run_shared`](crate::LlmBulkhead::run_shared)
    /// whose key (by default the whole request, see [`Deduplication`](crate::dedup::Deduplication)) matches a call in
    /// flight of the same scope and class joins it: it takes no capacity and gets that call's
    /// outcome. `run`, `acquire` and the other methods never deduplicate.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, dedup::Deduplication, LlmBulkhead, LlmRequest};
    ///
    /// # futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("m", 4).deduplication(Deduplication::new()).build()?;
    /// let request = LlmRequest::new().user("What is a bulkhead?");
    /// let call = |_ctx| async { Ok::<_, String>(String::from("an isolating wall")) };
    /// let (a, b) = futures::join!(
    ///     bulkhead.run_shared(&request, AcquireOptions::new(), call),
    ///     bulkhead.run_shared(&request, AcquireOptions::new(), call),
    /// );
    /// assert_eq!((a.unwrap(), b.unwrap()), ("an isolating wall".into(), "an isolating wall".into()));
    /// let stats = bulkhead.stats();
    /// assert_eq!((stats.admitted, stats.deduplication.unwrap().hits), (1, 1));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn deduplication(mut self, deduplication: Deduplication) -> LlmBulkheadBuilder {
        self.deduplication = Some(deduplication);
        self
    }

    /// Divides the bulkhead among admission classes (tenants, tiers): each class may have a
    /// protected floor (capacity other classes never borrow) and a ceiling, for calls and for
    /// tokens; calls beyond their class's floor share what no class protects. Whether a
    /// bulkhead has classes, and which, is fixed for its lifetime.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, classes::AdmissionClasses, classes::ClassLimits, rejection::Constraint, LlmBulkhead, LlmRequest, RejectReason};
    ///
    /// // 4 slots: 2 protected for premium, 1 for standard, 1 shared.
    /// let bulkhead = LlmBulkhead::builder("m", 4)
    ///     .admission_classes(
    ///         AdmissionClasses::new("standard")
    ///             .class("premium", ClassLimits::new().protected_concurrent(2))
    ///             .class("standard", ClassLimits::new().protected_concurrent(1)),
    ///     )
    ///     .build()?;
    /// let premium = AcquireOptions::new().class(bulkhead.class("premium")?);
    /// let held: Vec<_> = (0..3).map(|_| bulkhead.try_acquire(&LlmRequest::new(), premium)).collect();
    /// assert!(held.iter().all(Result::is_ok)); // its floor and the shared slot
    /// let refused = bulkhead.try_acquire(&LlmRequest::new(), premium).unwrap_err();
    /// let rejection = refused.rejection().unwrap();
    /// assert_eq!(rejection.reason(), RejectReason::ConcurrencyLimit);
    /// assert_eq!(rejection.detail().constraint, Some(Constraint::AdmissionClassProtection));
    /// // Standard's floor is still free for it.
    /// assert!(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).is_ok());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn admission_classes(mut self, classes: AdmissionClasses) -> LlmBulkheadBuilder {
        self.admission_classes = Some(classes);
        self
    }

    /// Sets the revision of the initial limits (default 0); every applied snapshot must be
    /// greater.
    ///
    /// # Examples
    ///
    /// ```
    /// let b = async_bulkhead_llm::LlmBulkhead::builder("m", 1).initial_revision(9).build()?;
    /// assert_eq!(b.limits().revision, 9);
    /// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn initial_revision(mut self, revision: u64) -> LlmBulkheadBuilder {
        self.initial_revision = revision;
        self
    }

    /// Sets how many calls may wait for a slot (default: the profile's, 0 for
    /// [`Profile::Interactive`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, Profile};
    ///
    /// let b = LlmBulkhead::builder("m", 1).max_queue(20).build()?;
    /// assert_eq!(b.limits().max_queue, 20);
    /// // Explicit options win over the profile, in any order.
    /// let b = LlmBulkhead::builder("m", 1).max_queue(3).profile(Profile::Batch).build()?;
    /// assert_eq!(b.limits().max_queue, 3);
    /// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn max_queue(mut self, max_queue: usize) -> LlmBulkheadBuilder {
        self.max_queue = Some(max_queue);
        self
    }

    /// Chooses a queueing profile (default [`Profile::Interactive`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::{LlmBulkhead, Profile};
    ///
    /// let b = LlmBulkhead::builder("m", 4).profile(Profile::Batch).build()?;
    /// assert_eq!(b.limits().max_queue, 20);
    /// assert_eq!(b.queue_timeout(), Some(Duration::from_secs(30)));
    /// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn profile(mut self, profile: Profile) -> LlmBulkheadBuilder {
        self.profile = profile;
        self
    }

    /// Sets the default queue timeout: how long a call may wait for a slot when it sets no
    /// timeout of its own (default: the profile's, none for [`Profile::Interactive`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::{LlmBulkhead, Profile};
    ///
    /// let b = LlmBulkhead::builder("m", 4)
    ///     .queue_timeout(Duration::from_millis(250))
    ///     .profile(Profile::Batch)
    ///     .build()?;
    /// assert_eq!(b.queue_timeout(), Some(Duration::from_millis(250)));
    /// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn queue_timeout(mut self, timeout: Duration) -> LlmBulkheadBuilder {
        self.queue_timeout = Some(timeout);
        self
    }

    /// Adds a token budget. Whether a bulkhead has one is fixed for its lifetime.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, TokenBudget};
    ///
    /// let b = LlmBulkhead::builder("m", 1).token_budget(TokenBudget::new(500)).build()?;
    /// assert_eq!(b.limits().token_budget.unwrap().budget, 500);
    /// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn token_budget(mut self, token_budget: TokenBudget) -> LlmBulkheadBuilder {
        self.token_budget = Some(token_budget);
        self
    }

    /// Limits requests and tokens per window (rpm / tpm, as providers bill and throttle):
    /// decided in the same admission as the limits in flight, changed through `apply_limits`
    /// with the rest (see [`RateLimits`](crate::rate::RateLimits) and the `rate` module). A
    /// tokens window needs a token budget.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, TokenBudget, rate::RateLimits};
    ///
    /// let bulkhead = LlmBulkhead::builder("gpt-4o", 64)
    ///     .token_budget(TokenBudget::new(400_000))
    ///     .rate_limits(RateLimits::per_minute().requests(5_000).tokens(2_000_000))
    ///     .build()?;
    /// assert_eq!(bulkhead.limits().rate.unwrap().requests, Some(5_000));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn rate_limits(mut self, rate: RateLimits) -> LlmBulkheadBuilder {
        self.rate = Some(rate);
        self
    }

    /// The clock the rate windows read (default [`RateClock::system`](crate::rate::RateClock::system),
    /// a coarse process-wide clock; a manual or tokio clock in tests).
    pub fn rate_clock(mut self, clock: RateClock) -> LlmBulkheadBuilder {
        self.rate_clock = clock;
        self
    }

    /// Sizes calls with `estimator` instead of the default, a [`ModelAwareEstimator`](crate::estimate::ModelAwareEstimator) seeded
    /// with the bulkhead's model and the token budget's output cap. Only a bulkhead with a token
    /// budget estimates. When an admission the estimator sized settles with usage, the
    /// estimator observes it (see [`Estimator::observe`](crate::estimate::Estimator::observe)).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, LlmRequest, estimate::NaiveEstimator, Reservation, TokenBudget};
    ///
    /// let bulkhead = LlmBulkhead::builder("claude-sonnet-4", 4)
    ///     .token_budget(TokenBudget::new(10_000))
    ///     .estimator(NaiveEstimator::new().output_cap(100))
    ///     .build()?;
    /// let request = LlmRequest::new().user("x".repeat(390));
    /// assert_eq!(bulkhead.estimate(&request)?, Some(Reservation::new(98, 100)?)); // chars / 4
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn estimator(mut self, estimator: impl Estimator + 'static) -> LlmBulkheadBuilder {
        self.estimator = Some(Arc::new(estimator));
        self
    }

    /// Validates the configuration and builds the bulkhead.
    ///
    /// # Errors
    ///
    /// In this order: [`ConfigError::EmptyModel`](crate::builder::ConfigError::EmptyModel), [`ConfigError::MaxConcurrentTooLarge`](crate::builder::ConfigError::MaxConcurrentTooLarge),
    /// [`ConfigError::InitialRevisionTooLarge`](crate::builder::ConfigError::InitialRevisionTooLarge), [`ConfigError::MaxQueueTooLarge`](crate::builder::ConfigError::MaxQueueTooLarge),
    /// [`ConfigError::BudgetTooLarge`](crate::builder::ConfigError::BudgetTooLarge),
    /// [`ConfigError::ReserveExceedsBudget`](crate::builder::ConfigError::ReserveExceedsBudget), then the admission classes':
    /// [`ConfigError::DefaultClassEmpty`](crate::builder::ConfigError::DefaultClassEmpty), [`ConfigError::NoClasses`](crate::builder::ConfigError::NoClasses), each class in order
    /// ([`ConfigError::Class`](crate::builder::ConfigError::Class): an empty or repeated id, a field too large, a floor above its
    /// ceiling, a token field without a budget), [`ConfigError::UnknownDefaultClass`](crate::builder::ConfigError::UnknownDefaultClass),
    /// [`ConfigError::ProtectedConcurrentSumTooLarge`](crate::builder::ConfigError::ProtectedConcurrentSumTooLarge),
    /// [`ConfigError::ProtectedTokensSumTooLarge`](crate::builder::ConfigError::ProtectedTokensSumTooLarge).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{builder::ConfigError, LlmBulkhead};
    ///
    /// assert!(LlmBulkhead::builder("m", 0).build().is_ok()); // fail-closed start
    /// assert_eq!(
    ///     LlmBulkhead::builder("m", 1).initial_revision(1 << 53).build().unwrap_err(),
    ///     ConfigError::InitialRevisionTooLarge { value: 1 << 53, max: (1 << 53) - 1 },
    /// );
    /// ```
    pub fn build(self) -> Result<LlmBulkhead, ConfigError> {
        if self.model.trim().is_empty() {
            return Err(ConfigError::EmptyModel { model: self.model });
        }
        let max_concurrent = match u32::try_from(self.max_concurrent) {
            Ok(value) if value <= MAX_CONCURRENT => value,
            _ => {
                return Err(ConfigError::MaxConcurrentTooLarge {
                    value: self.max_concurrent,
                    max: MAX_CONCURRENT as usize,
                });
            }
        };
        if self.initial_revision > MAX_REVISION {
            return Err(ConfigError::InitialRevisionTooLarge {
                value: self.initial_revision,
                max: MAX_REVISION,
            });
        }
        let max_queue = match self.max_queue {
            None => self.profile.max_queue(),
            Some(max_queue) => {
                u32::try_from(max_queue).map_err(|_| ConfigError::MaxQueueTooLarge {
                    value: max_queue,
                    max: u32::MAX as usize,
                })?
            }
        };
        let queue_timeout = self.queue_timeout.or(self.profile.timeout());
        let mut limits =
            Limits::new(self.initial_revision, max_concurrent).with_max_queue(max_queue);
        let mut output_cap = DEFAULT_OUTPUT_CAP;
        let model = self.model;
        if let Some(budget) = self.token_budget {
            if budget.budget > MAX_BUDGET {
                return Err(ConfigError::BudgetTooLarge {
                    value: budget.budget,
                    max: MAX_BUDGET,
                });
            }
            if budget.high_priority_reserve > budget.budget {
                return Err(ConfigError::ReserveExceedsBudget {
                    reserve: budget.high_priority_reserve,
                    budget: budget.budget,
                });
            }
            limits = limits.with_token_budget(budget.budget, budget.high_priority_reserve);
            output_cap = budget.output_cap;
        }
        if let Some(rate) = self.rate {
            crate::engine::limits::validate_rate(&rate, self.token_budget.is_some())
                .map_err(ConfigError::RateLimits)?;
            limits = limits.with_rate(rate);
        }
        let mut default_class = 0;
        if let Some(classes) = self.admission_classes {
            let budget = self.token_budget.map(|b| b.budget);
            let (table, default) = classes.validate(max_concurrent, budget)?;
            limits = limits.with_admission_classes(table);
            default_class = default;
        }
        let estimator = match self.estimator {
            Some(estimator) => estimator,
            None => Arc::new(
                ModelAwareEstimator::builder()
                    .default_model(model.clone())
                    .output_cap(output_cap)
                    .build()
                    .expect("no ratio overrides to refuse"),
            ),
        };
        Ok(LlmBulkhead {
            core: crate::support::sync::Arc::new(LlmCore::new(
                model,
                Engine::with_rate_clock(limits, default_class, self.rate_clock),
                estimator,
                queue_timeout,
                self.deduplication,
                (self.name, self.tenant),
            )),
        })
    }
}

impl fmt::Debug for LlmBulkheadBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlmBulkheadBuilder")
            .field("model", &self.model)
            .field("max_concurrent", &self.max_concurrent)
            .field("profile", &self.profile)
            .field("max_queue", &self.max_queue)
            .field("queue_timeout", &self.queue_timeout)
            .field("initial_revision", &self.initial_revision)
            .field("token_budget", &self.token_budget)
            .field("estimator", &self.estimator.as_ref().map(|_| ".."))
            .field("admission_classes", &self.admission_classes)
            .finish()
    }
}
