//! [`Bulkhead`]: the general bulkhead's handle, its fail-fast acquires, its state, close and
//! drain. The waiting acquires are in `acquire`, the limits in `limits`, the statistics in
//! `stats`, construction in `builder`.

use core::fmt;
use std::time::Duration;

use crate::engine::drain::{Drain, DrainTimeout};
use crate::support::sync::Arc;

use super::error::{BulkheadError, BulkheadState};
use super::permit::{BulkheadPermit, OwnedBulkheadPermit};
use super::shared::{ASK, BulkheadCore};

/// A bulkhead for any dependency: at most `max_concurrent` calls run at once; the excess waits
/// in a FIFO queue of `max_queue` places for at most the queue timeout, and beyond that is
/// refused at once. Refusals are [`BulkheadError`]s, never to be retried.
///
/// Cheap to clone (an `Arc`): clones share the slots. A call that finds a slot free is admitted
/// with one lock-free compare-and-swap, and a release with nobody queued is one wait-free
/// `fetch_sub`; queueing, and a release handing its slot to the oldest queued call, take the
/// queue's short lock.
///
/// | | |
/// |---|---|
/// | fail fast | [`try_acquire`](Bulkhead::try_acquire), [`try_acquire_owned`](Bulkhead::try_acquire_owned) |
/// | wait in the queue | [`acquire`](Bulkhead::acquire), [`acquire_with`](Bulkhead::acquire_with) (a timeout or deadline of its own), the `_owned` variants |
/// | run a future under a slot | [`run`](Bulkhead::run), [`run_with`](Bulkhead::run_with) |
/// | threads | [`acquire_blocking`](Bulkhead::acquire_blocking), [`acquire_blocking_with`](Bulkhead::acquire_blocking_with), the `_owned` variants |
/// | observe | [`state`](Bulkhead::state), [`stats`](Bulkhead::stats), [`on_reject`](super::BulkheadBuilder::on_reject) |
/// | operate | [`apply_limits`](Bulkhead::apply_limits), [`set_max_concurrent`](Bulkhead::set_max_concurrent), [`close`](Bulkhead::close), [`drain`](Bulkhead::drain) |
///
/// # Examples
///
/// A slow dependency capped at 5 calls cannot starve a fast one:
///
/// ```
/// use async_bulkhead_llm::Bulkhead;
///
/// # futures::executor::block_on(async {
/// let slow_api = Bulkhead::builder(5).max_queue(20).build()?;
/// let fast_api = Bulkhead::builder(50).max_queue(200).build()?;
///
/// let stuck: Vec<_> = (0..5).map(|_| slow_api.try_acquire()).collect::<Result<_, _>>()?;
/// assert!(slow_api.try_acquire().is_err()); // the slow API is at its cap...
/// let answer = fast_api.run(async { "fast" }).await?; // ...the fast one is unaffected
/// assert_eq!(answer, "fast");
/// # drop(stuck);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct Bulkhead {
    pub(super) core: Arc<BulkheadCore>,
}

impl Bulkhead {
    pub(super) fn from_core(core: Arc<BulkheadCore>) -> Bulkhead {
        Bulkhead { core }
    }

    /// Takes a free slot now, or refuses now: never waits. A call that finds every slot taken,
    /// or calls already queued (it may not pass them), is refused with
    /// [`QueueFull`](BulkheadError::QueueFull): to a call that may not wait, the queue is
    /// always full.
    ///
    /// # Errors
    ///
    /// [`BulkheadError::QueueFull`] or [`BulkheadError::Shutdown`].
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Bulkhead, BulkheadError};
    ///
    /// let bulkhead = Bulkhead::new(1)?;
    /// let permit = bulkhead.try_acquire()?;
    /// assert!(matches!(bulkhead.try_acquire(), Err(BulkheadError::QueueFull { .. })));
    /// drop(permit);
    /// assert!(bulkhead.try_acquire().is_ok());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn try_acquire(&self) -> Result<BulkheadPermit<'_>, BulkheadError> {
        let core = &*self.core;
        // The engine's fast lane first (a free slot, nobody queued, no change of limits under
        // way: the LLM bulkhead's lane without a budget); everything else out of line.
        match core.engine().try_admit_fast(ASK) {
            Some(grant) => Ok(BulkheadPermit::new(core, grant)),
            None => self.try_acquire_general(),
        }
    }

    /// [`try_acquire`](Bulkhead::try_acquire) beyond its fast lane: the engine's general
    /// decision, a refusal included (its snapshot, the reject hook).
    #[inline(never)]
    fn try_acquire_general(&self) -> Result<BulkheadPermit<'_>, BulkheadError> {
        let core = &*self.core;
        core.engine().try_admit(
            ASK,
            |grant| BulkheadPermit::new(core, grant),
            |rejection| core.refused(&rejection, Duration::ZERO),
        )
    }

    /// Like [`try_acquire`](Bulkhead::try_acquire), returning an [`OwnedBulkheadPermit`](crate::bulkhead::OwnedBulkheadPermit).
    ///
    /// # Errors
    ///
    /// As for [`try_acquire`](Bulkhead::try_acquire).
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::new(1)?;
    /// let permit = bulkhead.try_acquire_owned()?;
    /// std::thread::spawn(move || drop(permit)).join().unwrap();
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn try_acquire_owned(&self) -> Result<OwnedBulkheadPermit, BulkheadError> {
        let core = &self.core;
        // As `try_acquire`.
        match core.engine().try_admit_fast(ASK) {
            Some(grant) => Ok(OwnedBulkheadPermit::new(Arc::clone(core), grant)),
            None => self.try_acquire_owned_general(),
        }
    }

    /// [`try_acquire_owned`](Bulkhead::try_acquire_owned) beyond its fast lane.
    #[inline(never)]
    fn try_acquire_owned_general(&self) -> Result<OwnedBulkheadPermit, BulkheadError> {
        let core = &self.core;
        core.engine().try_admit(
            ASK,
            |grant| OwnedBulkheadPermit::new(Arc::clone(core), grant),
            |rejection| core.refused(&rejection, Duration::ZERO),
        )
    }

    /// The live occupancy: calls holding a slot and calls queued (two loads, no lock).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Bulkhead, bulkhead::BulkheadState};
    ///
    /// let bulkhead = Bulkhead::new(3)?;
    /// let _a = bulkhead.try_acquire()?;
    /// assert_eq!(bulkhead.state(), BulkheadState::new(1, 0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn state(&self) -> BulkheadState {
        self.core.state()
    }

    /// The queue timeout (`None` if built with
    /// [`wait_indefinitely`](super::BulkheadBuilder::wait_indefinitely)).
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::new(1)?;
    /// assert_eq!(bulkhead.queue_timeout(), Some(std::time::Duration::from_secs(10)));
    /// # Ok::<(), async_bulkhead_llm::bulkhead::BulkheadConfigError>(())
    /// ```
    pub fn queue_timeout(&self) -> Option<Duration> {
        self.core.queue_timeout()
    }

    /// Closes the bulkhead: every later call is refused with
    /// [`Shutdown`](BulkheadError::Shutdown), and so is every queued call (at once). Calls in
    /// flight keep their slots until they release. Returns whether this call closed it.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Bulkhead, BulkheadError};
    ///
    /// let bulkhead = Bulkhead::new(1)?;
    /// let held = bulkhead.try_acquire()?;
    /// assert!(bulkhead.close());
    /// assert!(!bulkhead.close());
    /// assert!(matches!(bulkhead.try_acquire(), Err(BulkheadError::Shutdown { .. })));
    /// drop(held);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn close(&self) -> bool {
        self.core.engine().close()
    }

    /// Whether [`close`](Bulkhead::close) has been called.
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::new(1)?;
    /// bulkhead.close();
    /// assert!(bulkhead.is_closed());
    /// # Ok::<(), async_bulkhead_llm::bulkhead::BulkheadConfigError>(())
    /// ```
    pub fn is_closed(&self) -> bool {
        self.core.engine().is_closed()
    }

    /// Resolves once nothing is in flight and nobody is queued (at once if so now). With
    /// [`close`](Bulkhead::close) first, a graceful shutdown.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropping the future only stops waiting.
    ///
    /// # Examples
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// let bulkhead = async_bulkhead_llm::Bulkhead::new(1)?;
    /// let permit = bulkhead.try_acquire_owned()?;
    /// bulkhead.close();
    /// std::thread::spawn(move || drop(permit));
    /// bulkhead.drain().await;
    /// assert_eq!(bulkhead.state().active, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn drain(&self) -> Drain<'_> {
        self.core.engine().drain()
    }

    /// Like [`drain`](Bulkhead::drain), giving up at `timeout` and reporting what was still
    /// in flight and queued.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropping the future only stops waiting.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// # futures::executor::block_on(async {
    /// let bulkhead = async_bulkhead_llm::Bulkhead::new(1)?;
    /// let _held = bulkhead.try_acquire()?;
    /// let report = bulkhead.drain_timeout(Duration::from_millis(5)).await;
    /// assert!(!report.drained);
    /// assert_eq!(report.in_flight, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn drain_timeout(&self, timeout: Duration) -> DrainTimeout<'_> {
        self.core.engine().drain().within(timeout)
    }
}

impl fmt::Debug for Bulkhead {
    /// Never blocks: reads the admission word and the published limits only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.core, f)
    }
}

impl OwnedBulkheadPermit {
    /// The bulkhead the permit belongs to.
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::new(2)?;
    /// let permit = bulkhead.try_acquire_owned()?;
    /// assert_eq!(permit.bulkhead().state().active, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn bulkhead(&self) -> Bulkhead {
        Bulkhead::from_core(Arc::clone(self.shared_core()))
    }
}
