//! report_usage / report_usage_progressive (Permit, OwnedPermit, RunContext)

use std::convert::Infallible;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, OwnedPermit, Permit, Priority, RunContext, RunError,
    TokenUsage, limits::MAX_BUDGET, usage::Progressive, usage::UsageError, usage::UsageReport,
};
use futures::executor::block_on;

use crate::support::{ReportFields, Twin, budgeted, fields, plain, usage, with_res};

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

impl Reporter for OwnedPermit {
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
    // Without a budget there is no cap and nothing is held (design §U4.3).
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
