//! The control plane (random limits, budgets, drains and a close), and one scenario run.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    Limits, LlmBulkhead, TokenBudget, limits::ApplyOutcome, limits::LimitsError,
    limits::MAX_BUDGET, limits::MAX_CONCURRENT,
};
use futures::future::join_all;

use super::books::{Heard, Ledger, Shared, Tally, token_balance};
use super::callers::worker;
use super::runtime::{Guard, Plane, Rt, Setup, Task, yield_now};
use super::{BUDGET, PEAK_QUEUE, PEAK_SLOTS, QUEUE, RESERVE, SLOTS, mix};

/// A random budget: 0, below the tokens in flight, below the initial one, or up to three
/// times it (the common case, so that calls are admitted between the squeezes).
fn random_budget(bulkhead: &LlmBulkhead, rng: &mut fastrand::Rng) -> u64 {
    match rng.u8(0..12) {
        0 => 0,
        1 => rng.u64(0..=bulkhead.stats().token_budget.unwrap().in_flight_tokens),
        2 | 3 => rng.u64(300..BUDGET),
        _ => rng.u64(BUDGET..=3 * BUDGET),
    }
}

/// One random change (or non-change) of the limits, checked.
fn reconfigure(shared: &Shared, rng: &mut fastrand::Rng) {
    let bulkhead = &shared.bulkhead;
    let before = bulkhead.limits();
    let changes = shared.setup.plane != Plane::Fixed;
    match rng.u8(0..10) {
        0..=4 if changes => {
            let max_concurrent = match shared.setup.plane {
                Plane::Varying if rng.u8(0..8) == 0 => 0, // the kill switch, waiters kept
                Plane::Varying => rng.u32(1..=PEAK_SLOTS),
                _ => SLOTS,
            };
            let max_queue = if rng.u8(0..8) == 0 {
                0
            } else {
                rng.u32(1..=PEAK_QUEUE)
            };
            let budget = random_budget(bulkhead, rng);
            let reserve = match rng.u8(0..12) {
                // Above the budget: normal-priority calls get no tokens at all.
                0 => budget + rng.u64(0..100),
                _ => rng.u64(0..=budget / 4),
            };
            let next = Limits::new(before.revision + 1, max_concurrent)
                .with_max_queue(max_queue)
                .with_token_budget(budget, reserve);
            shared
                .peak_queue
                .fetch_max(u64::from(max_queue), Ordering::AcqRel);
            let outcome = bulkhead.apply_limits(next.clone()).unwrap();
            assert_eq!(
                outcome,
                ApplyOutcome::Applied {
                    previous: before.clone(),
                    current: next.clone()
                }
            );
            assert_eq!(bulkhead.limits(), next);
            Tally::bump(&shared.tally.limit_changes);
        }
        5 | 6 if changes => {
            let budget = random_budget(bulkhead, rng);
            let now = bulkhead.set_budget(budget).unwrap();
            assert_eq!(now.revision, before.revision + 1);
            assert_eq!(now.token_budget.unwrap().budget, budget);
            assert_eq!(
                (now.max_concurrent, now.max_queue),
                (before.max_concurrent, before.max_queue)
            );
            assert_eq!(bulkhead.limits(), now);
            Tally::bump(&shared.tally.limit_changes);
        }
        7 => {
            // Stale: nothing changes, the rest is not even examined.
            let stale = Limits::new(rng.u64(0..=before.revision), rng.u32(0..=PEAK_SLOTS));
            assert_eq!(
                bulkhead.apply_limits(stale).unwrap(),
                ApplyOutcome::Stale {
                    current: before.clone()
                }
            );
            assert_eq!(bulkhead.limits(), before);
        }
        8 => {
            // Invalid: refused whole, nothing changes.
            let next = Limits::new(before.revision + 1, SLOTS);
            let (invalid, expected) = match rng.u8(0..3) {
                0 => (next, LimitsError::TokenBudgetRequired),
                1 => (
                    Limits::new(before.revision + 1, MAX_CONCURRENT + 1).with_token_budget(1, 0),
                    LimitsError::MaxConcurrentTooLarge {
                        value: MAX_CONCURRENT + 1,
                        max: MAX_CONCURRENT,
                    },
                ),
                _ => (
                    next.with_token_budget(MAX_BUDGET + 1, 0),
                    LimitsError::BudgetTooLarge {
                        value: MAX_BUDGET + 1,
                        max: MAX_BUDGET,
                    },
                ),
            };
            assert_eq!(bulkhead.apply_limits(invalid).unwrap_err(), expected);
            assert_eq!(bulkhead.limits(), before);
        }
        _ => {
            let stats = bulkhead.stats();
            assert!(stats.in_flight <= shared.setup.ceiling(), "{stats:?}");
            assert!(
                stats.pending <= shared.peak_queue.load(Ordering::Acquire),
                "{stats:?}"
            );
            assert_eq!(stats.limits, before);
        }
    }
}

fn start_drain(shared: &Arc<Shared>, drains: &mut Vec<Task>) {
    Tally::bump(&shared.tally.drains_started);
    let inner = Arc::clone(shared);
    drains.push(shared.spawn(async move {
        inner.bulkhead.drain().await;
        Tally::bump(&inner.tally.drains_resolved);
    }));
}

async fn control_plane(shared: Arc<Shared>) {
    let mut rng = fastrand::Rng::with_seed(mix(shared.setup.seed, 0));
    let bulkhead = &shared.bulkhead;
    let total = shared.setup.workers * shared.setup.ops;
    let close_at = rng.u64(total / 2..=total * 19 / 20);
    let mut drains = Vec::new();
    while shared.ops_done.load(Ordering::Acquire) < close_at && !shared.failed() {
        reconfigure(&shared, &mut rng);
        match rng.u8(0..40) {
            0 => start_drain(&shared, &mut drains),
            1 => {
                // Cancels nothing, whatever it finds.
                let wait = Duration::from_micros(rng.u64(0..500));
                let report = bulkhead.drain_timeout(wait).await;
                if report.drained {
                    assert_eq!((report.in_flight, report.pending), (0, 0));
                }
            }
            _ => {}
        }
        shared.rt.pause(&mut rng).await;
        yield_now().await;
    }

    assert!(bulkhead.close(), "the control plane closes");
    shared.closed.store(true, Ordering::Release);
    assert!(!bulkhead.close(), "close is idempotent");
    start_drain(&shared, &mut drains);
    // After the close: nothing waits, and slots in flight only go down, whatever the limits.
    let mut in_flight = u64::MAX;
    while shared.workers_done.load(Ordering::Acquire) < shared.setup.workers && !shared.failed() {
        let stats = bulkhead.stats();
        assert!(stats.closed);
        assert_eq!(stats.pending, 0, "nobody waits after the close");
        assert!(
            stats.in_flight <= in_flight,
            "{} -> {}",
            in_flight,
            stats.in_flight
        );
        in_flight = stats.in_flight;
        check_quiet_books(&shared);
        reconfigure(&shared, &mut rng);
        shared.rt.pause(&mut rng).await;
        yield_now().await;
    }
    if !shared.failed() {
        bulkhead.drain().await;
        check_quiet_books(&shared);
    }
    join_all(drains).await;
}

/// After the close, once nothing is in flight (no admission unsettled, none can come: every
/// call is refused), the token books are quiet whatever the callers still do: the token
/// identity must hold exactly, at 0. The counters are read again after the word showed it
/// idle (a settlement books before it returns its hold), so none of them lags.
fn check_quiet_books(shared: &Shared) {
    let idle = shared.bulkhead.stats();
    let tokens = idle.token_budget.unwrap();
    if idle.in_flight > 0 || idle.abandoned_in_flight > 0 || tokens.in_flight_tokens > 0 {
        return;
    }
    let stats = shared.bulkhead.stats();
    let tokens = stats.token_budget.unwrap();
    assert_eq!(tokens.in_flight_tokens, 0, "closed and idle: {stats:?}");
    if let Some(balance) = token_balance(&tokens) {
        assert_eq!(
            balance, 0,
            "closed and idle: reserved + overrun + reheld - refunded - consumed - returned \
             == in_flight_tokens: {tokens:?}"
        );
        Tally::bump(&shared.tally.quiet_checks);
    }
}

pub(crate) async fn scenario(name: &str, setup: Setup, rt: Rt) {
    let bulkhead = LlmBulkhead::builder("gpt-4o", SLOTS as usize)
        .max_queue(QUEUE as usize)
        .token_budget(TokenBudget::new(BUDGET).high_priority_reserve(RESERVE))
        .build()
        .unwrap();
    let _guard = Guard::new(
        format!("{name}: seed {} {setup:?}", setup.seed),
        bulkhead.clone(),
    );
    let heard = Arc::new(Heard::default());
    let _subscription = setup.listen.then(|| {
        let heard = Arc::clone(&heard);
        bulkhead.on(move |event| heard.hear(event))
    });
    let shared = Arc::new(Shared {
        setup,
        bulkhead: bulkhead.clone(),
        rt,
        tally: Tally::default(),
        ledger: Ledger::default(),
        heard,
        closed: AtomicBool::new(false),
        peak_queue: AtomicU64::new(u64::from(QUEUE)),
        ops_done: AtomicU64::new(0),
        workers_done: AtomicU64::new(0),
        tasks: Arc::default(),
    });
    let started = Instant::now();
    let plane = shared.spawn(control_plane(Arc::clone(&shared)));
    let workers: Vec<_> = (0..setup.workers)
        .map(|w| shared.spawn(worker(Arc::clone(&shared), w)))
        .collect();
    join_all(workers).await;
    plane.await;
    shared.rethrow();
    assert!(bulkhead.drain_timeout(Duration::ZERO).await.drained);
    bulkhead.drain().await;
    shared.verify();
    println!("chaos {name}: {:?}", started.elapsed());
}
