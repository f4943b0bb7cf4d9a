//! Refunds and overruns act on admission at once.

use async_bulkhead_llm::RejectReason;

use crate::common::usage_fixtures::{
    budgeted, fixed, live, opts, rejection, req, tokens, totals, usage,
};

#[test]
fn a_refund_admits_a_call_that_the_full_budget_refused() {
    let bulkhead = budgeted(8, 2200);
    let mut a = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let _b = bulkhead.try_acquire(&req(), fixed()).unwrap();
    assert_eq!(live(&tokens(&bulkhead)), (2200, 0));

    let refused = rejection(bulkhead.try_acquire(&req(), opts(0, 80)));
    assert_eq!(refused.reason(), RejectReason::BudgetLimit);
    let t = refused.detail().token_budget.unwrap();
    assert_eq!(
        (t.in_flight_tokens, t.available, t.requested),
        (2200, 0, 80)
    );

    // The prompt was 20 tokens, not 100: 80 tokens are back in the budget at once.
    a.report_usage(usage(20, 5)).unwrap();
    assert_eq!(live(&tokens(&bulkhead)), (2120, 80));
    let c = bulkhead.try_acquire(&req(), opts(0, 80)).unwrap();
    assert_eq!(live(&tokens(&bulkhead)), (2200, 0));
    // Exactly full again.
    let refused = rejection(bulkhead.try_acquire(&req(), opts(0, 1)));
    assert_eq!(refused.reason(), RejectReason::BudgetLimit);
    assert_eq!(bulkhead.stats().rejected_by_reason.budget_limit, 2);
    drop(c);
}

#[test]
fn an_overrun_refuses_a_call_that_fitted_until_the_overrunning_permit_is_released() {
    let bulkhead = budgeted(8, 3000);
    let mut a = bulkhead.try_acquire(&req(), fixed()).unwrap();
    // 1100 + 1900 = 3000: an exact fit.
    assert_eq!(
        bulkhead.would_admit(&req(), opts(0, 1900)).unwrap(),
        async_bulkhead_llm::admission::Verdict::Admit
    );

    a.report_usage(usage(100, 1400)).unwrap();
    assert_eq!(live(&tokens(&bulkhead)), (1500, 1500));
    let refused = rejection(bulkhead.try_acquire(&req(), opts(0, 1900)));
    assert_eq!(refused.reason(), RejectReason::BudgetLimit);
    let t = refused.detail().token_budget.unwrap();
    assert_eq!(
        (t.budget, t.in_flight_tokens, t.available, t.requested),
        (3000, 1500, 1500, 1900)
    );
    // A later report cannot shrink the hold below the output already generated.
    a.report_usage(usage(100, 1200)).unwrap();
    assert_eq!(live(&tokens(&bulkhead)), (1500, 1500));
    assert_eq!(
        rejection(bulkhead.try_acquire(&req(), opts(0, 1900))).reason(),
        RejectReason::BudgetLimit
    );

    a.release(None);
    let b = bulkhead.try_acquire(&req(), opts(0, 1900)).unwrap();
    assert_eq!(b.held_tokens(), 1900);
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (3000, 1500, 0, 400));
}
