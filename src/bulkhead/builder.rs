//! [`BulkheadBuilder`]: a [`Bulkhead`]'s configuration, validated where each value is set.

use core::fmt;
use std::time::Duration;

use crate::engine::Engine;
use crate::engine::limits::{Limits, MAX_CONCURRENT};
use crate::sync::Arc;

use super::Bulkhead;
use super::core::{BulkheadCore, RejectHook};
use super::error::{BulkheadConfigError, BulkheadError};

/// The default queue length: 50 calls may wait for a slot.
pub const DEFAULT_MAX_QUEUE: u32 = 50;

/// The default queue timeout: a queued call gives up after 10 seconds. Waiting without a
/// bound is opt-in ([`BulkheadBuilder::wait_indefinitely`]), never the default: a caller
/// blocked forever behind a sick dependency is a blocked thread by another name.
pub const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_secs(10);

/// Builds a [`Bulkhead`]: from [`Bulkhead::builder`], which checks `max_concurrent`; every
/// other setting is valid as given, so [`build`](BulkheadBuilder::build) cannot fail.
///
/// | Setting | Default |
/// |---|---|
/// | `max_concurrent` | (required, `1..=MAX_CONCURRENT`) |
/// | [`max_queue`](BulkheadBuilder::max_queue) | 50 ([`DEFAULT_MAX_QUEUE`]); 0 refuses at once |
/// | [`queue_timeout`](BulkheadBuilder::queue_timeout) | 10 s ([`DEFAULT_QUEUE_TIMEOUT`]); [`wait_indefinitely`](BulkheadBuilder::wait_indefinitely) to opt out |
/// | [`on_reject`](BulkheadBuilder::on_reject) | none |
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use async_bulkhead_llm::Bulkhead;
///
/// let bulkhead = Bulkhead::builder(20)?    // max in flight at any moment
///     .max_queue(100)                       // queue up to 100 excess calls
///     .queue_timeout(Duration::from_secs(3)) // refuse queued calls after 3 s
///     .build();
/// assert_eq!(bulkhead.limits().max_queue, 100);
/// # Ok::<(), async_bulkhead_llm::BulkheadConfigError>(())
/// ```
#[must_use = "a builder does nothing until `build` is called"]
pub struct BulkheadBuilder {
    max_concurrent: u32,
    max_queue: u32,
    queue_timeout: Option<Duration>,
    on_reject: Option<Box<RejectHook>>,
}

impl BulkheadBuilder {
    /// Checked by [`Bulkhead::builder`].
    pub(super) fn new(max_concurrent: u32) -> Result<BulkheadBuilder, BulkheadConfigError> {
        check_max_concurrent(max_concurrent)?;
        Ok(BulkheadBuilder {
            max_concurrent,
            max_queue: DEFAULT_MAX_QUEUE,
            queue_timeout: Some(DEFAULT_QUEUE_TIMEOUT),
            on_reject: None,
        })
    }

    /// How many calls may wait for a slot (default 50). With 0 a call that finds every slot
    /// taken is refused at once ([`QueueFull`](BulkheadError::QueueFull)).
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::builder(1)?.max_queue(0).build();
    /// let _held = bulkhead.try_acquire()?;
    /// # futures::executor::block_on(async {
    /// assert!(bulkhead.acquire().await.is_err()); // refused, not queued
    /// # });
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn max_queue(mut self, max_queue: u32) -> BulkheadBuilder {
        self.max_queue = max_queue;
        self
    }

    /// How long a queued call waits for a slot before it is refused with
    /// [`QueueTimeout`](BulkheadError::QueueTimeout) (default 10 s). A call's own deadline
    /// ([`acquire_by`](Bulkhead::acquire_by)) can shorten its wait, never lengthen it.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let bulkhead = async_bulkhead_llm::Bulkhead::builder(5)?
    ///     .queue_timeout(Duration::from_secs(30))
    ///     .build();
    /// assert_eq!(bulkhead.queue_timeout(), Some(Duration::from_secs(30)));
    /// # Ok::<(), async_bulkhead_llm::BulkheadConfigError>(())
    /// ```
    pub fn queue_timeout(mut self, timeout: Duration) -> BulkheadBuilder {
        self.queue_timeout = Some(timeout);
        self
    }

    /// Lets queued calls wait for a slot as long as it takes (the original's
    /// `queueTimeoutMs: Infinity`). Opt in knowingly: a queued caller can then be held
    /// forever by a dependency that never answers. A call's deadline
    /// ([`acquire_by`](Bulkhead::acquire_by)) still bounds its own wait.
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::builder(5)?.wait_indefinitely().build();
    /// assert_eq!(bulkhead.queue_timeout(), None);
    /// # Ok::<(), async_bulkhead_llm::BulkheadConfigError>(())
    /// ```
    pub fn wait_indefinitely(mut self) -> BulkheadBuilder {
        self.queue_timeout = None;
        self
    }

    /// Calls `hook` with every refusal (queue full, queue timeout, shutdown), synchronously,
    /// on the thread that sees it (for a queued call, where its future is polled), never under
    /// a lock of the bulkhead's. [`BulkheadError::state`] is the occupancy `{active, queued}`
    /// the refusal saw. A call that gives up by being dropped is not a refusal. A panicking
    /// hook is caught and counted in [`BulkheadStats::hook_panics`](crate::BulkheadStats).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use std::sync::Arc;
    /// use async_bulkhead_llm::{Bulkhead, BulkheadState};
    ///
    /// let rejected = Arc::new(AtomicU64::new(0));
    /// let seen = Arc::clone(&rejected);
    /// let bulkhead = Bulkhead::builder(1)?
    ///     .max_queue(0)
    ///     .on_reject(move |error| {
    ///         let BulkheadState { active, queued, .. } = error.state();
    ///         assert_eq!((active, queued), (1, 0));
    ///         seen.fetch_add(1, Ordering::Relaxed);
    ///     })
    ///     .build();
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
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::builder(3)?.build();
    /// assert_eq!(bulkhead.limits().max_concurrent, 3);
    /// # Ok::<(), async_bulkhead_llm::BulkheadConfigError>(())
    /// ```
    pub fn build(self) -> Bulkhead {
        let limits = Limits::new(0, self.max_concurrent).with_max_queue(self.max_queue);
        let engine = Engine::new(limits, 0);
        Bulkhead::from_core(Arc::new(BulkheadCore::new(
            engine,
            self.queue_timeout,
            self.on_reject,
        )))
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
pub(super) fn check_max_concurrent(max_concurrent: u32) -> Result<(), BulkheadConfigError> {
    if max_concurrent == 0 {
        return Err(BulkheadConfigError::ZeroMaxConcurrent);
    }
    if max_concurrent > MAX_CONCURRENT {
        return Err(BulkheadConfigError::MaxConcurrentTooLarge {
            value: max_concurrent,
            max: MAX_CONCURRENT,
        });
    }
    Ok(())
}
