//! The worked examples of design §U4.3, exactly.

use async_bulkhead_llm::{Priority, events::EventKind};

use crate::common::usage_fixtures::{
    R, REV, Recorder, assert_identity, budgeted, figures, fixed, live, moved, one_release,
    one_usage, progressive, release_figures, req, settled, tokens, totals, usage, usage_state,
};

#[test]
fn report_below_the_reservation_refunds_the_unused_input_at_once() {
    // §U4.3: report {20, 5} -> hold 20 + max(1000, 5) = 1020, refund 80.
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage, EventKind::Release]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    assert_eq!(permit.held_tokens(), R);
    assert_eq!(live(&tokens(&bulkhead)), (1100, 3900));

    let report = permit.report_usage(usage(20, 5)).unwrap();
    assert_eq!(
        figures(&report),
        (1, 1100, 1020, 25, Some(1000), Some(995), false)
    );
    assert_eq!(report.admission_id, permit.admission_id());
    assert_eq!(report.limit_revision, REV);
    assert_eq!(permit.held_tokens(), 1020);
    let t = tokens(&bulkhead);
    assert_eq!(live(&t), (1020, 3980));
    // Nothing is consumed until settlement; the refund is booked now.
    assert_eq!(totals(&t), (1100, 0, 80, 0));

    let e = one_usage(&events);
    assert_eq!(moved(&e), (1, 1100, 1100, 1020, -80));
    assert_eq!(
        usage_state(&e),
        (usage(20, 5), Some(1000), Some(995), false, None)
    );
    assert_eq!(
        (e.admission_id, e.limit_revision, e.priority),
        (permit.admission_id(), REV, Priority::Normal)
    );

    // Released without usage: settled with the last reported usage (25 consumed), and the
    // rest of the hold (1020 - 25) refunded at release.
    let id = permit.admission_id();
    let report = permit.release(None);
    assert_eq!(settled(&report), (1020, 995, 0, Some(usage(20, 5))));
    let t = tokens(&bulkhead);
    assert_eq!(live(&t), (0, 5000));
    assert_eq!(totals(&t), (1100, 25, 1075, 0));
    assert_identity(&t);
    let e = one_release(&events);
    assert_eq!(
        release_figures(&e),
        (1100, 1020, 995, 1, Some(usage(20, 5)))
    );
    assert_eq!((e.admission_id, e.limit_revision), (id, REV));
}

#[test]
fn report_beyond_the_reservation_expands_the_hold_as_overrun() {
    // §U4.3: report {100, 1400} -> hold 100 + 1400 = 1500, overrun 400, over the reservation.
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let report = permit.report_usage(usage(100, 1400)).unwrap();
    assert_eq!(
        figures(&report),
        (1, 1100, 1500, 1500, Some(1000), Some(0), true)
    );
    let t = tokens(&bulkhead);
    assert_eq!(live(&t), (1500, 3500));
    assert_eq!(totals(&t), (1100, 0, 0, 400));
    let e = one_usage(&events);
    assert_eq!(moved(&e), (1, 1100, 1100, 1500, 400));
    assert_eq!(
        usage_state(&e),
        (usage(100, 1400), Some(1000), Some(0), true, None)
    );

    let report = permit.release(None);
    assert_eq!(settled(&report), (1500, 0, 0, Some(usage(100, 1400))));
    let t = tokens(&bulkhead);
    assert_eq!(live(&t), (0, 5000));
    assert_eq!(totals(&t), (1100, 1500, 0, 400));
    assert_identity(&t);
}

#[test]
fn progressive_reports_stop_holding_processed_input_and_generated_output() {
    // §U4.3: progressive {20, 100} rem 900 margin 50 -> 950 (refund 150); then {20, 400} rem 600
    // margin 50 -> 650 (sequence 2), cumulative refund 450.
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();

    let first = permit
        .report_usage_progressive(usage(20, 100), progressive(900, 50))
        .unwrap();
    assert_eq!(
        figures(&first),
        (1, 1100, 950, 120, Some(1000), Some(900), false)
    );
    let t = tokens(&bulkhead);
    assert_eq!(live(&t), (950, 4050));
    assert_eq!(totals(&t), (1100, 0, 150, 0));
    let e = one_usage(&events);
    assert_eq!(moved(&e), (1, 1100, 1100, 950, -150));
    assert_eq!(
        usage_state(&e),
        (
            usage(20, 100),
            Some(1000),
            Some(900),
            false,
            Some(progressive(900, 50))
        )
    );
    assert_eq!(e.progressive.unwrap().safety_margin_tokens, 50);

    let second = permit
        .report_usage_progressive(usage(20, 400), progressive(600, 50))
        .unwrap();
    assert_eq!(
        figures(&second),
        (2, 1100, 650, 420, Some(1000), Some(600), false)
    );
    let t = tokens(&bulkhead);
    assert_eq!(live(&t), (650, 4350));
    assert_eq!(totals(&t), (1100, 0, 450, 0));
    let e = one_usage(&events);
    assert_eq!(moved(&e), (2, 1100, 950, 650, -300));

    // Settled with {20, 400}: 420 consumed, 650 - 420 = 230 more refunded.
    let report = permit.release(None);
    assert_eq!(settled(&report), (650, 230, 0, Some(usage(20, 400))));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 420, 680, 0));
    assert_eq!(t.in_flight_tokens, 0);
    assert_identity(&t);
}

#[test]
fn a_progressive_hold_rising_back_below_the_reservation_is_re_held_not_overrun() {
    // §U4.3: progressive {100, 1000} rem 0 margin 128 -> 128; then {100, 1200} rem 0 margin 100
    // -> 100 + 200 = 300. Q4: the rise 128 -> 300 stays below r = 1100, so it is re-held (taken
    // off the refunds), not overrun (upstream booked 172 of overrun here).
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage, EventKind::Release]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();

    let first = permit
        .report_usage_progressive(usage(100, 1000), progressive(0, 128))
        .unwrap();
    assert_eq!(
        figures(&first),
        (1, 1100, 128, 1100, Some(1000), Some(0), false)
    );
    let t = tokens(&bulkhead);
    assert_eq!(live(&t), (128, 4872));
    assert_eq!(totals(&t), (1100, 0, 972, 0));
    assert_eq!(moved(&one_usage(&events)), (1, 1100, 1100, 128, -972));

    let second = permit
        .report_usage_progressive(usage(100, 1200), progressive(0, 100))
        .unwrap();
    assert_eq!(
        figures(&second),
        (2, 1100, 300, 1300, Some(1000), Some(0), true)
    );
    let t = tokens(&bulkhead);
    assert_eq!(live(&t), (300, 4700));
    assert_eq!(
        t.total_overrun, 0,
        "a rise below the reservation is no overrun"
    );
    assert_eq!(
        t.total_refunded, 972,
        "refunds are gross: the rise does not lower them"
    );
    assert_eq!(
        t.total_reheld, 172,
        "the rise back below the reservation is re-held"
    );
    assert_identity(&t);
    let e = one_usage(&events);
    assert_eq!(moved(&e), (2, 1100, 128, 300, 172));
    assert_eq!(
        usage_state(&e),
        (
            usage(100, 1200),
            Some(1000),
            Some(0),
            true,
            Some(progressive(0, 100))
        )
    );

    // Settled with {100, 1200} = 1300 from a hold of 300: 800 re-held up to r, 200 above it.
    let report = permit.release(None);
    assert_eq!(settled(&report), (300, 0, 200, Some(usage(100, 1200))));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 1300, 972, 200));
    assert_eq!(t.total_reheld, 172 + 800);
    assert_eq!(t.in_flight_tokens, 0);
    assert_identity(&t);
    assert_eq!(
        release_figures(&one_release(&events)),
        (1100, 300, 0, 2, Some(usage(100, 1200)))
    );
}

#[test]
fn a_hold_crossing_the_reservation_splits_into_re_held_and_overrun() {
    // Q4: progressive to 900 (refund 200); a plain report of the same usage holds 20 + 1000 =
    // 1020 (120 re-held, no overrun); then {20, 1200} holds 1220: 80 re-held up to r and 120
    // above it (overrun).
    let bulkhead = budgeted(4, 5000);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let r = permit
        .report_usage_progressive(usage(20, 100), progressive(900, 0))
        .unwrap();
    assert_eq!((r.sequence, r.held), (1, 900));
    assert_eq!(totals(&tokens(&bulkhead)), (1100, 0, 200, 0));

    // Same usage, different hold: effective (sequence 2).
    let r = permit.report_usage(usage(20, 100)).unwrap();
    assert_eq!((r.sequence, r.held), (2, 1020));
    // Gross: the 200 stay refunded; the 120 are re-held.
    assert_eq!(totals(&tokens(&bulkhead)), (1100, 0, 200, 0));
    assert_eq!(tokens(&bulkhead).total_reheld, 120);

    let r = permit.report_usage(usage(20, 1200)).unwrap();
    assert_eq!(
        figures(&r),
        (3, 1100, 1220, 1220, Some(1000), Some(0), true)
    );
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 0, 200, 120));
    assert_eq!(t.total_reheld, 200);
    assert_eq!(live(&t), (1220, 3780));

    let report = permit.release(None);
    assert_eq!(settled(&report), (1220, 0, 0, Some(usage(20, 1200))));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 1220, 200, 120));
    assert_identity(&t);
}

#[test]
fn a_progressive_hold_driven_to_zero_still_books_consumption() {
    // Q3: upstream drops the usage of an admission whose hold is 0 at release; the port books it.
    let bulkhead = budgeted(4, 5000);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let r = permit
        .report_usage_progressive(usage(100, 1000), progressive(0, 0))
        .unwrap();
    assert_eq!(figures(&r), (1, 1100, 0, 1100, Some(1000), Some(0), false));
    assert_eq!(live(&tokens(&bulkhead)), (0, 5000));
    let report = permit.release(None);
    assert_eq!(settled(&report), (0, 0, 0, Some(usage(100, 1000))));
    let t = tokens(&bulkhead);
    // Refunded 1100 by the report, then re-held 1100 by the final usage (both gross).
    assert_eq!(totals(&t), (1100, 1100, 1100, 0));
    assert_eq!(t.total_reheld, 1100);
    assert_identity(&t);
}
