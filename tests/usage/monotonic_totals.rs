//! Every token total only grows, and the tokens in flight equal
//! `reserved + overrun + reheld - refunded - consumed - returned_unreported` after every step,
//! not only once every call has settled with usage. Each test failed before the fix: refunds
//! were net of re-holds (so `total_refunded` went down when a hold rose back), a release whose
//! hold had been lowered before reported nothing returned, and a release without usage
//! returned its hold with nothing booked.

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget, classes::AdmissionClasses,
    classes::ClassLimits, events::EventKind, stats::TokenBudgetStats,
};

use crate::common::usage_fixtures::{
    Recorder, assert_identity, budgeted, fixed, one_release, progressive, req, tokens, usage,
};

/// `(total_refunded, total_reheld, total_overrun, total_consumed, total_returned_unreported)`.
fn moving(t: &TokenBudgetStats) -> (u64, u64, u64, u64, u64) {
    (
        t.total_refunded,
        t.total_reheld,
        t.total_overrun,
        t.total_consumed,
        t.total_returned_unreported,
    )
}

#[test]
fn total_refunded_never_goes_down_over_a_progressive_stream() {
    // r = 1100; progressive reports lower the hold to 950 (150 back) and 650 (300 back), then
    // raise it to 900 (250 re-held); the release settles at 1,000 (100 more re-held).
    let bulkhead = budgeted(4, 5000);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let mut steps = vec![tokens(&bulkhead)];
    for (used, remaining) in [(usage(100, 50), 950), (usage(100, 350), 650)] {
        permit
            .report_usage_progressive(used, progressive(remaining, 0))
            .unwrap();
        steps.push(tokens(&bulkhead));
    }
    permit
        .report_usage_progressive(usage(100, 350), progressive(900, 0))
        .unwrap();
    steps.push(tokens(&bulkhead));
    let report = permit.release(Some(usage(100, 900)));
    steps.push(tokens(&bulkhead));

    let held: Vec<u64> = steps.iter().map(|t| t.in_flight_tokens).collect();
    assert_eq!(held, [1100, 950, 650, 900, 0]);
    let books: Vec<_> = steps.iter().map(moving).collect();
    assert_eq!(
        books,
        [
            (0, 0, 0, 0, 0),
            (150, 0, 0, 0, 0),
            (450, 0, 0, 0, 0),
            // The net figure would have fallen to 200 here.
            (450, 250, 0, 0, 0),
            (450, 350, 0, 1000, 0),
        ]
    );
    for pair in steps.windows(2) {
        let (before, after) = (moving(&pair[0]), moving(&pair[1]));
        assert!(
            before.0 <= after.0
                && before.1 <= after.1
                && before.2 <= after.2
                && before.3 <= after.3
                && before.4 <= after.4,
            "a total went down: {before:?} -> {after:?}"
        );
        assert_eq!(pair[1].total_reserved, 1100);
    }
    steps.iter().for_each(assert_identity);
    // What went back to the budget: 450 by the reports, the 900 held at release.
    assert_eq!(
        (
            report.held_tokens,
            report.refunded_tokens,
            report.overrun_tokens
        ),
        (900, 0, 0)
    );
    assert_eq!(
        (report.returned_tokens, report.returned_total_tokens),
        (900, 1350)
    );
}

#[test]
fn a_release_whose_hold_was_lowered_reports_what_it_returned() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Release]);
    // Lowered to 128 (972 back), settled at 1,300: nothing refunded at release, yet the 128
    // held went back then.
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    permit
        .report_usage_progressive(usage(100, 1000), progressive(0, 128))
        .unwrap();
    let report = permit.release(Some(usage(100, 1200)));
    assert_eq!(
        (
            report.held_tokens,
            report.refunded_tokens,
            report.overrun_tokens
        ),
        (128, 0, 200)
    );
    assert_eq!(
        (report.returned_tokens, report.returned_total_tokens),
        (128, 1100)
    );
    let event = one_release(&events);
    assert_eq!(
        (
            event.refunded_tokens,
            event.returned_tokens,
            event.returned_total_tokens
        ),
        (0, 128, 1100)
    );
    let t = tokens(&bulkhead);
    // 972 refunded, 972 re-held up to r and 200 above it at settlement.
    assert_eq!(moving(&t), (972, 972, 200, 1300, 0));
    assert_identity(&t);

    // Lowered to 650 (450 back), settled at 500: 150 more refunded at release.
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    permit
        .report_usage_progressive(usage(100, 350), progressive(650, 0))
        .unwrap();
    let report = permit.release(Some(usage(100, 400)));
    assert_eq!(
        (
            report.held_tokens,
            report.refunded_tokens,
            report.overrun_tokens
        ),
        (650, 150, 0)
    );
    assert_eq!(
        (report.returned_tokens, report.returned_total_tokens),
        (650, 1100)
    );
    let t = tokens(&bulkhead);
    assert_eq!(moving(&t), (972 + 600, 972, 200, 1800, 0));
    assert_identity(&t);
}

#[test]
fn a_release_without_usage_books_its_hold_as_returned_unreported() {
    // Three ways to release with nothing known: a drop nobody listens to (the fast path), a
    // drop with a release listener, an explicit `release(None)`.
    let bulkhead = budgeted(4, 5000);
    drop(bulkhead.try_acquire(&req(), fixed()).unwrap());
    let t = tokens(&bulkhead);
    assert_eq!(moving(&t), (0, 0, 0, 0, 1100));
    assert_eq!((t.total_reserved, t.in_flight_tokens), (1100, 0));
    assert_identity(&t);

    let events = Recorder::only(&bulkhead, &[EventKind::Release]);
    drop(bulkhead.try_acquire_owned(&req(), fixed()).unwrap());
    let event = one_release(&events);
    assert_eq!(
        (
            event.held_tokens,
            event.returned_tokens,
            event.returned_total_tokens
        ),
        (1100, 1100, 1100)
    );
    let report = bulkhead.try_acquire(&req(), fixed()).unwrap().release(None);
    assert_eq!(
        (
            report.refunded_tokens,
            report.returned_tokens,
            report.returned_total_tokens
        ),
        (0, 1100, 1100)
    );
    assert_eq!(report.usage, None);
    let t = tokens(&bulkhead);
    assert_eq!(moving(&t), (0, 0, 0, 0, 3300));
    assert_eq!(t.in_flight_tokens, 0);
    assert_identity(&t);

    // While held, the identity counts it in flight; a zero reservation books nothing.
    let held = bulkhead.try_acquire(&req(), fixed()).unwrap();
    assert_identity(&tokens(&bulkhead));
    drop(
        bulkhead
            .try_acquire(
                &req(),
                AcquireOptions::new().reservation(Reservation::new(0, 0).unwrap()),
            )
            .unwrap(),
    );
    assert_eq!(tokens(&bulkhead).total_returned_unreported, 3300);
    drop(held);
    let t = tokens(&bulkhead);
    assert_eq!((t.total_returned_unreported, t.in_flight_tokens), (4400, 0));
    assert_identity(&t);
}

#[test]
fn class_totals_only_grow_and_tie_to_the_class_tokens() {
    let bulkhead = LlmBulkhead::builder("m", 8)
        .token_budget(TokenBudget::new(10_000))
        .admission_classes(
            AdmissionClasses::new("standard")
                .class(
                    "premium",
                    ClassLimits::new().protected_in_flight_tokens(2000),
                )
                .class("standard", ClassLimits::new()),
        )
        .build()
        .unwrap();
    let premium = AcquireOptions::new()
        .class(bulkhead.class("premium").unwrap())
        .reservation(Reservation::new(100, 1000).unwrap());
    let standard = AcquireOptions::new().reservation(Reservation::new(100, 1000).unwrap());
    let class_books = |name: &str| {
        let stats = bulkhead.stats();
        let class = stats
            .admission_classes
            .unwrap()
            .classes
            .into_iter()
            .find(|c| c.class.id() == name)
            .unwrap();
        let balance = i128::from(class.total_reserved)
            + i128::from(class.total_overrun)
            + i128::from(class.total_reheld)
            - i128::from(class.total_refunded)
            - i128::from(class.total_consumed)
            - i128::from(class.total_returned_unreported);
        assert_eq!(i128::from(class.in_flight_tokens), balance, "{class:?}");
        (
            class.in_flight_tokens,
            class.total_refunded,
            class.total_reheld,
            class.total_consumed,
            class.total_returned_unreported,
        )
    };

    let mut p = bulkhead.try_acquire(&LlmRequest::new(), premium).unwrap();
    let s = bulkhead.try_acquire(&LlmRequest::new(), standard).unwrap();
    p.report_usage_progressive(usage(100, 350), progressive(650, 0))
        .unwrap();
    assert_eq!(class_books("premium"), (650, 450, 0, 0, 0));
    p.report_usage_progressive(usage(100, 350), progressive(900, 0))
        .unwrap();
    assert_eq!(class_books("premium"), (900, 450, 250, 0, 0));
    assert_eq!(class_books("standard"), (1100, 0, 0, 0, 0));
    drop(s);
    assert_eq!(class_books("standard"), (0, 0, 0, 0, 1100));
    let report = p.release(Some(usage(100, 900)));
    assert_eq!(
        (report.returned_tokens, report.returned_total_tokens),
        (900, 1350)
    );
    assert_eq!(class_books("premium"), (0, 450, 350, 1000, 0));
    let t = tokens(&bulkhead);
    assert_eq!(moving(&t), (450, 350, 0, 1000, 1100));
    assert_identity(&t);
}
