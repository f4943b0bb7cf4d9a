//! A simulated LLM gateway: hundreds of concurrent calls with random prompt sizes, output
//! ceilings and latencies go through one `LlmBulkhead` on a multi-threaded tokio runtime.
//! Interactive calls fail fast (`try_acquire`); batch calls wait in the bounded FIFO queue of
//! the batch profile (`acquire`), some with a short timeout. Halfway through, a "control plane"
//! pushes new limits; at the end the gateway closes the bulkhead and drains it. Prints what
//! was admitted, what waited and for how long, what was refused and why, how the token budget
//! was used, and the peaks against the limits.
//!
//! Run: `cargo run --release --example gateway_demo`

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, Limits, LlmBulkhead, LlmRequest, Priority, Profile, RejectReason,
    TokenBudget, TokenUsage,
};
use tokio::task::JoinSet;

const CALLS: usize = 600;
const MODEL: &str = "claude-sonnet-4";

/// Figures the gateway tracks on its side, to show peaks and waits.
#[derive(Default)]
struct Gauges {
    slots: AtomicU64,
    max_slots: AtomicU64,
    tokens: AtomicU64,
    max_tokens: AtomicU64,
    max_pending: AtomicU64,
    high_admitted: AtomicU64,
    batch_admitted: AtomicU64,
    waited: AtomicU64,
    wait_micros: AtomicU64,
    max_wait_micros: AtomicU64,
}

impl Gauges {
    fn enter(&self, tokens: u64, pending: u64) {
        let slots = self.slots.fetch_add(1, Ordering::AcqRel) + 1;
        self.max_slots.fetch_max(slots, Ordering::AcqRel);
        let held = self.tokens.fetch_add(tokens, Ordering::AcqRel) + tokens;
        self.max_tokens.fetch_max(held, Ordering::AcqRel);
        self.max_pending.fetch_max(pending, Ordering::AcqRel);
    }

    fn leave(&self, tokens: u64) {
        self.slots.fetch_sub(1, Ordering::AcqRel);
        self.tokens.fetch_sub(tokens, Ordering::AcqRel);
    }

    fn waited(&self, wait: Duration) {
        let micros = wait.as_micros() as u64;
        self.waited.fetch_add(1, Ordering::Relaxed);
        self.wait_micros.fetch_add(micros, Ordering::Relaxed);
        self.max_wait_micros.fetch_max(micros, Ordering::Relaxed);
    }
}

/// One simulated call: build a request, ask the bulkhead, "call the provider", settle.
async fn simulated_call(bulkhead: LlmBulkhead, gauges: Arc<Gauges>, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let prompt = "x".repeat(rng.usize(200..24_000));
    let max_tokens = rng.u64(256..=4096);
    let request = LlmRequest::new()
        .system("You are a careful assistant.")
        .user(prompt)
        .max_tokens(max_tokens);
    let interactive = rng.bool();
    let priority = if interactive && rng.u8(0..4) == 0 {
        Priority::High
    } else {
        Priority::Normal
    };
    let mut options = AcquireOptions::new().priority(priority);

    let asked = Instant::now();
    let admitted = if interactive {
        // Interactive traffic never waits: answer 429 at once if there is no room.
        bulkhead.try_acquire(&request, options)
    } else {
        // Batch traffic waits in the queue (the profile's 30 s timeout, or 150 ms for some).
        if rng.bool() {
            options = options.timeout(Duration::from_millis(150));
        }
        bulkhead.acquire(&request, options).await
    };
    let permit = match admitted {
        Ok(permit) => permit,
        // A gateway answers 429 (or 503 for shutdown) with `rejection.detail()` as the body.
        Err(AcquireError::Rejected(_)) => return,
        Err(AcquireError::Invalid(err)) => panic!("invalid request: {err}"),
    };
    let wait = asked.elapsed();
    if !interactive {
        gauges.batch_admitted.fetch_add(1, Ordering::Relaxed);
        if wait > Duration::from_micros(200) {
            gauges.waited(wait);
        }
    }
    if priority == Priority::High {
        gauges.high_admitted.fetch_add(1, Ordering::Relaxed);
    }
    let held = permit.held_tokens();
    gauges.enter(held, bulkhead.stats().pending);

    // The provider takes 50-300 ms and generates part of the allowed output.
    tokio::time::sleep(Duration::from_millis(rng.u64(50..300))).await;
    let input = permit.reservation().map_or(0, |r| r.input());
    let output = max_tokens * rng.u64(5..70) / 100;
    let usage = TokenUsage::new(input, output).expect("small numbers");

    gauges.leave(held);
    permit.release(Some(usage));
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let bulkhead = LlmBulkhead::builder(MODEL, 16)
        .profile(Profile::Batch)
        .token_budget(TokenBudget::new(100_000).high_priority_reserve(15_000))
        .build()?;
    let first = bulkhead.limits();
    let budget = first.token_budget.expect("configured");
    println!("async-bulkhead-llm demo: {CALLS} simulated calls to {MODEL}, 4 worker threads");
    println!(
        "limits at revision {}: max_concurrent {}, max_queue {} (batch profile, 30 s timeout), \
         token budget {} (high-priority reserve {})",
        first.revision,
        first.max_concurrent,
        first.max_queue,
        budget.budget,
        budget.high_priority_reserve,
    );

    let gauges = Arc::new(Gauges::default());
    let started = Instant::now();
    let mut calls = JoinSet::new();
    let mut arrivals = fastrand::Rng::with_seed(7);
    let mut raised = None;
    for i in 0..CALLS {
        calls.spawn(simulated_call(
            bulkhead.clone(),
            gauges.clone(),
            1000 + i as u64,
        ));
        // Bursty arrivals: mostly back to back, sometimes a pause.
        if arrivals.u8(0..3) == 0 {
            tokio::time::sleep(Duration::from_millis(arrivals.u64(2..20))).await;
        }
        if i == CALLS / 2 {
            // The control plane raises concurrency and budget halfway through; waiters are
            // admitted at once.
            let next = Limits::new(1, 32)
                .with_max_queue(20)
                .with_token_budget(160_000, 15_000);
            raised = Some(bulkhead.apply_limits(next)?.current());
        }
    }
    // Shutdown: refuse new work and whoever still waits, then wait for the calls in flight.
    bulkhead.close();
    let report = bulkhead.drain_timeout(Duration::from_secs(10)).await;
    while calls.join_next().await.is_some() {}
    let elapsed = started.elapsed();

    let stats = bulkhead.stats();
    let tokens = stats.token_budget.expect("budget configured");
    let raised = raised.expect("applied halfway");
    let by = stats.rejected_by_reason;
    let waited = gauges.waited.load(Ordering::Relaxed);
    println!(
        "limits at revision {}: max_concurrent {}, token budget {} (applied mid-run)",
        raised.revision,
        raised.max_concurrent,
        raised.token_budget.expect("configured").budget
    );
    println!();
    println!(
        "  calls                {:>9}  in {:.2} s",
        CALLS,
        elapsed.as_secs_f64()
    );
    println!(
        "  admitted             {:>9}  ({} high priority, {} batch)",
        stats.admitted,
        gauges.high_admitted.load(Ordering::Relaxed),
        gauges.batch_admitted.load(Ordering::Relaxed)
    );
    println!(
        "    after queueing     {:>9}  (mean wait {:.1} ms, longest {:.1} ms, peak queue {})",
        waited,
        gauges.wait_micros.load(Ordering::Relaxed) as f64 / waited.max(1) as f64 / 1000.0,
        gauges.max_wait_micros.load(Ordering::Relaxed) as f64 / 1000.0,
        gauges.max_pending.load(Ordering::Relaxed),
    );
    println!("  rejected             {:>9}", stats.rejected);
    for reason in RejectReason::ALL {
        if by.get(reason) > 0 {
            println!("    {:<18} {:>9}", reason.as_str(), by.get(reason));
        }
    }
    println!("  tokens reserved      {:>9}", tokens.total_reserved);
    println!("  tokens consumed      {:>9}", tokens.total_consumed);
    println!(
        "  tokens refunded      {:>9}  ({:.0}% of the reservations returned at release)",
        tokens.total_refunded,
        100.0 * tokens.total_refunded as f64 / tokens.total_reserved.max(1) as f64
    );
    println!(
        "  peak in flight       {:>9}  of {} slots (after the raise)",
        gauges.max_slots.load(Ordering::Relaxed),
        raised.max_concurrent
    );
    println!(
        "  peak tokens held     {:>9}  of a {} token budget (after the raise)",
        gauges.max_tokens.load(Ordering::Relaxed),
        raised.token_budget.expect("configured").budget
    );
    println!(
        "  drain after close    {:>9}  ({} in flight, {} queued when it completed)",
        if report.drained {
            "drained"
        } else {
            "timed out"
        },
        report.in_flight,
        report.pending
    );

    assert!(
        report.drained,
        "every call finished within the drain deadline"
    );
    assert_eq!(
        stats.admitted + stats.rejected,
        CALLS as u64,
        "every call decided once"
    );
    assert_eq!(
        (stats.in_flight, stats.pending, tokens.in_flight_tokens),
        (0, 0, 0),
        "everything returned"
    );
    assert_eq!(
        tokens.total_reserved,
        tokens.total_consumed + tokens.total_refunded,
        "every reservation was consumed or refunded"
    );
    Ok(())
}
