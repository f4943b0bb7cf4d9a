//! Listeners that call back into the bulkhead, and listeners that panic.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_bulkhead_llm::{events::Event, events::EventKind};

use crate::common::usage_fixtures::{
    REV, Recorder, budgeted, fixed, opts, rejection, req, settled, totals, usage, within_patience,
};

#[test]
fn listeners_may_call_back_into_the_bulkhead_without_deadlock() {
    let bulkhead = budgeted(4, 5000);
    let worker = bulkhead.clone();
    within_patience("re-entrant listeners", move || {
        let bulkhead = worker;
        let seen_stats = Arc::new(Mutex::new(Vec::new()));
        let nested = Arc::new(AtomicBool::new(false));

        // On admit: read stats, apply limits, and (once) admit and release another call.
        let handle = bulkhead.clone();
        let log = Arc::clone(&seen_stats);
        let once = Arc::clone(&nested);
        let on_admit = bulkhead.on_events([EventKind::Admit], move |event| {
            let Event::Admit(e) = event else { return };
            let t = handle.stats().token_budget.unwrap();
            log.lock()
                .unwrap()
                .push(("admit", e.reserved_tokens, t.in_flight_tokens));
            let mut next = handle.limits();
            next.revision += 1;
            handle.apply_limits(next).unwrap();
            if !once.swap(true, Ordering::SeqCst) {
                let inner = handle.try_acquire(&req(), opts(0, 10)).unwrap();
                inner.release(Some(usage(0, 3)));
            }
        });
        // On usage: the books already include the report.
        let handle = bulkhead.clone();
        let log = Arc::clone(&seen_stats);
        let on_usage = bulkhead.on_events([EventKind::Usage], move |event| {
            let Event::Usage(e) = event else { return };
            let t = handle.stats().token_budget.unwrap();
            log.lock()
                .unwrap()
                .push(("usage", e.held_tokens, t.in_flight_tokens));
            // 80 by this report, 7 by the nested call settled with {0, 3} of 10.
            assert_eq!(t.total_refunded, 87);
            handle.set_budget(t.budget + 1).unwrap();
        });
        // On release: admit and release another call (which emits its own events).
        let handle = bulkhead.clone();
        let log = Arc::clone(&seen_stats);
        let released_once = Arc::new(AtomicBool::new(false));
        let on_release = bulkhead.on_events([EventKind::Release], move |event| {
            let Event::Release(e) = event else { return };
            let t = handle.stats().token_budget.unwrap();
            log.lock()
                .unwrap()
                .push(("release", e.held_tokens, t.in_flight_tokens));
            // Only for the outer call's release (the nested ones are smaller).
            if e.held_tokens == 1020 && !released_once.swap(true, Ordering::SeqCst) {
                drop(handle.try_acquire_owned(&req(), opts(0, 20)).unwrap());
            }
        });

        let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
        permit.report_usage(usage(20, 5)).unwrap();
        permit.release(None);

        // Listener panics (failed assertions inside them included) are caught: check first.
        assert_eq!(bulkhead.stats().listener_panics, 0);
        assert_eq!(
            *seen_stats.lock().unwrap(),
            [
                // The outer admission is in flight when its admit event runs.
                ("admit", 1100, 1100),
                // The nested admission (10 tokens), inside the outer admit listener.
                ("admit", 10, 1110),
                ("release", 10, 1100),
                ("usage", 1020, 1020),
                // The outer release: its hold is already returned.
                ("release", 1020, 0),
                // The admission made inside the outer release listener.
                ("admit", 20, 20),
                ("release", 20, 0),
            ]
        );
        // Three admit events each applied one revision, one usage event one more.
        assert_eq!(bulkhead.limits().revision, REV + 4);
        assert_eq!(bulkhead.limits().token_budget.unwrap().budget, 5001);
        let stats = bulkhead.stats();
        assert_eq!((stats.admitted, stats.released, stats.in_flight), (3, 3, 0));
        assert_eq!(stats.listener_panics, 0);
        drop((on_admit, on_usage, on_release));
    });
}

#[test]
fn a_panicking_listener_is_counted_and_the_others_and_the_operation_carry_on() {
    let bulkhead = budgeted(2, 5000);
    let before = Recorder::all(&bulkhead);
    let _panics = bulkhead.on(|event| {
        if !matches!(event, Event::Reconfigure(_)) {
            panic!(
                "listener failure on {:?} (expected by the test)",
                event.kind()
            );
        }
    });
    let after = Recorder::all(&bulkhead);

    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let r = permit.report_usage(usage(20, 5)).unwrap();
    assert_eq!((r.sequence, r.held), (1, 1020));
    let report = permit.release(None);
    assert_eq!(settled(&report), (1020, 995, 0, Some(usage(20, 5))));
    rejection(bulkhead.try_acquire(&req(), opts(0, 9999)));
    bulkhead.set_budget(6000).unwrap();

    let kinds = [
        EventKind::Admit,
        EventKind::Usage,
        EventKind::Release,
        EventKind::Reject,
        EventKind::Reconfigure,
    ];
    assert_eq!(before.take_kinds(), kinds);
    assert_eq!(after.take_kinds(), kinds);
    let stats = bulkhead.stats();
    assert_eq!(stats.listener_panics, 4);
    assert_eq!((stats.admitted, stats.released, stats.rejected), (1, 1, 1));
    let t = stats.token_budget.unwrap();
    assert_eq!(totals(&t), (1100, 25, 1075, 0));
    assert_eq!(t.in_flight_tokens, 0);
}

#[test]
fn a_listener_panicking_while_a_permit_drops_does_not_unwind_the_drop() {
    let bulkhead = budgeted(1, 5000);
    let _panics = bulkhead.on_events([EventKind::Release], |_| {
        panic!("release listener failure (expected by the test)")
    });
    {
        let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
        permit.report_usage(usage(20, 5)).unwrap();
    }
    let stats = bulkhead.stats();
    assert_eq!(stats.listener_panics, 1);
    assert_eq!((stats.in_flight, stats.released), (0, 1));
    assert_eq!(totals(&stats.token_budget.unwrap()), (1100, 25, 1075, 0));
    // The slot is free again.
    drop(bulkhead.try_acquire(&req(), fixed()).unwrap());
    assert_eq!(bulkhead.stats().listener_panics, 2);
}
