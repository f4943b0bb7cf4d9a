//! The permit core every permit of the crate is made of: a face's core (borrowed, or shared
//! by an `Arc`) and what the permit holds, settled exactly once. The general bulkhead's
//! permits hold an engine [`Grant`](super::Grant); the LLM bulkhead's hold an admission
//! (the grant and its token ledger). A permit released explicitly is marked settled first,
//! so that its drop settles nothing; any other permit settles when it is dropped.

use core::ops::Deref;

/// A face's side of its permits: what a permit holds and how a dropped one settles.
pub(crate) trait Holder {
    /// What a permit holds.
    type Held;

    /// Whether `held` has been settled already (an explicit release, or its admission moved
    /// elsewhere).
    fn is_settled(held: &Self::Held) -> bool;

    /// Settles `held` for a permit dropped without an explicit release.
    fn settle_dropped(&self, held: &Self::Held);
}

/// A face's core `C` (`&Core` or `Arc<Core>`) and what one permit holds of it.
pub(crate) struct PermitCore<C: Deref<Target: Holder>> {
    core: C,
    held: <C::Target as Holder>::Held,
}

impl<C: Deref<Target: Holder>> PermitCore<C> {
    #[inline]
    pub(crate) fn new(core: C, held: <C::Target as Holder>::Held) -> PermitCore<C> {
        PermitCore { core, held }
    }

    /// The face's core, as the permit keeps it (to clone an `Arc`).
    #[inline]
    pub(crate) fn core(&self) -> &C {
        &self.core
    }

    #[inline]
    pub(crate) fn held(&self) -> &<C::Target as Holder>::Held {
        &self.held
    }

    /// The core and the hold together, for reports and explicit releases.
    #[inline]
    pub(crate) fn parts(&mut self) -> (&C::Target, &mut <C::Target as Holder>::Held) {
        (&*self.core, &mut self.held)
    }
}

impl<C: Deref<Target: Holder>> Drop for PermitCore<C> {
    #[inline]
    fn drop(&mut self) {
        if !<C::Target as Holder>::is_settled(&self.held) {
            self.core.settle_dropped(&self.held);
        }
    }
}
