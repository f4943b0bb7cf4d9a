//! `run_shared`: `run` with in-flight deduplication. The call is owned (`'static`, `Send`), so
//! that any of the callers waiting for it can drive it: the leader's own future may be dropped
//! while followers still wait, and the call goes on (see `dedup.rs` for the protocol).

use core::future::Future;
use core::task::Poll;
use std::time::{Duration, Instant};

use crate::engine::timer::{Bound, Sleep};
use crate::events::{DedupEvent, Event, EventKind};
use crate::support::sync::Arc;
use crate::support::sync::unmodeled;
use crate::vocabulary::error::RequestError;
use crate::vocabulary::priority::Priority;
use crate::vocabulary::rejection::RejectReason;
use crate::vocabulary::reservation::TokenUsage;

use super::acquire::AcquireOwned;
use super::bulkhead::LlmBulkhead;
use super::context::{CallState, RunContext, SharedCall};
use super::dedup::{Dedup, Outcome, Role, Share, Waiter};
use super::observe::BypassCall;
use super::options::RunOptions;
use super::permit::OwnedPermit;
use super::request::LlmRequest;
use super::run::{Entered, RunError, bypass, cut, cut_timer, enter, until_cut, untimed};
use super::shared::{Call, LlmCore};

/// How the followers of a shared call get their copy of its value, and which usage the call
/// settles with: for [`run_shared_with`](LlmBulkhead::run_shared_with).
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use async_bulkhead_llm::{dedup::Sharing, TokenUsage};
///
/// struct Reply { text: Arc<str>, input: u64, output: u64 }
///
/// // A value that is not `Clone`: followers get a copy made by the hook.
/// let sharing = Sharing::with(|r: &Reply| Reply { text: Arc::clone(&r.text), ..*r })
///     .usage(|r: &Reply| TokenUsage::new(r.input, r.output).ok());
/// # let _ = sharing;
/// ```
pub struct Sharing<T> {
    share: Box<dyn Fn(&T) -> T + Send + Sync>,
    usage: Option<UsageFn<T>>,
}

impl<T: Clone + 'static> Sharing<T> {
    /// Followers get a clone of the leader's value.
    ///
    /// # Examples
    ///
    /// ```
    /// let sharing = async_bulkhead_llm::dedup::Sharing::<String>::cloned();
    /// # let _ = sharing;
    /// ```
    pub fn cloned() -> Sharing<T> {
        Sharing::with(T::clone)
    }
}

impl<T> Sharing<T> {
    /// A follower gets what its own `share` makes of the leader's value (called once, for that
    /// follower, outside the bulkhead's locks). A follower whose `share` panics gets the panic
    /// (it is resumed in that follower's task); the others are unaffected.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// let sharing = async_bulkhead_llm::dedup::Sharing::with(|body: &Arc<[u8]>| Arc::clone(body));
    /// # let _ = sharing;
    /// ```
    pub fn with(share: impl Fn(&T) -> T + Send + Sync + 'static) -> Sharing<T> {
        Sharing {
            share: Box::new(share),
            usage: None,
        }
    }

    /// Settles a successful call with the usage `usage` extracts from its value (`None`: the
    /// last usage reported through the context), as
    /// [`run_with_usage`](LlmBulkhead::run_with_usage) does.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{dedup::Sharing, TokenUsage};
    /// let sharing = Sharing::<(String, u64)>::cloned().usage(|(_, n)| TokenUsage::new(0, *n).ok());
    /// # let _ = sharing;
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn usage(
        mut self,
        usage: impl FnOnce(&T) -> Option<TokenUsage> + Send + Sync + 'static,
    ) -> Sharing<T> {
        self.usage = Some(Box::new(usage));
        self
    }
}

impl<T: Clone + 'static> Default for Sharing<T> {
    fn default() -> Sharing<T> {
        Sharing::cloned()
    }
}

impl<T> core::fmt::Debug for Sharing<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Sharing")
            .field("usage", &self.usage.is_some())
            .finish_non_exhaustive()
    }
}

/// How a call's usage is extracted from its value.
type UsageFn<T> = Box<dyn FnOnce(&T) -> Option<TokenUsage> + Send + Sync>;

/// The outcome a shared call publishes.
type Output<T, E> = Result<T, RunError<E>>;

impl LlmBulkhead {
    /// [`run`](LlmBulkhead::run) with in-flight deduplication: on a bulkhead built with
    /// [`deduplication`](crate::LlmBulkheadBuilder::deduplication), a call whose key matches a
    /// call in flight (same scope, same class, same result type) *follows* it: it takes no
    /// capacity, is not counted as admitted, is not estimated, and gets a clone of that call's
    /// value or error. Otherwise it *leads*: it registers at once (before it is admitted, so an
    /// identical call made right after joins it even while it waits in the queue) and runs as
    /// `run` does. Followers get clones, so `T` and `E` must be `Clone`; see
    /// [`run_shared_with`](LlmBulkhead::run_shared_with) for a value that is shared otherwise.
    ///
    /// The call is owned: `f` takes a `RunContext<'static>` and returns a `Send + 'static`
    /// future, because whichever of the waiting callers is polled drives it. The shared call
    /// goes on while anyone waits for it; when every waiter is gone, it is dropped and its
    /// admission settles.
    ///
    /// A follower's wait ends early only by its own explicit
    /// [`timeout`](crate::AcquireOptions::timeout) or
    /// [`deadline`](crate::AcquireOptions::deadline) (the bulkhead's default queue timeout does
    /// not apply to it) or by dropping its future: both are counted as rejections (`timeout`,
    /// `aborted`) and announced without timing, and the shared call goes on. A follower in
    /// observe mode whose own timeout passes runs its own callback as a bypass. No call joins
    /// after [`close`](LlmBulkhead::close).
    ///
    /// # Errors
    ///
    /// As for [`run`](LlmBulkhead::run); a follower gets the leader's error (not counted again),
    /// or its own `timeout` rejection.
    ///
    /// # Cancel safety
    ///
    /// Dropping a follower's future ends its wait only. Dropping the leader's future while
    /// followers wait leaves the call to them; dropping the last waiter drops the call (which
    /// leaves the queue, or drops the callback's future and settles the admission).
    ///
    /// # Panics
    ///
    /// Resumes, in a follower's task, a panic of the share hook for that follower; if the call
    /// itself panics while one caller drives it, that caller's task unwinds and every other
    /// waiter panics too. A leader whose call panics before it starts (its estimator, say,
    /// which runs in `run_shared` itself, after the leader registered) unwinds from
    /// `run_shared`, and every follower that joined it meanwhile panics too; the flight is gone
    /// at once, so the next identical call leads anew.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, dedup::Deduplication, LlmBulkhead, LlmRequest};
    ///
    /// # ::futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("m", 8).deduplication(Deduplication::new()).build()?;
    /// let request = LlmRequest::new().user("Summarise RFC 9110").max_tokens(200);
    /// let calls = (0..5).map(|_| {
    ///     bulkhead.run_shared(&request, AcquireOptions::new(), |_ctx| async {
    ///         Ok::<_, String>("a summary".to_string()) // one provider call for all five
    ///     })
    /// });
    /// let replies = futures::future::join_all(calls).await;
    /// assert!(replies.iter().all(|r| r.as_deref().ok() == Some("a summary")));
    /// let stats = bulkhead.stats();
    /// assert_eq!(stats.admitted, 1);
    /// assert_eq!(stats.deduplication.unwrap().hits, 4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn run_shared<T, E, F, Fut>(
        &self,
        request: &LlmRequest,
        options: impl Into<RunOptions>,
        f: F,
    ) -> impl Future<Output = Result<T, RunError<E>>> + Send + 'static
    where
        T: Clone + Send + 'static,
        E: Clone + Send + 'static,
        F: FnOnce(RunContext<'static>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let core = Arc::clone(&self.core);
        // A clone of the whole outcome: a closure that captures nothing, so boxing it for a
        // follower allocates nothing.
        let share = || -> Share<Output<T, E>> { Box::new(Output::<T, E>::clone) };
        let plan = plan(&core, request, options.into(), share, None, f);
        drive(plan)
    }

    /// [`run_shared`](LlmBulkhead::run_shared) with a follower's copy of the value made by
    /// the follower's own `sharing` (so `T` need not be `Clone`), and the call settled with the
    /// usage the leader's `sharing` extracts from its value. A value that can be neither
    /// cloned nor shared cannot be deduplicated: that is a compile error, not a run-time
    /// refusal.
    ///
    /// Each caller brings its own hooks: a follower's [`Sharing::with`](crate::dedup::Sharing::with) hook makes its copy
    /// (so callers may share one call and still get different shapes of its value); its
    /// [`Sharing::usage`](crate::dedup::Sharing::usage) hook is not used, since the call it follows is the leader's and
    /// settles once, with the leader's.
    ///
    /// # Errors
    ///
    /// As for [`run_shared`](LlmBulkhead::run_shared).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use async_bulkhead_llm::*;
    /// use async_bulkhead_llm::{dedup::Deduplication, dedup::Sharing};
    ///
    /// struct Completion { text: Arc<str>, usage: TokenUsage } // not Clone
    ///
    /// # ::futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("m", 8)
    ///     .token_budget(TokenBudget::new(100_000))
    ///     .deduplication(Deduplication::new())
    ///     .build()?;
    /// let sharing = || {
    ///     Sharing::with(|c: &Completion| Completion { text: Arc::clone(&c.text), usage: c.usage })
    ///         .usage(|c: &Completion| Some(c.usage))
    /// };
    /// let request = LlmRequest::new().user("hi").max_tokens(100);
    /// let usage = TokenUsage::new(3, 5)?;
    /// let call = move |_ctx| async move {
    ///     Ok::<_, Arc<std::io::Error>>(Completion { text: "hello".into(), usage })
    /// };
    /// let (a, b) = ::futures::join!(
    ///     bulkhead.run_shared_with(&request, AcquireOptions::new(), sharing(), call),
    ///     bulkhead.run_shared_with(&request, AcquireOptions::new(), sharing(), call),
    /// );
    /// assert_eq!((&*a?.text, &*b?.text), ("hello", "hello"));
    /// assert_eq!(bulkhead.stats().token_budget.unwrap().total_consumed, 8); // settled once
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn run_shared_with<T, E, F, Fut>(
        &self,
        request: &LlmRequest,
        options: impl Into<RunOptions>,
        sharing: Sharing<T>,
        f: F,
    ) -> impl Future<Output = Result<T, RunError<E>>> + Send + 'static
    where
        T: Send + 'static,
        E: Clone + Send + 'static,
        F: FnOnce(RunContext<'static>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let core = Arc::clone(&self.core);
        let Sharing { share, usage } = sharing;
        // The follower's own hook over the outcome (a box: it captures the hook).
        let share = move || -> Share<Output<T, E>> {
            Box::new(move |output: &Output<T, E>| match output {
                Ok(value) => Ok(share(value)),
                Err(error) => Err(error.clone()),
            })
        };
        let plan = plan(&core, request, options.into(), share, usage, f);
        drive(plan)
    }
}

/// The future of a `run_shared` call, once planned.
async fn drive<T, E, F, Fut>(plan: Plan<T, E, F>) -> Output<T, E>
where
    T: Send + 'static,
    E: Clone + Send + 'static,
    F: FnOnce(RunContext<'static>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
{
    match plan {
        Plan::Ready(output) => output,
        Plan::Solo(call) => call.await,
        Plan::Lead(mut waiter) => match core::future::poll_fn(|cx| waiter.poll_outcome(cx)).await {
            Outcome::Value(output) => output,
            Outcome::Panicked(payload) => std::panic::resume_unwind(payload),
        },
        Plan::Follow(follower) => follower.wait().await,
    }
}

/// What a `run_shared` call does, decided when it is made (so that its registration is
/// synchronous).
enum Plan<T: Send + 'static, E: Send + 'static, F> {
    /// Refused before anything started (invalid options).
    Ready(Output<T, E>),
    /// Runs on its own (no deduplication for it).
    Solo(super::dedup::Call<Output<T, E>>),
    /// Leads a shared call.
    Lead(Waiter<Output<T, E>>),
    /// Follows a shared call.
    Follow(Follower<T, E, F>),
}

fn plan<T, E, F, Fut>(
    core: &Arc<LlmCore>,
    request: &LlmRequest,
    options: RunOptions,
    share: impl FnOnce() -> Share<Output<T, E>>,
    usage: Option<UsageFn<T>>,
    f: F,
) -> Plan<T, E, F>
where
    T: Send + 'static,
    E: Clone + Send + 'static,
    F: FnOnce(RunContext<'static>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
{
    // Every option is checked before the call joins or leads anything.
    if options.borrowed_concurrency_deadline == Some(Duration::ZERO) {
        return Plan::Ready(Err(RunError::Invalid(
            RequestError::ZeroBorrowedConcurrencyDeadline,
        )));
    }
    let class = match core.class_of(&options.acquire) {
        Ok(class) => class,
        Err(error) => return Plan::Ready(Err(RunError::Invalid(error))),
    };
    let key = match core.dedup() {
        // No call joins after `close`.
        Some(dedup) if options.dedup && !core.engine().is_closed() => {
            dedup.key(request, options.dedup_scope.as_ref(), class)
        }
        _ => None,
    };
    let Some((dedup, key)) = core.dedup().zip(key) else {
        let call = core.resolve(request, options.acquire);
        return Plan::Solo(Box::pin(lead(Arc::clone(core), call, options, usage, f)));
    };
    let (waiter, role) = Dedup::join_or_lead(dedup, key, share);
    match role {
        Role::Leader => {
            // Resolved (estimated) after registering, unlocked: followers never wait on it.
            let call = core.resolve(request, options.acquire);
            waiter.install(Box::pin(lead(Arc::clone(core), call, options, usage, f)));
            Plan::Lead(waiter)
        }
        Role::Follower { followers } => {
            if core.listeners().hears(EventKind::Dedup, true) {
                core.listeners()
                    .emit(&Event::Dedup(&DedupEvent { class, followers }), true);
            }
            // Its own bound only: the bulkhead's default queue timeout does not apply.
            let bound = Bound {
                timeout: options.acquire.timeout,
                deadline: options.acquire.deadline,
            };
            // A follower may run its own callback only as an observe-mode bypass after its own
            // timeout: only then is it resolved (estimated), now, while the request is here.
            let own = options
                .observe
                .filter(|reasons| bound.is_bounded() && reasons.contains(RejectReason::Timeout))
                .map(|_| (core.resolve(request, options.acquire), f, usage));
            Plan::Follow(Follower {
                joined: Joined {
                    core: Arc::clone(core),
                    waiter: Some(waiter),
                    priority: options.acquire.priority,
                    class,
                },
                sleep: bound.sleep(Instant::now()),
                own,
            })
        }
    }
}

/// A follower's wait.
struct Follower<T: Send + 'static, E: Send + 'static, F> {
    joined: Joined<Output<T, E>>,
    /// Its own timeout (none: no timeout, or one too far to represent).
    sleep: Option<Sleep>,
    /// What it runs as an observe-mode bypass if its own timeout passes.
    #[allow(clippy::type_complexity)]
    own: Option<(Result<Call, RequestError>, F, Option<UsageFn<T>>)>,
}

/// A follower's place in its flight. Dropped before its outcome (the caller's future dropped,
/// polled or not), it leaves the flight and counts the follower's cancellation as `aborted`.
struct Joined<O: Send + 'static> {
    core: Arc<LlmCore>,
    waiter: Option<Waiter<O>>,
    priority: Priority,
    class: Option<crate::vocabulary::admission_class::AdmissionClass>,
}

impl<O: Send + 'static> Drop for Joined<O> {
    fn drop(&mut self) {
        let Some(mut waiter) = self.waiter.take() else {
            return;
        };
        // An outcome that arrived meanwhile is dropped: the caller is gone either way.
        if waiter.leave().is_none() {
            let rejection = self.core.engine().refuse_undecided(
                RejectReason::Aborted,
                self.priority,
                self.class,
            );
            self.core.announce_reject_untimed(&rejection, self.class);
        }
    }
}

impl<T, E, F, Fut> Follower<T, E, F>
where
    T: Send + 'static,
    E: Clone + Send + 'static,
    F: FnOnce(RunContext<'static>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
{
    async fn wait(mut self) -> Output<T, E> {
        let mut sleep = self.sleep.take();
        let joined = &mut self.joined;
        let outcome = core::future::poll_fn(|cx| {
            let waiter = joined.waiter.as_mut().expect("waiting");
            if let Poll::Ready(outcome) = waiter.poll_outcome(cx) {
                return Poll::Ready(Some(outcome));
            }
            match sleep.as_mut() {
                Some(sleep) => sleep.poll_elapsed(cx).map(|()| None),
                None => Poll::Pending,
            }
        })
        .await;
        let mut waiter = self.joined.waiter.take().expect("waiting");
        let outcome = match outcome {
            Some(outcome) => outcome,
            // Its own timeout: it leaves (an outcome that arrived meanwhile wins).
            None => match waiter.leave() {
                Some(outcome) => outcome,
                None => return self.timed_out().await,
            },
        };
        match outcome {
            Outcome::Value(output) => output,
            Outcome::Panicked(payload) => std::panic::resume_unwind(payload),
        }
    }

    /// Its own timeout passed: a counted, untimed `timeout` rejection, then (observe mode) a
    /// bypass running its own callback.
    async fn timed_out(mut self) -> Output<T, E> {
        let core = Arc::clone(&self.joined.core);
        let (priority, class) = (self.joined.priority, self.joined.class);
        let rejection = core
            .engine()
            .refuse_undecided(RejectReason::Timeout, priority, class);
        core.announce_reject_untimed(&rejection, class);
        let Some((call, f, usage)) = self.own.take() else {
            return Err(RunError::Rejected(rejection));
        };
        let call = call.map_err(RunError::Invalid)?;
        match bypass::<OwnedPermit, E>(&core, &call, RejectReason::Timeout, None, false)? {
            Entered::Bypassed(bypass) => run_bypassed(core, bypass, usage, f).await,
            Entered::Admitted(_) => unreachable!("a bypass admits nothing"),
        }
    }
}

/// The call a leader (or a call without deduplication) runs: `run`'s admission (observe mode
/// included), then the callback with an owned context.
async fn lead<T, E, F, Fut>(
    core: Arc<LlmCore>,
    call: Result<Call, RequestError>,
    options: RunOptions,
    usage: Option<UsageFn<T>>,
    f: F,
) -> Output<T, E>
where
    T: Send + 'static,
    E: Send + 'static,
    F: FnOnce(RunContext<'static>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
{
    let call = call.map_err(RunError::Invalid)?;
    let acquire = AcquireOwned::resolved(
        Arc::clone(&core),
        call,
        options.acquire,
        untimed(options.observe),
    );
    match enter(&core, call, options.observe, acquire).await? {
        Entered::Admitted(permit) => {
            let borrowed = permit.resources().borrowed_concurrency;
            let shared = SharedCall::new(
                Arc::clone(&core),
                CallState::Admitted(permit.into_admission()),
            );
            let mut settle = Settle(Some(unmodeled::Arc::clone(&shared)));
            let deadline = options.borrowed_concurrency_deadline;
            let finished = until_cut(
                f(RunContext::shared(unmodeled::Arc::clone(&shared))),
                cut_timer(deadline, borrowed),
                shared.abandoned(),
            )
            .await;
            match finished {
                Some(Ok(value)) => {
                    settle.finish(usage.and_then(|usage| usage(&value)));
                    Ok(value)
                }
                Some(Err(error)) => {
                    settle.finish(None);
                    Err(RunError::Failed(error))
                }
                None => {
                    let error = shared
                        .with_admission(|core, admission| {
                            cut(core, admission, deadline.unwrap_or_default())
                        })
                        .expect("a cut call still holds its admission");
                    settle.finish(None);
                    Err(RunError::BorrowedConcurrencyDeadline(error))
                }
            }
        }
        Entered::Bypassed(bypass) => run_bypassed(core, bypass, usage, f).await,
    }
}

/// A bypassed `run_shared` call: the callback with an owned bypass context.
async fn run_bypassed<T, E, F, Fut>(
    core: Arc<LlmCore>,
    bypass: BypassCall,
    usage: Option<UsageFn<T>>,
    f: F,
) -> Output<T, E>
where
    F: FnOnce(RunContext<'static>) -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let shared = SharedCall::new(core, CallState::Bypassed(bypass));
    let mut settle = Settle(Some(unmodeled::Arc::clone(&shared)));
    match f(RunContext::shared(shared)).await {
        Ok(value) => {
            settle.finish(usage.and_then(|usage| usage(&value)));
            Ok(value)
        }
        Err(error) => {
            settle.finish(None);
            Err(RunError::Failed(error))
        }
    }
}

/// Settles a `run_shared` call once: when it finishes, or when its future is dropped (with
/// the last reported usage).
struct Settle(Option<unmodeled::Arc<SharedCall>>);

impl Settle {
    fn finish(&mut self, usage: Option<TokenUsage>) {
        if let Some(shared) = self.0.take() {
            settle(&shared, usage, false);
        }
    }
}

impl Drop for Settle {
    fn drop(&mut self) {
        if let Some(shared) = self.0.take() {
            settle(&shared, None, true);
        }
    }
}

fn settle(shared: &SharedCall, usage: Option<TokenUsage>, dropped: bool) {
    let core = shared.core();
    match shared.take() {
        CallState::Admitted(admission) if dropped => core.settle_unused(&admission),
        CallState::Admitted(admission) => {
            core.settle(&admission, usage);
        }
        CallState::Bypassed(call) => core.finish_bypass(&call, usage),
        CallState::Settled => {}
    }
}
