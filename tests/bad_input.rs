//! Bad input never panics and never changes state.
//!
//! A systematic sweep over every public entry point of `async-bulkhead-llm` that takes input,
//! with edge values (0, 1, `u64::MAX`, `u64::MAX - 1`, `MAX_BUDGET(+1)`, `MAX_CONCURRENT(+1)`,
//! `MAX_REVISION(+1)`), sums that overflow, inconsistent reservations, stale/equal/huge
//! revisions, empty and whitespace-only model names, non-finite and non-positive estimator
//! options, invalid JSON bodies, zero and huge timeouts, and usage reports whose totals or holds
//! cannot be represented.
//!
//! For each case the test asserts
//!
//! - the exact typed error (variant and fields) and, where the spec or the crate's docs give
//!   one, its `Display` text;
//! - that nothing panicked (a panic fails the test);
//! - that nothing changed: the bulkhead is compared with a *control twin* built the same way
//!   and given the same valid operations but not the bad one (stats, limits, closed flag, the
//!   events emitted, a permit's hold and its next report sequence), and a subsequent valid
//!   operation sequence (the "probe") behaves exactly as on the control.
//!
//! Valid edge values are checked too: they are accepted and behave as documented.
//!
//! References: `upstream-behavior.md` §1.4, §3.1, §4.3, §4.4, §8, §16 and `RUST-DESIGN.md` §4
//! (Q9/Q10: every option is validated before any capacity decision; Q17: override ratios must
//! be finite and > 0).

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, AdaptiveEstimator, ApplyOutcome, CapacityDetail, ConfigError,
    ContentBlock, DrainReport, Estimator, EstimatorError, EventKind, Limits, LimitsError,
    LlmBulkhead, LlmBulkheadBuilder, LlmRequest, MAX_BUDGET, MAX_CONCURRENT, MAX_REVISION, Memo,
    ModelAwareEstimator, NaiveEstimator, OpaqueBlockTokens, OwnedPermit, Permit, Priority, Profile,
    Progressive, RejectReason, Rejection, ReleaseReport, RequestError, Reservation, RunContext,
    RunError, Stats, Subscription, TokenBudget, TokenBudgetDetail, TokenEstimate, TokenUsage,
    UsageError, UsageReport, Verdict,
};
use futures::executor::block_on;

// =============================================================================================
// Helpers
// =============================================================================================

const MODEL: &str = "test-model";

fn res(input: u64, max_output: u64) -> Reservation {
    Reservation::new(input, max_output).expect("reservation fits in u64")
}

fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).expect("usage fits in u64")
}

fn with_res(input: u64, max_output: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(res(input, max_output))
}

fn plain(max_concurrent: u32) -> LlmBulkhead {
    LlmBulkhead::builder(MODEL, max_concurrent)
        .build()
        .expect("valid configuration")
}

fn budgeted(max_concurrent: u32, budget: u64, reserve: u64) -> LlmBulkhead {
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
struct Twin {
    subject: LlmBulkhead,
    control: LlmBulkhead,
    logs: [Log; 2],
    _subscriptions: [Subscription; 2],
    /// Permits held on both (same operations on each), kept alive for the twin's lifetime.
    held: Vec<OwnedPermit>,
}

impl Twin {
    fn new(build: impl Fn() -> LlmBulkhead) -> Twin {
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
    fn both<T>(&self, mut op: impl FnMut(&LlmBulkhead) -> T) -> (T, T) {
        (op(&self.subject), op(&self.control))
    }

    /// Acquires the same owned permit on both and keeps it.
    fn hold(&mut self, options: AcquireOptions) {
        let (a, b) = self.both(|b| b.try_acquire_owned(&LlmRequest::new(), options));
        self.held.push(a.expect("subject admits the setup permit"));
        self.held.push(b.expect("control admits the setup permit"));
    }

    fn subject_events(&self) -> Vec<EventKind> {
        self.logs[0].lock().unwrap().clone()
    }

    /// Stats, limits, the closed flag and the events emitted are those of the control.
    #[track_caller]
    fn assert_unchanged(&self, case: &str) {
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
    fn assert_behaves_like_control(&self, case: &str) {
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
type ReportFields = (u64, u64, u64, u64, Option<u64>, Option<u64>, bool, u64);

fn fields(r: UsageReport) -> ReportFields {
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
struct Admission {
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
struct ProbeOutcome {
    estimate: Result<Option<Reservation>, RequestError>,
    verdict: Result<(Verdict, CapacityDetail), RequestError>,
    admission: Result<Admission, AcquireError>,
    in_flight_after: u64,
    pending_after: u64,
    tokens_after: Option<u64>,
}

/// A fixed sequence of valid operations: estimate, advisory check, admit, report (plain then
/// progressive), release with usage.
fn probe(b: &LlmBulkhead) -> ProbeOutcome {
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
fn plus_one_rejection(before: Stats, reason: RejectReason) -> Stats {
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
enum Entry {
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

const ENTRIES: [Entry; 11] = [
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
    fn admits(self) -> bool {
        !matches!(
            self,
            Entry::WouldAdmit | Entry::WouldAdmitWithDetail | Entry::Estimate
        )
    }
}

/// What an entry point did.
#[derive(Debug, PartialEq)]
enum Outcome {
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
            }
        }
    }
}

fn call(entry: Entry, b: &LlmBulkhead, request: &LlmRequest, options: AcquireOptions) -> Outcome {
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

// =============================================================================================
// Builder: LlmBulkhead::builder(..).build()
// =============================================================================================

mod builder {
    use super::*;

    struct Case {
        name: &'static str,
        builder: LlmBulkheadBuilder,
        expected: ConfigError,
        display: &'static str,
    }

    fn cases() -> Vec<Case> {
        let b = LlmBulkhead::builder;
        let huge_budget = TokenBudget::new(u64::MAX)
            .high_priority_reserve(u64::MAX)
            .output_cap(u64::MAX);
        vec![
            Case {
                name: "empty model",
                builder: b("", 4),
                expected: ConfigError::EmptyModel { model: "".into() },
                display: "model must be a non-empty string (got \"\")",
            },
            Case {
                name: "single space model",
                builder: b(" ", 4),
                expected: ConfigError::EmptyModel { model: " ".into() },
                display: "model must be a non-empty string (got \" \")",
            },
            Case {
                name: "ASCII whitespace-only model",
                builder: b(" \t\r\n\x0b\x0c ", 4),
                expected: ConfigError::EmptyModel {
                    model: " \t\r\n\x0b\x0c ".into(),
                },
                display: "model must be a non-empty string (got \" \\t\\r\\n\\u{b}\\u{c} \")",
            },
            Case {
                name: "Unicode whitespace-only model (NBSP, ideographic space, line separator)",
                builder: b("\u{a0}\u{3000}\u{2028}", 4),
                expected: ConfigError::EmptyModel {
                    model: "\u{a0}\u{3000}\u{2028}".into(),
                },
                display: "model must be a non-empty string (got \"\\u{a0}\\u{3000}\\u{2028}\")",
            },
            Case {
                name: "empty model wins over every other invalid option",
                builder: b("  ", u32::MAX)
                    .initial_revision(u64::MAX)
                    .token_budget(huge_budget),
                expected: ConfigError::EmptyModel { model: "  ".into() },
                display: "model must be a non-empty string (got \"  \")",
            },
            Case {
                name: "max_concurrent MAX_CONCURRENT + 1",
                builder: b(MODEL, MAX_CONCURRENT + 1),
                expected: ConfigError::MaxConcurrentTooLarge {
                    value: MAX_CONCURRENT + 1,
                    max: MAX_CONCURRENT,
                },
                display: "max_concurrent (65536) must be <= 65535",
            },
            Case {
                name: "max_concurrent u32::MAX",
                builder: b(MODEL, u32::MAX),
                expected: ConfigError::MaxConcurrentTooLarge {
                    value: u32::MAX,
                    max: MAX_CONCURRENT,
                },
                display: "max_concurrent (4294967295) must be <= 65535",
            },
            Case {
                name: "max_concurrent wins over revision and budget",
                builder: b(MODEL, u32::MAX)
                    .initial_revision(u64::MAX)
                    .token_budget(huge_budget),
                expected: ConfigError::MaxConcurrentTooLarge {
                    value: u32::MAX,
                    max: MAX_CONCURRENT,
                },
                display: "max_concurrent (4294967295) must be <= 65535",
            },
            Case {
                name: "initial_revision MAX_REVISION + 1",
                builder: b(MODEL, 4).initial_revision(MAX_REVISION + 1),
                expected: ConfigError::InitialRevisionTooLarge {
                    value: MAX_REVISION + 1,
                    max: MAX_REVISION,
                },
                display: "initial_revision (9007199254740992) must be <= 9007199254740991",
            },
            Case {
                name: "initial_revision u64::MAX",
                builder: b(MODEL, 4).initial_revision(u64::MAX),
                expected: ConfigError::InitialRevisionTooLarge {
                    value: u64::MAX,
                    max: MAX_REVISION,
                },
                display: "initial_revision (18446744073709551615) must be <= 9007199254740991",
            },
            Case {
                name: "initial_revision wins over budget",
                builder: b(MODEL, 4)
                    .initial_revision(u64::MAX)
                    .token_budget(huge_budget),
                expected: ConfigError::InitialRevisionTooLarge {
                    value: u64::MAX,
                    max: MAX_REVISION,
                },
                display: "initial_revision (18446744073709551615) must be <= 9007199254740991",
            },
            Case {
                name: "budget MAX_BUDGET + 1",
                builder: b(MODEL, 4).token_budget(TokenBudget::new(MAX_BUDGET + 1)),
                expected: ConfigError::BudgetTooLarge {
                    value: MAX_BUDGET + 1,
                    max: MAX_BUDGET,
                },
                display: "token_budget.budget (34359738368) must be <= 34359738367",
            },
            Case {
                name: "budget u64::MAX",
                builder: b(MODEL, 4).token_budget(TokenBudget::new(u64::MAX)),
                expected: ConfigError::BudgetTooLarge {
                    value: u64::MAX,
                    max: MAX_BUDGET,
                },
                display: "token_budget.budget (18446744073709551615) must be <= 34359738367",
            },
            Case {
                name: "budget too large wins over reserve above budget",
                builder: b(MODEL, 4).token_budget(huge_budget),
                expected: ConfigError::BudgetTooLarge {
                    value: u64::MAX,
                    max: MAX_BUDGET,
                },
                display: "token_budget.budget (18446744073709551615) must be <= 34359738367",
            },
            Case {
                name: "reserve budget + 1",
                builder: b(MODEL, 4).token_budget(TokenBudget::new(100).high_priority_reserve(101)),
                expected: ConfigError::ReserveExceedsBudget {
                    reserve: 101,
                    budget: 100,
                },
                display: "token_budget.high_priority_reserve (101) must be <= token_budget.budget (100)",
            },
            Case {
                name: "reserve 1 over budget 0",
                builder: b(MODEL, 4).token_budget(TokenBudget::new(0).high_priority_reserve(1)),
                expected: ConfigError::ReserveExceedsBudget {
                    reserve: 1,
                    budget: 0,
                },
                display: "token_budget.high_priority_reserve (1) must be <= token_budget.budget (0)",
            },
            Case {
                name: "reserve u64::MAX over budget MAX_BUDGET",
                builder: b(MODEL, 4)
                    .token_budget(TokenBudget::new(MAX_BUDGET).high_priority_reserve(u64::MAX)),
                expected: ConfigError::ReserveExceedsBudget {
                    reserve: u64::MAX,
                    budget: MAX_BUDGET,
                },
                display: "token_budget.high_priority_reserve (18446744073709551615) must be <= token_budget.budget (34359738367)",
            },
            Case {
                name: "reserve MAX_BUDGET + 1 over budget MAX_BUDGET",
                builder: b(MODEL, 4).token_budget(
                    TokenBudget::new(MAX_BUDGET).high_priority_reserve(MAX_BUDGET + 1),
                ),
                expected: ConfigError::ReserveExceedsBudget {
                    reserve: MAX_BUDGET + 1,
                    budget: MAX_BUDGET,
                },
                display: "token_budget.high_priority_reserve (34359738368) must be <= token_budget.budget (34359738367)",
            },
        ]
    }

    #[test]
    fn every_invalid_configuration_is_refused_with_its_typed_error_in_the_documented_order() {
        for case in cases() {
            let err = case.builder.build().expect_err(case.name);
            assert_eq!(err, case.expected, "{}", case.name);
            assert_eq!(err.to_string(), case.display, "{}: Display", case.name);
            // The spec's wording (upstream §1.4 / §16) for the model is a prefix of ours.
            if let ConfigError::EmptyModel { .. } = err {
                assert!(
                    err.to_string()
                        .starts_with("model must be a non-empty string")
                );
            }
        }
    }

    #[test]
    fn a_refused_build_leaves_the_builder_reusable_once_the_input_is_fixed() {
        // The builder is Clone: the refused clone changed nothing in the original.
        let builder = LlmBulkhead::builder(MODEL, 4)
            .initial_revision(7)
            .token_budget(TokenBudget::new(100).high_priority_reserve(101));
        assert!(builder.clone().build().is_err());
        assert!(
            builder.clone().build().is_err(),
            "refusing twice is the same"
        );
        let fixed = builder
            .token_budget(TokenBudget::new(100).high_priority_reserve(100))
            .build()
            .expect("fixed configuration");
        assert_eq!(
            fixed.limits(),
            Limits::new(7, 4).with_token_budget(100, 100)
        );
        let fresh = LlmBulkhead::builder(MODEL, 4)
            .initial_revision(7)
            .token_budget(TokenBudget::new(100).high_priority_reserve(100))
            .build()
            .unwrap();
        assert_eq!(fixed.stats(), fresh.stats());
        assert_eq!(probe(&fixed), probe(&fresh));
    }

    #[test]
    fn models_with_surrounding_whitespace_or_odd_characters_are_accepted() {
        for model in [" m ", "\tm", "\u{3000}m\u{3000}", "m\0", "\u{200b}"] {
            let b = LlmBulkhead::builder(model, 1)
                .build()
                .unwrap_or_else(|e| panic!("{model:?}: {e}"));
            assert_eq!(b.model(), model, "the model is kept as given");
        }
    }

    #[test]
    fn valid_edge_values_are_accepted_and_reported_as_limits() {
        let edges: Vec<(&str, LlmBulkheadBuilder, Limits, Option<Duration>)> = vec![
            (
                "max_concurrent 0",
                LlmBulkhead::builder(MODEL, 0),
                Limits::new(0, 0),
                None,
            ),
            (
                "max_concurrent MAX_CONCURRENT",
                LlmBulkhead::builder(MODEL, MAX_CONCURRENT),
                Limits::new(0, MAX_CONCURRENT),
                None,
            ),
            (
                "initial_revision MAX_REVISION",
                LlmBulkhead::builder(MODEL, 1).initial_revision(MAX_REVISION),
                Limits::new(MAX_REVISION, 1),
                None,
            ),
            (
                "budget 0 reserve 0 output cap 0",
                LlmBulkhead::builder(MODEL, 1).token_budget(TokenBudget::new(0).output_cap(0)),
                Limits::new(0, 1).with_token_budget(0, 0),
                None,
            ),
            (
                "budget MAX_BUDGET reserve MAX_BUDGET output cap u64::MAX",
                LlmBulkhead::builder(MODEL, 1).token_budget(
                    TokenBudget::new(MAX_BUDGET)
                        .high_priority_reserve(MAX_BUDGET)
                        .output_cap(u64::MAX),
                ),
                Limits::new(0, 1).with_token_budget(MAX_BUDGET, MAX_BUDGET),
                None,
            ),
            (
                "max_queue u32::MAX, zero queue timeout",
                LlmBulkhead::builder(MODEL, 1)
                    .max_queue(u32::MAX)
                    .queue_timeout(Duration::ZERO),
                Limits::new(0, 1).with_max_queue(u32::MAX),
                Some(Duration::ZERO),
            ),
            (
                "queue timeout Duration::MAX",
                LlmBulkhead::builder(MODEL, 1).queue_timeout(Duration::MAX),
                Limits::new(0, 1),
                Some(Duration::MAX),
            ),
            (
                "custom profile with u32::MAX places and Duration::MAX",
                LlmBulkhead::builder(MODEL, 1).profile(Profile::Custom {
                    max_queue: u32::MAX,
                    timeout: Some(Duration::MAX),
                }),
                Limits::new(0, 1).with_max_queue(u32::MAX),
                Some(Duration::MAX),
            ),
            (
                "custom profile with 0 places and no timeout",
                LlmBulkhead::builder(MODEL, 1).profile(Profile::Custom {
                    max_queue: 0,
                    timeout: None,
                }),
                Limits::new(0, 1),
                None,
            ),
        ];
        for (name, builder, limits, timeout) in edges {
            let b = builder.build().unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(b.limits(), limits, "{name}");
            assert_eq!(b.queue_timeout(), timeout, "{name}");
            let stats = b.stats();
            assert_eq!(
                (
                    stats.in_flight,
                    stats.pending,
                    stats.admitted,
                    stats.rejected
                ),
                (0, 0, 0, 0),
                "{name}"
            );
        }
    }
}

// =============================================================================================
// apply_limits
// =============================================================================================

mod apply_limits {
    use super::*;

    /// Current limits of the plain twin: revision 5, 2 slots, no budget.
    fn plain_twin() -> Twin {
        Twin::new(|| {
            LlmBulkhead::builder(MODEL, 2)
                .initial_revision(5)
                .max_queue(1)
                .build()
                .unwrap()
        })
    }

    /// Current limits of the budgeted twin: revision 5, 2 slots, budget 1000, reserve 100.
    fn budget_twin() -> Twin {
        Twin::new(|| {
            LlmBulkhead::builder(MODEL, 2)
                .initial_revision(5)
                .token_budget(TokenBudget::new(1000).high_priority_reserve(100))
                .build()
                .unwrap()
        })
    }

    struct Case {
        name: &'static str,
        next: Limits,
        expected: Result<(), LimitsError>,
        display: Option<&'static str>,
    }

    fn err(name: &'static str, next: Limits, e: LimitsError, display: &'static str) -> Case {
        Case {
            name,
            next,
            expected: Err(e),
            display: Some(display),
        }
    }

    /// `Ok(())` here means `Ok(ApplyOutcome::Stale)` with the current limits.
    fn stale(name: &'static str, next: Limits) -> Case {
        Case {
            name,
            next,
            expected: Ok(()),
            display: None,
        }
    }

    fn run_cases(make: fn() -> Twin, cases: Vec<Case>) {
        for case in cases {
            let mut twin = make();
            // A permit in flight on both, so "nothing changed" includes the admission word.
            twin.hold(with_res(1, 2));
            let before = twin.subject.limits();
            let outcome = twin.subject.apply_limits(case.next);
            match (&outcome, &case.expected) {
                (Err(e), Err(expected)) => {
                    assert_eq!(e, expected, "{}", case.name);
                    assert_eq!(Some(e.to_string().as_str()), case.display, "{}", case.name);
                }
                (Ok(ApplyOutcome::Stale { current }), Ok(())) => {
                    assert_eq!(
                        *current, before,
                        "{}: stale reports the limits in force",
                        case.name
                    );
                }
                _ => panic!(
                    "{}: got {outcome:?}, expected {:?}",
                    case.name, case.expected
                ),
            }
            assert_eq!(twin.subject.limits(), before, "{}", case.name);
            assert!(
                !twin.subject_events().contains(&EventKind::Reconfigure),
                "{}: no reconfigure event",
                case.name
            );
            twin.assert_behaves_like_control(case.name);
        }
    }

    #[test]
    fn invalid_and_stale_snapshots_change_nothing_on_a_bulkhead_without_budget() {
        run_cases(
            plain_twin,
            vec![
                err(
                    "revision MAX_REVISION + 1",
                    Limits::new(MAX_REVISION + 1, 1),
                    LimitsError::RevisionTooLarge {
                        value: MAX_REVISION + 1,
                        max: MAX_REVISION,
                    },
                    "limits.revision (9007199254740992) must be <= 9007199254740991",
                ),
                err(
                    "revision u64::MAX wins over every other invalid field",
                    Limits::new(u64::MAX, u32::MAX).with_token_budget(u64::MAX, u64::MAX),
                    LimitsError::RevisionTooLarge {
                        value: u64::MAX,
                        max: MAX_REVISION,
                    },
                    "limits.revision (18446744073709551615) must be <= 9007199254740991",
                ),
                err(
                    "max_concurrent MAX_CONCURRENT + 1",
                    Limits::new(6, MAX_CONCURRENT + 1),
                    LimitsError::MaxConcurrentTooLarge {
                        value: MAX_CONCURRENT + 1,
                        max: MAX_CONCURRENT,
                    },
                    "limits.max_concurrent (65536) must be <= 65535",
                ),
                err(
                    "max_concurrent u32::MAX wins over the budget shape",
                    Limits::new(6, u32::MAX).with_token_budget(1, 0),
                    LimitsError::MaxConcurrentTooLarge {
                        value: u32::MAX,
                        max: MAX_CONCURRENT,
                    },
                    "limits.max_concurrent (4294967295) must be <= 65535",
                ),
                err(
                    "a token budget on a bulkhead built without one",
                    Limits::new(6, 1).with_token_budget(0, 0),
                    LimitsError::TokenBudgetNotConfigured,
                    "limits.token_budget must be omitted because no token budget was configured at construction",
                ),
                err(
                    "a huge token budget on a bulkhead built without one is a shape error",
                    Limits::new(MAX_REVISION, MAX_CONCURRENT).with_token_budget(u64::MAX, u64::MAX),
                    LimitsError::TokenBudgetNotConfigured,
                    "limits.token_budget must be omitted because no token budget was configured at construction",
                ),
                stale("equal revision", Limits::new(5, 9)),
                stale("revision 0", Limits::new(0, 9)),
                stale("lower revision 4", Limits::new(4, 9)),
                stale(
                    "stale with every other field invalid is not examined",
                    Limits::new(4, u32::MAX).with_token_budget(u64::MAX, u64::MAX),
                ),
                stale(
                    "equal revision with max_concurrent 0 (would be a kill switch)",
                    Limits::new(5, 0),
                ),
            ],
        );
    }

    #[test]
    fn invalid_and_stale_snapshots_change_nothing_on_a_bulkhead_with_budget() {
        run_cases(
            budget_twin,
            vec![
                err(
                    "no token budget on a bulkhead built with one",
                    Limits::new(6, 1),
                    LimitsError::TokenBudgetRequired,
                    "limits.token_budget is required because a token budget was configured at construction",
                ),
                err(
                    "budget MAX_BUDGET + 1",
                    Limits::new(6, 1).with_token_budget(MAX_BUDGET + 1, 0),
                    LimitsError::BudgetTooLarge {
                        value: MAX_BUDGET + 1,
                        max: MAX_BUDGET,
                    },
                    "limits.token_budget.budget (34359738368) must be <= 34359738367",
                ),
                err(
                    "budget u64::MAX and reserve u64::MAX",
                    Limits::new(6, 1).with_token_budget(u64::MAX, u64::MAX),
                    LimitsError::BudgetTooLarge {
                        value: u64::MAX,
                        max: MAX_BUDGET,
                    },
                    "limits.token_budget.budget (18446744073709551615) must be <= 34359738367",
                ),
                err(
                    "max_concurrent wins over the budget size",
                    Limits::new(6, MAX_CONCURRENT + 1).with_token_budget(u64::MAX, 0),
                    LimitsError::MaxConcurrentTooLarge {
                        value: MAX_CONCURRENT + 1,
                        max: MAX_CONCURRENT,
                    },
                    "limits.max_concurrent (65536) must be <= 65535",
                ),
                err(
                    "revision wins over a missing budget",
                    Limits::new(MAX_REVISION + 1, 1),
                    LimitsError::RevisionTooLarge {
                        value: MAX_REVISION + 1,
                        max: MAX_REVISION,
                    },
                    "limits.revision (9007199254740992) must be <= 9007199254740991",
                ),
                stale(
                    "equal revision without budget is not examined",
                    Limits::new(5, 1),
                ),
                stale(
                    "lower revision with a huge budget is not examined",
                    Limits::new(1, u32::MAX).with_token_budget(u64::MAX, 0),
                ),
                stale(
                    "equal revision with a valid new budget",
                    Limits::new(5, 3).with_token_budget(5, 0),
                ),
            ],
        );
    }

    #[test]
    fn at_max_revision_every_snapshot_is_stale_or_too_large() {
        let make = || {
            Twin::new(|| {
                LlmBulkhead::builder(MODEL, 2)
                    .initial_revision(MAX_REVISION)
                    .token_budget(TokenBudget::new(1000))
                    .build()
                    .unwrap()
            })
        };
        run_cases(
            make,
            vec![
                stale(
                    "MAX_REVISION again",
                    Limits::new(MAX_REVISION, 9).with_token_budget(9, 0),
                ),
                err(
                    "MAX_REVISION + 1 is too large, not newer",
                    Limits::new(MAX_REVISION + 1, 9).with_token_budget(9, 0),
                    LimitsError::RevisionTooLarge {
                        value: MAX_REVISION + 1,
                        max: MAX_REVISION,
                    },
                    "limits.revision (9007199254740992) must be <= 9007199254740991",
                ),
            ],
        );
    }

    #[test]
    fn valid_edge_snapshots_are_applied_and_behave_as_documented() {
        let b = budgeted(2, 1000, 100);
        let held = b
            .try_acquire(&LlmRequest::new(), with_res(300, 300))
            .unwrap();

        // Jump straight to the largest revision, with every field at its largest value.
        let next = Limits::new(MAX_REVISION, MAX_CONCURRENT)
            .with_max_queue(u32::MAX)
            .with_token_budget(MAX_BUDGET, MAX_BUDGET);
        let outcome = b.apply_limits(next).unwrap();
        assert_eq!(
            outcome,
            ApplyOutcome::Applied {
                previous: Limits::new(0, 2).with_token_budget(1000, 100),
                current: next
            }
        );
        assert_eq!(b.limits(), next);
        assert_eq!(held.limit_revision(), 0, "a permit keeps its revision");
        // Normal priority may use nothing (reserve == budget): with 600 tokens in flight even
        // a 0-token call is over its effective budget. High priority may use the rest.
        for normal in [with_res(0, 1), with_res(0, 0)] {
            assert_eq!(
                b.would_admit(&LlmRequest::new(), normal).unwrap(),
                Verdict::Reject(RejectReason::BudgetLimit)
            );
        }
        assert_eq!(
            b.would_admit(
                &LlmRequest::new(),
                with_res(MAX_BUDGET - 600, 0).priority(Priority::High)
            )
            .unwrap(),
            Verdict::Admit
        );
        assert_eq!(
            b.would_admit(
                &LlmRequest::new(),
                with_res(MAX_BUDGET - 599, 0).priority(Priority::High)
            )
            .unwrap(),
            Verdict::Reject(RejectReason::BudgetLimit)
        );
        // Nothing newer exists now.
        assert!(!b.apply_limits(next).unwrap().is_applied());
        assert_eq!(
            b.set_budget(1),
            Err(LimitsError::RevisionExhausted {
                current: MAX_REVISION
            })
        );
        drop(held);
        assert_eq!(b.stats().token_budget.unwrap().in_flight_tokens, 0);

        // A reserve above the budget is allowed at runtime: normal priority gets nothing.
        let b = budgeted(2, 1000, 0);
        b.apply_limits(Limits::new(1, 2).with_token_budget(1000, u64::MAX))
            .unwrap();
        let zero = b.try_acquire(&LlmRequest::new(), with_res(0, 0)).unwrap();
        let err = b
            .try_acquire(&LlmRequest::new(), with_res(0, 1))
            .unwrap_err();
        let detail = err.rejection().unwrap().detail().token_budget.unwrap();
        assert_eq!(
            detail,
            TokenBudgetDetail::compute(1000, u64::MAX, false, 0, 1)
        );
        assert_eq!((detail.effective_budget, detail.available), (0, 0));
        let high = b
            .try_acquire(
                &LlmRequest::new(),
                with_res(0, 1000).priority(Priority::High),
            )
            .unwrap();
        drop((zero, high));

        // Budget 0 and max_concurrent 0: a fail-closed kill switch.
        b.apply_limits(Limits::new(2, 0).with_max_queue(5).with_token_budget(0, 0))
            .unwrap();
        let err = b
            .try_acquire(&LlmRequest::new(), with_res(0, 0))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "bulkhead rejected: concurrency_limit (max_concurrent is 0)"
        );
        let err = block_on(b.acquire(&LlmRequest::new(), with_res(0, 0))).unwrap_err();
        assert_eq!(
            err.rejection().unwrap().reason(),
            RejectReason::ConcurrencyLimit,
            "zero concurrency never queues"
        );
        assert_eq!(b.stats().pending, 0);
    }
}

// =============================================================================================
// set_budget
// =============================================================================================

mod set_budget {
    use super::*;

    #[test]
    fn invalid_budgets_change_nothing() {
        type Case = (
            &'static str,
            fn() -> LlmBulkhead,
            u64,
            LimitsError,
            &'static str,
        );
        let cases: Vec<Case> = vec![
            (
                "no budget configured, tokens 0",
                || plain(2),
                0,
                LimitsError::TokenBudgetNotConfigured,
                "limits.token_budget must be omitted because no token budget was configured at construction",
            ),
            (
                "no budget configured wins over tokens u64::MAX",
                || plain(2),
                u64::MAX,
                LimitsError::TokenBudgetNotConfigured,
                "limits.token_budget must be omitted because no token budget was configured at construction",
            ),
            (
                "tokens MAX_BUDGET + 1",
                || budgeted(2, 1000, 100),
                MAX_BUDGET + 1,
                LimitsError::BudgetTooLarge {
                    value: MAX_BUDGET + 1,
                    max: MAX_BUDGET,
                },
                "limits.token_budget.budget (34359738368) must be <= 34359738367",
            ),
            (
                "tokens u64::MAX",
                || budgeted(2, 1000, 100),
                u64::MAX,
                LimitsError::BudgetTooLarge {
                    value: u64::MAX,
                    max: MAX_BUDGET,
                },
                "limits.token_budget.budget (18446744073709551615) must be <= 34359738367",
            ),
            (
                "revision exhausted",
                || {
                    LlmBulkhead::builder(MODEL, 2)
                        .initial_revision(MAX_REVISION)
                        .token_budget(TokenBudget::new(1000))
                        .build()
                        .unwrap()
                },
                10,
                LimitsError::RevisionExhausted {
                    current: MAX_REVISION,
                },
                "cannot advance the limit revision beyond 9007199254740991 (the largest revision)",
            ),
            (
                "revision exhausted is reported before the budget size (documented order)",
                || {
                    LlmBulkhead::builder(MODEL, 2)
                        .initial_revision(MAX_REVISION)
                        .token_budget(TokenBudget::new(1000))
                        .build()
                        .unwrap()
                },
                u64::MAX,
                LimitsError::RevisionExhausted {
                    current: MAX_REVISION,
                },
                "cannot advance the limit revision beyond 9007199254740991 (the largest revision)",
            ),
        ];
        for (name, build, tokens, expected, display) in cases {
            let mut twin = Twin::new(build);
            if twin.subject.limits().token_budget.is_some() {
                twin.hold(with_res(10, 10));
            } else {
                twin.hold(AcquireOptions::new());
            }
            let err = twin.subject.set_budget(tokens).expect_err(name);
            assert_eq!(err, expected, "{name}");
            assert_eq!(err.to_string(), display, "{name}");
            assert!(
                !twin.subject_events().contains(&EventKind::Reconfigure),
                "{name}: no reconfigure event"
            );
            twin.assert_behaves_like_control(name);
        }
    }

    #[test]
    fn valid_edge_budgets_are_installed_at_the_next_revision_keeping_the_reserve() {
        let b = LlmBulkhead::builder(MODEL, 2)
            .initial_revision(MAX_REVISION - 2)
            .token_budget(TokenBudget::new(1000).high_priority_reserve(100))
            .build()
            .unwrap();
        let held = b
            .try_acquire(&LlmRequest::new(), with_res(200, 300))
            .unwrap();

        // Below the tokens in flight: allowed (shrink by attrition).
        let now = b.set_budget(0).unwrap();
        assert_eq!(
            now,
            Limits::new(MAX_REVISION - 1, 2).with_token_budget(0, 100)
        );
        assert_eq!(
            b.try_acquire(&LlmRequest::new(), with_res(0, 0).priority(Priority::High))
                .unwrap_err()
                .rejection()
                .unwrap()
                .reason(),
            RejectReason::BudgetLimit,
            "tokens above the budget refuse even a 0-token call"
        );
        let now = b.set_budget(MAX_BUDGET).unwrap();
        assert_eq!(
            now,
            Limits::new(MAX_REVISION, 2).with_token_budget(MAX_BUDGET, 100)
        );
        assert_eq!(b.limits(), now);
        assert_eq!(
            b.set_budget(MAX_BUDGET),
            Err(LimitsError::RevisionExhausted {
                current: MAX_REVISION
            })
        );
        drop(held);
        let t = b.stats().token_budget.unwrap();
        assert_eq!((t.in_flight_tokens, t.available), (0, MAX_BUDGET));
    }
}

// =============================================================================================
// Reservation::new, Reservation::with_reserved, TokenUsage::new, TokenEstimate::reservation
// =============================================================================================

mod constructors {
    use super::*;

    #[test]
    fn reservation_new_refuses_sums_that_overflow() {
        let ok: [(u64, u64); 6] = [
            (0, 0),
            (u64::MAX, 0),
            (0, u64::MAX),
            (u64::MAX - 1, 1),
            (1, u64::MAX - 1),
            (MAX_BUDGET, MAX_BUDGET),
        ];
        for (input, max_output) in ok {
            let r = Reservation::new(input, max_output).unwrap();
            assert_eq!(
                (r.input(), r.max_output(), r.reserved()),
                (input, max_output, input + max_output)
            );
            assert_eq!(TokenEstimate::new(input, max_output).reservation(), Ok(r));
        }
        let overflowing: [(u64, u64); 5] = [
            (u64::MAX, 1),
            (1, u64::MAX),
            (u64::MAX, u64::MAX),
            (u64::MAX - 1, 2),
            (u64::MAX / 2 + 1, u64::MAX / 2 + 1),
        ];
        for (input, max_output) in overflowing {
            let expected = RequestError::ReservationOverflow { input, max_output };
            assert_eq!(Reservation::new(input, max_output), Err(expected));
            assert_eq!(
                TokenEstimate::new(input, max_output).reservation(),
                Err(expected)
            );
            assert_eq!(
                expected.to_string(),
                format!(
                    "token reservation ({input} input + {max_output} max output) does not fit in 64 bits"
                )
            );
        }
    }

    #[test]
    fn reservation_with_reserved_refuses_inconsistent_totals() {
        let cases: [(u64, u64, u64, Result<u64, RequestError>); 12] = [
            (100, 1000, 1100, Ok(1100)),
            (0, 0, 0, Ok(0)),
            (u64::MAX, 0, u64::MAX, Ok(u64::MAX)),
            (u64::MAX - 1, 1, u64::MAX, Ok(u64::MAX)),
            (
                100,
                1000,
                999,
                Err(RequestError::ReservedMismatch {
                    reserved: 999,
                    input: 100,
                    max_output: 1000,
                }),
            ),
            (
                100,
                1000,
                1101,
                Err(RequestError::ReservedMismatch {
                    reserved: 1101,
                    input: 100,
                    max_output: 1000,
                }),
            ),
            (
                1,
                2,
                0,
                Err(RequestError::ReservedMismatch {
                    reserved: 0,
                    input: 1,
                    max_output: 2,
                }),
            ),
            (
                0,
                0,
                u64::MAX,
                Err(RequestError::ReservedMismatch {
                    reserved: u64::MAX,
                    input: 0,
                    max_output: 0,
                }),
            ),
            (
                u64::MAX - 1,
                0,
                u64::MAX,
                Err(RequestError::ReservedMismatch {
                    reserved: u64::MAX,
                    input: u64::MAX - 1,
                    max_output: 0,
                }),
            ),
            // An overflowing sum is reported as such, whatever `reserved` says.
            (
                u64::MAX,
                1,
                0,
                Err(RequestError::ReservationOverflow {
                    input: u64::MAX,
                    max_output: 1,
                }),
            ),
            (
                u64::MAX,
                1,
                u64::MAX,
                Err(RequestError::ReservationOverflow {
                    input: u64::MAX,
                    max_output: 1,
                }),
            ),
            (
                u64::MAX,
                u64::MAX,
                u64::MAX - 1,
                Err(RequestError::ReservationOverflow {
                    input: u64::MAX,
                    max_output: u64::MAX,
                }),
            ),
        ];
        for (input, max_output, reserved, expected) in cases {
            let got = Reservation::with_reserved(input, max_output, reserved);
            assert_eq!(
                got.map(|r| r.reserved()),
                expected,
                "({input}, {max_output}, {reserved})"
            );
        }
        // Display of the mismatch (upstream §16, snake_case in Rust).
        assert_eq!(
            Reservation::with_reserved(100, 1000, 999)
                .unwrap_err()
                .to_string(),
            "reservation.reserved (999) must equal reservation.input + reservation.max_output (1100)"
        );
        assert_eq!(
            Reservation::with_reserved(0, 0, u64::MAX)
                .unwrap_err()
                .to_string(),
            "reservation.reserved (18446744073709551615) must equal reservation.input + reservation.max_output (0)"
        );
    }

    #[test]
    fn token_usage_new_refuses_totals_that_overflow() {
        for (input, output) in [(0, 0), (u64::MAX, 0), (0, u64::MAX), (u64::MAX - 1, 1)] {
            let u = TokenUsage::new(input, output).unwrap();
            assert_eq!(u.total(), input + output);
        }
        for (input, output) in [(u64::MAX, 1), (1, u64::MAX), (u64::MAX, u64::MAX)] {
            let err = TokenUsage::new(input, output).unwrap_err();
            assert_eq!(err, UsageError::TotalOverflow { input, output });
            assert_eq!(
                err.to_string(),
                format!(
                    "token usage total ({input} input + {output} output) does not fit in 64 bits"
                )
            );
            assert!(
                err.to_string().starts_with("token usage"),
                "upstream §16: /token usage/"
            );
        }
    }
}

// =============================================================================================
// try_acquire, try_acquire_owned, acquire, acquire_owned, acquire_blocking(_owned),
// would_admit(_with_detail), estimate, run, run_with_usage: unrepresentable requests
// =============================================================================================

mod requests {
    use super::*;

    const BUDGET: u64 = 10_000;
    const RESERVE: u64 = 100;

    fn default_estimator(max_concurrent: u32) -> LlmBulkhead {
        budgeted(max_concurrent, BUDGET, RESERVE)
    }

    fn tiny_ratio_estimator(max_concurrent: u32) -> LlmBulkhead {
        LlmBulkhead::builder(MODEL, max_concurrent)
            .token_budget(TokenBudget::new(BUDGET).high_priority_reserve(RESERVE))
            .estimator(
                ModelAwareEstimator::builder()
                    .default_model(MODEL)
                    .ratio("tiny", f64::MIN_POSITIVE)
                    .build()
                    .unwrap(),
            )
            .build()
            .unwrap()
    }

    fn opaque_max_estimator(max_concurrent: u32) -> LlmBulkhead {
        LlmBulkhead::builder(MODEL, max_concurrent)
            .token_budget(TokenBudget::new(BUDGET).high_priority_reserve(RESERVE))
            .estimator(
                ModelAwareEstimator::builder()
                    .default_model(MODEL)
                    .opaque_block_tokens(OpaqueBlockTokens::Each(u64::MAX))
                    .build()
                    .unwrap(),
            )
            .build()
            .unwrap()
    }

    fn closure_estimator(max_concurrent: u32) -> LlmBulkhead {
        LlmBulkhead::builder(MODEL, max_concurrent)
            .token_budget(TokenBudget::new(BUDGET).high_priority_reserve(RESERVE))
            .estimator(|_: &LlmRequest| TokenEstimate::new(u64::MAX, 1))
            .build()
            .unwrap()
    }

    fn naive_huge_cap(max_concurrent: u32) -> LlmBulkhead {
        LlmBulkhead::builder(MODEL, max_concurrent)
            .token_budget(TokenBudget::new(BUDGET).high_priority_reserve(RESERVE))
            .estimator(NaiveEstimator::new().output_cap(u64::MAX))
            .build()
            .unwrap()
    }

    fn huge_output_cap_default(max_concurrent: u32) -> LlmBulkhead {
        LlmBulkhead::builder(MODEL, max_concurrent)
            .token_budget(
                TokenBudget::new(BUDGET)
                    .high_priority_reserve(RESERVE)
                    .output_cap(u64::MAX),
            )
            .build()
            .unwrap()
    }

    pub(super) struct Case {
        pub(super) name: &'static str,
        pub(super) build: fn(u32) -> LlmBulkhead,
        pub(super) request: LlmRequest,
        pub(super) expected: RequestError,
        pub(super) display: &'static str,
    }

    pub(super) fn cases() -> Vec<Case> {
        let x = |n: usize| LlmRequest::new().user("x".repeat(n));
        let mut completion = x(4);
        completion.max_completion_tokens = Some(u64::MAX);
        vec![
            Case {
                name: "extra_input_tokens u64::MAX on top of 2 text tokens",
                build: default_estimator,
                request: x(8).extra_input_tokens(u64::MAX),
                expected: RequestError::InputOverflow {
                    text_tokens: 2,
                    opaque_tokens: 0,
                    extra_input_tokens: u64::MAX,
                },
                display: "estimated input (2 text tokens + 0 opaque-block tokens + 18446744073709551615 extra input tokens) does not fit in 64 bits",
            },
            Case {
                name: "extra_input_tokens u64::MAX - 1 on top of 2 text tokens",
                build: default_estimator,
                request: x(5).extra_input_tokens(u64::MAX - 1),
                expected: RequestError::InputOverflow {
                    text_tokens: 2,
                    opaque_tokens: 0,
                    extra_input_tokens: u64::MAX - 1,
                },
                display: "estimated input (2 text tokens + 0 opaque-block tokens + 18446744073709551614 extra input tokens) does not fit in 64 bits",
            },
            Case {
                name: "input u64::MAX plus the default output cap",
                build: default_estimator,
                request: LlmRequest::new().extra_input_tokens(u64::MAX),
                expected: RequestError::ReservationOverflow {
                    input: u64::MAX,
                    max_output: 2048,
                },
                display: "token reservation (18446744073709551615 input + 2048 max output) does not fit in 64 bits",
            },
            Case {
                name: "input + output overflows by exactly one",
                build: default_estimator,
                request: x(4).extra_input_tokens(u64::MAX - 2048),
                expected: RequestError::ReservationOverflow {
                    input: u64::MAX - 2047,
                    max_output: 2048,
                },
                display: "token reservation (18446744073709549568 input + 2048 max output) does not fit in 64 bits",
            },
            Case {
                name: "max_tokens u64::MAX with 1 input token",
                build: default_estimator,
                request: x(1).max_tokens(u64::MAX),
                expected: RequestError::ReservationOverflow {
                    input: 1,
                    max_output: u64::MAX,
                },
                display: "token reservation (1 input + 18446744073709551615 max output) does not fit in 64 bits",
            },
            Case {
                name: "max_tokens u64::MAX - 1 with 2 input tokens",
                build: default_estimator,
                request: x(8).max_tokens(u64::MAX - 1),
                expected: RequestError::ReservationOverflow {
                    input: 2,
                    max_output: u64::MAX - 1,
                },
                display: "token reservation (2 input + 18446744073709551614 max output) does not fit in 64 bits",
            },
            Case {
                name: "max_completion_tokens u64::MAX with 1 input token",
                build: default_estimator,
                request: completion,
                expected: RequestError::ReservationOverflow {
                    input: 1,
                    max_output: u64::MAX,
                },
                display: "token reservation (1 input + 18446744073709551615 max output) does not fit in 64 bits",
            },
            Case {
                name: "a default output cap of u64::MAX with 1 input token",
                build: huge_output_cap_default,
                request: x(1),
                expected: RequestError::ReservationOverflow {
                    input: 1,
                    max_output: u64::MAX,
                },
                display: "token reservation (1 input + 18446744073709551615 max output) does not fit in 64 bits",
            },
            Case {
                name: "a tiny chars-per-token override makes one character unrepresentable",
                build: tiny_ratio_estimator,
                request: x(1).model("tiny"),
                expected: RequestError::TextTooLarge { chars: 1 },
                display: "estimated input for 1 characters does not fit in 64 bits",
            },
            Case {
                name: "two opaque blocks of u64::MAX each",
                build: opaque_max_estimator,
                request: LlmRequest::new().user(vec![
                    ContentBlock::opaque("image"),
                    ContentBlock::opaque("image"),
                ]),
                expected: RequestError::InputOverflow {
                    text_tokens: 0,
                    opaque_tokens: u64::MAX,
                    extra_input_tokens: 0,
                },
                display: "estimated input (0 text tokens + 18446744073709551615 opaque-block tokens + 0 extra input tokens) does not fit in 64 bits",
            },
            Case {
                name: "an opaque block of u64::MAX in the system prompt plus 1 extra token",
                build: opaque_max_estimator,
                request: LlmRequest::new()
                    .system(vec![ContentBlock::opaque("document")])
                    .extra_input_tokens(1),
                expected: RequestError::InputOverflow {
                    text_tokens: 0,
                    opaque_tokens: u64::MAX,
                    extra_input_tokens: 1,
                },
                display: "estimated input (0 text tokens + 18446744073709551615 opaque-block tokens + 1 extra input tokens) does not fit in 64 bits",
            },
            Case {
                name: "one opaque block of u64::MAX plus the default output cap",
                build: opaque_max_estimator,
                request: LlmRequest::new().user(vec![ContentBlock::opaque("image")]),
                expected: RequestError::ReservationOverflow {
                    input: u64::MAX,
                    max_output: 2048,
                },
                display: "token reservation (18446744073709551615 input + 2048 max output) does not fit in 64 bits",
            },
            Case {
                name: "a closure estimator answering u64::MAX + 1",
                build: closure_estimator,
                request: LlmRequest::new(),
                expected: RequestError::ReservationOverflow {
                    input: u64::MAX,
                    max_output: 1,
                },
                display: "token reservation (18446744073709551615 input + 1 max output) does not fit in 64 bits",
            },
            Case {
                name: "the naive estimator with output cap u64::MAX",
                build: naive_huge_cap,
                request: x(1),
                expected: RequestError::ReservationOverflow {
                    input: 1,
                    max_output: u64::MAX,
                },
                display: "token reservation (1 input + 18446744073709551615 max output) does not fit in 64 bits",
            },
            Case {
                name: "the naive estimator with extra_input_tokens u64::MAX",
                build: naive_huge_cap,
                request: x(1).extra_input_tokens(u64::MAX),
                expected: RequestError::InputOverflow {
                    text_tokens: 1,
                    opaque_tokens: 0,
                    extra_input_tokens: u64::MAX,
                },
                display: "estimated input (1 text tokens + 0 opaque-block tokens + 18446744073709551615 extra input tokens) does not fit in 64 bits",
            },
        ]
    }

    /// The states a request is judged in: the error must come before any capacity decision
    /// (RUST-DESIGN Q9/Q10), so it is the same whether the bulkhead is open, closed, fail-closed
    /// or full.
    #[derive(Clone, Copy, Debug)]
    enum State {
        Open,
        Closed,
        ZeroConcurrency,
        BudgetFull,
        SlotsFullWithQueue,
    }

    const STATES: [State; 5] = [
        State::Open,
        State::Closed,
        State::ZeroConcurrency,
        State::BudgetFull,
        State::SlotsFullWithQueue,
    ];

    fn twin_in(state: State, build: fn(u32) -> LlmBulkhead) -> Twin {
        let mut twin = match state {
            State::ZeroConcurrency => Twin::new(|| build(0)),
            State::SlotsFullWithQueue => Twin::new(|| {
                let b = build(1);
                b.apply_limits({
                    let mut next = b.limits();
                    next.revision += 1;
                    next.max_queue = 4;
                    next
                })
                .unwrap();
                b
            }),
            _ => Twin::new(|| build(4)),
        };
        match state {
            State::Closed => {
                twin.both(LlmBulkhead::close);
            }
            State::BudgetFull => {
                twin.hold(with_res(BUDGET, 0).priority(Priority::High));
            }
            State::SlotsFullWithQueue => twin.hold(with_res(1, 1)),
            State::Open | State::ZeroConcurrency => {}
        }
        twin
    }

    #[test]
    fn unrepresentable_requests_are_refused_by_every_entry_point_in_every_state_changing_nothing() {
        let mut checked = 0;
        for case in cases() {
            assert_eq!(case.expected.to_string(), case.display, "{}", case.name);
            let acquire_display = format!("invalid request: {}", case.display);
            assert_eq!(
                AcquireError::Invalid(case.expected).to_string(),
                acquire_display
            );
            for state in STATES {
                for entry in ENTRIES {
                    for priority in [Priority::Normal, Priority::High] {
                        let label = format!("{} / {state:?} / {entry:?} / {priority:?}", case.name);
                        let twin = twin_in(state, case.build);
                        let options = AcquireOptions::new()
                            .priority(priority)
                            .timeout(Duration::from_secs(3600));
                        let outcome = call(entry, &twin.subject, &case.request, options);
                        assert_eq!(outcome, Outcome::Invalid(case.expected), "{label}");
                        twin.assert_behaves_like_control(&label);
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 15 * 5 * 11 * 2);
    }

    #[test]
    fn a_reservation_override_skips_the_estimator_so_an_unrepresentable_request_is_admitted() {
        // Upstream §3.1 step 5: with an override, the estimator is not called. `estimate`
        // always calls it (it takes no options).
        for case in cases() {
            let b = (case.build)(4);
            for entry in ENTRIES {
                let outcome = call(entry, &b, &case.request, with_res(3, 4));
                let expected = match entry {
                    Entry::Estimate => Outcome::Invalid(case.expected),
                    Entry::WouldAdmit | Entry::WouldAdmitWithDetail => {
                        Outcome::Verdict(Verdict::Admit)
                    }
                    _ => Outcome::Admitted,
                };
                assert_eq!(outcome, expected, "{} / {entry:?}", case.name);
            }
            let t = b.stats().token_budget.unwrap();
            assert_eq!(t.in_flight_tokens, 0, "{}", case.name);
            assert_eq!(b.stats().rejected, 0, "{}", case.name);
        }
    }

    #[test]
    fn without_a_token_budget_nothing_is_estimated_so_every_request_is_admitted() {
        // "No budget: nothing is estimated and an override is ignored."
        for case in cases() {
            let b = plain(4);
            for entry in ENTRIES {
                for options in [AcquireOptions::new(), with_res(u64::MAX, 0)] {
                    let outcome = call(entry, &b, &case.request, options);
                    let expected = match entry {
                        Entry::Estimate => Outcome::Estimate(None),
                        Entry::WouldAdmit | Entry::WouldAdmitWithDetail => {
                            Outcome::Verdict(Verdict::Admit)
                        }
                        _ => Outcome::Admitted,
                    };
                    assert_eq!(outcome, expected, "{} / {entry:?}", case.name);
                }
            }
            let stats = b.stats();
            assert_eq!((stats.in_flight, stats.rejected), (0, 0), "{}", case.name);
            assert!(stats.token_budget.is_none());
        }
    }

    #[test]
    fn an_invalid_request_is_reported_even_to_a_closed_bulkhead_before_shutdown() {
        // Q9/Q10 spelled out on one case: Invalid, not Rejected(Shutdown).
        let b = default_estimator(4);
        b.close();
        let request = LlmRequest::new().user("x").max_tokens(u64::MAX);
        let err = b.try_acquire(&request, AcquireOptions::new()).unwrap_err();
        assert!(err.rejection().is_none());
        assert_eq!(
            err,
            AcquireError::Invalid(RequestError::ReservationOverflow {
                input: 1,
                max_output: u64::MAX
            })
        );
        assert_eq!(b.stats().rejected_by_reason.shutdown, 0);
        // A valid request is refused for shutdown as usual.
        let err = b
            .try_acquire(&LlmRequest::new(), AcquireOptions::new())
            .unwrap_err();
        assert_eq!(err.rejection().unwrap().reason(), RejectReason::Shutdown);
    }
}

// =============================================================================================
// Reservations the budget can never hold: capacity refusals, not input errors
// =============================================================================================

mod oversized_reservations {
    use super::*;

    const BUDGET: u64 = 1000;
    const RESERVE: u64 = 100;
    const HELD: u64 = 10;

    #[test]
    fn reservations_above_any_budget_are_refused_budget_limit_and_count_only_the_refusal() {
        let requested_values = [
            u64::MAX,
            u64::MAX - 1,
            u64::MAX - HELD + 1, // held + requested overflows by exactly one
            MAX_BUDGET + 1,
            MAX_BUDGET,
            BUDGET + 1,
        ];
        for requested in requested_values {
            for split in [
                (requested, 0),
                (0, requested),
                (requested / 2, requested - requested / 2),
            ] {
                for priority in [Priority::Normal, Priority::High] {
                    for entry in ENTRIES.into_iter().filter(|e| *e != Entry::Estimate) {
                        let label = format!("{split:?} / {priority:?} / {entry:?}");
                        let mut twin = Twin::new(|| budgeted(4, BUDGET, RESERVE));
                        twin.hold(with_res(HELD, 0));
                        let before = twin.subject.stats();
                        let options = with_res(split.0, split.1).priority(priority);
                        let outcome = call(entry, &twin.subject, &LlmRequest::new(), options);
                        let high = priority == Priority::High;
                        let expected_detail =
                            TokenBudgetDetail::compute(BUDGET, RESERVE, high, HELD, requested);
                        match outcome {
                            Outcome::Rejected(rejection) => {
                                assert!(entry.admits(), "{label}");
                                assert_eq!(
                                    rejection.reason(),
                                    RejectReason::BudgetLimit,
                                    "{label}"
                                );
                                assert_eq!(
                                    rejection.detail().token_budget,
                                    Some(expected_detail),
                                    "{label}"
                                );
                                assert_eq!(rejection.detail().in_flight, 1, "{label}");
                                assert_eq!(
                                    rejection.to_string(),
                                    format!(
                                        "bulkhead rejected: budget_limit (requested {requested} tokens, {} of effective budget {} available, {HELD} in flight)",
                                        expected_detail.available, expected_detail.effective_budget
                                    ),
                                    "{label}"
                                );
                                // Only the refusal was counted (and announced).
                                assert_eq!(
                                    twin.subject.stats(),
                                    plus_one_rejection(before, RejectReason::BudgetLimit),
                                    "{label}"
                                );
                                let mut events = twin.logs[1].lock().unwrap().clone();
                                events.push(EventKind::Reject);
                                assert_eq!(twin.subject_events(), events, "{label}");
                            }
                            Outcome::Verdict(verdict) => {
                                assert!(!entry.admits(), "{label}");
                                assert_eq!(
                                    verdict,
                                    Verdict::Reject(RejectReason::BudgetLimit),
                                    "{label}"
                                );
                                twin.assert_unchanged(&label);
                            }
                            other => panic!("{label}: {other:?}"),
                        }
                        let t = twin.subject.stats().token_budget.unwrap();
                        assert_eq!(t.in_flight_tokens, HELD, "{label}");
                        assert_eq!(t.total_reserved, HELD, "{label}");
                        assert_eq!(probe(&twin.subject), probe(&twin.control), "{label}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_closed_bulkhead_refuses_an_oversized_reservation_for_shutdown_first() {
        let b = budgeted(4, BUDGET, RESERVE);
        b.close();
        let err = b
            .try_acquire(
                &LlmRequest::new(),
                with_res(u64::MAX, 0).priority(Priority::High),
            )
            .unwrap_err();
        let rejection = err.rejection().unwrap();
        assert_eq!(rejection.reason(), RejectReason::Shutdown);
        assert_eq!(
            rejection.to_string(),
            "bulkhead rejected: shutdown (the bulkhead is closed)"
        );
        assert_eq!(
            b.would_admit(&LlmRequest::new(), with_res(u64::MAX, 0))
                .unwrap(),
            Verdict::Reject(RejectReason::Shutdown)
        );
    }

    #[test]
    fn exact_fits_at_max_budget_are_admitted() {
        let b = budgeted(4, MAX_BUDGET, 0);
        let full = b
            .try_acquire(&LlmRequest::new(), with_res(MAX_BUDGET - 1, 1))
            .unwrap();
        assert_eq!(full.held_tokens(), MAX_BUDGET);
        // A 0-token call still fits (an exact fit admits); one more token does not.
        let zero = b.try_acquire(&LlmRequest::new(), with_res(0, 0)).unwrap();
        let err = b
            .try_acquire(&LlmRequest::new(), with_res(0, 1))
            .unwrap_err();
        assert_eq!(err.rejection().unwrap().reason(), RejectReason::BudgetLimit);
        drop((full, zero));
        let t = b.stats().token_budget.unwrap();
        assert_eq!((t.in_flight_tokens, t.total_reserved), (0, MAX_BUDGET));
    }
}

// =============================================================================================
// Queue timeouts: zero, huge and Duration::MAX (acquire, acquire_owned, acquire_blocking(_owned),
// run, builder queue_timeout, Profile::Custom)
// =============================================================================================

mod timeouts {
    use super::*;

    fn queued_twin() -> Twin {
        let mut twin = Twin::new(|| {
            LlmBulkhead::builder(MODEL, 1)
                .max_queue(4)
                .token_budget(TokenBudget::new(1000))
                .build()
                .unwrap()
        });
        twin.hold(with_res(10, 10));
        twin
    }

    #[test]
    fn a_zero_timeout_on_a_free_slot_admits_at_once() {
        let b = LlmBulkhead::builder(MODEL, 1).max_queue(4).build().unwrap();
        let options = AcquireOptions::new().timeout(Duration::ZERO);
        drop(block_on(b.acquire(&LlmRequest::new(), options)).unwrap());
        drop(b.acquire_blocking(&LlmRequest::new(), options).unwrap());
        let stats = b.stats();
        assert_eq!((stats.admitted, stats.rejected, stats.in_flight), (2, 0, 0));
    }

    #[test]
    fn a_zero_timeout_while_queued_gives_up_at_the_first_check_and_leaves_the_queue() {
        let zero = AcquireOptions::new().timeout(Duration::ZERO);
        type Wait = (&'static str, fn(&LlmBulkhead, AcquireOptions) -> Outcome);
        let waits: [Wait; 5] = [
            ("acquire", |b, o| {
                call(Entry::Acquire, b, &LlmRequest::new(), o)
            }),
            ("acquire_owned", |b, o| {
                call(Entry::AcquireOwned, b, &LlmRequest::new(), o)
            }),
            ("acquire_blocking", |b, o| {
                call(Entry::AcquireBlocking, b, &LlmRequest::new(), o)
            }),
            ("acquire_blocking_owned", |b, o| {
                call(Entry::AcquireBlockingOwned, b, &LlmRequest::new(), o)
            }),
            ("run", |b, o| call(Entry::Run, b, &LlmRequest::new(), o)),
        ];
        for (name, wait) in waits {
            for options in [
                zero.reservation(res(5, 5)),
                zero.reservation(res(0, 0)).priority(Priority::High),
            ] {
                let twin = queued_twin();
                let before = twin.subject.stats();
                let Outcome::Rejected(rejection) = wait(&twin.subject, options) else {
                    panic!("{name}: expected a timeout");
                };
                assert_eq!(rejection.reason(), RejectReason::Timeout, "{name}");
                assert_eq!(
                    rejection.to_string(),
                    "bulkhead rejected: timeout (no slot was granted before the queue timeout)"
                );
                let after = twin.subject.stats();
                assert_eq!(
                    after,
                    plus_one_rejection(before, RejectReason::Timeout),
                    "{name}"
                );
                assert_eq!((after.pending, after.in_flight), (0, 1), "{name}");
                assert_eq!(probe(&twin.subject), probe(&twin.control), "{name}");
            }
        }
    }

    /// Queues one acquire with `options`, checks it waits, frees the slot, checks it is then
    /// admitted (the timeout did not fire or panic).
    fn waits_then_admits(b: &LlmBulkhead, options: AcquireOptions, holder: OwnedPermit) {
        block_on(async {
            let mut waiting = Box::pin(b.acquire(&LlmRequest::new(), options));
            assert!(futures::poll!(waiting.as_mut()).is_pending());
            assert!(
                futures::poll!(waiting.as_mut()).is_pending(),
                "polled twice"
            );
            assert_eq!(b.stats().pending, 1);
            drop(holder);
            let permit = waiting.await.expect("handed the freed slot");
            assert_eq!(b.stats().in_flight, 1);
            drop(permit);
        });
        let stats = b.stats();
        assert_eq!((stats.in_flight, stats.pending, stats.rejected), (0, 0, 0));
    }

    #[test]
    fn duration_max_and_huge_timeouts_never_panic_and_wait_for_a_slot() {
        let huge = [
            Duration::MAX,
            Duration::new(u64::MAX, 0),
            Duration::from_secs(u64::MAX / 2),
            Duration::from_secs(1 << 40), // representable as an Instant: registers a timer
        ];
        for timeout in huge {
            // Per-call timeout.
            let b = LlmBulkhead::builder(MODEL, 1).max_queue(2).build().unwrap();
            let holder = b
                .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
                .unwrap();
            waits_then_admits(&b, AcquireOptions::new().timeout(timeout), holder);

            // Bulkhead default timeout (builder and custom profile).
            for b in [
                LlmBulkhead::builder(MODEL, 1)
                    .max_queue(2)
                    .queue_timeout(timeout)
                    .build()
                    .unwrap(),
                LlmBulkhead::builder(MODEL, 1)
                    .profile(Profile::Custom {
                        max_queue: 2,
                        timeout: Some(timeout),
                    })
                    .build()
                    .unwrap(),
            ] {
                assert_eq!(b.queue_timeout(), Some(timeout));
                let holder = b
                    .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
                    .unwrap();
                waits_then_admits(&b, AcquireOptions::new(), holder);
            }

            // Blocking: another thread frees the slot.
            let b = LlmBulkhead::builder(MODEL, 1).max_queue(2).build().unwrap();
            let holder = b
                .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
                .unwrap();
            let watcher = b.clone();
            let releaser = std::thread::spawn(move || {
                while watcher.stats().pending == 0 {
                    std::thread::yield_now();
                }
                drop(holder);
            });
            let permit = b
                .acquire_blocking_owned(&LlmRequest::new(), AcquireOptions::new().timeout(timeout))
                .expect("handed the freed slot");
            releaser.join().unwrap();
            drop(permit);
            assert_eq!(b.stats().rejected, 0);
        }

        // The timer still works afterwards: a short timeout still fires.
        let b = LlmBulkhead::builder(MODEL, 1).max_queue(2).build().unwrap();
        let _holder = b
            .try_acquire(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let err = block_on(b.acquire(
            &LlmRequest::new(),
            AcquireOptions::new().timeout(Duration::from_millis(20)),
        ))
        .unwrap_err();
        assert_eq!(err.rejection().unwrap().reason(), RejectReason::Timeout);
    }

    #[test]
    fn dropping_a_waiter_with_a_duration_max_timeout_aborts_cleanly() {
        let twin = queued_twin();
        block_on(async {
            let mut waiting = Box::pin(
                twin.subject
                    .acquire(&LlmRequest::new(), with_res(1, 1).timeout(Duration::MAX)),
            );
            assert!(futures::poll!(waiting.as_mut()).is_pending());
        });
        let stats = twin.subject.stats();
        assert_eq!(stats.pending, 0);
        assert_eq!(stats.rejected_by_reason.aborted, 1);
        assert_eq!(probe(&twin.subject), probe(&twin.control));
    }
}

// =============================================================================================
// report_usage / report_usage_progressive (Permit, OwnedPermit, RunContext)
// =============================================================================================

mod reports {
    use super::*;

    /// Anything usage can be reported through.
    trait Reporter {
        fn report(
            &mut self,
            usage: TokenUsage,
            progressive: Option<Progressive>,
        ) -> Result<UsageReport, UsageError>;
        fn held(&self) -> u64;
    }

    impl Reporter for Permit<'_> {
        fn report(
            &mut self,
            usage: TokenUsage,
            progressive: Option<Progressive>,
        ) -> Result<UsageReport, UsageError> {
            match progressive {
                None => self.report_usage(usage),
                Some(p) => self.report_usage_progressive(usage, p),
            }
        }
        fn held(&self) -> u64 {
            self.held_tokens()
        }
    }

    // `OwnedPermit` is `Permit<'static>`: the impl above covers it.

    impl Reporter for RunContext<'_> {
        fn report(
            &mut self,
            usage: TokenUsage,
            progressive: Option<Progressive>,
        ) -> Result<UsageReport, UsageError> {
            match progressive {
                None => self.report_usage(usage),
                Some(p) => self.report_usage_progressive(usage, p),
            }
        }
        fn held(&self) -> u64 {
            self.held_tokens()
        }
    }

    /// A report: `usage`, and the progressive reconciliation if any.
    type Report = (TokenUsage, Option<Progressive>);

    struct Case {
        name: &'static str,
        /// Budget of the bulkhead (`None`: no token budget).
        budget: Option<u64>,
        reservation: (u64, u64),
        /// Valid reports made before the bad one (on subject and control alike).
        before: Vec<Report>,
        bad: Report,
        expected: UsageError,
        display: Option<&'static str>,
    }

    fn p(remaining: u64, margin: u64) -> Option<Progressive> {
        Some(Progressive::new(remaining).safety_margin(margin))
    }

    const BUDGET: u64 = 10_000;

    fn cases() -> Vec<Case> {
        let budget = Some(BUDGET);
        let prior = || vec![(usage(20, 5), None)];
        vec![
            Case {
                name: "progressive remaining one above the cap",
                budget,
                reservation: (100, 1000),
                before: vec![],
                bad: (usage(20, 5), p(1001, 0)),
                expected: UsageError::RemainingExceedsCap {
                    remaining: 1001,
                    cap: 1000,
                },
                display: Some(
                    "progressive reconciliation remaining_output_tokens (1001) must not exceed the reserved output cap (1000)",
                ),
            },
            Case {
                name: "progressive remaining u64::MAX and margin u64::MAX: the cap is checked first",
                budget,
                reservation: (100, 1000),
                before: prior(),
                bad: (usage(20, 5), p(u64::MAX, u64::MAX)),
                expected: UsageError::RemainingExceedsCap {
                    remaining: u64::MAX,
                    cap: 1000,
                },
                display: Some(
                    "progressive reconciliation remaining_output_tokens (18446744073709551615) must not exceed the reserved output cap (1000)",
                ),
            },
            Case {
                name: "progressive remaining 1 above a zero cap",
                budget,
                reservation: (100, 0),
                before: vec![],
                bad: (usage(0, 0), p(1, 0)),
                expected: UsageError::RemainingExceedsCap {
                    remaining: 1,
                    cap: 0,
                },
                display: Some(
                    "progressive reconciliation remaining_output_tokens (1) must not exceed the reserved output cap (0)",
                ),
            },
            Case {
                name: "the cap is checked before the cumulative total overflows",
                budget,
                reservation: (100, 1000),
                before: prior(),
                bad: (usage(u64::MAX, 0), p(1001, 0)),
                expected: UsageError::RemainingExceedsCap {
                    remaining: 1001,
                    cap: 1000,
                },
                display: None,
            },
            Case {
                name: "progressive remaining + margin overflows u64",
                budget,
                reservation: (100, 1000),
                before: prior(),
                bad: (usage(20, 5), p(1000, u64::MAX)),
                expected: UsageError::HoldOverflow,
                display: Some("the hold this usage implies does not fit in 64 bits"),
            },
            Case {
                name: "progressive remaining + margin = u64::MAX exceeds what the budget counts",
                budget,
                reservation: (100, 1000),
                before: prior(),
                bad: (usage(20, 5), p(1000, u64::MAX - 1000)),
                expected: UsageError::HoldOverflow,
                display: Some("the hold this usage implies does not fit in 64 bits"),
            },
            Case {
                name: "progressive remaining + margin + overrun overflows u64",
                budget,
                reservation: (100, 1000),
                before: prior(),
                bad: (usage(20, 1001), p(0, u64::MAX)),
                expected: UsageError::HoldOverflow,
                display: None,
            },
            Case {
                name: "progressive remaining + margin just above MAX_BUDGET",
                budget,
                reservation: (100, 1000),
                before: prior(),
                bad: (usage(20, 5), p(500, MAX_BUDGET)),
                expected: UsageError::HoldOverflow,
                display: None,
            },
            Case {
                name: "plain input u64::MAX: input + max_output overflows u64",
                budget,
                reservation: (100, 1000),
                before: vec![],
                bad: (usage(u64::MAX, 0), None),
                expected: UsageError::HoldOverflow,
                display: None,
            },
            Case {
                name: "plain output u64::MAX: the hold fits u64 but not the admission word",
                budget,
                reservation: (100, 1000),
                before: vec![],
                bad: (usage(0, u64::MAX), None),
                expected: UsageError::HoldOverflow,
                display: None,
            },
            Case {
                name: "plain input MAX_BUDGET: the hold exceeds MAX_BUDGET",
                budget,
                reservation: (100, 1000),
                before: prior(),
                bad: (usage(MAX_BUDGET, 0), None),
                expected: UsageError::HoldOverflow,
                display: None,
            },
            Case {
                name: "cumulative input u64::MAX after output 5 overflows the total",
                budget,
                reservation: (100, 1000),
                before: prior(),
                bad: (usage(u64::MAX, 0), None),
                expected: UsageError::TotalOverflow {
                    input: u64::MAX,
                    output: 5,
                },
                display: Some(
                    "token usage total (18446744073709551615 input + 5 output) does not fit in 64 bits",
                ),
            },
            Case {
                name: "cumulative output u64::MAX after input 20 overflows the total",
                budget,
                reservation: (100, 1000),
                before: prior(),
                bad: (usage(0, u64::MAX), None),
                expected: UsageError::TotalOverflow {
                    input: 20,
                    output: u64::MAX,
                },
                display: Some(
                    "token usage total (20 input + 18446744073709551615 output) does not fit in 64 bits",
                ),
            },
            Case {
                name: "progressive report with an overflowing cumulative total",
                budget,
                reservation: (100, 1000),
                before: prior(),
                bad: (usage(u64::MAX - 1, 0), p(1000, 0)),
                expected: UsageError::TotalOverflow {
                    input: u64::MAX - 1,
                    output: 5,
                },
                display: None,
            },
            Case {
                name: "tokens in flight would pass MAX_BUDGET by one",
                budget: Some(MAX_BUDGET),
                reservation: (0, 10),
                before: vec![(usage(MAX_BUDGET - 10, 0), None)],
                bad: (usage(MAX_BUDGET - 9, 0), None),
                expected: UsageError::HoldOverflow,
                display: None,
            },
            Case {
                name: "no budget: cumulative input u64::MAX then output 1 overflows the total",
                budget: None,
                reservation: (0, 0),
                before: vec![(usage(u64::MAX, 0), None)],
                bad: (usage(0, 1), None),
                expected: UsageError::TotalOverflow {
                    input: u64::MAX,
                    output: 1,
                },
                display: Some(
                    "token usage total (18446744073709551615 input + 1 output) does not fit in 64 bits",
                ),
            },
            Case {
                name: "no budget: a progressive report with an overflowing cumulative total",
                budget: None,
                reservation: (0, 0),
                before: vec![(usage(1, u64::MAX - 1), p(u64::MAX, u64::MAX))],
                bad: (usage(2, 0), p(0, 0)),
                expected: UsageError::TotalOverflow {
                    input: 2,
                    output: u64::MAX - 1,
                },
                display: None,
            },
        ]
    }

    fn build(case: &Case) -> LlmBulkhead {
        match case.budget {
            Some(budget) => budgeted(4, budget, 0),
            None => plain(4),
        }
    }

    fn options(case: &Case) -> AcquireOptions {
        with_res(case.reservation.0, case.reservation.1).priority(Priority::High)
    }

    /// What one side saw: the bad report's result, the hold after it, and a valid report made
    /// afterwards (its sequence shows the bad one did not count).
    type Seen = (
        Option<Result<UsageReport, UsageError>>,
        u64,
        u64,
        [ReportFields; 2],
    );

    /// Replays `case` on `reporter` (the bad report only if `bad`), then makes two valid
    /// reports: a duplicate of the last valid one (changes nothing, so its sequence is the
    /// current one), and a progressive report with nothing remaining (drops the hold to the
    /// output beyond the reservation, the next sequence where it moves).
    fn replay(case: &Case, reporter: &mut dyn Reporter, bad: bool) -> Seen {
        for &(u, p) in &case.before {
            reporter.report(u, p).expect("setup report is valid");
        }
        let held_before = reporter.held();
        let outcome = bad.then(|| reporter.report(case.bad.0, case.bad.1));
        let held_after = reporter.held();
        let last = case.before.last().map_or(usage(0, 0), |r| r.0);
        let duplicate = reporter
            .report(last, None)
            .expect("a duplicate report is valid");
        let drained = reporter
            .report(last, Some(Progressive::new(0)))
            .expect("a progressive report with nothing remaining is valid");
        (
            outcome,
            held_before,
            held_after,
            [fields(duplicate), fields(drained)],
        )
    }

    #[track_caller]
    fn check(case: &Case, subject: Seen, control: Seen, twin: &Twin) {
        let name = case.name;
        let (outcome, held_before, held_after, next_subject) = subject;
        let (_, control_held_before, control_held_after, next_control) = control;
        let err = outcome
            .expect("subject made the bad report")
            .expect_err(name);
        assert_eq!(err, case.expected, "{name}");
        if let Some(display) = case.display {
            assert_eq!(err.to_string(), display, "{name}");
        }
        assert_eq!(held_after, held_before, "{name}: the hold did not move");
        assert_eq!(
            (held_before, held_after),
            (control_held_before, control_held_after),
            "{name}"
        );
        assert_eq!(
            next_subject, next_control,
            "{name}: the next valid reports (sequences included) are the control's"
        );
        twin.assert_unchanged(name);
    }

    #[test]
    fn invalid_reports_through_a_permit_change_nothing() {
        for case in cases() {
            let twin = Twin::new(|| build(&case));
            let mut s = twin
                .subject
                .try_acquire(&LlmRequest::new(), options(&case))
                .unwrap();
            let mut c = twin
                .control
                .try_acquire(&LlmRequest::new(), options(&case))
                .unwrap();
            let subject = replay(&case, &mut s, true);
            let control = replay(&case, &mut c, false);
            check(&case, subject, control, &twin);
            // Settling with the last valid report is the same on both.
            assert_eq!(s.release(None), c.release(None), "{}", case.name);
            twin.assert_behaves_like_control(case.name);
        }
    }

    #[test]
    fn invalid_reports_through_an_owned_permit_change_nothing() {
        for case in cases() {
            let twin = Twin::new(|| build(&case));
            let (s, c) = twin.both(|b| b.try_acquire_owned(&LlmRequest::new(), options(&case)));
            let (mut s, mut c) = (s.unwrap(), c.unwrap());
            let subject = replay(&case, &mut s, true);
            let control = replay(&case, &mut c, false);
            check(&case, subject, control, &twin);
            // Dropping settles with the last valid report on both.
            drop((s, c));
            twin.assert_behaves_like_control(case.name);
        }
    }

    #[test]
    fn invalid_reports_through_a_run_context_change_nothing() {
        for case in cases() {
            let twin = Twin::new(|| build(&case));
            let run = |b: &LlmBulkhead, bad: bool| {
                block_on(b.run(&LlmRequest::new(), options(&case), async |mut ctx| {
                    Ok::<_, Infallible>(replay(&case, &mut ctx, bad))
                }))
                .map_err(|e| e.to_string())
                .unwrap()
            };
            let subject = run(&twin.subject, true);
            let control = run(&twin.control, false);
            check(&case, subject, control, &twin);
            twin.assert_behaves_like_control(case.name);
        }
    }

    #[test]
    fn a_run_callback_that_fails_on_an_invalid_report_settles_with_the_last_valid_usage() {
        let twin = Twin::new(|| budgeted(4, BUDGET, 0));
        let subject = block_on(twin.subject.run(
            &LlmRequest::new(),
            with_res(100, 1000),
            async |mut ctx| {
                ctx.report_usage(usage(20, 5))?;
                ctx.report_usage_progressive(usage(20, 5), Progressive::new(1001))?;
                Ok::<_, UsageError>(())
            },
        ));
        match subject {
            Err(RunError::Failed(e)) => assert_eq!(
                e,
                UsageError::RemainingExceedsCap {
                    remaining: 1001,
                    cap: 1000
                }
            ),
            other => panic!("{other:?}"),
        }
        block_on(
            twin.control
                .run(&LlmRequest::new(), with_res(100, 1000), async |mut ctx| {
                    ctx.report_usage(usage(20, 5))?;
                    Err::<(), _>(UsageError::HoldOverflow)
                }),
        )
        .unwrap_err();
        let t = twin.subject.stats().token_budget.unwrap();
        assert_eq!((t.in_flight_tokens, t.total_consumed), (0, 25));
        twin.assert_behaves_like_control("failed run");
    }

    #[test]
    fn valid_extreme_reports_are_accepted() {
        // Without a budget there is no cap and nothing is held (upstream §4.3 step 2).
        let b = plain(1);
        let mut permit = b
            .try_acquire(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let r = permit
            .report_usage_progressive(
                usage(0, u64::MAX),
                Progressive::new(u64::MAX).safety_margin(u64::MAX),
            )
            .unwrap();
        assert_eq!(fields(r), (1, 0, 0, u64::MAX, None, None, false, 0));
        let r = permit.report_usage(usage(0, 0)).unwrap();
        assert_eq!(r.sequence, 1, "a stale report does not count");
        permit.release(None);
        assert_eq!(b.stats().in_flight, 0);

        // remaining == cap and a margin that reaches MAX_BUDGET exactly.
        let b = budgeted(1, MAX_BUDGET, 0);
        let mut permit = b
            .try_acquire(&LlmRequest::new(), with_res(0, 1000))
            .unwrap();
        let r = permit
            .report_usage_progressive(
                usage(0, 0),
                Progressive::new(1000).safety_margin(MAX_BUDGET - 1000),
            )
            .unwrap();
        assert_eq!((r.held, r.sequence), (MAX_BUDGET, 1));
        assert_eq!(b.stats().token_budget.unwrap().in_flight_tokens, MAX_BUDGET);
        // remaining 0, margin 0: nothing held.
        let r = permit
            .report_usage_progressive(usage(0, 0), Progressive::new(0))
            .unwrap();
        assert_eq!((r.held, r.sequence), (0, 2));
        let report = permit.release(None);
        assert_eq!(report.held_tokens, 0);
        assert_eq!(b.stats().token_budget.unwrap().in_flight_tokens, 0);
    }
}

// =============================================================================================
// release / drop: usage totals that saturate
// =============================================================================================

mod releases {
    use super::*;

    #[test]
    fn settling_with_huge_usage_saturates_the_totals_and_returns_every_token() {
        let b = budgeted(4, 1000, 0);
        for _ in 0..3 {
            let permit = b.try_acquire(&LlmRequest::new(), with_res(10, 20)).unwrap();
            let report = permit.release(Some(usage(u64::MAX, 0)));
            assert_eq!(report.held_tokens, 30);
            assert_eq!(report.refunded_tokens, 0);
            assert_eq!(report.overrun_tokens, u64::MAX - 30);
            assert_eq!(report.usage, Some(usage(u64::MAX, 0)));
        }
        let t = b.stats().token_budget.unwrap();
        assert_eq!(t.in_flight_tokens, 0);
        assert_eq!(t.total_consumed, u64::MAX, "saturates");
        assert_eq!(t.total_overrun, u64::MAX, "saturates");
        assert_eq!(t.total_reserved, 90);
        assert_eq!(b.stats().in_flight, 0);
        // Still admits normally.
        let fresh = budgeted(4, 1000, 0);
        let (a, c) = (probe(&b), probe(&fresh));
        assert_eq!(a.admission, c.admission);
        assert_eq!(a.tokens_after, c.tokens_after);

        // Without a budget, usage still reaches nothing but the consumed total (no budget
        // stats), and releases never panic.
        let b = plain(2);
        for _ in 0..2 {
            let permit = b
                .try_acquire(&LlmRequest::new(), AcquireOptions::new())
                .unwrap();
            let report = permit.release(Some(usage(0, u64::MAX)));
            assert_eq!((report.held_tokens, report.refunded_tokens), (0, 0));
        }
        assert_eq!(b.stats().in_flight, 0);
    }
}

// =============================================================================================
// Estimators: ModelAwareEstimator ratios, AdaptiveEstimator options, observe/reset with odd input
// =============================================================================================

mod estimators {
    use super::*;

    fn ratio_error(model: &str, ratio: f64) -> EstimatorError {
        ModelAwareEstimator::builder()
            .ratio(model, ratio)
            .build()
            .expect_err("invalid ratio")
    }

    #[test]
    fn model_aware_refuses_ratios_that_are_not_finite_and_positive() {
        // `None`: the value as Rust's `Display` spells it (a long decimal expansion).
        let cases: [(f64, Option<&str>); 9] = [
            (f64::NAN, Some("NaN")),
            (f64::INFINITY, Some("inf")),
            (f64::NEG_INFINITY, Some("-inf")),
            (0.0, Some("0")),
            (-0.0, Some("-0")),
            (-1.0, Some("-1")),
            (-f64::MIN_POSITIVE, None),
            (f64::MIN, None),
            (-5e-324, None),
        ];
        for (ratio, shown) in cases {
            let err = ratio_error("my-model", ratio);
            match &err {
                EstimatorError::InvalidRatio { model, ratio: got } => {
                    assert_eq!(model, "my-model");
                    assert_eq!(
                        got.to_bits(),
                        ratio.to_bits(),
                        "the refused value, bit for bit"
                    );
                }
                other => panic!("{ratio}: {other:?}"),
            }
            let shown = shown.map_or_else(|| ratio.to_string(), str::to_owned);
            assert_eq!(
                err.to_string(),
                format!(
                    "ratio override for \"my-model\" must be a finite number > 0 (got {shown})"
                )
            );
        }
        // Empty and whitespace-only model names: the ratio is what is validated.
        assert_eq!(
            ratio_error("", 0.0),
            EstimatorError::InvalidRatio {
                model: String::new(),
                ratio: 0.0
            }
        );
        assert_eq!(
            ratio_error("  ", -2.0).to_string(),
            "ratio override for \"  \" must be a finite number > 0 (got -2)"
        );
    }

    #[test]
    fn model_aware_reports_the_first_invalid_override_even_if_a_later_one_is_valid() {
        let err = ModelAwareEstimator::builder()
            .ratio("a", 1.0)
            .ratio("b", f64::NAN)
            .ratio("c", -1.0)
            .ratio("b", 2.0)
            .build()
            .unwrap_err();
        assert!(
            matches!(&err, EstimatorError::InvalidRatio { model, ratio } if model == "b" && ratio.is_nan())
        );
        assert_eq!(
            err.to_string(),
            "ratio override for \"b\" must be a finite number > 0 (got NaN)"
        );
    }

    #[test]
    fn model_aware_accepts_extreme_positive_ratios_and_refuses_unrepresentable_estimates() {
        for ratio in [f64::MIN_POSITIVE, 5e-324, f64::EPSILON, 1e-3, f64::MAX] {
            let e = ModelAwareEstimator::builder()
                .ratio("m", ratio)
                .build()
                .unwrap_or_else(|err| panic!("{ratio}: {err}"));
            assert_eq!(e.ratio_for("m").to_bits(), ratio.to_bits());
            // No text: nothing to estimate, whatever the ratio.
            assert_eq!(
                e.estimate(&LlmRequest::new().model("m")).unwrap(),
                TokenEstimate::new(0, 2048)
            );
            let one = e.estimate(&LlmRequest::new().model("m").user("x"));
            if ratio < 1e-19 {
                assert_eq!(one, Err(RequestError::TextTooLarge { chars: 1 }), "{ratio}");
            } else {
                assert!(one.is_ok(), "{ratio}");
            }
        }
        // f64::MAX chars per token: any text is one token.
        let e = ModelAwareEstimator::builder()
            .ratio("m", f64::MAX)
            .build()
            .unwrap();
        let long = LlmRequest::new().model("m").user("x".repeat(100_000));
        assert_eq!(e.estimate(&long).unwrap().input, 1);
        // Odd model names never panic and fall back to 4.0.
        let e = ModelAwareEstimator::builder().build().unwrap();
        for model in [
            "",
            " ",
            "\u{212A}",
            &"Ä".repeat(200),
            &"A".repeat(200),
            &"a".repeat(129),
        ] {
            assert_eq!(e.ratio_for(model), 4.0, "{model:?}");
        }
    }

    fn adaptive_builder() -> async_bulkhead_llm::AdaptiveEstimatorBuilder {
        AdaptiveEstimator::builder(ModelAwareEstimator::builder().build().unwrap())
    }

    #[test]
    fn adaptive_refuses_invalid_options_in_the_documented_order() {
        use EstimatorError::{MaxCorrection, MaxModels, MinCorrection, MinSamples, Smoothing};
        type Build = fn() -> Result<AdaptiveEstimator, EstimatorError>;
        let nan = f64::NAN;
        let inf = f64::INFINITY;
        let cases: Vec<(&str, Build, EstimatorError, &str)> = vec![
            (
                "smoothing NaN",
                || adaptive_builder().smoothing(f64::NAN).build(),
                Smoothing { value: nan },
                "smoothing must be a finite number in (0, 1] (got NaN)",
            ),
            (
                "smoothing inf",
                || adaptive_builder().smoothing(f64::INFINITY).build(),
                Smoothing { value: inf },
                "smoothing must be a finite number in (0, 1] (got inf)",
            ),
            (
                "smoothing -inf",
                || adaptive_builder().smoothing(f64::NEG_INFINITY).build(),
                Smoothing { value: -inf },
                "smoothing must be a finite number in (0, 1] (got -inf)",
            ),
            (
                "smoothing 0",
                || adaptive_builder().smoothing(0.0).build(),
                Smoothing { value: 0.0 },
                "smoothing must be a finite number in (0, 1] (got 0)",
            ),
            (
                "smoothing -0",
                || adaptive_builder().smoothing(-0.0).build(),
                Smoothing { value: -0.0 },
                "smoothing must be a finite number in (0, 1] (got -0)",
            ),
            (
                "smoothing -0.1",
                || adaptive_builder().smoothing(-0.1).build(),
                Smoothing { value: -0.1 },
                "smoothing must be a finite number in (0, 1] (got -0.1)",
            ),
            (
                "smoothing just above 1",
                || adaptive_builder().smoothing(1.0 + f64::EPSILON).build(),
                Smoothing {
                    value: 1.0 + f64::EPSILON,
                },
                "smoothing must be a finite number in (0, 1] (got 1.0000000000000002)",
            ),
            (
                "smoothing first when every option is invalid",
                || {
                    adaptive_builder()
                        .smoothing(2.0)
                        .min_samples(0)
                        .min_correction(f64::NAN)
                        .max_correction(-1.0)
                        .max_models(0)
                        .build()
                },
                Smoothing { value: 2.0 },
                "smoothing must be a finite number in (0, 1] (got 2)",
            ),
            (
                "min_samples 0",
                || adaptive_builder().min_samples(0).build(),
                MinSamples { value: 0 },
                "min_samples must be a positive integer (got 0)",
            ),
            (
                "min_samples before the corrections and max_models",
                || {
                    adaptive_builder()
                        .min_samples(0)
                        .min_correction(-1.0)
                        .max_correction(f64::NAN)
                        .max_models(0)
                        .build()
                },
                MinSamples { value: 0 },
                "min_samples must be a positive integer (got 0)",
            ),
            (
                "min_correction 0",
                || adaptive_builder().min_correction(0.0).build(),
                MinCorrection { value: 0.0 },
                "min_correction must be a finite number > 0 (got 0)",
            ),
            (
                "min_correction -1",
                || adaptive_builder().min_correction(-1.0).build(),
                MinCorrection { value: -1.0 },
                "min_correction must be a finite number > 0 (got -1)",
            ),
            (
                "min_correction NaN",
                || adaptive_builder().min_correction(f64::NAN).build(),
                MinCorrection { value: nan },
                "min_correction must be a finite number > 0 (got NaN)",
            ),
            (
                "min_correction inf (with max_correction inf)",
                || {
                    adaptive_builder()
                        .min_correction(f64::INFINITY)
                        .max_correction(f64::INFINITY)
                        .build()
                },
                MinCorrection { value: inf },
                "min_correction must be a finite number > 0 (got inf)",
            ),
            (
                "min_correction before max_correction and max_models",
                || {
                    adaptive_builder()
                        .min_correction(-0.0)
                        .max_correction(f64::NAN)
                        .max_models(0)
                        .build()
                },
                MinCorrection { value: -0.0 },
                "min_correction must be a finite number > 0 (got -0)",
            ),
            (
                "max_correction below min_correction",
                || {
                    adaptive_builder()
                        .min_correction(2.0)
                        .max_correction(1.0)
                        .build()
                },
                MaxCorrection {
                    value: 1.0,
                    min: 2.0,
                },
                "max_correction must be a finite number >= min_correction (2) (got 1)",
            ),
            (
                "max_correction below the default min_correction",
                || adaptive_builder().max_correction(0.25).build(),
                MaxCorrection {
                    value: 0.25,
                    min: 0.5,
                },
                "max_correction must be a finite number >= min_correction (0.5) (got 0.25)",
            ),
            (
                "max_correction NaN",
                || adaptive_builder().max_correction(f64::NAN).build(),
                MaxCorrection {
                    value: nan,
                    min: 0.5,
                },
                "max_correction must be a finite number >= min_correction (0.5) (got NaN)",
            ),
            (
                "max_correction inf",
                || adaptive_builder().max_correction(f64::INFINITY).build(),
                MaxCorrection {
                    value: inf,
                    min: 0.5,
                },
                "max_correction must be a finite number >= min_correction (0.5) (got inf)",
            ),
            (
                "max_correction -inf",
                || adaptive_builder().max_correction(f64::NEG_INFINITY).build(),
                MaxCorrection {
                    value: -inf,
                    min: 0.5,
                },
                "max_correction must be a finite number >= min_correction (0.5) (got -inf)",
            ),
            (
                "max_correction before max_models",
                || adaptive_builder().max_correction(0.0).max_models(0).build(),
                MaxCorrection {
                    value: 0.0,
                    min: 0.5,
                },
                "max_correction must be a finite number >= min_correction (0.5) (got 0)",
            ),
            (
                "max_models 0",
                || adaptive_builder().max_models(0).build(),
                MaxModels { value: 0 },
                "max_models must be a positive integer (got 0)",
            ),
        ];
        for (name, build, expected, display) in cases {
            let err = build().expect_err(name);
            // Debug compares NaN and the sign of zero exactly.
            assert_eq!(format!("{err:?}"), format!("{expected:?}"), "{name}");
            assert_eq!(err.to_string(), display, "{name}");
        }
    }

    #[test]
    fn adaptive_accepts_valid_edge_options() {
        let builders = [
            adaptive_builder().smoothing(1.0),
            adaptive_builder().smoothing(f64::MIN_POSITIVE),
            adaptive_builder().min_samples(1),
            adaptive_builder().min_samples(u64::MAX),
            adaptive_builder()
                .min_correction(f64::MIN_POSITIVE)
                .max_correction(f64::MIN_POSITIVE),
            adaptive_builder().min_correction(2.0).max_correction(2.0),
            adaptive_builder().max_correction(f64::MAX),
            adaptive_builder().max_models(1),
            adaptive_builder().max_models(usize::MAX),
        ];
        for builder in builders {
            let a = builder.build().unwrap();
            assert!(a.corrections().is_empty());
            let e = a.estimate(&LlmRequest::new().user("xxxx")).unwrap();
            assert_eq!((e.input, e.max_output), (1, 2048));
        }
    }

    fn adaptive(min: f64, max: f64) -> AdaptiveEstimator {
        AdaptiveEstimator::builder(ModelAwareEstimator::builder().build().unwrap())
            .smoothing(1.0)
            .min_samples(1)
            .min_correction(min)
            .max_correction(max)
            .build()
            .unwrap()
    }

    #[test]
    fn adaptive_survives_extreme_observations() {
        let a = adaptive(f64::MIN_POSITIVE, f64::MAX);
        let request = LlmRequest::new().model("m").user("xxxx"); // base input 1
        a.observe_request(&request, usage(u64::MAX, 0)).unwrap();
        let c = &a.corrections()[0];
        assert_eq!((c.model.as_str(), c.samples), ("m", 1));
        assert!(c.factor.is_finite() && c.factor > 1e19);
        // A correction that makes the estimate unrepresentable is an error, not a wrap.
        assert_eq!(
            a.estimate(&request),
            Err(RequestError::TextTooLarge { chars: 4 })
        );
        // A zero observation: the factor clamps to the (tiny) minimum, the estimate rounds up.
        a.observe_request(&request, usage(0, 0)).unwrap();
        assert_eq!(a.corrections()[0].factor, 0.0);
        assert_eq!(a.corrections()[0].applied, f64::MIN_POSITIVE);
        assert_eq!(a.estimate(&request).unwrap().input, 1);
    }

    #[test]
    fn adaptive_correction_of_a_huge_extra_input_is_refused_as_text_too_large() {
        // Documented: TextTooLarge also covers "an adaptive correction of a huge estimate". Its
        // `chars` is the request's text length, here 0 (the input came from extra tokens).
        let a = adaptive(0.5, 2.0);
        let model = LlmRequest::new().model("m");
        a.observe_request(&model.clone().user("x".repeat(400)), usage(200, 0))
            .unwrap(); // factor 2
        let huge = model.clone().extra_input_tokens(1 << 63);
        assert_eq!(
            a.estimate(&huge),
            Err(RequestError::TextTooLarge { chars: 0 })
        );
        assert_eq!(
            RequestError::TextTooLarge { chars: 0 }.to_string(),
            "estimated input for 0 characters does not fit in 64 bits"
        );
        // Through a bulkhead: Invalid, nothing counted.
        let b = LlmBulkhead::builder(MODEL, 2)
            .token_budget(TokenBudget::new(1000))
            .estimator(Arc::new(a))
            .build()
            .unwrap();
        let before = b.stats();
        assert_eq!(
            b.try_acquire(&huge, AcquireOptions::new()).unwrap_err(),
            AcquireError::Invalid(RequestError::TextTooLarge { chars: 0 })
        );
        assert_eq!(b.stats(), before);
    }

    #[test]
    fn adaptive_observe_request_with_an_unrepresentable_request_changes_nothing() {
        let a = adaptive(0.5, 2.0);
        a.observe_request(&LlmRequest::new().model("m").user("xxxx"), usage(2, 0))
            .unwrap();
        let before = a.corrections();
        let bad = LlmRequest::new()
            .model("m")
            .user("x".repeat(8))
            .extra_input_tokens(u64::MAX);
        assert_eq!(
            a.observe_request(&bad, usage(5, 5)),
            Err(RequestError::InputOverflow {
                text_tokens: 2,
                opaque_tokens: 0,
                extra_input_tokens: u64::MAX
            })
        );
        let bad_new_model = bad.clone().model("never-seen");
        assert!(a.observe_request(&bad_new_model, usage(5, 5)).is_err());
        assert_eq!(a.corrections(), before);
    }

    #[test]
    fn adaptive_observe_with_forged_memos_never_panics_and_changes_nothing() {
        let a = adaptive(0.5, 2.0);
        let seen = a
            .estimate(&LlmRequest::new().model("m").user("xxxx"))
            .unwrap();
        a.observe(&seen, usage(2, 0));
        let before = a.corrections();
        let forged = [
            Memo::new(u64::MAX, u64::MAX),
            Memo::new(u64::MAX, 0),
            Memo::new(1 << 32, 1),                     // slot 1 does not exist
            Memo::new((1000 << 32) | 1, 100),          // nor slot 1000
            Memo::new(0xFFFF_FFFF, 100),               // slot 0, generation u32::MAX
            Memo::new(seen.memo().parts().0 + 1, 100), // slot 0, a wrong generation
            Memo::new(0, u64::MAX),                    // "empty"
        ];
        for memo in forged {
            for u in [usage(0, 0), usage(u64::MAX, 0), usage(1, u64::MAX - 1)] {
                a.observe(&TokenEstimate::new(u64::MAX, u64::MAX).with_memo(memo), u);
            }
        }
        assert_eq!(a.corrections(), before);
    }

    #[test]
    fn adaptive_reset_with_unknown_or_empty_models_changes_nothing() {
        let a = adaptive(0.5, 2.0);
        a.reset(None); // empty table
        a.reset(Some(""));
        assert!(a.corrections().is_empty());
        a.observe_request(&LlmRequest::new().model("m").user("xxxx"), usage(2, 0))
            .unwrap();
        let before = a.corrections();
        for model in ["", " ", "never-seen", "\u{212A}", &"Z".repeat(300)] {
            a.reset(Some(model));
        }
        assert_eq!(a.corrections(), before);
        a.reset(Some("M")); // matched lowercased
        assert!(a.corrections().is_empty());
    }

    #[test]
    fn opaque_block_tokens_by_type_overflow_is_an_input_overflow() {
        let e = ModelAwareEstimator::builder()
            .opaque_block_tokens(OpaqueBlockTokens::by_type(
                Some(u64::MAX - 1),
                [("image", 1)],
            ))
            .build()
            .unwrap();
        // 1 + (u64::MAX - 1) fits; one more block does not.
        let fits = LlmRequest::new().user(vec![
            ContentBlock::opaque("image"),
            ContentBlock::opaque("doc"),
        ]);
        assert_eq!(e.estimate(&fits).unwrap().input, u64::MAX);
        let over = LlmRequest::new().user(vec![
            ContentBlock::opaque("image"),
            ContentBlock::opaque("doc"),
            ContentBlock::opaque("image"),
        ]);
        assert_eq!(
            e.estimate(&over),
            Err(RequestError::InputOverflow {
                text_tokens: 0,
                opaque_tokens: u64::MAX,
                extra_input_tokens: 0
            })
        );
    }
}

// =============================================================================================
// close, drain, drain_timeout
// =============================================================================================

mod shutdown {
    use super::*;

    #[test]
    fn closing_twice_changes_nothing_the_second_time() {
        let mut twin = Twin::new(|| budgeted(2, 1000, 0));
        twin.hold(with_res(1, 1));
        assert_eq!(twin.both(LlmBulkhead::close), (true, true));
        assert!(!twin.subject.close());
        assert!(!twin.subject.close());
        twin.assert_behaves_like_control("second close");
    }

    #[test]
    fn drain_timeout_with_zero_and_huge_durations_never_panics() {
        for timeout in [
            Duration::ZERO,
            Duration::from_nanos(1),
            Duration::from_secs(1 << 40),
            Duration::new(u64::MAX, 999_999_999),
            Duration::MAX,
        ] {
            // Idle: drained at once.
            let b = budgeted(2, 1000, 0);
            assert_eq!(
                block_on(b.drain_timeout(timeout)),
                DrainReport {
                    drained: true,
                    in_flight: 0,
                    pending: 0
                },
                "{timeout:?}"
            );
            // Busy: a zero or short timeout answers (at once or at its deadline) that it is
            // not drained; a huge one waits for the release.
            let mut twin = Twin::new(|| budgeted(2, 1000, 0));
            twin.hold(with_res(1, 1));
            let holder = twin.held.remove(0);
            if timeout < Duration::from_secs(1) {
                assert_eq!(
                    block_on(twin.subject.drain_timeout(timeout)),
                    DrainReport {
                        drained: false,
                        in_flight: 1,
                        pending: 0
                    }
                );
                drop(holder);
            } else {
                block_on(async {
                    let mut drain = Box::pin(twin.subject.drain_timeout(timeout));
                    assert!(futures::poll!(drain.as_mut()).is_pending());
                    drop(holder);
                    assert!(drain.await.drained);
                });
            }
            let control_holder = twin.held.remove(0);
            drop(control_holder);
            twin.assert_behaves_like_control(&format!("drain_timeout({timeout:?})"));
        }
    }
}

// =============================================================================================
// JSON: LlmRequest and Limits bodies (feature `serde`)
// =============================================================================================

#[cfg(feature = "serde")]
mod json {
    use super::*;

    fn parse(body: &str) -> Result<LlmRequest, String> {
        serde_json::from_str::<LlmRequest>(body).map_err(|e| e.to_string())
    }

    #[test]
    fn token_counts_that_are_not_non_negative_integers_are_refused_naming_field_and_value() {
        let values: [(&str, &str); 17] = [
            ("-1", "-1"),
            ("-1.0", "-1.0"),
            ("-9223372036854775808", "-9223372036854775808"),
            ("1.5", "1.5"),
            ("0.5", "0.5"),
            ("1e-7", "1e-7"),
            ("1.0000000000000002", "1.0000000000000002"),
            ("1e20", "1e+20"),
            ("18446744073709551616", "1.8446744073709552e+19"),
            ("1e400", ""), // out of f64 range: a parse error
            ("\"7\"", "\"7\""),
            ("\"\"", "\"\""),
            ("true", "true"),
            ("false", "false"),
            ("[]", "[]"),
            ("[1]", "[1]"),
            ("{}", "{}"),
        ];
        let fields = [
            ("max_tokens", "max_tokens"),
            ("max_completion_tokens", "max_completion_tokens"),
            ("extra_input_tokens", "extra_input_tokens"),
            ("extraInputTokens", "extra_input_tokens"),
        ];
        for (key, field) in fields {
            for (value, shown) in values {
                let body = format!("{{\"{key}\": {value}}}");
                let err = parse(&body).expect_err(&body);
                if shown.is_empty() {
                    continue;
                }
                let message = format!("request.{field} must be an integer >= 0 (got {shown})");
                assert!(err.starts_with(&message), "{body}: {err}");
            }
        }
        // The spec's wording for max_tokens (upstream §16) is a prefix of ours.
        assert!(
            parse(r#"{"max_tokens": -1}"#)
                .unwrap_err()
                .starts_with("request.max_tokens must be an integer >= 0")
        );
    }

    #[test]
    fn whole_token_counts_are_accepted_up_to_u64_max() {
        let cases: [(&str, Option<u64>); 9] = [
            ("null", None),
            ("0", Some(0)),
            ("-0", Some(0)),
            ("-0.0", Some(0)),
            ("2.0", Some(2)),
            ("1e3", Some(1000)),
            ("18446744073709551615", Some(u64::MAX)),
            ("18446744073709551614", Some(u64::MAX - 1)),
            ("18446744073709549568.0", Some(18_446_744_073_709_549_568)),
        ];
        for (value, expected) in cases {
            let r = parse(&format!(
                "{{\"max_tokens\": {value}, \"max_completion_tokens\": {value}, \"extraInputTokens\": {value}}}"
            ))
            .unwrap_or_else(|e| panic!("{value}: {e}"));
            assert_eq!(
                (r.max_tokens, r.max_completion_tokens, r.extra_input_tokens),
                (expected, expected, expected),
                "{value}"
            );
        }
    }

    #[test]
    fn malformed_bodies_are_refused_without_panicking() {
        let deep_content = format!(
            "{{\"messages\":[{{\"role\":\"user\",\"content\":{}}}]}}",
            "[".repeat(100_000)
        );
        let deep_extra = format!("{{\"x\":{}}}", "[".repeat(100_000));
        let deep_message_extra = format!(
            "{{\"messages\":[{{\"role\":\"user\",\"tool_calls\":{}}}]}}",
            "{\"a\":".repeat(100_000)
        );
        let deep_block = format!(
            "{{\"messages\":[{{\"role\":\"user\",\"content\":[{}]}}]}}",
            "{\"type\":\"image\",\"x\":".repeat(50_000)
        );
        let cases: Vec<(&str, &str)> = vec![
            ("", "EOF while parsing"),
            ("[]", "invalid type: sequence"),
            ("\"body\"", "invalid type: string"),
            ("5", "invalid type: integer"),
            ("null", "invalid type: null"),
            ("true", "invalid type: boolean"),
            (r#"{"max_tokens": 1"#, "EOF while parsing"),
            (r#"{"max_tokens": NaN}"#, "expected value"),
            (r#"{"max_tokens": Infinity}"#, "expected value"),
            (r#"{"max_tokens": 1,}"#, "trailing comma"),
            (
                r#"{"max_tokens": 1, "max_tokens": 2}"#,
                "duplicate field `max_tokens`",
            ),
            (
                r#"{"extra_input_tokens": 1, "extraInputTokens": 2}"#,
                "duplicate field `extra_input_tokens`",
            ),
            (
                r#"{"model": 5}"#,
                "invalid type: integer `5`, expected a string",
            ),
            (
                r#"{"model": []}"#,
                "invalid type: sequence, expected a string",
            ),
            (
                r#"{"messages": "hi"}"#,
                "invalid type: string \"hi\", expected a sequence",
            ),
            (
                r#"{"messages": {}}"#,
                "invalid type: map, expected a sequence",
            ),
            (r#"{"messages": [5]}"#, "invalid type: integer `5`"),
            (r#"{"messages": [null]}"#, "invalid type: null"),
            (
                r#"{"messages": [{"content": "x"}]}"#,
                "missing field `role`",
            ),
            (
                r#"{"messages": [{"role": null}]}"#,
                "invalid type: null, expected a string",
            ),
            (
                r#"{"messages": [{"role": 5}]}"#,
                "invalid type: integer `5`, expected a string",
            ),
            (
                r#"{"messages": [{"role": "user", "content": 5}]}"#,
                "content must be a string or an array of blocks (got 5)",
            ),
            (
                r#"{"messages": [{"role": "user", "content": {}}]}"#,
                "content must be a string or an array of blocks (got {})",
            ),
            (
                r#"{"messages": [{"role": "user", "content": true}]}"#,
                "content must be a string or an array of blocks (got true)",
            ),
            (
                r#"{"system": 5}"#,
                "content must be a string or an array of blocks (got 5)",
            ),
            (
                r#"{"system": {"type": "text", "text": "x"}}"#,
                "content must be a string or an array of blocks (got {",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "\ud800"}]}"#,
                "hex escape",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "\x"}]}"#,
                "invalid escape",
            ),
            (&deep_content, "recursion limit exceeded"),
            (&deep_extra, "recursion limit exceeded"),
            (&deep_message_extra, "recursion limit exceeded"),
            (&deep_block, "recursion limit exceeded"),
        ];
        for (body, expected) in cases {
            let err = parse(body).expect_err(&body[..body.len().min(80)]);
            assert!(
                err.contains(expected),
                "{}: {err}",
                &body[..body.len().min(80)]
            );
        }
    }

    #[test]
    fn odd_but_valid_content_blocks_are_kept_as_opaque() {
        let r = parse(
            r#"{"messages": [
                {"role": "user", "content": [5, null, "s", [], {}, {"type": 5}, {"type": "text", "text": 5}, {"type": "text"}]},
                {"role": "assistant"},
                {"role": "tool", "content": null}
            ], "model": null, "system": null}"#,
        )
        .unwrap();
        assert_eq!(r.text_len(), 0);
        let mut kinds = Vec::new();
        r.for_each_opaque_block(|k| kinds.push(k.to_owned()));
        assert_eq!(kinds, ["", "", "", "", "", "", "text", "text"]);
        assert_eq!(r.model, None);
        assert_eq!(r.system, None);
    }

    #[test]
    fn parsed_bodies_with_huge_token_counts_are_refused_by_the_bulkhead_changing_nothing() {
        let cases = [
            (
                r#"{"max_tokens": 18446744073709551615, "messages": [{"role": "user", "content": "x"}]}"#,
                RequestError::ReservationOverflow {
                    input: 1,
                    max_output: u64::MAX,
                },
            ),
            (
                r#"{"max_completion_tokens": 18446744073709549568.0, "extraInputTokens": 2048, "messages": [{"role": "user", "content": [{"type": "text", "text": "xxxxxxxx"}]}]}"#,
                RequestError::ReservationOverflow {
                    input: 2050,
                    max_output: 18_446_744_073_709_549_568,
                },
            ),
            (
                r#"{"extraInputTokens": 18446744073709551615, "messages": [{"role": "user", "content": "xxxxxxxx"}]}"#,
                RequestError::InputOverflow {
                    text_tokens: 2,
                    opaque_tokens: 0,
                    extra_input_tokens: u64::MAX,
                },
            ),
            (
                r#"{"extra_input_tokens": 18446744073709549568.0, "system": "xxxx", "max_tokens": 1e4}"#,
                RequestError::ReservationOverflow {
                    input: 18_446_744_073_709_549_569,
                    max_output: 10_000,
                },
            ),
        ];
        for (body, expected) in cases {
            let request = parse(body).unwrap();
            for entry in ENTRIES {
                let twin = Twin::new(|| budgeted(4, 10_000, 0));
                assert_eq!(
                    call(entry, &twin.subject, &request, AcquireOptions::new()),
                    Outcome::Invalid(expected),
                    "{body} / {entry:?}"
                );
                twin.assert_behaves_like_control(body);
            }
        }
    }

    #[test]
    fn limits_bodies_of_the_wrong_shape_are_refused() {
        let cases = [
            (
                r#"{"revision": -1, "max_concurrent": 1}"#,
                "invalid value: integer `-1`",
            ),
            (
                r#"{"revision": 1.5, "max_concurrent": 1}"#,
                "invalid type: floating point",
            ),
            (
                r#"{"revision": 18446744073709551616, "max_concurrent": 1}"#,
                "invalid type: floating point",
            ),
            (
                r#"{"revision": "1", "max_concurrent": 1}"#,
                "invalid type: string",
            ),
            (
                r#"{"revision": null, "max_concurrent": 1}"#,
                "invalid type: null",
            ),
            (r#"{"max_concurrent": 1}"#, "missing field `revision`"),
            (r#"{"revision": 1}"#, "missing field `max_concurrent`"),
            (
                r#"{"revision": 1, "max_concurrent": -1}"#,
                "invalid value: integer `-1`",
            ),
            (
                r#"{"revision": 1, "max_concurrent": 4294967296}"#,
                "invalid value: integer `4294967296`, expected u32",
            ),
            (
                r#"{"revision": 1, "max_concurrent": 1, "max_queue": -1}"#,
                "invalid value: integer `-1`",
            ),
            (
                r#"{"revision": 1, "max_concurrent": 1, "max_queue": 4294967296}"#,
                "expected u32",
            ),
            (
                r#"{"revision": 1, "max_concurrent": 1, "token_budget": 5}"#,
                "invalid type: integer `5`",
            ),
            (
                r#"{"revision": 1, "max_concurrent": 1, "token_budget": {"budget": 5}}"#,
                "missing field `high_priority_reserve`",
            ),
            (
                r#"{"revision": 1, "max_concurrent": 1, "token_budget": {"high_priority_reserve": 5}}"#,
                "missing field `budget`",
            ),
            (
                r#"{"revision": 1, "max_concurrent": 1, "token_budget": {"budget": -5, "high_priority_reserve": 0}}"#,
                "invalid value: integer `-5`",
            ),
            ("", "EOF while parsing"),
        ];
        for (body, expected) in cases {
            let err = serde_json::from_str::<Limits>(body)
                .expect_err(body)
                .to_string();
            assert!(err.contains(expected), "{body}: {err}");
        }
    }

    #[test]
    fn parsed_limits_out_of_range_are_refused_by_apply_limits_changing_nothing() {
        let cases: [(&str, bool, LimitsError); 6] = [
            (
                r#"{"revision": 9007199254740992, "max_concurrent": 1, "token_budget": {"budget": 1, "high_priority_reserve": 0}}"#,
                true,
                LimitsError::RevisionTooLarge {
                    value: MAX_REVISION + 1,
                    max: MAX_REVISION,
                },
            ),
            (
                r#"{"revision": 18446744073709551615, "max_concurrent": 1}"#,
                false,
                LimitsError::RevisionTooLarge {
                    value: u64::MAX,
                    max: MAX_REVISION,
                },
            ),
            (
                r#"{"revision": 6, "max_concurrent": 65536, "token_budget": {"budget": 1, "high_priority_reserve": 0}}"#,
                true,
                LimitsError::MaxConcurrentTooLarge {
                    value: MAX_CONCURRENT + 1,
                    max: MAX_CONCURRENT,
                },
            ),
            (
                r#"{"revision": 6, "max_concurrent": 1, "token_budget": {"budget": 34359738368, "high_priority_reserve": 0}}"#,
                true,
                LimitsError::BudgetTooLarge {
                    value: MAX_BUDGET + 1,
                    max: MAX_BUDGET,
                },
            ),
            (
                r#"{"revision": 6, "max_concurrent": 1, "token_budget": null}"#,
                true,
                LimitsError::TokenBudgetRequired,
            ),
            (
                r#"{"revision": 6, "max_concurrent": 1, "token_budget": {"budget": 0, "high_priority_reserve": 0}}"#,
                false,
                LimitsError::TokenBudgetNotConfigured,
            ),
        ];
        for (body, with_budget, expected) in cases {
            let next: Limits = serde_json::from_str(body).unwrap();
            let twin = Twin::new(|| {
                let b = LlmBulkhead::builder(MODEL, 2).initial_revision(5);
                if with_budget {
                    b.token_budget(TokenBudget::new(1000)).build().unwrap()
                } else {
                    b.build().unwrap()
                }
            });
            assert_eq!(twin.subject.apply_limits(next), Err(expected), "{body}");
            twin.assert_behaves_like_control(body);
        }
    }
}
