//! Usage reports on a bulkhead without a token budget.

use async_bulkhead_llm::events::EventKind;

use crate::common::usage_fixtures::{
    REV, Recorder, figures, fixed, moved, one_release, one_usage, plain, progressive,
    release_figures, req, settled, usage, usage_state,
};

#[test]
fn without_a_budget_reports_are_recorded_but_hold_nothing() {
    let bulkhead = plain(2);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage, EventKind::Release]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    assert_eq!((permit.held_tokens(), permit.reservation()), (0, None));

    let r = permit.report_usage(usage(10, 20)).unwrap();
    assert_eq!(figures(&r), (1, 0, 0, 30, None, None, false));
    assert_eq!(r.limit_revision, REV);
    let e = one_usage(&events);
    assert_eq!(moved(&e), (1, 0, 0, 0, 0));
    assert_eq!(usage_state(&e), (usage(10, 20), None, None, false, None));

    // Duplicate: no change, no event.
    let r = permit.report_usage(usage(10, 20)).unwrap();
    assert_eq!(r.sequence, 1);
    assert!(events.take().is_empty());

    // Way beyond any cap: never over a reservation it does not have.
    let r = permit.report_usage(usage(10, 1_000_000)).unwrap();
    assert_eq!(figures(&r), (2, 0, 0, 1_000_010, None, None, false));
    assert_eq!(one_usage(&events).sequence, 2);

    // Progressive: no cap to check.
    let r = permit
        .report_usage_progressive(usage(10, 1_000_001), progressive(u64::MAX, 7))
        .unwrap();
    assert_eq!(figures(&r), (3, 0, 0, 1_000_011, None, None, false));
    let e = one_usage(&events);
    assert_eq!(moved(&e), (3, 0, 0, 0, 0));
    assert_eq!(e.progressive, Some(progressive(u64::MAX, 7)));
    // A progressive report whose usage did not change is stale (the hold stays 0).
    let r = permit
        .report_usage_progressive(usage(10, 1_000_001), progressive(5, 0))
        .unwrap();
    assert_eq!(r.sequence, 3);
    assert!(events.take().is_empty());

    let report = permit.release(None);
    assert_eq!(settled(&report), (0, 0, 0, Some(usage(10, 1_000_001))));
    assert_eq!(
        release_figures(&one_release(&events)),
        (0, 0, 0, 3, Some(usage(10, 1_000_001)))
    );
    let stats = bulkhead.stats();
    assert!(stats.token_budget.is_none());
    assert_eq!((stats.admitted, stats.released, stats.in_flight), (1, 1, 0));
}
