//! loom models of a release *passing* its slot to the queue head (`Engine::pass_slot`, on an
//! engine without a token budget or classes): the slot changes hands under the queue lock
//! without a write of the admission word, the head's admission validated by a second load of
//! the word and the published epoch. Raced here against what could invalidate it: a change of
//! limits, a close, and another release passing its slot.
//!
//! Invariants checked: a passed slot is granted under the limits in force at its decision (a
//! lowered `max_concurrent` is never exceeded by a pass decided under it), no waiter is left
//! in the queue with a free slot or after `close`, every decided waiter is woken, and slots
//! and places are returned exactly.
//!
//! Run: see `loom-tests/README.md`.
#![cfg(loom)]
// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

mod common;

use std::task::Poll;

use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason};
use common::{assert_idle, poll, queued, settle};
use loom::thread;

fn held(bulkhead: &LlmBulkhead) -> async_bulkhead_llm::OwnedPermit {
    bulkhead
        .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
        .unwrap()
}

/// Two calls hold the two slots, one waits; one call releases while `max_concurrent` drops
/// to one. A pass decided before the change grants the head under revision 0 (and the change
/// then revokes nothing); after it, two calls in flight exceed the new limit, so nothing is
/// passed and the head waits for the next release. Never a grant under revision 1 while two
/// hold.
#[test]
fn a_pass_racing_a_lowered_limit_never_exceeds_the_limit_it_was_decided_under() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 2).max_queue(2).build().unwrap();
        let first = held(&bulkhead);
        let second = held(&bulkhead);
        let head = queued(&bulkhead, AcquireOptions::new());

        let releaser = thread::spawn(move || drop(first));
        let lowerer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let mut next = bulkhead.limits();
                next.revision = 1;
                next.max_concurrent = 1;
                assert!(bulkhead.apply_limits(next).unwrap().is_applied());
            })
        };
        releaser.join().unwrap();
        lowerer.join().unwrap();

        let mut future = head.future;
        let passed = if head.flag.woken() {
            match poll(&mut future, std::task::Waker::noop()) {
                Poll::Ready(result) => Some(result.expect("a woken head was granted")),
                Poll::Pending => panic!("a woken head found nothing"),
            }
        } else {
            assert!(poll(&mut future, std::task::Waker::noop()).is_pending());
            None
        };
        match passed {
            Some(permit) => {
                assert_eq!(
                    permit.limit_revision(),
                    0,
                    "a pass decided under the new limit"
                );
                assert_eq!(bulkhead.stats().in_flight, 2);
                drop((permit, second));
            }
            None => {
                assert_eq!(bulkhead.stats().in_flight, 1);
                drop(second); // serves the head under the new limit
                let permit = match poll(&mut future, std::task::Waker::noop()) {
                    Poll::Ready(result) => result.expect("served after the next release"),
                    Poll::Pending => panic!("the head was left waiting with a free slot"),
                };
                assert_eq!(permit.limit_revision(), 1);
                drop(permit);
            }
        }
        assert_idle(&bulkhead);
    });
}

/// The only holder releases while the bulkhead closes, one call waiting: the head is either
/// passed the slot (the pass came first: it holds it until it releases) or refused `shutdown`
/// (close came first), woken either way, and never left in the queue of a closed bulkhead.
#[test]
fn a_pass_racing_close_grants_or_refuses_the_head_and_strands_nothing() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(2).build().unwrap();
        let first = held(&bulkhead);
        let head = queued(&bulkhead, AcquireOptions::new());

        let releaser = thread::spawn(move || drop(first));
        let closer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                bulkhead.close();
            })
        };
        releaser.join().unwrap();
        closer.join().unwrap();

        match settle(head.future, Poll::Pending, &head.flag) {
            Ok(permit) => drop(permit),
            Err(reason) => assert_eq!(reason, RejectReason::Shutdown),
        }
        assert_eq!(bulkhead.stats().pending, 0);
        assert_idle(&bulkhead);
    });
}

/// Both holders release at once with two calls waiting: each release passes its slot to the
/// head of its moment, so both waiters are granted, both are woken, and the first in line is
/// never skipped.
#[test]
fn two_releases_pass_their_slots_to_both_waiters_in_order() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 2).max_queue(2).build().unwrap();
        let first = held(&bulkhead);
        let second = held(&bulkhead);
        let a = queued(&bulkhead, AcquireOptions::new());
        let b = queued(&bulkhead, AcquireOptions::new());

        let one = thread::spawn(move || drop(first));
        let two = thread::spawn(move || drop(second));
        one.join().unwrap();
        two.join().unwrap();

        let a = settle(a.future, Poll::Pending, &a.flag).expect("the first waiter");
        let b = settle(b.future, Poll::Pending, &b.flag).expect("the second waiter");
        let stats = bulkhead.stats();
        assert_eq!((stats.in_flight, stats.pending, stats.admitted), (2, 0, 4));
        drop((a, b));
        assert_idle(&bulkhead);
    });
}
