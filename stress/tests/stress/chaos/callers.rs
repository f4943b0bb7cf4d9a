//! The callers: random mixes of every operation.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmRequest, Priority, RejectReason, Reservation, RunContext,
    RunError, TokenUsage, admission::Verdict, limits::MAX_BUDGET,
};
use futures::future::{Either, join_all, select};

use super::books::{Shared, Tally};
use super::model::report_step;
use super::runtime::{Task, Timer, Tracked, poll_once, yield_now, yields};
use super::{POST_CLOSE_OPS, mix};
use crate::caller_model::{AnyPermit, Model, Reporter};

/// A random request and options: an explicit reservation or one the estimator sizes.
fn random_call(rng: &mut fastrand::Rng) -> (LlmRequest, AcquireOptions) {
    let mut options = AcquireOptions::new();
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
fn queued(rng: &mut fastrand::Rng, options: AcquireOptions) -> AcquireOptions {
    match rng.u8(0..8) {
        0 | 1 => options,
        2 => options.timeout(Duration::ZERO),
        _ => options.timeout(Duration::from_micros(rng.u64(0..3_000))),
    }
}

/// Something that fires soon: a few executor turns or a short sleep.
fn canceller(shared: &Shared, rng: &mut fastrand::Rng) -> Task {
    match rng.u8(0..3) {
        0 => Box::pin(yields(rng.usize(0..4))),
        _ => shared.rt.sleep(Duration::from_micros(rng.u64(0..2_500))),
    }
}

/// Holds an admitted permit (already counted in the ledger) for a random short time, streaming
/// random usage reports, then settles it: explicit usage, the last reported, or a drop.
async fn hold(shared: &Shared, rng: &mut fastrand::Rng, mut permit: AnyPermit<'_>) {
    let reservation = permit
        .reservation()
        .expect("a budget: every admission reserves");
    let mut model = Model::new(reservation);
    assert_eq!(permit.held(), reservation.reserved());
    let effective = &shared.tally.effective_reports;
    if shared.setup.always_usage {
        report_step(&mut permit, &mut model, rng, true, effective);
    }
    for _ in 0..rng.usize(0..5) {
        shared.rt.pause(rng).await;
        report_step(&mut permit, &mut model, rng, false, effective);
    }
    shared.rt.pause(rng).await;
    shared.leave();
    match rng.u8(0..3) {
        0 => {
            drop(permit);
            let settled = model.settle(None);
            shared.tally.settled(&model, &settled);
        }
        finish => {
            let explicit = (finish == 1).then(|| model.random_usage(rng));
            let report = permit.release(explicit);
            let settled = model.settle(explicit);
            assert_eq!(
                (
                    report.held_tokens,
                    report.refunded_tokens,
                    report.overrun_tokens,
                    report.usage
                ),
                (
                    settled.held,
                    settled.refunded,
                    settled.overrun,
                    settled.usage
                ),
                "release report of {model:?}"
            );
            shared.tally.settled(&model, &settled);
        }
    }
}

/// Holds the permit if the call was admitted.
async fn hold_if(shared: &Shared, rng: &mut fastrand::Rng, permit: Option<AnyPermit<'_>>) {
    if let Some(permit) = permit {
        hold(shared, rng, permit).await;
    }
}

/// One random operation of a worker.
async fn op(shared: &Arc<Shared>, rng: &mut fastrand::Rng, handoffs: &mut Vec<Task>) {
    let bulkhead = &shared.bulkhead;
    // Read before the call starts: if set, `close()` returned before it, so it must be refused.
    let closed_before = shared.closed.load(Ordering::Acquire);
    let (request, options) = random_call(rng);
    let kinds = if shared.rt.threads() { 17 } else { 15 };
    match rng.u8(0..kinds) {
        0 => {
            let result = bulkhead.try_acquire(&request, options);
            let permit = shared.decided(result.map(AnyPermit::Borrowed), closed_before);
            hold_if(shared, rng, permit).await;
        }
        1 => {
            let result = bulkhead.try_acquire_owned(&request, options);
            let permit = shared.decided(result.map(AnyPermit::Owned), closed_before);
            hold_if(shared, rng, permit).await;
        }
        2 | 3 => {
            let result = bulkhead.acquire(&request, queued(rng, options)).await;
            let permit = shared.decided(result.map(AnyPermit::Borrowed), closed_before);
            hold_if(shared, rng, permit).await;
        }
        4 => {
            let result = bulkhead.acquire_owned(&request, queued(rng, options)).await;
            let permit = shared.decided(result.map(AnyPermit::Owned), closed_before);
            hold_if(shared, rng, permit).await;
        }
        5 => {
            // Cancelled by `tokio::select!` (random branch order: it may never be polled).
            let mut acquire = Tracked::new(bulkhead.acquire(&request, queued(rng, options)));
            let cancel = canceller(shared, rng);
            let result = tokio::select! {
                result = &mut acquire => Some(result),
                () = cancel => None,
            };
            match result {
                Some(result) => {
                    let permit = shared.decided(result.map(AnyPermit::Borrowed), closed_before);
                    drop(acquire);
                    hold_if(shared, rng, permit).await;
                }
                None => {
                    let polled = acquire.polled;
                    // Dropped wherever it is: queued, or handed a slot it never picked up.
                    drop(acquire);
                    shared.vanished(polled);
                }
            }
        }
        6 => {
            // Cancelled by a timeout around the future.
            let mut acquire = Tracked::new(bulkhead.acquire_owned(&request, queued(rng, options)));
            let limit = Duration::from_micros(rng.u64(0..2_500));
            let result = if shared.rt.timer == Timer::Tokio {
                tokio::time::timeout(limit, &mut acquire).await.ok()
            } else {
                match select(&mut acquire, shared.rt.sleep(limit)).await {
                    Either::Left((result, _)) => Some(result),
                    Either::Right(_) => None,
                }
            };
            match result {
                Some(result) => {
                    let permit = shared.decided(result.map(AnyPermit::Owned), closed_before);
                    hold_if(shared, rng, permit).await;
                }
                None => {
                    let polled = acquire.polled;
                    drop(acquire);
                    shared.vanished(polled);
                }
            }
        }
        7 => {
            // Polled once or twice, then dropped.
            let mut acquire = Tracked::new(bulkhead.acquire(&request, queued(rng, options)));
            let mut result = poll_once(&mut acquire).await;
            if result.is_pending() && rng.bool() {
                yields(rng.usize(0..3)).await;
                result = poll_once(&mut acquire).await;
            }
            match result {
                Poll::Ready(result) => {
                    let permit = shared.decided(result.map(AnyPermit::Borrowed), closed_before);
                    hold_if(shared, rng, permit).await;
                }
                Poll::Pending => {
                    drop(acquire);
                    shared.vanished(true);
                }
            }
        }
        8 => {
            // Dropped before the first poll: decides nothing, counts nothing.
            match rng.u8(0..3) {
                0 => drop(bulkhead.acquire(&request, options)),
                1 => drop(bulkhead.acquire_owned(&request, options)),
                _ => drop(bulkhead.run(&request, options, async |_| Ok::<(), ()>(()))),
            }
            shared.vanished(false);
        }
        9 | 10 => {
            let options = queued(rng, options);
            run_op(shared, rng, &request, options, closed_before).await;
        }
        11 => {
            // An owned permit handed to another task (or thread), which holds and settles it.
            let result = if rng.bool() {
                bulkhead.try_acquire_owned(&request, options)
            } else {
                bulkhead.acquire_owned(&request, queued(rng, options)).await
            };
            if let Some(permit) = shared.decided(result, closed_before) {
                let (inner, mut inner_rng) =
                    (Arc::clone(shared), fastrand::Rng::with_seed(rng.u64(..)));
                handoffs.push(shared.spawn(async move {
                    hold(&inner, &mut inner_rng, AnyPermit::Owned(permit)).await;
                }));
            }
        }
        12 => {
            // Several permits at once (only `try_acquire`: never wait while holding), held
            // concurrently by this one task.
            let mut held = Vec::new();
            for _ in 0..rng.usize(2..5) {
                let (request, options) = random_call(rng);
                let result = bulkhead.try_acquire(&request, options);
                if let Some(permit) = shared.decided(result.map(AnyPermit::Borrowed), closed_before)
                {
                    held.push(permit);
                }
            }
            let sessions = held.into_iter().map(|permit| {
                let mut rng = fastrand::Rng::with_seed(rng.u64(..));
                async move { hold(shared, &mut rng, permit).await }
            });
            join_all(sessions.collect::<Vec<_>>()).await;
        }
        13 => odd_call(shared, rng, &request, options, closed_before).await,
        14 => {
            // A quick look at the figures.
            let stats = bulkhead.stats();
            assert!(stats.in_flight <= shared.setup.ceiling(), "{stats:?}");
            assert!(
                stats.pending <= shared.peak_queue.load(Ordering::Acquire),
                "{stats:?}"
            );
            if closed_before {
                assert!(stats.closed && bulkhead.is_closed());
            }
        }
        15 => {
            let result = bulkhead.acquire_blocking(&request, queued(rng, options));
            let permit = shared.decided(result.map(AnyPermit::Borrowed), closed_before);
            hold_if(shared, rng, permit).await;
        }
        _ => {
            let result = bulkhead.acquire_blocking_owned(&request, queued(rng, options));
            let permit = shared.decided(result.map(AnyPermit::Owned), closed_before);
            hold_if(shared, rng, permit).await;
        }
    }
}

/// Advisory checks, input that cannot be estimated, and a reservation no budget fits.
async fn odd_call(
    shared: &Shared,
    rng: &mut fastrand::Rng,
    request: &LlmRequest,
    options: AcquireOptions,
    closed_before: bool,
) {
    let bulkhead = &shared.bulkhead;
    match rng.u8(0..3) {
        0 => {
            // Advisory: decides and counts nothing.
            let verdict = bulkhead.would_admit(request, options).unwrap();
            if closed_before {
                assert_eq!(verdict, Verdict::Reject(RejectReason::Shutdown));
            }
        }
        1 => {
            // The estimate overflows: invalid, before anything else (even after the close).
            let invalid = LlmRequest::new()
                .user("hello")
                .extra_input_tokens(u64::MAX)
                .max_tokens(10);
            let options = AcquireOptions::new();
            let invalid_result = match rng.u8(0..5) {
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
                    Tally::bump(&shared.tally.invalid);
                    return;
                }
                _ => {
                    assert!(bulkhead.would_admit(&invalid, options).is_err());
                    Tally::bump(&shared.tally.invalid);
                    return;
                }
            };
            assert!(
                matches!(invalid_result, Err(AcquireError::Invalid(_))),
                "{invalid_result:?}"
            );
            Tally::bump(&shared.tally.invalid);
        }
        _ => {
            // Fits no budget: refused for tokens at once, even when it may queue.
            let options = AcquireOptions::new()
                .reservation(Reservation::new(MAX_BUDGET, 1).unwrap())
                .priority(Priority::High);
            let result = if rng.bool() {
                bulkhead.try_acquire(request, options)
            } else {
                bulkhead
                    .acquire(request, options.timeout(Duration::from_secs(60)))
                    .await
            };
            let reason = result.unwrap_err().rejection().unwrap().reason();
            assert!(
                reason == RejectReason::BudgetLimit || reason == RejectReason::Shutdown,
                "{reason}"
            );
            Tally::bump(&shared.tally.decided);
            shared.refused(reason, closed_before);
        }
    }
}

/// A call through `run` / `run_with_usage`: the callback reports usage and then succeeds
/// (settling with the last report, or with usage extracted from its result), fails, or is
/// cancelled at a random point (while waiting, or while the callback runs).
async fn run_op(
    shared: &Shared,
    rng: &mut fastrand::Rng,
    request: &LlmRequest,
    options: AcquireOptions,
    closed_before: bool,
) {
    // 0: plain run, 1: run_with_usage, 2: the callback fails, 3: the run is cancelled.
    let variant = rng.u8(0..4);
    let (fails, cancelled) = (variant == 2, variant == 3);
    let mut run_rng = fastrand::Rng::with_seed(rng.u64(..));
    // The callback keeps its model (and the usage it returns) here, so it survives a
    // cancelled run; `Some` once the callback started, i.e. once the call was admitted.
    let cell: Mutex<Option<(Model, Option<TokenUsage>)>> = Mutex::new(None);
    let callback = {
        let cell = &cell;
        let run_rng = &mut run_rng;
        async move |mut ctx: RunContext<'_>| {
            assert!(!closed_before, "admitted after close() returned");
            Tally::bump(&shared.tally.admitted);
            // A cancelled run settles when its future is dropped, with no chance to leave the
            // ledger first: it stays out of it (the ledger stays a lower bound).
            if !cancelled {
                shared.enter();
            }
            let mut model = Model::new(ctx.reservation().unwrap());
            let effective = &shared.tally.effective_reports;
            if shared.setup.always_usage {
                // Before any await: a cancellation cannot come first.
                report_step(&mut ctx, &mut model, run_rng, true, effective);
            }
            *cell.lock().unwrap() = Some((model, None));
            for _ in 0..run_rng.usize(0..4) {
                shared.rt.pause(run_rng).await;
                report_step(&mut ctx, &mut model, run_rng, false, effective);
                *cell.lock().unwrap() = Some((model, None));
            }
            shared.rt.pause(run_rng).await;
            if !cancelled {
                shared.leave();
            }
            let explicit = (variant == 1 && run_rng.bool()).then(|| model.random_usage(run_rng));
            *cell.lock().unwrap() = Some((model, explicit));
            if fails { Err(()) } else { Ok(explicit) }
        }
    };
    let bulkhead = &shared.bulkhead;
    type RunFuture<'a> =
        Pin<Box<dyn Future<Output = Result<Option<TokenUsage>, RunError<()>>> + Send + 'a>>;
    let future: RunFuture<'_> = if variant == 1 {
        Box::pin(bulkhead.run_with_usage(request, options, |u: &Option<TokenUsage>| *u, callback))
    } else {
        Box::pin(bulkhead.run(request, options, callback))
    };
    let mut run = Tracked::new(future);
    let result = if cancelled {
        let cancel = canceller(shared, rng);
        tokio::select! {
            result = &mut run => Some(result),
            () = cancel => None,
        }
    } else {
        Some((&mut run).await)
    };
    let polled = run.polled;
    drop(run);
    let explicit = match result {
        Some(Ok(explicit)) => {
            assert!(!fails);
            explicit
        }
        Some(Err(RunError::Failed(()))) => {
            assert!(fails);
            None
        }
        Some(Err(RunError::Rejected(rejection))) => {
            assert!(cell.lock().unwrap().is_none());
            Tally::bump(&shared.tally.decided);
            return shared.refused(rejection.reason(), closed_before);
        }
        Some(Err(RunError::Invalid(error))) => panic!("valid input refused: {error}"),
        Some(Err(RunError::BorrowedConcurrencyDeadline(cut))) => {
            panic!("no deadline was set, yet: {cut}")
        }
        Some(Err(other)) => panic!("an error this test does not know: {other:?}"),
        None => None, // cancelled: settled (if admitted) with the last reported usage
    };
    let Some((mut model, _)) = cell.into_inner().unwrap() else {
        assert!(result.is_none());
        return shared.vanished(polled);
    };
    Tally::bump(&shared.tally.decided);
    let settled = model.settle(explicit);
    shared.tally.settled(&model, &settled);
}

pub(crate) async fn worker(shared: Arc<Shared>, index: u64) {
    let mut rng = fastrand::Rng::with_seed(mix(shared.setup.seed, index + 1));
    let mut handoffs = Vec::new();
    for _ in 0..shared.setup.ops {
        op(&shared, &mut rng, &mut handoffs).await;
        shared.ops_done.fetch_add(1, Ordering::AcqRel);
        if handoffs.len() > 4 {
            join_all(handoffs.drain(..)).await;
        }
        // Think time, as a client has: without it refused calls come back at once and the
        // run is all refusals, however long it is.
        shared.rt.pause(&mut rng).await;
        yield_now().await;
        if shared.failed() {
            break;
        }
    }
    // Keep calling until the close, then a few more: all of those are refused. Each round
    // sleeps a little: a task that only yields is re-polled at once by some executors (the
    // futures thread pool re-runs a task that woke itself on the same thread), so a few such
    // loops would hold every pool thread and starve the control plane that closes.
    while !shared.closed.load(Ordering::Acquire) && !shared.failed() {
        op(&shared, &mut rng, &mut handoffs).await;
        shared
            .rt
            .sleep(Duration::from_micros(rng.u64(50..500)))
            .await;
    }
    for _ in 0..POST_CLOSE_OPS {
        op(&shared, &mut rng, &mut handoffs).await;
        yield_now().await;
    }
    join_all(handoffs).await;
    shared.workers_done.fetch_add(1, Ordering::AcqRel);
}
