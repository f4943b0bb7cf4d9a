//! Acquiring a slot of a [`Bulkhead`]: the waiting futures ([`BulkheadAcquire`],
//! [`BulkheadAcquireOwned`]), the blocking acquires, and `run`.
//!
//! An acquire first tries the engine's lock-free fast path. If no slot is free and the queue
//! has room it joins the engine's strictly FIFO queue at its first poll and waits to be
//! *handed* a slot by a release (nobody arriving later can take it first). The wait is bounded
//! by the bulkhead's queue timeout and by the call's own deadline, whichever comes first.
//! Dropping the future leaves the queue at once, holding nothing: a slot already handed to it
//! goes to the next waiter.
//!
//! The futures are `Unpin` (the waiter lives in an `Arc` shared with the queue). Both futures
//! and both blocking variants share one state machine (`Machine`).

use core::fmt;
use core::future::{Future, IntoFuture};
use core::mem::ManuallyDrop;
use core::ops::Deref;
use core::pin::Pin;
use core::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::engine::queued::Queued;
use crate::engine::timer::Bound;
use crate::engine::{Decision, Grant, Wait, WaiterHandle};
use crate::support::sync::Arc;
use crate::vocabulary::rejection::Rejection;

use super::error::BulkheadError;
use super::face::Bulkhead;
use super::options::WaitOptions;
use super::permit::{BulkheadPermit, OwnedBulkheadPermit};
use super::shared::{ASK, BulkheadCore};

impl Bulkhead {
    /// Takes a slot, waiting in the queue for one if none is free and the queue has room.
    ///
    /// When every slot is taken the call joins the FIFO queue (unless it is full:
    /// [`QueueFull`](BulkheadError::QueueFull)), and is handed the slot of the next release
    /// once every call queued before it has been served. It waits at most the bulkhead's
    /// [`queue_timeout`](Bulkhead::queue_timeout)
    /// ([`QueueTimeout`](BulkheadError::QueueTimeout)), and ends with
    /// [`Shutdown`](BulkheadError::Shutdown) if the bulkhead closes meanwhile. Nothing happens
    /// until the future is first polled; that poll takes the place in the queue.
    /// [`acquire_with`](Bulkhead::acquire_with) bounds the wait differently.
    ///
    /// # Errors
    ///
    /// [`BulkheadError::QueueFull`], [`BulkheadError::QueueTimeout`] or
    /// [`BulkheadError::Shutdown`]; none of them may be retried.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves the queue at once and holds no slot; a slot already handed
    /// to it goes to the next waiter.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::Bulkhead;
    ///
    /// # futures::executor::block_on(async {
    /// let bulkhead = Bulkhead::new(1)?;
    /// let first = bulkhead.acquire().await?;
    /// let mut second = bulkhead.acquire();
    /// assert!(futures::poll!(&mut second).is_pending()); // queued
    /// assert_eq!(bulkhead.state().queued, 1);
    /// drop(first); // hands the slot to the oldest queued call
    /// let _second = second.await?;
    /// assert_eq!(bulkhead.state().active, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn acquire(&self) -> BulkheadAcquire<'_> {
        self.acquire_with(WaitOptions::new())
    }

    /// Like [`acquire`](Bulkhead::acquire), the queue wait bounded by `options`: its
    /// [`timeout`](WaitOptions::timeout) instead of the bulkhead's queue timeout, and its
    /// [`deadline`](WaitOptions::deadline), whichever comes first. Running out of either is a
    /// [`QueueTimeout`](BulkheadError::QueueTimeout). A free slot is taken whatever the
    /// options say: they bound waiting only. (The LLM bulkhead's
    /// [`AcquireOptions`](crate::AcquireOptions) bound its waits the same way.)
    ///
    /// # Errors
    ///
    /// As for [`acquire`](Bulkhead::acquire).
    ///
    /// # Cancel safety
    ///
    /// As for [`acquire`](Bulkhead::acquire).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use async_bulkhead_llm::bulkhead::{Bulkhead, BulkheadError, WaitOptions};
    ///
    /// # futures::executor::block_on(async {
    /// let bulkhead = Bulkhead::builder(1).queue_timeout(Duration::from_secs(30)).build()?;
    /// let _held = bulkhead.acquire().await?;
    /// let deadline = Instant::now() + Duration::from_millis(20);
    /// let err = bulkhead.acquire_with(WaitOptions::new().deadline(deadline)).await.unwrap_err();
    /// assert!(matches!(err, BulkheadError::QueueTimeout { .. }));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn acquire_with(&self, options: WaitOptions) -> BulkheadAcquire<'_> {
        BulkheadAcquire {
            machine: Machine::new(&*self.core, options),
        }
    }

    /// Like [`acquire`](Bulkhead::acquire), resolving to an [`OwnedBulkheadPermit`](crate::bulkhead::OwnedBulkheadPermit); the
    /// future itself is `'static` and can be spawned.
    ///
    /// # Errors
    ///
    /// As for [`acquire`](Bulkhead::acquire).
    ///
    /// # Cancel safety
    ///
    /// As for [`acquire`](Bulkhead::acquire).
    ///
    /// # Examples
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// let bulkhead = async_bulkhead_llm::Bulkhead::new(2)?;
    /// let permit = bulkhead.acquire_owned().await?;
    /// std::thread::spawn(move || drop(permit)).join().unwrap();
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn acquire_owned(&self) -> BulkheadAcquireOwned {
        self.acquire_owned_with(WaitOptions::new())
    }

    /// Like [`acquire_with`](Bulkhead::acquire_with), resolving to an
    /// [`OwnedBulkheadPermit`](crate::bulkhead::OwnedBulkheadPermit).
    ///
    /// # Errors
    ///
    /// As for [`acquire`](Bulkhead::acquire).
    ///
    /// # Cancel safety
    ///
    /// As for [`acquire`](Bulkhead::acquire).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use async_bulkhead_llm::bulkhead::{Bulkhead, WaitOptions};
    ///
    /// # futures::executor::block_on(async {
    /// let bulkhead = Bulkhead::new(1)?;
    /// let options = WaitOptions::new().deadline(Instant::now() + Duration::from_secs(1));
    /// let permit = bulkhead.acquire_owned_with(options).await?;
    /// # drop(permit);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn acquire_owned_with(&self, options: WaitOptions) -> BulkheadAcquireOwned {
        BulkheadAcquireOwned {
            machine: Machine::new(Arc::clone(&self.core), options),
        }
    }

    /// Runs `call` under a slot: waits for one like [`acquire`](Bulkhead::acquire), awaits
    /// `call`, releases the slot (also if `call` panics or the returned future is dropped).
    /// A refused call is never started.
    ///
    /// # Errors
    ///
    /// As for [`acquire`](Bulkhead::acquire); `call`'s own output (a `Result` or not) is
    /// returned as it is inside `Ok`.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future while it waits leaves the queue; while `call` runs, drops `call`
    /// and releases the slot.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Bulkhead, BulkheadError};
    ///
    /// # futures::executor::block_on(async {
    /// let slow_api = Bulkhead::builder(5).max_queue(20).build()?;
    /// let body: Result<String, BulkheadError> = slow_api.run(async { "report".to_owned() }).await;
    /// assert_eq!(body?, "report");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn run<F: IntoFuture>(&self, call: F) -> Result<F::Output, BulkheadError> {
        self.run_with(WaitOptions::new(), call).await
    }

    /// Like [`run`](Bulkhead::run), the queue wait bounded by `options` (see
    /// [`acquire_with`](Bulkhead::acquire_with)). They do not cut `call` itself once it runs.
    ///
    /// # Errors
    ///
    /// As for [`acquire`](Bulkhead::acquire).
    ///
    /// # Cancel safety
    ///
    /// As for [`run`](Bulkhead::run).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::bulkhead::{Bulkhead, WaitOptions};
    ///
    /// # futures::executor::block_on(async {
    /// let bulkhead = Bulkhead::new(1)?;
    /// let options = WaitOptions::new().timeout(Duration::from_secs(2));
    /// assert_eq!(bulkhead.run_with(options, async { 7 }).await?, 7);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn run_with<F: IntoFuture>(
        &self,
        options: WaitOptions,
        call: F,
    ) -> Result<F::Output, BulkheadError> {
        let permit = self.acquire_with(options).await?;
        let output = call.await;
        drop(permit);
        Ok(output)
    }

    /// Like [`acquire`](Bulkhead::acquire), blocking the calling thread while it waits.
    ///
    /// # Errors
    ///
    /// As for [`acquire`](Bulkhead::acquire).
    ///
    /// # Blocking
    ///
    /// Parks the thread until a slot is handed over, the wait times out or the bulkhead
    /// closes. Do not call it from async code: use [`acquire`](Bulkhead::acquire).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::{Bulkhead, BulkheadError};
    ///
    /// let bulkhead = Bulkhead::builder(1).queue_timeout(Duration::from_millis(10)).build()?;
    /// let held = bulkhead.acquire_blocking()?;
    /// let err = bulkhead.acquire_blocking().unwrap_err();
    /// assert!(matches!(err, BulkheadError::QueueTimeout { .. }));
    /// # drop(held);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn acquire_blocking(&self) -> Result<BulkheadPermit<'_>, BulkheadError> {
        self.acquire_blocking_with(WaitOptions::new())
    }

    /// Like [`acquire_blocking`](Bulkhead::acquire_blocking), the wait bounded by `options`
    /// (see [`acquire_with`](Bulkhead::acquire_with)).
    ///
    /// # Errors
    ///
    /// As for [`acquire`](Bulkhead::acquire).
    ///
    /// # Blocking
    ///
    /// As for [`acquire_blocking`](Bulkhead::acquire_blocking).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use async_bulkhead_llm::bulkhead::{Bulkhead, WaitOptions};
    ///
    /// let bulkhead = Bulkhead::new(1)?;
    /// let _held = bulkhead.acquire_blocking()?;
    /// let deadline = Instant::now() + Duration::from_millis(10);
    /// assert!(bulkhead.acquire_blocking_with(WaitOptions::new().deadline(deadline)).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn acquire_blocking_with(
        &self,
        options: WaitOptions,
    ) -> Result<BulkheadPermit<'_>, BulkheadError> {
        let core = &*self.core;
        Machine::new(core, options)
            .block()
            .map(|grant| BulkheadPermit::new(core, grant))
    }

    /// Like [`acquire_blocking`](Bulkhead::acquire_blocking), returning an
    /// [`OwnedBulkheadPermit`](crate::bulkhead::OwnedBulkheadPermit).
    ///
    /// # Errors
    ///
    /// As for [`acquire`](Bulkhead::acquire).
    ///
    /// # Blocking
    ///
    /// As for [`acquire_blocking`](Bulkhead::acquire_blocking).
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::new(1)?;
    /// let permit = bulkhead.acquire_blocking_owned()?;
    /// std::thread::spawn(move || drop(permit)).join().unwrap();
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn acquire_blocking_owned(&self) -> Result<OwnedBulkheadPermit, BulkheadError> {
        self.acquire_blocking_owned_with(WaitOptions::new())
    }

    /// Like [`acquire_blocking_with`](Bulkhead::acquire_blocking_with), returning an
    /// [`OwnedBulkheadPermit`](crate::bulkhead::OwnedBulkheadPermit).
    ///
    /// # Errors
    ///
    /// As for [`acquire`](Bulkhead::acquire).
    ///
    /// # Blocking
    ///
    /// As for [`acquire_blocking`](Bulkhead::acquire_blocking).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::bulkhead::{Bulkhead, WaitOptions};
    ///
    /// let bulkhead = Bulkhead::new(1)?;
    /// let options = WaitOptions::new().timeout(Duration::from_millis(50));
    /// let permit = bulkhead.acquire_blocking_owned_with(options)?;
    /// std::thread::spawn(move || drop(permit)).join().unwrap();
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn acquire_blocking_owned_with(
        &self,
        options: WaitOptions,
    ) -> Result<OwnedBulkheadPermit, BulkheadError> {
        let core = Arc::clone(&self.core);
        Machine::new(Arc::clone(&core), options)
            .block()
            .map(|grant| OwnedBulkheadPermit::new(core, grant))
    }
}

/// Future returned by [`Bulkhead::acquire`] and [`Bulkhead::acquire_with`].
#[must_use = "futures do nothing unless polled"]
pub struct BulkheadAcquire<'a> {
    machine: Machine<&'a BulkheadCore>,
}

impl<'a> Future for BulkheadAcquire<'a> {
    type Output = Result<BulkheadPermit<'a>, BulkheadError>;

    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let core = self.machine.core;
        // The first poll's fast lane, on its own way out: the permit is built where the
        // future returns it (carried out as a grant, it was copied right after the stores
        // that made it, which stalls the CPU's store forwarding).
        if matches!(self.machine.step, Step::Start { .. })
            && let Some(grant) = core.engine().try_admit_fast(ASK)
        {
            self.machine.step = Step::Done;
            return Poll::Ready(Ok(BulkheadPermit::new(core, grant)));
        }
        self.poll_general(cx)
    }
}

impl<'a> BulkheadAcquire<'a> {
    /// [`poll`](Future::poll) beyond the first poll's fast lane: the first decision on the
    /// general path (which tries the lane once more: a call that missed it was refused or
    /// queues, where a few instructions do not show), or the wait. Out of line, so that the
    /// fast lane stays small.
    #[inline(never)]
    fn poll_general(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<BulkheadPermit<'a>, BulkheadError>> {
        let core = self.machine.core;
        self.machine
            .poll(cx)
            .map_ok(|grant| BulkheadPermit::new(core, grant))
    }
}

impl fmt::Debug for BulkheadAcquire<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BulkheadAcquire { .. }")
    }
}

/// Future returned by [`Bulkhead::acquire_owned`] and [`Bulkhead::acquire_owned_with`].
#[must_use = "futures do nothing unless polled"]
pub struct BulkheadAcquireOwned {
    machine: Machine<Arc<BulkheadCore>>,
}

impl Future for BulkheadAcquireOwned {
    type Output = Result<OwnedBulkheadPermit, BulkheadError>;

    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // As `BulkheadAcquire`'s.
        if matches!(self.machine.step, Step::Start { .. })
            && let Some(grant) = self.machine.core.engine().try_admit_fast(ASK)
        {
            self.machine.step = Step::Done;
            let core = Arc::clone(&self.machine.core);
            return Poll::Ready(Ok(OwnedBulkheadPermit::new(core, grant)));
        }
        self.poll_general(cx)
    }
}

impl BulkheadAcquireOwned {
    /// As [`BulkheadAcquire`]'s: beyond the first poll's fast lane, out of line.
    #[inline(never)]
    fn poll_general(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<OwnedBulkheadPermit, BulkheadError>> {
        match self.machine.poll(cx) {
            Poll::Ready(Ok(grant)) => Poll::Ready(Ok(OwnedBulkheadPermit::new(
                Arc::clone(&self.machine.core),
                grant,
            ))),
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl fmt::Debug for BulkheadAcquireOwned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BulkheadAcquireOwned { .. }")
    }
}

/// Where an acquire is.
enum Step {
    /// Not polled yet.
    Start { options: WaitOptions },
    /// In the queue. Dropped only by the two ways out of a wait (`finish`, `Machine`'s
    /// drop), which take it out of the step: so the step has no drop glue, and leaving
    /// `Start` or `Waiting` writes the step without a call to a drop.
    Waiting(ManuallyDrop<Waiting>),
    /// Finished (returned a permit or an error).
    Done,
}

struct Waiting {
    /// The engine's queued wait (the one protocol both faces follow).
    queued: Queued,
    /// When the call joined the queue (read only if its wait can end in a timeout).
    queued_at: Option<Instant>,
}

/// The state machine shared by both futures and the blocking acquires: the first decision,
/// then the engine's queued wait, its outcome turned into a grant or a `BulkheadError`.
struct Machine<C: Deref<Target = BulkheadCore>> {
    core: C,
    step: Step,
}

impl<C: Deref<Target = BulkheadCore>> Machine<C> {
    #[inline]
    fn new(core: C, options: WaitOptions) -> Machine<C> {
        Machine {
            core,
            step: Step::Start { options },
        }
    }

    /// Leaves `Start`: finished, or now `Waiting` (as a parked thread if `blocking`).
    #[inline]
    fn start(&mut self, wait: Wait<'_>) -> Option<Result<Grant, BulkheadError>> {
        let Step::Start { options } = self.step else {
            return None;
        };
        self.step = Step::Done;
        // The fast lane first, as `try_acquire`'s (nothing to queue when it admits).
        if let Some(grant) = self.core.engine().try_admit_fast(ASK) {
            return Some(Ok(grant));
        }
        match self.core.engine().admit(ASK, wait) {
            Decision::Admitted(grant) => Some(Ok(grant)),
            Decision::Refused(rejection) => {
                Some(Err(self.core.refused(&rejection, Duration::ZERO)))
            }
            Decision::Queued(waiter) => {
                self.wait(waiter, options);
                None
            }
        }
    }

    /// Enters `Waiting` for a call that just joined the queue: its wait ends at its timeout
    /// (the options', else the bulkhead's queue timeout) or its deadline, whichever comes
    /// first (a past deadline ends it at once).
    #[cold]
    fn wait(&mut self, waiter: WaiterHandle, options: WaitOptions) {
        let bound = Bound {
            timeout: options.timeout.or(self.core.queue_timeout()),
            deadline: options.deadline,
        };
        // No end to the wait: no clock to read (a clock read costs as much as the rest of
        // joining the queue on some virtual machines).
        let queued_at = bound.is_bounded().then(Instant::now);
        let sleep = queued_at.and_then(|at| bound.sleep(at));
        self.step = Step::Waiting(ManuallyDrop::new(Waiting {
            queued: Queued::new(waiter, sleep),
            queued_at,
        }));
    }

    /// Turns the wait's outcome into the acquire's (a refusal announced to the hook, with how
    /// long the call waited); the acquire is finished.
    fn finish(&mut self, decided: Result<Grant, Rejection>) -> Result<Grant, BulkheadError> {
        let Step::Waiting(waiting) = core::mem::replace(&mut self.step, Step::Done) else {
            unreachable!("only a waiting acquire finishes its wait")
        };
        let waiting = ManuallyDrop::into_inner(waiting);
        decided.map_err(|rejection| {
            let waited = waiting.queued_at.map_or(Duration::ZERO, |at| at.elapsed());
            self.core.refused(&rejection, waited)
        })
    }

    /// Polls the acquire: the first poll decides (admitted, refused or queued); later polls
    /// follow the queued wait.
    #[inline]
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<Grant, BulkheadError>> {
        if matches!(self.step, Step::Start { .. }) {
            return match self.start(Wait::Async(cx.waker())) {
                Some(done) => Poll::Ready(done),
                None => self.poll_waiting(cx, true),
            };
        }
        self.poll_waiting(cx, false)
    }

    /// A poll of the queued wait (`arrived`: by the poll that queued the call, whose waker
    /// is registered already).
    #[cold]
    fn poll_waiting(
        &mut self,
        cx: &mut Context<'_>,
        arrived: bool,
    ) -> Poll<Result<Grant, BulkheadError>> {
        let Step::Waiting(waiting) = &mut self.step else {
            panic!("`BulkheadAcquire` polled after completion");
        };
        let engine = self.core.engine();
        let decided = if arrived {
            waiting.queued.poll_arrived(engine, cx)
        } else {
            waiting.queued.poll(engine, cx)
        };
        decided.map(|decided| self.finish(decided))
    }

    /// The blocking equivalent of polling to completion.
    fn block(mut self) -> Result<Grant, BulkheadError> {
        if let Some(done) = self.start(Wait::Blocking) {
            return done;
        }
        let Step::Waiting(waiting) = &mut self.step else {
            unreachable!("a call not finished at once waits")
        };
        let decided = waiting.queued.block(self.core.engine());
        self.finish(decided)
    }
}

impl<C: Deref<Target = BulkheadCore>> Machine<C> {
    /// Leaves the queue (the acquire was dropped while waiting), counted as aborted; a slot
    /// already handed over goes on to the next waiter. Not a refusal: the hook does not hear
    /// it.
    #[cold]
    #[inline(never)]
    fn withdraw(&mut self) {
        if let Step::Waiting(waiting) = core::mem::replace(&mut self.step, Step::Done) {
            let waiting = ManuallyDrop::into_inner(waiting);
            let _ = waiting.queued.withdraw(self.core.engine());
        }
    }
}

impl<C: Deref<Target = BulkheadCore>> Drop for Machine<C> {
    /// Only a waiting acquire has something to give back: the check is inlined into every
    /// acquire's drop, the withdrawal is not.
    #[inline]
    fn drop(&mut self) {
        if matches!(self.step, Step::Waiting(_)) {
            self.withdraw();
        }
    }
}
