//! Drain after close: `drain` completes when the last permit drops (queued calls were refused
//! by the close), and not before; `drain_timeout` reports what is still in flight.

use std::time::Duration;

use async_bulkhead_llm::BulkheadError;

use crate::support::{assert_pending, bulkhead, on_three_runtimes, ready, st};

async fn drain_completes_when_the_last_permit_drops() {
    let bulkhead = bulkhead(2, 4);
    let first = bulkhead.try_acquire().expect("free");
    let second = bulkhead.acquire_owned().await.expect("free");
    let mut queued = bulkhead.acquire();
    assert_pending(&mut queued).await;

    assert!(bulkhead.close());
    let mut drain = bulkhead.drain();
    assert_pending(&mut drain).await;
    assert!(matches!(
        ready(&mut queued).await,
        Err(BulkheadError::Shutdown { .. })
    ));
    assert_eq!(bulkhead.state(), st(2, 0));
    drop(first);
    assert_pending(&mut drain).await;
    let report = bulkhead.drain_timeout(Duration::from_millis(10)).await;
    assert!(!report.drained);
    assert_eq!((report.in_flight, report.pending), (1, 0));
    // The last permit drops on another task's thread.
    std::thread::spawn(move || drop(second))
        .join()
        .expect("no panic");
    drain.await;
    assert_eq!(bulkhead.state(), st(0, 0));
    bulkhead.drain().await; // at once when already idle
    let stats = bulkhead.stats();
    assert_eq!(
        (stats.admitted, stats.released, stats.rejected_shutdown),
        (2, 2, 1)
    );
}

on_three_runtimes!(
    drain_after_close_completes_when_the_last_permit_drops,
    super::drain_completes_when_the_last_permit_drops
);
