//! Cumulative counters, sharded per thread: every thread that uses the crate holds a small
//! *slot* number (see `super::local`), and each engine keeps one shard per slot, so a shard has
//! exactly one writer at a time, which bumps it with a plain load and store, no locked
//! instruction and no shared cache line. Reading sums the shards. Slots are reused when threads
//! exit, and a shard keeps its counts across owners, so the number of shards stays at the number
//! of threads that used the crate at once.
//!
//! The ledger counters of an admission of a class (its reservation, and what its usage and
//! release did to its hold: [`Counter::class_twin`]) are booked in its class's row only, and
//! the global figure of each is the global cell (admissions without a class) plus every
//! class's row ([`Totals::get`]): one bump per event, not two, on the class path.

use crate::support::sync::unmodeled::OnceLock;

use crossbeam_utils::CachePadded;

use crate::support::sync::unmodeled::{self, AtomicU64, Mutex, MutexGuard, Ordering};
use crate::vocabulary::admission_class::AbandonCause;
use crate::vocabulary::admission_id::{self, IdParts};
use crate::vocabulary::rejection::RejectReason;

/// One cumulative counter of a shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Counter {
    Admitted,
    Reserved,
    Consumed,
    /// Tokens removed from holds (gross).
    Refunded,
    /// Tokens added to holds above their reservations.
    Overrun,
    /// Tokens added back to holds below their reservations.
    Reheld,
    /// Tokens of holds returned by releases that knew no usage.
    ReturnedUnreported,
    /// Effective usage reports (those that changed an admission's usage or hold).
    UsageReports,
    /// Slots the queue handed to waiters.
    HandedOut,
    /// Hand-offs their waiters consumed (picked up, or gave back).
    HandedBack,
    Rejected(RejectReason),
    /// Admissions that gave their borrowed slot back before settling.
    Abandoned(AbandonCause),
    /// A class's own counter (the class's position, the counter).
    Class(u16, ClassCounter),
}

/// One cumulative counter of one admission class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ClassCounter {
    Admitted,
    Released,
    Reserved,
    Consumed,
    Refunded,
    Overrun,
    Reheld,
    ReturnedUnreported,
    /// Admissions that borrowed their slot.
    BorrowedAdmissions,
    /// Tokens admissions borrowed from the shared pool.
    BorrowedTokensReserved,
    Rejected(RejectReason),
    Abandoned(AbandonCause),
}

impl ClassCounter {
    /// Counters per class.
    pub(crate) const COUNT: usize = 10 + RejectReason::ALL.len() + AbandonCause::ALL.len();

    #[inline]
    fn index(self) -> usize {
        match self {
            ClassCounter::Admitted => 0,
            ClassCounter::Released => 1,
            ClassCounter::Reserved => 2,
            ClassCounter::Consumed => 3,
            ClassCounter::Refunded => 4,
            ClassCounter::Overrun => 5,
            ClassCounter::Reheld => 6,
            ClassCounter::BorrowedAdmissions => 7,
            ClassCounter::BorrowedTokensReserved => 8,
            ClassCounter::ReturnedUnreported => 9,
            ClassCounter::Rejected(reason) => 10 + reason as usize,
            ClassCounter::Abandoned(cause) => 10 + RejectReason::ALL.len() + cause as usize,
        }
    }
}

/// Where the refusal counters start among the global counters.
const REJECTED_AT: usize = 10;
const HANDED_OUT_AT: usize = 6;
const HANDED_BACK_AT: usize = 7;
/// Where [`Counter::ReturnedUnreported`] is among the global counters.
const RETURNED_UNREPORTED_AT: usize = 8;

impl Counter {
    /// The class counter that books this ledger counter for an admission of a class, in
    /// place of the global one (see the module docs).
    #[inline]
    pub(crate) fn class_twin(self) -> Option<ClassCounter> {
        match self {
            Counter::Reserved => Some(ClassCounter::Reserved),
            Counter::Consumed => Some(ClassCounter::Consumed),
            Counter::Refunded => Some(ClassCounter::Refunded),
            Counter::Overrun => Some(ClassCounter::Overrun),
            Counter::Reheld => Some(ClassCounter::Reheld),
            Counter::ReturnedUnreported => Some(ClassCounter::ReturnedUnreported),
            _ => None,
        }
    }

    /// Global counters (the classes' come after them, `ClassCounter::COUNT` per class).
    const COUNT: usize = 10 + RejectReason::ALL.len() + AbandonCause::ALL.len();

    #[inline]
    fn index(self) -> usize {
        match self {
            Counter::Admitted => 0,
            Counter::Reserved => 1,
            Counter::Consumed => 2,
            Counter::Refunded => 3,
            Counter::Overrun => 4,
            Counter::Reheld => 5,
            Counter::HandedOut => HANDED_OUT_AT,
            Counter::HandedBack => HANDED_BACK_AT,
            Counter::ReturnedUnreported => RETURNED_UNREPORTED_AT,
            Counter::UsageReports => 9,
            Counter::Rejected(reason) => REJECTED_AT + reason as usize,
            Counter::Abandoned(cause) => REJECTED_AT + RejectReason::ALL.len() + cause as usize,
            Counter::Class(class, counter) => {
                Counter::COUNT + usize::from(class) * ClassCounter::COUNT + counter.index()
            }
        }
    }
}

/// One slot's counters for one bulkhead. Its admission count is also the sequence of the
/// admission ids it mints (see `crate::vocabulary::admission_id`).
#[derive(Debug)]
pub(crate) struct Shard(CachePadded<ShardCells>);

/// One class's counters in a shard, in [`ClassCounter::index`] order.
type ClassRow = [AtomicU64; ClassCounter::COUNT];

#[derive(Debug)]
struct ShardCells {
    /// The global counters, inline: the path without classes indexes them with constants.
    global: [AtomicU64; Counter::COUNT],
    /// A row of `ClassCounter::COUNT` per class (empty without classes): a class's row is
    /// found with one bounds check.
    classes: Box<[ClassRow]>,
    /// This shard's id tag (immutable).
    tag: u64,
}

impl Shard {
    /// A shard for an engine with `classes` admission classes.
    fn new(classes: usize) -> Shard {
        Shard(CachePadded::new(ShardCells {
            global: core::array::from_fn(|_| AtomicU64::new(0)),
            classes: (0..classes)
                .map(|_| core::array::from_fn(|_| AtomicU64::new(0)))
                .collect(),
            tag: admission_id::new_tag(),
        }))
    }

    /// The cell of `counter`.
    #[cfg_attr(not(loom), inline(always))]
    fn cell(&self, counter: Counter) -> &AtomicU64 {
        match counter {
            Counter::Class(class, counter) => &self.0.classes[usize::from(class)][counter.index()],
            counter => &self.0.global[counter.index()],
        }
    }

    /// Every cell, global first, in [`Counter::index`] order.
    fn cells(&self) -> impl Iterator<Item = &AtomicU64> {
        self.0.global.iter().chain(self.0.classes.iter().flatten())
    }
}

impl Shard {
    /// Counts an admission of `reserved` tokens and mints its id. Single-writer, like `bump`.
    /// An admission of a class passes 0: its reservation is booked in its class's row.
    #[inline]
    pub(crate) fn admit(&self, reserved: u64) -> IdParts {
        let admitted = &self.0.global[Counter::Admitted.index()];
        let seq = admitted.load(Ordering::Relaxed);
        admitted.store(seq + 1, Ordering::Release);
        if reserved > 0 {
            self.bump(Counter::Reserved, reserved);
        }
        IdParts::new(self.0.tag, seq)
    }

    /// Counts a slot the queue handed to a waiter (indexed directly: no [`Counter`] value
    /// read back through memory on the hand-off path).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn bump_handed_out(&self) {
        self.bump_at(HANDED_OUT_AT, 1);
    }

    /// Counts `held` tokens returned by a release that knew no usage (indexed directly: the
    /// release path of a dropped permit).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn bump_returned_unreported(&self, held: u64) {
        self.bump_at(RETURNED_UNREPORTED_AT, held);
    }

    /// Counts a hand-off its waiter consumed (see [`bump_handed_out`](Shard::bump_handed_out)).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn bump_handed_back(&self) {
        self.bump_at(HANDED_BACK_AT, 1);
    }

    #[cfg_attr(not(loom), inline(always))]
    fn bump_at(&self, index: usize, by: u64) {
        let cell = &self.0.global[index];
        add(cell, by);
    }

    /// Counts one refusal for `reason` (the refusal path: indexed directly, no [`Counter`]
    /// value built and read back).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn bump_rejected(&self, reason: RejectReason) {
        let cell = &self.0.global[REJECTED_AT + reason as usize];
        add(cell, 1);
    }

    /// Adds `by` to class `class`'s `counter` (its arguments stay scalars: a [`Counter`] value
    /// built and read back through memory costs a store-forwarding stall on the fast path).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn bump_class(&self, class: u16, counter: ClassCounter, by: u64) {
        add(&self.0.classes[usize::from(class)][counter.index()], by);
    }

    /// Counts one event of class `class` (`event`: an admission, a release) and adds `by` to
    /// its `counter`: the class's row found (and bounds-checked) once.
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn count_class_with(
        &self,
        class: u16,
        event: ClassCounter,
        (counter, by): (ClassCounter, u64),
    ) {
        let row = &self.0.classes[usize::from(class)];
        count(&row[event.index()]);
        add(&row[counter.index()], by);
    }

    /// Counts one event of class `class` (see [`count`]).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn count_class(&self, class: u16, event: ClassCounter) {
        count(&self.0.classes[usize::from(class)][event.index()]);
    }

    /// Adds `by` to `counter`, saturating (see [`add`]).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn bump(&self, counter: Counter, by: u64) {
        add(self.cell(counter), by);
    }
}

/// Adds `by` to a shard's `cell`, saturating: every counter update goes through here.
///
/// Single-writer: only the thread the shard is attached to (or a holder of the hub's fallback
/// lock) calls this, so the plain load and store cannot lose an update. The load is `Relaxed`
/// (the writer reads its own latest value). The store is `Release` so that a reader whose
/// `Acquire` load sees a count also sees the admission-word update that came before it (see
/// `LlmBulkhead::stats`); on x86-64 both are plain moves.
#[cfg_attr(not(loom), inline(always))]
fn add(cell: &AtomicU64, by: u64) {
    cell.store(
        cell.load(Ordering::Relaxed).saturating_add(by),
        Ordering::Release,
    );
}

/// Counts one event in a shard's `cell` (single-writer, orderings as [`add`]'s): `+ 1`, which
/// cannot overflow in practice (2^64 events take 584 years at one per nanosecond), so unlike a
/// sum of tokens it needs no saturation.
#[cfg_attr(not(loom), inline(always))]
fn count(cell: &AtomicU64) {
    cell.store(
        cell.load(Ordering::Relaxed).wrapping_add(1),
        Ordering::Release,
    );
}

/// Shards per chunk of a hub.
const CHUNK: usize = 64;
/// Chunks per hub: slots `0..CHUNK * CHUNKS` have a shard of their own.
const CHUNKS: usize = 64;
/// The number of slots with a shard of their own; threads beyond it share the locked fallback.
pub(crate) const SLOTS: u32 = (CHUNK * CHUNKS) as u32;

/// All shards of one bulkhead: one per slot, allocated a chunk at a time when a slot of the
/// chunk first counts something, and read without a lock.
#[derive(Debug)]
pub(crate) struct Hub {
    chunks: [OnceLock<Box<[Shard; CHUNK]>>; CHUNKS],
    /// Used (under its lock) by threads without a slot (their thread-local state is being
    /// torn down, or more than `SLOTS` threads use the crate at once).
    fallback: Mutex<Shard>,
    /// The engine's admission classes (0 without).
    classes: usize,
}

impl Hub {
    /// The shards of an engine with `classes` admission classes.
    pub(crate) fn new(classes: usize) -> Hub {
        Hub {
            chunks: core::array::from_fn(|_| OnceLock::new()),
            fallback: Mutex::new(Shard::new(classes)),
            classes,
        }
    }

    /// The shard of `slot`, if its chunk exists (`None` for slots without a shard).
    #[inline]
    pub(crate) fn shard(&self, slot: u32) -> Option<&Shard> {
        let slot = slot as usize;
        let chunk = self.chunks.get(slot / CHUNK)?.get()?;
        Some(&chunk[slot % CHUNK])
    }

    /// The shard of `slot`, allocating its chunk if needed (`None` for slots without one).
    #[cold]
    pub(crate) fn shard_or_init(&self, slot: u32) -> Option<&Shard> {
        let slot = slot as usize;
        let chunk = self.chunks.get(slot / CHUNK)?.get_or_init(|| {
            // Built on the heap: a chunk is too large for a small stack (loom's threads).
            let shards: Box<[Shard]> = (0..CHUNK).map(|_| Shard::new(self.classes)).collect();
            shards.try_into().expect("CHUNK shards")
        });
        Some(&chunk[slot % CHUNK])
    }

    /// The shared fallback shard, locked.
    pub(crate) fn fallback(&self) -> MutexGuard<'_, Shard> {
        unmodeled::lock(&self.fallback)
    }

    /// Every counter summed over every shard, in one pass.
    pub(crate) fn totals(&self) -> Totals {
        let mut totals = Totals(vec![0; Counter::COUNT + self.classes * ClassCounter::COUNT]);
        let mut add = |shard: &Shard| {
            for (total, cell) in totals.0.iter_mut().zip(shard.cells()) {
                *total = total.saturating_add(cell.load(Ordering::Acquire));
            }
        };
        add(&self.fallback());
        for chunk in self.chunks.iter().filter_map(OnceLock::get) {
            chunk.iter().for_each(&mut add);
        }
        totals
    }
}

/// Counter sums at one moment.
#[derive(Clone, Debug)]
pub(crate) struct Totals(Vec<u64>);

impl Totals {
    /// `counter`'s total; for a ledger counter with a class twin, the global cell plus the
    /// twin of every class (see the module docs).
    pub(crate) fn get(&self, counter: Counter) -> u64 {
        let global = self.0[counter.index()];
        let Some(twin) = counter.class_twin() else {
            return global;
        };
        self.0[Counter::COUNT..]
            .chunks_exact(ClassCounter::COUNT)
            .fold(global, |total, row| total.saturating_add(row[twin.index()]))
    }

    /// Refusals for `reason`.
    pub(crate) fn rejected(&self, reason: RejectReason) -> u64 {
        self.get(Counter::Rejected(reason))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn every_slot_below_the_limit_has_its_own_shard_and_the_rest_share_the_fallback() {
        let hub = Hub::new(0);
        assert!(hub.shard(0).is_none(), "chunks are allocated on first use");
        for slot in [0, 63, 64, SLOTS - 1] {
            hub.shard_or_init(slot).unwrap().bump(Counter::Consumed, 1);
            assert!(hub.shard(slot).is_some());
        }
        assert!(hub.shard(SLOTS).is_none() && hub.shard_or_init(SLOTS).is_none());
        assert!(hub.shard_or_init(u32::MAX).is_none());
        hub.fallback().bump(Counter::Consumed, 10);
        assert_eq!(hub.totals().get(Counter::Consumed), 14);
        // Distinct shards, distinct id tags.
        let a = hub.shard(0).unwrap().admit(0);
        let b = hub
            .shard(1)
            .unwrap_or_else(|| hub.shard_or_init(1).unwrap())
            .admit(0);
        assert_ne!(a.id(), b.id());
        assert_eq!(hub.totals().get(Counter::Admitted), 2);
    }
}
