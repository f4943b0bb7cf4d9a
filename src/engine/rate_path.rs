//! The engine's side of the rate windows (`rate`): charging a call at the doors before the
//! word is decided (to the bulkhead's windows, then to its class's), giving a charge back on a
//! refusal or a wait that ends refused, correcting the tokens charge to the usage, and the
//! windows' figures for headers.

use super::assembly::Engine;
use super::policy::{self, Ask};
use super::rate::{Charge, RateBounds, RateRefusal, RateStatus, Stale, Windows, tag_of};
use crate::vocabulary::admission_class::AdmissionClass;
use crate::vocabulary::rejection::{RateWindow, RejectReason, Rejection};

/// What a call was charged: on the bulkhead's windows, and on its class's (with class
/// windows: the class's index and its units), to give back exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Charged {
    global: Charge,
    class: Option<(usize, Charge)>,
}

impl Charged {
    /// A charge on the bulkhead's windows alone.
    #[inline]
    pub(super) fn bulkhead(global: Charge) -> Charged {
        Charged {
            global,
            class: None,
        }
    }
}

impl Engine {
    /// Runs `decide` with the figures `read` takes from the limits of the epoch in force (and
    /// that epoch's tag) until it finds every window's word on that epoch's ticks. A word on
    /// another epoch's ticks means a writer is between publishing an epoch and rescaling the
    /// words (or has just done both): the decision waits for its rescale (`Windows::rescaling`),
    /// then reads again; an epoch that moved while its figures were read is read again at once
    /// (each writer moves it once).
    #[inline]
    fn with_epoch_bounds<B, T>(
        &self,
        read: impl Fn(u64) -> B,
        mut decide: impl FnMut(u64, B) -> Result<T, Stale>,
    ) -> T {
        loop {
            let epoch = self.published.epoch();
            let bounds = read(epoch);
            if self.published.epoch() != epoch {
                continue;
            }
            match decide(tag_of(epoch), bounds) {
                Ok(out) => return out,
                Err(Stale) => {
                    if let Some(windows) = &self.windows {
                        windows.wait_for_rescale();
                    }
                }
            }
        }
    }

    /// [`with_epoch_bounds`](Engine::with_epoch_bounds) with the bulkhead's windows' figures.
    #[inline]
    fn with_rate_bounds<T>(&self, decide: impl FnMut(u64, RateBounds) -> Result<T, Stale>) -> T {
        self.with_epoch_bounds(|epoch| self.published.read_rate(epoch), decide)
    }

    /// [`with_rate_bounds`](Engine::with_rate_bounds) with class `index`'s figures of the same
    /// epoch too.
    fn with_class_rate_bounds<T>(
        &self,
        index: usize,
        mut decide: impl FnMut(u64, RateBounds, RateBounds) -> Result<T, Stale>,
    ) -> T {
        self.with_epoch_bounds(
            |epoch| {
                (
                    self.published.read_rate(epoch),
                    self.published.read_class_rate(epoch, index),
                )
            },
            |tag, (bounds, class)| decide(tag, bounds, class),
        )
    }

    /// The index of `class`'s windows, if the engine keeps class windows.
    #[inline]
    fn class_windows(windows: &Windows, class: Option<AdmissionClass>) -> Option<usize> {
        let index = usize::from(class?.index());
        windows.class(index).map(|_| index)
    }

    /// Charges `ask` to the rate windows before its admission is decided: `Ok(None)` without
    /// windows, `Ok(charge)` to give back if the decision refuses, or the `rate_limit` refusal
    /// (counted; nothing charged). A closed engine refuses `shutdown` before any limit: its
    /// windows are not judged (`Ok(None)` once the one pass found no room), and a charge the
    /// pass made goes back with the decision's `shutdown`.
    pub(super) fn charge_windows(&self, ask: Ask) -> Result<Option<Charged>, Rejection> {
        if ask.class.is_none()
            && let Some(windows) = self.windows.as_deref()
            && let Some((global, _)) = self.charge_bulkhead_windows(windows, ask)
        {
            return Ok(Some(Charged::bulkhead(global)));
        }
        self.charge_windows_again(ask)
    }

    /// [`charge_windows`](Engine::charge_windows) after its one pass on the bulkhead's
    /// windows found no room or a change under way (or for a call of a class): decided on one
    /// epoch's figures, with those a refusal reports.
    pub(super) fn charge_windows_again(&self, ask: Ask) -> Result<Option<Charged>, Rejection> {
        let Some(windows) = &self.windows else {
            return Ok(None);
        };
        if self.state.load().is_closed() {
            return Ok(None);
        }
        let charged = match Engine::class_windows(windows, ask.class) {
            None => self.charge_windows_slow(windows, ask),
            Some(index) => self.with_class_rate_bounds(index, |tag, bounds, class_bounds| {
                let now = windows.now_ns();
                let global = match windows.global().charge(tag, bounds, ask.reserved, now)? {
                    Ok(charge) => charge,
                    Err(refusal) => return Ok(Err((refusal, false))),
                };
                let class = windows.classes()[index].charge(tag, class_bounds, ask.reserved, now);
                if !matches!(class, Ok(Ok(_))) {
                    // Refused (or stale): the bulkhead's charge goes back first.
                    windows.global().refund(global);
                }
                Ok(match class? {
                    Ok(charge) => Ok(Charged {
                        global,
                        class: Some((index, charge)),
                    }),
                    Err(refusal) => Err((refusal, true)),
                })
            }),
        };
        match charged {
            Ok(charged) => Ok(Some(charged)),
            Err((refusal, class)) => Err(self.reject_rate(refusal, class, ask)),
        }
    }

    /// The bulkhead's windows charged for `ask` in one pass on the limits' epoch read once:
    /// the charge and that epoch, or `None` (nothing charged) when a window refuses, a word
    /// is on another epoch's ticks or the epoch moved while its figures were read.
    #[cfg_attr(not(loom), inline(always))]
    pub(super) fn charge_bulkhead_windows(
        &self,
        windows: &Windows,
        ask: Ask,
    ) -> Option<(Charge, u64)> {
        let epoch = self.published.epoch();
        let bounds = self.published.read_rate(epoch);
        let now_ns = windows.now_ns();
        // The figures are of `epoch` only if it is still current (see `limits`).
        if self.published.epoch() != epoch {
            return None;
        }
        let charge = windows
            .global()
            .charge_fast(tag_of(epoch), &bounds, ask.reserved, now_ns)?;
        Some((charge, epoch))
    }

    /// [`charge_windows`](Engine::charge_windows) on the bulkhead's windows after the one pass
    /// found no room or a change under way: until a decision on one epoch's figures, with the
    /// refusal's figures.
    #[cold]
    fn charge_windows_slow(
        &self,
        windows: &Windows,
        ask: Ask,
    ) -> Result<Charged, (RateRefusal, bool)> {
        self.with_rate_bounds(|tag, bounds| {
            let global = windows.charge(tag, bounds, ask.reserved)?;
            Ok(global
                .map(Charged::bulkhead)
                .map_err(|refusal| (refusal, false)))
        })
    }

    /// Whether `ask` would fit the rate windows now (the bulkhead's and its class's),
    /// charging nothing: `true` without windows.
    pub(super) fn windows_would_fit(&self, ask: Ask) -> bool {
        let Some(windows) = &self.windows else {
            return true;
        };
        let now = windows.now_ns();
        match Engine::class_windows(windows, ask.class) {
            None => self.with_rate_bounds(|tag, bounds| {
                windows.global().would_fit(tag, bounds, ask.reserved, now)
            }),
            Some(index) => self.with_class_rate_bounds(index, |tag, bounds, class| {
                Ok(windows.global().would_fit(tag, bounds, ask.reserved, now)?
                    && windows.classes()[index].would_fit(tag, class, ask.reserved, now)?)
            }),
        }
    }

    /// Counts a `rate_limit` refusal of `ask` and builds its rejection (the figures of this
    /// moment, the class's too when its window refused; which window; when the call would
    /// fit).
    #[cold]
    fn reject_rate(&self, refusal: RateRefusal, class: bool, ask: Ask) -> Rejection {
        self.count_refusal(RejectReason::RateLimit, ask.class);
        let (state, bounds) = self.snapshot();
        let state = self.in_flight_of(state);
        let detail = match ask.class.filter(|_| class) {
            Some(of) => {
                let (guard, view) = self.lock_class_view(of);
                drop(guard);
                policy::detail(state, &bounds, self.queue.len(), ask, Some(&view), None)
            }
            None => {
                let global = Ask { class: None, ..ask };
                policy::global_detail(state, &bounds, self.queue.len(), global)
            }
        };
        let window = RateWindow::of(class, refusal.tokens);
        Rejection::rate(detail, window, refusal.retry_after)
    }

    /// Gives back a charge whose admission did not happen.
    pub(super) fn refund_windows(&self, charged: Option<Charged>) {
        if let (Some(windows), Some(charged)) = (&self.windows, charged) {
            windows.global().refund(charged.global);
            if let Some((index, charge)) = charged.class {
                windows.classes()[index].refund(charge);
            }
        }
    }

    /// Gives back the charge of a queued call whose wait ended refused (its units: 1 request,
    /// its reservation in tokens, on the windows configured now).
    pub(super) fn refund_waiter(&self, ask: Ask) {
        if let Some(windows) = &self.windows {
            match Engine::class_windows(windows, ask.class) {
                None => {
                    let bounds = self.with_rate_bounds(|_, bounds| Ok(bounds));
                    windows
                        .global()
                        .refund(Windows::charge_of(bounds, ask.reserved));
                }
                Some(index) => {
                    let (bounds, class) = self.with_class_rate_bounds(index, |_, b, c| Ok((b, c)));
                    windows
                        .global()
                        .refund(Windows::charge_of(bounds, ask.reserved));
                    windows.classes()[index].refund(Windows::charge_of(class, ask.reserved));
                }
            }
        }
    }

    /// Moves a call's tokens charge from `from` tokens to `to` (its usage), on the bulkhead's
    /// tokens window and its class's: see [`Words::correct`](super::rate::Words::correct). Nothing without a tokens window.
    pub(crate) fn correct_rate(&self, class: Option<AdmissionClass>, from: u64, to: u64) {
        if let Some(windows) = &self.windows
            && from != to
        {
            // Each pair in its own loop: a stale word met by one never repeats the other's move.
            self.with_rate_bounds(|tag, bounds| {
                windows
                    .global()
                    .correct(tag, bounds, from, to, windows.now_ns())
            });
            if let Some(index) = Engine::class_windows(windows, class) {
                self.correct_class_rate(windows, index, from, to);
            }
        }
    }

    /// [`correct_rate`](Engine::correct_rate) on class `index`'s tokens window.
    #[cold]
    fn correct_class_rate(&self, windows: &Windows, index: usize, from: u64, to: u64) {
        self.with_class_rate_bounds(index, |tag, _, bounds| {
            windows.classes()[index].correct(tag, bounds, from, to, windows.now_ns())
        });
    }

    /// Each of the bulkhead's windows' figures now, for rate-limit headers (`None` without
    /// windows of its own).
    pub(crate) fn rate_status(&self) -> Option<RateStatus> {
        let windows = self.windows.as_ref()?;
        let status = self
            .with_rate_bounds(|tag, bounds| windows.global().status(tag, bounds, windows.now_ns()));
        (status.requests.is_some() || status.tokens.is_some()).then_some(status)
    }

    /// Class `class`'s windows' figures now (`None` when it has no rate limits).
    pub(crate) fn class_rate_status(&self, class: AdmissionClass) -> Option<RateStatus> {
        let windows = self.windows.as_ref()?;
        let index = Engine::class_windows(windows, Some(class))?;
        let status = self.with_class_rate_bounds(index, |tag, _, bounds| {
            windows.classes()[index].status(tag, bounds, windows.now_ns())
        });
        (status.requests.is_some() || status.tokens.is_some()).then_some(status)
    }

    /// Moves every window to the limits of the epoch tagged `tag` (`previous` to `next`): the
    /// writer's step of a change of limits, under its lock, after the epoch is published.
    pub(super) fn rescale_windows(
        &self,
        previous: &crate::vocabulary::limits::Limits,
        next: &crate::vocabulary::limits::Limits,
        tag: u64,
    ) {
        let Some(windows) = &self.windows else {
            return;
        };
        let now = windows.now_ns();
        windows.global().rescale(
            RateBounds::of(previous.rate.as_ref()),
            RateBounds::of(next.rate.as_ref()),
            tag,
            now,
        );
        if let (Some(old), Some(new)) = (&previous.admission_classes, &next.admission_classes) {
            // Both in the engine's class order (normalized), the order of the pairs.
            for ((words, (_, old)), (_, new)) in
                windows.classes().iter().zip(old.iter()).zip(new.iter())
            {
                words.rescale(
                    RateBounds::of(old.rate.as_ref()),
                    RateBounds::of(new.rate.as_ref()),
                    tag,
                    now,
                );
            }
        }
    }
}
