//! [`Grant`]: what the engine records of one admission (its id, the revision that admitted it,
//! its priority, the tokens it holds, and with admission classes its class, what it borrowed
//! and whether it still holds its slot). Whatever a bulkhead adds to an admission (the LLM
//! wing's reservation and usage) lives beside it, in that bulkhead's own record.

use crate::vocabulary::admission_class::{AdmissionClass, Resources};
use crate::vocabulary::admission_id::{AdmissionId, IdParts};
use crate::vocabulary::priority::Priority;

/// One admission, as the engine knows it. Kept small and `Copy` (48 bytes): it is moved into
/// every permit on the fast path, and a permit must stay within the 128 bytes the compiler
/// copies inline (a larger one is copied by a `memcpy` call at every layer it crosses, which
/// measured as doubling the cost of an admission). So what it borrowed and whether it still
/// holds its slot are packed into the padding after `priority`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grant {
    id: IdParts,
    revision: u64,
    /// Tokens this admission currently contributes to the tokens in flight (its reservation
    /// at first; moved by [`Engine::move_hold`](super::Engine::move_hold)).
    held: u64,
    class: Option<AdmissionClass>,
    /// The low 32 bits of the tokens it borrowed (the rest in `flags`, see below).
    borrowed_low: u32,
    priority: Priority,
    /// `HOLDS_SLOT`, `BORROWED_SLOT`, and bits 32.. of the borrowed tokens from bit
    /// `BORROWED_HIGH_SHIFT` on (borrowed tokens are at most `MAX_TOKENS`, 35 bits).
    flags: u8,
}

/// It still holds its slot (not after abandoning it).
const HOLDS_SLOT: u8 = 1;
/// It borrowed its slot from the shared pool.
const BORROWED_SLOT: u8 = 1 << 1;
const BORROWED_HIGH_SHIFT: u32 = 2;

const _: () = assert!(super::state::MAX_TOKENS >> 32 < 1 << (8 - BORROWED_HIGH_SHIFT));

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
        debug_assert!(resources.borrowed_tokens <= super::state::MAX_TOKENS);
        let mut flags =
            HOLDS_SLOT | ((resources.borrowed_tokens >> 32) as u8) << BORROWED_HIGH_SHIFT;
        if resources.borrowed_concurrency {
            flags |= BORROWED_SLOT;
        }
        Grant {
            id,
            revision,
            held,
            class,
            borrowed_low: resources.borrowed_tokens as u32,
            priority,
            flags,
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
        Resources {
            borrowed_concurrency: self.flags & BORROWED_SLOT != 0,
            borrowed_tokens: u64::from(self.borrowed_low)
                | u64::from(self.flags >> BORROWED_HIGH_SHIFT) << 32,
        }
    }

    /// Whether it still holds its slot.
    #[inline]
    pub(crate) fn holds_slot(&self) -> bool {
        self.flags & HOLDS_SLOT != 0
    }

    #[inline]
    pub(super) fn set_slot_returned(&mut self) {
        self.flags &= !HOLDS_SLOT;
    }
}
