//! The ledger's cost, against a real redis-server started here on a free loopback port:
//! exact mode's reservation + release (the global release
//! is sent by the background task, pipelined) beside one `PING` round trip, exact admissions per
//! second through one Redis with 64 concurrent tasks (the multiplexed connection pipelines
//! them), and leased mode's admission (the local bulkhead with the leased slice as its
//! budget) beside the plain local bulkhead.

#[path = "../tests/common/mod.rs"]
mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget};
use async_bulkhead_llm_redis::{ExactLedger, LeasedLedger, LedgerConfig};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

fn bulkhead() -> LlmBulkhead {
    LlmBulkhead::builder("m", 1_024)
        .token_budget(TokenBudget::new(10_000_000))
        .build()
        .unwrap()
}

fn options() -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(100, 400).unwrap())
}

fn ledger(c: &mut Criterion) {
    let server = common::RedisServer::start();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let config = |ns: &str| {
        LedgerConfig::new(server.url(), ns, 10_000_000)
            .replica_id("bench")
            .timeout(Duration::from_secs(2))
    };
    let exact = runtime
        .block_on(ExactLedger::connect(bulkhead(), config("{bench-exact}")))
        .unwrap();
    let request = LlmRequest::new();
    let mut group = c.benchmark_group("ledger");
    group.throughput(Throughput::Elements(1));
    group.bench_function("ping", |b| {
        b.to_async(&runtime)
            .iter(|| async { exact.ping().await.unwrap() })
    });
    group.bench_function("exact_reserve_release", |b| {
        b.to_async(&runtime).iter(|| async {
            let permit = exact.try_acquire(&request, options()).await.unwrap();
            black_box(permit.release(None));
        })
    });
    // 64 tasks share the iterations: the time per admission is the inverse of the rate.
    group.bench_function("exact_64_tasks", |b| {
        b.iter_custom(|iters| {
            runtime.block_on(async {
                let tasks = 64;
                let each = iters.div_ceil(tasks);
                let started = Instant::now();
                let handles: Vec<_> = (0..tasks)
                    .map(|_| {
                        let exact = exact.clone();
                        tokio::spawn(async move {
                            let request = LlmRequest::new();
                            for _ in 0..each {
                                let permit = exact.try_acquire(&request, options()).await.unwrap();
                                permit.release(None);
                            }
                        })
                    })
                    .collect();
                for handle in handles {
                    handle.await.unwrap();
                }
                started.elapsed() * u32::try_from(iters).unwrap_or(u32::MAX)
                    / u32::try_from(each * tasks).unwrap_or(u32::MAX)
            })
        })
    });
    let stats = exact.stats();
    eprintln!(
        "exact mode: {} releases, {} of them on a reservation",
        stats.releases_deferred, stats.releases_on_reservations
    );
    let local = bulkhead();
    let leased_bulkhead = bulkhead();
    // No rebalance during the measurement: the admission on the slice is what is measured.
    let leased_config = config("{bench-leased}")
        .lease(Duration::from_secs(3_000))
        .renew_every(Duration::from_secs(1_000));
    let _leased = runtime
        .block_on(LeasedLedger::start(leased_bulkhead.clone(), leased_config))
        .unwrap();
    group.bench_function("local_acquire_release", |b| {
        b.iter(|| drop(black_box(local.try_acquire(&request, options()).unwrap())))
    });
    group.bench_function("leased_acquire_release", |b| {
        b.iter(|| {
            drop(black_box(
                leased_bulkhead.try_acquire(&request, options()).unwrap(),
            ))
        })
    });
    group.finish();
}

criterion_group!(benches, ledger);
criterion_main!(benches);
