//! [`Grant`]: what the engine records of one admission (its id, the revision that admitted it,
//! its priority and the tokens it holds). Whatever a bulkhead adds to an admission (the LLM
//! wing's reservation and usage) lives beside it, in that bulkhead's own record.

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
}

impl Grant {
    #[inline]
    pub(super) fn new(id: IdParts, revision: u64, priority: Priority, held: u64) -> Grant {
        Grant {
            id,
            revision,
            priority,
            held,
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
}
