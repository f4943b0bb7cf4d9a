//! loom models of the blocking acquires (`acquire_blocking`, `acquire_blocking_owned`): the
//! same state machine as the futures, but a queued thread parks on its waiter's
//! `event_listener::Event` (built against loom's primitives with the crate's `loom` feature)
//! instead of registering a waker. A wake-up that is never sent leaves the thread parked for
//! good, which loom reports as a deadlock, so these models fail on a lost wake-up.
//!
//! Timeouts are not modelled (event-listener cannot park with a deadline under loom): these
//! calls wait without one.
//!
//! Run: see `loom-tests/README.md`.
#![cfg(loom)]
// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

mod common;

use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, TokenBudget};
use common::{assert_idle, tokens};
use loom::thread;

/// A blocked acquire woken by a release on another thread. The release may come before the
/// call starts (fast path), while it arrives (decided again under the queue lock), or after
/// it parked (handed the slot and its tokens, then notified): it is admitted in every
/// interleaving and never parks for good.
#[test]
fn a_blocked_acquire_is_handed_the_slot_a_release_frees() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1)
            .max_queue(1)
            .token_budget(TokenBudget::new(100))
            .build()
            .unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), tokens(40, 0))
            .unwrap();

        let waiter = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                bulkhead
                    .acquire_blocking_owned(&LlmRequest::new(), tokens(60, 0))
                    .expect("admitted once the slot is free")
            })
        };
        let releaser = thread::spawn(move || drop(held));
        releaser.join().unwrap();
        let permit = waiter.join().unwrap();

        assert_eq!(permit.held_tokens(), 60);
        let stats = bulkhead.stats();
        assert_eq!((stats.in_flight, stats.pending), (1, 0));
        assert_eq!(stats.token_budget.unwrap().in_flight_tokens, 60);
        drop(permit);
        assert_idle(&bulkhead);
    });
}

/// `close` while a thread blocks for the only slot (held throughout): the thread is refused
/// `shutdown`, by its own decision or by `close` emptying the queue and notifying it, and
/// never stays parked.
#[test]
fn close_wakes_a_blocked_acquire_with_shutdown() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();

        let waiter = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let err = bulkhead
                    .acquire_blocking(&LlmRequest::new(), AcquireOptions::new())
                    .map(drop)
                    .expect_err("the only slot stays held");
                err.rejection().expect("a capacity refusal").reason()
            })
        };
        let closer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || assert!(bulkhead.close()))
        };
        closer.join().unwrap();
        assert_eq!(waiter.join().unwrap(), RejectReason::Shutdown);

        let stats = bulkhead.stats();
        assert_eq!((stats.in_flight, stats.pending), (1, 0));
        assert_eq!(stats.rejected_by_reason.shutdown, 1);
        drop(held);
        assert_idle(&bulkhead);
    });
}
