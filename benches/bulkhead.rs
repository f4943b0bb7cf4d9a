//! The general `Bulkhead` beside tokio's and async-lock's semaphores, in the same run:
//!
//! - `bulkhead_uncontended`: one thread, a free slot: `try_acquire` + release, and
//!   `acquire().await` + release polled in a loop inside one `block_on`.
//! - `bulkhead_waiting_64_tasks_4_slots`: the queued hand-off: 64 tasks on a tokio runtime of
//!   1 or 2 workers share 4 slots, so most acquires wait in the queue and are handed a slot by
//!   a release. Each operation is acquire (awaited), one executor yield while holding the
//!   slot, release; time per iteration is per operation across all tasks. The bulkhead runs
//!   with its defaults (queue timeout 10 s, so every queued wait arms a timer) and with
//!   `wait_indefinitely` (no timer: what a semaphore's `acquire` does).
//!
//! Figures and ratios are recorded in `benches/README.md`; `benches/targets.py` judges them.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_bulkhead_llm::Bulkhead;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

const SLOTS: u32 = 4;
const TASKS: u64 = 64;

fn uncontended(c: &mut Criterion) {
    let mut group = c.benchmark_group("bulkhead_uncontended");
    group.throughput(Throughput::Elements(1));
    let ours = Bulkhead::new(1024).expect("valid");
    group.bench_function("bulkhead_try_acquire", |b| {
        b.iter(|| drop(black_box(ours.try_acquire())))
    });
    let tokio_sem = tokio::sync::Semaphore::new(1024);
    group.bench_function("tokio_semaphore_try_acquire", |b| {
        b.iter(|| drop(black_box(tokio_sem.try_acquire())))
    });
    let lock_sem = async_lock::Semaphore::new(1024);
    group.bench_function("async_lock_semaphore_try_acquire", |b| {
        b.iter(|| drop(black_box(lock_sem.try_acquire())))
    });
    group.bench_function("bulkhead_acquire_await", |b| {
        b.iter_custom(|iters| {
            futures::executor::block_on(async {
                let started = Instant::now();
                for _ in 0..iters {
                    drop(black_box(ours.acquire().await));
                }
                started.elapsed()
            })
        })
    });
    group.bench_function("tokio_semaphore_acquire_await", |b| {
        b.iter_custom(|iters| {
            futures::executor::block_on(async {
                let started = Instant::now();
                for _ in 0..iters {
                    drop(black_box(tokio_sem.acquire().await));
                }
                started.elapsed()
            })
        })
    });
    group.finish();
}

fn runtime(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
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

/// The queued hand-off, on one tokio worker (every hand-off runs on one core: the cost of
/// the machinery itself) and on two (two cores contending for the queue, as a gateway's
/// workers do; on a machine whose cores are shared, which of the two cases a run resembles
/// depends on where the scheduler puts the workers: `benches/README.md`).
fn waiting(c: &mut Criterion) {
    let mut group = c.benchmark_group("bulkhead_waiting_64_tasks_4_slots");
    group.throughput(Throughput::Elements(1));
    for workers in [1, 2] {
        let runtime = runtime(workers);
        let cases = [
            (
                "bulkhead_defaults",
                Bulkhead::builder(SLOTS as usize)
                    .max_queue(TASKS as usize)
                    .build()
                    .expect("valid"),
            ),
            (
                "bulkhead_wait_indefinitely",
                Bulkhead::builder(SLOTS as usize)
                    .max_queue(TASKS as usize)
                    .wait_indefinitely()
                    .build()
                    .expect("valid"),
            ),
        ];
        for (case, bulkhead) in cases {
            group.bench_function(BenchmarkId::new(case, workers), |b| {
                b.iter_custom(|iters| {
                    let bulkhead = bulkhead.clone();
                    drive(&runtime, iters, move || {
                        let bulkhead = bulkhead.clone();
                        async move {
                            let permit = bulkhead.acquire().await;
                            tokio::task::yield_now().await;
                            drop(permit.expect("admitted"));
                        }
                    })
                })
            });
        }

        let tokio_sem = Arc::new(tokio::sync::Semaphore::new(SLOTS as usize));
        group.bench_function(BenchmarkId::new("tokio_semaphore", workers), |b| {
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

        let lock_sem = Arc::new(async_lock::Semaphore::new(SLOTS as usize));
        group.bench_function(BenchmarkId::new("async_lock_semaphore", workers), |b| {
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
    }
    group.finish();
}

criterion_group!(quick, uncontended);
criterion_group! {
    name = handoff;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    targets = waiting
}
criterion_main!(quick, handoff);
