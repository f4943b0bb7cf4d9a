//! Advisory checks: `would_admit` reserves and counts nothing.

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, RejectReason, TokenBudget, admission::Verdict,
};

use crate::support::{
    budget_figures, budgeted, counts, high, opts, plain, req, slot_figures, text,
};

#[test]
fn would_admit_answers_admit_then_queue_then_reject() {
    let queued = LlmBulkhead::builder("m", 1).max_queue(2).build().unwrap();
    assert_eq!(
        queued.would_admit(&req(), AcquireOptions::new()).unwrap(),
        Verdict::Admit
    );
    let _held = queued.try_acquire(&req(), AcquireOptions::new()).unwrap();
    assert_eq!(
        queued.would_admit(&req(), AcquireOptions::new()).unwrap(),
        Verdict::Queue
    );

    let unqueued = plain(1);
    let _held2 = unqueued.try_acquire(&req(), AcquireOptions::new()).unwrap();
    assert_eq!(
        unqueued.would_admit(&req(), AcquireOptions::new()).unwrap(),
        Verdict::Reject(RejectReason::ConcurrencyLimit)
    );
    assert_eq!(queued.stats().admitted, 1);
    assert_eq!(queued.stats().rejected, 0);
    assert_eq!(unqueued.stats().rejected, 0);
}

#[test]
fn would_admit_checks_closed_first() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .max_queue(5)
        .token_budget(TokenBudget::new(100))
        .build()
        .unwrap();
    let _held = bulkhead.try_acquire(&req(), opts(50, 0)).unwrap();
    bulkhead.close();
    for o in [opts(500, 0), opts(0, 0), high(10, 10)] {
        assert_eq!(
            bulkhead.would_admit(&req(), o).unwrap(),
            Verdict::Reject(RejectReason::Shutdown)
        );
    }
    let (verdict, detail) = bulkhead
        .would_admit_with_detail(&req(), opts(500, 0))
        .unwrap();
    assert_eq!(verdict, Verdict::Reject(RejectReason::Shutdown));
    assert_eq!(slot_figures(&detail), (0, 1, 1, 0, 5));
    assert_eq!(budget_figures(&detail), (100, 50, 100, 50, 500));

    let zero = LlmBulkhead::builder("m", 0).max_queue(3).build().unwrap();
    zero.close();
    assert_eq!(
        zero.would_admit(&req(), AcquireOptions::new()).unwrap(),
        Verdict::Reject(RejectReason::Shutdown)
    );
}

#[test]
fn would_admit_checks_the_budget_before_slots_and_queue() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .max_queue(5)
        .token_budget(TokenBudget::new(100).high_priority_reserve(20))
        .build()
        .unwrap();
    let _held = bulkhead.try_acquire(&req(), opts(50, 0)).unwrap();
    // 50 + 60 > 100: refused for budget although it could queue for a slot.
    assert_eq!(
        bulkhead.would_admit(&req(), high(60, 0)).unwrap(),
        Verdict::Reject(RejectReason::BudgetLimit)
    );
    // 50 + 31 > 80 for normal priority, fits 100 for high.
    assert_eq!(
        bulkhead.would_admit(&req(), opts(31, 0)).unwrap(),
        Verdict::Reject(RejectReason::BudgetLimit)
    );
    assert_eq!(
        bulkhead.would_admit(&req(), high(31, 0)).unwrap(),
        Verdict::Queue
    );
    assert_eq!(
        bulkhead.would_admit(&req(), opts(30, 0)).unwrap(),
        Verdict::Queue
    );
}

#[test]
fn would_admit_with_zero_concurrency_refuses_even_with_a_queue() {
    let bulkhead = LlmBulkhead::builder("m", 0)
        .max_queue(10)
        .token_budget(TokenBudget::new(100))
        .build()
        .unwrap();
    assert_eq!(
        bulkhead.would_admit(&req(), opts(1, 1)).unwrap(),
        Verdict::Reject(RejectReason::ConcurrencyLimit)
    );
    // Budget still comes first.
    assert_eq!(
        bulkhead.would_admit(&req(), opts(101, 0)).unwrap(),
        Verdict::Reject(RejectReason::BudgetLimit)
    );
}

#[test]
fn would_admit_with_detail_gives_the_snapshot_for_an_admit_too() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .initial_revision(3)
        .token_budget(TokenBudget::new(1000).high_priority_reserve(100))
        .build()
        .unwrap();
    let _held = bulkhead.try_acquire(&req(), opts(100, 200)).unwrap();

    let (verdict, detail) = bulkhead
        .would_admit_with_detail(&req(), opts(200, 200))
        .unwrap();
    assert_eq!(verdict, Verdict::Admit);
    assert_eq!(slot_figures(&detail), (3, 1, 2, 0, 0));
    assert_eq!(budget_figures(&detail), (1000, 300, 900, 600, 400));

    let (verdict, detail) = bulkhead
        .would_admit_with_detail(&req(), high(200, 200))
        .unwrap();
    assert_eq!(verdict, Verdict::Admit);
    assert_eq!(budget_figures(&detail), (1000, 300, 1000, 700, 400));

    let (verdict, detail) = bulkhead
        .would_admit_with_detail(&req(), opts(601, 0))
        .unwrap();
    assert_eq!(verdict, Verdict::Reject(RejectReason::BudgetLimit));
    assert_eq!(budget_figures(&detail), (1000, 300, 900, 600, 601));

    // The estimate is the requested figure when no override is given.
    let (_, detail) = bulkhead
        .would_admit_with_detail(&text(40), AcquireOptions::new())
        .unwrap();
    assert_eq!(detail.token_budget.unwrap().requested, 10 + 2048);

    let unbudgeted = plain(1);
    let (verdict, detail) = unbudgeted
        .would_admit_with_detail(&req(), opts(5, 5))
        .unwrap();
    assert_eq!(verdict, Verdict::Admit);
    assert_eq!(slot_figures(&detail), (0, 0, 1, 0, 0));
    assert!(detail.token_budget.is_none());
}

#[test]
fn would_admit_counts_and_reserves_nothing() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .max_queue(1)
        .token_budget(TokenBudget::new(100))
        .build()
        .unwrap();
    let held = bulkhead.try_acquire(&req(), opts(10, 10)).unwrap();
    let before = bulkhead.stats();
    for o in [opts(0, 0), opts(1000, 0), high(1, 1)] {
        let _ = bulkhead.would_admit(&req(), o).unwrap();
        let _ = bulkhead.would_admit_with_detail(&req(), o).unwrap();
    }
    let _ = bulkhead.would_admit(&text(8).max_tokens(u64::MAX), AcquireOptions::new());
    assert_eq!(bulkhead.stats(), before);
    drop(held);
    let before = bulkhead.stats();
    assert_eq!(
        bulkhead.would_admit(&req(), opts(100, 0)).unwrap(),
        Verdict::Admit
    );
    // Nothing was reserved: the whole budget is still there.
    assert_eq!(bulkhead.stats(), before);
    assert!(bulkhead.try_acquire(&req(), opts(100, 0)).is_ok());
}

#[test]
fn would_admit_agrees_with_try_acquire() {
    let bulkhead = budgeted(2, 1000, 200);
    let cases = [
        opts(500, 0),
        opts(400, 0),
        high(300, 0),
        opts(0, 0),
        high(1, 0),
    ];
    let mut held = Vec::new();
    for o in cases {
        let verdict = bulkhead.would_admit(&req(), o).unwrap();
        match bulkhead.try_acquire(&req(), o) {
            Ok(permit) => {
                assert_eq!(verdict, Verdict::Admit);
                held.push(permit);
            }
            Err(err) => assert_eq!(verdict, Verdict::Reject(err.rejection().unwrap().reason())),
        }
    }
    // 500 admitted, 400 refused for budget (900 > 800), 300 high admitted (800 <= 1000), then
    // no slot for the rest.
    assert_eq!(held.len(), 2);
    assert_eq!(
        counts(&bulkhead.stats().rejected_by_reason),
        [0, 2, 1, 0, 0, 0]
    );
}

#[test]
fn verdict_helpers() {
    assert!(Verdict::Admit.is_admit());
    assert!(Verdict::Queue.is_admit());
    assert!(!Verdict::Reject(RejectReason::Shutdown).is_admit());
    assert_eq!(Verdict::Admit.reject_reason(), None);
    assert_eq!(Verdict::Queue.reject_reason(), None);
    assert_eq!(
        Verdict::Reject(RejectReason::BudgetLimit).reject_reason(),
        Some(RejectReason::BudgetLimit)
    );
}
