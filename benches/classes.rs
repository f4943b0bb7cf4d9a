//! Admission classes, side by side with their baselines in one run.
//!
//! - `classes_1_thread/*`: `try_acquire` + drop with a token budget, one thread: the bulkhead
//!   with 4 classes and floors (a call naming its class), the same bulkhead without classes,
//!   and the tokio baseline of three semaphores a class gateway would otherwise stack (global
//!   slots, global tokens with `try_acquire_many`, the class's own slots).
//! - `classes_1_thread/atomics_floor*`: the locked instructions alone, no decision: what any
//!   class admission + release that keeps the class's counts and the global figures exact
//!   must execute (a CAS to take the class's word and a 128-bit CAS to commit, then a CAS
//!   and a 128-bit `fetch_sub` to release, each followed by the store that frees the class),
//!   beside the same floor of the path without classes (a CAS and a `fetch_sub`). They bound
//!   from below what a class path can cost, measured in the same run as the paths themselves
//!   (`benches/README.md`, "Admission classes").
//! - `classes_2_threads/*`: two threads admitting in different classes at once (time per
//!   iteration is one operation on each thread), ours against the three-semaphore baseline
//!   (one class semaphore per thread, the global two shared).
//!
//! Figures and ratios are recorded in `benches/README.md`; `benches/targets.py` checks them.

use std::hint::black_box;
use std::sync::Barrier;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget, classes::AdmissionClasses,
    classes::ClassLimits,
};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

/// Reservation of every case: 100 input + 1000 max output.
const RESERVED: u32 = 1100;
const SLOTS: u32 = 1024;
const BUDGET: u64 = 1 << 34;

fn with_classes() -> LlmBulkhead {
    LlmBulkhead::builder("claude-sonnet-4", SLOTS as usize)
        .token_budget(TokenBudget::new(BUDGET))
        .admission_classes(
            AdmissionClasses::new("standard")
                .class(
                    "premium",
                    ClassLimits::new()
                        .protected_concurrent(256)
                        .protected_in_flight_tokens(1 << 30),
                )
                .class("standard", ClassLimits::new().protected_concurrent(128))
                .class("batch", ClassLimits::new().max_concurrent(512))
                .class(
                    "internal",
                    ClassLimits::new()
                        .protected_concurrent(64)
                        .max_in_flight_tokens(1 << 32),
                ),
        )
        .build()
        .expect("valid configuration")
}

fn without_classes() -> LlmBulkhead {
    LlmBulkhead::builder("claude-sonnet-4", SLOTS as usize)
        .token_budget(TokenBudget::new(BUDGET))
        .build()
        .expect("valid configuration")
}

fn options() -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(100, 1000).expect("fits"))
}

/// The baseline: what a gateway would stack without a class-aware limiter.
struct ThreeSemaphores {
    slots: tokio::sync::Semaphore,
    tokens: tokio::sync::Semaphore,
    classes: [tokio::sync::Semaphore; 2],
}

impl ThreeSemaphores {
    fn new() -> ThreeSemaphores {
        ThreeSemaphores {
            slots: tokio::sync::Semaphore::new(SLOTS as usize),
            tokens: tokio::sync::Semaphore::new(1 << 30),
            classes: [
                tokio::sync::Semaphore::new(512),
                tokio::sync::Semaphore::new(512),
            ],
        }
    }

    #[inline]
    fn cycle(&self, class: usize) {
        let slot = self.slots.try_acquire();
        let tokens = self.tokens.try_acquire_many(black_box(RESERVED));
        let own = self.classes[class].try_acquire();
        drop(black_box((slot, tokens, own)));
    }
}

/// The locked instructions of a class admission + release, in the order the engine runs them,
/// with none of its decisions: a lower bound on any class protocol that changes a class's
/// counts and the global figures together (`src/engine/classes.rs` says why it takes two
/// words).
struct AtomicsFloor {
    class: AtomicU64,
    wide: portable_atomic_crate::AtomicU128,
}

/// The class word's lock bit.
const LOCKED: u64 = 1 << 63;

impl AtomicsFloor {
    fn new() -> AtomicsFloor {
        AtomicsFloor {
            class: AtomicU64::new(0),
            wide: portable_atomic_crate::AtomicU128::new(0),
        }
    }

    /// Takes the class word's lock (one CAS), returning the counts it held.
    #[inline]
    fn lock(&self) -> u64 {
        let mut current = self.class.load(Ordering::Relaxed);
        loop {
            match self.class.compare_exchange_weak(
                current & !LOCKED,
                current | LOCKED,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(counts) => return counts,
                Err(actual) => current = actual,
            }
        }
    }

    #[inline]
    fn cycle(&self, tokens: u64) {
        let wide_delta = (1u128 << 64) | u128::from(tokens);
        let counts = self.lock();
        let mut current = self.wide.load(Ordering::Acquire);
        while let Err(actual) = self.wide.compare_exchange_weak(
            current,
            current + wide_delta,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            current = actual;
        }
        self.class.store(counts + tokens + 1, Ordering::Release);
        let counts = self.lock();
        self.wide.fetch_sub(wide_delta, Ordering::AcqRel);
        self.class.store(counts - tokens - 1, Ordering::Release);
    }
}

/// The same floor without classes: one CAS to admit, one `fetch_sub` to release.
#[inline]
fn plain_floor(word: &AtomicU64, tokens: u64) {
    let mut current = word.load(Ordering::Acquire);
    while let Err(actual) = word.compare_exchange_weak(
        current,
        current + tokens + 1,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        current = actual;
    }
    word.fetch_sub(tokens + 1, Ordering::AcqRel);
}

fn one_thread(c: &mut Criterion) {
    let request = LlmRequest::new();
    let mut group = c.benchmark_group("classes_1_thread");
    group.throughput(Throughput::Elements(1));
    let classed = with_classes();
    let premium = options().class(classed.class("premium").expect("configured"));
    group.bench_function("four_classes", |b| {
        b.iter(|| drop(black_box(classed.try_acquire(&request, black_box(premium)))))
    });
    let plain = without_classes();
    let opts = options();
    group.bench_function("no_classes", |b| {
        b.iter(|| drop(black_box(plain.try_acquire(&request, black_box(opts)))))
    });
    let baseline = ThreeSemaphores::new();
    group.bench_function("tokio_three_semaphores", |b| {
        b.iter(|| baseline.cycle(black_box(0)))
    });
    let floor = AtomicsFloor::new();
    group.bench_function("atomics_floor", |b| {
        b.iter(|| floor.cycle(black_box(u64::from(RESERVED))))
    });
    let word = AtomicU64::new(0);
    group.bench_function("atomics_floor_no_classes", |b| {
        b.iter(|| plain_floor(&word, black_box(u64::from(RESERVED))))
    });
    group.finish();
}

/// Runs `op(thread)` `iters` times on each of two threads at once, each pinned to its own core
/// (as in `admission.rs`'s `on_threads`); returns the wall time from when both are ready.
fn on_two_threads(iters: u64, op: &(impl Fn(usize) + Sync)) -> Duration {
    let start = Barrier::new(3);
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    std::thread::scope(|s| {
        for thread in 0..2 {
            let start = &start;
            let core = cores.get(thread % cores.len().max(1)).copied();
            s.spawn(move || {
                if let Some(core) = core {
                    core_affinity::set_for_current(core);
                }
                start.wait();
                for _ in 0..iters {
                    op(thread);
                }
            });
        }
        start.wait();
        Instant::now()
    })
    .elapsed()
}

fn two_threads(c: &mut Criterion) {
    let request = LlmRequest::new();
    let classed = with_classes();
    let by_thread = [
        options().class(classed.class("premium").expect("configured")),
        options().class(classed.class("batch").expect("configured")),
    ];
    let baseline = ThreeSemaphores::new();
    let mut group = c.benchmark_group("classes_2_threads");
    // Multi-thread figures swing with how the VM schedules the threads: sample longer.
    group
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Elements(2));
    group.bench_function("four_classes", |b| {
        b.iter_custom(|iters| {
            on_two_threads(iters, &|thread| {
                drop(black_box(classed.try_acquire(&request, by_thread[thread])))
            })
        })
    });
    group.bench_function("tokio_three_semaphores", |b| {
        b.iter_custom(|iters| on_two_threads(iters, &|thread| baseline.cycle(thread)))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(40);
    targets = one_thread, two_threads
}
criterion_main!(benches);
