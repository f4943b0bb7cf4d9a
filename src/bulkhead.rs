//! [`LlmBulkhead`]: the admission engine that ties the packed state, the published limits, the
//! pure policy, permits and statistics together.

use core::convert::Infallible;
use core::fmt;
use std::time::Duration;

use crate::config::LlmBulkheadBuilder;
use crate::error::{AcquireError, LimitsError, RequestError};
use crate::estimate::{Estimator, Memo};
use crate::events::{ALL_KINDS, Event, EventKind, Listeners, Subscription, kinds_mask};
use crate::limits::{
    self, ApplyOutcome, BudgetLimits, Limits, MAX_BUDGET, MAX_REVISION, PublishedLimits,
};
use crate::local;
use crate::options::AcquireOptions;
use crate::permit::{Grant, OwnedPermit, Permit};
use crate::policy::{self, Ask, Refusal, Turn, Verdict};
use crate::queue::{Arrival, HandedOff, WaitQueue, Waiter};
use crate::rejection::{CapacityDetail, RejectReason, Rejection};
use crate::request::LlmRequest;
use crate::reservation::Reservation;
use crate::state::{AtomicState, EPOCH_BITS, State};
use crate::stats::{Counter, Hub, Stats, TokenBudgetStats};
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::{Arc, Mutex, lock, unmodeled};
use crossbeam_utils::Backoff;

/// Admission control for calls to one LLM: a hard cap on calls in flight and, optionally, on
/// tokens in flight, decided by one lock-free compare-and-swap per admission.
///
/// Cloning is cheap (a reference count) and every clone is the same bulkhead.
///
/// # Memory ordering
///
/// Admission and release are `AcqRel` read-modify-writes of one atomic word, so they are
/// totally ordered, and everything a permit holder did before releasing happens-before the
/// admission that reuses its capacity. Refusals, advisory checks and statistics behave like
/// `Acquire` loads of that word. `apply_limits`, `set_budget` and `close` are linearizable
/// with admissions: once they return, no admission decided under the previous limits (or
/// before the close) can still succeed.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, TokenBudget, TokenUsage};
///
/// let bulkhead = LlmBulkhead::builder("claude-sonnet-4", 8)
///     .token_budget(TokenBudget::new(8_000))
///     .build()?;
///
/// let request = LlmRequest::new().user("Explain bulkheads in one line.").max_tokens(200);
/// let permit = bulkhead.try_acquire(&request, AcquireOptions::new())?;
/// assert_eq!(permit.held_tokens(), 8 + 200); // ceil(30 chars / 4) input + 200 output
///
/// // ... call the provider ...
/// let report = permit.release(Some(TokenUsage::new(8, 60)?));
/// assert_eq!(report.refunded_tokens, 140);
///
/// // A request that cannot fit is refused at once, with a capacity snapshot.
/// let huge = LlmRequest::new().user("x".repeat(40_000)).max_tokens(1);
/// let err = bulkhead.try_acquire(&huge, AcquireOptions::new()).unwrap_err();
/// assert_eq!(err.rejection().unwrap().reason(), RejectReason::BudgetLimit);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct LlmBulkhead {
    pub(crate) inner: Arc<Inner>,
}

/// The shared state behind every clone of a bulkhead and every permit.
pub(crate) struct Inner {
    /// The packed admission word (written by every admission and release; cache-padded).
    pub(crate) state: AtomicState,
    /// The limits in force, readable without a lock (see `crate::limits`).
    published: PublishedLimits,
    /// Serialises limit writers and holds the authoritative copy of the limits in force.
    writer: Mutex<Limits>,
    /// Calls waiting for a slot, in arrival order (see `crate::queue`).
    pub(crate) queue: WaitQueue,
    /// Notified when the bulkhead becomes idle while a drain waits (see `crate::drain`).
    pub(crate) drained: event_listener::Event,
    /// Counts those notifications, so a woken drainer knows an idle moment happened.
    pub(crate) idle_generation: AtomicU64,
    /// Cumulative counters, sharded per thread.
    pub(crate) hub: unmodeled::Arc<Hub>,
    /// Event listeners (see `crate::events`).
    pub(crate) listeners: unmodeled::Arc<Listeners>,
    model: Box<str>,
    /// Sizes calls that bring no reservation of their own (with a token budget only).
    pub(crate) estimator: unmodeled::Arc<dyn Estimator>,
    /// Panics of `estimator.observe`, caught and counted (see `crate::contain`).
    pub(crate) estimator_panics: unmodeled::AtomicU64,
    has_budget: bool,
    /// Queue timeout of calls that set none.
    default_timeout: Option<Duration>,
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
    /// # Ok::<(), async_bulkhead_llm::ConfigError>(())
    /// ```
    pub fn builder(model: impl Into<String>, max_concurrent: u32) -> LlmBulkheadBuilder {
        LlmBulkheadBuilder::new(model.into(), max_concurrent)
    }

    pub(crate) fn from_parts(
        model: String,
        limits: Limits,
        estimator: unmodeled::Arc<dyn Estimator>,
        default_timeout: Option<Duration>,
    ) -> LlmBulkhead {
        let has_budget = limits.token_budget.is_some();
        let inner = Inner {
            state: AtomicState::new(),
            published: PublishedLimits::new(&limits),
            writer: Mutex::new(limits),
            queue: WaitQueue::new(),
            drained: event_listener::Event::new(),
            idle_generation: AtomicU64::new(0),
            hub: unmodeled::Arc::new(Hub::default()),
            listeners: unmodeled::Arc::new(Listeners::default()),
            model: model.into_boxed_str(),
            estimator,
            estimator_panics: unmodeled::AtomicU64::new(0),
            has_budget,
            default_timeout,
        };
        LlmBulkhead {
            inner: Arc::new(inner),
        }
    }

    /// The model this bulkhead guards (the estimator's default model).
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::LlmBulkhead::builder("gpt-4o", 1).build()?;
    /// assert_eq!(bulkhead.model(), "gpt-4o");
    /// # Ok::<(), async_bulkhead_llm::ConfigError>(())
    /// ```
    pub fn model(&self) -> &str {
        &self.inner.model
    }

    /// Admits the call now or refuses it now; never waits.
    ///
    /// The reservation is the options' override, or else the estimate for `request` (only
    /// when the bulkhead has a token budget; without one nothing is estimated). The checks, in
    /// order: closed (`shutdown`), the priority-adjusted token budget (`budget_limit`), a free
    /// slot (`concurrency_limit`). Slot and tokens are taken in one atomic step.
    ///
    /// # Errors
    ///
    /// [`AcquireError::Rejected`] for a capacity refusal (with its snapshot), and
    /// [`AcquireError::Invalid`] when the estimate cannot be represented; in both cases
    /// nothing is held.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason};
    ///
    /// let bulkhead = LlmBulkhead::builder("gpt-4o", 1).build()?;
    /// let permit = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// let err = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).unwrap_err();
    /// assert_eq!(err.rejection().unwrap().reason(), RejectReason::ConcurrencyLimit);
    /// drop(permit);
    /// assert!(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).is_ok());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn try_acquire(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<Permit<'_>, AcquireError> {
        let call = self.inner.resolve(request, options)?;
        let grant = self.inner.try_admit(call)?;
        Ok(Permit::new(&self.inner, grant))
    }

    /// Like [`try_acquire`](LlmBulkhead::try_acquire), returning an [`OwnedPermit`] that keeps
    /// the bulkhead alive (for spawned tasks and response bodies).
    ///
    /// # Errors
    ///
    /// As for [`try_acquire`](LlmBulkhead::try_acquire).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest};
    ///
    /// let bulkhead = LlmBulkhead::builder("gpt-4o", 1).build()?;
    /// let permit = bulkhead.try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())?;
    /// drop(bulkhead); // the permit keeps the bulkhead alive
    /// drop(permit);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn try_acquire_owned(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<OwnedPermit, AcquireError> {
        let call = self.inner.resolve(request, options)?;
        let grant = self.inner.try_admit(call)?;
        Ok(OwnedPermit::new(Arc::clone(&self.inner), grant))
    }

    /// The reservation an admission of `request` would make, without reserving anything:
    /// `None` when the bulkhead has no token budget. Passing the result back with
    /// [`AcquireOptions::reservation`] admits exactly this reservation.
    ///
    /// # Errors
    ///
    /// [`RequestError`] when the estimate cannot be represented.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 4).token_budget(TokenBudget::new(10_000)).build()?;
    /// let request = LlmRequest::new().user("x".repeat(401));
    /// let preview = bulkhead.estimate(&request)?.unwrap();
    /// assert_eq!(preview, Reservation::new(101, 2048)?);
    /// let permit = bulkhead.try_acquire(&request, AcquireOptions::new().reservation(preview))?;
    /// assert_eq!(permit.reservation(), Some(preview));
    ///
    /// let unbudgeted = LlmBulkhead::builder("m", 4).build()?;
    /// assert_eq!(unbudgeted.estimate(&request)?, None);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn estimate(&self, request: &LlmRequest) -> Result<Option<Reservation>, RequestError> {
        if self.inner.has_budget {
            Ok(Some(self.inner.estimator.estimate(request)?.reservation()?))
        } else {
            Ok(None)
        }
    }

    /// Whether `request` would be admitted now, without reserving anything or counting
    /// anything. A closed bulkhead answers `shutdown` first.
    ///
    /// # Errors
    ///
    /// [`RequestError`] when the estimate cannot be represented (checked before anything else).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, Verdict};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build()?;
    /// let request = LlmRequest::new();
    /// assert_eq!(bulkhead.would_admit(&request, AcquireOptions::new())?, Verdict::Admit);
    /// let _held = bulkhead.try_acquire(&request, AcquireOptions::new())?;
    /// assert_eq!(bulkhead.would_admit(&request, AcquireOptions::new())?, Verdict::Queue);
    /// bulkhead.close();
    /// assert_eq!(
    ///     bulkhead.would_admit(&request, AcquireOptions::new())?,
    ///     Verdict::Reject(RejectReason::Shutdown),
    /// );
    /// assert_eq!(bulkhead.stats().rejected, 0); // advisory checks count nothing
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn would_admit(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<Verdict, RequestError> {
        self.would_admit_with_detail(request, options)
            .map(|(verdict, _)| verdict)
    }

    /// [`would_admit`](LlmBulkhead::would_admit), plus the capacity snapshot the verdict was
    /// made on (for an admit as well as a refusal).
    ///
    /// # Errors
    ///
    /// As for [`would_admit`](LlmBulkhead::would_admit).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget, Verdict};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 2).token_budget(TokenBudget::new(1000)).build()?;
    /// let opts = AcquireOptions::new().reservation(Reservation::new(300, 400)?);
    /// let (verdict, detail) = bulkhead.would_admit_with_detail(&LlmRequest::new(), opts)?;
    /// assert_eq!(verdict, Verdict::Admit);
    /// assert_eq!(detail.token_budget.unwrap().requested, 700);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn would_admit_with_detail(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<(Verdict, CapacityDetail), RequestError> {
        let ask = self.inner.resolve(request, options)?.ask;
        let (state, limits) = self.inner.snapshot();
        let pending = self.inner.pending();
        Ok((
            policy::verdict(state, &limits, pending, ask),
            policy::detail(state, &limits, pending, ask),
        ))
    }

    /// The limits in force.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Limits, LlmBulkhead, TokenBudget};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 3)
    ///     .token_budget(TokenBudget::new(900).high_priority_reserve(100))
    ///     .build()?;
    /// assert_eq!(bulkhead.limits(), Limits::new(0, 3).with_token_budget(900, 100));
    /// # Ok::<(), async_bulkhead_llm::ConfigError>(())
    /// ```
    pub fn limits(&self) -> Limits {
        self.inner.snapshot().1
    }

    /// Installs a new limits snapshot atomically, if its revision is newer.
    ///
    /// - A revision not greater than the current one returns [`ApplyOutcome::Stale`] without
    ///   examining the rest of the snapshot; nothing changes.
    /// - Otherwise the whole snapshot is validated before anything changes. Whether a token
    ///   budget exists is fixed at construction. A high-priority reserve above the budget is
    ///   allowed (normal-priority calls then get no tokens).
    /// - Lowering a limit never revokes anything: calls in flight keep their capacity and new
    ///   admissions wait for attrition (shrink by attrition). Raising one takes effect for the
    ///   very next admission.
    ///
    /// Linearizable with admissions: once this returns, every admission decision uses the new
    /// limits, and each permit keeps the revision that admitted it.
    ///
    /// # Errors
    ///
    /// [`LimitsError`] when the revision exceeds 2^53 - 1 (checked first), `max_concurrent`
    /// exceeds [`MAX_CONCURRENT`](crate::MAX_CONCURRENT), the budget exceeds
    /// [`MAX_BUDGET`](crate::MAX_BUDGET), or the token budget's presence does not match the
    /// construction.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, ApplyOutcome, Limits, LlmBulkhead, LlmRequest};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 2).build()?;
    /// let a = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// let b = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    ///
    /// // Shrink to 1 while 2 are in flight: nothing is revoked, new calls wait for attrition.
    /// let outcome = bulkhead.apply_limits(Limits::new(1, 1))?;
    /// assert_eq!(outcome, ApplyOutcome::Applied { previous: Limits::new(0, 2), current: Limits::new(1, 1) });
    /// drop(a);
    /// assert!(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).is_err());
    /// drop(b);
    /// let c = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// assert_eq!(c.limit_revision(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn apply_limits(&self, next: Limits) -> Result<ApplyOutcome, LimitsError> {
        if next.revision > MAX_REVISION {
            return Err(LimitsError::RevisionTooLarge {
                value: next.revision,
                max: MAX_REVISION,
            });
        }
        let mut current = lock(&self.inner.writer);
        if next.revision <= current.revision {
            return Ok(ApplyOutcome::Stale { current: *current });
        }
        limits::validate(&next, self.inner.has_budget)?;
        let (previous, handed_off) = self.inner.install(&mut current, next);
        drop(current);
        // Wake only now: a woken task may be polled inline and call back into `apply_limits`.
        handed_off.finish(&self.inner);
        self.inner.announce_reconfigure(previous, next);
        Ok(ApplyOutcome::Applied {
            previous,
            current: next,
        })
    }

    /// Changes only the token budget, at the next revision, keeping everything else (the
    /// high-priority reserve included). Lowering it below the tokens in flight is allowed
    /// (shrink by attrition). Returns the limits now in force.
    ///
    /// # Errors
    ///
    /// [`LimitsError::TokenBudgetNotConfigured`] without a token budget,
    /// [`LimitsError::RevisionExhausted`] when the revision is already 2^53 - 1, and
    /// [`LimitsError::BudgetTooLarge`] above [`MAX_BUDGET`](crate::MAX_BUDGET).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, TokenBudget};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 2)
    ///     .token_budget(TokenBudget::new(1000).high_priority_reserve(200))
    ///     .build()?;
    /// let now = bulkhead.set_budget(5000)?;
    /// assert_eq!(now.revision, 1);
    /// assert_eq!((now.token_budget.unwrap().budget, now.token_budget.unwrap().high_priority_reserve), (5000, 200));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_budget(&self, tokens: u64) -> Result<Limits, LimitsError> {
        let mut current = lock(&self.inner.writer);
        let Some(budget) = current.token_budget else {
            return Err(LimitsError::TokenBudgetNotConfigured);
        };
        if current.revision >= MAX_REVISION {
            return Err(LimitsError::RevisionExhausted {
                current: current.revision,
            });
        }
        if tokens > MAX_BUDGET {
            return Err(LimitsError::BudgetTooLarge {
                value: tokens,
                max: MAX_BUDGET,
            });
        }
        let next = Limits {
            revision: current.revision + 1,
            token_budget: Some(BudgetLimits {
                budget: tokens,
                ..budget
            }),
            ..*current
        };
        let (previous, handed_off) = self.inner.install(&mut current, next);
        drop(current);
        handed_off.finish(&self.inner);
        self.inner.announce_reconfigure(previous, next);
        Ok(next)
    }

    /// Stops admission for good. Idempotent; returns `true` for the call that closed it.
    ///
    /// Calls in flight are not interrupted and release normally. Every later admission is
    /// refused with `shutdown`, before any capacity check; limits and statistics keep working.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 1).build()?;
    /// let permit = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// assert!(bulkhead.close());
    /// assert!(!bulkhead.close());
    /// let err = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).unwrap_err();
    /// assert_eq!(err.rejection().unwrap().reason(), RejectReason::Shutdown);
    /// drop(permit);
    /// assert_eq!(bulkhead.stats().in_flight, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn close(&self) -> bool {
        let closed_now = self
            .inner
            .state
            .update(|s| {
                if s.is_closed() {
                    Err(())
                } else {
                    Ok((s.with_closed(), ()))
                }
            })
            .is_ok();
        if closed_now {
            // No call can join the queue any more (it would see the flag); empty it.
            self.inner.refuse_all_waiters();
        }
        closed_now
    }

    /// Whether [`close`](LlmBulkhead::close) has been called.
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::LlmBulkhead::builder("m", 1).build()?;
    /// assert!(!bulkhead.is_closed());
    /// bulkhead.close();
    /// assert!(bulkhead.is_closed());
    /// # Ok::<(), async_bulkhead_llm::ConfigError>(())
    /// ```
    pub fn is_closed(&self) -> bool {
        self.inner.state.load().is_closed()
    }

    /// Calls `listener` with every lifecycle event until the returned [`Subscription`] is
    /// dropped. See [`Event`] and `crate::events` for delivery rules: synchronous, in
    /// registration order, never under a lock of the bulkhead, panics caught and counted.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use async_bulkhead_llm::{Event, LlmBulkhead, Limits};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 1).build()?;
    /// let revisions = Arc::new(Mutex::new(Vec::new()));
    /// let seen = revisions.clone();
    /// let _subscription = bulkhead.on(move |event: &Event<'_>| {
    ///     if let Event::Reconfigure(e) = event {
    ///         seen.lock().unwrap().push(e.current.revision);
    ///     }
    /// });
    /// bulkhead.apply_limits(Limits::new(1, 2))?;
    /// bulkhead.apply_limits(Limits::new(2, 3))?;
    /// assert_eq!(*revisions.lock().unwrap(), [1, 2]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn on(&self, listener: impl Fn(&Event<'_>) + Send + Sync + 'static) -> Subscription {
        Subscription::new(&self.inner.listeners, ALL_KINDS, Box::new(listener))
    }

    /// Like [`on`](LlmBulkhead::on), for the given kinds only: other kinds cost nothing.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use async_bulkhead_llm::{AcquireOptions, Event, EventKind, LlmBulkhead, LlmRequest};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 0).build()?;
    /// let refused = Arc::new(AtomicU64::new(0));
    /// let count = refused.clone();
    /// let _subscription = bulkhead.on_events([EventKind::Reject], move |event| {
    ///     if let Event::Reject(e) = event {
    ///         assert_eq!(e.queue_wait, std::time::Duration::ZERO);
    ///         count.fetch_add(1, Ordering::Relaxed);
    ///     }
    /// });
    /// let _ = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new());
    /// assert_eq!(refused.load(Ordering::Relaxed), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn on_events(
        &self,
        kinds: impl IntoIterator<Item = EventKind>,
        listener: impl Fn(&Event<'_>) + Send + Sync + 'static,
    ) -> Subscription {
        Subscription::new(&self.inner.listeners, kinds_mask(kinds), Box::new(listener))
    }

    /// A snapshot of the bulkhead's figures; see [`Stats`].
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 1).build()?;
    /// let _permit = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// let _ = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new());
    /// let stats = bulkhead.stats();
    /// assert_eq!((stats.in_flight, stats.admitted, stats.rejected), (1, 1, 1));
    /// assert_eq!(stats.rejected_by_reason.concurrency_limit, 1);
    /// assert!(stats.token_budget.is_none());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn stats(&self) -> Stats {
        // Counters first, then the word: an admission whose count we see (Acquire, pairing
        // with the shard's Release store) has its slot in the word we read after, so
        // `admitted - in_flight` never counts a call as released before it was; it may lag
        // calls completing right now, and is exact once the callers are synchronised with us.
        let totals = self.inner.hub.totals();
        let (state, limits) = self.inner.snapshot();
        let admitted = totals.get(Counter::Admitted);
        let rejected_by_reason = totals.rejections();
        Stats {
            limits,
            closed: state.is_closed(),
            in_flight: u64::from(state.slots()),
            pending: self.inner.pending(),
            admitted,
            // Every admission either holds a slot or has been settled; slots handed to waiters
            // that have not picked them up are in flight but not yet admitted.
            released: admitted.saturating_sub(
                u64::from(state.slots()).saturating_sub(
                    totals
                        .get(Counter::HandedOut)
                        .saturating_sub(totals.get(Counter::HandedBack)),
                ),
            ),
            rejected: rejected_by_reason.total(),
            rejected_by_reason,
            listener_panics: self.inner.listeners.panics(),
            estimator_panics: self
                .inner
                .estimator_panics
                .load(unmodeled::Ordering::Relaxed),
            token_budget: limits.token_budget.map(|b| TokenBudgetStats {
                budget: b.budget,
                high_priority_reserve: b.high_priority_reserve,
                in_flight_tokens: state.tokens(),
                available: b.budget.saturating_sub(state.tokens()),
                total_reserved: totals.get(Counter::Reserved),
                total_consumed: totals.get(Counter::Consumed),
                total_refunded: totals
                    .get(Counter::Refunded)
                    .saturating_sub(totals.get(Counter::Reheld)),
                total_overrun: totals.get(Counter::Overrun),
            }),
        }
    }
}

/// The full epoch of the limits `word` was written under, from two loads of the published
/// epoch made just before (`before`) and just after (`seen`) the word was read; `None` if a
/// writer finished a change between them.
///
/// Writers advance the word's epoch bits and only then store the next epoch, so while the two
/// loads agree the word's epoch is `seen` or, if a writer is between its two steps, `seen + 1`;
/// the bits tell which. Nothing waits for that writer: its new slot was complete before it
/// advanced the bits.
#[inline]
fn word_epoch(before: u64, seen: u64, word: State) -> Option<u64> {
    if before != seen {
        None
    } else if word.matches_epoch(seen) {
        Some(seen)
    } else {
        debug_assert!(word.matches_epoch(seen + 1));
        Some(seen + 1)
    }
}

impl fmt::Debug for LlmBulkhead {
    /// Never blocks: reads the admission word and the published limits only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (state, limits) = self.inner.snapshot();
        let mut d = f.debug_struct("LlmBulkhead");
        d.field("model", &self.inner.model)
            .field("in_flight", &state.slots())
            .field("closed", &state.is_closed())
            .field("limits", &limits);
        if self.inner.has_budget {
            d.field("in_flight_tokens", &state.tokens());
        }
        d.finish_non_exhaustive()
    }
}

impl Inner {
    /// Turns a call's input into what it asks of the bulkhead.
    #[inline]
    pub(crate) fn resolve(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<Call, RequestError> {
        let priority = options.priority;
        if !self.has_budget {
            // No budget: nothing is estimated and an override is ignored.
            return Ok(Call {
                ask: Ask {
                    reserved: 0,
                    priority,
                },
                reservation: None,
                memo: None,
            });
        }
        let (reservation, memo) = match options.reservation {
            Some(r) => (r, None),
            None => {
                let estimate = self.estimator.estimate(request)?;
                (estimate.reservation()?, Some(estimate.memo()))
            }
        };
        Ok(Call {
            ask: Ask {
                reserved: reservation.reserved(),
                priority,
            },
            reservation: Some(reservation),
            memo,
        })
    }

    /// The queue timeout of a call: its own, else the bulkhead's default.
    pub(crate) fn timeout(&self, options: AcquireOptions) -> Option<Duration> {
        options.timeout.or(self.default_timeout)
    }

    /// Runs one decision against the current state and the limits in force, linearizably
    /// with `apply_limits` (see `crate::limits` for the protocol and why it is sound).
    ///
    /// `decide` answers `Ok((next, out))` to commit `next` with a CAS (re-deciding from the
    /// value a failed CAS returns), or `Err(out)` to commit nothing. A refusal is returned only
    /// if no limit change overlapped the reading of the limits. A commit is kept unless
    /// 2^`EPOCH_BITS` limit changes overlapped it (then the word's epoch bits cannot tell
    /// whether it used stale limits): such a commit is undone (`undo` restores the state it
    /// replaced, see [`undo_commit`](Inner::undo_commit)) and the decision starts over.
    /// `queue_locked` says whether the caller holds the queue lock.
    #[inline(always)]
    pub(crate) fn decide<T, U>(
        &self,
        queue_locked: bool,
        mut decide: impl FnMut(State, &Limits) -> Result<(State, T), U>,
    ) -> Result<T, U> {
        let backoff = Backoff::new();
        'start: loop {
            let mut before = self.published.epoch();
            let mut current = self.state.load();
            loop {
                let seen = self.published.epoch();
                let Some(epoch) = word_epoch(before, seen, current) else {
                    // A writer finished a change between the two loads: read again.
                    backoff.spin();
                    continue 'start;
                };
                let limits = self.published.read(epoch);
                match decide(current, &limits) {
                    Err(out) => {
                        // No later writer began overwriting the slot we read.
                        if self.published.epoch() <= epoch {
                            return Err(out);
                        }
                        continue 'start;
                    }
                    Ok((next, out)) => match self.state.compare_exchange(current, next) {
                        Ok(()) => {
                            let after = self.published.epoch();
                            // Fewer than 2^EPOCH_BITS - 1 later epochs published: the epoch
                            // bits cannot have wrapped back to ours, so no limit change
                            // landed between our read of the word and our CAS.
                            if (after as i64).wrapping_sub(epoch as i64) < (1 << EPOCH_BITS) - 1 {
                                return Ok(out);
                            }
                            self.undo_commit(current, next, queue_locked);
                            continue 'start;
                        }
                        Err(actual) => {
                            current = actual;
                            before = seen;
                            backoff.spin();
                        }
                    },
                }
            }
        }
    }

    /// Reverts a commit from `current` to `next` that [`decide`](Inner::decide) could not
    /// vouch for: takes back the slot and tokens it added and restores the queue flag it
    /// changed (only the queue, under its lock, changes that flag, and the queue's commits are
    /// made under that lock). Returning capacity is a release: it serves the drainers, and the
    /// queue unless the caller holds the queue lock (then it is the pump, or a newcomer that
    /// found the queue empty, and decides again itself).
    #[cold]
    fn undo_commit(&self, current: State, next: State, queue_locked: bool) {
        let added_slot = next.slots() != current.slots();
        let added_tokens = next.tokens() - current.tokens();
        let restore_waiters =
            (next.has_waiters() != current.has_waiters()).then_some(current.has_waiters());
        let after = self
            .state
            .update(|s| {
                let mut undone = if added_slot {
                    s.without_admission(added_tokens)
                } else {
                    s
                };
                if let Some(waiters) = restore_waiters {
                    undone = undone.with_waiters(waiters);
                }
                Ok::<_, Infallible>((undone, undone))
            })
            .unwrap_or_else(|never| match never {});
        if after.has_waiters() && !queue_locked {
            self.pump();
        }
        self.idle_check(after);
    }

    /// Admits `ask` now, as a newcomer, or says why not.
    #[inline]
    pub(crate) fn admit_now(&self, ask: Ask) -> Result<u64, (Refusal, State, Limits)> {
        self.decide(false, |s, limits| {
            match policy::admit(s, limits, ask, Turn::Newcomer) {
                Ok(next) => Ok((next, limits.revision)),
                Err(refusal) => Err((refusal, s, *limits)),
            }
        })
    }

    /// Admits `ask` now or refuses it, counting either outcome; never queues.
    #[inline]
    fn try_admit(&self, call: Call) -> Result<Grant, Rejection> {
        // Decision timing starts here: after estimation, before the decision.
        let timing = self.timing();
        match self.admit_now(call.ask) {
            Ok(revision) => {
                let grant = self.grant(call, revision);
                self.announce_admit(&grant, timing, None);
                Ok(grant)
            }
            Err((refusal, state, limits)) => {
                let rejection = self.reject(refusal.reason(), state, &limits, call.ask);
                self.announce_reject(&rejection, timing, None);
                Err(rejection)
            }
        }
    }

    /// Admits `call` now, refuses it, or queues it (to be woken as a blocked thread if
    /// `blocking`).
    pub(crate) fn begin(&self, call: Call, blocking: bool) -> Begun {
        match self.admit_now(call.ask) {
            Ok(revision) => Begun::Admitted(self.grant(call, revision)),
            Err((Refusal::NoSlot, state, limits)) => {
                // The limits alone can refuse without the queue lock; the queue length cannot.
                if let Err(reason) = policy::queue_or_refuse(&limits, 0) {
                    return Begun::Refused(self.reject(reason, state, &limits, call.ask));
                }
                match self.arrive(call, blocking) {
                    Arrival::Admitted { revision } => Begun::Admitted(self.grant(call, revision)),
                    Arrival::Queued(waiter) => Begun::Queued(waiter),
                    Arrival::Refused(rejection) => Begun::Refused(rejection),
                }
            }
            Err((refusal, state, limits)) => {
                Begun::Refused(self.reject(refusal.reason(), state, &limits, call.ask))
            }
        }
    }

    /// Counts an admission and mints its id.
    #[inline]
    pub(crate) fn grant(&self, call: Call, revision: u64) -> Grant {
        let id = local::with(&self.hub, |sink| sink.admit(call.ask.reserved));
        Grant::new(
            id,
            revision,
            call.ask.priority,
            call.reservation,
            call.memo,
            call.ask.reserved,
        )
    }

    /// Counts a refusal and builds its rejection. Inlined: refusing fast is a goal of its own,
    /// and inlining lets the rejection be built where the caller returns it.
    #[inline]
    pub(crate) fn reject(
        &self,
        reason: RejectReason,
        state: State,
        limits: &Limits,
        ask: Ask,
    ) -> Rejection {
        self.count(Counter::Rejected(reason), 1);
        Rejection::new(reason, policy::detail(state, limits, self.pending(), ask))
    }

    /// Bumps a counter in this thread's shard.
    pub(crate) fn count(&self, counter: Counter, by: u64) {
        local::with(&self.hub, |sink| sink.bump(counter, by));
    }

    /// A consistent (state, limits) pair, without a lock: the state at one moment and the
    /// limits in force at that moment.
    pub(crate) fn snapshot(&self) -> (State, Limits) {
        let backoff = Backoff::new();
        loop {
            let before = self.published.epoch();
            let state = self.state.load();
            let seen = self.published.epoch();
            if let Some(epoch) = word_epoch(before, seen, state) {
                let limits = self.published.read(epoch);
                if self.published.epoch() <= epoch {
                    return (state, limits);
                }
            }
            backoff.spin();
        }
    }

    /// Calls waiting in the queue.
    pub(crate) fn pending(&self) -> u64 {
        self.queue.len()
    }

    /// Publishes `next` and makes it current. The caller holds the writer lock (`current` is
    /// its guard's contents) and has validated `next`. Returns the replaced limits and the
    /// hand-offs the new limits allowed, which the caller wakes after releasing the lock.
    ///
    /// The hand-offs are made here, under the writer lock, so that once `apply_limits`
    /// returns every waiter the new limits admit has its slot (no later change can slip in
    /// between and decide for them under other limits).
    fn install(&self, current: &mut Limits, next: Limits) -> (Limits, HandedOff) {
        // Only writers move the epoch and we hold the writer lock, so it is stable here.
        let epoch = self.published.epoch();
        self.published.store(epoch + 1, &next);
        // The linearization point: admissions that read the word before this fail their CAS,
        // and those that read it after see the new epoch's bits (and so read the new slot).
        let after = self
            .state
            .update(|s| {
                debug_assert!(s.matches_epoch(epoch));
                let next = s.with_next_epoch();
                Ok::<_, Infallible>((next, next))
            })
            .unwrap_or_else(|never| match never {});
        self.published.set_epoch(epoch + 1);
        let previous = core::mem::replace(current, next);
        let handed_off = if after.has_waiters() {
            // Raised limits admit waiters at once, in order.
            self.hand_off()
        } else {
            HandedOff::default()
        };
        (previous, handed_off)
    }

    /// Returns `held` tokens and one slot, then serves the queue or the drainers if the word
    /// said someone waits for that.
    #[inline]
    pub(crate) fn release_capacity(&self, held: u64) {
        let before = self.state.release(held);
        if before.needs_attention_on_release() {
            self.after_release(before);
        }
    }

    #[cold]
    fn after_release(&self, before: State) {
        if before.has_waiters() {
            self.pump();
        } else if before.is_draining() && before.slots() == 1 {
            self.notify_drained();
        }
    }

    /// Wakes the drainers if `state` (just written) is idle and someone drains.
    pub(crate) fn idle_check(&self, state: State) {
        if state.is_idle() && state.is_draining() {
            self.notify_drained();
        }
    }

    #[cold]
    fn notify_drained(&self) {
        // Clear the flag first: a drainer that re-arms after the notification waits for the
        // next idle moment, and one that was armed sees the generation move.
        let _ = self.state.update(|s| {
            if s.is_draining() {
                Ok((s.with_draining(false), ()))
            } else {
                Err(())
            }
        });
        // Release: pairs with the drainers' Acquire loads of the generation.
        self.idle_generation.fetch_add(1, Ordering::Release);
        self.drained.notify(usize::MAX);
    }
}

/// What a call asks for, resolved once: its tokens and priority, the reservation behind them
/// and the estimator's memo (when the bulkhead's estimator sized it).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Call {
    pub(crate) ask: Ask,
    pub(crate) reservation: Option<Reservation>,
    pub(crate) memo: Option<Memo>,
}

/// How an acquire started.
#[derive(Debug)]
pub(crate) enum Begun {
    Admitted(Grant),
    Refused(Rejection),
    Queued(Arc<Waiter>),
}
