//! The callers: random mixes of every operation, each in a random class, with abandonments
//! and `run` borrowed-slot deadlines.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmRequest, Priority, RejectReason, Reservation, RunError,
    admission::Admission, admission::Verdict, limits::MAX_BUDGET, request::RequestError,
};
use futures::future::{Either, join_all, select};

use super::POST_CLOSE_OPS;
use super::books::{Call, Facts, Held, Own, Plane, Shared, bump};
use super::runs::run_op;
use crate::caller_model::{AnyPermit, Model, Reporter};
use crate::chaos::mix;
use crate::chaos::model::report_step;
use crate::chaos::runtime::{Task, Timer, Tracked, poll_once, yield_now, yields};

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
    let call = Call {
        class: class.unwrap_or(shared.default),
        priority: options.priority,
    };
    (request, options, call)
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
pub(crate) fn canceller(shared: &Shared, rng: &mut fastrand::Rng) -> Task {
    match rng.u8(0..3) {
        0 => Box::pin(yields(rng.usize(0..4))),
        _ => shared.rt.sleep(Duration::from_micros(rng.u64(0..2_500))),
    }
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
    let effective = &shared.book(held.class).effective_reports;
    report_step(reporter, model, rng, valid, effective);
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
            assert!(!closed_before, "admitted after close() returned");
            let held = shared.admitted(Facts::of(admission(&permit)), call, own, true);
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
    let book = shared.book(held.class);
    match rng.u8(0..3) {
        0 => {
            drop(permit);
            let settled = model.settle(None);
            book.settled(&model, &settled);
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
            book.settled(&model, &settled);
        }
    }
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
async fn op(shared: &Arc<Shared>, rng: &mut fastrand::Rng, worker: u64, handoffs: &mut Vec<Task>) {
    let bulkhead = &shared.bulkhead;
    // Read before the call starts: if set, `close()` returned before it, so it must be refused.
    let closed_before = shared.closed.load(Ordering::Acquire);
    let (request, options, call) = random_call(shared, rng, worker);
    let kinds = if shared.rt.threads() { 17 } else { 15 };
    match rng.u8(0..kinds) {
        0 => {
            let result = bulkhead.try_acquire(&request, options);
            decide_and_hold(
                shared,
                rng,
                result.map(AnyPermit::Borrowed),
                call,
                closed_before,
            )
            .await;
        }
        1 => {
            let result = bulkhead.try_acquire_owned(&request, options);
            decide_and_hold(
                shared,
                rng,
                result.map(AnyPermit::Owned),
                call,
                closed_before,
            )
            .await;
        }
        2 | 3 => {
            let result = bulkhead.acquire(&request, queued(rng, options)).await;
            decide_and_hold(
                shared,
                rng,
                result.map(AnyPermit::Borrowed),
                call,
                closed_before,
            )
            .await;
        }
        4 => {
            let result = bulkhead.acquire_owned(&request, queued(rng, options)).await;
            decide_and_hold(
                shared,
                rng,
                result.map(AnyPermit::Owned),
                call,
                closed_before,
            )
            .await;
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
                    drop(acquire);
                    decide_and_hold(
                        shared,
                        rng,
                        result.map(AnyPermit::Borrowed),
                        call,
                        closed_before,
                    )
                    .await;
                }
                None => {
                    let polled = acquire.polled;
                    drop(acquire);
                    shared.vanished(call.class, polled);
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
                    decide_and_hold(
                        shared,
                        rng,
                        result.map(AnyPermit::Owned),
                        call,
                        closed_before,
                    )
                    .await;
                }
                None => {
                    let polled = acquire.polled;
                    drop(acquire);
                    shared.vanished(call.class, polled);
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
                    decide_and_hold(
                        shared,
                        rng,
                        result.map(AnyPermit::Borrowed),
                        call,
                        closed_before,
                    )
                    .await;
                }
                Poll::Pending => {
                    drop(acquire);
                    shared.vanished(call.class, true);
                }
            }
        }
        8 => {
            // Dropped before the first poll: decides nothing, counts nothing.
            match rng.u8(0..3) {
                0 => drop(bulkhead.acquire(&request, options)),
                1 => drop(bulkhead.acquire_owned(&request, options)),
                _ => drop(bulkhead.run(
                    &request,
                    options.borrowed_concurrency_deadline(Duration::from_millis(1)),
                    async |_| Ok::<(), ()>(()),
                )),
            }
            shared.vanished(call.class, false);
        }
        9 | 10 => {
            let options = queued(rng, options);
            run_op(shared, rng, &request, options, call, closed_before).await;
        }
        11 => {
            // An owned permit handed to another task (or thread), which holds and settles it.
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
        12 => several(shared, rng, worker, closed_before).await,
        13 => odd_call(shared, rng, &request, options, call, closed_before).await,
        14 => look(shared, worker, closed_before),
        15 => {
            let result = bulkhead.acquire_blocking(&request, queued(rng, options));
            decide_and_hold(
                shared,
                rng,
                result.map(AnyPermit::Borrowed),
                call,
                closed_before,
            )
            .await;
        }
        _ => {
            let result = bulkhead.acquire_blocking_owned(&request, queued(rng, options));
            decide_and_hold(
                shared,
                rng,
                result.map(AnyPermit::Owned),
                call,
                closed_before,
            )
            .await;
        }
    }
}

/// Several permits at once (only `try_acquire`: never wait while holding), some abandoned
/// between the acquisitions, then held concurrently by this one task. Each admission is
/// checked against what the task itself holds in its class (its own slots and tokens are a
/// lower bound of the class's).
async fn several(shared: &Shared, rng: &mut fastrand::Rng, worker: u64, closed_before: bool) {
    let mut own = [Own::default(); super::books::MAX_CLASSES];
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
    assert!(
        stats.pending <= shared.peak_queue.load(Ordering::Acquire),
        "{stats:?}"
    );
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
        0 => {
            // Advisory: decides and counts nothing.
            let verdict = bulkhead.would_admit(request, options).unwrap();
            if closed_before {
                assert_eq!(verdict, Verdict::Reject(RejectReason::Shutdown));
            }
        }
        1 => {
            // The estimate overflows: invalid, before anything else (even after the close).
            let mut options = options;
            options.reservation = None;
            let invalid = LlmRequest::new()
                .user("hello")
                .extra_input_tokens(u64::MAX)
                .max_tokens(10);
            let result = match rng.u8(0..3) {
                0 => bulkhead.try_acquire(&invalid, options).map(drop),
                1 => bulkhead
                    .acquire(&invalid, queued(rng, options))
                    .await
                    .map(drop),
                _ => {
                    let result = bulkhead
                        .run(&invalid, options, async |_| Ok::<(), ()>(()))
                        .await;
                    assert!(matches!(result, Err(RunError::Invalid(_))), "{result:?}");
                    bump(&shared.tally.invalid);
                    return;
                }
            };
            assert!(
                matches!(result, Err(AcquireError::Invalid(_))),
                "{result:?}"
            );
            bump(&shared.tally.invalid);
        }
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
            bump(&shared.tally.invalid);
        }
        _ => {
            // Fits no budget: refused for tokens at once (the global budget is judged before
            // any class limit), even when it may queue.
            let options = options
                .reservation(Reservation::new(MAX_BUDGET, 1).unwrap())
                .priority(Priority::High);
            let call = Call {
                priority: Priority::High,
                ..call
            };
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
            shared.refused(&rejection, call, closed_before);
        }
    }
}

pub(crate) async fn worker(shared: Arc<Shared>, index: u64) {
    let mut rng = fastrand::Rng::with_seed(mix(shared.setup.seed, index + 1));
    let mut handoffs = Vec::new();
    for _ in 0..shared.setup.ops {
        op(&shared, &mut rng, index, &mut handoffs).await;
        shared.ops_done.fetch_add(1, Ordering::AcqRel);
        if handoffs.len() > 4 {
            join_all(handoffs.drain(..)).await;
        }
        // Think time, as a client has (see `chaos::callers::worker`).
        shared.rt.pause(&mut rng).await;
        yield_now().await;
        if shared.failed() {
            break;
        }
    }
    // Keep calling until the close, then a few more: all of those are refused.
    while !shared.closed.load(Ordering::Acquire) && !shared.failed() {
        op(&shared, &mut rng, index, &mut handoffs).await;
        shared
            .rt
            .sleep(Duration::from_micros(rng.u64(50..500)))
            .await;
    }
    for _ in 0..POST_CLOSE_OPS {
        op(&shared, &mut rng, index, &mut handoffs).await;
        yield_now().await;
    }
    join_all(handoffs).await;
    shared.workers_done.fetch_add(1, Ordering::AcqRel);
}
