//! Per-thread fast-path state: this thread's statistics shard for each bulkhead it uses (which
//! also mints its admission ids). Nothing here is written by two threads at once.

use core::cell::RefCell;

use crate::admission_id::IdParts;
use crate::stats::{Counter, Hub, Shard};
use crate::sync::unmodeled::{Arc, Weak};

/// A shard attached to this thread, and the hub to return it to when the thread exits.
#[derive(Debug)]
struct Attached {
    /// The hub's address, for a cheap lookup. A live `Weak` keeps its allocation, so the
    /// address cannot be reused by a new hub while this entry exists.
    key: usize,
    hub: Weak<Hub>,
    shard: Arc<Shard>,
}

impl Drop for Attached {
    fn drop(&mut self) {
        // The thread is exiting (or the bulkhead is gone and we are pruning): hand the shard
        // back so the next thread adopts it, counts intact.
        if let Some(hub) = self.hub.upgrade() {
            hub.detach(Arc::clone(&self.shard));
        }
    }
}

/// This thread's shard for `hub`, attaching one on first use.
#[inline]
fn shard_for<'a>(attached: &'a mut Vec<Attached>, hub: &Arc<Hub>) -> &'a Shard {
    let key = Arc::as_ptr(hub) as usize;
    match attached.iter().position(|a| a.key == key) {
        Some(i) => &attached[i].shard,
        None => attach(attached, hub),
    }
}

#[cold]
fn attach<'a>(attached: &'a mut Vec<Attached>, hub: &Arc<Hub>) -> &'a Shard {
    // Forget bulkheads that no longer exist, so the list stays as short as the set of live
    // bulkheads this thread uses.
    attached.retain(|a| a.hub.strong_count() > 0);
    let key = Arc::as_ptr(hub) as usize;
    attached.push(Attached {
        key,
        hub: Arc::downgrade(hub),
        shard: hub.attach(),
    });
    &attached[attached.len() - 1].shard
}

crate::sync::thread_local_cell!(LOCAL: RefCell<Vec<Attached>> = RefCell::new(Vec::new()));

/// Where a counter update goes: this thread's own shard, or the hub's locked fallback shard
/// when the thread-local state is unavailable (the thread is being torn down).
#[derive(Debug)]
pub(crate) enum Sink<'a> {
    Own(&'a Shard),
    Fallback(&'a Hub),
}

impl Sink<'_> {
    #[inline]
    pub(crate) fn bump(&self, counter: Counter, by: u64) {
        match self {
            Sink::Own(shard) => shard.bump(counter, by),
            Sink::Fallback(hub) => hub.fallback().bump(counter, by),
        }
    }

    /// Counts an admission of `reserved` tokens and mints its id.
    #[inline]
    pub(crate) fn admit(&self, reserved: u64) -> IdParts {
        match self {
            Sink::Own(shard) => shard.admit(reserved),
            Sink::Fallback(hub) => hub.fallback().admit(reserved),
        }
    }
}

/// Runs `f` with this thread's counter sink for `hub`.
///
/// `f` must not call `with` again (it never does: the callers pass tiny closures that only
/// bump counters and mint ids).
#[inline]
pub(crate) fn with<R>(hub: &Arc<Hub>, f: impl FnOnce(Sink<'_>) -> R) -> R {
    let mut f = Some(f);
    let done = LOCAL.try_with(|cell| {
        let mut attached = cell.try_borrow_mut().ok()?;
        let f = f.take()?;
        Some(f(Sink::Own(shard_for(&mut attached, hub))))
    });
    match (done, f) {
        (Ok(Some(out)), _) => out,
        // Thread-local state destroyed (thread teardown) or, defensively, already borrowed:
        // use the hub's locked fallback shard.
        (_, Some(f)) => f(Sink::Fallback(hub)),
        (_, None) => unreachable!("`f` ran but produced no value"),
    }
}
