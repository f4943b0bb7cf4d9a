//! In-flight deduplication: the keys, the registry of shared calls in flight, and the shared
//! call itself ([`Flight`]), which any of its waiters drives.
//!
//! # Keys
//!
//! A call's key is a SHA-256 digest of its partition (the call's [`DedupScope`](crate::dedup::DedupScope), its admission
//! class) and of its raw key: by default the canonical form of the whole request's JSON
//! (`canonical.rs`: object keys sorted at every level, null members dropped so that an absent
//! optional field equals a null one, arrays in order); or what the bulkhead's key function
//! returns. The registry keeps the
//! digest and the result type, never the request. An empty raw key, or a key function that
//! panics, opts the call out.
//!
//! # The protocol
//!
//! The registry is sharded; each shard is a map from (digest, result type) to a flight, under
//! a mutex. A flight is a mutex over: the call's future (absent while a waiter polls it, and
//! once it finished or was dropped), its waiters' slots (a waker and, once finished, the
//! outcome), and who drives it. Lock order: a registry shard, then a flight. No user code runs
//! under either (the call is polled, the outcome shared and wakers woken after unlocking).
//!
//! - **Join** (under the shard lock, then the flight's): a live flight of the same key and type
//!   takes a new slot; otherwise the caller registers a new flight as its leader. A flight is
//!   live until it is removed from its shard, which happens before it finishes; so a joiner
//!   always finds a flight that will fill its slot.
//! - **Drive**: a waiter whose slot is empty takes the call out (so nobody else polls it),
//!   polls it unlocked with the flight's waker, and puts it back; a wake-up that arrives while
//!   it polls makes it poll again (`repoll`), so none is lost. The flight's waker wakes the
//!   last driver; a driver that leaves hands the call to another waiter and wakes it.
//! - **Finish**: the waiter that sees the call complete removes the flight from its shard
//!   (no one joins after that), marks it finished, takes the waiters' slots, shares the
//!   outcome with each follower outside the locks, fills the slots and wakes them; the leader
//!   gets the original outcome.
//! - **Leave** (a waiter dropped, or a follower's own timeout): under the shard lock and the
//!   flight's, its slot is removed; the last waiter of an unfinished call removes the flight
//!   from its shard and drops the call (after unlocking), which settles its admission.
//! - **Install**: the leader registers first and installs its call after unlocking (it
//!   resolves the call meanwhile: user code, the estimator, which may panic). A leader that
//!   leaves before installing (that panic unwinding through it) leaves nothing to drive: it
//!   removes the flight from its shard and finishes it with a panic for every follower that
//!   joined meanwhile, so none waits for a call that will never come.
//! - A call that panics while polled finishes the flight with a panic for every other waiter.

use core::any::{Any, TypeId};
use core::fmt;
use core::future::Future;
use core::pin::Pin;
use core::task::{Context, Poll, Waker};
use std::collections::HashMap;
use std::task::Wake;

use sha2::{Digest, Sha256};

use crate::support::contain::contain;
use crate::support::sync::unmodeled;
use crate::support::sync::unmodeled::{AtomicU64, Ordering};
use crate::support::sync::{Arc, Mutex, lock};
use crate::vocabulary::admission_class::AdmissionClass;

use super::canonical;
use super::options::DedupScope;
use super::request::LlmRequest;

/// Registry shards (a power of two): joins of different keys rarely share a lock.
const SHARDS: usize = 16;

/// The raw key function of a [`Deduplication`](crate::dedup::Deduplication).
type KeyFn = dyn Fn(&LlmRequest) -> String + Send + Sync;

/// In-flight deduplication for [`LlmBulkheadBuilder::deduplication`](crate::LlmBulkheadBuilder::deduplication):
/// when identical calls arrive together through [`run_shared`](crate::LlmBulkhead::run_shared),
/// one runs and the others share its outcome, taking no capacity.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{dedup::Deduplication, LlmBulkhead};
///
/// // By the whole request (its canonical JSON):
/// let bulkhead = LlmBulkhead::builder("m", 4).deduplication(Deduplication::new()).build()?;
/// // Or by a key of your own (an empty key opts a call out):
/// let by_user = LlmBulkhead::builder("m", 4)
///     .deduplication(Deduplication::by_key(|request| {
///         request.messages.last().map(|m| format!("{:?}", m.content)).unwrap_or_default()
///     }))
///     .build()?;
/// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct Deduplication {
    key: Option<unmodeled::Arc<KeyFn>>,
}

impl Deduplication {
    /// Deduplicates by the whole request: two calls share only when every field of their
    /// requests is equal (the order of JSON object keys does not matter, and an absent optional
    /// field equals a null one; arrays keep their order). The key is a SHA-256 digest of the
    /// request's canonical JSON (without the `serde` feature, of its typed fields, which are
    /// then all it has).
    ///
    /// # Examples
    ///
    /// ```
    /// let dedup = async_bulkhead_llm::dedup::Deduplication::new();
    /// # let _ = dedup;
    /// ```
    pub fn new() -> Deduplication {
        Deduplication { key: None }
    }

    /// Deduplicates by the key `key` returns for a request: two calls share when their keys
    /// are equal (in the same scope and class). An empty key, or a `key` that panics, runs
    /// that call on its own. Only a digest of the key is kept.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::dedup::Deduplication;
    ///
    /// let by_prompt = Deduplication::by_key(|request| {
    ///     request.messages.iter().map(|m| m.role.as_str()).collect::<Vec<_>>().join("/")
    /// });
    /// # let _ = by_prompt;
    /// ```
    pub fn by_key(key: impl Fn(&LlmRequest) -> String + Send + Sync + 'static) -> Deduplication {
        Deduplication {
            key: Some(unmodeled::Arc::new(key)),
        }
    }
}

impl Default for Deduplication {
    fn default() -> Deduplication {
        Deduplication::new()
    }
}

impl fmt::Debug for Deduplication {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Deduplication")
            .field(
                "key",
                &if self.key.is_some() {
                    "custom"
                } else {
                    "canonical request"
                },
            )
            .finish()
    }
}

/// A call's deduplication key: the digest of its partition and raw key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct Key([u8; 32]);

/// A registry entry's identity: the key and the type of the outcome shared.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Slot {
    key: Key,
    output: TypeId,
}

/// A shard's entries: each value is the `Arc<Flight<O>>` of the slot's `O`, as `Any`.
type Entries = HashMap<Slot, Entry>;

/// A flight as a registry entry: the `Arc` itself unsized to `Any` (one pointer to follow on a
/// join), or under `--cfg loom`, whose `Arc` cannot be unsized, the `Arc` boxed.
#[cfg(not(loom))]
type Entry = Arc<dyn Any + Send + Sync>;
#[cfg(loom)]
type Entry = Box<dyn Any + Send + Sync>;

#[cfg(not(loom))]
fn entry<O: Send + 'static>(flight: &Arc<Flight<O>>) -> Entry {
    Arc::clone(flight) as Entry
}

#[cfg(loom)]
fn entry<O: Send + 'static>(flight: &Arc<Flight<O>>) -> Entry {
    Box::new(Arc::clone(flight))
}

/// The flight of `entry` (whose slot says its type is `O`).
#[cfg(not(loom))]
fn flight_of<O: Send + 'static>(entry: &Entry) -> Arc<Flight<O>> {
    Arc::clone(entry)
        .downcast::<Flight<O>>()
        .unwrap_or_else(|_| unreachable!("an entry's type is part of its slot"))
}

#[cfg(loom)]
fn flight_of<O: Send + 'static>(entry: &Entry) -> Arc<Flight<O>> {
    Arc::clone(
        entry
            .downcast_ref::<Arc<Flight<O>>>()
            .unwrap_or_else(|| unreachable!("an entry's type is part of its slot")),
    )
}

/// Whether `entry` is `flight`.
#[cfg(not(loom))]
fn is_flight<O: Send + 'static>(entry: &Entry, flight: &Arc<Flight<O>>) -> bool {
    core::ptr::addr_eq(Arc::as_ptr(entry), Arc::as_ptr(flight))
}

#[cfg(loom)]
fn is_flight<O: Send + 'static>(entry: &Entry, flight: &Arc<Flight<O>>) -> bool {
    entry
        .downcast_ref::<Arc<Flight<O>>>()
        .is_some_and(|entry| Arc::ptr_eq(entry, flight))
}

type Shard = Mutex<Entries>;

/// The deduplication of one bulkhead: its key function, its registry and its counters.
pub(crate) struct Dedup {
    config: Deduplication,
    shards: Box<[Shard]>,
    active: AtomicU64,
    hits: AtomicU64,
    key_panics: AtomicU64,
}

impl Dedup {
    pub(crate) fn new(config: Deduplication) -> Dedup {
        Dedup {
            config,
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            active: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            key_panics: AtomicU64::new(0),
        }
    }

    /// `(active, hits, key_panics)`.
    pub(crate) fn figures(&self) -> (u64, u64, u64) {
        (
            self.active.load(Ordering::Relaxed),
            self.hits.load(Ordering::Relaxed),
            self.key_panics.load(Ordering::Relaxed),
        )
    }

    /// The key of `request` in `scope` and `class`, or `None` when the call opts out (an
    /// empty raw key, a key function that panicked, a request that cannot be serialized).
    pub(crate) fn key(
        &self,
        request: &LlmRequest,
        scope: Option<&DedupScope>,
        class: Option<AdmissionClass>,
    ) -> Option<Key> {
        let mut hasher = Sha256::new();
        // The partition first, in a fixed layout: no raw key can imitate another partition.
        match scope {
            Some(scope) => {
                hasher.update([1]);
                hasher.update(scope.digest());
            }
            None => hasher.update([0]),
        }
        match class {
            Some(class) => {
                hasher.update([1]);
                hasher.update((class.index() as u64).to_le_bytes());
            }
            None => hasher.update([0]),
        }
        match &self.config.key {
            Some(key) => {
                let mut raw = None;
                if contain(|| raw = Some(key(request))) {
                    self.key_panics.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
                let raw = raw.filter(|raw| !raw.is_empty())?;
                hasher.update(raw.as_bytes());
            }
            None => canonical::feed(request, &mut hasher),
        }
        Some(Key(hasher.finalize().into()))
    }

    fn shard(&self, key: &Key) -> &Shard {
        &self.shards[usize::from(key.0[0]) % SHARDS]
    }

    /// Joins the live flight of `key` for outcomes of type `O` as a follower, whose copy of the
    /// outcome `share` makes (made by `share` only then); or registers a new one with the
    /// caller as its leader, who then [`install`](Waiter::install)s its call and gets the
    /// original. Returns this caller's waiter and its role.
    pub(crate) fn join_or_lead<O: Send + 'static>(
        this: &Arc<Self>,
        key: Key,
        share: impl FnOnce() -> Share<O>,
    ) -> (Waiter<O>, Role) {
        let slot = Slot {
            key,
            output: TypeId::of::<O>(),
        };
        let mut shard = lock(this.shard(&key));
        if let Some(found) = shard.get(&slot) {
            let flight = flight_of::<O>(found);
            // Made before locking the flight (a box; no user code).
            let share = share();
            let (index, followers) = {
                let mut inner = lock(&flight.inner);
                let index = inner.add_waiter(Some(share));
                inner.followers += 1;
                (index, inner.followers)
            };
            drop(shard);
            this.hits.fetch_add(1, Ordering::Relaxed);
            return (
                Waiter::new(Arc::clone(this), flight, index),
                Role::Follower { followers },
            );
        }
        let flight = Flight::new(slot);
        let index = {
            let mut inner = lock(&flight.inner);
            let index = inner.add_waiter(None);
            inner.leader = Some(index);
            index
        };
        shard.insert(slot, entry(&flight));
        this.active.fetch_add(1, Ordering::Relaxed);
        drop(shard);
        (Waiter::new(Arc::clone(this), flight, index), Role::Leader)
    }

    /// Removes `flight` from its shard if it is still there.
    fn unregister<O: Send + 'static>(&self, flight: &Arc<Flight<O>>, shard: &mut Entries) {
        let slot = flight.slot;
        let same = shard
            .get(&slot)
            .is_some_and(|entry| is_flight(entry, flight));
        if same {
            shard.remove(&slot);
            self.active.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn shard_of<O>(&self, flight: &Flight<O>) -> &Shard {
        self.shard(&flight.slot.key)
    }
}

impl fmt::Debug for Dedup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (active, hits, key_panics) = self.figures();
        f.debug_struct("Dedup")
            .field("config", &self.config)
            .field("active", &active)
            .field("hits", &hits)
            .field("key_panics", &key_panics)
            .finish()
    }
}

/// Whether a caller leads a new shared call or follows one in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Leader,
    /// A follower; `followers` counts this one and those before it.
    Follower {
        followers: u64,
    },
}

/// What a waiter gets: the outcome, or the panic of the call or of the share hook.
pub(crate) enum Outcome<O> {
    Value(O),
    Panicked(Box<dyn Any + Send>),
}

/// The boxed future of a shared call.
pub(crate) type Call<O> = Pin<Box<dyn Future<Output = O> + Send>>;

/// How a flight gives followers their copy of the outcome (user code: it may panic).
pub(crate) type Share<O> = Box<dyn Fn(&O) -> O + Send + Sync>;

/// One shared call in flight (see the module docs for the protocol).
pub(crate) struct Flight<O> {
    inner: Mutex<Inner<O>>,
    /// Its registry slot.
    slot: Slot,
}

struct Inner<O> {
    /// The call; `None` until its leader installs it, while a waiter polls it, and once it
    /// finished or was dropped.
    call: Option<Call<O>>,
    /// The leader installed the call (a leader gone before that leaves nothing to drive).
    installed: bool,
    polling: bool,
    /// A wake-up arrived while a waiter polled the call.
    repoll: bool,
    /// The call finished (every slot filled) or was dropped.
    finished: bool,
    waiters: Slots<O>,
    live: usize,
    leader: Option<usize>,
    /// The waiter to wake when the call wakes.
    driver: Option<usize>,
    followers: u64,
}

struct WaiterSlot<O> {
    waker: Option<Waker>,
    /// Boxed: a slot stays small, so the first ones fit beside the flight's other fields.
    outcome: Option<Box<Outcome<O>>>,
    /// How a follower's copy of the outcome is made: its own `Sharing` (`None`: the leader,
    /// which gets the original). Taken out, and called and dropped unlocked, when the call
    /// finishes.
    share: Option<Share<O>>,
}

/// Waiters stored inline in the flight before this many (a join touches no other allocation).
const INLINE_WAITERS: usize = 2;

/// The waiters' slots, by index: the first inline, the others in a vector.
struct Slots<O> {
    inline: [Option<WaiterSlot<O>>; INLINE_WAITERS],
    more: Vec<Option<WaiterSlot<O>>>,
}

impl<O> Slots<O> {
    fn new() -> Slots<O> {
        Slots {
            inline: [None, None],
            more: Vec::new(),
        }
    }

    fn len(&self) -> usize {
        INLINE_WAITERS + self.more.len()
    }

    fn at(&mut self, index: usize) -> &mut Option<WaiterSlot<O>> {
        match index.checked_sub(INLINE_WAITERS) {
            None => &mut self.inline[index],
            Some(i) => &mut self.more[i],
        }
    }

    fn is_used(&self, index: usize) -> bool {
        match index.checked_sub(INLINE_WAITERS) {
            None => self.inline[index].is_some(),
            Some(i) => self.more[i].is_some(),
        }
    }

    /// Stores `slot` in the first free place; its index.
    fn insert(&mut self, slot: WaiterSlot<O>) -> usize {
        let free = (0..self.len()).find(|&i| !self.is_used(i));
        match free {
            Some(i) => {
                *self.at(i) = Some(slot);
                i
            }
            None => {
                self.more.push(Some(slot));
                self.len() - 1
            }
        }
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = &mut Option<WaiterSlot<O>>> {
        self.inline.iter_mut().chain(self.more.iter_mut())
    }
}

impl<O> Inner<O> {
    fn add_waiter(&mut self, share: Option<Share<O>>) -> usize {
        self.live += 1;
        let slot = WaiterSlot {
            waker: None,
            outcome: None,
            share,
        };
        self.waiters.insert(slot)
    }

    fn slot(&mut self, index: usize) -> &mut WaiterSlot<O> {
        self.waiters
            .at(index)
            .as_mut()
            .expect("a waiter's slot lives until it leaves")
    }

    /// Removes waiter `index`, returning its slot (its waker and outcome are dropped by the
    /// caller, after unlocking).
    fn remove(&mut self, index: usize) -> Option<WaiterSlot<O>> {
        let slot = self.waiters.at(index).take()?;
        self.live -= 1;
        if self.leader == Some(index) {
            self.leader = None;
        }
        if self.driver == Some(index) {
            self.driver = None;
        }
        Some(slot)
    }

    /// Takes the waker of some waiter still waiting (to hand the call to); the waiter
    /// registers a new one when it is polled.
    fn any_waker(&mut self) -> Option<(usize, Waker)> {
        self.waiters
            .iter_mut()
            .enumerate()
            .find_map(|(i, slot)| Some((i, slot.as_mut()?.waker.take()?)))
    }

    /// Finishes the flight with a panic (`message`) for every waiter still in it; their wakers,
    /// to wake after unlocking. The caller has removed the flight from its shard.
    fn fail(&mut self, message: &'static str) -> Vec<Waker> {
        self.finished = true;
        self.polling = false;
        self.waiters
            .iter_mut()
            .flatten()
            .filter_map(|slot| {
                slot.outcome = Some(Box::new(Outcome::Panicked(Box::new(message))));
                slot.waker.take()
            })
            .collect()
    }
}

/// What the other waiters of a call that panicked while polled get, as their panic.
const CALL_PANICKED: &str = "the shared call panicked while another caller polled it";
/// What the followers of a leader that panicked before installing its call get, as their panic.
const LEADER_PANICKED: &str =
    "the shared call's leader panicked before its call started (in the estimator or a listener)";

impl<O: Send + 'static> Flight<O> {
    /// A flight registered in `slot`; its leader installs the call.
    fn new(slot: Slot) -> Arc<Flight<O>> {
        Arc::new(Flight {
            inner: Mutex::new(Inner {
                call: None,
                installed: false,
                polling: false,
                repoll: false,
                finished: false,
                waiters: Slots::new(),
                live: 0,
                leader: None,
                driver: None,
                followers: 0,
            }),
            slot,
        })
    }
}

/// The flight's waker: wakes the waiter that drives the call (or makes the one polling it
/// poll again). It keeps the flight alive; the flight keeps it only inside its call, which is
/// dropped when the flight finishes or its last waiter leaves, so no cycle outlives the call.
struct FlightWaker<O>(Arc<Flight<O>>);

impl<O: Send + 'static> Wake for FlightWaker<O> {
    fn wake(self: unmodeled::Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &unmodeled::Arc<Self>) {
        let waker = {
            let mut inner = lock(&self.0.inner);
            if inner.polling {
                inner.repoll = true;
                None
            } else {
                match inner.driver {
                    Some(d) => inner.slot(d).waker.take(),
                    None => inner.any_waker().map(|(_, w)| w),
                }
            }
        };
        if let Some(waker) = waker {
            contain(|| waker.wake());
        }
    }
}

/// One caller waiting for a flight's outcome (the leader or a follower).
///
/// Dropping it before its outcome arrived leaves the flight (see the module docs).
pub(crate) struct Waiter<O: Send + 'static> {
    dedup: Arc<Dedup>,
    flight: Arc<Flight<O>>,
    /// Its slot; `None` once it left or took its outcome.
    index: Option<usize>,
    /// The waker the call is polled with, made once.
    waker: Option<Waker>,
}

impl<O: Send + 'static> Waiter<O> {
    fn new(dedup: Arc<Dedup>, flight: Arc<Flight<O>>, index: usize) -> Waiter<O> {
        Waiter {
            dedup,
            flight,
            index: Some(index),
            waker: None,
        }
    }

    /// Installs the call of the flight this waiter leads (made after registering, so that no
    /// user code ran under the registry's lock). Followers that joined meanwhile wait for it.
    /// A follower another thread polled before the call was here waits with its waker
    /// registered: it is woken to drive the call (the leader's own future may never be
    /// polled).
    pub(crate) fn install(&self, call: Call<O>) {
        let waker = {
            let mut inner = lock(&self.flight.inner);
            debug_assert!(
                inner.call.is_none() && !inner.finished,
                "installed once, first"
            );
            inner.call = Some(call);
            inner.installed = true;
            if inner.driver.is_none() {
                inner.any_waker().map(|(i, waker)| {
                    inner.driver = Some(i);
                    waker
                })
            } else {
                None
            }
        };
        if let Some(waker) = waker {
            contain(|| waker.wake());
        }
    }

    /// Polls for the outcome, driving the call if nobody else does.
    pub(crate) fn poll_outcome(&mut self, cx: &mut Context<'_>) -> Poll<Outcome<O>> {
        let index = self
            .index
            .expect("a waiter is not polled after it finished");
        // Wakers are cloned and dropped outside the lock (they are user code); under it they
        // are only moved and compared.
        let mut mine = Some(cx.waker().clone());
        let mut replaced = None;
        let call = {
            let mut inner = lock(&self.flight.inner);
            if let Some(outcome) = inner.slot(index).outcome.take() {
                let slot = inner.remove(index);
                drop(inner);
                drop(slot);
                self.index = None;
                return Poll::Ready(*outcome);
            }
            let slot = inner.slot(index);
            match &slot.waker {
                Some(w) if w.will_wake(cx.waker()) => {}
                _ => replaced = core::mem::replace(&mut slot.waker, mine.take()),
            }
            if inner.polling || inner.finished {
                None
            } else {
                inner.call.take().inspect(|_| {
                    inner.polling = true;
                    inner.repoll = false;
                    inner.driver = Some(index);
                })
            }
        };
        drop((mine, replaced));
        let Some(mut call) = call else {
            return Poll::Pending;
        };
        let waker = self.flight_waker();
        let mut guard = PollGuard {
            flight: &self.flight,
            dedup: &self.dedup,
            armed: true,
        };
        loop {
            let polled = call.as_mut().poll(&mut Context::from_waker(&waker));
            match polled {
                Poll::Ready(outcome) => {
                    guard.armed = false;
                    drop(call);
                    let own = self.finish(outcome, index);
                    self.index = None;
                    return Poll::Ready(own);
                }
                Poll::Pending => {
                    let mut inner = lock(&self.flight.inner);
                    if inner.repoll {
                        inner.repoll = false;
                        continue;
                    }
                    inner.call = Some(call);
                    inner.polling = false;
                    guard.armed = false;
                    return Poll::Pending;
                }
            }
        }
    }

    fn flight_waker(&mut self) -> Waker {
        self.waker
            .get_or_insert_with(|| {
                Waker::from(unmodeled::Arc::new(FlightWaker(Arc::clone(&self.flight))))
            })
            .clone()
    }

    /// Finishes the flight with `outcome` (this waiter polled it to completion): no one joins
    /// after this; every follower gets the copy its own share hook makes, the leader the
    /// original; returns this waiter's own.
    fn finish(&self, outcome: O, own: usize) -> Outcome<O> {
        let dedup = &*self.dedup;
        dedup.unregister(&self.flight, &mut lock(dedup.shard_of(&self.flight)));
        let (leader, followers) = {
            let mut inner = lock(&self.flight.inner);
            inner.finished = true;
            inner.polling = false;
            let leader = inner.leader;
            let followers: Vec<(usize, Share<O>)> = inner
                .waiters
                .iter_mut()
                .enumerate()
                .filter_map(|(i, slot)| Some((i, slot.as_mut()?.share.take()?)))
                .collect();
            (leader, followers)
        };
        // Shares are made unlocked (user code), then stored all at once; the hooks are dropped
        // here, unlocked too.
        let mut shares: Vec<(usize, Outcome<O>)> = followers
            .into_iter()
            .map(|(i, share)| (i, copy(&share, &outcome)))
            .collect();
        let mut own_outcome = None;
        let original = Outcome::Value(outcome);
        match leader {
            Some(l) if l == own => own_outcome = Some(original),
            Some(l) => shares.push((l, original)),
            None => drop(original),
        }
        if own_outcome.is_none() {
            let at = shares
                .iter()
                .position(|(i, _)| *i == own)
                .expect("the finishing waiter is a waiter");
            own_outcome = Some(shares.swap_remove(at).1);
        }
        // Outcomes of waiters that left meanwhile are dropped after unlocking (user types).
        let mut leftovers = Vec::new();
        let (wakers, removed): (Vec<Waker>, _) = {
            let mut inner = lock(&self.flight.inner);
            let removed = inner.remove(own);
            let wakers = shares
                .into_iter()
                .filter_map(|(i, outcome)| match inner.waiters.at(i).as_mut() {
                    Some(slot) => {
                        slot.outcome = Some(Box::new(outcome));
                        slot.waker.take()
                    }
                    None => {
                        leftovers.push(outcome);
                        None
                    }
                })
                .collect();
            (wakers, removed)
        };
        drop((leftovers, removed));
        for waker in wakers {
            contain(|| waker.wake());
        }
        own_outcome.expect("set above")
    }

    /// Leaves the flight before its outcome (dropped, or a follower's own timeout). The last
    /// waiter of an unfinished call drops the call; its outcome, if one arrived meanwhile, is
    /// returned.
    pub(crate) fn leave(&mut self) -> Option<Outcome<O>> {
        let index = self.index.take()?;
        let dedup = &*self.dedup;
        let mut shard = lock(dedup.shard_of(&self.flight));
        let mut inner = lock(&self.flight.inner);
        // Only the leader installs the call: a leader leaving before it did (something it
        // called on the way, such as the estimator, panicked) leaves nothing to drive.
        let orphaned = !inner.finished && !inner.installed && inner.leader == Some(index);
        let removed = inner.remove(index);
        let mut dropped = None;
        let mut wake = None;
        if orphaned {
            dedup.unregister(&self.flight, &mut shard);
            let wakers = inner.fail(LEADER_PANICKED);
            drop(inner);
            drop(shard);
            for waker in wakers {
                contain(|| waker.wake());
            }
            return removed
                .and_then(|slot| slot.outcome)
                .map(|outcome| *outcome);
        }
        if !inner.finished {
            if inner.live == 0 {
                inner.finished = true;
                dropped = inner.call.take();
                dedup.unregister(&self.flight, &mut shard);
            } else if inner.driver.is_none() && !inner.polling {
                // Hand the call to another waiter.
                wake = inner.any_waker().map(|(i, w)| {
                    inner.driver = Some(i);
                    w
                });
            }
        }
        drop(inner);
        drop(shard);
        if let Some(waker) = wake {
            contain(|| waker.wake());
        }
        // The call's future (and with it its admission) is dropped unlocked.
        drop(dropped);
        removed
            .and_then(|slot| slot.outcome)
            .map(|outcome| *outcome)
    }
}

impl<O: Send + 'static> Drop for Waiter<O> {
    fn drop(&mut self) {
        // An outcome that arrived meanwhile is dropped with it.
        drop(self.leave());
    }
}

/// A follower's copy of `outcome` made by its `share` hook, or the hook's panic.
fn copy<O>(share: &Share<O>, outcome: &O) -> Outcome<O> {
    match std::panic::catch_unwind(core::panic::AssertUnwindSafe(|| share(outcome))) {
        Ok(copy) => Outcome::Value(copy),
        Err(payload) => Outcome::Panicked(payload),
    }
}

/// Finishes the flight for the other waiters if the call panics while polled: they get a
/// panic of their own, the flight leaves the registry.
struct PollGuard<'a, O: Send + 'static> {
    flight: &'a Arc<Flight<O>>,
    dedup: &'a Dedup,
    armed: bool,
}

impl<O: Send + 'static> Drop for PollGuard<'_, O> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.dedup
            .unregister(self.flight, &mut lock(self.dedup.shard_of(self.flight)));
        let wakers = lock(&self.flight.inner).fail(CALL_PANICKED);
        for waker in wakers {
            contain(|| waker.wake());
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::{Dedup, Deduplication};
    use crate::llm::options::DedupScope;
    use crate::llm::request::LlmRequest;

    #[test]
    fn texts_that_escape_alike_still_get_different_keys() {
        let dedup = Dedup::new(Deduplication::new());
        let texts = [
            "a\"", "a\\\"", "a\u{1}", "a\\u0001", "a\\", "a", "a\n", "a\\n",
        ];
        let keys: Vec<_> = texts
            .iter()
            .map(|t| dedup.key(&LlmRequest::new().user(*t), None, None).unwrap())
            .collect();
        for (i, a) in keys.iter().enumerate() {
            for b in &keys[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn the_partition_is_part_of_the_key() {
        let dedup = Dedup::new(Deduplication::new());
        let request = LlmRequest::new().user("x");
        let none = dedup.key(&request, None, None).unwrap();
        let named = dedup
            .key(&request, Some(&DedupScope::new("")), None)
            .unwrap();
        let other = dedup
            .key(&request, Some(&DedupScope::new("t")), None)
            .unwrap();
        assert_ne!(none, named); // the unnamed scope is not the scope named ""
        assert_ne!(named, other);
        assert_eq!(none, dedup.key(&request, None, None).unwrap());
    }

    #[test]
    fn an_empty_custom_key_opts_out() {
        let dedup = Dedup::new(Deduplication::by_key(|_| String::new()));
        assert_eq!(dedup.key(&LlmRequest::new(), None, None), None);
    }
}
