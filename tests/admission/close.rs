//! `close`: idempotent, and what still works afterwards.

use async_bulkhead_llm::{AcquireOptions, Limits, RejectReason};

use crate::support::{
    budget_figures, budgeted, counts, opts, plain, reason_of, rejected, report_figures, req,
    slot_figures, totals, usage,
};

#[test]
fn close_returns_true_once_and_is_idempotent() {
    let bulkhead = plain(2);
    assert!(!bulkhead.is_closed());
    assert!(!bulkhead.stats().closed);
    assert!(bulkhead.close());
    assert!(!bulkhead.close());
    assert!(!bulkhead.clone().close());
    assert!(bulkhead.is_closed());
    assert!(bulkhead.stats().closed);
    for _ in 0..3 {
        assert_eq!(
            reason_of(bulkhead.try_acquire(&req(), AcquireOptions::new())),
            RejectReason::Shutdown
        );
    }
    let stats = bulkhead.stats();
    assert_eq!(counts(&stats.rejected_by_reason), [3, 0, 0, 0, 0, 0]);
    assert_eq!((stats.rejected, stats.admitted), (3, 0));
}

#[test]
fn close_races_have_exactly_one_winner() {
    for _ in 0..50 {
        let bulkhead = plain(1);
        let winners = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4).map(|_| s.spawn(|| bulkhead.close())).collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .filter(|&won| won)
                .count()
        });
        assert_eq!(winners, 1);
        assert!(bulkhead.is_closed());
    }
}

#[test]
fn permits_in_flight_release_normally_after_close() {
    let bulkhead = budgeted(3, 5000, 0);
    let a = bulkhead.try_acquire(&req(), opts(100, 1000)).unwrap();
    let b = bulkhead.try_acquire_owned(&req(), opts(10, 10)).unwrap();
    let c = bulkhead.try_acquire(&req(), opts(1, 1)).unwrap();
    assert!(bulkhead.close());
    assert_eq!(bulkhead.stats().in_flight, 3);

    let report = a.release(Some(usage(20, 5)));
    assert_eq!(report_figures(&report), (1100, 1075, Some(usage(20, 5))));
    let report = std::thread::spawn(move || b.release(None)).join().unwrap();
    assert_eq!(report_figures(&report), (20, 0, None));
    drop(c);

    let stats = bulkhead.stats();
    assert!(stats.closed);
    assert_eq!((stats.admitted, stats.released, stats.in_flight), (3, 3, 0));
    let t = stats.token_budget.unwrap();
    assert_eq!(totals(&t), (1122, 25, 1075, 0));
    assert_eq!(t.in_flight_tokens, 0);
    // Freed capacity does not reopen a closed bulkhead.
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts(0, 0))),
        RejectReason::Shutdown
    );
}

#[test]
fn limits_and_set_budget_keep_working_after_close() {
    let bulkhead = budgeted(1, 100, 0);
    bulkhead.close();
    let outcome = bulkhead
        .apply_limits(Limits::new(1, 10).with_token_budget(1000, 0))
        .unwrap();
    assert!(outcome.is_applied());
    let now = bulkhead.set_budget(2000).unwrap();
    assert_eq!(now, Limits::new(2, 10).with_token_budget(2000, 0));
    assert_eq!(bulkhead.limits(), now);
    let stats = bulkhead.stats();
    assert!(stats.closed);
    assert_eq!(stats.limits, now);
    assert_eq!(stats.token_budget.unwrap().budget, 2000);
    let rejection = rejected(bulkhead.try_acquire(&req(), opts(1, 1)));
    assert_eq!(rejection.reason(), RejectReason::Shutdown);
    assert_eq!(rejection.limit_revision(), 2);
    assert_eq!(slot_figures(rejection.detail()), (2, 0, 10, 0, 0));
    assert_eq!(budget_figures(rejection.detail()), (2000, 0, 2000, 2000, 2));
    // Applying limits never reopens it.
    assert!(bulkhead.is_closed());
}
