//! loom models of usage reconciliation: a report moves its admission's hold with one CAS of the
//! admission word, racing admissions, releases and reconfigurations. In every interleaving a
//! refund is usable at once, an overrun blocks admissions until released (but is itself never
//! refused, even above the budget), no update is lost, and the books balance exactly:
//! `reserved + overrun + reheld == consumed + refunded` once every admission is settled with
//! usage (nothing returned unreported).
//!
//! Run: see `loom-tests/README.md`.
#![cfg(loom)]
// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, OwnedPermit, RejectReason, Rejection,
    Reservation, TokenBudget, TokenUsage, stats::TokenBudgetStats, usage::Progressive,
};
use loom::sync::Arc;
use loom::sync::atomic::AtomicBool;
use loom::sync::atomic::AtomicU64;
use loom::sync::atomic::Ordering::{AcqRel, Acquire, Release};
use loom::thread;

fn with_tokens(input: u64, max_output: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(input, max_output).unwrap())
}

fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).unwrap()
}

fn budgeted(max_concurrent: usize, budget: u64) -> LlmBulkhead {
    LlmBulkhead::builder("m", max_concurrent)
        .token_budget(TokenBudget::new(budget))
        .build()
        .unwrap()
}

fn acquire(bulkhead: &LlmBulkhead, options: AcquireOptions) -> Result<OwnedPermit, Rejection> {
    bulkhead
        .try_acquire_owned(&LlmRequest::new(), options)
        .map_err(|e: AcquireError| *e.rejection().expect("capacity refusal, not invalid input"))
}

/// What the threads of a model hold, checked at every admission.
///
/// Admissions are recorded after they commit and holds are lowered before they are released
/// or refunded, so the ledger never holds more than the bulkhead does. A report that raises a
/// hold is recorded after it returns, both in `tokens` and in `grown`: such growth is never
/// refused and may take the total above the budget, but the tokens admissions were granted
/// (`tokens - grown`) can only grow by admission, and an admission is only granted when the
/// whole in-flight total (growth included) plus its reservation fits the budget. So
/// `tokens - grown <= max_tokens` at every step of a correct implementation.
struct Ledger {
    slots: AtomicU64,
    tokens: AtomicU64,
    grown: AtomicU64,
    max_slots: u64,
    max_tokens: u64,
}

impl Ledger {
    fn new(max_slots: u64, max_tokens: u64) -> Arc<Ledger> {
        Arc::new(Ledger {
            slots: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            grown: AtomicU64::new(0),
            max_slots,
            max_tokens,
        })
    }

    /// An admission of `tokens` committed.
    fn enter(&self, tokens: u64) {
        let slots = self.slots.fetch_add(1, AcqRel) + 1;
        // Tokens first, then growth, both read-modify-writes (which read the latest value):
        // growth included in `held` is then included in `grown` too (`grow` adds it to
        // `grown` first), so `held - grown` never overstates what admissions hold.
        let held = self.tokens.fetch_add(tokens, AcqRel) + tokens;
        let grown = self.grown.fetch_add(0, AcqRel);
        assert!(
            slots <= self.max_slots,
            "{slots} slots held, ceiling {}",
            self.max_slots
        );
        assert!(
            held.saturating_sub(grown) <= self.max_tokens,
            "{held} tokens held ({grown} of them grown by reports), budget {}",
            self.max_tokens
        );
    }

    /// A hold is about to be lowered by `tokens` (a refund).
    fn shrink(&self, tokens: u64) {
        self.tokens.fetch_sub(tokens, AcqRel);
    }

    /// A hold was raised by `tokens` (a report above the reservation).
    fn grow(&self, tokens: u64) {
        // `grown` first: `tokens - grown` must never look larger than it is (see `enter`).
        self.grown.fetch_add(tokens, AcqRel);
        self.tokens.fetch_add(tokens, AcqRel);
    }

    /// An admission holding `tokens`, `grown` of them by reports, is about to be released.
    fn leave(&self, tokens: u64, grown: u64) {
        self.slots.fetch_sub(1, AcqRel);
        self.tokens.fetch_sub(tokens, AcqRel);
        self.grown.fetch_sub(grown, AcqRel);
    }
}

fn token_stats(bulkhead: &LlmBulkhead) -> TokenBudgetStats {
    bulkhead.stats().token_budget.expect("a budgeted bulkhead")
}

/// Everything came back, and the books say exactly `(reserved, consumed, refunded, overrun,
/// reheld)` (refunds gross), which must balance.
fn assert_settled(bulkhead: &LlmBulkhead, books: (u64, u64, u64, u64, u64)) {
    let stats = bulkhead.stats();
    assert_eq!(stats.in_flight, 0, "slots returned exactly");
    assert_eq!(stats.admitted, stats.released);
    let t = stats.token_budget.unwrap();
    assert_eq!(t.in_flight_tokens, 0, "tokens returned exactly");
    assert_eq!(
        (
            t.total_reserved,
            t.total_consumed,
            t.total_refunded,
            t.total_overrun,
            t.total_reheld
        ),
        books,
        "(reserved, consumed, refunded, overrun, reheld)"
    );
    assert_eq!(
        t.total_returned_unreported, 0,
        "every admission settled with usage"
    );
    assert_eq!(
        t.total_reserved + t.total_overrun + t.total_reheld,
        t.total_consumed + t.total_refunded,
        "the books balance"
    );
}

/// A report refunds part of a hold that fills the whole budget while a newcomer asks for
/// exactly the refunded tokens: it is admitted iff it commits after the refund (at once once
/// the report has returned), refused `budget_limit` otherwise, and never takes the total above
/// the budget.
#[test]
fn refund_races_an_admission_needing_exactly_the_refund() {
    loom::model(|| {
        // Budget 1000, fully held by a 400 + 600 reservation.
        let bulkhead = budgeted(2, 1000);
        let ledger = Ledger::new(2, 1000);
        let mut held = acquire(&bulkhead, with_tokens(400, 600)).unwrap();
        ledger.enter(1000);
        let refunded = Arc::new(AtomicBool::new(false));

        let reporter = {
            let (ledger, refunded) = (ledger.clone(), refunded.clone());
            thread::spawn(move || {
                // The prompt was 300 tokens, not 400: the hold drops to 300 + 600.
                ledger.shrink(100);
                let report = held.report_usage(usage(300, 50)).unwrap();
                assert_eq!(
                    (
                        report.reserved,
                        report.held,
                        report.consumed,
                        report.sequence
                    ),
                    (1000, 900, 350, 1)
                );
                refunded.store(true, Release);
                held
            })
        };
        let admitter = {
            let (bulkhead, ledger, refunded) = (bulkhead.clone(), ledger.clone(), refunded.clone());
            thread::spawn(move || {
                let after_refund = refunded.load(Acquire);
                match acquire(&bulkhead, with_tokens(40, 60)) {
                    Ok(permit) => {
                        ledger.enter(100);
                        Some(permit)
                    }
                    Err(rejection) => {
                        assert!(!after_refund, "the refund was not available at once");
                        assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
                        // Decided before the refund: the whole budget was held.
                        let t = rejection.detail().token_budget.unwrap();
                        assert_eq!(
                            (t.in_flight_tokens, t.available, t.requested),
                            (1000, 0, 100)
                        );
                        None
                    }
                }
            })
        };
        let held = reporter.join().unwrap();
        let newcomer = admitter.join().unwrap();

        let admitted = newcomer.is_some();
        let t = token_stats(&bulkhead);
        assert_eq!(t.in_flight_tokens, 900 + if admitted { 100 } else { 0 });
        assert!(t.in_flight_tokens <= t.budget, "never above the budget");
        assert_eq!(
            bulkhead.stats().rejected_by_reason.budget_limit,
            u64::from(!admitted)
        );

        if let Some(permit) = newcomer {
            ledger.leave(100, 0);
            let report = permit.release(Some(usage(10, 20)));
            assert_eq!((report.held_tokens, report.refunded_tokens), (100, 70));
        }
        ledger.leave(900, 0);
        // Settles from 900 to 300 + 50: 550 more refunded.
        let report = held.release(None);
        assert_eq!(
            (
                report.held_tokens,
                report.refunded_tokens,
                report.overrun_tokens
            ),
            (900, 550, 0)
        );
        // A: reserved 1000, consumed 350, refunded 100 + 550.
        // Newcomer: reserved 100, consumed 30, refunded 70.
        let a = u64::from(admitted);
        assert_settled(
            &bulkhead,
            (1000 + 100 * a, 350 + 30 * a, 650 + 70 * a, 0, 0),
        );
    });
}

/// A report raises a hold above its reservation while a newcomer is admitted: the overrun is
/// never refused (the total may exceed the budget, by the overrun only), and the newcomer is
/// admitted only if it committed before the overrun, when its reservation still fit.
#[test]
fn overrun_races_an_admission() {
    loom::model(|| {
        // Budget 1000; 500 held. A newcomer of 400 fits next to 500 (900) but not next to
        // the 800 the overrun makes (1200).
        let bulkhead = budgeted(2, 1000);
        let ledger = Ledger::new(2, 1000);
        let mut held = acquire(&bulkhead, with_tokens(100, 400)).unwrap();
        ledger.enter(500);
        let overran = Arc::new(AtomicBool::new(false));
        let admitted_flag = Arc::new(AtomicBool::new(false));

        let reporter = {
            let (bulkhead, ledger, overran, admitted_flag) = (
                bulkhead.clone(),
                ledger.clone(),
                overran.clone(),
                admitted_flag.clone(),
            );
            thread::spawn(move || {
                let after_admission = admitted_flag.load(Acquire);
                // 700 output against a 400 cap: the hold grows to 100 + 700, 300 above the
                // reservation, whatever else is in flight.
                let report = held.report_usage(usage(100, 700)).unwrap();
                ledger.grow(300);
                overran.store(true, Release);
                assert_eq!(
                    (report.reserved, report.held, report.output_remaining),
                    (500, 800, Some(0))
                );
                assert!(report.over_reservation);
                if after_admission {
                    // Reported after the newcomer was admitted: the overrun was not refused
                    // although it takes the total above the budget.
                    let t = token_stats(&bulkhead);
                    assert_eq!((t.in_flight_tokens, t.budget), (1200, 1000));
                }
                held
            })
        };
        let admitter = {
            let (bulkhead, ledger, overran, admitted_flag) = (
                bulkhead.clone(),
                ledger.clone(),
                overran.clone(),
                admitted_flag.clone(),
            );
            thread::spawn(move || {
                let after_overrun = overran.load(Acquire);
                match acquire(&bulkhead, with_tokens(100, 300)) {
                    Ok(permit) => {
                        assert!(!after_overrun, "admitted over the budget after the overrun");
                        ledger.enter(400);
                        admitted_flag.store(true, Release);
                        Some(permit)
                    }
                    Err(rejection) => {
                        assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
                        // Only the overrun can refuse it, and the detail shows it.
                        let t = rejection.detail().token_budget.unwrap();
                        assert_eq!(
                            (t.in_flight_tokens, t.available, t.requested),
                            (800, 200, 400)
                        );
                        assert!(t.in_flight_tokens + t.requested > t.effective_budget);
                        None
                    }
                }
            })
        };
        let held = reporter.join().unwrap();
        let newcomer = admitter.join().unwrap();

        let admitted = newcomer.is_some();
        let t = token_stats(&bulkhead);
        // Admitted first: 500 + 400, then the overrun takes it to 1200, above the budget.
        assert_eq!(t.in_flight_tokens, 800 + if admitted { 400 } else { 0 });
        assert_eq!(t.available, if admitted { 0 } else { 200 });
        assert_eq!(t.total_overrun, 300);
        // While the overrun is held, nothing else gets in.
        // (250 would fit next to the 500 reserved, not next to the 800 held.)
        let blocked = acquire(&bulkhead, with_tokens(100, 150)).unwrap_err();
        assert_eq!(blocked.reason(), RejectReason::BudgetLimit);

        if let Some(permit) = newcomer {
            ledger.leave(400, 0);
            let report = permit.release(Some(usage(100, 250)));
            assert_eq!((report.refunded_tokens, report.overrun_tokens), (50, 0));
        }
        ledger.leave(800, 300);
        // Settles from 800 to 100 + 750: 50 more above the reservation.
        let report = held.release(Some(usage(100, 750)));
        assert_eq!(
            (
                report.held_tokens,
                report.refunded_tokens,
                report.overrun_tokens
            ),
            (800, 0, 50)
        );
        // A: reserved 500, consumed 850, overrun 300 + 50. Newcomer: reserved 400, consumed
        // 350, refunded 50.
        let a = u64::from(admitted);
        assert_settled(&bulkhead, (500 + 400 * a, 850 + 350 * a, 50 * a, 350, 0));
    });
}

/// Two reports on one permit (a refund, then a rise past the reservation that re-holds the
/// refund and overruns) race the release of another permit and a budget change, three
/// read-modify-writes of one word: none is lost, and the books are exact.
#[test]
fn reports_race_a_release_and_set_budget() {
    loom::model(|| {
        let bulkhead = budgeted(2, 1000);
        let mut a = acquire(&bulkhead, with_tokens(200, 300)).unwrap();
        let b = acquire(&bulkhead, with_tokens(300, 200)).unwrap();

        let reporter = thread::spawn(move || {
            // 100 in, 100 out: hold 100 + 300, 100 refunded.
            let first = a.report_usage(usage(100, 100)).unwrap();
            assert_eq!(
                (first.held, first.sequence, first.over_reservation),
                (400, 1, false)
            );
            // 100 in, 450 out: hold 100 + 450 = 550, re-holding the 100 and 50 above the 500.
            let second = a.report_usage(usage(100, 450)).unwrap();
            assert_eq!(
                (second.held, second.sequence, second.over_reservation),
                (550, 2, true)
            );
            a
        });
        let releaser = thread::spawn(move || {
            let report = b.release(Some(usage(250, 100)));
            assert_eq!(
                (
                    report.held_tokens,
                    report.refunded_tokens,
                    report.overrun_tokens
                ),
                (500, 150, 0)
            );
        });
        let reconfigurer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let now = bulkhead.set_budget(600).unwrap();
                assert_eq!((now.revision, now.token_budget.unwrap().budget), (1, 600));
            })
        };
        let a = reporter.join().unwrap();
        releaser.join().unwrap();
        reconfigurer.join().unwrap();

        // Exactly A's hold is left, under the new budget.
        let t = token_stats(&bulkhead);
        assert_eq!((t.budget, t.in_flight_tokens, t.available), (600, 550, 50));
        assert_eq!(bulkhead.stats().in_flight, 1);
        let refused = acquire(&bulkhead, with_tokens(50, 50)).unwrap_err();
        assert_eq!(refused.reason(), RejectReason::BudgetLimit);
        assert_eq!(refused.limit_revision(), 1);
        assert_eq!(refused.detail().token_budget.unwrap().in_flight_tokens, 550);

        // Settles from 550 to 100 + 500: 50 more above the reservation.
        let report = a.release(Some(usage(100, 500)));
        assert_eq!(
            (
                report.held_tokens,
                report.refunded_tokens,
                report.overrun_tokens
            ),
            (550, 0, 50)
        );
        // A: reserved 500, consumed 600, refunded 100 then re-held 100 (refunds are gross: the
        // re-hold does not take them back), overrun 50 + 50. B: reserved 500, consumed 350,
        // refunded 150.
        assert_settled(&bulkhead, (1000, 950, 100 + 150, 100, 100));
    });
}

/// A progressive report drops a hold that fills the whole budget to 0 while a newcomer asks
/// for the whole budget; the reporter then releases with a usage above the hold of 0 (re-held
/// below the reservation, not an overrun, and always consumed).
#[test]
fn progressive_report_to_zero_races_an_admission() {
    loom::model(|| {
        let bulkhead = budgeted(2, 1000);
        let ledger = Ledger::new(2, 1000);
        let mut held = acquire(&bulkhead, with_tokens(200, 800)).unwrap();
        ledger.enter(1000);
        let dropped = Arc::new(AtomicBool::new(false));

        let reporter = {
            let (ledger, dropped) = (ledger.clone(), dropped.clone());
            thread::spawn(move || {
                // Prefill done, the provider says nothing more will be generated.
                ledger.shrink(1000);
                let report = held
                    .report_usage_progressive(usage(200, 600), Progressive::new(0))
                    .unwrap();
                assert_eq!((report.held, report.consumed, report.sequence), (0, 800, 1));
                dropped.store(true, Release);
                ledger.leave(0, 0);
                // The final usage is above the hold of 0 but below the reservation.
                let report = held.release(Some(usage(200, 650)));
                assert_eq!(
                    (
                        report.held_tokens,
                        report.refunded_tokens,
                        report.overrun_tokens
                    ),
                    (0, 0, 0)
                );
                assert_eq!(report.usage, Some(usage(200, 650)));
            })
        };
        let admitter = {
            let (bulkhead, ledger, dropped) = (bulkhead.clone(), ledger.clone(), dropped.clone());
            thread::spawn(move || {
                let after_drop = dropped.load(Acquire);
                match acquire(&bulkhead, with_tokens(500, 500)) {
                    Ok(permit) => {
                        ledger.enter(1000);
                        Some(permit)
                    }
                    Err(rejection) => {
                        assert!(!after_drop, "the refund was not available at once");
                        assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
                        let t = rejection.detail().token_budget.unwrap();
                        assert_eq!((t.in_flight_tokens, t.requested), (1000, 1000));
                        None
                    }
                }
            })
        };
        reporter.join().unwrap();
        let newcomer = admitter.join().unwrap();

        let admitted = newcomer.is_some();
        let t = token_stats(&bulkhead);
        assert_eq!(t.in_flight_tokens, if admitted { 1000 } else { 0 });
        assert_eq!(bulkhead.stats().in_flight, u64::from(admitted));
        if let Some(permit) = newcomer {
            ledger.leave(1000, 0);
            let report = permit.release(Some(usage(500, 500)));
            assert_eq!(report.refunded_tokens, 0);
        }
        // A: reserved 1000, consumed 850, refunded 1000 then re-held 850 (both gross).
        // Newcomer: reserved 1000, consumed 1000.
        let a = u64::from(admitted);
        assert_settled(&bulkhead, (1000 + 1000 * a, 850 + 1000 * a, 1000, 0, 850));
    });
}

/// A report moves a hold in one step: a newcomer that fits neither before nor after any of the
/// moves (a refund, then a rise past the reservation) is refused whenever it decides, and its
/// refusal shows one of the holds the reports made, never a value in between.
#[test]
fn a_moving_hold_never_opens_a_gap() {
    loom::model(|| {
        let bulkhead = budgeted(2, 1000);
        let mut held = acquire(&bulkhead, with_tokens(400, 600)).unwrap();

        let reporter = thread::spawn(move || {
            // 1000 -> 300 + 600 = 900 (refund 100) -> 300 + 800 = 1100 (re-hold 100, overrun
            // 100).
            assert_eq!(held.report_usage(usage(300, 50)).unwrap().held, 900);
            assert_eq!(held.report_usage(usage(300, 800)).unwrap().held, 1100);
            held
        });
        let admitter = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                // 200 fits next to none of 1000, 900 and 1100.
                let rejection = acquire(&bulkhead, with_tokens(100, 100)).unwrap_err();
                assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
                let t = rejection.detail().token_budget.unwrap();
                assert!(
                    [1000, 900, 1100].contains(&t.in_flight_tokens),
                    "refused on a hold no report made: {t:?}"
                );
            })
        };
        let held = reporter.join().unwrap();
        admitter.join().unwrap();

        let report = held.release(None);
        assert_eq!(
            (
                report.held_tokens,
                report.refunded_tokens,
                report.overrun_tokens
            ),
            (1100, 0, 0)
        );
        // Reserved 1000, consumed 1100, refunded 100 then re-held 100, overrun 100.
        assert_settled(&bulkhead, (1000, 1100, 100, 100, 100));
        assert_eq!(bulkhead.stats().rejected_by_reason.budget_limit, 1);
    });
}
