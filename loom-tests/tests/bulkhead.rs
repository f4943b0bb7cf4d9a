//! loom models of what the general `Bulkhead` adds over the engine: its acquire machine
//! (`src/bulkhead/acquire.rs`: leaving the queue in `Drop`, `time_out`, picking up the waiter's
//! fate after registering the waker, the blocking wait) and its reject hook
//! (`src/bulkhead/shared.rs`: every refusal announced once, with the state it carries), raced
//! against releases, `close` and each other in every interleaving up to the preemption bound.
//! Futures are polled by hand; wakers record whether they were woken, so a lost wake-up fails
//! the model. The hook records into a std mutex (not a loom point: it is the user's code).
//!
//! Run: see `loom-tests/README.md`.
#![cfg(loom)]

mod common;

use std::sync::{Arc as StdArc, Mutex as StdMutex};
use std::task::{Poll, Waker};
use std::time::Duration;

use async_bulkhead_llm::futures::BulkheadAcquireOwned;
use async_bulkhead_llm::{
    Bulkhead, BulkheadError, bulkhead::BulkheadBuilder, bulkhead::BulkheadState,
    bulkhead::OwnedBulkheadPermit,
};
use common::{Flag, flag, poll};
use loom::thread;

/// The refusals the reject hook heard.
#[derive(Clone, Default)]
struct Heard(StdArc<StdMutex<Vec<BulkheadError>>>);

impl Heard {
    fn on(&self, builder: BulkheadBuilder) -> BulkheadBuilder {
        let heard = self.clone();
        builder.on_reject(move |error| heard.0.lock().unwrap().push(*error))
    }

    fn all(&self) -> Vec<BulkheadError> {
        self.0.lock().unwrap().clone()
    }
}

/// A bulkhead of `max_concurrent` slots, `max_queue` places, no queue timeout (loom models no
/// timer), recording its refusals.
fn observed(max_concurrent: usize, max_queue: usize) -> (Bulkhead, Heard) {
    let heard = Heard::default();
    let bulkhead = heard
        .on(Bulkhead::builder(max_concurrent)
            .max_queue(max_queue)
            .wait_indefinitely())
        .build()
        .unwrap();
    (bulkhead, heard)
}

fn st(active: u64, queued: u64) -> BulkheadState {
    BulkheadState::new(active, queued)
}

/// An owned acquire polled once with a recording waker: it must have joined the queue.
fn queued(bulkhead: &Bulkhead) -> (BulkheadAcquireOwned, StdArc<Flag>) {
    let mut future = bulkhead.acquire_owned();
    let (woken, waker) = flag();
    assert!(poll(&mut future, &waker).is_pending(), "joins the queue");
    (future, woken)
}

/// Finishes an acquire whose earlier poll returned `polled`, once every thread that could
/// decide it has been joined: if it was pending it must have been woken, and one more poll
/// must finish it.
fn settle(
    future: &mut BulkheadAcquireOwned,
    polled: Poll<Result<OwnedBulkheadPermit, BulkheadError>>,
    woken: &Flag,
) -> Result<OwnedBulkheadPermit, BulkheadError> {
    match polled {
        Poll::Ready(result) => result,
        Poll::Pending => {
            assert!(
                woken.woken(),
                "a waiter whose fate was decided was never woken"
            );
            match poll(future, Waker::noop()) {
                Poll::Ready(result) => result,
                Poll::Pending => panic!("a waiter was left in the queue"),
            }
        }
    }
}

/// Nothing active, nothing queued, every admission released.
fn assert_idle(bulkhead: &Bulkhead) {
    assert_eq!(bulkhead.state(), st(0, 0), "slots and places returned");
    let stats = bulkhead.stats();
    assert_eq!(stats.admitted, stats.released);
}

/// (a) The head of the queue is dropped (`Drop` of the acquire machine: `cancel`) while a
/// release hands it the slot: whatever the order, the slot reaches the next waiter, which is
/// woken; the dropped call counts as cancelled, never admitted; the hook hears nothing.
#[test]
fn a_queued_acquire_dropped_while_a_release_hands_it_the_slot_passes_the_slot_on() {
    loom::model(|| {
        let (bulkhead, heard) = observed(1, 2);
        let held = bulkhead.try_acquire_owned().unwrap();
        let (first, _) = queued(&bulkhead);
        let (mut second, second_woken) = queued(&bulkhead);

        let releaser = thread::spawn(move || drop(held));
        let canceller = thread::spawn(move || drop(first));
        releaser.join().unwrap();
        canceller.join().unwrap();

        assert!(second_woken.woken(), "the next waiter was woken");
        let permit = match poll(&mut second, Waker::noop()) {
            Poll::Ready(result) => result.expect("the slot passed to the next waiter"),
            Poll::Pending => panic!("the next waiter was left waiting with a free slot"),
        };
        assert_eq!(bulkhead.state(), st(1, 0));
        let stats = bulkhead.stats();
        assert_eq!((stats.admitted, stats.cancelled), (2, 1));
        drop(permit);
        assert!(heard.all().is_empty(), "a cancellation is not a refusal");
        assert_idle(&bulkhead);
    });
}

/// (b) `close` races the first poll of an acquire that finds the slot taken: the acquire ends
/// `Shutdown` (refused at its start, or queued then refused by the close and woken), and the
/// hook hears exactly that one refusal, with the state it carries: the slot still held,
/// nobody queued.
#[test]
fn close_racing_an_acquires_first_poll_ends_it_shutdown_heard_once() {
    loom::model(|| {
        let (bulkhead, heard) = observed(1, 1);
        let held = bulkhead.try_acquire_owned().unwrap();

        let closer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || assert!(bulkhead.close()))
        };
        let caller = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let mut future = bulkhead.acquire_owned();
                let (woken, waker) = flag();
                let polled = poll(&mut future, &waker);
                (future, polled, woken)
            })
        };
        closer.join().unwrap();
        let (mut future, polled, woken) = caller.join().unwrap();
        let refused = settle(&mut future, polled, &woken).unwrap_err();

        let closed = BulkheadError::Shutdown { state: st(1, 0) };
        assert_eq!(refused, closed);
        assert_eq!(heard.all(), vec![closed], "heard exactly once");
        assert_eq!(bulkhead.stats().rejected_shutdown, 1);
        drop(held);
        assert_idle(&bulkhead);
    });
}

/// (b') `close` races a later poll of a queued acquire (picking up its fate, registering the
/// waker, picking up again): it ends `Shutdown`, woken if the poll returned pending; the hook
/// hears that refusal exactly once.
#[test]
fn close_racing_a_queued_acquires_poll_ends_it_shutdown_heard_once() {
    loom::model(|| {
        let (bulkhead, heard) = observed(1, 1);
        let held = bulkhead.try_acquire_owned().unwrap();
        let (mut future, _) = queued(&bulkhead);

        let closer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || assert!(bulkhead.close()))
        };
        let poller = thread::spawn(move || {
            let (woken, waker) = flag();
            let polled = poll(&mut future, &waker);
            (future, polled, woken)
        });
        closer.join().unwrap();
        let (mut future, polled, woken) = poller.join().unwrap();
        let refused = settle(&mut future, polled, &woken).unwrap_err();

        let closed = BulkheadError::Shutdown { state: st(1, 0) };
        assert_eq!(refused, closed);
        assert_eq!(heard.all(), vec![closed], "heard exactly once");
        drop(held);
        assert_idle(&bulkhead);
    });
}

/// (c) Two threads `try_acquire` a bulkhead of 1 while a third releases its only slot: never
/// two permits; each refusal is `QueueFull` seeing the slot taken, heard once and counted
/// once; admissions counted exactly.
#[test]
fn two_try_acquires_racing_a_release_never_hold_two_permits() {
    loom::model(|| {
        let (bulkhead, heard) = observed(1, 0);
        let held = bulkhead.try_acquire_owned().unwrap();

        let tries: Vec<_> = (0..2)
            .map(|_| {
                let bulkhead = bulkhead.clone();
                thread::spawn(move || bulkhead.try_acquire_owned())
            })
            .collect();
        let releaser = thread::spawn(move || drop(held));
        let outcomes: Vec<_> = tries.into_iter().map(|t| t.join().unwrap()).collect();
        releaser.join().unwrap();

        let admitted = outcomes.iter().filter(|o| o.is_ok()).count() as u64;
        assert!(admitted <= 1, "two permits for one slot");
        assert_eq!(bulkhead.state(), st(admitted, 0));
        let full = BulkheadError::QueueFull { state: st(1, 0) };
        for outcome in &outcomes {
            if let Err(error) = outcome {
                assert_eq!(*error, full);
            }
        }
        assert_eq!(heard.all(), vec![full; 2 - admitted as usize]);
        let stats = bulkhead.stats();
        assert_eq!(
            (stats.admitted, stats.rejected_queue_full),
            (1 + admitted, 2 - admitted)
        );
        drop(outcomes);
        assert_idle(&bulkhead);
    });
}

/// A queued acquire's later poll (pick up, register the waker, pick up again) races the
/// release that hands it the slot: it is admitted, and woken if that poll returned pending.
#[test]
fn a_hand_off_racing_a_queued_acquires_poll_is_never_lost() {
    loom::model(|| {
        let (bulkhead, heard) = observed(1, 1);
        let held = bulkhead.try_acquire_owned().unwrap();
        let (mut future, _) = queued(&bulkhead);

        let releaser = thread::spawn(move || drop(held));
        let poller = thread::spawn(move || {
            let (woken, waker) = flag();
            let polled = poll(&mut future, &waker);
            (future, polled, woken)
        });
        releaser.join().unwrap();
        let (mut future, polled, woken) = poller.join().unwrap();
        let permit = settle(&mut future, polled, &woken).expect("handed the slot");
        assert_eq!(bulkhead.state(), st(1, 0));
        drop(permit);
        assert!(heard.all().is_empty());
        assert_idle(&bulkhead);
    });
}

/// `time_out` (a zero queue timeout, decided at the first poll that queues) races the release
/// that would hand the slot over: admitted or refused `QueueTimeout`, never both; the hook
/// hears the timeout alone, once, seeing the slot held and nobody queued.
#[test]
fn a_time_out_racing_a_hand_off_is_admitted_or_refused_once() {
    loom::model(|| {
        let heard = Heard::default();
        let bulkhead = heard
            .on(Bulkhead::builder(1)
                .max_queue(1)
                .queue_timeout(Duration::ZERO))
            .build()
            .unwrap();
        let held = bulkhead.try_acquire_owned().unwrap();
        let mut future = bulkhead.acquire_owned();

        let releaser = thread::spawn(move || drop(held));
        let caller = thread::spawn(move || match poll(&mut future, Waker::noop()) {
            Poll::Ready(result) => result,
            Poll::Pending => panic!("a zero timeout completes at its first poll"),
        });
        releaser.join().unwrap();
        let outcome = caller.join().unwrap();

        let stats = bulkhead.stats();
        match outcome {
            Ok(permit) => {
                assert!(heard.all().is_empty());
                assert_eq!((stats.admitted, stats.timed_out), (2, 0));
                drop(permit);
            }
            Err(error) => {
                let BulkheadError::QueueTimeout { state, .. } = error else {
                    panic!("expected a timeout, got {error:?}")
                };
                // The slot was held when it queued; it may have been released since.
                assert!(state == st(1, 0) || state == st(0, 0), "{state:?}");
                assert_eq!(heard.all(), vec![error]);
                assert_eq!((stats.admitted, stats.timed_out), (1, 1));
            }
        }
        assert_idle(&bulkhead);
    });
}

/// A blocked thread (the machine's blocking wait: listen, check again, park) is handed the
/// slot a release on another thread frees, and never parks for good.
#[test]
fn a_blocked_acquire_is_handed_the_slot_a_release_frees() {
    loom::model(|| {
        let (bulkhead, heard) = observed(1, 1);
        let held = bulkhead.try_acquire_owned().unwrap();
        let blocked = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || bulkhead.acquire_blocking_owned().map(drop))
        };
        let releaser = thread::spawn(move || drop(held));
        releaser.join().unwrap();
        blocked.join().unwrap().expect("handed the slot");
        assert!(heard.all().is_empty());
        assert_idle(&bulkhead);
        assert_eq!(bulkhead.stats().admitted, 2);
    });
}
