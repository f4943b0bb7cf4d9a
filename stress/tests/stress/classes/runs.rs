//! `run` and `run_with_usage` with classes: callbacks that report usage, give their borrowed
//! slot back by hand, fail, are cancelled, or run under a borrowed-slot deadline that must cut
//! exactly the callbacks hanging on a borrowed slot.

use std::sync::Mutex;
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, LlmRequest, RunContext, RunError, RunOptions, TokenUsage,
};

use super::books::{Call, Facts, Held, Shared};
use super::callers::report;
use crate::caller_model::Model;
use crate::kit::books::bump;
use crate::kit::callers::{RunFuture, canceller, run_or_cancel};

/// A short deadline, cut while the callback hangs on a borrowed slot.
const SHORT: Duration = Duration::from_millis(3);
/// A deadline no callback reaches.
const LONG: Duration = Duration::from_secs(30);

/// What a `run` callback leaves behind, so that it survives a cut or a cancelled run.
#[derive(Clone, Copy)]
struct RunCell {
    model: Model,
    held: Held,
    explicit: Option<TokenUsage>,
    /// It hung on a borrowed slot under a short deadline (must be cut unless cancelled).
    hung: bool,
}

/// A call through `run` / `run_with_usage`, perhaps with a borrowed-slot deadline: the
/// callback reports usage, perhaps gives its slot back, and then succeeds (settling with the
/// last report, or with usage extracted from its result), fails, hangs on a borrowed slot
/// under a short deadline (cut), lingers past a short deadline that cannot apply (not cut),
/// or is cancelled at a random point.
pub(crate) async fn run_op(
    shared: &Shared,
    rng: &mut fastrand::Rng,
    request: &LlmRequest,
    options: AcquireOptions,
    call: Call,
    closed_before: bool,
) {
    // 0: plain run, 1: run_with_usage, 2: the callback fails, 3: the run is cancelled.
    let variant = rng.u8(0..4);
    let (fails, cancelled) = (variant == 2, variant == 3);
    let deadline = match rng.u8(0..4) {
        0 | 1 => None,
        2 => Some(SHORT),
        _ => Some(LONG),
    };
    let (abandons, hangs, lingers) = (rng.u8(0..4) == 0, rng.bool(), rng.bool());
    let mut run_rng = fastrand::Rng::with_seed(rng.u64(..));
    let cell: Mutex<Option<RunCell>> = Mutex::new(None);
    let callback = {
        let cell = &cell;
        let run_rng = &mut run_rng;
        async move |mut ctx: RunContext<'_>| {
            // A cancelled run settles when its future is dropped, and a cut one when its
            // deadline passes, with no chance to leave the ledger first: they stay out of it.
            let borrowed = ctx.resources().borrowed_concurrency;
            let cuttable = deadline.is_some() && borrowed;
            let in_ledger = !(cancelled || cuttable);
            let facts = Facts::of_context(&ctx);
            let mut held = shared.admitted(facts, call, closed_before, None, in_ledger);
            let mut state = RunCell {
                model: Model::new(ctx.reservation().unwrap()),
                held,
                explicit: None,
                hung: false,
            };
            if shared.setup.always_usage {
                // Before any await: a cancellation cannot come first.
                report(shared, &mut ctx, &mut state.model, run_rng, true, &held);
            }
            *cell.lock().unwrap() = Some(state);
            let steps = run_rng.usize(0..4);
            let abandon_at = abandons.then(|| run_rng.usize(0..=steps));
            for step in 0..=steps {
                if abandon_at == Some(step) {
                    shared.abandon(&mut held, || ctx.abandon_borrowed_concurrency());
                    assert_eq!(ctx.holds_slot(), !held.abandoned);
                    state.held = held;
                    *cell.lock().unwrap() = Some(state);
                }
                if step < steps {
                    shared.rt.pause(run_rng).await;
                    report(shared, &mut ctx, &mut state.model, run_rng, false, &held);
                    *cell.lock().unwrap() = Some(state);
                }
            }
            let holds_borrowed = borrowed && !held.abandoned;
            match deadline {
                Some(d) if d == SHORT && holds_borrowed && hangs => {
                    state.hung = true;
                    *cell.lock().unwrap() = Some(state);
                    std::future::pending::<()>().await;
                }
                Some(d) if d == SHORT && !holds_borrowed && lingers => {
                    let past = SHORT + Duration::from_micros(run_rng.u64(500..2_000));
                    shared.rt.sleep(past).await;
                }
                _ => shared.rt.pause(run_rng).await,
            }
            shared.leave(&mut held);
            state.held = held;
            state.explicit =
                (variant == 1 && run_rng.bool()).then(|| state.model.random_usage(run_rng));
            *cell.lock().unwrap() = Some(state);
            if fails { Err(()) } else { Ok(state.explicit) }
        }
    };
    let bulkhead = &shared.bulkhead;
    let options = match deadline {
        Some(deadline) => options.borrowed_concurrency_deadline(deadline),
        None => RunOptions::from(options),
    };
    let future: RunFuture<'_> = if variant == 1 {
        Box::pin(bulkhead.run_with_usage(request, options, |u: &Option<TokenUsage>| *u, callback))
    } else {
        Box::pin(bulkhead.run(request, options, callback))
    };
    let cancel = cancelled.then(|| canceller(&shared.rt, rng));
    let (result, polled) = run_or_cancel(future, cancel).await;
    let state = *cell.lock().unwrap();
    let book = shared.book(call.class);
    let (explicit, cut) = match result {
        Some(Ok(explicit)) => {
            assert!(!fails);
            (explicit, false)
        }
        Some(Err(RunError::Failed(()))) => {
            assert!(fails);
            (None, false)
        }
        Some(Err(RunError::Rejected(rejection))) => {
            assert!(state.is_none());
            return shared.refused(&rejection, call, closed_before);
        }
        Some(Err(RunError::Invalid(error))) => panic!("valid input refused: {error}"),
        Some(Err(RunError::BorrowedConcurrencyDeadline(error))) => {
            let state = state.expect("cut after its admission");
            let held = state.held;
            assert_eq!(deadline, Some(SHORT), "cut by {error}");
            assert!(
                held.resources.borrowed_concurrency && !held.abandoned,
                "only a slot still borrowed is cut: {held:?}, {error}"
            );
            assert_eq!(
                (error.admission_id, error.resources, error.class),
                (held.id, held.resources, Some(shared.handles[call.class])),
                "{error}"
            );
            bump(&book.abandoned_deadline);
            (None, true)
        }
        Some(Err(other)) => panic!("an error this test does not know: {other:?}"),
        None => (None, false), // cancelled: settled (if admitted) with the last reported usage
    };
    let Some(RunCell {
        mut model,
        mut held,
        hung,
        ..
    }) = state
    else {
        assert!(result.is_none());
        return shared.vanished(call.class, polled);
    };
    if hung && result.is_some() {
        assert!(
            cut,
            "a callback hanging on a borrowed slot past its deadline is cut"
        );
    }
    if deadline.is_some() && result.is_some() && !cut {
        bump(&book.deadline_kept);
    }
    shared.settle(&mut held, model.held);
    let settled = model.settle(explicit);
    book.settled(held.id, &model, &settled);
}
