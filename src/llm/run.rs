//! `run`: acquire, call, settle, in one future that cannot leak its permit; with an optional
//! borrowed-slot deadline that cuts a call holding a slot it borrowed from the shared pool, and
//! observe mode's entry (`enter`: the advisory and race bypasses), which `run_shared` shares.

use crate::support::sync::unmodeled::{AtomicBool, Ordering};
use core::fmt;
use core::future::Future;
use core::ops::AsyncFnOnce;
use core::pin::pin;
use core::task::Poll;
use std::time::{Duration, Instant};

use crate::engine::timer::Sleep;
use crate::vocabulary::admission_class::{AbandonCause, AdmissionClass, Resources};
use crate::vocabulary::admission_id::{AdmissionId, ShadowId};
use crate::vocabulary::error::{AcquireError, RequestError};
use crate::vocabulary::rejection::{CapacityDetail, RejectReason, Rejection};
use crate::vocabulary::reservation::TokenUsage;
use crate::vocabulary::verdict::Verdict;

use super::acquire::Acquire;
use super::admission::Admission;
use super::bulkhead::LlmBulkhead;
use super::context::RunContext;
use super::observe::{Bypass, BypassCall};
use super::options::{RunOptions, ShadowReasons};
use super::permit::Permit;
use super::request::LlmRequest;
use super::shared::{Call, LlmCore};

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
#[non_exhaustive]
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
/// use async_bulkhead_llm::{classes::AdmissionClasses, classes::ClassLimits};
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

/// Says which way the call ended, with a refusal's reason code (`the bulkhead refused the
/// call: budget_limit`, what a log line of `{err}` shows); the bulkhead's own errors are then
/// the [`source`] (`std::error::Error::source`), with their details (a refusal's capacity
/// figures), so an error chain shows each once. A callback's error is shown here (`call
/// failed: ...`): `E` need not be an `Error` itself.
///
/// [`source`]: std::error::Error::source
impl<E: fmt::Display> fmt::Display for RunError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Rejected(rejection) => {
                write!(f, "the bulkhead refused the call: {}", rejection.reason())
            }
            RunError::Invalid(_) => f.write_str("invalid request"),
            RunError::Failed(error) => write!(f, "call failed: {error}"),
            RunError::BorrowedConcurrencyDeadline(_) => {
                f.write_str("the call was cut by its borrowed-slot deadline")
            }
        }
    }
}

/// An `Error` whenever the callback's error can be shown, so a `RunError` converts into
/// `Box<dyn Error + Send + Sync>` (tower's `BoxError`) with `?`.
///
/// # Examples
///
/// ```
/// use std::error::Error;
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest};
///
/// # ::futures::executor::block_on(async {
/// let bulkhead = LlmBulkhead::builder("m", 0).build()?;
/// let err = bulkhead
///     .run(&LlmRequest::new(), AcquireOptions::new(), async |_| Ok::<(), String>(()))
///     .await
///     .unwrap_err();
/// assert_eq!(err.to_string(), "the bulkhead refused the call: concurrency_limit");
/// let cause = err.source().expect("the rejection");
/// assert!(cause.to_string().starts_with("bulkhead rejected: concurrency_limit"));
/// let boxed: Box<dyn Error + Send + Sync> = err.into(); // e.g. tower's BoxError
/// # let _ = boxed;
/// # Ok::<(), Box<dyn Error>>(())
/// # }).unwrap();
/// ```
impl<E: fmt::Debug + fmt::Display> std::error::Error for RunError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RunError::Rejected(rejection) => Some(rejection),
            RunError::Invalid(error) => Some(error),
            RunError::Failed(_) => None,
            RunError::BorrowedConcurrencyDeadline(error) => Some(error),
        }
    }
}

impl LlmBulkhead {
    /// Acquires (waiting in the queue if allowed, as [`acquire`](LlmBulkhead::acquire)), runs
    /// `f` with the admission's [`RunContext`], and settles the admission when `f` finishes,
    /// on success or failure: with the last usage `f` reported through the context, else with
    /// no usage (the whole hold returns, booked as returned unreported). Use
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
        let run = async move {
            let call = prepared.map_err(RunError::Invalid)?;
            let acquire = Acquire::resolved(core, call, options.acquire, untimed(options.observe));
            match enter(core, call, options.observe, acquire).await? {
                Entered::Admitted(permit) => run_admitted(permit, deadline, usage, f).await,
                Entered::Bypassed(bypass) => {
                    let mut guard = BypassGuard::new(core, bypass);
                    let result = f(RunContext::bypassed(core, &mut guard.call)).await;
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
        };
        // The whole call, wait and callback, inside one span (its admission id recorded once
        // admitted): what the call's events and the callback's own log lines are recorded in.
        #[cfg(feature = "tracing")]
        let run = tracing::Instrument::instrument(
            run,
            tracing::debug_span!(
                target: "async_bulkhead_llm",
                "llm_bulkhead.run",
                model = core.model(),
                bulkhead = core.name(),
                tenant = core.tenant(),
                admission_id = tracing::field::Empty,
            ),
        );
        run
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
    #[cfg(feature = "tracing")]
    tracing::Span::current().record(
        "admission_id",
        tracing::field::display(permit.admission_id()),
    );
    let timer = cut_timer(deadline, permit.resources().borrowed_concurrency);
    let abandoned = AtomicBool::new(false);
    // The permit lives in this future: dropping the future settles it.
    let (core, admission) = permit.parts();
    // The callback's future is dropped at the end of this statement, before a cut call is
    // settled.
    let finished = until_cut(
        f(RunContext::admitted(core, admission, &abandoned)),
        timer,
        &abandoned,
    )
    .await;
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
pub(crate) enum Entered<P> {
    /// Admitted: its permit (borrowed for `run`, owned for `run_shared`).
    Admitted(P),
    Bypassed(BypassCall),
}

/// The admission of a `run` call, in observe mode when `observe` names the refusals to
/// bypass: an advisory check first (a predicted refusal is bypassed without being counted),
/// then the admission itself (a refusal for one of `observe` is counted, then bypassed as a
/// race). A bypass passes its hard check (`shutdown`) before it starts.
pub(crate) async fn enter<P, E>(
    core: &LlmCore,
    call: Call,
    observe: Option<ShadowReasons>,
    acquire: impl Future<Output = Result<P, AcquireError>>,
) -> Result<Entered<P>, RunError<E>> {
    let Some(reasons) = observe else {
        return Ok(Entered::Admitted(acquire.await?));
    };
    // The snapshot is built only for a refusal that is bypassed on the advice.
    let bypassed = |verdict| matches!(verdict, Verdict::Reject(r) if reasons.contains(r));
    let (verdict, detail) = core.engine().advise(call.ask(), bypassed);
    if let (Verdict::Reject(reason), Some(detail)) = (verdict, detail) {
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

/// The refusals of an acquire announced untimed: in observe mode, those it would bypass as a
/// race (counted and announced by the acquire, with no timing, as the original does).
pub(crate) fn untimed(observe: Option<ShadowReasons>) -> u8 {
    observe.map_or(0, ShadowReasons::bits)
}

/// Starts the bypass of `call`, refused for `reason`.
pub(crate) fn bypass<P, E>(
    core: &LlmCore,
    call: &Call,
    reason: RejectReason,
    detail: Option<CapacityDetail>,
    raced: bool,
) -> Result<Entered<P>, RunError<E>> {
    let bypass = Bypass {
        shadow_id: ShadowId::next(),
        reason,
        detail,
        raced,
        reservation: call.reservation(),
        limit_revision: detail.map_or_else(|| core.engine().revision(), |d| d.limit_revision),
        priority: call.ask().priority,
        class: call.class(),
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

/// The timer of a borrowed-slot deadline, started now: only for a call that borrowed its slot
/// (a deadline too far to represent never passes).
pub(crate) fn cut_timer(deadline: Option<Duration>, borrowed: bool) -> Option<Sleep> {
    deadline
        .filter(|_| borrowed)
        .and_then(|d| Sleep::after(Instant::now(), d))
}

/// Polls `call` until it finishes (`Some`) or `cut` passes while it still holds its borrowed
/// slot (`None`). After the callback gave its slot back itself, only `call` counts.
pub(crate) async fn until_cut<R>(
    call: impl Future<Output = R>,
    cut: Option<Sleep>,
    abandoned: &AtomicBool,
) -> Option<R> {
    let Some(mut sleep) = cut else {
        return Some(call.await);
    };
    let mut call = pin!(call);
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
