//! Behavioural tests of streaming usage reconciliation (reports, progressive reports, settlement
//! with the last reported usage), of the token books they keep, and of typed lifecycle events
//! (payloads, order, subscription handling, re-entrancy, panics, admission timing).
//!
//! Figures come from the upstream behaviour reference (`upstream-behavior.md` §4.3, §4.4, §4.5,
//! §11, §12) as adapted by RUST-DESIGN §4:
//!
//! - Q3: reported usage always reaches `total_consumed`, even when the hold is 0;
//! - Q4: every move of a hold, and the settlement (which moves the hold to the final usage), is
//!   split at the reservation `r`: tokens added above `r` are *overrun*, tokens removed are
//!   *refunded*, tokens added back below `r` are *re-held* and taken off the refunds. So for every
//!   admission settled with usage, `reserved + overrun == consumed + refunded`;
//! - Q15: reporting after release cannot compile (covered by a `compile_fail` doctest).
//!
//! Unless said otherwise an admission reserves the fixed override input 100 / max output 1000,
//! so `r = 1100`, on a bulkhead whose limits start at revision [`REV`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::thread;
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, AdaptiveEstimator, AdmitEvent, ApplyOutcome, Correction, Event,
    EventKind, Limits, LimitsError, LlmBulkhead, LlmRequest, MAX_BUDGET, ModelAwareEstimator,
    OwnedPermit, Permit, Priority, Progressive, ReconfigureEvent, RejectEvent, RejectReason,
    Rejection, ReleaseEvent, ReleaseReport, Reservation, RunError, Stats, Subscription,
    TokenBudget, TokenBudgetStats, TokenUsage, UsageError, UsageEvent, UsageReport,
};
use futures::executor::block_on;

// ===== helpers =====

/// Revision of the limits every test bulkhead starts with (so a revision of 0 proves nothing).
const REV: u64 = 7;
/// The fixed reservation: estimated input, maximum output, and their sum `r`.
const R_INPUT: u64 = 100;
const R_OUTPUT: u64 = 1000;
const R: u64 = R_INPUT + R_OUTPUT;
/// How long to wait for another thread before declaring a hang (only bounds failures).
const PATIENCE: Duration = Duration::from_secs(20);

fn res(input: u64, max_output: u64) -> Reservation {
    Reservation::new(input, max_output).expect("reservation fits in u64")
}

/// Normal-priority options reserving `input + max_output`.
fn opts(input: u64, max_output: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(res(input, max_output))
}

/// Normal-priority options with the fixed reservation (100 + 1000).
fn fixed() -> AcquireOptions {
    opts(R_INPUT, R_OUTPUT)
}

fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).expect("usage fits in u64")
}

fn progressive(remaining: u64, margin: u64) -> Progressive {
    Progressive::new(remaining).safety_margin(margin)
}

fn req() -> LlmRequest {
    LlmRequest::new()
}

/// A bulkhead with a token budget (no reserve, no queue), limits at revision [`REV`].
fn budgeted(max_concurrent: u32, budget: u64) -> LlmBulkhead {
    LlmBulkhead::builder("test-model", max_concurrent)
        .initial_revision(REV)
        .token_budget(TokenBudget::new(budget))
        .build()
        .expect("valid configuration")
}

/// A bulkhead without a token budget, limits at revision [`REV`].
fn plain(max_concurrent: u32) -> LlmBulkhead {
    LlmBulkhead::builder("test-model", max_concurrent)
        .initial_revision(REV)
        .build()
        .expect("valid configuration")
}

fn tokens(bulkhead: &LlmBulkhead) -> TokenBudgetStats {
    bulkhead
        .stats()
        .token_budget
        .expect("bulkhead has a token budget")
}

/// `(total_reserved, total_consumed, total_refunded, total_overrun)`.
fn totals(t: &TokenBudgetStats) -> (u64, u64, u64, u64) {
    (
        t.total_reserved,
        t.total_consumed,
        t.total_refunded,
        t.total_overrun,
    )
}

/// `(in_flight_tokens, available)`.
fn live(t: &TokenBudgetStats) -> (u64, u64) {
    (t.in_flight_tokens, t.available)
}

/// Q4's identity for admissions that all settled with usage.
fn assert_identity(t: &TokenBudgetStats) {
    assert_eq!(
        t.total_reserved + t.total_overrun,
        t.total_consumed + t.total_refunded,
        "reserved + overrun == consumed + refunded: {t:?}"
    );
}

/// `(sequence, reserved, held, consumed, output_cap, output_remaining, over_reservation)`.
type ReportFigures = (u64, u64, u64, u64, Option<u64>, Option<u64>, bool);

fn figures(r: &UsageReport) -> ReportFigures {
    (
        r.sequence,
        r.reserved,
        r.held,
        r.consumed,
        r.output_cap,
        r.output_remaining,
        r.over_reservation,
    )
}

/// `(held_tokens, refunded_tokens, overrun_tokens, usage)` of a release report.
fn settled(r: &ReleaseReport) -> (u64, u64, u64, Option<TokenUsage>) {
    (r.held_tokens, r.refunded_tokens, r.overrun_tokens, r.usage)
}

/// `(sequence, reserved, previous_held, held, delta)` of a usage event.
fn moved(e: &UsageEvent) -> (u64, u64, u64, u64, i128) {
    (
        e.sequence,
        e.reserved_tokens,
        e.previous_held_tokens,
        e.held_tokens,
        e.delta_tokens,
    )
}

/// `(usage, output_cap, output_remaining, over_reservation, progressive)` of a usage event.
fn usage_state(
    e: &UsageEvent,
) -> (
    TokenUsage,
    Option<u64>,
    Option<u64>,
    bool,
    Option<Progressive>,
) {
    (
        e.usage,
        e.output_cap,
        e.output_remaining,
        e.over_reservation,
        e.progressive,
    )
}

/// `(reserved, held, refunded, usage_sequence, usage)` of a release event.
fn release_figures(e: &ReleaseEvent) -> (u64, u64, u64, u64, Option<TokenUsage>) {
    (
        e.reserved_tokens,
        e.held_tokens,
        e.refunded_tokens,
        e.usage_sequence,
        e.usage,
    )
}

fn rejection<T: fmt::Debug>(result: Result<T, AcquireError>) -> Rejection {
    match result {
        Err(AcquireError::Rejected(rejection)) => rejection,
        other => panic!("expected a capacity rejection, got {other:?}"),
    }
}

/// An event as a listener saw it, owned.
#[derive(Clone, Debug, PartialEq)]
enum Seen {
    Admit(AdmitEvent),
    Reject(RejectEvent),
    Usage(UsageEvent),
    Release(ReleaseEvent),
    Reconfigure(ReconfigureEvent),
    Other(EventKind),
}

impl Seen {
    fn of(event: &Event<'_>) -> Seen {
        match event {
            Event::Admit(e) => Seen::Admit(**e),
            Event::Reject(e) => Seen::Reject(**e),
            Event::Usage(e) => Seen::Usage(**e),
            Event::Release(e) => Seen::Release(**e),
            Event::Reconfigure(e) => Seen::Reconfigure(**e),
            other => Seen::Other(other.kind()),
        }
    }

    fn kind(&self) -> EventKind {
        match self {
            Seen::Admit(_) => EventKind::Admit,
            Seen::Reject(_) => EventKind::Reject,
            Seen::Usage(_) => EventKind::Usage,
            Seen::Release(_) => EventKind::Release,
            Seen::Reconfigure(_) => EventKind::Reconfigure,
            Seen::Other(kind) => *kind,
        }
    }
}

/// Records the events of one subscription.
struct Recorder {
    seen: Arc<Mutex<Vec<Seen>>>,
    _subscription: Subscription,
}

impl Recorder {
    /// Listens to every kind.
    fn all(bulkhead: &LlmBulkhead) -> Recorder {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        let subscription = bulkhead.on(move |event| log.lock().unwrap().push(Seen::of(event)));
        Recorder {
            seen,
            _subscription: subscription,
        }
    }

    /// Listens to `kinds` only.
    fn only(bulkhead: &LlmBulkhead, kinds: &[EventKind]) -> Recorder {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        let subscription = bulkhead.on_events(kinds.iter().copied(), move |event| {
            log.lock().unwrap().push(Seen::of(event))
        });
        Recorder {
            seen,
            _subscription: subscription,
        }
    }

    /// Everything seen since the last call.
    fn take(&self) -> Vec<Seen> {
        std::mem::take(&mut *self.seen.lock().unwrap())
    }

    /// The kinds seen since the last call.
    fn take_kinds(&self) -> Vec<EventKind> {
        self.take().iter().map(Seen::kind).collect()
    }

    /// The single event seen since the last call.
    fn take_one(&self) -> Seen {
        let mut seen = self.take();
        assert_eq!(seen.len(), 1, "expected exactly one event: {seen:?}");
        seen.pop().unwrap()
    }
}

fn one_usage(recorder: &Recorder) -> UsageEvent {
    match recorder.take_one() {
        Seen::Usage(e) => e,
        other => panic!("expected a usage event, got {other:?}"),
    }
}

fn one_release(recorder: &Recorder) -> ReleaseEvent {
    match recorder.take_one() {
        Seen::Release(e) => e,
        other => panic!("expected a release event, got {other:?}"),
    }
}

fn one_admit(recorder: &Recorder) -> AdmitEvent {
    match recorder.take_one() {
        Seen::Admit(e) => e,
        other => panic!("expected an admit event, got {other:?}"),
    }
}

fn one_reject(recorder: &Recorder) -> RejectEvent {
    match recorder.take_one() {
        Seen::Reject(e) => e,
        other => panic!("expected a reject event, got {other:?}"),
    }
}

fn one_reconfigure(recorder: &Recorder) -> ReconfigureEvent {
    match recorder.take_one() {
        Seen::Reconfigure(e) => e,
        other => panic!("expected a reconfigure event, got {other:?}"),
    }
}

/// Runs `f` on its own thread and fails (instead of hanging) if it does not finish in time.
fn within_patience(what: &str, f: impl FnOnce() + Send + 'static) {
    let (done, finished) = mpsc::channel();
    let worker = thread::spawn(move || {
        f();
        let _ = done.send(());
    });
    match finished.recv_timeout(PATIENCE) {
        Ok(()) => worker.join().expect("worker finished"),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            // The worker panicked: surface its panic.
            if let Err(panic) = worker.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: still running after {PATIENCE:?} (deadlock?)")
        }
    }
}

/// Polls `fut` once with a no-op waker.
fn poll_once<F: Future + Unpin>(fut: &mut F) -> Poll<F::Output> {
    let waker = futures::task::noop_waker();
    Pin::new(fut).poll(&mut Context::from_waker(&waker))
}

// ===== §4.3 worked examples, exactly =====

#[test]
fn report_below_the_reservation_refunds_the_unused_input_at_once() {
    // §4.3: report {20, 5} -> hold 20 + max(1000, 5) = 1020, refund 80.
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage, EventKind::Release]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    assert_eq!(permit.held_tokens(), R);
    assert_eq!(live(&tokens(&bulkhead)), (1100, 3900));

    let report = permit.report_usage(usage(20, 5)).unwrap();
    assert_eq!(
        figures(&report),
        (1, 1100, 1020, 25, Some(1000), Some(995), false)
    );
    assert_eq!(report.admission_id, permit.admission_id());
    assert_eq!(report.limit_revision, REV);
    assert_eq!(permit.held_tokens(), 1020);
    let t = tokens(&bulkhead);
    assert_eq!(live(&t), (1020, 3980));
    // Nothing is consumed until settlement; the refund is booked now.
    assert_eq!(totals(&t), (1100, 0, 80, 0));

    let e = one_usage(&events);
    assert_eq!(moved(&e), (1, 1100, 1100, 1020, -80));
    assert_eq!(
        usage_state(&e),
        (usage(20, 5), Some(1000), Some(995), false, None)
    );
    assert_eq!(
        (e.admission_id, e.limit_revision, e.priority),
        (permit.admission_id(), REV, Priority::Normal)
    );

    // Released without usage: settled with the last reported usage (25 consumed), and the
    // rest of the hold (1020 - 25) refunded at release.
    let id = permit.admission_id();
    let report = permit.release(None);
    assert_eq!(settled(&report), (1020, 995, 0, Some(usage(20, 5))));
    let t = tokens(&bulkhead);
    assert_eq!(live(&t), (0, 5000));
    assert_eq!(totals(&t), (1100, 25, 1075, 0));
    assert_identity(&t);
    let e = one_release(&events);
    assert_eq!(
        release_figures(&e),
        (1100, 1020, 995, 1, Some(usage(20, 5)))
    );
    assert_eq!((e.admission_id, e.limit_revision), (id, REV));
}

#[test]
fn report_beyond_the_reservation_expands_the_hold_as_overrun() {
    // §4.3: report {100, 1400} -> hold 100 + 1400 = 1500, overrun 400, over the reservation.
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let report = permit.report_usage(usage(100, 1400)).unwrap();
    assert_eq!(
        figures(&report),
        (1, 1100, 1500, 1500, Some(1000), Some(0), true)
    );
    let t = tokens(&bulkhead);
    assert_eq!(live(&t), (1500, 3500));
    assert_eq!(totals(&t), (1100, 0, 0, 400));
    let e = one_usage(&events);
    assert_eq!(moved(&e), (1, 1100, 1100, 1500, 400));
    assert_eq!(
        usage_state(&e),
        (usage(100, 1400), Some(1000), Some(0), true, None)
    );

    let report = permit.release(None);
    assert_eq!(settled(&report), (1500, 0, 0, Some(usage(100, 1400))));
    let t = tokens(&bulkhead);
    assert_eq!(live(&t), (0, 5000));
    assert_eq!(totals(&t), (1100, 1500, 0, 400));
    assert_identity(&t);
}

#[test]
fn progressive_reports_stop_holding_processed_input_and_generated_output() {
    // §4.3: progressive {20, 100} rem 900 margin 50 -> 950 (refund 150); then {20, 400} rem 600
    // margin 50 -> 650 (sequence 2), cumulative refund 450.
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();

    let first = permit
        .report_usage_progressive(usage(20, 100), progressive(900, 50))
        .unwrap();
    assert_eq!(
        figures(&first),
        (1, 1100, 950, 120, Some(1000), Some(900), false)
    );
    let t = tokens(&bulkhead);
    assert_eq!(live(&t), (950, 4050));
    assert_eq!(totals(&t), (1100, 0, 150, 0));
    let e = one_usage(&events);
    assert_eq!(moved(&e), (1, 1100, 1100, 950, -150));
    assert_eq!(
        usage_state(&e),
        (
            usage(20, 100),
            Some(1000),
            Some(900),
            false,
            Some(progressive(900, 50))
        )
    );
    assert_eq!(e.progressive.unwrap().safety_margin_tokens, 50);

    let second = permit
        .report_usage_progressive(usage(20, 400), progressive(600, 50))
        .unwrap();
    assert_eq!(
        figures(&second),
        (2, 1100, 650, 420, Some(1000), Some(600), false)
    );
    let t = tokens(&bulkhead);
    assert_eq!(live(&t), (650, 4350));
    assert_eq!(totals(&t), (1100, 0, 450, 0));
    let e = one_usage(&events);
    assert_eq!(moved(&e), (2, 1100, 950, 650, -300));

    // Settled with {20, 400}: 420 consumed, 650 - 420 = 230 more refunded.
    let report = permit.release(None);
    assert_eq!(settled(&report), (650, 230, 0, Some(usage(20, 400))));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 420, 680, 0));
    assert_eq!(t.in_flight_tokens, 0);
    assert_identity(&t);
}

#[test]
fn a_progressive_hold_rising_back_below_the_reservation_is_re_held_not_overrun() {
    // §4.3: progressive {100, 1000} rem 0 margin 128 -> 128; then {100, 1200} rem 0 margin 100
    // -> 100 + 200 = 300. Q4: the rise 128 -> 300 stays below r = 1100, so it is re-held (taken
    // off the refunds), not overrun (upstream booked 172 of overrun here).
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage, EventKind::Release]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();

    let first = permit
        .report_usage_progressive(usage(100, 1000), progressive(0, 128))
        .unwrap();
    assert_eq!(
        figures(&first),
        (1, 1100, 128, 1100, Some(1000), Some(0), false)
    );
    let t = tokens(&bulkhead);
    assert_eq!(live(&t), (128, 4872));
    assert_eq!(totals(&t), (1100, 0, 972, 0));
    assert_eq!(moved(&one_usage(&events)), (1, 1100, 1100, 128, -972));

    let second = permit
        .report_usage_progressive(usage(100, 1200), progressive(0, 100))
        .unwrap();
    assert_eq!(
        figures(&second),
        (2, 1100, 300, 1300, Some(1000), Some(0), true)
    );
    let t = tokens(&bulkhead);
    assert_eq!(live(&t), (300, 4700));
    assert_eq!(
        t.total_overrun, 0,
        "a rise below the reservation is no overrun"
    );
    assert_eq!(t.total_refunded, 1100 - 300, "refunds are net of re-holds");
    let e = one_usage(&events);
    assert_eq!(moved(&e), (2, 1100, 128, 300, 172));
    assert_eq!(
        usage_state(&e),
        (
            usage(100, 1200),
            Some(1000),
            Some(0),
            true,
            Some(progressive(0, 100))
        )
    );

    // Settled with {100, 1200} = 1300 from a hold of 300: 800 re-held up to r, 200 above it.
    let report = permit.release(None);
    assert_eq!(settled(&report), (300, 0, 200, Some(usage(100, 1200))));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 1300, 0, 200));
    assert_eq!(t.in_flight_tokens, 0);
    assert_identity(&t);
    assert_eq!(
        release_figures(&one_release(&events)),
        (1100, 300, 0, 2, Some(usage(100, 1200)))
    );
}

#[test]
fn a_hold_crossing_the_reservation_splits_into_re_held_and_overrun() {
    // Q4: progressive to 900 (refund 200); a plain report of the same usage holds 20 + 1000 =
    // 1020 (120 re-held, no overrun); then {20, 1200} holds 1220: 80 re-held up to r and 120
    // above it (overrun).
    let bulkhead = budgeted(4, 5000);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let r = permit
        .report_usage_progressive(usage(20, 100), progressive(900, 0))
        .unwrap();
    assert_eq!((r.sequence, r.held), (1, 900));
    assert_eq!(totals(&tokens(&bulkhead)), (1100, 0, 200, 0));

    // Same usage, different hold: effective (sequence 2).
    let r = permit.report_usage(usage(20, 100)).unwrap();
    assert_eq!((r.sequence, r.held), (2, 1020));
    assert_eq!(totals(&tokens(&bulkhead)), (1100, 0, 80, 0));

    let r = permit.report_usage(usage(20, 1200)).unwrap();
    assert_eq!(
        figures(&r),
        (3, 1100, 1220, 1220, Some(1000), Some(0), true)
    );
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 0, 0, 120));
    assert_eq!(live(&t), (1220, 3780));

    let report = permit.release(None);
    assert_eq!(settled(&report), (1220, 0, 0, Some(usage(20, 1200))));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 1220, 0, 120));
    assert_identity(&t);
}

#[test]
fn a_progressive_hold_driven_to_zero_still_books_consumption() {
    // Q3: upstream drops the usage of an admission whose hold is 0 at release; the port books it.
    let bulkhead = budgeted(4, 5000);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let r = permit
        .report_usage_progressive(usage(100, 1000), progressive(0, 0))
        .unwrap();
    assert_eq!(figures(&r), (1, 1100, 0, 1100, Some(1000), Some(0), false));
    assert_eq!(live(&tokens(&bulkhead)), (0, 5000));
    let report = permit.release(None);
    assert_eq!(settled(&report), (0, 0, 0, Some(usage(100, 1000))));
    let t = tokens(&bulkhead);
    // Refunded 1100 by the report, then re-held 1100 by the final usage: net 0.
    assert_eq!(totals(&t), (1100, 1100, 0, 0));
    assert_identity(&t);
}

// ===== cumulative clamp, stale reports =====

#[test]
fn reports_are_clamped_per_field_and_stale_ones_change_nothing() {
    // §4.3 step 3: {50, 10} then {40, 20} -> reported {50, 20}.
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();

    let r = permit.report_usage(usage(50, 10)).unwrap();
    assert_eq!(
        figures(&r),
        (1, 1100, 1050, 60, Some(1000), Some(990), false)
    );
    assert_eq!(moved(&one_usage(&events)), (1, 1100, 1100, 1050, -50));

    // The output rose, the input did not: usage {50, 20}, same hold, still effective.
    let r = permit.report_usage(usage(40, 20)).unwrap();
    assert_eq!(
        figures(&r),
        (2, 1100, 1050, 70, Some(1000), Some(980), false)
    );
    let e = one_usage(&events);
    assert_eq!(moved(&e), (2, 1100, 1050, 1050, 0));
    assert_eq!(e.usage, usage(50, 20));

    let before = bulkhead.stats();
    // Duplicate, all-lower and mixed-lower reports: nothing changes, nothing is emitted.
    for stale in [usage(50, 20), usage(0, 0), usage(49, 19), usage(50, 0)] {
        let r = permit.report_usage(stale).unwrap();
        assert_eq!(
            figures(&r),
            (2, 1100, 1050, 70, Some(1000), Some(980), false),
            "{stale:?}"
        );
    }
    // A stale progressive report that implies the same hold is stale too.
    permit
        .report_usage_progressive(usage(50, 20), progressive(900, 0))
        .unwrap();
    let r = permit
        .report_usage_progressive(usage(10, 10), progressive(900, 0))
        .unwrap();
    assert_eq!(
        figures(&r),
        (3, 1100, 900, 70, Some(1000), Some(980), false)
    );
    let e = one_usage(&events);
    assert_eq!(moved(&e), (3, 1100, 1050, 900, -150));
    assert_eq!(e.usage, usage(50, 20));
    assert_eq!(permit.held_tokens(), 900);
    assert!(events.take().is_empty());
    let after = bulkhead.stats();
    assert_eq!(before.token_budget.unwrap().total_overrun, 0);
    assert_eq!(after.token_budget.unwrap().total_refunded, 200);

    // Settled with the clamped usage.
    let report = permit.release(None);
    assert_eq!(settled(&report), (900, 830, 0, Some(usage(50, 20))));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 70, 1030, 0));
    assert_identity(&t);
}

#[test]
fn a_stale_report_leaves_the_whole_stats_snapshot_unchanged() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    permit.report_usage(usage(30, 300)).unwrap();
    events.take();
    let before: Stats = bulkhead.stats();
    let r = permit.report_usage(usage(29, 300)).unwrap();
    assert_eq!((r.sequence, r.held, r.consumed), (1, 1030, 330));
    assert_eq!(bulkhead.stats(), before);
    assert!(events.take().is_empty());
}

// ===== refunds and overruns act on admission at once =====

#[test]
fn a_refund_admits_a_call_that_the_full_budget_refused() {
    let bulkhead = budgeted(8, 2200);
    let mut a = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let _b = bulkhead.try_acquire(&req(), fixed()).unwrap();
    assert_eq!(live(&tokens(&bulkhead)), (2200, 0));

    let refused = rejection(bulkhead.try_acquire(&req(), opts(0, 80)));
    assert_eq!(refused.reason(), RejectReason::BudgetLimit);
    let t = refused.detail().token_budget.unwrap();
    assert_eq!(
        (t.in_flight_tokens, t.available, t.requested),
        (2200, 0, 80)
    );

    // The prompt was 20 tokens, not 100: 80 tokens are back in the budget at once.
    a.report_usage(usage(20, 5)).unwrap();
    assert_eq!(live(&tokens(&bulkhead)), (2120, 80));
    let c = bulkhead.try_acquire(&req(), opts(0, 80)).unwrap();
    assert_eq!(live(&tokens(&bulkhead)), (2200, 0));
    // Exactly full again.
    let refused = rejection(bulkhead.try_acquire(&req(), opts(0, 1)));
    assert_eq!(refused.reason(), RejectReason::BudgetLimit);
    assert_eq!(bulkhead.stats().rejected_by_reason.budget_limit, 2);
    drop(c);
}

#[test]
fn an_overrun_refuses_a_call_that_fitted_until_the_overrunning_permit_is_released() {
    let bulkhead = budgeted(8, 3000);
    let mut a = bulkhead.try_acquire(&req(), fixed()).unwrap();
    // 1100 + 1900 = 3000: an exact fit.
    assert_eq!(
        bulkhead.would_admit(&req(), opts(0, 1900)).unwrap(),
        async_bulkhead_llm::Verdict::Admit
    );

    a.report_usage(usage(100, 1400)).unwrap();
    assert_eq!(live(&tokens(&bulkhead)), (1500, 1500));
    let refused = rejection(bulkhead.try_acquire(&req(), opts(0, 1900)));
    assert_eq!(refused.reason(), RejectReason::BudgetLimit);
    let t = refused.detail().token_budget.unwrap();
    assert_eq!(
        (t.budget, t.in_flight_tokens, t.available, t.requested),
        (3000, 1500, 1500, 1900)
    );
    // A later report cannot shrink the hold below the output already generated.
    a.report_usage(usage(100, 1200)).unwrap();
    assert_eq!(live(&tokens(&bulkhead)), (1500, 1500));
    assert_eq!(
        rejection(bulkhead.try_acquire(&req(), opts(0, 1900))).reason(),
        RejectReason::BudgetLimit
    );

    a.release(None);
    let b = bulkhead.try_acquire(&req(), opts(0, 1900)).unwrap();
    assert_eq!(b.held_tokens(), 1900);
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (3000, 1500, 0, 400));
}

// ===== settlement =====

#[test]
fn release_without_usage_settles_with_the_last_reported_usage() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Release]);
    let mut permit = bulkhead.try_acquire_owned(&req(), fixed()).unwrap();
    permit.report_usage(usage(20, 5)).unwrap();
    permit.report_usage(usage(20, 300)).unwrap();
    let report = permit.release(None);
    assert_eq!(settled(&report), (1020, 700, 0, Some(usage(20, 300))));
    assert_eq!(
        release_figures(&one_release(&events)),
        (1100, 1020, 700, 2, Some(usage(20, 300)))
    );
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 320, 780, 0));
    assert_identity(&t);
    assert_eq!((bulkhead.stats().released, t.in_flight_tokens), (1, 0));
}

#[test]
fn release_with_explicit_usage_overrides_the_reported_usage() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Release]);

    // Explicit usage above the reported one.
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    permit.report_usage(usage(20, 5)).unwrap();
    let report = permit.release(Some(usage(30, 40)));
    assert_eq!(settled(&report), (1020, 950, 0, Some(usage(30, 40))));
    assert_eq!(
        release_figures(&one_release(&events)),
        (1100, 1020, 950, 1, Some(usage(30, 40)))
    );
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 70, 1030, 0));
    assert_identity(&t);

    // Explicit usage below the reported one is taken as given (not clamped).
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    permit.report_usage(usage(20, 5)).unwrap();
    let report = permit.release(Some(usage(10, 1)));
    assert_eq!(settled(&report), (1020, 1009, 0, Some(usage(10, 1))));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (2200, 81, 2119, 0));
    assert_identity(&t);

    // Explicit usage beyond the reservation after a progressive drop: re-held, then overrun.
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    permit
        .report_usage_progressive(usage(100, 500), progressive(500, 0))
        .unwrap();
    let report = permit.release(Some(usage(100, 1500)));
    assert_eq!(settled(&report), (500, 0, 500, Some(usage(100, 1500))));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (3300, 1681, 2119, 500));
    assert_identity(&t);
    assert_eq!(t.in_flight_tokens, 0);
}

#[test]
fn dropping_a_permit_that_reported_books_the_last_reported_usage() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Release]);
    {
        let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
        permit.report_usage(usage(20, 5)).unwrap();
    }
    assert_eq!(
        release_figures(&one_release(&events)),
        (1100, 1020, 995, 1, Some(usage(20, 5)))
    );
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 25, 1075, 0));
    assert_eq!(t.in_flight_tokens, 0);

    // Owned, dropped on another thread, after a progressive report.
    let mut owned = bulkhead.try_acquire_owned(&req(), fixed()).unwrap();
    owned
        .report_usage_progressive(usage(10, 200), progressive(800, 10))
        .unwrap();
    thread::spawn(move || drop(owned)).join().unwrap();
    assert_eq!(
        release_figures(&one_release(&events)),
        (1100, 810, 600, 1, Some(usage(10, 200)))
    );
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (2200, 235, 1965, 0));
    assert_identity(&t);
    assert_eq!(bulkhead.stats().released, 2);
}

#[test]
fn dropping_or_releasing_a_permit_that_never_reported_books_nothing() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Release]);
    drop(bulkhead.try_acquire(&req(), fixed()).unwrap());
    assert_eq!(
        release_figures(&one_release(&events)),
        (1100, 1100, 0, 0, None)
    );
    let report = bulkhead.try_acquire(&req(), fixed()).unwrap().release(None);
    assert_eq!(settled(&report), (1100, 0, 0, None));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (2200, 0, 0, 0));
    assert_eq!(t.in_flight_tokens, 0);
}

#[test]
fn run_settles_with_the_usage_reported_through_its_context() {
    let bulkhead = budgeted(4, 5000);
    let held = block_on(bulkhead.run(&req(), fixed(), async |mut ctx| {
        let r = ctx.report_usage(usage(20, 5))?;
        assert_eq!(ctx.held_tokens(), 1020);
        let r2 = ctx.report_usage_progressive(usage(20, 50), progressive(950, 0))?;
        assert_eq!((r.sequence, r2.sequence), (1, 2));
        Ok::<_, UsageError>(r2.held)
    }))
    .unwrap();
    assert_eq!(held, 950);
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 70, 1030, 0));
    assert_eq!(t.in_flight_tokens, 0);

    // A failing callback also settles with what it reported.
    let failed = block_on(bulkhead.run(&req(), fixed(), async |mut ctx| {
        ctx.report_usage(usage(100, 1400)).unwrap();
        Err::<(), _>(std::io::Error::other("stream broke"))
    }));
    assert!(matches!(failed, Err(RunError::Failed(_))));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (2200, 1570, 1030, 400));
    assert_identity(&t);
    assert_eq!(t.in_flight_tokens, 0);
}

// ===== without a token budget =====

#[test]
fn without_a_budget_reports_are_recorded_but_hold_nothing() {
    let bulkhead = plain(2);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage, EventKind::Release]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    assert_eq!((permit.held_tokens(), permit.reservation()), (0, None));

    let r = permit.report_usage(usage(10, 20)).unwrap();
    assert_eq!(figures(&r), (1, 0, 0, 30, None, None, false));
    assert_eq!(r.limit_revision, REV);
    let e = one_usage(&events);
    assert_eq!(moved(&e), (1, 0, 0, 0, 0));
    assert_eq!(usage_state(&e), (usage(10, 20), None, None, false, None));

    // Duplicate: no change, no event.
    let r = permit.report_usage(usage(10, 20)).unwrap();
    assert_eq!(r.sequence, 1);
    assert!(events.take().is_empty());

    // Way beyond any cap: never over a reservation it does not have.
    let r = permit.report_usage(usage(10, 1_000_000)).unwrap();
    assert_eq!(figures(&r), (2, 0, 0, 1_000_010, None, None, false));
    assert_eq!(one_usage(&events).sequence, 2);

    // Progressive: no cap to check.
    let r = permit
        .report_usage_progressive(usage(10, 1_000_001), progressive(u64::MAX, 7))
        .unwrap();
    assert_eq!(figures(&r), (3, 0, 0, 1_000_011, None, None, false));
    let e = one_usage(&events);
    assert_eq!(moved(&e), (3, 0, 0, 0, 0));
    assert_eq!(e.progressive, Some(progressive(u64::MAX, 7)));
    // A progressive report whose usage did not change is stale (the hold stays 0).
    let r = permit
        .report_usage_progressive(usage(10, 1_000_001), progressive(5, 0))
        .unwrap();
    assert_eq!(r.sequence, 3);
    assert!(events.take().is_empty());

    let report = permit.release(None);
    assert_eq!(settled(&report), (0, 0, 0, Some(usage(10, 1_000_001))));
    assert_eq!(
        release_figures(&one_release(&events)),
        (0, 0, 0, 3, Some(usage(10, 1_000_001)))
    );
    let stats = bulkhead.stats();
    assert!(stats.token_budget.is_none());
    assert_eq!((stats.admitted, stats.released, stats.in_flight), (1, 1, 0));
}

// ===== errors change nothing =====

#[test]
fn remaining_above_the_output_cap_is_refused_and_changes_nothing() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    permit.report_usage(usage(20, 5)).unwrap();
    events.take();
    let before = bulkhead.stats();

    let err = permit
        .report_usage_progressive(usage(30, 50), progressive(1001, 0))
        .unwrap_err();
    assert_eq!(
        err,
        UsageError::RemainingExceedsCap {
            remaining: 1001,
            cap: 1000
        }
    );
    assert_eq!(permit.held_tokens(), 1020);
    assert_eq!(bulkhead.stats(), before);
    assert!(events.take().is_empty());
    // The usage of the refused report was not recorded: repeating the last good one is stale.
    let r = permit.report_usage(usage(20, 5)).unwrap();
    assert_eq!(
        figures(&r),
        (1, 1100, 1020, 25, Some(1000), Some(995), false)
    );
    assert!(events.take().is_empty());

    // At the cap exactly is fine.
    let r = permit
        .report_usage_progressive(usage(20, 5), progressive(1000, 0))
        .unwrap();
    assert_eq!((r.sequence, r.held), (2, 1000));
    drop(permit);
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 25, 1075, 0));
}

#[test]
fn overflowing_holds_are_refused_and_change_nothing() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    permit.report_usage(usage(20, 5)).unwrap();
    events.take();
    let before = bulkhead.stats();

    // Plain: input + max_output overflows.
    let huge_input = usage(u64::MAX - 500, 0);
    assert_eq!(
        permit.report_usage(huge_input).unwrap_err(),
        UsageError::HoldOverflow
    );
    // Progressive: remaining + margin overflows.
    assert_eq!(
        permit
            .report_usage_progressive(usage(20, 5), progressive(1000, u64::MAX))
            .unwrap_err(),
        UsageError::HoldOverflow
    );
    // Progressive: remaining + margin + output beyond the cap overflows.
    assert_eq!(
        permit
            .report_usage_progressive(usage(20, 1001), progressive(1000, u64::MAX - 1000))
            .unwrap_err(),
        UsageError::HoldOverflow
    );
    assert_eq!(permit.held_tokens(), 1020);
    assert_eq!(bulkhead.stats(), before);
    assert!(events.take().is_empty());
    let r = permit.report_usage(usage(20, 5)).unwrap();
    assert_eq!((r.sequence, r.held, r.consumed), (1, 1020, 25));
    assert!(events.take().is_empty());
}

#[test]
fn a_hold_that_would_overflow_the_tokens_in_flight_is_refused_and_changes_nothing() {
    // The word counts at most MAX_BUDGET tokens in flight (2^35 - 1).
    let bulkhead = budgeted(4, MAX_BUDGET);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage]);
    let _big = bulkhead
        .try_acquire(&req(), opts(0, MAX_BUDGET - 2000))
        .unwrap();
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    assert_eq!(tokens(&bulkhead).in_flight_tokens, MAX_BUDGET - 900);
    let before = bulkhead.stats();

    // 1100 -> 2100 needs 1000 more tokens in flight; only 900 more can be counted.
    assert_eq!(
        permit.report_usage(usage(100, 2000)).unwrap_err(),
        UsageError::HoldOverflow
    );
    assert_eq!(permit.held_tokens(), 1100);
    assert_eq!(bulkhead.stats(), before);
    assert!(events.take().is_empty());

    // 1100 -> 1900 fits.
    let r = permit.report_usage(usage(100, 1800)).unwrap();
    assert_eq!((r.sequence, r.held), (1, 1900));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, MAX_BUDGET - 100);
    assert_eq!(tokens(&bulkhead).total_overrun, 800);
}

#[test]
fn a_clamped_usage_whose_total_overflows_is_refused_and_changes_nothing() {
    let bulkhead = budgeted(4, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage]);
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    // Progressive to 0 keeps the hold small whatever the input.
    let r = permit
        .report_usage_progressive(usage(u64::MAX - 5, 0), progressive(0, 0))
        .unwrap();
    assert_eq!((r.sequence, r.held, r.consumed), (1, 0, u64::MAX - 5));
    events.take();
    let before = bulkhead.stats();

    // {0, 10} alone is fine, but clamped with the input so far its total overflows.
    let err = permit
        .report_usage_progressive(usage(0, 10), progressive(0, 0))
        .unwrap_err();
    assert_eq!(
        err,
        UsageError::TotalOverflow {
            input: u64::MAX - 5,
            output: 10
        }
    );
    assert_eq!(permit.report_usage(usage(0, 10)).unwrap_err(), err);
    assert_eq!(permit.held_tokens(), 0);
    assert_eq!(bulkhead.stats(), before);
    assert!(events.take().is_empty());
    let r = permit
        .report_usage_progressive(usage(1, 0), progressive(0, 0))
        .unwrap();
    assert_eq!((r.sequence, r.held, r.consumed), (1, 0, u64::MAX - 5));

    // Without a budget the clamp overflows the same way.
    let unbudgeted = plain(1);
    let mut permit = unbudgeted.try_acquire(&req(), fixed()).unwrap();
    permit.report_usage(usage(u64::MAX - 5, 0)).unwrap();
    assert_eq!(
        permit.report_usage(usage(0, 6)).unwrap_err(),
        UsageError::TotalOverflow {
            input: u64::MAX - 5,
            output: 6
        }
    );
    assert_eq!(permit.report_usage(usage(0, 5)).unwrap().sequence, 2);
}

// ===== the books balance whatever the path =====

/// A reference model of one admission's hold and of the books, straight from §4.3 and Q4.
#[derive(Clone, Copy, Debug)]
struct Model {
    input: u64,
    max_output: u64,
    held: u64,
    reported: Option<(u64, u64)>,
    sequence: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Books {
    reserved: u64,
    consumed: u64,
    overrun: u64,
    refunded_gross: u64,
    reheld: u64,
}

impl Books {
    /// Books the move of a hold from `old` to `new` for a reservation of `r`.
    fn book(&mut self, r: u64, old: u64, new: u64) {
        if new < old {
            self.refunded_gross += old - new;
        } else if new > old {
            // The part of [old, new) above r is overrun; the part below r is re-held.
            if new > r {
                self.overrun += new - old.max(r);
            }
            if old < r {
                self.reheld += new.min(r) - old;
            }
        }
    }

    fn add(&mut self, other: Books) {
        self.reserved += other.reserved;
        self.consumed += other.consumed;
        self.overrun += other.overrun;
        self.refunded_gross += other.refunded_gross;
        self.reheld += other.reheld;
    }

    /// `(total_reserved, total_consumed, total_refunded, total_overrun)` as stats show them.
    fn totals(&self) -> (u64, u64, u64, u64) {
        (
            self.reserved,
            self.consumed,
            self.refunded_gross - self.reheld,
            self.overrun,
        )
    }
}

impl Model {
    fn new(input: u64, max_output: u64) -> Model {
        Model {
            input,
            max_output,
            held: input + max_output,
            reported: None,
            sequence: 0,
        }
    }

    fn r(&self) -> u64 {
        self.input + self.max_output
    }

    /// Applies a report; returns what the `UsageReport` must say.
    fn report(&mut self, books: &mut Books, u: (u64, u64), p: Option<(u64, u64)>) -> ReportFigures {
        let reported = match self.reported {
            None => u,
            Some((i, o)) => (i.max(u.0), o.max(u.1)),
        };
        let hold = match p {
            None => reported.0 + self.max_output.max(reported.1),
            Some((remaining, margin)) => {
                remaining + margin + reported.1.saturating_sub(self.max_output)
            }
        };
        if Some(reported) != self.reported || hold != self.held {
            self.sequence += 1;
        }
        books.book(self.r(), self.held, hold);
        self.held = hold;
        self.reported = Some(reported);
        let consumed = reported.0 + reported.1;
        (
            self.sequence,
            self.r(),
            hold,
            consumed,
            Some(self.max_output),
            Some(self.max_output.saturating_sub(reported.1)),
            consumed > self.r(),
        )
    }

    /// Settles; returns what the `ReleaseReport` must say.
    fn settle(
        &self,
        books: &mut Books,
        explicit: Option<(u64, u64)>,
    ) -> (u64, u64, u64, Option<TokenUsage>) {
        let effective = explicit.or(self.reported).expect("settled with usage");
        let consumed = effective.0 + effective.1;
        let before = *books;
        books.consumed += consumed;
        books.book(self.r(), self.held, consumed);
        (
            self.held,
            books.refunded_gross - before.refunded_gross,
            books.overrun - before.overrun,
            Some(usage(effective.0, effective.1)),
        )
    }
}

/// A permit of either flavour.
enum Live<'a> {
    Borrowed(Permit<'a>),
    Owned(OwnedPermit),
}

impl Live<'_> {
    fn report(&mut self, u: TokenUsage, p: Option<Progressive>) -> UsageReport {
        match (self, p) {
            (Live::Borrowed(permit), None) => permit.report_usage(u),
            (Live::Borrowed(permit), Some(p)) => permit.report_usage_progressive(u, p),
            (Live::Owned(permit), None) => permit.report_usage(u),
            (Live::Owned(permit), Some(p)) => permit.report_usage_progressive(u, p),
        }
        .expect("a valid report")
    }

    fn held(&self) -> u64 {
        match self {
            Live::Borrowed(permit) => permit.held_tokens(),
            Live::Owned(permit) => permit.held_tokens(),
        }
    }

    fn release(self, u: Option<TokenUsage>) -> ReleaseReport {
        match self {
            Live::Borrowed(permit) => permit.release(u),
            Live::Owned(permit) => permit.release(u),
        }
    }
}

/// Runs `steps` random operations (admit, report plain or progressive with rising or falling
/// usage, settle by release with or without usage or by drop) on `bulkhead`, checking every
/// report and settlement against the model; settles everything at the end, always with some
/// usage known. Returns the books of this run. With `check_live`, also checks the tokens in
/// flight after every step (only valid while no other thread uses the bulkhead).
fn random_walk(bulkhead: &LlmBulkhead, seed: u64, steps: usize, check_live: bool) -> Books {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut books = Books::default();
    let mut open: Vec<(Live<'_>, Model)> = Vec::new();

    let settle =
        |books: &mut Books, rng: &mut fastrand::Rng, (permit, model): (Live<'_>, Model)| {
            let explicit = if model.reported.is_none() || rng.u8(..3) == 0 {
                Some((rng.u64(..600), rng.u64(..2500)))
            } else {
                None
            };
            let expected = model.settle(books, explicit);
            let report = if explicit.is_none() && rng.bool() {
                // Dropped: settles with the last reported usage, no report to check.
                drop(permit);
                return;
            } else {
                permit.release(explicit.map(|(i, o)| usage(i, o)))
            };
            assert_eq!(settled(&report), expected, "seed {seed}: {model:?}");
        };

    for _ in 0..steps {
        match rng.u8(..10) {
            0..=2 if open.len() < 8 => {
                let (input, max_output) = (rng.u64(..500), rng.u64(..2000));
                let permit = if rng.bool() {
                    Live::Borrowed(
                        bulkhead
                            .try_acquire(&req(), opts(input, max_output))
                            .unwrap(),
                    )
                } else {
                    Live::Owned(
                        bulkhead
                            .try_acquire_owned(&req(), opts(input, max_output))
                            .unwrap(),
                    )
                };
                books.reserved += input + max_output;
                open.push((permit, Model::new(input, max_output)));
            }
            3..=7 if !open.is_empty() => {
                let i = rng.usize(..open.len());
                let (permit, model) = &mut open[i];
                let (pi, po) = model.reported.unwrap_or((0, 0));
                // Mostly rising, sometimes falling (clamped), sometimes identical (stale).
                let u = match rng.u8(..4) {
                    0 => (rng.u64(..=pi), rng.u64(..=po)),
                    1 => (pi, po),
                    _ => (pi + rng.u64(..200), po + rng.u64(..700)),
                };
                let p = rng
                    .bool()
                    .then(|| (rng.u64(..=model.max_output), rng.u64(..300)));
                let expected = model.report(&mut books, u, p);
                let report = permit.report(usage(u.0, u.1), p.map(|(r, m)| progressive(r, m)));
                assert_eq!(figures(&report), expected, "seed {seed}: {u:?} {p:?}");
                assert_eq!(permit.held(), model.held);
            }
            8..=9 if !open.is_empty() => {
                let i = rng.usize(..open.len());
                settle(&mut books, &mut rng, open.swap_remove(i));
            }
            _ => {}
        }
        if check_live {
            let t = tokens(bulkhead);
            let held: u64 = open.iter().map(|(_, m)| m.held).sum();
            assert_eq!(t.in_flight_tokens, held, "seed {seed}");
            let (reserved, consumed, refunded, overrun) = books.totals();
            assert_eq!(
                totals(&t),
                (reserved, consumed, refunded, overrun),
                "seed {seed}"
            );
        }
    }
    while let Some(entry) = open.pop() {
        settle(&mut books, &mut rng, entry);
    }
    books
}

#[test]
fn the_books_balance_after_random_report_paths_on_one_thread() {
    for seed in 0..40 {
        let bulkhead = budgeted(64, 1_000_000_000);
        let books = random_walk(&bulkhead, seed, 300, true);
        let t = tokens(&bulkhead);
        assert_eq!(totals(&t), books.totals(), "seed {seed}");
        assert_eq!(t.in_flight_tokens, 0, "seed {seed}");
        assert_identity(&t);
        let stats = bulkhead.stats();
        assert_eq!(stats.admitted, stats.released);
        assert_eq!(stats.in_flight, 0);
    }
}

#[test]
fn the_books_balance_after_random_report_paths_on_several_threads() {
    let bulkhead = budgeted(256, 1_000_000_000);
    let all = thread::scope(|scope| {
        let workers: Vec<_> = (0..4u64)
            .map(|n| {
                let bulkhead = &bulkhead;
                scope.spawn(move || random_walk(bulkhead, 1000 + n, 400, false))
            })
            .collect();
        let mut all = Books::default();
        for worker in workers {
            all.add(worker.join().unwrap());
        }
        all
    });
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), all.totals());
    assert_eq!(t.in_flight_tokens, 0);
    assert_identity(&t);
}

#[test]
fn the_books_balance_for_scripted_paths_of_every_kind() {
    let bulkhead = budgeted(16, 100_000);
    // Plain, falling then rising above r, released without usage:
    // 1100 -> 1010 (refund 90) -> 1510 (re-hold 90, overrun 410) -> settled at 1510.
    let mut p = bulkhead.try_acquire(&req(), fixed()).unwrap();
    p.report_usage(usage(10, 0)).unwrap();
    assert_eq!(totals(&tokens(&bulkhead)), (1100, 0, 90, 0));
    p.report_usage(usage(10, 1500)).unwrap();
    assert_eq!(totals(&tokens(&bulkhead)), (1100, 0, 0, 410));
    assert_eq!(
        settled(&p.release(None)),
        (1510, 0, 0, Some(usage(10, 1500)))
    );
    assert_eq!(totals(&tokens(&bulkhead)), (1100, 1510, 0, 410));

    // Progressive, falling, rising above r, falling, released with larger explicit usage:
    // 1100 -> 1000 (refund 100) -> 1200 (re-hold 100, overrun 100) -> 100 (refund 1100)
    // -> settled at 2100 (re-hold 1000, overrun 1000). Tokens once held above r stay booked
    // as overrun even when a later report gives them back (then they are refunds too).
    let mut p = bulkhead.try_acquire_owned(&req(), fixed()).unwrap();
    p.report_usage_progressive(usage(100, 0), progressive(1000, 0))
        .unwrap();
    p.report_usage_progressive(usage(100, 100), progressive(900, 300))
        .unwrap();
    assert_eq!(totals(&tokens(&bulkhead)), (2200, 1510, 0, 510));
    p.report_usage_progressive(usage(100, 900), progressive(100, 0))
        .unwrap();
    assert_eq!(totals(&tokens(&bulkhead)), (2200, 1510, 1100, 510));
    let report = p.release(Some(usage(100, 2000)));
    assert_eq!(settled(&report), (100, 0, 1000, Some(usage(100, 2000))));
    assert_eq!(totals(&tokens(&bulkhead)), (2200, 3610, 100, 1510));

    // A zero reservation, mixed reports, dropped: 0 -> 7 (overrun 7) -> 4 (refund 3)
    // -> settled at 7 (overrun 3).
    let mut p = bulkhead.try_acquire(&req(), opts(0, 0)).unwrap();
    p.report_usage(usage(3, 4)).unwrap();
    p.report_usage_progressive(usage(3, 4), progressive(0, 0))
        .unwrap();
    assert_eq!(p.held_tokens(), 4);
    drop(p);
    assert_eq!(totals(&tokens(&bulkhead)), (2200, 3617, 103, 1520));

    // No reports, explicit usage equal to the reservation.
    bulkhead
        .try_acquire(&req(), fixed())
        .unwrap()
        .release(Some(usage(100, 1000)));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (3300, 4717, 103, 1520));
    assert_eq!(t.in_flight_tokens, 0);
    assert_identity(&t);
}

// ===== events: payloads =====

#[test]
fn admit_and_reject_events_carry_the_decision() {
    let bulkhead = budgeted(2, 5000);
    let events = Recorder::all(&bulkhead);

    let high = bulkhead
        .try_acquire(&req(), fixed().priority(Priority::High))
        .unwrap();
    let e = one_admit(&events);
    assert_eq!(
        (
            e.admission_id,
            e.limit_revision,
            e.priority,
            e.reserved_tokens
        ),
        (high.admission_id(), REV, Priority::High, 1100)
    );
    assert_eq!(e.queue_wait, Duration::ZERO);

    let normal = bulkhead.try_acquire_owned(&req(), opts(5, 7)).unwrap();
    let e = one_admit(&events);
    assert_eq!(
        (
            e.admission_id,
            e.limit_revision,
            e.priority,
            e.reserved_tokens
        ),
        (normal.admission_id(), REV, Priority::Normal, 12)
    );
    assert_ne!(normal.admission_id(), high.admission_id());

    // Out of slots.
    let refused = rejection(bulkhead.try_acquire(&req(), fixed()));
    let e = one_reject(&events);
    assert_eq!(
        (e.reason, e.limit_revision),
        (RejectReason::ConcurrencyLimit, REV)
    );
    assert_eq!(e.detail, *refused.detail());
    let d = e.detail;
    assert_eq!(
        (d.in_flight, d.max_concurrent, d.pending, d.max_queue),
        (2, 2, 0, 0)
    );
    assert_eq!(e.queue_wait, Duration::ZERO);

    // Out of tokens (checked before slots).
    let refused = rejection(bulkhead.try_acquire(&req(), opts(0, 4000)));
    let e = one_reject(&events);
    assert_eq!(
        (e.reason, e.limit_revision),
        (RejectReason::BudgetLimit, REV)
    );
    assert_eq!(e.detail, *refused.detail());
    let t = e.detail.token_budget.unwrap();
    assert_eq!(
        (
            t.budget,
            t.in_flight_tokens,
            t.effective_budget,
            t.available,
            t.requested
        ),
        (5000, 1112, 5000, 3888, 4000)
    );

    // The revision in events follows applied limits.
    bulkhead
        .apply_limits(Limits::new(REV + 1, 0).with_token_budget(5000, 0))
        .unwrap();
    assert_eq!(events.take_kinds(), [EventKind::Reconfigure]);
    rejection(bulkhead.try_acquire(&req(), opts(0, 1)));
    let e = one_reject(&events);
    assert_eq!(
        (e.reason, e.limit_revision),
        (RejectReason::ConcurrencyLimit, REV + 1)
    );
    drop((high, normal));
    assert_eq!(
        events.take_kinds(),
        [EventKind::Release, EventKind::Release]
    );

    // Closed.
    bulkhead.close();
    rejection(bulkhead.try_acquire(&req(), fixed()));
    assert_eq!(one_reject(&events).reason, RejectReason::Shutdown);
}

#[test]
fn admit_events_without_a_budget_reserve_zero_tokens() {
    let bulkhead = plain(1);
    let events = Recorder::only(&bulkhead, &[EventKind::Admit, EventKind::Release]);
    let permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let e = one_admit(&events);
    assert_eq!(
        (e.admission_id, e.reserved_tokens, e.limit_revision),
        (permit.admission_id(), 0, REV)
    );
    drop(permit);
    assert_eq!(release_figures(&one_release(&events)), (0, 0, 0, 0, None));
}

#[test]
fn usage_and_release_events_carry_ids_priority_and_revision() {
    let bulkhead = budgeted(2, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Usage, EventKind::Release]);
    let mut permit = bulkhead
        .try_acquire_owned(&req(), fixed().priority(Priority::High))
        .unwrap();
    // Limits applied after admission do not change what the admission's events say.
    bulkhead
        .apply_limits(Limits::new(REV + 5, 2).with_token_budget(6000, 0))
        .unwrap();
    let id = permit.admission_id();
    permit.report_usage(usage(20, 5)).unwrap();
    let e = one_usage(&events);
    assert_eq!(
        (e.admission_id, e.limit_revision, e.priority),
        (id, REV, Priority::High)
    );
    permit.release(Some(usage(20, 80)));
    let e = one_release(&events);
    assert_eq!(
        (e.admission_id, e.limit_revision, e.priority),
        (id, REV, Priority::High)
    );
    assert_eq!(
        release_figures(&e),
        (1100, 1020, 920, 1, Some(usage(20, 80)))
    );
}

#[test]
fn reconfigure_events_carry_previous_and_current_limits() {
    let bulkhead = budgeted(2, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Reconfigure]);
    let initial = Limits::new(REV, 2).with_token_budget(5000, 0);
    let next = Limits::new(REV + 1, 3)
        .with_max_queue(2)
        .with_token_budget(6000, 500);
    assert_eq!(
        bulkhead.apply_limits(next).unwrap(),
        ApplyOutcome::Applied {
            previous: initial,
            current: next
        }
    );
    let e = one_reconfigure(&events);
    assert_eq!((e.previous, e.current), (initial, next));

    let now = bulkhead.set_budget(7000).unwrap();
    assert_eq!(
        now,
        Limits::new(REV + 2, 3)
            .with_max_queue(2)
            .with_token_budget(7000, 500)
    );
    let e = one_reconfigure(&events);
    assert_eq!((e.previous, e.current), (next, now));

    // Stale and invalid snapshots apply nothing and emit nothing.
    assert!(!bulkhead.apply_limits(next).unwrap().is_applied());
    assert_eq!(
        bulkhead.apply_limits(Limits::new(REV + 9, 3)).unwrap_err(),
        LimitsError::TokenBudgetRequired
    );
    assert!(events.take().is_empty());
}

#[test]
fn events_of_a_run_come_in_order_admit_usage_release() {
    let bulkhead = budgeted(2, 5000);
    let events = Recorder::all(&bulkhead);
    let id = block_on(bulkhead.run(&req(), fixed(), async |mut ctx| {
        ctx.report_usage(usage(20, 5))?;
        ctx.report_usage(usage(20, 5))?; // stale: no event
        ctx.report_usage_progressive(usage(20, 105), progressive(900, 0))?;
        Ok::<_, UsageError>(ctx.admission_id())
    }))
    .unwrap();
    let seen = events.take();
    assert_eq!(
        seen.iter().map(Seen::kind).collect::<Vec<_>>(),
        [
            EventKind::Admit,
            EventKind::Usage,
            EventKind::Usage,
            EventKind::Release
        ]
    );
    match (&seen[0], &seen[1], &seen[2], &seen[3]) {
        (Seen::Admit(a), Seen::Usage(u1), Seen::Usage(u2), Seen::Release(r)) => {
            assert_eq!(
                [
                    a.admission_id,
                    u1.admission_id,
                    u2.admission_id,
                    r.admission_id
                ],
                [id; 4]
            );
            assert_eq!(moved(u1), (1, 1100, 1100, 1020, -80));
            assert_eq!(moved(u2), (2, 1100, 1020, 900, -120));
            assert_eq!(
                release_figures(r),
                (1100, 900, 775, 2, Some(usage(20, 105)))
            );
        }
        other => panic!("unexpected events {other:?}"),
    }

    // run_with_usage: the extracted usage wins at release.
    block_on(bulkhead.run_with_usage(
        &req(),
        fixed(),
        |n: &u64| TokenUsage::new(*n, 1).ok(),
        async |mut ctx| {
            ctx.report_usage(usage(20, 5)).unwrap();
            Ok::<u64, std::io::Error>(60)
        },
    ))
    .unwrap();
    let seen = events.take();
    assert_eq!(seen.len(), 3);
    match &seen[2] {
        Seen::Release(r) => {
            assert_eq!(release_figures(r), (1100, 1020, 959, 1, Some(usage(60, 1))))
        }
        other => panic!("expected the release last, got {other:?}"),
    }
}

// ===== events: subscriptions =====

#[test]
fn listeners_run_in_registration_order_and_unsubscribe_on_drop() {
    let bulkhead = budgeted(2, 5000);
    let order = Arc::new(Mutex::new(Vec::new()));
    let listener = |name: &'static str| {
        let order = Arc::clone(&order);
        move |event: &Event<'_>| order.lock().unwrap().push((name, event.kind()))
    };
    let a = bulkhead.on(listener("a"));
    let b = bulkhead.on(listener("b"));
    let c = bulkhead.on(listener("c"));
    drop(bulkhead.try_acquire(&req(), fixed()).unwrap());
    assert_eq!(
        std::mem::take(&mut *order.lock().unwrap()),
        [
            ("a", EventKind::Admit),
            ("b", EventKind::Admit),
            ("c", EventKind::Admit),
            ("a", EventKind::Release),
            ("b", EventKind::Release),
            ("c", EventKind::Release),
        ]
    );

    drop(b);
    let d = bulkhead.on(listener("d"));
    drop(bulkhead.try_acquire(&req(), fixed()).unwrap());
    assert_eq!(
        std::mem::take(&mut *order.lock().unwrap()),
        [
            ("a", EventKind::Admit),
            ("c", EventKind::Admit),
            ("d", EventKind::Admit),
            ("a", EventKind::Release),
            ("c", EventKind::Release),
            ("d", EventKind::Release),
        ]
    );

    drop((a, c, d));
    drop(bulkhead.try_acquire(&req(), fixed()).unwrap());
    rejection(bulkhead.try_acquire(&req(), opts(0, 9999)));
    assert!(order.lock().unwrap().is_empty());
}

#[test]
fn on_events_delivers_only_the_kinds_asked_for() {
    let bulkhead = budgeted(1, 5000);
    let usage_and_release = Recorder::only(&bulkhead, &[EventKind::Usage, EventKind::Release]);
    let rejects = Recorder::only(&bulkhead, &[EventKind::Reject]);
    let nothing = Recorder::only(&bulkhead, &[]);
    let everything = Recorder::all(&bulkhead);

    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    rejection(bulkhead.try_acquire(&req(), fixed()));
    permit.report_usage(usage(1, 1)).unwrap();
    drop(permit);
    bulkhead.set_budget(6000).unwrap();

    assert_eq!(
        usage_and_release.take_kinds(),
        [EventKind::Usage, EventKind::Release]
    );
    assert_eq!(rejects.take_kinds(), [EventKind::Reject]);
    assert!(nothing.take().is_empty());
    assert_eq!(
        everything.take_kinds(),
        [
            EventKind::Admit,
            EventKind::Reject,
            EventKind::Usage,
            EventKind::Release,
            EventKind::Reconfigure
        ]
    );
}

#[test]
fn a_detached_listener_lives_as_long_as_the_bulkhead() {
    let bulkhead = budgeted(1, 5000);
    let count = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&count);
    bulkhead
        .on_events([EventKind::Admit], move |_| {
            counter.fetch_add(1, Ordering::Relaxed);
        })
        .detach();
    assert_eq!(Arc::strong_count(&count), 2);
    for _ in 0..3 {
        drop(bulkhead.try_acquire(&req(), fixed()).unwrap());
    }
    assert_eq!(count.load(Ordering::Relaxed), 3);
    // The listener goes with the bulkhead (no leak).
    let clone = bulkhead.clone();
    drop(bulkhead);
    drop(clone.try_acquire(&req(), fixed()).unwrap());
    assert_eq!(count.load(Ordering::Relaxed), 4);
    drop(clone);
    assert_eq!(Arc::strong_count(&count), 1);
}

#[test]
fn a_subscription_dropped_after_its_bulkhead_is_harmless() {
    let bulkhead = plain(1);
    let subscription = bulkhead.on(|_| {});
    drop(bulkhead);
    drop(subscription);
}

// ===== events: re-entrancy and panics =====

#[test]
fn listeners_may_call_back_into_the_bulkhead_without_deadlock() {
    let bulkhead = budgeted(4, 5000);
    let worker = bulkhead.clone();
    within_patience("re-entrant listeners", move || {
        let bulkhead = worker;
        let seen_stats = Arc::new(Mutex::new(Vec::new()));
        let nested = Arc::new(AtomicBool::new(false));

        // On admit: read stats, apply limits, and (once) admit and release another call.
        let handle = bulkhead.clone();
        let log = Arc::clone(&seen_stats);
        let once = Arc::clone(&nested);
        let on_admit = bulkhead.on_events([EventKind::Admit], move |event| {
            let Event::Admit(e) = event else { return };
            let t = handle.stats().token_budget.unwrap();
            log.lock()
                .unwrap()
                .push(("admit", e.reserved_tokens, t.in_flight_tokens));
            let mut next = handle.limits();
            next.revision += 1;
            handle.apply_limits(next).unwrap();
            if !once.swap(true, Ordering::SeqCst) {
                let inner = handle.try_acquire(&req(), opts(0, 10)).unwrap();
                inner.release(Some(usage(0, 3)));
            }
        });
        // On usage: the books already include the report.
        let handle = bulkhead.clone();
        let log = Arc::clone(&seen_stats);
        let on_usage = bulkhead.on_events([EventKind::Usage], move |event| {
            let Event::Usage(e) = event else { return };
            let t = handle.stats().token_budget.unwrap();
            log.lock()
                .unwrap()
                .push(("usage", e.held_tokens, t.in_flight_tokens));
            // 80 by this report, 7 by the nested call settled with {0, 3} of 10.
            assert_eq!(t.total_refunded, 87);
            handle.set_budget(t.budget + 1).unwrap();
        });
        // On release: admit and release another call (which emits its own events).
        let handle = bulkhead.clone();
        let log = Arc::clone(&seen_stats);
        let released_once = Arc::new(AtomicBool::new(false));
        let on_release = bulkhead.on_events([EventKind::Release], move |event| {
            let Event::Release(e) = event else { return };
            let t = handle.stats().token_budget.unwrap();
            log.lock()
                .unwrap()
                .push(("release", e.held_tokens, t.in_flight_tokens));
            // Only for the outer call's release (the nested ones are smaller).
            if e.held_tokens == 1020 && !released_once.swap(true, Ordering::SeqCst) {
                drop(handle.try_acquire_owned(&req(), opts(0, 20)).unwrap());
            }
        });

        let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
        permit.report_usage(usage(20, 5)).unwrap();
        permit.release(None);

        // Listener panics (failed assertions inside them included) are caught: check first.
        assert_eq!(bulkhead.stats().listener_panics, 0);
        assert_eq!(
            *seen_stats.lock().unwrap(),
            [
                // The outer admission is in flight when its admit event runs.
                ("admit", 1100, 1100),
                // The nested admission (10 tokens), inside the outer admit listener.
                ("admit", 10, 1110),
                ("release", 10, 1100),
                ("usage", 1020, 1020),
                // The outer release: its hold is already returned.
                ("release", 1020, 0),
                // The admission made inside the outer release listener.
                ("admit", 20, 20),
                ("release", 20, 0),
            ]
        );
        // Three admit events each applied one revision, one usage event one more.
        assert_eq!(bulkhead.limits().revision, REV + 4);
        assert_eq!(bulkhead.limits().token_budget.unwrap().budget, 5001);
        let stats = bulkhead.stats();
        assert_eq!((stats.admitted, stats.released, stats.in_flight), (3, 3, 0));
        assert_eq!(stats.listener_panics, 0);
        drop((on_admit, on_usage, on_release));
    });
}

#[test]
fn a_panicking_listener_is_counted_and_the_others_and_the_operation_carry_on() {
    let bulkhead = budgeted(2, 5000);
    let before = Recorder::all(&bulkhead);
    let _panics = bulkhead.on(|event| {
        if !matches!(event, Event::Reconfigure(_)) {
            panic!(
                "listener failure on {:?} (expected by the test)",
                event.kind()
            );
        }
    });
    let after = Recorder::all(&bulkhead);

    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let r = permit.report_usage(usage(20, 5)).unwrap();
    assert_eq!((r.sequence, r.held), (1, 1020));
    let report = permit.release(None);
    assert_eq!(settled(&report), (1020, 995, 0, Some(usage(20, 5))));
    rejection(bulkhead.try_acquire(&req(), opts(0, 9999)));
    bulkhead.set_budget(6000).unwrap();

    let kinds = [
        EventKind::Admit,
        EventKind::Usage,
        EventKind::Release,
        EventKind::Reject,
        EventKind::Reconfigure,
    ];
    assert_eq!(before.take_kinds(), kinds);
    assert_eq!(after.take_kinds(), kinds);
    let stats = bulkhead.stats();
    assert_eq!(stats.listener_panics, 4);
    assert_eq!((stats.admitted, stats.released, stats.rejected), (1, 1, 1));
    let t = stats.token_budget.unwrap();
    assert_eq!(totals(&t), (1100, 25, 1075, 0));
    assert_eq!(t.in_flight_tokens, 0);
}

#[test]
fn a_listener_panicking_while_a_permit_drops_does_not_unwind_the_drop() {
    let bulkhead = budgeted(1, 5000);
    let _panics = bulkhead.on_events([EventKind::Release], |_| {
        panic!("release listener failure (expected by the test)")
    });
    {
        let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
        permit.report_usage(usage(20, 5)).unwrap();
    }
    let stats = bulkhead.stats();
    assert_eq!(stats.listener_panics, 1);
    assert_eq!((stats.in_flight, stats.released), (0, 1));
    assert_eq!(totals(&stats.token_budget.unwrap()), (1100, 25, 1075, 0));
    // The slot is free again.
    drop(bulkhead.try_acquire(&req(), fixed()).unwrap());
    assert_eq!(bulkhead.stats().listener_panics, 2);
}

// ===== admission timing =====

/// How long the queued call is made to wait.
const WAIT: Duration = Duration::from_millis(30);

#[test]
fn an_immediate_admission_has_zero_queue_wait_and_a_bounded_decision_time() {
    let bulkhead = budgeted(2, 5000);
    let events = Recorder::only(&bulkhead, &[EventKind::Admit, EventKind::Reject]);
    let started = Instant::now();
    let permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let elapsed = started.elapsed();
    let e = one_admit(&events);
    assert_eq!(e.queue_wait, Duration::ZERO);
    assert!(e.decision_duration <= elapsed, "{e:?} vs {elapsed:?}");

    // The waiting acquire admitted at once is timed the same way.
    let started = Instant::now();
    let second = block_on(bulkhead.acquire(&req(), fixed())).unwrap();
    let elapsed = started.elapsed();
    let e = one_admit(&events);
    assert_eq!(e.queue_wait, Duration::ZERO);
    assert!(e.decision_duration <= elapsed, "{e:?} vs {elapsed:?}");
    drop((permit, second));
}

#[test]
fn immediate_rejections_have_zero_queue_wait() {
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .max_queue(1)
        .token_budget(TokenBudget::new(5000))
        .build()
        .unwrap();
    let events = Recorder::only(&bulkhead, &[EventKind::Reject]);
    let _held = bulkhead.try_acquire(&req(), fixed()).unwrap();

    // try_acquire out of slots; acquire out of tokens.
    let started = Instant::now();
    rejection(bulkhead.try_acquire(&req(), fixed()));
    let elapsed = started.elapsed();
    let e = one_reject(&events);
    assert_eq!(e.reason, RejectReason::ConcurrencyLimit);
    assert_eq!(e.queue_wait, Duration::ZERO);
    assert!(e.decision_duration <= elapsed);

    rejection(block_on(bulkhead.acquire(&req(), opts(0, 4000))));
    let e = one_reject(&events);
    assert_eq!(e.reason, RejectReason::BudgetLimit);
    assert_eq!(e.queue_wait, Duration::ZERO);

    // acquire with the queue full.
    let mut waiting = Box::pin(bulkhead.acquire(&req(), fixed()));
    assert!(poll_once(&mut waiting).is_pending());
    rejection(block_on(bulkhead.acquire(&req(), fixed())));
    let e = one_reject(&events);
    assert_eq!(e.reason, RejectReason::QueueLimit);
    assert_eq!(e.queue_wait, Duration::ZERO);
    drop(waiting);
    // The withdrawn waiter is refused `aborted` after some wait.
    let e = one_reject(&events);
    assert_eq!(e.reason, RejectReason::Aborted);
}

#[test]
fn a_call_that_waited_reports_its_queue_wait_apart_from_its_decision_time() {
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .max_queue(4)
        .token_budget(TokenBudget::new(5000))
        .build()
        .unwrap();
    let events = Recorder::only(&bulkhead, &[EventKind::Admit, EventKind::Reject]);
    let first = bulkhead.try_acquire_owned(&req(), fixed()).unwrap();
    events.take();

    let started = Instant::now();
    let mut waiting = Box::pin(bulkhead.acquire(&req(), fixed().timeout(PATIENCE)));
    assert!(poll_once(&mut waiting).is_pending());
    assert_eq!(bulkhead.stats().pending, 1);
    // Released from another thread after WAIT, i.e. at least WAIT after the call queued.
    let releaser = thread::spawn(move || {
        thread::sleep(WAIT);
        first.release(Some(usage(1, 1)));
    });
    let second = block_on(waiting).unwrap();
    let elapsed = started.elapsed();
    releaser.join().unwrap();

    let e = one_admit(&events);
    assert_eq!(e.admission_id, second.admission_id());
    assert!(e.queue_wait >= WAIT, "{e:?}");
    assert!(e.queue_wait <= elapsed, "{e:?} vs {elapsed:?}");
    // The decision time excludes the wait: both fit in the call's span together.
    assert!(
        e.queue_wait + e.decision_duration <= elapsed,
        "{e:?} vs {elapsed:?}"
    );
    assert_eq!(e.reserved_tokens, 1100);
}

#[test]
fn a_queue_timeout_reports_the_whole_wait() {
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .max_queue(4)
        .token_budget(TokenBudget::new(5000))
        .build()
        .unwrap();
    let events = Recorder::only(&bulkhead, &[EventKind::Reject]);
    let _held = bulkhead.try_acquire(&req(), fixed()).unwrap();

    // Blocking and async waits, each timing out.
    let started = Instant::now();
    let refused = rejection(bulkhead.acquire_blocking(&req(), fixed().timeout(WAIT)));
    let elapsed = started.elapsed();
    assert_eq!(refused.reason(), RejectReason::Timeout);
    let e = one_reject(&events);
    assert_eq!(e.reason, RejectReason::Timeout);
    let wait = e.queue_wait;
    // The wait is measured from the instant the deadline counts from.
    assert!(wait >= WAIT, "{e:?}");
    assert!(
        wait + e.decision_duration <= elapsed,
        "{e:?} vs {elapsed:?}"
    );

    let refused = rejection(block_on(bulkhead.acquire(&req(), fixed().timeout(WAIT))));
    assert_eq!(refused.reason(), RejectReason::Timeout);
    let e = one_reject(&events);
    assert!(e.queue_wait >= WAIT, "{e:?}");
    assert_eq!(e.detail, *refused.detail());
}

#[test]
fn a_cancelled_waiter_reports_how_long_it_waited() {
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .max_queue(4)
        .build()
        .unwrap();
    let events = Recorder::only(&bulkhead, &[EventKind::Reject]);
    let _held = bulkhead.try_acquire(&req(), fixed()).unwrap();
    let mut waiting = Box::pin(bulkhead.acquire(&req(), AcquireOptions::new()));
    assert!(poll_once(&mut waiting).is_pending());
    thread::sleep(WAIT);
    drop(waiting);
    let e = one_reject(&events);
    assert_eq!(e.reason, RejectReason::Aborted);
    assert!(e.queue_wait >= WAIT, "{e:?}");
}

// ===== the estimator learns from the usage a release settles with =====

#[test]
fn releases_settled_with_reported_usage_feed_the_adaptive_estimator() {
    let base = ModelAwareEstimator::builder()
        .default_model("gpt-4o")
        .build()
        .unwrap();
    let adaptive = Arc::new(
        AdaptiveEstimator::builder(base)
            .smoothing(1.0)
            .min_samples(1)
            .build()
            .unwrap(),
    );
    let bulkhead = LlmBulkhead::builder("gpt-4o", 8)
        .token_budget(TokenBudget::new(100_000))
        .estimator(adaptive.clone())
        .build()
        .unwrap();
    // 370 characters: a base estimate of 100 input tokens for gpt-4o.
    let request = LlmRequest::new().user("x".repeat(370)).max_tokens(10);
    let correction = |samples: u64, factor: f64| {
        vec![Correction {
            model: "gpt-4o".into(),
            samples,
            factor,
            applied: factor,
        }]
    };
    assert_eq!(bulkhead.estimate(&request).unwrap(), Some(res(100, 10)));

    // Released without usage after reports: the last reported usage is observed.
    let mut permit = bulkhead
        .try_acquire(&request, AcquireOptions::new())
        .unwrap();
    assert_eq!(permit.reservation(), Some(res(100, 10)));
    permit.report_usage(usage(120, 1)).unwrap();
    permit.report_usage(usage(150, 5)).unwrap();
    permit.release(None);
    assert_eq!(adaptive.corrections(), correction(1, 1.5));
    assert_eq!(bulkhead.estimate(&request).unwrap(), Some(res(150, 10)));

    // Dropped after a report: observed against the uncorrected base (100), not 150.
    let mut permit = bulkhead
        .try_acquire_owned(&request, AcquireOptions::new())
        .unwrap();
    assert_eq!(permit.reservation(), Some(res(150, 10)));
    permit
        .report_usage_progressive(usage(80, 3), progressive(7, 0))
        .unwrap();
    drop(permit);
    assert_eq!(adaptive.corrections(), correction(2, 0.8));

    // Explicit usage at release wins over the reports.
    let mut permit = bulkhead
        .try_acquire(&request, AcquireOptions::new())
        .unwrap();
    permit.report_usage(usage(300, 3)).unwrap();
    permit.release(Some(usage(120, 3)));
    assert_eq!(adaptive.corrections(), correction(3, 1.2));

    // Nothing known, nothing observed.
    bulkhead
        .try_acquire(&request, AcquireOptions::new())
        .unwrap()
        .release(None);
    assert_eq!(adaptive.corrections(), correction(3, 1.2));

    // A run settled with what its callback reported.
    block_on(
        bulkhead.run(&request, AcquireOptions::new(), async |mut ctx| {
            ctx.report_usage(usage(90, 2))
        }),
    )
    .unwrap();
    assert_eq!(adaptive.corrections(), correction(4, 0.9));
    assert_eq!(bulkhead.estimate(&request).unwrap(), Some(res(90, 10)));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 0);
}

// ===== stats serialization =====

#[cfg(feature = "serde")]
#[test]
fn stats_serialize_with_the_token_books_and_listener_panics() {
    let bulkhead = budgeted(2, 5000);
    let _panics = bulkhead.on_events([EventKind::Usage], |_| {
        panic!("usage listener failure (expected by the test)")
    });
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    permit.report_usage(usage(100, 1400)).unwrap();
    permit.release(None);
    rejection(bulkhead.try_acquire(&req(), opts(0, 9999)));

    let value = serde_json::to_value(bulkhead.stats()).unwrap();
    assert_eq!(value["listener_panics"], 1);
    assert_eq!(value["admitted"], 1);
    assert_eq!(value["released"], 1);
    assert_eq!(value["rejected"], 1);
    assert_eq!(value["rejected_by_reason"]["budget_limit"], 1);
    assert_eq!(value["limits"]["revision"], REV);
    assert_eq!(value["limits"]["token_budget"]["budget"], 5000);
    let t = &value["token_budget"];
    assert_eq!(t["total_reserved"], 1100);
    assert_eq!(t["total_consumed"], 1500);
    assert_eq!(t["total_refunded"], 0);
    assert_eq!(t["total_overrun"], 400);
    assert_eq!(t["in_flight_tokens"], 0);
    assert_eq!(t["available"], 5000);
    assert_eq!(t["budget"], 5000);
    assert_eq!(t["high_priority_reserve"], 0);

    // Without a budget the token block is null.
    let unbudgeted = plain(1);
    let value = serde_json::to_value(unbudgeted.stats()).unwrap();
    assert!(value["token_budget"].is_null());
    assert_eq!(value["listener_panics"], 0);
}
