//! Usage reconciliation (the LLM ledger): streaming usage reports that move an admission's
//! hold, and the settlement that books consumption, refunds and overruns and tells the
//! estimator what a call really cost.
//!
//! # The hold
//!
//! An admission holds `r` tokens (its reservation) from admission. Reports of cumulative usage
//! move the hold (`docs/design.md` §U4.3):
//!
//! - a plain report holds `input + max(max_output, output)`: the estimated input is replaced by
//!   the actual one, the whole output reservation is kept, output beyond it expands the hold;
//! - a progressive report holds `remaining_output + safety_margin + max(0, output - max_output)`:
//!   input and output already generated stop being held.
//!
//! Every hold change is one update of the admission word (lock-free; a class admission's takes
//! its class's lock for it), so a refund is available to the next admission at once, and an
//! overrun blocks new admissions until it is released.
//!
//! # Booking (our fix of the original's quirk Q4, `docs/design.md` §D4)
//!
//! Each move of the hold, and the settlement (which moves it to the final usage before
//! returning it), is split at `r`: tokens added above `r` are *overrun*; tokens removed are
//! *refunded*; tokens added back below `r` (a later report raising a hold that had dropped)
//! are *re-held*. So `total_overrun` counts only tokens held above reservations (the original
//! counted any increase). Every total only grows: a hold is `r + overrun + reheld - refunded`
//! (its own bookings) at every step, and for every admission settled with usage
//! `reserved + overrun + reheld == consumed + refunded`, whatever the path its hold took. A
//! release that knows no usage books its hold as *returned unreported* instead (nobody said
//! what it cost): `reserved + overrun + reheld == refunded + returned_unreported`. Summed over
//! the admissions, the tokens in flight are
//! `reserved + overrun + reheld - refunded - consumed - returned_unreported`.

use crate::engine::Counter;
use crate::events::{Event, EventKind, ReleaseEvent, UsageEvent};
use crate::support::contain::contain;
use crate::vocabulary::admission_id::AdmissionId;
use crate::vocabulary::error::UsageError;
use crate::vocabulary::reservation::{
    Progressive, ReleaseReport, Reservation, TokenUsage, UsageReport,
};

use super::admission::Admission;
use super::estimate::TokenEstimate;
use super::shared::LlmCore;

/// The bookings of one move of a hold from `old` to `new`, split at the reservation `r`:
/// `(overrun, refunded, reheld)`.
pub(crate) fn book(r: u64, old: u64, new: u64) -> (u64, u64, u64) {
    let (old_base, old_excess) = (old.min(r), old.saturating_sub(r));
    let (new_base, new_excess) = (new.min(r), new.saturating_sub(r));
    let overrun = new_excess.saturating_sub(old_excess);
    let refunded = old_excess.saturating_sub(new_excess) + old_base.saturating_sub(new_base);
    let reheld = new_base.saturating_sub(old_base);
    (overrun, refunded, reheld)
}

impl LlmCore {
    /// Applies a cumulative usage report to `admission` (see the module docs). Checks
    /// everything before changing anything.
    pub(crate) fn report(
        &self,
        admission: &mut Admission,
        usage: TokenUsage,
        progressive: Option<Progressive>,
    ) -> Result<UsageReport, UsageError> {
        let reservation = admission.reservation();
        let reported = cumulative(admission.usage(), usage, progressive, reservation)?;
        let usage_changed = admission.usage() != Some(reported);
        let hold = match reservation {
            None => 0,
            Some(r) => {
                let overrun_output = reported.output().saturating_sub(r.max_output());
                let hold = match progressive {
                    None => reported
                        .input()
                        .checked_add(r.max_output().max(reported.output())),
                    Some(p) => p
                        .remaining_output_tokens
                        .checked_add(p.safety_margin_tokens)
                        .and_then(|h| h.checked_add(overrun_output)),
                };
                hold.ok_or(UsageError::HoldOverflow)?
            }
        };
        let previous_hold = self.engine().move_hold(admission.grant_mut(), hold)?;
        let effective = usage_changed || hold != previous_hold;
        if hold != previous_hold {
            let (overrun, refunded, reheld) =
                book(admission.reserved_tokens(), previous_hold, hold);
            admission.add_refunded(refunded);
            self.engine().count_all(
                admission.class(),
                &[
                    (Counter::Overrun, overrun),
                    (Counter::Refunded, refunded),
                    (Counter::Reheld, reheld),
                    (Counter::UsageReports, 1),
                ],
            );
        } else if effective {
            self.engine()
                .count_all(admission.class(), &[(Counter::UsageReports, 1)]);
        }
        if self.engine().has_rate() {
            // Usage beyond the reservation is charged to the tokens window as it is reported.
            let reserved = admission.reserved_tokens();
            let before = admission.usage().map_or(0, |u| u.total()).max(reserved);
            self.engine().correct_rate(
                admission.class(),
                before,
                reported.total().max(reserved).max(before),
            );
        }
        admission.record(reported, effective);
        let report = snapshot(admission, reported);
        if effective
            && self
                .listeners()
                .hears(EventKind::Usage, admission.sampled())
        {
            let event = UsageEvent {
                admission_id: report.admission_id,
                limit_revision: report.limit_revision,
                priority: admission.priority(),
                class: admission.class(),
                sequence: report.sequence,
                reserved_tokens: report.reserved,
                previous_held_tokens: previous_hold,
                held_tokens: hold,
                delta_tokens: i128::from(hold) - i128::from(previous_hold),
                usage: reported,
                output_cap: report.output_cap,
                output_remaining: report.output_remaining,
                over_reservation: report.over_reservation,
                progressive,
            };
            self.listeners()
                .emit(&Event::Usage(&event), admission.sampled());
        }
        Ok(report)
    }

    /// Settles an admission without explicit usage (a dropped permit): with the last reported
    /// usage if any; a call that never reported and that nobody listens to only returns its
    /// slot and its hold, booking a hold it returns as returned unreported (the release itself
    /// is not counted: `released` is derived, see `Engine::figures`).
    #[inline]
    pub(crate) fn settle_unused(&self, admission: &Admission) {
        // Anyone listening to releases at all (sampled or not): the general settlement, which
        // announces the release to those who hear this admission (one test of the mask here,
        // not the audience of this admission).
        if admission.usage().is_some()
            || self.listeners().mask()
                & (EventKind::Release.bit() | EventKind::Release.sampled_bit())
                != 0
        {
            self.settle_reported(admission);
        } else {
            self.engine().release_unreported(admission.grant());
        }
    }

    /// [`settle`](LlmCore::settle) for a dropped permit that reported usage or whose release
    /// someone hears: out of line, so that a drop's common case stays small. A sampled
    /// listener does not hear the release of an admission it did not sample: such a drop,
    /// without usage, is settled as one nobody hears.
    #[cold]
    #[inline(never)]
    fn settle_reported(&self, admission: &Admission) {
        if admission.usage().is_none()
            && !self
                .listeners()
                .hears(EventKind::Release, admission.sampled())
        {
            self.engine().release_unreported(admission.grant());
            return;
        }
        self.settle(admission, None);
    }

    /// Settles an admission with `usage`, else the last reported usage, else none: books the
    /// consumption and the last move of the hold (to the usage), or without usage the hold as
    /// returned unreported; returns the slot and the hold, tells the estimator, announces the
    /// release.
    pub(crate) fn settle(&self, admission: &Admission, usage: Option<TokenUsage>) -> ReleaseReport {
        let held = admission.held_tokens();
        let usage = usage.or(admission.usage());
        let mut refunded = 0;
        let mut overrun = 0;
        // Book before returning capacity, so a drainer woken by this release sees the books
        // complete. Releases themselves are not counted: `released` is derived.
        if let Some(usage) = usage {
            let consumed = usage.total();
            let mut reheld = 0;
            if admission.reservation().is_some() {
                (overrun, refunded, reheld) = book(admission.reserved_tokens(), held, consumed);
            }
            self.engine().count_all(
                admission.class(),
                &[
                    // Reported usage always reaches the consumed total, even when the hold is 0
                    // (Q3).
                    (Counter::Consumed, consumed),
                    (Counter::Overrun, overrun),
                    (Counter::Refunded, refunded),
                    (Counter::Reheld, reheld),
                ],
            );
        } else if held > 0 {
            // Nobody said what it cost: the hold goes back unbooked as consumed or refunded.
            self.engine()
                .count_all(admission.class(), &[(Counter::ReturnedUnreported, held)]);
        }
        if let Some(usage) = usage
            && self.engine().has_rate()
        {
            // The tokens window follows what the provider bills: from what it was charged (the
            // reservation, or more reported beyond it) to the usage.
            let reserved = admission.reserved_tokens();
            let charged = admission.usage().map_or(0, |u| u.total()).max(reserved);
            self.engine()
                .correct_rate(admission.class(), charged, usage.total());
        }
        // Capacity returns before any user code runs: nothing the estimator or a listener does
        // can keep it.
        self.engine().release(admission.grant());
        // Tell the estimator that sized this admission what it really cost. It is user code:
        // a panic is caught and counted, never unwound into the release (which may be a drop
        // on a thread that is already unwinding).
        if let (Some(usage), Some(memo), Some(reservation)) =
            (usage, admission.memo(), admission.reservation())
        {
            let estimate =
                TokenEstimate::new(reservation.input(), reservation.max_output()).with_memo(memo);
            if contain(|| self.estimator().observe(&estimate, usage)) {
                self.count_estimator_panic();
            }
        }
        if self
            .listeners()
            .hears(EventKind::Release, admission.sampled())
        {
            let event = ReleaseEvent {
                admission_id: admission.admission_id(),
                limit_revision: admission.limit_revision(),
                priority: admission.priority(),
                class: admission.class(),
                resources: admission.resources(),
                reserved_tokens: admission.reserved_tokens(),
                held_tokens: held,
                refunded_tokens: refunded,
                returned_tokens: held,
                returned_total_tokens: admission.refunded_tokens().saturating_add(held),
                usage_sequence: admission.usage_sequence(),
                usage,
            };
            self.listeners()
                .emit(&Event::Release(&event), admission.sampled());
        }
        ReleaseReport {
            held_tokens: held,
            refunded_tokens: refunded,
            overrun_tokens: overrun,
            returned_tokens: held,
            returned_total_tokens: admission.refunded_tokens().saturating_add(held),
            usage,
        }
    }
}

/// The cumulative usage after a report of `usage` on top of `previous` (each field's maximum),
/// checked against the reservation (a progressive report's remaining output must fit its
/// maximum output): for an admitted call and a bypassed one alike.
pub(crate) fn cumulative(
    previous: Option<TokenUsage>,
    usage: TokenUsage,
    progressive: Option<Progressive>,
    reservation: Option<Reservation>,
) -> Result<TokenUsage, UsageError> {
    if let (Some(p), Some(r)) = (progressive, reservation)
        && p.remaining_output_tokens > r.max_output()
    {
        return Err(UsageError::RemainingExceedsCap {
            remaining: p.remaining_output_tokens,
            cap: r.max_output(),
        });
    }
    match previous {
        None => Ok(usage),
        Some(prev) => Ok(TokenUsage::new(
            prev.input().max(usage.input()),
            prev.output().max(usage.output()),
        )?),
    }
}

/// The report of `admission` after `reported` was applied.
fn snapshot(admission: &Admission, reported: TokenUsage) -> UsageReport {
    report_figures(
        admission.admission_id(),
        admission.limit_revision(),
        admission.usage_sequence(),
        admission.reservation(),
        admission.held_tokens(),
        reported,
    )
}

/// A usage report's figures (`shadow_id` none: a bypass sets it).
pub(crate) fn report_figures(
    admission_id: AdmissionId,
    limit_revision: u64,
    sequence: u64,
    reservation: Option<Reservation>,
    held: u64,
    reported: TokenUsage,
) -> UsageReport {
    let reserved = reservation.map_or(0, |r| r.reserved());
    let output_cap = reservation.map(|r| r.max_output());
    UsageReport {
        admission_id,
        limit_revision,
        sequence,
        reserved,
        held,
        consumed: reported.total(),
        output_cap,
        output_remaining: output_cap.map(|cap| cap.saturating_sub(reported.output())),
        over_reservation: reservation.is_some() && reported.total() > reserved,
        shadow_id: None,
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::book;

    #[test]
    fn booking_splits_moves_at_the_reservation() {
        // r = 1100: a plain report of {20, 5} holds 1020 (refund 80)...
        assert_eq!(book(1100, 1100, 1020), (0, 80, 0));
        // ...{100, 1400} holds 1500: 400 above the reservation.
        assert_eq!(book(1100, 1100, 1500), (400, 0, 0));
        // Progressive 950 then 650: refunds 150 then 300.
        assert_eq!(book(1100, 1100, 950), (0, 150, 0));
        assert_eq!(book(1100, 950, 650), (0, 300, 0));
        // A hold that rises back below the reservation re-holds (not an overrun, Q4)...
        assert_eq!(book(1100, 128, 300), (0, 0, 172));
        // ...and one that crosses it splits.
        assert_eq!(book(1100, 1000, 1300), (200, 0, 100));
        assert_eq!(book(1100, 1300, 900), (0, 400, 0));
    }

    #[test]
    fn every_path_satisfies_the_identity() {
        // reserved + overrun + reheld == consumed + refunded (all gross), for any path, and
        // at every step the hold is reserved + overrun + reheld - refunded.
        let r = 1000u64;
        for path in [
            vec![1000, 500, 800, 1200, 300, 1500],
            vec![1000, 0, 2000, 0],
            vec![1000, 1000],
        ] {
            let (mut overrun, mut refunded, mut reheld) = (0u64, 0u64, 0u64);
            for w in path.windows(2) {
                let (o, f, h) = book(r, w[0], w[1]);
                overrun += o;
                refunded += f;
                reheld += h;
                assert_eq!(r + overrun + reheld - refunded, w[1], "{path:?}");
            }
            let consumed = *path.last().unwrap();
            assert_eq!(r + overrun + reheld, consumed + refunded, "{path:?}");
        }
    }
}
