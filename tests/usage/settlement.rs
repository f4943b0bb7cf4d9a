//! Settlement: with the explicit usage, else the last reported one, else none.

use std::thread;

use async_bulkhead_llm::{RunError, events::EventKind, usage::UsageError};
use futures::executor::block_on;

use crate::common::usage_fixtures::{
    Recorder, assert_identity, budgeted, fixed, one_release, progressive, release_figures, req,
    settled, tokens, totals, usage,
};

#[test]
fn release_without_usage_settles_with_the_last_reported_usage() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Release]);
    let mut permit = bulkhead.try_acquire_owned(&req(), fixed()).unwrap();
    permit.report_usage(usage(20, 5)).unwrap();
    permit.report_usage(usage(20, 300)).unwrap();
    let report = permit.release(None);
    assert_eq!(settled(&report), (1020, 700, 0, Some(usage(20, 300))));
    assert_eq!(
        release_figures(&one_release(&events)),
        (1100, 1020, 700, 2, Some(usage(20, 300)))
    );
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 320, 780, 0));
    assert_identity(&t);
    assert_eq!((bulkhead.stats().released, t.in_flight_tokens), (1, 0));
}

#[test]
fn release_with_explicit_usage_overrides_the_reported_usage() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Release]);

    // Explicit usage above the reported one.
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    permit.report_usage(usage(20, 5)).unwrap();
    let report = permit.release(Some(usage(30, 40)));
    assert_eq!(settled(&report), (1020, 950, 0, Some(usage(30, 40))));
    assert_eq!(
        release_figures(&one_release(&events)),
        (1100, 1020, 950, 1, Some(usage(30, 40)))
    );
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 70, 1030, 0));
    assert_identity(&t);

    // Explicit usage below the reported one is taken as given (not clamped).
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    permit.report_usage(usage(20, 5)).unwrap();
    let report = permit.release(Some(usage(10, 1)));
    assert_eq!(settled(&report), (1020, 1009, 0, Some(usage(10, 1))));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (2200, 81, 2119, 0));
    assert_identity(&t);

    // Explicit usage beyond the reservation after a progressive drop: re-held, then overrun.
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    permit
        .report_usage_progressive(usage(100, 500), progressive(500, 0))
        .unwrap();
    let report = permit.release(Some(usage(100, 1500)));
    assert_eq!(settled(&report), (500, 0, 500, Some(usage(100, 1500))));
    let t = tokens(&bulkhead);
    // Refunds are gross: the 600 the drop refunded stay refunded, re-held apart at settlement.
    assert_eq!(totals(&t), (3300, 1681, 2119 + 600, 500));
    assert_eq!((t.total_reheld, t.total_returned_unreported), (600, 0));
    assert_identity(&t);
    assert_eq!(t.in_flight_tokens, 0);
}

#[test]
fn dropping_a_permit_that_reported_books_the_last_reported_usage() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Release]);
    {
        let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
        permit.report_usage(usage(20, 5)).unwrap();
    }
    assert_eq!(
        release_figures(&one_release(&events)),
        (1100, 1020, 995, 1, Some(usage(20, 5)))
    );
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 25, 1075, 0));
    assert_eq!(t.in_flight_tokens, 0);

    // Owned, dropped on another thread, after a progressive report.
    let mut owned = bulkhead.try_acquire_owned(&req(), fixed()).unwrap();
    owned
        .report_usage_progressive(usage(10, 200), progressive(800, 10))
        .unwrap();
    thread::spawn(move || drop(owned)).join().unwrap();
    assert_eq!(
        release_figures(&one_release(&events)),
        (1100, 810, 600, 1, Some(usage(10, 200)))
    );
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (2200, 235, 1965, 0));
    assert_identity(&t);
    assert_eq!(bulkhead.stats().released, 2);
}

#[test]
fn dropping_or_releasing_a_permit_that_never_reported_books_nothing() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Release]);
    drop(bulkhead.try_acquire(&req(), fixed()).unwrap());
    assert_eq!(
        release_figures(&one_release(&events)),
        (1100, 1100, 0, 0, None)
    );
    let report = bulkhead.try_acquire(&req(), fixed()).unwrap().release(None);
    assert_eq!(settled(&report), (1100, 0, 0, None));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (2200, 0, 0, 0));
    assert_eq!(t.in_flight_tokens, 0);
}

#[test]
fn run_settles_with_the_usage_reported_through_its_context() {
    let bulkhead = budgeted(4, 5000);
    let held = block_on(bulkhead.run(&req(), fixed(), async |mut ctx| {
        let r = ctx.report_usage(usage(20, 5))?;
        assert_eq!(ctx.held_tokens(), 1020);
        let r2 = ctx.report_usage_progressive(usage(20, 50), progressive(950, 0))?;
        assert_eq!((r.sequence, r2.sequence), (1, 2));
        Ok::<_, UsageError>(r2.held)
    }))
    .unwrap();
    assert_eq!(held, 950);
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 70, 1030, 0));
    assert_eq!(t.in_flight_tokens, 0);

    // A failing callback also settles with what it reported.
    let failed = block_on(bulkhead.run(&req(), fixed(), async |mut ctx| {
        ctx.report_usage(usage(100, 1400)).unwrap();
        Err::<(), _>(std::io::Error::other("stream broke"))
    }));
    assert!(matches!(failed, Err(RunError::Failed(_))));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (2200, 1570, 1030, 400));
    assert_identity(&t);
    assert_eq!(t.in_flight_tokens, 0);
}
