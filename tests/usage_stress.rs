//! Usage-reconciliation stress on real runtimes (tokio multi-thread and current-thread, smol,
//! async-std, a futures thread pool) and on blocked threads: many callers acquire
//! (`try_acquire`, queued `acquire` with timeouts, `run`), stream cumulative usage reports
//! (plain and progressive, stale ones, refused ones, holds rising above the reservation and
//! falling below it), and settle by releasing with or without usage, by dropping the permit or
//! by cancelling a `run`, while a control plane changes the limits and the budget (and, in
//! some runs, closes the bulkhead halfway and drains it) and a listener subscribed to every
//! event checks and tallies them (some runs have no listener, which takes other paths).
//!
//! Every caller keeps its own model of its admission (the hold rules and the booking split of
//! `src/usage.rs`, written here independently) and checks each report and each release against
//! it. A ledger of holders, kept by the callers themselves, checks the concurrency ceiling
//! during the run. At the end everything must be back and every book must balance: the
//! bulkhead's counters against the callers' sums, the listener's per-admission traces (usage
//! events, sum of their `delta_tokens`, the release) against the callers' own, and
//! `reserved + overrun == consumed + refunded` over the admissions settled with usage.
//!
//! Two focused tests check that an overrun hold really blocks admissions until it is released.
//!
//! `STRESS_SCALE` (default 1) multiplies the number of callers, e.g. `STRESS_SCALE=100`.

mod common;

use std::any::Any;
use std::collections::HashMap;
use std::future::{Future, poll_fn};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::task::Poll;
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, AdmissionId, Event, Limits, LlmBulkhead, LlmRequest, Permit,
    Priority, Progressive, RejectReason, Reservation, RunError, Subscription, TokenBudget,
    TokenUsage, UsageError, Verdict,
};
use common::{AnyPermit, Model, Reporter, Settled};
use futures::FutureExt;
use futures::future::{Either, select};

fn scale() -> u64 {
    std::env::var("STRESS_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1)
}

/// Yields to the executor once, whatever the runtime.
async fn yield_now() {
    let mut yielded = false;
    poll_fn(|cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await
}

async fn yields(n: usize) {
    for _ in 0..n {
        yield_now().await;
    }
}

fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).expect("usage fits in u64")
}

fn with(reservation: Reservation) -> AcquireOptions {
    AcquireOptions::new().reservation(reservation)
}

/// Slots of the bulkheads whose concurrency limit never changes.
const SLOTS: u32 = 4;
/// The largest `max_concurrent` the varying control plane ever applies.
const PEAK_SLOTS: u32 = 6;
/// Concurrent callers of the async scenarios (a few per slot).
const WORKERS: u64 = 10;

// ------------------------------------------------------------------------------------------
// The callers' own model of one admission.
// ------------------------------------------------------------------------------------------

// `Model` (the hold rules and the booking split) lives in `tests/common/mod.rs`.

/// What the listener should have heard of one admission, from admit to release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Trace {
    reserved: u64,
    usage_events: u64,
    /// Sum of the usage events' `delta_tokens`.
    delta_sum: i128,
    held_at_release: u64,
    refunded_at_release: u64,
    usage: Option<TokenUsage>,
}

/// How a caller's call goes, decided up front.
#[derive(Clone, Copy, Debug)]
struct Plan {
    /// Actual prompt tokens (may exceed the estimate).
    input: u64,
    /// Final output tokens (may exceed the reservation's cap: an overrun).
    output: u64,
    reports: u64,
    /// The last report is the complete usage, plain (so the usage is known at settlement).
    closing: bool,
    finish: Finish,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Finish {
    /// `release(Some(usage))`.
    Explicit(TokenUsage),
    /// `release(None)`: the last reported usage, if any.
    Last,
    /// Dropped without release.
    Drop,
}

impl Plan {
    fn new(rng: &mut fastrand::Rng, reservation: Reservation, always_usage: bool) -> Plan {
        let input = rng.u64(0..=reservation.input() * 3 / 2 + 10);
        let cap = reservation.max_output();
        let output = if rng.u8(0..4) == 0 {
            cap + rng.u64(1..400)
        } else {
            rng.u64(0..=cap)
        };
        let reports = if always_usage {
            rng.u64(1..6)
        } else {
            rng.u64(0..6)
        };
        let finish = match rng.u8(0..3) {
            // Sometimes the final usage is below what was reported (settled as given).
            0 if rng.u8(0..6) == 0 => {
                Finish::Explicit(usage(rng.u64(0..=input), rng.u64(0..=output)))
            }
            0 => Finish::Explicit(usage(input, output)),
            1 => Finish::Last,
            _ => Finish::Drop,
        };
        Plan {
            input,
            output,
            reports,
            closing: always_usage,
            finish,
        }
    }

    fn explicit(&self) -> Option<TokenUsage> {
        match self.finish {
            Finish::Explicit(u) => Some(u),
            _ => None,
        }
    }

    /// The `k`th of `self.reports` cumulative reports.
    fn report(
        &self,
        rng: &mut fastrand::Rng,
        k: u64,
        cap: u64,
    ) -> (TokenUsage, Option<Progressive>) {
        if self.closing && k + 1 == self.reports {
            return (usage(self.input, self.output), None);
        }
        let so_far = self.output * (k + 1) / self.reports;
        let (input, output) = match rng.u8(0..8) {
            // Stale (or partly stale): changes nothing unless the hold rule does.
            0 => (rng.u64(0..=self.input), so_far / 2),
            // The prompt not fully counted yet.
            1 if k == 0 => (rng.u64(0..=self.input), so_far),
            _ => (self.input, so_far),
        };
        let remaining = match rng.u8(0..10) {
            0..=4 => None,
            // Refused: above the cap.
            5 => Some(cap + 1 + rng.u64(0..10)),
            // Arbitrary: may raise the hold again (re-held below the reservation).
            6 | 7 => Some(rng.u64(0..=cap)),
            // Authoritative.
            _ => Some(cap.saturating_sub(output)),
        };
        let progressive =
            remaining.map(|remaining| Progressive::new(remaining).safety_margin(rng.u64(0..64)));
        (usage(input, output), progressive)
    }
}

// ------------------------------------------------------------------------------------------
// Shared tallies: the callers' sums, their ledger of holders, and the listener's books.
// ------------------------------------------------------------------------------------------

/// Sums the callers keep, compared with the bulkhead's statistics at the end.
#[derive(Default)]
struct Tally {
    admitted: AtomicU64,
    /// Reports whose returned sequence increased.
    effective_reports: AtomicU64,
    reserved: AtomicU64,
    /// Reservations of admissions settled without any usage (they book nothing).
    unused_reserved: AtomicU64,
    consumed: AtomicU64,
    overrun: AtomicU64,
    refunded: AtomicU64,
    reheld: AtomicU64,
    refused: AtomicU64,
    /// Callers that finished.
    done: AtomicU64,
    traces: Mutex<HashMap<AdmissionId, Trace>>,
}

impl Tally {
    fn refused(&self, error: AcquireError) {
        match error {
            AcquireError::Rejected(rejection) => self.refused_for(rejection.reason()),
            AcquireError::Invalid(error) => panic!("valid input refused: {error}"),
        }
    }

    fn refused_for(&self, reason: RejectReason) {
        match reason {
            RejectReason::BudgetLimit
            | RejectReason::ConcurrencyLimit
            | RejectReason::QueueLimit
            | RejectReason::Timeout
            | RejectReason::Shutdown => {
                self.refused.fetch_add(1, Ordering::Relaxed);
            }
            other => panic!("unexpected refusal {other}"),
        }
    }

    /// Books a settled admission (the model already includes the settlement's move).
    fn settled(&self, id: AdmissionId, model: &Model, settled: Settled) {
        let r = model.reserved();
        self.reserved.fetch_add(r, Ordering::Relaxed);
        match settled.usage {
            Some(u) => self.consumed.fetch_add(u.total(), Ordering::Relaxed),
            None => self.unused_reserved.fetch_add(r, Ordering::Relaxed),
        };
        self.overrun.fetch_add(model.overrun, Ordering::Relaxed);
        self.refunded.fetch_add(model.refunded, Ordering::Relaxed);
        self.reheld.fetch_add(model.reheld, Ordering::Relaxed);
        let trace = Trace {
            reserved: r,
            usage_events: model.sequence,
            delta_sum: i128::from(settled.held) - i128::from(r),
            held_at_release: settled.held,
            refunded_at_release: settled.refunded,
            usage: settled.usage,
        };
        let previous = self.traces.lock().unwrap().insert(id, trace);
        assert!(previous.is_none(), "admission id {id} settled twice");
    }
}

/// Admitted callers holding their permit, counted by the callers themselves: a caller counts
/// itself after it was admitted and uncounts itself before it settles, so the ledger never
/// exceeds what the bulkhead really holds.
struct Ledger {
    holders: AtomicU64,
    ceiling: u64,
    peak: AtomicU64,
}

impl Ledger {
    fn new(ceiling: u32) -> Ledger {
        Ledger {
            holders: AtomicU64::new(0),
            ceiling: u64::from(ceiling),
            peak: AtomicU64::new(0),
        }
    }

    fn enter(&self) {
        let holders = self.holders.fetch_add(1, Ordering::AcqRel) + 1;
        self.peak.fetch_max(holders, Ordering::Relaxed);
        assert!(
            holders <= self.ceiling,
            "{holders} holders at once, max_concurrent {}",
            self.ceiling
        );
    }

    fn leave(&self) {
        self.holders.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What the listener heard, checked as it arrives.
#[derive(Default)]
struct Heard {
    admits: AtomicU64,
    usages: AtomicU64,
    releases: AtomicU64,
    rejects: AtomicU64,
    reconfigures: AtomicU64,
    books: Mutex<Books>,
}

#[derive(Default)]
struct Books {
    open: HashMap<AdmissionId, Open>,
    closed: HashMap<AdmissionId, Trace>,
    /// Inconsistencies seen (a panic in a listener would only be counted, not reported).
    errors: Vec<String>,
}

impl Books {
    fn error(&mut self, message: String) {
        if self.errors.len() < 20 {
            self.errors.push(message);
        }
    }
}

/// An admission between its admit and release events.
struct Open {
    revision: u64,
    reserved: u64,
    held: u64,
    sequence: u64,
    delta_sum: i128,
}

impl Heard {
    fn hear(&self, event: &Event<'_>) {
        match event {
            Event::Admit(e) => {
                self.admits.fetch_add(1, Ordering::Relaxed);
                let mut books = self.books.lock().unwrap();
                let open = Open {
                    revision: e.limit_revision,
                    reserved: e.reserved_tokens,
                    held: e.reserved_tokens,
                    sequence: 0,
                    delta_sum: 0,
                };
                let id = e.admission_id;
                if books.open.insert(id, open).is_some() || books.closed.contains_key(&id) {
                    books.error(format!("admission id {id} admitted twice"));
                }
            }
            Event::Usage(e) => {
                self.usages.fetch_add(1, Ordering::Relaxed);
                let mut books = self.books.lock().unwrap();
                let id = e.admission_id;
                let Some(open) = books.open.get_mut(&id) else {
                    books.error(format!("usage event of {id} outside its admission"));
                    return;
                };
                let expected = (
                    open.sequence + 1,
                    open.held,
                    i128::from(e.held_tokens) - i128::from(open.held),
                    open.reserved,
                    open.revision,
                );
                let seen = (
                    e.sequence,
                    e.previous_held_tokens,
                    e.delta_tokens,
                    e.reserved_tokens,
                    e.limit_revision,
                );
                open.sequence = e.sequence;
                open.held = e.held_tokens;
                open.delta_sum += e.delta_tokens;
                if seen != expected {
                    books.error(format!(
                        "usage event of {id}: (sequence, previous held, delta, reserved, revision) \
                         {seen:?}, expected {expected:?}"
                    ));
                }
            }
            Event::Release(e) => {
                self.releases.fetch_add(1, Ordering::Relaxed);
                let mut books = self.books.lock().unwrap();
                let id = e.admission_id;
                let Some(open) = books.open.remove(&id) else {
                    books.error(format!("release event of {id} outside its admission"));
                    return;
                };
                let expected = (open.held, open.sequence, open.reserved, open.revision);
                let seen = (
                    e.held_tokens,
                    e.usage_sequence,
                    e.reserved_tokens,
                    e.limit_revision,
                );
                if seen != expected {
                    books.error(format!(
                        "release event of {id}: (held, usage sequence, reserved, revision) \
                         {seen:?}, expected {expected:?}"
                    ));
                }
                if i128::from(open.reserved) + open.delta_sum != i128::from(e.held_tokens) {
                    books.error(format!(
                        "release event of {id}: reserved {} + usage deltas {} != held {}",
                        open.reserved, open.delta_sum, e.held_tokens
                    ));
                }
                let trace = Trace {
                    reserved: e.reserved_tokens,
                    usage_events: e.usage_sequence,
                    delta_sum: open.delta_sum,
                    held_at_release: e.held_tokens,
                    refunded_at_release: e.refunded_tokens,
                    usage: e.usage,
                };
                books.closed.insert(id, trace);
            }
            Event::Reject(_) => {
                self.rejects.fetch_add(1, Ordering::Relaxed);
            }
            Event::Reconfigure(_) => {
                self.reconfigures.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }
}

/// Everything the callers of one scenario share.
struct Shared {
    tally: Tally,
    ledger: Ledger,
    heard: Arc<Heard>,
    /// The first panic of a caller or of the control plane, re-raised once the others have
    /// stopped: a failed check ends the run instead of leaving the control plane waiting for
    /// callers that will never finish (or a runtime swallowing the panic).
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Shared {
    /// The shared tallies and, if the setup listens, a listener subscribed to every event of
    /// `bulkhead`.
    fn new(bulkhead: &LlmBulkhead, setup: Setup) -> (Arc<Shared>, Option<Subscription>) {
        let heard = Arc::new(Heard::default());
        let listener = Arc::clone(&heard);
        let subscription = setup
            .listen
            .then(|| bulkhead.on(move |event| listener.hear(event)));
        let shared = Shared {
            tally: Tally::default(),
            ledger: Ledger::new(setup.ceiling()),
            heard,
            panic: Mutex::new(None),
        };
        (Arc::new(shared), subscription)
    }

    /// Runs `f`, keeping its panic (the first one) for [`rethrow`](Shared::rethrow).
    fn guard(&self, f: impl FnOnce()) {
        if let Err(panic) = catch_unwind(AssertUnwindSafe(f)) {
            self.keep(panic);
        }
    }

    fn keep(&self, panic: Box<dyn Any + Send>) {
        let mut kept = self.panic.lock().unwrap_or_else(PoisonError::into_inner);
        kept.get_or_insert(panic);
    }

    fn rethrow(&self) {
        let kept = self
            .panic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(panic) = kept {
            resume_unwind(panic);
        }
    }

    /// Whether the control plane keeps changing the limits: until enough calls are done, or
    /// something failed.
    fn plane_continues(&self, setup: Setup, callers: u64) -> bool {
        let failed = self
            .panic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some();
        !failed && self.tally.done.load(Ordering::Acquire) < setup.plane_stops_after(callers)
    }

    /// The end-of-run invariants, once every caller finished and nothing is in flight.
    fn verify(&self, bulkhead: &LlmBulkhead, callers: u64, setup: Setup) {
        let (tally, heard) = (&self.tally, &self.heard);
        let stats = bulkhead.stats();
        let tokens = stats.token_budget.unwrap();
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);

        // Everything is back.
        assert_eq!(
            (stats.in_flight, stats.pending, tokens.in_flight_tokens),
            (0, 0, 0),
            "{stats:?}"
        );
        assert_eq!(load(&self.ledger.holders), 0);
        assert!(load(&self.ledger.peak) <= self.ledger.ceiling);

        // Every caller decided exactly once; every admission settled exactly once.
        let admitted = load(&tally.admitted);
        assert_eq!(stats.admitted, admitted, "admissions the callers saw");
        assert_eq!(stats.released, stats.admitted);
        assert_eq!(stats.admitted + stats.rejected, callers);
        assert!(stats.rejected >= load(&tally.refused));
        assert_eq!(stats.listener_panics, 0);
        assert_eq!(stats.closed, setup.closes);
        if !setup.closes {
            assert_eq!(stats.rejected_by_reason.shutdown, 0);
        }

        // The listener heard every admission, report and release, consistently.
        if setup.listen {
            let books = heard.books.lock().unwrap();
            assert!(books.errors.is_empty(), "{:#?}", books.errors);
            assert!(
                books.open.is_empty(),
                "{} admissions never released",
                books.open.len()
            );
            assert_eq!(load(&heard.admits), admitted, "admit events");
            assert_eq!(load(&heard.releases), admitted, "release events");
            assert_eq!(
                load(&heard.usages),
                load(&tally.effective_reports),
                "usage events == effective reports"
            );
            assert_eq!(load(&heard.rejects), stats.rejected, "reject events");
            let traces = tally.traces.lock().unwrap();
            assert_eq!(books.closed.len(), traces.len());
            for (id, expected) in traces.iter() {
                assert_eq!(
                    books.closed.get(id),
                    Some(expected),
                    "admission {id}: heard vs. modelled"
                );
            }
        }

        // The token books, against the callers' models...
        let unused = load(&tally.unused_reserved);
        assert_eq!(tokens.total_reserved, load(&tally.reserved), "reserved");
        assert_eq!(tokens.total_consumed, load(&tally.consumed), "consumed");
        assert_eq!(tokens.total_overrun, load(&tally.overrun), "overrun");
        assert_eq!(
            tokens.total_refunded,
            load(&tally.refunded) - load(&tally.reheld),
            "refunded (net of re-holds)"
        );
        // ...and the identity over the admissions settled with usage.
        if setup.always_usage {
            assert_eq!(unused, 0, "every admission settled with usage");
        }
        assert_eq!(
            tokens.total_reserved - unused + tokens.total_overrun,
            tokens.total_consumed + tokens.total_refunded,
            "reserved + overrun == consumed + refunded ({unused} reserved by admissions \
             settled without usage left out): {tokens:?}"
        );

        // The run did what it was meant to (not a vacuous pass).
        assert!(admitted > 0 && load(&tally.effective_reports) > 0);
        assert!(tokens.total_overrun > 0 && tokens.total_refunded > 0);
        assert!(!setup.listen || load(&heard.reconfigures) > 0);
    }
}

// ------------------------------------------------------------------------------------------
// Permits and reports.
// ------------------------------------------------------------------------------------------

/// One report through `reporter`, checked against (and applied to) the model.
fn report_step(
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
fn settle(permit: AnyPermit<'_>, mut model: Model, plan: &Plan, tally: &Tally) {
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

// ------------------------------------------------------------------------------------------
// Async callers and control plane.
// ------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
struct Setup {
    seed: u64,
    /// Every admission settles with usage (the plain identity must hold).
    always_usage: bool,
    /// The control plane also changes `max_concurrent` (the ledger's ceiling is then the
    /// largest limit ever applied).
    varying_slots: bool,
    /// A listener subscribed to every event (without one, no event is built, no admission is
    /// timed, and a permit dropped without usage takes the release fast path).
    listen: bool,
    /// The control plane closes the bulkhead once half the calls are done, with calls still
    /// streaming usage, and checks that `drain()` resolves with every token back.
    closes: bool,
}

impl Setup {
    /// Fixed `max_concurrent`, some admissions settled without usage, a listener.
    const fn new(seed: u64) -> Setup {
        Setup {
            seed,
            always_usage: false,
            varying_slots: false,
            listen: true,
            closes: false,
        }
    }

    const fn always_usage(mut self) -> Setup {
        self.always_usage = true;
        self
    }

    const fn varying_slots(mut self) -> Setup {
        self.varying_slots = true;
        self
    }

    const fn unobserved(mut self) -> Setup {
        self.listen = false;
        self
    }

    const fn closes(mut self) -> Setup {
        self.closes = true;
        self
    }

    /// The calls after which the control plane stops (closing the bulkhead if it closes).
    fn plane_stops_after(&self, callers: u64) -> u64 {
        if self.closes { callers / 2 } else { callers }
    }

    fn ceiling(&self) -> u32 {
        if self.varying_slots {
            PEAK_SLOTS
        } else {
            SLOTS
        }
    }
}

fn new_bulkhead() -> LlmBulkhead {
    LlmBulkhead::builder("m", SLOTS)
        .max_queue(6)
        .token_budget(TokenBudget::new(3_000).high_priority_reserve(300))
        .build()
        .unwrap()
}

/// One change of limits; checks the slots in flight against the fixed limit first.
fn reconfigure(bulkhead: &LlmBulkhead, rng: &mut fastrand::Rng, setup: Setup) {
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
fn assert_idle_after_close(bulkhead: &LlmBulkhead) {
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
            *cell.lock().unwrap() = Some((ctx.admission_id(), model));
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
        None => {} // cancelled while acquiring or while the callback ran
    }
    let Some((id, mut model)) = cell.into_inner().unwrap() else {
        return; // cancelled before admission (counted as aborted)
    };
    let settled = model.settle(explicit);
    shared.tally.settled(id, &model, settled);
}

type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Runs the scenario with `spawn` (which returns a future that completes with the task).
async fn scenario(setup: Setup, spawn: impl Fn(Task) -> Task) {
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

fn tokio_spawn(task: Task) -> Task {
    let handle = tokio::spawn(task);
    Box::pin(async move { handle.await.unwrap() })
}

#[test]
fn tokio_multi_thread() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .build()
        .unwrap();
    for setup in [
        Setup::new(0),
        Setup::new(1).always_usage(),
        Setup::new(2).varying_slots(),
        Setup::new(3).unobserved(),
        Setup::new(4).closes(),
    ] {
        runtime.block_on(scenario(setup, tokio_spawn));
    }
}

#[test]
fn tokio_current_thread() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let setup = Setup::new(10);
    runtime.block_on(scenario(setup, tokio_spawn));
}

#[test]
fn smol_executor() {
    for setup in [Setup::new(20), Setup::new(21).always_usage()] {
        smol::block_on(scenario(setup, |task| Box::pin(smol::spawn(task))));
    }
}

#[test]
fn async_std_executor() {
    let setup = Setup::new(30).varying_slots();
    async_std::task::block_on(scenario(setup, |task| {
        Box::pin(async_std::task::spawn(task))
    }));
}

#[test]
fn futures_block_on_with_a_thread_pool() {
    let pool = futures::executor::ThreadPool::builder()
        .pool_size(6)
        .create()
        .unwrap();
    let setup = Setup::new(40).always_usage();
    futures::executor::block_on(scenario(setup, |task| {
        let (remote, handle) = futures::FutureExt::remote_handle(task);
        pool.spawn_ok(remote);
        Box::pin(handle)
    }));
}

// ------------------------------------------------------------------------------------------
// Blocked threads.
// ------------------------------------------------------------------------------------------

/// A short pause between reports: nothing, a yield, or a spin.
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

fn blocking_call(bulkhead: &LlmBulkhead, shared: &Shared, setup: Setup, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let (reservation, options) = random_call(&mut rng);
    let plan = Plan::new(&mut rng, reservation, setup.always_usage);
    let queued = options.timeout(Duration::from_micros(rng.u64(0..3_000)));
    let request = LlmRequest::new();
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
        Err(error) => return shared.tally.refused(error),
    };
    shared.tally.admitted.fetch_add(1, Ordering::Relaxed);
    shared.ledger.enter();
    assert_eq!(permit.reservation(), Some(reservation));
    let mut model = Model::new(reservation);
    for k in 0..plan.reports {
        pause(&mut rng);
        let (usage, progressive) = plan.report(&mut rng, k, reservation.max_output());
        report_step(&mut permit, &mut model, usage, progressive, &shared.tally);
    }
    pause(&mut rng);
    shared.ledger.leave();
    if rng.u8(0..8) == 0 {
        // Settled on a fresh thread: its bookings land in another statistics shard, which the
        // next thread adopts when this one exits.
        std::thread::scope(|s| {
            s.spawn(|| settle(permit, model, &plan, &shared.tally));
        });
    } else {
        settle(permit, model, &plan, &shared.tally);
    }
}

/// Blocked threads (`acquire_blocking`, `try_acquire`) instead of tasks: the same invariants.
#[test]
fn blocking_threads() {
    for setup in [
        Setup::new(50).always_usage(),
        Setup::new(51).varying_slots(),
        Setup::new(52).unobserved(),
        Setup::new(53).closes().always_usage(),
    ] {
        let bulkhead = new_bulkhead();
        let (shared, _subscription) = Shared::new(&bulkhead, setup);
        let threads = 8u64;
        let per_thread = 1_000 * scale();
        let callers = threads * per_thread;
        std::thread::scope(|s| {
            for t in 0..threads {
                let (bulkhead, shared) = (&bulkhead, &shared);
                s.spawn(move || {
                    shared.guard(|| {
                        for i in 0..per_thread {
                            let seed = setup.seed * 1_000_003 + t * per_thread + i;
                            blocking_call(bulkhead, shared, setup, seed);
                            shared.tally.done.fetch_add(1, Ordering::AcqRel);
                        }
                    });
                });
            }
            s.spawn(|| {
                let mut rng = fastrand::Rng::with_seed(setup.seed);
                shared.guard(|| {
                    while shared.plane_continues(setup, callers) {
                        reconfigure(&bulkhead, &mut rng, setup);
                        std::thread::sleep(Duration::from_micros(rng.u64(50..500)));
                    }
                    if setup.closes {
                        assert!(bulkhead.close());
                        futures::executor::block_on(bulkhead.drain());
                        assert_idle_after_close(&bulkhead);
                    }
                });
            });
        });
        shared.rethrow();
        assert!(futures::executor::block_on(bulkhead.drain_timeout(Duration::ZERO)).drained);
        shared.verify(&bulkhead, callers, setup);
    }
}

// ------------------------------------------------------------------------------------------
// An overrun hold blocks admissions.
// ------------------------------------------------------------------------------------------

/// A barrier that gives up (panics) after a while, so that a participant that failed fails the
/// test instead of leaving the others waiting forever.
struct Rendezvous {
    parties: usize,
    /// (arrived, generation)
    state: Mutex<(usize, u64)>,
    turn: Condvar,
}

impl Rendezvous {
    fn new(parties: usize) -> Rendezvous {
        Rendezvous {
            parties,
            state: Mutex::new((0, 0)),
            turn: Condvar::new(),
        }
    }

    fn wait(&self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let generation = state.1;
        state.0 += 1;
        if state.0 == self.parties {
            *state = (0, generation + 1);
            self.turn.notify_all();
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while state.1 == generation {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "a participant never arrived (did it fail?)"
            );
            state = self
                .turn
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// Checks that a call needing `reservation` is refused for its tokens right now, in every way
/// of asking; returns how many refusals the bulkhead counted.
fn assert_refused_for_tokens(
    bulkhead: &LlmBulkhead,
    reservation: Reservation,
    priority: Priority,
    in_flight_tokens: u64,
) -> u64 {
    let options = with(reservation).priority(priority);
    let request = LlmRequest::new();
    let check = |result: Result<(), AcquireError>| {
        let error = result.expect_err("refused while the holds exceed the budget");
        let rejection = error.rejection().expect("a capacity refusal");
        assert_eq!(rejection.reason(), RejectReason::BudgetLimit, "{rejection}");
        let detail = rejection.detail().token_budget.unwrap();
        assert_eq!(
            (detail.in_flight_tokens, detail.requested),
            (in_flight_tokens, reservation.reserved())
        );
    };
    check(bulkhead.try_acquire(&request, options).map(drop));
    check(bulkhead.try_acquire_owned(&request, options).map(drop));
    // A token shortage never makes a call wait, even one that may queue.
    let queued = options.timeout(Duration::from_secs(30));
    check(bulkhead.acquire_blocking(&request, queued).map(drop));
    assert_eq!(
        bulkhead.would_admit(&request, options).unwrap(),
        Verdict::Reject(RejectReason::BudgetLimit)
    );
    3
}

/// Admits `reservation`-sized calls of `priority` until the first refusal (which must be for
/// tokens); returns the permits.
fn fill<'a>(
    bulkhead: &'a LlmBulkhead,
    reservation: Reservation,
    priority: Priority,
    refusals: &AtomicU64,
) -> Vec<Permit<'a>> {
    let mut permits = Vec::new();
    loop {
        match bulkhead.try_acquire(&LlmRequest::new(), with(reservation).priority(priority)) {
            Ok(permit) => permits.push(permit),
            Err(error) => {
                let reason = error.rejection().unwrap().reason();
                assert_eq!(reason, RejectReason::BudgetLimit);
                refusals.fetch_add(1, Ordering::Relaxed);
                return permits;
            }
        }
    }
}

/// Threads hold permits whose usage runs past their reservations, pushing the tokens in flight
/// above the budget; meanwhile other threads hammer the bulkhead and every call needing budget
/// is refused `budget_limit` (even a zero-token one, even a high-priority one, even one that
/// may queue). A progressive report then refunds most of the holds and exactly what fits is
/// admitted; after the holders release, the whole budget is admitted again.
#[test]
fn overrun_holds_block_admissions_until_released() {
    const HOLDERS: usize = 3;
    const HAMMERS: usize = 4;
    let bulkhead = LlmBulkhead::builder("m", 64)
        .max_queue(16)
        .token_budget(TokenBudget::new(1_000).high_priority_reserve(100))
        .build()
        .unwrap();
    // 3 x 300 = 900: the normal-priority budget, exactly.
    let held = Reservation::new(100, 200).unwrap();
    let hundred = Reservation::new(20, 80).unwrap();
    let holders: Vec<Permit<'_>> = (0..HOLDERS)
        .map(|_| {
            bulkhead
                .try_acquire(&LlmRequest::new(), with(held))
                .unwrap()
        })
        .collect();
    let refusals = AtomicU64::new(0);
    let admitted_in_phase = [AtomicU64::new(0), AtomicU64::new(0)];
    let barrier = Rendezvous::new(HOLDERS + HAMMERS);
    let tokens_in_flight = || bulkhead.stats().token_budget.unwrap().in_flight_tokens;

    std::thread::scope(|s| {
        for mut permit in holders {
            let barrier = &barrier;
            s.spawn(move || {
                // Phase 1: the output runs 150 past the reservation: hold 100 + 350 = 450.
                let report = permit.report_usage(usage(100, 350)).unwrap();
                assert_eq!((report.held, report.sequence), (450, 1));
                assert!(report.over_reservation);
                barrier.wait(); // (1) every hold is above the budget: 1350 in flight
                barrier.wait(); // (2) the hammers were refused
                // Phase 2: nothing more to come: only the 150 above the cap stays held.
                let progress = Progressive::new(0);
                let report = permit
                    .report_usage_progressive(usage(100, 350), progress)
                    .unwrap();
                assert_eq!((report.held, report.sequence), (150, 2));
                barrier.wait(); // (3) refunded: 450 in flight
                barrier.wait(); // (4) the hammers filled what the refunds freed
                // Phase 3: settle with the final usage (450, above the hold of 150).
                let report = permit.release(Some(usage(100, 350)));
                assert_eq!(
                    (
                        report.held_tokens,
                        report.refunded_tokens,
                        report.overrun_tokens
                    ),
                    (150, 0, 150)
                );
                barrier.wait(); // (5) every holder released
                barrier.wait(); // (6) the hammers filled the whole budget
                barrier.wait(); // (7) ...and that was checked
            });
        }
        for h in 0..HAMMERS {
            let (bulkhead, barrier, refusals) = (&bulkhead, &barrier, &refusals);
            let (admitted_in_phase, tokens_in_flight) = (&admitted_in_phase, &tokens_in_flight);
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(h as u64);
                barrier.wait(); // (1)
                assert_eq!(tokens_in_flight(), 1_350);
                for _ in 0..50 {
                    let reservation = match rng.u8(0..4) {
                        0 => Reservation::new(0, 0).unwrap(),
                        _ => Reservation::new(rng.u64(0..50), rng.u64(1..50)).unwrap(),
                    };
                    let priority = if rng.bool() {
                        Priority::High
                    } else {
                        Priority::Normal
                    };
                    let counted = assert_refused_for_tokens(bulkhead, reservation, priority, 1_350);
                    refusals.fetch_add(counted, Ordering::Relaxed);
                }
                assert_eq!(bulkhead.stats().pending, 0, "nothing queued for tokens");
                barrier.wait(); // (2)
                barrier.wait(); // (3)
                // The refunds are available at once: 450 in flight leaves 450 of the normal
                // budget and 550 of the whole one. Whatever the interleaving of normal and high
                // calls, 100-token admissions stop at 950 in flight: 5 of them.
                let mut permits = fill(bulkhead, hundred, Priority::Normal, refusals);
                permits.extend(fill(bulkhead, hundred, Priority::High, refusals));
                admitted_in_phase[0].fetch_add(permits.len() as u64, Ordering::Relaxed);
                barrier.wait(); // (4)
                for permit in permits {
                    assert_eq!(permit.release(Some(usage(20, 80))).refunded_tokens, 0);
                }
                barrier.wait(); // (5)
                // Everything released: the whole budget is admitted again, 10 x 100 tokens.
                let mut permits = fill(bulkhead, hundred, Priority::Normal, refusals);
                permits.extend(fill(bulkhead, hundred, Priority::High, refusals));
                admitted_in_phase[1].fetch_add(permits.len() as u64, Ordering::Relaxed);
                barrier.wait(); // (6)
                if h == 0 {
                    assert_eq!(tokens_in_flight(), 1_000);
                }
                barrier.wait(); // (7)
                for permit in permits {
                    permit.release(Some(usage(20, 80)));
                }
            });
        }
    });

    assert_eq!(admitted_in_phase[0].load(Ordering::Relaxed), 5);
    assert_eq!(admitted_in_phase[1].load(Ordering::Relaxed), 10);
    let stats = bulkhead.stats();
    let tokens = stats.token_budget.unwrap();
    assert_eq!((stats.in_flight, tokens.in_flight_tokens), (0, 0));
    assert_eq!(stats.admitted, HOLDERS as u64 + 15);
    assert_eq!(stats.released, stats.admitted);
    assert_eq!(
        stats.rejected_by_reason.budget_limit,
        refusals.load(Ordering::Relaxed)
    );
    assert_eq!(stats.rejected, stats.rejected_by_reason.budget_limit);
    // Each holder: +150 above the reservation, -300 refunded, then +150 re-held and +150 above
    // the reservation again at settlement.
    assert_eq!(tokens.total_overrun, HOLDERS as u64 * 300);
    assert_eq!(tokens.total_refunded, HOLDERS as u64 * 150);
    assert_eq!(tokens.total_consumed, HOLDERS as u64 * 450 + 15 * 100);
    assert_eq!(
        tokens.total_reserved + tokens.total_overrun,
        tokens.total_consumed + tokens.total_refunded
    );
}

/// The same inside `run`: while a callback's reported usage holds more than the budget, calls
/// from other tasks are refused for tokens; once the run settles, all of them get in.
#[test]
fn an_overrun_inside_run_blocks_admissions_until_the_run_settles() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .build()
        .unwrap();
    runtime.block_on(async {
        let bulkhead = LlmBulkhead::builder("m", 8)
            .max_queue(64)
            .token_budget(TokenBudget::new(1_000))
            .build()
            .unwrap();
        let (overran, overran_rx) = tokio::sync::oneshot::channel();
        let (finish, finish_rx) = tokio::sync::oneshot::channel::<()>();
        let runner = tokio::spawn({
            let bulkhead = bulkhead.clone();
            async move {
                let options = with(Reservation::new(100, 400).unwrap());
                bulkhead
                    .run(&LlmRequest::new(), options, async |mut ctx| {
                        // 100 + 950: 550 past the reservation, 50 past the whole budget.
                        let report = ctx.report_usage(usage(100, 950))?;
                        assert_eq!(report.held, 1_050);
                        overran.send(()).unwrap();
                        finish_rx.await.unwrap();
                        Ok::<_, UsageError>(())
                    })
                    .await
                    .unwrap();
            }
        });
        overran_rx.await.unwrap();
        let probes: Vec<_> = (0..16u64)
            .map(|i| {
                let bulkhead = bulkhead.clone();
                tokio::spawn(async move {
                    let mut rng = fastrand::Rng::with_seed(i);
                    for _ in 0..20 {
                        let reservation = Reservation::new(rng.u64(0..20), rng.u64(0..20)).unwrap();
                        let options = with(reservation).timeout(Duration::from_secs(30));
                        let result = bulkhead.acquire(&LlmRequest::new(), options).await;
                        let reason = result.unwrap_err().rejection().unwrap().reason();
                        assert_eq!(reason, RejectReason::BudgetLimit);
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        for probe in probes {
            probe.await.unwrap();
        }
        assert_eq!(bulkhead.stats().rejected_by_reason.budget_limit, 16 * 20);
        finish.send(()).unwrap();
        runner.await.unwrap();
        // Settled with the reported usage: the overrun is gone, everyone gets in (8 at a time,
        // the rest waiting in the queue for a slot).
        let callers: Vec<_> = (0..40u64)
            .map(|i| {
                let bulkhead = bulkhead.clone();
                tokio::spawn(async move {
                    let options =
                        with(Reservation::new(10, 90).unwrap()).timeout(Duration::from_secs(30));
                    let mut permit = bulkhead.acquire(&LlmRequest::new(), options).await.unwrap();
                    permit.report_usage(usage(10, i)).unwrap();
                    tokio::task::yield_now().await;
                    permit.release(None);
                })
            })
            .collect();
        for caller in callers {
            caller.await.unwrap();
        }
        let stats = bulkhead.stats();
        let tokens = stats.token_budget.unwrap();
        assert_eq!((stats.in_flight, tokens.in_flight_tokens), (0, 0));
        assert_eq!((stats.admitted, stats.released), (41, 41));
        assert_eq!(tokens.total_overrun, 550);
        assert_eq!(
            tokens.total_consumed,
            1_050 + 40 * 10 + (0..40).sum::<u64>()
        );
        assert_eq!(
            tokens.total_reserved + tokens.total_overrun,
            tokens.total_consumed + tokens.total_refunded
        );
    });
}
