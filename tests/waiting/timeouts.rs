//! Queue timeouts: per call, the bulkhead's default, profiles. That they fire on every executor
//! (tokio, smol, async-std, `futures::executor`) is checked by the stress member's
//! `timeouts_on_every_runtime` test, which has those runtimes as dev-dependencies.

use std::thread;
use std::time::{Duration, Instant};

use async_bulkhead_llm::{LlmBulkhead, Profile, RejectReason};
use futures::executor::block_on;

use crate::support::{
    PATIENCE, SHORT, assert_pending, count, figures, opts, plain, queued, ready, reason_of,
    rejection, req, within,
};

/// An empty request for futures that outlive the statement that made them (an acquire
/// borrows its request until its first poll).
static EMPTY_REQUEST: std::sync::LazyLock<async_bulkhead_llm::LlmRequest> =
    std::sync::LazyLock::new(async_bulkhead_llm::LlmRequest::new);

#[test]
fn a_per_call_timeout_refuses_timeout_and_leaves_the_queue() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let started = Instant::now();
    let mut a = queued(&bulkhead, within(SHORT));
    let mut b = queued(&bulkhead, opts());
    let refused = rejection(block_on(&mut a));
    let waited = started.elapsed();
    assert_eq!(refused.reason(), RejectReason::Timeout);
    assert!(
        waited >= SHORT && waited < PATIENCE,
        "timed out after {waited:?}"
    );
    assert_eq!(refused.detail().pending, 1, "only B is left in the queue");
    let stats = bulkhead.stats();
    assert_eq!((stats.pending, stats.rejected), (1, 1));
    assert_eq!(stats.rejected_by_reason.timeout, 1);
    drop(held);
    let permit = ready(&mut b).expect("B is now first");
    drop(permit);
    assert_eq!(figures(&bulkhead), (0, 0, 2));
}

#[test]
fn the_bulkhead_default_timeout_applies_when_the_call_sets_none() {
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .max_queue(4)
        .queue_timeout(SHORT)
        .build()
        .expect("valid configuration");
    assert_eq!(bulkhead.queue_timeout(), Some(SHORT));
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let started = Instant::now();
    assert_eq!(
        reason_of(block_on(bulkhead.acquire(&req(), opts()))),
        RejectReason::Timeout
    );
    assert!(started.elapsed() >= SHORT);
    assert_eq!(
        reason_of(block_on(bulkhead.acquire_owned(&req(), opts()))),
        RejectReason::Timeout
    );
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.pending,
            stats.in_flight,
            stats.rejected_by_reason.timeout
        ),
        (0, 1, 2)
    );
    drop(held);
}

#[test]
fn a_per_call_timeout_overrides_the_default() {
    // Shorter than the default: it fires long before the default would.
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .max_queue(4)
        .queue_timeout(PATIENCE)
        .build()
        .expect("valid configuration");
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let started = Instant::now();
    assert_eq!(
        reason_of(block_on(bulkhead.acquire(&req(), within(SHORT)))),
        RejectReason::Timeout
    );
    assert!(started.elapsed() < PATIENCE / 2);
    drop(held);

    // Longer than the default: a call that queued before one relying on the default outlives it.
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .max_queue(4)
        .queue_timeout(SHORT)
        .build()
        .expect("valid configuration");
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut patient = queued(&bulkhead, within(PATIENCE));
    let mut default = queued(&bulkhead, opts());
    assert_eq!(
        reason_of(block_on(&mut default)),
        RejectReason::Timeout,
        "the default applies to the call that set none"
    );
    assert_pending(&mut patient);
    assert_eq!(bulkhead.stats().pending, 1);
    drop(held);
    drop(ready(&mut patient).expect("still waiting, then served"));
    assert_eq!(count(&bulkhead, RejectReason::Timeout), 1);
}

#[test]
fn profile_default_timeouts_apply_to_the_queue() {
    let custom = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Custom {
            max_queue: 2,
            timeout: Some(SHORT),
        })
        .build()
        .expect("valid configuration");
    assert_eq!(custom.queue_timeout(), Some(SHORT));
    let held = custom.try_acquire(&req(), opts()).expect("free slot");
    assert_eq!(
        reason_of(block_on(custom.acquire(&req(), opts()))),
        RejectReason::Timeout
    );
    assert_eq!(custom.stats().pending, 0);
    drop(held);

    // Batch waits 30 s by default: a call without a timeout outlives one with a short one.
    let batch = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Batch)
        .build()
        .expect("valid configuration");
    assert_eq!(batch.queue_timeout(), Some(Duration::from_secs(30)));
    let held = batch.try_acquire(&req(), opts()).expect("free slot");
    let mut default = queued(&batch, opts());
    let mut short = queued(&batch, within(SHORT));
    assert_eq!(reason_of(block_on(&mut short)), RejectReason::Timeout);
    assert_pending(&mut default);
    drop(held);
    drop(ready(&mut default).expect("served after the release"));
    assert_eq!(figures(&batch), (0, 0, 2));
}

#[test]
fn a_timeout_bounds_only_the_queue_wait() {
    let bulkhead = plain(2, 4);
    let mut instant = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, within(Duration::ZERO)));
    let p1 = ready(&mut instant).expect("a free slot admits at once, whatever the timeout");
    let mut tiny = Box::pin(bulkhead.acquire_owned(&req(), within(Duration::from_nanos(1))));
    let p2 = ready(&mut tiny).expect("a free slot admits at once");
    thread::sleep(Duration::from_millis(5)); // both timeouts are long past
    assert_eq!(figures(&bulkhead), (2, 0, 2));
    assert_eq!(bulkhead.stats().rejected, 0);

    // A slot handed over before the deadline is kept even if the future is polled after it.
    let mut waiter = queued(&bulkhead, within(Duration::from_millis(5)));
    drop(p1);
    thread::sleep(Duration::from_millis(15));
    let p3 = ready(&mut waiter).expect("the hand-off won before the deadline");
    assert_eq!(count(&bulkhead, RejectReason::Timeout), 0);
    assert_eq!(figures(&bulkhead), (2, 0, 3));
    drop((p2, p3));
    assert_eq!(figures(&bulkhead), (0, 0, 3));
}

#[test]
fn a_zero_timeout_queues_and_times_out_at_the_first_check() {
    let bulkhead = plain(1, 1);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut zero = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, within(Duration::ZERO)));
    let refused = rejection(ready(&mut zero));
    // `timeout`, not `concurrency_limit`: it did join the queue, then gave up at once.
    assert_eq!(refused.reason(), RejectReason::Timeout);
    assert_eq!(refused.detail().pending, 0);
    assert_eq!(bulkhead.stats().pending, 0);
    assert_eq!(count(&bulkhead, RejectReason::Timeout), 1);
    assert_eq!(
        reason_of(bulkhead.acquire_blocking(&req(), within(Duration::ZERO))),
        RejectReason::Timeout
    );

    // The queue is judged first: a full queue says queue_limit, no queue concurrency_limit.
    let _w = queued(&bulkhead, opts());
    let mut zero = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, within(Duration::ZERO)));
    assert_eq!(reason_of(ready(&mut zero)), RejectReason::QueueLimit);
    let no_queue = plain(1, 0);
    let _h = no_queue.try_acquire(&req(), opts()).expect("free slot");
    let mut zero = Box::pin(no_queue.acquire(&EMPTY_REQUEST, within(Duration::ZERO)));
    assert_eq!(reason_of(ready(&mut zero)), RejectReason::ConcurrencyLimit);

    assert_eq!(count(&bulkhead, RejectReason::Timeout), 2);
    assert_eq!(count(&bulkhead, RejectReason::QueueLimit), 1);
    drop(held);
}
