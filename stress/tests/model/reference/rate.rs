//! The reference model of the bulkhead's rate windows (crate src/engine/rate.rs module docs,
//! "The algorithm"; the charging rules: src/engine/rate.rs and rate_path.rs docs).
//!
//! Each window is a GCRA kept as one timestamp `tat`, counted in the window's ticks: a tick is
//! one unit's share of the window (`window / limit`), the tick of a time `t` (nanoseconds) is
//! `floor(t * limit / window)`, and a call of `n` units at tick `now` is admitted iff
//! `max(tat, now) + n - now <= limit`. Refused, it fits at the start of tick
//! `max(tat, now) + n - limit`, which starts at `ceil(tick * window / limit)` nanoseconds.
//!
//! Which formulation: the model counts in the crate's documented ticks, exactly (u128
//! arithmetic: the tick of `now` is an exact floor here, where the crate estimates it with a
//! 64-bit fraction and corrects it). A GCRA on exact rational time (`tat` in limit-scaled
//! nanoseconds) agrees with it whenever a window restarts from idle on a tick boundary, and is
//! stricter by less than a tick otherwise (the ticks version restarts an idle window at the
//! start of the current tick); since the crate's docs specify ticks, the model follows them,
//! and the clock is moved by arbitrary amounts (not only whole ticks), so the floor is tested.

use std::time::Duration;

use async_bulkhead_llm::limits::LimitsError;

use super::state::Model;
use super::values::{Ask, ModelLimits, Reason, Refused};

/// Where a manual clock starts (crate rate.rs `ManualClock`: "a day past the process's
/// origin").
pub(crate) const CLOCK_START_NS: u64 = 86_400_000_000_000;

/// The largest `tat` a window keeps (56 bits of ticks, crate rate.rs `TICK_BITS`).
const MAX_TAT: u64 = (1 << 56) - 1;

/// A bulkhead's rate limits (crate `RateLimits`): per `window_ns` nanoseconds, `requests`
/// calls and `tokens` tokens (none: no such window).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    pub window_ns: u64,
    pub requests: Option<u64>,
    pub tokens: Option<u64>,
}

/// The shortest and the longest window (crate engine/limits.rs: "a window of 1 ms to 1 day").
const MIN_WINDOW_NS: u64 = 1_000_000;
const MAX_WINDOW_NS: u64 = 86_400 * 1_000_000_000;

/// Checks rate limits (crate engine/limits.rs `validate_rate`: "a window of 1 ms to 1 day, at
/// least one limit, each at least 1, a tokens window only with a token budget"; error.rs
/// `RateLimitTooHigh`: "at most one unit per nanosecond of its window"), in that order.
pub(crate) fn check_rate(rate: Rate, has_budget: bool) -> Result<(), LimitsError> {
    let window = Duration::from_nanos(rate.window_ns);
    if !(MIN_WINDOW_NS..=MAX_WINDOW_NS).contains(&rate.window_ns) {
        return Err(LimitsError::RateWindowOutOfRange { window });
    }
    if rate.requests.is_none() && rate.tokens.is_none()
        || rate.requests == Some(0)
        || rate.tokens == Some(0)
    {
        return Err(LimitsError::RateLimitsEmpty);
    }
    if rate.tokens.is_some() && !has_budget {
        return Err(LimitsError::RateTokensNeedBudget);
    }
    for limit in [rate.requests, rate.tokens].into_iter().flatten() {
        if limit > rate.window_ns {
            return Err(LimitsError::RateLimitTooHigh { limit, window });
        }
    }
    Ok(())
}

/// Rate limits the builder and `apply_limits` accept, made of `rate`: the window clamped into
/// range, a zero limit dropped, the tokens window dropped without a budget, each limit at most
/// one per nanosecond; none if no limit is left.
pub(crate) fn repair_rate(rate: Rate, has_budget: bool) -> Option<Rate> {
    let window_ns = rate.window_ns.clamp(MIN_WINDOW_NS, MAX_WINDOW_NS);
    let limit = |limit: Option<u64>| limit.filter(|&l| l > 0).map(|l| l.min(window_ns));
    let requests = limit(rate.requests);
    let tokens = limit(rate.tokens).filter(|_| has_budget);
    (requests.is_some() || tokens.is_some()).then_some(Rate {
        window_ns,
        requests,
        tokens,
    })
}

/// One window: its limit (0: not configured) and its `tat` in its ticks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Window {
    pub(crate) limit: u64,
    pub(crate) tat: u64,
}

/// What a window reports (crate `WindowStatus`): limit, remaining, reset in nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Status {
    pub(crate) limit: u64,
    pub(crate) remaining: u64,
    pub(crate) reset_ns: u64,
}

impl Window {
    /// The tick `now_ns` falls in: `floor(now_ns * limit / window_ns)`.
    fn ticks(self, window_ns: u64, now_ns: u64) -> u64 {
        (u128::from(now_ns) * u128::from(self.limit) / u128::from(window_ns)) as u64
    }

    /// When tick `ticks` starts, in nanoseconds (rounded up; at most `u64::MAX`).
    fn start_ns(self, window_ns: u64, ticks: u64) -> u64 {
        let ns =
            (u128::from(ticks) * u128::from(window_ns)).div_ceil(u128::from(self.limit.max(1)));
        u64::try_from(ns).unwrap_or(u64::MAX)
    }

    /// Charges `units` at `now_ns` if they fit, else when they would, in nanoseconds from now
    /// (`None`: never, more than the whole limit). Nothing to charge (no window, 0 units) fits.
    fn take(&mut self, window_ns: u64, units: u64, now_ns: u64) -> Result<(), Option<u64>> {
        if units == 0 || self.limit == 0 {
            return Ok(());
        }
        if units > self.limit {
            return Err(None);
        }
        let now = self.ticks(window_ns, now_ns);
        let next = self.tat.max(now) + units;
        if next - now > self.limit {
            return Err(Some(self.start_ns(window_ns, next - self.limit) - now_ns));
        }
        self.tat = next;
        Ok(())
    }

    /// A charge given back moves `tat` back by its units, never below zero (crate rate.rs: "A
    /// charge given back moves `tat` back by what it added", `give_back`).
    fn give_back(&mut self, units: u64) {
        if self.limit > 0 {
            self.tat = self.tat.saturating_sub(units);
        }
    }

    fn status(self, window_ns: u64, now_ns: u64) -> Option<Status> {
        (self.limit > 0).then(|| {
            let now = self.ticks(window_ns, now_ns);
            let behind = self.tat.saturating_sub(now).min(self.limit);
            Status {
                limit: self.limit,
                remaining: self.limit - behind,
                reset_ns: self.start_ns(window_ns, self.tat).saturating_sub(now_ns),
            }
        })
    }
}

/// The bulkhead's pair of windows and the clock they read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Windows {
    pub(crate) window_ns: u64,
    pub(crate) requests: Window,
    pub(crate) tokens: Window,
}

/// Which window refused a call, and when it would fit: in milliseconds from now, rounded up
/// (crate rejection.rs `Rejection::retry_after`: "milliseconds, rounded up"); none: never (it
/// asks more than the window's whole limit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WindowRefusal {
    /// A window of the call's class (not the bulkhead's).
    pub(crate) class: bool,
    pub(crate) tokens: bool,
    pub(crate) retry_after_ms: Option<u64>,
}

/// How a rejection carries `retry_after` (crate rejection.rs `Rejection::retry_after`):
/// milliseconds rounded up while below `NEVER_MS` (about 1.55 days, beyond the longest window);
/// a longer wait, which only usage charged far beyond the limit makes (corrections never
/// refuse), in whole seconds rounded up (at most `NEVER_MS` seconds).
const NEVER_MS: u64 = (1 << 27) - 1;

fn ms(retry_after_ns: Option<u64>) -> Option<u64> {
    retry_after_ns.map(|ns| {
        let ms = ns.div_ceil(1_000_000);
        if ms < NEVER_MS {
            ms
        } else {
            ns.div_ceil(1_000_000_000).min(NEVER_MS) * 1_000
        }
    })
}

impl Windows {
    /// A pair of `rate`, or a pair that counts nothing (a bulkhead's pair without rate limits
    /// of its own, or a class's, on an engine that keeps windows).
    pub(crate) fn of(rate: Option<Rate>) -> Windows {
        rate.map_or(
            Windows {
                window_ns: 0,
                requests: Window::default(),
                tokens: Window::default(),
            },
            Windows::new,
        )
    }

    pub(crate) fn new(rate: Rate) -> Windows {
        Windows {
            window_ns: rate.window_ns,
            requests: Window {
                limit: rate.requests.unwrap_or(0),
                tat: 0,
            },
            tokens: Window {
                limit: rate.tokens.unwrap_or(0),
                tat: 0,
            },
        }
    }

    /// Charges a call of `tokens` (its reservation) at `now_ns`: 1 unit to the requests
    /// window, then `tokens` to the tokens window; a refusal by the tokens window gives the
    /// requests charge back (crate rate.rs: "a refusal by either takes nothing").
    pub(crate) fn charge(&mut self, tokens: u64, now_ns: u64) -> Result<(), WindowRefusal> {
        let window_ns = self.window_ns;
        self.requests
            .take(window_ns, 1, now_ns)
            .map_err(|retry_after_ns| WindowRefusal {
                class: false,
                tokens: false,
                retry_after_ms: ms(retry_after_ns),
            })?;
        if let Err(retry_after_ns) = self.tokens.take(window_ns, tokens, now_ns) {
            self.requests.give_back(1);
            return Err(WindowRefusal {
                class: false,
                tokens: true,
                retry_after_ms: ms(retry_after_ns),
            });
        }
        Ok(())
    }

    /// Gives back the charge of a call of `tokens` (1 request, its tokens).
    pub(crate) fn refund(&mut self, tokens: u64) {
        self.requests.give_back(1);
        self.tokens.give_back(tokens);
    }

    /// Moves a call's tokens charge from `from` tokens to `to` at `now_ns` (crate rate.rs: "A
    /// settled call's tokens charge is corrected to its reported usage"; `Words::correct`):
    /// less is given back, more is charged without refusing, from `max(tat, now)`.
    pub(crate) fn correct(&mut self, from: u64, to: u64, now_ns: u64) {
        let window = &mut self.tokens;
        if window.limit == 0 || from == to {
            return;
        }
        if to < from {
            window.give_back(from - to);
        } else {
            let now = window.ticks(self.window_ns, now_ns);
            // A window's `tat` is kept in 56 bits of ticks (crate rate.rs, the window's word:
            // "its `tat` in the rest (56 bits of ticks)"): a usage charged beyond that stops
            // there.
            window.tat = window.tat.max(now).saturating_add(to - from).min(MAX_TAT);
        }
    }

    /// A change of limits at `now_ns` (crate rate.rs: "a change of limits moves each `tat` to
    /// the new ticks"; `Words::rescale`): the units charged and not yet drained stay charged
    /// (at most the new limit), counted from the new ticks of now; a window added or removed
    /// starts over.
    pub(crate) fn rescale(&mut self, next: Option<Rate>, now_ns: u64) {
        let next = next.unwrap_or(Rate {
            window_ns: 0,
            requests: None,
            tokens: None,
        });
        let old_ns = self.window_ns;
        for (window, limit) in [
            (&mut self.requests, next.requests.unwrap_or(0)),
            (&mut self.tokens, next.tokens.unwrap_or(0)),
        ] {
            let new = Window { limit, tat: 0 };
            window.tat = if window.limit == 0 || limit == 0 {
                0
            } else {
                let behind = window
                    .tat
                    .saturating_sub(window.ticks(old_ns, now_ns))
                    .min(limit);
                new.ticks(next.window_ns, now_ns) + behind
            };
            window.limit = limit;
        }
        self.window_ns = next.window_ns;
    }

    /// Each window's figures at `now_ns` (crate rate.rs `RateStatus`).
    pub(crate) fn status(&self, now_ns: u64) -> (Option<Status>, Option<Status>) {
        (
            self.requests.status(self.window_ns, now_ns),
            self.tokens.status(self.window_ns, now_ns),
        )
    }

    /// What `rate_status()` / `class_rate_status()` report: none without any window.
    pub(crate) fn report(&self, now_ns: u64) -> Option<(Option<Status>, Option<Status>)> {
        Some(self.status(now_ns)).filter(|(r, t)| r.is_some() || t.is_some())
    }
}

impl Model {
    /// Charges `ask` to the windows at the doors, before the in-flight decision (crate
    /// rate.rs: "A call is charged to the requests window (1 unit) and then to the tokens
    /// window (its reservation) before the admission word is decided"; rate_path.rs
    /// `charge_windows`: a closed bulkhead charges nothing, it refuses `shutdown` before any
    /// limit). `Ok(true)`: charged, to give back if the decision refuses. A window's refusal
    /// takes nothing and is counted, noted and announced as `rate_limit`, with the global
    /// detail of this moment (rate_path.rs `reject_rate`).
    pub(crate) fn charge_windows(&mut self, ask: Ask) -> Result<bool, Refused> {
        let now_ns = self.now_ns;
        let Some(windows) = self.windows.as_mut().filter(|_| !self.closed) else {
            return Ok(false);
        };
        // The bulkhead's pair, then the class's (crate rate.rs: "to the bulkhead's pair, then
        // to its class's, each pair on its own words, a refusal by the class's giving the
        // bulkhead's charge back").
        let mut refusal = windows.charge(ask.reserved(), now_ns);
        if refusal.is_ok()
            && let Some(class) = ask.class.and_then(|c| self.class_windows.get_mut(c))
        {
            refusal = class
                .charge(ask.reserved(), now_ns)
                .map_err(|refusal| WindowRefusal {
                    class: true,
                    ..refusal
                });
            if refusal.is_err() {
                windows.refund(ask.reserved());
            }
        }
        let Err(refusal) = refusal else {
            return Ok(true);
        };
        self.note("refused: rate_limit");
        self.note(
            match (refusal.class, refusal.tokens, refusal.retry_after_ms) {
                (false, false, _) => "refused: requests window",
                (false, true, Some(_)) => "refused: tokens window",
                (false, true, None) => "refused: tokens window, never fits",
                (true, false, _) => "refused: class requests window",
                (true, true, _) => "refused: class tokens window",
            },
        );
        // A class window's refusal carries the class's figures (no constraint), the
        // bulkhead's the global detail (crate rate_path.rs `reject_rate`); both count against
        // the call's class.
        let mut refused = if refusal.class {
            self.refuse(Reason::RateLimit, None, ask)
        } else {
            let refused = self.refuse(Reason::RateLimit, None, Ask { class: None, ..ask });
            if let Some(class) = ask.class {
                self.classes[class].rejected[Reason::RateLimit as usize] += 1;
            }
            refused
        };
        refused.rate = Some(refusal);
        self.announce_reject(ask.class, refused);
        Err(refused)
    }

    /// Whether `ask` would fit the windows now (the bulkhead's pair, then its class's),
    /// charging nothing: `would_admit` judges the windows before the word, `shutdown` before
    /// both, as an admission does (crate admission.rs `advise`).
    pub(crate) fn windows_would_fit(&self, ask: Ask) -> bool {
        let Some(windows) = &self.windows else {
            return true;
        };
        let mut windows = *windows;
        if windows.charge(ask.reserved(), self.now_ns).is_err() {
            return false;
        }
        match ask.class.and_then(|c| self.class_windows.get(c)) {
            Some(&class) => {
                let mut class = class;
                class.charge(ask.reserved(), self.now_ns).is_ok()
            }
            None => true,
        }
    }

    /// Gives back the charge of `ask` (its admission did not happen, or its wait ended
    /// refused): 1 request and its reservation, on the windows configured now (crate
    /// rate_path.rs `refund_windows`, `refund_waiter`).
    pub(crate) fn refund_windows(&mut self, ask: Ask, why: &'static str) {
        if let Some(windows) = &mut self.windows {
            windows.refund(ask.reserved());
            if let Some(class) = ask.class.and_then(|c| self.class_windows.get_mut(c)) {
                class.refund(ask.reserved());
            }
            self.note("rate charge given back");
            self.note(why);
        }
    }

    /// Moves a settled or reporting call's tokens charge from `from` to `to` (crate usage.rs,
    /// rate.rs "the window converges on what the provider bills").
    pub(crate) fn correct_windows(&mut self, class: Option<usize>, from: u64, to: u64) {
        let now_ns = self.now_ns;
        if from == to {
            return;
        }
        let what = if to < from {
            "rate usage given back"
        } else {
            "rate usage charged beyond"
        };
        if let Some(windows) = &mut self.windows
            && windows.tokens.limit > 0
        {
            windows.correct(from, to, now_ns);
            self.note(what);
        }
        if let Some(windows) = class.and_then(|c| self.class_windows.get_mut(c))
            && windows.tokens.limit > 0
        {
            windows.correct(from, to, now_ns);
            self.note("rate usage corrected on a class window");
        }
    }

    /// Every pair to the limits `next` (crate rate.rs: "a change of limits moves each `tat` to
    /// the new ticks"; rate_path.rs `rescale_windows`: the bulkhead's pair, then each class's).
    pub(crate) fn rescale_windows(&mut self, next: &ModelLimits) {
        let now_ns = self.now_ns;
        let rates = |limits: &ModelLimits| {
            limits
                .classes
                .map(|table| table.iter().map(|(_, caps)| caps.rate).collect::<Vec<_>>())
        };
        if self.windows.is_some() && rates(&self.limits) != rates(next) {
            let spent = self.class_windows.iter().any(|w| {
                let (requests, tokens) = w.status(now_ns);
                [requests, tokens]
                    .into_iter()
                    .flatten()
                    .any(|s| s.remaining < s.limit)
            });
            self.note(if spent {
                "class rate limits changed with units charged"
            } else {
                "class rate limits changed"
            });
        }
        if let Some(windows) = &mut self.windows {
            windows.rescale(next.rate, now_ns);
            if let Some(table) = next.classes {
                for (windows, (_, caps)) in self.class_windows.iter_mut().zip(table.iter()) {
                    windows.rescale(caps.rate, now_ns);
                }
            }
        }
    }
}
