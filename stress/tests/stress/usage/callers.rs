//! The calls (async and on blocked threads), each checked report by report against the
//! callers' model; the control plane's limit changes; one scenario run on the kit.

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, Limits, LlmBulkhead, LlmRequest, Priority, Reservation, RunError, TokenBudget,
    TokenUsage, admission::AdmissionId, usage::Progressive,
};
use futures::future::{Either, select};

use super::books::Shared;
use super::plan::Plan;
use super::{PEAK_SLOTS, Plane, SLOTS, with};
use crate::caller_model::{AnyPermit, Model, Reporter};
use crate::kit::books::{Book, Heard, Ledger, bump};
use crate::kit::control_plane::{Close, Pace, Schedule, apply, set_budget, with_budget};
use crate::kit::reports::{check_report, settle};
use crate::kit::runtimes::{Rt, Task, yields};
use crate::kit::scene::{Family, Scene, Setup, play};

/// The control plane changes the limits as fast as it goes until every call is done.
const CHANGES: Schedule = Schedule {
    close: Close::Never,
    drains: false,
    drain_at_close: false,
    pace: Pace::Busy,
    post_close_ops: 0,
};

/// As `CHANGES`, but closes the bulkhead once half the calls are done and drains it; every
/// worker then makes a few calls more once it saw the close (all refused `shutdown`), however
/// late the close came.
const CLOSES: Schedule = Schedule {
    close: Close::Between(500, 500),
    drain_at_close: true,
    post_close_ops: 4,
    ..CHANGES
};

/// One planned report through `reporter`, checked against (and applied to) the model: the
/// plans make only valid reports, but for a remaining output above the cap, which must be
/// refused (with the cap) and change nothing.
fn report(
    reporter: &mut impl Reporter,
    model: &mut Model,
    usage: TokenUsage,
    progressive: Option<Progressive>,
    book: &Book,
) {
    let cap = model.cap();
    let refused = check_report(reporter, model, usage, progressive, book).is_err();
    assert_eq!(
        refused,
        progressive.is_some_and(|p| p.remaining_output_tokens > cap),
        "{usage:?} {progressive:?} on {:?}",
        model.reservation
    );
}

/// Settles `permit` as planned (the release report checked against the model) and books it.
fn settle_planned(shared: &Shared, permit: AnyPermit<'_>, mut model: Model, plan: &Plan) {
    let id = permit.admission_id();
    let settled = settle(permit, &mut model, plan.finish);
    shared.book.settled(id, &model, &settled);
}

/// A random reservation and priority.
fn random_call(rng: &mut fastrand::Rng) -> (Reservation, AcquireOptions) {
    let reservation = match rng.u8(0..40) {
        0 => Reservation::new(0, 0).unwrap(),
        1 => Reservation::new(rng.u64(0..200), 0).unwrap(),
        _ => Reservation::new(rng.u64(0..200), rng.u64(1..600)).unwrap(),
    };
    let mut options = with(reservation);
    if rng.u8(0..4) == 0 {
        options = options.priority(Priority::High);
    }
    (reservation, options)
}

fn new_bulkhead() -> LlmBulkhead {
    LlmBulkhead::builder("m", SLOTS as usize)
        .max_queue(6)
        .token_budget(TokenBudget::new(3_000).high_priority_reserve(300))
        .build()
        .unwrap()
}

/// One change of limits; checks the slots in flight against the fixed limit first.
fn reconfigure(shared: &Shared, rng: &mut fastrand::Rng) {
    let bulkhead = &shared.bulkhead;
    let varying = shared.setup.plane == Plane::Varying;
    let in_flight = bulkhead.stats().in_flight;
    if !varying {
        assert!(
            in_flight <= u64::from(SLOTS),
            "{in_flight} in flight, limit {SLOTS}"
        );
    }
    let before = bulkhead.limits();
    if rng.u8(0..3) == 0 {
        set_budget(shared, &with_budget(&before, rng.u64(1_500..8_000)));
    } else {
        let max_concurrent = match (varying, rng.u8(0..10)) {
            (false, _) => SLOTS,
            (true, 0) => 0, // the kill switch, waiters kept
            (true, _) => rng.u32(1..=PEAK_SLOTS),
        };
        let next = Limits::new(before.revision + 1, max_concurrent)
            .with_max_queue(if rng.u8(0..10) == 0 {
                0
            } else {
                rng.u32(2..12)
            })
            .with_token_budget(rng.u64(1_500..8_000), rng.u64(0..500));
        apply(shared, &before, next.clone(), &next);
    }
}

/// One call, async: acquired in a random way (or through `run`), reported on as planned with
/// a few executor turns between reports, settled as planned.
async fn call(shared: &Shared, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    // Read before the call starts: if set, `close()` returned before it, so it must be refused.
    let closed_before = shared.closed();
    let (reservation, options) = random_call(&mut rng);
    let plan = Plan::new(&mut rng, reservation, shared.setup.always_usage);
    let queued = options.timeout(Duration::from_micros(rng.u64(0..4_000)));
    let request = LlmRequest::new();
    let bulkhead = &shared.bulkhead;
    let acquired = match rng.u8(0..12) {
        0 | 1 => bulkhead
            .try_acquire(&request, options)
            .map(AnyPermit::Borrowed),
        2 => bulkhead
            .try_acquire_owned(&request, options)
            .map(AnyPermit::Owned),
        3..=5 => bulkhead
            .acquire(&request, queued)
            .await
            .map(AnyPermit::Borrowed),
        6 => bulkhead
            .acquire_owned(&request, queued)
            .await
            .map(AnyPermit::Owned),
        7 => {
            // Gives up after a few executor turns: the acquire future (polled first, so
            // decided) is dropped wherever it is (counted as aborted if it was waiting).
            let acquire = bulkhead.acquire(&request, queued);
            match select(pin!(acquire), pin!(yields(rng.usize(0..6)))).await {
                Either::Left((result, _)) => result.map(AnyPermit::Borrowed),
                Either::Right(_) => return shared.book.vanished(true),
            }
        }
        _ => {
            let run = run_call(shared, queued, reservation, plan, &mut rng, closed_before);
            return run.await;
        }
    };
    let mut permit = match acquired {
        Ok(permit) => permit,
        Err(error) => return shared.refused(error, closed_before),
    };
    shared.book.admitted(closed_before);
    shared.enter();
    assert_eq!(permit.reservation(), Some(reservation));
    let mut model = Model::new(reservation);
    for k in 0..plan.reports {
        yields(rng.usize(0..3)).await;
        let (usage, progressive) = plan.report(&mut rng, k, reservation.max_output());
        report(&mut permit, &mut model, usage, progressive, &shared.book);
    }
    yields(rng.usize(0..3)).await;
    shared.leave();
    settle_planned(shared, permit, model, &plan);
}

/// A call through `run_with_usage`: reports through the `RunContext`; settles with the
/// extracted usage, or (plain `run`, a failing callback, a cancelled run) the last reported.
async fn run_call(
    shared: &Shared,
    options: AcquireOptions,
    reservation: Reservation,
    plan: Plan,
    rng: &mut fastrand::Rng,
    closed_before: bool,
) {
    // 0: plain run, 1: run_with_usage, 2: the callback fails, 3: the run is cancelled.
    let variant = if shared.setup.always_usage {
        rng.u8(0..3)
    } else {
        rng.u8(0..4)
    };
    let (fails, cancelled) = (variant == 2, variant == 3);
    let explicit = if variant == 1 {
        plan.finish.explicit()
    } else {
        None
    };
    let give_up_after = rng.usize(0..8);
    let mut run_rng = fastrand::Rng::with_seed(rng.u64(..));
    // The callback keeps its admission's model here after every step, so the model survives
    // a cancelled run.
    let cell: Mutex<Option<(AdmissionId, Model)>> = Mutex::new(None);
    let run = shared.bulkhead.run_with_usage(
        &LlmRequest::new(),
        options,
        move |_: &()| explicit,
        async |mut ctx| {
            shared.book.admit(closed_before);
            assert_eq!(ctx.reservation(), Some(reservation));
            let mut model = Model::new(reservation);
            *cell.lock().unwrap() = Some((ctx.admission_id().expect("admitted"), model));
            // A cancelled run settles when its future is dropped, with no chance to leave the
            // ledger first: it stays out of it (the ledger stays a lower bound).
            if !cancelled {
                shared.enter();
            }
            for k in 0..plan.reports {
                yields(run_rng.usize(0..3)).await;
                let (usage, progressive) = plan.report(&mut run_rng, k, reservation.max_output());
                report(&mut ctx, &mut model, usage, progressive, &shared.book);
                cell.lock().unwrap().as_mut().unwrap().1 = model;
            }
            yields(run_rng.usize(0..3)).await;
            if !cancelled {
                shared.leave();
            }
            if fails { Err(()) } else { Ok(()) }
        },
    );
    // Polled first (so decided) when it is given up.
    let result = if cancelled {
        match select(pin!(run), pin!(yields(give_up_after))).await {
            Either::Left((result, _)) => Some(result),
            Either::Right(_) => None,
        }
    } else {
        Some(run.await)
    };
    match result {
        Some(Ok(())) => assert!(!fails),
        Some(Err(RunError::Failed(()))) => assert!(fails),
        Some(Err(RunError::Rejected(rejection))) => {
            assert!(cell.lock().unwrap().is_none());
            return shared.book.refused(rejection.reason(), closed_before);
        }
        Some(Err(RunError::Invalid(error))) => panic!("valid input refused: {error}"),
        Some(Err(RunError::BorrowedConcurrencyDeadline(cut))) => {
            panic!("no deadline was set, yet: {cut}")
        }
        Some(Err(other)) => panic!("an error this test does not know: {other:?}"),
        None => {} // cancelled while acquiring or while the callback ran
    }
    let Some((id, mut model)) = cell.into_inner().unwrap() else {
        // Cancelled before admission (counted as aborted).
        assert!(result.is_none());
        return shared.book.vanished(true);
    };
    shared.book.decided();
    let settled = model.settle(explicit);
    shared.book.settled(id, &model, &settled);
}

/// A short pause between reports on a blocked thread: nothing, a yield, or a spin.
fn pause(rng: &mut fastrand::Rng) {
    match rng.u8(0..4) {
        0 => std::thread::yield_now(),
        1 => {
            for _ in 0..rng.usize(0..300) {
                std::hint::spin_loop();
            }
        }
        _ => {}
    }
}

/// One call on a blocked thread (`acquire_blocking`, `try_acquire`): the same checks.
fn blocking_call(shared: &Shared, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let closed_before = shared.closed();
    let (reservation, options) = random_call(&mut rng);
    let plan = Plan::new(&mut rng, reservation, shared.setup.always_usage);
    let queued = options.timeout(Duration::from_micros(rng.u64(0..3_000)));
    let request = LlmRequest::new();
    let bulkhead = &shared.bulkhead;
    let acquired = match rng.u8(0..6) {
        0 => bulkhead
            .try_acquire(&request, options)
            .map(AnyPermit::Borrowed),
        1 => bulkhead
            .try_acquire_owned(&request, options)
            .map(AnyPermit::Owned),
        2 | 3 => bulkhead
            .acquire_blocking(&request, queued)
            .map(AnyPermit::Borrowed),
        _ => bulkhead
            .acquire_blocking_owned(&request, queued)
            .map(AnyPermit::Owned),
    };
    let mut permit = match acquired {
        Ok(permit) => permit,
        Err(error) => return shared.refused(error, closed_before),
    };
    shared.book.admitted(closed_before);
    shared.enter();
    assert_eq!(permit.reservation(), Some(reservation));
    let mut model = Model::new(reservation);
    for k in 0..plan.reports {
        pause(&mut rng);
        let (usage, progressive) = plan.report(&mut rng, k, reservation.max_output());
        report(&mut permit, &mut model, usage, progressive, &shared.book);
    }
    pause(&mut rng);
    shared.leave();
    if rng.u8(0..8) == 0 {
        // Settled on a fresh thread: its bookings land in another statistics shard, which the
        // next thread adopts when this one exits.
        std::thread::scope(|s| {
            s.spawn(|| settle_planned(shared, permit, model, &plan));
        });
    } else {
        settle_planned(shared, permit, model, &plan);
    }
}

/// One call of a worker: on a blocked thread with plain threads, else async.
async fn op(shared: &Shared, rng: &mut fastrand::Rng) {
    let seed = rng.u64(..);
    bump(&shared.calls);
    if shared.rt.threads() {
        blocking_call(shared, seed);
    } else {
        call(shared, seed).await;
    }
}

impl Family for Shared {
    fn op<'a>(
        shared: &'a Arc<Self>,
        rng: &'a mut fastrand::Rng,
        _worker: u64,
        _handoffs: &'a mut Vec<Task>,
    ) -> impl Future<Output = ()> + Send + 'a {
        op(shared, rng)
    }

    fn reconfigure(&self, rng: &mut fastrand::Rng) {
        reconfigure(self, rng);
    }

    fn verify(&self) {
        self.check_end();
    }
}

/// One scenario: `setup.workers` workers of `setup.ops` calls each on `rt`.
pub(crate) async fn scenario(runtime: &'static str, setup: Setup<Plane>, rt: Rt) {
    let bulkhead = new_bulkhead();
    let heard = Arc::new(Heard::new(false));
    let _subscription = setup.listen.then(|| {
        let heard = Arc::clone(&heard);
        bulkhead.on(move |event| heard.hear(event))
    });
    let schedule = match setup.plane {
        Plane::Closes => CLOSES,
        Plane::SlotsFixed | Plane::Varying => CHANGES,
    };
    let shared = Arc::new(Shared {
        setup,
        scene: Scene::new("usage", runtime, &setup, schedule, bulkhead, rt),
        book: if setup.listen {
            Book::tracing()
        } else {
            Book::default()
        },
        ledger: Ledger::default(),
        heard,
        calls: AtomicU64::new(0),
    });
    play(shared).await;
}
