//! The engine's waiting methods: a newcomer joining the queue (`arrive`), free capacity handed
//! to the queue head (`hand_off`, `pump`), a waiter's owner picking up its fate, giving up at
//! its timeout or cancelling, and `close` refusing everyone. The queue's data and its hand-off
//! protocol are described in `super::queue`.
//!
//! A class call's decisions here run with the queue lock held and then its class's lock (the
//! lock order of `super::classes`); they change the class's counts only when they admit.

use super::assembly::{Engine, Seen};
use super::classes::{ClassCounts, Returned};
use super::counters::Counter;
use super::grant::Grant;
use super::limits::Bounds;
use super::local;
use super::policy::{self, Ask, ClassView, Refusal, Turn};
use super::pool;
use super::queue::{Arrival, Decided, HandedOff, Waiter, Withdrawn, Woken};
use super::state::State;
use super::wait::Wait;
use crate::support::sync::Arc;
use crate::vocabulary::admission_class::Resources;
use crate::vocabulary::rejection::{Constraint, RejectReason, Rejection};

/// What withdrawing a waiter found.
#[derive(Debug)]
enum Withdrawal {
    /// It had already been handed a slot and its tokens: the caller now owns them.
    Granted { revision: u64, borrowed: Resources },
    /// It was refused (just now, for the withdrawal's reason, or earlier); already counted.
    Refused(Rejection),
}

/// One turn of the hand-off loop.
enum Turned {
    Granted {
        revision: u64,
        borrowed: Resources,
        /// Whether a slot was still free after this one (else the next head would be blocked).
        more: bool,
    },
    Refused {
        refusal: Refusal,
        state: State,
        bounds: Bounds,
        after: State,
    },
    Blocked,
}

impl Engine {
    /// One decision of the queue's (the queue lock held): for a class call, its class locked
    /// for it, and its counts written when `decide` admits (says so with its `bool`). Returns
    /// the outcome and, for a class call, the class as the decision saw it.
    fn decide_queued<T, U>(
        &self,
        ask: Ask,
        mut decide: impl FnMut(State, &Bounds, Option<&ClassView>) -> Result<(State, T, bool), U>,
    ) -> (Result<T, U>, Option<ClassView>) {
        let Some(class) = ask.class else {
            let out = self.decide(true, |s, b| decide(s, b, None).map(|(n, t, _)| (n, t)));
            return (out, None);
        };
        let (guard, bounds, view) = self.lock_class(class);
        let mut admitted = false;
        let out = self.decide_class(&bounds, &view, |s, b, v| {
            decide(s, b, Some(v)).map(|(next, out, admits)| {
                admitted = admits;
                (next, out)
            })
        });
        if out.is_ok() && admitted {
            guard.set(
                ClassCounts {
                    slots: view.slots + 1,
                    tokens: view.tokens + ask.reserved,
                },
                view.floors(),
            );
        } else {
            drop(guard);
        }
        (out, Some(view))
    }

    /// What a decision for `ask` would see now (a class call's class locked for the reading),
    /// for the refusals the queue makes on its own (a timeout, a cancellation, a close).
    fn seen(&self, ask: Ask) -> Seen {
        match ask.class {
            None => {
                let (state, bounds) = self.snapshot();
                Seen::global(state, bounds)
            }
            Some(class) => {
                let (guard, bounds, view) = self.lock_class(class);
                let state = self.state.load();
                drop(guard);
                Seen::class(state, bounds, view)
            }
        }
    }

    /// A newcomer found no free slot on the fast path: under the queue lock, decide again
    /// (a slot may have freed meanwhile) and queue it if the queue has room.
    pub(super) fn arrive(&self, ask: Ask, wait: Wait<'_>) -> Arrival {
        enum Step {
            Admitted(u64, Resources),
            Queue,
            Refused(RejectReason, Option<Constraint>, State, Bounds),
            /// The classes' floors are reserved: no call may queue until they are not (a
            /// call within its class's floors would be admitted past the queue).
            Release,
        }
        // Allocated before taking the lock, to keep the critical section short: a newcomer
        // that reached this slow path almost always queues.
        let waiter = pool::take(ask, wait);
        // The queue's reference, taken before the lock too: the lock is contended by every
        // arrival and hand-off, so it is held for the decision and the push only.
        let queued = Arc::clone(&waiter);
        let mut list = self.queue.lock();
        let pending = list.len() as u64;
        let decide = |s: State, bounds: &Bounds, class: Option<&ClassView>| {
            if s.floors_reserved() {
                return Err(Step::Release);
            }
            match policy::admit_any(s, bounds, class, ask, Turn::Newcomer) {
                Ok((next, borrowed)) => Ok((next, Step::Admitted(bounds.revision, borrowed), true)),
                // Setting the flag is a CAS that also confirms the limits which allowed
                // queueing are still the ones in force; when the flag is already set there is
                // nothing to write, and `decide` confirms the limits as it does a refusal's.
                Err(Refusal::NoSlot) => match policy::queue_or_refuse(bounds, pending) {
                    Ok(()) => Ok((s.with_waiters(true), Step::Queue, false)),
                    Err(reason) => Err(Step::Refused(reason, Some(Constraint::Global), s, *bounds)),
                },
                Err(refusal) => Err(Step::Refused(
                    refusal.reason(),
                    refusal.constraint(),
                    s,
                    *bounds,
                )),
            }
        };
        let (step, view) = loop {
            match self.decide_queued(ask, decide) {
                // A limits writer may reserve them again before the next decision: it then
                // goes round once more.
                (Err(Step::Release), _) => self.release_floors(),
                decided => break decided,
            }
        };
        match step.unwrap_or_else(|step| step) {
            Step::Admitted(revision, borrowed) => Arrival::Admitted { revision, borrowed },
            Step::Queue => {
                let key = list.push_back(queued);
                waiter.set_key(key);
                drop(list);
                Arrival::Queued(waiter)
            }
            Step::Release => unreachable!("decided again once the floors were released"),
            Step::Refused(reason, constraint, state, bounds) => {
                drop(list);
                let seen = Seen {
                    state,
                    bounds,
                    class: view,
                };
                Arrival::Refused(self.reject(reason, constraint, &seen, ask))
            }
        }
    }

    /// A release while calls wait, on an engine without a token budget or classes: passes the
    /// releasing call's slot straight to the queue head under the queue lock, without writing
    /// the admission word (the slot changes hands; the count of slots in flight stays as it
    /// is). Returns `false`, having done nothing, when it cannot: the queue is empty, the head
    /// would not fit the limits in force (lowered below the calls in flight), the bulkhead is
    /// closed, or a limits writer got in between; the caller then releases as usual (and the
    /// pump serves the queue).
    ///
    /// The head's admission takes effect at the load of the word the decision reads: the
    /// snapshot shows that the limits it read were in force then (no writer published a change
    /// around it), and the word shows the bulkhead open with the releasing call's slot among
    /// those in flight. Nothing writes the word here, so there is nothing to commit; a close or
    /// a change of limits after that instant revokes nothing, as for any call in flight, and
    /// whatever else touches the head (its cancellation, `close` refusing the queue) takes the
    /// queue lock held here. A release with a hold of tokens never comes here (no budget), so
    /// nothing but the slot moves.
    #[cold]
    #[inline(never)]
    pub(super) fn pass_slot(&self) -> bool {
        let head = {
            let mut list = self.queue.lock();
            if list.is_empty() {
                return false;
            }
            let (state, bounds) = self.snapshot();
            // The head's decision on the word without the releasing call's slot: a slot is
            // free for it iff `slots - 1 < max_concurrent`.
            if state.is_closed() || state.slots() > bounds.max_concurrent {
                return false;
            }
            let head = list.pop_front().expect("a non-empty queue has a head");
            if list.is_empty() {
                self.set_waiters_flag(false);
            }
            local::with(&self.counters, move |sink| sink.bump_handed_out());
            head.grant(bounds.revision, Resources::NONE);
            head
        };
        head.wake();
        true
    }

    /// Hands free capacity to the queue head, then the next, in order, until a head finds no
    /// slot or the queue is empty. Called when a release or a limit change may have freed
    /// capacity while the queue was non-empty.
    #[cold]
    pub(super) fn pump(&self) {
        let handed_off = self.hand_off();
        self.finish(handed_off);
    }

    /// Wakes the waiters `handed_off` served, then the drainers if the queue emptied into an
    /// idle engine. The caller holds no lock of the engine: a waker may poll its task inline,
    /// and the task's listeners may call back into the bulkhead.
    pub(super) fn finish(&self, handed_off: HandedOff) {
        handed_off.woken.wake_all();
        if let Some(after) = handed_off.emptied {
            self.idle_check(after);
        }
    }

    /// The hand-offs of [`pump`](Engine::pump), made under the queue lock, without waking
    /// anyone: the caller wakes them with [`finish`](Engine::finish) once it holds no lock of
    /// its own.
    #[cold]
    pub(super) fn hand_off(&self) -> HandedOff {
        let mut woken = Woken::default();
        let mut emptied = None;
        {
            let mut list = self.queue.lock();
            let served = !list.is_empty();
            while let Some(ask) = list.front().map(|head| head.ask()) {
                let last = list.len() == 1;
                let (turned, view) = self.decide_queued(ask, |s, bounds, class| {
                    match policy::admit_any(s, bounds, class, ask, Turn::Head) {
                        // The last waiter leaves the queue: clear the flag in the same CAS.
                        Ok((next, borrowed)) => Ok((
                            next.with_waiters(!last),
                            Turned::Granted {
                                revision: bounds.revision,
                                borrowed,
                                more: next.slots() < bounds.max_concurrent,
                            },
                            true,
                        )),
                        Err(Refusal::NoSlot) => Err(Turned::Blocked),
                        Err(refusal) => {
                            let after = s.with_waiters(false);
                            let turned = Turned::Refused {
                                refusal,
                                state: s,
                                bounds: *bounds,
                                after,
                            };
                            if last {
                                Ok((after, turned, false))
                            } else {
                                Err(turned)
                            }
                        }
                    }
                });
                let head = match turned.unwrap_or_else(|t| t) {
                    Turned::Blocked => break,
                    Turned::Granted {
                        revision,
                        borrowed,
                        more,
                    } => {
                        let head = list.pop_front().expect("the head");
                        // Counted in this thread's shard: no shared counter under the lock.
                        local::with(&self.counters, move |sink| sink.bump_handed_out());
                        head.grant(revision, borrowed);
                        if !more {
                            // The next head would find no slot: skip deciding it. Whatever
                            // frees one next (a release, raised limits) pumps again.
                            woken.push(head);
                            break;
                        }
                        head
                    }
                    Turned::Refused {
                        refusal,
                        state,
                        bounds,
                        after,
                    } => {
                        let head = list.pop_front().expect("the head");
                        let seen = Seen {
                            state,
                            bounds,
                            class: view,
                        };
                        head.refuse(self.reject(
                            refusal.reason(),
                            refusal.constraint(),
                            &seen,
                            ask,
                        ));
                        if last {
                            emptied = Some(after);
                        }
                        head
                    }
                };
                woken.push(head);
            }
            if served && list.is_empty() && self.classes().is_some() {
                // The queue emptied: the classes' floors may be reserved again (an arrival
                // released them; it cannot queue meanwhile, this thread holds the queue lock).
                self.recount_classes(true, |s| s);
            }
        }
        HandedOff { woken, emptied }
    }

    /// Takes `waiter` out of the queue because it gave up (`Aborted` or `Timeout`). Called by
    /// the waiter's owner only, at most once.
    fn withdraw(&self, waiter: &Waiter, reason: RejectReason) -> Withdrawal {
        let mut list = self.queue.lock();
        match waiter.withdraw() {
            Withdrawn::Queued(key) => {
                let removed = list.remove(key);
                debug_assert!(removed.is_some(), "a queued waiter is in the list");
                let emptied = list.is_empty().then(|| self.set_waiters_flag(false));
                drop(list);
                if let Some(after) = emptied {
                    self.idle_check(after);
                }
                let seen = self.seen(waiter.ask());
                let constraint = policy::constraint_of(reason);
                Withdrawal::Refused(self.reject(reason, constraint, &seen, waiter.ask()))
            }
            Withdrawn::Decided(Decided::Granted { revision, borrowed }) => {
                drop(list);
                self.count(Counter::HandedBack, 1);
                Withdrawal::Granted { revision, borrowed }
            }
            Withdrawn::Decided(Decided::Refused(rejection)) => Withdrawal::Refused(rejection),
        }
    }

    /// Refuses every waiter with `shutdown` (the bulkhead was just closed).
    ///
    /// Every refusal carries the capacity snapshot of the bulkhead after the close emptied the
    /// queue (`pending: 0` for all of them), as the original reports it.
    pub(super) fn refuse_all_waiters(&self) {
        let mut woken = Vec::new();
        let emptied;
        {
            let mut list = self.queue.lock();
            if list.is_empty() {
                return;
            }
            woken.extend(core::iter::from_fn(|| list.pop_front()));
            emptied = self.set_waiters_flag(false);
            for waiter in &woken {
                let seen = self.seen(waiter.ask());
                waiter.refuse(self.reject(RejectReason::Shutdown, None, &seen, waiter.ask()));
            }
        }
        for waiter in woken {
            waiter.wake();
        }
        self.idle_check(emptied);
    }

    /// Sets or clears `WAITERS`; returns the state after. The caller holds the queue lock.
    fn set_waiters_flag(&self, on: bool) -> State {
        self.state.modify(|s| s.with_waiters(on))
    }

    /// The waiter's outcome, if it has been decided: its grant (counted now, as the admission
    /// it is) or its refusal (counted when it was decided). Called by the waiter's owner.
    pub(super) fn pick_up(&self, waiter: &Waiter) -> Option<Result<Grant, Rejection>> {
        Some(match waiter.take_decided()? {
            Decided::Granted { revision, borrowed } => {
                Ok(self.grant_handed(waiter.ask(), revision, borrowed))
            }
            Decided::Refused(rejection) => {
                self.refund_waiter(waiter.ask());
                Err(rejection)
            }
        })
    }

    /// [`grant`](Engine::grant) for a hand-off its waiter picked up, counted as consumed in
    /// the same visit to this thread's shard.
    #[inline]
    fn grant_handed(&self, ask: Ask, revision: u64, borrowed: Resources) -> Grant {
        if ask.class.is_some() {
            self.count(Counter::HandedBack, 1);
            return self.grant(ask, revision, borrowed);
        }
        let id = local::with(&self.counters, move |sink| {
            sink.bump_handed_back();
            sink.admit(ask.reserved)
        });
        Grant::new(id, revision, ask.priority, ask.reserved, None, borrowed)
    }

    /// The waiter gave up because its timeout passed: it leaves the queue refused `timeout`,
    /// unless a hand-off reached it first, which it keeps.
    pub(super) fn time_out(&self, waiter: &Waiter) -> Result<Grant, Rejection> {
        match self.withdraw(waiter, RejectReason::Timeout) {
            Withdrawal::Granted { revision, borrowed } => {
                Ok(self.grant(waiter.ask(), revision, borrowed))
            }
            Withdrawal::Refused(rejection) => {
                self.refund_waiter(waiter.ask());
                Err(rejection)
            }
        }
    }

    /// The waiter's future was dropped: it leaves the queue refused `aborted`. If it had
    /// already been handed a slot, the call was still waiting as far as its caller knew, so it
    /// counts as aborted too, and the slot and tokens go back (to the next waiter, if any)
    /// exactly as a release returns them. Returns the refusal to announce.
    pub(super) fn cancel(&self, waiter: &Waiter) -> Rejection {
        self.refund_waiter(waiter.ask());
        match self.withdraw(waiter, RejectReason::Aborted) {
            Withdrawal::Granted { .. } => {
                let ask = waiter.ask();
                let seen = self.seen(ask);
                let rejection = self.reject(RejectReason::Aborted, None, &seen, ask);
                match ask.class {
                    None => self.release_capacity(ask.reserved),
                    Some(class) => {
                        self.release_class(class, ask.reserved, Returned::All);
                    }
                }
                rejection
            }
            // Counted when it was refused (now, or earlier while it waited).
            Withdrawal::Refused(rejection) => rejection,
        }
    }
}
