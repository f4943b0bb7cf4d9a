//! [`Queued`]: the wait of a call the engine queued, the one protocol every acquire of both
//! faces follows from the moment its call joins the queue to its outcome (a hand-off, a
//! refusal, its wait's end) or its withdrawal. The faces add only what they make of the
//! outcome (a permit, an error, an event).
//!
//! The protocol: a waiter's outcome is published by whoever decides it (a release's hand-off,
//! a close, a change of limits) and picked up by the waiter's owner. A poll checks, registers
//! its waker, and checks again: an outcome published between the first check and the
//! registration is caught by the second, one published after it wakes the task. When the
//! wait's end passes first, the waiter withdraws with `timeout`, unless a hand-off reached it
//! first, which it keeps. A blocking wait does the same with an event listener in place of the
//! waker.

use core::task::{Context, Poll};

use event_listener::Listener;

use super::assembly::Engine;
use super::grant::Grant;
use super::pool::WaiterHandle;
use super::timer::Sleep;
use crate::vocabulary::rejection::Rejection;

/// A queued call's waiter and the end of its wait.
pub(crate) struct Queued {
    waiter: WaiterHandle,
    /// When the wait ends (`None`: as long as it takes).
    sleep: Option<Sleep>,
}

impl Queued {
    pub(crate) fn new(waiter: WaiterHandle, sleep: Option<Sleep>) -> Queued {
        Queued { waiter, sleep }
    }

    /// The poll that queued the call: its waker was registered in the waiter before the
    /// waiter was queued, so only the wait's end is checked (a hand-off still wins against an
    /// immediate time-out).
    pub(crate) fn poll_arrived(
        &mut self,
        engine: &Engine,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Grant, Rejection>> {
        self.poll_end(engine, cx)
    }

    /// Any later poll: the outcome if decided, else the task is woken when it is or when the
    /// wait ends. After `Ready` the wait is over: the caller drops it.
    pub(crate) fn poll(
        &mut self,
        engine: &Engine,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Grant, Rejection>> {
        if let Some(decided) = engine.pick_up(&self.waiter) {
            return Poll::Ready(decided);
        }
        // Register, then check again (see the module's docs).
        self.waiter.register(cx.waker());
        if let Some(decided) = engine.pick_up(&self.waiter) {
            return Poll::Ready(decided);
        }
        self.poll_end(engine, cx)
    }

    /// The wait's end: times the call out once it has passed, else makes sure the task is
    /// woken then.
    fn poll_end(
        &mut self,
        engine: &Engine,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Grant, Rejection>> {
        if let Some(sleep) = &mut self.sleep
            && sleep.poll_elapsed(cx).is_ready()
        {
            return Poll::Ready(engine.time_out(&self.waiter));
        }
        Poll::Pending
    }

    /// The blocking equivalent of polling to the outcome: parks the thread.
    pub(crate) fn block(&mut self, engine: &Engine) -> Result<Grant, Rejection> {
        loop {
            if let Some(decided) = engine.pick_up(&self.waiter) {
                return decided;
            }
            let listener = self.waiter.listen();
            if let Some(decided) = engine.pick_up(&self.waiter) {
                return decided;
            }
            match self.sleep.as_ref().map(Sleep::deadline) {
                None => listener.wait(),
                Some(deadline) => {
                    if listener.wait_deadline(deadline).is_none() {
                        return engine.time_out(&self.waiter);
                    }
                }
            }
        }
    }

    /// Leaves the queue because the acquire was dropped while it waited (counted as
    /// `aborted`); a slot already handed over goes on to the next waiter. Returns the refusal
    /// to announce. The wait is over: the caller drops it.
    pub(crate) fn withdraw(&self, engine: &Engine) -> Rejection {
        engine.cancel(&self.waiter)
    }
}
