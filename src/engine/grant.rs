//! [`Grant`]: what the engine records of one admission (its id, the revision that admitted it,
//! its priority, the tokens it holds, and with admission classes its class, what it borrowed
//! and whether it still holds its slot). Whatever a bulkhead adds to an admission (the LLM
//! wing's reservation and usage) lives beside it, in that bulkhead's own record.

use crate::admission_class::{AdmissionClass, Resources};
use crate::admission_id::{AdmissionId, IdParts};
use crate::priority::Priority;

/// One admission, as the engine knows it. Kept small and `Copy`: it is moved into every
/// permit on the fast path.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grant {
    id: IdParts,
    revision: u64,
    priority: Priority,
    /// Tokens this admission currently contributes to the tokens in flight (its reservation
    /// at first; moved by [`Engine::move_hold`](super::Engine::move_hold)).
    held: u64,
    class: Option<AdmissionClass>,
    resources: Resources,
    /// Whether it still holds its slot (not after abandoning it).
    holds_slot: bool,
}

impl Grant {
    #[inline]
    pub(super) fn new(
        id: IdParts,
        revision: u64,
        priority: Priority,
        held: u64,
        class: Option<AdmissionClass>,
        resources: Resources,
    ) -> Grant {
        Grant {
            id,
            revision,
            priority,
            held,
            class,
            resources,
            holds_slot: true,
        }
    }

    /// The admission's id (mixed into its UUID form on demand).
    #[inline]
    pub(crate) fn id(&self) -> AdmissionId {
        self.id.id()
    }

    /// The revision of the limits that admitted it.
    #[inline]
    pub(crate) fn revision(&self) -> u64 {
        self.revision
    }

    #[inline]
    pub(crate) fn priority(&self) -> Priority {
        self.priority
    }

    /// The tokens it holds now.
    #[inline]
    pub(crate) fn held(&self) -> u64 {
        self.held
    }

    #[inline]
    pub(super) fn set_held(&mut self, held: u64) {
        self.held = held;
    }

    /// Its admission class, with classes.
    #[inline]
    pub(crate) fn class(&self) -> Option<AdmissionClass> {
        self.class
    }

    /// What it borrowed from the shared pool when it was admitted.
    #[inline]
    pub(crate) fn resources(&self) -> Resources {
        self.resources
    }

    /// Whether it still holds its slot.
    #[inline]
    pub(crate) fn holds_slot(&self) -> bool {
        self.holds_slot
    }

    #[inline]
    pub(super) fn set_slot_returned(&mut self) {
        self.holds_slot = false;
    }
}
