//! The blocking acquires, from plain threads.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use async_bulkhead_llm::RejectReason;

use crate::support::{
    PATIENCE, SHORT, figures, opts, plain, reason_of, rejection, req, wait_until, within,
};

#[test]
fn blocking_acquires_from_threads_are_served_one_at_a_time_in_fifo_order() {
    const THREADS: usize = 6;
    let bulkhead = plain(1, 8);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let active = AtomicUsize::new(0);
    let most = AtomicUsize::new(0);
    let order = Mutex::new(Vec::new());
    thread::scope(|s| {
        let mut workers = Vec::new();
        for i in 0..THREADS {
            let (bulkhead, active, most, order) = (&bulkhead, &active, &most, &order);
            let critical = move || {
                let now = active.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                order.lock().expect("not poisoned").push(i);
                thread::sleep(Duration::from_millis(1));
                active.fetch_sub(1, Ordering::SeqCst);
            };
            workers.push(s.spawn(move || {
                if i % 2 == 0 {
                    let permit = bulkhead
                        .acquire_blocking(&req(), opts())
                        .expect("served in turn");
                    critical();
                    drop(permit);
                } else {
                    let permit = bulkhead
                        .acquire_blocking_owned(&req(), opts())
                        .expect("served in turn");
                    critical();
                    drop(permit);
                }
            }));
            // Queue the threads one after another, so their order is known.
            wait_until("the thread is queued", || {
                bulkhead.stats().pending == i as u64 + 1
            });
        }
        assert_eq!(figures(&bulkhead), (1, THREADS as u64, 1));
        drop(held);
        for worker in workers {
            worker.join().expect("worker did not panic");
        }
    });
    assert_eq!(
        *order.lock().expect("not poisoned"),
        (0..THREADS).collect::<Vec<_>>()
    );
    assert_eq!(most.load(Ordering::SeqCst), 1, "one at a time");
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.pending,
            stats.admitted,
            stats.released
        ),
        (0, 0, THREADS as u64 + 1, THREADS as u64 + 1)
    );
    assert_eq!(stats.rejected, 0);
}

#[test]
fn a_blocking_acquire_with_a_short_timeout_returns_timeout() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let started = Instant::now();
    let refused = rejection(bulkhead.acquire_blocking(&req(), within(SHORT)));
    assert_eq!(refused.reason(), RejectReason::Timeout);
    let waited = started.elapsed();
    assert!(waited >= SHORT && waited < PATIENCE, "waited {waited:?}");
    assert_eq!(
        reason_of(bulkhead.acquire_blocking_owned(&req(), within(SHORT))),
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
    // Without a queue, a blocking acquire refuses at once.
    let no_queue = plain(1, 0);
    let _h = no_queue.try_acquire(&req(), opts()).expect("free slot");
    assert_eq!(
        reason_of(no_queue.acquire_blocking(&req(), opts())),
        RejectReason::ConcurrencyLimit
    );
    drop(held);
    // With a free slot it returns at once.
    let permit = bulkhead
        .acquire_blocking(&req(), within(Duration::ZERO))
        .expect("free slot");
    drop(permit);
}

#[test]
fn close_wakes_blocked_waiters_with_shutdown() {
    const THREADS: u64 = 3;
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let workers: Vec<_> = (0..THREADS)
        .map(|i| {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                if i % 2 == 0 {
                    reason_of(bulkhead.acquire_blocking_owned(&req(), opts()))
                } else {
                    reason_of(bulkhead.acquire_blocking(&req(), opts()))
                }
            })
        })
        .collect();
    wait_until("every thread is queued", || {
        bulkhead.stats().pending == THREADS
    });
    assert!(bulkhead.close());
    for worker in workers {
        assert_eq!(
            worker.join().expect("worker did not panic"),
            RejectReason::Shutdown
        );
    }
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.pending,
            stats.in_flight,
            stats.rejected_by_reason.shutdown
        ),
        (0, 1, THREADS)
    );
    drop(held);
    assert_eq!(figures(&bulkhead), (0, 0, 1));
}
