//! The callers' plan for one admission.

use async_bulkhead_llm::{Reservation, TokenUsage, usage::Progressive};

use crate::kit::reports::Finish;
use crate::kit::usage;

// `Model` (the hold rules and the booking split) lives in `caller_model.rs`; what the
// listener should hear of an admission (`Trace`) in `crate::kit::books`.

/// How a caller's call goes, decided up front.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plan {
    /// Actual prompt tokens (may exceed the estimate).
    input: u64,
    /// Final output tokens (may exceed the reservation's cap: an overrun).
    output: u64,
    pub(crate) reports: u64,
    /// The last report is the complete usage, plain (so the usage is known at settlement).
    closing: bool,
    pub(crate) finish: Finish,
}

impl Plan {
    pub(crate) fn new(
        rng: &mut fastrand::Rng,
        reservation: Reservation,
        always_usage: bool,
    ) -> Plan {
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
                Finish::Release(Some(usage(rng.u64(0..=input), rng.u64(0..=output))))
            }
            0 => Finish::Release(Some(usage(input, output))),
            1 => Finish::Release(None),
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

    /// The `k`th of `self.reports` cumulative reports.
    pub(crate) fn report(
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
