//! loom models of a newcomer *arriving*: an acquire that found no slot on the fast path and
//! takes the queue lock to decide again and queue (`Inner::arrive`), racing what can change
//! its fate meanwhile: the last release (which looks at `WAITERS` only once, in its
//! `fetch_sub`), `close` (which empties the queue once, under the same lock), and a hand-off to
//! a waiter already queued.
//!
//! Invariants checked: no lost wake-up (a newcomer that saw `Pending` was woken, and its next
//! poll finishes it), no waiter stranded in the queue with a free slot or after `close`, no
//! barging past a queued waiter, and slots, tokens and places returned exactly.
//!
//! Run: see `loom-tests/README.md`.
#![cfg(loom)]
// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

mod common;

use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, TokenBudget};
use common::{Queued, assert_idle, first_poll, poll, queued, settle, tokens};
use loom::thread;

/// The last holder releases while a newcomer arrives. Either the release comes first and the
/// newcomer's decision under the queue lock finds the slot, or the newcomer sets `WAITERS`
/// first and the release sees it and hands the slot over (and wakes it). The gap in between,
/// a release that saw no waiter and a newcomer that saw no slot, must not exist: the newcomer
/// is admitted, with its tokens, in every interleaving.
#[test]
fn a_newcomer_arriving_while_the_last_holder_releases_is_never_stranded() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1)
            .max_queue(1)
            .token_budget(TokenBudget::new(100))
            .build()
            .unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), tokens(40, 0))
            .unwrap();

        let newcomer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let mut future = bulkhead.acquire_owned(&LlmRequest::new(), tokens(50, 0));
                let (first, flag) = first_poll(&mut future);
                (future, first, flag)
            })
        };
        let releaser = thread::spawn(move || drop(held));
        let (future, first, flag) = newcomer.join().unwrap();
        releaser.join().unwrap();

        let permit = settle(future, first, &flag).expect("the freed slot reaches the newcomer");
        let stats = bulkhead.stats();
        assert_eq!((stats.in_flight, stats.pending), (1, 0));
        assert_eq!(stats.token_budget.unwrap().in_flight_tokens, 50);
        drop(permit);
        assert_idle(&bulkhead);
    });
}

/// `close` races a newcomer arriving while the only slot stays held: the newcomer is refused
/// `shutdown` whichever comes first (by its own decision, which sees the flag, or by `close`
/// emptying the queue after it joined, which wakes it), and is never left in the queue of a
/// closed bulkhead.
#[test]
fn close_while_a_newcomer_arrives_refuses_it_and_empties_the_queue() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();

        let newcomer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let mut future = bulkhead.acquire_owned(&LlmRequest::new(), AcquireOptions::new());
                let (first, flag) = first_poll(&mut future);
                (future, first, flag)
            })
        };
        let closer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || assert!(bulkhead.close()))
        };
        let (future, first, flag) = newcomer.join().unwrap();
        closer.join().unwrap();

        let outcome = settle(future, first, &flag);
        assert_eq!(outcome.unwrap_err(), RejectReason::Shutdown);
        let stats = bulkhead.stats();
        assert_eq!((stats.in_flight, stats.pending), (1, 0));
        assert_eq!(stats.rejected_by_reason.shutdown, 1);
        drop(held);
        assert_idle(&bulkhead);
    });
}

/// A newcomer arrives while a release hands the only slot to the waiter already queued: the
/// slot goes to that waiter (woken), the newcomer never barges past it (it queues behind it,
/// or, if it decided after the hand-off, finds no slot and queues), and it is served next.
#[test]
fn a_newcomer_arriving_during_a_hand_off_queues_behind_the_head() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(2).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let head = queued(&bulkhead, AcquireOptions::new());

        let newcomer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let mut future = bulkhead.acquire_owned(&LlmRequest::new(), AcquireOptions::new());
                let (first, flag) = first_poll(&mut future);
                assert!(first.is_pending(), "the newcomer barged past the queue");
                Queued { future, flag }
            })
        };
        let releaser = thread::spawn(move || drop(held));
        let mut newcomer = newcomer.join().unwrap();
        releaser.join().unwrap();

        let first = settle(head.future, std::task::Poll::Pending, &head.flag).expect("the head");
        assert!(
            !newcomer.flag.woken(),
            "the newcomer was woken without a slot"
        );
        assert!(
            poll(&mut newcomer.future, &common::waker(&newcomer.flag)).is_pending(),
            "the newcomer was served past the head"
        );
        let stats = bulkhead.stats();
        assert_eq!((stats.in_flight, stats.pending), (1, 1));
        drop(first);
        let second =
            settle(newcomer.future, std::task::Poll::Pending, &newcomer.flag).expect("served next");
        drop(second);
        assert_idle(&bulkhead);
    });
}

/// A newcomer queues behind a waiter (the `WAITERS` flag already set: it writes nothing to
/// the admission word, and confirms the limits it decided under by the epoch alone) while
/// `apply_limits` raises `max_concurrent` to make room for both: neither is left in the queue
/// with a free slot, whichever of the newcomer's decision and the new limits comes first.
#[test]
fn a_newcomer_queueing_behind_a_waiter_while_limits_rise_is_never_stranded() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(2).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let head = queued(&bulkhead, AcquireOptions::new());

        let newcomer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let mut future = bulkhead.acquire_owned(&LlmRequest::new(), AcquireOptions::new());
                let (first, flag) = first_poll(&mut future);
                (future, first, flag)
            })
        };
        let raiser = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let mut next = bulkhead.limits();
                next.revision += 1;
                next.max_concurrent = 3;
                assert!(bulkhead.apply_limits(next).unwrap().is_applied());
            })
        };
        let (future, first, flag) = newcomer.join().unwrap();
        raiser.join().unwrap();

        let head = settle(head.future, std::task::Poll::Pending, &head.flag).expect("the head");
        let newcomer = settle(future, first, &flag).expect("the newcomer, admitted");
        let stats = bulkhead.stats();
        assert_eq!((stats.in_flight, stats.pending), (3, 0));
        drop((held, head, newcomer));
        assert_idle(&bulkhead);
    });
}
