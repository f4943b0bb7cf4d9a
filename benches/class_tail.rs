//! The tail latency of a class admission under same-class contention, with more threads than
//! cores (so a thread holding its class's lock is descheduled now and then), against the path
//! without classes and tokio's `Semaphore::try_acquire`.
//!
//! Every case runs `THREADS` threads (8) at once, unpinned, each making `CALLS` calls in a plain
//! loop and timing each one with `Instant::now()` around it; a call is one `try_acquire` and the
//! drop of its permit (admission + release). The cases, on one bulkhead each (built as in
//! `benches/classes.rs`: 1,024 slots, a token budget, a reservation of 1,100 tokens per call):
//!
//! - `raw_cas`: a packed `AtomicU64` CAS loop acquiring slot and tokens, then releasing them
//!   (as `benches/admission.rs`'s raw CAS floor): what timing and scheduling alone cost.
//! - `tokio_semaphore`: tokio's `Semaphore::try_acquire` + drop.
//! - `no_classes`: the bulkhead without classes.
//! - `class_within_floor`: 4 classes with floors, every thread in `premium` (a floor of 256
//!   calls, so every call is within it: the class word's one-CAS path).
//! - `class_beyond_floor`: the same bulkhead, every thread in `batch` (no floor: every call
//!   borrows, the class-locked path).
//!
//! Each round runs every case once, in turn; each figure printed is its median over the rounds
//! (a burst of other work on the host spoils one round, not the figure), the maximum the
//! largest of all, `>=10us/M` the calls per million that took 10 µs or more. The host
//! line gives the raw CAS cost on one thread (a plain loop, no timing per call), a pair of
//! `Instant::now()` and a `spin_loop` hint.
//!
//! `cargo bench --bench class_tail` (5 rounds of 200,000 calls per thread);
//! `cargo bench --bench class_tail -- --quick` (1 round of 20,000: a few seconds).
//! Figures are recorded in `benches/README.md`, "Class admission tail".

use std::hint::black_box;
use std::sync::Barrier;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget, classes::AdmissionClasses,
    classes::ClassLimits,
};

const THREADS: usize = 8;
/// Reservation of every case: 100 input + 1000 max output.
const RESERVED: u64 = 1100;
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

/// Slots (low 16 bits) and tokens (high 48 bits) in one word, acquired and released by CAS
/// loops (as `benches/admission.rs`'s `RawPacked`).
struct RawPacked(AtomicU64);

impl RawPacked {
    #[inline]
    fn cycle(&self, tokens: u64) {
        let word = &self.0;
        let mut current = word.load(Ordering::Acquire);
        loop {
            let (slots, held) = (current & 0xFFFF, current >> 16);
            assert!(slots < u64::from(SLOTS) && held + tokens <= BUDGET);
            let next = ((held + tokens) << 16) | (slots + 1);
            match word.compare_exchange_weak(current, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(actual) => current = actual,
            }
        }
        let mut current = word.load(Ordering::Acquire);
        loop {
            let next = (((current >> 16) - tokens) << 16) | ((current & 0xFFFF) - 1);
            match word.compare_exchange_weak(current, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(actual) => current = actual,
            }
        }
    }
}

/// Runs `call` `calls` times on each of `THREADS` threads at once (unpinned), timing each call;
/// returns every call's latency in nanoseconds and the wall time from when all were ready.
fn timed(calls: usize, call: &(impl Fn() + Sync)) -> (Vec<u32>, Duration) {
    let start = Barrier::new(THREADS + 1);
    let (samples, wall) = std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|_| {
                let start = &start;
                s.spawn(move || {
                    // Warm up (caches, this thread's statistics shard), untimed.
                    for _ in 0..calls / 10 {
                        call();
                    }
                    let mut samples = Vec::with_capacity(calls);
                    start.wait();
                    for _ in 0..calls {
                        let began = Instant::now();
                        call();
                        let took = began.elapsed();
                        samples.push(u32::try_from(took.as_nanos()).unwrap_or(u32::MAX));
                    }
                    samples
                })
            })
            .collect();
        start.wait();
        let began = Instant::now();
        let samples: Vec<u32> = workers
            .into_iter()
            .flat_map(|w| w.join().expect("worker"))
            .collect();
        (samples, began.elapsed())
    });
    (samples, wall)
}

/// One round of one case: its calls' latencies, sorted, and their wall time.
struct Round {
    samples: Vec<u32>,
    wall: Duration,
}

impl Round {
    fn new(mut samples: Vec<u32>, wall: Duration) -> Round {
        samples.sort_unstable();
        Round { samples, wall }
    }

    /// The `q` quantile (nearest rank).
    fn at(&self, q: f64) -> f64 {
        let rank = ((q * self.samples.len() as f64).ceil() as usize).max(1);
        f64::from(self.samples[rank.min(self.samples.len()) - 1])
    }

    /// Calls that took 10 µs or more, per million.
    fn slow_per_million(&self) -> f64 {
        let slow = self.samples.len() - self.samples.partition_point(|&ns| ns < 10_000);
        slow as f64 * 1e6 / self.samples.len() as f64
    }

    /// Calls per second, all threads together.
    fn throughput(&self) -> f64 {
        self.samples.len() as f64 / self.wall.as_secs_f64()
    }
}

/// The median over rounds of `figure`.
fn median(rounds: &[Round], figure: impl Fn(&Round) -> f64) -> f64 {
    let mut values: Vec<f64> = rounds.iter().map(figure).collect();
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Nanoseconds per iteration of `op`, one thread, `iters` times in a plain loop.
fn per_op(iters: u64, op: impl Fn()) -> f64 {
    let began = Instant::now();
    for _ in 0..iters {
        op();
    }
    began.elapsed().as_nanos() as f64 / iters as f64
}

fn format_ns(ns: f64) -> String {
    if ns < 10_000.0 {
        format!("{ns:.0} ns")
    } else if ns < 10_000_000.0 {
        format!("{:.1} us", ns / 1e3)
    } else {
        format!("{:.1} ms", ns / 1e6)
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let (round_count, calls) = if quick { (1, 20_000) } else { (5, 200_000) };
    let cores = std::thread::available_parallelism().map_or(0, usize::from);

    let request = LlmRequest::new();
    let classed = with_classes();
    let premium = options().class(classed.class("premium").expect("configured"));
    let batch = options().class(classed.class("batch").expect("configured"));
    let plain = without_classes();
    let opts = options();
    let semaphore = tokio::sync::Semaphore::new(SLOTS as usize);
    let raw = RawPacked(AtomicU64::new(0));

    // Host figures, one thread, no timing per call.
    let raw_cas = per_op(20_000_000, || raw.cycle(black_box(RESERVED)));
    let clock = per_op(2_000_000, || {
        black_box(Instant::now().elapsed());
    });
    let pause = per_op(2_000_000, std::hint::spin_loop);
    println!(
        "class_tail: {THREADS} threads on {cores} CPUs, {calls} calls per thread x {round_count} \
         round(s); latency of one try_acquire + release, Instant::now() around each call; \
         median over rounds (max: over all)"
    );
    println!(
        "host: raw CAS acquire + release (AtomicU64, 1 thread) {raw_cas:.1} ns; \
         Instant::now() + elapsed {clock:.1} ns; spin_loop hint {pause:.1} ns"
    );

    type Case<'a> = (&'static str, Box<dyn Fn() + Sync + 'a>);
    let cases: Vec<Case<'_>> = vec![
        ("raw_cas", Box::new(|| raw.cycle(black_box(RESERVED)))),
        (
            "tokio_semaphore",
            Box::new(|| drop(black_box(semaphore.try_acquire()))),
        ),
        (
            "no_classes",
            Box::new(|| drop(black_box(plain.try_acquire(&request, black_box(opts))))),
        ),
        (
            "class_within_floor",
            Box::new(|| drop(black_box(classed.try_acquire(&request, black_box(premium))))),
        ),
        (
            "class_beyond_floor",
            Box::new(|| drop(black_box(classed.try_acquire(&request, black_box(batch))))),
        ),
    ];
    let mut rounds: Vec<Vec<Round>> = cases.iter().map(|_| Vec::new()).collect();
    for _ in 0..round_count {
        for ((_, call), case_rounds) in cases.iter().zip(&mut rounds) {
            let (samples, wall) = timed(calls, call);
            case_rounds.push(Round::new(samples, wall));
        }
    }
    assert_eq!(classed.stats().in_flight, 0);
    assert_eq!(plain.stats().in_flight, 0);

    println!(
        "{:<20} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9}",
        "case", "p50", "p99", "p99.9", "p99.99", "max", ">=10us/M", "Mcalls/s"
    );
    for ((name, _), case_rounds) in cases.iter().zip(&rounds) {
        let max = case_rounds.iter().map(|r| r.at(1.0)).fold(0.0, f64::max);
        println!(
            "{:<20} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9.0} {:>9.2}",
            name,
            format_ns(median(case_rounds, |r| r.at(0.5))),
            format_ns(median(case_rounds, |r| r.at(0.99))),
            format_ns(median(case_rounds, |r| r.at(0.999))),
            format_ns(median(case_rounds, |r| r.at(0.9999))),
            format_ns(max),
            median(case_rounds, Round::slow_per_million),
            median(case_rounds, Round::throughput) / 1e6,
        );
    }
}
