//! Admission timing: decision time and queue wait (design §U11.3).

use std::thread;
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, RejectReason, TokenBudget, events::EventKind,
};
use futures::executor::block_on;

use crate::common::usage_fixtures::{
    PATIENCE, Recorder, budgeted, fixed, one_admit, one_reject, opts, poll_once, rejection, req,
    usage,
};

/// An empty request for futures that outlive the statement that made them (an acquire
/// borrows its request until its first poll).
static EMPTY_REQUEST: std::sync::LazyLock<async_bulkhead_llm::LlmRequest> =
    std::sync::LazyLock::new(async_bulkhead_llm::LlmRequest::new);

/// How long the queued call is made to wait.
const WAIT: Duration = Duration::from_millis(30);

#[test]
fn an_immediate_admission_has_zero_queue_wait_and_a_bounded_decision_time() {
    let bulkhead = budgeted(2, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Admit, EventKind::Reject]);
    let started = Instant::now();
    let permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let elapsed = started.elapsed();
    let e = one_admit(&events);
    assert_eq!(e.queue_wait, Duration::ZERO);
    assert!(e.decision_duration <= elapsed, "{e:?} vs {elapsed:?}");

    // The waiting acquire admitted at once is timed the same way.
    let started = Instant::now();
    let second = block_on(bulkhead.acquire(&req(), fixed())).unwrap();
    let elapsed = started.elapsed();
    let e = one_admit(&events);
    assert_eq!(e.queue_wait, Duration::ZERO);
    assert!(e.decision_duration <= elapsed, "{e:?} vs {elapsed:?}");
    drop((permit, second));
}

#[test]
fn immediate_rejections_have_zero_queue_wait() {
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .max_queue(1)
        .token_budget(TokenBudget::new(5000))
        .build()
        .unwrap();
    let events = Recorder::only(&bulkhead, &[EventKind::Reject]);
    let _held = bulkhead.try_acquire(&req(), fixed()).unwrap();

    // try_acquire out of slots; acquire out of tokens.
    let started = Instant::now();
    rejection(bulkhead.try_acquire(&req(), fixed()));
    let elapsed = started.elapsed();
    let e = one_reject(&events);
    assert_eq!(e.reason, RejectReason::ConcurrencyLimit);
    assert_eq!(e.queue_wait, Duration::ZERO);
    assert!(e.decision_duration <= elapsed);

    rejection(block_on(bulkhead.acquire(&req(), opts(0, 4000))));
    let e = one_reject(&events);
    assert_eq!(e.reason, RejectReason::BudgetLimit);
    assert_eq!(e.queue_wait, Duration::ZERO);

    // acquire with the queue full.
    let mut waiting = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, fixed()));
    assert!(poll_once(&mut waiting).is_pending());
    rejection(block_on(bulkhead.acquire(&req(), fixed())));
    let e = one_reject(&events);
    assert_eq!(e.reason, RejectReason::QueueLimit);
    assert_eq!(e.queue_wait, Duration::ZERO);
    drop(waiting);
    // The withdrawn waiter is refused `aborted` after some wait.
    let e = one_reject(&events);
    assert_eq!(e.reason, RejectReason::Aborted);
}

#[test]
fn a_call_that_waited_reports_its_queue_wait_apart_from_its_decision_time() {
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .max_queue(4)
        .token_budget(TokenBudget::new(5000))
        .build()
        .unwrap();
    let events = Recorder::only(&bulkhead, &[EventKind::Admit, EventKind::Reject]);
    let first = bulkhead.try_acquire_owned(&req(), fixed()).unwrap();
    events.take();

    let started = Instant::now();
    let mut waiting = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, fixed().timeout(PATIENCE)));
    assert!(poll_once(&mut waiting).is_pending());
    assert_eq!(bulkhead.stats().pending, 1);
    // Released from another thread after WAIT, i.e. at least WAIT after the call queued.
    let releaser = thread::spawn(move || {
        thread::sleep(WAIT);
        first.release(Some(usage(1, 1)));
    });
    let second = block_on(waiting).unwrap();
    let elapsed = started.elapsed();
    releaser.join().unwrap();

    let e = one_admit(&events);
    assert_eq!(e.admission_id, second.admission_id());
    assert!(e.queue_wait >= WAIT, "{e:?}");
    assert!(e.queue_wait <= elapsed, "{e:?} vs {elapsed:?}");
    // The decision time excludes the wait: both fit in the call's span together.
    assert!(
        e.queue_wait + e.decision_duration <= elapsed,
        "{e:?} vs {elapsed:?}"
    );
    assert_eq!(e.reserved_tokens, 1100);
}

#[test]
fn a_queue_timeout_reports_the_whole_wait() {
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .max_queue(4)
        .token_budget(TokenBudget::new(5000))
        .build()
        .unwrap();
    let events = Recorder::only(&bulkhead, &[EventKind::Reject]);
    let _held = bulkhead.try_acquire(&req(), fixed()).unwrap();

    // Blocking and async waits, each timing out.
    let started = Instant::now();
    let refused = rejection(bulkhead.acquire_blocking(&req(), fixed().timeout(WAIT)));
    let elapsed = started.elapsed();
    assert_eq!(refused.reason(), RejectReason::Timeout);
    let e = one_reject(&events);
    assert_eq!(e.reason, RejectReason::Timeout);
    let wait = e.queue_wait;
    // The wait is measured from the instant the deadline counts from.
    assert!(wait >= WAIT, "{e:?}");
    assert!(
        wait + e.decision_duration <= elapsed,
        "{e:?} vs {elapsed:?}"
    );

    let refused = rejection(block_on(bulkhead.acquire(&req(), fixed().timeout(WAIT))));
    assert_eq!(refused.reason(), RejectReason::Timeout);
    let e = one_reject(&events);
    assert!(e.queue_wait >= WAIT, "{e:?}");
    assert_eq!(e.detail, *refused.detail());
}

#[test]
fn a_cancelled_waiter_reports_how_long_it_waited() {
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .max_queue(4)
        .build()
        .unwrap();
    let events = Recorder::only(&bulkhead, &[EventKind::Reject]);
    let _held = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let mut waiting = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, AcquireOptions::new()));
    assert!(poll_once(&mut waiting).is_pending());
    thread::sleep(WAIT);
    drop(waiting);
    let e = one_reject(&events);
    assert_eq!(e.reason, RejectReason::Aborted);
    assert!(e.queue_wait >= WAIT, "{e:?}");
}
