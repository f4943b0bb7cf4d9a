//! The `metrics` and `tracing` integrations, read back: a test recorder (`metrics-util`'s
//! `DebuggingRecorder`) and a test subscriber (a `tracing-subscriber` layer that keeps every
//! event and span) record a mixed workload on two threads, and what they recorded must equal
//! `stats()` (counters, gauges, event counts) and the events the bulkhead emitted (histogram
//! counts, admission ids, spans).

mod metrics;
mod tracing;

use std::sync::{Arc, Barrier, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget, TokenUsage,
    usage::Progressive,
};

/// Serializes this binary's tests. `tracing` caches each callsite's interest process-wide and
/// rebuilds it when a dispatcher comes or goes: a test that records spans through its own
/// thread-local dispatcher, run beside another whose threads hit the same callsites without
/// one, sometimes found its `queue_wait` span disabled (its events logged outside any span;
/// about 1 run in 12 in parallel, 0 in 60 alone or serialized).
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Calls each worker makes.
const CALLS: usize = 400;

/// A bulkhead the workload fills: 2 slots, a queue of 1, a budget for 3 reservations of
/// `100 + 1000` (slots run out first, so a third call queues; a progressive report can make
/// room for tokens above a reservation, refused for tokens).
fn bulkhead() -> LlmBulkhead {
    LlmBulkhead::builder("gpt-4o", 2)
        .max_queue(1)
        .queue_timeout(Duration::from_millis(2))
        .token_budget(TokenBudget::new(3500))
        .name("primary")
        .tenant("acme")
        .build()
        .expect("valid")
}

fn options() -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(100, 1000).expect("valid"))
}

/// One worker's calls: admissions released with usage, with progressive reports, dropped
/// without usage; refusals (two held at once), queued waits that are admitted or time out.
fn worker(bulkhead: &LlmBulkhead, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let request = LlmRequest::new();
    for _ in 0..CALLS {
        match rng.u8(0..5) {
            0 => {
                if let Ok(permit) = bulkhead.try_acquire(&request, options()) {
                    permit.release(Some(TokenUsage::new(90, rng.u64(1..1500)).expect("valid")));
                }
            }
            1 => {
                if let Ok(mut permit) = bulkhead.try_acquire(&request, options()) {
                    let usage = TokenUsage::new(100, 300).expect("valid");
                    let _ = permit.report_usage_progressive(usage, Progressive::new(600));
                    let _ = permit.report_usage(TokenUsage::new(100, 400).expect("valid"));
                    drop(permit);
                }
            }
            2 => {
                // Two at once: the second is often refused.
                let first = bulkhead.try_acquire(&request, options());
                let second = bulkhead.try_acquire(&request, options());
                thread::yield_now();
                drop((first, second));
            }
            _ => {
                // One held, a second waited for: it queues while the other worker holds the
                // other slot, and is admitted when that one is released (or times out).
                let first = bulkhead.try_acquire(&request, options());
                if let Ok(permit) = bulkhead.acquire_blocking(&request, options()) {
                    thread::sleep(Duration::from_micros(rng.u64(0..200)));
                    permit.release(None);
                }
                drop(first);
            }
        }
    }
}

/// Runs the workload on two threads, each inside `enter` (which sets up what must be
/// thread-local, e.g. a tracing dispatcher), started together.
fn on_two_threads(bulkhead: &LlmBulkhead, enter: impl Fn(&dyn Fn()) + Sync) {
    let start = Arc::new(Barrier::new(2));
    thread::scope(|scope| {
        for seed in [7, 11] {
            let start = &start;
            let enter = &enter;
            scope.spawn(move || {
                enter(&|| {
                    start.wait();
                    worker(bulkhead, seed);
                })
            });
        }
    }); // Whatever the scheduling did above, one call waits and is handed a slot: both slots held,
    // a third call queues (with a timeout far beyond this step), the first release hands it
    // the slot. Each thread inside `enter`, as the workers.
    enter(&|| {
        let request = LlmRequest::new();
        let held: Vec<_> = (0..2)
            .map(|_| {
                bulkhead
                    .try_acquire(&request, options())
                    .expect("a free slot")
            })
            .collect();
        thread::scope(|scope| {
            let waiter = scope.spawn(|| {
                enter(&|| {
                    let options = options().timeout(Duration::from_secs(60));
                    let permit = bulkhead
                        .acquire_blocking(&LlmRequest::new(), options)
                        .expect("handed a slot");
                    permit.release(None);
                })
            });
            while bulkhead.stats().pending == 0 {
                thread::yield_now();
            }
            drop(held);
            waiter.join().expect("the waiter");
        });
    });
}
