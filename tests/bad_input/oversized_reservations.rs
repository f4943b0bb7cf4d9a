//! Reservations the budget can never hold: capacity refusals, not input errors

use async_bulkhead_llm::{
    LlmRequest, Priority, RejectReason, admission::Verdict, events::EventKind, limits::MAX_BUDGET,
    rejection::TokenBudgetDetail,
};

use crate::support::{
    ENTRIES, Entry, Outcome, Twin, budgeted, call, plus_one_rejection, probe, with_res,
};

const BUDGET: u64 = 1000;
const RESERVE: u64 = 100;
const HELD: u64 = 10;

#[test]
fn reservations_above_any_budget_are_refused_budget_limit_and_count_only_the_refusal() {
    let requested_values = [
        u64::MAX,
        u64::MAX - 1,
        u64::MAX - HELD + 1, // held + requested overflows by exactly one
        MAX_BUDGET + 1,
        MAX_BUDGET,
        BUDGET + 1,
    ];
    for requested in requested_values {
        for split in [
            (requested, 0),
            (0, requested),
            (requested / 2, requested - requested / 2),
        ] {
            for priority in [Priority::Normal, Priority::High] {
                for entry in ENTRIES.into_iter().filter(|e| *e != Entry::Estimate) {
                    let label = format!("{split:?} / {priority:?} / {entry:?}");
                    let mut twin = Twin::new(|| budgeted(4, BUDGET, RESERVE));
                    twin.hold(with_res(HELD, 0));
                    let before = twin.subject.stats();
                    let options = with_res(split.0, split.1).priority(priority);
                    let outcome = call(entry, &twin.subject, &LlmRequest::new(), options);
                    let high = priority == Priority::High;
                    let expected_detail =
                        TokenBudgetDetail::compute(BUDGET, RESERVE, high, HELD, requested);
                    match outcome {
                        Outcome::Rejected(rejection) => {
                            assert!(entry.admits(), "{label}");
                            assert_eq!(rejection.reason(), RejectReason::BudgetLimit, "{label}");
                            assert_eq!(
                                rejection.detail().token_budget,
                                Some(expected_detail),
                                "{label}"
                            );
                            assert_eq!(rejection.detail().in_flight, 1, "{label}");
                            assert_eq!(
                                rejection.to_string(),
                                format!(
                                    "bulkhead rejected: budget_limit (requested {requested} tokens, {} of effective budget {} available, {HELD} in flight)",
                                    expected_detail.available, expected_detail.effective_budget
                                ),
                                "{label}"
                            );
                            // Only the refusal was counted (and announced).
                            assert_eq!(
                                twin.subject.stats(),
                                plus_one_rejection(before, RejectReason::BudgetLimit),
                                "{label}"
                            );
                            let mut events = twin.logs[1].lock().unwrap().clone();
                            events.push(EventKind::Reject);
                            assert_eq!(twin.subject_events(), events, "{label}");
                        }
                        Outcome::Verdict(verdict) => {
                            assert!(!entry.admits(), "{label}");
                            assert_eq!(
                                verdict,
                                Verdict::Reject(RejectReason::BudgetLimit),
                                "{label}"
                            );
                            twin.assert_unchanged(&label);
                        }
                        other => panic!("{label}: {other:?}"),
                    }
                    let t = twin.subject.stats().token_budget.unwrap();
                    assert_eq!(t.in_flight_tokens, HELD, "{label}");
                    assert_eq!(t.total_reserved, HELD, "{label}");
                    assert_eq!(probe(&twin.subject), probe(&twin.control), "{label}");
                }
            }
        }
    }
}

#[test]
fn a_closed_bulkhead_refuses_an_oversized_reservation_for_shutdown_first() {
    let b = budgeted(4, BUDGET, RESERVE);
    b.close();
    let err = b
        .try_acquire(
            &LlmRequest::new(),
            with_res(u64::MAX, 0).priority(Priority::High),
        )
        .unwrap_err();
    let rejection = err.rejection().unwrap();
    assert_eq!(rejection.reason(), RejectReason::Shutdown);
    assert_eq!(
        rejection.to_string(),
        "bulkhead rejected: shutdown (the bulkhead is closed)"
    );
    assert_eq!(
        b.would_admit(&LlmRequest::new(), with_res(u64::MAX, 0))
            .unwrap(),
        Verdict::Reject(RejectReason::Shutdown)
    );
}

#[test]
fn exact_fits_at_max_budget_are_admitted() {
    let b = budgeted(4, MAX_BUDGET, 0);
    let full = b
        .try_acquire(&LlmRequest::new(), with_res(MAX_BUDGET - 1, 1))
        .unwrap();
    assert_eq!(full.held_tokens(), MAX_BUDGET);
    // A 0-token call still fits (an exact fit admits); one more token does not.
    let zero = b.try_acquire(&LlmRequest::new(), with_res(0, 0)).unwrap();
    let err = b
        .try_acquire(&LlmRequest::new(), with_res(0, 1))
        .unwrap_err();
    assert_eq!(err.rejection().unwrap().reason(), RejectReason::BudgetLimit);
    drop((full, zero));
    let t = b.stats().token_budget.unwrap();
    assert_eq!((t.in_flight_tokens, t.total_reserved), (0, MAX_BUDGET));
}
