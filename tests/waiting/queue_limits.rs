//! Limits of queueing: `max_queue`, zero concurrency, `try_acquire`.

use async_bulkhead_llm::{Limits, RejectReason};

use crate::support::{
    PATIENCE, budgeted, count, figures, opts, plain, queued, ready, reason_of, rejection, req,
    tokens, toks, within,
};

/// An empty request for futures that outlive the statement that made them (an acquire
/// borrows its request until its first poll).
static EMPTY_REQUEST: std::sync::LazyLock<async_bulkhead_llm::LlmRequest> =
    std::sync::LazyLock::new(async_bulkhead_llm::LlmRequest::new);

#[test]
fn a_full_queue_refuses_queue_limit_with_pending_equal_to_max_queue() {
    let bulkhead = plain(1, 2);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let a = queued(&bulkhead, opts());
    let _b = queued(&bulkhead, opts());
    let mut c = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, opts()));
    let refused = rejection(ready(&mut c));
    assert_eq!(refused.reason(), RejectReason::QueueLimit);
    let d = refused.detail();
    assert_eq!(
        (d.in_flight, d.max_concurrent, d.pending, d.max_queue),
        (1, 1, 2, 2)
    );
    assert_eq!(refused.limit_revision(), 0);
    let mut owned = Box::pin(bulkhead.acquire_owned(&req(), opts()));
    assert_eq!(reason_of(ready(&mut owned)), RejectReason::QueueLimit);
    assert_eq!(bulkhead.stats().pending, 2);
    assert_eq!(count(&bulkhead, RejectReason::QueueLimit), 2);

    // A place freed by a cancellation can be taken again.
    drop(a);
    assert_eq!(bulkhead.stats().pending, 1);
    let _again = queued(&bulkhead, opts());
    assert_eq!(bulkhead.stats().pending, 2);
    drop(held);
}

#[test]
fn zero_max_concurrent_never_queues_even_with_a_queue() {
    let bulkhead = plain(0, 5);
    let mut fut = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, opts()));
    let refused = rejection(ready(&mut fut));
    assert_eq!(refused.reason(), RejectReason::ConcurrencyLimit);
    assert_eq!(
        (refused.detail().pending, refused.detail().max_queue),
        (0, 5)
    );
    assert_eq!(bulkhead.stats().pending, 0);

    // The same when the limit drops to 0 at runtime.
    let bulkhead = plain(1, 5);
    bulkhead
        .apply_limits(Limits::new(1, 0).with_max_queue(5))
        .expect("valid limits");
    let mut fut = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, within(PATIENCE)));
    assert_eq!(reason_of(ready(&mut fut)), RejectReason::ConcurrencyLimit);
    let mut owned = Box::pin(bulkhead.acquire_owned(&req(), opts()));
    assert_eq!(reason_of(ready(&mut owned)), RejectReason::ConcurrencyLimit);
    assert_eq!(bulkhead.stats().pending, 0);
    assert_eq!(count(&bulkhead, RejectReason::ConcurrencyLimit), 2);
}

#[test]
fn zero_max_queue_refuses_concurrency_limit() {
    let bulkhead = plain(1, 0);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut fut = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, within(PATIENCE)));
    let refused = rejection(ready(&mut fut));
    assert_eq!(refused.reason(), RejectReason::ConcurrencyLimit);
    assert_eq!(
        (refused.detail().pending, refused.detail().max_queue),
        (0, 0)
    );
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    assert_eq!(bulkhead.stats().rejected, 1);
    drop(held);
}

#[test]
fn try_acquire_never_queues() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts())),
        RejectReason::ConcurrencyLimit
    );
    assert_eq!(
        reason_of(bulkhead.try_acquire_owned(&req(), within(PATIENCE))),
        RejectReason::ConcurrencyLimit
    );
    assert_eq!(bulkhead.stats().pending, 0);
    // With the queue full, try_acquire still says concurrency_limit: it never looks at the queue.
    let _w = (0..4)
        .map(|_| queued(&bulkhead, opts()))
        .collect::<Vec<_>>();
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts())),
        RejectReason::ConcurrencyLimit
    );
    assert_eq!(bulkhead.stats().pending, 4);
    assert_eq!(count(&bulkhead, RejectReason::ConcurrencyLimit), 3);
    assert_eq!(count(&bulkhead, RejectReason::QueueLimit), 0);
    drop(held);
}

#[test]
fn an_acquire_never_polled_counts_nothing_and_holds_nothing() {
    let bulkhead = budgeted(1, 4, 1000);
    let held = bulkhead.try_acquire(&req(), toks(100)).expect("free slot");
    let fut = bulkhead.acquire(&EMPTY_REQUEST, toks(100));
    let owned = bulkhead.acquire_owned(&req(), toks(100));
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    drop(fut);
    drop(owned);
    let stats = bulkhead.stats();
    assert_eq!((stats.pending, stats.rejected), (0, 0));
    drop(held);
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 0);
}
