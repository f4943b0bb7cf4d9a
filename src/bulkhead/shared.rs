//! [`BulkheadCore`]: the engine behind every clone of a [`Bulkhead`](super::Bulkhead) and
//! every permit, with what makes it a general bulkhead: the default queue timeout and the
//! reject hook. Every call asks the engine for one slot and no tokens (`ASK`); every refusal
//! becomes a [`BulkheadError`] here, where the hook hears it.

use core::fmt;
use std::time::Duration;

use crate::engine::permit::Holder;
use crate::engine::{Ask, Engine, Grant};
use crate::support::contain::contain;
use crate::support::sync::unmodeled::{AtomicU64, Ordering};
use crate::vocabulary::priority::Priority;
use crate::vocabulary::rejection::{RejectReason, Rejection};

use super::error::{BulkheadError, BulkheadState};

/// What every call of a general bulkhead asks the engine for: a slot, no tokens, no class.
pub(super) const ASK: Ask = Ask::slot(Priority::Normal);

/// The reject hook's type.
pub(super) type RejectHook = dyn Fn(&BulkheadError) + Send + Sync;

pub(super) struct BulkheadCore {
    engine: Engine,
    /// How long a queued call waits at most (`None`: as long as it takes).
    queue_timeout: Option<Duration>,
    /// Hears every refusal, with the occupancy it saw.
    on_reject: Option<Box<RejectHook>>,
    /// Panics of the hook, caught and counted.
    hook_panics: AtomicU64,
}

impl BulkheadCore {
    pub(super) fn new(
        engine: Engine,
        queue_timeout: Option<Duration>,
        on_reject: Option<Box<RejectHook>>,
    ) -> BulkheadCore {
        BulkheadCore {
            engine,
            queue_timeout,
            on_reject,
            hook_panics: AtomicU64::new(0),
        }
    }

    #[inline]
    pub(super) fn engine(&self) -> &Engine {
        &self.engine
    }

    pub(super) fn queue_timeout(&self) -> Option<Duration> {
        self.queue_timeout
    }

    pub(super) fn hook_panics(&self) -> u64 {
        self.hook_panics.load(Ordering::Relaxed)
    }

    /// The error of a call refused by the engine (already counted there), announced to the
    /// hook. `waited` is how long it queued, for a timeout.
    #[cold]
    pub(super) fn refused(&self, rejection: &Rejection, waited: Duration) -> BulkheadError {
        let detail = rejection.detail();
        let state = BulkheadState {
            active: detail.in_flight,
            queued: detail.pending,
        };
        let error = match rejection.reason() {
            RejectReason::Shutdown => BulkheadError::Shutdown { state },
            RejectReason::Timeout => BulkheadError::QueueTimeout { waited, state },
            // No slot and no room to wait (`max_queue` reached, or a call that may not wait);
            // a call without tokens is never refused for its budget, nor does it refuse itself.
            _ => BulkheadError::QueueFull { state },
        };
        self.announce(&error);
        error
    }

    /// Tells the hook, if any, catching its panic.
    fn announce(&self, error: &BulkheadError) {
        if let Some(hook) = &self.on_reject
            && contain(|| hook(error))
        {
            self.hook_panics.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The live occupancy.
    pub(super) fn state(&self) -> BulkheadState {
        let occupancy = self.engine.occupancy();
        BulkheadState {
            active: occupancy.active,
            queued: occupancy.queued,
        }
    }
}

impl Holder for BulkheadCore {
    type Held = Grant;

    /// A general permit settles only when it is dropped (`release` drops it).
    #[inline]
    fn is_settled(_: &Grant) -> bool {
        false
    }

    /// Returns the slot (to the oldest queued call, if one waits).
    #[inline]
    fn settle_dropped(&self, grant: &Grant) {
        self.engine.release(grant);
    }
}

impl fmt::Debug for BulkheadCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bulkhead")
            .field("engine", &self.engine)
            .field("queue_timeout", &self.queue_timeout)
            .field("on_reject", &self.on_reject.is_some())
            .finish()
    }
}
