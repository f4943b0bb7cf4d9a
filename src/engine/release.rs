//! Holds and releases: a usage report moving a hold, a release returning a slot and its tokens
//! (handing them to the queue's head when someone waits), a borrowed slot abandoned early, and
//! the counters every settlement writes.

use super::assembly::Engine;
use super::classes::Returned;
use super::counters::{ClassCounter, Counter};
use super::grant::Grant;
use super::local;
use super::state::State;
use crate::support::sync::atomic::Ordering;
use crate::vocabulary::admission_class::{AbandonCause, AdmissionClass};
use crate::vocabulary::error::UsageError;

impl Engine {
    // ----- holds and release -----

    /// Moves `grant`'s hold to `to` tokens in one CAS of the word; returns the previous hold.
    ///
    /// # Errors
    ///
    /// [`UsageError::HoldOverflow`](crate::usage::UsageError::HoldOverflow) when the tokens in flight would pass what the word counts
    /// ([`MAX_BUDGET`](crate::limits::MAX_BUDGET)); nothing changes.
    pub(crate) fn move_hold(&self, grant: &mut Grant, to: u64) -> Result<u64, UsageError> {
        if grant.class().is_some() {
            return self.move_class_hold(grant, to);
        }
        let from = grant.held();
        if from != to {
            self.state.update(|s| {
                let tokens = if to >= from {
                    s.tokens().checked_add(to - from)
                } else {
                    Some(s.tokens() - (from - to))
                };
                let next = tokens
                    .and_then(|t| s.with_tokens(t))
                    .ok_or(UsageError::HoldOverflow)?;
                Ok((next, ()))
            })?;
            grant.set_held(to);
        }
        Ok(from)
    }

    /// Returns `grant`'s slot and hold, then serves the queue or the drainers if the word said
    /// someone waits for that.
    #[inline]
    pub(crate) fn release(&self, grant: &Grant) {
        match grant.class() {
            None => self.release_capacity(grant.held()),
            Some(class) => {
                local::with(&self.counters, move |sink| {
                    sink.bump_class(class.index(), ClassCounter::Released, 1);
                });
                self.release_class_admission(class, grant);
            }
        }
    }

    /// Returns `grant`'s hold without usage (a dropped permit): counts the hold as returned
    /// unreported (and, for a class admission, the release, in the same counter lookup), then
    /// returns the slot and the hold as [`release`](Engine::release) does.
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn release_unreported(&self, grant: &Grant) {
        if self.passes_slots() {
            // Neither a budget nor classes: no class and no hold (nothing to book), only the
            // slot, tested with the one flag `release_capacity` tests anyway.
            debug_assert!(grant.class().is_none() && grant.held() == 0);
            self.release_capacity_as(true, 0);
            return;
        }
        let held = grant.held();
        match grant.class() {
            None => {
                // With a hold of 0, there is nothing to book (no lookup).
                if held > 0 {
                    self.count_returned_unreported(held);
                }
                // The flag is known (the counters' stores in between would make the compiler
                // read it again).
                self.release_capacity_as(false, held);
            }
            Some(class) => self.release_class_unreported(class, grant),
        }
    }

    /// [`release_unreported`](Engine::release_unreported) of a class admission: out of line,
    /// so that a release without a class stays small.
    #[inline(never)]
    pub(super) fn release_class_unreported(&self, class: AdmissionClass, grant: &Grant) {
        let held = grant.held();
        // The hold returned is booked in the class's row only (see `counters`).
        local::with(&self.counters, move |sink| {
            if held > 0 {
                sink.count_class_with(
                    class.index(),
                    ClassCounter::Released,
                    (ClassCounter::ReturnedUnreported, held),
                );
            } else {
                sink.count_class(class.index(), ClassCounter::Released);
            }
        });
        self.release_class_admission(class, grant);
    }

    /// The capacity a class admission returns at its release (its counters already booked).
    #[inline]
    pub(super) fn release_class_admission(&self, class: AdmissionClass, grant: &Grant) {
        if grant.holds_slot() {
            self.release_class_all(class, grant.held());
        } else {
            self.release_class_abandoned(class, grant.held());
        }
    }

    /// The hold of a class admission that abandoned its slot earlier, at its release: rare
    /// (out of line, so that the common release falls through to its own path).
    #[cold]
    #[inline(never)]
    fn release_class_abandoned(&self, class: AdmissionClass, held: u64) {
        self.release_class(class, held, Returned::Tokens);
    }

    /// Returns `grant`'s slot now, keeping its hold until its release, if it borrowed its
    /// slot, still holds it and the abandonment can be counted; says whether it did.
    pub(crate) fn abandon(&self, grant: &mut Grant, cause: AbandonCause) -> bool {
        let Some(class) = grant.class() else {
            return false;
        };
        if !grant.holds_slot() || !grant.resources().borrowed_concurrency {
            return false;
        }
        if !self.release_class(class, grant.held(), Returned::Slot) {
            return false;
        }
        grant.set_slot_returned();
        local::with(&self.counters, move |sink| {
            sink.bump(Counter::Abandoned(cause), 1);
            sink.bump_class(class.index(), ClassCounter::Abandoned(cause), 1);
        });
        true
    }

    /// Returns one slot and `held` tokens (see [`release`](Engine::release)).
    #[inline]
    pub(super) fn release_capacity(&self, held: u64) {
        self.release_capacity_as(self.passes_slots(), held);
    }

    /// [`release_capacity`](Engine::release_capacity) by a caller that read the engine's
    /// `passes_slots` flag (`passes_slots`, which must be its own).
    #[inline]
    fn release_capacity_as(&self, passes_slots: bool, held: u64) {
        debug_assert_eq!(passes_slots, self.passes_slots());
        // Calls wait (on an engine without a token budget or classes): the slot goes straight
        // to the queue head, without a write of the word, if it can (see `pass_slot`).
        if passes_slots
            && State::narrow(self.state.narrow_word().load(Ordering::Acquire)).has_waiters()
            && self.pass_slot()
        {
            return;
        }
        let before = self.state.release(held);
        if before.needs_attention_on_release() {
            self.after_release(before);
        }
    }

    #[cold]
    #[inline(never)]
    pub(super) fn after_release(&self, before: State) {
        if before.has_waiters() {
            self.pump();
        } else if before.is_draining() && before.slots() == 1 {
            self.notify_drained();
        }
    }

    // ----- counters -----

    /// Bumps a counter in this thread's shard.
    #[inline]
    pub(super) fn count(&self, counter: Counter, by: u64) {
        local::with(&self.counters, move |sink| sink.bump(counter, by));
    }

    /// Counts `held` tokens returned without usage by a release of an admission without a
    /// class (the dropped-permit path: the counter indexed directly, no [`Counter`] value read
    /// back through memory).
    #[inline]
    pub(super) fn count_returned_unreported(&self, held: u64) {
        local::with(&self.counters, move |sink| {
            sink.bump_returned_unreported(held)
        });
    }

    /// Bumps several counters in this thread's shard (one slot lookup); for an admission of
    /// `class`, the class's twin in place of each that has one (see [`Counter::class_twin`]).
    #[inline]
    pub(crate) fn count_all(&self, class: Option<AdmissionClass>, counts: &[(Counter, u64)]) {
        local::with(&self.counters, move |sink| match class {
            None => {
                for &(counter, by) in counts {
                    sink.bump(counter, by);
                }
            }
            Some(class) => {
                for &(counter, by) in counts {
                    match counter.class_twin() {
                        Some(twin) => sink.bump_class(class.index(), twin, by),
                        None => sink.bump(counter, by),
                    }
                }
            }
        });
    }
}
