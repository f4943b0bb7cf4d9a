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

use super::fifo::{Fifo, Key};
use super::policy::Ask;
use super::state::State;
use super::wait::Wait;
use crate::support::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use crate::support::sync::{Arc, AtomicWaker, Mutex, MutexGuard, lock};
use crate::vocabulary::admission_class::Resources;
use crate::vocabulary::rejection::Rejection;

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

    /// The list, locked. Every change through the guard republishes the length.
    pub(super) fn lock(&self) -> Locked<'_> {
        Locked {
            list: lock(&self.list),
            len: &self.len,
        }
    }
}

/// The locked list of a [`WaitQueue`]; its changes keep the published length current.
pub(super) struct Locked<'a> {
    list: MutexGuard<'a, Fifo<Arc<Waiter>>>,
    len: &'a AtomicU64,
}

impl Locked<'_> {
    pub(super) fn len(&self) -> usize {
        self.list.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub(super) fn front(&self) -> Option<&Arc<Waiter>> {
        self.list.front()
    }

    pub(super) fn push_back(&mut self, waiter: Arc<Waiter>) -> Key {
        let key = self.list.push_back(waiter);
        self.publish();
        key
    }

    pub(super) fn pop_front(&mut self) -> Option<Arc<Waiter>> {
        let waiter = self.list.pop_front();
        self.publish();
        waiter
    }

    pub(super) fn remove(&mut self, key: Key) -> Option<Arc<Waiter>> {
        let waiter = self.list.remove(key);
        self.publish();
        waiter
    }

    /// `Relaxed`: the length is a statistic (see [`WaitQueue::len`]).
    fn publish(&self) {
        self.len.store(self.list.len() as u64, Ordering::Relaxed);
    }
}

/// One waiting call.
///
/// Its fate is decided under the queue lock and published through `status`; the waiting
/// future reads it without the lock. Async waiters are woken through `waker` (no allocation);
/// blocked threads park on `event`.
#[derive(Debug)]
pub(crate) struct Waiter {
    /// What it asks for.
    ask: Ask,
    /// `QUEUED`, `GRANTED`, `REFUSED` or `SETTLED`.
    status: AtomicU8,
    /// The waiter's key in the list, packed; read and written under the queue lock only.
    key: AtomicU64,
    /// The limit revision of the hand-off; written before `GRANTED` is published.
    revision: AtomicU64,
    /// What the hand-off borrowed of the shared pool (tokens, and the slot in the top bit);
    /// written before `GRANTED` is published.
    borrowed: AtomicU64,
    /// The refusal; written before `REFUSED` is published. Boxed: a refusal while queued is
    /// rare (a close, tokens that no longer fit at the head's turn), and the waiter that
    /// every queued call allocates and both threads of a hand-off touch stays small.
    refusal: Mutex<Option<Box<Rejection>>>,
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

/// What a waiter was when its owner withdrew it.
#[derive(Debug)]
pub(super) enum Withdrawn {
    /// Still in the queue, at this key.
    Queued(Key),
    /// Already decided.
    Decided(Decided),
}

/// A decided waiter, as its owner picks it up.
#[derive(Debug)]
pub(super) enum Decided {
    Granted { revision: u64, borrowed: Resources },
    Refused(Rejection),
}

impl Waiter {
    /// A waiter not yet queued; an async one with its task's waker already registered.
    pub(super) fn new(ask: Ask, wait: Wait<'_>) -> Waiter {
        let waiter = Waiter {
            ask,
            status: AtomicU8::new(QUEUED),
            key: AtomicU64::new(0),
            revision: AtomicU64::new(0),
            borrowed: AtomicU64::new(0),
            refusal: Mutex::new(None),
            waker: AtomicWaker::default(),
            event: Event::new(),
            blocking: matches!(wait, Wait::Blocking),
        };
        if let Wait::Async(waker) = wait {
            waiter.waker.register(waker);
        }
        waiter
    }

    /// Makes a waiter taken from the pool (nobody else holds it) the waiter of a new call:
    /// only what is read before it is written again changes (its key, revision and borrowed
    /// resources are written before they are read; its refusal is empty; its event is reused).
    #[cfg(not(loom))]
    pub(super) fn reuse(&mut self, ask: Ask, wait: Wait<'_>) {
        self.ask = ask;
        *self.status.get_mut() = QUEUED;
        self.blocking = matches!(wait, Wait::Blocking);
        if let Wait::Async(waker) = wait {
            self.waker.register(waker);
        }
    }

    /// Takes out the waker it still holds (after a timeout or a cancellation: a wake-up took
    /// it otherwise), for the pool; its refusal, if it had one, was taken by whoever decided
    /// its fate.
    #[cfg(not(loom))]
    pub(super) fn forget_waker(&self) -> Option<core::task::Waker> {
        debug_assert!(
            lock(&self.refusal).is_none(),
            "a published refusal is always taken"
        );
        self.waker.take()
    }

    /// What it asks for.
    pub(super) fn ask(&self) -> Ask {
        self.ask
    }

    /// Takes the outcome if it has been decided. Called by the waiter's owner only.
    pub(super) fn take_decided(&self) -> Option<Decided> {
        // Acquire: pairs with the Release publication in `grant`/`refuse`, so the revision or
        // the refusal written before it is visible.
        match self.status.load(Ordering::Acquire) {
            GRANTED => {
                self.status.store(SETTLED, Ordering::Relaxed);
                Some(self.granted())
            }
            REFUSED => {
                self.status.store(SETTLED, Ordering::Relaxed);
                let rejection = lock(&self.refusal).take().expect("a refusal is published");
                Some(Decided::Refused(*rejection))
            }
            _ => None,
        }
    }

    /// Registers the task to wake when the outcome is decided. Check
    /// [`Engine::pick_up`] again afterwards, before returning `Pending`.
    pub(crate) fn register(&self, waker: &core::task::Waker) {
        self.waker.register(waker);
    }

    /// A listener for a blocked thread. Check [`Engine::pick_up`] again
    /// after creating it, before waiting on it.
    pub(crate) fn listen(&self) -> EventListener {
        debug_assert!(
            self.blocking,
            "only blocking waiters are notified through the event"
        );
        self.event.listen()
    }

    /// Under the queue lock: records where the waiter is in the list.
    pub(super) fn set_key(&self, key: Key) {
        // Relaxed: read and written under the queue lock only.
        self.key.store(pack_key(key), Ordering::Relaxed);
    }

    /// Under the queue lock: settles the waiter for its owner, who gives up waiting; returns
    /// what it was (still queued, with its key; or decided).
    pub(super) fn withdraw(&self) -> Withdrawn {
        // Relaxed: under the queue lock, which every publisher of the status holds.
        match self.status.swap(SETTLED, Ordering::Relaxed) {
            QUEUED => Withdrawn::Queued(unpack_key(self.key.load(Ordering::Relaxed))),
            GRANTED => Withdrawn::Decided(self.granted()),
            REFUSED => Withdrawn::Decided(Decided::Refused(
                *lock(&self.refusal).take().expect("a refusal is published"),
            )),
            _ => unreachable!("a waiter is withdrawn at most once"),
        }
    }

    /// Under the queue lock: publishes the hand-off, made under `revision`, which borrowed
    /// `borrowed`.
    pub(super) fn grant(&self, revision: u64, borrowed: Resources) {
        self.revision.store(revision, Ordering::Relaxed);
        let borrowed = borrowed.borrowed_tokens | (u64::from(borrowed.borrowed_concurrency) << 63);
        self.borrowed.store(borrowed, Ordering::Relaxed);
        self.status.store(GRANTED, Ordering::Release);
    }

    /// The hand-off, once `GRANTED` was read with `Acquire` (or under the queue lock).
    fn granted(&self) -> Decided {
        // Relaxed: published before `GRANTED` (Release), which the caller has seen.
        let borrowed = self.borrowed.load(Ordering::Relaxed);
        Decided::Granted {
            revision: self.revision.load(Ordering::Relaxed),
            borrowed: Resources {
                borrowed_concurrency: borrowed >> 63 == 1,
                borrowed_tokens: borrowed & !(1 << 63),
            },
        }
    }

    /// Under the queue lock: publishes a refusal.
    pub(super) fn refuse(&self, rejection: Rejection) {
        *lock(&self.refusal) = Some(Box::new(rejection));
        self.status.store(REFUSED, Ordering::Release);
    }

    /// After the queue lock is released: wakes the waiter. The waker is user code: its panic
    /// is caught, so it cannot keep the other waiters of a hand-off from being woken.
    pub(super) fn wake(&self) {
        if self.blocking {
            self.event.notify(1);
        } else {
            crate::support::contain::contain(|| self.waker.wake());
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
pub(super) struct Woken {
    first: Option<Arc<Waiter>>,
    rest: Vec<Arc<Waiter>>,
}

impl Woken {
    pub(super) fn push(&mut self, waiter: Arc<Waiter>) {
        if self.first.is_none() {
            self.first = Some(waiter);
        } else {
            self.rest.push(waiter);
        }
    }

    pub(super) fn wake_all(self) {
        for waiter in self.first.into_iter().chain(self.rest) {
            waiter.wake();
        }
    }
}

/// Hand-offs made under the queue lock, to be announced (woken) once no lock is held.
#[must_use = "the waiters handed capacity must be woken"]
#[derive(Default)]
pub(super) struct HandedOff {
    pub(super) woken: Woken,
    /// The state after the last waiter left, if the hand-offs emptied the queue.
    pub(super) emptied: Option<State>,
}

/// What a newcomer got from the queue's slow path.
#[derive(Debug)]
pub(super) enum Arrival {
    /// A slot was free after all (checked again under the lock).
    Admitted { revision: u64, borrowed: Resources },
    /// Queued; wait on the waiter (the caller's handle wraps it).
    Queued(Arc<Waiter>),
    /// Refused (already counted).
    Refused(Rejection),
}
