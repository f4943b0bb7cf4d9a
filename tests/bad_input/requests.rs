//! try_acquire, try_acquire_owned, acquire, acquire_owned, acquire_blocking(_owned),
//! would_admit(_with_detail), estimate, run, run_with_usage: unrepresentable requests

use std::time::Duration;

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, Priority, RejectReason, TokenBudget,
    admission::Verdict, estimate::ModelAwareEstimator, estimate::NaiveEstimator,
    estimate::OpaqueBlockTokens, estimate::TokenEstimate, request::ContentBlock,
    request::RequestError,
};

use crate::support::{ENTRIES, Entry, MODEL, Outcome, Twin, budgeted, call, plain, with_res};

const BUDGET: u64 = 10_000;
const RESERVE: u64 = 100;

fn default_estimator(max_concurrent: usize) -> LlmBulkhead {
    budgeted(max_concurrent, BUDGET, RESERVE)
}

fn tiny_ratio_estimator(max_concurrent: usize) -> LlmBulkhead {
    LlmBulkhead::builder(MODEL, max_concurrent)
        .token_budget(TokenBudget::new(BUDGET).high_priority_reserve(RESERVE))
        .estimator(
            ModelAwareEstimator::builder()
                .default_model(MODEL)
                .ratio("tiny", f64::MIN_POSITIVE)
                .build()
                .unwrap(),
        )
        .build()
        .unwrap()
}

fn opaque_max_estimator(max_concurrent: usize) -> LlmBulkhead {
    LlmBulkhead::builder(MODEL, max_concurrent)
        .token_budget(TokenBudget::new(BUDGET).high_priority_reserve(RESERVE))
        .estimator(
            ModelAwareEstimator::builder()
                .default_model(MODEL)
                .opaque_block_tokens(OpaqueBlockTokens::Each(u64::MAX))
                .build()
                .unwrap(),
        )
        .build()
        .unwrap()
}

fn closure_estimator(max_concurrent: usize) -> LlmBulkhead {
    LlmBulkhead::builder(MODEL, max_concurrent)
        .token_budget(TokenBudget::new(BUDGET).high_priority_reserve(RESERVE))
        .estimator(|_: &LlmRequest| TokenEstimate::new(u64::MAX, 1))
        .build()
        .unwrap()
}

fn naive_huge_cap(max_concurrent: usize) -> LlmBulkhead {
    LlmBulkhead::builder(MODEL, max_concurrent)
        .token_budget(TokenBudget::new(BUDGET).high_priority_reserve(RESERVE))
        .estimator(NaiveEstimator::new().output_cap(u64::MAX))
        .build()
        .unwrap()
}

fn huge_output_cap_default(max_concurrent: usize) -> LlmBulkhead {
    LlmBulkhead::builder(MODEL, max_concurrent)
        .token_budget(
            TokenBudget::new(BUDGET)
                .high_priority_reserve(RESERVE)
                .output_cap(u64::MAX),
        )
        .build()
        .unwrap()
}

pub(super) struct Case {
    pub(super) name: &'static str,
    pub(super) build: fn(usize) -> LlmBulkhead,
    pub(super) request: LlmRequest,
    pub(super) expected: RequestError,
    pub(super) display: &'static str,
}

pub(super) fn cases() -> Vec<Case> {
    let x = |n: usize| LlmRequest::new().user("x".repeat(n));
    let mut completion = x(4);
    completion.max_completion_tokens = Some(u64::MAX);
    vec![
        Case {
            name: "extra_input_tokens u64::MAX on top of 2 text tokens",
            build: default_estimator,
            request: x(8).extra_input_tokens(u64::MAX),
            expected: RequestError::InputOverflow {
                text_tokens: 2,
                opaque_tokens: 0,
                extra_input_tokens: u64::MAX,
            },
            display: "estimated input (2 text tokens + 0 opaque-block tokens + 18446744073709551615 extra input tokens) does not fit in 64 bits",
        },
        Case {
            name: "extra_input_tokens u64::MAX - 1 on top of 2 text tokens",
            build: default_estimator,
            request: x(5).extra_input_tokens(u64::MAX - 1),
            expected: RequestError::InputOverflow {
                text_tokens: 2,
                opaque_tokens: 0,
                extra_input_tokens: u64::MAX - 1,
            },
            display: "estimated input (2 text tokens + 0 opaque-block tokens + 18446744073709551614 extra input tokens) does not fit in 64 bits",
        },
        Case {
            name: "input u64::MAX plus the default output cap",
            build: default_estimator,
            request: LlmRequest::new().extra_input_tokens(u64::MAX),
            expected: RequestError::ReservationOverflow {
                input: u64::MAX,
                max_output: 2048,
            },
            display: "token reservation (18446744073709551615 input + 2048 max output) does not fit in 64 bits",
        },
        Case {
            name: "input + output overflows by exactly one",
            build: default_estimator,
            request: x(4).extra_input_tokens(u64::MAX - 2048),
            expected: RequestError::ReservationOverflow {
                input: u64::MAX - 2047,
                max_output: 2048,
            },
            display: "token reservation (18446744073709549568 input + 2048 max output) does not fit in 64 bits",
        },
        Case {
            name: "max_tokens u64::MAX with 1 input token",
            build: default_estimator,
            request: x(1).max_tokens(u64::MAX),
            expected: RequestError::ReservationOverflow {
                input: 1,
                max_output: u64::MAX,
            },
            display: "token reservation (1 input + 18446744073709551615 max output) does not fit in 64 bits",
        },
        Case {
            name: "max_tokens u64::MAX - 1 with 2 input tokens",
            build: default_estimator,
            request: x(8).max_tokens(u64::MAX - 1),
            expected: RequestError::ReservationOverflow {
                input: 2,
                max_output: u64::MAX - 1,
            },
            display: "token reservation (2 input + 18446744073709551614 max output) does not fit in 64 bits",
        },
        Case {
            name: "max_completion_tokens u64::MAX with 1 input token",
            build: default_estimator,
            request: completion,
            expected: RequestError::ReservationOverflow {
                input: 1,
                max_output: u64::MAX,
            },
            display: "token reservation (1 input + 18446744073709551615 max output) does not fit in 64 bits",
        },
        Case {
            name: "a default output cap of u64::MAX with 1 input token",
            build: huge_output_cap_default,
            request: x(1),
            expected: RequestError::ReservationOverflow {
                input: 1,
                max_output: u64::MAX,
            },
            display: "token reservation (1 input + 18446744073709551615 max output) does not fit in 64 bits",
        },
        Case {
            name: "a tiny chars-per-token override makes one character unrepresentable",
            build: tiny_ratio_estimator,
            request: x(1).model("tiny"),
            expected: RequestError::TextTooLarge { chars: 1 },
            display: "estimated input for 1 characters does not fit in 64 bits",
        },
        Case {
            name: "two opaque blocks of u64::MAX each",
            build: opaque_max_estimator,
            request: LlmRequest::new().user(vec![
                ContentBlock::opaque("image"),
                ContentBlock::opaque("image"),
            ]),
            expected: RequestError::InputOverflow {
                text_tokens: 0,
                opaque_tokens: u64::MAX,
                extra_input_tokens: 0,
            },
            display: "estimated input (0 text tokens + 18446744073709551615 opaque-block tokens + 0 extra input tokens) does not fit in 64 bits",
        },
        Case {
            name: "an opaque block of u64::MAX in the system prompt plus 1 extra token",
            build: opaque_max_estimator,
            request: LlmRequest::new()
                .system(vec![ContentBlock::opaque("document")])
                .extra_input_tokens(1),
            expected: RequestError::InputOverflow {
                text_tokens: 0,
                opaque_tokens: u64::MAX,
                extra_input_tokens: 1,
            },
            display: "estimated input (0 text tokens + 18446744073709551615 opaque-block tokens + 1 extra input tokens) does not fit in 64 bits",
        },
        Case {
            name: "one opaque block of u64::MAX plus the default output cap",
            build: opaque_max_estimator,
            request: LlmRequest::new().user(vec![ContentBlock::opaque("image")]),
            expected: RequestError::ReservationOverflow {
                input: u64::MAX,
                max_output: 2048,
            },
            display: "token reservation (18446744073709551615 input + 2048 max output) does not fit in 64 bits",
        },
        Case {
            name: "a closure estimator answering u64::MAX + 1",
            build: closure_estimator,
            request: LlmRequest::new(),
            expected: RequestError::ReservationOverflow {
                input: u64::MAX,
                max_output: 1,
            },
            display: "token reservation (18446744073709551615 input + 1 max output) does not fit in 64 bits",
        },
        Case {
            name: "the naive estimator with output cap u64::MAX",
            build: naive_huge_cap,
            request: x(1),
            expected: RequestError::ReservationOverflow {
                input: 1,
                max_output: u64::MAX,
            },
            display: "token reservation (1 input + 18446744073709551615 max output) does not fit in 64 bits",
        },
        Case {
            name: "the naive estimator with extra_input_tokens u64::MAX",
            build: naive_huge_cap,
            request: x(1).extra_input_tokens(u64::MAX),
            expected: RequestError::InputOverflow {
                text_tokens: 1,
                opaque_tokens: 0,
                extra_input_tokens: u64::MAX,
            },
            display: "estimated input (1 text tokens + 0 opaque-block tokens + 18446744073709551615 extra input tokens) does not fit in 64 bits",
        },
    ]
}

/// The states a request is judged in: the error must come before any capacity decision
/// (design §D4, Q9/Q10), so it is the same whether the bulkhead is open, closed, fail-closed
/// or full.
#[derive(Clone, Copy, Debug)]
enum State {
    Open,
    Closed,
    ZeroConcurrency,
    BudgetFull,
    SlotsFullWithQueue,
}

const STATES: [State; 5] = [
    State::Open,
    State::Closed,
    State::ZeroConcurrency,
    State::BudgetFull,
    State::SlotsFullWithQueue,
];

fn twin_in(state: State, build: fn(usize) -> LlmBulkhead) -> Twin {
    let mut twin = match state {
        State::ZeroConcurrency => Twin::new(|| build(0)),
        State::SlotsFullWithQueue => Twin::new(|| {
            let b = build(1);
            b.apply_limits({
                let mut next = b.limits();
                next.revision += 1;
                next.max_queue = 4;
                next
            })
            .unwrap();
            b
        }),
        _ => Twin::new(|| build(4)),
    };
    match state {
        State::Closed => {
            twin.both(LlmBulkhead::close);
        }
        State::BudgetFull => {
            twin.hold(with_res(BUDGET, 0).priority(Priority::High));
        }
        State::SlotsFullWithQueue => twin.hold(with_res(1, 1)),
        State::Open | State::ZeroConcurrency => {}
    }
    twin
}

#[test]
fn unrepresentable_requests_are_refused_by_every_entry_point_in_every_state_changing_nothing() {
    let mut checked = 0;
    for case in cases() {
        assert_eq!(case.expected.to_string(), case.display, "{}", case.name);
        let acquire_display = format!("invalid request: {}", case.display);
        assert_eq!(
            AcquireError::Invalid(case.expected).to_string(),
            acquire_display
        );
        for state in STATES {
            for entry in ENTRIES {
                for priority in [Priority::Normal, Priority::High] {
                    let label = format!("{} / {state:?} / {entry:?} / {priority:?}", case.name);
                    let twin = twin_in(state, case.build);
                    let options = AcquireOptions::new()
                        .priority(priority)
                        .timeout(Duration::from_secs(3600));
                    let outcome = call(entry, &twin.subject, &case.request, options);
                    assert_eq!(outcome, Outcome::Invalid(case.expected), "{label}");
                    twin.assert_behaves_like_control(&label);
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 15 * 5 * 11 * 2);
}

#[test]
fn a_reservation_override_skips_the_estimator_so_an_unrepresentable_request_is_admitted() {
    // Design §U3.1: with an override, the estimator is not called. `estimate`
    // always calls it (it takes no options).
    for case in cases() {
        let b = (case.build)(4);
        for entry in ENTRIES {
            let outcome = call(entry, &b, &case.request, with_res(3, 4));
            let expected = match entry {
                Entry::Estimate => Outcome::Invalid(case.expected),
                Entry::WouldAdmit | Entry::WouldAdmitWithDetail => Outcome::Verdict(Verdict::Admit),
                _ => Outcome::Admitted,
            };
            assert_eq!(outcome, expected, "{} / {entry:?}", case.name);
        }
        let t = b.stats().token_budget.unwrap();
        assert_eq!(t.in_flight_tokens, 0, "{}", case.name);
        assert_eq!(b.stats().rejected, 0, "{}", case.name);
    }
}

#[test]
fn without_a_token_budget_nothing_is_estimated_so_every_request_is_admitted() {
    // "No budget: nothing is estimated and an override is ignored."
    for case in cases() {
        let b = plain(4);
        for entry in ENTRIES {
            for options in [AcquireOptions::new(), with_res(u64::MAX, 0)] {
                let outcome = call(entry, &b, &case.request, options);
                let expected = match entry {
                    Entry::Estimate => Outcome::Estimate(None),
                    Entry::WouldAdmit | Entry::WouldAdmitWithDetail => {
                        Outcome::Verdict(Verdict::Admit)
                    }
                    _ => Outcome::Admitted,
                };
                assert_eq!(outcome, expected, "{} / {entry:?}", case.name);
            }
        }
        let stats = b.stats();
        assert_eq!((stats.in_flight, stats.rejected), (0, 0), "{}", case.name);
        assert!(stats.token_budget.is_none());
    }
}

#[test]
fn an_invalid_request_is_reported_even_to_a_closed_bulkhead_before_shutdown() {
    // Q9/Q10 spelled out on one case: Invalid, not Rejected(Shutdown).
    let b = default_estimator(4);
    b.close();
    let request = LlmRequest::new().user("x").max_tokens(u64::MAX);
    let err = b.try_acquire(&request, AcquireOptions::new()).unwrap_err();
    assert!(err.rejection().is_none());
    assert_eq!(
        err,
        AcquireError::Invalid(RequestError::ReservationOverflow {
            input: 1,
            max_output: u64::MAX
        })
    );
    assert_eq!(b.stats().rejected_by_reason.shutdown, 0);
    // A valid request is refused for shutdown as usual.
    let err = b
        .try_acquire(&LlmRequest::new(), AcquireOptions::new())
        .unwrap_err();
    assert_eq!(err.rejection().unwrap().reason(), RejectReason::Shutdown);
}
