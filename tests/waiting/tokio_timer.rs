//! The `tokio` feature: inside a tokio runtime whose time driver is on, queue timeouts and
//! deadlines wait on `tokio::time`, so under a paused clock (`start_paused`) a 2 s timeout
//! passes in 2 s of virtual time and next to no real time; without a tokio runtime the same
//! timeouts fire through the crate's own timer, in real time.
//!
//! The scenarios: a queued acquire's timeout, the borrowed-slot deadline of `run` and of
//! `run_shared`, a follower's own timeout, a drain deadline. Each runs twice: under `#[tokio::test(start_paused = true)]` (virtual elapsed
//! exactly 2 s, real elapsed under 500 ms) and under `futures::executor::block_on` (real
//! elapsed at least 2 s). Runtimes without a time driver are covered by `timeouts.rs`
//! (`timeouts_fire_on_tokio_*`) and `tests/classes/deadline.rs`.

use std::future::Future;
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, RunError, RunOptions,
    classes::AdmissionClasses, classes::ClassLimits, dedup::Deduplication,
};
use futures::executor::block_on;

use crate::support::{opts, plain, req, within};

/// The timeout every scenario waits for.
const TIMEOUT: Duration = Duration::from_secs(2);
/// The most real time a paused-clock scenario may take (it takes a few milliseconds).
const REAL_BOUND: Duration = Duration::from_millis(500);

/// A queued acquire with a 2 s queue timeout behind a held slot: refused `Timeout`.
async fn queued_acquire_times_out() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let refused = bulkhead.acquire(&req(), within(TIMEOUT)).await;
    let Err(AcquireError::Rejected(rejection)) = refused else {
        panic!("expected a timeout, got {refused:?}")
    };
    assert_eq!(rejection.reason(), RejectReason::Timeout);
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.pending,
            stats.rejected_by_reason.timeout,
            stats.admitted
        ),
        (0, 1, 1)
    );
    drop(held);
}

/// Two slots, one protected for `premium`: a `batch` call borrows the other from the shared
/// pool, so the borrowed-slot deadline applies to it.
fn tiers() -> LlmBulkhead {
    LlmBulkhead::builder("m", 2)
        .admission_classes(
            AdmissionClasses::new("batch")
                .class("premium", ClassLimits::new().protected_concurrent(1))
                .class("batch", ClassLimits::new()),
        )
        .build()
        .expect("valid configuration")
}

fn batch(bulkhead: &LlmBulkhead) -> RunOptions {
    AcquireOptions::new()
        .class(bulkhead.class("batch").expect("declared"))
        .borrowed_concurrency_deadline(TIMEOUT)
}

/// A `run` holding a borrowed slot forever: cut by its 2 s deadline.
async fn run_is_cut_at_its_deadline() {
    let bulkhead = tiers();
    let result = bulkhead
        .run(&LlmRequest::new(), batch(&bulkhead), async |_| {
            futures::future::pending::<Result<(), std::io::Error>>().await
        })
        .await;
    let Err(RunError::BorrowedConcurrencyDeadline(cut)) = result else {
        panic!("expected the deadline, got {result:?}")
    };
    assert_eq!(cut.deadline, TIMEOUT);
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.borrowed_concurrency_abandoned_by_cause.deadline
        ),
        (0, 1)
    );
}

/// The same through `run_shared` (the leader's own cut).
async fn shared_run_is_cut_at_its_deadline() {
    let bulkhead = tiers();
    let result = bulkhead
        .run_shared(&LlmRequest::new(), batch(&bulkhead), |_| {
            futures::future::pending::<Result<(), String>>()
        })
        .await;
    assert!(
        matches!(result, Err(RunError::BorrowedConcurrencyDeadline(_))),
        "expected the deadline, got {result:?}"
    );
    assert_eq!(bulkhead.stats().in_flight, 0);
}

/// A follower of a shared call that never ends leaves at its own 2 s timeout.
async fn follower_times_out() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .deduplication(Deduplication::new())
        .build()
        .expect("valid configuration");
    let request = LlmRequest::new().user("slow").max_tokens(100);
    let never = |_| futures::future::pending::<Result<u32, String>>();
    let mut leader = Box::pin(bulkhead.run_shared(&request, AcquireOptions::new(), never));
    assert!(futures::poll!(&mut leader).is_pending());
    let follower = bulkhead.run_shared(&request, AcquireOptions::new().timeout(TIMEOUT), never);
    let result = follower.await;
    let Err(RunError::Rejected(rejection)) = result else {
        panic!("expected a timeout, got {result:?}")
    };
    assert_eq!(rejection.reason(), RejectReason::Timeout);
    let stats = bulkhead.stats();
    assert_eq!(
        (stats.in_flight, stats.rejected_by_reason.timeout),
        (1, 1),
        "the shared call goes on"
    );
}

/// A drain with a 2 s deadline while a permit is held: gives up, not drained.
async fn drain_gives_up_at_its_deadline() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let report = bulkhead.drain_timeout(TIMEOUT).await;
    assert!(!report.drained);
    assert_eq!(bulkhead.stats().in_flight, 1);
    drop(held);
}

/// Runs `scenario` on the paused clock of the current runtime: 2 s of virtual time, almost no
/// real time.
async fn on_the_paused_clock(scenario: impl Future<Output = ()>) {
    let virtual_start = tokio::time::Instant::now();
    let real_start = Instant::now();
    scenario.await;
    let (virtual_elapsed, real_elapsed) = (virtual_start.elapsed(), real_start.elapsed());
    assert!(
        virtual_elapsed >= TIMEOUT,
        "fired after {virtual_elapsed:?} of virtual time"
    );
    // The timeout counts from tokio's clock: exactly 2 s (tokio's timer ticks in whole
    // milliseconds, and a paused clock starts on a tick).
    assert_eq!(virtual_elapsed, TIMEOUT);
    assert!(
        real_elapsed < REAL_BOUND,
        "took {real_elapsed:?} of real time"
    );
}

/// Runs `scenario` without any runtime: the crate's timer, 2 s of real time.
fn without_a_runtime(scenario: impl Future<Output = ()>) {
    let real_start = Instant::now();
    block_on(scenario);
    let real_elapsed = real_start.elapsed();
    assert!(
        real_elapsed >= TIMEOUT,
        "fired after {real_elapsed:?} of real time"
    );
}

#[tokio::test(start_paused = true)]
async fn a_queue_timeout_passes_in_virtual_time() {
    on_the_paused_clock(queued_acquire_times_out()).await;
}

#[tokio::test(start_paused = true)]
async fn a_run_deadline_passes_in_virtual_time() {
    on_the_paused_clock(run_is_cut_at_its_deadline()).await;
}

#[tokio::test(start_paused = true)]
async fn a_shared_run_deadline_passes_in_virtual_time() {
    on_the_paused_clock(shared_run_is_cut_at_its_deadline()).await;
}

#[tokio::test(start_paused = true)]
async fn a_followers_own_timeout_passes_in_virtual_time() {
    on_the_paused_clock(follower_times_out()).await;
}

#[tokio::test(start_paused = true)]
async fn a_drain_deadline_passes_in_virtual_time() {
    on_the_paused_clock(drain_gives_up_at_its_deadline()).await;
}

#[test]
fn a_drain_deadline_fires_without_a_runtime() {
    without_a_runtime(drain_gives_up_at_its_deadline());
}

#[test]
fn a_queue_timeout_fires_without_a_runtime() {
    without_a_runtime(queued_acquire_times_out());
}

#[test]
fn a_run_deadline_fires_without_a_runtime() {
    without_a_runtime(run_is_cut_at_its_deadline());
}

#[test]
fn a_shared_run_deadline_fires_without_a_runtime() {
    without_a_runtime(shared_run_is_cut_at_its_deadline());
}

#[test]
fn a_followers_own_timeout_fires_without_a_runtime() {
    without_a_runtime(follower_times_out());
}

/// On a running (not paused) tokio clock the timeout takes its real time, as on the crate's
/// timer.
#[tokio::test]
async fn a_queue_timeout_takes_real_time_on_a_running_tokio_clock() {
    let bulkhead = plain(1, 4);
    let _held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let timeout = Duration::from_millis(50);
    let real_start = Instant::now();
    let refused = bulkhead.acquire(&req(), within(timeout)).await;
    assert!(
        matches!(refused, Err(AcquireError::Rejected(r)) if r.reason() == RejectReason::Timeout)
    );
    let real_elapsed = real_start.elapsed();
    assert!(
        real_elapsed >= timeout && real_elapsed < Duration::from_secs(10),
        "fired after {real_elapsed:?}"
    );
}
