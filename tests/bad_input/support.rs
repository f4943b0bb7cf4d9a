//! Helpers shared by the bad-input tests: fixtures, the control twin, the probe, and
//! every entry point that takes a request and options.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, OwnedPermit, Priority, RejectReason,
    Rejection, Reservation, RunError, Stats, TokenBudget, TokenUsage, admission::Verdict,
    events::EventKind, events::Subscription, rejection::CapacityDetail, request::RequestError,
    usage::Progressive, usage::ReleaseReport, usage::UsageError, usage::UsageReport,
};
use futures::executor::block_on;

pub(crate) const MODEL: &str = "test-model";

pub(crate) fn res(input: u64, max_output: u64) -> Reservation {
    Reservation::new(input, max_output).expect("reservation fits in u64")
}

pub(crate) fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).expect("usage fits in u64")
}

pub(crate) fn with_res(input: u64, max_output: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(res(input, max_output))
}

pub(crate) fn plain(max_concurrent: usize) -> LlmBulkhead {
    LlmBulkhead::builder(MODEL, max_concurrent)
        .build()
        .expect("valid configuration")
}

pub(crate) fn budgeted(max_concurrent: usize, budget: u64, reserve: u64) -> LlmBulkhead {
    LlmBulkhead::builder(MODEL, max_concurrent)
        .token_budget(TokenBudget::new(budget).high_priority_reserve(reserve))
        .build()
        .expect("valid configuration")
}

/// The events a bulkhead emitted, by kind, in order.
type Log = Arc<Mutex<Vec<EventKind>>>;

fn record(bulkhead: &LlmBulkhead) -> (Log, Subscription) {
    let log: Log = Arc::default();
    let sink = Arc::clone(&log);
    let subscription = bulkhead.on(move |event| sink.lock().unwrap().push(event.kind()));
    (log, subscription)
}

/// Two bulkheads built the same way: the *subject* gets the bad input, the *control* does not.
/// Every valid operation is done on both, so they must stay indistinguishable.
pub(crate) struct Twin {
    pub(crate) subject: LlmBulkhead,
    pub(crate) control: LlmBulkhead,
    pub(crate) logs: [Log; 2],
    _subscriptions: [Subscription; 2],
    /// Permits held on both (same operations on each), kept alive for the twin's lifetime.
    pub(crate) held: Vec<OwnedPermit>,
}

impl Twin {
    pub(crate) fn new(build: impl Fn() -> LlmBulkhead) -> Twin {
        let subject = build();
        let control = build();
        let (subject_log, subject_sub) = record(&subject);
        let (control_log, control_sub) = record(&control);
        Twin {
            subject,
            control,
            logs: [subject_log, control_log],
            _subscriptions: [subject_sub, control_sub],
            held: Vec::new(),
        }
    }

    /// Runs the same valid operation on both bulkheads.
    pub(crate) fn both<T>(&self, mut op: impl FnMut(&LlmBulkhead) -> T) -> (T, T) {
        (op(&self.subject), op(&self.control))
    }

    /// Acquires the same owned permit on both and keeps it.
    pub(crate) fn hold(&mut self, options: AcquireOptions) {
        let (a, b) = self.both(|b| b.try_acquire_owned(&LlmRequest::new(), options));
        self.held.push(a.expect("subject admits the setup permit"));
        self.held.push(b.expect("control admits the setup permit"));
    }

    pub(crate) fn subject_events(&self) -> Vec<EventKind> {
        self.logs[0].lock().unwrap().clone()
    }

    /// Stats, limits, the closed flag and the events emitted are those of the control.
    #[track_caller]
    pub(crate) fn assert_unchanged(&self, case: &str) {
        assert_eq!(self.subject.stats(), self.control.stats(), "{case}: stats");
        assert_eq!(
            self.subject.limits(),
            self.control.limits(),
            "{case}: limits"
        );
        assert_eq!(
            self.subject.is_closed(),
            self.control.is_closed(),
            "{case}: closed"
        );
        assert_eq!(
            *self.logs[0].lock().unwrap(),
            *self.logs[1].lock().unwrap(),
            "{case}: events"
        );
    }

    /// [`assert_unchanged`](Twin::assert_unchanged), then the probe behaves the same on both,
    /// and they are still the same afterwards.
    #[track_caller]
    pub(crate) fn assert_behaves_like_control(&self, case: &str) {
        self.assert_unchanged(case);
        assert_eq!(
            probe(&self.subject),
            probe(&self.control),
            "{case}: a valid operation afterwards"
        );
        self.assert_unchanged(case);
    }
}

/// A usage report without its admission id (ids are unique per admission).
pub(crate) type ReportFields = (u64, u64, u64, u64, Option<u64>, Option<u64>, bool, u64);

pub(crate) fn fields(r: UsageReport) -> ReportFields {
    (
        r.sequence,
        r.reserved,
        r.held,
        r.consumed,
        r.output_cap,
        r.output_remaining,
        r.over_reservation,
        r.limit_revision,
    )
}

#[derive(Debug, PartialEq)]
pub(crate) struct Admission {
    limit_revision: u64,
    priority: Priority,
    reservation: Option<Reservation>,
    held_at_admission: u64,
    plain_report: Result<ReportFields, UsageError>,
    progressive_report: Result<ReportFields, UsageError>,
    held_before_release: u64,
    release: ReleaseReport,
}

#[derive(Debug, PartialEq)]
pub(crate) struct ProbeOutcome {
    estimate: Result<Option<Reservation>, RequestError>,
    verdict: Result<(Verdict, CapacityDetail), RequestError>,
    pub(crate) admission: Result<Admission, AcquireError>,
    in_flight_after: u64,
    pending_after: u64,
    pub(crate) tokens_after: Option<u64>,
}

/// A fixed sequence of valid operations: estimate, advisory check, admit, report (plain then
/// progressive), release with usage.
pub(crate) fn probe(b: &LlmBulkhead) -> ProbeOutcome {
    let request = LlmRequest::new().user("x".repeat(40)).max_tokens(30);
    let options = with_res(10, 20);
    let estimate = b.estimate(&request);
    let verdict = b.would_admit_with_detail(&request, options);
    let admission = b.try_acquire(&request, options).map(|mut permit| {
        let held_at_admission = permit.held_tokens();
        let plain_report = permit.report_usage(usage(4, 6)).map(fields);
        let progressive_report = permit
            .report_usage_progressive(usage(4, 9), Progressive::new(10).safety_margin(1))
            .map(fields);
        Admission {
            limit_revision: permit.limit_revision(),
            priority: permit.priority(),
            reservation: permit.reservation(),
            held_at_admission,
            plain_report,
            progressive_report,
            held_before_release: permit.held_tokens(),
            release: permit.release(Some(usage(4, 12))),
        }
    });
    let stats = b.stats();
    ProbeOutcome {
        estimate,
        verdict,
        admission,
        in_flight_after: stats.in_flight,
        pending_after: stats.pending,
        tokens_after: stats.token_budget.map(|t| t.in_flight_tokens),
    }
}

/// `before` with one more refusal for `reason`.
pub(crate) fn plus_one_rejection(before: Stats, reason: RejectReason) -> Stats {
    let mut expected = before;
    expected.rejected += 1;
    let counts = &mut expected.rejected_by_reason;
    match reason {
        RejectReason::Shutdown => counts.shutdown += 1,
        RejectReason::ConcurrencyLimit => counts.concurrency_limit += 1,
        RejectReason::BudgetLimit => counts.budget_limit += 1,
        RejectReason::QueueLimit => counts.queue_limit += 1,
        RejectReason::Timeout => counts.timeout += 1,
        RejectReason::Aborted => counts.aborted += 1,
        other => panic!("unexpected reason {other:?}"),
    }
    expected
}

// ----- every entry point that takes a request and options -----

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Entry {
    TryAcquire,
    TryAcquireOwned,
    Acquire,
    AcquireOwned,
    AcquireBlocking,
    AcquireBlockingOwned,
    WouldAdmit,
    WouldAdmitWithDetail,
    Estimate,
    Run,
    RunWithUsage,
}

pub(crate) const ENTRIES: [Entry; 11] = [
    Entry::TryAcquire,
    Entry::TryAcquireOwned,
    Entry::Acquire,
    Entry::AcquireOwned,
    Entry::AcquireBlocking,
    Entry::AcquireBlockingOwned,
    Entry::WouldAdmit,
    Entry::WouldAdmitWithDetail,
    Entry::Estimate,
    Entry::Run,
    Entry::RunWithUsage,
];

impl Entry {
    /// Whether the entry admits (and so counts refusals); the others are advisory.
    pub(crate) fn admits(self) -> bool {
        !matches!(
            self,
            Entry::WouldAdmit | Entry::WouldAdmitWithDetail | Entry::Estimate
        )
    }
}

/// What an entry point did.
#[derive(Debug, PartialEq)]
pub(crate) enum Outcome {
    Invalid(RequestError),
    Rejected(Rejection),
    /// Admitted (the permit was dropped at once; for `run`, the callback ran).
    Admitted,
    Verdict(Verdict),
    Estimate(Option<Reservation>),
}

fn from_acquire<P>(result: Result<P, AcquireError>) -> Outcome {
    match result {
        Ok(_permit) => Outcome::Admitted,
        Err(AcquireError::Rejected(rejection)) => Outcome::Rejected(rejection),
        Err(AcquireError::Invalid(error)) => Outcome::Invalid(error),
        Err(other) => panic!("an error this test does not know: {other}"),
    }
}

fn from_run<T>(result: Result<T, RunError<Infallible>>, ran: bool) -> Outcome {
    match result {
        Ok(_) => {
            assert!(ran, "run returned Ok without running the callback");
            Outcome::Admitted
        }
        Err(error) => {
            assert!(!ran, "the callback ran although the call was refused");
            match error {
                RunError::Rejected(rejection) => Outcome::Rejected(rejection),
                RunError::Invalid(error) => Outcome::Invalid(error),
                RunError::Failed(never) => match never {},
                RunError::BorrowedConcurrencyDeadline(cut) => panic!("no deadline was set: {cut}"),
                other => panic!("an error this test does not know: {other}"),
            }
        }
    }
}

pub(crate) fn call(
    entry: Entry,
    b: &LlmBulkhead,
    request: &LlmRequest,
    options: AcquireOptions,
) -> Outcome {
    match entry {
        Entry::TryAcquire => from_acquire(b.try_acquire(request, options)),
        Entry::TryAcquireOwned => from_acquire(b.try_acquire_owned(request, options)),
        Entry::Acquire => from_acquire(block_on(b.acquire(request, options))),
        Entry::AcquireOwned => from_acquire(block_on(b.acquire_owned(request, options))),
        Entry::AcquireBlocking => from_acquire(b.acquire_blocking(request, options)),
        Entry::AcquireBlockingOwned => from_acquire(b.acquire_blocking_owned(request, options)),
        Entry::WouldAdmit => match b.would_admit(request, options) {
            Ok(verdict) => Outcome::Verdict(verdict),
            Err(error) => Outcome::Invalid(error),
        },
        Entry::WouldAdmitWithDetail => match b.would_admit_with_detail(request, options) {
            Ok((verdict, _detail)) => Outcome::Verdict(verdict),
            Err(error) => Outcome::Invalid(error),
        },
        Entry::Estimate => match b.estimate(request) {
            Ok(reservation) => Outcome::Estimate(reservation),
            Err(error) => Outcome::Invalid(error),
        },
        Entry::Run => {
            let ran = AtomicBool::new(false);
            let result = block_on(b.run(request, options, async |_ctx| {
                ran.store(true, Ordering::Relaxed);
                Ok::<_, Infallible>(())
            }));
            from_run(result, ran.load(Ordering::Relaxed))
        }
        Entry::RunWithUsage => {
            let ran = AtomicBool::new(false);
            let result = block_on(b.run_with_usage(
                request,
                options,
                |_: &()| Some(usage(1, 1)),
                async |_ctx| {
                    ran.store(true, Ordering::Relaxed);
                    Ok::<_, Infallible>(())
                },
            ));
            from_run(result, ran.load(Ordering::Relaxed))
        }
    }
}
