//! Caller plumbing: the worker loop every family runs, random calls with queue timeouts and
//! cancellers, the acquisitions of the chaos mixes (try, queued, owned, cancelled by
//! `select!`, by a timeout or after a poll or two, dropped before the first poll, blocking),
//! `run` futures driven or cancelled, and the odd calls (advisory checks, input that cannot be
//! estimated, a reservation no budget fits).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, Priority, RejectReason, Rejection,
    Reservation, RunError, RunOptions, TokenUsage, admission::Verdict, limits::MAX_BUDGET,
};
use futures::future::{Either, join_all, select};

use super::books::bump;
use super::control_plane::Close;
use super::mix;
use super::runtimes::{Rt, Task, Timer, Tracked, poll_once, yield_now, yields};
use super::scene::{Family, Scene};
use crate::caller_model::AnyPermit;

/// One worker of a scenario: the family's operations, `ops` of them with think time between;
/// then, if the control plane closes, operations until it sees the close, and a few more (all
/// refused). Permits handed to other tasks are joined before it counts itself done.
pub(crate) async fn worker<F: Family>(shared: Arc<F>, index: u64) {
    let mut rng = fastrand::Rng::with_seed(mix(shared.seed, index + 1));
    let mut handoffs = Vec::new();
    for _ in 0..shared.ops {
        F::op(&shared, &mut rng, index, &mut handoffs).await;
        shared.ops_done.fetch_add(1, Ordering::AcqRel);
        if handoffs.len() > 4 {
            join_all(handoffs.drain(..)).await;
        }
        shared.think(&mut rng).await;
        if shared.failed() {
            break;
        }
    }
    if shared.schedule.close != Close::Never {
        // Keep calling until the close, then a few more: all of those are refused. Each round
        // sleeps a little: a task that only yields is re-polled at once by some executors (the
        // futures thread pool re-runs a task that woke itself on the same thread), so a few
        // such loops would hold every pool thread and starve the control plane that closes.
        while !shared.closed() && !shared.failed() {
            F::op(&shared, &mut rng, index, &mut handoffs).await;
            shared
                .rt
                .timer(Duration::from_micros(rng.u64(50..500)))
                .await;
        }
        for _ in 0..shared.schedule.post_close_ops {
            F::op(&shared, &mut rng, index, &mut handoffs).await;
            yield_now().await;
        }
    }
    join_all(handoffs).await;
    shared.workers_done.fetch_add(1, Ordering::AcqRel);
}

/// A random request and `options` (high priority a quarter of the time): an explicit
/// reservation, or a request the estimator sizes.
pub(crate) fn random_call(
    rng: &mut fastrand::Rng,
    mut options: AcquireOptions,
) -> (LlmRequest, AcquireOptions) {
    if rng.u8(0..4) == 0 {
        options = options.priority(Priority::High);
    }
    let request = match rng.u8(0..12) {
        0..=2 => LlmRequest::new()
            .user("x".repeat(rng.usize(0..1_600)))
            .max_tokens(rng.u64(1..500)),
        3 => {
            options = options.reservation(Reservation::new(0, 0).unwrap());
            LlmRequest::new()
        }
        _ => {
            let reservation = Reservation::new(rng.u64(0..200), rng.u64(0..500)).unwrap();
            options = options.reservation(reservation);
            LlmRequest::new()
        }
    };
    (request, options)
}

/// The options with a random queue timeout: none, zero, or up to a few ms.
pub(crate) fn queued(rng: &mut fastrand::Rng, options: AcquireOptions) -> AcquireOptions {
    match rng.u8(0..8) {
        0 | 1 => options,
        2 => options.timeout(Duration::ZERO),
        _ => options.timeout(Duration::from_micros(rng.u64(0..3_000))),
    }
}

/// Something that fires soon: a few executor turns or a short sleep.
pub(crate) fn canceller(rt: &Rt, rng: &mut fastrand::Rng) -> Task {
    match rng.u8(0..3) {
        0 => Box::pin(yields(rng.usize(0..4))),
        _ => rt.sleep(Duration::from_micros(rng.u64(0..2_500))),
    }
}

/// How the chaos mixes acquire (the kit makes these calls; the family books their outcome).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Way {
    Try,
    TryOwned,
    /// `acquire` with a random queue timeout.
    Queued,
    QueuedOwned,
    /// Cancelled by `tokio::select!` (random branch order: it may never be polled).
    Selected,
    /// An owned acquire cancelled by a timeout around the future.
    TimedOut,
    /// Polled once or twice, then dropped.
    PolledOnce,
    /// Dropped before the first poll (an acquire, an owned acquire or a `run`).
    Unpolled,
    /// `acquire_blocking` (plain threads only).
    Blocking,
    BlockingOwned,
}

/// One operation of the chaos mixes: one of the kit's acquisitions, or one the family makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    Acquire(Way),
    /// `run` / `run_with_usage`.
    Run,
    /// An owned permit handed to another task (or thread), which holds and settles it.
    Handoff,
    /// Several permits held at once by one task.
    Several,
    /// Advisory checks, invalid input, a reservation no budget fits.
    Odd,
    /// A quick look at the figures.
    Look,
}

impl Op {
    /// A random operation (the blocking acquisitions only on plain threads).
    pub(crate) fn random(rng: &mut fastrand::Rng, threads: bool) -> Op {
        let kinds = if threads { 17 } else { 15 };
        match rng.u8(0..kinds) {
            0 => Op::Acquire(Way::Try),
            1 => Op::Acquire(Way::TryOwned),
            2 | 3 => Op::Acquire(Way::Queued),
            4 => Op::Acquire(Way::QueuedOwned),
            5 => Op::Acquire(Way::Selected),
            6 => Op::Acquire(Way::TimedOut),
            7 => Op::Acquire(Way::PolledOnce),
            8 => Op::Acquire(Way::Unpolled),
            9 | 10 => Op::Run,
            11 => Op::Handoff,
            12 => Op::Several,
            13 => Op::Odd,
            14 => Op::Look,
            15 => Op::Acquire(Way::Blocking),
            _ => Op::Acquire(Way::BlockingOwned),
        }
    }
}

/// What an acquisition came to.
pub(crate) enum Acquired<'b> {
    /// The bulkhead decided: its result.
    Decided(Result<AnyPermit<'b>, AcquireError>),
    /// Cancelled before its result: decided (and counted as a refusal) iff it was polled.
    Vanished { polled: bool },
}

/// Acquires `request` `way`; a `run` dropped before its first poll gets `unpolled_run`'s
/// options.
pub(crate) async fn acquire<'b>(
    bulkhead: &'b LlmBulkhead,
    rt: &Rt,
    rng: &mut fastrand::Rng,
    request: &LlmRequest,
    options: AcquireOptions,
    way: Way,
    unpolled_run: fn(AcquireOptions) -> RunOptions,
) -> Acquired<'b> {
    use AnyPermit::{Borrowed, Owned};
    let decided = |result: Result<AnyPermit<'b>, AcquireError>| Acquired::Decided(result);
    match way {
        Way::Try => decided(bulkhead.try_acquire(request, options).map(Borrowed)),
        Way::TryOwned => decided(bulkhead.try_acquire_owned(request, options).map(Owned)),
        Way::Queued => {
            let result = bulkhead.acquire(request, queued(rng, options)).await;
            decided(result.map(Borrowed))
        }
        Way::QueuedOwned => {
            let result = bulkhead.acquire_owned(request, queued(rng, options)).await;
            decided(result.map(Owned))
        }
        Way::Selected => {
            let mut acquire = Tracked::new(bulkhead.acquire(request, queued(rng, options)));
            let cancel = canceller(rt, rng);
            let result = tokio::select! {
                result = &mut acquire => Some(result),
                () = cancel => None,
            };
            let polled = acquire.polled;
            // Dropped wherever it is: queued, or handed a slot it never picked up.
            drop(acquire);
            match result {
                Some(result) => decided(result.map(Borrowed)),
                None => Acquired::Vanished { polled },
            }
        }
        Way::TimedOut => {
            let mut acquire = Tracked::new(bulkhead.acquire_owned(request, queued(rng, options)));
            let limit = Duration::from_micros(rng.u64(0..2_500));
            let result = if rt.timer == Timer::Tokio {
                tokio::time::timeout(limit, &mut acquire).await.ok()
            } else {
                match select(&mut acquire, rt.sleep(limit)).await {
                    Either::Left((result, _)) => Some(result),
                    Either::Right(_) => None,
                }
            };
            let polled = acquire.polled;
            drop(acquire);
            match result {
                Some(result) => decided(result.map(Owned)),
                None => Acquired::Vanished { polled },
            }
        }
        Way::PolledOnce => {
            let mut acquire = Tracked::new(bulkhead.acquire(request, queued(rng, options)));
            let mut result = poll_once(&mut acquire).await;
            if result.is_pending() && rng.bool() {
                yields(rng.usize(0..3)).await;
                result = poll_once(&mut acquire).await;
            }
            drop(acquire);
            match result {
                Poll::Ready(result) => decided(result.map(Borrowed)),
                Poll::Pending => Acquired::Vanished { polled: true },
            }
        }
        Way::Unpolled => {
            // Decides nothing, counts nothing.
            match rng.u8(0..3) {
                0 => drop(bulkhead.acquire(request, options)),
                1 => drop(bulkhead.acquire_owned(request, options)),
                _ => drop(bulkhead.run(request, unpolled_run(options), async |_| Ok::<(), ()>(()))),
            }
            Acquired::Vanished { polled: false }
        }
        Way::Blocking => {
            let result = bulkhead.acquire_blocking(request, queued(rng, options));
            decided(result.map(Borrowed))
        }
        Way::BlockingOwned => {
            let result = bulkhead.acquire_blocking_owned(request, queued(rng, options));
            decided(result.map(Owned))
        }
    }
}

/// A `run` / `run_with_usage` future of the chaos mixes (their callbacks return the explicit
/// usage they settle with, if any).
pub(crate) type RunFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Option<TokenUsage>, RunError<()>>> + Send + 'a>>;

/// Drives `run` to its end or, given a canceller, until the canceller fires (whichever
/// `tokio::select!` sees first); returns its output (`None`: cancelled) and whether it was
/// ever polled.
pub(crate) async fn run_or_cancel<F: Future + Unpin>(
    run: F,
    cancel: Option<Task>,
) -> (Option<F::Output>, bool) {
    let mut run = Tracked::new(run);
    let result = match cancel {
        Some(cancel) => tokio::select! {
            result = &mut run => Some(result),
            () = cancel => None,
        },
        None => Some((&mut run).await),
    };
    let polled = run.polled;
    drop(run);
    (result, polled)
}

/// Advisory: decides and counts nothing; after the close, it answers `shutdown`.
pub(crate) fn advisory(
    bulkhead: &LlmBulkhead,
    request: &LlmRequest,
    options: AcquireOptions,
    closed_before: bool,
) {
    let verdict = bulkhead.would_admit(request, options).unwrap();
    if closed_before {
        assert_eq!(verdict, Verdict::Reject(RejectReason::Shutdown));
    }
}

/// A request whose estimate overflows, with `options` (and no reservation): refused as
/// invalid before anything else, even after the close, whichever way it is asked; counted in
/// the scene's `invalid`.
pub(crate) async fn invalid_estimate(
    scene: &Scene,
    rng: &mut fastrand::Rng,
    mut options: AcquireOptions,
) {
    let bulkhead = &scene.bulkhead;
    options.reservation = None;
    let invalid = LlmRequest::new()
        .user("hello")
        .extra_input_tokens(u64::MAX)
        .max_tokens(10);
    let result = match rng.u8(0..5) {
        0 => bulkhead.try_acquire(&invalid, options).map(drop),
        1 => bulkhead.try_acquire_owned(&invalid, options).map(drop),
        2 => bulkhead
            .acquire(&invalid, queued(rng, options))
            .await
            .map(drop),
        3 => {
            let result = bulkhead
                .run(&invalid, options, async |_| Ok::<(), ()>(()))
                .await;
            assert!(matches!(result, Err(RunError::Invalid(_))), "{result:?}");
            return bump(&scene.counts.invalid);
        }
        _ => {
            assert!(bulkhead.would_admit(&invalid, options).is_err());
            return bump(&scene.counts.invalid);
        }
    };
    assert!(
        matches!(result, Err(AcquireError::Invalid(_))),
        "{result:?}"
    );
    bump(&scene.counts.invalid);
}

/// A high-priority call reserving more than any budget: refused for its tokens at once (the
/// global budget is judged before anything else), even when it may queue, or `shutdown`
/// after the close. Returns the refusal, for the family to book.
pub(crate) async fn beyond_every_budget(
    bulkhead: &LlmBulkhead,
    rng: &mut fastrand::Rng,
    request: &LlmRequest,
    options: AcquireOptions,
) -> Rejection {
    let options = options
        .reservation(Reservation::new(MAX_BUDGET, 1).unwrap())
        .priority(Priority::High);
    let result = if rng.bool() {
        bulkhead.try_acquire(request, options)
    } else {
        bulkhead
            .acquire(request, options.timeout(Duration::from_secs(60)))
            .await
    };
    let rejection = *result.unwrap_err().rejection().unwrap();
    let reason = rejection.reason();
    assert!(
        reason == RejectReason::BudgetLimit || reason == RejectReason::Shutdown,
        "{reason}"
    );
    rejection
}
