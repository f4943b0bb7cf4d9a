//! Subscriptions: order, kinds, lifetime, and what dropping one guarantees.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_bulkhead_llm::{
    AcquireOptions, Limits, LlmBulkhead, LlmRequest, events::Event, events::EventKind,
};

use crate::common::usage_fixtures::{
    Recorder, budgeted, fixed, opts, plain, rejection, req, usage,
};

#[test]
fn listeners_run_in_registration_order_and_unsubscribe_on_drop() {
    let bulkhead = budgeted(2, 5000);
    let order = Arc::new(Mutex::new(Vec::new()));
    let listener = |name: &'static str| {
        let order = Arc::clone(&order);
        move |event: &Event<'_>| order.lock().unwrap().push((name, event.kind()))
    };
    let a = bulkhead.on(listener("a"));
    let b = bulkhead.on(listener("b"));
    let c = bulkhead.on(listener("c"));
    drop(bulkhead.try_acquire(&req(), fixed()).unwrap());
    assert_eq!(
        std::mem::take(&mut *order.lock().unwrap()),
        [
            ("a", EventKind::Admit),
            ("b", EventKind::Admit),
            ("c", EventKind::Admit),
            ("a", EventKind::Release),
            ("b", EventKind::Release),
            ("c", EventKind::Release),
        ]
    );

    drop(b);
    let d = bulkhead.on(listener("d"));
    drop(bulkhead.try_acquire(&req(), fixed()).unwrap());
    assert_eq!(
        std::mem::take(&mut *order.lock().unwrap()),
        [
            ("a", EventKind::Admit),
            ("c", EventKind::Admit),
            ("d", EventKind::Admit),
            ("a", EventKind::Release),
            ("c", EventKind::Release),
            ("d", EventKind::Release),
        ]
    );

    drop((a, c, d));
    drop(bulkhead.try_acquire(&req(), fixed()).unwrap());
    rejection(bulkhead.try_acquire(&req(), opts(0, 9999)));
    assert!(order.lock().unwrap().is_empty());
}

#[test]
fn on_events_delivers_only_the_kinds_asked_for() {
    let bulkhead = budgeted(1, 5000);
    let usage_and_release = Recorder::only(&bulkhead, &[EventKind::Usage, EventKind::Release]);
    let rejects = Recorder::only(&bulkhead, &[EventKind::Reject]);
    let nothing = Recorder::only(&bulkhead, &[]);
    let everything = Recorder::all(&bulkhead);

    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    rejection(bulkhead.try_acquire(&req(), fixed()));
    permit.report_usage(usage(1, 1)).unwrap();
    drop(permit);
    bulkhead.set_budget(6000).unwrap();

    assert_eq!(
        usage_and_release.take_kinds(),
        [EventKind::Usage, EventKind::Release]
    );
    assert_eq!(rejects.take_kinds(), [EventKind::Reject]);
    assert!(nothing.take().is_empty());
    assert_eq!(
        everything.take_kinds(),
        [
            EventKind::Admit,
            EventKind::Reject,
            EventKind::Usage,
            EventKind::Release,
            EventKind::Reconfigure
        ]
    );
}

#[test]
fn a_detached_listener_lives_as_long_as_the_bulkhead() {
    let bulkhead = budgeted(1, 5000);
    let count = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&count);
    bulkhead
        .on_events([EventKind::Admit], move |_| {
            counter.fetch_add(1, Ordering::Relaxed);
        })
        .detach();
    assert_eq!(Arc::strong_count(&count), 2);
    for _ in 0..3 {
        drop(bulkhead.try_acquire(&req(), fixed()).unwrap());
    }
    assert_eq!(count.load(Ordering::Relaxed), 3);
    // The listener goes with the bulkhead (no leak).
    let clone = bulkhead.clone();
    drop(bulkhead);
    drop(clone.try_acquire(&req(), fixed()).unwrap());
    assert_eq!(count.load(Ordering::Relaxed), 4);
    drop(clone);
    assert_eq!(Arc::strong_count(&count), 1);
}

/// A subscription may outlive every clone of its bulkhead: the listener goes with the last
/// clone (the subscription does not keep it alive), and dropping the subscription then is
/// harmless.
#[test]
fn a_subscription_dropped_after_its_bulkhead_is_harmless() {
    let bulkhead = plain(1);
    let heard = Arc::new(AtomicU64::new(0));
    let subscription = {
        let heard = heard.clone();
        bulkhead.on(move |_| {
            heard.fetch_add(1, Ordering::Relaxed);
        })
    };
    let clone = bulkhead.clone();
    drop(bulkhead);
    drop(clone.try_acquire(&req(), fixed()).unwrap());
    assert_eq!(heard.load(Ordering::Relaxed), 2); // admit and release, through the clone
    drop(clone);
    assert_eq!(
        Arc::strong_count(&heard),
        1,
        "the listener went with the bulkhead"
    );
    drop(subscription);
    assert_eq!(heard.load(Ordering::Relaxed), 2);
}

// ===== what dropping a subscription guarantees =====

#[test]
fn a_dropped_subscription_hears_no_event_that_starts_after_the_drop() {
    let bulkhead = LlmBulkhead::builder("m", 4).build().unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    for round in 0..200u64 {
        let subscription = {
            let calls = calls.clone();
            bulkhead.on(move |_| {
                calls.fetch_add(1, Ordering::SeqCst);
            })
        };
        // Events on another thread race the drop...
        let racer = {
            let bulkhead = bulkhead.clone();
            std::thread::spawn(move || {
                for _ in 0..20 {
                    drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()));
                }
            })
        };
        drop(subscription);
        racer.join().unwrap();
        // ...but once the drop returned (and the racer is joined), no event reaches it.
        let before = calls.load(Ordering::SeqCst);
        drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()));
        bulkhead.apply_limits(Limits::new(round + 1, 4)).unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), before, "round {round}");
    }
}

#[test]
fn a_listener_may_drop_its_own_subscription() {
    let bulkhead = LlmBulkhead::builder("m", 4).build().unwrap();
    let slot: Arc<Mutex<Option<async_bulkhead_llm::events::Subscription>>> = Arc::default();
    let calls = Arc::new(AtomicU64::new(0));
    let subscription = {
        let (slot, calls) = (slot.clone(), calls.clone());
        bulkhead.on(move |_| {
            calls.fetch_add(1, Ordering::SeqCst);
            drop(slot.lock().unwrap().take());
        })
    };
    *slot.lock().unwrap() = Some(subscription);
    drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()));
    // Admit (which unsubscribed), then nothing more.
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}
