//! Sampled listeners (`on_events_sampled`): one call in `every` per thread, every call that
//! waited, a sampled call's whole life, the shared rate, and listeners on every call beside
//! them.

use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, Limits, LlmBulkhead, LlmRequest, admission::AdmissionId, events::Event,
    events::EventKind,
};

use crate::common::usage_fixtures::{budgeted, fixed, req, tokens, usage};

fn every(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}

type Heard = Arc<Mutex<Vec<(EventKind, Option<AdmissionId>)>>>;

fn log() -> (Heard, impl Fn(&Event<'_>) + Send + Sync + 'static) {
    let heard: Heard = Arc::default();
    let sink = heard.clone();
    (heard, move |event: &Event<'_>| {
        let id = match event {
            Event::Admit(e) => Some(e.admission_id),
            Event::Usage(e) => Some(e.admission_id),
            Event::Release(e) => Some(e.admission_id),
            _ => None,
        };
        sink.lock().unwrap().push((event.kind(), id));
    })
}

fn count(heard: &Heard, kind: EventKind) -> usize {
    heard
        .lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k == kind)
        .count()
}

/// `calls` admissions on a new thread (its countdown starts afresh), each reporting usage and
/// released.
fn calls_on_a_new_thread(bulkhead: &LlmBulkhead, calls: usize) {
    let bulkhead = bulkhead.clone();
    thread::spawn(move || {
        for _ in 0..calls {
            let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
            permit.report_usage(usage(10, 10)).unwrap();
            permit.release(None);
        }
    })
    .join()
    .unwrap();
}

#[test]
fn a_sampled_listener_hears_one_call_in_every_on_each_thread_and_all_of_its_events() {
    let bulkhead = budgeted(4, 100_000);
    let (heard, listener) = log();
    let kinds = [EventKind::Admit, EventKind::Usage, EventKind::Release];
    let _sampled = bulkhead.on_events_sampled(kinds, every(4), listener);
    calls_on_a_new_thread(&bulkhead, 40);
    calls_on_a_new_thread(&bulkhead, 40);
    // 10 calls of each thread's 40, each with its admit, usage and release.
    for kind in kinds {
        assert_eq!(count(&heard, kind), 20, "{kind:?}");
    }
    let heard = heard.lock().unwrap();
    let admitted: Vec<_> = heard
        .iter()
        .filter(|(k, _)| *k == EventKind::Admit)
        .map(|(_, id)| id)
        .collect();
    let released: Vec<_> = heard
        .iter()
        .filter(|(k, _)| *k == EventKind::Release)
        .map(|(_, id)| id)
        .collect();
    assert_eq!(admitted, released);
}

#[test]
fn a_call_passed_over_stays_unheard_and_a_sampled_one_stays_heard() {
    let bulkhead = budgeted(4, 100_000);
    let (heard, listener) = log();
    let _sampled = bulkhead.on_events_sampled(
        [EventKind::Admit, EventKind::Usage, EventKind::Release],
        every(2),
        listener,
    );
    let bulkhead2 = bulkhead.clone();
    let sampled_id = thread::spawn(move || {
        // The thread's first call is sampled, its second is not.
        let mut a = bulkhead2.try_acquire(&req(), fixed()).unwrap();
        let mut b = bulkhead2.try_acquire(&req(), fixed()).unwrap();
        b.report_usage(usage(10, 10)).unwrap();
        a.report_usage(usage(10, 10)).unwrap();
        let id = a.admission_id();
        drop(b);
        drop(a);
        id
    })
    .join()
    .unwrap();
    let heard = heard.lock().unwrap().clone();
    assert_eq!(
        heard,
        [
            (EventKind::Admit, Some(sampled_id)),
            (EventKind::Usage, Some(sampled_id)),
            (EventKind::Release, Some(sampled_id)),
        ]
    );
}

#[test]
fn every_call_that_waited_is_heard_whatever_the_rate() {
    let bulkhead = LlmBulkhead::builder("m", 1).max_queue(2).build().unwrap();
    let (heard, listener) = log();
    let _sampled = bulkhead.on_events_sampled(
        [EventKind::Admit, EventKind::Reject, EventKind::Release],
        every(1_000_000),
        listener,
    );
    // The test thread's first call is sampled: use it up.
    drop(
        bulkhead
            .try_acquire(&LlmRequest::new(), AcquireOptions::new())
            .unwrap(),
    );
    heard.lock().unwrap().clear();
    let held = bulkhead
        .try_acquire(&LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    thread::scope(|scope| {
        let waiter = scope.spawn(|| {
            // A new thread: its first call is sampled (heard: a refusal, the slot is held).
            drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()));
            let timed_out = bulkhead.acquire_blocking(
                &LlmRequest::new(),
                AcquireOptions::new().timeout(Duration::from_millis(1)),
            );
            assert!(timed_out.is_err());
            bulkhead
                .acquire_blocking(&LlmRequest::new(), AcquireOptions::new())
                .map(drop)
                .is_ok()
        });
        while bulkhead.stats().rejected_by_reason.timeout == 0 || bulkhead.stats().pending == 0 {
            thread::yield_now();
        }
        drop(held);
        assert!(waiter.join().unwrap());
    });
    let kinds: Vec<EventKind> = heard.lock().unwrap().iter().map(|(k, _)| *k).collect();
    // The waiter thread's first call (sampled by the countdown), then only because they
    // waited: the timed-out wait's refusal, the admitted wait's admission and its release.
    // Nothing of the held permit (the test thread's second call).
    assert_eq!(
        kinds,
        [
            EventKind::Reject,
            EventKind::Reject,
            EventKind::Admit,
            EventKind::Release
        ]
    );
}

#[test]
fn listeners_on_every_call_hear_every_call_beside_a_sampled_one() {
    let bulkhead = budgeted(4, 100_000);
    let (all, full) = log();
    let (some, sampled) = log();
    let _full = bulkhead.on_events([EventKind::Admit, EventKind::Release], full);
    let _sampled =
        bulkhead.on_events_sampled([EventKind::Admit, EventKind::Release], every(10), sampled);
    calls_on_a_new_thread(&bulkhead, 50);
    assert_eq!(
        (
            count(&all, EventKind::Admit),
            count(&all, EventKind::Release)
        ),
        (50, 50)
    );
    assert_eq!(
        (
            count(&some, EventKind::Admit),
            count(&some, EventKind::Release)
        ),
        (5, 5)
    );
}

#[test]
fn sampled_listeners_share_the_highest_rate_until_its_subscription_is_dropped() {
    let bulkhead = budgeted(4, 100_000);
    let (slow, slow_listener) = log();
    let (fast, fast_listener) = log();
    let _slow = bulkhead.on_events_sampled([EventKind::Admit], every(8), slow_listener);
    let fast_subscription = bulkhead.on_events_sampled([EventKind::Admit], every(2), fast_listener);
    calls_on_a_new_thread(&bulkhead, 16);
    assert_eq!(
        (
            count(&slow, EventKind::Admit),
            count(&fast, EventKind::Admit)
        ),
        (8, 8)
    );
    drop(fast_subscription);
    calls_on_a_new_thread(&bulkhead, 16);
    assert_eq!(
        (
            count(&slow, EventKind::Admit),
            count(&fast, EventKind::Admit)
        ),
        (10, 8)
    );
}

#[test]
fn events_about_no_single_call_reach_sampled_listeners_every_time() {
    let bulkhead = budgeted(4, 100_000);
    let (heard, listener) = log();
    let _sampled = bulkhead.on_events_sampled([EventKind::Reconfigure], every(1000), listener);
    for revision in 1..=3 {
        let mut next: Limits = bulkhead.limits();
        next.revision = revision + 100;
        bulkhead.apply_limits(next).unwrap();
    }
    assert_eq!(count(&heard, EventKind::Reconfigure), 3);
}

/// A sampled listener subscribing while calls run on another thread never hears the release
/// of a call whose admission it did not hear: a call is sampled only if it saw the listener's
/// bit, and once it saw the bit its admit event reaches the listener (the listener list is
/// published before the bit). The listener is dropped only while no call is in flight (the
/// caller pauses between calls), so no listener leaves during a call's life: a release heard
/// without its admission can only be a sampled call whose admit event missed the listener.
#[test]
fn a_sampled_listener_never_hears_a_release_without_its_admission() {
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    let bulkhead = LlmBulkhead::builder("m", 4).build().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    // The subscriber asks the caller to pause between calls; the caller says it has.
    let pause = Arc::new(AtomicBool::new(false));
    let paused = Arc::new(AtomicBool::new(false));
    let orphans = Arc::new(AtomicU64::new(0));
    let heard_releases = Arc::new(AtomicU64::new(0));
    let caller = {
        let (bulkhead, stop) = (bulkhead.clone(), stop.clone());
        let (pause, paused) = (pause.clone(), paused.clone());
        thread::spawn(move || {
            let mut calls = 0u64;
            while !stop.load(Ordering::Acquire) {
                if pause.load(Ordering::Acquire) {
                    paused.store(true, Ordering::Release);
                    while pause.load(Ordering::Acquire) {
                        thread::yield_now();
                    }
                    paused.store(false, Ordering::Release);
                }
                drop(bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap());
                calls += 1;
            }
            calls
        })
    };
    for _ in 0..100_000 {
        let admitted: Arc<Mutex<HashSet<AdmissionId>>> = Arc::default();
        let (orphans, heard_releases) = (orphans.clone(), heard_releases.clone());
        let subscription = bulkhead.on_events_sampled(
            [EventKind::Admit, EventKind::Release],
            every(1),
            move |event| match event {
                Event::Admit(e) => {
                    admitted.lock().unwrap().insert(e.admission_id);
                }
                Event::Release(e) => {
                    heard_releases.fetch_add(1, Ordering::Relaxed);
                    if !admitted.lock().unwrap().contains(&e.admission_id) {
                        orphans.fetch_add(1, Ordering::Relaxed);
                    }
                }
                _ => {}
            },
        );
        thread::yield_now();
        pause.store(true, Ordering::Release);
        while !paused.load(Ordering::Acquire) {
            thread::yield_now();
        }
        drop(subscription);
        pause.store(false, Ordering::Release);
        while paused.load(Ordering::Acquire) {
            thread::yield_now();
        }
    }
    stop.store(true, Ordering::Release);
    let calls = caller.join().unwrap();
    assert!(
        calls > 1_000 && heard_releases.load(Ordering::Relaxed) > 0,
        "the calls and the subscriptions did not overlap ({calls} calls)"
    );
    assert_eq!(
        orphans.load(Ordering::Relaxed),
        0,
        "releases heard without their admission, of {} heard",
        heard_releases.load(Ordering::Relaxed)
    );
}

/// A dropped permit whose call the sampled listener passed over is settled as a drop nobody
/// hears (its slot and hold returned, the hold booked as returned unreported, no event); a
/// sampled one is heard; a passed-over one that reported usage books it.
#[test]
fn drops_a_sampled_listener_passed_over_are_settled_unheard_and_exact() {
    let bulkhead = budgeted(4, 100_000);
    let (heard, listener) = log();
    let _sampled =
        bulkhead.on_events_sampled([EventKind::Admit, EventKind::Release], every(4), listener);
    let worker = bulkhead.clone();
    thread::spawn(move || {
        // 8 calls dropped without usage (2 sampled), then 4 reporting 10 + 10 before the drop
        // (1 sampled).
        for _ in 0..8 {
            drop(worker.try_acquire(&req(), fixed()).unwrap());
        }
        for _ in 0..4 {
            let mut permit = worker.try_acquire(&req(), fixed()).unwrap();
            permit.report_usage(usage(10, 10)).unwrap();
            drop(permit);
        }
    })
    .join()
    .unwrap();
    assert_eq!(count(&heard, EventKind::Admit), 3);
    assert_eq!(count(&heard, EventKind::Release), 3);
    let stats = bulkhead.stats();
    assert_eq!(
        (stats.in_flight, stats.admitted, stats.released),
        (0, 12, 12)
    );
    let tokens = tokens(&bulkhead);
    assert_eq!(tokens.in_flight_tokens, 0);
    assert_eq!(tokens.total_reserved, 12 * 1_100);
    assert_eq!(tokens.total_returned_unreported, 8 * 1_100);
    assert_eq!(tokens.total_consumed, 4 * 20);
}
