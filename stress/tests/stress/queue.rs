//! Queue stress on real runtimes (tokio multi-thread, smol, async-std) and on blocked threads:
//! many tasks acquire with random priorities, reservations and timeouts, give up at random
//! points (dropping their futures), hold and release with or without usage, while a control
//! plane changes the limits and finally closes the bulkhead. Every run ends with exact
//! invariants: nothing in flight or queued, every token back, every counter accounted for, and
//! `drain()` resolves.
//!
//! `STRESS_SCALE` (default 1) multiplies the number of tasks, e.g. `STRESS_SCALE=100`.

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, Limits, LlmBulkhead, LlmRequest, Priority, RejectReason,
    Reservation, TokenBudget, TokenUsage,
};
use futures::future::{Either, select};

use crate::kit::runtimes::yields;
use crate::kit::scale;

/// An empty request for futures that outlive the statement that made them (an acquire
/// borrows its request until its first poll).
static EMPTY_REQUEST: std::sync::LazyLock<async_bulkhead_llm::LlmRequest> =
    std::sync::LazyLock::new(async_bulkhead_llm::LlmRequest::new);

/// What the tasks saw, to compare with the bulkhead's own counters.
#[derive(Default)]
struct Tally {
    admitted: AtomicU64,
    refused: [AtomicU64; RejectReason::ALL.len()],
    abandoned: AtomicU64,
    consumed: AtomicU64,
    refunded: AtomicU64,
    /// Callers that finished.
    done: AtomicU64,
}

impl Tally {
    fn refused(&self, reason: RejectReason) {
        let i = RejectReason::ALL.iter().position(|&r| r == reason).unwrap();
        self.refused[i].fetch_add(1, Ordering::Relaxed);
    }

    fn refused_count(&self, reason: RejectReason) -> u64 {
        let i = RejectReason::ALL.iter().position(|&r| r == reason).unwrap();
        self.refused[i].load(Ordering::Relaxed)
    }
}

/// One task: acquire (maybe giving up at a random point), hold, settle.
async fn caller(bulkhead: LlmBulkhead, tally: Arc<Tally>, seed: u64) {
    call(&bulkhead, &tally, seed).await;
    tally.done.fetch_add(1, Ordering::AcqRel);
}

async fn call(bulkhead: &LlmBulkhead, tally: &Tally, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let reservation = Reservation::new(rng.u64(0..200), rng.u64(0..400)).unwrap();
    let mut options = AcquireOptions::new().reservation(reservation);
    if rng.bool() {
        options = options.priority(Priority::High);
    }
    if rng.u8(0..3) == 0 {
        options = options.timeout(Duration::from_micros(rng.u64(0..2_000)));
    }
    let acquire = bulkhead.acquire(&EMPTY_REQUEST, options);
    let result = if rng.u8(0..4) == 0 {
        // Give up after a few executor turns: the acquire future is dropped wherever it is.
        match select(pin!(acquire), pin!(yields(rng.usize(0..6)))).await {
            Either::Left((result, _)) => result,
            Either::Right(_) => {
                tally.abandoned.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    } else {
        acquire.await
    };
    let permit = match result {
        Ok(permit) => permit,
        Err(AcquireError::Rejected(rejection)) => {
            tally.refused(rejection.reason());
            return;
        }
        Err(AcquireError::Invalid(error)) => panic!("valid input refused: {error}"),
        Err(other) => panic!("an error this test does not know: {other}"),
    };
    tally.admitted.fetch_add(1, Ordering::Relaxed);
    assert_eq!(permit.held_tokens(), reservation.reserved());
    yields(rng.usize(0..4)).await;
    if rng.bool() {
        drop(permit);
    } else {
        let total = rng.u64(0..=reservation.reserved() + 50);
        let usage = TokenUsage::new(total / 3, total - total / 3).unwrap();
        let report = permit.release(Some(usage));
        tally.consumed.fetch_add(total, Ordering::Relaxed);
        tally
            .refunded
            .fetch_add(report.refunded_tokens, Ordering::Relaxed);
    }
}

/// The control plane: limit changes while the callers run, then a close once `close_after`
/// callers have finished.
async fn control_plane(bulkhead: LlmBulkhead, seed: u64, tally: Arc<Tally>, close_after: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut revision = 0;
    while tally.done.load(Ordering::Acquire) < close_after {
        revision += 1;
        // Mostly open, sometimes the kill switch (0 slots) with waiters preserved.
        let max_concurrent = if rng.u8(0..8) == 0 { 0 } else { rng.u32(1..6) };
        let limits = Limits::new(revision, max_concurrent)
            .with_max_queue(rng.u32(0..10))
            .with_token_budget(rng.u64(300..3_000), rng.u64(0..300));
        assert!(bulkhead.apply_limits(limits).unwrap().is_applied());
        yields(rng.usize(1..20)).await;
    }
    assert!(bulkhead.close());
}

/// Runs the scenario with `spawn` (which returns a future that completes with the task).
async fn scenario(
    seed: u64,
    spawn: impl Fn(Pin<Box<dyn Future<Output = ()> + Send>>) -> Pin<Box<dyn Future<Output = ()> + Send>>,
) {
    let bulkhead = LlmBulkhead::builder("m", 3)
        .max_queue(8)
        .token_budget(TokenBudget::new(1_500))
        .build()
        .unwrap();
    let tally = Arc::new(Tally::default());
    let tasks = 1_000 * scale();
    let first_wave = tasks * 3 / 4;
    // The control plane closes the bulkhead halfway through the first wave, with calls in
    // flight and in the queue; the second wave starts after the close and must be refused.
    let plane = control_plane(bulkhead.clone(), seed, tally.clone(), first_wave / 2);
    let plane = spawn(Box::pin(plane));
    let wave = |range: std::ops::Range<u64>| {
        range
            .map(|i| {
                spawn(Box::pin(caller(
                    bulkhead.clone(),
                    tally.clone(),
                    seed * 1_000_003 + i,
                )))
            })
            .collect::<Vec<_>>()
    };
    futures::future::join_all(wave(0..first_wave)).await;
    plane.await;
    let shutdowns_before = tally.refused_count(RejectReason::Shutdown);
    futures::future::join_all(wave(first_wave..tasks)).await;
    assert_eq!(
        tally.refused_count(RejectReason::Shutdown) - shutdowns_before,
        tasks - first_wave,
        "every call after the close was refused with shutdown"
    );

    bulkhead.drain().await;
    let stats = bulkhead.stats();
    let tokens = stats.token_budget.unwrap();
    assert!(stats.closed);
    assert_eq!(
        (stats.in_flight, stats.pending, tokens.in_flight_tokens),
        (0, 0, 0)
    );
    assert_eq!(stats.admitted, tally.admitted.load(Ordering::Relaxed));
    assert_eq!(stats.released, stats.admitted);
    let by = stats.rejected_by_reason;
    // A caller that gives up after the bulkhead already decided its fate (refused at its turn
    // for tokens, or by the close) was counted with that reason, not as aborted: the refusal
    // came first. So each reason counts at least what the callers saw, and the difference is
    // exactly the callers that gave up.
    let abandoned = tally.abandoned.load(Ordering::Relaxed);
    let mut unseen = 0;
    for &reason in RejectReason::ALL {
        let seen = tally.refused_count(reason);
        assert!(
            by.get(reason) >= seen,
            "{reason}: {} counted, {seen} seen",
            by.get(reason)
        );
        unseen += by.get(reason) - seen;
    }
    assert_eq!(
        unseen, abandoned,
        "every abandoned call counted exactly once"
    );
    assert!(by.aborted <= abandoned + tally.refused_count(RejectReason::Aborted));
    assert_eq!(
        stats.admitted + stats.rejected,
        tasks,
        "every caller decided exactly once"
    );
    assert_eq!(
        tokens.total_consumed,
        tally.consumed.load(Ordering::Relaxed)
    );
    assert_eq!(
        tokens.total_refunded,
        tally.refunded.load(Ordering::Relaxed)
    );
}

#[test]
fn tokio_multi_thread() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .build()
        .unwrap();
    for seed in 0..3 {
        runtime.block_on(scenario(seed, |task| {
            let handle = tokio::spawn(task);
            Box::pin(async move { handle.await.unwrap() })
        }));
    }
}

#[test]
fn tokio_current_thread() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(scenario(10, |task| {
        let handle = tokio::spawn(task);
        Box::pin(async move { handle.await.unwrap() })
    }));
}

#[test]
fn smol_executor() {
    for seed in 20..22 {
        smol::block_on(scenario(seed, |task| Box::pin(smol::spawn(task))));
    }
}

#[test]
fn async_std_executor() {
    for seed in 30..32 {
        async_std::task::block_on(scenario(seed, |task| {
            Box::pin(async_std::task::spawn(task))
        }));
    }
}

#[test]
fn futures_block_on_with_a_thread_pool() {
    let pool = futures::executor::ThreadPool::builder()
        .pool_size(3)
        .create()
        .unwrap();
    futures::executor::block_on(scenario(40, |task| {
        let (remote, handle) = futures::FutureExt::remote_handle(task);
        pool.spawn_ok(remote);
        Box::pin(handle)
    }));
}

/// Blocked threads instead of tasks: the same invariants.
#[test]
fn blocking_threads() {
    let bulkhead = LlmBulkhead::builder("m", 2).max_queue(6).build().unwrap();
    let admitted = AtomicU64::new(0);
    let timed_out = AtomicU64::new(0);
    let shut = AtomicU64::new(0);
    let threads = 12u64;
    std::thread::scope(|s| {
        for t in 0..threads {
            let (bulkhead, admitted, timed_out, shut) = (&bulkhead, &admitted, &timed_out, &shut);
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t);
                for _ in 0..200 * scale() {
                    let options =
                        AcquireOptions::new().timeout(Duration::from_micros(rng.u64(0..3_000)));
                    match bulkhead.acquire_blocking(&LlmRequest::new(), options) {
                        Ok(permit) => {
                            admitted.fetch_add(1, Ordering::Relaxed);
                            for _ in 0..rng.usize(0..200) {
                                std::hint::spin_loop();
                            }
                            drop(permit);
                        }
                        Err(err) => match err.rejection().unwrap().reason() {
                            RejectReason::Timeout => {
                                timed_out.fetch_add(1, Ordering::Relaxed);
                            }
                            RejectReason::Shutdown => {
                                shut.fetch_add(1, Ordering::Relaxed);
                            }
                            RejectReason::QueueLimit => {}
                            other => panic!("unexpected {other}"),
                        },
                    }
                }
            });
        }
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(30));
            bulkhead.close();
        });
    });
    futures::executor::block_on(bulkhead.drain());
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.pending), (0, 0));
    assert_eq!(stats.admitted, admitted.load(Ordering::Relaxed));
    assert_eq!(
        stats.rejected_by_reason.timeout,
        timed_out.load(Ordering::Relaxed)
    );
    assert_eq!(
        stats.rejected_by_reason.shutdown,
        shut.load(Ordering::Relaxed)
    );
    assert_eq!(stats.admitted + stats.rejected, threads * 200 * scale());
}

/// A first poll that the word refuses for want of a slot but that the queue lock admits (the
/// holder released in between) resolves to a permit, on `acquire` and `acquire_owned` alike:
/// two threads take and return one slot as fast as they can, so that window is hit often.
#[test]
fn first_polls_admitted_under_the_queue_lock_resolve_to_permits() {
    let bulkhead = LlmBulkhead::builder("m", 1).max_queue(4).build().unwrap();
    let rounds = 100_000 * scale();
    let start = Arc::new(std::sync::Barrier::new(2));
    let threads: Vec<_> = (0..2)
        .map(|t| {
            let bulkhead = bulkhead.clone();
            let start = Arc::clone(&start);
            std::thread::spawn(move || {
                let request = LlmRequest::new();
                start.wait();
                for i in 0..rounds {
                    if (i + t) % 2 == 0 {
                        let permit = futures::executor::block_on(
                            bulkhead.acquire(&request, AcquireOptions::new()),
                        );
                        drop(permit.expect("a queued call is admitted"));
                    } else {
                        let permit = futures::executor::block_on(
                            bulkhead.acquire_owned(&request, AcquireOptions::new()),
                        );
                        drop(permit.expect("a queued call is admitted"));
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    let stats = bulkhead.stats();
    assert_eq!(stats.admitted, 2 * rounds);
    assert_eq!(stats.released, 2 * rounds);
    assert_eq!(stats.rejected, 0);
    assert_eq!((stats.in_flight, stats.pending), (0, 0));
}
