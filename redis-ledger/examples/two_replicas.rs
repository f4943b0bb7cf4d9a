//! Two gateway replicas sharing one token budget through a local Redis, first in exact mode,
//! then in leased mode. Run it with a Redis on 127.0.0.1:6379 (or set `REDIS_URL`):
//!
//! ```sh
//! redis-server --port 6379 --save '' &
//! cargo run -p async-bulkhead-llm-redis --example two_replicas
//! ```

use std::time::Duration;

use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget};
use async_bulkhead_llm_redis::{
    ExactLedger, FailurePolicy, LeasedLedger, LedgerConfig, LedgerRefusal,
};

/// One replica's local bulkhead: each alone would allow 8,000 tokens in flight.
fn bulkhead() -> Result<LlmBulkhead, Box<dyn std::error::Error>> {
    Ok(LlmBulkhead::builder("gpt-4o", 64)
        .token_budget(TokenBudget::new(8_000))
        .build()?)
}

fn call(input: u64, output: u64) -> Result<AcquireOptions, Box<dyn std::error::Error>> {
    Ok(AcquireOptions::new().reservation(Reservation::new(input, output)?))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    // A namespace of its own per run, so that runs never see each other's holds.
    let ns = format!("{{example-{}}}", std::process::id());
    let config = |replica: &str| {
        LedgerConfig::new(url.clone(), ns.clone(), 10_000)
            .replica_id(replica)
            .lease(Duration::from_secs(6))
            .failure(FailurePolicy::LocalFloor { tokens: 1_000 })
    };

    println!("exact mode: 10,000 tokens shared by two replicas of 8,000 each");
    let a = ExactLedger::connect(bulkhead()?, config("gateway-a")).await?;
    let b = ExactLedger::connect(bulkhead()?, config("gateway-b")).await?;
    let first = a.acquire(&LlmRequest::new(), call(1_000, 5_000)?).await?;
    println!("  a holds 6,000 (global: {:?})", a.global().await?);
    match b.acquire(&LlmRequest::new(), call(1_000, 5_000)?).await {
        Err(LedgerRefusal::Global(refused)) => println!(
            "  b refused globally, HTTP 429: {} requested, {} of {} held by both replicas",
            refused.requested, refused.global_in_flight, refused.global_budget
        ),
        other => return Err(format!("b should have been refused globally: {other:?}").into()),
    }
    let second = b.acquire(&LlmRequest::new(), call(1_000, 3_000)?).await?;
    println!(
        "  b holds 4,000: the budget is full ({:?})",
        b.global().await?
    );
    first.release(None);
    second.release(None);
    assert!(a.settled(Duration::from_secs(2)).await && b.settled(Duration::from_secs(2)).await);
    assert_eq!(a.global().await?.in_flight_tokens, 0);
    println!("  both released: every token is back");
    a.close().await?;
    b.close().await?;

    println!("leased mode: each replica installs a slice as its local budget");
    let (local_a, local_b) = (bulkhead()?, bulkhead()?);
    let a = LeasedLedger::start(local_a.clone(), config("gateway-a")).await?;
    println!("  a alone leases {}", a.slice());
    let b = LeasedLedger::start(local_b.clone(), config("gateway-b")).await?;
    println!("  b joins and leases {} (what a left)", b.slice());
    // b is refused a 3,000-token call for want of tokens; a is idle: a rebalance moves the
    // budget.
    assert!(
        local_b
            .try_acquire(&LlmRequest::new(), call(1_000, 2_000)?)
            .is_err()
    );
    a.rebalance().await?;
    b.rebalance().await?;
    println!(
        "  after a rebalance: a {} (idle), b {}",
        a.slice(),
        b.slice()
    );
    assert!(a.slice() + b.slice() <= 10_000 && b.slice() > 0);
    let permit = local_b.try_acquire(&LlmRequest::new(), call(1_000, 2_000)?)?;
    println!(
        "  b admits locally, lock-free, on its slice ({} tokens held)",
        permit.held_tokens()
    );
    drop(permit);
    a.close().await?;
    b.close().await?;
    Ok(())
}
