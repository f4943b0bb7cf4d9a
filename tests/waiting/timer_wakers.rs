//! The timer thread and user wakers: a waker that panics, blocks, or owns a timed task does
//! not stop the timer, hold back other timeouts, or get dropped under the timer's lock.
//!
//! Each scenario hung, aborted or broke the timer before its fix, so each runs in a
//! child process with a watchdog (`crate::common::child_process::isolated`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

use async_bulkhead_llm::futures::AcquireOwned;
use async_bulkhead_llm::{AcquireError, AcquireOptions, LlmRequest, RejectReason};

use crate::common::child_process::isolated;
use crate::common::waiters::{full_with_queue, poll_once};

/// A waker that counts its wake-ups.
#[derive(Default)]
struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A waker whose `wake` panics.
struct PanicsOnWake;

impl Wake for PanicsOnWake {
    fn wake(self: Arc<Self>) {
        panic!("waker panics");
    }
}

/// A queue timeout on a fresh bulkhead completes about on time (blocking acquire on the
/// futures executor, which only polls again when woken).
fn short_timeout_fires(within: Duration) {
    let (bulkhead, _held) = full_with_queue(1);
    let started = Instant::now();
    let options = AcquireOptions::new().timeout(Duration::from_millis(20));
    let result = futures::executor::block_on(bulkhead.acquire(&LlmRequest::new(), options));
    let took = started.elapsed();
    match result {
        Err(AcquireError::Rejected(r)) => assert_eq!(r.reason(), RejectReason::Timeout),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(
        took >= Duration::from_millis(20) && took < within,
        "a 20 ms timeout completed after {took:?}"
    );
}

fn panicking_waker_scenario() {
    let (bulkhead, _held) = full_with_queue(1);
    let waker = Waker::from(Arc::new(PanicsOnWake));
    let mut waiting = bulkhead.acquire_owned(
        &LlmRequest::new(),
        AcquireOptions::new().timeout(Duration::from_millis(5)),
    );
    assert!(poll_once(&mut waiting, &waker).is_pending());
    // Let the timer call (and survive) the panicking waker.
    std::thread::sleep(Duration::from_millis(50));
    for _ in 0..3 {
        short_timeout_fires(Duration::from_millis(1_000));
    }
    drop(waiting);
}

#[test]
fn a_panicking_waker_does_not_stop_the_timer() {
    isolated(
        "timer_wakers::a_panicking_waker_does_not_stop_the_timer",
        Duration::from_secs(30),
        panicking_waker_scenario,
    );
}

/// A waker whose `wake` blocks for a while.
struct BlocksOnWake(Duration);

impl Wake for BlocksOnWake {
    fn wake(self: Arc<Self>) {
        std::thread::sleep(self.0);
    }
}

fn blocking_waker_scenario() {
    let (bulkhead, _held) = full_with_queue(2);
    let waker = Waker::from(Arc::new(BlocksOnWake(Duration::from_millis(1_500))));
    let mut stuck = bulkhead.acquire_owned(
        &LlmRequest::new(),
        AcquireOptions::new().timeout(Duration::from_millis(10)),
    );
    assert!(poll_once(&mut stuck, &waker).is_pending());
    // The blocking waker is called at about 10 ms and holds its thread for 1.5 s; an unrelated
    // 20 ms timeout registered now must not wait for it.
    std::thread::sleep(Duration::from_millis(15));
    short_timeout_fires(Duration::from_millis(500));
    drop(stuck);
}

#[test]
fn a_blocking_waker_does_not_hold_back_other_timeouts() {
    isolated(
        "timer_wakers::a_blocking_waker_does_not_hold_back_other_timeouts",
        Duration::from_secs(30),
        blocking_waker_scenario,
    );
}

// ===== a waker dropped under the timer lock =====

/// A waker that owns a task: here, another timed acquire future. Dropping the last reference
/// drops that future, which cancels its own timer registration.
struct OwnsTask(Mutex<Option<AcquireOwned>>);

impl Wake for OwnsTask {
    fn wake(self: Arc<Self>) {
        // A real task would poll its future here; these scenarios never wake it.
        drop(self.0.lock().unwrap().take());
    }
}

fn replaced_waker_scenario() {
    let (bulkhead, _held) = full_with_queue(4);
    let timeout = AcquireOptions::new().timeout(Duration::from_secs(60));
    // The task the first waker owns: a queued acquire with a live timer registration.
    let mut owned = bulkhead.acquire_owned(&LlmRequest::new(), timeout);
    assert!(poll_once(&mut owned, Waker::noop()).is_pending());
    let first = Waker::from(Arc::new(OwnsTask(Mutex::new(Some(owned)))));

    // A second queued acquire, polled by the first task, then moved to another task: the
    // timer replaces the first waker by the second, dropping the first's last reference.
    let mut moved = bulkhead.acquire_owned(&LlmRequest::new(), timeout);
    assert!(poll_once(&mut moved, &first).is_pending());
    drop(first);
    let second = Waker::from(Arc::new(Count::default()));
    assert!(poll_once(&mut moved, &second).is_pending());
    assert_eq!(
        bulkhead.stats().rejected_by_reason.aborted,
        1,
        "the owned task was dropped"
    );

    // Cancelling (dropping a registered acquire) drops its waker outside the lock too.
    let mut other = bulkhead.acquire_owned(&LlmRequest::new(), timeout);
    let mut inner = bulkhead.acquire_owned(&LlmRequest::new(), timeout);
    assert!(poll_once(&mut inner, Waker::noop()).is_pending());
    let owner = Waker::from(Arc::new(OwnsTask(Mutex::new(Some(inner)))));
    assert!(poll_once(&mut other, &owner).is_pending());
    drop(owner);
    drop(other);
    drop(moved);
    assert_eq!(bulkhead.stats().rejected_by_reason.aborted, 4);
    // The timer still works.
    short_timeout_fires(Duration::from_millis(1_000));
}

#[test]
fn a_waker_that_owns_a_timed_task_is_dropped_outside_the_timer_lock() {
    isolated(
        "timer_wakers::a_waker_that_owns_a_timed_task_is_dropped_outside_the_timer_lock",
        Duration::from_secs(30),
        replaced_waker_scenario,
    );
}
