//! Provisional admissions: the lower level of a two-level decision (a tenant within global
//! limits). A provisional admission takes its slot and tokens on the word exactly as an
//! admission does (one CAS, or its class's path), but counts nothing and mints no id: the
//! level above decides next, and the provisional admission is then either confirmed (counted
//! and minted, as if admitted at that moment: [`Engine::confirm`]) or cancelled (its slot and
//! tokens returned, nothing counted: [`Engine::cancel_provisional`]). So no level counts an admission
//! another level refused, and nothing ever holds more than its limits allow: while the level
//! above decides, the slot is taken, so a concurrent call of the same lower level sees it
//! taken (it may be refused for a slot that is then given back; it is never admitted beyond
//! the limits).

use super::assembly::Engine;
use super::classes::Returned;
use super::grant::Grant;
use super::policy::Ask;
use super::rate_path::Charged;
use crate::vocabulary::admission_class::Resources;
use crate::vocabulary::rejection::Rejection;

/// A slot and tokens taken on the word for `ask`, not yet counted: [`Engine::confirm`] or
/// [`Engine::cancel_provisional`] must consume it (the caller guarantees it; dropping one would keep its
/// capacity forever, which the debug build reports).
#[derive(Debug)]
#[must_use = "a provisional admission holds capacity until confirmed or cancelled"]
pub(crate) struct Provisional {
    ask: Ask,
    revision: u64,
    borrowed: Resources,
    /// What the rate windows were charged (given back if it is cancelled).
    charge: Option<Charged>,
    #[cfg(debug_assertions)]
    settled: bool,
}

impl Provisional {
    #[inline]
    fn new(ask: Ask, revision: u64, borrowed: Resources, charge: Option<Charged>) -> Provisional {
        Provisional {
            ask,
            revision,
            borrowed,
            charge,
            #[cfg(debug_assertions)]
            settled: false,
        }
    }

    /// The parts, marking it consumed.
    #[inline]
    fn take(self) -> (Ask, u64, Resources, Option<Charged>) {
        let parts = (self.ask, self.revision, self.borrowed, self.charge);
        #[cfg(debug_assertions)]
        {
            let mut this = self;
            this.settled = true;
        }
        parts
    }
}

#[cfg(debug_assertions)]
impl Drop for Provisional {
    fn drop(&mut self) {
        if !self.settled && !std::thread::panicking() {
            panic!("a provisional admission was dropped without confirm or cancel");
        }
    }
}

impl Engine {
    /// Takes `ask`'s slot and tokens now, without counting an admission, or refuses it now
    /// (never queues; the refusal is counted: it is this level's decision).
    pub(crate) fn try_provisional(&self, ask: Ask) -> Result<Provisional, Rejection> {
        let charge = self.charge_windows(ask)?;
        let decided = self.decide_provisional(ask, charge);
        if decided.is_err() {
            self.refund_windows(charge);
        }
        decided
    }

    /// [`try_provisional`](Engine::try_provisional)'s decision, after the rate windows.
    fn decide_provisional(
        &self,
        ask: Ask,
        charge: Option<Charged>,
    ) -> Result<Provisional, Rejection> {
        if ask.class.is_some() {
            return match self.admit_class_now(ask) {
                Ok((revision, borrowed)) => Ok(Provisional::new(ask, revision, borrowed, charge)),
                Err(refusal) => Err(self.refuse_class_now(ask, refusal)),
            };
        }
        match self.admit_now(ask) {
            Ok(revision) => Ok(Provisional::new(ask, revision, Resources::NONE, charge)),
            Err(refusal) => Err(self.refuse_global_now(ask, refusal)),
        }
    }

    /// [`try_provisional`](Engine::try_provisional) on the fast lane (a call without a class,
    /// decided as [`try_admit_fast`](Engine::try_admit_fast) decides it); `None`, with nothing
    /// changed, for anything the general path must decide (or refuse).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn try_provisional_fast(&self, ask: Ask) -> Option<Provisional> {
        if ask.class.is_some() || !self.has_fast_lane() {
            return None;
        }
        let revision = self.admit_fast(ask)?;
        Some(Provisional::new(ask, revision, Resources::NONE, None))
    }

    /// Counts `provisional` as admitted now and mints its id: its grant, as an admission of
    /// the same ask under the same limits would have had it.
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn confirm(&self, provisional: Provisional) -> Grant {
        let (ask, revision, borrowed, _) = provisional.take();
        if ask.class.is_none() {
            return self.grant_unclassed(ask, revision);
        }
        self.grant(ask, revision, borrowed)
    }

    /// Returns `provisional`'s slot and tokens, counting nothing (no admission happened), and
    /// serves the queue or the drainers as a release does.
    pub(crate) fn cancel_provisional(&self, provisional: Provisional) {
        let (ask, _, _, charge) = provisional.take();
        self.refund_windows(charge);
        match ask.class {
            None => self.release_capacity(ask.reserved),
            // The general (locked) release, not the inlined fast one of every class permit:
            // a second caller of that one would cost every class release its inlining
            // (measured: 22 more instructions per class admission + release).
            Some(class) => {
                self.release_class(class, ask.reserved, Returned::All);
            }
        }
    }
}
