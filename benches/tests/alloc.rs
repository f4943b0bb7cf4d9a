//! The fast paths allocate nothing: once a thread has used a bulkhead (its statistics shard is
//! attached, see `crate::local`), admitting, reporting usage, releasing, dropping and refusing
//! (the `Rejection` and its capacity snapshot included) never touch the heap, with or without a
//! token budget, with or without admission classes (abandoning a borrowed slot and every class
//! refusal included), and a listener subscribed to other event kinds costs nothing either.
//! Once warm, the waiting path allocates nothing either: queueing, being handed a slot, being
//! cancelled and timing out (both bulkheads; waiters come from a per-thread pool, and the
//! timer's map keeps its node).
//!
//! The `allocation-counter` dev-dependency installs a counting global allocator in this test
//! binary (and only here: no other target links it). It counts per thread, so the harness's
//! other test threads stay out of every measurement; the crate itself stays free of `unsafe`.

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, Reservation, TokenBudget, TokenUsage,
    events::EventKind, usage::Progressive,
};

/// The allocations `f` makes on this thread (reallocations count as allocations).
fn allocations_in(f: impl FnOnce()) -> u64 {
    allocation_counter::measure(f).count_total
}

/// Asserts that `f`, run `ITERATIONS` times after `WARM_UP` runs, allocates nothing.
fn assert_allocation_free(what: &str, mut f: impl FnMut()) {
    for _ in 0..WARM_UP {
        f();
    }
    let count = allocations_in(|| {
        for _ in 0..ITERATIONS {
            f();
        }
    });
    assert_eq!(
        count, 0,
        "{what}: {count} allocations in {ITERATIONS} iterations"
    );
}

const ITERATIONS: usize = 1000;
const WARM_UP: usize = 3;

// ===== fixtures =====

fn reservation(input: u64, max_output: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(input, max_output).unwrap())
}

fn budgeted(max_concurrent: usize, budget: u64) -> LlmBulkhead {
    LlmBulkhead::builder("m", max_concurrent)
        .token_budget(TokenBudget::new(budget))
        .build()
        .unwrap()
}

fn unbudgeted(max_concurrent: usize) -> LlmBulkhead {
    LlmBulkhead::builder("m", max_concurrent).build().unwrap()
}

/// Every allocation-free operation, against `bulkhead` (with or without a budget).
fn exercise_every_path(label: &str, bulkhead: &LlmBulkhead) {
    let request = LlmRequest::new();
    let opts = reservation(100, 1000);
    let usage = TokenUsage::new(20, 5).unwrap();
    let overrun = TokenUsage::new(100, 1400).unwrap();
    let progressive = Progressive::new(600).safety_margin(50);
    let has_budget = bulkhead.limits().token_budget.is_some();

    assert_allocation_free(&format!("{label}: try_acquire + release(None)"), || {
        let permit = bulkhead.try_acquire(black_box(&request), opts).unwrap();
        black_box(permit.release(None));
    });
    assert_allocation_free(&format!("{label}: try_acquire + drop"), || {
        let permit = bulkhead.try_acquire(black_box(&request), opts).unwrap();
        drop(black_box(permit));
    });
    assert_allocation_free(
        &format!("{label}: try_acquire + report_usage + release(Some)"),
        || {
            let mut permit = bulkhead.try_acquire(black_box(&request), opts).unwrap();
            let report = permit.report_usage(black_box(usage)).unwrap();
            assert_eq!(report.held, if has_budget { 1020 } else { 0 });
            black_box(report);
            black_box(permit.release(Some(black_box(usage))));
        },
    );
    assert_allocation_free(
        &format!("{label}: report (refund, then overrun) + drop settling the last report"),
        || {
            let mut permit = bulkhead.try_acquire(black_box(&request), opts).unwrap();
            black_box(permit.report_usage(black_box(usage)).unwrap());
            black_box(permit.report_usage(black_box(overrun)).unwrap());
            drop(black_box(permit));
        },
    );
    assert_allocation_free(
        &format!("{label}: progressive report + release(Some)"),
        || {
            let mut permit = bulkhead.try_acquire(black_box(&request), opts).unwrap();
            black_box(
                permit
                    .report_usage_progressive(black_box(usage), progressive)
                    .unwrap(),
            );
            black_box(permit.release(Some(black_box(usage))));
        },
    );
    assert_allocation_free(&format!("{label}: try_acquire_owned + drop"), || {
        let permit = bulkhead
            .try_acquire_owned(black_box(&request), opts)
            .unwrap();
        drop(black_box(permit));
    });
    assert_allocation_free(
        &format!("{label}: try_acquire_owned + report_usage + release(Some)"),
        || {
            let mut permit = bulkhead
                .try_acquire_owned(black_box(&request), opts)
                .unwrap();
            black_box(permit.report_usage(black_box(usage)).unwrap());
            black_box(permit.release(Some(black_box(usage))));
        },
    );
}

/// A refusal for lack of a slot (and, with a budget, for lack of tokens), reading the
/// rejection's capacity snapshot inside the measured region.
fn exercise_refusals(label: &str, bulkhead: &LlmBulkhead) {
    let request = LlmRequest::new();
    let has_budget = bulkhead.limits().token_budget.is_some();
    let max_concurrent = bulkhead.limits().max_concurrent;

    if has_budget {
        // Budget 10_000: one call holds 9_000, a newcomer asking 1_100 does not fit.
        let held = bulkhead
            .try_acquire(&request, reservation(1000, 8000))
            .unwrap();
        let opts = reservation(100, 1000);
        assert_allocation_free(&format!("{label}: try_acquire refused (budget)"), || {
            let err = bulkhead
                .try_acquire(black_box(&request), opts)
                .err()
                .unwrap();
            let rejection = *err.rejection().unwrap();
            assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
            let detail = rejection.detail();
            let tokens = detail.token_budget.unwrap();
            assert_eq!((tokens.in_flight_tokens, tokens.requested), (9000, 1100));
            black_box((rejection, detail.in_flight, detail.max_concurrent));
        });
        assert_allocation_free(
            &format!("{label}: try_acquire_owned refused (budget)"),
            || {
                let err = bulkhead
                    .try_acquire_owned(black_box(&request), opts)
                    .err()
                    .unwrap();
                assert_eq!(err.rejection().unwrap().reason(), RejectReason::BudgetLimit);
                black_box(err);
            },
        );
        drop(held);
    }

    // Fill every slot, with a small reservation so the budget is not what refuses.
    let held: Vec<_> = (0..max_concurrent)
        .map(|_| bulkhead.try_acquire(&request, reservation(1, 1)).unwrap())
        .collect();
    let opts = reservation(1, 1);
    assert_allocation_free(
        &format!("{label}: try_acquire refused (concurrency)"),
        || {
            let err = bulkhead
                .try_acquire(black_box(&request), opts)
                .err()
                .unwrap();
            let rejection = *err.rejection().unwrap();
            assert_eq!(rejection.reason(), RejectReason::ConcurrencyLimit);
            let detail = rejection.detail();
            assert_eq!(detail.in_flight, u64::from(max_concurrent));
            assert_eq!(detail.token_budget.is_some(), has_budget);
            black_box((rejection, detail.pending));
        },
    );
    assert_allocation_free(
        &format!("{label}: try_acquire_owned refused (concurrency)"),
        || {
            let err = bulkhead
                .try_acquire_owned(black_box(&request), opts)
                .err()
                .unwrap();
            assert_eq!(
                err.rejection().unwrap().reason(),
                RejectReason::ConcurrencyLimit
            );
            black_box(err);
        },
    );
    drop(held);
}

/// The books of `bulkhead` are complete and everything came back.
fn assert_idle(bulkhead: &LlmBulkhead) {
    let stats = bulkhead.stats();
    assert_eq!(stats.in_flight, 0);
    assert_eq!(stats.admitted, stats.released);
    if let Some(tokens) = stats.token_budget {
        assert_eq!(tokens.in_flight_tokens, 0);
    }
}

// ===== the tests =====

#[test]
fn the_counter_sees_allocations() {
    // Guards against a vacuous pass: the counter must notice a heap allocation.
    let count = allocations_in(|| {
        black_box(Box::new(black_box(7u64)));
    });
    assert_eq!(count, 1);
    let count = allocations_in(|| {
        let mut v: Vec<u64> = Vec::with_capacity(1);
        v.extend(black_box([1, 2, 3]));
        black_box(v);
    });
    assert_eq!(count, 2, "alloc + realloc");
}

#[test]
fn budgeted_paths_allocate_nothing() {
    let bulkhead = budgeted(4, 10_000);
    exercise_every_path("budget", &bulkhead);
    assert_idle(&bulkhead);
    // The measured operations really happened (and were counted).
    let stats = bulkhead.stats();
    assert_eq!(stats.admitted, (7 * (WARM_UP + ITERATIONS)) as u64);
    let tokens = stats.token_budget.unwrap();
    assert!(tokens.total_consumed > 0 && tokens.total_refunded > 0 && tokens.total_overrun > 0);
}

#[test]
fn budgeted_refusals_allocate_nothing() {
    let bulkhead = budgeted(2, 10_000);
    exercise_refusals("budget", &bulkhead);
    assert_idle(&bulkhead);
    let rejected = bulkhead.stats().rejected_by_reason;
    let per_path = (WARM_UP + ITERATIONS) as u64;
    assert_eq!(
        (rejected.budget_limit, rejected.concurrency_limit),
        (2 * per_path, 2 * per_path)
    );
}

#[test]
fn unbudgeted_paths_allocate_nothing() {
    let bulkhead = unbudgeted(4);
    exercise_every_path("no budget", &bulkhead);
    assert_idle(&bulkhead);
    assert!(bulkhead.stats().token_budget.is_none());
}

#[test]
fn unbudgeted_refusals_allocate_nothing() {
    let bulkhead = unbudgeted(2);
    exercise_refusals("no budget", &bulkhead);
    assert_idle(&bulkhead);
    assert_eq!(
        bulkhead.stats().rejected_by_reason.concurrency_limit,
        2 * (WARM_UP + ITERATIONS) as u64
    );
}

#[test]
fn a_fail_closed_refusal_allocates_nothing() {
    // max_concurrent 0: every call is refused before anything is taken.
    let bulkhead = budgeted(0, 10_000);
    let request = LlmRequest::new();
    let opts = reservation(1, 1);
    assert_allocation_free("max_concurrent 0: refused", || {
        let err = bulkhead
            .try_acquire(black_box(&request), opts)
            .err()
            .unwrap();
        assert_eq!(
            err.rejection().unwrap().reason(),
            RejectReason::ConcurrencyLimit
        );
        black_box(err);
    });
}

#[test]
fn listeners_of_other_kinds_cost_no_allocation() {
    for (label, bulkhead) in [
        ("budget, reconfigure listener", budgeted(2, 10_000)),
        ("no budget, reconfigure listener", unbudgeted(2)),
    ] {
        let reconfigures = Arc::new(AtomicU64::new(0));
        let seen = Arc::clone(&reconfigures);
        let _subscription = bulkhead.on_events([EventKind::Reconfigure], move |_| {
            seen.fetch_add(1, Ordering::Relaxed);
        });
        exercise_every_path(label, &bulkhead);
        exercise_refusals(label, &bulkhead);
        assert_idle(&bulkhead);
        // The listener is live: a reconfiguration reaches it.
        let mut next = bulkhead.limits();
        next.revision += 1;
        assert!(bulkhead.apply_limits(next).unwrap().is_applied());
        assert_eq!(reconfigures.load(Ordering::Relaxed), 1, "{label}");
    }
}

#[test]
fn a_listener_subscription_that_was_dropped_costs_nothing() {
    // Subscribing to everything, then unsubscribing, leaves the mask empty again.
    let bulkhead = budgeted(2, 10_000);
    drop(bulkhead.on(|_| {}));
    exercise_every_path("budget, dropped subscription", &bulkhead);
    assert_idle(&bulkhead);
}

#[test]
fn an_estimated_admission_allocates_nothing() {
    // Beyond the override: the default estimator sizes the call (request built beforehand).
    let bulkhead = budgeted(2, 1_000_000);
    let request = LlmRequest::new()
        .user("Explain bulkheads in one line.")
        .max_tokens(200);
    let usage = TokenUsage::new(8, 60).unwrap();
    assert_allocation_free("estimated: try_acquire + report + release(Some)", || {
        let mut permit = bulkhead
            .try_acquire(black_box(&request), AcquireOptions::new())
            .unwrap();
        assert_eq!(permit.held_tokens(), 208);
        black_box(permit.report_usage(black_box(usage)).unwrap());
        black_box(permit.release(Some(black_box(usage))));
    });
    assert_idle(&bulkhead);
}

/// 4 classes with floors and a budget: the class fast path (named class, default class,
/// reports, abandonment and its settlement, every kind of class refusal) allocates nothing.
#[test]
fn class_paths_allocate_nothing() {
    use async_bulkhead_llm::{
        classes::AdmissionClasses, classes::ClassLimits, rejection::Constraint,
    };

    let bulkhead = LlmBulkhead::builder("m", 8)
        .token_budget(TokenBudget::new(10_000))
        .admission_classes(
            AdmissionClasses::new("batch")
                .class(
                    "premium",
                    ClassLimits::new()
                        .protected_concurrent(2)
                        .protected_in_flight_tokens(2000),
                )
                .class("standard", ClassLimits::new().protected_concurrent(1))
                .class("internal", ClassLimits::new().max_concurrent(1))
                .class("batch", ClassLimits::new().max_in_flight_tokens(3000)),
        )
        .build()
        .unwrap();
    let premium = bulkhead.class("premium").unwrap();
    let internal = bulkhead.class("internal").unwrap();
    exercise_every_path("classes (default class)", &bulkhead);
    let request = LlmRequest::new();
    let opts = reservation(100, 1000).class(premium);
    let usage = TokenUsage::new(20, 5).unwrap();
    assert_allocation_free("classes: named class + report + release(Some)", || {
        let mut permit = bulkhead.try_acquire(black_box(&request), opts).unwrap();
        black_box(permit.report_usage(black_box(usage)).unwrap());
        black_box(permit.release(Some(black_box(usage))));
    });
    assert_allocation_free("classes: abandon a borrowed slot, then settle", || {
        let mut permit = bulkhead
            .try_acquire(black_box(&request), reservation(1, 1).class(internal))
            .unwrap();
        assert!(permit.abandon_borrowed_concurrency());
        drop(black_box(permit));
    });
    // A class ceiling refusal, with its class detail and shared pool.
    let held = bulkhead
        .try_acquire(&request, reservation(1, 1).class(internal))
        .unwrap();
    assert_allocation_free("classes: class ceiling refusal", || {
        let err = bulkhead
            .try_acquire(black_box(&request), reservation(1, 1).class(internal))
            .err()
            .unwrap();
        let rejection = *err.rejection().unwrap();
        let detail = rejection.detail();
        assert_eq!(detail.constraint, Some(Constraint::AdmissionClass));
        black_box((rejection, detail.admission_class().unwrap().in_flight));
    });
    drop(held);
    // A protection refusal: the shared pool (8 - 3 = 5 slots) is full.
    let held: Vec<_> = (0..7)
        .map(|_| {
            bulkhead
                .try_acquire(&request, reservation(1, 1).class(premium))
                .unwrap()
        })
        .collect();
    assert_allocation_free("classes: protection refusal", || {
        let err = bulkhead
            .try_acquire(black_box(&request), reservation(1, 1).class(premium))
            .err()
            .unwrap();
        let rejection = *err.rejection().unwrap();
        assert_eq!(
            rejection.detail().constraint,
            Some(Constraint::AdmissionClassProtection)
        );
        black_box(rejection.detail().shared_capacity().unwrap());
    });
    drop(held);
    assert_idle(&bulkhead);
    assert_eq!(bulkhead.stats().abandoned_in_flight, 0);
}

// ===== the waiting path =====

/// Polls `future` once with a waker that does nothing.
fn poll_once<F: std::future::Future + Unpin>(future: &mut F) -> std::task::Poll<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    std::pin::Pin::new(future).poll(&mut cx)
}

/// Queueing, being handed a slot, and being cancelled (queued, or after the hand-off) allocate
/// nothing once the thread is warm: the waiter comes from this thread's pool. (Timing out: see
/// the `timed_out_wait` tests below.)
#[test]
fn the_general_bulkheads_waiting_path_allocates_nothing_once_warm() {
    let bulkhead = async_bulkhead_llm::Bulkhead::builder(1)
        .max_queue(4)
        .wait_indefinitely()
        .build()
        .unwrap();
    assert_allocation_free("bulkhead: queue, hand-off, cancel", || {
        let held = bulkhead.try_acquire().unwrap();
        let mut waiting = bulkhead.acquire();
        assert!(poll_once(&mut waiting).is_pending());
        let mut cancelled = bulkhead.acquire();
        assert!(poll_once(&mut cancelled).is_pending());
        drop(held); // hands the slot to `waiting`
        drop(cancelled); // leaves the queue
        let permit = match poll_once(&mut waiting) {
            std::task::Poll::Ready(permit) => permit.unwrap(),
            std::task::Poll::Pending => panic!("the head was not handed the slot"),
        };
        let mut handed = bulkhead.acquire();
        assert!(poll_once(&mut handed).is_pending());
        drop(permit); // hands the slot to `handed`...
        drop(handed); // ...which gives it back unused
        black_box(&bulkhead);
    });
    assert_eq!(bulkhead.state(), Default::default());
    assert_eq!(
        bulkhead.stats().cancelled,
        (WARM_UP + ITERATIONS) as u64 * 2
    );
}

/// The same for the LLM bulkhead, with a token budget.
#[test]
fn the_llm_bulkheads_waiting_path_allocates_nothing_once_warm() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .max_queue(4)
        .token_budget(TokenBudget::new(10_000))
        .build()
        .unwrap();
    let request = LlmRequest::new();
    let opts = reservation(10, 20);
    assert_allocation_free("llm: queue, hand-off, cancel", || {
        let held = bulkhead.try_acquire(&request, opts).unwrap();
        let mut waiting = bulkhead.acquire(&request, opts);
        assert!(poll_once(&mut waiting).is_pending());
        let mut cancelled = bulkhead.acquire(&request, opts);
        assert!(poll_once(&mut cancelled).is_pending());
        drop(held);
        drop(cancelled);
        let permit = match poll_once(&mut waiting) {
            std::task::Poll::Ready(permit) => permit.unwrap(),
            std::task::Poll::Pending => panic!("the head was not handed the slot"),
        };
        let mut handed = bulkhead.acquire(&request, opts);
        assert!(poll_once(&mut handed).is_pending());
        drop(permit);
        drop(handed);
    });
    assert_idle(&bulkhead);
}

/// Polls `future` until it is ready, spinning (the timer wakes nobody here: the waker is a
/// no-op, and the poll that finds the deadline passed is what times the wait out).
fn spin_until_ready<F: std::future::Future + Unpin>(future: &mut F) -> F::Output {
    loop {
        if let std::task::Poll::Ready(output) = poll_once(future) {
            return output;
        }
        std::hint::spin_loop();
    }
}

/// A queued wait that times out allocates nothing once warm: it registers with the crate's
/// timer (an entry in its ordered map, whose node stays allocated while the map is empty) and
/// leaves it when the deadline has passed; its waiter returns to the pool.
#[test]
fn the_llm_bulkheads_timed_out_wait_allocates_nothing_once_warm() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .max_queue(4)
        .token_budget(TokenBudget::new(10_000))
        .build()
        .unwrap();
    let request = LlmRequest::new();
    let opts = reservation(10, 20).timeout(std::time::Duration::from_micros(200));
    let held = bulkhead.try_acquire(&request, opts).unwrap();
    let queued = std::cell::Cell::new(0);
    assert_allocation_free("llm: queue, time out", || {
        let mut waiting = bulkhead.acquire(&request, opts);
        // The first poll queues the call; on a loaded machine the 200 us can pass before it
        // returns, and then it times the wait out itself.
        let refused = match poll_once(&mut waiting) {
            std::task::Poll::Ready(done) => done.unwrap_err(),
            std::task::Poll::Pending => {
                queued.set(queued.get() + 1);
                spin_until_ready(&mut waiting).unwrap_err()
            }
        };
        assert_eq!(refused.rejection().unwrap().reason(), RejectReason::Timeout);
    });
    assert!(
        queued.get() > ITERATIONS / 2,
        "only {} waits timed out later",
        queued.get()
    );
    drop(held);
    assert_idle(&bulkhead);
    assert_eq!(
        bulkhead.stats().rejected_by_reason.timeout,
        (WARM_UP + ITERATIONS) as u64
    );
}

/// The same for the general bulkhead's queue timeout.
#[test]
fn the_general_bulkheads_timed_out_wait_allocates_nothing_once_warm() {
    let bulkhead = async_bulkhead_llm::Bulkhead::builder(1)
        .max_queue(4)
        .queue_timeout(std::time::Duration::from_micros(200))
        .build()
        .unwrap();
    let held = bulkhead.try_acquire().unwrap();
    let queued = std::cell::Cell::new(0);
    assert_allocation_free("bulkhead: queue, time out", || {
        let mut waiting = bulkhead.acquire();
        // As above: the first poll may itself find the 200 us passed on a loaded machine.
        let refused = match poll_once(&mut waiting) {
            std::task::Poll::Ready(done) => done.unwrap_err(),
            std::task::Poll::Pending => {
                queued.set(queued.get() + 1);
                spin_until_ready(&mut waiting).unwrap_err()
            }
        };
        assert!(matches!(
            refused,
            async_bulkhead_llm::BulkheadError::QueueTimeout { .. }
        ));
    });
    assert!(
        queued.get() > ITERATIONS / 2,
        "only {} waits timed out later",
        queued.get()
    );
    drop(held);
    assert_eq!(bulkhead.stats().timed_out, (WARM_UP + ITERATIONS) as u64);
}

/// Rate windows (the bulkhead's and a class's, far from binding): admission, usage reports
/// (the overrun charged as it arrives), release (the charge corrected to the usage), drop, and
/// a window's refusal allocate nothing.
#[test]
fn rate_window_paths_allocate_nothing() {
    use std::time::Duration;

    use async_bulkhead_llm::classes::{AdmissionClasses, ClassLimits};
    use async_bulkhead_llm::rate::{ManualClock, RateClock, RateLimits};

    let clock = ManualClock::new();
    let wide = RateLimits::new(Duration::from_secs(1_000))
        .requests(1_000_000_000)
        .tokens(1_000_000_000_000);
    let windowed = LlmBulkhead::builder("m", 8)
        .token_budget(TokenBudget::new(100_000))
        .rate_limits(wide)
        .rate_clock(RateClock::manual(&clock))
        .build()
        .unwrap();
    exercise_every_path("windows", &windowed);
    let classed = LlmBulkhead::builder("m", 8)
        .token_budget(TokenBudget::new(100_000))
        .rate_limits(wide)
        .admission_classes(
            AdmissionClasses::new("batch").class("batch", ClassLimits::new().rate(wide)),
        )
        .rate_clock(RateClock::manual(&clock))
        .build()
        .unwrap();
    exercise_every_path("class windows", &classed);
    let tight = LlmBulkhead::builder("m", 8)
        .token_budget(TokenBudget::new(100_000))
        .rate_limits(RateLimits::new(Duration::from_secs(3_600)).requests(1))
        .rate_clock(RateClock::manual(&clock))
        .build()
        .unwrap();
    drop(
        tight
            .try_acquire(&LlmRequest::new(), reservation(1, 1))
            .unwrap(),
    );
    let request = LlmRequest::new();
    assert_allocation_free("a window's refusal", || {
        let refused = tight.try_acquire(black_box(&request), reservation(1, 1));
        black_box(refused.unwrap_err());
    });
    assert_idle(&windowed);
    assert_idle(&classed);
}
