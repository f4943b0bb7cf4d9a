//! Waiters recycled per thread, so that a call waiting in the queue allocates nothing once the
//! thread is warm.
//!
//! A queued call's [`Waiter`] is shared by the call's future (through a [`WaiterHandle`]) and
//! the queue (and, for a moment, the releaser that hands it a slot and wakes it). When the
//! future is done with it, the handle gives it back to this thread's pool if nobody else holds
//! it any more (its strong count is 1 and nobody makes a `Weak` of a waiter: no reference
//! left anywhere, so nothing can still read or write it), without the waker it may hold; the
//! next call that queues on this thread takes it instead of allocating. A waiter someone still holds is simply dropped by its last
//! holder. A thread keeps at most [`POOL_SIZE`] waiters.
//!
//! Per thread, not shared: taking and giving back are a thread-local access, no atomic
//! operation and no contended line, and a waiter mostly returns to the thread (the worker)
//! whose task queued it. Under loom there is no pool: every waiter is allocated and dropped.

use core::ops::Deref;

use super::policy::Ask;
use super::queue::Waiter;
use super::wait::Wait;
use crate::support::sync::Arc;

/// The most waiters one thread keeps for reuse.
#[cfg(not(loom))]
pub(crate) const POOL_SIZE: usize = 32;

#[cfg(not(loom))]
std::thread_local! {
    static POOL: core::cell::RefCell<Vec<Arc<Waiter>>> = const { core::cell::RefCell::new(Vec::new()) };
}

/// A waiter for `ask`, waiting as `wait` (an async waiter with its waker registered): one of
/// this thread's pool, else a new one.
pub(super) fn take(ask: Ask, wait: Wait<'_>) -> Arc<Waiter> {
    #[cfg(not(loom))]
    {
        let pooled = POOL
            .try_with(|pool| pool.try_borrow_mut().ok().and_then(|mut pool| pool.pop()))
            .ok()
            .flatten();
        if let Some(mut waiter) = pooled
            && let Some(slot) = Arc::get_mut(&mut waiter)
        {
            slot.reuse(ask, wait);
            return waiter;
        }
    }
    Arc::new(Waiter::new(ask, wait))
}

/// The owner's handle of a queued call's waiter: what its future holds. Derefs to the waiter;
/// dropping it gives the waiter back to this thread's pool if nobody else holds it.
#[derive(Debug)]
pub(crate) struct WaiterHandle(Option<Arc<Waiter>>);

impl WaiterHandle {
    pub(super) fn new(waiter: Arc<Waiter>) -> WaiterHandle {
        WaiterHandle(Some(waiter))
    }
}

impl Deref for WaiterHandle {
    type Target = Waiter;

    #[inline]
    fn deref(&self) -> &Waiter {
        self.0
            .as_deref()
            .expect("a handle holds its waiter until dropped")
    }
}

impl Drop for WaiterHandle {
    fn drop(&mut self) {
        #[cfg(not(loom))]
        if let Some(waiter) = self.0.take()
            // No other reference (nobody makes a `Weak` of a waiter, so the strong count
            // says it all); the fence orders whatever the last other holder did before it
            // let go (its `Release` decrement) before the waiter's reuse.
            && Arc::strong_count(&waiter) == 1
        {
            crate::support::sync::unmodeled::fence(
                crate::support::sync::unmodeled::Ordering::Acquire,
            );
            // Nothing else holds it: drop the task's waker it may still hold (after a timeout
            // or a cancellation) before it waits in the pool. Outside every lock.
            drop(waiter.forget_waker());
            let _ = POOL.try_with(|pool| {
                if let Ok(mut pool) = pool.try_borrow_mut()
                    && pool.len() < POOL_SIZE
                {
                    pool.push(waiter);
                }
            });
        }
    }
}
