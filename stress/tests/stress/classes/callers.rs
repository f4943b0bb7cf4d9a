//! The callers: random mixes of every operation, each in a random class, with abandonments
//! and `run` borrowed-slot deadlines.

use std::sync::Arc;
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmRequest, Priority, admission::Admission, request::RequestError,
};
use futures::future::join_all;

use super::books::{Call, Facts, Held, MAX_CLASSES, Own, Plane, Shared};
use super::runs::run_op;
use crate::caller_model::{AnyPermit, Model, Reporter};
use crate::kit::books::bump;
use crate::kit::callers::{
    Acquired, Op, acquire, advisory, beyond_every_budget, invalid_estimate, queued,
};
use crate::kit::reports::{Finish, report_step, settle};
use crate::kit::runtimes::Task;

/// The admission behind a permit.
fn admission<'p>(permit: &'p AnyPermit<'_>) -> &'p Admission {
    match permit {
        AnyPermit::Borrowed(p) => p,
        AnyPermit::Owned(p) => p,
    }
}

fn abandon(permit: &mut AnyPermit<'_>) -> bool {
    match permit {
        AnyPermit::Borrowed(p) => p.abandon_borrowed_concurrency(),
        AnyPermit::Owned(p) => p.abandon_borrowed_concurrency(),
    }
}

/// A random class for worker `worker` (`solo` only for worker 0, half its calls), and a
/// random request and options in it: an explicit reservation or one the estimator sizes.
fn random_call(
    shared: &Shared,
    rng: &mut fastrand::Rng,
    worker: u64,
) -> (LlmRequest, AcquireOptions, Call) {
    let class = if worker == 0 && rng.bool() {
        Some(shared.solo)
    } else {
        // Every class but `solo` (the last one), or none: the default class.
        (rng.u8(0..5) != 0).then(|| rng.usize(0..shared.handles.len() - 1))
    };
    let mut options = AcquireOptions::new();
    if let Some(class) = class {
        options = options.class(shared.handles[class]);
    }
    let (request, options) = crate::kit::callers::random_call(rng, options);
    let call = Call {
        class: class.unwrap_or(shared.default),
        priority: options.priority,
    };
    (request, options, call)
}

/// One random report through `reporter`, checked against the model; the hold it moves is
/// booked for `solo`.
pub(crate) fn report(
    shared: &Shared,
    reporter: &mut impl Reporter,
    model: &mut Model,
    rng: &mut fastrand::Rng,
    valid: bool,
    held: &Held,
) {
    let before = model.held;
    report_step(reporter, model, rng, valid, shared.book(held.class));
    shared.moved(held, before, model.held);
}

/// Books a decided call's result; returns the permit (counted in the ledger) if admitted.
fn decided<'b>(
    shared: &Shared,
    result: Result<AnyPermit<'b>, AcquireError>,
    call: Call,
    closed_before: bool,
    own: Option<Own>,
) -> Option<(AnyPermit<'b>, Held)> {
    match result {
        Ok(permit) => {
            let facts = Facts::of(admission(&permit));
            let held = shared.admitted(facts, call, closed_before, own, true);
            Some((permit, held))
        }
        Err(AcquireError::Rejected(rejection)) => {
            shared.refused(&rejection, call, closed_before);
            None
        }
        Err(AcquireError::Invalid(error)) => panic!("valid input refused: {error}"),
        Err(other) => panic!("an error this test does not know: {other}"),
    }
}

/// Holds an admitted permit for a random short time, streaming random usage reports and
/// perhaps abandoning its slot at a random moment (then reporting on), then settles it:
/// explicit usage, the last reported, or a drop.
async fn hold(shared: &Shared, rng: &mut fastrand::Rng, mut permit: AnyPermit<'_>, mut held: Held) {
    let reservation = permit
        .reservation()
        .expect("a budget: every admission reserves");
    let mut model = Model::new(reservation);
    if shared.setup.always_usage {
        report(shared, &mut permit, &mut model, rng, true, &held);
    }
    let steps = rng.usize(0..5);
    let abandon_at = (rng.u8(0..3) == 0).then(|| rng.usize(0..=steps));
    for step in 0..=steps {
        if abandon_at == Some(step) {
            for _ in 0..rng.usize(1..3) {
                shared.abandon(&mut held, || abandon(&mut permit));
                assert_eq!(permit_holds_slot(&permit), !held.abandoned);
            }
        }
        if step < steps {
            shared.rt.pause(rng).await;
            report(shared, &mut permit, &mut model, rng, false, &held);
        }
    }
    shared.rt.pause(rng).await;
    shared.settle(&mut held, model.held);
    let finish = Finish::random(rng, &model);
    let settled = settle(permit, &mut model, finish);
    shared.book(held.class).settled(held.id, &model, &settled);
}

fn permit_holds_slot(permit: &AnyPermit<'_>) -> bool {
    admission(permit).holds_slot()
}

/// Checks an acquire's outcome (see [`decided`]) and, if it admitted, holds and settles it.
async fn decide_and_hold(
    shared: &Shared,
    rng: &mut fastrand::Rng,
    result: Result<AnyPermit<'_>, AcquireError>,
    call: Call,
    closed_before: bool,
) {
    if let Some((permit, held)) = decided(shared, result, call, closed_before, None) {
        hold(shared, rng, permit, held).await;
    }
}

/// One random operation of worker `worker`.
pub(crate) async fn op(
    shared: &Arc<Shared>,
    rng: &mut fastrand::Rng,
    worker: u64,
    handoffs: &mut Vec<Task>,
) {
    let bulkhead = &shared.bulkhead;
    // Read before the call starts: if set, `close()` returned before it, so it must be refused.
    let closed_before = shared.closed();
    let (request, options, call) = random_call(shared, rng, worker);
    match Op::random(rng, shared.rt.threads()) {
        Op::Acquire(way) => {
            // A `run` dropped before its first poll carries a borrowed-slot deadline.
            let unpolled_run = |options: AcquireOptions| {
                options.borrowed_concurrency_deadline(Duration::from_millis(1))
            };
            let acquired = acquire(
                bulkhead,
                &shared.rt,
                rng,
                &request,
                options,
                way,
                unpolled_run,
            )
            .await;
            match acquired {
                Acquired::Decided(result) => {
                    decide_and_hold(shared, rng, result, call, closed_before).await;
                }
                Acquired::Vanished { polled } => shared.vanished(call.class, polled),
            }
        }
        Op::Run => {
            let options = queued(rng, options);
            run_op(shared, rng, &request, options, call, closed_before).await;
        }
        Op::Handoff => {
            // Never in `solo`: its book is exact only while worker 0 alone holds its permits.
            let (request, mut options, mut call) = (request, options, call);
            if call.class == shared.solo {
                call.class = shared.default;
                options.class = Some(shared.handles[shared.default]);
            }
            let result = if rng.bool() {
                bulkhead.try_acquire_owned(&request, options)
            } else {
                bulkhead.acquire_owned(&request, queued(rng, options)).await
            };
            if let Some((permit, held)) = decided(
                shared,
                result.map(AnyPermit::Owned),
                call,
                closed_before,
                None,
            ) {
                let AnyPermit::Owned(permit) = permit else {
                    unreachable!()
                };
                let (inner, mut inner_rng) =
                    (Arc::clone(shared), fastrand::Rng::with_seed(rng.u64(..)));
                handoffs.push(shared.spawn(async move {
                    hold(&inner, &mut inner_rng, AnyPermit::Owned(permit), held).await;
                }));
            }
        }
        Op::Several => several(shared, rng, worker, closed_before).await,
        Op::Odd => odd_call(shared, rng, &request, options, call, closed_before).await,
        Op::Look => look(shared, worker, closed_before),
    }
}

/// Several permits at once (only `try_acquire`: never wait while holding), some abandoned
/// between the acquisitions, then held concurrently by this one task. Each admission is
/// checked against what the task itself holds in its class (its own slots and tokens are a
/// lower bound of the class's).
async fn several(shared: &Shared, rng: &mut fastrand::Rng, worker: u64, closed_before: bool) {
    let mut own = [Own::default(); MAX_CLASSES];
    let mut held: Vec<(AnyPermit<'_>, Held)> = Vec::new();
    for _ in 0..rng.usize(2..6) {
        let (request, options, call) = random_call(shared, rng, worker);
        let result = shared.bulkhead.try_acquire(&request, options);
        let mine = own[call.class];
        if let Some((permit, h)) = decided(
            shared,
            result.map(AnyPermit::Borrowed),
            call,
            closed_before,
            Some(mine),
        ) {
            own[call.class].slots += 1;
            own[call.class].tokens += permit.held();
            held.push((permit, h));
        }
        if !held.is_empty() && rng.u8(0..3) == 0 {
            let (permit, h) = rng.choice(held.iter_mut()).unwrap();
            let was = h.abandoned;
            shared.abandon(h, || abandon(permit));
            if h.abandoned && !was {
                own[h.class].slots -= 1;
            }
        }
    }
    let sessions = held.into_iter().map(|(permit, h)| {
        let mut rng = fastrand::Rng::with_seed(rng.u64(..));
        async move { hold(shared, &mut rng, permit, h).await }
    });
    join_all(sessions.collect::<Vec<_>>()).await;
}

/// A quick look at the figures: classes within the ceilings ever in force, `solo` exactly as
/// its book says (for worker 0), and with fixed limits the ledger within every bound.
fn look(shared: &Shared, worker: u64, closed_before: bool) {
    let stats = shared.bulkhead.stats();
    let classes = stats.admission_classes.as_ref().unwrap();
    let revisions = &shared.revisions;
    for (c, s) in classes.classes.iter().enumerate() {
        if let Some(max) = revisions.max_since(0, |caps| caps.ceiling(c)) {
            assert!(
                s.in_flight <= max,
                "class {c} above every ceiling {max}: {s:?}"
            );
        }
    }
    let max = revisions.max_since(0, |caps| Some(u64::from(caps.max_concurrent)));
    assert!(stats.in_flight <= max.unwrap(), "{stats:?}");
    shared.check_pending(&stats);
    if shared.setup.plane == Plane::Fixed {
        let caps = revisions.get(0);
        if caps.floors() > 0 {
            assert!(
                classes.shared.in_flight <= classes.shared.max_concurrent,
                "the shared pool overdrawn: {:?}",
                classes.shared
            );
        }
        shared.check_fixed(shared.ledger.read());
    }
    if worker == 0 {
        let s = &classes.classes[shared.solo];
        let book = *shared.solo_book.lock().unwrap();
        assert_eq!(
            Own {
                slots: s.in_flight,
                tokens: s.in_flight_tokens
            },
            book,
            "solo's figures against its book: {s:?}"
        );
    }
    if closed_before {
        assert!(stats.closed && shared.bulkhead.is_closed());
    }
}

/// Advisory checks, input that cannot be estimated, a class of another bulkhead, and a
/// reservation no budget fits.
async fn odd_call(
    shared: &Shared,
    rng: &mut fastrand::Rng,
    request: &LlmRequest,
    options: AcquireOptions,
    call: Call,
    closed_before: bool,
) {
    let bulkhead = &shared.bulkhead;
    match rng.u8(0..4) {
        0 => advisory(bulkhead, request, options, closed_before),
        1 => invalid_estimate(shared, rng, options).await,
        2 => {
            // Another bulkhead's class: refused before anything is counted.
            let foreign = options.class(shared.foreign);
            let result = match rng.u8(0..3) {
                0 => bulkhead.try_acquire(request, foreign).map(drop),
                1 => bulkhead.acquire_owned(request, foreign).await.map(drop),
                _ => bulkhead
                    .would_admit(request, foreign)
                    .map(drop)
                    .map_err(AcquireError::Invalid),
            };
            assert!(
                matches!(
                    result,
                    Err(AcquireError::Invalid(RequestError::ForeignClass { class }))
                        if class == shared.foreign
                ),
                "{result:?}"
            );
            bump(&shared.counts.invalid);
        }
        _ => {
            // Fits no budget: refused for tokens at once (the global budget is judged before
            // any class limit), even when it may queue.
            let call = Call {
                priority: Priority::High,
                ..call
            };
            let rejection = beyond_every_budget(bulkhead, rng, request, options).await;
            shared.refused(&rejection, call, closed_before);
        }
    }
}
