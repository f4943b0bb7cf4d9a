//! Stress tests on real threads and a real multi-threaded runtime: many callers hammer one
//! bulkhead with random reservations, priorities, releases with and without usage, limit
//! changes and a close at a random point, and every run ends with exact invariants.
//!
//! `STRESS_SCALE` (default 1) multiplies the work, e.g. `STRESS_SCALE=100` for a long soak.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, Limits, LlmBulkhead, LlmRequest, Priority, RejectReason,
    Reservation, TokenBudget, TokenUsage,
};

use crate::kit::scale;

/// What the callers hold, on their side, checked against fixed ceilings at every admission.
#[derive(Default)]
struct Ledger {
    slots: AtomicU64,
    tokens: AtomicU64,
}

impl Ledger {
    fn enter(&self, tokens: u64, max_slots: u64, max_tokens: u64) {
        // A caller counts itself only after it was admitted and uncounts itself before it
        // releases, so the ledger never exceeds what the bulkhead really holds.
        let slots = self.slots.fetch_add(1, Ordering::AcqRel) + 1;
        let held = self.tokens.fetch_add(tokens, Ordering::AcqRel) + tokens;
        assert!(slots <= max_slots, "{slots} slots held, limit {max_slots}");
        assert!(
            held <= max_tokens,
            "{held} tokens held, budget {max_tokens}"
        );
    }

    fn leave(&self, tokens: u64) {
        self.slots.fetch_sub(1, Ordering::AcqRel);
        self.tokens.fetch_sub(tokens, Ordering::AcqRel);
    }
}

/// Sums the callers keep, to compare with the bulkhead's statistics at the end.
#[derive(Default)]
struct Tally {
    admitted: AtomicU64,
    rejected: [AtomicU64; 3],
    reserved: AtomicU64,
    consumed: AtomicU64,
    refunded: AtomicU64,
}

impl Tally {
    fn rejected(&self, reason: RejectReason) {
        let i = match reason {
            RejectReason::Shutdown => 0,
            RejectReason::ConcurrencyLimit => 1,
            RejectReason::BudgetLimit => 2,
            other => panic!("unexpected reason {other}"),
        };
        self.rejected[i].fetch_add(1, Ordering::Relaxed);
    }
}

/// One caller's random operation; returns whether it was admitted.
fn random_call(
    bulkhead: &LlmBulkhead,
    rng: &mut fastrand::Rng,
    ledger: &Ledger,
    tally: &Tally,
    ceilings: Option<(u64, u64)>,
) {
    let reservation = Reservation::new(rng.u64(0..300), rng.u64(0..700)).unwrap();
    let priority = if rng.bool() {
        Priority::High
    } else {
        Priority::Normal
    };
    let options = AcquireOptions::new()
        .priority(priority)
        .reservation(reservation);
    let permit = match bulkhead.try_acquire(&LlmRequest::new(), options) {
        Ok(permit) => permit,
        Err(AcquireError::Rejected(rejection)) => {
            tally.rejected(rejection.reason());
            return;
        }
        Err(AcquireError::Invalid(err)) => panic!("valid input refused: {err}"),
        Err(other) => panic!("an error this test does not know: {other}"),
    };
    tally.admitted.fetch_add(1, Ordering::Relaxed);
    tally
        .reserved
        .fetch_add(reservation.reserved(), Ordering::Relaxed);
    assert_eq!(permit.held_tokens(), reservation.reserved());
    if let Some((max_slots, max_tokens)) = ceilings {
        ledger.enter(reservation.reserved(), max_slots, max_tokens);
    }
    for _ in 0..rng.usize(0..20) {
        std::hint::spin_loop();
    }
    if let Some((..)) = ceilings {
        ledger.leave(reservation.reserved());
    }
    match rng.u8(0..3) {
        0 => drop(permit),
        1 => {
            let report = permit.release(None);
            assert_eq!(
                (report.held_tokens, report.refunded_tokens),
                (reservation.reserved(), 0)
            );
        }
        _ => {
            // Usage up to 150% of the reservation: some refund, some overrun the hold.
            let total = rng.u64(0..=reservation.reserved() * 3 / 2 + 1);
            let input = rng.u64(0..=total);
            let usage = TokenUsage::new(input, total - input).unwrap();
            let report = permit.release(Some(usage));
            assert_eq!(
                report.refunded_tokens,
                reservation.reserved().saturating_sub(total)
            );
            tally.consumed.fetch_add(total, Ordering::Relaxed);
            tally
                .refunded
                .fetch_add(report.refunded_tokens, Ordering::Relaxed);
        }
    }
}

fn assert_settled(bulkhead: &LlmBulkhead, tally: &Tally) {
    let stats = bulkhead.stats();
    let tokens = stats.token_budget.expect("budget configured");
    assert_eq!(stats.in_flight, 0, "every slot returned");
    assert_eq!(tokens.in_flight_tokens, 0, "every token returned");
    assert_eq!(stats.admitted, tally.admitted.load(Ordering::Relaxed));
    assert_eq!(stats.released, stats.admitted);
    let by = stats.rejected_by_reason;
    let rejected: Vec<u64> = tally
        .rejected
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .collect();
    assert_eq!(
        vec![by.shutdown, by.concurrency_limit, by.budget_limit],
        rejected
    );
    assert_eq!(stats.rejected, rejected.iter().sum::<u64>());
    assert_eq!(
        tokens.total_reserved,
        tally.reserved.load(Ordering::Relaxed)
    );
    assert_eq!(
        tokens.total_consumed,
        tally.consumed.load(Ordering::Relaxed)
    );
    assert_eq!(
        tokens.total_refunded,
        tally.refunded.load(Ordering::Relaxed)
    );
}

#[test]
fn threads_never_exceed_fixed_ceilings_and_return_everything() {
    const THREADS: u64 = 8;
    let per_thread = 20_000 * scale();
    let (max_slots, budget) = (6u64, 2_000u64);
    let bulkhead = LlmBulkhead::builder("m", max_slots as usize)
        .token_budget(TokenBudget::new(budget).high_priority_reserve(300))
        .build()
        .unwrap();
    let ledger = Ledger::default();
    let tally = Tally::default();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (bulkhead, ledger, tally) = (&bulkhead, &ledger, &tally);
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t);
                for _ in 0..per_thread {
                    random_call(bulkhead, &mut rng, ledger, tally, Some((max_slots, budget)));
                }
            });
        }
    });
    assert_settled(&bulkhead, &tally);
    let stats = bulkhead.stats();
    assert!(
        stats.admitted > 0 && stats.rejected > 0,
        "the run exercised both outcomes"
    );
}

#[test]
fn threads_with_limit_changes_and_a_close_return_everything() {
    const THREADS: u64 = 6;
    let per_thread = 15_000 * scale();
    let bulkhead = LlmBulkhead::builder("m", 4)
        .token_budget(TokenBudget::new(1_500))
        .build()
        .unwrap();
    let ledger = Ledger::default();
    let tally = Tally::default();
    let done = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (bulkhead, ledger, tally, done) = (&bulkhead, &ledger, &tally, &done);
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(100 + t);
                for _ in 0..per_thread {
                    random_call(bulkhead, &mut rng, ledger, tally, None);
                }
                done.fetch_add(1, Ordering::AcqRel);
                // Keep calling until the close, then once more: that call must be refused.
                while !bulkhead.is_closed() {
                    random_call(bulkhead, &mut rng, ledger, tally, None);
                }
                let shutdowns = tally.rejected[0].load(Ordering::Relaxed);
                random_call(bulkhead, &mut rng, ledger, tally, None);
                assert!(tally.rejected[0].load(Ordering::Relaxed) > shutdowns);
            });
        }
        // The control plane: random snapshots (some stale) and budget changes, then a close
        // while callers are still running.
        let (bulkhead, done) = (&bulkhead, &done);
        s.spawn(move || {
            // Closes the bulkhead however this thread ends, so that a failed assertion here
            // fails the test instead of leaving the callers waiting for the close forever.
            struct CloseOnExit<'a>(&'a LlmBulkhead);
            impl Drop for CloseOnExit<'_> {
                fn drop(&mut self) {
                    self.0.close();
                }
            }
            let _close = CloseOnExit(bulkhead);
            let mut rng = fastrand::Rng::with_seed(99);
            let mut revision = 0;
            let mut applied = 0;
            // At least a few changes, however fast the callers finish their share.
            while done.load(Ordering::Acquire) < THREADS / 2 || applied < 20 {
                revision += 1;
                let stale = rng.u8(0..5) == 0;
                let next = Limits::new(if stale { 0 } else { revision }, rng.u32(0..8))
                    .with_max_queue(rng.u32(0..3))
                    .with_token_budget(rng.u64(0..3_000), rng.u64(0..1_000));
                let outcome = bulkhead.apply_limits(next).unwrap();
                assert_eq!(outcome.is_applied(), !stale);
                applied += u64::from(outcome.is_applied());
                if rng.bool() {
                    let now = bulkhead.set_budget(rng.u64(0..3_000)).unwrap();
                    revision = now.revision;
                }
                std::thread::yield_now();
            }
            assert!(applied > 0);
            assert!(bulkhead.close());
        });
    });
    assert!(bulkhead.is_closed());
    assert_settled(&bulkhead, &tally);
    assert!(
        tally.rejected[0].load(Ordering::Relaxed) > 0,
        "calls after the close were refused"
    );
}

#[test]
fn tokio_tasks_hold_permits_across_awaits_and_return_everything() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_time()
        .build()
        .unwrap();
    let bulkhead = LlmBulkhead::builder("m", 16)
        .token_budget(TokenBudget::new(20_000))
        .build()
        .unwrap();
    let tally = Arc::new(Tally::default());
    let peak = Arc::new(AtomicU64::new(0));
    let live = Arc::new(AtomicU64::new(0));
    let tasks = 2_000 * scale();
    runtime.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        for i in 0..tasks {
            let (bulkhead, tally, peak, live) =
                (bulkhead.clone(), tally.clone(), peak.clone(), live.clone());
            set.spawn(async move {
                let mut rng = fastrand::Rng::with_seed(i);
                let reservation = Reservation::new(rng.u64(10..500), rng.u64(10..2_000)).unwrap();
                // Owned permits live across awaits and may resume on another worker.
                match bulkhead.try_acquire_owned(
                    &LlmRequest::new(),
                    AcquireOptions::new().reservation(reservation),
                ) {
                    Ok(permit) => {
                        tally.admitted.fetch_add(1, Ordering::Relaxed);
                        tally
                            .reserved
                            .fetch_add(reservation.reserved(), Ordering::Relaxed);
                        let now = live.fetch_add(1, Ordering::AcqRel) + 1;
                        peak.fetch_max(now, Ordering::AcqRel);
                        assert!(now <= 16);
                        tokio::task::yield_now().await;
                        tokio::time::sleep(std::time::Duration::from_micros(rng.u64(0..300))).await;
                        live.fetch_sub(1, Ordering::AcqRel);
                        let usage = TokenUsage::new(
                            reservation.input(),
                            rng.u64(0..=reservation.max_output()),
                        )
                        .unwrap();
                        let report = permit.release(Some(usage));
                        tally.consumed.fetch_add(usage.total(), Ordering::Relaxed);
                        tally
                            .refunded
                            .fetch_add(report.refunded_tokens, Ordering::Relaxed);
                    }
                    Err(err) => tally.rejected(err.rejection().unwrap().reason()),
                }
            });
        }
        while let Some(joined) = set.join_next().await {
            joined.unwrap();
        }
    });
    assert_settled(&bulkhead, &tally);
    let t = bulkhead.stats().token_budget.unwrap();
    // Every usage was at most its reservation, so every reserved token was consumed or refunded.
    assert_eq!(t.total_reserved, t.total_consumed + t.total_refunded);
    assert!(peak.load(Ordering::Relaxed) > 1, "tasks really overlapped");
}

#[test]
fn statistics_survive_their_threads() {
    // Shards of exited threads are adopted by new ones; no count is lost and the number of
    // shards does not grow with the number of threads that ever ran.
    let bulkhead = LlmBulkhead::builder("m", 4)
        .token_budget(TokenBudget::new(1_000))
        .build()
        .unwrap();
    for round in 0..50u64 {
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let bulkhead = &bulkhead;
                s.spawn(move || {
                    let opts =
                        AcquireOptions::new().reservation(Reservation::new(round, t).unwrap());
                    let permit = bulkhead.try_acquire(&LlmRequest::new(), opts).unwrap();
                    permit.release(Some(TokenUsage::new(round, 0).unwrap()));
                });
            }
        });
    }
    let stats = bulkhead.stats();
    assert_eq!(
        (stats.admitted, stats.released, stats.in_flight),
        (200, 200, 0)
    );
    let t = stats.token_budget.unwrap();
    let reserved: u64 = (0..50u64).map(|r| 4 * r + 6).sum();
    assert_eq!(t.total_reserved, reserved);
    assert_eq!(t.total_consumed, (0..50u64).map(|r| 4 * r).sum::<u64>());
    assert_eq!(t.total_refunded, 50 * 6);
}
