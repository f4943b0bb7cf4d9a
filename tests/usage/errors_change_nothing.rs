//! A refused usage report changes nothing.

use async_bulkhead_llm::{events::EventKind, limits::MAX_BUDGET, usage::UsageError};

use crate::common::usage_fixtures::{
    Recorder, budgeted, figures, fixed, opts, plain, progressive, req, tokens, totals, usage,
};

#[test]
fn remaining_above_the_output_cap_is_refused_and_changes_nothing() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    permit.report_usage(usage(20, 5)).unwrap();
    events.take();
    let before = bulkhead.stats();

    let err = permit
        .report_usage_progressive(usage(30, 50), progressive(1001, 0))
        .unwrap_err();
    assert_eq!(
        err,
        UsageError::RemainingExceedsCap {
            remaining: 1001,
            cap: 1000
        }
    );
    assert_eq!(permit.held_tokens(), 1020);
    assert_eq!(bulkhead.stats(), before);
    assert!(events.take().is_empty());
    // The usage of the refused report was not recorded: repeating the last good one is stale.
    let r = permit.report_usage(usage(20, 5)).unwrap();
    assert_eq!(
        figures(&r),
        (1, 1100, 1020, 25, Some(1000), Some(995), false)
    );
    assert!(events.take().is_empty());

    // At the cap exactly is fine.
    let r = permit
        .report_usage_progressive(usage(20, 5), progressive(1000, 0))
        .unwrap();
    assert_eq!((r.sequence, r.held), (2, 1000));
    drop(permit);
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 25, 1075, 0));
}

#[test]
fn overflowing_holds_are_refused_and_change_nothing() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    permit.report_usage(usage(20, 5)).unwrap();
    events.take();
    let before = bulkhead.stats();

    // Plain: input + max_output overflows.
    let huge_input = usage(u64::MAX - 500, 0);
    assert_eq!(
        permit.report_usage(huge_input).unwrap_err(),
        UsageError::HoldOverflow
    );
    // Progressive: remaining + margin overflows.
    assert_eq!(
        permit
            .report_usage_progressive(usage(20, 5), progressive(1000, u64::MAX))
            .unwrap_err(),
        UsageError::HoldOverflow
    );
    // Progressive: remaining + margin + output beyond the cap overflows.
    assert_eq!(
        permit
            .report_usage_progressive(usage(20, 1001), progressive(1000, u64::MAX - 1000))
            .unwrap_err(),
        UsageError::HoldOverflow
    );
    assert_eq!(permit.held_tokens(), 1020);
    assert_eq!(bulkhead.stats(), before);
    assert!(events.take().is_empty());
    let r = permit.report_usage(usage(20, 5)).unwrap();
    assert_eq!((r.sequence, r.held, r.consumed), (1, 1020, 25));
    assert!(events.take().is_empty());
}

#[test]
fn a_hold_that_would_overflow_the_tokens_in_flight_is_refused_and_changes_nothing() {
    // The word counts at most MAX_BUDGET tokens in flight (2^35 - 1).
    let bulkhead = budgeted(4, MAX_BUDGET);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage]);
    let _big = bulkhead
        .try_acquire(&req(), opts(0, MAX_BUDGET - 2000))
        .unwrap();
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    assert_eq!(tokens(&bulkhead).in_flight_tokens, MAX_BUDGET - 900);
    let before = bulkhead.stats();

    // 1100 -> 2100 needs 1000 more tokens in flight; only 900 more can be counted.
    assert_eq!(
        permit.report_usage(usage(100, 2000)).unwrap_err(),
        UsageError::HoldOverflow
    );
    assert_eq!(permit.held_tokens(), 1100);
    assert_eq!(bulkhead.stats(), before);
    assert!(events.take().is_empty());

    // 1100 -> 1900 fits.
    let r = permit.report_usage(usage(100, 1800)).unwrap();
    assert_eq!((r.sequence, r.held), (1, 1900));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, MAX_BUDGET - 100);
    assert_eq!(tokens(&bulkhead).total_overrun, 800);
}

#[test]
fn a_clamped_usage_whose_total_overflows_is_refused_and_changes_nothing() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    // Progressive to 0 keeps the hold small whatever the input.
    let r = permit
        .report_usage_progressive(usage(u64::MAX - 5, 0), progressive(0, 0))
        .unwrap();
    assert_eq!((r.sequence, r.held, r.consumed), (1, 0, u64::MAX - 5));
    events.take();
    let before = bulkhead.stats();

    // {0, 10} alone is fine, but clamped with the input so far its total overflows.
    let err = permit
        .report_usage_progressive(usage(0, 10), progressive(0, 0))
        .unwrap_err();
    assert_eq!(
        err,
        UsageError::TotalOverflow {
            input: u64::MAX - 5,
            output: 10
        }
    );
    assert_eq!(permit.report_usage(usage(0, 10)).unwrap_err(), err);
    assert_eq!(permit.held_tokens(), 0);
    assert_eq!(bulkhead.stats(), before);
    assert!(events.take().is_empty());
    let r = permit
        .report_usage_progressive(usage(1, 0), progressive(0, 0))
        .unwrap();
    assert_eq!((r.sequence, r.held, r.consumed), (1, 0, u64::MAX - 5));

    // Without a budget the clamp overflows the same way.
    let unbudgeted = plain(1);
    let mut permit = unbudgeted.try_acquire(&req(), fixed()).unwrap();
    permit.report_usage(usage(u64::MAX - 5, 0)).unwrap();
    assert_eq!(
        permit.report_usage(usage(0, 6)).unwrap_err(),
        UsageError::TotalOverflow {
            input: u64::MAX - 5,
            output: 6
        }
    );
    assert_eq!(permit.report_usage(usage(0, 5)).unwrap().sequence, 2);
}
