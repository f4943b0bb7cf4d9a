//! [`LlmBulkhead`]: the public face of the LLM wing. Every method is a thin call into the
//! [`LlmCore`] (which pairs the engine with the estimator and the listeners); the acquire
//! family lives in `acquire.rs` and `run` in `run.rs`.

use core::fmt;
use core::num::NonZeroU32;
use std::time::Duration;

use crate::engine::Ask;
use crate::engine::drain::{Drain, DrainTimeout};
use crate::engine::rate::RateStatus;
use crate::events::{ALL_KINDS, Event, EventKind, Subscription, Timing, kinds_mask};
use crate::stats::{DedupStats, Stats};
use crate::support::sync::Arc;
use crate::vocabulary::admission_class::AdmissionClass;
use crate::vocabulary::error::{AcquireError, ClassLookupError, LimitsError, RequestError};
use crate::vocabulary::limits::{ApplyOutcome, Limits};
use crate::vocabulary::rejection::CapacityDetail;
use crate::vocabulary::reservation::Reservation;
use crate::vocabulary::verdict::Verdict;

use super::admission::Admission;
use super::options::AcquireOptions;
use super::permit::{OwnedPermit, Permit};
use super::request::LlmRequest;
use super::shared::LlmCore;

/// Admission control for calls to one LLM: a hard cap on calls in flight and, optionally, on
/// tokens in flight, decided by one lock-free compare-and-swap per admission (of the admission
/// word, or of its class's word for a call within its class's floors; a class call beyond its
/// floors takes its class's lock for a few instructions, and a call that waits takes the
/// queue's: see the crate docs).
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
    pub(crate) core: Arc<LlmCore>,
}

impl LlmBulkhead {
    /// The model this bulkhead guards (the estimator's default model).
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::LlmBulkhead::builder("gpt-4o", 1).build()?;
    /// assert_eq!(bulkhead.model(), "gpt-4o");
    /// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
    /// ```
    pub fn model(&self) -> &str {
        self.core.model()
    }

    /// The name given with [`LlmBulkheadBuilder::name`](crate::LlmBulkheadBuilder::name)
    /// (empty if none).
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::LlmBulkhead::builder("m", 1).name("primary").build()?;
    /// assert_eq!(bulkhead.name(), "primary");
    /// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
    /// ```
    pub fn name(&self) -> &str {
        self.core.name()
    }

    /// The tenant given with [`LlmBulkheadBuilder::tenant`](crate::LlmBulkheadBuilder::tenant)
    /// (empty if none).
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::LlmBulkhead::builder("m", 1).tenant("acme").build()?;
    /// assert_eq!(bulkhead.tenant(), "acme");
    /// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
    /// ```
    pub fn tenant(&self) -> &str {
        self.core.tenant()
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
    #[inline(never)]
    pub fn try_acquire(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<Permit<'_>, AcquireError> {
        // Tested without deciding a sampling (`untimed`: then the call's timing is `None` for
        // sure), so that the fast lane carries no timing.
        if !self.core.untimed() {
            return self.try_acquire_timed(request, options);
        }
        if options.class.is_some() {
            return self.try_acquire_classed(request, options);
        }
        if let Ok(permit) = self
            .core
            .try_admit_fast(&options, |admission| Permit::new(&self.core, admission))
        {
            return Ok(permit);
        }
        self.try_acquire_general(request, options, None)
    }

    /// [`try_acquire`](LlmBulkhead::try_acquire) of a call that names its class, nobody timing
    /// it: the class lane (a call within its class's floors), else the general path. Its own
    /// door, out of line and small (in the general path, whose frame is the crate's largest,
    /// the class lane cost class calls about 50 instructions more, and inlined there it cost
    /// every refusal 5-6).
    #[inline(never)]
    fn try_acquire_classed(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<Permit<'_>, AcquireError> {
        if let Ok(permit) = self
            .core
            .try_admit_class_fast::<false, _>(&options, |admission| {
                Permit::new(&self.core, admission)
            })
        {
            return Ok(permit);
        }
        self.try_acquire_general(request, options, None)
    }

    /// [`try_acquire`](LlmBulkhead::try_acquire) while someone listens to decisions: the
    /// call's sampling decided, then the class door or the fast lane if nobody times the call
    /// after all (a sampled listener, the call not sampled), else the general path. Out of
    /// line, so that the fast lane of a bulkhead nobody listens to stays small.
    #[inline(never)]
    fn try_acquire_timed(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<Permit<'_>, AcquireError> {
        let timed = self.core.timed();
        if timed.is_none() {
            if options.class.is_some() {
                return self.try_acquire_classed(request, options);
            }
            if let Ok(permit) = self
                .core
                .try_admit_fast(&options, |admission| Permit::new(&self.core, admission))
            {
                return Ok(permit);
            }
        }
        self.try_acquire_general(request, options, timed)
    }

    /// [`try_acquire`](LlmBulkhead::try_acquire) beyond its fast lane: a call of the default
    /// class (which names none) within its class's floors on the class lane, a call on a
    /// bulkhead with rate windows on the windowed lane, everything else (estimation, classes
    /// beyond their floors, timed decisions, refusals) on the general path. Out of line, so
    /// that the fast lane stays small. `timed`: the call's sampling, decided by the caller
    /// (see `LlmCore::timed`); its timing starts here.
    #[inline(never)]
    fn try_acquire_general(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
        timed: Option<bool>,
    ) -> Result<Permit<'_>, AcquireError> {
        let timing = timed.map(Timing::start);
        // The class lane's admission out of line (`OUTLINED`): inlined here, it cost every
        // refusal 5-6 instructions.
        if timing.is_none()
            && let Ok(permit) = self
                .core
                .try_admit_class_fast::<true, _>(&options, |admission| {
                    Permit::new(&self.core, admission)
                })
        {
            return Ok(permit);
        }
        if timing.is_none()
            && let Some((grant, ledger)) = self.core.windowed_admission(&options)
        {
            return Ok(Permit::new(&self.core, Admission::new(grant, ledger)));
        }
        let call = self.core.resolve(request, options)?;
        self.core
            .try_admit(call, timing, |admission| Permit::new(&self.core, admission))
    }

    /// [`try_acquire_owned`](LlmBulkhead::try_acquire_owned) beyond its fast lane: the
    /// windowed lane, the class lane, else the general path. `timed` as for
    /// `try_acquire_general`.
    #[inline(never)]
    fn try_acquire_owned_general(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
        timed: Option<bool>,
    ) -> Result<OwnedPermit, AcquireError> {
        let timing = timed.map(Timing::start);
        let permit = |admission| OwnedPermit::new(Arc::clone(&self.core), admission);
        // The windowed lane, else the class lane (`LlmCore::class_admission`), chosen by the
        // flag the windowed lane tests anyway: the windowed calls pay nothing for the class
        // lane (tested after the windowed lane, it cost them 3).
        if timing.is_none() {
            let lane = if self.core.engine().has_window_lane() {
                self.core
                    .windowed_admission(&options)
                    .map(|(grant, ledger)| Admission::new(grant, ledger))
            } else {
                self.core.class_admission::<true>(&options)
            };
            if let Some(admission) = lane {
                return Ok(permit(admission));
            }
        }
        let call = self.core.resolve(request, options)?;
        self.core.try_admit(call, timing, permit)
    }

    /// [`try_acquire_timed`](LlmBulkhead::try_acquire_timed) of the owned door.
    #[inline(never)]
    fn try_acquire_owned_timed(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<OwnedPermit, AcquireError> {
        let timed = self.core.timed();
        if timed.is_none() {
            if options.class.is_some() {
                return self.try_acquire_owned_classed(request, options);
            }
            if let Ok(permit) = self.core.try_admit_fast(&options, |admission| {
                OwnedPermit::new(Arc::clone(&self.core), admission)
            }) {
                return Ok(permit);
            }
        }
        self.try_acquire_owned_general(request, options, timed)
    }

    /// [`try_acquire_classed`](LlmBulkhead::try_acquire_classed) of the owned door.
    #[inline(never)]
    fn try_acquire_owned_classed(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<OwnedPermit, AcquireError> {
        if let Some(admission) = self.core.class_admission::<false>(&options) {
            return Ok(OwnedPermit::new(Arc::clone(&self.core), admission));
        }
        self.try_acquire_owned_general(request, options, None)
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
    pub fn try_acquire_owned(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<OwnedPermit, AcquireError> {
        // As `try_acquire`: the fast lane, then the rest out of line.
        if !self.core.untimed() {
            return self.try_acquire_owned_timed(request, options);
        }
        if options.class.is_some() {
            return self.try_acquire_owned_classed(request, options);
        }
        if let Ok(permit) = self.core.try_admit_fast(&options, |admission| {
            OwnedPermit::new(Arc::clone(&self.core), admission)
        }) {
            return Ok(permit);
        }
        self.try_acquire_owned_general(request, options, None)
    }

    /// The reservation an admission of `request` would make, without reserving anything:
    /// `None` when the bulkhead has no token budget. Passing the result back with
    /// [`AcquireOptions::reservation`] admits exactly this reservation.
    ///
    /// # Errors
    ///
    /// [`RequestError`](crate::request::RequestError) when the estimate cannot be represented.
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
        if self.core.engine().has_budget() {
            Ok(Some(
                self.core.estimator().estimate(request)?.reservation()?,
            ))
        } else {
            Ok(None)
        }
    }

    /// The handle of admission class `id`, to pass to [`AcquireOptions::class`]. Resolve a
    /// name once (at startup, or per tenant) and keep the handle: it is `Copy`, and a call
    /// carrying it is not looked up again.
    ///
    /// # Errors
    ///
    /// [`ClassLookupError::NotConfigured`](crate::classes::ClassLookupError::NotConfigured) on a bulkhead without admission classes,
    /// [`ClassLookupError::Unknown`](crate::classes::ClassLookupError::Unknown) for an id that is not one of its classes. Nothing changes.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{classes::AdmissionClasses, classes::ClassLimits, classes::ClassLookupError, LlmBulkhead};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 8)
    ///     .admission_classes(
    ///         AdmissionClasses::new("standard")
    ///             .class("premium", ClassLimits::new().protected_concurrent(4))
    ///             .class("standard", ClassLimits::new()),
    ///     )
    ///     .build()?;
    /// let premium = bulkhead.class("premium")?;
    /// assert_eq!((premium.id(), premium.index()), ("premium", 0));
    /// assert!(matches!(bulkhead.class("gold"), Err(ClassLookupError::Unknown { .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn class(&self, id: &str) -> Result<AdmissionClass, ClassLookupError> {
        let classes = self
            .core
            .engine()
            .classes()
            .ok_or(ClassLookupError::NotConfigured)?;
        classes
            .handles()
            .iter()
            .copied()
            .find(|class| class.id() == id)
            .ok_or_else(|| ClassLookupError::Unknown {
                class: id.to_owned(),
            })
    }

    /// The admission classes, in configured order (empty without classes).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{classes::AdmissionClasses, classes::ClassLimits, LlmBulkhead};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 8)
    ///     .admission_classes(
    ///         AdmissionClasses::new("b").class("a", ClassLimits::new()).class("b", ClassLimits::new()),
    ///     )
    ///     .build()?;
    /// let ids: Vec<&str> = bulkhead.classes().iter().map(|c| c.id()).collect();
    /// assert_eq!(ids, ["a", "b"]);
    /// assert_eq!(bulkhead.default_class().map(|c| c.id()), Some("b"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn classes(&self) -> &[AdmissionClass] {
        self.core
            .engine()
            .classes()
            .map_or(&[], |classes| classes.handles())
    }

    /// The class of calls that name none (`None` without admission classes).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::LlmBulkhead;
    ///
    /// assert_eq!(LlmBulkhead::builder("m", 1).build()?.default_class(), None);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn default_class(&self) -> Option<AdmissionClass> {
        self.core
            .engine()
            .classes()
            .map(|classes| classes.default_class())
    }

    /// Whether `request` would be admitted now, without reserving anything or counting
    /// anything (its rate windows are read, not charged). A closed bulkhead answers `shutdown`
    /// first; then the rate windows (`rate_limit`), then the limits in flight, as an
    /// admission judges them.
    ///
    /// # Errors
    ///
    /// [`RequestError`](crate::request::RequestError) when the estimate cannot be represented (checked before anything else).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, admission::Verdict};
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
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget, admission::Verdict};
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
        let ask: Ask = self.core.resolve(request, options)?.ask();
        let (verdict, detail) = self.core.engine().advise(ask, |_| true);
        Ok((verdict, detail.expect("asked for every verdict's detail")))
    }

    /// Its rate windows now (what each would let through at once, and when it is whole
    /// again), `None` without rate limits. One read of the clock and of each window.
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::LlmBulkhead::builder("m", 4).build()?;
    /// assert!(bulkhead.rate_status().is_none());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn rate_status(&self) -> Option<RateStatus> {
        self.core.engine().rate_status()
    }

    /// Its admission class `class`'s rate windows now ([`ClassLimits::rate`](crate::classes::ClassLimits::rate)),
    /// `None` when that class has no rate limits (or the bulkhead has no classes).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest};
    /// use async_bulkhead_llm::classes::{AdmissionClasses, ClassLimits};
    /// use async_bulkhead_llm::rate::RateLimits;
    ///
    /// let batch = ClassLimits::new().rate(RateLimits::per_minute().requests(100));
    /// let bulkhead = LlmBulkhead::builder("m", 8)
    ///     .admission_classes(
    ///         AdmissionClasses::new("chat").class("chat", ClassLimits::new()).class("batch", batch),
    ///     )
    ///     .build()?;
    /// let (chat, batch) = (bulkhead.class("chat").unwrap(), bulkhead.class("batch").unwrap());
    /// drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new().class(batch))?);
    /// assert_eq!(bulkhead.class_rate_status(batch).unwrap().requests.unwrap().remaining, 99);
    /// assert!(bulkhead.class_rate_status(chat).is_none());
    /// assert!(bulkhead.rate_status().is_none()); // no windows of its own
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn class_rate_status(&self, class: AdmissionClass) -> Option<RateStatus> {
        self.core.engine().class_rate_status(class)
    }

    /// What a normal-priority call of the default class asking for nothing would be decided on
    /// now: calls and tokens
    /// in flight against the limits, the queue, the budget such a call may use. One read of the
    /// admission word and the limits (no counters summed, unlike [`stats`](LlmBulkhead::stats)),
    /// for headers that tell a client how much room is left (the tower layer's
    /// [`rate_limit_headers`](crate::tower::LlmLayer::rate_limit_headers)).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, TokenBudget};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 3).token_budget(TokenBudget::new(900)).build()?;
    /// let _held = bulkhead.try_acquire(&LlmRequest::new().max_tokens(100), AcquireOptions::new())?;
    /// let capacity = bulkhead.capacity();
    /// assert_eq!((capacity.in_flight, capacity.max_concurrent), (1, 3));
    /// assert_eq!(capacity.token_budget.unwrap().available, 800);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn capacity(&self) -> CapacityDetail {
        let ask = Ask {
            reserved: 0,
            priority: crate::vocabulary::priority::Priority::Normal,
            class: self
                .core
                .engine()
                .classes()
                .map(|classes| classes.default_class()),
        };
        let (_, detail) = self.core.engine().advise(ask, |_| true);
        detail.expect("asked for every verdict's detail")
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
    /// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
    /// ```
    pub fn limits(&self) -> Limits {
        self.core.engine().limits()
    }

    /// Installs a new limits snapshot atomically, if its revision is newer.
    ///
    /// - A revision not greater than the current one returns [`ApplyOutcome::Stale`](crate::limits::ApplyOutcome::Stale) without
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
    /// [`LimitsError`](crate::limits::LimitsError) when the revision exceeds 2^53 - 1 (checked first), `max_concurrent`
    /// exceeds [`MAX_CONCURRENT`](crate::limits::MAX_CONCURRENT), the budget exceeds
    /// [`MAX_BUDGET`](crate::limits::MAX_BUDGET), or the token budget's presence does not match the
    /// construction.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, limits::ApplyOutcome, Limits, LlmBulkhead, LlmRequest};
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
        let outcome = self.core.engine().apply_limits(next)?;
        if let ApplyOutcome::Applied { previous, current } = &outcome {
            self.core.announce_reconfigure(previous, current);
        }
        Ok(outcome)
    }

    /// Changes only the token budget, at the next revision, keeping everything else (the
    /// high-priority reserve included). Lowering it below the tokens in flight is allowed
    /// (shrink by attrition). Returns the limits now in force.
    ///
    /// # Errors
    ///
    /// [`LimitsError::TokenBudgetNotConfigured`](crate::limits::LimitsError::TokenBudgetNotConfigured) without a token budget,
    /// [`LimitsError::RevisionExhausted`](crate::limits::LimitsError::RevisionExhausted) when the revision is already 2^53 - 1, and
    /// [`LimitsError::BudgetTooLarge`](crate::limits::LimitsError::BudgetTooLarge) above [`MAX_BUDGET`](crate::limits::MAX_BUDGET).
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
        let (previous, current) = self.core.engine().set_budget(tokens)?;
        self.core.announce_reconfigure(&previous, &current);
        Ok(current)
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
        self.core.engine().close()
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
    /// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
    /// ```
    pub fn is_closed(&self) -> bool {
        self.core.engine().is_closed()
    }

    /// Calls `listener` with every lifecycle event until the returned [`Subscription`](crate::events::Subscription) is
    /// dropped.
    ///
    /// Listeners are called synchronously, on the thread where the event happens, in
    /// registration order, and never while the bulkhead holds a lock of its own: a listener may
    /// call `stats()`, `apply_limits()` or even acquire. A panicking listener is caught and
    /// counted in [`Stats::listener_panics`]; the other listeners and the operation carry on.
    /// The outcome of a call that waited in the queue is delivered where its acquire is polled
    /// (or dropped), to the listeners subscribed then, including those that subscribed while it
    /// waited. With no listener an event costs one relaxed atomic load: no allocation, no
    /// clock read. What unsubscribing guarantees is on [`Subscription`](crate::events::Subscription).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use async_bulkhead_llm::{events::Event, LlmBulkhead, Limits};
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
        Subscription::new(self.core.listeners(), ALL_KINDS, Box::new(listener))
    }

    /// Like [`on`](LlmBulkhead::on), for the given kinds only: other kinds cost nothing.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use async_bulkhead_llm::{AcquireOptions, events::Event, events::EventKind, LlmBulkhead, LlmRequest};
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
        Subscription::new(self.core.listeners(), kinds_mask(kinds), Box::new(listener))
    }

    /// Like [`on_events`](LlmBulkhead::on_events), for a sample of the calls: the listener
    /// hears one call in `every` on each thread, and every call that waited in the queue; for a
    /// sampled call, all of its events among `kinds` (its admit or reject, usage, abandonment
    /// and release). Events that are not about one call (reconfigure, bypass, deduplication)
    /// it hears every time. This is how a listener that times every call (a histogram of
    /// decision or hold times) stays cheap: the calls it does not hear cost a thread-local
    /// countdown, no clock read and no delivery. Several sampled subscriptions on one bulkhead
    /// share one rate, the highest asked for (the smallest `every`).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use async_bulkhead_llm::{AcquireOptions, events::EventKind, LlmBulkhead, LlmRequest};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 4).build()?;
    /// let heard = Arc::new(AtomicU64::new(0));
    /// let count = heard.clone();
    /// let every = NonZeroU32::new(10).unwrap();
    /// let _subscription = bulkhead.on_events_sampled([EventKind::Admit, EventKind::Release], every, move |_| {
    ///     count.fetch_add(1, Ordering::Relaxed);
    /// });
    /// for _ in 0..100 {
    ///     drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?);
    /// }
    /// // One call in ten on this thread: 10 admit and 10 release events.
    /// assert_eq!(heard.load(Ordering::Relaxed), 20);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn on_events_sampled(
        &self,
        kinds: impl IntoIterator<Item = EventKind>,
        every: NonZeroU32,
        listener: impl Fn(&Event<'_>) + Send + Sync + 'static,
    ) -> Subscription {
        Subscription::sampled(
            self.core.listeners(),
            kinds_mask(kinds),
            every,
            Box::new(listener),
        )
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
        let mut stats = Stats::new(
            self.core.engine().figures(),
            self.core.listeners().panics(),
            self.core.estimator_panics(),
        );
        stats.deduplication = self.core.dedup().map(|dedup| {
            let (active, hits, key_panics) = dedup.figures();
            DedupStats {
                active,
                hits,
                key_panics,
            }
        });
        stats.observe = self.core.observe_counters().stats();
        stats
    }

    /// Resolves once nothing is in flight and nothing is queued, whatever made it so (releases,
    /// queue timeouts, cancellations, refusals, `close`).
    ///
    /// It does not stop admission: combine it with [`close`](LlmBulkhead::close) for a graceful
    /// shutdown. Resolves at once when the bulkhead is already idle.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropping the future only stops waiting.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest};
    ///
    /// # futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("m", 4).build()?;
    /// let permit = bulkhead.acquire_owned(&LlmRequest::new(), AcquireOptions::new()).await?;
    /// let worker = std::thread::spawn(move || {
    ///     std::thread::sleep(std::time::Duration::from_millis(20));
    ///     drop(permit);
    /// });
    /// bulkhead.close(); // stop admitting...
    /// bulkhead.drain().await; // ...and wait for the call in flight
    /// assert_eq!(bulkhead.stats().in_flight, 0);
    /// worker.join().unwrap();
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn drain(&self) -> Drain<'_> {
        self.core.engine().drain()
    }

    /// Like [`drain`](LlmBulkhead::drain), but gives up at `timeout` and reports what was
    /// still in flight and queued. The deadline cancels nothing and changes no accounting.
    /// With a zero timeout it answers "is it idle right now?".
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropping the future only stops waiting.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest};
    ///
    /// # futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("m", 4).build()?;
    /// let stuck = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// let report = bulkhead.drain_timeout(Duration::from_millis(10)).await;
    /// assert!(!report.drained);
    /// assert_eq!((report.in_flight, report.pending), (1, 0));
    /// drop(stuck); // the deadline cancelled nothing: the call still releases normally
    /// assert!(bulkhead.drain_timeout(Duration::ZERO).await.drained);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn drain_timeout(&self, timeout: Duration) -> DrainTimeout<'_> {
        self.core.engine().drain().within(timeout)
    }
}

impl fmt::Debug for LlmBulkhead {
    /// Never blocks: reads the admission word and the published limits only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlmBulkhead")
            .field("model", &self.core.model())
            .field("engine", self.core.engine())
            .finish_non_exhaustive()
    }
}

impl OwnedPermit {
    /// The bulkhead this permit was admitted by (a handle sharing its state), for code that
    /// got the permit alone, e.g. a response body that reports usage and wants `stats()`
    /// (as [`OwnedBulkheadPermit::bulkhead`](crate::bulkhead::OwnedBulkheadPermit::bulkhead)).
    ///
    /// There is no `forget`: a permit that never returned its slot and tokens would shrink
    /// the bulkhead for good behind the control plane's back. To lower capacity, apply new
    /// limits ([`LlmBulkhead::apply_limits`](crate::LlmBulkhead::apply_limits)).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest};
    ///
    /// let permit = LlmBulkhead::builder("m", 2)
    ///     .build()?
    ///     .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())?;
    /// // The builder's bulkhead is gone; the permit still knows it.
    /// assert_eq!(permit.bulkhead().stats().in_flight, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn bulkhead(&self) -> LlmBulkhead {
        LlmBulkhead {
            core: Arc::clone(self.shared_core()),
        }
    }
}
