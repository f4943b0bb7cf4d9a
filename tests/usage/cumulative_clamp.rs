//! Usage is cumulative: reports are clamped per field and stale ones change nothing.

use async_bulkhead_llm::{Stats, events::EventKind};

use crate::common::usage_fixtures::{
    Recorder, assert_identity, budgeted, figures, fixed, moved, one_usage, progressive, req,
    settled, tokens, totals, usage,
};

#[test]
fn reports_are_clamped_per_field_and_stale_ones_change_nothing() {
    // §U4.3, a per-field maximum: {50, 10} then {40, 20} -> reported {50, 20}.
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();

    let r = permit.report_usage(usage(50, 10)).unwrap();
    assert_eq!(
        figures(&r),
        (1, 1100, 1050, 60, Some(1000), Some(990), false)
    );
    assert_eq!(moved(&one_usage(&events)), (1, 1100, 1100, 1050, -50));

    // The output rose, the input did not: usage {50, 20}, same hold, still effective.
    let r = permit.report_usage(usage(40, 20)).unwrap();
    assert_eq!(
        figures(&r),
        (2, 1100, 1050, 70, Some(1000), Some(980), false)
    );
    let e = one_usage(&events);
    assert_eq!(moved(&e), (2, 1100, 1050, 1050, 0));
    assert_eq!(e.usage, usage(50, 20));

    let before = bulkhead.stats();
    // Duplicate, all-lower and mixed-lower reports: nothing changes, nothing is emitted.
    for stale in [usage(50, 20), usage(0, 0), usage(49, 19), usage(50, 0)] {
        let r = permit.report_usage(stale).unwrap();
        assert_eq!(
            figures(&r),
            (2, 1100, 1050, 70, Some(1000), Some(980), false),
            "{stale:?}"
        );
    }
    // A stale progressive report that implies the same hold is stale too.
    permit
        .report_usage_progressive(usage(50, 20), progressive(900, 0))
        .unwrap();
    let r = permit
        .report_usage_progressive(usage(10, 10), progressive(900, 0))
        .unwrap();
    assert_eq!(
        figures(&r),
        (3, 1100, 900, 70, Some(1000), Some(980), false)
    );
    let e = one_usage(&events);
    assert_eq!(moved(&e), (3, 1100, 1050, 900, -150));
    assert_eq!(e.usage, usage(50, 20));
    assert_eq!(permit.held_tokens(), 900);
    assert!(events.take().is_empty());
    let after = bulkhead.stats();
    assert_eq!(before.token_budget.unwrap().total_overrun, 0);
    assert_eq!(after.token_budget.unwrap().total_refunded, 200);

    // Settled with the clamped usage.
    let report = permit.release(None);
    assert_eq!(settled(&report), (900, 830, 0, Some(usage(50, 20))));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 70, 1030, 0));
    assert_identity(&t);
}

#[test]
fn a_stale_report_leaves_the_whole_stats_snapshot_unchanged() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    permit.report_usage(usage(30, 300)).unwrap();
    events.take();
    let before: Stats = bulkhead.stats();
    let r = permit.report_usage(usage(29, 300)).unwrap();
    assert_eq!((r.sequence, r.held, r.consumed), (1, 1030, 330));
    assert_eq!(bulkhead.stats(), before);
    assert!(events.take().is_empty());
}
