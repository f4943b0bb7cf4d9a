//! set_budget

use async_bulkhead_llm::{
    AcquireOptions, Limits, LlmBulkhead, LlmRequest, Priority, RejectReason, TokenBudget,
    events::EventKind, limits::LimitsError, limits::MAX_BUDGET, limits::MAX_REVISION,
};

use crate::support::{MODEL, Twin, budgeted, plain, with_res};

#[test]
fn invalid_budgets_change_nothing() {
    type Case = (
        &'static str,
        fn() -> LlmBulkhead,
        u64,
        LimitsError,
        &'static str,
    );
    let cases: Vec<Case> = vec![
        (
            "no budget configured, tokens 0",
            || plain(2),
            0,
            LimitsError::TokenBudgetNotConfigured,
            "limits.token_budget must be omitted because no token budget was configured at construction",
        ),
        (
            "no budget configured wins over tokens u64::MAX",
            || plain(2),
            u64::MAX,
            LimitsError::TokenBudgetNotConfigured,
            "limits.token_budget must be omitted because no token budget was configured at construction",
        ),
        (
            "tokens MAX_BUDGET + 1",
            || budgeted(2, 1000, 100),
            MAX_BUDGET + 1,
            LimitsError::BudgetTooLarge {
                value: MAX_BUDGET + 1,
                max: MAX_BUDGET,
            },
            "limits.token_budget.budget (34359738368) must be <= 34359738367",
        ),
        (
            "tokens u64::MAX",
            || budgeted(2, 1000, 100),
            u64::MAX,
            LimitsError::BudgetTooLarge {
                value: u64::MAX,
                max: MAX_BUDGET,
            },
            "limits.token_budget.budget (18446744073709551615) must be <= 34359738367",
        ),
        (
            "revision exhausted",
            || {
                LlmBulkhead::builder(MODEL, 2)
                    .initial_revision(MAX_REVISION)
                    .token_budget(TokenBudget::new(1000))
                    .build()
                    .unwrap()
            },
            10,
            LimitsError::RevisionExhausted {
                current: MAX_REVISION,
            },
            "cannot advance the limit revision beyond 9007199254740991 (the largest revision)",
        ),
        (
            "revision exhausted is reported before the budget size (documented order)",
            || {
                LlmBulkhead::builder(MODEL, 2)
                    .initial_revision(MAX_REVISION)
                    .token_budget(TokenBudget::new(1000))
                    .build()
                    .unwrap()
            },
            u64::MAX,
            LimitsError::RevisionExhausted {
                current: MAX_REVISION,
            },
            "cannot advance the limit revision beyond 9007199254740991 (the largest revision)",
        ),
    ];
    for (name, build, tokens, expected, display) in cases {
        let mut twin = Twin::new(build);
        if twin.subject.limits().token_budget.is_some() {
            twin.hold(with_res(10, 10));
        } else {
            twin.hold(AcquireOptions::new());
        }
        let err = twin.subject.set_budget(tokens).expect_err(name);
        assert_eq!(err, expected, "{name}");
        assert_eq!(err.to_string(), display, "{name}");
        assert!(
            !twin.subject_events().contains(&EventKind::Reconfigure),
            "{name}: no reconfigure event"
        );
        twin.assert_behaves_like_control(name);
    }
}

#[test]
fn valid_edge_budgets_are_installed_at_the_next_revision_keeping_the_reserve() {
    let b = LlmBulkhead::builder(MODEL, 2)
        .initial_revision(MAX_REVISION - 2)
        .token_budget(TokenBudget::new(1000).high_priority_reserve(100))
        .build()
        .unwrap();
    let held = b
        .try_acquire(&LlmRequest::new(), with_res(200, 300))
        .unwrap();

    // Below the tokens in flight: allowed (shrink by attrition).
    let now = b.set_budget(0).unwrap();
    assert_eq!(
        now,
        Limits::new(MAX_REVISION - 1, 2).with_token_budget(0, 100)
    );
    assert_eq!(
        b.try_acquire(&LlmRequest::new(), with_res(0, 0).priority(Priority::High))
            .unwrap_err()
            .rejection()
            .unwrap()
            .reason(),
        RejectReason::BudgetLimit,
        "tokens above the budget refuse even a 0-token call"
    );
    let now = b.set_budget(MAX_BUDGET).unwrap();
    assert_eq!(
        now,
        Limits::new(MAX_REVISION, 2).with_token_budget(MAX_BUDGET, 100)
    );
    assert_eq!(b.limits(), now);
    assert_eq!(
        b.set_budget(MAX_BUDGET),
        Err(LimitsError::RevisionExhausted {
            current: MAX_REVISION
        })
    );
    drop(held);
    let t = b.stats().token_budget.unwrap();
    assert_eq!((t.in_flight_tokens, t.available), (0, MAX_BUDGET));
}
