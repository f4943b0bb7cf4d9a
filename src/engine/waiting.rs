//! The engine's waiting methods: a newcomer joining the queue (`arrive`), free capacity handed
//! to the queue head (`hand_off`, `pump`), a waiter's owner picking up its fate, giving up at
//! its timeout or cancelling, and `close` refusing everyone. The queue's data and its hand-off
//! protocol are described in `super::queue`.

use super::counters::Counter;
use super::limits::Limits;
use super::policy::{self, Ask, Refusal, Turn};
use super::queue::{Arrival, Decided, HandedOff, Waiter, Withdrawn, Woken};
use super::state::State;
use super::{Engine, Grant};
use crate::rejection::{RejectReason, Rejection};
use crate::sync::Arc;

/// What withdrawing a waiter found.
#[derive(Debug)]
enum Withdrawal {
    /// It had already been handed a slot and its tokens: the caller now owns them.
    Granted { revision: u64 },
    /// It was refused (just now, for the withdrawal's reason, or earlier); already counted.
    Refused(Rejection),
}

/// One turn of the hand-off loop.
enum Turned {
    Granted {
        revision: u64,
        /// Whether a slot was still free after this one (else the next head would be blocked).
        more: bool,
    },
    Refused {
        reason: RejectReason,
        state: State,
        limits: Limits,
        after: State,
    },
    Blocked,
}

impl Engine {
    /// A newcomer found no free slot on the fast path: under the queue lock, decide again
    /// (a slot may have freed meanwhile) and queue it if the queue has room.
    pub(super) fn arrive(&self, ask: Ask, blocking: bool) -> Arrival {
        enum Step {
            Admitted(u64),
            Queue,
            Refused(RejectReason, State, Limits),
        }
        // Allocated before taking the lock, to keep the critical section short: a newcomer
        // that reached this slow path almost always queues.
        let waiter = Arc::new(Waiter::new(ask, blocking));
        let mut list = self.queue.lock();
        let pending = list.len() as u64;
        let step = self.decide(true, |s, limits| {
            match policy::admit(s, limits, ask, Turn::Newcomer) {
                Ok(next) => Ok((next, Step::Admitted(limits.revision))),
                // Setting the flag is a CAS even when it is already set: it confirms that the
                // limits which allowed queueing are still the ones in force.
                Err(Refusal::NoSlot) => match policy::queue_or_refuse(limits, pending) {
                    Ok(()) => Ok((s.with_waiters(true), Step::Queue)),
                    Err(reason) => Err(Step::Refused(reason, s, *limits)),
                },
                Err(refusal) => Err(Step::Refused(refusal.reason(), s, *limits)),
            }
        });
        match step.unwrap_or_else(|step| step) {
            Step::Admitted(revision) => Arrival::Admitted { revision },
            Step::Queue => {
                let key = list.push_back(Arc::clone(&waiter));
                waiter.set_key(key);
                Arrival::Queued(waiter)
            }
            Step::Refused(reason, state, limits) => {
                drop(list);
                Arrival::Refused(self.reject(reason, state, &limits, ask))
            }
        }
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
            while let Some(ask) = list.front().map(|head| head.ask()) {
                let last = list.len() == 1;
                let turned = self.decide(true, |s, limits| {
                    match policy::admit(s, limits, ask, Turn::Head) {
                        // The last waiter leaves the queue: clear the flag in the same CAS.
                        Ok(next) => Ok((
                            next.with_waiters(!last),
                            Turned::Granted {
                                revision: limits.revision,
                                more: next.slots() < limits.max_concurrent,
                            },
                        )),
                        Err(Refusal::NoSlot) => Err(Turned::Blocked),
                        Err(refusal) => {
                            let (reason, limits) = (refusal.reason(), *limits);
                            let after = s.with_waiters(false);
                            let turned = Turned::Refused {
                                reason,
                                state: s,
                                limits,
                                after,
                            };
                            if last {
                                Ok((after, turned))
                            } else {
                                Err(turned)
                            }
                        }
                    }
                });
                let head = match turned.unwrap_or_else(|t| t) {
                    Turned::Blocked => break,
                    Turned::Granted { revision, more } => {
                        let head = list.pop_front().expect("the head");
                        // Counted in this thread's shard: no shared counter under the lock.
                        self.count(Counter::HandedOut, 1);
                        head.grant(revision);
                        if !more {
                            // The next head would find no slot: skip deciding it. Whatever
                            // frees one next (a release, raised limits) pumps again.
                            woken.push(head);
                            break;
                        }
                        head
                    }
                    Turned::Refused {
                        reason,
                        state,
                        limits,
                        after,
                    } => {
                        let head = list.pop_front().expect("the head");
                        head.refuse(self.reject(reason, state, &limits, ask));
                        if last {
                            emptied = Some(after);
                        }
                        head
                    }
                };
                woken.push(head);
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
                let (state, limits) = self.snapshot();
                Withdrawal::Refused(self.reject(reason, state, &limits, waiter.ask()))
            }
            Withdrawn::Decided(Decided::Granted { revision }) => {
                drop(list);
                self.count(Counter::HandedBack, 1);
                Withdrawal::Granted { revision }
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
            let (state, limits) = self.snapshot();
            for waiter in &woken {
                waiter.refuse(self.reject(RejectReason::Shutdown, state, &limits, waiter.ask()));
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
    pub(crate) fn pick_up(&self, waiter: &Waiter) -> Option<Result<Grant, Rejection>> {
        Some(match waiter.take_decided()? {
            Decided::Granted { revision } => {
                self.count(Counter::HandedBack, 1);
                Ok(self.grant(waiter.ask(), revision))
            }
            Decided::Refused(rejection) => Err(rejection),
        })
    }

    /// The waiter gave up because its timeout passed: it leaves the queue refused `timeout`,
    /// unless a hand-off reached it first, which it keeps.
    pub(crate) fn time_out(&self, waiter: &Waiter) -> Result<Grant, Rejection> {
        match self.withdraw(waiter, RejectReason::Timeout) {
            Withdrawal::Granted { revision } => Ok(self.grant(waiter.ask(), revision)),
            Withdrawal::Refused(rejection) => Err(rejection),
        }
    }

    /// The waiter's future was dropped: it leaves the queue refused `aborted`. If it had
    /// already been handed a slot, the call was still waiting as far as its caller knew, so it
    /// counts as aborted too, and the slot and tokens go back (to the next waiter, if any)
    /// exactly as a release returns them. Returns the refusal to announce.
    pub(crate) fn cancel(&self, waiter: &Waiter) -> Rejection {
        match self.withdraw(waiter, RejectReason::Aborted) {
            Withdrawal::Granted { .. } => {
                let (state, limits) = self.snapshot();
                let rejection = self.reject(RejectReason::Aborted, state, &limits, waiter.ask());
                self.release_capacity(waiter.ask().reserved);
                rejection
            }
            // Counted when it was refused (now, or earlier while it waited).
            Withdrawal::Refused(rejection) => rejection,
        }
    }
}
