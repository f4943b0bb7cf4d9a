//! The blocking acquires, from plain std threads: a blocked thread is handed the slot a
//! release frees (in FIFO order with other blocked threads), gives up at the queue timeout,
//! and is woken with `Shutdown` by `close`.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use async_bulkhead_llm::{Bulkhead, BulkheadError};

use crate::support::{PATIENCE, bulkhead, eventually, st};

#[test]
fn a_blocked_thread_is_handed_the_slot_a_release_frees_in_fifo_order() {
    let bulkhead = bulkhead(1, 4);
    let held = bulkhead.acquire_blocking().expect("free");
    let (served, order) = mpsc::channel();
    let mut threads = Vec::new();
    for id in 0..3 {
        let (shared, served) = (bulkhead.clone(), served.clone());
        threads.push(thread::spawn(move || {
            let permit = shared.acquire_blocking_owned().expect("handed over");
            served.send(id).expect("the test listens");
            drop(permit);
        }));
        // The next thread queues only once this one has.
        eventually("the thread queues", || bulkhead.state() == st(1, id + 1));
    }
    drop(held);
    let order: Vec<u64> = (0..3)
        .map(|_| order.recv_timeout(PATIENCE).expect("served"))
        .collect();
    assert_eq!(order, vec![0, 1, 2], "in arrival order");
    for thread in threads {
        thread.join().expect("no panic");
    }
    assert_eq!(bulkhead.state(), st(0, 0));
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released), (4, 4));
}

#[test]
fn a_blocked_thread_gives_up_at_the_queue_timeout() {
    let timeout = Duration::from_millis(30);
    let bulkhead = Bulkhead::builder(1)
        .queue_timeout(timeout)
        .build()
        .expect("valid");
    let _held = bulkhead.acquire_blocking_owned().expect("free");
    let waiter = {
        let bulkhead = bulkhead.clone();
        thread::spawn(move || {
            let started = Instant::now();
            (bulkhead.acquire_blocking().map(drop), started.elapsed())
        })
    };
    let (refused, elapsed) = waiter.join().expect("no panic");
    let Err(BulkheadError::QueueTimeout { waited, state }) = refused else {
        panic!("expected a queue timeout, got {refused:?}")
    };
    assert!(waited >= timeout && elapsed >= timeout && elapsed < PATIENCE);
    assert_eq!(state, st(1, 0));
    assert_eq!(bulkhead.stats().timed_out, 1);
}

#[test]
fn close_wakes_a_blocked_thread_with_shutdown() {
    let bulkhead = Bulkhead::builder(1)
        .wait_indefinitely()
        .build()
        .expect("valid");
    let held = bulkhead.try_acquire_owned().expect("free");
    let waiter = {
        let bulkhead = bulkhead.clone();
        thread::spawn(move || bulkhead.acquire_blocking().map(drop))
    };
    eventually("the thread queues", || bulkhead.state() == st(1, 1));
    assert!(bulkhead.close());
    assert_eq!(
        waiter.join().expect("no panic"),
        Err(BulkheadError::Shutdown { state: st(1, 0) })
    );
    drop(held);
    assert_eq!(bulkhead.state(), st(0, 0));
}

#[test]
fn an_owned_permit_is_released_on_another_thread_and_hands_its_slot_on() {
    let bulkhead = bulkhead(1, 1);
    let permit = bulkhead.acquire_blocking_owned().expect("free");
    assert_eq!(permit.bulkhead().state(), st(1, 0));
    let waiter = {
        let bulkhead = bulkhead.clone();
        thread::spawn(move || bulkhead.acquire_blocking().map(|p| p.id()))
    };
    eventually("the thread queues", || bulkhead.state() == st(1, 1));
    thread::spawn(move || permit.release())
        .join()
        .expect("no panic");
    waiter.join().expect("no panic").expect("handed over");
    assert_eq!(bulkhead.state(), st(0, 0));
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released), (2, 2));
}
