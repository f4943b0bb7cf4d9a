//! The same admission code under smol and under async-std: the crate needs no runtime of its
//! own (its queue timeouts run on its own timer thread outside tokio), so one gateway function
//! runs unchanged on both.
//!
//! Each run: a bulkhead of 4 calls and 10,000 tokens in flight with a queue of 32; 24 tasks
//! (spawned on the runtime) each acquire (waiting in the queue), "call the provider" for a few
//! milliseconds (the runtime's own sleep), and release with the usage the call reported; then
//! one call that finds the bulkhead full and waits 30 ms in the queue is refused `timeout`.
//! Checked: every task admitted, never more than 4 calls or 10,000 tokens in flight, the books
//! exact (nothing left in flight, every reservation settled), the timeout exact.
//!
//! Run: `cargo run --example runtimes`.

// Refusals carry their capacity snapshot by value (boxing it would allocate on every refusal).
#![allow(clippy::result_large_err)]

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, Reservation, TokenBudget, TokenUsage,
};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What a runtime lends the gateway code: a way to spawn a task and a way to sleep.
struct Runtime {
    name: &'static str,
    spawn: fn(BoxFuture<u64>) -> BoxFuture<u64>,
    sleep: fn(Duration) -> BoxFuture<()>,
}

/// The gateway code: identical on every runtime.
async fn burst(runtime: &Runtime) -> Result<(), Box<dyn std::error::Error>> {
    let bulkhead = LlmBulkhead::builder("gpt-4o", 4)
        .max_queue(32)
        .token_budget(TokenBudget::new(10_000))
        .build()?;
    let peak_calls = Arc::new(AtomicU64::new(0));
    let peak_tokens = Arc::new(AtomicU64::new(0));
    let tasks: Vec<BoxFuture<u64>> = (0..24u64)
        .map(|i| {
            let (bulkhead, peak_calls, peak_tokens) =
                (bulkhead.clone(), peak_calls.clone(), peak_tokens.clone());
            let sleep = runtime.sleep;
            (runtime.spawn)(Box::pin(async move {
                let reservation = Reservation::new(500, 1_000 + 100 * (i % 5)).unwrap();
                let options = AcquireOptions::new()
                    .reservation(reservation)
                    .timeout(Duration::from_secs(10));
                let permit = bulkhead
                    .acquire_owned(&LlmRequest::new(), options)
                    .await
                    .expect("admitted: the queue has room and a long timeout");
                let stats = bulkhead.stats();
                peak_calls.fetch_max(stats.in_flight, Ordering::Relaxed);
                let tokens = stats.token_budget.map_or(0, |b| b.in_flight_tokens);
                peak_tokens.fetch_max(tokens, Ordering::Relaxed);
                sleep(Duration::from_millis(2 + i % 3)).await; // the provider's call
                let usage = TokenUsage::new(500, 300 + 10 * i).unwrap();
                permit.release(Some(usage));
                usage.total()
            }))
        })
        .collect();
    let mut consumed = 0;
    for task in tasks {
        consumed += task.await;
    }
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.in_flight, stats.pending), (24, 0, 0));
    let budget = stats.token_budget.expect("a budget");
    assert_eq!(
        (budget.in_flight_tokens, budget.total_consumed),
        (0, consumed)
    );
    let (calls, tokens) = (
        peak_calls.load(Ordering::Relaxed),
        peak_tokens.load(Ordering::Relaxed),
    );
    assert!(
        calls <= 4 && tokens <= 10_000,
        "{calls} calls, {tokens} tokens"
    );

    // A full bulkhead and a short wait: refused by the crate's own timer, on this runtime.
    let small = || AcquireOptions::new().reservation(Reservation::new(10, 10).unwrap());
    let held: Vec<_> = (0..4)
        .map(|_| bulkhead.try_acquire_owned(&LlmRequest::new(), small()))
        .collect::<Result<_, _>>()?;
    let started = Instant::now();
    let short = small().timeout(Duration::from_millis(30));
    let refused = bulkhead
        .acquire(&LlmRequest::new(), short)
        .await
        .expect_err("no slot frees within 30 ms");
    let waited = started.elapsed();
    let reason = refused.rejection().map(|r| r.reason());
    assert_eq!(reason, Some(RejectReason::Timeout));
    assert!(waited >= Duration::from_millis(30), "{waited:?}");
    drop(held);
    println!(
        "{:<10} 24 calls admitted through a queue (peak {calls} calls, {tokens} tokens in \
         flight of 4 / 10,000), {consumed} tokens consumed, a full bulkhead's 30 ms wait \
         refused `timeout` after {:.1} ms",
        runtime.name,
        waited.as_secs_f64() * 1e3
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let smol = Runtime {
        name: "smol",
        spawn: |task| Box::pin(smol::spawn(task)),
        sleep: |by| {
            Box::pin(async move {
                smol::Timer::after(by).await;
            })
        },
    };
    smol::block_on(burst(&smol))?;
    let async_std = Runtime {
        name: "async-std",
        spawn: |task| Box::pin(async_std::task::spawn(task)),
        sleep: |by| Box::pin(async_std::task::sleep(by)),
    };
    async_std::task::block_on(burst(&async_std))?;
    Ok(())
}
