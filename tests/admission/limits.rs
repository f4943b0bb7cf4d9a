//! Versioned limits: `apply_limits` and `set_budget`.

use async_bulkhead_llm::{
    AcquireOptions, Limits, LlmBulkhead, Priority, RejectReason, TokenBudget, admission::Verdict,
    limits::ApplyOutcome, limits::LimitsError, limits::MAX_BUDGET, limits::MAX_CONCURRENT,
    limits::MAX_REVISION,
};

use crate::support::{
    budget_figures, budgeted, counts, high, opts, plain, reason_of, rejected, req, slot_figures,
    tokens,
};

#[test]
fn revision_above_the_maximum_is_an_error_checked_first() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .initial_revision(MAX_REVISION)
        .token_budget(TokenBudget::new(100))
        .build()
        .unwrap();
    let before = (bulkhead.limits(), bulkhead.stats());

    let err = bulkhead
        .apply_limits(Limits::new(MAX_REVISION + 1, 2).with_token_budget(100, 0))
        .unwrap_err();
    assert_eq!(
        err,
        LimitsError::RevisionTooLarge {
            value: MAX_REVISION + 1,
            max: MAX_REVISION
        }
    );
    assert_eq!(
        err.to_string(),
        "limits.revision (9007199254740992) must be <= 9007199254740991"
    );
    // Checked before the rest of the snapshot (too many slots, wrong budget shape).
    let err = bulkhead
        .apply_limits(Limits::new(u64::MAX, u32::MAX))
        .unwrap_err();
    assert_eq!(
        err,
        LimitsError::RevisionTooLarge {
            value: u64::MAX,
            max: MAX_REVISION
        }
    );
    assert_eq!(
        err.to_string(),
        "limits.revision (18446744073709551615) must be <= 9007199254740991"
    );
    // Also on a bulkhead whose revision is far below (not stale, not applied).
    let low = plain(1);
    assert!(matches!(
        low.apply_limits(Limits::new(MAX_REVISION + 1, 1)),
        Err(LimitsError::RevisionTooLarge { .. })
    ));
    assert_eq!(low.limits(), Limits::new(0, 1));

    assert_eq!((bulkhead.limits(), bulkhead.stats()), before);
    // MAX_REVISION itself is stale here.
    assert_eq!(
        bulkhead.apply_limits(Limits::new(MAX_REVISION, 2).with_token_budget(1, 0)),
        Ok(ApplyOutcome::Stale { current: before.0 })
    );
}

#[test]
fn stale_snapshots_are_not_validated() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .initial_revision(10)
        .max_queue(1)
        .token_budget(TokenBudget::new(500).high_priority_reserve(50))
        .build()
        .unwrap();
    let current = bulkhead.limits();
    assert_eq!(
        current,
        Limits::new(10, 2)
            .with_max_queue(1)
            .with_token_budget(500, 50)
    );

    // Too many slots and no token budget: both invalid, but the revision is stale.
    for stale in [
        Limits::new(10, u32::MAX),
        Limits::new(9, MAX_CONCURRENT + 1).with_token_budget(1, 2),
        Limits::new(0, 5),
        Limits::new(10, 3).with_token_budget(9000, 0),
    ] {
        let outcome = bulkhead.apply_limits(stale).unwrap();
        assert_eq!(
            outcome,
            ApplyOutcome::Stale {
                current: current.clone()
            }
        );
        assert!(!outcome.is_applied());
        assert_eq!(outcome.current(), &current);
    }
    // A budget on a budget-less bulkhead, stale: still Stale, not TokenBudgetNotConfigured.
    let unbudgeted = LlmBulkhead::builder("m", 2)
        .initial_revision(3)
        .build()
        .unwrap();
    assert_eq!(
        unbudgeted.apply_limits(Limits::new(3, 9).with_token_budget(10, 0)),
        Ok(ApplyOutcome::Stale {
            current: Limits::new(3, 2)
        })
    );
    assert_eq!(bulkhead.limits(), current);
    assert_eq!(bulkhead.stats().limits, current);
}

#[test]
fn a_newer_snapshot_is_validated_whole_before_anything_changes() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .token_budget(TokenBudget::new(1000).high_priority_reserve(100))
        .build()
        .unwrap();
    let held = bulkhead.try_acquire(&req(), opts(10, 10)).unwrap();
    let _ = rejected(bulkhead.try_acquire(&req(), opts(1000, 0)));
    let before = (bulkhead.limits(), bulkhead.stats());

    let err = bulkhead
        .apply_limits(Limits::new(1, MAX_CONCURRENT + 1).with_token_budget(5000, 0))
        .unwrap_err();
    assert_eq!(
        err,
        LimitsError::MaxConcurrentTooLarge {
            value: MAX_CONCURRENT + 1,
            max: MAX_CONCURRENT
        }
    );
    assert_eq!(
        err.to_string(),
        "limits.max_concurrent (65536) must be <= 65535"
    );

    // Too many slots and a missing budget: max_concurrent is reported first.
    assert!(matches!(
        bulkhead.apply_limits(Limits::new(2, u32::MAX)),
        Err(LimitsError::MaxConcurrentTooLarge {
            value: u32::MAX,
            ..
        })
    ));

    let err = bulkhead.apply_limits(Limits::new(1, 8)).unwrap_err();
    assert_eq!(err, LimitsError::TokenBudgetRequired);
    assert_eq!(
        err.to_string(),
        "limits.token_budget is required because a token budget was configured at construction"
    );
    assert_eq!((bulkhead.limits(), bulkhead.stats()), before);

    let unbudgeted = plain(2);
    let before_plain = (unbudgeted.limits(), unbudgeted.stats());
    let err = unbudgeted
        .apply_limits(Limits::new(1, 8).with_token_budget(100, 0))
        .unwrap_err();
    assert_eq!(err, LimitsError::TokenBudgetNotConfigured);
    assert_eq!(
        err.to_string(),
        "limits.token_budget must be omitted because no token budget was configured at construction"
    );
    assert_eq!((unbudgeted.limits(), unbudgeted.stats()), before_plain);

    // The failed attempts did not consume revision 1.
    let outcome = bulkhead
        .apply_limits(Limits::new(1, 3).with_token_budget(900, 100))
        .unwrap();
    assert!(outcome.is_applied());
    assert_eq!(bulkhead.limits().revision, 1);
    // The rejected snapshot's values never took effect: 2 slots were never 8.
    drop(held);
}

#[test]
fn applied_snapshot_reports_previous_and_current() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .initial_revision(3)
        .token_budget(TokenBudget::new(1000).high_priority_reserve(100))
        .build()
        .unwrap();
    let next = Limits::new(4, 8)
        .with_max_queue(2)
        .with_token_budget(5000, 500);
    let outcome = bulkhead.apply_limits(next.clone()).unwrap();
    assert_eq!(
        outcome,
        ApplyOutcome::Applied {
            previous: Limits::new(3, 2).with_token_budget(1000, 100),
            current: next.clone(),
        }
    );
    assert!(outcome.is_applied());
    assert_eq!(outcome.current(), &next);
    assert_eq!(bulkhead.limits(), next);
    assert_eq!(bulkhead.stats().limits, next);
    let t = tokens(&bulkhead);
    assert_eq!((t.budget, t.high_priority_reserve), (5000, 500));

    // Revisions may jump, and identical values at a newer revision still apply.
    let same = Limits::new(100, 8)
        .with_max_queue(2)
        .with_token_budget(5000, 500);
    assert_eq!(
        bulkhead.apply_limits(same.clone()),
        Ok(ApplyOutcome::Applied {
            previous: next.clone(),
            current: same.clone()
        })
    );
    // Reaching MAX_REVISION is allowed.
    let top = Limits::new(MAX_REVISION, MAX_CONCURRENT).with_token_budget(0, 0);
    assert!(bulkhead.apply_limits(top.clone()).unwrap().is_applied());
    assert_eq!(bulkhead.limits(), top);
}

#[test]
fn lowering_concurrency_shrinks_by_attrition() {
    let bulkhead = plain(3);
    let a = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    let b = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    let c = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    bulkhead.apply_limits(Limits::new(1, 1)).unwrap();
    assert_eq!(bulkhead.stats().in_flight, 3);

    let rejection = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
    assert_eq!(
        rejection.to_string(),
        "bulkhead rejected: concurrency_limit (3 of 1 slots in flight)"
    );
    assert_eq!(slot_figures(rejection.detail()), (1, 3, 1, 0, 0));
    drop(a);
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), AcquireOptions::new())),
        RejectReason::ConcurrencyLimit
    );
    drop(b);
    let rejection = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
    assert_eq!(
        rejection.to_string(),
        "bulkhead rejected: concurrency_limit (1 of 1 slots in flight)"
    );
    drop(c);
    let d = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    assert_eq!(d.limit_revision(), 1);
    assert_eq!(bulkhead.stats().rejected, 3);
}

#[test]
fn lowering_the_budget_shrinks_by_attrition() {
    let bulkhead = budgeted(4, 1000, 0);
    let a = bulkhead.try_acquire(&req(), opts(300, 0)).unwrap();
    let b = bulkhead.try_acquire(&req(), opts(300, 0)).unwrap();
    bulkhead
        .apply_limits(Limits::new(1, 4).with_token_budget(400, 0))
        .unwrap();
    let t = tokens(&bulkhead);
    assert_eq!((t.budget, t.in_flight_tokens, t.available), (400, 600, 0));
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts(0, 0))),
        RejectReason::BudgetLimit
    );
    drop(a);
    // 300 + 101 > 400.
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts(101, 0))),
        RejectReason::BudgetLimit
    );
    let c = bulkhead.try_acquire(&req(), opts(100, 0)).unwrap();
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 400);
    drop((b, c));
}

#[test]
fn raising_limits_takes_effect_for_the_next_admission() {
    let bulkhead = plain(1);
    let _a = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    assert!(bulkhead.try_acquire(&req(), AcquireOptions::new()).is_err());
    bulkhead.apply_limits(Limits::new(1, 2)).unwrap();
    let b = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    assert_eq!(b.limit_revision(), 1);

    let budget = budgeted(4, 100, 0);
    let _full = budget.try_acquire(&req(), opts(100, 0)).unwrap();
    assert!(budget.try_acquire(&req(), opts(1, 0)).is_err());
    budget.set_budget(101).unwrap();
    let one = budget.try_acquire(&req(), opts(1, 0)).unwrap();
    assert_eq!(one.limit_revision(), 1);
    budget
        .apply_limits(Limits::new(2, 4).with_token_budget(200, 0))
        .unwrap();
    let more = budget.try_acquire(&req(), opts(99, 0)).unwrap();
    assert_eq!(more.limit_revision(), 2);
    let t = tokens(&budget);
    // 100 + 1 + 99: a 1-token reservation is booked like any other.
    assert_eq!((t.in_flight_tokens, t.total_reserved), (200, 200));
}

#[test]
fn zero_concurrency_at_runtime_is_a_kill_switch_until_raised() {
    let bulkhead = LlmBulkhead::builder("m", 2).max_queue(4).build().unwrap();
    let held = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    bulkhead
        .apply_limits(Limits::new(1, 0).with_max_queue(4))
        .unwrap();
    let rejection = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
    assert_eq!(
        rejection.to_string(),
        "bulkhead rejected: concurrency_limit (max_concurrent is 0)"
    );
    assert_eq!(
        bulkhead.would_admit(&req(), AcquireOptions::new()).unwrap(),
        Verdict::Reject(RejectReason::ConcurrencyLimit)
    );
    drop(held);
    assert!(bulkhead.try_acquire(&req(), AcquireOptions::new()).is_err());
    bulkhead
        .apply_limits(Limits::new(2, 1).with_max_queue(4))
        .unwrap();
    assert!(bulkhead.try_acquire(&req(), AcquireOptions::new()).is_ok());
}

#[test]
fn reserve_above_budget_is_accepted_at_runtime() {
    let bulkhead = budgeted(4, 1000, 0);
    let next = Limits::new(1, 4).with_token_budget(100, 500);
    assert!(bulkhead.apply_limits(next.clone()).unwrap().is_applied());
    assert_eq!(bulkhead.limits(), next);
    assert_eq!(
        bulkhead.limits().effective_budget(Priority::Normal),
        Some(0)
    );
    assert_eq!(
        bulkhead.limits().effective_budget(Priority::High),
        Some(100)
    );

    let rejection = rejected(bulkhead.try_acquire(&req(), opts(1, 0)));
    assert_eq!(budget_figures(rejection.detail()), (100, 0, 0, 0, 1));
    let zero = bulkhead.try_acquire(&req(), opts(0, 0)).unwrap();
    let top = bulkhead.try_acquire(&req(), high(50, 50)).unwrap();
    let t = tokens(&bulkhead);
    assert_eq!(
        (
            t.budget,
            t.high_priority_reserve,
            t.in_flight_tokens,
            t.available
        ),
        (100, 500, 100, 0)
    );
    drop((zero, top));
}

#[test]
fn set_budget_keeps_the_rest_and_advances_the_revision() {
    let bulkhead = LlmBulkhead::builder("m", 3)
        .initial_revision(7)
        .max_queue(2)
        .token_budget(TokenBudget::new(1000).high_priority_reserve(200))
        .build()
        .unwrap();
    let now = bulkhead.set_budget(5000).unwrap();
    let expected = Limits::new(8, 3)
        .with_max_queue(2)
        .with_token_budget(5000, 200);
    assert_eq!(now, expected);
    assert_eq!(bulkhead.limits(), expected);

    // Below the reserve and down to 0 are fine; the reserve is kept.
    assert_eq!(
        bulkhead.set_budget(100).unwrap(),
        Limits::new(9, 3)
            .with_max_queue(2)
            .with_token_budget(100, 200)
    );
    assert_eq!(
        bulkhead.set_budget(0).unwrap(),
        Limits::new(10, 3)
            .with_max_queue(2)
            .with_token_budget(0, 200)
    );
    assert_eq!(
        bulkhead.set_budget(MAX_BUDGET).unwrap(),
        Limits::new(11, 3)
            .with_max_queue(2)
            .with_token_budget(MAX_BUDGET, 200)
    );
    // A stale apply after set_budget sees the new revision.
    assert_eq!(
        bulkhead.apply_limits(Limits::new(11, 1).with_token_budget(1, 0)),
        Ok(ApplyOutcome::Stale {
            current: bulkhead.limits()
        })
    );
}

#[test]
fn set_budget_without_a_budget_is_refused_and_changes_nothing() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .initial_revision(4)
        .build()
        .unwrap();
    let before = (bulkhead.limits(), bulkhead.stats());
    let err = bulkhead.set_budget(100).unwrap_err();
    assert_eq!(err, LimitsError::TokenBudgetNotConfigured);
    assert_eq!(
        err.to_string(),
        "limits.token_budget must be omitted because no token budget was configured at construction"
    );
    assert_eq!((bulkhead.limits(), bulkhead.stats()), before);
}

#[test]
fn set_budget_at_the_maximum_revision_is_refused_and_changes_nothing() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .initial_revision(MAX_REVISION - 1)
        .token_budget(TokenBudget::new(1000).high_priority_reserve(10))
        .build()
        .unwrap();
    let now = bulkhead.set_budget(2000).unwrap();
    assert_eq!(now.revision, MAX_REVISION);
    let before = bulkhead.limits();
    let err = bulkhead.set_budget(3000).unwrap_err();
    assert_eq!(
        err,
        LimitsError::RevisionExhausted {
            current: MAX_REVISION
        }
    );
    assert_eq!(
        err.to_string(),
        "cannot advance the limit revision beyond 9007199254740991 (the largest revision)"
    );
    assert_eq!(bulkhead.limits(), before);
    assert_eq!(
        bulkhead.limits(),
        Limits::new(MAX_REVISION, 2).with_token_budget(2000, 10)
    );
    // The refused budget did not take effect: 2001 tokens do not fit.
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), high(2001, 0))),
        RejectReason::BudgetLimit
    );
}

#[test]
fn upstream_apply_limits_example_adapted_to_fail_fast() {
    // Design §U8.2, its example: one request in flight (400 tokens of 1000) and one waiting
    // for a slot; applying {rev 8, max_concurrent 2, max_queue 3, budget 500, reserve 100}
    // frees a slot, but the waiting request no longer fits the budget: budget_limit at
    // revision 8, in flight stays 1 and the tokens stay 400.
    let bulkhead = LlmBulkhead::builder("claude", 1)
        .initial_revision(7)
        .max_queue(1)
        .token_budget(TokenBudget::new(1000))
        .build()
        .unwrap();
    let first = bulkhead.try_acquire(&req(), opts(100, 300)).unwrap();
    // The second request would wait (it fits the budget but has no slot).
    assert_eq!(
        bulkhead.would_admit(&req(), opts(100, 300)).unwrap(),
        Verdict::Queue
    );
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts(100, 300))),
        RejectReason::ConcurrencyLimit
    );

    let next = Limits::new(8, 2)
        .with_max_queue(3)
        .with_token_budget(500, 100);
    assert_eq!(
        bulkhead.apply_limits(next.clone()),
        Ok(ApplyOutcome::Applied {
            previous: Limits::new(7, 1)
                .with_max_queue(1)
                .with_token_budget(1000, 0),
            current: next.clone(),
        })
    );
    let rejection = rejected(bulkhead.try_acquire(&req(), opts(100, 300)));
    assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
    assert_eq!(rejection.limit_revision(), 8);
    assert_eq!(slot_figures(rejection.detail()), (8, 1, 2, 0, 3));
    assert_eq!(budget_figures(rejection.detail()), (500, 400, 400, 0, 400));

    let stats = bulkhead.stats();
    assert_eq!(stats.in_flight, 1);
    assert_eq!(stats.token_budget.unwrap().in_flight_tokens, 400);
    assert_eq!(counts(&stats.rejected_by_reason), [0, 1, 1, 0, 0, 0]);
    assert_eq!(first.limit_revision(), 7);
    // A high-priority request of up to 100 tokens still fits.
    let small = bulkhead.try_acquire(&req(), high(0, 100)).unwrap();
    assert_eq!(small.limit_revision(), 8);
    drop((first, small));
}
