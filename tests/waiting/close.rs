//! `close` while calls wait.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::thread;

use async_bulkhead_llm::futures::Acquire;
use async_bulkhead_llm::{AcquireOptions, LlmRequest, RejectReason};
use futures::executor::block_on;

use crate::common::waiters::{full_with_queue, poll_once};
use crate::support::{
    PATIENCE, WakeCount, count, counting_waker, figures, opts, plain, poll_with, queued, ready,
    reason_of, rejection, req, wait_until, within,
};

/// An empty request for futures that outlive the statement that made them (an acquire
/// borrows its request until its first poll).
static EMPTY_REQUEST: std::sync::LazyLock<async_bulkhead_llm::LlmRequest> =
    std::sync::LazyLock::new(async_bulkhead_llm::LlmRequest::new);

#[test]
fn close_refuses_every_waiter_with_shutdown_at_once() {
    let bulkhead = plain(1, 8);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let wakers: Vec<(Waker, Arc<WakeCount>)> = (0..3).map(|_| counting_waker()).collect();
    let mut waiters: Vec<Pin<Box<Acquire<'_, 'static>>>> = wakers
        .iter()
        .map(|(waker, _)| {
            let mut fut = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, within(PATIENCE)));
            assert!(poll_with(&mut fut, waker).is_pending());
            fut
        })
        .collect();
    let unpolled_later = queued(&bulkhead, opts());

    assert!(bulkhead.close());
    // Refused and counted at once, before any future runs again; every waiter was woken.
    let stats = bulkhead.stats();
    assert_eq!((stats.pending, stats.in_flight, stats.closed), (0, 1, true));
    assert_eq!(stats.rejected_by_reason.shutdown, 4);
    assert!(wakers.iter().all(|(_, c)| c.get() == 1));
    for waiter in &mut waiters {
        let refused = rejection(ready(waiter));
        assert_eq!(refused.reason(), RejectReason::Shutdown);
    }
    // Dropping a refused future that never looked at its refusal counts nothing more.
    drop(unpolled_later);
    assert_eq!(count(&bulkhead, RejectReason::Aborted), 0);

    // Nothing is admitted afterwards; the permit in flight releases normally.
    let mut late = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, opts()));
    assert_eq!(reason_of(ready(&mut late)), RejectReason::Shutdown);
    drop(held);
    assert_eq!(figures(&bulkhead), (0, 0, 1));
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts())),
        RejectReason::Shutdown
    );
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.released,
            stats.rejected,
            stats.rejected_by_reason.shutdown
        ),
        (1, 6, 6)
    );
}

#[test]
fn close_keeps_a_slot_already_handed_over() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut a = queued(&bulkhead, opts());
    let mut b = queued(&bulkhead, opts());
    drop(held);
    assert!(bulkhead.close());
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    assert_eq!(reason_of(ready(&mut b)), RejectReason::Shutdown);
    let pa = ready(&mut a).expect("A was handed the slot before the close");
    drop(pa);
    assert_eq!(figures(&bulkhead), (0, 0, 2));
    assert_eq!(bulkhead.stats().rejected, 1);
}

#[test]
fn close_wakes_a_waiter_awaited_on_another_thread() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let worker = {
        let bulkhead = bulkhead.clone();
        thread::spawn(move || reason_of(block_on(bulkhead.acquire_owned(&req(), opts()))))
    };
    wait_until("the worker is queued", || bulkhead.stats().pending == 1);
    bulkhead.close();
    assert_eq!(
        worker.join().expect("worker did not panic"),
        RejectReason::Shutdown
    );
    drop(held);
    assert_eq!(figures(&bulkhead), (0, 0, 1));
}

#[test]
fn a_release_wakes_a_waiter_awaited_on_another_thread() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let worker = {
        let bulkhead = bulkhead.clone();
        thread::spawn(move || {
            let permit = block_on(bulkhead.acquire_owned(&req(), opts())).expect("handed the slot");
            permit.limit_revision()
        })
    };
    wait_until("the worker is queued", || bulkhead.stats().pending == 1);
    drop(held);
    assert_eq!(worker.join().expect("worker did not panic"), 0);
    assert_eq!(figures(&bulkhead), (0, 0, 2));
}

// ===== the refusal detail of waiters refused by `close()` =====

#[test]
fn close_refuses_every_waiter_with_the_state_after_the_close() {
    let (bulkhead, held) = full_with_queue(2);
    let mut first = bulkhead.acquire_owned(&LlmRequest::new(), AcquireOptions::new());
    let mut second = bulkhead.acquire_owned(&LlmRequest::new(), AcquireOptions::new());
    assert!(poll_once(&mut first, Waker::noop()).is_pending());
    assert!(poll_once(&mut second, Waker::noop()).is_pending());
    assert_eq!(bulkhead.stats().pending, 2);
    bulkhead.close();
    for future in [&mut first, &mut second] {
        let Poll::Ready(Err(error)) = poll_once(future, Waker::noop()) else {
            panic!("refused by the close");
        };
        let rejection = error.rejection().unwrap();
        assert_eq!(rejection.reason(), RejectReason::Shutdown);
        let detail = rejection.detail();
        assert_eq!((detail.pending, detail.in_flight), (0, 1));
    }
    drop(held);
}
