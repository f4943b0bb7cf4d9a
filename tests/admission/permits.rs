//! Permits and token accounting: holds, releases, refunds and the token books.

use std::collections::HashSet;

use async_bulkhead_llm::{
    AcquireOptions, Limits, LlmBulkhead, OwnedPermit, Priority, RejectReason, TokenBudget,
    admission::AdmissionId,
};

use crate::support::{
    assert_valid_id, budgeted, opts, plain, reason_of, report_figures, req, res, text, tokens,
    totals, usage,
};

#[test]
fn release_with_usage_below_the_hold_refunds_the_rest() {
    let bulkhead = budgeted(2, 5000, 0);
    let permit = bulkhead.try_acquire(&req(), opts(100, 1000)).unwrap();
    assert_eq!(permit.held_tokens(), 1100);
    let report = permit.release(Some(usage(20, 5)));
    assert_eq!(report_figures(&report), (1100, 1075, Some(usage(20, 5))));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 25, 1075, 0));
    assert_eq!((t.in_flight_tokens, t.available), (0, 5000));
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released, stats.in_flight), (1, 1, 0));
}

#[test]
fn release_with_usage_above_the_hold_refunds_nothing() {
    let bulkhead = budgeted(2, 5000, 0);
    let permit = bulkhead.try_acquire_owned(&req(), opts(100, 1000)).unwrap();
    let report = permit.release(Some(usage(100, 1400)));
    assert_eq!(report_figures(&report), (1100, 0, Some(usage(100, 1400))));
    // The 400 tokens used beyond the reservation are booked as overrun at release (as a
    // report would have), so reserved + overrun + reheld == consumed + refunded.
    assert_eq!(report.overrun_tokens, 400);
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 1500, 0, 400));
    assert_eq!(t.in_flight_tokens, 0);
}

#[test]
fn release_with_usage_equal_to_the_hold_refunds_nothing() {
    let bulkhead = budgeted(2, 5000, 0);
    let permit = bulkhead.try_acquire(&req(), opts(100, 1000)).unwrap();
    let report = permit.release(Some(usage(100, 1000)));
    assert_eq!(report_figures(&report), (1100, 0, Some(usage(100, 1000))));
    assert_eq!(totals(&tokens(&bulkhead)), (1100, 1100, 0, 0));
}

#[test]
fn release_without_usage_returns_the_hold_and_books_nothing() {
    let bulkhead = budgeted(2, 5000, 0);
    let permit = bulkhead.try_acquire(&req(), opts(100, 1000)).unwrap();
    let owned = bulkhead.try_acquire_owned(&req(), opts(10, 20)).unwrap();
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 1130);

    let report = permit.release(None);
    assert_eq!(report_figures(&report), (1100, 0, None));
    let report = owned.release(None);
    assert_eq!(report_figures(&report), (30, 0, None));

    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1130, 0, 0, 0));
    assert_eq!(t.in_flight_tokens, 0);
    assert_eq!(bulkhead.stats().released, 2);
}

#[test]
fn dropping_a_permit_returns_the_hold_and_books_nothing() {
    let bulkhead = budgeted(2, 5000, 0);
    {
        let _permit = bulkhead.try_acquire(&req(), opts(100, 1000)).unwrap();
        let _owned = bulkhead.try_acquire_owned(&req(), opts(1, 2)).unwrap();
        let stats = bulkhead.stats();
        assert_eq!(stats.in_flight, 2);
        assert_eq!(stats.token_budget.unwrap().in_flight_tokens, 1103);
        // Both slots are taken.
        assert_eq!(
            reason_of(bulkhead.try_acquire(&req(), opts(0, 0))),
            RejectReason::ConcurrencyLimit
        );
    }
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released, stats.in_flight), (2, 2, 0));
    let t = stats.token_budget.unwrap();
    assert_eq!(totals(&t), (1103, 0, 0, 0));
    assert_eq!(t.in_flight_tokens, 0);
    // The capacity is really back.
    let again = bulkhead.try_acquire(&req(), opts(2500, 2500)).unwrap();
    assert_eq!(again.held_tokens(), 5000);
}

#[test]
fn usage_reaches_total_consumed_even_with_a_zero_token_hold() {
    // Q3 (design §D4): upstream drops usage when the hold is 0; the port books it.
    let bulkhead = budgeted(2, 1000, 0);
    let permit = bulkhead.try_acquire(&req(), opts(0, 0)).unwrap();
    assert_eq!(permit.held_tokens(), 0);
    let report = permit.release(Some(usage(7, 3)));
    assert_eq!(report_figures(&report), (0, 0, Some(usage(7, 3))));
    assert_eq!(report.overrun_tokens, 10); // all of it beyond the zero reservation
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (0, 10, 0, 10));
    assert_eq!(t.in_flight_tokens, 0);

    // Same on a zero budget, with the owned flavour.
    let zero = budgeted(1, 0, 0);
    let owned = zero.try_acquire_owned(&req(), opts(0, 0)).unwrap();
    owned.release(Some(usage(7, 3)));
    assert_eq!(totals(&tokens(&zero)), (0, 10, 0, 10));
}

#[test]
fn books_balance_after_everything_settles_with_usage_within_the_hold() {
    let bulkhead = budgeted(16, 100_000, 10_000);
    let plan: [(u64, u64, Priority, u64, u64); 6] = [
        (100, 1000, Priority::Normal, 20, 5),
        (100, 1000, Priority::High, 100, 1000),
        (0, 2048, Priority::Normal, 0, 0),
        (5000, 5000, Priority::High, 4000, 1),
        (1, 1, Priority::Normal, 1, 0),
        (333, 0, Priority::Normal, 300, 0),
    ];
    let permits: Vec<_> = plan
        .iter()
        .map(|&(i, o, p, _, _)| {
            bulkhead
                .try_acquire_owned(&req(), opts(i, o).priority(p))
                .unwrap()
        })
        .collect();
    let reserved: u64 = plan.iter().map(|&(i, o, ..)| i + o).sum();
    assert_eq!(tokens(&bulkhead).in_flight_tokens, reserved);

    let mut refunded = 0;
    let mut consumed = 0;
    for (permit, &(i, o, p, ui, uo)) in permits.into_iter().zip(plan.iter()) {
        assert_eq!(permit.priority(), p);
        let report = permit.release(Some(usage(ui, uo)));
        assert_eq!(report.held_tokens, i + o);
        assert_eq!(report.refunded_tokens, i + o - (ui + uo));
        refunded += report.refunded_tokens;
        consumed += ui + uo;
    }
    let t = tokens(&bulkhead);
    assert_eq!(t.in_flight_tokens, 0);
    assert_eq!(totals(&t), (reserved, consumed, refunded, 0));
    assert_eq!(
        t.total_reserved + t.total_overrun,
        t.total_consumed + t.total_refunded
    );
    assert_eq!((reserved, consumed, refunded), (14_583, 5_427, 9_156));
}

#[test]
fn owned_permit_outlives_every_bulkhead_handle() {
    let bulkhead = budgeted(1, 5000, 0);
    let permit = bulkhead.try_acquire_owned(&req(), opts(100, 1000)).unwrap();
    drop(bulkhead);
    assert_eq!(permit.held_tokens(), 1100);
    assert_eq!(permit.limit_revision(), 0);
    assert_valid_id(permit.admission_id());
    let report = permit.release(Some(usage(20, 5)));
    assert_eq!(report_figures(&report), (1100, 1075, Some(usage(20, 5))));

    // Dropping (rather than releasing) after the handle is gone is fine too.
    let bulkhead = plain(1);
    let permit = bulkhead
        .try_acquire_owned(&req(), AcquireOptions::new())
        .unwrap();
    drop(bulkhead);
    drop(permit);
}

#[test]
fn owned_permit_moves_to_another_thread_after_the_handle_is_dropped() {
    let bulkhead = budgeted(1, 5000, 0);
    let observer = bulkhead.clone();
    let permit: OwnedPermit = bulkhead.try_acquire_owned(&req(), opts(100, 1000)).unwrap();
    drop(bulkhead);
    let report = std::thread::spawn(move || permit.release(Some(usage(20, 5))))
        .join()
        .unwrap();
    assert_eq!(report_figures(&report), (1100, 1075, Some(usage(20, 5))));
    let stats = observer.stats();
    assert_eq!((stats.admitted, stats.released, stats.in_flight), (1, 1, 0));
    let t = stats.token_budget.unwrap();
    assert_eq!(totals(&t), (1100, 25, 1075, 0));
    assert_eq!(t.in_flight_tokens, 0);
    assert!(observer.try_acquire(&req(), opts(2500, 2500)).is_ok());
}

#[test]
fn borrowed_permit_can_be_released_on_a_scoped_thread() {
    let bulkhead = budgeted(1, 5000, 0);
    let permit = bulkhead.try_acquire(&req(), opts(10, 10)).unwrap();
    let report = std::thread::scope(|s| {
        s.spawn(move || permit.release(Some(usage(5, 5))))
            .join()
            .unwrap()
    });
    assert_eq!(report_figures(&report), (20, 10, Some(usage(5, 5))));
    assert_eq!(bulkhead.stats().in_flight, 0);
}

#[test]
fn admission_ids_are_unique_v4_uuids_across_four_threads() {
    const THREADS: usize = 4;
    const PER_THREAD: usize = 2000;
    let bulkhead = budgeted(64, 1_000_000, 0);
    let ids: Vec<AdmissionId> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let bulkhead = &bulkhead;
                s.spawn(move || {
                    let mut ids = Vec::with_capacity(PER_THREAD);
                    for i in 0..PER_THREAD {
                        if (t + i) % 2 == 0 {
                            let p = bulkhead.try_acquire(&req(), opts(1, 1)).unwrap();
                            ids.push(p.admission_id());
                            p.release(Some(usage(1, 0)));
                        } else {
                            let p = bulkhead.try_acquire_owned(&req(), opts(1, 1)).unwrap();
                            ids.push(p.admission_id());
                            drop(p);
                        }
                    }
                    ids
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    assert_eq!(ids.len(), THREADS * PER_THREAD);
    let unique: HashSet<AdmissionId> = ids.iter().copied().collect();
    assert_eq!(unique.len(), ids.len(), "duplicate admission ids");
    let unique_text: HashSet<String> = ids.iter().map(ToString::to_string).collect();
    assert_eq!(unique_text.len(), ids.len());
    for &id in &ids {
        assert_valid_id(id);
    }
    let first = ids[0];
    assert_eq!(format!("{first:?}"), format!("AdmissionId({first})"));

    let stats = bulkhead.stats();
    assert_eq!(stats.admitted, 8000);
    assert_eq!(stats.released, 8000);
    assert_eq!(stats.in_flight, 0);
    let t = stats.token_budget.unwrap();
    assert_eq!(totals(&t), (16_000, 4000, 4000, 0));
    assert_eq!(t.in_flight_tokens, 0);
}

#[test]
fn admission_ids_stay_unique_across_short_lived_threads_and_bulkheads() {
    // Threads that exit hand their statistics shard to the next thread; ids must not repeat.
    let a = plain(4);
    let b = plain(4);
    let mut ids = Vec::new();
    for _ in 0..8 {
        let (a2, b2) = (a.clone(), b.clone());
        let batch = std::thread::spawn(move || {
            let mut ids = Vec::new();
            for _ in 0..100 {
                ids.push(
                    a2.try_acquire(&req(), AcquireOptions::new())
                        .unwrap()
                        .admission_id(),
                );
                ids.push(
                    b2.try_acquire(&req(), AcquireOptions::new())
                        .unwrap()
                        .admission_id(),
                );
            }
            ids
        })
        .join()
        .unwrap();
        ids.extend(batch);
    }
    for _ in 0..100 {
        ids.push(
            a.try_acquire(&req(), AcquireOptions::new())
                .unwrap()
                .admission_id(),
        );
        ids.push(
            b.try_acquire(&req(), AcquireOptions::new())
                .unwrap()
                .admission_id(),
        );
    }
    let unique: HashSet<AdmissionId> = ids.iter().copied().collect();
    assert_eq!(unique.len(), 1800);
    assert_eq!(a.stats().admitted, 900);
    assert_eq!(b.stats().admitted, 900);
}

#[test]
fn limit_revision_is_the_revision_at_admission() {
    let bulkhead = LlmBulkhead::builder("m", 4)
        .initial_revision(4)
        .token_budget(TokenBudget::new(1000))
        .build()
        .unwrap();
    let early = bulkhead.try_acquire(&req(), opts(1, 1)).unwrap();
    let early_owned = bulkhead.try_acquire_owned(&req(), opts(1, 1)).unwrap();
    assert_eq!(early.limit_revision(), 4);

    bulkhead
        .apply_limits(Limits::new(9, 5).with_token_budget(2000, 0))
        .unwrap();
    assert_eq!(early.limit_revision(), 4);
    assert_eq!(early_owned.limit_revision(), 4);
    let middle = bulkhead.try_acquire(&req(), opts(1, 1)).unwrap();
    assert_eq!(middle.limit_revision(), 9);

    bulkhead.set_budget(3000).unwrap();
    assert_eq!(early.limit_revision(), 4);
    assert_eq!(middle.limit_revision(), 9);
    let late = bulkhead.try_acquire(&req(), opts(1, 1)).unwrap();
    assert_eq!(late.limit_revision(), 10);

    // A stale snapshot changes nothing.
    bulkhead.apply_limits(Limits::new(3, 1)).unwrap();
    let latest = bulkhead.try_acquire(&req(), opts(1, 1)).unwrap();
    assert_eq!(latest.limit_revision(), 10);
    drop((early, early_owned, middle, late, latest));
}

#[test]
fn permit_accessors_report_what_was_admitted() {
    let bulkhead = budgeted(2, 10_000, 0);
    let permit = bulkhead
        .try_acquire(
            &text(400).max_tokens(100),
            AcquireOptions::new().priority(Priority::High),
        )
        .unwrap();
    assert_eq!(permit.priority(), Priority::High);
    assert_eq!(permit.reservation(), Some(res(100, 100)));
    assert_eq!(permit.held_tokens(), 200);
    assert_eq!(permit.limit_revision(), 0);
    assert_valid_id(permit.admission_id());
    let owned = bulkhead.try_acquire_owned(&req(), opts(3, 4)).unwrap();
    assert_eq!(owned.priority(), Priority::Normal);
    assert_eq!(owned.reservation(), Some(res(3, 4)));
    assert_eq!(owned.held_tokens(), 7);
    assert_ne!(owned.admission_id(), permit.admission_id());
    assert!(format!("{permit:?}").starts_with("Permit"));
    assert!(format!("{owned:?}").starts_with("OwnedPermit"));
}
