//! The bounded FIFO wait queue, with direct hand-off.
//!
//! # Design
//!
//! Waiters are kept in arrival order in a [`Fifo`] under one short lock. The admission word's
//! `WAITERS` flag mirrors "the queue is non-empty" and changes only under that lock, so:
//!
//! - a newcomer never takes a slot while anyone waits (its policy decision sees the flag), so
//!   nobody barges past the queue, `try_acquire` included;
//! - a release only touches the queue when the flag was set in the word it decremented, so an
//!   uncontended release takes no lock and notifies nobody;
//! - when capacity frees up, the releaser (or `apply_limits`) *hands* it to the head: under the
//!   queue lock it runs the head's admission with the same policy and the same kind of CAS as
//!   any admission, taking the head's slot and tokens in one step, and records the outcome in
//!   the waiter before waking it. A head whose tokens no longer fit is refused `budget_limit`
//!   and the turn passes on; nothing is held in between.
//!
//! Each waiter publishes its fate through an atomic status that its future reads without the
//! lock, and is woken through its own waker slot (atomic-waker: no allocation per wait) or,
//! for a blocked thread, its own [`event_listener::Event`]. The order lives in our list rather
//! than in a shared event's listener list because a hand-off must say *which* waiter got
//! *what* (a slot and its tokens, or a refusal) and a cancelled waiter must leave the order
//! without losing anything: both are decided under the queue lock, and the wake-up only says
//! "look again". Wakers are always called after the lock is released.
//!
//! # Cancellation
//!
//! A waiter that gives up (its future dropped, or its timeout passed) withdraws under the queue
//! lock: if it is still queued it leaves the list (clearing `WAITERS` if it was the last);
//! if a hand-off already reached it, a dropped waiter returns that slot and those tokens
//! exactly as a release would (which hands them on to the next waiter), while a timed-out one
//! keeps the admission it was granted. No hand-off and no wake-up can be lost: both happen
//! under the lock the withdrawal takes.

use event_listener::{Event, EventListener};

use crate::bulkhead::Call;
use crate::fifo::{Fifo, Key};
use crate::limits::Limits;
use crate::policy::{self, Refusal, Turn};
use crate::rejection::{RejectReason, Rejection};
use crate::state::State;
use crate::stats::Counter;
use crate::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use crate::sync::{Arc, AtomicWaker, Mutex, lock};

/// The queue: waiters in arrival order, under one lock.
#[derive(Debug)]
pub(crate) struct WaitQueue {
    list: Mutex<Fifo<Arc<Waiter>>>,
    /// `list.len()`, written under the lock and read without it (capacity details, stats).
    len: AtomicU64,
}

impl WaitQueue {
    pub(crate) fn new() -> WaitQueue {
        WaitQueue {
            list: Mutex::new(Fifo::new()),
            len: AtomicU64::new(0),
        }
    }

    /// Waiters in the queue. `Relaxed`: a statistic; decisions read the list under its lock.
    pub(crate) fn len(&self) -> u64 {
        self.len.load(Ordering::Relaxed)
    }

    fn publish_len(&self, list: &Fifo<Arc<Waiter>>) {
        self.len.store(list.len() as u64, Ordering::Relaxed);
    }
}

/// One waiting call.
///
/// Its fate is decided under the queue lock and published through `status`; the waiting
/// future reads it without the lock. Async waiters are woken through `waker` (no allocation);
/// blocked threads park on `event`.
#[derive(Debug)]
pub(crate) struct Waiter {
    pub(crate) call: Call,
    /// `QUEUED`, `GRANTED`, `REFUSED` or `SETTLED`.
    status: AtomicU8,
    /// The waiter's key in the list, packed; read and written under the queue lock only.
    key: AtomicU64,
    /// The limit revision of the hand-off; written before `GRANTED` is published.
    revision: AtomicU64,
    /// The refusal; written before `REFUSED` is published.
    refusal: Mutex<Option<Rejection>>,
    /// Wakes an async waiter.
    waker: AtomicWaker,
    /// Wakes a blocked thread (notified only for blocking waiters).
    event: Event,
    blocking: bool,
}

/// In the queue, waiting.
const QUEUED: u8 = 0;
/// Handed a slot and its tokens; not yet picked up.
const GRANTED: u8 = 1;
/// Refused while waiting (its tokens no longer fit at its turn, or the bulkhead closed);
/// already counted.
const REFUSED: u8 = 2;
/// Picked up or withdrawn.
const SETTLED: u8 = 3;

/// A decided waiter, as its future picks it up.
#[derive(Debug)]
pub(crate) enum Decided {
    Granted { revision: u64 },
    Refused(Rejection),
}

impl Waiter {
    fn new(call: Call, blocking: bool) -> Waiter {
        Waiter {
            call,
            status: AtomicU8::new(QUEUED),
            key: AtomicU64::new(0),
            revision: AtomicU64::new(0),
            refusal: Mutex::new(None),
            waker: AtomicWaker::default(),
            event: Event::new(),
            blocking,
        }
    }

    /// Takes the outcome if it has been decided. Called by the waiter's owner only.
    pub(crate) fn take_decided(&self) -> Option<Decided> {
        // Acquire: pairs with the Release publication in `grant`/`refuse`, so the revision or
        // the refusal written before it is visible.
        match self.status.load(Ordering::Acquire) {
            GRANTED => {
                self.status.store(SETTLED, Ordering::Relaxed);
                Some(Decided::Granted {
                    revision: self.revision.load(Ordering::Relaxed),
                })
            }
            REFUSED => {
                self.status.store(SETTLED, Ordering::Relaxed);
                let rejection = lock(&self.refusal).take().expect("a refusal is published");
                Some(Decided::Refused(rejection))
            }
            _ => None,
        }
    }

    /// Registers the task to wake when the outcome is decided. Check
    /// [`take_decided`](Waiter::take_decided) again afterwards, before returning `Pending`.
    pub(crate) fn register(&self, waker: &core::task::Waker) {
        self.waker.register(waker);
    }

    /// A listener for a blocked thread. Check [`take_decided`](Waiter::take_decided) again
    /// after creating it, before waiting on it.
    pub(crate) fn listen(&self) -> EventListener {
        debug_assert!(
            self.blocking,
            "only blocking waiters are notified through the event"
        );
        self.event.listen()
    }

    /// Under the queue lock: publishes the hand-off.
    fn grant(&self, revision: u64) {
        self.revision.store(revision, Ordering::Relaxed);
        self.status.store(GRANTED, Ordering::Release);
    }

    /// Under the queue lock: publishes a refusal.
    fn refuse(&self, rejection: Rejection) {
        *lock(&self.refusal) = Some(rejection);
        self.status.store(REFUSED, Ordering::Release);
    }

    /// After the queue lock is released: wakes the waiter. The waker is user code: its panic
    /// is caught, so it cannot keep the other waiters of a hand-off from being woken.
    fn wake(&self) {
        if self.blocking {
            self.event.notify(1);
        } else {
            crate::contain::contain(|| self.waker.wake());
        }
    }
}

fn pack_key(key: Key) -> u64 {
    let (index, generation) = key.into_parts();
    (u64::from(generation) << 32) | u64::from(index)
}

fn unpack_key(packed: u64) -> Key {
    Key::from_parts(packed as u32, (packed >> 32) as u32)
}

/// Waiters to wake once the queue lock is released. A pump usually hands over one slot, so
/// the first waiter is kept inline: no allocation under the lock in the common case.
#[derive(Default)]
pub(crate) struct Woken {
    first: Option<Arc<Waiter>>,
    rest: Vec<Arc<Waiter>>,
}

impl Woken {
    fn push(&mut self, waiter: Arc<Waiter>) {
        if self.first.is_none() {
            self.first = Some(waiter);
        } else {
            self.rest.push(waiter);
        }
    }

    fn wake_all(self) {
        for waiter in self.first.into_iter().chain(self.rest) {
            waiter.wake();
        }
    }
}

/// Hand-offs made under the queue lock, to be announced (woken) once no lock is held.
#[must_use = "the waiters handed capacity must be woken"]
#[derive(Default)]
pub(crate) struct HandedOff {
    woken: Woken,
    /// The state after the last waiter left, if the hand-offs emptied the queue.
    emptied: Option<State>,
}

impl HandedOff {
    /// Wakes the waiters, then the drainers if the queue emptied into an idle bulkhead. The
    /// caller holds no lock of the bulkhead.
    pub(crate) fn finish(self, inner: &crate::bulkhead::Inner) {
        self.woken.wake_all();
        if let Some(after) = self.emptied {
            inner.idle_check(after);
        }
    }
}

/// What a newcomer got from the queue's slow path.
#[derive(Debug)]
pub(crate) enum Arrival {
    /// A slot was free after all (checked again under the lock).
    Admitted { revision: u64 },
    /// Queued; wait on the waiter.
    Queued(Arc<Waiter>),
    /// Refused (already counted).
    Refused(Rejection),
}

/// What withdrawing a waiter found.
#[derive(Debug)]
pub(crate) enum Withdrawal {
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

impl crate::bulkhead::Inner {
    /// A newcomer found no free slot on the fast path: under the queue lock, decide again
    /// (a slot may have freed meanwhile) and queue it if the queue has room.
    pub(crate) fn arrive(&self, call: Call, blocking: bool) -> Arrival {
        let ask = call.ask;
        enum Step {
            Admitted(u64),
            Queue,
            Refused(RejectReason, State, Limits),
        }
        // Allocated before taking the lock, to keep the critical section short: a newcomer
        // that reached this slow path almost always queues.
        let waiter = Arc::new(Waiter::new(call, blocking));
        let mut list = lock(&self.queue.list);
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
                waiter.key.store(pack_key(key), Ordering::Relaxed);
                self.queue.publish_len(&list);
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
    pub(crate) fn pump(&self) {
        self.hand_off().finish(self);
    }

    /// The hand-offs of [`pump`](Inner::pump), made under the queue lock, without waking
    /// anyone: the caller wakes them with [`HandedOff::finish`] once it holds no lock of its
    /// own (a waker may poll its task inline, and the task's listeners may call back into the
    /// bulkhead).
    #[cold]
    pub(crate) fn hand_off(&self) -> HandedOff {
        let mut woken = Woken::default();
        let mut emptied = None;
        {
            let mut list = lock(&self.queue.list);
            while let Some(ask) = list.front().map(|head| head.call.ask) {
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
                        self.queue.publish_len(&list);
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
                        self.queue.publish_len(&list);
                        head.refuse(self.reject(reason, state, &limits, ask));
                        if last {
                            emptied = Some(after);
                        }
                        head
                    }
                };
                woken.push(head);
            }
            self.queue.publish_len(&list);
        }
        HandedOff { woken, emptied }
    }

    /// Takes `waiter` out of the queue because it gave up (`Aborted` or `Timeout`). Called by
    /// the waiter's owner only, at most once.
    pub(crate) fn withdraw(&self, waiter: &Waiter, reason: RejectReason) -> Withdrawal {
        let mut list = lock(&self.queue.list);
        // Relaxed: under the queue lock, which every publisher of the status holds.
        let status = waiter.status.swap(SETTLED, Ordering::Relaxed);
        match status {
            QUEUED => {
                let key = unpack_key(waiter.key.load(Ordering::Relaxed));
                let removed = list.remove(key);
                debug_assert!(removed.is_some(), "a queued waiter is in the list");
                self.queue.publish_len(&list);
                let emptied = list.is_empty().then(|| self.set_waiters_flag(false));
                drop(list);
                if let Some(after) = emptied {
                    self.idle_check(after);
                }
                let (state, limits) = self.snapshot();
                Withdrawal::Refused(self.reject(reason, state, &limits, waiter.call.ask))
            }
            GRANTED => {
                drop(list);
                self.count(Counter::HandedBack, 1);
                Withdrawal::Granted {
                    revision: waiter.revision.load(Ordering::Relaxed),
                }
            }
            REFUSED => Withdrawal::Refused(lock(&waiter.refusal).take().expect("published")),
            _ => unreachable!("a waiter is withdrawn at most once"),
        }
    }

    /// Refuses every waiter with `shutdown` (the bulkhead was just closed).
    ///
    /// Every refusal carries the capacity snapshot of the bulkhead after the close emptied the
    /// queue (`pending: 0` for all of them), as the original reports it.
    pub(crate) fn refuse_all_waiters(&self) {
        let mut woken = Vec::new();
        let emptied;
        {
            let mut list = lock(&self.queue.list);
            if list.is_empty() {
                return;
            }
            woken.extend(core::iter::from_fn(|| list.pop_front()));
            self.queue.publish_len(&list);
            emptied = self.set_waiters_flag(false);
            let (state, limits) = self.snapshot();
            for waiter in &woken {
                waiter.refuse(self.reject(RejectReason::Shutdown, state, &limits, waiter.call.ask));
            }
        }
        for waiter in woken {
            waiter.wake();
        }
        self.idle_check(emptied);
    }

    /// Sets or clears `WAITERS`; returns the state after. The caller holds the queue lock.
    fn set_waiters_flag(&self, on: bool) -> State {
        self.state
            .update(|s| {
                let next = s.with_waiters(on);
                Ok::<_, core::convert::Infallible>((next, next))
            })
            .unwrap_or_else(|never| match never {})
    }
}
