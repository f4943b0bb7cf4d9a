//! `run`: acquire, call, settle, in one future that cannot leak its permit; with an optional
//! borrowed-slot deadline that cuts a call holding a slot it borrowed from the shared pool.

use core::fmt;
use core::future::Future;
use core::ops::{AsyncFnOnce, Deref};
use core::pin::pin;
use core::task::Poll;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::admission_class::{AbandonCause, AdmissionClass, Resources};
use crate::admission_id::AdmissionId;
use crate::engine::timer::Sleep;
use crate::error::{AcquireError, RequestError, UsageError};
use crate::rejection::Rejection;
use crate::reservation::{Progressive, TokenUsage, UsageReport};

use super::admission::Admission;
use super::bulkhead::LlmBulkhead;
use super::core::LlmCore;
use super::options::RunOptions;
use super::request::LlmRequest;

/// What a [`run`](LlmBulkhead::run) callback knows about its admission: it dereferences to
/// the call's [`Admission`] (id, limit revision, priority, reservation, hold, usage so far) and
/// reports usage like a [`Permit`](crate::Permit). It cannot release: `run` settles when the
/// callback finishes.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Priority};
///
/// # futures::executor::block_on(async {
/// let bulkhead = LlmBulkhead::builder("m", 1).initial_revision(3).build()?;
/// let revision = bulkhead
///     .run(&LlmRequest::new(), AcquireOptions::new().priority(Priority::High), async |ctx| {
///         assert_eq!(ctx.priority(), Priority::High);
///         assert!(ctx.reservation().is_none()); // no token budget
///         Ok::<_, std::io::Error>(ctx.limit_revision())
///     })
///     .await?;
/// assert_eq!(revision, 3);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
pub struct RunContext<'a> {
    core: &'a LlmCore,
    admission: &'a mut Admission,
    /// Set when the callback gave its borrowed slot back itself (the deadline then no longer
    /// applies).
    abandoned: &'a AtomicBool,
}

impl RunContext<'_> {
    /// Reports the call's cumulative usage so far; see [`Permit::report_usage`](crate::Permit::report_usage).
    ///
    /// # Errors
    ///
    /// As for [`Permit::report_usage`](crate::Permit::report_usage); nothing changes.
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
        self.core.report(self.admission, usage, None)
    }

    /// Reports cumulative usage with a progressive reconciliation; see
    /// [`Permit::report_usage_progressive`](crate::Permit::report_usage_progressive).
    ///
    /// # Errors
    ///
    /// As for [`Permit::report_usage_progressive`](crate::Permit::report_usage_progressive); nothing changes.
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
        self.core.report(self.admission, usage, Some(progressive))
    }

    /// Gives the call's borrowed slot back now, keeping its tokens until `run` settles; see
    /// [`Permit::abandon_borrowed_concurrency`](crate::Permit::abandon_borrowed_concurrency).
    /// After it, a borrowed-slot deadline no longer applies to the call.
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
        let done = self.core.abandon(self.admission, AbandonCause::Manual);
        if done {
            // Relaxed: read by the future that polls this context, on the same thread.
            self.abandoned.store(true, Ordering::Relaxed);
        }
        done
    }
}

impl Deref for RunContext<'_> {
    type Target = Admission;

    #[inline]
    fn deref(&self) -> &Admission {
        self.admission
    }
}

impl fmt::Debug for RunContext<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RunContext").field(&*self.admission).finish()
    }
}

/// Why a [`run`](LlmBulkhead::run) did not return the callback's value.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, RunError};
///
/// # futures::executor::block_on(async {
/// let bulkhead = LlmBulkhead::builder("m", 0).build()?;
/// let err = bulkhead
///     .run(&LlmRequest::new(), AcquireOptions::new(), async |_| Ok::<(), std::io::Error>(()))
///     .await
///     .unwrap_err();
/// assert!(matches!(err, RunError::Rejected(r) if r.reason() == RejectReason::ConcurrencyLimit));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Debug)]
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
    /// # futures::executor::block_on(async {
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
    /// # futures::executor::block_on(async {
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
        // Checked first, even when the deadline would not apply; resolved now otherwise, so
        // the future does not borrow the request.
        let acquire =
            (deadline != Some(Duration::ZERO)).then(|| self.acquire(request, options.acquire));
        async move {
            let Some(acquire) = acquire else {
                return Err(RunError::Invalid(
                    RequestError::ZeroBorrowedConcurrencyDeadline,
                ));
            };
            let mut permit = acquire.await?;
            // The deadline applies only to a borrowed slot, from admission on (a deadline too
            // far to represent never passes).
            let cut_at = deadline
                .filter(|_| permit.resources().borrowed_concurrency)
                .and_then(|d| Instant::now().checked_add(d));
            let abandoned = AtomicBool::new(false);
            // The permit lives in this future: dropping the future settles it.
            let (core, admission) = permit.parts();
            let finished = {
                let call = f(RunContext {
                    core,
                    admission,
                    abandoned: &abandoned,
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
                    // Counted as abandoned for the deadline, unless the count of abandoned
                    // admissions is full (see `abandon_borrowed_concurrency`): the release
                    // below returns the slot either way.
                    let (core, admission) = permit.parts();
                    core.abandon(admission, AbandonCause::Deadline);
                    let error = BorrowedConcurrencyDeadlineError {
                        deadline: deadline.unwrap_or_default(),
                        admission_id: permit.admission_id(),
                        resources: permit.resources(),
                        class: permit.class(),
                    };
                    // Its tokens settle now, with the last usage it reported.
                    permit.release(None);
                    Err(RunError::BorrowedConcurrencyDeadline(error))
                }
            }
        }
    }
}

/// Polls `call` until it finishes (`Some`) or `cut_at` passes while it still holds its
/// borrowed slot (`None`). After the callback gave its slot back itself, only `call` counts.
async fn until_cut<R>(
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
