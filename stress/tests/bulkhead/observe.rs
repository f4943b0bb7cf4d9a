//! Observability: `state()` reports live `{active, queued}` at every step, and the reject hook
//! receives that state on every refusal (queue full, timeout, shutdown), once each; a hook
//! that panics is counted in `hook_panics` and the refusal still reaches its caller.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_bulkhead_llm::bulkhead::WaitOptions;
use async_bulkhead_llm::{Bulkhead, BulkheadError};

use crate::support::{Heard, assert_pending, on_three_runtimes, ready, st};

/// A walk through every kind of step, `state()` checked after each, and the hook's record
/// checked against the refusals the callers got.
async fn state_and_hook_at_every_step() {
    let heard = Heard::new();
    let bulkhead = heard
        .on(Bulkhead::builder(2)
            .max_queue(2)
            .queue_timeout(Duration::from_millis(20)))
        .build()
        .expect("valid");
    let mut refusals = Vec::new();
    assert_eq!(bulkhead.state(), st(0, 0));
    let a = bulkhead.try_acquire().expect("free");
    assert_eq!(bulkhead.state(), st(1, 0));
    let b = bulkhead.acquire().await.expect("free");
    assert_eq!(bulkhead.state(), st(2, 0));
    refusals.push(bulkhead.try_acquire().unwrap_err());
    assert_eq!(bulkhead.state(), st(2, 0), "a refusal changes nothing");

    let mut c = bulkhead.acquire_with(
        WaitOptions::new().deadline(std::time::Instant::now() + Duration::from_secs(30)),
    );
    assert_pending(&mut c).await;
    assert_eq!(bulkhead.state(), st(2, 1));
    // Times out after 20 ms (the queue timeout), alone in the queue.
    let timed_out = bulkhead.acquire().await.unwrap_err();
    assert!(matches!(timed_out, BulkheadError::QueueTimeout { state, .. } if state == st(2, 1)));
    refusals.push(timed_out);
    assert_eq!(bulkhead.state(), st(2, 1));

    let mut d = bulkhead.acquire();
    assert_pending(&mut d).await;
    assert_eq!(bulkhead.state(), st(2, 2));
    let mut e = bulkhead.acquire();
    refusals.push(ready(&mut e).await.unwrap_err());
    assert_eq!(refusals[2], BulkheadError::QueueFull { state: st(2, 2) });

    drop(a);
    assert_eq!(bulkhead.state(), st(2, 1), "handed to the oldest waiter");
    // `c`'s 20 ms may have passed, but a wait ends only when its future is polled, and a
    // hand-off that arrived first wins.
    let c = ready(&mut c).await.expect("handed the slot of a");
    drop(b);
    assert_eq!(bulkhead.state(), st(2, 0));
    let d = d.await.expect("handed the slot of b");
    bulkhead.close();
    refusals.push(bulkhead.try_acquire().unwrap_err());
    assert_eq!(refusals[3], BulkheadError::Shutdown { state: st(2, 0) });
    drop((c, d));
    assert_eq!(bulkhead.state(), st(0, 0));

    assert_eq!(
        heard.all(),
        refusals,
        "the hook heard each refusal once, in order"
    );
    assert_eq!(heard.states(), vec![st(2, 0), st(2, 1), st(2, 2), st(2, 0)]);
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.rejected_queue_full,
            stats.timed_out,
            stats.rejected_shutdown
        ),
        (2, 1, 1)
    );
    assert_eq!(
        (stats.admitted, stats.released, stats.hook_panics),
        (4, 4, 0)
    );
}

on_three_runtimes!(
    state_is_exact_at_each_step_and_the_hook_hears_each_refusal_with_it,
    super::state_and_hook_at_every_step
);

/// A hook that panics on every refusal: each panic is counted, every refusal still returns to
/// its caller, and the bulkhead keeps working.
async fn a_panicking_hook_is_counted_and_refusals_still_return() {
    let calls = Arc::new(AtomicU64::new(0));
    let bulkhead = {
        let calls = Arc::clone(&calls);
        Bulkhead::builder(1)
            .max_queue(1)
            .queue_timeout(Duration::from_millis(10))
            .on_reject(move |error| {
                calls.fetch_add(1, Ordering::Relaxed);
                panic!("hook panics on {error}");
            })
            .build()
            .expect("valid")
    };
    let held = bulkhead.try_acquire().expect("free");
    assert!(matches!(
        bulkhead.try_acquire(),
        Err(BulkheadError::QueueFull { .. })
    ));
    assert!(matches!(
        bulkhead.acquire().await,
        Err(BulkheadError::QueueTimeout { .. })
    ));
    let mut queued = bulkhead.acquire_with(
        WaitOptions::new().deadline(std::time::Instant::now() + Duration::from_secs(30)),
    );
    // The queue timeout (10 ms) still applies; hand the slot over before polling again.
    assert_pending(&mut queued).await;
    drop(held);
    let permit = queued.await.expect("handed over");
    bulkhead.close();
    assert!(matches!(
        bulkhead.try_acquire(),
        Err(BulkheadError::Shutdown { .. })
    ));
    drop(permit);
    assert_eq!(calls.load(Ordering::Relaxed), 3);
    let stats = bulkhead.stats();
    assert_eq!(stats.hook_panics, 3);
    assert_eq!(
        (
            stats.rejected_queue_full,
            stats.timed_out,
            stats.rejected_shutdown
        ),
        (1, 1, 1)
    );
    assert_eq!(bulkhead.state(), st(0, 0));
}

on_three_runtimes!(
    a_panicking_hook_is_counted_in_hook_panics_and_the_refusal_is_still_returned,
    super::a_panicking_hook_is_counted_and_refusals_still_return
);
