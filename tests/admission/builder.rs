//! Builder validation: every refused value, in the documented order, with its text.

use async_bulkhead_llm::{
    AcquireOptions, Limits, LlmBulkhead, LlmBulkheadBuilder, Permit, Priority, RejectReason,
    TokenBudget, builder::ConfigError, limits::LimitsError, limits::MAX_BUDGET,
    limits::MAX_CONCURRENT, limits::MAX_REVISION, usage::DEFAULT_OUTPUT_CAP,
};

use crate::support::{
    budget_figures, budgeted, high, opts, plain, reason_of, rejected, req, res, slot_figures, text,
    tokens,
};

/// `MAX_CONCURRENT` as the builder takes it.
const MAX: usize = MAX_CONCURRENT as usize;
/// Past what the limits' `u32` holds: refused, never truncated into range.
const HUGE: usize = u32::MAX as usize;

#[test]
fn builder_rejects_empty_model_with_exact_text() {
    let err = LlmBulkhead::builder("", 1).build().unwrap_err();
    assert_eq!(
        err,
        ConfigError::EmptyModel {
            model: String::new()
        }
    );
    assert_eq!(
        err.to_string(),
        r#"model must be a non-empty string (got "")"#
    );
}

#[test]
fn builder_rejects_whitespace_only_model_with_exact_text() {
    let err = LlmBulkhead::builder(" \t\n ", 1).build().unwrap_err();
    assert_eq!(
        err,
        ConfigError::EmptyModel {
            model: " \t\n ".to_owned()
        }
    );
    assert_eq!(
        err.to_string(),
        r#"model must be a non-empty string (got " \t\n ")"#
    );

    // Unicode whitespace is whitespace too (the original trims with JS `trim`).
    let err = LlmBulkhead::builder("\u{3000}\u{00A0}", 1)
        .build()
        .unwrap_err();
    assert!(matches!(err, ConfigError::EmptyModel { .. }), "{err:?}");
}

#[test]
fn builder_accepts_a_model_with_surrounding_whitespace() {
    let bulkhead = LlmBulkhead::builder("  gpt-4o  ", 1).build().unwrap();
    assert!(!bulkhead.model().trim().is_empty());
    assert_eq!(LlmBulkhead::builder("m", 1).build().unwrap().model(), "m");
}

#[test]
fn builder_rejects_max_concurrent_one_above_the_maximum() {
    assert_eq!(MAX_CONCURRENT, (1 << 16) - 1);
    let err = LlmBulkhead::builder("m", MAX + 1).build().unwrap_err();
    assert_eq!(
        err,
        ConfigError::MaxConcurrentTooLarge {
            value: 65_536,
            max: 65_535
        }
    );
    assert_eq!(err.to_string(), "max_concurrent (65536) must be <= 65535");
}

#[test]
fn builder_rejects_max_concurrent_u32_max() {
    let err = LlmBulkhead::builder("m", HUGE).build().unwrap_err();
    assert_eq!(
        err,
        ConfigError::MaxConcurrentTooLarge {
            value: HUGE,
            max: MAX
        }
    );
    assert_eq!(
        err.to_string(),
        "max_concurrent (4294967295) must be <= 65535"
    );
}

#[test]
fn builder_rejects_initial_revision_one_above_the_maximum() {
    assert_eq!(MAX_REVISION, (1 << 53) - 1);
    let err = LlmBulkhead::builder("m", 1)
        .initial_revision(MAX_REVISION + 1)
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        ConfigError::InitialRevisionTooLarge {
            value: 9_007_199_254_740_992,
            max: 9_007_199_254_740_991
        }
    );
    assert_eq!(
        err.to_string(),
        "initial_revision (9007199254740992) must be <= 9007199254740991"
    );
}

#[test]
fn builder_rejects_initial_revision_u64_max() {
    let err = LlmBulkhead::builder("m", 1)
        .initial_revision(u64::MAX)
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        ConfigError::InitialRevisionTooLarge {
            value: u64::MAX,
            max: MAX_REVISION
        }
    );
    assert_eq!(
        err.to_string(),
        "initial_revision (18446744073709551615) must be <= 9007199254740991"
    );
}

#[test]
fn builder_rejects_reserve_above_budget() {
    let err = LlmBulkhead::builder("m", 1)
        .token_budget(TokenBudget::new(100).high_priority_reserve(101))
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        ConfigError::ReserveExceedsBudget {
            reserve: 101,
            budget: 100
        }
    );
    assert_eq!(
        err.to_string(),
        "token_budget.high_priority_reserve (101) must be <= token_budget.budget (100)"
    );

    let err = LlmBulkhead::builder("m", 1)
        .token_budget(TokenBudget::new(0).high_priority_reserve(u64::MAX))
        .build()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "token_budget.high_priority_reserve (18446744073709551615) must be <= token_budget.budget (0)"
    );
}

#[test]
fn builder_validation_order_is_model_concurrency_revision_reserve() {
    let bad_reserve = TokenBudget::new(1).high_priority_reserve(2);
    let all_bad = || {
        LlmBulkhead::builder(" ", HUGE)
            .initial_revision(u64::MAX)
            .token_budget(bad_reserve)
    };
    assert!(matches!(
        all_bad().build().unwrap_err(),
        ConfigError::EmptyModel { .. }
    ));

    let err = LlmBulkhead::builder("m", HUGE)
        .initial_revision(u64::MAX)
        .token_budget(bad_reserve)
        .build()
        .unwrap_err();
    assert!(
        matches!(err, ConfigError::MaxConcurrentTooLarge { .. }),
        "{err:?}"
    );

    let err = LlmBulkhead::builder("m", 1)
        .initial_revision(u64::MAX)
        .token_budget(bad_reserve)
        .build()
        .unwrap_err();
    assert!(
        matches!(err, ConfigError::InitialRevisionTooLarge { .. }),
        "{err:?}"
    );

    let err = LlmBulkhead::builder("m", 1)
        .token_budget(bad_reserve)
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        ConfigError::ReserveExceedsBudget {
            reserve: 2,
            budget: 1
        }
    );
}

#[test]
fn builder_defaults_are_revision_zero_no_queue_no_budget() {
    let bulkhead = plain(4);
    assert_eq!(bulkhead.limits(), Limits::new(0, 4));
    assert_eq!(bulkhead.limits().max_queue, 0);
    assert!(bulkhead.limits().token_budget.is_none());
    assert_eq!(DEFAULT_OUTPUT_CAP, 2048);
    assert_eq!(TokenBudget::new(5).output_cap, 2048);
    assert_eq!(TokenBudget::new(5).high_priority_reserve, 0);
}

#[test]
fn builder_is_cloneable_and_each_clone_builds_an_independent_bulkhead() {
    let builder: LlmBulkheadBuilder = LlmBulkhead::builder("m", 1).max_queue(3);
    let a = builder.clone().build().unwrap();
    let b = builder.build().unwrap();
    let _held = a.try_acquire(&req(), AcquireOptions::new()).unwrap();
    assert!(b.try_acquire(&req(), AcquireOptions::new()).is_ok());
    assert_eq!(a.limits().max_queue, 3);
}

#[test]
fn max_concurrent_zero_builds_fail_closed() {
    let bulkhead = LlmBulkhead::builder("m", 0).max_queue(5).build().unwrap();
    for _ in 0..3 {
        let rejection = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
        assert_eq!(rejection.reason(), RejectReason::ConcurrencyLimit);
        assert_eq!(slot_figures(rejection.detail()), (0, 0, 0, 0, 5));
        assert!(rejection.detail().token_budget.is_none());
        assert_eq!(
            rejection.to_string(),
            "bulkhead rejected: concurrency_limit (max_concurrent is 0)"
        );
    }
    assert_eq!(
        reason_of(
            bulkhead.try_acquire_owned(&req(), AcquireOptions::new().priority(Priority::High))
        ),
        RejectReason::ConcurrencyLimit
    );
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.rejected, stats.in_flight), (0, 4, 0));
    assert_eq!(stats.rejected_by_reason.concurrency_limit, 4);

    // With a budget too: a request that fits the budget still has no slot.
    let budgeted_zero = budgeted(0, 1000, 0);
    assert_eq!(
        reason_of(budgeted_zero.try_acquire(&req(), opts(1, 1))),
        RejectReason::ConcurrencyLimit
    );
}

#[test]
fn max_concurrent_at_the_maximum_is_accepted() {
    let bulkhead = plain(MAX);
    assert_eq!(bulkhead.limits().max_concurrent, MAX_CONCURRENT);
    let held: Vec<Permit<'_>> = (0..100)
        .map(|_| bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap())
        .collect();
    assert_eq!(bulkhead.stats().in_flight, 100);
    drop(held);
    assert_eq!(bulkhead.stats().in_flight, 0);
}

#[test]
fn initial_revision_at_the_maximum_is_accepted() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .initial_revision(MAX_REVISION)
        .build()
        .unwrap();
    assert_eq!(bulkhead.limits().revision, MAX_REVISION);
    let permit = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    assert_eq!(permit.limit_revision(), MAX_REVISION);
    let rejection = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
    assert_eq!(rejection.limit_revision(), MAX_REVISION);
}

#[test]
fn budget_zero_and_the_largest_budget_are_accepted_and_above_is_refused() {
    let zero = budgeted(1, 0, 0);
    assert_eq!(zero.limits(), Limits::new(0, 1).with_token_budget(0, 0));
    let t = tokens(&zero);
    assert_eq!((t.budget, t.available, t.in_flight_tokens), (0, 0, 0));

    assert_eq!(MAX_BUDGET, (1 << 35) - 1);
    let max = budgeted(1, MAX_BUDGET, 0);
    assert_eq!(
        max.limits(),
        Limits::new(0, 1).with_token_budget(MAX_BUDGET, 0)
    );
    let t = tokens(&max);
    assert_eq!(
        (t.budget, t.available, t.in_flight_tokens),
        (MAX_BUDGET, MAX_BUDGET, 0)
    );
    // The whole budget can be held at once.
    let permit = max.try_acquire(&req(), opts(MAX_BUDGET - 1, 1)).unwrap();
    assert_eq!(tokens(&max).in_flight_tokens, MAX_BUDGET);
    drop(permit);

    // Above it: a typed error, at build, apply_limits and set_budget, and nothing changes.
    let err = LlmBulkhead::builder("m", 1)
        .token_budget(TokenBudget::new(MAX_BUDGET + 1))
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        ConfigError::BudgetTooLarge {
            value: MAX_BUDGET + 1,
            max: MAX_BUDGET
        }
    );
    assert_eq!(
        err.to_string(),
        "token_budget.budget (34359738368) must be <= 34359738367"
    );
    let too_large = LimitsError::BudgetTooLarge {
        value: u64::MAX,
        max: MAX_BUDGET,
    };
    assert_eq!(max.set_budget(u64::MAX).unwrap_err(), too_large);
    assert_eq!(
        max.apply_limits(Limits::new(1, 1).with_token_budget(u64::MAX, 0))
            .unwrap_err(),
        too_large
    );
    assert_eq!(
        too_large.to_string(),
        "limits.token_budget.budget (18446744073709551615) must be <= 34359738367"
    );
    assert_eq!(
        max.limits(),
        Limits::new(0, 1).with_token_budget(MAX_BUDGET, 0)
    );
}

#[test]
fn reserve_equal_to_budget_is_accepted_and_leaves_normal_priority_nothing() {
    let bulkhead = budgeted(4, 500, 500);
    assert_eq!(
        bulkhead.limits().effective_budget(Priority::Normal),
        Some(0)
    );
    let rejection = rejected(bulkhead.try_acquire(&req(), opts(1, 0)));
    assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
    assert_eq!(budget_figures(rejection.detail()), (500, 0, 0, 0, 1));
    let permit = bulkhead.try_acquire(&req(), high(200, 300)).unwrap();
    assert_eq!(permit.held_tokens(), 500);
}

#[test]
fn output_cap_zero_is_accepted_and_reserves_no_output() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .token_budget(TokenBudget::new(10).output_cap(0))
        .build()
        .unwrap();
    assert_eq!(bulkhead.estimate(&text(8)).unwrap(), Some(res(2, 0)));
    // max_tokens still wins over the cap.
    assert_eq!(
        bulkhead.estimate(&text(8).max_tokens(5)).unwrap(),
        Some(res(2, 5))
    );
    let permit = bulkhead
        .try_acquire(&text(40), AcquireOptions::new())
        .unwrap();
    assert_eq!(permit.reservation(), Some(res(10, 0)));
    assert_eq!(permit.held_tokens(), 10);
}
