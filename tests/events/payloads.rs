//! Event payloads.

use std::time::Duration;

use async_bulkhead_llm::{
    Limits, Priority, RejectReason, TokenUsage, events::EventKind, limits::ApplyOutcome,
    limits::LimitsError, usage::UsageError,
};
use futures::executor::block_on;

use crate::common::usage_fixtures::{
    REV, Recorder, Seen, budgeted, fixed, moved, one_admit, one_reconfigure, one_reject,
    one_release, one_usage, opts, plain, progressive, rejection, release_figures, req, usage,
};

#[test]
fn admit_and_reject_events_carry_the_decision() {
    let bulkhead = budgeted(2, 5000);
    let events = Recorder::all(&bulkhead);

    let high = bulkhead
        .try_acquire(&req(), fixed().priority(Priority::High))
        .unwrap();
    let e = one_admit(&events);
    assert_eq!(
        (
            e.admission_id,
            e.limit_revision,
            e.priority,
            e.reserved_tokens
        ),
        (high.admission_id(), REV, Priority::High, 1100)
    );
    assert_eq!(e.queue_wait, Duration::ZERO);

    let normal = bulkhead.try_acquire_owned(&req(), opts(5, 7)).unwrap();
    let e = one_admit(&events);
    assert_eq!(
        (
            e.admission_id,
            e.limit_revision,
            e.priority,
            e.reserved_tokens
        ),
        (normal.admission_id(), REV, Priority::Normal, 12)
    );
    assert_ne!(normal.admission_id(), high.admission_id());

    // Out of slots.
    let refused = rejection(bulkhead.try_acquire(&req(), fixed()));
    let e = one_reject(&events);
    assert_eq!(
        (e.reason, e.limit_revision),
        (RejectReason::ConcurrencyLimit, REV)
    );
    assert_eq!(e.detail, *refused.detail());
    let d = e.detail;
    assert_eq!(
        (d.in_flight, d.max_concurrent, d.pending, d.max_queue),
        (2, 2, 0, 0)
    );
    assert_eq!(e.queue_wait, Duration::ZERO);

    // Out of tokens (checked before slots).
    let refused = rejection(bulkhead.try_acquire(&req(), opts(0, 4000)));
    let e = one_reject(&events);
    assert_eq!(
        (e.reason, e.limit_revision),
        (RejectReason::BudgetLimit, REV)
    );
    assert_eq!(e.detail, *refused.detail());
    let t = e.detail.token_budget.unwrap();
    assert_eq!(
        (
            t.budget,
            t.in_flight_tokens,
            t.effective_budget,
            t.available,
            t.requested
        ),
        (5000, 1112, 5000, 3888, 4000)
    );

    // The revision in events follows applied limits.
    bulkhead
        .apply_limits(Limits::new(REV + 1, 0).with_token_budget(5000, 0))
        .unwrap();
    assert_eq!(events.take_kinds(), [EventKind::Reconfigure]);
    rejection(bulkhead.try_acquire(&req(), opts(0, 1)));
    let e = one_reject(&events);
    assert_eq!(
        (e.reason, e.limit_revision),
        (RejectReason::ConcurrencyLimit, REV + 1)
    );
    drop((high, normal));
    assert_eq!(
        events.take_kinds(),
        [EventKind::Release, EventKind::Release]
    );

    // Closed.
    bulkhead.close();
    rejection(bulkhead.try_acquire(&req(), fixed()));
    assert_eq!(one_reject(&events).reason, RejectReason::Shutdown);
}

#[test]
fn admit_events_without_a_budget_reserve_zero_tokens() {
    let bulkhead = plain(1);
    let events = Recorder::only(&bulkhead, &[EventKind::Admit, EventKind::Release]);
    let permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let e = one_admit(&events);
    assert_eq!(
        (e.admission_id, e.reserved_tokens, e.limit_revision),
        (permit.admission_id(), 0, REV)
    );
    drop(permit);
    assert_eq!(release_figures(&one_release(&events)), (0, 0, 0, 0, None));
}

#[test]
fn usage_and_release_events_carry_ids_priority_and_revision() {
    let bulkhead = budgeted(2, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage, EventKind::Release]);
    let mut permit = bulkhead
        .try_acquire_owned(&req(), fixed().priority(Priority::High))
        .unwrap();
    // Limits applied after admission do not change what the admission's events say.
    bulkhead
        .apply_limits(Limits::new(REV + 5, 2).with_token_budget(6000, 0))
        .unwrap();
    let id = permit.admission_id();
    permit.report_usage(usage(20, 5)).unwrap();
    let e = one_usage(&events);
    assert_eq!(
        (e.admission_id, e.limit_revision, e.priority),
        (id, REV, Priority::High)
    );
    permit.release(Some(usage(20, 80)));
    let e = one_release(&events);
    assert_eq!(
        (e.admission_id, e.limit_revision, e.priority),
        (id, REV, Priority::High)
    );
    assert_eq!(
        release_figures(&e),
        (1100, 1020, 920, 1, Some(usage(20, 80)))
    );
}

#[test]
fn reconfigure_events_carry_previous_and_current_limits() {
    let bulkhead = budgeted(2, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Reconfigure]);
    let initial = Limits::new(REV, 2).with_token_budget(5000, 0);
    let next = Limits::new(REV + 1, 3)
        .with_max_queue(2)
        .with_token_budget(6000, 500);
    assert_eq!(
        bulkhead.apply_limits(next.clone()).unwrap(),
        ApplyOutcome::Applied {
            previous: initial.clone(),
            current: next.clone()
        }
    );
    let e = one_reconfigure(&events);
    assert_eq!((e.previous, e.current), (initial, next.clone()));

    let now = bulkhead.set_budget(7000).unwrap();
    assert_eq!(
        now,
        Limits::new(REV + 2, 3)
            .with_max_queue(2)
            .with_token_budget(7000, 500)
    );
    let e = one_reconfigure(&events);
    assert_eq!((e.previous, e.current), (next.clone(), now));

    // Stale and invalid snapshots apply nothing and emit nothing.
    assert!(!bulkhead.apply_limits(next.clone()).unwrap().is_applied());
    assert_eq!(
        bulkhead.apply_limits(Limits::new(REV + 9, 3)).unwrap_err(),
        LimitsError::TokenBudgetRequired
    );
    assert!(events.take().is_empty());
}

#[test]
fn events_of_a_run_come_in_order_admit_usage_release() {
    let bulkhead = budgeted(2, 5000);
    let events = Recorder::all(&bulkhead);
    let id = block_on(bulkhead.run(&req(), fixed(), async |mut ctx| {
        ctx.report_usage(usage(20, 5))?;
        ctx.report_usage(usage(20, 5))?; // stale: no event
        ctx.report_usage_progressive(usage(20, 105), progressive(900, 0))?;
        Ok::<_, UsageError>(ctx.admission_id().unwrap())
    }))
    .unwrap();
    let seen = events.take();
    assert_eq!(
        seen.iter().map(Seen::kind).collect::<Vec<_>>(),
        [
            EventKind::Admit,
            EventKind::Usage,
            EventKind::Usage,
            EventKind::Release
        ]
    );
    match (&seen[0], &seen[1], &seen[2], &seen[3]) {
        (Seen::Admit(a), Seen::Usage(u1), Seen::Usage(u2), Seen::Release(r)) => {
            assert_eq!(
                [
                    a.admission_id,
                    u1.admission_id,
                    u2.admission_id,
                    r.admission_id
                ],
                [id; 4]
            );
            assert_eq!(moved(u1), (1, 1100, 1100, 1020, -80));
            assert_eq!(moved(u2), (2, 1100, 1020, 900, -120));
            assert_eq!(
                release_figures(r),
                (1100, 900, 775, 2, Some(usage(20, 105)))
            );
        }
        other => panic!("unexpected events {other:?}"),
    }

    // run_with_usage: the extracted usage wins at release.
    block_on(bulkhead.run_with_usage(
        &req(),
        fixed(),
        |n: &u64| TokenUsage::new(*n, 1).ok(),
        async |mut ctx| {
            ctx.report_usage(usage(20, 5)).unwrap();
            Ok::<u64, std::io::Error>(60)
        },
    ))
    .unwrap();
    let seen = events.take();
    assert_eq!(seen.len(), 3);
    match &seen[2] {
        Seen::Release(r) => {
            assert_eq!(release_figures(r), (1100, 1020, 959, 1, Some(usage(60, 1))))
        }
        other => panic!("expected the release last, got {other:?}"),
    }
}
