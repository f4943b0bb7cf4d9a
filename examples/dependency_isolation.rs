//! One service, two dependencies: a slow API (each call hangs for a second) and a fast one
//! (10 ms). The service can run 20 calls at once (its worker pool: threads, connections,
//! memory). A burst of 50 slow calls arrives, and then 20 fast ones.
//!
//! - Without a bulkhead the slow calls take every worker: the fast calls wait behind them and
//!   take as long as the slow ones.
//! - With `Bulkhead::builder(5).max_queue(20)` in front of the slow API, the slow calls hold at
//!   most 5 workers, 20 more wait (and give up after the queue timeout), the rest are refused
//!   at once with `QueueFull` (not retried); the fast calls are not affected.
//!
//! Run: `cargo run --release --example dependency_isolation`

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_bulkhead_llm::{Bulkhead, BulkheadError, bulkhead::BulkheadState};
use tokio::sync::Semaphore;

/// The service's worker pool.
const WORKERS: usize = 20;
const SLOW_CALL: Duration = Duration::from_secs(1);
const FAST_CALL: Duration = Duration::from_millis(10);
const SLOW_BURST: usize = 50;
const FAST_BURST: usize = 20;

/// One call to a dependency, run on one of the service's workers.
async fn call_dependency(workers: &Semaphore, latency: Duration) {
    let _worker = workers.acquire().await.expect("the pool stays open");
    tokio::time::sleep(latency).await;
}

#[derive(Default)]
struct Outcome {
    fast_latencies: Vec<Duration>,
    slow_done: usize,
    slow_queue_full: usize,
    slow_queue_timeout: usize,
}

async fn run(slow_api: Option<Bulkhead>) -> Outcome {
    let workers = Arc::new(Semaphore::new(WORKERS));
    let mut slow = Vec::new();
    for _ in 0..SLOW_BURST {
        let workers = Arc::clone(&workers);
        let slow_api = slow_api.clone();
        slow.push(tokio::spawn(async move {
            match slow_api {
                Some(bulkhead) => bulkhead
                    .run(call_dependency(&workers, SLOW_CALL))
                    .await
                    .err(),
                None => {
                    call_dependency(&workers, SLOW_CALL).await;
                    None
                }
            }
        }));
    }
    // The fast calls arrive just after the burst.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut fast = Vec::new();
    for _ in 0..FAST_BURST {
        let workers = Arc::clone(&workers);
        fast.push(tokio::spawn(async move {
            let started = Instant::now();
            call_dependency(&workers, FAST_CALL).await;
            started.elapsed()
        }));
    }
    let mut outcome = Outcome::default();
    for task in fast {
        outcome.fast_latencies.push(task.await.expect("fast call"));
    }
    for task in slow {
        match task.await.expect("slow call") {
            None => outcome.slow_done += 1,
            Some(BulkheadError::QueueFull { .. }) => outcome.slow_queue_full += 1,
            Some(BulkheadError::QueueTimeout { .. }) => outcome.slow_queue_timeout += 1,
            Some(other) => panic!("unexpected refusal: {other}"),
        }
    }
    outcome
}

fn report(title: &str, outcome: &mut Outcome) {
    outcome.fast_latencies.sort();
    let p50 = outcome.fast_latencies[outcome.fast_latencies.len() / 2];
    let max = *outcome.fast_latencies.last().expect("fast calls ran");
    println!("{title}");
    println!(
        "  fast-api: {} calls, p50 {:>7.1?}, max {:>7.1?}",
        outcome.fast_latencies.len(),
        p50,
        max
    );
    println!(
        "  slow-api: {} completed, {} refused (queue full), {} gave up (queue timeout)",
        outcome.slow_done, outcome.slow_queue_full, outcome.slow_queue_timeout
    );
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "{WORKERS} workers; a burst of {SLOW_BURST} slow calls ({SLOW_CALL:?} each), then \
         {FAST_BURST} fast calls ({FAST_CALL:?} each)\n"
    );
    let mut without = run(None).await;
    report("Without bulkhead:", &mut without);

    let slow_api = Bulkhead::builder(5)
        .max_queue(20)
        .queue_timeout(Duration::from_millis(1500))
        .on_reject(|error| {
            // The seed's `onBulkheadReject({ active, queued })`: a metric in a real service.
            let BulkheadState { active, queued, .. } = error.state();
            debug_assert!(active <= 5 && queued <= 20);
        })
        .build()?;
    let mut with = run(Some(slow_api.clone())).await;
    report(
        "\nWith bulkhead (slow-api: max_concurrent 5, max_queue 20):",
        &mut with,
    );
    let stats = slow_api.stats();
    println!(
        "  slow-api bulkhead: admitted {}, refused {} (queue full) + {} (timeout), now {:?}",
        stats.admitted,
        stats.rejected_queue_full,
        stats.timed_out,
        slow_api.state()
    );

    // What the example demonstrates, checked: the fast API is unaffected only with the
    // bulkhead.
    let fast_max = |o: &Outcome| *o.fast_latencies.last().expect("fast calls ran");
    assert!(
        fast_max(&without) >= SLOW_CALL / 2,
        "without isolation the fast calls wait"
    );
    assert!(
        fast_max(&with) < SLOW_CALL / 2,
        "with isolation the fast calls do not wait"
    );
    assert_eq!(with.slow_queue_full, SLOW_BURST - 5 - 20);
    Ok(())
}
