//! Admission classes: each class's live counts, the per-class lock, and the class path of every
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
//! Progress: the class path is lock-free across classes and obstruction-free within a class,
//! with a bounded window (a call of a class waits only while another call of the same class is
//! between its lock and its store, a few dozen instructions unless that thread is
//! descheduled). A class without contention pays one CAS and one store more per operation
//! than the path without classes, and its word operations are 128 bits wide: a CAS to admit,
//! and to release (slot and hold together, the common case) one 128-bit `fetch_sub`, which,
//! like the narrow word's, cannot borrow across fields because everything it subtracts is
//! part of the counts it subtracts from (the class's borrowed figures are part of the shared
//! ones while its lock is held).
//!
//! The alternatives lose: a pending-reservation protocol on 64-bit words still needs one extra
//! read-modify-write per operation per word touched and makes every refusal wait for pending
//! reservations of other classes; keeping every class's counts in the one atomic word does not
//! fit (each class needs 51 bits); sharding capacity per class makes refusals on capacity
//! leased to an idle class unexplainable.
//!
//! What it costs, and the one way under it: any protocol that changes a class's counts and the
//! global figures, held in two words, together takes two locked instructions per side against
//! one without classes. `benches/classes.rs` measures those instructions alone
//! (`atomics_floor`) in the same run as both paths, and `benches/README.md` ("Admission
//! classes") what they leave of a 1.5x budget and the design that would need only one: a
//! call within its class's floors decided on its class's word alone, the floors counted in
//! the wide word as if in use.

use crossbeam_utils::{Backoff, CachePadded};

use super::limits::Bounds;
use super::policy::{ClassView, Refusal};
use super::state::{MAX_ABANDONED, MAX_SLOTS, MAX_TOKENS, State};
use super::{Engine, Grant};
use crate::admission_class::{AdmissionClass, Resources};
use crate::error::{RequestError, UsageError};
use crate::sync::atomic::{AtomicU64, Ordering};

/// Bits of a class word that count tokens.
const TOKEN_BITS: u32 = 35;
const TOKEN_MASK: u64 = (1 << TOKEN_BITS) - 1;
/// Position of the count of calls in flight.
const SLOT_SHIFT: u32 = TOKEN_BITS;
const SLOT_MASK: u64 = (1 << 16) - 1;
/// Set while an operation of the class holds the class.
const LOCKED: u64 = 1 << 63;

const _: () = assert!(TOKEN_MASK == MAX_TOKENS && SLOT_MASK == MAX_SLOTS as u64);

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
        ClassCounts::unpack(self.word(class).load(Ordering::Acquire) & !LOCKED)
    }

    fn word(&self, class: AdmissionClass) -> &AtomicU64 {
        &self.words[usize::from(class.index())]
    }

    /// Takes `class`'s lock, waiting (briefly) while another operation of the class holds it.
    /// (A `fetch_or` would take it in one instruction without the load, but measured no
    /// faster, and its spinning waiter is not a model loom can explore: a CAS it is.)
    #[inline]
    pub(crate) fn lock(&self, class: AdmissionClass) -> ClassGuard<'_> {
        let word = self.word(class);
        let backoff = Backoff::new();
        // Relaxed: only a successful CAS acquires.
        let mut current = word.load(Ordering::Relaxed);
        loop {
            if current & LOCKED == 0 {
                // Acquire: pairs with the Release store of the last holder, so its counts
                // (and the wide-word CAS it made before storing them) are visible.
                match word.compare_exchange_weak(
                    current,
                    current | LOCKED,
                    Ordering::Acquire,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        return ClassGuard {
                            word,
                            counts: ClassCounts::unpack(current),
                        };
                    }
                    Err(actual) => current = actual,
                }
            } else {
                crate::sync::spin_wait(&backoff);
                current = word.load(Ordering::Relaxed);
            }
        }
    }

    /// Takes every class's lock, in class order (installing new limits).
    pub(crate) fn lock_all(&self) -> Vec<ClassGuard<'_>> {
        self.handles.iter().map(|&class| self.lock(class)).collect()
    }
}

/// A held class lock and the class's counts as of taking it. Dropping it releases the lock
/// without changing the counts; [`set`](ClassGuard::set) writes new ones.
#[derive(Debug)]
#[must_use = "dropping a class guard releases the class at once"]
pub(crate) struct ClassGuard<'a> {
    word: &'a AtomicU64,
    counts: ClassCounts,
}

impl ClassGuard<'_> {
    pub(crate) fn counts(&self) -> ClassCounts {
        self.counts
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
        self.word.store(self.counts.pack(), Ordering::Release);
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

    /// Admits a class call as a newcomer, or says why not (with what it decided on). On
    /// success the class's counts are written and its lock released; on a refusal the lock is
    /// released unchanged.
    pub(super) fn admit_class_now(
        &self,
        ask: crate::engine::Ask,
    ) -> Result<(u64, Resources), (Refusal, State, Bounds, ClassView)> {
        let class = ask.class.expect("a class call");
        let (guard, bounds, view) = self.lock_class(class);
        let decided =
            self.decide_class(&bounds, &view, |s, b, v| {
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
                Ok(out)
            }
            Err((refusal, state)) => {
                drop(guard);
                Err((refusal, state, bounds, view))
            }
        }
    }

    /// Moves a class admission's hold to `to` tokens: the class's tokens, the tokens in flight
    /// and the shared tokens together. Returns the previous hold.
    pub(super) fn move_class_hold(&self, grant: &mut Grant, to: u64) -> Result<u64, UsageError> {
        let from = grant.held();
        if from == to {
            return Ok(from);
        }
        let class = grant.class().expect("a class admission");
        let (guard, view) = self.lock_class_view(class);
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
        self.state.update(|s| {
            let total = if to >= from {
                s.tokens().checked_add(to - from)
            } else {
                Some(s.tokens() - (from - to))
            };
            let next = total
                .and_then(|t| s.with_tokens(t))
                .ok_or(UsageError::HoldOverflow)?;
            let shared = (i128::from(s.shared_tokens()) + shared_delta) as u64;
            Ok((next.with_shared(s.shared_slots(), shared), ()))
        })?;
        guard.set(ClassCounts {
            slots: view.slots,
            tokens,
        });
        grant.set_held(to);
        Ok(from)
    }

    /// Returns a class admission's slot and hold (a release, the common case): the class's
    /// counts, the word's slot and tokens and the shared figures in one wide `fetch_sub`
    /// ([`AtomicState::release_wide`](super::state::AtomicState::release_wide)), the class
    /// locked meanwhile; then serves the queue and the drainers as a release does.
    /// [`release_class`](Engine::release_class) with [`Returned::All`], specialized: the
    /// release path of every class permit. It decides nothing (an abandonment must check the
    /// abandoned count's room, which takes a CAS loop), so it needs no loop: measured, 807 to
    /// 744 instructions per class admission + release, and about 4 ns, against the CAS loop it
    /// replaced (a load and a `cmpxchg16b`, each a call through `portable-atomic`'s run-time
    /// dispatch on x86-64).
    #[inline]
    pub(super) fn release_class_all(&self, class: AdmissionClass, held: u64) {
        let (guard, view) = self.lock_class_view(class);
        let counts = ClassCounts {
            slots: view.slots - 1,
            tokens: view.tokens - held,
        };
        let shared_slots = view.borrowed_slots(view.slots) - view.borrowed_slots(counts.slots);
        let shared_tokens = view.borrowed_tokens(view.tokens) - view.borrowed_tokens(counts.tokens);
        let (before, after) = self.state.release_wide(held, shared_slots, shared_tokens);
        guard.set(counts);
        if before.needs_attention_on_release() {
            self.after_class_release(before, after);
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
        let shared_slots = view.borrowed_slots(view.slots) - view.borrowed_slots(counts.slots);
        let shared_tokens = view.borrowed_tokens(view.tokens) - view.borrowed_tokens(counts.tokens);
        let updated = self.state.update(|s| {
            let mut next = s;
            if slot == 1 {
                next = next.without_slot();
            }
            next = next
                .with_tokens(s.tokens() - tokens)
                .expect("fewer tokens fit")
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
}
