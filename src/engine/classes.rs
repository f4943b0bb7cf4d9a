//! Admission classes: each class's live counts, the per-class lock, the reserved floors (a call
//! within its class's floors admitted on its class's word alone), and the class path of every
//! operation that moves a class's counts (admission, hand-off, usage, abandonment, release).
//!
//! # The protocol, and why this one
//!
//! A class call is judged on three kinds of figures: global ones (slots and tokens in flight,
//! the budget), its class's own (calls and tokens in flight, against the class's ceilings and
//! floors), and the shared pool's (what calls beyond their floors borrow, `Σ_c max(0,
//! in_flight_c − floor_c)` for slots and the same for tokens), which depend on every class at
//! once. Three requirements decide the design:
//!
//! 1. every global and shared figure a decision checks must change in the same atomic step
//!    that commits the decision, or a concurrent decision can be refused on a half-made one
//!    (or, worse, admitted past a floor);
//! 2. the shared figures must equal the sums they stand for at every moment, whatever order
//!    classes admit, release, report and abandon in;
//! 3. a class's counts must not be read, decided on and written back by two calls of that
//!    class at once (the naive "CAS the class word, then the global word, undo on failure"
//!    lets a second call compute its borrow from a count that is then undone, and the shared
//!    figure drifts from the sum for good).
//!
//! So:
//!
//! - The admission word is **wide** (128 bits, `super::state`): its low half is the usual word
//!   (slots, tokens, epoch bits, flags) and its high half the shared pool's slots and tokens
//!   and the count of abandoned admissions. One CAS of it commits a class decision: global
//!   and shared figures together (requirements 1 and 2).
//! - Each class has a 64-bit **class word** (its calls and tokens in flight, and a lock bit).
//!   An operation on a class takes the class's lock (one CAS), reads its counts, decides and
//!   commits with the wide CAS, and writes the new counts back with the lock cleared (one
//!   store). Calls of one class are serialized for those few instructions; calls of different
//!   classes never wait for each other (requirement 3).
//! - Limits cannot change under a held class lock: installing new limits takes every class's
//!   lock (in class order) for the few instructions that publish them and recompute the shared
//!   figures from the class counts and the new floors. So a class decision reads the limits
//!   once and needs no epoch check after its CAS.
//! - Lock order: limits writer, then queue, then class locks (always in class order when
//!   several). A class lock is never held while taking another lock, and no user code runs
//!   under one.
//!
//! Progress: the locked path is lock-free across classes (but while a writer of every class,
//! `lock_all`, holds them all) and blocking within a class: a call waits (spinning, then
//! yielding: see `take`) while another operation of the same class is between its lock and its
//! store, a few dozen instructions unless that thread is descheduled, and then for as long as
//! it stays descheduled (`benches/class_tail.rs` measures that tail).
//! A class without contention pays one CAS and one store more per operation than the path
//! without classes, and its word operations are 128 bits wide: a CAS to admit, and to release
//! (slot and hold together, the common case) one 128-bit `fetch_sub`, which, like the narrow
//! word's, cannot borrow across fields because everything it subtracts is part of the counts
//! it subtracts from (the class's borrowed figures are part of the shared ones while its lock
//! is held).
//!
//! The alternatives lose: a pending-reservation protocol on 64-bit words still needs one extra
//! read-modify-write per operation per word touched and makes every refusal wait for pending
//! reservations of other classes; keeping every class's counts in the one atomic word does not
//! fit (each class needs 51 bits); sharding capacity per class makes refusals on capacity
//! leased to an idle class unexplainable.
//!
//! The locked path costs two locked instructions per side (the class lock's CAS and the wide
//! word's), against one without classes, and any protocol that changes a class's counts and
//! the global figures, held in two words, together needs that many (`benches/classes.rs`
//! measures them alone as `atomics_floor`). The common call does not change both: see the
//! next section.
//!
//! # Floors reserved
//!
//! Floors are strict (idle protected capacity is never lent), so a call within its class's
//! floors needs nothing the other classes could take. While the floors are **reserved**, the
//! wide word counts every class that has a floor of calls at its floors at least:
//!
//! ```text
//!   slots in the word  = Σ_c counted_c(in_flight_c),   counted_c(n) = max(n, floor_c)
//!   tokens in the word = Σ_c counted_c(tokens_c),      (the same with the token floor)
//! ```
//!
//! for those classes, and the plain counts for the others; the shared figures are unchanged.
//! A call within its class's floor of calls and of tokens changes no counted figure, so it is
//! admitted and released with **one CAS on its class's word** (`admit_within_floors`,
//! `release_within_floors`), and the wide word is not touched at all. The class word:
//!
//! ```text
//!   63       62         61       60 .. 51 (low bits)   50 .......... 35   34 ............. 0
//! +--------+----------+--------+---------------------+-----------------+------------------+
//! | LOCKED | RESERVED | BEYOND |  LIMITS EPOCH       | CALLS (16 bits) | TOKENS (35 bits) |
//! +--------+----------+--------+---------------------+-----------------+------------------+
//! ```
//!
//! `RESERVED` says the class's floors are reserved; the epoch bits are those of the limits
//! the word was last unlocked under by a writer of every class; `BEYOND` says the counts are
//! beyond the class's floors in force (more calls or more tokens), written by whoever unlocks
//! the word with new counts or new limits. An admission within the floors reads them (of the
//! epoch in the word's bits) and keeps `BEYOND` clear; a release needs no limits at all: the
//! class word with `RESERVED` and without `BEYOND` or `LOCKED` says its counts are within the
//! floors in force, and its CAS checks that with the counts it takes the release from (limits
//! change only under every class lock, and their writer sets `BEYOND` from the new floors as
//! it unlocks each word). The wide word's
//! `FLOORS RESERVED` bit (`super::state`) says the same of the whole engine, in the same CAS
//! as the figures it qualifies, so a reader can tell which figures it holds.
//!
//! Why the fast admission is the decision the locked path would make. Reserving is allowed
//! only on an open word with nobody waiting and no drain armed, when some class has a floor of
//! calls and the shared figures are within their capacities (`floors_may_be_reserved`):
//! `shared_slots ≤ max_concurrent − Σ floors` and `shared_tokens ≤ budget − Σ token floors`.
//! Every borrowing admission checks exactly those capacities (protection; without token
//! floors the budget check bounds the shared tokens) and nothing but a usage report or new
//! limits raises a shared figure, so they hold for as long as the floors stay reserved. Then, for a call within its class's floors, `in_flight + 1 ≤ Σ_c
//! min(in_flight_c, floor_c) + shared_slots + 1 ≤ Σ floors + shared_slots ≤ max_concurrent`,
//! and likewise the tokens against the budget: every global check passes; the class's
//! ceilings are checked on the class word; it borrows nothing, so protection does not apply;
//! and nobody waits, so there is no one to barge past. A normal-priority call may use only the
//! budget less its high-priority reserve, which the capacities do not bound: with a reserve it
//! takes the locked path.
//!
//! Why the locked path stays exact while the floors are reserved. It decides on what the word
//! counts, adding what the admission adds to the counted figures (`ClassView::added`): a call
//! the word admits the true figures admit too (they are lower by the idle floors). The
//! converse holds whenever protection passes, which covers every call but those refused on
//! the budget or a slot: those are decided again after the floors stop being reserved, so a
//! refusal's reason is always the one the true figures give. Releases, usage moves and
//! abandonment move the counted figures by what they move in `counted_c`. A usage move that
//! would take the shared tokens past their capacity stops reserving first.
//!
//! Switching: `recount_classes` takes every class's lock, recomputes the wide word's slots,
//! tokens and shared figures from the class counts (reserving the idle floors or not) in one
//! CAS, and unlocks every class word with its `RESERVED` bit and the epoch's bits. The floors
//! are reserved when the engine is built, at every install of limits (which recounts under the
//! new floors in the CAS that advances the epoch: attrition after a shrink leaves them released
//! until the shared figures fit again), when the queue empties, and on a release once the
//! shared pool is at most half used; they are released by `close` (in the CAS that closes), by
//! a drain before it arms, by an arrival before it queues (under the queue lock), and by a
//! refusal or usage move that needs the true figures. While every class is locked no class
//! operation is between its lock and its store, so the wide word's plain figures equal the
//! sums of the class counts there.
//!
//! The race the epoch bits settle: a fast admission reads its class word, then the caps of the
//! epoch it names, then CASes the word. An install in between locks the word and unlocks it
//! with the new epoch's bits, so the CAS fails even when the counts and `RESERVED` are back
//! where they were. Only 2^`EPOCH_BITS` installs within that window could bring the bits back
//! too; the call checks the full epoch after its CAS and, if it moved, recounts every figure
//! from the class counts (the figures are derived, so a recount repairs them; the call stays
//! admitted, as one decided just before the change).
//!
//! Readers of the figures (`stats`, a refusal's snapshot, `is_idle`) take the idle floors out
//! (`in_flight_of`), reading the class words after the word: exact when nothing else runs.
//!
//! Progress: the fast path is a CAS on the class word, retried while it fails because another
//! operation within the class's floors committed first: lock-free while nobody holds the
//! class's lock. It goes to the locked path while the class is locked (a call beyond its
//! floors, a usage report, an abandonment, a writer of every class). Measured (criterion, one
//! thread, 4 classes, budget and floors): about 1.1x the path without classes, against 1.9x
//! for the locked path.

use crossbeam_utils::{Backoff, CachePadded};

use super::state::{EPOCH_MASK, MAX_SLOTS, MAX_TOKENS};
use crate::support::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use crate::vocabulary::admission_class::AdmissionClass;
use crate::vocabulary::error::RequestError;

/// Bits of a class word that count tokens.
const TOKEN_BITS: u32 = 35;
const TOKEN_MASK: u64 = (1 << TOKEN_BITS) - 1;
/// Position of the count of calls in flight.
const SLOT_SHIFT: u32 = TOKEN_BITS;
const SLOT_MASK: u64 = (1 << 16) - 1;
/// One call in flight, in place.
pub(super) const ONE_SLOT: u64 = 1 << SLOT_SHIFT;
/// Position of the low bits of the limits epoch the class word was last unlocked under by a
/// writer of every class (see "Floors reserved").
pub(super) const EPOCH_SHIFT: u32 = SLOT_SHIFT + 16;
/// Set while the class's counts are beyond its floors (more calls or more tokens) under the
/// limits in force: its releases give back shared capacity, so they take the locked path.
/// Written by whoever unlocks the word with new counts or new limits (a guard's
/// [`set`](ClassGuard::set), [`unlock_all`](Classes::unlock_all)), from the floors in force;
/// the operations on the word alone keep it clear (they stay within the floors).
pub(super) const BEYOND: u64 = 1 << 61;
/// Set while the admission word counts the class at its floors at least: its calls within
/// its floors are admitted and released on this word alone.
pub(super) const RESERVED: u64 = 1 << 62;
/// Set while an operation of the class holds the class.
pub(super) const LOCKED: u64 = 1 << 63;

const _: () = assert!(TOKEN_MASK == MAX_TOKENS && SLOT_MASK == MAX_SLOTS as u64);
const _: () = assert!(EPOCH_SHIFT + 10 <= 61 && EPOCH_MASK < 1 << 10);

/// The low bits of `epoch` as a class word carries them.
#[inline]
pub(super) fn epoch_bits(epoch: u64) -> u64 {
    (epoch & EPOCH_MASK) << EPOCH_SHIFT
}

/// A class's live counts, as its word holds them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ClassCounts {
    /// Calls of the class holding a slot.
    pub(crate) slots: u32,
    /// Tokens the class's admissions hold.
    pub(crate) tokens: u64,
}

impl ClassCounts {
    pub(super) fn unpack(word: u64) -> ClassCounts {
        ClassCounts {
            slots: ((word >> SLOT_SHIFT) & SLOT_MASK) as u32,
            tokens: word & TOKEN_MASK,
        }
    }

    fn pack(self) -> u64 {
        debug_assert!(self.slots <= MAX_SLOTS && self.tokens <= MAX_TOKENS);
        (u64::from(self.slots) << SLOT_SHIFT) | self.tokens
    }

    /// The word's [`BEYOND`] bit for these counts against a class's `floors` (its floors of
    /// calls and of tokens, as counts).
    fn beyond_bit(self, floors: ClassCounts) -> u64 {
        if self.slots > floors.slots || self.tokens > floors.tokens {
            BEYOND
        } else {
            0
        }
    }
}

/// The classes of one engine: their ids, order and words.
#[derive(Debug)]
pub(crate) struct Classes {
    /// Each class's word, alone on its cache line.
    words: Box<[CachePadded<AtomicU64>]>,
    /// Each class's handle, in order.
    handles: Box<[AdmissionClass]>,
    /// The class of calls that name none.
    default: AdmissionClass,
    /// Whether the limits in force give some class a floor of calls (so its floors may be
    /// reserved): written with every class locked.
    pub(super) reservable: AtomicU8,
}

impl Classes {
    /// Classes with these ids (validated, distinct), calls naming none going to `default`.
    pub(crate) fn new(ids: &[&str], default: usize) -> Classes {
        let handles: Box<[AdmissionClass]> = ids
            .iter()
            .enumerate()
            .map(|(index, &id)| AdmissionClass::new(id, index as u16))
            .collect();
        Classes {
            words: ids
                .iter()
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
            default: handles[default],
            handles,
            reservable: AtomicU8::new(0),
        }
    }

    /// The classes' handles, in order.
    pub(crate) fn handles(&self) -> &[AdmissionClass] {
        &self.handles
    }

    pub(crate) fn default_class(&self) -> AdmissionClass {
        self.default
    }

    /// The class a call names (`None`: the default), checked to be one of these.
    pub(crate) fn resolve(
        &self,
        class: Option<AdmissionClass>,
    ) -> Result<AdmissionClass, RequestError> {
        match class {
            None => Ok(self.default),
            // Ours iff we have its id at its position (one pointer comparison).
            Some(class) if self.handles.get(usize::from(class.index())) == Some(&class) => {
                Ok(class)
            }
            Some(class) => Err(RequestError::ForeignClass { class }),
        }
    }

    /// The class's counts now (not locked: a statistic).
    pub(crate) fn counts(&self, class: AdmissionClass) -> ClassCounts {
        // Acquire: pairs with the Release store that wrote them.
        ClassCounts::unpack(self.word(class).load(Ordering::Acquire))
    }

    pub(super) fn word(&self, class: AdmissionClass) -> &AtomicU64 {
        &self.words[usize::from(class.index())]
    }

    /// Takes `class`'s lock, waiting (briefly) while another operation of the class holds it.
    #[inline]
    pub(crate) fn lock(&self, class: AdmissionClass) -> ClassGuard<'_> {
        let word = self.word(class);
        let held = take(word);
        ClassGuard {
            word,
            counts: ClassCounts::unpack(held),
            bits: held & (RESERVED | BEYOND | (EPOCH_MASK << EPOCH_SHIFT)),
        }
    }

    /// Takes every class's lock, in class order, until [`unlock_all`](Classes::unlock_all)
    /// (installing limits, switching the reserved floors).
    pub(super) fn lock_all(&self) {
        for word in self.words.iter() {
            take(word);
        }
    }

    /// Class `index`'s counts while every class is locked.
    pub(super) fn locked_counts(&self, index: usize) -> ClassCounts {
        // Relaxed: this thread holds the lock (its Acquire CAS saw the last holder's store).
        ClassCounts::unpack(self.words[index].load(Ordering::Relaxed))
    }

    /// Releases every class [`lock_all`](Classes::lock_all) took, their counts unchanged,
    /// marked with `epoch`'s low bits, reserving their floors where `floors(index)` says so
    /// and [`BEYOND`] where their counts exceed the floors it gives (those of `epoch`, the
    /// limits in force).
    pub(super) fn unlock_all(&self, epoch: u64, floors: impl Fn(usize) -> (bool, ClassCounts)) {
        for (index, word) in self.words.iter().enumerate() {
            let counts = self.locked_counts(index);
            let (reserves, floors) = floors(index);
            let reserved = if reserves { RESERVED } else { 0 };
            // Release: as a guard's drop.
            word.store(
                counts.pack() | epoch_bits(epoch) | reserved | counts.beyond_bit(floors),
                Ordering::Release,
            );
        }
    }

    pub(super) fn len(&self) -> usize {
        self.words.len()
    }
}

/// Sets `word`'s lock bit, waiting (briefly) while another operation of the class holds it;
/// returns the word as it was. (A `fetch_or` would take it in one instruction without the
/// load, but measured no faster, and its spinning waiter is not a model loom can explore: a
/// CAS it is.)
///
/// The wait is crossbeam's `Backoff::snooze` (`crate::support::sync::spin_wait`): exponential
/// spinning on plain loads (127 `spin_loop` hints, a few µs), then `yield_now` at every
/// retry. Yielding sooner measured worse (`benches/class_tail.rs`, 8 threads on one class on
/// 2 cores: yielding after 0 or 3 hints put the locked path's p99.9 at 22 to 60 µs, after 15
/// at 2 to 150 µs, against 1 to 4 µs with this wait): a yield costs a system call and hands
/// the core to another waiter, while a holder that is running leaves within a few hundred
/// nanoseconds. A holder that was descheduled runs again only when its core's scheduler picks
/// it, which spinning longer before yielding (up to about 1.6 ms) did not hasten either.
#[inline]
fn take(word: &AtomicU64) -> u64 {
    let backoff = Backoff::new();
    // Relaxed: only a successful CAS acquires.
    let mut current = word.load(Ordering::Relaxed);
    loop {
        if current & LOCKED == 0 {
            // Acquire: pairs with the Release store of the last holder, so its counts (and the
            // wide-word CAS it made before storing them) are visible.
            match word.compare_exchange_weak(
                current,
                current | LOCKED,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return current,
                Err(actual) => current = actual,
            }
        } else {
            crate::support::sync::spin_wait(&backoff);
            current = word.load(Ordering::Relaxed);
        }
    }
}

/// A held class lock and the class's counts as of taking it. Dropping it releases the lock
/// without changing the counts; [`set`](ClassGuard::set) writes new ones.
#[derive(Debug)]
#[must_use = "dropping a class guard releases the class at once"]
pub(crate) struct ClassGuard<'a> {
    word: &'a AtomicU64,
    counts: ClassCounts,
    /// The word's epoch bits and `RESERVED`, written back as they were, and `BEYOND`, kept
    /// with the counts it was written for.
    bits: u64,
}

impl ClassGuard<'_> {
    pub(crate) fn counts(&self) -> ClassCounts {
        self.counts
    }

    /// Whether the admission word counts this class at its floors at least.
    pub(crate) fn reserved(&self) -> bool {
        self.bits & RESERVED != 0
    }

    /// Writes `counts` and releases the lock; `floors`: the class's floors under the limits
    /// in force (stable while the lock is held), which set [`BEYOND`] for them.
    pub(crate) fn set(mut self, counts: ClassCounts, floors: ClassCounts) {
        self.counts = counts;
        self.bits = (self.bits & !BEYOND) | counts.beyond_bit(floors);
        // Drop stores them.
    }
}

impl Drop for ClassGuard<'_> {
    fn drop(&mut self) {
        // Release: the next holder's Acquire CAS sees these counts and everything this holder
        // did before (its wide-word CAS included).
        self.word
            .store(self.counts.pack() | self.bits, Ordering::Release);
    }
}

/// What a release gives back.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Returned {
    /// The slot and the hold.
    All,
    /// The slot only (abandonment); the hold stays until the release.
    Slot,
    /// The hold of an admission that abandoned its slot earlier.
    Tokens,
}
