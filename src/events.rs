//! Typed lifecycle events and their listeners.
//!
//! # Delivery
//!
//! Listeners are called synchronously, on the thread where the event happens, in registration
//! order, and never while the bulkhead holds a lock of its own: a listener may call
//! `stats()`, `apply_limits()` or even acquire. A panicking listener is caught; the panic is
//! counted in [`Stats::listener_panics`](crate::Stats::listener_panics) and the other listeners
//! and the operation carry on. For a call that waited in the queue, its admit or reject event is
//! delivered where its acquire is polled (or dropped), to the listeners subscribed at that
//! moment, including those that subscribed while it waited.
//!
//! # Unsubscribing
//!
//! Dropping a [`Subscription`] removes its listener before the drop returns: an event whose
//! delivery starts after that (on any thread that synchronizes with the drop, and always on
//! the dropping thread) never reaches it. A delivery that another thread had already started
//! took its copy of the listener list before the drop, and may still call the listener, once,
//! while or after the drop returns. The drop does not wait for such calls: waiting would
//! deadlock a listener that drops its own subscription, and would put a shared counter on
//! every delivery. A listener that must not run after some point should check a flag of its
//! own that is cleared before the drop.
//!
//! # Cost
//!
//! Each event kind has a bit in one atomic mask, set while at least one listener wants that
//! kind. Emitting an event nobody listens to is one relaxed load and a branch: no allocation,
//! no lock, and no clock read (admission timing is measured only while someone listens to admit
//! or reject events).
//!
//! # Sampling
//!
//! A listener on every admission costs a delivery (and two clock reads) per call, several times
//! the admission itself. A *sampled* subscription
//! ([`on_events_sampled`](crate::LlmBulkhead::on_events_sampled)) hears only some calls: one
//! call in `every` on each thread (a per-thread countdown decides, when the call's decision
//! starts), and every call that waited in the queue (a wait already costs far more than its
//! event). A sampled call stays sampled for its whole life: the listener hears its admit or
//! reject event, and its usage, abandonment and release events. Events that are not about one
//! call's fast path (reconfigure, bypass, deduplication) reach sampled listeners every time.
//! The other calls cost one relaxed load, a branch and a decrement of a thread-local counter.
//! Several sampled subscriptions share one rate, the highest asked for (the smallest `every`).

use core::fmt;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::support::sync::unmodeled::{
    Arc, AtomicU32, AtomicU64, Mutex, Ordering, Weak, fence, lock,
};
use crate::vocabulary::admission_class::{AbandonCause, AdmissionClass, Resources};
use crate::vocabulary::admission_id::{AdmissionId, ShadowId};
use crate::vocabulary::limits::Limits;
use crate::vocabulary::priority::Priority;
use crate::vocabulary::rejection::{CapacityDetail, RejectReason};
use crate::vocabulary::reservation::{Progressive, Reservation, TokenUsage};

/// The kinds of events, to subscribe to some of them.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::events::EventKind;
///
/// assert_eq!(EventKind::ALL.len(), 10);
/// assert_eq!(EventKind::Admit.as_str(), "admit");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum EventKind {
    /// A call was admitted.
    Admit,
    /// A call was refused.
    Reject,
    /// An admission reported usage that changed its cumulative usage or its hold.
    Usage,
    /// An admission was settled.
    Release,
    /// New limits were applied.
    Reconfigure,
    /// An admission gave its borrowed slot back before settling.
    BorrowedConcurrencyAbandon,
    /// An observe-mode call the bulkhead refused runs anyway (bypassed).
    Bypass,
    /// A bypassed call reported usage that changed its cumulative usage.
    BypassUsage,
    /// A bypassed call finished.
    BypassRelease,
    /// A call joined an identical call in flight (deduplication).
    Dedup,
}

impl EventKind {
    /// Every kind, in declaration order. A slice, so that adding a kind (the enum is
    /// `#[non_exhaustive]`) changes no type.
    pub const ALL: &'static [EventKind] = &[
        EventKind::Admit,
        EventKind::Reject,
        EventKind::Usage,
        EventKind::Release,
        EventKind::Reconfigure,
        EventKind::BorrowedConcurrencyAbandon,
        EventKind::Bypass,
        EventKind::BypassUsage,
        EventKind::BypassRelease,
        EventKind::Dedup,
    ];

    /// The kind's wire name, in snake_case like every name the crate prints
    /// ([`RejectReason::as_str`](crate::RejectReason::as_str), the serialized fields of
    /// [`Stats`](crate::Stats) and [`Limits`]).
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::events::EventKind::Reconfigure.as_str(), "reconfigure");
    /// ```
    pub const fn as_str(self) -> &'static str {
        match self {
            EventKind::Admit => "admit",
            EventKind::Reject => "reject",
            EventKind::Usage => "usage",
            EventKind::Release => "release",
            EventKind::Reconfigure => "reconfigure",
            EventKind::BorrowedConcurrencyAbandon => "borrowed_concurrency_abandon",
            EventKind::Bypass => "bypass",
            EventKind::BypassUsage => "bypass_usage",
            EventKind::BypassRelease => "bypass_release",
            EventKind::Dedup => "dedup",
        }
    }

    #[inline]
    pub(crate) const fn bit(self) -> u64 {
        1 << self as u32
    }

    /// The kind's bit among sampled listeners' kinds.
    #[inline]
    pub(crate) const fn sampled_bit(self) -> u64 {
        self.bit() << SAMPLED_SHIFT
    }
}

/// Sampled listeners' kinds sit this far above the kinds' own bits, in the same mask: one load
/// tells both.
const SAMPLED_SHIFT: u32 = 32;

/// A lifecycle event, as a listener receives it.
///
/// # Examples
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use async_bulkhead_llm::{AcquireOptions, events::Event, LlmBulkhead, LlmRequest};
///
/// let bulkhead = LlmBulkhead::builder("m", 1).build()?;
/// let seen = Arc::new(Mutex::new(Vec::new()));
/// let log = seen.clone();
/// let _subscription = bulkhead.on(move |event: &Event<'_>| log.lock().unwrap().push(event.kind()));
///
/// let permit = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
/// let _ = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()); // refused
/// drop(permit);
/// use async_bulkhead_llm::events::EventKind::*;
/// assert_eq!(*seen.lock().unwrap(), [Admit, Reject, Release]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum Event<'a> {
    /// See [`AdmitEvent`].
    Admit(&'a AdmitEvent),
    /// See [`RejectEvent`].
    Reject(&'a RejectEvent),
    /// See [`UsageEvent`].
    Usage(&'a UsageEvent),
    /// See [`ReleaseEvent`].
    Release(&'a ReleaseEvent),
    /// See [`ReconfigureEvent`].
    Reconfigure(&'a ReconfigureEvent),
    /// See [`BorrowedConcurrencyAbandonEvent`].
    BorrowedConcurrencyAbandon(&'a BorrowedConcurrencyAbandonEvent),
    /// See [`BypassEvent`].
    Bypass(&'a BypassEvent),
    /// See [`BypassUsageEvent`].
    BypassUsage(&'a BypassUsageEvent),
    /// See [`BypassReleaseEvent`].
    BypassRelease(&'a BypassReleaseEvent),
    /// See [`DedupEvent`].
    Dedup(&'a DedupEvent),
}

impl Event<'_> {
    /// The event's kind.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use async_bulkhead_llm::{AcquireOptions, events::EventKind, LlmBulkhead, LlmRequest};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 1).build()?;
    /// let kinds = Arc::new(Mutex::new(Vec::new()));
    /// let seen = kinds.clone();
    /// let _subscription = bulkhead.on(move |event| seen.lock().unwrap().push(event.kind()));
    /// bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?.release(None);
    /// assert_eq!(*kinds.lock().unwrap(), [EventKind::Admit, EventKind::Release]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn kind(&self) -> EventKind {
        match self {
            Event::Admit(_) => EventKind::Admit,
            Event::Reject(_) => EventKind::Reject,
            Event::Usage(_) => EventKind::Usage,
            Event::Release(_) => EventKind::Release,
            Event::Reconfigure(_) => EventKind::Reconfigure,
            Event::BorrowedConcurrencyAbandon(_) => EventKind::BorrowedConcurrencyAbandon,
            Event::Bypass(_) => EventKind::Bypass,
            Event::BypassUsage(_) => EventKind::BypassUsage,
            Event::BypassRelease(_) => EventKind::BypassRelease,
            Event::Dedup(_) => EventKind::Dedup,
        }
    }
}

/// A call was admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AdmitEvent {
    /// The admission's id.
    pub admission_id: AdmissionId,
    /// Revision of the limits that admitted it.
    pub limit_revision: u64,
    /// Its priority.
    pub priority: Priority,
    /// Its admission class (with classes).
    pub class: Option<AdmissionClass>,
    /// Tokens reserved (0 without a token budget).
    pub reserved_tokens: u64,
    /// What it borrowed from the shared pool.
    pub resources: Resources,
    /// Time spent deciding, queue wait excluded (estimation excluded too). For a call that
    /// waited and that nobody timed when it arrived (no listener then), only the part after
    /// the wait.
    pub decision_duration: Duration,
    /// Time spent waiting in the queue (zero for a call admitted at once).
    pub queue_wait: Duration,
}

/// A call was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RejectEvent {
    /// Why.
    pub reason: RejectReason,
    /// The call's admission class (with classes).
    pub class: Option<AdmissionClass>,
    /// Revision of the limits in force at the decision.
    pub limit_revision: u64,
    /// The capacity snapshot of the decision.
    pub detail: CapacityDetail,
    /// Time spent deciding, queue wait excluded. For a call that waited and that nobody timed
    /// when it arrived (no listener then), only the part after the wait.
    ///
    /// Zero, with `queue_wait`, for a refusal announced untimed: a deduplication follower's own
    /// wait, a bypass's hard refusal, and in observe mode a refusal the call then bypasses as
    /// a race (as the original announces them).
    pub decision_duration: Duration,
    /// Time spent waiting in the queue (zero for a refusal decided before any wait, and for an
    /// untimed one).
    pub queue_wait: Duration,
}

/// An admission reported usage that changed its cumulative usage or its hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct UsageEvent {
    /// The admission's id.
    pub admission_id: AdmissionId,
    /// Revision of the limits that admitted it.
    pub limit_revision: u64,
    /// Its priority.
    pub priority: Priority,
    /// Its admission class (with classes).
    pub class: Option<AdmissionClass>,
    /// 1 for the first effective report, then +1 for each.
    pub sequence: u64,
    /// Tokens originally reserved (0 without a token budget).
    pub reserved_tokens: u64,
    /// The hold before this report.
    pub previous_held_tokens: u64,
    /// The hold now.
    pub held_tokens: u64,
    /// `held_tokens - previous_held_tokens`.
    pub delta_tokens: i128,
    /// The cumulative usage (per-field maximum of every report).
    pub usage: TokenUsage,
    /// The reservation's maximum output (`None` without a token budget).
    pub output_cap: Option<u64>,
    /// `output_cap - usage.output`, at least 0 (`None` without a token budget).
    pub output_remaining: Option<u64>,
    /// Whether the usage already exceeds the reservation.
    pub over_reservation: bool,
    /// The progressive reconciliation of this report, if it was one.
    pub progressive: Option<Progressive>,
}

/// An admission was settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReleaseEvent {
    /// The admission's id.
    pub admission_id: AdmissionId,
    /// Revision of the limits that admitted it.
    pub limit_revision: u64,
    /// Its priority.
    pub priority: Priority,
    /// Its admission class (with classes).
    pub class: Option<AdmissionClass>,
    /// What it borrowed from the shared pool when it was admitted.
    pub resources: Resources,
    /// Tokens originally reserved (0 without a token budget).
    pub reserved_tokens: u64,
    /// The hold just before release (all returned now).
    pub held_tokens: u64,
    /// Part of the hold the usage did not consume (refunded at release).
    pub refunded_tokens: u64,
    /// Tokens the release returned to the budget: its whole hold, usage known or not (see
    /// [`ReleaseReport::returned_tokens`](crate::usage::ReleaseReport::returned_tokens)).
    pub returned_tokens: u64,
    /// Tokens the admission gave back over its life: its reports' refunds plus
    /// `returned_tokens` (see
    /// [`ReleaseReport::returned_total_tokens`](crate::usage::ReleaseReport::returned_total_tokens)).
    pub returned_total_tokens: u64,
    /// Number of effective usage reports before release.
    pub usage_sequence: u64,
    /// The usage it was settled with: explicit, else the last reported, else none.
    pub usage: Option<TokenUsage>,
}

/// New limits were applied.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReconfigureEvent {
    /// The limits replaced.
    pub previous: Limits,
    /// The limits now in force.
    pub current: Limits,
}

/// An admission gave its borrowed slot back before settling: by
/// [`abandon_borrowed_concurrency`](crate::Permit::abandon_borrowed_concurrency), or because a
/// `run`'s borrowed-slot deadline expired. Its tokens stay held until it settles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BorrowedConcurrencyAbandonEvent {
    /// The admission's id.
    pub admission_id: AdmissionId,
    /// Revision of the limits that admitted it.
    pub limit_revision: u64,
    /// Its priority.
    pub priority: Priority,
    /// Its admission class.
    pub class: Option<AdmissionClass>,
    /// What it borrowed when it was admitted.
    pub resources: Resources,
    /// Why it gave the slot back.
    pub cause: AbandonCause,
    /// The tokens it still holds.
    pub held_tokens: u64,
}

/// An observe-mode call the bulkhead refused runs anyway, holding no capacity (see
/// [`RunOptions::observe`](crate::RunOptions::observe)). A refusal the advisory check predicted
/// (`raced: false`, except for a follower, below) was not counted as a rejection and emitted no
/// reject event; one the admission itself made (`raced: true`, or a queue timeout) was both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BypassEvent {
    /// The bypass's id (`shadow-…`).
    pub shadow_id: ShadowId,
    /// Revision of the limits that refused the call.
    pub limit_revision: u64,
    /// The call's priority.
    pub priority: Priority,
    /// The call's admission class (with classes).
    pub class: Option<AdmissionClass>,
    /// Why the bulkhead refused it.
    pub reason: RejectReason,
    /// The capacity snapshot of the refusal (none for a deduplication follower whose own
    /// wait timed out).
    pub detail: Option<CapacityDetail>,
    /// The reservation it would have held (none without a token budget).
    pub reservation: Option<Reservation>,
    /// Whether the advisory check said "admit" or "queue" and the admission then refused.
    pub raced: bool,
}

/// A bypassed call reported usage that changed its cumulative usage (it holds nothing, so a
/// progressive reconciliation alone changes nothing and emits nothing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BypassUsageEvent {
    /// The bypass's id.
    pub shadow_id: ShadowId,
    /// Revision of the limits that refused the call.
    pub limit_revision: u64,
    /// The call's priority.
    pub priority: Priority,
    /// The call's admission class (with classes).
    pub class: Option<AdmissionClass>,
    /// Why the bulkhead refused it.
    pub reason: RejectReason,
    /// 1 for the first effective report, then +1 for each.
    pub sequence: u64,
    /// The reservation it would have held.
    pub reservation: Option<Reservation>,
    /// The cumulative usage (per-field maximum of every report).
    pub usage: TokenUsage,
    /// The would-be reservation's maximum output (`None` without a token budget).
    pub output_cap: Option<u64>,
    /// `output_cap - usage.output`, at least 0.
    pub output_remaining: Option<u64>,
    /// Whether the usage already exceeds the would-be reservation.
    pub over_reservation: bool,
    /// The progressive reconciliation of this report, if it was one.
    pub progressive: Option<Progressive>,
}

/// A bypassed call finished (its callback returned or failed, or its future was dropped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BypassReleaseEvent {
    /// The bypass's id.
    pub shadow_id: ShadowId,
    /// Revision of the limits that refused the call.
    pub limit_revision: u64,
    /// The call's priority.
    pub priority: Priority,
    /// The call's admission class (with classes).
    pub class: Option<AdmissionClass>,
    /// Why the bulkhead refused it.
    pub reason: RejectReason,
    /// The reservation it would have held.
    pub reservation: Option<Reservation>,
    /// Effective usage reports before it finished.
    pub usage_sequence: u64,
    /// The usage it finished with: extracted from its result, else the last reported.
    pub usage: Option<TokenUsage>,
}

/// A call joined an identical call in flight: it takes no capacity and will get that call's
/// outcome (see [`Deduplication`](crate::dedup::Deduplication)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DedupEvent {
    /// The admission class of both calls (with classes).
    pub class: Option<AdmissionClass>,
    /// Followers of this call so far, this one included.
    pub followers: u64,
}

type Listener = Box<dyn Fn(&Event<'_>) + Send + Sync>;

struct Entry {
    id: u64,
    /// The kinds' bits (`EventKind::bit`), or for a sampled listener their sampled bits.
    kinds: u64,
    /// A sampled listener's rate (one call in `every`); 0 for a listener on every call.
    every: u32,
    listener: Listener,
}

/// The listeners of one bulkhead.
///
/// Emitting reads the current list through an [`ArcSwap`]: no lock and no write to a shared
/// cache line, so listening threads do not serialise on each other. Subscribing and
/// unsubscribing (rare) copy the list under `writer` and swap the copy in.
#[derive(Default)]
pub(crate) struct Listeners {
    /// One bit per [`EventKind`](crate::events::EventKind) with at least one listener on every call, and one
    /// (`EventKind::sampled_bit`) per kind with at least one sampled listener.
    active: AtomicU64,
    /// The sampling rate: one call in this many (the smallest `every` of the sampled
    /// listeners; 0 without any).
    sample_every: AtomicU32,
    /// The listeners, in registration order.
    entries: ArcSwap<Vec<Arc<Entry>>>,
    /// Serialises subscribing and unsubscribing.
    writer: Mutex<()>,
    next_id: AtomicU64,
    panics: AtomicU64,
}

impl Listeners {
    /// Whether anyone listens to `kind` for a call that is `sampled` or not: listeners on
    /// every call always, sampled listeners only for a sampled call.
    ///
    /// `Relaxed`: a listener registered concurrently with an event may or may not see it;
    /// one registered before the event (happens-before) is seen because registration and the
    /// event's own synchronisation (the caller's) order them.
    #[inline]
    pub(crate) fn hears(&self, kind: EventKind, sampled: bool) -> bool {
        self.active.load(Ordering::Relaxed) & audience(kind, sampled) != 0
    }

    /// The mask of kinds listened to (see `active`), for a caller that tests several bits
    /// with one load.
    #[inline]
    pub(crate) fn mask(&self) -> u64 {
        self.active.load(Ordering::Relaxed)
    }

    /// Whether the call whose decision starts now on this thread is sampled: one in
    /// `sample_every`, counted down per thread.
    #[inline]
    pub(crate) fn sample(&self) -> bool {
        let every = self.sample_every.load(Ordering::Relaxed);
        if every == 0 {
            return false;
        }
        SAMPLE_COUNTDOWN.with(|left| match left.get() {
            0 => {
                left.set(every - 1);
                true
            }
            n => {
                left.set(n - 1);
                false
            }
        })
    }

    /// Delivers `event` to its listeners: those on every call, and the sampled ones when
    /// `sampled` (the caller checked [`hears`](Listeners::hears)).
    #[cold]
    pub(crate) fn emit(&self, event: &Event<'_>, sampled: bool) {
        let bits = audience(event.kind(), sampled);
        // Acquire: with the relaxed loads of the mask before it, synchronizes with the
        // `Release` store of the mask they read (see `publish`), so the list loaded below is at
        // least the one published with that mask. Off the fast path: only a call someone
        // listens to gets here.
        fence(Ordering::Acquire);
        let entries = self.entries.load();
        for entry in entries.iter().filter(|e| e.kinds & bits != 0) {
            // A listener's panic must not unwind into the bulkhead's bookkeeping.
            if crate::support::contain::contain(|| (entry.listener)(event)) {
                self.panics.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Listener panics caught so far.
    pub(crate) fn panics(&self) -> u64 {
        self.panics.load(Ordering::Relaxed)
    }

    fn add(&self, kinds: u64, every: u32, listener: Listener) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let _writer = lock(&self.writer);
        let mut next: Vec<Arc<Entry>> = self.entries.load().iter().cloned().collect();
        next.push(Arc::new(Entry {
            id,
            kinds,
            every,
            listener,
        }));
        self.publish(next);
        id
    }

    fn remove(&self, id: u64) {
        let _writer = lock(&self.writer);
        let next = self
            .entries
            .load()
            .iter()
            .filter(|e| e.id != id)
            .cloned()
            .collect();
        self.publish(next);
    }

    /// Installs `next` (the caller holds `writer`): the list first, then the rate and the
    /// mask. A call decides whether anyone listens (and whether it is sampled) from the mask,
    /// and its events are delivered to the list as it is then; a bit set before its listener
    /// is in the list would let a call be sampled for a listener its admit event then misses,
    /// while that listener still hears the call's later events (a release without its
    /// admission: `tests/events/sampling.rs` caught it). `Release`, paired with the `Acquire`
    /// fence in [`emit`](Listeners::emit): whoever read the new mask (with a relaxed load, on
    /// the fast path) and then emits sees the list published before it.
    fn publish(&self, next: Vec<Arc<Entry>>) {
        let every = next
            .iter()
            .map(|e| e.every)
            .filter(|&every| every > 0)
            .min()
            .unwrap_or(0);
        let bits = mask(&next);
        self.entries.store(Arc::new(next));
        self.sample_every.store(every, Ordering::Release);
        self.active.store(bits, Ordering::Release);
    }
}

/// The bits of the listeners that hear an event of `kind` about a call that is `sampled` or
/// not.
#[inline]
const fn audience(kind: EventKind, sampled: bool) -> u64 {
    if sampled {
        kind.bit() | kind.sampled_bit()
    } else {
        kind.bit()
    }
}

// Calls left before this thread's next sampled call (see [`Listeners::sample`]); one per
// modelled thread under loom, so a model's first call on a thread is sampled in every run.
crate::support::sync::thread_local_cell!(SAMPLE_COUNTDOWN: core::cell::Cell<u32> = core::cell::Cell::new(0));

fn mask(entries: &[Arc<Entry>]) -> u64 {
    entries.iter().fold(0, |m, e| m | e.kinds)
}

impl fmt::Debug for Listeners {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listeners")
            .field("active", &self.active.load(Ordering::Relaxed))
            .field("panics", &self.panics())
            .finish_non_exhaustive()
    }
}

/// A registered listener. Dropping it unsubscribes (so keep it for as long as you listen);
/// [`detach`](Subscription::detach) keeps the listener for the bulkhead's lifetime.
///
/// # Caveats
///
/// Dropping a subscription removes its listener before the drop returns: an event whose
/// delivery starts after that (on the dropping thread, or on any thread that synchronizes with
/// the drop) never reaches it. A delivery that another thread had already started took its copy
/// of the listener list before the drop, and may still call the listener, once, while or after
/// the drop returns. The drop does not wait for such calls: waiting would deadlock a listener
/// that drops its own subscription, and would put a shared counter on every delivery. A
/// listener that must not run after some point should check a flag of its own, cleared before
/// the drop.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use async_bulkhead_llm::{AcquireOptions, events::EventKind, LlmBulkhead, LlmRequest};
///
/// let bulkhead = LlmBulkhead::builder("m", 4).build()?;
/// let admits = Arc::new(AtomicU64::new(0));
/// let count = admits.clone();
/// let subscription = bulkhead.on_events([EventKind::Admit], move |_| {
///     count.fetch_add(1, Ordering::Relaxed);
/// });
/// drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?);
/// drop(subscription); // unsubscribed
/// drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?);
/// assert_eq!(admits.load(Ordering::Relaxed), 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "dropping a subscription unsubscribes at once"]
pub struct Subscription {
    listeners: Weak<Listeners>,
    id: Option<u64>,
}

impl Subscription {
    pub(crate) fn new(listeners: &Arc<Listeners>, kinds: u64, listener: Listener) -> Subscription {
        Subscription::register(listeners, kinds, 0, listener)
    }

    /// A sampled listener of `kinds` (a mask of `EventKind::bit`s), hearing one call in
    /// `every`.
    pub(crate) fn sampled(
        listeners: &Arc<Listeners>,
        kinds: u64,
        every: core::num::NonZeroU32,
        listener: Listener,
    ) -> Subscription {
        Subscription::register(listeners, kinds << SAMPLED_SHIFT, every.get(), listener)
    }

    fn register(
        listeners: &Arc<Listeners>,
        kinds: u64,
        every: u32,
        listener: Listener,
    ) -> Subscription {
        let id = listeners.add(kinds, every, listener);
        Subscription {
            listeners: Arc::downgrade(listeners),
            id: Some(id),
        }
    }

    /// Keeps the listener registered for as long as the bulkhead lives.
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::LlmBulkhead::builder("m", 1).build()?;
    /// bulkhead.on(|_| {}).detach();
    /// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
    /// ```
    pub fn detach(mut self) {
        self.id = None;
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if let (Some(id), Some(listeners)) = (self.id, self.listeners.upgrade()) {
            listeners.remove(id);
        }
    }
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription")
            .field("id", &self.id)
            .finish()
    }
}

/// The kinds an iterator names, as a mask.
pub(crate) fn kinds_mask(kinds: impl IntoIterator<Item = EventKind>) -> u64 {
    kinds.into_iter().fold(0, |m, k| m | k.bit())
}

/// Every kind's bit.
pub(crate) const ALL_KINDS: u64 = (1 << EventKind::ALL.len()) - 1;

/// When a decision started and, for a call that waited, when it joined the queue; and whether
/// the call is sampled. Taken only while someone listens to admit or reject events, or while a
/// sampled listener listens and the call is sampled (no clock read otherwise).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timing {
    started: std::time::Instant,
    queued_at: Option<std::time::Instant>,
    /// Whether sampled listeners hear this call (see the module docs).
    pub(crate) sampled: bool,
    /// The refusals announced without timing (a bit per `RejectReason`, as `ShadowReasons`
    /// has them): in observe mode, those the call bypasses as a race.
    untimed: u8,
}

impl Timing {
    /// A decision that starts now, of a call that is `sampled` or not.
    #[inline]
    pub(crate) fn start(sampled: bool) -> Timing {
        Timing {
            started: std::time::Instant::now(),
            queued_at: None,
            sampled,
            untimed: 0,
        }
    }

    /// A decision nobody timed when it started, which joined the queue at `at`: its decision
    /// time counts from there (the part before is unknown), its queue wait is exact. Every call
    /// that waited is sampled.
    pub(crate) fn from_queue(at: std::time::Instant) -> Timing {
        Timing {
            started: at,
            queued_at: Some(at),
            sampled: true,
            untimed: 0,
        }
    }

    /// The same decision, whose refusals for the reasons in `untimed` (a bit per
    /// `RejectReason`) are announced without timing.
    #[inline]
    pub(crate) fn untimed(self, untimed: u8) -> Timing {
        Timing { untimed, ..self }
    }

    /// `(decision, queue_wait)` for a refusal for `reason` that ends now (see
    /// [`durations`](Timing::durations)): both zero if the refusal is announced untimed.
    pub(crate) fn refusal_durations(
        self,
        reason: crate::vocabulary::rejection::RejectReason,
        picked_at: std::time::Instant,
    ) -> (Duration, Duration) {
        if self.untimed & (1 << reason as u8) != 0 {
            return (Duration::ZERO, Duration::ZERO);
        }
        self.durations(picked_at)
    }

    /// The same decision, which joined the queue at `at` (so it is sampled).
    pub(crate) fn queued(self, at: std::time::Instant) -> Timing {
        Timing {
            queued_at: Some(at),
            sampled: true,
            ..self
        }
    }

    /// `(decision, queue_wait)` for a decision that ends now, picked up from the queue at
    /// `picked_at` if it waited.
    pub(crate) fn durations(self, picked_at: std::time::Instant) -> (Duration, Duration) {
        let now = std::time::Instant::now();
        match self.queued_at {
            None => (now - self.started, Duration::ZERO),
            Some(queued_at) => {
                let before = queued_at - self.started;
                let wait = picked_at.saturating_duration_since(queued_at);
                (before + now.saturating_duration_since(picked_at), wait)
            }
        }
    }
}

/// The kinds whose events carry decision timing.
pub(crate) const DECISION_KINDS: u64 = EventKind::Admit.bit() | EventKind::Reject.bit();

/// The sampled bits of the kinds of one call's events: a sampled listener of any of them makes
/// the bulkhead sample calls.
pub(crate) const SAMPLED_CALL_KINDS: u64 = (EventKind::Admit.bit()
    | EventKind::Reject.bit()
    | EventKind::Usage.bit()
    | EventKind::Release.bit()
    | EventKind::BorrowedConcurrencyAbandon.bit())
    << SAMPLED_SHIFT;

/// The sampled bits of the kinds whose events carry decision timing.
pub(crate) const SAMPLED_DECISION_KINDS: u64 = DECISION_KINDS << SAMPLED_SHIFT;
