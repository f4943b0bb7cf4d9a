//! [`BulkheadStats`]: a [`Bulkhead`]'s live figures and cumulative counters, read at one
//! moment.

use crate::vocabulary::rejection::RejectReason;

use super::face::Bulkhead;
use super::limits::BulkheadLimits;

/// A snapshot of a [`Bulkhead`]: its limits, its occupancy and what it has done so far.
/// Every counter only ever grows.
///
/// The counters satisfy, at any moment the callers are quiet (no call between its decision
/// and its return): `admitted == released + active`, and every call that reached a decision
/// is counted once in `admitted`, `rejected_queue_full`, `timed_out`, `rejected_shutdown` or
/// `cancelled`.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::Bulkhead;
///
/// let bulkhead = Bulkhead::builder(1).max_queue(0).build()?;
/// let held = bulkhead.try_acquire()?;
/// assert!(bulkhead.try_acquire().is_err());
/// drop(held);
/// let stats = bulkhead.stats();
/// assert_eq!((stats.admitted, stats.released, stats.rejected_queue_full), (1, 1, 1));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct BulkheadStats {
    /// The limits in force.
    pub limits: BulkheadLimits,
    /// Whether `close()` has been called.
    pub closed: bool,
    /// Calls holding a slot.
    pub active: u64,
    /// Calls waiting for a slot.
    pub queued: u64,
    /// Calls admitted so far (at once or from the queue).
    pub admitted: u64,
    /// Slots released so far.
    pub released: u64,
    /// Calls refused with [`QueueFull`](crate::BulkheadError::QueueFull).
    pub rejected_queue_full: u64,
    /// Queued calls refused with [`QueueTimeout`](crate::BulkheadError::QueueTimeout).
    pub timed_out: u64,
    /// Calls refused with [`Shutdown`](crate::BulkheadError::Shutdown).
    pub rejected_shutdown: u64,
    /// Queued calls that gave up by being dropped (cancelled).
    pub cancelled: u64,
    /// Panics of the reject hook, caught and counted.
    pub hook_panics: u64,
}

impl Bulkhead {
    /// The bulkhead's figures now. Never blocks admissions (it takes only the limits
    /// writer's lock and reads the per-thread counters).
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::new(2)?;
    /// let _permit = bulkhead.try_acquire()?;
    /// let stats = bulkhead.stats();
    /// assert_eq!((stats.active, stats.queued, stats.admitted), (1, 0, 1));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn stats(&self) -> BulkheadStats {
        let figures = self.core.engine().figures();
        let rejected = |reason: RejectReason| {
            RejectReason::ALL
                .iter()
                .position(|&r| r == reason)
                .map_or(0, |i| figures.rejected[i])
        };
        BulkheadStats {
            limits: BulkheadLimits {
                revision: figures.limits.revision,
                max_concurrent: figures.limits.max_concurrent,
                max_queue: figures.limits.max_queue,
            },
            closed: figures.closed,
            active: figures.in_flight,
            queued: figures.pending,
            admitted: figures.admitted,
            released: figures.released,
            rejected_queue_full: rejected(RejectReason::ConcurrencyLimit)
                + rejected(RejectReason::QueueLimit),
            timed_out: rejected(RejectReason::Timeout),
            rejected_shutdown: rejected(RejectReason::Shutdown),
            cancelled: rejected(RejectReason::Aborted),
            hook_panics: self.core.hook_panics(),
        }
    }
}
