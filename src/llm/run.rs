//! `run`: acquire, call, settle, in one future that cannot leak its permit; with an optional
//! borrowed-slot deadline that cuts a call holding a slot it borrowed from the shared pool.

use core::fmt;
use core::future::Future;
use core::ops::AsyncFnOnce;
use core::pin::pin;
use core::task::Poll;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::admission_class::{AbandonCause, AdmissionClass, Resources};
use crate::admission_id::{AdmissionId, ShadowId};
use crate::engine::policy::Verdict;
use crate::engine::timer::Sleep;
use crate::error::{AcquireError, RequestError, UsageError};
use crate::priority::Priority;
use crate::rejection::{CapacityDetail, RejectReason, Rejection};
use crate::reservation::{Progressive, Reservation, TokenUsage, UsageReport};

use super::acquire::Acquire;
use super::admission::Admission;
use super::bulkhead::LlmBulkhead;
use super::core::{Call, LlmCore};
use super::observe::{Bypass, BypassCall};
use super::options::{RunOptions, ShadowReasons};
use super::permit::Permit;
use super::request::LlmRequest;

/// What a [`run`](LlmBulkhead::run) callback knows about its call, and how it reports usage:
/// its admission (id, limit revision, priority, class, reservation, hold, usage so far) or,
/// for an observe-mode call the bulkhead refused, its [`Bypass`]. It cannot release: `run`
/// settles when the callback finishes.
///
/// A [`run_shared`](LlmBulkhead::run_shared) callback gets a `RunContext<'static>`, which it
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
    Shared(std::sync::Arc<SharedCall>),
}

/// The state of a `run_shared` call, shared by its context and the future that settles it.
pub(crate) struct SharedCall {
    core: crate::sync::Arc<LlmCore>,
    state: std::sync::Mutex<CallState>,
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
        core: crate::sync::Arc<LlmCore>,
        state: CallState,
    ) -> std::sync::Arc<SharedCall> {
        std::sync::Arc::new(SharedCall {
            core,
            state: std::sync::Mutex::new(state),
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
            &mut *crate::sync::unmodeled::lock(&self.state),
            CallState::Settled,
        )
    }

    /// Runs `f` on the call's admission, if it holds one.
    pub(crate) fn with_admission<R>(
        &self,
        f: impl FnOnce(&LlmCore, &mut Admission) -> R,
    ) -> Option<R> {
        match &mut *crate::sync::unmodeled::lock(&self.state) {
            CallState::Admitted(admission) => Some(f(&self.core, admission)),
            _ => None,
        }
    }

    pub(crate) fn core(&self) -> &LlmCore {
        &self.core
    }
}

impl<'a> RunContext<'a> {
    pub(crate) fn shared(call: std::sync::Arc<SharedCall>) -> RunContext<'static> {
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
                let mut state = crate::sync::unmodeled::lock(&shared.state);
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
            Inner::Shared(shared) => match &*crate::sync::unmodeled::lock(&shared.state) {
                CallState::Admitted(admission) => admitted(admission),
                CallState::Bypassed(call) => bypassed(call),
                CallState::Settled => settled,
            },
        }
    }

    /// Reports the call's cumulative usage so far; see [`Permit::report_usage`](crate::Permit::report_usage).
    /// A bypassed call's report is validated and clamped the same way, holds nothing, and is
    /// announced with a [`BypassUsageEvent`](crate::BypassUsageEvent).
    ///
    /// # Errors
    ///
    /// As for [`Permit::report_usage`](crate::Permit::report_usage); nothing changes.
    /// [`UsageError::Settled`] from a `run_shared` context kept after its call was settled.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
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

    /// What the call borrowed from the shared pool (see [`Admission::resources`]);
    /// [`Resources::NONE`] for a bypassed call.
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

/// Why a [`run`](LlmBulkhead::run) did not return the callback's value.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, RunError};
///
/// # ::futures::executor::block_on(async {
/// let bulkhead = LlmBulkhead::builder("m", 0).build()?;
/// let err = bulkhead
///     .run(&LlmRequest::new(), AcquireOptions::new(), async |_| Ok::<(), std::io::Error>(()))
///     .await
///     .unwrap_err();
/// assert!(matches!(err, RunError::Rejected(r) if r.reason() == RejectReason::ConcurrencyLimit));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunError<E> {
    /// The bulkhead refused the call; the callback never ran.
    Rejected(Rejection),
    /// The call's input was invalid; the callback never ran.
    Invalid(RequestError),
    /// The callback ran and failed with this error (its admission was settled).
    Failed(E),
    /// The callback held a borrowed slot past the run's borrowed-slot deadline: its slot was
    /// given back, its future dropped and its tokens settled with the last usage it reported.
    BorrowedConcurrencyDeadline(BorrowedConcurrencyDeadlineError),
}

/// A [`run`](LlmBulkhead::run) was cut by its borrowed-slot deadline
/// ([`RunOptions::borrowed_concurrency_deadline`]).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use async_bulkhead_llm::*;
///
/// # ::futures::executor::block_on(async {
/// let bulkhead = LlmBulkhead::builder("m", 2)
///     .admission_classes(AdmissionClasses::new("batch").class("batch", ClassLimits::new()))
///     .build()?;
/// let options = AcquireOptions::new().borrowed_concurrency_deadline(Duration::from_millis(10));
/// let err = bulkhead
///     .run(&LlmRequest::new(), options, async |_| {
///         ::futures::future::pending::<Result<(), std::io::Error>>().await // a call that hangs
///     })
///     .await
///     .unwrap_err();
/// let RunError::BorrowedConcurrencyDeadline(cut) = err else { panic!("{err}") };
/// assert_eq!(cut.deadline, Duration::from_millis(10));
/// assert_eq!(cut.class.map(|c| c.id()), Some("batch"));
/// assert!(cut.resources.borrowed_concurrency);
/// assert_eq!(bulkhead.stats().in_flight, 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BorrowedConcurrencyDeadlineError {
    /// The deadline that passed.
    pub deadline: Duration,
    /// The admission that was cut.
    pub admission_id: AdmissionId,
    /// What it borrowed when it was admitted.
    pub resources: Resources,
    /// Its admission class.
    pub class: Option<AdmissionClass>,
}

impl fmt::Display for BorrowedConcurrencyDeadlineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "borrowed concurrency deadline of {:?} exceeded by admission {}",
            self.deadline, self.admission_id
        )?;
        if let Some(class) = self.class {
            write!(f, " (admission class {:?})", class.id())?;
        }
        Ok(())
    }
}

impl std::error::Error for BorrowedConcurrencyDeadlineError {}

impl<E> RunError<E> {
    /// The rejection, when the bulkhead refused the call.
    ///
    /// # Examples
    ///
    /// ```
    /// let err: async_bulkhead_llm::RunError<()> = async_bulkhead_llm::RunError::Failed(());
    /// assert!(err.rejection().is_none());
    /// ```
    pub fn rejection(&self) -> Option<&Rejection> {
        match self {
            RunError::Rejected(rejection) => Some(rejection),
            _ => None,
        }
    }
}

impl<E> From<AcquireError> for RunError<E> {
    fn from(error: AcquireError) -> RunError<E> {
        match error {
            AcquireError::Rejected(rejection) => RunError::Rejected(rejection),
            AcquireError::Invalid(error) => RunError::Invalid(error),
        }
    }
}

impl<E: fmt::Display> fmt::Display for RunError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Rejected(rejection) => rejection.fmt(f),
            RunError::Invalid(error) => write!(f, "invalid request: {error}"),
            RunError::Failed(error) => write!(f, "call failed: {error}"),
            RunError::BorrowedConcurrencyDeadline(error) => error.fmt(f),
        }
    }
}

// `Display` already shows the inner error, so `source` stays `None` (no duplicated messages).
impl<E: std::error::Error> std::error::Error for RunError<E> {}

impl LlmBulkhead {
    /// Acquires (waiting in the queue if allowed, as [`acquire`](LlmBulkhead::acquire)), runs
    /// `f` with the admission's [`RunContext`], and settles the admission when `f` finishes,
    /// on success or failure: with the last usage `f` reported through the context, else with
    /// no usage (the whole hold returns, nothing is booked). Use
    /// [`run_with_usage`](LlmBulkhead::run_with_usage) to settle with the usage in `f`'s result.
    ///
    /// # Errors
    ///
    /// [`RunError::Rejected`] / [`RunError::Invalid`] when the call was not admitted (the
    /// callback never ran), [`RunError::Failed`] with the callback's own error, and
    /// [`RunError::BorrowedConcurrencyDeadline`] when the options' borrowed-slot deadline cut
    /// the call (see [`RunOptions::borrowed_concurrency_deadline`]).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future while it waits leaves the queue (as dropping an
    /// [`Acquire`](crate::futures::Acquire)); dropping it while `f` runs drops `f`'s future and
    /// settles the admission at once.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RunError};
    ///
    /// # ::futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("gpt-4o", 4).build()?;
    /// let answer = bulkhead
    ///     .run(&LlmRequest::new().user("2+2?"), AcquireOptions::new(), async |_ctx| {
    ///         Ok::<_, std::io::Error>("4") // call the provider here
    ///     })
    ///     .await?;
    /// assert_eq!(answer, "4");
    ///
    /// let failed = bulkhead
    ///     .run(&LlmRequest::new(), AcquireOptions::new(), async |_| {
    ///         Err::<(), _>(std::io::Error::other("provider down"))
    ///     })
    ///     .await;
    /// assert!(matches!(failed, Err(RunError::Failed(_))));
    /// assert_eq!(bulkhead.stats().in_flight, 0); // settled either way
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn run<'a, T, E, F>(
        &'a self,
        request: &LlmRequest,
        options: impl Into<RunOptions>,
        f: F,
    ) -> impl Future<Output = Result<T, RunError<E>>> + 'a
    where
        F: for<'c> AsyncFnOnce(RunContext<'c>) -> Result<T, E> + 'a,
    {
        self.run_with_usage(request, options, |_: &T| None, f)
    }

    /// Like [`run`](LlmBulkhead::run), settling a successful call with the usage `usage`
    /// extracts from its result (`None`: the last usage reported through the context, if any).
    /// A failed call settles with the last reported usage, if any.
    ///
    /// # Errors
    ///
    /// As for [`run`](LlmBulkhead::run).
    ///
    /// # Cancel safety
    ///
    /// As for [`run`](LlmBulkhead::run).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget, TokenUsage};
    ///
    /// struct Reply { text: String, input_tokens: u64, output_tokens: u64 }
    ///
    /// # ::futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("m", 4).token_budget(TokenBudget::new(10_000)).build()?;
    /// let options = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
    /// let reply = bulkhead
    ///     .run_with_usage(
    ///         &LlmRequest::new(),
    ///         options,
    ///         |r: &Reply| TokenUsage::new(r.input_tokens, r.output_tokens).ok(),
    ///         async |_ctx| Ok::<_, std::io::Error>(Reply { text: "hi".into(), input_tokens: 90, output_tokens: 10 }),
    ///     )
    ///     .await?;
    /// assert_eq!(reply.text, "hi");
    /// let t = bulkhead.stats().token_budget.unwrap();
    /// assert_eq!((t.total_consumed, t.total_refunded), (100, 1000));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn run_with_usage<'a, T, E, F, U>(
        &'a self,
        request: &LlmRequest,
        options: impl Into<RunOptions>,
        usage: U,
        f: F,
    ) -> impl Future<Output = Result<T, RunError<E>>> + 'a
    where
        F: for<'c> AsyncFnOnce(RunContext<'c>) -> Result<T, E> + 'a,
        U: FnOnce(&T) -> Option<TokenUsage> + 'a,
    {
        let options = options.into();
        let deadline = options.borrowed_concurrency_deadline;
        // Checked first, even when the deadline would not apply; the call is resolved now
        // otherwise, so the future does not borrow the request.
        let prepared = if deadline == Some(Duration::ZERO) {
            Err(RequestError::ZeroBorrowedConcurrencyDeadline)
        } else {
            self.core.resolve(request, options.acquire)
        };
        let core = &*self.core;
        async move {
            let call = prepared.map_err(RunError::Invalid)?;
            let acquire = Acquire::resolved(core, call, options.acquire);
            match enter(core, call, options.observe, acquire).await? {
                Entered::Admitted(permit) => run_admitted(permit, deadline, usage, f).await,
                Entered::Bypassed(bypass) => {
                    let mut guard = BypassGuard::new(core, bypass);
                    let result = f(RunContext {
                        inner: Inner::Bypassed {
                            core,
                            call: &mut guard.call,
                        },
                    })
                    .await;
                    match result {
                        Ok(value) => {
                            guard.finish(usage(&value));
                            Ok(value)
                        }
                        Err(error) => {
                            guard.finish(None);
                            Err(RunError::Failed(error))
                        }
                    }
                }
            }
        }
    }
}

/// An admitted `run` call: the callback runs with the admission's context (cut by the
/// borrowed-slot deadline, if one applies) and the permit settles when it ends.
async fn run_admitted<T, E, F, U>(
    mut permit: Permit<'_>,
    deadline: Option<Duration>,
    usage: U,
    f: F,
) -> Result<T, RunError<E>>
where
    F: for<'c> AsyncFnOnce(RunContext<'c>) -> Result<T, E>,
    U: FnOnce(&T) -> Option<TokenUsage>,
{
    // The deadline applies only to a borrowed slot, from admission on (a deadline too far to
    // represent never passes).
    let cut_at = deadline
        .filter(|_| permit.resources().borrowed_concurrency)
        .and_then(|d| Instant::now().checked_add(d));
    let abandoned = AtomicBool::new(false);
    // The permit lives in this future: dropping the future settles it.
    let (core, admission) = permit.parts();
    let finished = {
        let call = f(RunContext {
            inner: Inner::Admitted {
                core,
                admission,
                abandoned: &abandoned,
            },
        });
        match cut_at {
            None => Some(call.await),
            Some(cut_at) => until_cut(call, cut_at, &abandoned).await,
        }
        // The callback's future is dropped here, before a cut call is settled.
    };
    match finished {
        Some(Ok(value)) => {
            let usage = usage(&value);
            permit.release(usage);
            Ok(value)
        }
        Some(Err(error)) => {
            permit.release(None);
            Err(RunError::Failed(error))
        }
        None => {
            let (core, admission) = permit.parts();
            let error = cut(core, admission, deadline.unwrap_or_default());
            // Its tokens settle now, with the last usage it reported.
            permit.release(None);
            Err(RunError::BorrowedConcurrencyDeadline(error))
        }
    }
}

/// Gives back the borrowed slot of a call its deadline cut, counted as abandoned for the
/// deadline unless the count of abandoned admissions is full (see
/// `abandon_borrowed_concurrency`: the release that follows returns the slot either way).
pub(crate) fn cut(
    core: &LlmCore,
    admission: &mut Admission,
    deadline: Duration,
) -> BorrowedConcurrencyDeadlineError {
    core.abandon(admission, AbandonCause::Deadline);
    BorrowedConcurrencyDeadlineError {
        deadline,
        admission_id: admission.admission_id(),
        resources: admission.resources(),
        class: admission.class(),
    }
}

/// How a `run` call got in: admitted, or (observe mode) bypassed.
pub(crate) enum Entered<'p> {
    Admitted(Permit<'p>),
    Bypassed(BypassCall),
}

/// The admission of a `run` call, in observe mode when `observe` names the refusals to
/// bypass: an advisory check first (a predicted refusal is bypassed without being counted),
/// then the admission itself (a refusal for one of `observe` is counted, then bypassed as a
/// race). A bypass passes its hard check (`shutdown`) before it starts.
pub(crate) async fn enter<'p, E>(
    core: &LlmCore,
    call: Call,
    observe: Option<ShadowReasons>,
    acquire: impl Future<Output = Result<Permit<'p>, AcquireError>>,
) -> Result<Entered<'p>, RunError<E>> {
    let Some(reasons) = observe else {
        return Ok(Entered::Admitted(acquire.await?));
    };
    let (verdict, detail) = core.engine().would_admit(call.ask);
    if let Verdict::Reject(reason) = verdict
        && reasons.contains(reason)
    {
        return bypass(core, &call, reason, Some(detail), false);
    }
    match acquire.await {
        Ok(permit) => Ok(Entered::Admitted(permit)),
        Err(AcquireError::Rejected(rejection)) if reasons.contains(rejection.reason()) => bypass(
            core,
            &call,
            rejection.reason(),
            Some(*rejection.detail()),
            verdict.is_admit(),
        ),
        Err(error) => Err(error.into()),
    }
}

/// Starts the bypass of `call`, refused for `reason`.
pub(crate) fn bypass<'p, E>(
    core: &LlmCore,
    call: &Call,
    reason: RejectReason,
    detail: Option<CapacityDetail>,
    raced: bool,
) -> Result<Entered<'p>, RunError<E>> {
    let bypass = Bypass {
        shadow_id: ShadowId::next(),
        reason,
        detail,
        raced,
        reservation: call.reservation,
        limit_revision: detail.map_or_else(|| core.engine().revision(), |d| d.limit_revision),
        priority: call.ask.priority,
        class: call.ask.class,
    };
    core.begin_bypass(bypass)
        .map(Entered::Bypassed)
        .map_err(RunError::Rejected)
}

/// A bypassed call of `run` while its callback runs: ends it (with the last reported usage)
/// if the future is dropped first.
struct BypassGuard<'a> {
    core: &'a LlmCore,
    call: BypassCall,
    finished: bool,
}

impl<'a> BypassGuard<'a> {
    fn new(core: &'a LlmCore, call: BypassCall) -> BypassGuard<'a> {
        BypassGuard {
            core,
            call,
            finished: false,
        }
    }

    fn finish(&mut self, usage: Option<TokenUsage>) {
        self.finished = true;
        self.core.finish_bypass(&self.call, usage);
    }
}

impl Drop for BypassGuard<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.core.finish_bypass(&self.call, None);
        }
    }
}

/// Polls `call` until it finishes (`Some`) or `cut_at` passes while it still holds its
/// borrowed slot (`None`). After the callback gave its slot back itself, only `call` counts.
pub(crate) async fn until_cut<R>(
    call: impl Future<Output = R>,
    cut_at: Instant,
    abandoned: &AtomicBool,
) -> Option<R> {
    let mut call = pin!(call);
    let mut sleep = Sleep::until(cut_at);
    core::future::poll_fn(|cx| {
        if let Poll::Ready(result) = call.as_mut().poll(cx) {
            return Poll::Ready(Some(result));
        }
        if abandoned.load(Ordering::Relaxed) {
            sleep.cancel();
            return Poll::Pending;
        }
        sleep.poll_elapsed(cx).map(|()| None)
    })
    .await
}
