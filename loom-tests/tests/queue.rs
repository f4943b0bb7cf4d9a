//! loom models of the wait queue: hand-off, cancellation, timeouts, close and drain, in every
//! interleaving of the threads involved. Futures are polled by hand; wakers record whether they
//! were woken, so a lost wake-up fails the model.
//!
//! Run: see `loom-tests/README.md`.
#![cfg(loom)]
// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

mod common;

use std::task::{Poll, Waker};
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, Reservation, TokenBudget,
};
use common::{Queued, assert_idle, drain_to_completion, poll, queued, reason};
use loom::thread;

/// A release hands the slot to the head while the head's future is being dropped: the slot and
/// the tokens must reach the next waiter, and the dropped one counts as aborted.
#[test]
fn waiter_cancelled_while_a_release_hands_it_the_slot() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1)
            .max_queue(2)
            .token_budget(TokenBudget::new(100))
            .build()
            .unwrap();
        let opts = AcquireOptions::new().reservation(Reservation::new(10, 20).unwrap());
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), opts)
            .unwrap();
        let first = queued(&bulkhead, opts).future;
        let Queued {
            future: mut second,
            flag: woken,
        } = queued(&bulkhead, opts);

        let releaser = thread::spawn(move || drop(held));
        let canceller = thread::spawn(move || drop(first));
        releaser.join().unwrap();
        canceller.join().unwrap();

        // Whatever the order, the slot ended with the second waiter, which was woken.
        assert!(woken.woken(), "the next waiter was woken");
        let permit = match poll(&mut second, Waker::noop()) {
            Poll::Ready(result) => result.expect("the slot passed to the next waiter"),
            Poll::Pending => panic!("the second waiter was left waiting with a free slot"),
        };
        let stats = bulkhead.stats();
        assert_eq!((stats.in_flight, stats.pending, stats.admitted), (1, 0, 2));
        assert_eq!(stats.rejected_by_reason.aborted, 1);
        assert_eq!(stats.token_budget.unwrap().in_flight_tokens, 30);
        drop(permit);
        assert_idle(&bulkhead);
    });
}

/// A zero timeout races the release that hands the waiter its slot: it either gets the slot
/// or times out, never both, and nothing leaks.
#[test]
fn timeout_races_a_grant() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let mut waiter = bulkhead.acquire_owned(
            &LlmRequest::new(),
            AcquireOptions::new().timeout(Duration::ZERO),
        );

        let releaser = thread::spawn(move || drop(held));
        let outcome = thread::spawn(move || match poll(&mut waiter, Waker::noop()) {
            Poll::Ready(result) => reason(result),
            Poll::Pending => panic!("a zero timeout completes at its first poll"),
        });
        releaser.join().unwrap();
        let outcome = outcome.join().unwrap();

        let stats = bulkhead.stats();
        match outcome {
            Ok(permit) => {
                assert_eq!((stats.in_flight, stats.rejected), (1, 0));
                drop(permit);
            }
            Err(reason) => {
                assert_eq!(reason, RejectReason::Timeout);
                assert_eq!(stats.rejected_by_reason.timeout, 1);
            }
        }
        assert_idle(&bulkhead);
    });
}

/// `close` races a release while two calls wait: every waiter ends admitted (if the release
/// handed it the slot before the close) or refused `shutdown`, and nothing is admitted after.
#[test]
fn close_races_waiters() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(2).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let Queued {
            future: mut first,
            flag: first_woken,
        } = queued(&bulkhead, AcquireOptions::new());
        let Queued {
            future: mut second,
            flag: second_woken,
        } = queued(&bulkhead, AcquireOptions::new());

        let closer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || assert!(bulkhead.close()))
        };
        let releaser = thread::spawn(move || drop(held));
        closer.join().unwrap();
        releaser.join().unwrap();

        assert!(first_woken.woken() && second_woken.woken(), "both woken");
        let Poll::Ready(first) = poll(&mut first, Waker::noop()) else {
            panic!("first waits")
        };
        let Poll::Ready(second) = poll(&mut second, Waker::noop()) else {
            panic!("second waits")
        };
        assert_eq!(reason(second).unwrap_err(), RejectReason::Shutdown);
        let shutdowns = match reason(first) {
            Ok(permit) => {
                drop(permit);
                1
            }
            Err(reason) => {
                assert_eq!(reason, RejectReason::Shutdown);
                2
            }
        };
        assert_eq!(bulkhead.stats().rejected_by_reason.shutdown, shutdowns);
        assert!(
            bulkhead
                .try_acquire(&LlmRequest::new(), AcquireOptions::new())
                .is_err()
        );
        assert_idle(&bulkhead);
    });
}

/// Two releases on two threads hand exactly two slots, to the first two waiters, and wake
/// exactly them: the third keeps its place and is not woken.
#[test]
fn releases_wake_exactly_the_heads() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 2).max_queue(3).build().unwrap();
        let one = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let two = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let (mut waiters, flags): (Vec<_>, Vec<_>) = (0..3)
            .map(|_| {
                let Queued { future, flag } = queued(&bulkhead, AcquireOptions::new());
                (future, flag)
            })
            .unzip();

        let a = thread::spawn(move || drop(one));
        let b = thread::spawn(move || drop(two));
        a.join().unwrap();
        b.join().unwrap();

        assert!(flags[0].woken() && flags[1].woken(), "the heads were woken");
        assert!(!flags[2].woken(), "the third waiter was not woken");
        let mut third = waiters.pop().unwrap();
        let permits: Vec<_> = waiters
            .iter_mut()
            .map(|w| match poll(w, Waker::noop()) {
                Poll::Ready(result) => result.unwrap(),
                Poll::Pending => panic!("a head was not handed its slot"),
            })
            .collect();
        assert!(
            poll(&mut third, Waker::noop()).is_pending(),
            "the third still waits"
        );
        let stats = bulkhead.stats();
        assert_eq!((stats.in_flight, stats.pending), (2, 1));
        drop(permits);
        let Poll::Ready(last) = poll(&mut third, Waker::noop()) else {
            panic!("third not served")
        };
        drop(last.unwrap());
        assert_idle(&bulkhead);
    });
}

/// A drain armed while the last call releases is woken (no lost wake-up) and completes.
#[test]
fn drain_races_the_last_release() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let releaser = thread::spawn(move || drop(held));
        let drainer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || drain_to_completion(&bulkhead))
        };
        releaser.join().unwrap();
        drainer.join().unwrap();
        assert_idle(&bulkhead);
    });
}

/// The last waiter leaving (cancelled) while nothing is in flight makes the bulkhead idle
/// (upstream's Q5 hang): a drain armed meanwhile completes.
#[test]
fn drain_completes_when_the_last_waiter_leaves() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let waiter = queued(&bulkhead, AcquireOptions::new()).future;
        // The kill switch: no slot will ever be handed to the waiter.
        bulkhead
            .apply_limits(async_bulkhead_llm::Limits::new(1, 0).with_max_queue(1))
            .unwrap();
        drop(held);
        assert_eq!(bulkhead.stats().pending, 1);

        let drainer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || drain_to_completion(&bulkhead))
        };
        let canceller = thread::spawn(move || drop(waiter));
        canceller.join().unwrap();
        drainer.join().unwrap();
        assert_eq!(bulkhead.stats().rejected_by_reason.aborted, 1);
        assert_idle(&bulkhead);
    });
}
