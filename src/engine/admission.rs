//! The doors of every admission: `try_admit` (never waits), `admit_in_place` and `admit` (may
//! queue), their class variants and the fast lane; the decision itself (`decide`: the word and
//! the limits of its epoch, one CAS), refusals and their snapshots, and the advisory check.

use crossbeam_utils::Backoff;

use super::assembly::{Engine, Seen, word_epoch};
use super::counters::ClassCounter;
use super::decision::Decision;
use super::grant::Grant;
use super::limits::Bounds;
use super::local;
use super::policy::{self, Ask, ClassView, Refusal, Turn};
use super::pool::WaiterHandle;
use super::queue::Arrival;
use super::rate_path::Charged;
use super::state::{self, EPOCH_BITS, State};
use super::wait::Wait;
use crate::support::sync::atomic::Ordering;
use crate::vocabulary::admission_class::{AdmissionClass, Resources};
use crate::vocabulary::rejection::{CapacityDetail, Constraint, RejectReason, Rejection};
use crate::vocabulary::verdict::Verdict;

impl Engine {
    // ----- admission -----

    /// The front door of every admission that may wait: admits `ask` now, refuses it now, or
    /// (when only a slot is missing and the queue has room) queues it. Admissions and
    /// refusals are counted. A call that may not wait goes through
    /// [`try_admit`](Engine::try_admit).
    ///
    /// A call of an admission class goes to [`admit_class`](Engine::admit_class), one
    /// without to [`admit_global`](Engine::admit_global); the dispatch is inlined into the
    /// caller, so that the path without classes stays exactly what it was before classes (a
    /// branch inside it costs that path its in-place construction of the result).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn admit(&self, ask: Ask, wait: Wait<'_>) -> Decision {
        if self.windows.is_some() {
            return self.admit_windowed(ask, wait);
        }
        if ask.class.is_none() {
            self.admit_global(ask, wait)
        } else {
            self.admit_class(ask, wait)
        }
    }

    /// [`admit`](Engine::admit) on an engine with rate windows: the call charged to them
    /// first (a window's refusal takes nothing), the charge given back if the decision
    /// refuses; a queued call keeps it while it waits (given back if its wait ends refused).
    #[inline(never)]
    pub(super) fn admit_windowed(&self, ask: Ask, wait: Wait<'_>) -> Decision {
        let charge = match self.charge_windows(ask) {
            Ok(charge) => charge,
            Err(rejection) => return Decision::Refused(rejection),
        };
        let decision = if ask.class.is_none() {
            self.admit_global(ask, wait)
        } else {
            self.admit_class(ask, wait)
        };
        if let Decision::Refused(_) = decision {
            self.refund_windows(charge);
        }
        decision
    }

    /// [`admit`](Engine::admit) for a call without a class.
    #[inline]
    pub(super) fn admit_global(&self, ask: Ask, wait: Wait<'_>) -> Decision {
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
        if self.windows.is_some() {
            return match self.admit_windowed(ask, wait) {
                Decision::Admitted(grant) => Ok(admitted(grant)),
                other => Err(other),
            };
        }
        match self.admit_now(ask) {
            Ok(revision) => Ok(admitted(self.grant(ask, revision, Resources::NONE))),
            Err(refused) => Err(self.queue_or_refuse(ask, wait, refused)),
        }
    }

    /// What [`admit`](Engine::admit) does with a call the word refused: queue it (decided
    /// again under the queue lock) if only a slot is missing and it may wait, else refuse it.
    #[cold]
    pub(super) fn queue_or_refuse(
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
    /// result would be copied at every layer). A class call goes through
    /// [`try_admit_class`](Engine::try_admit_class): the caller dispatches on the call's class
    /// before it builds the [`Ask`] (measured: dispatching here, on `ask.class`, costs a refusal
    /// 5 instructions and a class admission 3).
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
        if self.windows.is_some() {
            return self.try_admit_windowed(ask, admitted, refused);
        }
        self.try_admit_global(ask, admitted, refused)
    }

    /// [`try_admit`](Engine::try_admit)'s decision, after the rate windows if any.
    #[cfg_attr(not(loom), inline(always))]
    pub(super) fn try_admit_global<T, E>(
        &self,
        ask: Ask,
        admitted: impl FnOnce(Grant) -> T,
        refused: impl FnOnce(Rejection) -> E,
    ) -> Result<T, E> {
        match self.admit_now(ask) {
            Ok(revision) => Ok(admitted(self.grant(ask, revision, Resources::NONE))),
            Err(refusal) => Err(refused(self.refuse_global_now(ask, refusal))),
        }
    }

    /// The rejection of a call without a class refused now (never queued): a missing slot is
    /// `concurrency_limit`, or the limits' own reason (a queue of 0 behind `max_concurrent` 0).
    #[cfg_attr(not(loom), inline(always))]
    pub(super) fn refuse_global_now(
        &self,
        ask: Ask,
        refusal: (Refusal, State, Bounds),
    ) -> Rejection {
        let (refusal, state, bounds) = refusal;
        let reason = match refusal {
            Refusal::NoSlot => policy::queue_or_refuse(&bounds, 0)
                .err()
                .unwrap_or(RejectReason::ConcurrencyLimit),
            refusal => refusal.reason(),
        };
        self.reject_global(reason, state, &bounds, ask)
    }

    /// [`try_admit`](Engine::try_admit) and [`try_admit_class`](Engine::try_admit_class) on
    /// an engine with rate windows: charged first, the charge given back on a refusal.
    #[inline(never)]
    pub(super) fn try_admit_windowed<T, E>(
        &self,
        ask: Ask,
        admitted: impl FnOnce(Grant) -> T,
        refused: impl FnOnce(Rejection) -> E,
    ) -> Result<T, E> {
        // The bulkhead's windows in one pass first (a call without a class); a closed engine
        // refuses `shutdown` below, and the charge goes back with the refusal.
        if ask.class.is_none()
            && let Some(windows) = self.windows.as_deref()
            && let Some((charge, _)) = self.charge_bulkhead_windows(windows, ask)
        {
            let charge = Some(Charged::bulkhead(charge));
            let refused = |rejection| {
                self.refund_windows(charge);
                refused(rejection)
            };
            return self.try_admit_global(ask, admitted, refused);
        }
        let charge = match self.charge_windows_again(ask) {
            Ok(charge) => charge,
            Err(rejection) => return Err(refused(rejection)),
        };
        let refused = |rejection| {
            self.refund_windows(charge);
            refused(rejection)
        };
        if ask.class.is_none() {
            self.try_admit_global(ask, admitted, refused)
        } else {
            self.try_admit_class_now(ask, admitted, refused)
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
        if self.windows.is_some() {
            return self.try_admit_windowed(ask, admitted, refused);
        }
        self.try_admit_class_now(ask, admitted, refused)
    }

    /// [`try_admit_class`](Engine::try_admit_class)'s decision, after the rate windows if any.
    #[cfg_attr(not(loom), inline(always))]
    pub(super) fn try_admit_class_now<T, E>(
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
    pub(super) fn refuse_class_now(
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
    pub(super) fn admit_class(&self, ask: Ask, wait: Wait<'_>) -> Decision {
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
    pub(super) fn arrive_or_refuse(&self, ask: Ask, wait: Wait<'_>) -> Decision {
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
    pub(super) fn grant(&self, ask: Ask, revision: u64, borrowed: Resources) -> Grant {
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
    pub(super) fn count_class_admission(
        &self,
        class: AdmissionClass,
        reserved: u64,
        borrowed: Resources,
    ) -> crate::vocabulary::admission_id::IdParts {
        let class = class.index();
        local::with(&self.counters, move |sink| {
            // The reservation is booked in the class's row only (see `counters`).
            let id = sink.admit(0);
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
        if ask.class.is_some() {
            return self.try_admit_class_fast::<false>(ask);
        }
        self.try_admit_unclassed_fast(ask)
    }

    /// [`try_admit_fast`](Engine::try_admit_fast) of a call the caller knows has no class.
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn try_admit_unclassed_fast(&self, ask: Ask) -> Option<Grant> {
        debug_assert!(ask.class.is_none());
        if !self.has_fast_lane() {
            return None;
        }
        let revision = self.admit_fast(ask)?;
        Some(self.grant_unclassed(ask, revision))
    }

    /// [`grant`](Engine::grant) for a call without a class, inlined into the fast lanes
    /// (`try_admit_fast`, `try_admit_fast_windowed`, `confirm`) whatever `grant`'s other
    /// callers: out of line, its call cost a tenant's admission within a global bulkhead 35
    /// instructions.
    #[cfg_attr(not(loom), inline(always))]
    pub(super) fn grant_unclassed(&self, ask: Ask, revision: u64) -> Grant {
        let id = local::with(&self.counters, move |sink| sink.admit(ask.reserved));
        Grant::new(
            id,
            revision,
            ask.priority,
            ask.reserved,
            None,
            Resources::NONE,
        )
    }

    /// The fast lane of an engine with rate windows and no classes: the bulkhead's windows
    /// charged (on the figures of the epoch read once, before the word, as `admit_fast`
    /// reads it), then the word's fast lane; `None` (nothing charged, nothing changed) for
    /// anything else, which the general path decides (a window's refusal included, to refuse
    /// with its snapshot; a change of limits under way).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn try_admit_fast_windowed(&self, ask: Ask) -> Option<Grant> {
        let windows = self.windows.as_deref()?;
        let (charge, epoch) = self.charge_bulkhead_windows(windows, ask)?;
        let Some(revision) = self.admit_fast_at(ask, epoch) else {
            windows.global().refund(charge);
            return None;
        };
        Some(self.grant_unclassed(ask, revision))
    }

    /// The decision of [`try_admit_fast`](Engine::try_admit_fast): its revision.
    #[cfg_attr(not(loom), inline(always))]
    pub(super) fn admit_fast(&self, ask: Ask) -> Option<u64> {
        // Read before the epoch's (acquire) load, so that a caller's own test of the budget
        // (`fast_ask`'s) decides this one too.
        let has_budget = self.has_budget;
        let epoch = self.published.epoch();
        if has_budget {
            self.admit_fast_with(true, ask, epoch)
        } else {
            self.admit_slot_fast_at(ask, epoch)
        }
    }

    /// [`admit_fast_at`](Engine::admit_fast_at) of an engine without a token budget: a call
    /// asks a slot and nothing else (no tokens are ever charged to its word), so the decision
    /// is the slot count against `max_concurrent`, and the commit adds one slot.
    #[cfg_attr(not(loom), inline(always))]
    fn admit_slot_fast_at(&self, ask: Ask, epoch: u64) -> Option<u64> {
        debug_assert_eq!(ask.reserved, 0, "a call without a budget asks no tokens");
        let current = self.fast_word(epoch)?;
        let (revision, max_concurrent, _) = self.published.read_fast(false, epoch, ask.priority);
        if current.slots() >= max_concurrent {
            return None;
        }
        self.commit_fast(current, current.with_admission(0), epoch)?;
        Some(revision)
    }

    /// [`admit_fast`](Engine::admit_fast) under the limits' epoch `epoch`, read before the
    /// word.
    #[cfg_attr(not(loom), inline(always))]
    fn admit_fast_at(&self, ask: Ask, epoch: u64) -> Option<u64> {
        self.admit_fast_with(self.has_budget, ask, epoch)
    }

    /// [`admit_fast_at`](Engine::admit_fast_at) by a caller that knows whether the engine has
    /// a budget (`has_budget`, which must be its own).
    #[cfg_attr(not(loom), inline(always))]
    fn admit_fast_with(&self, has_budget: bool, ask: Ask, epoch: u64) -> Option<u64> {
        let current = self.fast_word(epoch)?;
        let (revision, max_concurrent, budget) =
            self.published.read_fast(has_budget, epoch, ask.priority);
        if current.slots() >= max_concurrent || ask.reserved > state::MAX_TOKENS {
            return None;
        }
        // Both at most `MAX_TOKENS` (2^35 - 1): no overflow.
        let tokens = current.tokens() + ask.reserved;
        if tokens > budget || tokens > state::MAX_TOKENS {
            return None;
        }
        self.commit_fast(current, current.with_admission(ask.reserved), epoch)?;
        Some(revision)
    }

    /// The narrow word as a fast lane under the limits' epoch `epoch` finds it: `None` (the
    /// general path's) with a flag set or other epoch bits.
    #[cfg_attr(not(loom), inline(always))]
    fn fast_word(&self, epoch: u64) -> Option<State> {
        // Acquire: as `AtomicState::load`.
        let current = State::narrow(self.state.narrow_word().load(Ordering::Acquire));
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
        Some(current)
    }

    /// A fast lane's commit of `next` over `current` (found under `epoch`): one CAS, then the
    /// epoch read again. `None` (nothing changed) if the CAS lost or the commit is undone.
    #[cfg_attr(not(loom), inline(always))]
    fn commit_fast(&self, current: State, next: State, epoch: u64) -> Option<()> {
        // AcqRel / Acquire: as `AtomicState::compare_exchange`.
        self.state
            .narrow_word()
            .compare_exchange_weak(current.lo(), next.lo(), Ordering::AcqRel, Ordering::Acquire)
            .ok()?;
        let after = self.published.epoch();
        if (after as i64).wrapping_sub(epoch as i64) >= (1 << EPOCH_BITS) - 1 {
            // As in `decide`: a commit the word's epoch bits cannot vouch for is undone.
            self.undo_commit(current, next, false);
            return None;
        }
        Some(())
    }

    /// Admits `ask` (without a class) now, as a newcomer, or says why not (with the word and
    /// limits it decided on).
    #[inline]
    pub(super) fn admit_now(&self, ask: Ask) -> Result<u64, (Refusal, State, Bounds)> {
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
    pub(super) fn reject_global(
        &self,
        reason: RejectReason,
        state: State,
        bounds: &Bounds,
        ask: Ask,
    ) -> Rejection {
        local::with(&self.counters, move |sink| sink.bump_rejected(reason));
        Rejection::new(
            reason,
            policy::global_detail(state, bounds, self.queue.len(), ask),
        )
    }

    /// Counts a refusal for `reason` (bound by `constraint`) and builds its rejection from
    /// what the decision saw. Inlined: refusing fast is a goal of its own, and inlining lets
    /// the rejection be built where the caller returns it.
    #[inline]
    pub(super) fn reject(
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
                self.queue.len(),
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
        let pending = self.queue.len();
        self.count_refusal(reason, class);
        let state = self.in_flight_of(state);
        Rejection::new(reason, policy::global_detail(state, &bounds, pending, ask))
    }

    /// Counts a refusal for `reason` of a call of `class` (globally and for its class).
    #[inline]
    pub(super) fn count_refusal(&self, reason: RejectReason, class: Option<AdmissionClass>) {
        local::with(&self.counters, move |sink| {
            sink.bump_rejected(reason);
            if let Some(class) = class {
                sink.bump_class(class.index(), ClassCounter::Rejected(reason), 1);
            }
        });
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
        let pending = self.queue.len();
        let (mut verdict, mut constraint) =
            policy::verdict(seen.state, &seen.bounds, pending, ask, seen.class.as_ref());
        // The windows decide before the word (`shutdown` before both), as an admission does.
        if verdict != Verdict::Reject(RejectReason::Shutdown) && !self.windows_would_fit(ask) {
            (verdict, constraint) = (Verdict::Reject(RejectReason::RateLimit), None);
        }
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
    pub(super) fn decide<T, U>(
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
                    // A writer is between its steps, or finished a change between the two
                    // loads: read again (a wait loom can explore).
                    crate::support::sync::spin_wait(&backoff);
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
    pub(super) fn undo_commit(&self, current: State, next: State, queue_locked: bool) {
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
}
