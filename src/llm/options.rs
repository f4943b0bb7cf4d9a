//! Per-call options of the LLM bulkhead: priority, reservation override, queue timeout and
//! admission class ([`AcquireOptions`]), and what `run` adds to them ([`RunOptions`]): a
//! borrowed-slot deadline, observe mode ([`ShadowReasons`](crate::observe::ShadowReasons)) and the deduplication scope
//! ([`DedupScope`](crate::dedup::DedupScope)).

use core::fmt;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::vocabulary::admission_class::AdmissionClass;
use crate::vocabulary::priority::Priority;
use crate::vocabulary::rejection::RejectReason;
use crate::vocabulary::reservation::Reservation;

/// Options of one acquire or advisory check.
///
/// Every option is a valid value by construction: a [`Reservation`] has been checked when it
/// was built, so options never fail validation.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, Priority, Reservation};
///
/// let options = AcquireOptions::new()
///     .priority(Priority::High)
///     .reservation(Reservation::new(120, 512)?);
/// assert_eq!(options.priority, Priority::High);
/// assert_eq!(options.reservation.map(|r| r.reserved()), Some(632));
/// # Ok::<(), async_bulkhead_llm::request::RequestError>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AcquireOptions {
    /// The call's priority (default [`Priority::Normal`]).
    pub priority: Priority,
    /// A reservation to use instead of the estimator's (default: none, estimate).
    pub reservation: Option<Reservation>,
    /// The queue timeout of this call (default: none, the bulkhead's).
    pub timeout: Option<Duration>,
    /// When this call gives up waiting in the queue at the latest (default: none).
    pub deadline: Option<Instant>,
    /// The call's admission class (default: none, the bulkhead's default class). Only a
    /// bulkhead with admission classes accepts one, and only its own.
    pub class: Option<AdmissionClass>,
}

impl AcquireOptions {
    /// Normal priority, reservation from the bulkhead's estimator.
    ///
    /// # Examples
    ///
    /// ```
    /// let options = async_bulkhead_llm::AcquireOptions::new();
    /// assert!(options.reservation.is_none());
    /// ```
    pub const fn new() -> AcquireOptions {
        AcquireOptions {
            priority: Priority::Normal,
            reservation: None,
            timeout: None,
            deadline: None,
            class: None,
        }
    }

    /// Admits the call in admission class `class` (resolved once with
    /// [`LlmBulkhead::class`](crate::LlmBulkhead::class)).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, classes::AdmissionClasses, classes::ClassLimits, LlmBulkhead, LlmRequest};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 2)
    ///     .admission_classes(AdmissionClasses::new("a").class("a", ClassLimits::new()).class("b", ClassLimits::new()))
    ///     .build()?;
    /// let b = bulkhead.class("b")?;
    /// let permit = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new().class(b))?;
    /// assert_eq!(permit.class(), Some(b));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn class(mut self, class: AdmissionClass) -> AcquireOptions {
        self.class = Some(class);
        self
    }

    /// Sets the priority.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, Priority};
    ///
    /// assert_eq!(AcquireOptions::new().priority(Priority::High).priority, Priority::High);
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn priority(mut self, priority: Priority) -> AcquireOptions {
        self.priority = priority;
        self
    }

    /// Uses `reservation` instead of calling the estimator. Ignored by a bulkhead without a
    /// token budget (it reserves no tokens).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, Reservation};
    ///
    /// let r = Reservation::new(1, 2)?;
    /// assert_eq!(AcquireOptions::new().reservation(r).reservation, Some(r));
    /// # Ok::<(), async_bulkhead_llm::request::RequestError>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn reservation(mut self, reservation: Reservation) -> AcquireOptions {
        self.reservation = Some(reservation);
        self
    }

    /// Bounds how long the call may wait in the queue (overriding the bulkhead's default); it
    /// never limits the call itself. A zero timeout still queues, and gives up at the first
    /// check unless a slot was handed over by then. With a [`deadline`](AcquireOptions::deadline)
    /// too, the wait ends at whichever comes first (as for the general bulkhead's
    /// [`WaitOptions`](crate::bulkhead::WaitOptions)).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::AcquireOptions;
    ///
    /// let options = AcquireOptions::new().timeout(Duration::from_secs(5));
    /// assert_eq!(options.timeout, Some(Duration::from_secs(5)));
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn timeout(mut self, timeout: Duration) -> AcquireOptions {
        self.timeout = Some(timeout);
        self
    }

    /// Gives up waiting in the queue at `deadline` if the timeout has not ended the wait
    /// first; a deadline already past ends the wait at once (a call that finds room now is
    /// admitted whatever its deadline). It never limits the call itself.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use async_bulkhead_llm::{AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, Profile, RejectReason};
    ///
    /// # futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("m", 1).profile(Profile::Batch).build()?;
    /// let request = LlmRequest::new();
    /// let _held = bulkhead.acquire(&request, AcquireOptions::new()).await?;
    /// let options = AcquireOptions::new().deadline(Instant::now() + Duration::from_millis(20));
    /// match bulkhead.acquire(&request, options).await {
    ///     Err(AcquireError::Rejected(refused)) => assert_eq!(refused.reason(), RejectReason::Timeout),
    ///     other => panic!("expected a timeout, got {other:?}"),
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn deadline(mut self, deadline: Instant) -> AcquireOptions {
        self.deadline = Some(deadline);
        self
    }

    /// These options for a [`run`](crate::LlmBulkhead::run), with a borrowed-slot deadline
    /// (see [`RunOptions::borrowed_concurrency_deadline`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::AcquireOptions;
    ///
    /// let options = AcquireOptions::new().borrowed_concurrency_deadline(Duration::from_secs(30));
    /// assert_eq!(options.borrowed_concurrency_deadline, Some(Duration::from_secs(30)));
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn borrowed_concurrency_deadline(self, deadline: Duration) -> RunOptions {
        RunOptions::new(self).borrowed_concurrency_deadline(deadline)
    }

    /// These options for a [`run`](crate::LlmBulkhead::run) in observe mode (see
    /// [`RunOptions::observe`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, observe::ShadowReasons};
    ///
    /// let options = AcquireOptions::new().observe(ShadowReasons::ALL);
    /// assert_eq!(options.observe, Some(ShadowReasons::ALL));
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn observe(self, reasons: ShadowReasons) -> RunOptions {
        RunOptions::new(self).observe(reasons)
    }

    /// These options for a [`run_shared`](crate::LlmBulkhead::run_shared), deduplicated
    /// within `scope` only (see [`RunOptions::dedup_scope`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, dedup::DedupScope};
    ///
    /// let options = AcquireOptions::new().dedup_scope(DedupScope::new("tenant-42"));
    /// assert_eq!(options.dedup_scope, Some(DedupScope::new("tenant-42")));
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn dedup_scope(self, scope: DedupScope) -> RunOptions {
        RunOptions::new(self).dedup_scope(scope)
    }

    /// These options for a [`run_shared`](crate::LlmBulkhead::run_shared) that neither joins
    /// nor leads a shared call (see [`RunOptions::no_dedup`]).
    ///
    /// # Examples
    ///
    /// ```
    /// assert!(!async_bulkhead_llm::AcquireOptions::new().no_dedup().dedup);
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn no_dedup(self) -> RunOptions {
        RunOptions::new(self).no_dedup()
    }
}

/// Options of one [`run`](crate::LlmBulkhead::run): the [`AcquireOptions`] of its admission,
/// and a borrowed-slot deadline. Every `run` accepts plain `AcquireOptions` too (they convert).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use async_bulkhead_llm::{AcquireOptions, Priority, RunOptions};
///
/// let options = RunOptions::from(AcquireOptions::new().priority(Priority::High))
///     .borrowed_concurrency_deadline(Duration::from_secs(10));
/// assert_eq!(options.acquire.priority, Priority::High);
/// assert_eq!(options.borrowed_concurrency_deadline, Some(Duration::from_secs(10)));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunOptions {
    /// How the call is admitted.
    pub acquire: AcquireOptions,
    /// How long the call may keep a slot it borrowed from the shared pool (default: no limit).
    pub borrowed_concurrency_deadline: Option<Duration>,
    /// Observe mode: the refusals that let the call run anyway (default: none, enforce).
    pub observe: Option<ShadowReasons>,
    /// Whether a [`run_shared`](crate::LlmBulkhead::run_shared) may join or lead a shared
    /// call (default `true`; it has no effect on a bulkhead without deduplication).
    pub dedup: bool,
    /// The partition the call's deduplication key lives in (default: the unnamed scope).
    pub dedup_scope: Option<DedupScope>,
}

impl Default for RunOptions {
    fn default() -> RunOptions {
        RunOptions::new(AcquireOptions::new())
    }
}

impl RunOptions {
    /// Run options admitting with `acquire`, without a deadline.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, RunOptions};
    ///
    /// assert_eq!(RunOptions::new(AcquireOptions::new()).borrowed_concurrency_deadline, None);
    /// ```
    pub const fn new(acquire: AcquireOptions) -> RunOptions {
        RunOptions {
            acquire,
            borrowed_concurrency_deadline: None,
            observe: None,
            dedup: true,
            dedup_scope: None,
        }
    }

    /// Observe (shadow) mode: when the bulkhead refuses the call for one of `reasons`, the
    /// call runs anyway, holding no slot and no tokens, and the refusal is counted in
    /// [`Stats::observe`](crate::Stats::observe) and announced with a
    /// [`BypassEvent`](crate::events::BypassEvent): roll limits out on real traffic before they bite.
    ///
    /// - A refusal the advisory check ([`would_admit`](crate::LlmBulkhead::would_admit))
    ///   predicts is bypassed at once, neither counted as a rejection nor announced as one.
    /// - Otherwise the call is admitted as usual (it may queue); if the admission then refuses
    ///   it for one of `reasons` (a race, a queue timeout), that rejection is counted and
    ///   announced, and the call is bypassed (`raced`).
    /// - Shutdown is never bypassed: a closed bulkhead refuses an observe-mode call as any
    ///   other. A bypassed call that finds the bulkhead closed is refused with `shutdown`.
    ///
    /// The callback of a bypassed call sees [`RunContext::bypass`](crate::RunContext::bypass)
    /// (its `shadow-` id, the refusal, the would-be reservation); it may report usage, which
    /// is validated and clamped as for an admitted call and announced with
    /// [`BypassUsageEvent`](crate::events::BypassUsageEvent)s; its end is announced with a
    /// [`BypassReleaseEvent`](crate::events::BypassReleaseEvent).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, RejectReason, RunOptions, observe::ShadowReasons};
    ///
    /// let options = RunOptions::new(AcquireOptions::new()).observe(ShadowReasons::ALL);
    /// assert!(options.observe.unwrap().contains(RejectReason::BudgetLimit));
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn observe(mut self, reasons: ShadowReasons) -> RunOptions {
        self.observe = Some(reasons);
        self
    }

    /// Deduplicates the call only with calls of the same `scope` (a tenant, an API key): no
    /// outcome ever crosses a scope. Calls without a scope share the unnamed scope.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, dedup::DedupScope, RunOptions};
    ///
    /// let options = RunOptions::new(AcquireOptions::new()).dedup_scope(DedupScope::new("acme"));
    /// assert_eq!(options.dedup_scope, Some(DedupScope::new("acme")));
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn dedup_scope(mut self, scope: DedupScope) -> RunOptions {
        self.dedup_scope = Some(scope);
        self
    }

    /// Runs this call on its own: it neither joins an identical call in flight nor lets
    /// others join it.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, RunOptions};
    ///
    /// assert!(RunOptions::new(AcquireOptions::new()).dedup);
    /// assert!(!RunOptions::new(AcquireOptions::new()).no_dedup().dedup);
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn no_dedup(mut self) -> RunOptions {
        self.dedup = false;
        self
    }

    /// Bounds how long the call may keep a slot it borrowed from the shared pool (its class's
    /// floor was full when it was admitted; see
    /// [`Admission::resources`](crate::admission::Admission::resources)). If the callback has not
    /// finished when the deadline passes, `run` gives the slot back at once, drops the
    /// callback's future, settles its tokens with the last usage it reported, and returns
    /// [`RunError::BorrowedConcurrencyDeadline`](crate::RunError::BorrowedConcurrencyDeadline).
    /// A call that did not borrow its slot (or that gave it back itself) is never cut. The
    /// deadline needs no runtime timer (the crate's own timer thread wakes the task).
    ///
    /// A zero deadline is refused when `run` starts, with
    /// [`RequestError::ZeroBorrowedConcurrencyDeadline`](crate::request::RequestError::ZeroBorrowedConcurrencyDeadline),
    /// even when it would not apply.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::{AcquireOptions, RunOptions};
    ///
    /// let options = RunOptions::new(AcquireOptions::new())
    ///     .borrowed_concurrency_deadline(Duration::from_millis(1500));
    /// assert_eq!(options.borrowed_concurrency_deadline, Some(Duration::from_millis(1500)));
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn borrowed_concurrency_deadline(mut self, deadline: Duration) -> RunOptions {
        self.borrowed_concurrency_deadline = Some(deadline);
        self
    }
}

impl From<AcquireOptions> for RunOptions {
    fn from(acquire: AcquireOptions) -> RunOptions {
        RunOptions::new(acquire)
    }
}

impl From<Priority> for AcquireOptions {
    fn from(priority: Priority) -> AcquireOptions {
        AcquireOptions::new().priority(priority)
    }
}

/// The refusals an observe-mode call may bypass: a subset of budget, concurrency, queue limit
/// and queue timeout. Shutdown and cancellation are never bypassed, so a set holding them
/// cannot be built.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{RejectReason, observe::ShadowReasons};
///
/// let only_budget = ShadowReasons::new([RejectReason::BudgetLimit])?;
/// assert!(only_budget.contains(RejectReason::BudgetLimit));
/// assert!(!only_budget.contains(RejectReason::Timeout));
/// assert!(ShadowReasons::ALL.contains(RejectReason::QueueLimit));
///
/// let err = ShadowReasons::new([RejectReason::Shutdown]).unwrap_err();
/// assert_eq!(err.reason, RejectReason::Shutdown);
/// # Ok::<(), async_bulkhead_llm::observe::NotShadowable>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShadowReasons(u8);

impl ShadowReasons {
    /// Budget, concurrency, queue limit and queue timeout: every refusal that may be bypassed.
    pub const ALL: ShadowReasons = ShadowReasons(
        1 << RejectReason::BudgetLimit as u8
            | 1 << RejectReason::ConcurrencyLimit as u8
            | 1 << RejectReason::QueueLimit as u8
            | 1 << RejectReason::Timeout as u8,
    );

    /// No reason: an observe-mode call with this set is never bypassed.
    pub const NONE: ShadowReasons = ShadowReasons(0);

    /// The set of `reasons`.
    ///
    /// # Errors
    ///
    /// [`NotShadowable`](crate::observe::NotShadowable) naming the first reason that can never be bypassed (shutdown,
    /// aborted).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{RejectReason, observe::ShadowReasons};
    ///
    /// let set = ShadowReasons::new([RejectReason::Timeout, RejectReason::QueueLimit])?;
    /// assert!(set.contains(RejectReason::Timeout));
    /// assert!(ShadowReasons::new([RejectReason::Aborted]).is_err());
    /// # Ok::<(), async_bulkhead_llm::observe::NotShadowable>(())
    /// ```
    pub fn new(
        reasons: impl IntoIterator<Item = RejectReason>,
    ) -> Result<ShadowReasons, NotShadowable> {
        reasons
            .into_iter()
            .try_fold(ShadowReasons::NONE, |set, reason| {
                let bit = 1 << reason as u8;
                if ShadowReasons::ALL.0 & bit == 0 {
                    return Err(NotShadowable { reason });
                }
                Ok(ShadowReasons(set.0 | bit))
            })
    }

    /// Whether `reason` is in the set.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{RejectReason, observe::ShadowReasons};
    ///
    /// assert!(!ShadowReasons::NONE.contains(RejectReason::BudgetLimit));
    /// assert!(!ShadowReasons::ALL.contains(RejectReason::Shutdown));
    /// ```
    pub const fn contains(self, reason: RejectReason) -> bool {
        self.0 & (1 << reason as u8) != 0
    }

    /// The set as bits, one per `RejectReason` (`1 << reason as u8`).
    pub(crate) const fn bits(self) -> u8 {
        self.0
    }
}

impl Default for ShadowReasons {
    /// [`ShadowReasons::ALL`](crate::observe::ShadowReasons::ALL).
    fn default() -> ShadowReasons {
        ShadowReasons::ALL
    }
}

/// A reason that can never be bypassed was given to [`ShadowReasons::new`](crate::observe::ShadowReasons::new).
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{RejectReason, observe::ShadowReasons};
///
/// let err = ShadowReasons::new([RejectReason::Aborted]).unwrap_err();
/// assert_eq!(
///     err.to_string(),
///     "aborted cannot be bypassed: shadow reasons may contain only budget_limit, concurrency_limit, queue_limit or timeout",
/// );
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct NotShadowable {
    /// The reason given.
    pub reason: RejectReason,
}

impl fmt::Display for NotShadowable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} cannot be bypassed: shadow reasons may contain only budget_limit, concurrency_limit, queue_limit or timeout",
            self.reason
        )
    }
}

impl std::error::Error for NotShadowable {}

/// A deduplication partition (a tenant, an API key): calls deduplicate only with calls of the
/// same scope. It keeps a SHA-256 digest of the name, never the name itself.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::dedup::DedupScope;
///
/// assert_eq!(DedupScope::new("tenant-1"), DedupScope::new("tenant-1"));
/// assert_ne!(DedupScope::new("tenant-1"), DedupScope::new("tenant-2"));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DedupScope([u8; 32]);

impl DedupScope {
    /// The scope named `name` (any bytes; two scopes are equal when their names are).
    ///
    /// # Examples
    ///
    /// ```
    /// let scope = async_bulkhead_llm::dedup::DedupScope::new(b"\x00binary ok");
    /// assert_eq!(scope, async_bulkhead_llm::dedup::DedupScope::new(b"\x00binary ok"));
    /// ```
    pub fn new(name: impl AsRef<[u8]>) -> DedupScope {
        DedupScope(Sha256::digest(name.as_ref()).into())
    }

    /// The digest of the scope's name.
    pub(crate) fn digest(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for DedupScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DedupScope(")?;
        for byte in &self.0[..6] {
            write!(f, "{byte:02x}")?;
        }
        write!(f, "…)")
    }
}
