//! The callers: random mixes of every operation (the kit's acquisitions, `run`, hand-offs,
//! several permits at once, odd calls, a look at the figures), each admission held for a
//! while with random usage reports and then settled.

use std::sync::{Arc, Mutex};

use async_bulkhead_llm::{
    AcquireOptions, LlmRequest, RunContext, RunError, RunOptions, TokenUsage,
    admission::AdmissionId,
};
use futures::future::join_all;

use super::books::Shared;
use crate::caller_model::{AnyPermit, Model, Reporter};
use crate::kit::callers::{
    Acquired, Op, RunFuture, acquire, advisory, beyond_every_budget, canceller, invalid_estimate,
    queued, random_call, run_or_cancel,
};
use crate::kit::reports::{Finish, report_step, settle};
use crate::kit::runtimes::Task;

/// Holds an admitted permit (already counted in the ledger) for a random short time, streaming
/// random usage reports, then settles it: explicit usage, the last reported, or a drop.
async fn hold(shared: &Shared, rng: &mut fastrand::Rng, mut permit: AnyPermit<'_>) {
    let reservation = permit
        .reservation()
        .expect("a budget: every admission reserves");
    let mut model = Model::new(reservation);
    assert_eq!(permit.held(), reservation.reserved());
    let book = &shared.book;
    if shared.setup.always_usage {
        report_step(&mut permit, &mut model, rng, true, book);
    }
    for _ in 0..rng.usize(0..5) {
        shared.rt.pause(rng).await;
        report_step(&mut permit, &mut model, rng, false, book);
    }
    shared.rt.pause(rng).await;
    shared.leave();
    let id = permit.admission_id();
    let finish = Finish::random(rng, &model);
    let settled = settle(permit, &mut model, finish);
    book.settled(id, &model, &settled);
}

/// Holds the permit if the call was admitted.
async fn hold_if(shared: &Shared, rng: &mut fastrand::Rng, permit: Option<AnyPermit<'_>>) {
    if let Some(permit) = permit {
        hold(shared, rng, permit).await;
    }
}

/// One random operation of a worker.
pub(crate) async fn op(shared: &Arc<Shared>, rng: &mut fastrand::Rng, handoffs: &mut Vec<Task>) {
    let bulkhead = &shared.bulkhead;
    // Read before the call starts: if set, `close()` returned before it, so it must be refused.
    let closed_before = shared.closed();
    let (request, options) = random_call(rng, AcquireOptions::new());
    match Op::random(rng, shared.rt.threads()) {
        Op::Acquire(way) => {
            let acquired = acquire(
                bulkhead,
                &shared.rt,
                rng,
                &request,
                options,
                way,
                RunOptions::from,
            )
            .await;
            match acquired {
                Acquired::Decided(result) => {
                    let permit = shared.decided(result, closed_before);
                    hold_if(shared, rng, permit).await;
                }
                Acquired::Vanished { polled } => shared.book.vanished(polled),
            }
        }
        Op::Run => {
            let options = queued(rng, options);
            run_op(shared, rng, &request, options, closed_before).await;
        }
        Op::Handoff => {
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
        Op::Several => {
            // Only `try_acquire`: never wait while holding. Held concurrently by this task.
            let mut held = Vec::new();
            for _ in 0..rng.usize(2..5) {
                let (request, options) = random_call(rng, AcquireOptions::new());
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
        Op::Odd => match rng.u8(0..3) {
            0 => advisory(bulkhead, &request, options, closed_before),
            1 => invalid_estimate(shared, rng, AcquireOptions::new()).await,
            _ => {
                let rejection =
                    beyond_every_budget(bulkhead, rng, &request, AcquireOptions::new()).await;
                shared.book.refused(rejection.reason(), closed_before);
            }
        },
        Op::Look => {
            let stats = bulkhead.stats();
            assert!(stats.in_flight <= shared.setup.ceiling(), "{stats:?}");
            shared.check_pending(&stats);
            if closed_before {
                assert!(stats.closed && bulkhead.is_closed());
            }
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
    // The callback keeps its model and admission here, so they survive a cancelled run;
    // `Some` once the callback started, i.e. once the call was admitted.
    let cell: Mutex<Option<(Model, AdmissionId)>> = Mutex::new(None);
    let callback = {
        let cell = &cell;
        let run_rng = &mut run_rng;
        async move |mut ctx: RunContext<'_>| {
            shared.book.admit(closed_before);
            // A cancelled run settles when its future is dropped, with no chance to leave the
            // ledger first: it stays out of it (the ledger stays a lower bound).
            if !cancelled {
                shared.enter();
            }
            let id = ctx.admission_id().expect("admitted");
            let mut model = Model::new(ctx.reservation().unwrap());
            let book = &shared.book;
            if shared.setup.always_usage {
                // Before any await: a cancellation cannot come first.
                report_step(&mut ctx, &mut model, run_rng, true, book);
            }
            *cell.lock().unwrap() = Some((model, id));
            for _ in 0..run_rng.usize(0..4) {
                shared.rt.pause(run_rng).await;
                report_step(&mut ctx, &mut model, run_rng, false, book);
                *cell.lock().unwrap() = Some((model, id));
            }
            shared.rt.pause(run_rng).await;
            if !cancelled {
                shared.leave();
            }
            let explicit = (variant == 1 && run_rng.bool()).then(|| model.random_usage(run_rng));
            *cell.lock().unwrap() = Some((model, id));
            if fails { Err(()) } else { Ok(explicit) }
        }
    };
    let bulkhead = &shared.bulkhead;
    let future: RunFuture<'_> = if variant == 1 {
        Box::pin(bulkhead.run_with_usage(request, options, |u: &Option<TokenUsage>| *u, callback))
    } else {
        Box::pin(bulkhead.run(request, options, callback))
    };
    let cancel = cancelled.then(|| canceller(&shared.rt, rng));
    let (result, polled) = run_or_cancel(future, cancel).await;
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
            return shared.book.refused(rejection.reason(), closed_before);
        }
        Some(Err(RunError::Invalid(error))) => panic!("valid input refused: {error}"),
        Some(Err(RunError::BorrowedConcurrencyDeadline(cut))) => {
            panic!("no deadline was set, yet: {cut}")
        }
        Some(Err(other)) => panic!("an error this test does not know: {other:?}"),
        None => None, // cancelled: settled (if admitted) with the last reported usage
    };
    let Some((mut model, id)) = cell.into_inner().unwrap() else {
        assert!(result.is_none());
        return shared.book.vanished(polled);
    };
    shared.book.decided();
    let settled = model.settle(explicit);
    shared.book.settled(id, &model, &settled);
}
