//! Admission fast path, side by side with its baselines in one run.
//!
//! - `uncontended/no_budget`: `try_acquire` + drop of one permit, against tokio's and
//!   async-lock's semaphores and a raw `AtomicU64` CAS loop.
//! - `uncontended/budget`: the same with a token budget (reservation given), against two tokio
//!   semaphores (slot + `try_acquire_many(tokens)`) and a raw packed-`AtomicU64` CAS loop that
//!   checks slot and tokens together (the floor: the least work one CAS decision can do).
//! - `scaling/<case>/<threads>`: 1, 2 and 4 threads hammering one limiter; time per iteration
//!   is the wall time for one operation on each thread (throughput in elements = operations).
//! - `vs_js/*`: `acquire().await` + release in a loop, like for like with the JavaScript
//!   original's async `acquire` (`benches/js/bench.mjs`).
//! - `rejection/*`: the refusal path (full, closed) against tokio's `try_acquire` on an empty
//!   semaphore.
//! - `events/*`: the budget cycle with no listener, with a listener for another kind only
//!   (must cost the same: one relaxed load per event), and with a no-op listener on every kind
//!   (two events and two clock reads per cycle); `events_2_threads/*`: the same on two threads
//!   at once (listening threads must not serialise on the listener list).
//! - `usage/*`: one cycle with a streamed usage report before release, against the same cycle
//!   settled with usage at release only.
//!
//! Figures and ratios are recorded in `benches/README.md`.

use std::hint::black_box;
use std::sync::Barrier;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget, TokenUsage,
    events::EventKind, usage::Progressive,
};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

/// Reservation used by every budget case: 100 input + 1000 max output.
const RESERVED: u64 = 1100;

/// The floor: slots (low 16 bits) and tokens (high 48 bits) in one word, decided by one CAS
/// loop on acquire and one on release.
struct RawPacked {
    word: AtomicU64,
    max_slots: u64,
    budget: u64,
}

impl RawPacked {
    fn new(max_slots: u64, budget: u64) -> Self {
        RawPacked {
            word: AtomicU64::new(0),
            max_slots,
            budget,
        }
    }

    #[inline]
    fn try_acquire(&self, tokens: u64) -> bool {
        let mut cur = self.word.load(Ordering::Acquire);
        loop {
            let (slots, held) = (cur & 0xFFFF, cur >> 16);
            if slots >= self.max_slots || held + tokens > self.budget {
                return false;
            }
            let next = ((held + tokens) << 16) | (slots + 1);
            match self
                .word
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    #[inline]
    fn release(&self, tokens: u64) {
        let mut cur = self.word.load(Ordering::Acquire);
        loop {
            let next = (((cur >> 16) - tokens) << 16) | ((cur & 0xFFFF) - 1);
            match self
                .word
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return,
                Err(actual) => cur = actual,
            }
        }
    }
}

fn bulkhead(budget: bool, max_concurrent: usize) -> LlmBulkhead {
    let builder = LlmBulkhead::builder("claude-sonnet-4", max_concurrent);
    let builder = if budget {
        builder.token_budget(TokenBudget::new(1 << 34))
    } else {
        builder
    };
    builder.build().expect("valid configuration")
}

fn budget_options() -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(100, 1000).expect("fits"))
}

fn uncontended(c: &mut Criterion) {
    let request = LlmRequest::new();

    let mut group = c.benchmark_group("uncontended/no_budget");
    group.throughput(Throughput::Elements(1));
    let ours = bulkhead(false, 1024);
    group.bench_function("llm_bulkhead", |b| {
        b.iter(|| drop(black_box(ours.try_acquire(&request, AcquireOptions::new()))))
    });
    let tokio_sem = tokio::sync::Semaphore::new(1024);
    group.bench_function("tokio_semaphore", |b| {
        b.iter(|| drop(black_box(tokio_sem.try_acquire())))
    });
    let lock_sem = async_lock::Semaphore::new(1024);
    group.bench_function("async_lock_semaphore", |b| {
        b.iter(|| drop(black_box(lock_sem.try_acquire())))
    });
    let raw = RawPacked::new(1024, 0);
    group.bench_function("raw_cas", |b| {
        b.iter(|| {
            assert!(raw.try_acquire(black_box(0)));
            raw.release(0);
        })
    });
    group.finish();

    let mut group = c.benchmark_group("uncontended/budget");
    group.throughput(Throughput::Elements(1));
    let ours = bulkhead(true, 1024);
    let opts = budget_options();
    group.bench_function("llm_bulkhead", |b| {
        b.iter(|| drop(black_box(ours.try_acquire(&request, black_box(opts)))))
    });
    let slots = tokio::sync::Semaphore::new(1024);
    let tokens = tokio::sync::Semaphore::new(1 << 30);
    group.bench_function("tokio_two_semaphores", |b| {
        b.iter(|| {
            let slot = slots.try_acquire();
            let held = tokens.try_acquire_many(black_box(RESERVED as u32));
            drop(black_box((slot, held)));
        })
    });
    let raw = RawPacked::new(1024, 1 << 40);
    group.bench_function("raw_cas", |b| {
        b.iter(|| {
            assert!(raw.try_acquire(black_box(RESERVED)));
            raw.release(RESERVED);
        })
    });
    group.finish();
}

/// Runs `op` `iters` times on each of `threads` threads at once; returns the wall time from
/// the moment all of them are ready (their start-up is outside it) to the last one's end.
/// Thread `i` is pinned to core `i mod cores`, so two threads on a 2-core machine always run on
/// different cores (each admission's cache line crosses between them, the case the figures are
/// about) and never time-share one core by the scheduler's choice.
fn on_threads(threads: usize, iters: u64, op: &(impl Fn() + Sync)) -> Duration {
    let start = Barrier::new(threads + 1);
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    std::thread::scope(|s| {
        for i in 0..threads {
            let core = cores.get(i % cores.len().max(1)).copied();
            let start = &start;
            s.spawn(move || {
                if let Some(core) = core {
                    core_affinity::set_for_current(core);
                }
                start.wait();
                for _ in 0..iters {
                    op();
                }
            });
        }
        start.wait();
        let began = Instant::now();
        // The scope joins every thread before returning.
        began
    })
    .elapsed()
}

/// The thread counts of `scaling`: powers of two up to twice the machine's cores (1, 2 and 4
/// here), so the last oversubscribes it.
fn thread_counts() -> Vec<usize> {
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    core::iter::successors(Some(1usize), |n| Some(n * 2))
        .take_while(|&n| n <= 2 * cores)
        .collect()
}

/// Throughput at 1, 2, ... threads hammering one limiter, up to twice the cores (see
/// [`thread_counts`]). Time per iteration is one operation on every thread, so throughput in
/// elements is operations per second in all.
fn scaling(c: &mut Criterion) {
    let request = LlmRequest::new();
    let opts = budget_options();
    let plain = bulkhead(false, 1024);
    let budgeted = bulkhead(true, 1024);
    let tokio_sem = tokio::sync::Semaphore::new(1024);
    let slots = tokio::sync::Semaphore::new(1024);
    let tokens = tokio::sync::Semaphore::new(1 << 30);
    let raw = RawPacked::new(1024, 1 << 34);
    let mut group = c.benchmark_group("scaling");
    // Multi-thread figures swing with how the VM schedules the threads: sample longer.
    group
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for threads in thread_counts() {
        group.throughput(Throughput::Elements(threads as u64));
        group.bench_function(BenchmarkId::new("llm_bulkhead_no_budget", threads), |b| {
            b.iter_custom(|iters| {
                on_threads(threads, iters, &|| {
                    drop(black_box(
                        plain.try_acquire(&request, AcquireOptions::new()),
                    ))
                })
            })
        });
        group.bench_function(BenchmarkId::new("llm_bulkhead_budget", threads), |b| {
            b.iter_custom(|iters| {
                on_threads(threads, iters, &|| {
                    drop(black_box(budgeted.try_acquire(&request, opts)))
                })
            })
        });
        group.bench_function(BenchmarkId::new("tokio_semaphore", threads), |b| {
            b.iter_custom(|iters| {
                on_threads(threads, iters, &|| drop(black_box(tokio_sem.try_acquire())))
            })
        });
        group.bench_function(BenchmarkId::new("tokio_two_semaphores", threads), |b| {
            b.iter_custom(|iters| {
                on_threads(threads, iters, &|| {
                    let slot = slots.try_acquire();
                    let held = tokens.try_acquire_many(RESERVED as u32);
                    drop(black_box((slot, held)));
                })
            })
        });
        group.bench_function(BenchmarkId::new("raw_cas_budget", threads), |b| {
            b.iter_custom(|iters| {
                on_threads(threads, iters, &|| {
                    assert!(raw.try_acquire(black_box(RESERVED)));
                    raw.release(RESERVED);
                })
            })
        });
    }
    group.finish();
}

/// Like for like with the JavaScript original, whose `acquire` is async: `acquire().await` +
/// release in a loop inside one `block_on`, with the same request and reservation as
/// `benches/js/bench.mjs`.
fn vs_js(c: &mut Criterion) {
    let request = LlmRequest::new();
    let mut group = c.benchmark_group("vs_js");
    group.throughput(Throughput::Elements(1));
    // tokio's `Semaphore::acquire().await` + drop, the same loop: the async baseline.
    let tokio_sem = tokio::sync::Semaphore::new(1024);
    group.bench_function("tokio_semaphore_acquire_await", |b| {
        b.iter_custom(|iters| {
            futures::executor::block_on(async {
                let started = Instant::now();
                for _ in 0..iters {
                    let permit = tokio_sem.acquire().await;
                    drop(black_box(permit.expect("open")));
                }
                started.elapsed()
            })
        })
    });
    for (case, budget, opts) in [
        ("acquire_await_budget", true, budget_options()),
        ("acquire_await_no_budget", false, AcquireOptions::new()),
    ] {
        let ours = bulkhead(budget, 1024);
        group.bench_function(case, |b| {
            b.iter_custom(|iters| {
                futures::executor::block_on(async {
                    let started = Instant::now();
                    for _ in 0..iters {
                        let permit = ours.acquire(&request, black_box(opts)).await;
                        drop(black_box(permit.expect("admitted")));
                    }
                    started.elapsed()
                })
            })
        });
    }
    group.finish();
}

fn rejection(c: &mut Criterion) {
    let request = LlmRequest::new();
    let mut group = c.benchmark_group("rejection");
    group.throughput(Throughput::Elements(1));
    let full = bulkhead(true, 0);
    let opts = budget_options();
    group.bench_function("llm_bulkhead_full", |b| {
        b.iter(|| black_box(full.try_acquire(&request, black_box(opts))).is_err())
    });
    let closed = bulkhead(true, 8);
    closed.close();
    group.bench_function("llm_bulkhead_closed", |b| {
        b.iter(|| black_box(closed.try_acquire(&request, black_box(opts))).is_err())
    });
    let empty = tokio::sync::Semaphore::new(0);
    group.bench_function("tokio_semaphore_empty", |b| {
        b.iter(|| black_box(empty.try_acquire()).is_err())
    });
    group.finish();
}

fn events(c: &mut Criterion) {
    let request = LlmRequest::new();
    let opts = budget_options();
    let mut group = c.benchmark_group("events");
    group.throughput(Throughput::Elements(1));
    let silent = bulkhead(true, 1024);
    group.bench_function("no_listener", |b| {
        b.iter(|| drop(black_box(silent.try_acquire(&request, black_box(opts)))))
    });
    let other = bulkhead(true, 1024);
    let _other = other.on_events([EventKind::Reconfigure], |event| {
        black_box(event);
    });
    group.bench_function("listener_for_another_kind", |b| {
        b.iter(|| drop(black_box(other.try_acquire(&request, black_box(opts)))))
    });
    let heard = bulkhead(true, 1024);
    let _heard = heard.on(|event| {
        black_box(event);
    });
    group.bench_function("noop_listener_on_every_kind", |b| {
        b.iter(|| drop(black_box(heard.try_acquire(&request, black_box(opts)))))
    });
    group.finish();

    // Listening threads must not serialise on the listener list.
    const THREADS: usize = 2;
    let mut group = c.benchmark_group("events_2_threads");
    group.throughput(Throughput::Elements(THREADS as u64));
    group.bench_function("no_listener", |b| {
        b.iter_custom(|iters| {
            on_threads(THREADS, iters, &|| {
                drop(black_box(silent.try_acquire(&request, opts)))
            })
        })
    });
    group.bench_function("noop_listener_on_every_kind", |b| {
        b.iter_custom(|iters| {
            on_threads(THREADS, iters, &|| {
                drop(black_box(heard.try_acquire(&request, opts)))
            })
        })
    });
    group.finish();
}

fn usage(c: &mut Criterion) {
    let request = LlmRequest::new();
    let opts = budget_options();
    let used = TokenUsage::new(80, 200).expect("fits");
    let mut group = c.benchmark_group("usage");
    group.throughput(Throughput::Elements(1));
    let ours = bulkhead(true, 1024);
    group.bench_function("release_with_usage", |b| {
        b.iter(|| {
            let permit = ours
                .try_acquire(&request, black_box(opts))
                .expect("admitted");
            black_box(permit.release(Some(black_box(used))))
        })
    });
    group.bench_function("report_then_release", |b| {
        b.iter(|| {
            let mut permit = ours
                .try_acquire(&request, black_box(opts))
                .expect("admitted");
            black_box(permit.report_usage(black_box(used)).expect("valid"));
            black_box(permit.release(None))
        })
    });
    let progress = Progressive::new(800).safety_margin(32);
    group.bench_function("progressive_report_then_release", |b| {
        b.iter(|| {
            let mut permit = ours
                .try_acquire(&request, black_box(opts))
                .expect("admitted");
            black_box(
                permit
                    .report_usage_progressive(black_box(used), black_box(progress))
                    .expect("valid"),
            );
            black_box(permit.release(None))
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(40);
    targets = uncontended, scaling, rejection, events, usage, vs_js
}
criterion_main!(benches);
