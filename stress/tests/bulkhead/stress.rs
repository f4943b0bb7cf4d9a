//! Stress: tasks on a tokio multi-thread runtime and plain OS threads hammer one bulkhead with
//! every way in (`try_acquire`, `acquire`, `acquire_by` with short deadlines, `call`, queued
//! futures dropped after one poll, blocking acquires with and without a deadline). A counter
//! incremented while a permit is held never exceeds `max_concurrent`; at the end nothing is
//! active or queued, and the statistics match the callers' own tally exactly: every attempt
//! counted once, as admitted, refused `QueueFull`, timed out or cancelled.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::thread;
use std::time::{Duration, Instant};

use async_bulkhead_llm::bulkhead::WaitOptions;
use async_bulkhead_llm::{Bulkhead, BulkheadError};

use crate::support::{Heard, st};

const MAX_CONCURRENT: u32 = 4;
const TASKS: u64 = 8;
const THREADS: u64 = 2;
const OPS_PER_TASK: u64 = 4_000;
const OPS_PER_THREAD: u64 = 2_500;

/// What the callers saw, counted by them.
#[derive(Default)]
struct Tally {
    attempts: AtomicU64,
    admitted: AtomicU64,
    queue_full: AtomicU64,
    timed_out: AtomicU64,
    cancelled: AtomicU64,
    /// Permits held right now, counted independently of the bulkhead.
    inside: AtomicU64,
    /// The most ever held at once.
    most_inside: AtomicU64,
}

impl Tally {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a refused attempt.
    fn refused(&self, error: BulkheadError) {
        match error {
            BulkheadError::QueueFull { .. } => Tally::bump(&self.queue_full),
            BulkheadError::QueueTimeout { .. } => Tally::bump(&self.timed_out),
            other => panic!("never closed, yet refused: {other}"),
        }
    }

    /// Enters the critical section a permit guards.
    fn enter(&self) {
        Tally::bump(&self.admitted);
        let now = self.inside.fetch_add(1, Ordering::AcqRel) + 1;
        assert!(
            now <= u64::from(MAX_CONCURRENT),
            "{now} permits held at once"
        );
        self.most_inside.fetch_max(now, Ordering::Relaxed);
    }

    /// Leaves it (before the permit drops).
    fn leave(&self) {
        self.inside.fetch_sub(1, Ordering::AcqRel);
    }
}

async fn hold_briefly(rng: &mut fastrand::Rng) {
    for _ in 0..rng.u8(0..6) {
        tokio::task::yield_now().await;
    }
}

async fn task(bulkhead: Bulkhead, tally: Arc<Tally>, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    for _ in 0..OPS_PER_TASK {
        Tally::bump(&tally.attempts);
        match rng.u8(0..5) {
            0 => match bulkhead.try_acquire() {
                Ok(permit) => {
                    tally.enter();
                    hold_briefly(&mut rng).await;
                    tally.leave();
                    drop(permit);
                }
                Err(error) => tally.refused(error),
            },
            1 => match bulkhead.acquire_owned().await {
                Ok(permit) => {
                    tally.enter();
                    hold_briefly(&mut rng).await;
                    tally.leave();
                    drop(permit);
                }
                Err(error) => tally.refused(error),
            },
            2 => {
                let deadline = Instant::now() + Duration::from_micros(rng.u64(0..300));
                match bulkhead
                    .acquire_with(WaitOptions::new().deadline(deadline))
                    .await
                {
                    Ok(permit) => {
                        tally.enter();
                        hold_briefly(&mut rng).await;
                        tally.leave();
                        drop(permit);
                    }
                    Err(error) => tally.refused(error),
                }
            }
            3 => {
                let called = bulkhead
                    .run(async {
                        tally.enter();
                        hold_briefly(&mut rng).await;
                        tally.leave();
                    })
                    .await;
                if let Err(error) = called {
                    tally.refused(error);
                }
            }
            _ => {
                // Polled once, then dropped if it queued (it may have been handed a slot
                // meanwhile: still a cancellation).
                let mut waiter = bulkhead.acquire();
                match futures::poll!(&mut waiter) {
                    Poll::Ready(Ok(permit)) => {
                        tally.enter();
                        tally.leave();
                        drop(permit);
                    }
                    Poll::Ready(Err(error)) => tally.refused(error),
                    Poll::Pending => {
                        if rng.bool() {
                            tokio::task::yield_now().await;
                        }
                        drop(waiter);
                        Tally::bump(&tally.cancelled);
                    }
                }
            }
        }
    }
}

fn blocking_thread(bulkhead: &Bulkhead, tally: &Tally, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    for _ in 0..OPS_PER_THREAD {
        Tally::bump(&tally.attempts);
        let acquired = if rng.bool() {
            bulkhead.acquire_blocking()
        } else {
            bulkhead.acquire_blocking_with(
                WaitOptions::new()
                    .deadline(Instant::now() + Duration::from_micros(rng.u64(0..300))),
            )
        };
        match acquired {
            Ok(permit) => {
                tally.enter();
                for _ in 0..rng.u8(0..4) {
                    thread::yield_now();
                }
                tally.leave();
                drop(permit);
            }
            Err(error) => tally.refused(error),
        }
    }
}

#[test]
fn tasks_and_threads_never_exceed_max_concurrent_and_every_attempt_is_counted_once() {
    let started = Instant::now();
    let heard = Heard::new();
    let bulkhead = heard
        .on(Bulkhead::builder(MAX_CONCURRENT as usize)
            .max_queue(6)
            .queue_timeout(Duration::from_millis(5)))
        .build()
        .expect("valid");
    let tally = Arc::new(Tally::default());
    let seed = fastrand::u64(..);
    println!("stress seed {seed}");

    let threads: Vec<_> = (0..THREADS)
        .map(|i| {
            let (bulkhead, tally) = (bulkhead.clone(), Arc::clone(&tally));
            thread::spawn(move || blocking_thread(&bulkhead, &tally, seed ^ (100 + i)))
        })
        .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async {
        let tasks: Vec<_> = (0..TASKS)
            .map(|i| tokio::spawn(task(bulkhead.clone(), Arc::clone(&tally), seed ^ i)))
            .collect();
        for task in tasks {
            task.await.expect("no task panicked");
        }
    });
    for thread in threads {
        thread.join().expect("no thread panicked");
    }

    assert_eq!(bulkhead.state(), st(0, 0));
    let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    let stats = bulkhead.stats();
    let attempts = TASKS * OPS_PER_TASK + THREADS * OPS_PER_THREAD;
    assert_eq!(load(&tally.attempts), attempts);
    assert_eq!(stats.admitted, load(&tally.admitted), "{stats:?}");
    assert_eq!(stats.released, stats.admitted);
    assert_eq!(stats.rejected_queue_full, load(&tally.queue_full));
    assert_eq!(stats.timed_out, load(&tally.timed_out));
    assert_eq!(stats.cancelled, load(&tally.cancelled));
    assert_eq!((stats.rejected_shutdown, stats.hook_panics), (0, 0));
    assert_eq!(
        stats.admitted + stats.rejected_queue_full + stats.timed_out + stats.cancelled,
        attempts,
        "every attempt counted exactly once"
    );
    assert_eq!(
        heard.count() as u64,
        stats.rejected_queue_full + stats.timed_out,
        "the hook heard every refusal, and no cancellation"
    );
    assert_eq!(load(&tally.inside), 0);
    let most = load(&tally.most_inside);
    assert!(most >= 1 && most <= u64::from(MAX_CONCURRENT));
    println!(
        "stress: {attempts} attempts in {:?}, at most {most} inside, {stats:?}",
        started.elapsed()
    );
}

/// A control plane lowers and raises `max_concurrent` (between 1 and 4) as fast as it can while
/// tasks and threads queue, are handed slots (a release passing its slot straight to the queue
/// head, or the pump after raised limits) and release. Every wait is bounded by a 2 s deadline
/// that no waiter may reach: slots are held for microseconds, so a waiter still queued after 2 s
/// was stranded (a slot freed and nobody served). Nothing is ever held above the largest limit,
/// and at the end nothing is active or queued and the books balance.
#[test]
fn limits_changing_under_hand_offs_strand_no_waiter_and_exceed_no_limit() {
    let bulkhead = Bulkhead::builder(MAX_CONCURRENT as usize)
        .max_queue(64)
        .wait_indefinitely()
        .build()
        .expect("valid");
    let tally = Arc::new(Tally::default());
    let seed = fastrand::u64(..);
    println!("limits stress seed {seed}");
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let control = {
        let (bulkhead, done) = (bulkhead.clone(), Arc::clone(&done));
        thread::spawn(move || {
            let mut rng = fastrand::Rng::with_seed(seed);
            let mut changes = 0u64;
            while !done.load(Ordering::Relaxed) {
                bulkhead
                    .set_max_concurrent(rng.usize(1..=MAX_CONCURRENT as usize))
                    .expect("a valid limit");
                changes += 1;
                for _ in 0..rng.u8(0..50) {
                    std::hint::spin_loop();
                }
            }
            changes
        })
    };
    let waits = |tally: &Tally, result: Result<(), BulkheadError>| match result {
        Ok(()) => {}
        Err(error) => panic!(
            "a waiter was stranded or refused: {error} ({:?})",
            tally.attempts
        ),
    };
    let threads: Vec<_> = (0..THREADS)
        .map(|i| {
            let (bulkhead, tally) = (bulkhead.clone(), Arc::clone(&tally));
            thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(seed ^ (100 + i));
                for _ in 0..OPS_PER_THREAD / 2 {
                    Tally::bump(&tally.attempts);
                    let acquired = bulkhead
                        .acquire_blocking_with(
                            WaitOptions::new().deadline(Instant::now() + Duration::from_secs(2)),
                        )
                        .map(|permit| {
                            tally.enter();
                            for _ in 0..rng.u8(0..4) {
                                thread::yield_now();
                            }
                            tally.leave();
                            drop(permit);
                        });
                    waits(&tally, acquired);
                }
            })
        })
        .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async {
        let tasks: Vec<_> = (0..TASKS)
            .map(|i| {
                let (bulkhead, tally) = (bulkhead.clone(), Arc::clone(&tally));
                tokio::spawn(async move {
                    let mut rng = fastrand::Rng::with_seed(seed ^ i);
                    for _ in 0..OPS_PER_TASK / 2 {
                        Tally::bump(&tally.attempts);
                        let deadline = Instant::now() + Duration::from_secs(2);
                        match bulkhead
                            .acquire_with(WaitOptions::new().deadline(deadline))
                            .await
                        {
                            Ok(permit) => {
                                tally.enter();
                                hold_briefly(&mut rng).await;
                                tally.leave();
                                drop(permit);
                            }
                            Err(error) => waits(&tally, Err(error)),
                        }
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("no task panicked");
        }
    });
    for thread in threads {
        thread.join().expect("no thread panicked");
    }
    done.store(true, Ordering::Relaxed);
    let changes = control.join().expect("the control plane did not panic");

    assert_eq!(bulkhead.state(), st(0, 0));
    let stats = bulkhead.stats();
    let attempts = TASKS * (OPS_PER_TASK / 2) + THREADS * (OPS_PER_THREAD / 2);
    assert_eq!(stats.admitted, attempts, "{stats:?}");
    assert_eq!(stats.released, attempts);
    assert_eq!(
        (stats.rejected_queue_full, stats.timed_out, stats.cancelled),
        (0, 0, 0)
    );
    assert_eq!(stats.limits.revision, changes);
    assert!(changes > 0);
    println!("limits stress: {attempts} admissions across {changes} limit changes");
}
