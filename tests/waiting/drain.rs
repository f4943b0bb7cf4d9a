//! `drain` and `drain_timeout` (Q5: a drain completes whenever the bulkhead becomes idle).

use std::time::{Duration, Instant};

use async_bulkhead_llm::{Limits, RejectReason};
use futures::executor::block_on;

use crate::support::{
    PATIENCE, SHORT, assert_pending, budgeted, count, counting_waker, figures, opts, parts, plain,
    poll_now, poll_with, queued, ready, reason_of, req, toks, within,
};

#[test]
fn drain_resolves_at_once_when_idle() {
    let bulkhead = plain(1, 4);
    let mut drain = Box::pin(bulkhead.drain());
    assert!(poll_now(&mut drain).is_ready());
    let mut report = Box::pin(bulkhead.drain_timeout(Duration::ZERO));
    assert_eq!(parts(ready(&mut report)), (true, 0, 0));
    assert_eq!(
        parts(block_on(bulkhead.drain_timeout(PATIENCE))),
        (true, 0, 0)
    );

    // Busy: a zero timeout answers "not idle" at once.
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let _w = queued(&bulkhead, opts());
    let mut report = Box::pin(bulkhead.drain_timeout(Duration::ZERO));
    assert_eq!(parts(ready(&mut report)), (false, 1, 1));
    drop(held);
}

#[test]
fn drain_resolves_after_the_last_release() {
    let bulkhead = plain(2, 4);
    let p1 = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let p2 = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut a = queued(&bulkhead, opts());
    let (waker, woken) = counting_waker();
    let mut drain = Box::pin(bulkhead.drain());
    assert!(poll_with(&mut drain, &waker).is_pending());

    drop(p1); // hands the slot to A: still busy
    assert!(poll_with(&mut drain, &waker).is_pending());
    let pa = ready(&mut a).expect("handed the slot");
    drop(p2);
    assert!(poll_with(&mut drain, &waker).is_pending());
    assert_eq!(woken.get(), 0);
    drop(pa);
    assert!(woken.get() > 0, "the last release woke the drain");
    assert!(poll_with(&mut drain, &waker).is_ready());
    assert_eq!(figures(&bulkhead), (0, 0, 3));
}

#[test]
fn drain_resolves_when_the_last_waiter_times_out_with_nothing_in_flight() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut a = queued(&bulkhead, within(SHORT));
    bulkhead
        .apply_limits(Limits::new(1, 0).with_max_queue(4))
        .expect("valid limits");
    drop(held);
    assert_eq!(
        figures(&bulkhead),
        (0, 1, 1),
        "A is preserved, nothing in flight"
    );
    let (waker, woken) = counting_waker();
    let mut drain = Box::pin(bulkhead.drain());
    assert!(poll_with(&mut drain, &waker).is_pending());

    assert_eq!(reason_of(block_on(&mut a)), RejectReason::Timeout);
    assert_eq!(figures(&bulkhead), (0, 0, 1));
    assert!(
        woken.get() > 0,
        "the timeout made it idle and woke the drain"
    );
    assert!(poll_with(&mut drain, &waker).is_ready());
}

#[test]
fn drain_resolves_when_the_last_waiter_is_cancelled_with_nothing_in_flight() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let a = queued(&bulkhead, opts());
    let b = queued(&bulkhead, opts());
    bulkhead
        .apply_limits(Limits::new(1, 0).with_max_queue(4))
        .expect("valid limits");
    drop(held);
    let (waker, woken) = counting_waker();
    let mut drain = Box::pin(bulkhead.drain());
    assert!(poll_with(&mut drain, &waker).is_pending());
    drop(a);
    assert!(poll_with(&mut drain, &waker).is_pending(), "B still waits");
    drop(b);
    assert!(
        woken.get() > 0,
        "the cancellation made it idle and woke the drain"
    );
    assert!(poll_with(&mut drain, &waker).is_ready());
    assert_eq!(count(&bulkhead, RejectReason::Aborted), 2);
}

#[test]
fn drain_resolves_when_close_refuses_the_last_waiters() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut a = queued(&bulkhead, opts());
    bulkhead
        .apply_limits(Limits::new(1, 0).with_max_queue(4))
        .expect("valid limits");
    drop(held);
    let (waker, woken) = counting_waker();
    let mut drain = Box::pin(bulkhead.drain());
    assert!(poll_with(&mut drain, &waker).is_pending());
    bulkhead.close();
    assert!(woken.get() > 0, "close made it idle and woke the drain");
    assert!(poll_with(&mut drain, &waker).is_ready());
    assert_eq!(reason_of(ready(&mut a)), RejectReason::Shutdown);
}

#[test]
fn drain_resolves_when_a_limit_change_refuses_the_last_waiter() {
    // Raising the slots gives the waiter its turn, but a smaller budget in the same snapshot
    // leaves its tokens no room: it is refused and the bulkhead becomes idle.
    let bulkhead = budgeted(1, 4, 1000);
    let held = bulkhead.try_acquire(&req(), toks(100)).expect("free slot");
    let mut a = queued(&bulkhead, toks(300));
    bulkhead
        .apply_limits(
            Limits::new(1, 0)
                .with_max_queue(4)
                .with_token_budget(1000, 0),
        )
        .expect("valid limits");
    drop(held);
    let (waker, woken) = counting_waker();
    let mut drain = Box::pin(bulkhead.drain());
    assert!(poll_with(&mut drain, &waker).is_pending());
    bulkhead
        .apply_limits(
            Limits::new(2, 1)
                .with_max_queue(4)
                .with_token_budget(200, 0),
        )
        .expect("valid limits");
    assert_eq!(figures(&bulkhead), (0, 0, 1));
    assert!(
        woken.get() > 0,
        "the refusal made it idle and woke the drain"
    );
    assert!(poll_with(&mut drain, &waker).is_ready());
    assert_eq!(reason_of(ready(&mut a)), RejectReason::BudgetLimit);
}

#[test]
fn drain_timeout_reports_what_is_left_and_cancels_nothing() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut a = queued(&bulkhead, opts());
    let mut b = queued(&bulkhead, opts());
    let started = Instant::now();
    let report = block_on(bulkhead.drain_timeout(SHORT));
    assert!(started.elapsed() >= SHORT);
    assert_eq!(parts(report), (false, 1, 2));
    // Nothing was cancelled or counted; the waiters still wait and are served normally.
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.pending,
            stats.admitted,
            stats.rejected
        ),
        (1, 2, 1, 0)
    );
    assert_pending(&mut a);
    drop(held);
    let pa = ready(&mut a).expect("A served");
    assert_eq!(
        parts(block_on(bulkhead.drain_timeout(Duration::ZERO))),
        (false, 1, 1)
    );
    drop(pa);
    let pb = ready(&mut b).expect("B served");
    let mut bounded = Box::pin(bulkhead.drain_timeout(PATIENCE));
    assert_pending(&mut bounded);
    drop(pb);
    assert_eq!(parts(ready(&mut bounded)), (true, 0, 0));
    assert_eq!(figures(&bulkhead), (0, 0, 3));
}
