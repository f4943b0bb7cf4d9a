//! Usage reconciliation: streaming usage reports that move an admission's hold, and the
//! settlement that books consumption, refunds and overruns.
//!
//! # The hold
//!
//! An admission holds `r` tokens (its reservation) from admission. Reports of cumulative usage
//! move the hold (upstream §4.3):
//!
//! - a plain report holds `input + max(max_output, output)`: the estimated input is replaced by
//!   the actual one, the whole output reservation is kept, output beyond it expands the hold;
//! - a progressive report holds `remaining_output + safety_margin + max(0, output - max_output)`:
//!   input and output already generated stop being held.
//!
//! Every hold change is one lock-free update of the admission word, so a refund is available to
//! the next admission at once, and an overrun blocks new admissions until it is released.
//!
//! # Booking (our Q4 fix)
//!
//! Each move of the hold, and the settlement (which moves it to the final usage before
//! returning it), is split at `r`: tokens added above `r` are *overrun*; tokens removed are
//! *refunded*; tokens added back below `r` (a later report raising a hold that had dropped)
//! are *re-held* and taken off the refunds. So `total_overrun` counts only tokens held above
//! reservations (the original counted any increase), `total_refunded` is net, and for every
//! admission settled with usage `reserved + overrun == consumed + refunded`, whatever the path
//! its hold took.

use crate::admission_id::AdmissionId;
use crate::bulkhead::Inner;
use crate::error::UsageError;
use crate::estimate::TokenEstimate;
use crate::events::{Event, EventKind, ReleaseEvent, UsageEvent};
use crate::local;
use crate::permit::{Grant, ReleaseReport};
use crate::reservation::TokenUsage;
use crate::stats::Counter;
use crate::sync::unmodeled::Ordering;

/// A progressive reconciliation: how much output the provider may still generate, from an
/// authoritative source, plus a safety margin. Use it only once prefill is known complete.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::Progressive;
///
/// let p = Progressive::new(600).safety_margin(50);
/// assert_eq!((p.remaining_output_tokens, p.safety_margin_tokens), (600, 50));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Progressive {
    /// Output tokens the call may still generate; at most the reservation's maximum output.
    pub remaining_output_tokens: u64,
    /// Extra tokens kept held for safety (default 0).
    pub safety_margin_tokens: u64,
}

impl Progressive {
    /// `remaining_output_tokens` still to come, no safety margin.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::Progressive::new(10).safety_margin_tokens, 0);
    /// ```
    pub const fn new(remaining_output_tokens: u64) -> Progressive {
        Progressive {
            remaining_output_tokens,
            safety_margin_tokens: 0,
        }
    }

    /// This reconciliation with a safety margin.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::Progressive::new(10).safety_margin(128).safety_margin_tokens, 128);
    /// ```
    pub const fn safety_margin(mut self, tokens: u64) -> Progressive {
        self.safety_margin_tokens = tokens;
        self
    }
}

/// What a usage report did, as the permit sees it afterwards.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::*;
///
/// let bulkhead = LlmBulkhead::builder("m", 1).token_budget(TokenBudget::new(5000)).build()?;
/// let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
/// let mut permit = bulkhead.try_acquire(&LlmRequest::new(), opts)?;
/// let report = permit.report_usage(TokenUsage::new(20, 5)?)?;
/// assert_eq!((report.sequence, report.reserved, report.held, report.consumed), (1, 1100, 1020, 25));
/// assert_eq!((report.output_cap, report.output_remaining, report.over_reservation), (Some(1000), Some(995), false));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct UsageReport {
    /// The admission's id.
    pub admission_id: AdmissionId,
    /// Revision of the limits that admitted it.
    pub limit_revision: u64,
    /// Effective reports so far (a stale or duplicate report does not count).
    pub sequence: u64,
    /// The original reservation (0 without a token budget).
    pub reserved: u64,
    /// The hold now (0 without a token budget).
    pub held: u64,
    /// Cumulative input + output reported.
    pub consumed: u64,
    /// The reservation's maximum output (`None` without a token budget).
    pub output_cap: Option<u64>,
    /// `output_cap - output`, at least 0 (`None` without a token budget).
    pub output_remaining: Option<u64>,
    /// Whether `consumed` exceeds the reservation (always false without a token budget).
    pub over_reservation: bool,
}

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

impl Inner {
    /// Applies a cumulative usage report to `grant` (see the module docs). Checks everything
    /// before changing anything.
    pub(crate) fn report(
        &self,
        grant: &mut Grant,
        usage: TokenUsage,
        progressive: Option<Progressive>,
    ) -> Result<UsageReport, UsageError> {
        let reservation = grant.reservation();
        if let (Some(p), Some(r)) = (progressive, reservation)
            && p.remaining_output_tokens > r.max_output()
        {
            return Err(UsageError::RemainingExceedsCap {
                remaining: p.remaining_output_tokens,
                cap: r.max_output(),
            });
        }
        let reported = match grant.reported() {
            None => usage,
            Some(prev) => TokenUsage::new(
                prev.input().max(usage.input()),
                prev.output().max(usage.output()),
            )?,
        };
        let usage_changed = grant.reported() != Some(reported);
        let previous_hold = grant.held;
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
        if hold != previous_hold {
            self.move_hold(previous_hold, hold)?;
            let r = reservation.map_or(0, |r| r.reserved());
            let (overrun, refunded, reheld) = book(r, previous_hold, hold);
            local::with(&self.hub, |sink| {
                sink.bump(Counter::Overrun, overrun);
                sink.bump(Counter::Refunded, refunded);
                sink.bump(Counter::Reheld, reheld);
            });
        }
        grant.held = hold;
        grant.set_reported(reported);
        if usage_changed || hold != previous_hold {
            grant.sequence += 1;
        }
        let report = snapshot(grant, reported);
        if (usage_changed || hold != previous_hold) && self.listeners.wants(EventKind::Usage) {
            let event = UsageEvent {
                admission_id: report.admission_id,
                limit_revision: report.limit_revision,
                priority: grant.priority,
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
            self.listeners.emit(&Event::Usage(&event));
        }
        Ok(report)
    }

    /// Moves the tokens in flight from one hold to another, in one CAS of the word.
    fn move_hold(&self, from: u64, to: u64) -> Result<(), UsageError> {
        self.state.update(|s| {
            let tokens = if to >= from {
                s.tokens().checked_add(to - from)
            } else {
                Some(s.tokens() - (from - to))
            };
            // The tokens in flight must stay within what the word counts (`MAX_BUDGET`).
            let next = tokens
                .and_then(|t| s.with_tokens(t))
                .ok_or(UsageError::HoldOverflow)?;
            Ok((next, ()))
        })
    }

    /// Settles an admission without any usage (a dropped permit that never reported): returns
    /// its slot and its hold and books nothing (`released` is derived, see `stats`).
    #[inline]
    pub(crate) fn settle_unused(&self, grant: &Grant) {
        if grant.reported().is_some() || self.listeners.wants(EventKind::Release) {
            self.settle(grant, None);
        } else {
            self.release_capacity(grant.held);
        }
    }

    /// Settles an admission with `usage`, else the last reported usage, else none: books the
    /// consumption and the last move of the hold (to the usage), tells the estimator, returns
    /// the slot and the hold.
    pub(crate) fn settle(&self, grant: &Grant, usage: Option<TokenUsage>) -> ReleaseReport {
        let held = grant.held;
        let usage = usage.or(grant.reported());
        let mut refunded = 0;
        let mut overrun = 0;
        // Book before returning capacity, so a drainer woken by this release sees the books
        // complete. Releases themselves are not counted: `released` is derived.
        if let Some(usage) = usage {
            let consumed = usage.total();
            let r = grant.reservation().map_or(0, |r| r.reserved());
            let reheld;
            if grant.reservation().is_some() {
                (overrun, refunded, reheld) = book(r, held, consumed);
            } else {
                reheld = 0;
            }
            local::with(&self.hub, |sink| {
                // Reported usage always reaches the consumed total, even when the hold is 0.
                sink.bump(Counter::Consumed, consumed);
                sink.bump(Counter::Overrun, overrun);
                sink.bump(Counter::Refunded, refunded);
                sink.bump(Counter::Reheld, reheld);
            });
        }
        // Capacity returns before any user code runs: nothing the estimator or a listener does
        // can keep it (issue #11).
        self.release_capacity(held);
        // Tell the estimator that sized this admission what it really cost. It is user code:
        // a panic is caught and counted, never unwound into the release (which may be a drop
        // on a thread that is already unwinding).
        if let (Some(usage), Some(memo), Some(reservation)) =
            (usage, grant.memo(), grant.reservation())
        {
            let estimate =
                TokenEstimate::new(reservation.input(), reservation.max_output()).with_memo(memo);
            if crate::contain::contain(|| self.estimator.observe(&estimate, usage)) {
                self.estimator_panics.fetch_add(1, Ordering::Relaxed);
            }
        }
        if self.listeners.wants(EventKind::Release) {
            let event = ReleaseEvent {
                admission_id: grant.id.id(),
                limit_revision: grant.revision,
                priority: grant.priority,
                reserved_tokens: grant.reservation().map_or(0, |r| r.reserved()),
                held_tokens: held,
                refunded_tokens: refunded,
                usage_sequence: grant.sequence,
                usage,
            };
            self.listeners.emit(&Event::Release(&event));
        }
        ReleaseReport {
            held_tokens: held,
            refunded_tokens: refunded,
            overrun_tokens: overrun,
            usage,
        }
    }
}

/// The report of `grant` after `reported` was applied.
fn snapshot(grant: &Grant, reported: TokenUsage) -> UsageReport {
    let reserved = grant.reservation().map_or(0, |r| r.reserved());
    let output_cap = grant.reservation().map(|r| r.max_output());
    UsageReport {
        admission_id: grant.id.id(),
        limit_revision: grant.revision,
        sequence: grant.sequence,
        reserved,
        held: grant.held,
        consumed: reported.total(),
        output_cap,
        output_remaining: output_cap.map(|cap| cap.saturating_sub(reported.output())),
        over_reservation: grant.reservation().is_some() && reported.total() > reserved,
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
        // A hold that rises back below the reservation re-holds (not an overrun: Q4)...
        assert_eq!(book(1100, 128, 300), (0, 0, 172));
        // ...and one that crosses it splits.
        assert_eq!(book(1100, 1000, 1300), (200, 0, 100));
        assert_eq!(book(1100, 1300, 900), (0, 400, 0));
    }

    #[test]
    fn every_path_satisfies_the_identity() {
        // reserved + overrun == consumed + refunded (net of re-holds), for any path.
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
            }
            let consumed = *path.last().unwrap();
            assert_eq!(r + overrun, consumed + (refunded - reheld), "{path:?}");
        }
    }
}
