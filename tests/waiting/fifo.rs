//! FIFO order and direct hand-off; no barging past waiters.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Poll, Waker};

use async_bulkhead_llm::futures::Acquire;
use async_bulkhead_llm::{Limits, Priority, RejectReason, admission::Verdict};

use crate::support::{
    WakeCount, assert_pending, budgeted, count, counting_waker, figures, opts, plain, poll_with,
    queued, ready, reason_of, rejection, req, toks,
};

/// An empty request for futures that outlive the statement that made them (an acquire
/// borrows its request until its first poll).
static EMPTY_REQUEST: std::sync::LazyLock<async_bulkhead_llm::LlmRequest> =
    std::sync::LazyLock::new(async_bulkhead_llm::LlmRequest::new);

#[test]
fn releases_grant_waiters_strictly_in_arrival_order() {
    let bulkhead = plain(1, 8);
    let mut held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let wakers: Vec<(Waker, Arc<WakeCount>)> = (0..5).map(|_| counting_waker()).collect();
    let mut waiters: Vec<Option<Pin<Box<Acquire<'_, 'static>>>>> = Vec::new();
    for (i, (waker, _)) in wakers.iter().enumerate() {
        let mut fut = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, opts()));
        assert!(poll_with(&mut fut, waker).is_pending(), "waiter {i} queues");
        assert_eq!(bulkhead.stats().pending, i as u64 + 1);
        waiters.push(Some(fut));
    }
    assert_eq!(figures(&bulkhead), (1, 5, 1));

    let mut order = Vec::new();
    for turn in 0..5 {
        drop(held);
        // The slot went straight to the head: in flight at once, admitted only once picked up.
        assert_eq!(figures(&bulkhead), (1, 4 - turn as u64, 1 + turn as u64));
        // Exactly the head was woken by this release.
        let woken: Vec<usize> = wakers.iter().map(|(_, c)| c.get()).collect();
        let expected: Vec<usize> = (0..5).map(|j| usize::from(j <= turn)).collect();
        assert_eq!(woken, expected, "wake-ups after release {turn}");
        // Poll every remaining waiter (with its own waker), latest first: only the head is
        // ready.
        let mut granted = None;
        for j in (turn..5).rev() {
            let fut = waiters[j].as_mut().expect("still waiting");
            if let Poll::Ready(result) = poll_with(fut, &wakers[j].0) {
                assert!(granted.is_none(), "a single waiter is granted per release");
                order.push(j);
                granted = Some(result.expect("handed the slot"));
            }
        }
        waiters[turn] = None;
        held = granted.expect("the head was granted");
        assert_eq!(held.limit_revision(), 0);
        assert_eq!(figures(&bulkhead), (1, 4 - turn as u64, 2 + turn as u64));
    }
    assert_eq!(order, vec![0, 1, 2, 3, 4]);
    drop(held);
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.pending,
            stats.admitted,
            stats.released
        ),
        (0, 0, 6, 6)
    );
    assert_eq!(stats.rejected, 0);
}

#[test]
fn raising_max_concurrent_admits_the_first_waiters_at_once_in_order() {
    let bulkhead = plain(1, 8);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let wakers: Vec<(Waker, Arc<WakeCount>)> = (0..5).map(|_| counting_waker()).collect();
    let mut waiters: Vec<Pin<Box<Acquire<'_, 'static>>>> = wakers
        .iter()
        .map(|(waker, _)| {
            let mut fut = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, opts()));
            assert!(poll_with(&mut fut, waker).is_pending());
            fut
        })
        .collect();
    assert_eq!(figures(&bulkhead), (1, 5, 1));

    let outcome = bulkhead
        .apply_limits(Limits::new(1, 4).with_max_queue(8))
        .expect("valid limits");
    assert!(outcome.is_applied());
    // Three slots freed: the first three waiters hold them at once, the last two still wait.
    assert_eq!(figures(&bulkhead), (4, 2, 1));
    let woken: Vec<usize> = wakers.iter().map(|(_, c)| c.get()).collect();
    assert_eq!(woken, vec![1, 1, 1, 0, 0]);

    assert_pending(&mut waiters[4]);
    assert_pending(&mut waiters[3]);
    let mut permits = Vec::new();
    for waiter in &mut waiters[..3] {
        let permit = ready(waiter).expect("handed a slot");
        assert_eq!(
            permit.limit_revision(),
            1,
            "granted under the raised limits"
        );
        permits.push(permit);
    }
    assert_eq!(figures(&bulkhead), (4, 2, 4));

    drop(held);
    assert_eq!(figures(&bulkhead), (4, 1, 4));
    assert_pending(&mut waiters[4]);
    permits.push(ready(&mut waiters[3]).expect("fourth in line"));
    drop(permits.remove(0));
    assert_eq!(figures(&bulkhead), (4, 0, 5));
    permits.push(ready(&mut waiters[4]).expect("fifth in line"));
    drop(permits);
    assert_eq!(figures(&bulkhead), (0, 0, 6));
    assert_eq!(bulkhead.stats().released, 6);
}

#[test]
fn priority_does_not_reorder_the_queue() {
    let bulkhead = budgeted(1, 4, 10_000);
    let held = bulkhead.try_acquire(&req(), toks(100)).expect("free slot");
    let mut normal = queued(&bulkhead, toks(100));
    let mut high = queued(&bulkhead, toks(100).priority(Priority::High));
    drop(held);
    assert_pending(&mut high);
    let first = ready(&mut normal).expect("first in line");
    assert_eq!(first.priority(), Priority::Normal);
    drop(first);
    let second = ready(&mut high).expect("second in line");
    assert_eq!(second.priority(), Priority::High);
    drop(second);
    assert_eq!(figures(&bulkhead), (0, 0, 3));
}

#[test]
fn an_acquire_takes_its_place_at_its_first_poll_not_at_creation() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut created_first = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, opts()));
    let mut polled_first = queued(&bulkhead, opts());
    assert_eq!(
        bulkhead.stats().pending,
        1,
        "an unpolled acquire is not queued"
    );
    assert_pending(&mut created_first);
    assert_eq!(bulkhead.stats().pending, 2);
    drop(held);
    assert_pending(&mut created_first);
    let permit = ready(&mut polled_first).expect("first to be polled, first served");
    drop(permit);
    drop(ready(&mut created_first).expect("served second"));
    assert_eq!(figures(&bulkhead), (0, 0, 3));
}

#[test]
fn an_acquire_with_a_free_slot_is_admitted_at_its_first_poll() {
    let bulkhead = plain(2, 4);
    let mut fut = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, opts()));
    let permit = ready(&mut fut).expect("free slot");
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    let mut owned = Box::pin(bulkhead.acquire_owned(&req(), opts()));
    let owned_permit = ready(&mut owned).expect("free slot");
    assert_eq!(figures(&bulkhead), (2, 0, 2));
    drop((permit, owned_permit));
    assert_eq!(figures(&bulkhead), (0, 0, 2));
}

#[test]
fn released_counts_a_permit_whose_slot_was_handed_to_a_waiter() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut waiter = queued(&bulkhead, opts());
    drop(held);
    // Single thread, nothing racing: every figure must be exact. One admission (`held`) was
    // made and settled; the waiter holds the slot but has not been admitted yet.
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.admitted), (1, 1));
    assert_eq!(stats.released, 1, "`held` was released");
    drop(ready(&mut waiter).expect("handed the slot"));
    assert_eq!(bulkhead.stats().released, 2);
}

// ===== no barging =====

#[test]
fn a_slot_handed_to_a_waiter_is_not_taken_by_try_acquire() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut waiter = queued(&bulkhead, opts());
    drop(held);
    // The slot already belongs to the waiter, although its future has not run again.
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    let refused = rejection(bulkhead.try_acquire(&req(), opts().priority(Priority::High)));
    assert_eq!(refused.reason(), RejectReason::ConcurrencyLimit);
    assert_eq!(refused.detail().in_flight, 1);
    assert_eq!(
        reason_of(bulkhead.try_acquire_owned(&req(), opts())),
        RejectReason::ConcurrencyLimit
    );
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    let permit = ready(&mut waiter).expect("the waiter gets the slot");
    assert_eq!(figures(&bulkhead), (1, 0, 2));
    assert_eq!(count(&bulkhead, RejectReason::ConcurrencyLimit), 2);
    drop(permit);
    assert_eq!(figures(&bulkhead), (0, 0, 2));
}

#[test]
fn a_fresh_acquire_queues_behind_existing_waiters() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut a = queued(&bulkhead, opts());
    let mut b = queued(&bulkhead, opts());
    drop(held);
    assert_eq!(figures(&bulkhead), (1, 1, 1));
    // A newcomer sees the queue and joins its tail, even before A has picked its slot up.
    assert_eq!(
        bulkhead.would_admit(&req(), opts()).expect("valid"),
        Verdict::Queue
    );
    let mut c = queued(&bulkhead, opts());
    assert_eq!(figures(&bulkhead), (1, 2, 1));
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts())),
        RejectReason::ConcurrencyLimit
    );
    let pa = ready(&mut a).expect("A first");
    drop(pa);
    assert_pending(&mut c);
    let pb = ready(&mut b).expect("B before the newcomer");
    drop(pb);
    let pc = ready(&mut c).expect("then the newcomer");
    drop(pc);
    assert_eq!(figures(&bulkhead), (0, 0, 4));
    assert_eq!(bulkhead.stats().rejected, 1);
}
