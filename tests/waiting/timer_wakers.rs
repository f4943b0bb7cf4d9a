//! The timer thread and user wakers: a waker that panics, blocks, or owns a timed task does
//! not stop the timer, hold back other timeouts, or get dropped under the timer's lock.
//!
//! Each scenario hung, aborted or broke the timer before its fix, so each runs in a
//! child process with a watchdog (`crate::common::child_process::isolated`).
//!
//! Many wakers that block at once: while fewer than the timer's 64 waker threads are stuck, an
//! unrelated timeout is held back by about the timer's 2 ms stall; past the cap, until a waker
//! thread comes free for it. Before the clock rechecked due wakers left without a thread (and
//! started their threads all at once), 2 wakers blocking 300 ms held an unrelated 20 ms timeout
//! back 290 ms, and 40 blocking 150 ms held it back 1.9 s. These run in child processes too:
//! the timer is process-wide, so each scenario's blocked waker threads stay its own.

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

// ===== many wakers that block at once =====

/// Queued acquires whose wakers block, then (in field order, so no slot is handed to one of
/// them) the slot that keeps them queued and their bulkhead.
struct Blocked {
    _acquires: Vec<AcquireOwned>,
    _held: async_bulkhead_llm::OwnedPermit,
    _bulkhead: async_bulkhead_llm::LlmBulkhead,
}

/// `count` queued acquires on a full bulkhead of their own, each timing out after 10 ms and
/// polled once with a waker that blocks for `blocks` when the timer calls it; then how late
/// an unrelated 20 ms queue timeout (another bulkhead, the futures executor) fires past its
/// deadline. The queued acquires and the held slot are returned so that they outlive the
/// measurement (a slot freed here would be handed to a queued acquire, calling its blocking
/// waker on this thread).
fn lateness_behind_blocking_wakers(count: usize, blocks: Duration) -> (Duration, Blocked) {
    let (bulkhead, held) = full_with_queue(count);
    let waker = Waker::from(Arc::new(BlocksOnWake(blocks)));
    let stuck: Vec<AcquireOwned> = (0..count)
        .map(|_| {
            let mut acquire = bulkhead.acquire_owned(
                &LlmRequest::new(),
                AcquireOptions::new().timeout(Duration::from_millis(10)),
            );
            assert!(poll_once(&mut acquire, &waker).is_pending());
            acquire
        })
        .collect();
    let (other, _other_held) = full_with_queue(1);
    let timeout = Duration::from_millis(20);
    let started = Instant::now();
    let result = futures::executor::block_on(
        other.acquire(&LlmRequest::new(), AcquireOptions::new().timeout(timeout)),
    );
    let late = started.elapsed().saturating_sub(timeout);
    match result {
        Err(AcquireError::Rejected(r)) => assert_eq!(r.reason(), RejectReason::Timeout),
        other => panic!("expected a timeout, got {other:?}"),
    }
    eprintln!("{count} wakers blocking {blocks:?}: an unrelated 20 ms timeout fired {late:?} late");
    let blocked = Blocked {
        _acquires: stuck,
        _held: held,
        _bulkhead: bulkhead,
    };
    (late, blocked)
}

fn two_blocking_wakers_scenario() {
    // Both blocking wakers are due at 10 ms and block 300 ms; the unrelated timeout is due at
    // 20 ms, behind them. It used to wait for the first of them to return (about 290 ms late).
    // The first round starts waker threads; the later ones find them idle.
    for _ in 0..3 {
        let (late, _blocked) = lateness_behind_blocking_wakers(2, Duration::from_millis(300));
        assert!(
            late < Duration::from_millis(100),
            "an unrelated 20 ms timeout fired {late:?} late behind two wakers blocking 300 ms"
        );
        // Let this round's wakers return before the next.
        std::thread::sleep(Duration::from_millis(400));
    }
}

#[test]
fn two_blocking_wakers_do_not_hold_back_an_unrelated_timeout() {
    isolated(
        "timer_wakers::two_blocking_wakers_do_not_hold_back_an_unrelated_timeout",
        Duration::from_secs(30),
        two_blocking_wakers_scenario,
    );
}

fn many_blocking_wakers_scenario() {
    // 40 wakers (fewer than the 64 waker threads the timer may run) due at 10 ms, each
    // blocking 150 ms: the clock starts a thread for each of them at once, so the unrelated
    // timeout still finds (or gets) a free thread about a stall after its deadline.
    // The first round starts waker threads; the later ones find them idle (each round's
    // wakers return before the next, so no round needs more than the cap).
    for _ in 0..3 {
        let (late, _blocked) = lateness_behind_blocking_wakers(40, Duration::from_millis(150));
        assert!(
            late < Duration::from_millis(60),
            "an unrelated 20 ms timeout fired {late:?} late behind 40 wakers blocking 150 ms"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn many_blocking_wakers_below_the_thread_cap_do_not_hold_back_an_unrelated_timeout() {
    isolated(
        "timer_wakers::many_blocking_wakers_below_the_thread_cap_do_not_hold_back_an_unrelated_timeout",
        Duration::from_secs(30),
        many_blocking_wakers_scenario,
    );
}

fn past_the_cap_scenario() {
    // 70 wakers due at 10 ms, each blocking 300 ms: 64 waker threads take 64 of them and
    // block; the 6 others and the unrelated timeout (due at 20 ms) wait for a thread to come
    // free, at about 310 ms: the shortest remaining block at its deadline (about 290 ms).
    let (late, _blocked) = lateness_behind_blocking_wakers(70, Duration::from_millis(300));
    assert!(
        late >= Duration::from_millis(200),
        "past the cap the unrelated timeout waits for a waker thread, yet it fired {late:?} late"
    );
    assert!(
        late < Duration::from_millis(500),
        "an unrelated 20 ms timeout fired {late:?} late behind 70 wakers blocking 300 ms"
    );
}

#[test]
fn past_the_thread_cap_an_unrelated_timeout_waits_for_a_waker_thread_to_come_free() {
    isolated(
        "timer_wakers::past_the_thread_cap_an_unrelated_timeout_waits_for_a_waker_thread_to_come_free",
        Duration::from_secs(30),
        past_the_cap_scenario,
    );
}

fn far_past_the_cap_scenario() {
    // 200 wakers due at 10 ms, each blocking 100 ms: the 136 past the cap take the 64 threads
    // in turns as they come free (at about 110, 210 and 310 ms), and the unrelated timeout,
    // due at 20 ms, behind them all, gets a thread in the third turn (about 290 ms late).
    let (late, _blocked) = lateness_behind_blocking_wakers(200, Duration::from_millis(100));
    assert!(
        late >= Duration::from_millis(150),
        "the unrelated timeout waits for the wakers queued before it, yet it fired {late:?} late"
    );
    assert!(
        late < Duration::from_millis(600),
        "an unrelated 20 ms timeout fired {late:?} late behind 200 wakers blocking 100 ms"
    );
}

#[test]
fn far_past_the_thread_cap_an_unrelated_timeout_waits_for_the_wakers_due_before_it() {
    isolated(
        "timer_wakers::far_past_the_thread_cap_an_unrelated_timeout_waits_for_the_wakers_due_before_it",
        Duration::from_secs(30),
        far_past_the_cap_scenario,
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
