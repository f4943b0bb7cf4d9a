//! `try_acquire`: the refusal reasons and the order in which they are checked.

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, Priority, RejectReason, Reservation, admission::Verdict,
    limits::MAX_BUDGET,
};

use crate::support::{
    budget_figures, budgeted, counts, high, opts, plain, reason_of, rejected, req, res,
    slot_figures, tokens,
};

#[test]
fn closed_bulkhead_says_shutdown_even_when_over_budget_and_out_of_slots() {
    let bulkhead = budgeted(1, 100, 0);
    let _held = bulkhead.try_acquire(&req(), opts(50, 0)).unwrap();
    assert!(bulkhead.close());

    // Over budget (50 + 200 > 100) and no free slot: shutdown wins.
    let rejection = rejected(bulkhead.try_acquire(&req(), opts(100, 100)));
    assert_eq!(rejection.reason(), RejectReason::Shutdown);
    assert_eq!(slot_figures(rejection.detail()), (0, 1, 1, 0, 0));
    assert_eq!(budget_figures(rejection.detail()), (100, 50, 100, 50, 200));
    assert_eq!(
        rejection.to_string(),
        "bulkhead rejected: shutdown (the bulkhead is closed)"
    );
    // The same for the owned flavour and for high priority.
    assert_eq!(
        reason_of(bulkhead.try_acquire_owned(&req(), high(1000, 1000))),
        RejectReason::Shutdown
    );

    // A closed bulkhead with zero slots and a zero budget also says shutdown.
    let zero = budgeted(0, 0, 0);
    zero.close();
    assert_eq!(
        reason_of(zero.try_acquire(&req(), opts(5, 5))),
        RejectReason::Shutdown
    );
    // And one without a budget.
    let unbudgeted = plain(0);
    unbudgeted.close();
    assert_eq!(
        reason_of(unbudgeted.try_acquire(&req(), AcquireOptions::new())),
        RejectReason::Shutdown
    );

    let stats = bulkhead.stats();
    assert_eq!(counts(&stats.rejected_by_reason), [2, 0, 0, 0, 0, 0]);
    assert_eq!(stats.rejected, 2);
}

#[test]
fn budget_is_checked_before_concurrency() {
    let bulkhead = budgeted(1, 1000, 0);
    let _held = bulkhead.try_acquire(&req(), opts(600, 0)).unwrap();

    // 600 + 500 > 1000 and no slot: the budget reason is reported.
    let rejection = rejected(bulkhead.try_acquire(&req(), opts(500, 0)));
    assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
    assert_eq!(
        budget_figures(rejection.detail()),
        (1000, 600, 1000, 400, 500)
    );

    // 600 + 400 fits exactly, but there is no slot.
    let rejection = rejected(bulkhead.try_acquire(&req(), opts(400, 0)));
    assert_eq!(rejection.reason(), RejectReason::ConcurrencyLimit);
    assert_eq!(slot_figures(rejection.detail()), (0, 1, 1, 0, 0));
    assert_eq!(
        budget_figures(rejection.detail()),
        (1000, 600, 1000, 400, 400)
    );

    // max_concurrent 0 with an over-budget request: budget still comes first.
    let zero_slots = budgeted(0, 10, 0);
    assert_eq!(
        reason_of(zero_slots.try_acquire(&req(), opts(11, 0))),
        RejectReason::BudgetLimit
    );
    assert_eq!(
        reason_of(zero_slots.try_acquire(&req(), opts(10, 0))),
        RejectReason::ConcurrencyLimit
    );

    let counts_now = bulkhead.stats().rejected_by_reason;
    assert_eq!(counts(&counts_now), [0, 1, 1, 0, 0, 0]);
}

#[test]
fn exact_fit_admits_and_one_more_token_is_refused() {
    let bulkhead = budgeted(4, 1000, 0);
    let a = bulkhead.try_acquire(&req(), opts(400, 600)).unwrap();
    assert_eq!(a.held_tokens(), 1000);
    let t = tokens(&bulkhead);
    assert_eq!((t.in_flight_tokens, t.available), (1000, 0));

    // T + 0 = B is not above B: a 0-token request still fits.
    let b = bulkhead.try_acquire(&req(), opts(0, 0)).unwrap();
    assert_eq!(b.held_tokens(), 0);

    let rejection = rejected(bulkhead.try_acquire(&req(), opts(0, 1)));
    assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
    assert_eq!(budget_figures(rejection.detail()), (1000, 1000, 1000, 0, 1));
    assert_eq!(rejection.detail().in_flight, 2);

    drop(a);
    let c = bulkhead.try_acquire(&req(), opts(1000, 0)).unwrap();
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 1000);
    drop((b, c));
}

#[test]
fn budget_zero_admits_zero_token_requests_only() {
    let bulkhead = budgeted(4, 0, 0);
    let permit = bulkhead.try_acquire(&req(), opts(0, 0)).unwrap();
    assert_eq!(permit.reservation(), Some(Reservation::new(0, 0).unwrap()));
    assert_eq!(permit.held_tokens(), 0);

    // An estimate of 0 is admitted too (empty request, max_tokens 0).
    let estimated = bulkhead
        .try_acquire(&req().max_tokens(0), AcquireOptions::new())
        .unwrap();
    assert_eq!(estimated.reservation(), Some(res(0, 0)));

    for o in [opts(0, 1), opts(1, 0), high(1, 0)] {
        let rejection = rejected(bulkhead.try_acquire(&req(), o));
        assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
        assert_eq!(budget_figures(rejection.detail()), (0, 0, 0, 0, 1));
    }
    // The default estimate of an empty request is 0 + 2048.
    let rejection = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
    assert_eq!(budget_figures(rejection.detail()), (0, 0, 0, 0, 2048));

    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.in_flight, stats.rejected), (2, 2, 4));
    assert_eq!(stats.rejected_by_reason.budget_limit, 4);
}

#[test]
fn tokens_above_the_budget_after_a_shrink_refuse_even_zero_token_requests() {
    let bulkhead = budgeted(4, 1000, 0);
    let held = bulkhead.try_acquire(&req(), opts(800, 0)).unwrap();
    let now = bulkhead.set_budget(500).unwrap();
    assert_eq!(now.token_budget.unwrap().budget, 500);

    for o in [opts(0, 0), high(0, 0)] {
        let rejection = rejected(bulkhead.try_acquire(&req(), o));
        assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
        assert_eq!(budget_figures(rejection.detail()), (500, 800, 500, 0, 0));
        assert_eq!(rejection.limit_revision(), 1);
    }
    let t = tokens(&bulkhead);
    assert_eq!((t.budget, t.in_flight_tokens, t.available), (500, 800, 0));

    drop(held);
    let a = bulkhead.try_acquire(&req(), opts(0, 0)).unwrap();
    let b = bulkhead.try_acquire(&req(), opts(500, 0)).unwrap();
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 500);
    drop((a, b));
}

#[test]
fn high_priority_reserve_follows_the_upstream_example() {
    let bulkhead = budgeted(4, 2400, 400);
    let first = bulkhead.try_acquire(&req(), opts(100, 1000)).unwrap();
    assert_eq!(first.priority(), Priority::Normal);

    let rejection = rejected(bulkhead.try_acquire(&req(), opts(100, 1000)));
    assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
    let detail = rejection.detail();
    assert_eq!(slot_figures(detail), (0, 1, 4, 0, 0));
    assert_eq!(budget_figures(detail), (2400, 1100, 2000, 900, 1100));
    assert_eq!(
        rejection.to_string(),
        "bulkhead rejected: budget_limit (requested 1100 tokens, 900 of effective budget 2000 available, 1100 in flight)"
    );

    let second = bulkhead.try_acquire(&req(), high(100, 1000)).unwrap();
    assert_eq!(second.priority(), Priority::High);
    let t = tokens(&bulkhead);
    assert_eq!((t.in_flight_tokens, t.available), (2200, 200));

    // 2200 + 1100 > 2400 even for high priority.
    let rejection = rejected(bulkhead.try_acquire(&req(), high(100, 1000)));
    assert_eq!(
        budget_figures(rejection.detail()),
        (2400, 2200, 2400, 200, 1100)
    );

    // Priority through `From<Priority>` works the same way.
    let options: AcquireOptions = Priority::High.into();
    assert_eq!(options.priority, Priority::High);
    let third = bulkhead
        .try_acquire(&req().max_tokens(200), options)
        .unwrap();
    assert_eq!(third.held_tokens(), 200);
    drop((first, second, third));
}

#[test]
fn reserve_above_a_shrunken_budget_leaves_normal_nothing_and_high_everything() {
    let bulkhead = budgeted(4, 1000, 400);
    let now = bulkhead.set_budget(300).unwrap();
    let budget = now.token_budget.unwrap();
    assert_eq!((budget.budget, budget.high_priority_reserve), (300, 400));

    let rejection = rejected(bulkhead.try_acquire(&req(), opts(0, 1)));
    assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
    assert_eq!(budget_figures(rejection.detail()), (300, 0, 0, 0, 1));

    let zero = bulkhead.try_acquire(&req(), opts(0, 0)).unwrap();
    let all = bulkhead.try_acquire(&req(), high(100, 200)).unwrap();
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 300);
    let rejection = rejected(bulkhead.try_acquire(&req(), high(0, 1)));
    assert_eq!(budget_figures(rejection.detail()), (300, 300, 300, 0, 1));
    drop((zero, all));
}

#[test]
fn token_sum_overflow_is_a_budget_refusal_not_a_panic() {
    const M: u64 = MAX_BUDGET;
    let bulkhead = budgeted(8, M, 0);
    let small = bulkhead.try_acquire(&req(), opts(0, 2)).unwrap();

    for (o, requested) in [
        (opts(0, u64::MAX), u64::MAX),
        (high(u64::MAX, 0), u64::MAX),
        (opts(M, 0), M),
    ] {
        let rejection = rejected(bulkhead.try_acquire(&req(), o));
        assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
        assert_eq!(
            budget_figures(rejection.detail()),
            (M, 2, M, M - 2, requested)
        );
    }
    let rejection = rejected(bulkhead.try_acquire(&req(), opts(0, u64::MAX)));
    assert_eq!(
        rejection.to_string(),
        "bulkhead rejected: budget_limit (requested 18446744073709551615 tokens, \
         34359738365 of effective budget 34359738367 available, 2 in flight)"
    );
    assert_eq!(
        bulkhead.would_admit(&req(), opts(0, u64::MAX)).unwrap(),
        Verdict::Reject(RejectReason::BudgetLimit)
    );

    // Filling the budget exactly to the largest one works; then only 0-token requests fit.
    let rest = bulkhead.try_acquire(&req(), opts(M - 3, 1)).unwrap();
    let t = tokens(&bulkhead);
    assert_eq!(
        (t.in_flight_tokens, t.available, t.total_reserved),
        (M, 0, M)
    );
    let zero = bulkhead.try_acquire(&req(), opts(0, 0)).unwrap();
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), high(0, 1))),
        RejectReason::BudgetLimit
    );
    drop((small, rest, zero));
    let t = tokens(&bulkhead);
    assert_eq!((t.in_flight_tokens, t.available), (0, M));
    assert_eq!(bulkhead.stats().rejected_by_reason.budget_limit, 5);
}

#[test]
fn full_slots_refuse_with_concurrency_limit_until_a_release() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .initial_revision(6)
        .build()
        .unwrap();
    let a = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    let b = bulkhead
        .try_acquire_owned(&req(), AcquireOptions::new())
        .unwrap();
    let rejection = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
    assert_eq!(rejection.reason(), RejectReason::ConcurrencyLimit);
    assert_eq!(rejection.limit_revision(), 6);
    assert_eq!(slot_figures(rejection.detail()), (6, 2, 2, 0, 0));
    assert!(rejection.detail().token_budget.is_none());
    assert_eq!(
        rejection.to_string(),
        "bulkhead rejected: concurrency_limit (2 of 2 slots in flight)"
    );
    drop(a);
    let c = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    drop((b, c));
    assert_eq!(bulkhead.stats().in_flight, 0);
}

#[test]
fn try_acquire_never_waits_even_with_a_queue_configured() {
    let bulkhead = LlmBulkhead::builder("m", 1).max_queue(3).build().unwrap();
    let _held = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    let rejection = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
    assert_eq!(rejection.reason(), RejectReason::ConcurrencyLimit);
    assert_eq!(slot_figures(rejection.detail()), (0, 1, 1, 0, 3));
    assert_eq!(bulkhead.stats().pending, 0);
}

#[test]
fn clones_share_one_bulkhead() {
    let a = plain(1);
    let b = a.clone();
    let _held = a.try_acquire(&req(), AcquireOptions::new()).unwrap();
    assert_eq!(
        reason_of(b.try_acquire(&req(), AcquireOptions::new())),
        RejectReason::ConcurrencyLimit
    );
    assert_eq!(b.stats().in_flight, 1);
    assert_eq!(a.stats().rejected, 1);
    b.close();
    assert!(a.is_closed());
}
