//! `apply_limits` while calls wait.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Wake, Waker};
use std::time::Duration;

use async_bulkhead_llm::futures::AcquireOwned;
use async_bulkhead_llm::{AcquireOptions, Limits, LlmRequest, RejectReason, events::EventKind};

use crate::common::child_process::isolated;
use crate::common::waiters::{full_with_queue, poll_once};
use crate::support::{
    assert_pending, counting_waker, figures, opts, plain, poll_with, queued, ready, reason_of,
    rejection, req,
};

/// An empty request for futures that outlive the statement that made them (an acquire
/// borrows its request until its first poll).
static EMPTY_REQUEST: std::sync::LazyLock<async_bulkhead_llm::LlmRequest> =
    std::sync::LazyLock::new(async_bulkhead_llm::LlmRequest::new);

#[test]
fn lowering_max_concurrent_keeps_waiters_until_capacity_frees_under_the_new_limit() {
    let bulkhead = plain(2, 4);
    let p1 = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let p2 = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut a = queued(&bulkhead, opts());
    let mut b = queued(&bulkhead, opts());
    bulkhead
        .apply_limits(Limits::new(1, 1).with_max_queue(4))
        .expect("valid limits");
    assert_eq!(figures(&bulkhead), (2, 2, 2));
    drop(p1);
    // 1 in flight under a limit of 1: nothing frees for the queue.
    assert_eq!(figures(&bulkhead), (1, 2, 2));
    assert_pending(&mut a);
    // Newcomers still queue (the queue has room under the new limits).
    let mut c = queued(&bulkhead, opts());
    assert_eq!(bulkhead.stats().pending, 3);
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts())),
        RejectReason::ConcurrencyLimit
    );
    drop(p2);
    assert_eq!(figures(&bulkhead), (1, 2, 2));
    let pa = ready(&mut a).expect("A first");
    assert_eq!(pa.limit_revision(), 1);
    assert_pending(&mut b);
    drop(pa);
    drop(ready(&mut b).expect("then B"));
    drop(ready(&mut c).expect("then C"));
    assert_eq!(figures(&bulkhead), (0, 0, 5));
}

#[test]
fn lowering_max_queue_keeps_accepted_waiters_and_refuses_newcomers() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut waiters: Vec<_> = (0..3).map(|_| queued(&bulkhead, opts())).collect();
    bulkhead
        .apply_limits(Limits::new(1, 1).with_max_queue(1))
        .expect("valid limits");
    assert_eq!(bulkhead.stats().pending, 3);
    let mut late = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, opts()));
    let refused = rejection(ready(&mut late));
    assert_eq!(refused.reason(), RejectReason::QueueLimit);
    assert_eq!(
        (refused.detail().pending, refused.detail().max_queue),
        (3, 1)
    );
    assert_eq!(refused.limit_revision(), 1);

    bulkhead
        .apply_limits(Limits::new(2, 1).with_max_queue(0))
        .expect("valid limits");
    let mut late = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, opts()));
    assert_eq!(reason_of(ready(&mut late)), RejectReason::ConcurrencyLimit);
    assert_eq!(bulkhead.stats().pending, 3);

    // The kept waiters are served in order as capacity frees.
    let mut permit = held;
    for i in 0..3 {
        drop(permit);
        for later in &mut waiters[i + 1..] {
            assert_pending(later);
        }
        permit = ready(&mut waiters[i]).expect("kept waiter served in order");
        assert_eq!(permit.limit_revision(), 2);
    }
    drop(permit);
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.pending, stats.admitted), (0, 0, 4));
    assert_eq!(
        (
            stats.rejected_by_reason.queue_limit,
            stats.rejected_by_reason.concurrency_limit
        ),
        (1, 1)
    );
}

#[test]
fn zero_max_concurrent_keeps_a_waiter_until_the_limit_is_raised() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let (waker, woken) = counting_waker();
    let mut a = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, opts()));
    assert!(poll_with(&mut a, &waker).is_pending());
    bulkhead
        .apply_limits(Limits::new(1, 0).with_max_queue(4))
        .expect("valid limits");
    drop(held);
    assert_eq!(figures(&bulkhead), (0, 1, 1));
    assert_eq!(woken.get(), 0);
    assert!(poll_with(&mut a, &waker).is_pending());
    let mut late = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, opts()));
    assert_eq!(reason_of(ready(&mut late)), RejectReason::ConcurrencyLimit);

    bulkhead
        .apply_limits(Limits::new(2, 1).with_max_queue(4))
        .expect("valid limits");
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    assert_eq!(woken.get(), 1);
    let pa = ready(&mut a).expect("granted by the raise");
    assert_eq!(pa.limit_revision(), 2);
    drop(pa);
    assert_eq!(figures(&bulkhead), (0, 0, 2));
}

// ===== waking under the limits writer lock =====

/// A waker that polls its task inline, as some executors do.
struct PollsInline {
    task: Mutex<Option<AcquireOwned>>,
    admitted: AtomicBool,
}

impl Wake for PollsInline {
    fn wake(self: Arc<Self>) {
        let waker = Waker::from(self.clone());
        let mut task = self.task.lock().unwrap();
        if let Some(future) = task.as_mut()
            && let Poll::Ready(result) = poll_once(future, &waker)
        {
            assert!(result.is_ok(), "handed a slot by the raised limits");
            self.admitted.store(true, Ordering::SeqCst);
            *task = None;
        }
    }
}

fn inline_poll_scenario() {
    let (bulkhead, _held) = full_with_queue(1);
    // An admit listener that pushes a new revision (as a control plane hook would).
    let reconfigured = Arc::new(AtomicU64::new(0));
    let _subscription = {
        let (handle, reconfigured) = (bulkhead.clone(), reconfigured.clone());
        bulkhead.on_events([EventKind::Admit], move |_| {
            let next = Limits::new(handle.limits().revision + 1, 2).with_max_queue(1);
            handle.apply_limits(next).unwrap();
            reconfigured.fetch_add(1, Ordering::SeqCst);
        })
    };
    let waker = Arc::new(PollsInline {
        task: Mutex::new(None),
        admitted: AtomicBool::new(false),
    });
    let mut waiting = bulkhead.acquire_owned(&LlmRequest::new(), AcquireOptions::new());
    assert!(poll_once(&mut waiting, &Waker::from(waker.clone())).is_pending());
    *waker.task.lock().unwrap() = Some(waiting);

    // Raising the limits hands the slot to the waiter; its waker polls it inline, its admit
    // listener calls `apply_limits` again.
    bulkhead
        .apply_limits(Limits::new(1, 2).with_max_queue(1))
        .unwrap();
    assert!(waker.admitted.load(Ordering::SeqCst));
    assert_eq!(reconfigured.load(Ordering::SeqCst), 1);
    assert_eq!(bulkhead.limits().revision, 2);
}

#[test]
fn apply_limits_wakes_waiters_after_releasing_its_lock() {
    isolated(
        "limit_changes::apply_limits_wakes_waiters_after_releasing_its_lock",
        Duration::from_secs(30),
        inline_poll_scenario,
    );
}
