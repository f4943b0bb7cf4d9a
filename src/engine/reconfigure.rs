//! Changing the limits and closing: `apply_limits`, `set_budget`, `close`, and the install
//! step they share (publish the new limits, recompute the classes' shared figures, serve the
//! queue), all under the limits writer's lock.

use crate::support::sync::lock;
use crate::vocabulary::error::LimitsError;

use super::assembly::Engine;
use super::limits;
use super::queue::HandedOff;
use super::rate::{Windows, tag_of};
use super::state::State;
use crate::vocabulary::limits::{ApplyOutcome, BudgetLimits, Limits, MAX_BUDGET, MAX_REVISION};

impl Engine {
    // ----- limits and close -----

    /// Installs `next` atomically if its revision is newer (see
    /// [`LlmBulkhead::apply_limits`](crate::LlmBulkhead::apply_limits) for the contract).
    pub(crate) fn apply_limits(&self, next: Limits) -> Result<ApplyOutcome, LimitsError> {
        if next.revision > MAX_REVISION {
            return Err(LimitsError::RevisionTooLarge {
                value: next.revision,
                max: MAX_REVISION,
            });
        }
        let mut current = lock(&self.writer);
        if next.revision <= current.revision {
            return Ok(ApplyOutcome::Stale {
                current: current.clone(),
            });
        }
        let ids = self.class_ids();
        limits::validate(
            &next,
            self.has_budget,
            current.rate.is_some(),
            self.windows.is_some(),
            ids.as_deref(),
        )?;
        let next = limits::normalized(next, ids.as_deref());
        let (previous, handed_off) = self.install(&mut current, next.clone());
        drop(current);
        // Wake only now: a woken task may be polled inline and call back into the limits.
        self.finish(handed_off);
        Ok(ApplyOutcome::Applied {
            previous,
            current: next,
        })
    }

    /// Checks `next` as [`apply_limits`](Engine::apply_limits) would (the revision's range, the
    /// shape against this engine's budget and classes, every field), installing nothing and
    /// ignoring whether the revision is newer.
    pub(crate) fn check_limits(&self, next: &Limits) -> Result<(), LimitsError> {
        if next.revision > MAX_REVISION {
            return Err(LimitsError::RevisionTooLarge {
                value: next.revision,
                max: MAX_REVISION,
            });
        }
        let ids = self.class_ids();
        let has_rate = lock(&self.writer).rate.is_some();
        limits::validate(
            next,
            self.has_budget,
            has_rate,
            self.windows.is_some(),
            ids.as_deref(),
        )
    }

    /// Changes only the token budget, at the next revision; returns `(previous, current)`.
    pub(crate) fn set_budget(&self, tokens: u64) -> Result<(Limits, Limits), LimitsError> {
        let mut current = lock(&self.writer);
        let Some(budget) = current.token_budget else {
            return Err(LimitsError::TokenBudgetNotConfigured);
        };
        if current.revision >= MAX_REVISION {
            return Err(LimitsError::RevisionExhausted {
                current: current.revision,
            });
        }
        if tokens > MAX_BUDGET {
            return Err(LimitsError::BudgetTooLarge {
                value: tokens,
                max: MAX_BUDGET,
            });
        }
        if let Some(table) = &current.admission_classes {
            let (_, floors) = limits::floor_sums(table.iter().map(|(_, l)| l));
            if floors > tokens {
                return Err(LimitsError::ProtectedTokensSumTooLarge {
                    sum: floors,
                    budget: tokens,
                });
            }
        }
        let next = Limits {
            revision: current.revision + 1,
            token_budget: Some(BudgetLimits {
                budget: tokens,
                ..budget
            }),
            ..current.clone()
        };
        let (previous, handed_off) = self.install(&mut current, next.clone());
        drop(current);
        self.finish(handed_off);
        Ok((previous, next))
    }

    /// Publishes `next` and makes it current. The caller holds the writer lock (`current` is
    /// its guard's contents) and has validated `next`. Returns the replaced limits and the
    /// hand-offs the new limits allowed, which the caller wakes after releasing the lock.
    ///
    /// The hand-offs are made here, under the writer lock, so that once `apply_limits`
    /// returns every waiter the new limits admit has its slot (no later change can slip in
    /// between and decide for them under other limits).
    fn install(&self, current: &mut Limits, next: Limits) -> (Limits, HandedOff) {
        // With classes, hold every class still while the limits change (see `classes`): class
        // decisions then read the limits once, and the word's figures are recomputed here
        // from the class counts and the new floors (reserved again if they may be).
        if let Some(classes) = &self.classes {
            classes.lock_all();
        }
        // Only writers move the epoch and we hold the writer lock, so it is stable here.
        let epoch = self.published.epoch();
        self.published.store(epoch + 1, &next);
        // The linearization point: admissions that read the word before this fail their CAS,
        // and those that read it after see the new epoch's bits (and so read the new slot).
        let next_epoch = |s: State| {
            debug_assert!(s.matches_epoch(epoch));
            s.with_next_epoch()
        };
        let after = match &self.classes {
            Some(_) => self.recount(epoch + 1, true, next_epoch).1,
            None => self.state.modify(next_epoch),
        };
        // The windows' timestamps move to the new limits' time scale (see `rate`); decisions
        // that meet a word still on the old ticks wait for it on `rescaling`.
        let rescaling = self.windows.as_deref().map(Windows::rescaling);
        self.published.set_epoch(epoch + 1);
        self.rescale_windows(current, &next, tag_of(epoch + 1));
        drop(rescaling);
        // The class locks go before the hand-offs, which take the queue lock then class locks.
        if self.classes.is_some() {
            self.unlock_classes(epoch + 1, after);
        }
        let previous = core::mem::replace(current, next);
        let handed_off = if after.has_waiters() {
            // Raised limits admit waiters at once, in order.
            self.hand_off()
        } else {
            HandedOff::default()
        };
        (previous, handed_off)
    }

    /// Stops admission for good; `true` for the call that closed it. Every waiter is refused
    /// `shutdown`.
    pub(crate) fn close(&self) -> bool {
        let closed_now = if self.classes.is_some() {
            // The floors stop being reserved in the same CAS that closes (a call within its
            // class's floors would otherwise still be admitted on its class's word).
            let (before, _) = self.recount_classes(false, State::with_closed);
            !before.is_closed()
        } else {
            self.state
                .update(|s| {
                    if s.is_closed() {
                        Err(())
                    } else {
                        Ok((s.with_closed(), ()))
                    }
                })
                .is_ok()
        };
        if closed_now {
            // No call can join the queue any more (it would see the flag); empty it.
            self.refuse_all_waiters();
        }
        closed_now
    }

    /// The class ids, in order, with classes.
    fn class_ids(&self) -> Option<Vec<&'static str>> {
        self.classes
            .as_ref()
            .map(|c| c.handles().iter().map(|h| h.id()).collect())
    }
}
