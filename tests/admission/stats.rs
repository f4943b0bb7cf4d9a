//! Statistics snapshots.

use std::sync::atomic::{AtomicU64, Ordering};

use async_bulkhead_llm::{
    AcquireOptions, Limits, LlmBulkhead, RejectReason, Stats, TokenBudget, stats::RejectionCounts,
};

use crate::support::{
    budgeted, counts, high, opts, reason_of, rejected, req, tokens, totals, usage,
};

#[test]
fn stats_after_a_scripted_sequence() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .initial_revision(5)
        .token_budget(TokenBudget::new(10_000).high_priority_reserve(1000))
        .build()
        .unwrap();

    let fresh = bulkhead.stats();
    assert_eq!(
        fresh.limits,
        Limits::new(5, 2).with_token_budget(10_000, 1000)
    );
    assert!(!fresh.closed);
    assert_eq!(
        (
            fresh.in_flight,
            fresh.pending,
            fresh.admitted,
            fresh.released,
            fresh.rejected
        ),
        (0, 0, 0, 0, 0)
    );
    assert_eq!(fresh.rejected_by_reason, RejectionCounts::default());
    let t = fresh.token_budget.unwrap();
    assert_eq!(
        (
            t.budget,
            t.high_priority_reserve,
            t.in_flight_tokens,
            t.available
        ),
        (10_000, 1000, 0, 10_000)
    );
    assert_eq!(totals(&t), (0, 0, 0, 0));

    let a = bulkhead.try_acquire(&req(), opts(100, 1000)).unwrap(); // T = 1100
    let b = bulkhead.try_acquire(&req(), high(200, 2000)).unwrap(); // T = 3300
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts(0, 0))),
        RejectReason::ConcurrencyLimit
    );
    // 3300 + 7000 > 9000 (normal ceiling).
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts(5000, 2000))),
        RejectReason::BudgetLimit
    );
    let mid = bulkhead.stats();
    assert_eq!(
        (mid.in_flight, mid.admitted, mid.released, mid.rejected),
        (2, 2, 0, 2)
    );
    let t = mid.token_budget.unwrap();
    assert_eq!((t.in_flight_tokens, t.available), (3300, 6700));

    a.release(Some(usage(50, 250))); // consumed 300, refunded 800, T = 2200
    drop(b); // nothing booked, T = 0
    let c = bulkhead.try_acquire(&req(), opts(10, 90)).unwrap(); // T = 100
    assert!(bulkhead.close());
    for _ in 0..2 {
        assert_eq!(
            reason_of(bulkhead.try_acquire(&req(), opts(0, 0))),
            RejectReason::Shutdown
        );
    }

    let stats: Stats = bulkhead.stats();
    assert_eq!(
        stats.limits,
        Limits::new(5, 2).with_token_budget(10_000, 1000)
    );
    assert_eq!(stats.limits, bulkhead.limits());
    assert!(stats.closed);
    assert_eq!(stats.in_flight, 1);
    assert_eq!(stats.pending, 0);
    assert_eq!(stats.admitted, 3);
    assert_eq!(stats.released, 2);
    assert_eq!(stats.rejected, 4);
    assert_eq!(counts(&stats.rejected_by_reason), [2, 1, 1, 0, 0, 0]);
    assert_eq!(stats.rejected_by_reason.total(), 4);
    for (reason, expected) in RejectReason::ALL.iter().copied().zip([2, 1, 1, 0, 0, 0]) {
        assert_eq!(stats.rejected_by_reason.get(reason), expected, "{reason}");
    }
    let t = stats.token_budget.unwrap();
    assert_eq!(
        (
            t.budget,
            t.high_priority_reserve,
            t.in_flight_tokens,
            t.available
        ),
        (10_000, 1000, 100, 9900)
    );
    assert_eq!(totals(&t), (3400, 300, 800, 0));

    c.release(Some(usage(10, 90)));
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.admitted, stats.released), (0, 3, 3));
    let t = stats.token_budget.unwrap();
    assert_eq!((t.in_flight_tokens, t.available), (0, 10_000));
    assert_eq!(totals(&t), (3400, 400, 800, 0));
}

#[test]
fn stats_without_a_budget_have_no_token_block() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .initial_revision(2)
        .max_queue(7)
        .build()
        .unwrap();
    let p = bulkhead.try_acquire(&req(), opts(100, 100)).unwrap();
    let _ = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
    let stats = bulkhead.stats();
    assert!(stats.token_budget.is_none());
    assert_eq!(stats.limits, Limits::new(2, 1).with_max_queue(7));
    assert_eq!(
        (
            stats.in_flight,
            stats.pending,
            stats.admitted,
            stats.released,
            stats.rejected
        ),
        (1, 0, 1, 0, 1)
    );
    assert_eq!(counts(&stats.rejected_by_reason), [0, 1, 0, 0, 0, 0]);
    p.release(Some(usage(1, 1)));
    let stats = bulkhead.stats();
    assert!(stats.token_budget.is_none());
    assert_eq!((stats.in_flight, stats.released), (0, 1));
}

#[test]
fn stats_available_saturates_when_tokens_exceed_the_budget() {
    let bulkhead = budgeted(2, 1000, 300);
    let _held = bulkhead.try_acquire(&req(), high(900, 0)).unwrap();
    // Not priority-adjusted: budget - in flight, not (budget - reserve) - in flight.
    assert_eq!(tokens(&bulkhead).available, 100);
    bulkhead.set_budget(600).unwrap();
    let t = tokens(&bulkhead);
    assert_eq!((t.budget, t.in_flight_tokens, t.available), (600, 900, 0));
}

#[test]
fn stats_sum_every_thread_exactly_after_join() {
    let bulkhead = budgeted(64, 1_000_000, 0);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..500 {
                    let p = bulkhead.try_acquire(&req(), opts(10, 10)).unwrap();
                    p.release(Some(usage(5, 5)));
                }
                for _ in 0..100 {
                    let _ = rejected(bulkhead.try_acquire(&req(), opts(2_000_000, 0)));
                }
            });
        }
    });
    // Threads have exited; their counts must survive.
    let stats = bulkhead.stats();
    assert_eq!(
        (stats.admitted, stats.released, stats.in_flight),
        (2000, 2000, 0)
    );
    assert_eq!(stats.rejected, 400);
    assert_eq!(counts(&stats.rejected_by_reason), [0, 0, 400, 0, 0, 0]);
    let t = stats.token_budget.unwrap();
    assert_eq!(totals(&t), (40_000, 20_000, 20_000, 0));
    assert_eq!(t.in_flight_tokens, 0);
}

#[test]
fn concurrent_admissions_never_exceed_slots_or_tokens() {
    const SLOTS: u64 = 3;
    const BUDGET: u64 = 1000;
    let bulkhead = budgeted(SLOTS as usize, BUDGET, 0);
    let slots_seen = AtomicU64::new(0);
    let tokens_seen = AtomicU64::new(0);
    let peak_slots = AtomicU64::new(0);
    let peak_tokens = AtomicU64::new(0);
    let admitted = AtomicU64::new(0);
    let refused = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..6u64 {
            let (bulkhead, slots_seen, tokens_seen) = (&bulkhead, &slots_seen, &tokens_seen);
            let (peak_slots, peak_tokens) = (&peak_slots, &peak_tokens);
            let (admitted, refused) = (&admitted, &refused);
            s.spawn(move || {
                for i in 0..3000u64 {
                    let size = 100 + (t * 37 + i * 13) % 400;
                    match bulkhead.try_acquire(&req(), opts(size, 0)) {
                        Ok(permit) => {
                            // Counted after admission and uncounted before release, so these
                            // figures never exceed what the bulkhead really holds.
                            let s_now = slots_seen.fetch_add(1, Ordering::SeqCst) + 1;
                            let t_now = tokens_seen.fetch_add(size, Ordering::SeqCst) + size;
                            peak_slots.fetch_max(s_now, Ordering::SeqCst);
                            peak_tokens.fetch_max(t_now, Ordering::SeqCst);
                            slots_seen.fetch_sub(1, Ordering::SeqCst);
                            tokens_seen.fetch_sub(size, Ordering::SeqCst);
                            permit.release(Some(usage(size, 0)));
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(err) => {
                            assert!(err.rejection().is_some(), "{err}");
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            });
        }
    });
    assert!(peak_slots.load(Ordering::SeqCst) <= SLOTS);
    assert!(peak_tokens.load(Ordering::SeqCst) <= BUDGET);
    let stats = bulkhead.stats();
    assert_eq!(stats.admitted, admitted.load(Ordering::Relaxed));
    assert_eq!(stats.rejected, refused.load(Ordering::Relaxed));
    assert_eq!(stats.admitted + stats.rejected, 18_000);
    assert_eq!((stats.in_flight, stats.released), (0, stats.admitted));
    let t = stats.token_budget.unwrap();
    assert_eq!(t.in_flight_tokens, 0);
    assert_eq!(t.total_reserved, t.total_consumed);
    assert_eq!((t.total_refunded, t.total_overrun), (0, 0));
}
