//! A caller's own model of one admission's token hold (written independently of
//! `src/usage.rs`, so a stress run checks the crate against it), and one handle over the three
//! things that report usage (borrowed permit, owned permit, run context).
//!
//! Used by the stress kit (`crate::kit::reports`) for the chaos, classes and usage families.

use async_bulkhead_llm::{
    OwnedPermit, Permit, Reservation, RunContext, TokenUsage, admission::AdmissionId,
    limits::MAX_BUDGET, usage::Progressive, usage::ReleaseReport, usage::UsageError,
    usage::UsageReport,
};

/// One admission as its caller models it: the cumulative usage is the per-field maximum of the
/// accepted reports; a plain report holds `input + max(cap, output)`, a progressive one
/// `remaining + margin + max(0, output - cap)`; every move of the hold is booked split at the
/// reservation (growth above it: overrun; any shrinking: refunded; growth back below it:
/// re-held; all gross); the settlement moves the hold to the final usage.
#[derive(Clone, Copy, Debug)]
pub struct Model {
    pub reservation: Reservation,
    pub held: u64,
    pub reported: Option<TokenUsage>,
    pub sequence: u64,
    pub overrun: u64,
    pub refunded: u64,
    pub reheld: u64,
}

/// What settling an admission should report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settled {
    pub held: u64,
    pub refunded: u64,
    pub overrun: u64,
    pub usage: Option<TokenUsage>,
}

impl Model {
    pub fn new(reservation: Reservation) -> Model {
        Model {
            reservation,
            held: reservation.reserved(),
            reported: None,
            sequence: 0,
            overrun: 0,
            refunded: 0,
            reheld: 0,
        }
    }

    pub fn reserved(&self) -> u64 {
        self.reservation.reserved()
    }

    pub fn cap(&self) -> u64 {
        self.reservation.max_output()
    }

    /// The cumulative usage and hold a report leads to, or the error it must be refused with.
    /// Holds are compared with `MAX_BUDGET` alone: the stress tests keep valid holds far below
    /// it and make invalid ones far above, so whether one fits never depends on the others.
    pub fn predict(
        &self,
        report: TokenUsage,
        progressive: Option<Progressive>,
    ) -> Result<(TokenUsage, u64), UsageError> {
        let cap = self.cap();
        if let Some(p) = progressive
            && p.remaining_output_tokens > cap
        {
            return Err(UsageError::RemainingExceedsCap {
                remaining: p.remaining_output_tokens,
                cap,
            });
        }
        let merged = match self.reported {
            None => report,
            Some(prev) => TokenUsage::new(
                prev.input().max(report.input()),
                prev.output().max(report.output()),
            )
            .expect("the stress tests report totals that fit in u64"),
        };
        let hold = match progressive {
            None => merged.input() + cap.max(merged.output()),
            Some(p) => {
                p.remaining_output_tokens
                    + p.safety_margin_tokens
                    + merged.output().saturating_sub(cap)
            }
        };
        if hold > MAX_BUDGET {
            Err(UsageError::HoldOverflow)
        } else {
            Ok((merged, hold))
        }
    }

    /// Moves the hold to `new`; returns this move's `(overrun, refunded)`.
    pub fn move_hold(&mut self, new: u64) -> (u64, u64) {
        let (r, old) = (self.reserved(), self.held);
        let overrun = new.saturating_sub(r).saturating_sub(old.saturating_sub(r));
        let refunded = old.saturating_sub(new);
        self.reheld += new.min(r).saturating_sub(old.min(r));
        self.overrun += overrun;
        self.refunded += refunded;
        self.held = new;
        (overrun, refunded)
    }

    /// Applies an accepted report; returns whether it was effective (changed the cumulative
    /// usage or the hold, and so counted in `sequence`).
    pub fn apply(&mut self, merged: TokenUsage, hold: u64) -> bool {
        let effective = self.reported != Some(merged) || hold != self.held;
        self.reported = Some(merged);
        self.move_hold(hold);
        self.sequence += u64::from(effective);
        effective
    }

    /// Settles with `explicit` usage, else the last reported, else none (books nothing).
    pub fn settle(&mut self, explicit: Option<TokenUsage>) -> Settled {
        let held = self.held;
        let usage = explicit.or(self.reported);
        let (overrun, refunded) = usage.map_or((0, 0), |u| self.move_hold(u.total()));
        Settled {
            held,
            refunded,
            overrun,
            usage,
        }
    }
}

/// Anything that takes usage reports: a permit (borrowed or owned) or a run context.
pub trait Reporter {
    fn report(
        &mut self,
        usage: TokenUsage,
        progressive: Option<Progressive>,
    ) -> Result<UsageReport, UsageError>;
    fn held(&self) -> u64;
}

/// A borrowed or an owned permit.
#[derive(Debug)]
pub enum AnyPermit<'a> {
    Borrowed(Permit<'a>),
    Owned(OwnedPermit),
}

impl AnyPermit<'_> {
    pub fn admission_id(&self) -> AdmissionId {
        match self {
            AnyPermit::Borrowed(p) => p.admission_id(),
            AnyPermit::Owned(p) => p.admission_id(),
        }
    }

    pub fn reservation(&self) -> Option<Reservation> {
        match self {
            AnyPermit::Borrowed(p) => p.reservation(),
            AnyPermit::Owned(p) => p.reservation(),
        }
    }

    pub fn release(self, usage: Option<TokenUsage>) -> ReleaseReport {
        match self {
            AnyPermit::Borrowed(p) => p.release(usage),
            AnyPermit::Owned(p) => p.release(usage),
        }
    }
}

impl Reporter for AnyPermit<'_> {
    fn report(
        &mut self,
        usage: TokenUsage,
        progressive: Option<Progressive>,
    ) -> Result<UsageReport, UsageError> {
        match (self, progressive) {
            (AnyPermit::Borrowed(p), None) => p.report_usage(usage),
            (AnyPermit::Borrowed(p), Some(prog)) => p.report_usage_progressive(usage, prog),
            (AnyPermit::Owned(p), None) => p.report_usage(usage),
            (AnyPermit::Owned(p), Some(prog)) => p.report_usage_progressive(usage, prog),
        }
    }

    fn held(&self) -> u64 {
        match self {
            AnyPermit::Borrowed(p) => p.held_tokens(),
            AnyPermit::Owned(p) => p.held_tokens(),
        }
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
