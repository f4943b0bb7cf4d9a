//! Usage-reconciliation stress on real runtimes (tokio multi-thread and current-thread, smol,
//! async-std, a futures thread pool) and on blocked threads: many callers acquire
//! (`try_acquire`, queued `acquire` with timeouts, `run`), stream cumulative usage reports
//! (plain and progressive, stale ones, refused ones, holds rising above the reservation and
//! falling below it), and settle by releasing with or without usage, by dropping the permit or
//! by cancelling a `run`, while a control plane changes the limits and the budget (and, in
//! some runs, closes the bulkhead halfway and drains it) and a listener subscribed to every
//! event checks and tallies them (some runs have no listener, which takes other paths).
//!
//! Every caller keeps its own model of its admission (the hold rules and the booking split of
//! `src/usage.rs`, written here independently) and checks each report and each release against
//! it. A ledger of holders, kept by the callers themselves, checks the concurrency ceiling
//! during the run. At the end everything must be back and every book must balance: the
//! bulkhead's counters against the callers' sums, the listener's per-admission traces (usage
//! events, sum of their `delta_tokens`, the release) against the callers' own, and
//! `reserved + overrun + reheld == consumed + refunded + returned_unreported`.
//!
//! Two focused tests check that an overrun hold really blocks admissions until it is released.
//!
//! `STRESS_SCALE` (default 1) multiplies the number of callers, e.g. `STRESS_SCALE=100`.

use std::future::poll_fn;
use std::task::Poll;

use async_bulkhead_llm::{AcquireOptions, Reservation, TokenUsage};

mod books;
mod callers;
mod overrun;
mod plan;
mod runtimes;

fn scale() -> u64 {
    std::env::var("STRESS_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1)
}

/// Yields to the executor once, whatever the runtime.
async fn yield_now() {
    let mut yielded = false;
    poll_fn(|cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await
}

async fn yields(n: usize) {
    for _ in 0..n {
        yield_now().await;
    }
}

fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).expect("usage fits in u64")
}

fn with(reservation: Reservation) -> AcquireOptions {
    AcquireOptions::new().reservation(reservation)
}

/// Slots of the bulkheads whose concurrency limit never changes.
const SLOTS: u32 = 4;
/// The largest `max_concurrent` the varying control plane ever applies.
const PEAK_SLOTS: u32 = 6;
/// Concurrent callers of the async scenarios (a few per slot).
const WORKERS: u64 = 10;
