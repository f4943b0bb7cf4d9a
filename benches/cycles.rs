//! One admission + release per iteration, in plain loops of our own (no criterion): the
//! second opinion on every single-thread figure, and the program `benches/instructions.py`
//! counts instructions in.
//!
//! Each case is a closure behind `&dyn Fn()` (as a gateway's handler calls the bulkhead: no
//! inlining of the whole loop into one specialized body), run a fixed number of times with a
//! real request (a prompt and `max_tokens`), beside its peers in the same binary.
//!
//! ```text
//! cargo bench --bench cycles                  # every case: ns per iteration, median of 7
//! cargo bench --bench cycles -- ns budget     # the cases whose name contains `budget`
//! cargo bench --bench cycles -- count CASE N  # only CASE's loop, N times (for callgrind)
//! ```
//!
//! In `count` mode the measured loop is the function `cycles::measured` (never inlined), so
//! `valgrind --tool=callgrind --toggle-collect=*cycles::measured*` counts exactly the cases'
//! iterations; `benches/instructions.py` runs it twice (N and 2N) and divides the difference.

use std::future::Future;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget, classes::AdmissionClasses,
    classes::ClassLimits, events::EventKind, rate::RateLimits,
};

/// Tokens every budget case reserves (100 input + 1,000 output), as in `admission.rs`.
const RESERVED: u32 = 1100;
/// Iterations of one timed run, and timed runs per case (the median is reported); the
/// environment's `CYCLES_ITERATIONS` and `CYCLES_RUNS` override them (CI's quick mode).
const ITERATIONS: u64 = 2_000_000;
const RUNS: usize = 7;

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A real request: a system prompt, a user prompt, a cap on the output.
fn request() -> LlmRequest {
    LlmRequest::new()
        .model("claude-sonnet-4")
        .system("You are a concise assistant.")
        .user("Summarise the attached incident report in three bullet points.")
        .max_tokens(1000)
}

fn reservation() -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(100, 1000).expect("fits"))
}

fn plain() -> LlmBulkhead {
    LlmBulkhead::builder("claude-sonnet-4", 1024)
        .build()
        .expect("valid")
}

fn budgeted() -> LlmBulkhead {
    LlmBulkhead::builder("claude-sonnet-4", 1024)
        .token_budget(TokenBudget::new(1 << 34))
        .build()
        .expect("valid")
}

/// Four classes with floors and a budget, as `benches/classes.rs`.
fn classed() -> LlmBulkhead {
    classed_by_default("standard")
}

/// [`classed`] with `default` the default class.
fn classed_by_default(default: &str) -> LlmBulkhead {
    LlmBulkhead::builder("claude-sonnet-4", 1024)
        .token_budget(TokenBudget::new(1 << 34))
        .admission_classes(
            AdmissionClasses::new(default)
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
        .expect("valid")
}

/// Polls `future` once, with a waker that does nothing: every awaited case here finds a
/// free slot, so the first poll finishes it. Always inlined, as an `.await` is into its
/// async fn (left to the optimizer, whether it was inlined changed with the size of the
/// futures' drop, which no user's `.await` pays as a call).
#[inline(always)]
fn ready<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("a free slot was not taken at once"),
    }
}

/// The host's raw cost of one compare-and-swap acquire and one compare-and-swap release (as
/// `admission.rs`'s `raw_cas`): what a ns figure is read against (hosts with cheap atomics
/// make the non-atomic work weigh more).
fn raw_cas(word: &AtomicU64) {
    for delta in [1u64, u64::MAX] {
        let mut current = word.load(Ordering::Acquire);
        while let Err(actual) = word.compare_exchange_weak(
            current,
            current.wrapping_add(black_box(delta)),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            current = actual;
        }
    }
}

/// A case: its name and the closure of one iteration.
type Case = (&'static str, Box<dyn Fn()>);

/// Every case.
fn cases() -> Vec<Case> {
    let request: &'static LlmRequest = Box::leak(Box::new(request()));
    let no_budget = plain();
    let budget = budgeted();
    let with_classes = classed();
    // The same classes, `premium` the default: a call that names no class is `premium`'s.
    let premium_by_default = classed_by_default("premium");
    let premium = reservation().class(with_classes.class("premium").expect("configured"));
    let full = LlmBulkhead::builder("claude-sonnet-4", 1)
        .build()
        .expect("valid");
    std::mem::forget(full.try_acquire_owned(request, AcquireOptions::new()));
    let closed = plain();
    closed.close();
    // The general `Bulkhead` (one slot per call, no tokens, no events).
    let general = async_bulkhead_llm::Bulkhead::new(1024).expect("valid");
    let tokio_one = tokio::sync::Semaphore::new(1024);
    let tokio_slots = std::sync::Arc::new(tokio::sync::Semaphore::new(1024));
    let tokio_tokens = std::sync::Arc::new(tokio::sync::Semaphore::new(1 << 30));
    let async_lock = async_lock::Semaphore::new(1024);
    let word = Box::leak(Box::new(AtomicU64::new(0)));
    let (slots, tokens) = (tokio_slots.clone(), tokio_tokens.clone());
    let tokio_empty = tokio::sync::Semaphore::new(0);
    let tokio_slots2 = std::sync::Arc::new(tokio::sync::Semaphore::new(1024));
    // A tenant within a global bulkhead, both with a budget, and one bulkhead alone with the
    // same permit kind (owned: a tenant's permit keeps both bulkheads alive).
    let (tenant, global, alone) = (budgeted(), budgeted(), budgeted());
    // The budget case with a sampled listener that hears one call in 2^20 (as the metrics
    // integration's histograms listen): the calls it does not sample take the fast lane.
    let sampled = budgeted();
    std::mem::forget(sampled.on_events_sampled(
        [EventKind::Admit, EventKind::Release],
        NonZeroU32::new(1 << 20).expect("not zero"),
        |_| {},
    ));
    // The same pair, awaited (`acquire_within`).
    let (awaited_tenant, awaited_global) = (budgeted(), budgeted());
    // The budget case with rate windows (requests and tokens per minute, far from binding),
    // on the default (coarse) clock.
    let windowed = LlmBulkhead::builder("claude-sonnet-4", 1024)
        .token_budget(TokenBudget::new(1 << 34))
        .rate_limits(RateLimits::per_minute().requests(1 << 34).tokens(1 << 35))
        .build()
        .expect("valid");
    let (windowed_owned, windowed_await) = (windowed.clone(), windowed.clone());
    let one_window = LlmBulkhead::builder("claude-sonnet-4", 1024)
        .rate_limits(RateLimits::per_minute().requests(1 << 34))
        .build()
        .expect("valid");
    let tokens_window = LlmBulkhead::builder("claude-sonnet-4", 1024)
        .token_budget(TokenBudget::new(1 << 34))
        .rate_limits(RateLimits::per_minute().tokens(1 << 35))
        .build()
        .expect("valid");
    // A requests window used up (one a day): every call is refused `rate_limit`.
    let rate_limited = LlmBulkhead::builder("claude-sonnet-4", 1024)
        .token_budget(TokenBudget::new(1 << 34))
        .rate_limits(RateLimits::new(std::time::Duration::from_secs(86_400)).requests(1))
        .build()
        .expect("valid");
    drop(
        rate_limited
            .try_acquire(request, reservation())
            .expect("the day's one call"),
    );
    vec![
        ("raw_cas", Box::new(|| raw_cas(word))),
        (
            "no_budget",
            Box::new({
                let b = no_budget.clone();
                move || drop(black_box(b.try_acquire(request, AcquireOptions::new())))
            }),
        ),
        (
            "tokio_try_acquire",
            Box::new(move || drop(black_box(tokio_one.try_acquire()))),
        ),
        (
            "async_lock_try_acquire",
            Box::new(move || drop(black_box(async_lock.try_acquire()))),
        ),
        (
            "budget",
            Box::new({
                let b = budget.clone();
                move || drop(black_box(b.try_acquire(request, black_box(reservation()))))
            }),
        ),
        (
            "budget_sampled",
            Box::new(move || {
                drop(black_box(
                    sampled.try_acquire(request, black_box(reservation())),
                ))
            }),
        ),
        (
            "tokio_two_semaphores",
            Box::new(move || {
                let slot = slots.try_acquire();
                let held = tokens.try_acquire_many(black_box(RESERVED));
                drop(black_box((slot, held)));
            }),
        ),
        (
            "classes",
            Box::new({
                let b = with_classes.clone();
                move || drop(black_box(b.try_acquire(request, black_box(premium))))
            }),
        ),
        (
            "classes_owned",
            Box::new({
                let b = with_classes.clone();
                move || drop(black_box(b.try_acquire_owned(request, black_box(premium))))
            }),
        ),
        (
            "classes_await",
            Box::new({
                let b = with_classes.clone();
                move || drop(black_box(ready(b.acquire(request, black_box(premium)))))
            }),
        ),
        (
            "classes_default",
            Box::new({
                let b = premium_by_default.clone();
                move || drop(black_box(b.try_acquire(request, black_box(reservation()))))
            }),
        ),
        (
            "classes_default_await",
            Box::new({
                let b = premium_by_default;
                move || {
                    drop(black_box(ready(
                        b.acquire(request, black_box(reservation())),
                    )))
                }
            }),
        ),
        (
            "classes_owned_await",
            Box::new(move || {
                drop(black_box(ready(
                    with_classes.acquire_owned(request, black_box(premium)),
                )))
            }),
        ),
        (
            "await_budget",
            Box::new({
                let b = budget.clone();
                move || {
                    drop(black_box(ready(
                        b.acquire(request, black_box(reservation())),
                    )))
                }
            }),
        ),
        (
            "await_budget_in_place",
            Box::new({
                let b = budget.clone();
                move || {
                    let mut future = pin!(b.acquire(request, black_box(reservation())));
                    let Poll::Ready(out) = future
                        .as_mut()
                        .poll(&mut Context::from_waker(Waker::noop()))
                    else {
                        panic!("pending")
                    };
                    drop(black_box(out))
                }
            }),
        ),
        (
            "await_budget_no_black_box",
            Box::new({
                let b = budget.clone();
                let opts = reservation();
                move || drop(black_box(ready(b.acquire(request, opts))))
            }),
        ),
        (
            "await_block_on",
            Box::new({
                let b = budget.clone();
                move || {
                    drop(black_box(futures::executor::block_on(
                        b.acquire(request, black_box(reservation())),
                    )))
                }
            }),
        ),
        (
            "tokio_block_on",
            Box::new({
                let s = tokio_slots2.clone();
                move || drop(black_box(futures::executor::block_on(s.acquire())))
            }),
        ),
        (
            "await_no_budget",
            Box::new({
                let b = no_budget.clone();
                move || drop(black_box(ready(b.acquire(request, AcquireOptions::new()))))
            }),
        ),
        (
            "tokio_acquire_await",
            Box::new(move || drop(black_box(ready(tokio_slots.acquire())))),
        ),
        (
            "await_owned",
            Box::new({
                let b = budget.clone();
                move || {
                    drop(black_box(ready(
                        b.acquire_owned(request, black_box(reservation())),
                    )))
                }
            }),
        ),
        (
            "bulkhead_try_acquire",
            Box::new({
                let b = general.clone();
                move || drop(black_box(b.try_acquire()))
            }),
        ),
        (
            "bulkhead_await",
            Box::new(move || drop(black_box(ready(general.acquire())))),
        ),
        (
            "rejection_full",
            Box::new(move || drop(black_box(full.try_acquire(request, AcquireOptions::new())))),
        ),
        (
            "one_requests_window",
            Box::new(move || {
                drop(black_box(
                    one_window.try_acquire(request, AcquireOptions::new()),
                ))
            }),
        ),
        (
            "one_tokens_window",
            Box::new(move || {
                drop(black_box(
                    tokens_window.try_acquire(request, black_box(reservation())),
                ))
            }),
        ),
        (
            "rejection_rate",
            Box::new(move || {
                drop(black_box(
                    rate_limited.try_acquire(request, black_box(reservation())),
                ))
            }),
        ),
        (
            "rejection_closed",
            Box::new(move || {
                drop(black_box(
                    closed.try_acquire(request, AcquireOptions::new()),
                ))
            }),
        ),
        (
            "budget_owned",
            Box::new(move || {
                drop(black_box(
                    alone.try_acquire_owned(request, black_box(reservation())),
                ))
            }),
        ),
        (
            "within",
            Box::new(move || {
                drop(black_box(tenant.try_acquire_within(
                    &global,
                    request,
                    black_box(reservation()),
                )))
            }),
        ),
        (
            "within_await",
            Box::new(move || {
                // Released, not dropped: a second user of the result's drop glue made the
                // optimizer stop inlining it into `within`'s loop (+9 there, harness only).
                let permit = ready(awaited_tenant.acquire_within(
                    &awaited_global,
                    request,
                    black_box(reservation()),
                ));
                black_box(permit.expect("a free slot").release(None));
            }),
        ),
        (
            "rate_window",
            Box::new(move || {
                drop(black_box(
                    windowed.try_acquire(request, black_box(reservation())),
                ))
            }),
        ),
        (
            "rate_window_await",
            Box::new(move || {
                drop(black_box(ready(
                    windowed_await.acquire(request, black_box(reservation())),
                )))
            }),
        ),
        (
            "rate_window_owned",
            Box::new(move || {
                drop(black_box(
                    windowed_owned.try_acquire_owned(request, black_box(reservation())),
                ))
            }),
        ),
        (
            "tokio_rejection",
            Box::new(move || drop(black_box(tokio_empty.try_acquire()))),
        ),
    ]
}

/// The measured loop: `op`, `iterations` times. Never inlined, so a profiler can count it
/// alone (see the module docs).
#[inline(never)]
fn measured(op: &dyn Fn(), iterations: u64) {
    for _ in 0..iterations {
        op();
    }
}

/// Nanoseconds per iteration of `op`: the median of `runs` timed runs of `iterations`, after
/// a warm-up run.
fn time(op: &dyn Fn(), iterations: u64, runs: usize) -> f64 {
    measured(op, iterations / 10);
    let mut times: Vec<f64> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            measured(op, iterations);
            start.elapsed().as_nanos() as f64 / iterations as f64
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[runs / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; criterion-style filters come after it.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let cases = cases();
    match args.first().map(String::as_str) {
        Some("count") => {
            let name = args.get(1).expect("count CASE N");
            let iterations: u64 = args
                .get(2)
                .and_then(|n| n.parse().ok())
                .expect("count CASE N");
            let (_, op) = cases
                .iter()
                .find(|(n, _)| n == name)
                .unwrap_or_else(|| panic!("no case {name}"));
            // Warm: the first calls of a thread set up its counter shard and its id block.
            measured(op.as_ref(), 1000);
            measured(op.as_ref(), iterations);
        }
        Some("list") => {
            for (name, _) in &cases {
                println!("{name}");
            }
        }
        mode => {
            let filter = match mode {
                Some("ns") => args.get(1).cloned(),
                _ => None,
            };
            let iterations = setting("CYCLES_ITERATIONS", ITERATIONS);
            let runs = setting("CYCLES_RUNS", RUNS as u64).max(1) as usize;
            println!("case ns_per_iteration (median of {runs} runs of {iterations})");
            for (name, op) in &cases {
                if filter.as_deref().is_some_and(|f| !name.contains(f)) {
                    continue;
                }
                println!("{name} {:.2}", time(op.as_ref(), iterations, runs));
            }
        }
    }
}
