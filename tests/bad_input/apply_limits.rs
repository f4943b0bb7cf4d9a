//! apply_limits

use async_bulkhead_llm::{
    Limits, LlmBulkhead, LlmRequest, Priority, RejectReason, TokenBudget, admission::Verdict,
    events::EventKind, limits::ApplyOutcome, limits::LimitsError, limits::MAX_BUDGET,
    limits::MAX_CONCURRENT, limits::MAX_REVISION, rejection::TokenBudgetDetail,
};
use futures::executor::block_on;

use crate::support::{MODEL, Twin, budgeted, with_res};

/// Current limits of the plain twin: revision 5, 2 slots, no budget.
fn plain_twin() -> Twin {
    Twin::new(|| {
        LlmBulkhead::builder(MODEL, 2)
            .initial_revision(5)
            .max_queue(1)
            .build()
            .unwrap()
    })
}

/// Current limits of the budgeted twin: revision 5, 2 slots, budget 1000, reserve 100.
fn budget_twin() -> Twin {
    Twin::new(|| {
        LlmBulkhead::builder(MODEL, 2)
            .initial_revision(5)
            .token_budget(TokenBudget::new(1000).high_priority_reserve(100))
            .build()
            .unwrap()
    })
}

struct Case {
    name: &'static str,
    next: Limits,
    expected: Result<(), LimitsError>,
    display: Option<&'static str>,
}

fn err(name: &'static str, next: Limits, e: LimitsError, display: &'static str) -> Case {
    Case {
        name,
        next,
        expected: Err(e),
        display: Some(display),
    }
}

/// `Ok(())` here means `Ok(ApplyOutcome::Stale)` with the current limits.
fn stale(name: &'static str, next: Limits) -> Case {
    Case {
        name,
        next,
        expected: Ok(()),
        display: None,
    }
}

fn run_cases(make: fn() -> Twin, cases: Vec<Case>) {
    for case in cases {
        let mut twin = make();
        // A permit in flight on both, so "nothing changed" includes the admission word.
        twin.hold(with_res(1, 2));
        let before = twin.subject.limits();
        let outcome = twin.subject.apply_limits(case.next);
        match (&outcome, &case.expected) {
            (Err(e), Err(expected)) => {
                assert_eq!(e, expected, "{}", case.name);
                assert_eq!(Some(e.to_string().as_str()), case.display, "{}", case.name);
            }
            (Ok(ApplyOutcome::Stale { current }), Ok(())) => {
                assert_eq!(
                    *current, before,
                    "{}: stale reports the limits in force",
                    case.name
                );
            }
            _ => panic!(
                "{}: got {outcome:?}, expected {:?}",
                case.name, case.expected
            ),
        }
        assert_eq!(twin.subject.limits(), before, "{}", case.name);
        assert!(
            !twin.subject_events().contains(&EventKind::Reconfigure),
            "{}: no reconfigure event",
            case.name
        );
        twin.assert_behaves_like_control(case.name);
    }
}

#[test]
fn invalid_and_stale_snapshots_change_nothing_on_a_bulkhead_without_budget() {
    run_cases(
        plain_twin,
        vec![
            err(
                "revision MAX_REVISION + 1",
                Limits::new(MAX_REVISION + 1, 1),
                LimitsError::RevisionTooLarge {
                    value: MAX_REVISION + 1,
                    max: MAX_REVISION,
                },
                "limits.revision (9007199254740992) must be <= 9007199254740991",
            ),
            err(
                "revision u64::MAX wins over every other invalid field",
                Limits::new(u64::MAX, u32::MAX).with_token_budget(u64::MAX, u64::MAX),
                LimitsError::RevisionTooLarge {
                    value: u64::MAX,
                    max: MAX_REVISION,
                },
                "limits.revision (18446744073709551615) must be <= 9007199254740991",
            ),
            err(
                "max_concurrent MAX_CONCURRENT + 1",
                Limits::new(6, MAX_CONCURRENT + 1),
                LimitsError::MaxConcurrentTooLarge {
                    value: MAX_CONCURRENT + 1,
                    max: MAX_CONCURRENT,
                },
                "limits.max_concurrent (65536) must be <= 65535",
            ),
            err(
                "max_concurrent u32::MAX wins over the budget shape",
                Limits::new(6, u32::MAX).with_token_budget(1, 0),
                LimitsError::MaxConcurrentTooLarge {
                    value: u32::MAX,
                    max: MAX_CONCURRENT,
                },
                "limits.max_concurrent (4294967295) must be <= 65535",
            ),
            err(
                "a token budget on a bulkhead built without one",
                Limits::new(6, 1).with_token_budget(0, 0),
                LimitsError::TokenBudgetNotConfigured,
                "limits.token_budget must be omitted because no token budget was configured at construction",
            ),
            err(
                "a huge token budget on a bulkhead built without one is a shape error",
                Limits::new(MAX_REVISION, MAX_CONCURRENT).with_token_budget(u64::MAX, u64::MAX),
                LimitsError::TokenBudgetNotConfigured,
                "limits.token_budget must be omitted because no token budget was configured at construction",
            ),
            stale("equal revision", Limits::new(5, 9)),
            stale("revision 0", Limits::new(0, 9)),
            stale("lower revision 4", Limits::new(4, 9)),
            stale(
                "stale with every other field invalid is not examined",
                Limits::new(4, u32::MAX).with_token_budget(u64::MAX, u64::MAX),
            ),
            stale(
                "equal revision with max_concurrent 0 (would be a kill switch)",
                Limits::new(5, 0),
            ),
        ],
    );
}

#[test]
fn invalid_and_stale_snapshots_change_nothing_on_a_bulkhead_with_budget() {
    run_cases(
        budget_twin,
        vec![
            err(
                "no token budget on a bulkhead built with one",
                Limits::new(6, 1),
                LimitsError::TokenBudgetRequired,
                "limits.token_budget is required because a token budget was configured at construction",
            ),
            err(
                "budget MAX_BUDGET + 1",
                Limits::new(6, 1).with_token_budget(MAX_BUDGET + 1, 0),
                LimitsError::BudgetTooLarge {
                    value: MAX_BUDGET + 1,
                    max: MAX_BUDGET,
                },
                "limits.token_budget.budget (34359738368) must be <= 34359738367",
            ),
            err(
                "budget u64::MAX and reserve u64::MAX",
                Limits::new(6, 1).with_token_budget(u64::MAX, u64::MAX),
                LimitsError::BudgetTooLarge {
                    value: u64::MAX,
                    max: MAX_BUDGET,
                },
                "limits.token_budget.budget (18446744073709551615) must be <= 34359738367",
            ),
            err(
                "max_concurrent wins over the budget size",
                Limits::new(6, MAX_CONCURRENT + 1).with_token_budget(u64::MAX, 0),
                LimitsError::MaxConcurrentTooLarge {
                    value: MAX_CONCURRENT + 1,
                    max: MAX_CONCURRENT,
                },
                "limits.max_concurrent (65536) must be <= 65535",
            ),
            err(
                "revision wins over a missing budget",
                Limits::new(MAX_REVISION + 1, 1),
                LimitsError::RevisionTooLarge {
                    value: MAX_REVISION + 1,
                    max: MAX_REVISION,
                },
                "limits.revision (9007199254740992) must be <= 9007199254740991",
            ),
            stale(
                "equal revision without budget is not examined",
                Limits::new(5, 1),
            ),
            stale(
                "lower revision with a huge budget is not examined",
                Limits::new(1, u32::MAX).with_token_budget(u64::MAX, 0),
            ),
            stale(
                "equal revision with a valid new budget",
                Limits::new(5, 3).with_token_budget(5, 0),
            ),
        ],
    );
}

#[test]
fn at_max_revision_every_snapshot_is_stale_or_too_large() {
    let make = || {
        Twin::new(|| {
            LlmBulkhead::builder(MODEL, 2)
                .initial_revision(MAX_REVISION)
                .token_budget(TokenBudget::new(1000))
                .build()
                .unwrap()
        })
    };
    run_cases(
        make,
        vec![
            stale(
                "MAX_REVISION again",
                Limits::new(MAX_REVISION, 9).with_token_budget(9, 0),
            ),
            err(
                "MAX_REVISION + 1 is too large, not newer",
                Limits::new(MAX_REVISION + 1, 9).with_token_budget(9, 0),
                LimitsError::RevisionTooLarge {
                    value: MAX_REVISION + 1,
                    max: MAX_REVISION,
                },
                "limits.revision (9007199254740992) must be <= 9007199254740991",
            ),
        ],
    );
}

#[test]
fn valid_edge_snapshots_are_applied_and_behave_as_documented() {
    let b = budgeted(2, 1000, 100);
    let held = b
        .try_acquire(&LlmRequest::new(), with_res(300, 300))
        .unwrap();

    // Jump straight to the largest revision, with every field at its largest value.
    let next = Limits::new(MAX_REVISION, MAX_CONCURRENT)
        .with_max_queue(u32::MAX)
        .with_token_budget(MAX_BUDGET, MAX_BUDGET);
    let outcome = b.apply_limits(next.clone()).unwrap();
    assert_eq!(
        outcome,
        ApplyOutcome::Applied {
            previous: Limits::new(0, 2).with_token_budget(1000, 100),
            current: next.clone()
        }
    );
    assert_eq!(b.limits(), next);
    assert_eq!(held.limit_revision(), 0, "a permit keeps its revision");
    // Normal priority may use nothing (reserve == budget): with 600 tokens in flight even
    // a 0-token call is over its effective budget. High priority may use the rest.
    for normal in [with_res(0, 1), with_res(0, 0)] {
        assert_eq!(
            b.would_admit(&LlmRequest::new(), normal).unwrap(),
            Verdict::Reject(RejectReason::BudgetLimit)
        );
    }
    assert_eq!(
        b.would_admit(
            &LlmRequest::new(),
            with_res(MAX_BUDGET - 600, 0).priority(Priority::High)
        )
        .unwrap(),
        Verdict::Admit
    );
    assert_eq!(
        b.would_admit(
            &LlmRequest::new(),
            with_res(MAX_BUDGET - 599, 0).priority(Priority::High)
        )
        .unwrap(),
        Verdict::Reject(RejectReason::BudgetLimit)
    );
    // Nothing newer exists now.
    assert!(!b.apply_limits(next.clone()).unwrap().is_applied());
    assert_eq!(
        b.set_budget(1),
        Err(LimitsError::RevisionExhausted {
            current: MAX_REVISION
        })
    );
    drop(held);
    assert_eq!(b.stats().token_budget.unwrap().in_flight_tokens, 0);

    // A reserve above the budget is allowed at runtime: normal priority gets nothing.
    let b = budgeted(2, 1000, 0);
    b.apply_limits(Limits::new(1, 2).with_token_budget(1000, u64::MAX))
        .unwrap();
    let zero = b.try_acquire(&LlmRequest::new(), with_res(0, 0)).unwrap();
    let err = b
        .try_acquire(&LlmRequest::new(), with_res(0, 1))
        .unwrap_err();
    let detail = err.rejection().unwrap().detail().token_budget.unwrap();
    assert_eq!(
        detail,
        TokenBudgetDetail::compute(1000, u64::MAX, false, 0, 1)
    );
    assert_eq!((detail.effective_budget, detail.available), (0, 0));
    let high = b
        .try_acquire(
            &LlmRequest::new(),
            with_res(0, 1000).priority(Priority::High),
        )
        .unwrap();
    drop((zero, high));

    // Budget 0 and max_concurrent 0: a fail-closed kill switch.
    b.apply_limits(Limits::new(2, 0).with_max_queue(5).with_token_budget(0, 0))
        .unwrap();
    let err = b
        .try_acquire(&LlmRequest::new(), with_res(0, 0))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "bulkhead rejected: concurrency_limit (max_concurrent is 0)"
    );
    let err = block_on(b.acquire(&LlmRequest::new(), with_res(0, 0))).unwrap_err();
    assert_eq!(
        err.rejection().unwrap().reason(),
        RejectReason::ConcurrencyLimit,
        "zero concurrency never queues"
    );
    assert_eq!(b.stats().pending, 0);
}
