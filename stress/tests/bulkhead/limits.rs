//! Limits at run time: raising `max_concurrent` hands the new slots to queued calls at once,
//! oldest first; lowering it revokes nothing (calls in flight finish) and admits no one until
//! `active` falls below the new limit; limits of a stale revision are ignored.

use async_bulkhead_llm::limits::ApplyOutcome;
use async_bulkhead_llm::{BulkheadError, bulkhead::BulkheadLimits};

use crate::support::{assert_pending, bulkhead, on_three_runtimes, ready, st};

/// 2 slots held, 5 queued; raised to 5: the three oldest are handed a slot at once, in order.
async fn raising_hands_slots_to_the_queue_in_order() {
    let bulkhead = bulkhead(2, 10);
    let held: Vec<_> = (0..2)
        .map(|_| bulkhead.try_acquire().expect("free"))
        .collect();
    let mut waiters = Vec::new();
    for _ in 0..5 {
        let mut waiter = bulkhead.acquire();
        assert_pending(&mut waiter).await;
        waiters.push(waiter);
    }
    let raised = bulkhead.set_max_concurrent(5).expect("valid");
    assert_eq!((raised.max_concurrent, raised.max_queue), (5, 10));
    assert_eq!(bulkhead.state(), st(5, 2), "handed over at once");
    let mut served = Vec::new();
    for waiter in &mut waiters[..3] {
        let permit = ready(waiter).await.expect("handed a new slot");
        assert_eq!(permit.limit_revision(), raised.revision);
        served.push(permit);
    }
    for waiter in &mut waiters[3..] {
        assert_pending(waiter).await;
    }
    assert!(matches!(
        bulkhead.try_acquire(),
        Err(BulkheadError::QueueFull { .. })
    ));
    // Raised again through `apply_limits`: the last two, in order.
    let next = BulkheadLimits::new(raised.revision + 1, 7).with_max_queue(10);
    assert!(bulkhead.apply_limits(next).unwrap().is_applied());
    assert_eq!(bulkhead.state(), st(7, 0));
    for waiter in &mut waiters[3..] {
        served.push(ready(waiter).await.expect("handed a new slot"));
    }
    drop((held, served));
    assert_eq!(bulkhead.state(), st(0, 0));
    assert_eq!(bulkhead.stats().admitted, 7);
}

on_three_runtimes!(
    raising_max_concurrent_hands_slots_to_queued_calls_at_once_in_fifo_order,
    super::raising_hands_slots_to_the_queue_in_order
);

/// 4 in flight, lowered to 2: all 4 keep their slots and finish; a new call queues until
/// `active` falls below 2, i.e. after three releases.
async fn lowering_lets_calls_in_flight_finish() {
    let bulkhead = bulkhead(4, 10);
    let mut held: Vec<_> = (0..4)
        .map(|_| bulkhead.try_acquire().expect("free"))
        .collect();
    let lowered = bulkhead.set_max_concurrent(2).expect("valid");
    assert_eq!(lowered.max_concurrent, 2);
    assert_eq!(bulkhead.state(), st(4, 0), "nothing revoked");
    assert_eq!(
        bulkhead.try_acquire().unwrap_err(),
        BulkheadError::QueueFull { state: st(4, 0) }
    );
    let mut waiter = bulkhead.acquire();
    assert_pending(&mut waiter).await;
    drop(held.pop());
    assert_eq!(bulkhead.state(), st(3, 1));
    drop(held.pop());
    assert_eq!(
        bulkhead.state(),
        st(2, 1),
        "2 active: still at the new limit"
    );
    assert_pending(&mut waiter).await;
    drop(held.pop());
    assert_eq!(bulkhead.state(), st(2, 0), "below the limit: handed over");
    let permit = ready(&mut waiter).await.expect("served");
    assert_eq!(permit.limit_revision(), lowered.revision);
    drop((held, permit));
    assert_eq!(bulkhead.state(), st(0, 0));
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released), (5, 5));
}

on_three_runtimes!(
    lowering_max_concurrent_lets_in_flight_calls_finish,
    super::lowering_lets_calls_in_flight_finish
);

#[test]
fn limits_of_a_stale_revision_are_ignored() {
    let bulkhead = bulkhead(3, 10);
    let start = bulkhead.limits();
    let current = BulkheadLimits::new(start.revision + 5, 4).with_max_queue(6);
    assert!(bulkhead.apply_limits(current).unwrap().is_applied());
    assert_eq!(bulkhead.limits(), current);
    for revision in [start.revision + 4, start.revision + 1] {
        let stale = BulkheadLimits::new(revision, 1);
        assert_eq!(
            bulkhead.apply_limits(stale),
            Ok(ApplyOutcome::Stale { current }),
            "revision {revision}"
        );
        assert_eq!(bulkhead.limits(), current, "unchanged");
    }
    let same = BulkheadLimits::new(current.revision, 9).with_max_queue(current.max_queue);
    assert_eq!(
        bulkhead.apply_limits(same),
        Ok(ApplyOutcome::Stale { current }),
        "the same revision"
    );
    assert_eq!(bulkhead.limits(), current);
    let held: Vec<_> = (0..4)
        .map(|_| bulkhead.try_acquire().expect("4 slots"))
        .collect();
    assert!(bulkhead.try_acquire().is_err());
    assert_eq!(bulkhead.stats().limits, current);
    drop(held);
    // `set_max_concurrent` and `set_max_queue` build on the current revision.
    let next = bulkhead.set_max_queue(2).expect("valid");
    assert_eq!(
        next,
        BulkheadLimits::new(current.revision + 1, 4).with_max_queue(2)
    );
}
