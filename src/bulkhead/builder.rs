//! [`BulkheadBuilder`]: a [`Bulkhead`]'s configuration, validated by `build` (as the LLM
//! bulkhead's builder is).

use core::fmt;
use std::time::Duration;

use crate::engine::Engine;
use crate::support::sync::Arc;
use crate::vocabulary::limits::{Limits, MAX_CONCURRENT};

use super::error::{BulkheadConfigError, BulkheadError};
use super::face::Bulkhead;
use super::shared::{BulkheadCore, RejectHook};

/// The default queue length: 50 calls may wait for a slot.
pub const DEFAULT_MAX_QUEUE: u32 = 50;

/// The default queue timeout: a queued call gives up after 10 seconds. Waiting without a
/// bound is opt-in ([`BulkheadBuilder::wait_indefinitely`](crate::bulkhead::BulkheadBuilder::wait_indefinitely)), never the default: a caller
/// blocked forever behind a sick dependency is a blocked thread by another name.
pub const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_secs(10);

/// Builds a [`Bulkhead`]: from [`Bulkhead::builder`]; [`build`](BulkheadBuilder::build) checks
/// every setting before anything exists (as [`LlmBulkheadBuilder::build`](crate::LlmBulkheadBuilder::build)
/// does).
///
/// | Setting | Default |
/// |---|---|
/// | `max_concurrent` | (required, `1..=MAX_CONCURRENT`) |
/// | [`max_queue`](BulkheadBuilder::max_queue) | 50 ([`DEFAULT_MAX_QUEUE`](crate::bulkhead::DEFAULT_MAX_QUEUE)); 0 refuses at once; at most `u32::MAX` |
/// | [`queue_timeout`](BulkheadBuilder::queue_timeout) | 10 s ([`DEFAULT_QUEUE_TIMEOUT`](crate::bulkhead::DEFAULT_QUEUE_TIMEOUT)); [`wait_indefinitely`](BulkheadBuilder::wait_indefinitely) to opt out |
/// | [`on_reject`](BulkheadBuilder::on_reject) | none |
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use async_bulkhead_llm::Bulkhead;
///
/// let bulkhead = Bulkhead::builder(20)     // max in flight at any moment
///     .max_queue(100)                       // queue up to 100 excess calls
///     .queue_timeout(Duration::from_secs(3)) // refuse queued calls after 3 s
///     .build()?;
/// assert_eq!(bulkhead.limits().max_queue, 100);
/// # Ok::<(), async_bulkhead_llm::bulkhead::BulkheadConfigError>(())
/// ```
#[must_use = "a builder does nothing until `build` is called"]
pub struct BulkheadBuilder {
    max_concurrent: usize,
    max_queue: usize,
    queue_timeout: Option<Duration>,
    on_reject: Option<Box<RejectHook>>,
}

impl BulkheadBuilder {
    /// From [`Bulkhead::builder`]; `max_concurrent` is checked by `build`.
    pub(super) fn new(max_concurrent: usize) -> BulkheadBuilder {
        BulkheadBuilder {
            max_concurrent,
            max_queue: DEFAULT_MAX_QUEUE as usize,
            queue_timeout: Some(DEFAULT_QUEUE_TIMEOUT),
            on_reject: None,
        }
    }

    /// How many calls may wait for a slot (default 50). With 0 a call that finds every slot
    /// taken is refused at once ([`QueueFull`](BulkheadError::QueueFull)).
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::builder(1).max_queue(0).build()?;
    /// let _held = bulkhead.try_acquire()?;
    /// # futures::executor::block_on(async {
    /// assert!(bulkhead.acquire().await.is_err()); // refused, not queued
    /// # });
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn max_queue(mut self, max_queue: usize) -> BulkheadBuilder {
        self.max_queue = max_queue;
        self
    }

    /// How long a queued call waits for a slot before it is refused with
    /// [`QueueTimeout`](BulkheadError::QueueTimeout) (default 10 s). A call's own
    /// [`WaitOptions`](super::WaitOptions) can replace it with a timeout of its own and bound
    /// its wait with a deadline.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let bulkhead = async_bulkhead_llm::Bulkhead::builder(5)
    ///     .queue_timeout(Duration::from_secs(30))
    ///     .build()?;
    /// assert_eq!(bulkhead.queue_timeout(), Some(Duration::from_secs(30)));
    /// # Ok::<(), async_bulkhead_llm::bulkhead::BulkheadConfigError>(())
    /// ```
    pub fn queue_timeout(mut self, timeout: Duration) -> BulkheadBuilder {
        self.queue_timeout = Some(timeout);
        self
    }

    /// Lets queued calls wait for a slot as long as it takes (the original's
    /// `queueTimeoutMs: Infinity`). Opt in knowingly: a queued caller can then be held
    /// forever by a dependency that never answers. A call's own
    /// [`WaitOptions`](super::WaitOptions) still bound its wait.
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::builder(5).wait_indefinitely().build()?;
    /// assert_eq!(bulkhead.queue_timeout(), None);
    /// # Ok::<(), async_bulkhead_llm::bulkhead::BulkheadConfigError>(())
    /// ```
    pub fn wait_indefinitely(mut self) -> BulkheadBuilder {
        self.queue_timeout = None;
        self
    }

    /// Calls `hook` with every refusal (queue full, queue timeout, shutdown), synchronously,
    /// on the thread that sees it (for a queued call, where its future is polled), never under
    /// a lock of the bulkhead's. [`BulkheadError::state`] is the occupancy `{active, queued}`
    /// the refusal saw. A call that gives up by being dropped is not a refusal. A panicking
    /// hook is caught and counted in [`BulkheadStats::hook_panics`](crate::bulkhead::BulkheadStats).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use std::sync::Arc;
    /// use async_bulkhead_llm::{Bulkhead, bulkhead::BulkheadState};
    ///
    /// let rejected = Arc::new(AtomicU64::new(0));
    /// let seen = Arc::clone(&rejected);
    /// let bulkhead = Bulkhead::builder(1)
    ///     .max_queue(0)
    ///     .on_reject(move |error| {
    ///         let BulkheadState { active, queued, .. } = error.state();
    ///         assert_eq!((active, queued), (1, 0));
    ///         seen.fetch_add(1, Ordering::Relaxed);
    ///     })
    ///     .build()?;
    /// let _held = bulkhead.try_acquire()?;
    /// assert!(bulkhead.try_acquire().is_err());
    /// assert_eq!(rejected.load(Ordering::Relaxed), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn on_reject(
        mut self,
        hook: impl Fn(&BulkheadError) + Send + Sync + 'static,
    ) -> BulkheadBuilder {
        self.on_reject = Some(Box::new(hook));
        self
    }

    /// The bulkhead, with nothing in flight, at limits revision 0.
    ///
    /// # Errors
    ///
    /// [`BulkheadConfigError::ZeroMaxConcurrent`](crate::bulkhead::BulkheadConfigError::ZeroMaxConcurrent) for a `max_concurrent` of 0 (it would
    /// deadlock every call), `MaxConcurrentTooLarge` above
    /// [`MAX_CONCURRENT`](crate::limits::MAX_CONCURRENT), and `MaxQueueTooLarge` for a
    /// `max_queue` above `u32::MAX`; nothing is built.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::bulkhead::{Bulkhead, BulkheadConfigError};
    ///
    /// let bulkhead = Bulkhead::builder(3).build()?;
    /// assert_eq!(bulkhead.limits().max_concurrent, 3);
    /// assert_eq!(Bulkhead::builder(0).build().unwrap_err(), BulkheadConfigError::ZeroMaxConcurrent);
    /// assert_eq!(
    ///     Bulkhead::builder(1 << 20).build().unwrap_err(),
    ///     BulkheadConfigError::MaxConcurrentTooLarge { value: 1 << 20, max: 65_535 },
    /// );
    /// # Ok::<(), BulkheadConfigError>(())
    /// ```
    pub fn build(self) -> Result<Bulkhead, BulkheadConfigError> {
        let max_concurrent = check_max_concurrent(self.max_concurrent)?;
        let max_queue = check_max_queue(self.max_queue)?;
        let limits = Limits::new(0, max_concurrent).with_max_queue(max_queue);
        let engine = Engine::new(limits, 0);
        Ok(Bulkhead::from_core(Arc::new(BulkheadCore::new(
            engine,
            self.queue_timeout,
            self.on_reject,
        ))))
    }
}

impl fmt::Debug for BulkheadBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkheadBuilder")
            .field("max_concurrent", &self.max_concurrent)
            .field("max_queue", &self.max_queue)
            .field("queue_timeout", &self.queue_timeout)
            .field("on_reject", &self.on_reject.is_some())
            .finish()
    }
}

/// `max_concurrent` must be in `1..=MAX_CONCURRENT`.
pub(super) fn check_max_concurrent(max_concurrent: usize) -> Result<u32, BulkheadConfigError> {
    if max_concurrent == 0 {
        return Err(BulkheadConfigError::ZeroMaxConcurrent);
    }
    match u32::try_from(max_concurrent) {
        Ok(value) if value <= MAX_CONCURRENT => Ok(value),
        _ => Err(BulkheadConfigError::MaxConcurrentTooLarge {
            value: max_concurrent,
            max: MAX_CONCURRENT as usize,
        }),
    }
}

/// `max_queue` must fit the limits' `u32`.
pub(super) fn check_max_queue(max_queue: usize) -> Result<u32, BulkheadConfigError> {
    u32::try_from(max_queue).map_err(|_| BulkheadConfigError::MaxQueueTooLarge {
        value: max_queue,
        max: u32::MAX as usize,
    })
}

impl Bulkhead {
    /// A bulkhead of `max_concurrent` slots with the defaults: a queue of 50 places, a queue
    /// timeout of 10 seconds, no hook (`Bulkhead::builder(max_concurrent).build()`).
    ///
    /// # Errors
    ///
    /// As for [`BulkheadBuilder::build`](crate::bulkhead::BulkheadBuilder::build): [`BulkheadConfigError::ZeroMaxConcurrent`](crate::bulkhead::BulkheadConfigError::ZeroMaxConcurrent) for 0 (it
    /// would deadlock every call), `MaxConcurrentTooLarge` above
    /// [`MAX_CONCURRENT`](crate::limits::MAX_CONCURRENT).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::bulkhead::{Bulkhead, BulkheadConfigError};
    ///
    /// let bulkhead = Bulkhead::new(20)?;
    /// assert_eq!(bulkhead.limits().max_queue, 50);
    /// assert_eq!(bulkhead.queue_timeout(), Some(Duration::from_secs(10)));
    /// assert_eq!(Bulkhead::new(0).unwrap_err(), BulkheadConfigError::ZeroMaxConcurrent);
    /// # Ok::<(), BulkheadConfigError>(())
    /// ```
    pub fn new(max_concurrent: usize) -> Result<Bulkhead, BulkheadConfigError> {
        BulkheadBuilder::new(max_concurrent).build()
    }

    /// A builder for a bulkhead of `max_concurrent` slots (see [`BulkheadBuilder`](crate::bulkhead::BulkheadBuilder) for the
    /// other settings and their defaults); [`build`](BulkheadBuilder::build) checks them all.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::bulkhead::{Bulkhead, BulkheadConfigError};
    ///
    /// let bulkhead = Bulkhead::builder(20).max_queue(100).build()?;
    /// assert!(matches!(Bulkhead::builder(0).build(), Err(BulkheadConfigError::ZeroMaxConcurrent)));
    /// # Ok::<(), BulkheadConfigError>(())
    /// ```
    pub fn builder(max_concurrent: usize) -> BulkheadBuilder {
        BulkheadBuilder::new(max_concurrent)
    }
}
