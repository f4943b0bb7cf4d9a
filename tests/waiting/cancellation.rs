//! Cancellation: dropping an acquire future, queued or handed a slot.

use async_bulkhead_llm::RejectReason;

use crate::support::{
    assert_pending, budgeted, count, counting_waker, figures, opts, plain, poll_with, queued,
    ready, req, tokens, toks,
};

#[test]
fn dropping_queued_futures_removes_them_and_later_waiters_move_up() {
    let bulkhead = plain(1, 8);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let a = queued(&bulkhead, opts());
    let b = queued(&bulkhead, opts());
    let mut c = queued(&bulkhead, opts());
    let mut d = queued(&bulkhead, opts());
    assert_eq!(bulkhead.stats().pending, 4);

    drop(b); // from the middle
    assert_eq!(bulkhead.stats().pending, 3);
    assert_eq!(count(&bulkhead, RejectReason::Aborted), 1);
    drop(a); // the head
    assert_eq!(bulkhead.stats().pending, 2);
    assert_eq!(count(&bulkhead, RejectReason::Aborted), 2);

    drop(held);
    assert_pending(&mut d);
    let pc = ready(&mut c).expect("C moved up to the head");
    drop(pc);
    let pd = ready(&mut d).expect("then D");
    drop(pd);
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.pending,
            stats.admitted,
            stats.released
        ),
        (0, 0, 3, 3)
    );
    assert_eq!((stats.rejected, stats.rejected_by_reason.aborted), (2, 2));
}

#[test]
fn dropping_a_future_handed_a_slot_returns_slot_and_tokens_to_the_next_waiter() {
    let bulkhead = budgeted(1, 4, 1000);
    let held = bulkhead.try_acquire(&req(), toks(300)).expect("free slot");
    let a = queued(&bulkhead, toks(200));
    let (waker_b, woken_b) = counting_waker();
    let mut b = Box::pin(bulkhead.acquire_owned(&req(), toks(100)));
    assert!(poll_with(&mut b, &waker_b).is_pending());
    drop(held);
    // A holds the slot and its 200 tokens but has not picked them up.
    assert_eq!(figures(&bulkhead), (1, 1, 1));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 200);
    assert_eq!(woken_b.get(), 0);

    drop(a);
    // Counted as aborted; the slot went on to B with B's tokens.
    assert_eq!(count(&bulkhead, RejectReason::Aborted), 1);
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 100);
    assert_eq!(woken_b.get(), 1, "B was woken by the hand-off");
    let pb = ready(&mut b).expect("B got the slot");
    assert_eq!(pb.held_tokens(), 100);
    drop(pb);

    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.pending,
            stats.admitted,
            stats.released
        ),
        (0, 0, 2, 2)
    );
    let t = tokens(&bulkhead);
    assert_eq!((t.in_flight_tokens, t.total_reserved), (0, 400));
    assert_eq!(stats.rejected, 1);
}

#[test]
fn dropping_the_last_handed_future_frees_the_slot() {
    let bulkhead = budgeted(1, 4, 1000);
    let held = bulkhead.try_acquire(&req(), toks(300)).expect("free slot");
    let a = queued(&bulkhead, toks(200));
    drop(held);
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    drop(a);
    assert_eq!(figures(&bulkhead), (0, 0, 1));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 0);
    assert_eq!(count(&bulkhead, RejectReason::Aborted), 1);
    let again = bulkhead
        .try_acquire(&req(), toks(1000))
        .expect("all capacity is back");
    drop(again);
    assert_eq!(bulkhead.stats().released, 2);
}

#[test]
fn dropping_a_completed_future_counts_nothing() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut a = queued(&bulkhead, opts());
    drop(held);
    let permit = ready(&mut a).expect("handed the slot");
    drop(a);
    assert_eq!(figures(&bulkhead), (1, 0, 2));
    drop(permit);
    assert_eq!(bulkhead.stats().rejected, 0);
    assert_eq!(figures(&bulkhead), (0, 0, 2));
}
