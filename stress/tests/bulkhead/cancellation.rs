//! Cancellation: a queued call whose future is dropped leaves the queue immediately, does
//! not hold a slot; it counts as `cancelled`, and the hook does not hear it (it is not a
//! refusal). A future dropped after it was handed a slot passes the slot to the next waiter.

use async_bulkhead_llm::Bulkhead;

use crate::support::{Heard, assert_pending, on_three_runtimes, ready, st};

fn observed(max_concurrent: usize) -> (Bulkhead, Heard) {
    let heard = Heard::new();
    let bulkhead = heard
        .on(Bulkhead::builder(max_concurrent).max_queue(4))
        .build()
        .expect("valid");
    (bulkhead, heard)
}

/// A queued acquire polled once, then dropped: `queued` drops at once, no slot is held, one
/// `cancelled`, the hook silent; the waiter behind it moves up.
async fn a_dropped_queued_future_leaves_the_queue_at_once() {
    let (bulkhead, heard) = observed(1);
    let held = bulkhead.try_acquire().expect("free");
    let mut first = bulkhead.acquire();
    assert_pending(&mut first).await;
    let mut second = bulkhead.acquire();
    assert_pending(&mut second).await;
    assert_eq!(bulkhead.state(), st(1, 2));

    drop(first);
    assert_eq!(bulkhead.state(), st(1, 1), "left the queue at once");
    let stats = bulkhead.stats();
    assert_eq!((stats.cancelled, stats.admitted, stats.active), (1, 1, 1));
    assert_eq!(heard.count(), 0, "a cancellation is not a refusal");

    drop(held);
    let permit = ready(&mut second).await.expect("the next waiter moved up");
    assert_eq!(bulkhead.state(), st(1, 0));
    drop(permit);
    assert_eq!(bulkhead.state(), st(0, 0), "the dropped call holds no slot");
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released, stats.cancelled), (2, 2, 1));
    assert_eq!(heard.count(), 0);
}

on_three_runtimes!(
    a_dropped_queued_call_leaves_the_queue_immediately_and_holds_no_slot,
    super::a_dropped_queued_future_leaves_the_queue_at_once
);

/// A `call` dropped while it waits in the queue: its body never runs, it leaves the queue.
async fn a_dropped_queued_call_never_runs() {
    let (bulkhead, heard) = observed(1);
    let held = bulkhead.try_acquire().expect("free");
    let mut call = Box::pin(bulkhead.run(async { unreachable!("never started") }));
    assert_pending(&mut call).await;
    assert_eq!(bulkhead.state(), st(1, 1));
    drop(call);
    assert_eq!(bulkhead.state(), st(1, 0));
    assert_eq!(bulkhead.stats().cancelled, 1);
    assert_eq!(heard.count(), 0);
    drop(held);
    assert_eq!(bulkhead.state(), st(0, 0));
}

on_three_runtimes!(
    a_dropped_queued_call_leaves_the_queue_and_never_runs,
    super::a_dropped_queued_call_never_runs
);

/// A release hands the slot to the head; the head's future is dropped before it polls again:
/// the slot goes on to the next waiter, the head counts as cancelled, never as admitted.
async fn a_dropped_future_holding_a_handed_slot_passes_it_on() {
    let (bulkhead, heard) = observed(1);
    let held = bulkhead.try_acquire().expect("free");
    let mut head = bulkhead.acquire();
    assert_pending(&mut head).await;
    let mut next = bulkhead.acquire();
    assert_pending(&mut next).await;
    drop(held);
    assert_eq!(bulkhead.state(), st(1, 1), "handed to the head");

    drop(head);
    assert_eq!(bulkhead.state(), st(1, 0), "passed on to the next waiter");
    let permit = ready(&mut next).await.expect("the next waiter has it");
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.cancelled, stats.active), (2, 1, 1));
    drop(permit);
    assert_eq!(bulkhead.state(), st(0, 0));
    assert_eq!(heard.count(), 0);

    // With nobody behind it, the handed slot simply becomes free again.
    let held = bulkhead.try_acquire().expect("free");
    let mut alone = bulkhead.acquire_owned();
    assert_pending(&mut alone).await;
    drop(held);
    assert_eq!(bulkhead.state(), st(1, 0));
    drop(alone);
    assert_eq!(bulkhead.state(), st(0, 0));
    assert!(bulkhead.try_acquire().is_ok(), "the slot is free");
    let stats = bulkhead.stats();
    assert_eq!((stats.cancelled, stats.admitted, stats.released), (2, 4, 4));
}

on_three_runtimes!(
    a_dropped_future_that_was_handed_a_slot_passes_it_to_the_next_waiter,
    super::a_dropped_future_holding_a_handed_slot_passes_it_on
);
