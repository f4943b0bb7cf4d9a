//! The problem the bulkhead solves: a slow dependency (its calls hang until released) and a
//! fast one share a service. With a bulkhead of 5 in front of the slow one, 50 concurrent slow
//! calls take 5 slots and the rest queue (or are refused beyond `max_queue`), and every fast
//! call completes at once while the slow ones are stuck. With one shared pool of 50 in front
//! of both, the slow calls take every slot and the fast calls are blocked.

use std::pin::Pin;

use futures::future::join_all;

use async_bulkhead_llm::{Bulkhead, BulkheadError};

use crate::support::{Gate, assert_pending, bulkhead, on_three_runtimes, poll_once, ready, st};

/// How many slow calls arrive at once.
const SLOW_CALLS: usize = 50;
/// How many fast calls arrive while the slow ones are stuck.
const FAST_CALLS: usize = 100;

/// Starts `SLOW_CALLS` slow calls through `through` (each polled once: it takes a slot and
/// hangs on the gate, queues, or is refused) and returns them.
async fn start_slow_calls<'a>(
    through: &'a Bulkhead,
    gate: &Gate,
) -> Vec<Pin<Box<impl Future<Output = Result<&'static str, BulkheadError>> + Send + 'a>>> {
    let mut calls = Vec::with_capacity(SLOW_CALLS);
    for _ in 0..SLOW_CALLS {
        let wait = gate.wait();
        let mut call = Box::pin(through.run(async move {
            wait.await;
            "slow"
        }));
        assert_pending(&mut call).await;
        calls.push(call);
    }
    calls
}

/// Slow capped at 5 (default queue of 50): 5 run, 45 queue, none refused; 100 fast calls
/// through their own bulkhead all complete at their first poll while the slow ones are stuck.
async fn with_a_bulkhead_fast_calls_complete_while_slow_ones_are_stuck() {
    let slow = Bulkhead::new(5).expect("valid");
    let fast = bulkhead(50, 200);
    let mut gate = Gate::new();
    let slow_calls = start_slow_calls(&slow, &gate).await;
    assert_eq!(slow.state(), st(5, 45), "5 slots taken, 45 queued");

    let mut fast_calls = Box::pin(join_all(
        (0..FAST_CALLS).map(|_| fast.run(async { "fast" })),
    ));
    let done = ready(&mut fast_calls).await;
    assert_eq!(done.len(), FAST_CALLS);
    assert!(done.iter().all(|r| *r == Ok("fast")), "{done:?}");
    assert_eq!(slow.state(), st(5, 45), "the slow calls are still stuck");
    let fast_stats = fast.stats();
    assert_eq!(
        (fast_stats.admitted, fast_stats.released, fast_stats.active),
        (100, 100, 0)
    );
    assert_eq!(fast_stats.rejected_queue_full + fast_stats.timed_out, 0);

    gate.open();
    let slow_done = join_all(slow_calls).await;
    assert!(slow_done.iter().all(|r| *r == Ok("slow")));
    let stats = slow.stats();
    assert_eq!((stats.admitted, stats.released), (50, 50));
    assert_eq!(slow.state(), st(0, 0));
}

on_three_runtimes!(
    with_a_bulkhead_of_5_fifty_slow_calls_take_5_slots_and_fast_calls_complete_promptly,
    super::with_a_bulkhead_fast_calls_complete_while_slow_ones_are_stuck
);

/// Slow capped at 5 with a queue of 20 (the sizing guide's slow API): of 50 slow calls 5 run,
/// 20 queue and 25 are refused `QueueFull` at once; the fast calls are unaffected.
async fn with_a_bulkhead_and_a_short_queue_the_excess_is_refused() {
    let slow = bulkhead(5, 20);
    let fast = bulkhead(50, 200);
    let mut gate = Gate::new();
    let mut refused = 0;
    let mut slow_calls = Vec::new();
    for _ in 0..SLOW_CALLS {
        let wait = gate.wait();
        let mut call = Box::pin(slow.run(async move {
            wait.await;
            "slow"
        }));
        match poll_once(&mut call).await {
            std::task::Poll::Ready(Err(BulkheadError::QueueFull { state })) => {
                assert_eq!(state, st(5, 20));
                refused += 1;
            }
            std::task::Poll::Ready(other) => panic!("unexpected {other:?}"),
            std::task::Poll::Pending => slow_calls.push(call),
        }
    }
    assert_eq!((slow_calls.len(), refused), (25, 25));
    assert_eq!(slow.state(), st(5, 20));
    assert_eq!(slow.stats().rejected_queue_full, 25);

    let mut fast_calls = Box::pin(join_all((0..FAST_CALLS).map(|_| fast.run(async { 1u32 }))));
    let done = ready(&mut fast_calls).await;
    assert_eq!(done.into_iter().map(Result::unwrap).sum::<u32>(), 100);

    gate.open();
    let slow_done = join_all(slow_calls).await;
    assert_eq!(slow_done.iter().filter(|r| **r == Ok("slow")).count(), 25);
    assert_eq!(slow.state(), st(0, 0));
    assert_eq!((slow.stats().admitted, slow.stats().released), (25, 25));
}

on_three_runtimes!(
    with_max_queue_20_fifty_slow_calls_run_5_queue_20_and_25_are_refused,
    super::with_a_bulkhead_and_a_short_queue_the_excess_is_refused
);

/// One shared pool of 50 in front of both: the 50 slow calls take every slot, and fast calls
/// are blocked (queued, never done, `try_acquire` refused) until slow calls finish.
async fn without_a_bulkhead_fast_calls_are_blocked() {
    let shared = Bulkhead::new(50).expect("valid");
    let mut gate = Gate::new();
    let slow_calls = start_slow_calls(&shared, &gate).await;
    assert_eq!(shared.state(), st(50, 0), "0 slots left");

    let mut fast_calls = Box::pin(join_all((0..10).map(|_| shared.run(async { "fast" }))));
    assert_pending(&mut fast_calls).await;
    assert_eq!(shared.state(), st(50, 10), "every fast call is blocked");
    assert!(matches!(
        shared.try_acquire(),
        Err(BulkheadError::QueueFull { state }) if state == st(50, 10)
    ));
    assert_pending(&mut fast_calls).await;
    assert_eq!(shared.stats().admitted, 50, "no fast call got in");

    gate.open();
    let slow_done = join_all(slow_calls).await;
    assert!(slow_done.iter().all(|r| *r == Ok("slow")));
    let fast_done = fast_calls.await;
    assert!(fast_done.iter().all(|r| *r == Ok("fast")));
    let stats = shared.stats();
    assert_eq!(
        (stats.admitted, stats.released, stats.rejected_queue_full),
        (60, 60, 1)
    );
}

on_three_runtimes!(
    without_a_bulkhead_fifty_slow_calls_leave_0_slots_and_fast_calls_are_blocked,
    super::without_a_bulkhead_fast_calls_are_blocked
);
