//! loom models of event listeners subscribing and unsubscribing while calls emit events.
//!
//! What loom can and cannot see here: the listener list is an `arc_swap::ArcSwap` guarded by a
//! std mutex, and the "anyone listening?" mask is a std atomic (`sync::unmodeled`): none of it
//! is instrumented, so loom never preempts *inside* a subscribe, an unsubscribe or an emission's
//! read of the list, and does not check their memory orderings. Each of those steps is atomic
//! in these models, and loom interleaves them with every step of the bulkhead's own protocol
//! (the word, the queue, the waiter). What these models check is that a listener appearing or
//! disappearing at any such point never breaks a call (it is admitted or refused exactly as
//! without listeners, and its slot comes back), never delivers an event twice or after the
//! subscription was dropped, and never panics. The list itself is covered by the stress tests
//! in `tests/` that run with and without a listener (`chaos.rs`, `usage_stress.rs`).
//!
//! Run: see `loom-tests/README.md`.
#![cfg(loom)]
// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

mod common;

use std::task::Poll;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, events::Event, events::EventKind, events::Subscription,
};
use common::{assert_idle, poll, queued, settle, waker};
use loom::sync::Arc;
use loom::sync::atomic::AtomicU64;
use loom::sync::atomic::Ordering::{AcqRel, Acquire};
use loom::thread;

/// Admit and release events a listener heard.
#[derive(Default)]
struct Heard {
    admits: AtomicU64,
    releases: AtomicU64,
}

impl Heard {
    fn counts(&self) -> (u64, u64) {
        (self.admits.load(Acquire), self.releases.load(Acquire))
    }
}

fn subscribe(bulkhead: &LlmBulkhead, heard: &Arc<Heard>) -> Subscription {
    let heard = heard.clone();
    bulkhead.on(move |event| match event {
        Event::Admit(_) => {
            heard.admits.fetch_add(1, AcqRel);
        }
        Event::Release(_) => {
            heard.releases.fetch_add(1, AcqRel);
        }
        _ => {}
    })
}

/// Steps loom sees, placed around the steps it does not (subscribing, unsubscribing, and the
/// start of a call, where it checks whether anyone listens). Loom's partial-order reduction
/// only reorders steps that conflict: a shared counter both threads bump orders the listener's
/// steps against the start and end of the call, and a read of the admission word (which
/// conflicts with the call's CAS and release) orders them against its commit, after which the
/// call's event is emitted before it takes another step loom sees.
fn anchor(bulkhead: &LlmBulkhead, steps: &AtomicU64) {
    steps.fetch_add(1, AcqRel);
    let _ = bulkhead.is_closed();
}

/// A listener subscribes and unsubscribes on one thread while another admits and releases a
/// call: the call is admitted and released whatever the listener does, the listener hears each
/// event at most once, and nothing after its subscription was dropped.
#[test]
fn a_listener_coming_and_going_never_changes_a_call() {
    use std::sync::atomic::{AtomicBool as StdAtomicBool, Ordering::Relaxed};
    // Which placements the model reached: the admission heard, and not heard.
    static HEARD: StdAtomicBool = StdAtomicBool::new(false);
    static MISSED: StdAtomicBool = StdAtomicBool::new(false);

    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).build().unwrap();
        let heard = Arc::new(Heard::default());
        let steps = Arc::new(AtomicU64::new(0));

        let subscriber = {
            let (bulkhead, heard, steps) = (bulkhead.clone(), heard.clone(), steps.clone());
            thread::spawn(move || {
                anchor(&bulkhead, &steps);
                let subscription = subscribe(&bulkhead, &heard);
                anchor(&bulkhead, &steps);
                drop(subscription);
                anchor(&bulkhead, &steps);
            })
        };
        let caller = {
            let (bulkhead, steps) = (bulkhead.clone(), steps.clone());
            thread::spawn(move || {
                steps.fetch_add(1, AcqRel);
                let permit = bulkhead
                    .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
                    .expect("the only call gets the only slot");
                steps.fetch_add(1, AcqRel);
                drop(permit);
                steps.fetch_add(1, AcqRel);
            })
        };
        subscriber.join().unwrap();
        caller.join().unwrap();

        let (admits, releases) = heard.counts();
        assert!(
            admits <= 1 && releases <= 1,
            "heard {admits} admits, {releases} releases"
        );
        if admits == 1 { &HEARD } else { &MISSED }.store(true, Relaxed);
        let stats = bulkhead.stats();
        assert_eq!(stats.listener_panics, 0);
        assert_eq!(stats.admitted, 1);
        assert_idle(&bulkhead);

        // Unsubscribed: a later call is not heard.
        drop(
            bulkhead
                .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
                .unwrap(),
        );
        assert_eq!(heard.counts(), (admits, releases));
    });
    assert!(
        HEARD.load(Relaxed) && MISSED.load(Relaxed),
        "the subscription was not placed both before and after the admission"
    );
}

/// A call waits in the queue with its decision being timed (a listener was subscribed when it
/// started); the listener unsubscribes while a release hands the call its slot. The call is
/// admitted either way; it picks its slot up after the unsubscription returned, so its admit
/// event is not heard; the release racing the unsubscription is heard at most once.
#[test]
fn unsubscribing_while_a_timed_call_is_handed_its_slot() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
        let heard = Arc::new(Heard::default());
        let subscription = subscribe(&bulkhead, &heard);
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let waiter = queued(&bulkhead, AcquireOptions::new());
        assert_eq!(heard.counts(), (1, 0), "the first admission was heard");

        let steps = Arc::new(AtomicU64::new(0));
        let unsubscriber = {
            let (bulkhead, steps) = (bulkhead.clone(), steps.clone());
            thread::spawn(move || {
                anchor(&bulkhead, &steps);
                drop(subscription);
                anchor(&bulkhead, &steps);
            })
        };
        let releaser = {
            let steps = steps.clone();
            thread::spawn(move || {
                steps.fetch_add(1, AcqRel);
                drop(held);
                steps.fetch_add(1, AcqRel);
            })
        };
        unsubscriber.join().unwrap();
        releaser.join().unwrap();

        let permit = settle(waiter.future, Poll::Pending, &waiter.flag).expect("handed the slot");
        let (admits, releases) = heard.counts();
        assert_eq!(
            admits, 1,
            "an admission picked up after unsubscribing was heard"
        );
        assert!(releases <= 1, "heard {releases} releases");
        drop(permit);
        assert_eq!(
            heard.counts(),
            (admits, releases),
            "heard after unsubscribing"
        );
        let stats = bulkhead.stats();
        assert_eq!(stats.listener_panics, 0);
        assert_eq!(stats.admitted, 2);
        assert_idle(&bulkhead);
    });
}

fn subscribe_sampled(bulkhead: &LlmBulkhead, heard: &Arc<Heard>, every: u32) -> Subscription {
    let heard = heard.clone();
    bulkhead.on_events_sampled(
        [EventKind::Admit, EventKind::Release],
        std::num::NonZeroU32::new(every).unwrap(),
        move |event| match event {
            Event::Admit(_) => {
                heard.admits.fetch_add(1, AcqRel);
            }
            Event::Release(_) => {
                heard.releases.fetch_add(1, AcqRel);
            }
            _ => {}
        },
    )
}

/// A sampled listener (one call in one: every call is sampled while it listens) subscribes and
/// unsubscribes on one thread while another admits and releases a call. A call is sampled or
/// not for its whole life, decided when its admission starts: the listener never hears a
/// release whose admission it did not hear (the list is published before the mask and the
/// rate), hears each event at most once and nothing after unsubscribing, and the call is
/// admitted and released exactly as without listeners. Both placements (the admission heard,
/// and not) are asserted reached.
#[test]
fn a_sampled_listener_never_hears_a_release_without_its_admission() {
    use std::sync::atomic::{AtomicBool as StdAtomicBool, Ordering::Relaxed};
    static HEARD: StdAtomicBool = StdAtomicBool::new(false);
    static MISSED: StdAtomicBool = StdAtomicBool::new(false);

    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).build().unwrap();
        let heard = Arc::new(Heard::default());
        let steps = Arc::new(AtomicU64::new(0));

        let subscriber = {
            let (bulkhead, heard, steps) = (bulkhead.clone(), heard.clone(), steps.clone());
            thread::spawn(move || {
                anchor(&bulkhead, &steps);
                let subscription = subscribe_sampled(&bulkhead, &heard, 1);
                anchor(&bulkhead, &steps);
                drop(subscription);
                anchor(&bulkhead, &steps);
            })
        };
        let caller = {
            let (bulkhead, steps) = (bulkhead.clone(), steps.clone());
            thread::spawn(move || {
                steps.fetch_add(1, AcqRel);
                let permit = bulkhead
                    .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
                    .expect("the only call gets the only slot");
                steps.fetch_add(1, AcqRel);
                drop(permit);
                steps.fetch_add(1, AcqRel);
            })
        };
        subscriber.join().unwrap();
        caller.join().unwrap();

        let (admits, releases) = heard.counts();
        assert!(admits <= 1, "heard {admits} admits");
        assert!(
            releases <= admits,
            "heard a release ({releases}) whose admission it missed ({admits})"
        );
        if admits == 1 { &HEARD } else { &MISSED }.store(true, Relaxed);
        let stats = bulkhead.stats();
        assert_eq!((stats.listener_panics, stats.admitted), (0, 1));
        assert_idle(&bulkhead);
        drop(
            bulkhead
                .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
                .unwrap(),
        );
        assert_eq!(
            heard.counts(),
            (admits, releases),
            "heard after unsubscribing"
        );
    });
    assert!(
        HEARD.load(Relaxed) && MISSED.load(Relaxed),
        "the subscription was not placed both before and after the admission"
    );
}

/// A sampled listener that hears one call in a hundred: a call that waited in the queue is
/// sampled whatever the count (its wait is what the listener is for). The call is handed its
/// slot by a release on another thread while the main thread polls it (it picks its slot up
/// then, or after being woken): the listener hears its admit and its release, and of the
/// holder (admitted after the count's turn) neither.
#[test]
fn a_call_that_waited_is_heard_by_a_sampled_listener_whatever_its_rate() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
        let heard = Arc::new(Heard::default());
        let _subscription = subscribe_sampled(&bulkhead, &heard, 100);
        // This thread's first call is sampled (the count starts at the rate's turn); the
        // holder's is the second, not sampled.
        drop(
            bulkhead
                .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
                .unwrap(),
        );
        let sampled = heard.counts();
        assert_eq!(sampled, (1, 1), "a thread's first call is sampled");
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let mut waiter = queued(&bulkhead, AcquireOptions::new());
        let releaser = thread::spawn(move || drop(held));
        let first = poll(&mut waiter.future, &waker(&waiter.flag));
        releaser.join().unwrap();
        let permit = settle(waiter.future, first, &waiter.flag).expect("handed the slot");
        drop(permit);
        let (admits, releases) = heard.counts();
        assert_eq!(
            (admits - sampled.0, releases - sampled.1),
            (1, 1),
            "the call that waited was heard, the holder was not"
        );
        assert_eq!(bulkhead.stats().listener_panics, 0);
        assert_idle(&bulkhead);
    });
}
