//! Waiting acquires: the [`Acquire`] and [`AcquireOwned`] futures and the blocking variants.
//!
//! An acquire first tries the lock-free fast path. If no slot is free and the queue has room,
//! it joins the engine's FIFO queue at its first poll and waits to be *handed* a slot
//! and its tokens; a timeout bounds the wait only. Dropping the future withdraws it from the
//! queue without losing anything.
//!
//! The futures are `Unpin`: they hold no self-reference (the waiter lives in an `Arc`, shared
//! with the queue), so callers can poll them without pinning, and no `unsafe` pin projection
//! is needed. Both futures and both blocking variants share one state machine (`Machine`).

use core::fmt;
use core::future::Future;
use core::mem::ManuallyDrop;
use core::ops::Deref;
use core::pin::Pin;
use core::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::engine::queued::Queued;
use crate::engine::timer::Bound;
use crate::engine::{Grant, Wait, WaiterHandle};
use crate::events::Timing;
use crate::support::sync::Arc;
use crate::vocabulary::error::{AcquireError, RequestError};
use crate::vocabulary::rejection::Rejection;

use super::admission::Admission;
use super::bulkhead::LlmBulkhead;
use super::options::AcquireOptions;
use super::permit::{OwnedPermit, Permit};
use super::request::LlmRequest;
use super::shared::{Admitted, Call, LlmCore};

impl LlmBulkhead {
    /// Admits the call, waiting in the queue for a slot if none is free and the queue has room.
    ///
    /// The call is judged like [`try_acquire`](LlmBulkhead::try_acquire) (closed, then the
    /// priority-adjusted budget, then concurrency), except that when only a slot is missing it
    /// may wait: it joins the strictly FIFO queue unless `max_concurrent` or `max_queue` is 0
    /// (`concurrency_limit`) or the queue is full (`queue_limit`). A token budget never makes
    /// a call wait: tokens that do not fit now are refused now. When the call reaches the head
    /// and a slot frees, its slot and its tokens are taken together; if its tokens no longer
    /// fit by then it is refused `budget_limit` and the next waiter gets the turn.
    ///
    /// The wait is bounded by the call's [`timeout`](AcquireOptions::timeout), else the
    /// bulkhead's [`queue_timeout`](LlmBulkhead::queue_timeout) (`timeout`), and ends with
    /// `shutdown` if the bulkhead closes. Nothing happens until the future is first polled:
    /// that poll sizes the request (the estimator runs then, unless the options carry a
    /// reservation), decides, and takes the place in the queue. So the future borrows
    /// `request` as well as the bulkhead; a future kept beyond the statement that made it
    /// needs its request in a variable. ([`acquire_owned`](LlmBulkhead::acquire_owned) sizes
    /// the request at once and borrows nothing.)
    ///
    /// # Errors
    ///
    /// [`AcquireError::Rejected`] with `shutdown`, `budget_limit`, `concurrency_limit`,
    /// `queue_limit` or `timeout`, and [`AcquireError::Invalid`] when the estimate cannot be
    /// represented.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future gives up the place in the queue (counted as `aborted`). If a slot
    /// had already been handed to it, that slot and those tokens are returned at once and go to
    /// the next waiter.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Profile};
    ///
    /// # futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("claude-sonnet-4", 1).profile(Profile::Batch).build()?;
    /// let request = LlmRequest::new().user("hello");
    /// let first = bulkhead.acquire(&request, AcquireOptions::new()).await?;
    ///
    /// let mut second = Box::pin(bulkhead.acquire(&request, AcquireOptions::new()));
    /// assert!(futures::poll!(second.as_mut()).is_pending()); // queued
    /// assert_eq!(bulkhead.stats().pending, 1);
    /// drop(first); // hands the slot to the queue head
    /// let second = second.await?;
    /// assert_eq!(bulkhead.stats().in_flight, 1);
    /// # drop(second);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    #[inline]
    pub fn acquire<'a, 'r>(
        &'a self,
        request: &'r LlmRequest,
        options: AcquireOptions,
    ) -> Acquire<'a, 'r> {
        Acquire {
            machine: Machine {
                core: &*self.core,
                step: Step::Unresolved { request, options },
            },
        }
    }

    /// Like [`acquire`](LlmBulkhead::acquire), resolving to an [`OwnedPermit`]; the future
    /// itself is `'static` and can be spawned. It sizes the request at once (it cannot keep
    /// a borrow of it for its first poll); an invalid request is still reported by that poll.
    ///
    /// # Errors
    ///
    /// As for [`acquire`](LlmBulkhead::acquire).
    ///
    /// # Cancel safety
    ///
    /// As for [`acquire`](LlmBulkhead::acquire).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest};
    ///
    /// # futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("m", 2).build()?;
    /// let permit = bulkhead.acquire_owned(&LlmRequest::new(), AcquireOptions::new()).await?;
    /// std::thread::spawn(move || drop(permit)).join().unwrap();
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn acquire_owned(&self, request: &LlmRequest, options: AcquireOptions) -> AcquireOwned {
        AcquireOwned {
            machine: Machine::new(Arc::clone(&self.core), request, options),
        }
    }

    /// Like [`acquire`](LlmBulkhead::acquire), blocking the calling thread while it waits.
    ///
    /// # Errors
    ///
    /// As for [`acquire`](LlmBulkhead::acquire).
    ///
    /// # Blocking
    ///
    /// Parks the thread until a slot is handed over, the timeout passes or the bulkhead
    /// closes. Do not call it from async code: use [`acquire`](LlmBulkhead::acquire).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 1).max_queue(4).build()?;
    /// let held = bulkhead.acquire_blocking(&LlmRequest::new(), AcquireOptions::new())?;
    /// let short = AcquireOptions::new().timeout(Duration::from_millis(10));
    /// let err = bulkhead.acquire_blocking(&LlmRequest::new(), short).unwrap_err();
    /// assert_eq!(err.rejection().unwrap().reason(), RejectReason::Timeout);
    /// # drop(held);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn acquire_blocking(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<Permit<'_>, AcquireError> {
        let core = &*self.core;
        Machine::new(core, request, options)
            .block()
            .map(|admission| Permit::new(core, admission))
    }

    /// Like [`acquire_blocking`](LlmBulkhead::acquire_blocking), returning an [`OwnedPermit`].
    ///
    /// # Errors
    ///
    /// As for [`acquire`](LlmBulkhead::acquire).
    ///
    /// # Blocking
    ///
    /// As for [`acquire_blocking`](LlmBulkhead::acquire_blocking).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 1).build()?;
    /// let permit = bulkhead.acquire_blocking_owned(&LlmRequest::new(), AcquireOptions::new())?;
    /// assert_eq!(permit.limit_revision(), 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn acquire_blocking_owned(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<OwnedPermit, AcquireError> {
        let core = Arc::clone(&self.core);
        Machine::new(Arc::clone(&core), request, options)
            .block()
            .map(|admission| OwnedPermit::new(core, admission))
    }

    /// The bulkhead's default queue timeout (from its profile or
    /// [`queue_timeout`](crate::LlmBulkheadBuilder::queue_timeout)).
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::LlmBulkhead::builder("m", 1).build()?;
    /// assert_eq!(bulkhead.queue_timeout(), None);
    /// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
    /// ```
    pub fn queue_timeout(&self) -> Option<Duration> {
        self.core.bound(AcquireOptions::new()).timeout
    }
}

/// Future returned by [`LlmBulkhead::acquire`]: it borrows the bulkhead for `'a` (its permit
/// does too) and the request for `'r` (read at the first poll, which resolves it).
#[must_use = "futures do nothing unless polled"]
pub struct Acquire<'a, 'r> {
    machine: Machine<'r, &'a LlmCore>,
}

impl<'a> Acquire<'a, 'static> {
    /// The acquire of a call already resolved (by `run`, which needed its reservation first).
    /// Its refusals for the reasons in `untimed` (a bit per `RejectReason`: observe mode's race
    /// bypasses) are announced untimed.
    pub(crate) fn resolved(
        core: &'a LlmCore,
        call: Call,
        options: AcquireOptions,
        untimed: u8,
    ) -> Acquire<'a, 'static> {
        Acquire {
            machine: Machine::resolved(core, call, options, untimed),
        }
    }
}

impl<'a> Future for Acquire<'a, '_> {
    type Output = Result<Permit<'a>, AcquireError>;

    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let core = self.machine.core;
        let permit = |admission| Permit::new(core, admission);
        if let Step::Unresolved { options, .. } = &self.machine.step {
            // The first poll: the call's timing starts (and its sampling is decided) here.
            let timing = core.timing();
            // The fast lane first, on its own way out: a call `try_acquire` would admit on
            // its fast lane is admitted the same way (nothing to queue, nobody timing it).
            if timing.is_none() {
                // A call naming its class: its lane (the fast lane's own first test, moved
                // here, so that the other lanes do not pay for this one).
                if options.class.is_some() {
                    return self.poll_class_lane(cx);
                }
                if let Some((grant, ledger)) = core.fast_admission(options) {
                    self.machine.step = Step::Done;
                    return Poll::Ready(Ok(permit(Admission::new(grant, ledger))));
                }
                // A call of the default class, which names none (an engine with classes has
                // no fast lane: `fast_admission` said `None` at its first test).
                if core.engine().classes().is_some() {
                    return self.poll_class_lane(cx);
                }
            }
            return self.poll_general(cx, timing);
        }
        self.poll_general(cx, None)
    }
}

impl<'a> Acquire<'a, '_> {
    /// [`poll`](Future::poll) beyond the fast lane: the first decision on the general path,
    /// or a wait. Out of line, so that the fast lane stays small.
    ///
    /// `timing`: the call's, for a first poll that found an unresolved call (see
    /// `LlmCore::timing`); any other first poll starts it here.
    #[inline(never)]
    fn poll_general(
        &mut self,
        cx: &mut Context<'_>,
        timing: Option<Timing>,
    ) -> Poll<Result<Permit<'a>, AcquireError>> {
        let core = self.machine.core;
        let permit = |admission| Permit::new(core, admission);
        // The windowed lane (rate windows, no classes), as `try_acquire`'s, for a first poll
        // nobody times (a call naming its class took `poll_class_lane` before coming here).
        if timing.is_none()
            && let Step::Unresolved { options, .. } = &self.machine.step
            && let Some((grant, ledger)) = core.windowed_admission(options)
        {
            self.machine.step = Step::Done;
            return Poll::Ready(Ok(permit(Admission::new(grant, ledger))));
        }
        if self.machine.is_new() {
            let timing = match self.machine.step {
                Step::Unresolved { .. } => timing,
                _ => core.timing(),
            };
            return self
                .machine
                .start_in_place(cx, timing, permit, |_, admission| permit(admission));
        }
        self.machine.poll_waiting(cx, false).map_ok(permit)
    }
}

impl<'a> Acquire<'a, '_> {
    /// The first poll of a class call nobody times (one that names its class, or of the
    /// default class, tested after the fast lane): the class lane (`LlmCore::class_admission`:
    /// a call within its class's floors), else the general path. Out of line, so that neither
    /// the fast lane nor the general path's lanes grow (in `poll_general`, it cost
    /// `rate_window_await` 3 to 49; the default class's test after the fast lane costs it 2).
    #[inline(never)]
    fn poll_class_lane(&mut self, cx: &mut Context<'_>) -> Poll<Result<Permit<'a>, AcquireError>> {
        let core = self.machine.core;
        if let Step::Unresolved { options, .. } = &self.machine.step
            && let Some(admission) = core.class_admission::<false>(options)
        {
            self.machine.step = Step::Done;
            return Poll::Ready(Ok(Permit::new(core, admission)));
        }
        self.poll_general(cx, None)
    }
}

impl fmt::Debug for Acquire<'_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Acquire { .. }")
    }
}

/// Future returned by [`LlmBulkhead::acquire_owned`].
#[must_use = "futures do nothing unless polled"]
pub struct AcquireOwned {
    machine: Machine<'static, Arc<LlmCore>>,
}

impl AcquireOwned {
    /// The acquire of a call already resolved (by `run_shared`).
    /// Its refusals for the reasons in `untimed` are announced untimed (see
    /// [`Acquire::resolved`]).
    pub(crate) fn resolved(
        core: Arc<LlmCore>,
        call: Call,
        options: AcquireOptions,
        untimed: u8,
    ) -> AcquireOwned {
        AcquireOwned {
            machine: Machine::resolved(core, call, options, untimed),
        }
    }
}

impl Future for AcquireOwned {
    type Output = Result<OwnedPermit, AcquireError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if self.machine.is_new() {
            // The permit's own reference (dropped again if the call waits: the slow path).
            let core = Arc::clone(&self.machine.core);
            let timing = core.timing();
            // The engine's fast lane first, as `acquire`'s first poll: a call without a class
            // nobody times, resolved when the future was made.
            if timing.is_none()
                && let Step::Start { call, .. } = &self.machine.step
            {
                // A class call (its class resolved when the future was made, the default
                // class's included): the class lane, out of line.
                if call.class().is_some() {
                    return self.poll_class_lane(cx, core);
                }
                if let Some(grant) = core.engine().try_admit_unclassed_fast(call.ask()) {
                    let admission = call.admission(grant, None);
                    self.machine.step = Step::Done;
                    return Poll::Ready(Ok(OwnedPermit::new(core, admission)));
                }
            }
            return self.machine.start_in_place(
                cx,
                timing,
                move |admission| OwnedPermit::new(core, admission),
                |core, admission| OwnedPermit::new(Arc::clone(core), admission),
            );
        }
        let done = self.machine.poll_waiting(cx, false);
        done.map_ok(|admission| OwnedPermit::new(Arc::clone(&self.machine.core), admission))
    }
}

impl AcquireOwned {
    /// The first poll of a class call nobody times: the class lane (a call within its class's
    /// floors, on its class's word alone), else the general path. Out of line, so that the
    /// poll of a call without a class stays small. `core`: the permit's own reference.
    #[inline(never)]
    fn poll_class_lane(
        &mut self,
        cx: &mut Context<'_>,
        core: Arc<LlmCore>,
    ) -> Poll<Result<OwnedPermit, AcquireError>> {
        if let Step::Start { call, .. } = &self.machine.step
            && let Some(grant) = core.engine().try_admit_class_fast::<false>(call.ask())
        {
            let admission = call.admission(grant, None);
            self.machine.step = Step::Done;
            return Poll::Ready(Ok(OwnedPermit::new(core, admission)));
        }
        self.machine.start_in_place(
            cx,
            None,
            move |admission| OwnedPermit::new(core, admission),
            |core, admission| OwnedPermit::new(Arc::clone(core), admission),
        )
    }
}

impl fmt::Debug for AcquireOwned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AcquireOwned { .. }")
    }
}

/// Where an acquire is.
enum Step<'r> {
    /// Not polled yet, the request not resolved yet: [`acquire`](LlmBulkhead::acquire)'s
    /// future borrows its request and resolves it at the first poll, so that the resolved
    /// call goes from the estimate to the decision in registers. (A call resolved when the
    /// future is made is written into the future and read back at once by the first poll:
    /// about 3 ns of a 35 ns `acquire().await` + release, see benches/README.md "The async
    /// fast path".)
    Unresolved {
        request: &'r LlmRequest,
        options: AcquireOptions,
    },
    /// Not polled yet, the request resolved (the owned future, which cannot borrow it, the
    /// blocking acquires, and `run`, which needed the reservation first).
    Start {
        call: Call,
        bound: Bound,
        /// Refusals announced untimed (a bit per `RejectReason`; see `LlmCore::admit`).
        untimed: u8,
    },
    /// The input was invalid; reported at the first poll.
    Invalid(RequestError),
    /// In the queue: the wait's state, parked outside the future (see [`Parked`]). Dropped
    /// only by the two ways out of a wait (`finish_waiting`, `withdraw`), which take it out
    /// of the step: so the step has no drop glue, and an acquire's drop, inlined into every
    /// caller, is the one compare of `Machine`'s `Drop`.
    Waiting(ManuallyDrop<Parked>),
    /// Finished (returned a permit or an error).
    Done,
}

struct Waiting {
    /// The engine's queued wait (the one protocol both faces follow).
    queued: Queued,
    call: Call,
    /// When the call joined the queue, and when its decision started (the same instant if
    /// nobody listened to decisions when it arrived). Read for every queued call, listeners
    /// or not: whoever listens when the wait ends hears its outcome, with its queue wait.
    timing: Timing,
    /// The `llm_bulkhead.queue_wait` span, open while the call waits.
    #[cfg(feature = "tracing")]
    span: tracing::Span,
}

/// A wait's state, in a box of this thread's: outside the future, so that an acquire future
/// stays small (it is moved into every caller's own future on the fast path, where no call
/// waits), and without an allocation per wait once the thread is warm (a thread keeps up to
/// [`SPARE_PARKS`] empty boxes; `benches/tests/alloc.rs` checks it).
struct Parked(Option<Box<Option<Waiting>>>);

/// Empty boxes a thread keeps for waits to come.
#[cfg(not(loom))]
const SPARE_PARKS: usize = 32;

/// The spare boxes themselves (boxed: each is an allocation kept for a wait to reuse, which
/// a `Vec` of the states inline would not be).
#[cfg(not(loom))]
#[allow(clippy::vec_box)]
type Spares = Vec<Box<Option<Waiting>>>;

#[cfg(not(loom))]
std::thread_local! {
    static SPARE: core::cell::RefCell<Spares> = const { core::cell::RefCell::new(Vec::new()) };
}

impl Parked {
    #[cold]
    fn new(waiting: Waiting) -> Parked {
        #[cfg(not(loom))]
        let spare = SPARE
            .try_with(|spare| spare.try_borrow_mut().ok().and_then(|mut s| s.pop()))
            .ok()
            .flatten();
        #[cfg(loom)]
        let spare: Option<Box<Option<Waiting>>> = None;
        match spare {
            Some(mut parked) => {
                *parked = Some(waiting);
                Parked(Some(parked))
            }
            None => Parked(Some(Box::new(Some(waiting)))),
        }
    }
}

impl core::ops::Deref for Parked {
    type Target = Waiting;

    fn deref(&self) -> &Waiting {
        self.0
            .as_deref()
            .and_then(Option::as_ref)
            .expect("a parked wait until it is dropped")
    }
}

impl core::ops::DerefMut for Parked {
    fn deref_mut(&mut self) -> &mut Waiting {
        self.0
            .as_deref_mut()
            .and_then(Option::as_mut)
            .expect("a parked wait until it is dropped")
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        let Some(mut parked) = self.0.take() else {
            return;
        };
        // Its contents first (a waker, a timer registration: user code and locks), then the
        // empty box to the spares, outside both.
        drop(parked.take());
        #[cfg(not(loom))]
        let _ = SPARE.try_with(|spare| {
            if let Ok(mut spare) = spare.try_borrow_mut()
                && spare.len() < SPARE_PARKS
            {
                spare.push(parked);
            }
        });
        #[cfg(loom)]
        drop(parked);
    }
}

/// The state machine shared by both futures and both blocking variants (`'r`: the request
/// an unresolved acquire borrows).
struct Machine<'r, C: Deref<Target = LlmCore>> {
    core: C,
    step: Step<'r>,
}

impl<'r, C: Deref<Target = LlmCore>> Machine<'r, C> {
    #[inline]
    fn new(core: C, request: &LlmRequest, options: AcquireOptions) -> Machine<'r, C> {
        let step = match core.resolve(request, options) {
            Ok(call) => Step::Start {
                call,
                bound: core.bound(options),
                untimed: 0,
            },
            Err(error) => Step::Invalid(error),
        };
        Machine { core, step }
    }

    /// The acquire of `call`, resolved already, whose refusals for the reasons in `untimed` (a
    /// bit per `RejectReason`) are announced untimed.
    fn resolved(core: C, call: Call, options: AcquireOptions, untimed: u8) -> Machine<'r, C> {
        let bound = core.bound(options);
        Machine {
            core,
            step: Step::Start {
                call,
                bound,
                untimed,
            },
        }
    }

    /// Whether the acquire has not been polled yet.
    #[inline]
    fn is_new(&self) -> bool {
        matches!(
            self.step,
            Step::Unresolved { .. } | Step::Start { .. } | Step::Invalid(_)
        )
    }

    /// [`start`](Machine::start) for a future's first poll, building its output with
    /// `permit` in place when the call is admitted at once (the fast path: no intermediate
    /// result copied through the frames, see `LlmCore::admit_in_place`), with `later` when it
    /// is admitted on the slow path (decided again under the queue lock, or a call that just
    /// queued handed a slot before this poll returns).
    #[inline]
    fn start_in_place<P>(
        &mut self,
        cx: &mut Context<'_>,
        timing: Option<Timing>,
        permit: impl FnOnce(Admission) -> P,
        later: impl FnOnce(&C, Admission) -> P,
    ) -> Poll<Result<P, AcquireError>> {
        match &self.step {
            &Step::Unresolved { request, options } => {
                self.step = Step::Done;
                match self.core.resolve(request, options) {
                    Ok(call) => {
                        let bound = self.core.bound(options);
                        self.first_decision(cx, call, (bound, 0), timing, permit, later)
                    }
                    Err(error) => Poll::Ready(Err(AcquireError::Invalid(error))),
                }
            }
            &Step::Start {
                call,
                bound,
                untimed,
            } => {
                self.step = Step::Done;
                self.first_decision(cx, call, (bound, untimed), timing, permit, later)
            }
            Step::Invalid(_) => match core::mem::replace(&mut self.step, Step::Done) {
                Step::Invalid(error) => Poll::Ready(Err(AcquireError::Invalid(error))),
                _ => unreachable!(),
            },
            Step::Waiting(_) | Step::Done => unreachable!("only a new acquire starts"),
        }
    }

    /// The first decision of [`start_in_place`](Machine::start_in_place), `call` resolved.
    #[inline]
    fn first_decision<P>(
        &mut self,
        cx: &mut Context<'_>,
        call: Call,
        (bound, untimed): (Bound, u8),
        timing: Option<Timing>,
        permit: impl FnOnce(Admission) -> P,
        later: impl FnOnce(&C, Admission) -> P,
    ) -> Poll<Result<P, AcquireError>> {
        match self
            .core
            .admit_in_place(call, Wait::Async(cx.waker()), untimed, timing, permit)
        {
            Ok(permit) => Poll::Ready(Ok(permit)),
            // Admitted after all when decided again under the queue lock.
            Err(Admitted::Now(admission)) => Poll::Ready(Ok(later(&self.core, admission))),
            Err(Admitted::Refused(rejection)) => {
                Poll::Ready(Err(AcquireError::Rejected(rejection)))
            }
            Err(Admitted::Queued(waiter, timing)) => {
                self.wait(waiter, call, bound, timing, untimed);
                // Just queued, this task's waker registered before the waiter was (a
                // hand-off can still win against an immediate time-out).
                let done = self.poll_waiting(cx, true);
                done.map_ok(|admission| later(&self.core, admission))
            }
        }
    }

    /// Leaves `Start`/`Invalid`: either finished, or now `Waiting` (as a blocked thread if
    /// `blocking`).
    #[inline]
    fn start(&mut self, wait: Wait<'_>) -> Option<Result<Admission, AcquireError>> {
        // Matched by reference and left as it is unless it changes: moving the whole `Step`
        // out and back costs more than the decision on the fast path.
        match &self.step {
            &Step::Start {
                call,
                bound,
                untimed,
            } => {
                self.step = Step::Done;
                match self.core.admit(call, wait, untimed, self.core.timing()) {
                    Admitted::Now(admission) => Some(Ok(admission)),
                    Admitted::Refused(rejection) => Some(Err(AcquireError::Rejected(rejection))),
                    Admitted::Queued(waiter, timing) => {
                        self.wait(waiter, call, bound, timing, untimed);
                        None
                    }
                }
            }
            Step::Invalid(_) => match core::mem::replace(&mut self.step, Step::Done) {
                Step::Invalid(error) => Some(Err(AcquireError::Invalid(error))),
                _ => unreachable!(),
            },
            Step::Unresolved { .. } => unreachable!("a blocking acquire is resolved when made"),
            Step::Waiting(_) | Step::Done => None,
        }
    }

    /// Enters `Waiting` for a call that just joined the queue.
    #[cold]
    fn wait(
        &mut self,
        waiter: WaiterHandle,
        call: Call,
        bound: Bound,
        timing: Option<Timing>,
        untimed: u8,
    ) {
        // The wait is timed from the instant its deadline counts from. One clock read per
        // queued call (two with the `tokio` feature, whose sleep also reads tokio's clock):
        // the queue already took a lock and an allocation.
        let queued_at = Instant::now();
        // A timeout too large for the clock means no timeout.
        let queued = Queued::new(waiter, bound.sleep(queued_at));
        let timing = match timing {
            Some(timing) => timing.queued(queued_at),
            None => Timing::from_queue(queued_at).untimed(untimed),
        };
        self.step = Step::Waiting(ManuallyDrop::new(Parked::new(Waiting {
            queued,
            call,
            timing,
            #[cfg(feature = "tracing")]
            span: queue_wait_span(&self.core, &call),
        })));
    }

    /// Turns a decided wait into the acquire's result, announcing it to whoever listens now,
    /// subscribed before the call arrived or not.
    fn finish(
        &self,
        waiting: &Waiting,
        decided: Result<Grant, Rejection>,
    ) -> Result<Admission, AcquireError> {
        let picked_at = self.core.wants_decisions().then(Instant::now);
        // Events announced now are recorded inside the wait's span.
        #[cfg(feature = "tracing")]
        let _entered = waiting.span.enter();
        #[cfg(feature = "tracing")]
        record_outcome(&waiting.span, &decided);
        match decided {
            Ok(grant) => {
                let admission = waiting.call.admission(grant, Some(waiting.timing));
                self.core
                    .announce_admit(&admission, Some(waiting.timing), picked_at);
                Ok(admission)
            }
            Err(rejection) => {
                self.core.announce_reject(
                    &rejection,
                    waiting.call.class(),
                    Some(waiting.timing),
                    picked_at,
                );
                Err(AcquireError::Rejected(rejection))
            }
        }
    }

    /// A poll of the queued wait (`arrived`: by the poll that queued the call, whose waker
    /// is registered already); finishes the acquire once its outcome is known.
    #[cold]
    fn poll_waiting(
        &mut self,
        cx: &mut Context<'_>,
        arrived: bool,
    ) -> Poll<Result<Admission, AcquireError>> {
        let Step::Waiting(waiting) = &mut self.step else {
            panic!("`Acquire` polled after completion");
        };
        let engine = self.core.engine();
        let decided = if arrived {
            waiting.queued.poll_arrived(engine, cx)
        } else {
            waiting.queued.poll(engine, cx)
        };
        decided.map(|decided| self.finish_waiting(decided))
    }

    /// The queued wait's outcome as the acquire's result; the acquire is finished.
    fn finish_waiting(
        &mut self,
        decided: Result<Grant, Rejection>,
    ) -> Result<Admission, AcquireError> {
        let Step::Waiting(waiting) = core::mem::replace(&mut self.step, Step::Done) else {
            unreachable!("only a waiting acquire finishes its wait")
        };
        let waiting = ManuallyDrop::into_inner(waiting);
        self.finish(&waiting, decided)
    }

    /// Leaves the queue (the acquire was dropped while waiting), counted as `aborted`.
    #[cold]
    #[inline(never)]
    fn withdraw(&mut self) {
        let Step::Waiting(waiting) = core::mem::replace(&mut self.step, Step::Done) else {
            unreachable!()
        };
        let waiting = ManuallyDrop::into_inner(waiting);
        let picked_at = self.core.wants_decisions().then(Instant::now);
        let rejection = waiting.queued.withdraw(self.core.engine());
        #[cfg(feature = "tracing")]
        let _entered = waiting.span.enter();
        #[cfg(feature = "tracing")]
        waiting.span.record("outcome", rejection.reason().as_str());
        self.core.announce_reject(
            &rejection,
            waiting.call.class(),
            Some(waiting.timing),
            picked_at,
        );
    }

    /// The blocking equivalent of polling to completion.
    fn block(mut self) -> Result<Admission, AcquireError> {
        if let Some(done) = self.start(Wait::Blocking) {
            return done;
        }
        let Step::Waiting(waiting) = &mut self.step else {
            unreachable!("a call not finished at once waits")
        };
        let decided = waiting.queued.block(self.core.engine());
        self.finish_waiting(decided)
    }
}

impl<C: Deref<Target = LlmCore>> Drop for Machine<'_, C> {
    /// Only a waiting acquire has something to give back: the check is inlined into every
    /// acquire's drop (a finished one, the fast path's case, pays a compare), the withdrawal is
    /// not.
    #[inline]
    fn drop(&mut self) {
        if matches!(self.step, Step::Waiting(_)) {
            self.withdraw();
        }
    }
}

/// The span of a call's wait in the queue: `DEBUG` `llm_bulkhead.queue_wait`, with the call's
/// model, class, priority and tokens; its outcome (`admitted` and the admission id, or the
/// refusal's reason) is recorded when the wait ends.
#[cfg(feature = "tracing")]
#[cold]
fn queue_wait_span(core: &LlmCore, call: &Call) -> tracing::Span {
    tracing::debug_span!(
        target: "async_bulkhead_llm",
        "llm_bulkhead.queue_wait",
        model = core.model(),
        bulkhead = core.name(),
        tenant = core.tenant(),
        class = call.class().map(tracing::field::display),
        priority = call.ask().priority.as_str(),
        reserved_tokens = call.ask().reserved,
        outcome = tracing::field::Empty,
        admission_id = tracing::field::Empty,
    )
}

/// Records how a wait ended on its span.
#[cfg(feature = "tracing")]
fn record_outcome(span: &tracing::Span, decided: &Result<Grant, Rejection>) {
    match decided {
        Ok(grant) => {
            span.record("outcome", "admitted");
            span.record("admission_id", tracing::field::display(grant.id()));
        }
        Err(rejection) => {
            span.record("outcome", rejection.reason().as_str());
        }
    }
}
