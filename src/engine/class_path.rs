//! The class path: the engine's operations on a call of an admission class (its admission
//! within its floors on the class word alone, or under the class's lock with the wide CAS; its
//! hold moves, abandonment and release; the recount of the shared figures). The class table
//! and the protocol these follow are in `classes`.

use crossbeam_utils::Backoff;

use super::assembly::Engine;
use super::classes::{
    BEYOND, ClassCounts, ClassGuard, Classes, EPOCH_SHIFT, LOCKED, ONE_SLOT, RESERVED, Returned,
    epoch_bits,
};
use super::grant::Grant;
use super::limits::Bounds;
use super::policy::{ClassView, Refusal};
use super::state::{EPOCH_MASK, MAX_ABANDONED, MAX_SLOTS, MAX_TOKENS, State};
use crate::support::sync::atomic::{AtomicU64, Ordering};
use crate::vocabulary::admission_class::{AdmissionClass, Resources};
use crate::vocabulary::error::UsageError;
use crate::vocabulary::priority::Priority;

/// What one attempt of an admission within its class's floors did.
#[derive(Clone, Copy, Debug)]
enum Attempt {
    /// Admitted, under the limits of this revision.
    Committed(u64),
    /// Nothing changed: the call takes the locked path.
    Locked,
    /// Nothing changed: the CAS lost to another operation within the class's floors.
    Lost,
}

impl Engine {
    /// The classes, when the engine has them.
    #[inline]
    pub(crate) fn classes(&self) -> Option<&Classes> {
        self.classes.as_ref()
    }

    /// The classes of an engine a class operation runs on (built with classes).
    pub(super) fn class_table(&self) -> &Classes {
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
    pub(super) fn lock_class_view(&self, class: AdmissionClass) -> (ClassGuard<'_>, ClassView) {
        let guard = self.class_table().lock(class);
        let view = self.class_view(&guard, class, self.published.epoch());
        (guard, view)
    }

    #[cfg_attr(not(loom), inline(always))]
    pub(super) fn class_view(
        &self,
        guard: &ClassGuard<'_>,
        class: AdmissionClass,
        epoch: u64,
    ) -> ClassView {
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
    /// path without classes does not carry it. Inlined into each class lane whatever their
    /// number (called out of line from `try_acquire`'s general path, its class calls cost 35
    /// instructions more).
    ///
    /// `OUTLINED`: the admission itself ([`admit_within_floors`](Engine::admit_within_floors))
    /// called out of line, for a lane in a large frame (`try_acquire`'s general path), where
    /// inlined it would cost the frame's other paths. `None` on an engine with rate windows
    /// (the general path decides its class calls).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn try_admit_class_fast<const OUTLINED: bool>(
        &self,
        ask: crate::engine::Ask,
    ) -> Option<Grant> {
        if self.windows.is_some() {
            return None;
        }
        let revision = if OUTLINED {
            self.admit_within_floors_outlined(ask)
        } else {
            self.admit_within_floors(ask)
        }?;
        let class = ask.class?;
        // As `grant` (`count_class_admission`) for a call within its floors (it borrowed
        // nothing), in one visit to this thread's shard, inlined here.
        let (index, reserved) = (class.index(), ask.reserved);
        let id = super::local::with(
            &self.counters,
            #[inline(always)]
            move |sink| {
                // The reservation is booked in the class's row only (see `counters`).
                let id = sink.admit(0);
                if reserved > 0 {
                    sink.count_class_with(
                        index,
                        super::ClassCounter::Admitted,
                        (super::ClassCounter::Reserved, reserved),
                    );
                } else {
                    sink.count_class(index, super::ClassCounter::Admitted);
                }
                id
            },
        );
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
        match self.admit_within_floors_looped(ask) {
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
    ///
    /// The first attempt inline, the retries out of line
    /// ([`admit_within_floors_contended`](Engine::admit_within_floors_contended)): a retry
    /// loop here kept its state in registers the common, uncontended call then lacked.
    #[cfg_attr(not(loom), inline(always))]
    pub(super) fn admit_within_floors(&self, ask: crate::engine::Ask) -> Option<u64> {
        let class = ask.class?;
        let word = self.classes.as_ref()?.word(class);
        match self.attempt_within_floors(ask, class, word) {
            Attempt::Committed(revision) => Some(revision),
            Attempt::Locked => None,
            Attempt::Lost => self.admit_within_floors_contended(ask, class, word),
        }
    }

    /// [`admit_within_floors`](Engine::admit_within_floors) as one loop, for the general
    /// path's class decision (`admit_class_now`; the first attempt and the retries apart cost
    /// a windowed `acquire` 15 instructions there, by register allocation).
    #[cfg_attr(not(loom), inline(always))]
    fn admit_within_floors_looped(&self, ask: crate::engine::Ask) -> Option<u64> {
        let class = ask.class?;
        let word = self.classes.as_ref()?.word(class);
        let backoff = Backoff::new();
        loop {
            match self.attempt_within_floors(ask, class, word) {
                Attempt::Committed(revision) => return Some(revision),
                Attempt::Locked => return None,
                Attempt::Lost => backoff.spin(),
            }
        }
    }

    /// [`admit_within_floors`](Engine::admit_within_floors) after its first CAS lost to
    /// another operation within the class's floors: decided again from a fresh read of the
    /// word, after a backoff, until it commits or goes to the locked path.
    #[cold]
    #[inline(never)]
    fn admit_within_floors_contended(
        &self,
        ask: crate::engine::Ask,
        class: AdmissionClass,
        word: &AtomicU64,
    ) -> Option<u64> {
        let backoff = Backoff::new();
        loop {
            backoff.spin();
            match self.attempt_within_floors(ask, class, word) {
                Attempt::Committed(revision) => return Some(revision),
                Attempt::Locked => return None,
                Attempt::Lost => {}
            }
        }
    }

    /// One attempt of [`admit_within_floors`](Engine::admit_within_floors) for `ask`, of
    /// `class`, whose word is `word`: [`Attempt::Locked`] for the locked path,
    /// [`Attempt::Lost`] when its CAS lost (nothing changed either way).
    #[cfg_attr(not(loom), inline(always))]
    fn attempt_within_floors(
        &self,
        ask: crate::engine::Ask,
        class: AdmissionClass,
        word: &AtomicU64,
    ) -> Attempt {
        let Some((current, epoch, floors)) = self.reserved_word(word, class) else {
            return Attempt::Locked;
        };
        let counts = ClassCounts::unpack(current);
        let tokens = counts.tokens.saturating_add(ask.reserved);
        // Within the floors is within the class's ceilings too (a floor is at most its
        // ceiling, see `read_floors`).
        let within = counts.slots < floors.slots && tokens <= floors.tokens;
        // A normal-priority call may use the budget less its high-priority reserve, which the
        // reserved floors do not bound.
        if !within || (ask.priority != Priority::High && self.published.reserve(epoch) > 0) {
            return Attempt::Locked;
        }
        let revision = self.published.revision(epoch);
        if self.commit_within_floors(word, current, current + ONE_SLOT + ask.reserved, epoch) {
            Attempt::Committed(revision)
        } else {
            Attempt::Lost
        }
    }

    /// [`admit_within_floors`](Engine::admit_within_floors), out of line.
    #[inline(never)]
    pub(super) fn admit_within_floors_outlined(&self, ask: crate::engine::Ask) -> Option<u64> {
        self.admit_within_floors(ask)
    }

    /// `class`'s word (`word`) as an admission within its floors may move it alone: its
    /// floors reserved, not locked, and last unlocked under the limits in force. Returns its
    /// value, the epoch and the class's floors under it; `None` sends the admission to the
    /// locked path. (A release within the floors reads no limits: see
    /// [`release_within_floors`](Engine::release_within_floors).)
    #[inline]
    pub(super) fn reserved_word(
        &self,
        word: &AtomicU64,
        class: AdmissionClass,
    ) -> Option<(u64, u64, super::limits::Floors)> {
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
        let floors = self
            .published
            .read_floors(epoch, usize::from(class.index()));
        Some((current, epoch, floors))
    }

    /// Commits an admission within its class's floors decided on `current` under `epoch`:
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
    pub(super) fn commit_within_floors(
        &self,
        word: &AtomicU64,
        current: u64,
        next: u64,
        epoch: u64,
    ) -> bool {
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
    pub(super) fn admit_class_locked(
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
                    guard.set(
                        ClassCounts {
                            slots: view.slots + 1,
                            tokens: view.tokens + ask.reserved,
                        },
                        view.floors(),
                    );
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
                    guard.set(
                        ClassCounts {
                            slots: view.slots,
                            tokens,
                        },
                        view.floors(),
                    );
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
    /// when the release must take the locked path: the class is locked, its floors are not
    /// reserved, or its counts are beyond them ([`BEYOND`]).
    ///
    /// It reads no limits: the word says whether its counts are within the floors in force
    /// (whoever unlocks it with new counts or new limits sets [`BEYOND`] from them, and the
    /// operations on the word alone stay within them), so the CAS checks the decision with
    /// the counts it is made on, whatever limits were installed since the word was read, and
    /// needs no epoch check.
    #[inline]
    pub(super) fn release_within_floors(&self, class: AdmissionClass, held: u64) -> bool {
        let word = self.class_table().word(class);
        // Acquire: as `reserved_word`'s load.
        let current = word.load(Ordering::Acquire);
        match Engine::attempt_release_within_floors(word, current, held) {
            Ok(released) => released,
            Err(actual) => Engine::release_within_floors_contended(word, actual, held),
        }
    }

    /// [`release_within_floors`](Engine::release_within_floors) after its first CAS lost to
    /// another operation within the class's floors (`actual`: the word it found), retried
    /// after a backoff (out of line, as `admit_within_floors_contended`).
    #[cold]
    #[inline(never)]
    fn release_within_floors_contended(word: &AtomicU64, mut actual: u64, held: u64) -> bool {
        let backoff = Backoff::new();
        loop {
            backoff.spin();
            match Engine::attempt_release_within_floors(word, actual, held) {
                Ok(released) => return released,
                Err(found) => actual = found,
            }
        }
    }

    /// One attempt of [`release_within_floors`](Engine::release_within_floors) on the word
    /// read as `current`: `Ok(false)` for the locked path, `Ok(true)` released, `Err` with the
    /// word found when the CAS lost (nothing changed).
    #[cfg_attr(not(loom), inline(always))]
    fn attempt_release_within_floors(
        word: &AtomicU64,
        current: u64,
        held: u64,
    ) -> Result<bool, u64> {
        if current & (LOCKED | RESERVED | BEYOND) != RESERVED {
            return Ok(false);
        }
        debug_assert!(
            {
                let counts = ClassCounts::unpack(current);
                counts.slots > 0 && counts.tokens >= held
            },
            "class count underflow"
        );
        // AcqRel: as `commit_within_floors`; Acquire on failure: the word found is decided on.
        word.compare_exchange(
            current,
            current - ONE_SLOT - held,
            Ordering::AcqRel,
            Ordering::Acquire,
        )
        .map(|_| true)
    }

    /// The locked path of [`release_class_all`](Engine::release_class_all).
    pub(super) fn release_class_locked(&self, class: AdmissionClass, held: u64) {
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
        guard.set(counts, view.floors());
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
    pub(super) fn reserve_floors_again(&self, after: State) {
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
    pub(super) fn after_class_release(&self, before: State, after: State) {
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
        guard.set(counts, view.floors());
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
            let caps = self.published.read_class(epoch, index);
            let reserves = after.floors_reserved() && caps.protected_slots > 0;
            (reserves, super::policy::floors_of(&caps))
        });
    }

    /// `state` with the idle reserved floors taken out of its slots and tokens: the calls and
    /// tokens in flight. Read from the class words and the limits in force after `state`, not
    /// at the same instant: exact when nothing else runs; under concurrency it may count
    /// admissions or releases of other classes made meanwhile (a statistic's or a refusal's
    /// snapshot, never a decision).
    pub(super) fn in_flight_of(&self, state: State) -> State {
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
