//! Per-thread fast-path state: the calling thread's *slot*, a small number that picks its
//! statistics shard in every bulkhead (and so the shard that mints its admission ids).
//!
//! A thread takes a slot the first time it counts something and gives it back when it exits;
//! slots are reused, so they stay as few as the threads alive at once. Holding a slot makes a
//! thread the only writer of that slot's shard in every hub, which is what lets a shard be
//! bumped with a plain load and store. The hot path reads one thread-local `Cell` (no
//! destructor, so no registration check), and indexes the hub's chunk array: no lock, no
//! `RefCell`, no search.

use core::cell::Cell;

use super::counters::{Counter, Hub, SLOTS, Shard};
use crate::support::sync::unmodeled::{AtomicU64, Mutex, Ordering, lock};
use crate::vocabulary::admission_id::IdParts;

/// No slot taken yet.
const UNASSIGNED: u32 = u32::MAX;
/// The thread gave its slot back (it is exiting): count through the fallback shard.
const RELEASED: u32 = u32::MAX - 1;

crate::support::sync::thread_local_cell!(SLOT: Cell<u32> = Cell::new(UNASSIGNED));
// Separate from `SLOT` so that the hot path reads a thread-local without a destructor.
crate::support::sync::thread_local_cell!(OWNER: SlotOwner = SlotOwner(Cell::new(UNASSIGNED)));

/// Gives the thread's slot back when the thread exits.
struct SlotOwner(Cell<u32>);

impl Drop for SlotOwner {
    fn drop(&mut self) {
        // Under loom, slots are not recycled: loom tears a model's thread-locals down together
        // (and may not allow touching another one then), and statistics are not modelled.
        if cfg!(loom) {
            return;
        }
        let slot = self.0.get();
        if slot < SLOTS {
            // Stop using the slot before anyone else can take it: later counts on this
            // thread (other thread-locals' destructors) go to the fallback shard.
            let _ = SLOT.try_with(|s| s.set(RELEASED));
            // The lock orders this thread's last writes to its shards before the next
            // owner's first ones.
            lock(&FREE_SLOTS).push(slot);
        }
    }
}

/// Slots given back by exited threads.
static FREE_SLOTS: Mutex<Vec<u32>> = Mutex::new(Vec::new());
/// The next never-used slot.
static NEXT_SLOT: AtomicU64 = AtomicU64::new(0);

/// Takes a slot for this thread (a freed one if any); `RELEASED` if none can be had.
#[cold]
fn assign() -> u32 {
    let recycled = lock(&FREE_SLOTS).pop();
    let slot = recycled.unwrap_or_else(|| {
        let next = NEXT_SLOT.fetch_add(1, Ordering::Relaxed);
        u32::try_from(next).unwrap_or(RELEASED).min(RELEASED)
    });
    // Register the destructor that gives it back; if thread-locals are already being torn
    // down, do not take a slot at all.
    let owned = OWNER.try_with(|owner| owner.0.set(slot)).is_ok();
    let slot = if owned || slot >= SLOTS {
        slot
    } else {
        lock(&FREE_SLOTS).push(slot);
        RELEASED
    };
    let _ = SLOT.try_with(|s| s.set(slot));
    slot
}

/// Where a counter update goes: this slot's own shard, or the hub's locked fallback shard.
#[derive(Debug)]
pub(crate) enum Sink<'a> {
    Own(&'a Shard),
    Fallback(&'a Hub),
}

impl Sink<'_> {
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn bump(&self, counter: Counter, by: u64) {
        match self {
            Sink::Own(shard) => shard.bump(counter, by),
            Sink::Fallback(hub) => hub.fallback().bump(counter, by),
        }
    }

    /// Adds `by` to class `class`'s `counter`.
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn bump_class(&self, class: u16, counter: super::counters::ClassCounter, by: u64) {
        match self {
            Sink::Own(shard) => shard.bump_class(class, counter, by),
            Sink::Fallback(hub) => hub.fallback().bump_class(class, counter, by),
        }
    }

    /// Counts an event of class `class` and adds to another of its counters (see
    /// [`Shard::count_class_with`]).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn count_class_with(
        &self,
        class: u16,
        event: super::counters::ClassCounter,
        counter: (super::counters::ClassCounter, u64),
    ) {
        match self {
            Sink::Own(shard) => shard.count_class_with(class, event, counter),
            Sink::Fallback(hub) => hub.fallback().count_class_with(class, event, counter),
        }
    }

    /// Counts an event of class `class` (see [`Shard::count_class`]).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn count_class(&self, class: u16, event: super::counters::ClassCounter) {
        match self {
            Sink::Own(shard) => shard.count_class(class, event),
            Sink::Fallback(hub) => hub.fallback().count_class(class, event),
        }
    }

    /// Counts one refusal for `reason`.
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn bump_rejected(&self, reason: crate::vocabulary::rejection::RejectReason) {
        match self {
            Sink::Own(shard) => shard.bump_rejected(reason),
            Sink::Fallback(hub) => hub.fallback().bump_rejected(reason),
        }
    }

    /// Counts a slot the queue handed to a waiter.
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn bump_handed_out(&self) {
        match self {
            Sink::Own(shard) => shard.bump_handed_out(),
            Sink::Fallback(hub) => hub.fallback().bump_handed_out(),
        }
    }

    /// Counts `held` tokens returned by a release that knew no usage.
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn bump_returned_unreported(&self, held: u64) {
        match self {
            Sink::Own(shard) => shard.bump_returned_unreported(held),
            Sink::Fallback(hub) => hub.fallback().bump_returned_unreported(held),
        }
    }

    /// Counts a hand-off its waiter consumed.
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn bump_handed_back(&self) {
        match self {
            Sink::Own(shard) => shard.bump_handed_back(),
            Sink::Fallback(hub) => hub.fallback().bump_handed_back(),
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
#[cfg_attr(not(loom), inline(always))]
pub(crate) fn with<R>(hub: &Hub, f: impl FnOnce(Sink<'_>) -> R) -> R {
    let slot = SLOT.try_with(Cell::get).unwrap_or(RELEASED);
    match hub.shard(slot) {
        Some(shard) => f(Sink::Own(shard)),
        None => with_slow(hub, slot, f),
    }
}

/// [`with`] for a thread without a slot yet, or whose slot's chunk does not exist yet.
#[cold]
#[inline(never)]
fn with_slow<R>(hub: &Hub, slot: u32, f: impl FnOnce(Sink<'_>) -> R) -> R {
    let slot = if slot == UNASSIGNED { assign() } else { slot };
    match hub.shard_or_init(slot) {
        Some(shard) => f(Sink::Own(shard)),
        None => f(Sink::Fallback(hub)),
    }
}
