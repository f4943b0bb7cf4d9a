//! loom models of `drain()` reaching the idle moment through paths other than a release
//! (those are in `queue.rs`): `close` refusing the last waiter, and a blocked call leaving.
//!
//! A drain arms the word's `DRAINING` flag with a CAS that also reads whether the bulkhead is
//! idle; whatever makes it idle sees the flag in its own atomic operation and notifies. These
//! models poll the drain with a recording waker and, if it is pending, spin (yielding to loom)
//! until it is woken: after a lost notification the spin never ends, and loom fails the model
//! when it exceeds its branch limit.
//!
//! Run: see `loom-tests/README.md`.
#![cfg(loom)]
// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

mod common;

use async_bulkhead_llm::{AcquireOptions, Limits, LlmBulkhead, LlmRequest, RejectReason};
use common::{assert_idle, drain_to_completion, queued, settle};
use loom::thread;

/// The queue's last waiter is refused by `close` while a drain arms: nothing holds a slot, so
/// the bulkhead becomes idle when `close` clears `WAITERS`, and the drain (armed before or
/// after) completes. The waiter is refused `shutdown` and woken.
#[test]
fn drain_completes_when_close_refuses_the_last_waiter() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let waiter = queued(&bulkhead, AcquireOptions::new());
        // The kill switch: the waiter is never handed a slot; only `close` ends its wait.
        let next = Limits::new(1, 0).with_max_queue(1);
        assert!(bulkhead.apply_limits(next).unwrap().is_applied());
        drop(held);
        assert_eq!(bulkhead.stats().pending, 1);

        let drainer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || drain_to_completion(&bulkhead))
        };
        let closer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || assert!(bulkhead.close()))
        };
        closer.join().unwrap();
        drainer.join().unwrap();

        let outcome = settle(waiter.future, std::task::Poll::Pending, &waiter.flag);
        assert_eq!(outcome.unwrap_err(), RejectReason::Shutdown);
        assert_idle(&bulkhead);
    });
}

/// A drain races a blocked acquire being handed the last slot and releasing it: the drain
/// completes (it may see the hand-off keep the bulkhead busy, but the final release makes it
/// idle and notifies), and the blocked call is admitted.
#[test]
fn drain_completes_after_a_blocked_waiter_is_served_and_releases() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();

        let waiter = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let permit = bulkhead
                    .acquire_blocking_owned(&LlmRequest::new(), AcquireOptions::new())
                    .expect("admitted once the slot is free");
                drop(permit);
            })
        };
        let drainer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                drop(held);
                drain_to_completion(&bulkhead);
            })
        };
        drainer.join().unwrap();
        waiter.join().unwrap();

        let stats = bulkhead.stats();
        assert_eq!(stats.admitted, 2);
        assert_idle(&bulkhead);
    });
}
