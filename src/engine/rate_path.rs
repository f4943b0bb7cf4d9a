//! The engine's side of the rate windows (`rate`): charging a call at the doors before the
//! word is decided, giving a charge back on a refusal or a wait that ends refused, correcting
//! the tokens charge to the usage, and the windows' figures for headers.

use crossbeam_utils::Backoff;

use super::assembly::Engine;
use super::policy::{self, Ask};
use super::rate::{Charge, RateBounds, RateRefusal, RateStatus, Stale, Windows, tag_of};
use crate::vocabulary::rejection::{RejectReason, Rejection};

impl Engine {
    /// Runs `decide` with the rate windows' figures of the epoch in force (and its tag) until
    /// it finds every window's word on that epoch's ticks.
    fn with_rate_bounds<T>(
        &self,
        mut decide: impl FnMut(u64, RateBounds) -> Result<T, Stale>,
    ) -> T {
        let backoff = Backoff::new();
        loop {
            let epoch = self.published.epoch();
            let bounds = self.published.read_rate(epoch);
            if self.published.epoch() == epoch
                && let Ok(out) = decide(tag_of(epoch), bounds)
            {
                return out;
            }
            crate::support::sync::spin_wait(&backoff);
        }
    }

    /// Charges `ask` to the rate windows before its admission is decided: `Ok(None)` without
    /// windows (or on a closed engine, which refuses `shutdown` before any limit), `Ok(charge)`
    /// to give back if the decision refuses, or the `rate_limit` refusal (counted; nothing
    /// charged).
    pub(super) fn charge_windows(&self, ask: Ask) -> Result<Option<Charge>, Rejection> {
        let Some(windows) = &self.windows else {
            return Ok(None);
        };
        if self.state.load().is_closed() {
            return Ok(None);
        }
        match self.with_rate_bounds(|tag, bounds| windows.charge(tag, bounds, ask.reserved)) {
            Ok(charge) => Ok(Some(charge)),
            Err(refusal) => Err(self.reject_rate(refusal, ask)),
        }
    }

    /// [`charge_windows`](Engine::charge_windows) on the fast lane: `None` (nothing charged)
    /// when a window refuses (the general path decides again and refuses, with the snapshot)
    /// or the engine is closed.
    #[inline]
    pub(super) fn charge_windows_fast(&self, ask: Ask) -> Option<Charge> {
        let windows = self.windows.as_ref()?;
        self.with_rate_bounds(|tag, bounds| windows.charge(tag, bounds, ask.reserved))
            .ok()
    }

    /// Counts a `rate_limit` refusal of `ask` and builds its rejection (the global figures of
    /// this moment, which window refused, when the call would fit).
    #[cold]
    fn reject_rate(&self, refusal: RateRefusal, ask: Ask) -> Rejection {
        self.count_refusal(RejectReason::RateLimit, ask.class);
        let (state, bounds) = self.snapshot();
        let state = self.in_flight_of(state);
        let global = Ask { class: None, ..ask };
        let detail = policy::global_detail(state, &bounds, self.queue.len(), global);
        Rejection::rate(detail, refusal.tokens, refusal.retry_after)
    }

    /// Gives back a charge whose admission did not happen.
    pub(super) fn refund_windows(&self, charge: Option<Charge>) {
        if let (Some(windows), Some(charge)) = (&self.windows, charge) {
            windows.refund(charge);
        }
    }

    /// Gives back the charge of a queued call whose wait ended refused (its units: 1 request,
    /// its reservation in tokens, on the windows configured now).
    pub(super) fn refund_waiter(&self, ask: Ask) {
        if let Some(windows) = &self.windows {
            let bounds = self.with_rate_bounds(|_, bounds| Ok(bounds));
            windows.refund(Windows::charge_of(bounds, ask.reserved));
        }
    }

    /// Moves a call's tokens charge from `from` tokens to `to` (its usage): see
    /// [`Windows::correct`]. Nothing without a tokens window.
    pub(crate) fn correct_rate(&self, from: u64, to: u64) {
        if let Some(windows) = &self.windows
            && from != to
        {
            self.with_rate_bounds(|tag, bounds| windows.correct(tag, bounds, from, to));
        }
    }

    /// Each window's figures now, for rate-limit headers (`None` without windows).
    pub(crate) fn rate_status(&self) -> Option<RateStatus> {
        let windows = self.windows.as_ref()?;
        Some(self.with_rate_bounds(|tag, bounds| windows.status(tag, bounds)))
    }
}
