//! `call` runs a future under a slot and releases the slot when the future completes, when it
//! panics, and when the `call` future is dropped; a refused call is never started. The
//! statistics add up: admitted == released + active when quiet, each refusal counted once.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::FutureExt;

use async_bulkhead_llm::{Bulkhead, BulkheadError};

use crate::support::{Gate, assert_books, assert_pending, bulkhead, on_three_runtimes, ready, st};

async fn call_releases_its_slot_on_completion_panic_and_drop() {
    let bulkhead = bulkhead(1, 4);

    // Completes: the output is returned, the slot released.
    assert_eq!(bulkhead.run(async { "done" }).await, Ok("done"));
    assert_eq!(bulkhead.state(), st(0, 0));
    // A `Result` output is passed through as it is.
    let inner: Result<Result<u8, &str>, BulkheadError> = bulkhead.run(async { Err("bad") }).await;
    assert_eq!(inner, Ok(Err("bad")));

    // Panics: the panic reaches the caller, the slot is released.
    let panicked = AssertUnwindSafe(bulkhead.run(async { panic!("the call panics") }))
        .catch_unwind()
        .await;
    assert!(panicked.is_err());
    assert_eq!(bulkhead.state(), st(0, 0), "released by the panic");

    // Dropped while the body runs: the body is dropped, the slot released.
    let gate = Gate::new();
    let mut running = Box::pin(bulkhead.run(gate.wait()));
    assert_pending(&mut running).await;
    assert_eq!(bulkhead.state(), st(1, 0));
    drop(running);
    assert_eq!(bulkhead.state(), st(0, 0), "released by the drop");

    // Dropped while its slot is being handed on: a queued call waiting behind a running one
    // is served when the running one is dropped.
    let mut running = Box::pin(bulkhead.run(gate.wait()));
    assert_pending(&mut running).await;
    let mut behind = Box::pin(bulkhead.run(async { 7 }));
    assert_pending(&mut behind).await;
    drop(running);
    assert_eq!(ready(&mut behind).await, Ok(7));

    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released, stats.active), (6, 6, 0));
    assert_books(&bulkhead);
}

on_three_runtimes!(
    call_releases_the_slot_when_the_future_completes_panics_or_is_dropped,
    super::call_releases_its_slot_on_completion_panic_and_drop
);

/// A refused `call` never starts its future.
async fn a_refused_call_is_never_started() {
    let bulkhead = bulkhead(1, 0);
    let started = Arc::new(AtomicBool::new(false));
    let _held = bulkhead.try_acquire().expect("free");
    let flag = Arc::clone(&started);
    let refused = bulkhead
        .run(async move { flag.store(true, Ordering::Relaxed) })
        .await;
    assert!(matches!(refused, Err(BulkheadError::QueueFull { .. })));
    assert!(!started.load(Ordering::Relaxed));
}

on_three_runtimes!(
    a_refused_call_is_never_started,
    super::a_refused_call_is_never_started
);

/// Every attempt is counted exactly once: admitted, refused `QueueFull`, timed out, cancelled
/// or refused `Shutdown`; when quiet, admitted == released + active.
async fn every_attempt_is_counted_once() {
    let bulkhead = Bulkhead::builder(2)
        .max_queue(1)
        .queue_timeout(Duration::from_millis(10))
        .build()
        .expect("valid");
    let a = bulkhead.try_acquire().expect("1");
    let b = bulkhead.acquire_owned().await.expect("2");
    assert_books(&bulkhead);
    assert!(bulkhead.try_acquire().is_err()); // queue full (no free slot)
    assert!(bulkhead.acquire().await.is_err()); // timed out
    let mut cancelled = bulkhead.acquire();
    assert_pending(&mut cancelled).await;
    let mut full = bulkhead.acquire();
    assert!(ready(&mut full).await.is_err()); // queue full
    drop(cancelled);
    drop(a);
    assert_books(&bulkhead);
    let c = bulkhead.run(async { 3 }).await.expect("a free slot");
    assert_eq!(c, 3);
    bulkhead.close();
    assert!(bulkhead.try_acquire().is_err()); // shutdown
    assert_books(&bulkhead);
    drop(b);
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.admitted,
            stats.released,
            stats.active,
            stats.rejected_queue_full,
            stats.timed_out,
            stats.cancelled,
            stats.rejected_shutdown
        ),
        (3, 3, 0, 2, 1, 1, 1)
    );
    let attempts = 8;
    assert_eq!(
        stats.admitted
            + stats.rejected_queue_full
            + stats.timed_out
            + stats.cancelled
            + stats.rejected_shutdown,
        attempts
    );
    assert_books(&bulkhead);
}

on_three_runtimes!(
    the_stats_add_up_and_each_refusal_is_counted_once,
    super::every_attempt_is_counted_once
);
