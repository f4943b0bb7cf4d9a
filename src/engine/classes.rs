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
//!   63       62         61 .. 51 (low bits)   50 ........... 35   34 ................... 0
//! +--------+----------+---------------------+------------------+------------------------+
//! | LOCKED | RESERVED |  LIMITS EPOCH       |  CALLS (16 bits) |   TOKENS (35 bits)     |
//! +--------+----------+---------------------+------------------+------------------------+
//! ```
//!
//! `RESERVED` says the class's floors are reserved; the epoch bits are those of the limits
//! the word was last unlocked under by a writer of every class. The wide word's
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
//! The race the epoch bits settle: a fast call reads its class word, then the caps of the
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

use super::limits::Bounds;
use super::policy::{ClassView, Refusal};
use super::state::{EPOCH_MASK, MAX_ABANDONED, MAX_SLOTS, MAX_TOKENS, State};
use super::{Engine, Grant};
use crate::support::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use crate::vocabulary::admission_class::{AdmissionClass, Resources};
use crate::vocabulary::error::{RequestError, UsageError};
use crate::vocabulary::priority::Priority;

/// Bits of a class word that count tokens.
const TOKEN_BITS: u32 = 35;
const TOKEN_MASK: u64 = (1 << TOKEN_BITS) - 1;
/// Position of the count of calls in flight.
const SLOT_SHIFT: u32 = TOKEN_BITS;
const SLOT_MASK: u64 = (1 << 16) - 1;
/// One call in flight, in place.
const ONE_SLOT: u64 = 1 << SLOT_SHIFT;
/// Position of the low bits of the limits epoch the class word was last unlocked under by a
/// writer of every class (see "Floors reserved").
const EPOCH_SHIFT: u32 = SLOT_SHIFT + 16;
/// Set while the admission word counts the class at its floors at least: its calls within
/// its floors are admitted and released on this word alone.
const RESERVED: u64 = 1 << 62;
/// Set while an operation of the class holds the class.
const LOCKED: u64 = 1 << 63;

const _: () = assert!(TOKEN_MASK == MAX_TOKENS && SLOT_MASK == MAX_SLOTS as u64);
const _: () = assert!(EPOCH_SHIFT + 11 <= 62 && EPOCH_MASK < 1 << 11);

/// The low bits of `epoch` as a class word carries them.
#[inline]
fn epoch_bits(epoch: u64) -> u64 {
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
    fn unpack(word: u64) -> ClassCounts {
        ClassCounts {
            slots: ((word >> SLOT_SHIFT) & SLOT_MASK) as u32,
            tokens: word & TOKEN_MASK,
        }
    }

    fn pack(self) -> u64 {
        debug_assert!(self.slots <= MAX_SLOTS && self.tokens <= MAX_TOKENS);
        (u64::from(self.slots) << SLOT_SHIFT) | self.tokens
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
    reservable: AtomicU8,
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

    fn word(&self, class: AdmissionClass) -> &AtomicU64 {
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
            bits: held & (RESERVED | (EPOCH_MASK << EPOCH_SHIFT)),
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
    fn locked_counts(&self, index: usize) -> ClassCounts {
        // Relaxed: this thread holds the lock (its Acquire CAS saw the last holder's store).
        ClassCounts::unpack(self.words[index].load(Ordering::Relaxed))
    }

    /// Releases every class [`lock_all`](Classes::lock_all) took, their counts unchanged,
    /// marked with `epoch`'s low bits and reserving their floors where `reserves(index)`.
    fn unlock_all(&self, epoch: u64, reserves: impl Fn(usize) -> bool) {
        for (index, word) in self.words.iter().enumerate() {
            let counts = self.locked_counts(index);
            let reserved = if reserves(index) { RESERVED } else { 0 };
            // Release: as a guard's drop.
            word.store(
                counts.pack() | epoch_bits(epoch) | reserved,
                Ordering::Release,
            );
        }
    }

    fn len(&self) -> usize {
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
    /// The word's epoch bits and `RESERVED`, written back as they were.
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

    /// Writes `counts` and releases the lock.
    pub(crate) fn set(mut self, counts: ClassCounts) {
        self.counts = counts;
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

impl Engine {
    /// The classes, when the engine has them.
    #[inline]
    pub(crate) fn classes(&self) -> Option<&Classes> {
        self.classes.as_ref()
    }

    /// The classes of an engine a class operation runs on (built with classes).
    fn class_table(&self) -> &Classes {
        self.classes
            .as_ref()
            .expect("class operations run on an engine with classes")
    }

    /// Locks `class` and reads what a decision of its calls sees: the limits in force (stable
    /// while any class lock is held) and the class's view.
    #[cfg_attr(not(loom), inline(always))]
    pub(super) fn lock_class(&self, class: AdmissionClass) -> (ClassGuard<'_>, Bounds, ClassView) {
        let guard = self.class_table().lock(class);
        let epoch = self.published.epoch();
        let bounds = self.published.read(epoch);
        let view = self.class_view(&guard, class, epoch);
        (guard, bounds, view)
    }

    /// Locks `class` and reads its view only (what moving its counts needs: its floors).
    #[cfg_attr(not(loom), inline(always))]
    fn lock_class_view(&self, class: AdmissionClass) -> (ClassGuard<'_>, ClassView) {
        let guard = self.class_table().lock(class);
        let view = self.class_view(&guard, class, self.published.epoch());
        (guard, view)
    }

    #[cfg_attr(not(loom), inline(always))]
    fn class_view(&self, guard: &ClassGuard<'_>, class: AdmissionClass, epoch: u64) -> ClassView {
        let counts = guard.counts();
        ClassView {
            class,
            slots: counts.slots,
            tokens: counts.tokens,
            caps: self.published.read_class(epoch, usize::from(class.index())),
            reserved: guard.reserved(),
        }
    }

    /// One class decision, its class locked (`view` read under the lock): `decide` maps the
    /// word to the next (committed with the wide CAS, re-decided from the value a failed CAS
    /// returns) or to a refusal. The limits cannot change meanwhile, so a commit needs no
    /// epoch check and a refusal is consistent with the word it saw.
    #[inline]
    pub(super) fn decide_class<T, U>(
        &self,
        bounds: &Bounds,
        view: &ClassView,
        mut decide: impl FnMut(State, &Bounds, &ClassView) -> Result<(State, T), U>,
    ) -> Result<T, U> {
        self.state.update(|s| decide(s, bounds, view))
    }

    /// The fast lane of a class call: admitted within its class's reserved floors on its
    /// class's word alone ([`admit_within_floors`](Engine::admit_within_floors)), counted, its
    /// id minted; `None` (nothing changed) leaves it to the general path. Out of line: the
    /// path without classes does not carry it.
    #[inline]
    pub(crate) fn try_admit_class_fast(&self, ask: crate::engine::Ask) -> Option<Grant> {
        let revision = self.admit_within_floors(ask)?;
        let class = ask.class?;
        // As `grant` (`count_class_admission`) for a call within its floors (it borrowed
        // nothing), in one visit to this thread's shard, inlined here.
        let (index, reserved) = (class.index(), ask.reserved);
        let id = super::local::with(&self.counters, move |sink| {
            let id = sink.admit(reserved);
            sink.bump_class(index, super::ClassCounter::Admitted, 1);
            if reserved > 0 {
                sink.bump_class(index, super::ClassCounter::Reserved, reserved);
            }
            id
        });
        Some(Grant::new(
            id,
            revision,
            ask.priority,
            reserved,
            ask.class,
            Resources::NONE,
        ))
    }

    /// Admits a class call as a newcomer, or says why not (with what it decided on): within
    /// its class's floors while they are reserved, on its class's word alone
    /// ([`admit_within_floors`](Engine::admit_within_floors)); otherwise under its class's
    /// lock. On success the class's counts are written and its lock released; on a refusal
    /// the lock is released unchanged.
    #[inline]
    pub(super) fn admit_class_now(
        &self,
        ask: crate::engine::Ask,
    ) -> Result<(u64, Resources), (Refusal, State, Bounds, ClassView)> {
        match self.admit_within_floors(ask) {
            Some(revision) => Ok((revision, Resources::NONE)),
            None => self.admit_class_locked(ask),
        }
    }

    /// Admits a class call within its class's floors on its class's word alone, while the
    /// floors are reserved (see "Floors reserved" in the module docs): one CAS, retried while
    /// it fails on another operation within the class's floors (see
    /// [`commit_within_floors`](Engine::commit_within_floors)). `None` when the call must
    /// take the locked path (the floors are not reserved, the class is locked, the call would
    /// go beyond a floor, or it may use less than the whole budget).
    #[inline]
    fn admit_within_floors(&self, ask: crate::engine::Ask) -> Option<u64> {
        let class = ask.class?;
        let word = self.classes.as_ref()?.word(class);
        let backoff = Backoff::new();
        loop {
            let (current, epoch, caps) = self.reserved_word(word, class)?;
            let counts = ClassCounts::unpack(current);
            let tokens = counts.tokens.saturating_add(ask.reserved);
            let within = counts.slots < caps.protected_slots
                && tokens <= caps.protected_tokens
                && caps.max_slots.is_none_or(|max| counts.slots < max)
                && caps.max_tokens.is_none_or(|max| tokens <= max);
            // A normal-priority call may use the budget less its high-priority reserve, which
            // the reserved floors do not bound.
            if !within || (ask.priority != Priority::High && self.published.reserve(epoch) > 0) {
                return None;
            }
            let revision = self.published.revision(epoch);
            if self.commit_within_floors(word, current, current + ONE_SLOT + ask.reserved, epoch) {
                return Some(revision);
            }
            backoff.spin();
        }
    }

    /// `class`'s word (`word`) as an operation within its floors may move it alone: its floors
    /// reserved, not locked, and last unlocked under the limits in force. Returns its value,
    /// the epoch and the class's caps under it; `None` sends the operation to the locked path.
    #[inline]
    fn reserved_word(
        &self,
        word: &AtomicU64,
        class: AdmissionClass,
    ) -> Option<(u64, u64, super::limits::ClassCaps)> {
        // Acquire: pairs with the Release store of the writer that last unlocked the class
        // (its counts, and the limits it published for the epoch in the word's bits).
        let current = word.load(Ordering::Acquire);
        if current & (LOCKED | RESERVED) != RESERVED {
            return None;
        }
        let epoch = self.published.epoch();
        if current & (EPOCH_MASK << EPOCH_SHIFT) != epoch_bits(epoch) {
            return None;
        }
        let caps = self.published.read_class(epoch, usize::from(class.index()));
        Some((current, epoch, caps))
    }

    /// Commits an operation within its class's floors decided on `current` under `epoch`:
    /// one CAS of the class word to `next`. A failure means another operation of the class
    /// moved the word (it made progress) or locked it: the caller decides again from a fresh
    /// read of the word, which sends it to the locked path (serialized with the holder) if
    /// the word is locked or no longer reserved under the limits in force, and otherwise
    /// retries here, as a new call would (a lock-free retry: no lock is taken while only
    /// operations within the floors race). `AcqRel`: acquires as taking the lock would, and
    /// releases the counts (and what the caller did before) to the class's next operation.
    ///
    /// After the commit: if the limits changed as many times as the word's epoch bits wrap
    /// since `epoch` was read (2^10, or 2 under loom), the commit may have used a floor no
    /// longer in force and the shared figures may not be the sums they stand for: every
    /// figure of the admission word is recomputed from the class counts.
    #[inline]
    fn commit_within_floors(&self, word: &AtomicU64, current: u64, next: u64, epoch: u64) -> bool {
        let committed = word
            .compare_exchange(current, next, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok();
        if committed && self.published.epoch() != epoch {
            self.recount_classes(true, |s| s);
        }
        committed
    }

    /// The locked path of [`admit_class_now`](Engine::admit_class_now). A refusal on the
    /// budget or on a slot while the floors are reserved may come from the idle floors the
    /// word counts: the floors stop being reserved and the call is decided again.
    fn admit_class_locked(
        &self,
        ask: crate::engine::Ask,
    ) -> Result<(u64, Resources), (Refusal, State, Bounds, ClassView)> {
        let class = ask.class.expect("a class call");
        loop {
            let (guard, bounds, view) = self.lock_class(class);
            let decided = self.decide_class(&bounds, &view, |s, b, v| {
                match super::policy::admit_class(s, b, v, ask, super::policy::Turn::Newcomer) {
                    Ok((next, borrow)) => Ok((next, (b.revision, borrow))),
                    Err(refusal) => Err((refusal, s)),
                }
            });
            match decided {
                Ok(out) => {
                    guard.set(ClassCounts {
                        slots: view.slots + 1,
                        tokens: view.tokens + ask.reserved,
                    });
                    return Ok(out);
                }
                Err((Refusal::Budget | Refusal::NoSlot, state)) if state.floors_reserved() => {
                    drop(guard);
                    self.recount_classes(false, |s| s);
                }
                Err((refusal, state)) => {
                    drop(guard);
                    return Err((refusal, state, bounds, view));
                }
            }
        }
    }

    /// Moves a class admission's hold to `to` tokens: the class's tokens, the tokens in flight
    /// and the shared tokens together. Returns the previous hold. A move that would take the
    /// shared tokens past their capacity while the floors are reserved (a usage report above
    /// the reservation) first stops reserving them.
    pub(super) fn move_class_hold(&self, grant: &mut Grant, to: u64) -> Result<u64, UsageError> {
        enum Refused {
            Overflow,
            Reserved,
        }
        let from = grant.held();
        if from == to {
            return Ok(from);
        }
        let class = grant.class().expect("a class admission");
        loop {
            let (guard, bounds, view) = self.lock_class(class);
            let tokens = if to >= from {
                view.tokens.checked_add(to - from)
            } else {
                Some(view.tokens - (from - to))
            };
            let tokens = tokens
                .filter(|&t| t <= MAX_TOKENS)
                .ok_or(UsageError::HoldOverflow)?;
            let shared_delta = i128::from(view.borrowed_tokens(tokens))
                - i128::from(view.borrowed_tokens(view.tokens));
            let counted_delta = i128::from(view.counted(view.slots, tokens).1)
                - i128::from(view.counted(view.slots, view.tokens).1);
            let moved = self.state.update(|s| {
                let total = i128::from(s.tokens()) + counted_delta;
                let shared = (i128::from(s.shared_tokens()) + shared_delta) as u64;
                let refused = if s.floors_reserved() {
                    Refused::Reserved
                } else {
                    Refused::Overflow
                };
                let next = u64::try_from(total)
                    .ok()
                    .and_then(|t| s.with_tokens(t))
                    .ok_or(refused)?;
                if s.floors_reserved()
                    && bounds
                        .token_budget
                        .is_some_and(|b| shared + bounds.protected_tokens > b.budget)
                {
                    return Err(Refused::Reserved);
                }
                Ok((next.with_shared(s.shared_slots(), shared), ()))
            });
            match moved {
                Ok(()) => {
                    guard.set(ClassCounts {
                        slots: view.slots,
                        tokens,
                    });
                    grant.set_held(to);
                    return Ok(from);
                }
                Err(Refused::Overflow) => return Err(UsageError::HoldOverflow),
                Err(Refused::Reserved) => {
                    drop(guard);
                    self.recount_classes(false, |s| s);
                }
            }
        }
    }

    /// Returns a class admission's slot and hold (a release, the common case): within its
    /// class's floors while they are reserved, on the class's word alone
    /// ([`release_within_floors`](Engine::release_within_floors)); otherwise the class's
    /// counts, the word's slot and tokens and the shared figures in one wide `fetch_sub`
    /// ([`AtomicState::release_wide`](super::state::AtomicState::release_wide)), the class
    /// locked meanwhile; then serves the queue and the drainers as a release does.
    /// [`release_class`](Engine::release_class) with [`Returned::All`], specialized: the
    /// release path of every class permit. It decides nothing (an abandonment must check the
    /// abandoned count's room, which takes a CAS loop), so it needs no loop.
    #[inline]
    pub(super) fn release_class_all(&self, class: AdmissionClass, held: u64) {
        if !self.release_within_floors(class, held) {
            self.release_class_locked(class, held);
        }
    }

    /// Releases a class admission within its class's floors on its class's word alone, while
    /// the floors are reserved: one CAS, retried as
    /// [`admit_within_floors`](Engine::admit_within_floors) retries. `false` (nothing done)
    /// when the release must take the locked path.
    #[inline]
    fn release_within_floors(&self, class: AdmissionClass, held: u64) -> bool {
        let word = self.class_table().word(class);
        let backoff = Backoff::new();
        loop {
            let Some((current, epoch, caps)) = self.reserved_word(word, class) else {
                return false;
            };
            let counts = ClassCounts::unpack(current);
            debug_assert!(
                counts.slots > 0 && counts.tokens >= held,
                "class count underflow"
            );
            if counts.slots > caps.protected_slots || counts.tokens > caps.protected_tokens {
                return false;
            }
            if self.commit_within_floors(word, current, current - ONE_SLOT - held, epoch) {
                return true;
            }
            backoff.spin();
        }
    }

    /// The locked path of [`release_class_all`](Engine::release_class_all).
    fn release_class_locked(&self, class: AdmissionClass, held: u64) {
        let (guard, view) = self.lock_class_view(class);
        let counts = ClassCounts {
            slots: view.slots - 1,
            tokens: view.tokens - held,
        };
        let (counted_slots, counted_tokens) = view.counted(view.slots, view.tokens);
        let (after_slots, after_tokens) = view.counted(counts.slots, counts.tokens);
        let shared_slots = view.borrowed_slots(view.slots) - view.borrowed_slots(counts.slots);
        let shared_tokens = view.borrowed_tokens(view.tokens) - view.borrowed_tokens(counts.tokens);
        let (before, after) = self.state.release_wide(
            counted_slots - after_slots,
            counted_tokens - after_tokens,
            shared_slots,
            shared_tokens,
        );
        guard.set(counts);
        if before.needs_attention_on_release() {
            self.after_class_release(before, after);
        }
        // Relaxed: a hint; whether the floors may be reserved is decided with every class
        // locked.
        if !after.floors_reserved() && self.class_table().reservable.load(Ordering::Relaxed) != 0 {
            self.reserve_floors_again(after);
        }
    }

    /// After a release while the floors are not reserved on an engine whose limits allow it:
    /// reserves them again once the shared pool has room to spare (at most half its capacity
    /// of slots and of tokens borrowed), so that an engine that released them at a limit (a
    /// refusal on the budget, a usage report above it) does not take them back at the next
    /// release and give them up at the next refusal.
    #[inline(never)]
    fn reserve_floors_again(&self, after: State) {
        let bounds = self.published.read(self.published.epoch());
        let slots = bounds
            .max_concurrent
            .saturating_sub(bounds.protected_concurrent);
        let spare = after.shared_slots() <= slots / 2
            && bounds.token_budget.is_none_or(|b| {
                after.shared_tokens() <= b.budget.saturating_sub(bounds.protected_tokens) / 2
            });
        if spare && floors_may_be_reserved(after, &bounds) {
            self.recount_classes(true, |s| s);
        }
    }

    /// What a class release that saw waiters or a drainer does after its CAS: serves the
    /// queue, or tells the drainers if the state it wrote (`after`) was idle.
    #[cold]
    fn after_class_release(&self, before: State, after: State) {
        if before.has_waiters() {
            self.pump();
        }
        self.idle_check(after);
    }

    /// Returns what a class admission gives back (see [`Returned`]), moving the shared
    /// figures with the class's counts; then serves the queue and the drainers as a release
    /// does. `false` when an abandonment could not be counted (at most [`MAX_ABANDONED`]
    /// admissions may have abandoned their slot without settling at once).
    pub(super) fn release_class(
        &self,
        class: AdmissionClass,
        held: u64,
        returned: Returned,
    ) -> bool {
        let (guard, view) = self.lock_class_view(class);
        let (slot, tokens) = match returned {
            Returned::All => (1, held),
            Returned::Slot => (1, 0),
            Returned::Tokens => (0, held),
        };
        let counts = ClassCounts {
            slots: view.slots - slot,
            tokens: view.tokens - tokens,
        };
        let (counted_slots, counted_tokens) = view.counted(view.slots, view.tokens);
        let (after_slots, after_tokens) = view.counted(counts.slots, counts.tokens);
        let shared_slots = view.borrowed_slots(view.slots) - view.borrowed_slots(counts.slots);
        let shared_tokens = view.borrowed_tokens(view.tokens) - view.borrowed_tokens(counts.tokens);
        let updated = self.state.update(|s| {
            let mut next = s
                .with_counts(
                    s.slots() - (counted_slots - after_slots),
                    s.tokens() - (counted_tokens - after_tokens),
                )
                .with_shared(
                    s.shared_slots() - shared_slots,
                    s.shared_tokens() - shared_tokens,
                );
            match returned {
                Returned::All => {}
                Returned::Slot => {
                    if s.abandoned() >= MAX_ABANDONED {
                        return Err(());
                    }
                    next = next.with_abandoned(s.abandoned() + 1);
                }
                Returned::Tokens => next = next.with_abandoned(s.abandoned() - 1),
            }
            Ok((next, (s, next)))
        });
        let Ok((before, after)) = updated else {
            drop(guard);
            return false;
        };
        guard.set(counts);
        if before.has_waiters() && slot == 1 {
            self.pump();
        }
        self.idle_check(after);
        true
    }
    // ----- reserved floors -----

    /// Locks every class, rewrites the admission word's figures from the class counts under
    /// the limits in force ([`recount`](Engine::recount)), reserving the floors if `reserve`
    /// and they may be, with `also` applied in the same CAS; unlocks. Returns the word before
    /// and after. Without reserved floors and with `reserve` false it changes only what
    /// `also` does (the figures it writes are the ones already there).
    pub(super) fn recount_classes(
        &self,
        reserve: bool,
        also: impl Fn(State) -> State,
    ) -> (State, State) {
        let classes = self.class_table();
        classes.lock_all();
        // Stable: a limits writer takes every class's lock before it publishes.
        let epoch = self.published.epoch();
        let (before, after) = self.recount(epoch, reserve, also);
        self.unlock_classes(epoch, after);
        (before, after)
    }

    /// Stops reserving the classes' floors, if they are (one load when they are not).
    pub(super) fn release_floors(&self) {
        if self.state.load().floors_reserved() {
            self.recount_classes(false, |s| s);
        }
    }

    /// With every class locked ([`Classes::lock_all`]): rewrites the admission word's slots,
    /// tokens and shared figures from the class counts under the limits published for
    /// `epoch`, `also` applied first. The floors are reserved if `reserve` and
    /// [`floors_may_be_reserved`] allows it on the word written. Returns the word before and
    /// after.
    pub(super) fn recount(
        &self,
        epoch: u64,
        reserve: bool,
        also: impl Fn(State) -> State,
    ) -> (State, State) {
        let classes = self.class_table();
        let bounds = self.published.read(epoch);
        let (mut slots, mut tokens) = (0u32, 0u64);
        let (mut shared_slots, mut shared_tokens) = (0u32, 0u64);
        let (mut idle_slots, mut idle_tokens) = (0u32, 0u64);
        for index in 0..classes.len() {
            let counts = classes.locked_counts(index);
            let caps = self.published.read_class(epoch, index);
            slots += counts.slots;
            tokens += counts.tokens;
            shared_slots += counts.slots.saturating_sub(caps.protected_slots);
            shared_tokens += counts.tokens.saturating_sub(caps.protected_tokens);
            if caps.protected_slots > 0 {
                idle_slots += caps.protected_slots.saturating_sub(counts.slots);
                idle_tokens += caps.protected_tokens.saturating_sub(counts.tokens);
            }
        }
        // Relaxed: read as a hint (see `release_class_locked`); written under every lock.
        classes
            .reservable
            .store(u8::from(bounds.protected_concurrent > 0), Ordering::Relaxed);
        let mut before = State::INITIAL;
        let after = self.state.modify(|s| {
            before = s;
            debug_assert!(
                s.floors_reserved() || (s.slots(), s.tokens()) == (slots, tokens),
                "the word counts exactly what the classes hold"
            );
            let next = also(s).with_shared(shared_slots, shared_tokens);
            let reserved = reserve
                && floors_may_be_reserved(next, &bounds)
                && slots + idle_slots <= MAX_SLOTS
                && tokens + idle_tokens <= MAX_TOKENS;
            let next = if reserved {
                next.with_counts(slots + idle_slots, tokens + idle_tokens)
            } else {
                next.with_counts(slots, tokens)
            };
            next.with_floors_reserved(reserved)
        });
        (before, after)
    }

    /// Unlocks every class after [`recount`](Engine::recount) wrote `after` under `epoch`'s
    /// limits: the classes with a floor of calls reserve their floors iff `after` says so.
    pub(super) fn unlock_classes(&self, epoch: u64, after: State) {
        self.class_table().unlock_all(epoch, |index| {
            after.floors_reserved() && self.published.read_class(epoch, index).protected_slots > 0
        });
    }

    /// `state` with the idle reserved floors taken out of its slots and tokens: the calls and
    /// tokens in flight. Read from the class words and the limits in force after `state`, not
    /// at the same instant: exact when nothing else runs; under concurrency it may count
    /// admissions or releases of other classes made meanwhile (a statistic's or a refusal's
    /// snapshot, never a decision).
    pub(crate) fn in_flight_of(&self, state: State) -> State {
        let Some(classes) = self.classes.as_ref().filter(|_| state.floors_reserved()) else {
            return state;
        };
        let epoch = self.published.epoch();
        let (mut slots, mut tokens) = (state.slots(), state.tokens());
        for (index, &class) in classes.handles().iter().enumerate() {
            let caps = self.published.read_class(epoch, index);
            if caps.protected_slots > 0 {
                let counts = classes.counts(class);
                slots = slots.saturating_sub(caps.protected_slots.saturating_sub(counts.slots));
                tokens = tokens.saturating_sub(caps.protected_tokens.saturating_sub(counts.tokens));
            }
        }
        state.with_counts(slots, tokens).with_floors_reserved(false)
    }
}

/// Whether the word `state` (written under `bounds`) may count the classes at their floors:
/// open, nobody waiting, no drain waiting, some class with a floor of calls, and the shared
/// figures within their capacities, which every borrowing admission keeps them in (so a call
/// within its class's floors fits every global limit, see "Floors reserved").
fn floors_may_be_reserved(state: State, bounds: &Bounds) -> bool {
    !state.is_closed()
        && !state.has_waiters()
        && !state.is_draining()
        && bounds.protected_concurrent > 0
        && state.shared_slots() + bounds.protected_concurrent <= bounds.max_concurrent
        && bounds
            .token_budget
            .is_none_or(|b| state.shared_tokens() + bounds.protected_tokens <= b.budget)
}
