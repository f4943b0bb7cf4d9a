//! Permits and reports; async callers and the control plane; one scenario run.

use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, Limits, LlmBulkhead, LlmRequest, Priority, Reservation, RunError, TokenBudget,
    TokenUsage, admission::AdmissionId, usage::Progressive, usage::UsageError,
};
use futures::FutureExt;
use futures::future::{Either, select};

use super::books::{Shared, Tally};
use super::plan::{Finish, Plan};
use super::{PEAK_SLOTS, SLOTS, WORKERS, scale, with, yields};
use crate::caller_model::{AnyPermit, Model, Reporter};

/// One report through `reporter`, checked against (and applied to) the model.
pub(crate) fn report_step(
    reporter: &mut impl Reporter,
    model: &mut Model,
    usage: TokenUsage,
    progressive: Option<Progressive>,
    tally: &Tally,
) {
    let (sequence, held) = (model.sequence, model.held);
    assert_eq!(reporter.held(), held);
    let cap = model.reservation.max_output();
    let result = reporter.report(usage, progressive);
    if let Some(p) = progressive.filter(|p| p.remaining_output_tokens > cap) {
        let error = result.expect_err("a remaining output above the cap is refused");
        assert!(
            matches!(error, UsageError::RemainingExceedsCap { remaining, cap: c }
                if remaining == p.remaining_output_tokens && c == cap),
            "{error:?}"
        );
        assert_eq!(reporter.held(), held, "a refused report changes nothing");
        return;
    }
    let report = result.expect("a valid report is applied");
    let (cumulative_usage, hold) = model
        .predict(usage, progressive)
        .expect("the plans make only valid reports");
    let effective = model.apply(cumulative_usage, hold);
    let cumulative = model.reported.unwrap();
    assert_eq!(
        (
            report.held,
            report.sequence,
            report.reserved,
            report.consumed
        ),
        (
            model.held,
            model.sequence,
            model.reserved(),
            cumulative.total()
        ),
        "(held, sequence, reserved, consumed) after {usage:?} {progressive:?} on {:?}",
        model.reservation
    );
    assert_eq!(
        report.over_reservation,
        cumulative.total() > model.reserved()
    );
    assert_eq!(report.output_cap, Some(cap));
    assert_eq!(
        report.output_remaining,
        Some(cap.saturating_sub(cumulative.output()))
    );
    assert_eq!(reporter.held(), model.held);
    assert_eq!(report.sequence > sequence, effective);
    if report.sequence > sequence {
        tally.effective_reports.fetch_add(1, Ordering::Relaxed);
    }
}

/// Settles `permit` as planned, checking the release report against the model.
pub(crate) fn settle(permit: AnyPermit<'_>, mut model: Model, plan: &Plan, tally: &Tally) {
    let id = permit.admission_id();
    let settled = model.settle(plan.explicit());
    if plan.finish == Finish::Drop {
        drop(permit);
    } else {
        let report = permit.release(plan.explicit());
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
            "release report of {:?}",
            model.reservation
        );
    }
    tally.settled(id, &model, settled);
}

/// A random reservation and priority.
pub(crate) fn random_call(rng: &mut fastrand::Rng) -> (Reservation, AcquireOptions) {
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

// ===== async callers and control plane =====

#[derive(Clone, Copy, Debug)]
pub(crate) struct Setup {
    pub(crate) seed: u64,
    /// Every admission settles with usage (the plain identity must hold).
    pub(crate) always_usage: bool,
    /// The control plane also changes `max_concurrent` (the ledger's ceiling is then the
    /// largest limit ever applied).
    varying_slots: bool,
    /// A listener subscribed to every event (without one, no event is built, no admission is
    /// timed, and a permit dropped without usage takes the release fast path).
    pub(crate) listen: bool,
    /// The control plane closes the bulkhead once half the calls are done, with calls still
    /// streaming usage, and checks that `drain()` resolves with every token back.
    pub(crate) closes: bool,
}

impl Setup {
    /// Fixed `max_concurrent`, some admissions settled without usage, a listener.
    pub(crate) const fn new(seed: u64) -> Setup {
        Setup {
            seed,
            always_usage: false,
            varying_slots: false,
            listen: true,
            closes: false,
        }
    }

    pub(crate) const fn always_usage(mut self) -> Setup {
        self.always_usage = true;
        self
    }

    pub(crate) const fn varying_slots(mut self) -> Setup {
        self.varying_slots = true;
        self
    }

    pub(crate) const fn unobserved(mut self) -> Setup {
        self.listen = false;
        self
    }

    pub(crate) const fn closes(mut self) -> Setup {
        self.closes = true;
        self
    }

    /// The calls after which the control plane stops (closing the bulkhead if it closes).
    pub(crate) fn plane_stops_after(&self, callers: u64) -> u64 {
        if self.closes { callers / 2 } else { callers }
    }

    pub(crate) fn ceiling(&self) -> u32 {
        if self.varying_slots {
            PEAK_SLOTS
        } else {
            SLOTS
        }
    }
}

pub(crate) fn new_bulkhead() -> LlmBulkhead {
    LlmBulkhead::builder("m", SLOTS as usize)
        .max_queue(6)
        .token_budget(TokenBudget::new(3_000).high_priority_reserve(300))
        .build()
        .unwrap()
}

/// One change of limits; checks the slots in flight against the fixed limit first.
pub(crate) fn reconfigure(bulkhead: &LlmBulkhead, rng: &mut fastrand::Rng, setup: Setup) {
    let in_flight = bulkhead.stats().in_flight;
    if !setup.varying_slots {
        assert!(
            in_flight <= u64::from(SLOTS),
            "{in_flight} in flight, limit {SLOTS}"
        );
    }
    if rng.u8(0..3) == 0 {
        bulkhead.set_budget(rng.u64(1_500..8_000)).unwrap();
    } else {
        let max_concurrent = match (setup.varying_slots, rng.u8(0..10)) {
            (false, _) => SLOTS,
            (true, 0) => 0, // the kill switch, waiters kept
            (true, _) => rng.u32(1..=PEAK_SLOTS),
        };
        let limits = Limits::new(bulkhead.limits().revision + 1, max_concurrent)
            .with_max_queue(if rng.u8(0..10) == 0 {
                0
            } else {
                rng.u32(2..12)
            })
            .with_token_budget(rng.u64(1_500..8_000), rng.u64(0..500));
        assert!(bulkhead.apply_limits(limits).unwrap().is_applied());
    }
}

async fn control_plane(bulkhead: LlmBulkhead, shared: Arc<Shared>, setup: Setup, callers: u64) {
    let mut rng = fastrand::Rng::with_seed(setup.seed ^ 0x5eed);
    while shared.plane_continues(setup, callers) {
        reconfigure(&bulkhead, &mut rng, setup);
        yields(rng.usize(1..20)).await;
    }
    if setup.closes {
        assert!(bulkhead.close());
        bulkhead.drain().await;
        assert_idle_after_close(&bulkhead);
    }
}

/// After a close and a drain: nothing can be admitted any more, so nothing is in flight, no
/// token is held and nobody waits, although callers may still be running.
pub(crate) fn assert_idle_after_close(bulkhead: &LlmBulkhead) {
    let stats = bulkhead.stats();
    let tokens = stats.token_budget.unwrap();
    assert!(stats.closed);
    assert_eq!(
        (stats.in_flight, stats.pending, tokens.in_flight_tokens),
        (0, 0, 0),
        "drained: {stats:?}"
    );
}

/// One of the concurrent workers: `calls` calls one after the other, so the bulkhead stays
/// contended (a few workers per slot) without refusing nearly everything at once.
async fn worker(
    bulkhead: LlmBulkhead,
    shared: Arc<Shared>,
    setup: Setup,
    first_seed: u64,
    calls: u64,
) {
    for seed in first_seed..first_seed + calls {
        call(&bulkhead, &shared, setup, seed).await;
        shared.tally.done.fetch_add(1, Ordering::AcqRel);
        yields(usize::from(seed % 3 == 0)).await;
    }
}

async fn call(bulkhead: &LlmBulkhead, shared: &Shared, setup: Setup, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let (reservation, options) = random_call(&mut rng);
    let plan = Plan::new(&mut rng, reservation, setup.always_usage);
    let queued = options.timeout(Duration::from_micros(rng.u64(0..4_000)));
    let request = LlmRequest::new();
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
            // Gives up after a few executor turns: the acquire future is dropped wherever
            // it is (counted as aborted if it was waiting).
            let acquire = bulkhead.acquire(&request, queued);
            match select(pin!(acquire), pin!(yields(rng.usize(0..6)))).await {
                Either::Left((result, _)) => result.map(AnyPermit::Borrowed),
                Either::Right(_) => return,
            }
        }
        _ => return run_call(bulkhead, queued, reservation, plan, &mut rng, shared, setup).await,
    };
    let mut permit = match acquired {
        Ok(permit) => permit,
        Err(error) => return shared.tally.refused(error),
    };
    shared.tally.admitted.fetch_add(1, Ordering::Relaxed);
    shared.ledger.enter();
    assert_eq!(permit.reservation(), Some(reservation));
    let mut model = Model::new(reservation);
    for k in 0..plan.reports {
        yields(rng.usize(0..3)).await;
        let (usage, progressive) = plan.report(&mut rng, k, reservation.max_output());
        report_step(&mut permit, &mut model, usage, progressive, &shared.tally);
    }
    yields(rng.usize(0..3)).await;
    shared.ledger.leave();
    settle(permit, model, &plan, &shared.tally);
}

/// A call through `run_with_usage`: reports through the `RunContext`; settles with the
/// extracted usage, or (plain `run`, a failing callback, a cancelled run) the last reported.
async fn run_call(
    bulkhead: &LlmBulkhead,
    options: AcquireOptions,
    reservation: Reservation,
    plan: Plan,
    rng: &mut fastrand::Rng,
    shared: &Shared,
    setup: Setup,
) {
    // 0: plain run, 1: run_with_usage, 2: the callback fails, 3: the run is cancelled.
    let variant = if setup.always_usage {
        rng.u8(0..3)
    } else {
        rng.u8(0..4)
    };
    let (fails, cancelled) = (variant == 2, variant == 3);
    let explicit = if variant == 1 { plan.explicit() } else { None };
    let give_up_after = rng.usize(0..8);
    let mut run_rng = fastrand::Rng::with_seed(rng.u64(..));
    // The callback keeps its admission's model here after every step, so the model survives
    // a cancelled run.
    let cell: Mutex<Option<(AdmissionId, Model)>> = Mutex::new(None);
    let run = bulkhead.run_with_usage(
        &LlmRequest::new(),
        options,
        move |_: &()| explicit,
        async |mut ctx| {
            shared.tally.admitted.fetch_add(1, Ordering::Relaxed);
            assert_eq!(ctx.reservation(), Some(reservation));
            let mut model = Model::new(reservation);
            *cell.lock().unwrap() = Some((ctx.admission_id().expect("admitted"), model));
            // A cancelled run settles when its future is dropped, with no chance to leave the
            // ledger first: it stays out of it (the ledger stays a lower bound).
            if !cancelled {
                shared.ledger.enter();
            }
            for k in 0..plan.reports {
                yields(run_rng.usize(0..3)).await;
                let (usage, progressive) = plan.report(&mut run_rng, k, reservation.max_output());
                report_step(&mut ctx, &mut model, usage, progressive, &shared.tally);
                cell.lock().unwrap().as_mut().unwrap().1 = model;
            }
            yields(run_rng.usize(0..3)).await;
            if !cancelled {
                shared.ledger.leave();
            }
            if fails { Err(()) } else { Ok(()) }
        },
    );
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
            return shared.tally.refused_for(rejection.reason());
        }
        Some(Err(RunError::Invalid(error))) => panic!("valid input refused: {error}"),
        Some(Err(RunError::BorrowedConcurrencyDeadline(cut))) => {
            panic!("no deadline was set, yet: {cut}")
        }
        Some(Err(other)) => panic!("an error this test does not know: {other:?}"),
        None => {} // cancelled while acquiring or while the callback ran
    }
    let Some((id, mut model)) = cell.into_inner().unwrap() else {
        return; // cancelled before admission (counted as aborted)
    };
    let settled = model.settle(explicit);
    shared.tally.settled(id, &model, settled);
}

use crate::kit::runtimes::Task;

/// Runs the scenario with `spawn` (which returns a future that completes with the task).
pub(crate) async fn scenario(setup: Setup, spawn: impl Fn(Task) -> Task) {
    let bulkhead = new_bulkhead();
    let (shared, _subscription) = Shared::new(&bulkhead, setup);
    let (workers, calls) = (WORKERS, 2_000 * scale());
    let callers = workers * calls;
    // Each task keeps its panic in `shared` and completes, whatever the runtime does with a
    // panicking task; the scenario re-raises it once every task is done.
    let guarded = |task: Task| -> Task {
        let shared = Arc::clone(&shared);
        spawn(Box::pin(async move {
            if let Err(panic) = AssertUnwindSafe(task).catch_unwind().await {
                shared.keep(panic);
            }
        }))
    };
    let plane = guarded(Box::pin(control_plane(
        bulkhead.clone(),
        Arc::clone(&shared),
        setup,
        callers,
    )));
    let tasks: Vec<_> = (0..workers)
        .map(|w| {
            guarded(Box::pin(worker(
                bulkhead.clone(),
                Arc::clone(&shared),
                setup,
                setup.seed * 1_000_003 + w * calls,
                calls,
            )))
        })
        .collect();
    futures::future::join_all(tasks).await;
    plane.await;
    shared.rethrow();
    assert!(bulkhead.drain_timeout(Duration::ZERO).await.drained);
    shared.verify(&bulkhead, callers, setup);
}
