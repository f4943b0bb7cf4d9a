//! The waiting path: more tasks than slots on a tokio multi-thread runtime, so most acquires
//! wait in the queue and are handed a slot by a release. Side by side with tokio's and
//! async-lock's semaphores in the same run. Each operation is acquire (awaited), one executor
//! yield while holding the slot, release; time per iteration is per operation across all tasks.
//!
//! Figures and ratios are recorded in `benches/README.md`.

use std::time::{Duration, Instant};

use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

const SLOTS: u32 = 4;
const TASKS: u64 = 64;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .expect("runtime")
}

/// Runs `TASKS` tasks doing `iters` operations in all; returns the wall time.
fn drive<F, Fut>(runtime: &tokio::runtime::Runtime, iters: u64, op: F) -> Duration
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let per_task = iters.div_ceil(TASKS);
    runtime.block_on(async move {
        let started = Instant::now();
        let tasks: Vec<_> = (0..TASKS)
            .map(|_| {
                let op = op.clone();
                tokio::spawn(async move {
                    for _ in 0..per_task {
                        op().await;
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("task");
        }
        started.elapsed()
    })
}

fn waiting(c: &mut Criterion) {
    let runtime = runtime();
    let mut group = c.benchmark_group("waiting_64_tasks_4_slots");
    group.throughput(Throughput::Elements(1));

    let plain = LlmBulkhead::builder("m", SLOTS as usize)
        .max_queue(TASKS as usize)
        .build()
        .expect("valid");
    group.bench_function(BenchmarkId::new("llm_bulkhead", "no_budget"), |b| {
        b.iter_custom(|iters| {
            let bulkhead = plain.clone();
            drive(&runtime, iters, move || {
                let bulkhead = bulkhead.clone();
                async move {
                    let permit = bulkhead
                        .acquire(&LlmRequest::new(), AcquireOptions::new())
                        .await;
                    tokio::task::yield_now().await;
                    drop(permit.expect("admitted"));
                }
            })
        })
    });

    let budgeted = LlmBulkhead::builder("m", SLOTS as usize)
        .max_queue(TASKS as usize)
        .token_budget(TokenBudget::new(1 << 34))
        .build()
        .expect("valid");
    let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000).expect("fits"));
    group.bench_function(BenchmarkId::new("llm_bulkhead", "budget"), |b| {
        b.iter_custom(|iters| {
            let bulkhead = budgeted.clone();
            drive(&runtime, iters, move || {
                let bulkhead = bulkhead.clone();
                async move {
                    let permit = bulkhead.acquire(&LlmRequest::new(), opts).await;
                    tokio::task::yield_now().await;
                    drop(permit.expect("admitted"));
                }
            })
        })
    });

    let tokio_sem = std::sync::Arc::new(tokio::sync::Semaphore::new(SLOTS as usize));
    group.bench_function(BenchmarkId::new("tokio_semaphore", "acquire"), |b| {
        b.iter_custom(|iters| {
            let sem = tokio_sem.clone();
            drive(&runtime, iters, move || {
                let sem = sem.clone();
                async move {
                    let permit = sem.acquire().await;
                    tokio::task::yield_now().await;
                    drop(permit.expect("open"));
                }
            })
        })
    });

    let lock_sem = std::sync::Arc::new(async_lock::Semaphore::new(SLOTS as usize));
    group.bench_function(BenchmarkId::new("async_lock_semaphore", "acquire"), |b| {
        b.iter_custom(|iters| {
            let sem = lock_sem.clone();
            drive(&runtime, iters, move || {
                let sem = sem.clone();
                async move {
                    let guard = sem.acquire().await;
                    tokio::task::yield_now().await;
                    drop(guard);
                }
            })
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    targets = waiting
}
criterion_main!(benches);
