//! Small end-to-end runs of every path that goes through a dependency's `unsafe` code, sized to
//! finish under Miri in minutes: the crate itself has no `unsafe` (`unsafe_code = "forbid"`),
//! but `event-listener` (the queue's and the blocking wait's wake-ups), `atomic-waker` (async
//! wake-ups), `arc-swap` (the listener list), `crossbeam-utils` (padded counters) and
//! `portable-atomic` (the 128-bit admission word of a bulkhead with admission classes) and
//! `sha2` (deduplication keys) do.
//!
//! They are ordinary tests too (plain `cargo test` runs them in milliseconds). Under Miri:
//!
//! ```sh
//! MIRIFLAGS="-Zmiri-disable-isolation" CARGO_TARGET_DIR=target/miri \
//!   cargo +nightly miri test --test miri
//! ```
//!
//! (`-Zmiri-disable-isolation`: the queue timeouts and event timing read the clock.)

// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, Reservation, TokenBudget, TokenUsage,
    events::Event,
};
use std::future::Future;

use futures::executor::block_on;

fn tokens(input: u64, output: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(input, output).unwrap())
}

fn bulkhead(max_concurrent: usize, max_queue: usize, budget: u64) -> LlmBulkhead {
    LlmBulkhead::builder("gpt-4o", max_concurrent)
        .max_queue(max_queue)
        .token_budget(TokenBudget::new(budget))
        .build()
        .unwrap()
}

fn assert_idle(bulkhead: &LlmBulkhead) {
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.pending), (0, 0));
    assert_eq!(stats.token_budget.unwrap().in_flight_tokens, 0);
    assert_eq!(stats.admitted, stats.released);
}

#[test]
fn admit_report_release_and_refuse() {
    let b = bulkhead(2, 0, 100);
    let mut first = b.try_acquire(&LlmRequest::new(), tokens(30, 30)).unwrap();
    let second = b.try_acquire(&LlmRequest::new(), tokens(10, 10)).unwrap();
    let refused = b.try_acquire(&LlmRequest::new(), tokens(1, 1)).unwrap_err();
    assert_eq!(
        refused.rejection().unwrap().reason(),
        RejectReason::ConcurrencyLimit
    );
    let report = first.report_usage(TokenUsage::new(10, 5).unwrap()).unwrap();
    // Input 10 of 30 reported: 20 refunded at once, the output reservation still held.
    assert_eq!(report.held, 40);
    let released = first.release(Some(TokenUsage::new(10, 20).unwrap()));
    assert_eq!(released.refunded_tokens, 10);
    drop(second);
    let booked = b.stats().token_budget.unwrap();
    assert_eq!((booked.total_consumed, booked.total_refunded), (30, 30));
    assert_idle(&b);
}

/// Owned permits released on other threads while the main thread admits: the release path's
/// counters and hand-back shards across threads.
#[test]
fn owned_permits_released_on_other_threads() {
    let b = bulkhead(4, 0, 1_000);
    let mut handles = Vec::new();
    for _ in 0..3 {
        let permit = b
            .try_acquire_owned(&LlmRequest::new(), tokens(50, 50))
            .unwrap();
        handles.push(thread::spawn(move || {
            permit.release(Some(TokenUsage::new(20, 20).unwrap()))
        }));
    }
    for handle in handles {
        assert_eq!(handle.join().unwrap().refunded_tokens, 60);
    }
    assert_idle(&b);
    assert_eq!(b.stats().admitted, 3);
}

/// A queued async waiter is handed the slot by a release on another thread (event-listener
/// notify, atomic-waker wake).
#[test]
fn a_queued_waiter_is_handed_the_slot_across_threads() {
    let b = bulkhead(1, 2, 100);
    let held = b
        .try_acquire_owned(&LlmRequest::new(), tokens(10, 10))
        .unwrap();
    let releaser = thread::spawn(move || {
        thread::sleep(Duration::from_millis(1));
        drop(held);
    });
    let permit = block_on(b.acquire(&LlmRequest::new(), tokens(5, 5))).unwrap();
    assert_eq!(permit.held_tokens(), 10);
    releaser.join().unwrap();
    drop(permit);
    assert_idle(&b);
}

/// The blocking wait, woken by a release, and a second one refused by `close`.
#[test]
fn blocking_waits_are_woken_by_release_and_close() {
    let b = bulkhead(1, 2, 100);
    let held = b
        .try_acquire_owned(&LlmRequest::new(), tokens(10, 10))
        .unwrap();
    let waiter = {
        let b = b.clone();
        thread::spawn(move || {
            b.acquire_blocking_owned(&LlmRequest::new(), tokens(1, 1))
                .map(|p| p.held_tokens())
        })
    };
    while b.stats().pending == 0 {
        thread::yield_now();
    }
    drop(held);
    assert_eq!(waiter.join().unwrap().unwrap(), 2);

    let held = b
        .try_acquire_owned(&LlmRequest::new(), tokens(10, 10))
        .unwrap();
    let refused = {
        let b = b.clone();
        thread::spawn(move || {
            b.acquire_blocking_owned(&LlmRequest::new(), tokens(1, 1))
                .map(drop)
                .unwrap_err()
        })
    };
    while b.stats().pending == 0 {
        thread::yield_now();
    }
    assert!(b.close());
    let err = refused.join().unwrap();
    assert_eq!(err.rejection().unwrap().reason(), RejectReason::Shutdown);
    drop(held);
    block_on(b.drain());
    assert_idle(&b);
}

/// A queue timeout fires (the timer thread) and the waiter leaves the queue.
#[test]
fn a_queue_timeout_fires() {
    let b = bulkhead(1, 1, 100);
    let held = b.try_acquire(&LlmRequest::new(), tokens(1, 1)).unwrap();
    // A zero timeout: the wait ends at its first poll, through the same withdrawal a timer's
    // wake-up leads to. A timeout long enough to register with the timer would start its
    // threads, which outlive the test (Miri reports threads left running at exit).
    let err =
        block_on(b.acquire(&LlmRequest::new(), tokens(1, 1).timeout(Duration::ZERO))).unwrap_err();
    assert_eq!(err.rejection().unwrap().reason(), RejectReason::Timeout);
    drop(held);
    assert_idle(&b);
}

/// Listeners subscribed and dropped on one thread while another admits (arc-swap list).
#[test]
fn listeners_come_and_go_while_another_thread_admits() {
    let b = bulkhead(2, 0, 1_000);
    let heard = Arc::new(AtomicU64::new(0));
    let admitter = {
        let b = b.clone();
        thread::spawn(move || {
            for _ in 0..20 {
                let permit = b.try_acquire(&LlmRequest::new(), tokens(1, 1)).unwrap();
                permit.release(None);
            }
        })
    };
    for _ in 0..5 {
        let heard = Arc::clone(&heard);
        let subscription = b.on(move |event| {
            if let Event::Admit(_) = event {
                heard.fetch_add(1, Ordering::Relaxed);
            }
        });
        thread::yield_now();
        drop(subscription);
    }
    admitter.join().unwrap();
    assert!(heard.load(Ordering::Relaxed) <= 20);
    assert_idle(&b);
    assert_eq!(b.stats().admitted, 20);
}

/// Admission classes: the 128-bit admission word goes through `portable-atomic` (its own
/// `unsafe`), and the class words through the class lock, from two threads at once.
#[test]
fn admission_classes_across_threads() {
    use async_bulkhead_llm::{classes::AdmissionClasses, classes::ClassLimits};

    let bulkhead = LlmBulkhead::builder("gpt-4o", 3)
        .token_budget(TokenBudget::new(1000))
        .admission_classes(
            AdmissionClasses::new("batch")
                .class("premium", ClassLimits::new().protected_concurrent(1))
                .class("batch", ClassLimits::new()),
        )
        .build()
        .unwrap();
    let premium = bulkhead.class("premium").unwrap();
    let handles: Vec<_> = [Some(premium), None]
        .into_iter()
        .map(|class| {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                for _ in 0..3 {
                    let mut options = tokens(10, 20);
                    if let Some(class) = class {
                        options = options.class(class);
                    }
                    if let Ok(mut permit) = bulkhead.try_acquire_owned(&LlmRequest::new(), options)
                    {
                        permit.abandon_borrowed_concurrency();
                        permit.report_usage(TokenUsage::new(5, 5).unwrap()).unwrap();
                    }
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
    assert_idle(&bulkhead);
    let classes = bulkhead.stats().admission_classes.unwrap();
    assert_eq!(
        (classes.shared.in_flight, classes.classes[0].in_flight),
        (0, 0)
    );
}

#[test]
fn shared_calls_across_threads() {
    // The digest (`sha2`, whose SIMD paths are `unsafe`) and a flight driven by whichever
    // thread polls it, woken from another.
    let bulkhead = LlmBulkhead::builder("gpt-4o", 2)
        .deduplication(async_bulkhead_llm::dedup::Deduplication::new())
        .build()
        .unwrap();
    let request = LlmRequest::new().user("x".repeat(300));
    let (open, gate) = futures::channel::oneshot::channel::<()>();
    let leader = bulkhead.run_shared(&request, AcquireOptions::new(), move |_ctx| async move {
        let _ = gate.await;
        Ok::<_, String>(7u64)
    });
    let followers: Vec<_> = (0..2)
        .map(|_| {
            let follower = bulkhead.run_shared(&request, AcquireOptions::new(), |_ctx| async {
                Ok::<_, String>(0u64)
            });
            thread::spawn(move || block_on(follower))
        })
        .collect();
    let opener = thread::spawn(move || open.send(()));
    assert_eq!(block_on(leader), Ok(7));
    opener.join().unwrap().unwrap();
    for follower in followers {
        assert_eq!(follower.join().unwrap(), Ok(7));
    }
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.in_flight), (1, 0));
    assert_eq!(stats.deduplication.unwrap().hits, 2);
}

/// The general `Bulkhead` across threads: a release on another thread passes its slot to a
/// queued async waiter and to a blocked thread (the slot changes hands under the queue lock,
/// atomic-waker and event-listener wake them), a cancelled waiter leaves the queue, and the
/// waiters come from (and go back to) the threads' pools.
#[test]
fn the_general_bulkhead_hands_slots_across_threads() {
    let bulkhead = async_bulkhead_llm::Bulkhead::builder(1)
        .max_queue(4)
        .wait_indefinitely()
        .build()
        .unwrap();
    for _ in 0..2 {
        let held = bulkhead.try_acquire_owned().unwrap();
        let releaser = thread::spawn(move || drop(held));
        let permit = block_on(bulkhead.acquire()).unwrap();
        releaser.join().unwrap();

        let mut cancelled = Box::pin(bulkhead.acquire());
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        assert!(cancelled.as_mut().poll(&mut cx).is_pending());
        drop(cancelled);

        let blocked = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || bulkhead.acquire_blocking().map(drop).is_ok())
        };
        while bulkhead.state().queued == 0 {
            thread::yield_now();
        }
        drop(permit);
        assert!(blocked.join().unwrap());
    }
    let stats = bulkhead.stats();
    assert_eq!((stats.active, stats.queued, stats.cancelled), (0, 0, 2));
    assert_eq!(stats.admitted, stats.released);
}
