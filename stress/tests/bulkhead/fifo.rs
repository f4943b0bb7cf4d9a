//! FIFO promotion: when a slot frees up, the oldest queued call is promoted, so queued calls
//! are admitted in arrival order as slots free, and a newcomer (`try_acquire` or `acquire`)
//! never barges past them.

use async_bulkhead_llm::BulkheadError;

use crate::support::{assert_pending, bulkhead, on_three_runtimes, ready, st};

const WAITERS: usize = 8;

/// 2 slots held, 8 queued: each release promotes exactly the oldest waiter.
async fn queued_calls_are_admitted_in_arrival_order() {
    let bulkhead = bulkhead(2, 10);
    let mut held: Vec<_> = (0..2)
        .map(|_| bulkhead.try_acquire().expect("free"))
        .collect();
    let mut waiters = Vec::new();
    for _ in 0..WAITERS {
        let mut waiter = bulkhead.acquire();
        assert_pending(&mut waiter).await;
        waiters.push(Some(waiter));
    }
    assert_eq!(bulkhead.state(), st(2, 8));
    for promoted in 0..WAITERS {
        drop(held.remove(0));
        // Handed over at once: the slot counts as active though its owner has not polled.
        assert_eq!(bulkhead.state(), st(2, (WAITERS - promoted - 1) as u64));
        for later in waiters.iter_mut().skip(promoted + 1).flatten() {
            assert_pending(later).await;
        }
        let mut oldest = waiters[promoted].take().expect("not yet served");
        held.push(ready(&mut oldest).await.expect("the oldest is promoted"));
    }
    assert_eq!(bulkhead.state(), st(2, 0));
    drop(held);
    assert_eq!(bulkhead.state(), st(0, 0));
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released), (10, 10));
}

on_three_runtimes!(
    the_oldest_queued_call_is_promoted_when_a_slot_frees,
    super::queued_calls_are_admitted_in_arrival_order
);

/// A slot freed while a call waits goes to it, not to a newcomer: `try_acquire` is refused
/// `QueueFull` and a newcomer's `acquire` queues behind the waiter, even at the moment the
/// slot is handed over (before the waiter has polled).
async fn a_newcomer_never_barges_past_queued_calls() {
    let bulkhead = bulkhead(1, 4);
    let held = bulkhead.try_acquire().expect("free");
    let mut first = bulkhead.acquire();
    assert_pending(&mut first).await;
    // While it waits, newcomers may not pass it.
    assert_eq!(
        bulkhead.try_acquire().unwrap_err(),
        BulkheadError::QueueFull { state: st(1, 1) }
    );
    drop(held);
    // The slot went to `first`, though it has not polled yet.
    assert_eq!(bulkhead.state(), st(1, 0));
    assert_eq!(
        bulkhead.try_acquire().unwrap_err(),
        BulkheadError::QueueFull { state: st(1, 0) }
    );
    assert!(bulkhead.try_acquire_owned().is_err());
    let mut second = bulkhead.acquire();
    assert_pending(&mut second).await;
    assert_eq!(bulkhead.state(), st(1, 1));
    let first = ready(&mut first).await.expect("first keeps its place");
    assert_pending(&mut second).await;
    drop(first);
    let second = ready(&mut second).await.expect("then the newcomer");
    drop(second);
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.rejected_queue_full), (3, 3));
}

on_three_runtimes!(
    a_newcomer_never_barges_past_queued_calls,
    super::a_newcomer_never_barges_past_queued_calls
);
