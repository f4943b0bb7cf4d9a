//! The callers' model of one admission (extending `crate::caller_model::Model`),
//! and random reports checked against it.

use std::sync::atomic::{AtomicU64, Ordering};

use async_bulkhead_llm::{TokenUsage, usage::Progressive};

use super::{HUGE, usage};
use crate::caller_model::{Model, Reporter};

// `Model` (the hold rules and the booking split) lives in `caller_model.rs`.

impl Model {
    /// A random report: growing (plain or progressive), stale, or one that must be refused
    /// (a remaining output above the cap, a hold too large to count). `valid` only
    /// draws reports that must be accepted.
    fn random_report(
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

// ------------------------------------------------------------------------------------------
// Permits and reports.
// ------------------------------------------------------------------------------------------

/// One random report through `reporter`, checked against (and applied to) the model; an
/// effective one is counted in `effective_reports`.
pub(crate) fn report_step(
    reporter: &mut impl Reporter,
    model: &mut Model,
    rng: &mut fastrand::Rng,
    valid: bool,
    effective_reports: &AtomicU64,
) {
    assert_eq!(reporter.held(), model.held);
    let (report, progressive) = model.random_report(rng, valid);
    let predicted = model.predict(report, progressive);
    match (predicted, reporter.report(report, progressive)) {
        (Err(expected), Err(error)) => {
            assert_eq!(error, expected, "{report:?} {progressive:?} on {model:?}");
            assert_eq!(
                reporter.held(),
                model.held,
                "a refused report changes nothing"
            );
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
            assert_eq!(reporter.held(), model.held);
            if effective {
                effective_reports.fetch_add(1, Ordering::Relaxed);
            }
        }
        (predicted, got) => panic!(
            "report {report:?} {progressive:?} on {model:?}: expected {predicted:?}, got {got:?}"
        ),
    }
}
