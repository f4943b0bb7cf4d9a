//! The admission engine: a hard cap on slots and tokens in flight, decided by one lock-free
//! compare-and-swap per admission (a class call beyond its floors takes its class's lock, see
//! `classes`), with a strictly FIFO wait queue, versioned limits, close and drain. It knows
//! nothing of requests, estimators or events: a call asks for a number of tokens at a priority
//! ([`Ask`]) and gets a [`Grant`], a [`Rejection`] or a place in the queue.
//!
//! Everything above it (the LLM wing in `crate::llm`, and whatever bulkhead is built next) goes
//! through [`Engine`]'s methods; its fields are private to this folder.
//!
//! - `state`: the packed admission word (slots, tokens, epoch bits, flags; 128 bits with
//!   admission classes).
//! - `limits`: the public [`Limits`] snapshot, its validation, and the double-buffered copy that
//!   admissions read without a lock; `reconfigure`: `apply_limits`, `set_budget`, `close`.
//! - `policy`: the decision as a pure function of (word, limits, ask).
//! - `classes`: admission classes (class words, their locks, the class path).
//! - `queue`, `fifo` and `waiting`: the wait queue's data, its slab list, and the engine's
//!   methods that arrive, hand off, withdraw and refuse.
//! - `grant`: what the engine records of one admission.
//! - `counters` and `local`: cumulative counters in per-thread shards; admission ids;
//!   `figures`: what a statistics snapshot reads.
//! - `timer`: the process-wide timer behind queue timeouts, bounded drains and run deadlines.
//! - `drain`: waiting for quiescence.
//!
//! # How a decision is made
//!
//! [`Engine::decide`] reads the word and the limits published for its epoch, decides with a pure
//! function and commits with one CAS; a change of limits advances the epoch bits, so a decision
//! made under old limits fails its CAS and is made again (`limits` explains the protocol and the
//! one case the bits cannot settle). A release is one `fetch_sub` and serves the queue or the
//! drainers only when the word says someone waits.

pub(crate) mod classes;
mod counters;
pub(crate) mod drain;
mod fifo;
mod figures;
mod grant;
pub(crate) mod limits;
mod local;
pub(crate) mod permit;
pub(crate) mod policy;
mod pool;
mod queue;
mod reconfigure;
mod state;
pub(crate) mod timer;
mod waiting;

use core::fmt;

use crossbeam_utils::Backoff;

use crate::support::sync::atomic::{AtomicU64, Ordering};
use crate::support::sync::{Mutex, lock};
use crate::vocabulary::admission_class::{AbandonCause, AdmissionClass, Resources};
use crate::vocabulary::error::UsageError;
use crate::vocabulary::rejection::{CapacityDetail, Constraint, RejectReason, Rejection};

use crate::vocabulary::limits::Limits;
use crate::vocabulary::verdict::Verdict;
use classes::{Classes, Returned};
use counters::Hub;
pub(crate) use counters::{ClassCounter, Counter};
pub(crate) use figures::{ClassFigures, ClassesFigures, Figures};
pub(crate) use grant::Grant;
use limits::{Bounds, PublishedLimits};
pub(crate) use policy::Ask;
use policy::{ClassView, Refusal, Turn};
pub(crate) use pool::WaiterHandle;
use queue::{Arrival, WaitQueue};
use reconfigure::normalized;
use state::{AtomicState, EPOCH_BITS, State};

/// How a call that finds no free slot waits for one (a call that may not wait goes through
/// [`Engine::try_admit`] instead).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Wait<'w> {
    /// In the queue, woken through this waker (the polling task's): it is registered in the
    /// waiter before the waiter is queued, so every hand-off after the arrival wakes it and
    /// the arriving poll may return `Pending` without registering and checking again.
    Async(&'w core::task::Waker),
    /// In the queue, as a parked thread.
    Blocking,
}

/// What [`Engine::admit`] decided.
#[derive(Debug)]
pub(crate) enum Decision {
    /// Admitted now (counted, with its id).
    Admitted(Grant),
    /// Refused now (counted).
    Refused(Rejection),
    /// Waiting in the queue: its outcome comes through the waiter.
    Queued(WaiterHandle),
}

/// The engine shared by every clone of a bulkhead and every permit.
pub(crate) struct Engine {
    /// The packed admission word (written by every admission and release; cache-padded).
    state: AtomicState,
    /// The limits in force, readable without a lock (see `limits`).
    published: PublishedLimits,
    /// Serialises limit writers and holds the authoritative copy of the limits in force.
    writer: Mutex<Limits>,
    /// Calls waiting for a slot, in arrival order (see `queue`).
    queue: WaitQueue,
    /// Notified when the engine becomes idle while a drain waits (see `drain`).
    drained: event_listener::Event,
    /// Counts those notifications, so a woken drainer knows an idle moment happened.
    idle_generation: AtomicU64,
    /// Cumulative counters, sharded per thread.
    counters: Hub,
    /// Whether the limits carry a token budget (fixed at construction).
    has_budget: bool,
    /// The admission classes, when the engine has them (fixed at construction).
    classes: Option<Classes>,
    /// Neither a token budget nor classes (fixed at construction): see `passes_slots`.
    passes_slots: bool,
}

impl Engine {
    /// An engine enforcing `limits` (already validated; with admission classes iff
    /// `limits.admission_classes`, calls naming none going to class `default_class`), with
    /// nothing in flight.
    pub(crate) fn new(limits: Limits, default_class: usize) -> Engine {
        let limits = normalized(limits, None);
        let classes = limits.admission_classes.as_ref().map(|table| {
            let ids: Vec<&str> = table.iter().map(|(id, _)| id).collect();
            Classes::new(&ids, default_class)
        });
        let class_count = classes.as_ref().map_or(0, |c| c.handles().len());
        let has_budget = limits.token_budget.is_some();
        let engine = Engine {
            state: if classes.is_some() {
                AtomicState::wide()
            } else {
                AtomicState::narrow()
            },
            published: PublishedLimits::new(&limits),
            has_budget,
            writer: Mutex::new(limits),
            queue: WaitQueue::new(),
            drained: event_listener::Event::new(),
            idle_generation: AtomicU64::new(0),
            counters: Hub::new(class_count),
            passes_slots: !has_budget && classes.is_none(),
            classes,
        };
        if engine.classes.is_some() {
            // Nothing in flight: the floors are reserved from the start if any class has one.
            engine.recount_classes(true, |s| s);
        }
        engine
    }

    /// Whether the limits carry a token budget.
    #[inline]
    pub(crate) fn has_budget(&self) -> bool {
        self.has_budget
    }

    /// Whether a release may pass its slot straight to the queue head (`pass_slot`): an
    /// engine without a token budget or classes, where a slot is all a waiter needs.
    #[inline]
    fn passes_slots(&self) -> bool {
        self.passes_slots
    }

    /// Whether admissions may take the fast lane ([`try_admit_fast`](Engine::try_admit_fast)):
    /// an engine without admission classes.
    #[inline]
    pub(crate) fn has_fast_lane(&self) -> bool {
        self.classes.is_none()
    }

    // ----- admission -----

    /// The front door of every admission that may wait: admits `ask` now, refuses it now, or
    /// (when only a slot is missing and the queue has room) queues it. Admissions and
    /// refusals are counted. A call that may not wait goes through
    /// [`try_admit`](Engine::try_admit).
    ///
    /// A call of an admission class goes through [`admit_class`](Engine::admit_class): the
    /// caller dispatches, so that this path stays exactly what it was before classes (a
    /// branch here costs the path without classes its in-place construction of the result).
    #[inline]
    pub(crate) fn admit(&self, ask: Ask, wait: Wait<'_>) -> Decision {
        debug_assert!(ask.class.is_none(), "a class call goes through admit_class");
        match self.admit_now(ask) {
            Ok(revision) => Decision::Admitted(self.grant(ask, revision, Resources::NONE)),
            Err(refused) => self.queue_or_refuse(ask, wait, refused),
        }
    }

    /// [`admit`](Engine::admit), handing a grant made now to `admitted` so that the caller's
    /// result is built in place (the first poll of an acquire future: an intermediate
    /// [`Decision`] would be copied through every frame, and a copy read right after the
    /// writes that made it stalls store forwarding); anything else (refused, queued) is
    /// returned as the decision.
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn admit_in_place<T>(
        &self,
        ask: Ask,
        wait: Wait<'_>,
        admitted: impl FnOnce(Grant) -> T,
    ) -> Result<T, Decision> {
        debug_assert!(ask.class.is_none(), "a class call goes through admit_class");
        match self.admit_now(ask) {
            Ok(revision) => Ok(admitted(self.grant(ask, revision, Resources::NONE))),
            Err(refused) => Err(self.queue_or_refuse(ask, wait, refused)),
        }
    }

    /// What [`admit`](Engine::admit) does with a call the word refused: queue it (decided
    /// again under the queue lock) if only a slot is missing and it may wait, else refuse it.
    #[cold]
    fn queue_or_refuse(
        &self,
        ask: Ask,
        wait: Wait<'_>,
        refused: (Refusal, State, Bounds),
    ) -> Decision {
        match refused {
            (Refusal::NoSlot, state, bounds) => {
                // The limits alone can refuse without the queue lock; the queue length cannot.
                match (wait, policy::queue_or_refuse(&bounds, 0)) {
                    (wait, Ok(())) => self.arrive_or_refuse(ask, wait),
                    (_, may_queue) => {
                        let reason = may_queue.err().unwrap_or(RejectReason::ConcurrencyLimit);
                        Decision::Refused(self.reject_global(reason, state, &bounds, ask))
                    }
                }
            }
            (refusal, state, bounds) => {
                Decision::Refused(self.reject_global(refusal.reason(), state, &bounds, ask))
            }
        }
    }

    /// Admits `ask` (without a class) now or refuses it now: [`admit`](Engine::admit) with
    /// a call that may not wait, handing the grant to `admitted` or the rejection to `refused`, so
    /// that the caller's result is built in place (`try_acquire`'s fast path: an intermediate
    /// result would be copied at every layer).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn try_admit<T, E>(
        &self,
        ask: Ask,
        admitted: impl FnOnce(Grant) -> T,
        refused: impl FnOnce(Rejection) -> E,
    ) -> Result<T, E> {
        debug_assert!(
            ask.class.is_none(),
            "a class call goes through try_admit_class"
        );
        match self.admit_now(ask) {
            Ok(revision) => Ok(admitted(self.grant(ask, revision, Resources::NONE))),
            Err((refusal, state, bounds)) => {
                let reason = match refusal {
                    // Never queued: a missing slot is `concurrency_limit`, or the limits' own
                    // reason (a queue of 0 behind `max_concurrent` 0).
                    Refusal::NoSlot => policy::queue_or_refuse(&bounds, 0)
                        .err()
                        .unwrap_or(RejectReason::ConcurrencyLimit),
                    refusal => refusal.reason(),
                };
                Err(refused(self.reject_global(reason, state, &bounds, ask)))
            }
        }
    }

    /// [`try_admit`](Engine::try_admit) for a call of an admission class.
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn try_admit_class<T, E>(
        &self,
        ask: Ask,
        admitted: impl FnOnce(Grant) -> T,
        refused: impl FnOnce(Rejection) -> E,
    ) -> Result<T, E> {
        match self.admit_class_now(ask) {
            Ok((revision, borrowed)) => Ok(admitted(self.grant(ask, revision, borrowed))),
            Err(refusal) => Err(refused(self.refuse_class_now(ask, refusal))),
        }
    }

    /// The rejection of a class call refused now (never queued).
    #[cold]
    fn refuse_class_now(
        &self,
        ask: Ask,
        refusal: (Refusal, State, Bounds, ClassView),
    ) -> Rejection {
        let (refusal, state, bounds, view) = refusal;
        let (reason, constraint) = match refusal {
            Refusal::NoSlot => (
                policy::queue_or_refuse(&bounds, 0)
                    .err()
                    .unwrap_or(RejectReason::ConcurrencyLimit),
                Some(Constraint::Global),
            ),
            refusal => (refusal.reason(), refusal.constraint()),
        };
        self.reject(reason, constraint, &Seen::class(state, bounds, view), ask)
    }

    /// [`admit`](Engine::admit) for a call of an admission class (see `classes`).
    pub(crate) fn admit_class(&self, ask: Ask, wait: Wait<'_>) -> Decision {
        match self.admit_class_now(ask) {
            Ok((revision, borrowed)) => Decision::Admitted(self.grant(ask, revision, borrowed)),
            Err((Refusal::NoSlot, state, bounds, view)) => {
                match (wait, policy::queue_or_refuse(&bounds, 0)) {
                    (wait, Ok(())) => self.arrive_or_refuse(ask, wait),
                    (_, may_queue) => {
                        let reason = may_queue.err().unwrap_or(RejectReason::ConcurrencyLimit);
                        let seen = Seen::class(state, bounds, view);
                        Decision::Refused(self.reject(reason, Some(Constraint::Global), &seen, ask))
                    }
                }
            }
            Err((refusal, state, bounds, view)) => {
                let seen = Seen::class(state, bounds, view);
                Decision::Refused(self.reject(refusal.reason(), refusal.constraint(), &seen, ask))
            }
        }
    }

    /// A call that found no free slot and may queue: decided again under the queue lock.
    fn arrive_or_refuse(&self, ask: Ask, wait: Wait<'_>) -> Decision {
        match self.arrive(ask, wait) {
            Arrival::Admitted { revision, borrowed } => {
                Decision::Admitted(self.grant(ask, revision, borrowed))
            }
            Arrival::Queued(waiter) => Decision::Queued(WaiterHandle::new(waiter)),
            Arrival::Refused(rejection) => Decision::Refused(rejection),
        }
    }

    /// Counts an admission of `ask` under `revision`, which borrowed `borrowed` from the
    /// shared pool, and mints its id: the grant of a decision that committed (now, or by a
    /// hand-off the waiter picked up).
    #[inline]
    pub(crate) fn grant(&self, ask: Ask, revision: u64, borrowed: Resources) -> Grant {
        let id = match ask.class {
            None => local::with(&self.counters, move |sink| sink.admit(ask.reserved)),
            Some(class) => self.count_class_admission(class, ask.reserved, borrowed),
        };
        Grant::new(
            id,
            revision,
            ask.priority,
            ask.reserved,
            ask.class,
            borrowed,
        )
    }

    /// Counts an admission of `class` and mints its id, in one counter lookup (apart from
    /// [`grant`](Engine::grant)'s path without classes, which it would otherwise weigh down:
    /// measured, not guessed).
    #[inline(never)]
    fn count_class_admission(
        &self,
        class: AdmissionClass,
        reserved: u64,
        borrowed: Resources,
    ) -> crate::vocabulary::admission_id::IdParts {
        let class = class.index();
        local::with(&self.counters, move |sink| {
            let id = sink.admit(reserved);
            sink.bump_class(class, ClassCounter::Admitted, 1);
            if reserved > 0 {
                sink.bump_class(class, ClassCounter::Reserved, reserved);
            }
            if borrowed.borrowed_concurrency {
                sink.bump_class(class, ClassCounter::BorrowedAdmissions, 1);
            }
            if borrowed.borrowed_tokens > 0 {
                sink.bump_class(
                    class,
                    ClassCounter::BorrowedTokensReserved,
                    borrowed.borrowed_tokens,
                );
            }
            id
        })
    }

    /// The fast lane of an admission without a class: the common case decided on the narrow
    /// word and the three figures it needs (`max_concurrent`, the priority's budget, the
    /// revision), committed with one CAS, counted, its id minted. `None`, with nothing changed or
    /// everything undone, leaves the call to the general path ([`admit_now`](Engine::admit_now))
    /// whenever anything is unusual: a flag set (closed, waiters, draining), a limit change
    /// under way, no slot or tokens (the general path refuses, with the reason and the
    /// snapshot), a CAS lost to another call.
    ///
    /// It admits only what [`policy::admit`] admits for a newcomer, with the same next word
    /// (no flag, so neither closed nor behind waiters; a free slot; the tokens within the
    /// priority's budget and `MAX_TOKENS`), and follows [`decide`](Engine::decide)'s protocol
    /// with the limits: the epoch read before and after the word, the word carrying that
    /// epoch's bits (so a limits slot overwritten while it is read fails the CAS), and the
    /// epoch checked again after the CAS.
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn try_admit_fast(&self, ask: Ask) -> Option<Grant> {
        debug_assert!(ask.class.is_none(), "a class call goes through its class");
        if !self.has_fast_lane() {
            return None;
        }
        let revision = self.admit_fast(ask)?;
        // As `grant` for a call without a class, inlined here whatever `grant`'s other callers.
        let id = local::with(&self.counters, move |sink| sink.admit(ask.reserved));
        Some(Grant::new(
            id,
            revision,
            ask.priority,
            ask.reserved,
            None,
            Resources::NONE,
        ))
    }

    /// The decision of [`try_admit_fast`](Engine::try_admit_fast): its revision.
    #[cfg_attr(not(loom), inline(always))]
    fn admit_fast(&self, ask: Ask) -> Option<u64> {
        let word = self.state.narrow_word();
        let epoch = self.published.epoch();
        // Acquire: as `AtomicState::load`.
        let current = State::narrow(word.load(Ordering::Acquire));
        // The word carries the bits of the epoch read before it: the limits of that epoch are
        // the ones in force for it. (A writer advances the word's epoch bits before it
        // publishes the epoch, and overwrites this epoch's limits slot only for the epoch
        // after next: by then the word's bits have moved and the CAS below fails. The one
        // case the bits cannot tell, a full wrap of them, is checked after the CAS.) So,
        // unlike `decide`, no second read of the epoch: a word one epoch ahead of it is left
        // to the general path.
        if current.has_flags() || !current.matches_epoch(epoch) {
            return None;
        }
        let (revision, max_concurrent, budget) = self.published.read_fast(epoch, ask.priority);
        if current.slots() >= max_concurrent || ask.reserved > state::MAX_TOKENS {
            return None;
        }
        // Both at most `MAX_TOKENS` (2^35 - 1): no overflow.
        let tokens = current.tokens() + ask.reserved;
        if tokens > budget || tokens > state::MAX_TOKENS {
            return None;
        }
        let next = current.with_admission(ask.reserved);
        // AcqRel / Acquire: as `AtomicState::compare_exchange`.
        word.compare_exchange_weak(current.lo(), next.lo(), Ordering::AcqRel, Ordering::Acquire)
            .ok()?;
        let after = self.published.epoch();
        if (after as i64).wrapping_sub(epoch as i64) >= (1 << EPOCH_BITS) - 1 {
            // As in `decide`: a commit the word's epoch bits cannot vouch for is undone.
            self.undo_commit(current, next, false);
            return None;
        }
        Some(revision)
    }

    /// Admits `ask` (without a class) now, as a newcomer, or says why not (with the word and
    /// limits it decided on).
    #[inline]
    fn admit_now(&self, ask: Ask) -> Result<u64, (Refusal, State, Bounds)> {
        self.decide(false, |s, limits| {
            match policy::admit(s, limits, ask, Turn::Newcomer) {
                Ok(next) => Ok((next, limits.revision)),
                Err(refusal) => Err((refusal, s, *limits)),
            }
        })
    }

    /// Counts a refusal for `reason` of a call without a class and builds its rejection from
    /// what the decision saw (the path without classes, kept as small as it was before them:
    /// inlined, it builds the rejection where the caller returns it).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn reject_global(
        &self,
        reason: RejectReason,
        state: State,
        bounds: &Bounds,
        ask: Ask,
    ) -> Rejection {
        local::with(&self.counters, move |sink| sink.bump_rejected(reason));
        Rejection::new(
            reason,
            policy::global_detail(state, bounds, self.pending(), ask),
        )
    }

    /// Counts a refusal for `reason` (bound by `constraint`) and builds its rejection from
    /// what the decision saw. Inlined: refusing fast is a goal of its own, and inlining lets
    /// the rejection be built where the caller returns it.
    #[inline]
    pub(crate) fn reject(
        &self,
        reason: RejectReason,
        constraint: Option<Constraint>,
        seen: &Seen,
        ask: Ask,
    ) -> Rejection {
        self.count_refusal(reason, ask.class);
        Rejection::new(
            reason,
            policy::detail(
                self.in_flight_of(seen.state),
                &seen.bounds,
                self.pending(),
                ask,
                seen.class.as_ref(),
                constraint,
            ),
        )
    }

    /// Counts a refusal for `reason` of a call of `class` that was never decided (a
    /// deduplication follower whose own wait ended), and builds its rejection from the global
    /// figures of this moment: the refusal is the caller's, no limit bound it.
    pub(crate) fn refuse_undecided(
        &self,
        reason: RejectReason,
        priority: crate::vocabulary::priority::Priority,
        class: Option<AdmissionClass>,
    ) -> Rejection {
        let (state, bounds) = self.snapshot();
        let ask = Ask {
            reserved: 0,
            priority,
            class: None,
        };
        let pending = self.pending();
        self.count_refusal(reason, class);
        let state = self.in_flight_of(state);
        Rejection::new(reason, policy::global_detail(state, &bounds, pending, ask))
    }

    /// Counts a refusal for `reason` of a call of `class` (globally and for its class).
    #[inline]
    pub(crate) fn count_refusal(&self, reason: RejectReason, class: Option<AdmissionClass>) {
        local::with(&self.counters, move |sink| {
            sink.bump_rejected(reason);
            if let Some(class) = class {
                sink.bump_class(class.index(), ClassCounter::Rejected(reason), 1);
            }
        });
    }

    /// What an admission of `ask` would get now, and the snapshot it would be decided on;
    /// reserves and counts nothing.
    pub(crate) fn would_admit(&self, ask: Ask) -> (Verdict, CapacityDetail) {
        let (verdict, detail) = self.advise(ask, |_| true);
        (verdict, detail.expect("asked for every verdict's detail"))
    }

    /// What an admission of `ask` would get now, with the snapshot it would be decided on when
    /// `want_detail(verdict)` (building a detail costs more than the verdict: an observe-mode
    /// `run` needs it only for a refusal it bypasses). Reserves and counts nothing.
    pub(crate) fn advise(
        &self,
        ask: Ask,
        want_detail: impl FnOnce(Verdict) -> bool,
    ) -> (Verdict, Option<CapacityDetail>) {
        let seen = match ask.class {
            None => {
                let (state, bounds) = self.snapshot();
                Seen::global(state, bounds)
            }
            Some(class) => {
                // The class's counts and the word at one moment: the class locked meanwhile.
                let (guard, bounds, mut view) = self.lock_class(class);
                let state = self.state.load();
                drop(guard);
                // Judged on the calls and tokens in flight, not on floors the word reserves.
                view.reserved = false;
                Seen::class(self.in_flight_of(state), bounds, view)
            }
        };
        let pending = self.pending();
        let (verdict, constraint) =
            policy::verdict(seen.state, &seen.bounds, pending, ask, seen.class.as_ref());
        if !want_detail(verdict) {
            return (verdict, None);
        }
        let constraint = match verdict {
            Verdict::Reject(RejectReason::Shutdown) => None,
            _ => constraint,
        };
        let detail = policy::detail(
            seen.state,
            &seen.bounds,
            pending,
            ask,
            seen.class.as_ref(),
            constraint,
        );
        (verdict, Some(detail))
    }

    /// Runs one decision against the current word and the limits in force, linearizably with
    /// `apply_limits` (see `limits` for the protocol and why it is sound).
    ///
    /// `decide` answers `Ok((next, out))` to commit `next` with a CAS (re-deciding from the
    /// value a failed CAS returns), or `Err(out)` to commit nothing. A refusal is returned only
    /// if no limit change overlapped the reading of the limits. A commit is kept unless
    /// 2^`EPOCH_BITS` − 1 limit changes were published between the reading of the word and the
    /// check right after the CAS (then the word's epoch bits cannot tell whether it used stale
    /// limits): such a commit is undone (see [`undo_commit`](Engine::undo_commit)) and the
    /// decision starts over. `queue_locked` says whether the caller holds the queue lock.
    #[cfg_attr(not(loom), inline(always))]
    fn decide<T, U>(
        &self,
        queue_locked: bool,
        mut decide: impl FnMut(State, &Bounds) -> Result<(State, T), U>,
    ) -> Result<T, U> {
        let backoff = Backoff::new();
        'start: loop {
            let mut before = self.published.epoch();
            let mut current = self.state.load();
            loop {
                let seen = self.published.epoch();
                let Some(epoch) = word_epoch(before, seen, current) else {
                    // A writer finished a change between the two loads: read again.
                    backoff.spin();
                    continue 'start;
                };
                let limits = self.published.read(epoch);
                match decide(current, &limits) {
                    Err(out) => {
                        // No later writer began overwriting the slot we read.
                        if self.published.epoch() <= epoch {
                            return Err(out);
                        }
                        continue 'start;
                    }
                    // Nothing to write (a newcomer queueing behind waiters: the flag is
                    // already set, and only the queue, whose lock the caller holds, changes
                    // it): validated like a refusal, without a CAS on the hot word. The word
                    // it decided on had no slot for a newcomer, and a release since then saw
                    // the flag and serves the queue once the caller lets go of its lock.
                    Ok((next, out)) if next == current => {
                        if self.published.epoch() <= epoch {
                            return Ok(out);
                        }
                        continue 'start;
                    }
                    Ok((next, out)) => match self.state.compare_exchange(current, next) {
                        Ok(()) => {
                            let after = self.published.epoch();
                            // Fewer than 2^EPOCH_BITS - 1 later epochs published: the epoch
                            // bits cannot have wrapped back to ours, so no limit change
                            // landed between our read of the word and our CAS.
                            if (after as i64).wrapping_sub(epoch as i64) < (1 << EPOCH_BITS) - 1 {
                                return Ok(out);
                            }
                            self.undo_commit(current, next, queue_locked);
                            continue 'start;
                        }
                        Err(actual) => {
                            current = actual;
                            before = seen;
                            backoff.spin();
                        }
                    },
                }
            }
        }
    }

    /// Reverts a commit from `current` to `next` that [`decide`](Engine::decide) could not
    /// vouch for: takes back the slot and tokens it added and restores the queue flag it
    /// changed (only the queue, under its lock, changes that flag, and the queue's commits are
    /// made under that lock). Returning capacity is a release: it serves the drainers, and the
    /// queue unless the caller holds the queue lock (then it is the pump, or a newcomer that
    /// found the queue empty, and decides again itself).
    #[cold]
    fn undo_commit(&self, current: State, next: State, queue_locked: bool) {
        let added_slot = next.slots() != current.slots();
        let added_tokens = next.tokens() - current.tokens();
        let restore_waiters =
            (next.has_waiters() != current.has_waiters()).then_some(current.has_waiters());
        let after = self.state.modify(|s| {
            let undone = if added_slot {
                s.without_admission(added_tokens)
            } else {
                s
            };
            match restore_waiters {
                Some(waiters) => undone.with_waiters(waiters),
                None => undone,
            }
        });
        if after.has_waiters() && !queue_locked {
            self.pump();
        }
        self.idle_check(after);
    }

    // ----- holds and release -----

    /// Moves `grant`'s hold to `to` tokens in one CAS of the word; returns the previous hold.
    ///
    /// # Errors
    ///
    /// [`UsageError::HoldOverflow`](crate::usage::UsageError::HoldOverflow) when the tokens in flight would pass what the word counts
    /// ([`MAX_BUDGET`](crate::limits::MAX_BUDGET)); nothing changes.
    pub(crate) fn move_hold(&self, grant: &mut Grant, to: u64) -> Result<u64, UsageError> {
        if grant.class().is_some() {
            return self.move_class_hold(grant, to);
        }
        let from = grant.held();
        if from != to {
            self.state.update(|s| {
                let tokens = if to >= from {
                    s.tokens().checked_add(to - from)
                } else {
                    Some(s.tokens() - (from - to))
                };
                let next = tokens
                    .and_then(|t| s.with_tokens(t))
                    .ok_or(UsageError::HoldOverflow)?;
                Ok((next, ()))
            })?;
            grant.set_held(to);
        }
        Ok(from)
    }

    /// Returns `grant`'s slot and hold, then serves the queue or the drainers if the word said
    /// someone waits for that.
    #[inline]
    pub(crate) fn release(&self, grant: &Grant) {
        match grant.class() {
            None => self.release_capacity(grant.held()),
            Some(class) => {
                local::with(&self.counters, move |sink| {
                    sink.bump_class(class.index(), ClassCounter::Released, 1);
                });
                self.release_class_admission(class, grant);
            }
        }
    }

    /// Returns `grant`'s hold without usage (a dropped permit): counts the hold as returned
    /// unreported (and, for a class admission, the release, in the same counter lookup), then
    /// returns the slot and the hold as [`release`](Engine::release) does.
    #[inline]
    pub(crate) fn release_unreported(&self, grant: &Grant) {
        let held = grant.held();
        match grant.class() {
            None => {
                // Without a budget, or with a hold of 0, there is nothing to book (no lookup).
                if held > 0 {
                    self.count_returned_unreported(held);
                }
                self.release_capacity(held);
            }
            Some(class) => self.release_class_unreported(class, grant),
        }
    }

    /// [`release_unreported`](Engine::release_unreported) of a class admission: out of line,
    /// so that a release without a class stays small.
    #[inline(never)]
    fn release_class_unreported(&self, class: AdmissionClass, grant: &Grant) {
        let held = grant.held();
        local::with(&self.counters, move |sink| {
            if held > 0 {
                sink.bump_returned_unreported(held);
                sink.bump_class(class.index(), ClassCounter::ReturnedUnreported, held);
            }
            sink.bump_class(class.index(), ClassCounter::Released, 1);
        });
        self.release_class_admission(class, grant);
    }

    /// The capacity a class admission returns at its release (its counters already booked).
    #[inline]
    fn release_class_admission(&self, class: AdmissionClass, grant: &Grant) {
        if grant.holds_slot() {
            self.release_class_all(class, grant.held());
        } else {
            self.release_class(class, grant.held(), Returned::Tokens);
        }
    }

    /// Returns `grant`'s slot now, keeping its hold until its release, if it borrowed its
    /// slot, still holds it and the abandonment can be counted; says whether it did.
    pub(crate) fn abandon(&self, grant: &mut Grant, cause: AbandonCause) -> bool {
        let Some(class) = grant.class() else {
            return false;
        };
        if !grant.holds_slot() || !grant.resources().borrowed_concurrency {
            return false;
        }
        if !self.release_class(class, grant.held(), Returned::Slot) {
            return false;
        }
        grant.set_slot_returned();
        local::with(&self.counters, move |sink| {
            sink.bump(Counter::Abandoned(cause), 1);
            sink.bump_class(class.index(), ClassCounter::Abandoned(cause), 1);
        });
        true
    }

    /// Returns one slot and `held` tokens (see [`release`](Engine::release)).
    #[inline]
    fn release_capacity(&self, held: u64) {
        // Calls wait (on an engine without a token budget or classes): the slot goes straight
        // to the queue head, without a write of the word, if it can (see `pass_slot`).
        if self.passes_slots()
            && State::narrow(self.state.narrow_word().load(Ordering::Acquire)).has_waiters()
            && self.pass_slot()
        {
            return;
        }
        let before = self.state.release(held);
        if before.needs_attention_on_release() {
            self.after_release(before);
        }
    }

    #[cold]
    #[inline(never)]
    fn after_release(&self, before: State) {
        if before.has_waiters() {
            self.pump();
        } else if before.is_draining() && before.slots() == 1 {
            self.notify_drained();
        }
    }

    // ----- counters -----

    /// Bumps a counter in this thread's shard.
    #[inline]
    pub(crate) fn count(&self, counter: Counter, by: u64) {
        local::with(&self.counters, move |sink| sink.bump(counter, by));
    }

    /// Counts `held` tokens returned without usage by a release of an admission without a
    /// class (the dropped-permit path: the counter indexed directly, no [`Counter`] value read
    /// back through memory).
    #[inline]
    pub(crate) fn count_returned_unreported(&self, held: u64) {
        local::with(&self.counters, move |sink| {
            sink.bump_returned_unreported(held)
        });
    }

    /// Bumps several counters in this thread's shard (one slot lookup), and for an admission
    /// of `class` the class's twin of each (see [`Counter::class_twin`]).
    #[inline]
    pub(crate) fn count_all(&self, class: Option<AdmissionClass>, counts: &[(Counter, u64)]) {
        local::with(&self.counters, move |sink| {
            for &(counter, by) in counts {
                sink.bump(counter, by);
                if let (Some(class), Some(twin)) = (class, counter.class_twin()) {
                    sink.bump_class(class.index(), twin, by);
                }
            }
        });
    }

    // ----- reading -----

    /// A consistent (word, limits) pair, without a lock: the word at one moment and the
    /// limits in force at that moment.
    fn snapshot(&self) -> (State, Bounds) {
        let backoff = Backoff::new();
        loop {
            let before = self.published.epoch();
            let state = self.state.load();
            let seen = self.published.epoch();
            if let Some(epoch) = word_epoch(before, seen, state) {
                let limits = self.published.read(epoch);
                if self.published.epoch() <= epoch {
                    return (state, limits);
                }
            }
            backoff.spin();
        }
    }

    /// The limits in force (with admission classes, their floors of 0 omitted).
    pub(crate) fn limits(&self) -> Limits {
        lock(&self.writer).clone()
    }

    /// Revision of the limits in force.
    pub(crate) fn revision(&self) -> u64 {
        self.snapshot().1.revision
    }

    /// Calls waiting in the queue.
    pub(crate) fn pending(&self) -> u64 {
        self.queue.len()
    }

    /// Nothing in flight, nobody waiting, no abandoned admission unsettled: one load (and,
    /// while the classes' floors are reserved, a read of the class words).
    pub(crate) fn is_idle(&self) -> bool {
        self.in_flight_of(self.state.load()).is_idle()
    }

    /// Admissions not settled yet: those holding a slot, and those that gave their borrowed
    /// slot back but still hold their tokens.
    pub(crate) fn unsettled(&self) -> u64 {
        let state = self.in_flight_of(self.state.load());
        u64::from(state.slots()) + u64::from(state.abandoned())
    }

    /// Whether the engine has been closed.
    pub(crate) fn is_closed(&self) -> bool {
        self.state.load().is_closed()
    }

    // ----- drain -----

    /// Wakes the drainers if `state` (just written) is idle and someone drains.
    fn idle_check(&self, state: State) {
        if state.is_idle() && state.is_draining() {
            self.notify_drained();
        }
    }

    #[cold]
    fn notify_drained(&self) {
        // Clear the flag first: a drainer that re-arms after the notification waits for the
        // next idle moment, and one that was armed sees the generation move.
        let _ = self.state.update(|s| {
            if s.is_draining() {
                Ok((s.with_draining(false), ()))
            } else {
                Err(())
            }
        });
        // Release: pairs with the drainers' Acquire loads of the generation.
        self.idle_generation.fetch_add(1, Ordering::Release);
        self.drained.notify(usize::MAX);
    }
}

/// What a decision saw: the word, the limits, and (for a class call) its class.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Seen {
    pub(crate) state: State,
    pub(crate) bounds: Bounds,
    pub(crate) class: Option<ClassView>,
}

impl Seen {
    pub(crate) fn global(state: State, bounds: Bounds) -> Seen {
        Seen {
            state,
            bounds,
            class: None,
        }
    }

    pub(crate) fn class(state: State, bounds: Bounds, view: ClassView) -> Seen {
        Seen {
            state,
            bounds,
            class: Some(view),
        }
    }
}

impl fmt::Debug for Engine {
    /// Never blocks: reads the admission word and the published limits only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (state, limits) = self.snapshot();
        let state = self.in_flight_of(state);
        let mut d = f.debug_struct("Engine");
        d.field("in_flight", &state.slots())
            .field("closed", &state.is_closed())
            .field("limits", &limits);
        if self.has_budget {
            d.field("in_flight_tokens", &state.tokens());
        }
        d.finish_non_exhaustive()
    }
}

/// The full epoch of the limits `word` was written under, from two loads of the published
/// epoch made just before (`before`) and just after (`seen`) the word was read; `None` if a
/// writer finished a change between them.
///
/// Writers advance the word's epoch bits and only then store the next epoch, so while the two
/// loads agree the word's epoch is `seen` or, if a writer is between its two steps, `seen + 1`;
/// the bits tell which. Nothing waits for that writer: its new slot was complete before it
/// advanced the bits.
#[inline]
fn word_epoch(before: u64, seen: u64, word: State) -> Option<u64> {
    if before != seen {
        None
    } else if word.matches_epoch(seen) {
        Some(seen)
    } else {
        debug_assert!(word.matches_epoch(seen + 1));
        Some(seen + 1)
    }
}
