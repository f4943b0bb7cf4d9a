//! Usage reports and settlements, each checked against the callers' model of the admission
//! (`crate::caller_model::Model`, the hold rules and the booking split written independently
//! of the crate): random reports and random explicit usage for the chaos mixes, the checked
//! report step every family takes, and the checked settlement.

use async_bulkhead_llm::{TokenUsage, usage::Progressive, usage::UsageError};

use super::books::{Book, bump};
use super::usage;
use crate::caller_model::{AnyPermit, Model, Reporter, Settled};

/// Far above `MAX_BUDGET`: a hold this large can never be counted (`HoldOverflow`).
const HUGE: u64 = 1 << 40;

impl Model {
    /// A random report: growing (plain or progressive), stale, or one that must be refused
    /// (a remaining output above the cap, a hold too large to count). `valid` only
    /// draws reports that must be accepted.
    pub(crate) fn random_report(
        &self,
        rng: &mut fastrand::Rng,
        valid: bool,
    ) -> (TokenUsage, Option<Progressive>) {
        let cap = self.cap();
        let prev = self.reported.unwrap_or(usage(0, 0));
        let growth = |rng: &mut fastrand::Rng| {
            usage(
                prev.input()
                    .max(rng.u64(0..=self.reservation.input() * 3 / 2 + 10)),
                prev.output() + rng.u64(0..=cap / 3 + 40),
            )
        };
        let kind = if valid { rng.u8(4..10) } else { rng.u8(0..10) };
        match kind {
            // Stale or duplicate; a progressive one may still move the hold.
            0 => {
                let stale = usage(rng.u64(0..=prev.input()), rng.u64(0..=prev.output()));
                let progressive = rng
                    .bool()
                    .then(|| Progressive::new(rng.u64(0..=cap)).safety_margin(rng.u64(0..32)));
                (stale, progressive)
            }
            // A plain hold too large to count.
            1 => (usage(HUGE, prev.output()), None),
            // A remaining output above the cap.
            2 => (
                growth(rng),
                Some(Progressive::new(cap + 1 + rng.u64(0..100))),
            ),
            // A safety margin too large to count.
            3 => (
                growth(rng),
                Some(Progressive::new(rng.u64(0..=cap)).safety_margin(HUGE)),
            ),
            4..=6 => (growth(rng), None),
            7 => {
                // Authoritative: what may still come, plus a margin.
                let next = growth(rng);
                let remaining = cap.saturating_sub(next.output());
                let p = Progressive::new(remaining).safety_margin(rng.u64(0..64));
                (next, Some(p))
            }
            // Arbitrary remaining output: may raise the hold again (re-held).
            _ => (
                growth(rng),
                Some(Progressive::new(rng.u64(0..=cap)).safety_margin(rng.u64(0..64))),
            ),
        }
    }

    /// Random explicit usage for a settlement: below, at or above the reservation.
    pub(crate) fn random_usage(&self, rng: &mut fastrand::Rng) -> TokenUsage {
        usage(
            rng.u64(0..=self.reservation.input() * 2 + 5),
            rng.u64(0..=self.cap() * 3 / 2 + 10),
        )
    }
}

/// One report through `reporter`, checked against (and applied to) the model: the crate
/// refuses exactly the reports the model refuses, with the same error, and a refused report
/// changes nothing; an accepted one answers with the model's hold, sequence, reservation,
/// consumption, caps and remaining output, and its sequence grows iff it was effective
/// (counted in `book`). Returns the refusal, or whether the report was effective.
pub(crate) fn check_report(
    reporter: &mut impl Reporter,
    model: &mut Model,
    report: TokenUsage,
    progressive: Option<Progressive>,
    book: &Book,
) -> Result<bool, UsageError> {
    assert_eq!(reporter.held(), model.held);
    let sequence = model.sequence;
    let predicted = model.predict(report, progressive);
    match (predicted, reporter.report(report, progressive)) {
        (Err(expected), Err(error)) => {
            assert_eq!(error, expected, "{report:?} {progressive:?} on {model:?}");
            assert_eq!(
                reporter.held(),
                model.held,
                "a refused report changes nothing"
            );
            Err(error)
        }
        (Ok((merged, hold)), Ok(got)) => {
            let effective = model.apply(merged, hold);
            assert_eq!(
                (got.held, got.sequence, got.reserved, got.consumed),
                (model.held, model.sequence, model.reserved(), merged.total()),
                "(held, sequence, reserved, consumed) after {report:?} {progressive:?} on {model:?}"
            );
            assert_eq!(got.over_reservation, merged.total() > model.reserved());
            assert_eq!(got.output_cap, Some(model.cap()));
            assert_eq!(
                got.output_remaining,
                Some(model.cap().saturating_sub(merged.output()))
            );
            assert_eq!(reporter.held(), model.held);
            assert_eq!(got.sequence > sequence, effective);
            if effective {
                bump(&book.effective_reports);
            }
            Ok(effective)
        }
        (predicted, got) => panic!(
            "report {report:?} {progressive:?} on {model:?}: expected {predicted:?}, got {got:?}"
        ),
    }
}

/// One random report (see [`Model::random_report`]) through `reporter`, checked.
pub(crate) fn report_step(
    reporter: &mut impl Reporter,
    model: &mut Model,
    rng: &mut fastrand::Rng,
    valid: bool,
    book: &Book,
) {
    let (report, progressive) = model.random_report(rng, valid);
    let _ = check_report(reporter, model, report, progressive, book);
}

/// How a caller ends its admission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Finish {
    /// Dropped without release: settled with the last reported usage, if any.
    Drop,
    /// `release(usage)`: with explicit usage, or (`None`) the last reported, if any.
    Release(Option<TokenUsage>),
}

impl Finish {
    /// A drop, a release with the last reported usage, or one with random explicit usage.
    pub(crate) fn random(rng: &mut fastrand::Rng, model: &Model) -> Finish {
        match rng.u8(0..3) {
            0 => Finish::Drop,
            1 => Finish::Release(Some(model.random_usage(rng))),
            _ => Finish::Release(None),
        }
    }

    /// The explicit usage it settles with, if any.
    pub(crate) fn explicit(self) -> Option<TokenUsage> {
        match self {
            Finish::Release(usage) => usage,
            Finish::Drop => None,
        }
    }
}

/// Settles `permit` as `finish` says; the model follows, and a release's report must be the
/// model's (the hold released, the refund, the overrun, the usage settled with).
pub(crate) fn settle(permit: AnyPermit<'_>, model: &mut Model, finish: Finish) -> Settled {
    let settled = model.settle(finish.explicit());
    match finish {
        Finish::Drop => drop(permit),
        Finish::Release(explicit) => {
            let report = permit.release(explicit);
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
        }
    }
    settled
}
