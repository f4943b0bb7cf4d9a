//! [`RunContext`]: what a `run` callback knows about its call (its admission, or its
//! observe-mode bypass) and how it reports usage; borrowed by `run`'s callback, owned (over a
//! [`SharedCall`]) by `run_shared`'s.

use crate::support::sync::unmodeled;
use crate::support::sync::unmodeled::{AtomicBool, Ordering};
use core::fmt;

use crate::vocabulary::admission_class::{AbandonCause, AdmissionClass, Resources};
use crate::vocabulary::admission_id::AdmissionId;
use crate::vocabulary::error::UsageError;
use crate::vocabulary::priority::Priority;
use crate::vocabulary::reservation::{Progressive, Reservation, TokenUsage, UsageReport};

use super::admission::Admission;
use super::observe::{Bypass, BypassCall};
use super::shared::LlmCore;

/// What a [`run`](crate::LlmBulkhead::run) callback knows about its call, and how it reports usage:
/// its admission (id, limit revision, priority, class, reservation, hold, usage so far) or,
/// for an observe-mode call the bulkhead refused, its [`Bypass`](crate::observe::Bypass). It cannot release: `run`
/// settles when the callback finishes.
///
/// A [`run_shared`](crate::LlmBulkhead::run_shared) callback gets a `RunContext<'static>`, which it
/// may move into the future it returns.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Priority};
///
/// # ::futures::executor::block_on(async {
/// let bulkhead = LlmBulkhead::builder("m", 1).initial_revision(3).build()?;
/// let revision = bulkhead
///     .run(&LlmRequest::new(), AcquireOptions::new().priority(Priority::High), async |ctx| {
///         assert_eq!(ctx.priority(), Priority::High);
///         assert!(ctx.reservation().is_none()); // no token budget
///         assert!(ctx.bypass().is_none()); // admitted
///         Ok::<_, std::io::Error>(ctx.limit_revision())
///     })
///     .await?;
/// assert_eq!(revision, 3);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
pub struct RunContext<'a> {
    inner: Inner<'a>,
}

enum Inner<'a> {
    /// An admitted call of `run`.
    Admitted {
        core: &'a LlmCore,
        admission: &'a mut Admission,
        /// Set when the callback gave its borrowed slot back itself (the deadline then no
        /// longer applies).
        abandoned: &'a AtomicBool,
    },
    /// A bypassed call of `run`.
    Bypassed {
        core: &'a LlmCore,
        call: &'a mut BypassCall,
    },
    /// A call of `run_shared` (admitted or bypassed), owned.
    Shared(unmodeled::Arc<SharedCall>),
}

/// The state of a `run_shared` call, shared by its context and the future that settles it.
pub(crate) struct SharedCall {
    core: crate::support::sync::Arc<LlmCore>,
    state: unmodeled::Mutex<CallState>,
    abandoned: AtomicBool,
}

/// What a `run_shared` call holds.
pub(crate) enum CallState {
    Admitted(Admission),
    Bypassed(BypassCall),
    /// Settled: the callback finished, failed or was dropped.
    Settled,
}

/// A call as its context sees it.
enum View<'x> {
    Admitted(&'x mut Admission, &'x AtomicBool),
    Bypassed(&'x mut BypassCall),
    Settled,
}

impl SharedCall {
    pub(crate) fn new(
        core: crate::support::sync::Arc<LlmCore>,
        state: CallState,
    ) -> unmodeled::Arc<SharedCall> {
        unmodeled::Arc::new(SharedCall {
            core,
            state: unmodeled::Mutex::new(state),
            abandoned: AtomicBool::new(false),
        })
    }

    /// Whether the callback gave its borrowed slot back itself.
    pub(crate) fn abandoned(&self) -> &AtomicBool {
        &self.abandoned
    }

    /// Takes what the call holds, leaving it settled (so a context that outlives the call
    /// changes nothing).
    pub(crate) fn take(&self) -> CallState {
        core::mem::replace(
            &mut *crate::support::sync::unmodeled::lock(&self.state),
            CallState::Settled,
        )
    }

    /// Runs `f` on the call's admission, if it holds one.
    pub(crate) fn with_admission<R>(
        &self,
        f: impl FnOnce(&LlmCore, &mut Admission) -> R,
    ) -> Option<R> {
        match &mut *crate::support::sync::unmodeled::lock(&self.state) {
            CallState::Admitted(admission) => Some(f(&self.core, admission)),
            _ => None,
        }
    }

    pub(crate) fn core(&self) -> &LlmCore {
        &self.core
    }
}

impl<'a> RunContext<'a> {
    /// The context of an admitted `run` call.
    pub(crate) fn admitted(
        core: &'a LlmCore,
        admission: &'a mut Admission,
        abandoned: &'a AtomicBool,
    ) -> RunContext<'a> {
        RunContext {
            inner: Inner::Admitted {
                core,
                admission,
                abandoned,
            },
        }
    }

    /// The context of a bypassed `run` call.
    pub(crate) fn bypassed(core: &'a LlmCore, call: &'a mut BypassCall) -> RunContext<'a> {
        RunContext {
            inner: Inner::Bypassed { core, call },
        }
    }

    /// The context of a `run_shared` call.
    pub(crate) fn shared(call: unmodeled::Arc<SharedCall>) -> RunContext<'static> {
        RunContext {
            inner: Inner::Shared(call),
        }
    }

    /// Runs `f` on the call as it is now.
    fn with<R>(&mut self, f: impl FnOnce(&LlmCore, View<'_>) -> R) -> R {
        match &mut self.inner {
            Inner::Admitted {
                core,
                admission,
                abandoned,
            } => f(core, View::Admitted(admission, abandoned)),
            Inner::Bypassed { core, call } => f(core, View::Bypassed(call)),
            Inner::Shared(shared) => {
                let mut state = crate::support::sync::unmodeled::lock(&shared.state);
                let view = match &mut *state {
                    CallState::Admitted(admission) => View::Admitted(admission, &shared.abandoned),
                    CallState::Bypassed(call) => View::Bypassed(call),
                    CallState::Settled => View::Settled,
                };
                f(&shared.core, view)
            }
        }
    }

    /// Reads the call as it is now.
    fn read<R>(
        &self,
        admitted: impl FnOnce(&Admission) -> R,
        bypassed: impl FnOnce(&BypassCall) -> R,
        settled: R,
    ) -> R {
        match &self.inner {
            Inner::Admitted { admission, .. } => admitted(admission),
            Inner::Bypassed { call, .. } => bypassed(call),
            Inner::Shared(shared) => match &*crate::support::sync::unmodeled::lock(&shared.state) {
                CallState::Admitted(admission) => admitted(admission),
                CallState::Bypassed(call) => bypassed(call),
                CallState::Settled => settled,
            },
        }
    }

    /// Reports the call's cumulative usage so far; see [`Permit::report_usage`](crate::Permit::report_usage).
    /// A bypassed call's report is validated and clamped the same way, holds nothing, and is
    /// announced with a [`BypassUsageEvent`](crate::events::BypassUsageEvent).
    ///
    /// # Errors
    ///
    /// As for [`Permit::report_usage`](crate::Permit::report_usage); nothing changes.
    /// [`UsageError::Settled`](crate::usage::UsageError::Settled) from a `run_shared` context kept after its call was settled.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// # use async_bulkhead_llm::{usage::UsageError};
    /// # ::futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("m", 1).token_budget(TokenBudget::new(5000)).build()?;
    /// let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
    /// let held = bulkhead.run(&LlmRequest::new(), opts, async |mut ctx| {
    ///     // A streamed chunk carried the provider's running usage.
    ///     let report = ctx.report_usage(TokenUsage::new(20, 5)?)?;
    ///     Ok::<_, UsageError>(report.held)
    /// }).await?;
    /// assert_eq!(held, 1020);
    /// // Released with the last reported usage: 25 consumed, the rest of the hold refunded.
    /// let t = bulkhead.stats().token_budget.unwrap();
    /// assert_eq!((t.total_consumed, t.total_refunded, t.in_flight_tokens), (25, 1075, 0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn report_usage(&mut self, usage: TokenUsage) -> Result<UsageReport, UsageError> {
        self.report(usage, None)
    }

    /// Reports cumulative usage with a progressive reconciliation; see
    /// [`Permit::report_usage_progressive`](crate::Permit::report_usage_progressive).
    ///
    /// # Errors
    ///
    /// As for [`report_usage`](RunContext::report_usage).
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// # use async_bulkhead_llm::{usage::Progressive, usage::UsageError};
    /// # ::futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("m", 1).token_budget(TokenBudget::new(5000)).build()?;
    /// let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
    /// let held = bulkhead.run(&LlmRequest::new(), opts, async |mut ctx| {
    ///     let progress = Progressive::new(900).safety_margin(50);
    ///     Ok::<_, UsageError>(ctx.report_usage_progressive(TokenUsage::new(20, 100)?, progress)?.held)
    /// }).await?;
    /// assert_eq!(held, 950);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn report_usage_progressive(
        &mut self,
        usage: TokenUsage,
        progressive: Progressive,
    ) -> Result<UsageReport, UsageError> {
        self.report(usage, Some(progressive))
    }

    fn report(
        &mut self,
        usage: TokenUsage,
        progressive: Option<Progressive>,
    ) -> Result<UsageReport, UsageError> {
        self.with(|core, view| match view {
            View::Admitted(admission, _) => core.report(admission, usage, progressive),
            View::Bypassed(call) => core.report_bypass(call, usage, progressive),
            View::Settled => Err(UsageError::Settled),
        })
    }

    /// Gives the call's borrowed slot back now, keeping its tokens until `run` settles; see
    /// [`Permit::abandon_borrowed_concurrency`](crate::Permit::abandon_borrowed_concurrency).
    /// After it, a borrowed-slot deadline no longer applies to the call. A bypassed call holds
    /// no slot (`false`).
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// # use async_bulkhead_llm::{classes::AdmissionClasses, classes::ClassLimits};
    /// # ::futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("m", 1)
    ///     .admission_classes(AdmissionClasses::new("batch").class("batch", ClassLimits::new()))
    ///     .build()?;
    /// let gave_back = bulkhead.run(&LlmRequest::new(), AcquireOptions::new(), async |mut ctx| {
    ///     let gave_back = ctx.abandon_borrowed_concurrency();
    ///     assert!(!ctx.holds_slot());
    ///     Ok::<_, std::io::Error>(gave_back)
    /// }).await?;
    /// assert!(gave_back);
    /// assert_eq!(bulkhead.stats().borrowed_concurrency_abandoned_by_cause.manual, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn abandon_borrowed_concurrency(&mut self) -> bool {
        self.with(|core, view| match view {
            View::Admitted(admission, abandoned) => {
                let done = core.abandon(admission, AbandonCause::Manual);
                if done {
                    // Relaxed: read by the future that polls this call, which synchronizes
                    // with the callback through the call's own polling.
                    abandoned.store(true, Ordering::Relaxed);
                }
                done
            }
            View::Bypassed(_) | View::Settled => false,
        })
    }

    /// The observe-mode bypass this call runs as, or `None` when it was admitted.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::*;
    /// use async_bulkhead_llm::{observe::ShadowReasons};
    ///
    /// # ::futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("m", 0).build()?;
    /// let reason = bulkhead
    ///     .run(&LlmRequest::new(), AcquireOptions::new().observe(ShadowReasons::ALL), async |ctx| {
    ///         Ok::<_, std::io::Error>(ctx.bypass().map(|b| b.reason))
    ///     })
    ///     .await?;
    /// assert_eq!(reason, Some(RejectReason::ConcurrencyLimit));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn bypass(&self) -> Option<Bypass> {
        self.read(|_| None, |call| Some(call.bypass), None)
    }

    /// The admission's id, or `None` for a bypassed call (see [`bypass`](RunContext::bypass)
    /// for its shadow id) and for a settled `run_shared` call.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// # ::futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("m", 1).build()?;
    /// let id = bulkhead.run(&LlmRequest::new(), AcquireOptions::new(), async |ctx| {
    ///     Ok::<_, std::io::Error>(ctx.admission_id())
    /// }).await?;
    /// assert!(id.is_some());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn admission_id(&self) -> Option<AdmissionId> {
        self.read(|a| Some(a.admission_id()), |_| None, None)
    }

    /// Revision of the limits that admitted (or refused) the call.
    pub fn limit_revision(&self) -> u64 {
        self.read(|a| a.limit_revision(), |c| c.bypass.limit_revision, 0)
    }

    /// The call's priority.
    pub fn priority(&self) -> Priority {
        self.read(|a| a.priority(), |c| c.bypass.priority, Priority::Normal)
    }

    /// The call's admission class (with classes).
    pub fn class(&self) -> Option<AdmissionClass> {
        self.read(|a| a.class(), |c| c.bypass.class, None)
    }

    /// The reservation admitted (for a bypassed call: the one it would have held); `None`
    /// without a token budget.
    pub fn reservation(&self) -> Option<Reservation> {
        self.read(|a| a.reservation(), |c| c.bypass.reservation, None)
    }

    /// Tokens held against the budget now (0 for a bypassed call).
    pub fn held_tokens(&self) -> u64 {
        self.read(|a| a.held_tokens(), |_| 0, 0)
    }

    /// The cumulative usage reported so far.
    pub fn usage(&self) -> Option<TokenUsage> {
        self.read(|a| a.usage(), |c| c.reported, None)
    }

    /// Effective usage reports so far.
    pub fn usage_sequence(&self) -> u64 {
        self.read(|a| a.usage_sequence(), |c| c.sequence, 0)
    }

    /// What the call borrowed from the shared pool (see [`Admission::resources`](crate::admission::Admission::resources));
    /// [`Resources::NONE`](crate::classes::Resources::NONE) for a bypassed call.
    pub fn resources(&self) -> Resources {
        self.read(|a| a.resources(), |_| Resources::NONE, Resources::NONE)
    }

    /// Whether the call holds a slot now (`false` for a bypassed call, and once it abandoned
    /// its borrowed slot).
    pub fn holds_slot(&self) -> bool {
        self.read(|a| a.holds_slot(), |_| false, false)
    }
}

impl fmt::Debug for RunContext<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("RunContext");
        match self.bypass() {
            Some(bypass) => d.field("bypass", &bypass),
            None => d
                .field("admission_id", &self.admission_id())
                .field("limit_revision", &self.limit_revision())
                .field("priority", &self.priority())
                .field("class", &self.class())
                .field("reservation", &self.reservation())
                .field("held_tokens", &self.held_tokens())
                .field("usage", &self.usage()),
        };
        d.finish()
    }
}
