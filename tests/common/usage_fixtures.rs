//! Fixtures of the usage and events tests: bulkheads whose limits start at revision [`REV`],
//! the fixed reservation (input 100, maximum output 1000, so `r = 1100`), figures of reports,
//! events and stats, and a [`Recorder`] of the events a subscription hears.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, mpsc};
use std::task::{Context, Poll};
use std::time::Duration;
use std::{fmt, thread};

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, Rejection, Reservation, TokenBudget,
    TokenUsage, events::AdmitEvent, events::Event, events::EventKind, events::ReconfigureEvent,
    events::RejectEvent, events::ReleaseEvent, events::Subscription, events::UsageEvent,
    stats::TokenBudgetStats, usage::Progressive, usage::ReleaseReport, usage::UsageReport,
};

/// Revision of the limits every test bulkhead starts with (so a revision of 0 proves nothing).
pub(crate) const REV: u64 = 7;
/// The fixed reservation: estimated input, maximum output, and their sum `r`.
const R_INPUT: u64 = 100;
const R_OUTPUT: u64 = 1000;
pub(crate) const R: u64 = R_INPUT + R_OUTPUT;
/// How long to wait for another thread before declaring a hang (only bounds failures).
pub(crate) const PATIENCE: Duration = Duration::from_secs(20);

pub(crate) fn res(input: u64, max_output: u64) -> Reservation {
    Reservation::new(input, max_output).expect("reservation fits in u64")
}

/// Normal-priority options reserving `input + max_output`.
pub(crate) fn opts(input: u64, max_output: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(res(input, max_output))
}

/// Normal-priority options with the fixed reservation (100 + 1000).
pub(crate) fn fixed() -> AcquireOptions {
    opts(R_INPUT, R_OUTPUT)
}

pub(crate) fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).expect("usage fits in u64")
}

pub(crate) fn progressive(remaining: u64, margin: u64) -> Progressive {
    Progressive::new(remaining).safety_margin(margin)
}

pub(crate) fn req() -> LlmRequest {
    LlmRequest::new()
}

/// A bulkhead with a token budget (no reserve, no queue), limits at revision [`REV`].
pub(crate) fn budgeted(max_concurrent: usize, budget: u64) -> LlmBulkhead {
    LlmBulkhead::builder("test-model", max_concurrent)
        .initial_revision(REV)
        .token_budget(TokenBudget::new(budget))
        .build()
        .expect("valid configuration")
}

/// A bulkhead without a token budget, limits at revision [`REV`].
pub(crate) fn plain(max_concurrent: usize) -> LlmBulkhead {
    LlmBulkhead::builder("test-model", max_concurrent)
        .initial_revision(REV)
        .build()
        .expect("valid configuration")
}

pub(crate) fn tokens(bulkhead: &LlmBulkhead) -> TokenBudgetStats {
    bulkhead
        .stats()
        .token_budget
        .expect("bulkhead has a token budget")
}

/// `(total_reserved, total_consumed, total_refunded, total_overrun)` (refunds gross).
pub(crate) fn totals(t: &TokenBudgetStats) -> (u64, u64, u64, u64) {
    (
        t.total_reserved,
        t.total_consumed,
        t.total_refunded,
        t.total_overrun,
    )
}

/// `(in_flight_tokens, available)`.
pub(crate) fn live(t: &TokenBudgetStats) -> (u64, u64) {
    (t.in_flight_tokens, t.available)
}

/// `(total_reheld, total_returned_unreported)`.
pub(crate) fn reheld_returned(t: &TokenBudgetStats) -> (u64, u64) {
    (t.total_reheld, t.total_returned_unreported)
}

/// The token identity, at any step of calls on one thread: `in_flight_tokens == reserved +
/// overrun + reheld - refunded - consumed - returned_unreported`.
pub(crate) fn assert_identity(t: &TokenBudgetStats) {
    assert_eq!(
        i128::from(t.in_flight_tokens),
        i128::from(t.total_reserved) + i128::from(t.total_overrun) + i128::from(t.total_reheld)
            - i128::from(t.total_refunded)
            - i128::from(t.total_consumed)
            - i128::from(t.total_returned_unreported),
        "in_flight == reserved + overrun + reheld - refunded - consumed - returned: {t:?}"
    );
}

/// `(sequence, reserved, held, consumed, output_cap, output_remaining, over_reservation)`.
pub(crate) type ReportFigures = (u64, u64, u64, u64, Option<u64>, Option<u64>, bool);

pub(crate) fn figures(r: &UsageReport) -> ReportFigures {
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
pub(crate) fn settled(r: &ReleaseReport) -> (u64, u64, u64, Option<TokenUsage>) {
    (r.held_tokens, r.refunded_tokens, r.overrun_tokens, r.usage)
}

/// `(sequence, reserved, previous_held, held, delta)` of a usage event.
pub(crate) fn moved(e: &UsageEvent) -> (u64, u64, u64, u64, i128) {
    (
        e.sequence,
        e.reserved_tokens,
        e.previous_held_tokens,
        e.held_tokens,
        e.delta_tokens,
    )
}

/// `(usage, output_cap, output_remaining, over_reservation, progressive)` of a usage event.
pub(crate) fn usage_state(
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
pub(crate) fn release_figures(e: &ReleaseEvent) -> (u64, u64, u64, u64, Option<TokenUsage>) {
    (
        e.reserved_tokens,
        e.held_tokens,
        e.refunded_tokens,
        e.usage_sequence,
        e.usage,
    )
}

pub(crate) fn rejection<T: fmt::Debug>(result: Result<T, AcquireError>) -> Rejection {
    match result {
        Err(AcquireError::Rejected(rejection)) => rejection,
        other => panic!("expected a capacity rejection, got {other:?}"),
    }
}

/// An event as a listener saw it, owned.
#[derive(Clone, Debug, PartialEq)]
#[allow(clippy::large_enum_variant)] // a test record, copied rarely
pub(crate) enum Seen {
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
            Event::Reconfigure(e) => Seen::Reconfigure((*e).clone()),
            other => Seen::Other(other.kind()),
        }
    }

    pub(crate) fn kind(&self) -> EventKind {
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
pub(crate) struct Recorder {
    seen: Arc<Mutex<Vec<Seen>>>,
    _subscription: Subscription,
}

impl Recorder {
    /// Listens to every kind.
    pub(crate) fn all(bulkhead: &LlmBulkhead) -> Recorder {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        let subscription = bulkhead.on(move |event| log.lock().unwrap().push(Seen::of(event)));
        Recorder {
            seen,
            _subscription: subscription,
        }
    }

    /// Listens to `kinds` only.
    pub(crate) fn only(bulkhead: &LlmBulkhead, kinds: &[EventKind]) -> Recorder {
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
    pub(crate) fn take(&self) -> Vec<Seen> {
        std::mem::take(&mut *self.seen.lock().unwrap())
    }

    /// The kinds seen since the last call.
    pub(crate) fn take_kinds(&self) -> Vec<EventKind> {
        self.take().iter().map(Seen::kind).collect()
    }

    /// The single event seen since the last call.
    fn take_one(&self) -> Seen {
        let mut seen = self.take();
        assert_eq!(seen.len(), 1, "expected exactly one event: {seen:?}");
        seen.pop().unwrap()
    }
}

pub(crate) fn one_usage(recorder: &Recorder) -> UsageEvent {
    match recorder.take_one() {
        Seen::Usage(e) => e,
        other => panic!("expected a usage event, got {other:?}"),
    }
}

pub(crate) fn one_release(recorder: &Recorder) -> ReleaseEvent {
    match recorder.take_one() {
        Seen::Release(e) => e,
        other => panic!("expected a release event, got {other:?}"),
    }
}

pub(crate) fn one_admit(recorder: &Recorder) -> AdmitEvent {
    match recorder.take_one() {
        Seen::Admit(e) => e,
        other => panic!("expected an admit event, got {other:?}"),
    }
}

pub(crate) fn one_reject(recorder: &Recorder) -> RejectEvent {
    match recorder.take_one() {
        Seen::Reject(e) => e,
        other => panic!("expected a reject event, got {other:?}"),
    }
}

pub(crate) fn one_reconfigure(recorder: &Recorder) -> ReconfigureEvent {
    match recorder.take_one() {
        Seen::Reconfigure(e) => e,
        other => panic!("expected a reconfigure event, got {other:?}"),
    }
}

/// Runs `f` on its own thread and fails (instead of hanging) if it does not finish in time.
pub(crate) fn within_patience(what: &str, f: impl FnOnce() + Send + 'static) {
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
pub(crate) fn poll_once<F: Future + Unpin>(fut: &mut F) -> Poll<F::Output> {
    let waker = futures::task::noop_waker();
    Pin::new(fut).poll(&mut Context::from_waker(&waker))
}
