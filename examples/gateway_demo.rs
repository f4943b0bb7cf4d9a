//! A simulated LLM gateway: hundreds of concurrent calls with random prompt sizes, output
//! ceilings and latencies go through one `LlmBulkhead` on a multi-threaded tokio runtime,
//! while a "control plane" pushes new limits halfway through and the gateway shuts down at the
//! end. Prints what was admitted, what was refused and why, how the token budget was used,
//! and the peaks against the limits.
//!
//! Run: `cargo run --release --example gateway_demo`

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, Limits, LlmBulkhead, LlmRequest, Priority, RejectReason,
    TokenBudget, TokenUsage,
};
use tokio::task::JoinSet;

const CALLS: usize = 600;
const MODEL: &str = "claude-sonnet-4";

/// Live figures the gateway tracks on its side, to show peaks against the limits.
#[derive(Default)]
struct Peaks {
    slots: AtomicU64,
    max_slots: AtomicU64,
    tokens: AtomicU64,
    max_tokens: AtomicU64,
    high_admitted: AtomicU64,
}

impl Peaks {
    fn enter(&self, tokens: u64) {
        let slots = self.slots.fetch_add(1, Ordering::AcqRel) + 1;
        self.max_slots.fetch_max(slots, Ordering::AcqRel);
        let held = self.tokens.fetch_add(tokens, Ordering::AcqRel) + tokens;
        self.max_tokens.fetch_max(held, Ordering::AcqRel);
    }

    fn leave(&self, tokens: u64) {
        self.slots.fetch_sub(1, Ordering::AcqRel);
        self.tokens.fetch_sub(tokens, Ordering::AcqRel);
    }
}

/// One simulated call: build a request, ask the bulkhead, "call the provider", settle.
async fn simulated_call(bulkhead: LlmBulkhead, peaks: Arc<Peaks>, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let prompt = "x".repeat(rng.usize(200..24_000));
    let max_tokens = rng.u64(256..=4096);
    let request = LlmRequest::new()
        .system("You are a careful assistant.")
        .user(prompt)
        .max_tokens(max_tokens);
    let priority = if rng.u8(0..5) == 0 {
        Priority::High
    } else {
        Priority::Normal
    };

    let permit = match bulkhead.try_acquire(&request, AcquireOptions::new().priority(priority)) {
        Ok(permit) => permit,
        // A gateway answers 429 (or 503 for shutdown) with the detail as the body.
        Err(AcquireError::Rejected(_)) => return,
        Err(AcquireError::Invalid(err)) => panic!("invalid request: {err}"),
    };
    if priority == Priority::High {
        peaks.high_admitted.fetch_add(1, Ordering::Relaxed);
    }
    let held = permit.held_tokens();
    peaks.enter(held);

    // The provider takes 20-250 ms and generates some of the allowed output.
    tokio::time::sleep(Duration::from_millis(rng.u64(20..250))).await;
    let input = permit.reservation().map_or(0, |r| r.input());
    let output = rng.u64(0..=max_tokens);
    let usage = TokenUsage::new(input, output).expect("small numbers");

    peaks.leave(held);
    permit.release(Some(usage));
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let bulkhead = LlmBulkhead::builder(MODEL, 24)
        .token_budget(TokenBudget::new(150_000).high_priority_reserve(25_000))
        .build()?;
    let first = bulkhead.limits();
    println!("async-bulkhead-llm demo: {CALLS} simulated calls to {MODEL}, 4 worker threads");
    println!(
        "limits at revision {}: max_concurrent {}, token budget {} (high-priority reserve {})",
        first.revision,
        first.max_concurrent,
        first.token_budget.unwrap().budget,
        first.token_budget.unwrap().high_priority_reserve,
    );

    let peaks = Arc::new(Peaks::default());
    let started = Instant::now();
    let mut calls = JoinSet::new();
    let mut arrivals = fastrand::Rng::with_seed(7);
    let mut raised = None;
    for i in 0..CALLS {
        calls.spawn(simulated_call(
            bulkhead.clone(),
            peaks.clone(),
            1000 + i as u64,
        ));
        // Bursty arrivals: mostly back to back, sometimes a pause.
        if arrivals.u8(0..4) == 0 {
            tokio::time::sleep(Duration::from_millis(arrivals.u64(1..15))).await;
        }
        if i == CALLS / 2 {
            // The control plane raises concurrency and budget halfway through.
            let next = Limits::new(1, 48).with_token_budget(250_000, 25_000);
            raised = Some(bulkhead.apply_limits(next)?.current());
        }
        if i == CALLS - 20 {
            // Shutdown begins: the last calls are refused with `shutdown`.
            bulkhead.close();
        }
    }
    while calls.join_next().await.is_some() {}
    let elapsed = started.elapsed();

    let stats = bulkhead.stats();
    let tokens = stats.token_budget.expect("budget configured");
    let raised = raised.expect("applied halfway");
    let by = stats.rejected_by_reason;
    println!(
        "limits at revision {}: max_concurrent {}, token budget {} (applied mid-run)",
        raised.revision,
        raised.max_concurrent,
        raised.token_budget.unwrap().budget
    );
    println!();
    println!(
        "  calls                {:>9}  in {:.2} s",
        CALLS,
        elapsed.as_secs_f64()
    );
    println!(
        "  admitted             {:>9}  ({} high priority)",
        stats.admitted,
        peaks.high_admitted.load(Ordering::Relaxed)
    );
    println!("  rejected             {:>9}", stats.rejected);
    for reason in [
        RejectReason::BudgetLimit,
        RejectReason::ConcurrencyLimit,
        RejectReason::Shutdown,
    ] {
        println!("    {:<18} {:>9}", reason.as_str(), by.get(reason));
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
        peaks.max_slots.load(Ordering::Relaxed),
        raised.max_concurrent
    );
    println!(
        "  peak tokens held     {:>9}  of a {} token budget (after the raise)",
        peaks.max_tokens.load(Ordering::Relaxed),
        raised.token_budget.unwrap().budget
    );
    println!(
        "  after shutdown       {:>9}  calls and {} tokens still in flight",
        stats.in_flight, tokens.in_flight_tokens
    );

    assert_eq!(
        stats.admitted + stats.rejected,
        CALLS as u64,
        "every call decided once"
    );
    assert_eq!(
        (stats.in_flight, tokens.in_flight_tokens),
        (0, 0),
        "everything returned"
    );
    assert_eq!(
        tokens.total_reserved,
        tokens.total_consumed + tokens.total_refunded,
        "every reservation was consumed or refunded"
    );
    Ok(())
}
