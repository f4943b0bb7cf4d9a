//! `run`: acquire, call, settle, in one future that cannot leak its permit.

use core::fmt;
use core::future::Future;
use core::ops::{AsyncFnOnce, Deref};

use crate::error::{AcquireError, RequestError, UsageError};
use crate::rejection::Rejection;
use crate::reservation::{Progressive, TokenUsage, UsageReport};

use super::admission::Admission;
use super::bulkhead::LlmBulkhead;
use super::core::LlmCore;
use super::options::AcquireOptions;
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
}

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
    /// callback never ran), [`RunError::Failed`] with the callback's own error.
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
        options: AcquireOptions,
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
        options: AcquireOptions,
        usage: U,
        f: F,
    ) -> impl Future<Output = Result<T, RunError<E>>> + 'a
    where
        F: for<'c> AsyncFnOnce(RunContext<'c>) -> Result<T, E> + 'a,
        U: FnOnce(&T) -> Option<TokenUsage> + 'a,
    {
        // Resolved now, so the future does not borrow the request.
        let acquire = self.acquire(request, options);
        async move {
            let mut permit = acquire.await?;
            // The permit lives in this future: dropping the future settles it.
            let (core, admission) = permit.parts();
            let result = f(RunContext { core, admission }).await;
            match result {
                Ok(value) => {
                    let usage = usage(&value);
                    permit.release(usage);
                    Ok(value)
                }
                Err(error) => {
                    permit.release(None);
                    Err(RunError::Failed(error))
                }
            }
        }
    }
}
