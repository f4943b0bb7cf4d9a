//! The error types: `QueueFull` when `active >= max_concurrent` and the queue is full,
//! `QueueTimeout` when a queued call waited too long; neither is retried (re-queueing a shed
//! request is exactly the load the bulkhead exists to refuse), and both say so. `Shutdown`
//! refuses new calls and queued calls after `close`.

use std::time::Duration;

use async_bulkhead_llm::{Bulkhead, BulkheadError};

use crate::support::{Heard, assert_pending, bulkhead, on_three_runtimes, ready, st};

#[test]
fn every_error_says_not_to_retry_and_is_not_retryable() {
    let full = BulkheadError::QueueFull { state: st(2, 1) };
    let timeout = BulkheadError::QueueTimeout {
        waited: Duration::from_millis(1_500),
        state: st(2, 0),
    };
    let shutdown = BulkheadError::Shutdown { state: st(1, 0) };
    assert_eq!(
        full.to_string(),
        "bulkhead queue full (2 active, 1 queued); the call was shed: do not retry it"
    );
    assert_eq!(
        timeout.to_string(),
        "bulkhead queue timeout after 1.5s (2 active, 0 queued); the call was shed: do not retry it"
    );
    assert_eq!(
        shutdown.to_string(),
        "bulkhead is shut down; the call was refused: do not retry it"
    );
    for (error, name, state) in [
        (full, "bulkhead_queue_full", st(2, 1)),
        (timeout, "bulkhead_queue_timeout", st(2, 0)),
        (shutdown, "bulkhead_shutdown", st(1, 0)),
    ] {
        assert!(!error.is_retryable(), "{error}");
        assert!(error.to_string().contains("do not retry"));
        assert_eq!(error.as_str(), name);
        assert_eq!(error.state(), state);
        let boxed: Box<dyn std::error::Error> = Box::new(error);
        assert!(boxed.source().is_none());
    }
}

/// `QueueFull` exactly when every slot is taken and the queue is full: with 2 slots and 1
/// place, the first three calls get a slot or a place and the fourth is refused.
async fn queue_full_when_slots_and_queue_are_full() {
    let bulkhead = bulkhead(2, 1);
    let first = bulkhead.acquire().await.expect("slot 1");
    let second = bulkhead.acquire().await.expect("slot 2");
    let mut third = bulkhead.acquire();
    assert_pending(&mut third).await;
    let mut fourth = bulkhead.acquire();
    let refused = ready(&mut fourth).await.unwrap_err();
    assert_eq!(refused, BulkheadError::QueueFull { state: st(2, 1) });
    assert!(!refused.is_retryable());
    // A place frees: the next call may queue again.
    drop(first);
    let third = ready(&mut third).await.expect("promoted");
    let mut fifth = bulkhead.acquire();
    assert_pending(&mut fifth).await;
    drop((second, third));
    drop(fifth.await.expect("served"));
    assert_eq!(bulkhead.stats().rejected_queue_full, 1);
}

on_three_runtimes!(
    queue_full_when_active_reaches_max_concurrent_and_the_queue_is_full,
    super::queue_full_when_slots_and_queue_are_full
);

/// `QueueTimeout` when a queued call waits longer than the queue timeout.
async fn queue_timeout_when_a_call_waits_too_long() {
    let bulkhead = Bulkhead::builder(1)
        .queue_timeout(Duration::from_millis(20))
        .build()
        .expect("valid");
    let _held = bulkhead.try_acquire().expect("free");
    let refused = bulkhead.acquire().await.unwrap_err();
    let BulkheadError::QueueTimeout { waited, state } = refused else {
        panic!("expected a queue timeout, got {refused:?}")
    };
    assert!(waited >= Duration::from_millis(20), "{waited:?}");
    assert_eq!(state, st(1, 0));
    assert!(!refused.is_retryable());
    assert_eq!(bulkhead.stats().timed_out, 1);
}

on_three_runtimes!(
    queue_timeout_when_a_queued_call_waits_longer_than_the_queue_timeout,
    super::queue_timeout_when_a_call_waits_too_long
);

/// After `close`: queued calls are refused `Shutdown` at once (woken), and every new call of
/// every kind too; the hook hears each refusal; calls in flight keep their slots.
async fn shutdown_refuses_new_and_queued_calls() {
    let heard = Heard::new();
    let bulkhead = heard.on(Bulkhead::builder(1)).build().expect("valid");
    let held = bulkhead.try_acquire().expect("free");
    let mut queued_a = bulkhead.acquire();
    assert_pending(&mut queued_a).await;
    let mut queued_b = Box::pin(bulkhead.run(async { unreachable!("never started") }));
    assert_pending(&mut queued_b).await;
    assert_eq!(bulkhead.state(), st(1, 2));

    assert!(bulkhead.close());
    assert_eq!(bulkhead.state(), st(1, 0), "the queue is emptied at once");
    let closed = BulkheadError::Shutdown { state: st(1, 0) };
    assert_eq!(ready(&mut queued_a).await.unwrap_err(), closed);
    let refused: Result<(), _> = ready(&mut queued_b).await;
    assert_eq!(refused.unwrap_err(), closed);

    assert_eq!(bulkhead.try_acquire().unwrap_err(), closed);
    assert_eq!(bulkhead.try_acquire_owned().unwrap_err(), closed);
    assert_eq!(bulkhead.acquire().await.unwrap_err(), closed);
    assert_eq!(bulkhead.acquire_owned().await.unwrap_err(), closed);
    assert_eq!(bulkhead.run(async {}).await.unwrap_err(), closed);
    assert_eq!(bulkhead.acquire_blocking().unwrap_err(), closed);
    assert!(closed.to_string().contains("do not retry"));
    assert!(!closed.is_retryable());

    assert_eq!(heard.all(), vec![closed; 8]);
    drop(held);
    assert_eq!(bulkhead.state(), st(0, 0));
    let stats = bulkhead.stats();
    assert!(stats.closed);
    assert_eq!(
        (stats.rejected_shutdown, stats.admitted, stats.released),
        (8, 1, 1)
    );
}

on_three_runtimes!(
    shutdown_refuses_new_calls_and_queued_calls_after_close,
    super::shutdown_refuses_new_and_queued_calls
);
