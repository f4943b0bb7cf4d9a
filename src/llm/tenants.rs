//! [`Tenants`]: a keyed family of [`LlmBulkhead`]s, one per tenant (or API key, or any key),
//! each created on first use from a template, with its own limits, evicted once idle, at most
//! `max_tenants` of them at a time.
//!
//! The module owns the family's map, its eviction rule and its policy (per-tenant limits as
//! data, [`TenantPolicy`], which outlives the tenants); every tenant is an ordinary bulkhead
//! built by its [`LlmBulkheadBuilder`]; the eviction rule reads the bulkhead's engine (its
//! admission word and counters) directly, and a policy is checked against each live tenant's
//! engine before it is installed.
//!
//! # Protocol
//!
//! The family is split into shards, each a mutex over a `HashMap` from key to tenant and a
//! *clock*: the shard's keys in a ring. A key's shard is picked by its hash under the family's
//! own random hasher (so that keys a client chooses cannot all land in one shard). Under a
//! shard's lock run only the map's and the ring's operations (the key's `Hash`, `Eq`, `Clone`
//! and `Drop`: user code, the one exception to the crate's rule, which `HashMap` survives if it
//! panics) and reading a few tenants' figures (crate code). The template, the builder and the
//! bulkhead's `apply_limits` (which calls listeners) run unlocked, and every bulkhead the map
//! lets go of is dropped after the lock (dropping the last clone drops its estimator and
//! listeners, user code). The number of tenants is one atomic counter: a new key takes a place
//! in it with a compare-and-swap below `max_tenants`, so the bound holds across shards.
//!
//! - `get` of a live key: lock its shard, refresh its last use, clone, unlock.
//! - `get` of a new key: if the family is full, look for room (below) without evicting, and
//!   refuse `Full` if there is none; build from the template unlocked; lock the key's shard:
//!   if another thread inserted the key meanwhile, keep that one (ours is dropped); else take a
//!   place, or evict to make one (or refuse `Full`, dropping ours), insert; unlock.
//! - Room is looked for with the clock, a bounded number of steps: in the key's shard, then in
//!   each other shard in turn (from a hand that moves at every look), one lock at a time, at
//!   most [`PROBES`] tenants per shard, oldest in the ring first; one last active within
//!   `idle_after` goes to the back of the ring unchecked (its second chance), one that is old
//!   enough is checked (below) and evicted if it may be.
//!
//! # Idleness
//!
//! A tenant is *idle* when nothing is in flight, queued or unsettled (an admission that gave
//! its borrowed slot back still holds tokens): one load of its admission word. Observe-mode
//! bypasses hold nothing, so a tenant running only bypasses may be evicted mid-call (no
//! capacity is lost; its observe figures go with it). Each tenant keeps the instant of its last
//! known activity and a fingerprint of its cumulative counters (admissions, releases,
//! refusals, bypasses). A check (a sweep, or a new key that needs room) that finds a tenant
//! busy, or its fingerprint changed since the previous check, moves its last activity to now;
//! one that finds it idle, unchanged, and last active at least `idle_after` ago may evict it.
//! Calls made through a clone between two checks are seen by the fingerprint, so a tenant is
//! never evicted sooner than `idle_after` after its last activity that began before the check;
//! it may be later (by up to the time between checks).
//!
//! # Cost
//!
//! A `get` of a live key is two hashes of the key, one uncontended shard lock, a clock read
//! and a reference count; it waits only for another `get` of its own shard. A new key is
//! O(1): the template and the build, then at most [`PROBES`] steps of the clock in each shard
//! (at most 64), each step a read of one tenant's figures at most, under that shard's lock
//! alone. So a flood of unknown keys holds each shard's lock for a bounded
//! time and leaves the other shards' tenants alone. The price: a new key may be refused
//! `Full` while an evictable tenant exists that the bounded clock did not reach (the next
//! clock reaches it, the ring having turned), and the tenant evicted is the first idle one
//! the clock finds, not the least recently active of the whole family. A sweep
//! ([`evict_idle`](Tenants::evict_idle)) reads every tenant's figures, one shard at a time.

use core::borrow::Borrow;
use core::fmt;
use core::hash::{BuildHasher, Hash};
use std::cell::Cell;
use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use crate::stats::Stats;
use crate::support::contain::contain;
use crate::support::sync::atomic::{AtomicU64, Ordering, update};
use crate::support::sync::{Arc, Mutex, lock};
use crate::vocabulary::error::{ConfigError, LimitsError};
use crate::vocabulary::limits::{ApplyOutcome, Limits};
use crate::vocabulary::tenant_policy::{PolicyError, TenantPolicy};

use super::builder::LlmBulkheadBuilder;
use super::bulkhead::LlmBulkhead;

/// The default [`max_tenants`](TenantsBuilder::max_tenants).
const DEFAULT_MAX_TENANTS: usize = 1024;

/// The default [`idle_after`](TenantsBuilder::idle_after).
const DEFAULT_IDLE_AFTER: Duration = Duration::from_secs(60);

/// The most tenants the clock visits in one shard while it looks for room for a new key.
pub(crate) const PROBES: usize = 8;

/// The most shards a family has; it has one per 64 places of `max_tenants` below that.
const MAX_SHARDS: usize = 64;

/// The closure that makes a new tenant's builder.
type Template<K> = dyn Fn(&K) -> LlmBulkheadBuilder + Send + Sync;

/// A hook told of a tenant's creation or eviction.
type Hook<K> = dyn Fn(&K, &LlmBulkhead) + Send + Sync;

/// A key as the policy names it.
type PolicyKey<K> = dyn for<'k> Fn(&'k K) -> &'k str + Send + Sync;

/// A family's policy: the one in force, and how a key is named in it.
struct Policy<K> {
    /// Replaced whole under its lock (read once per new tenant and per `apply_policy`).
    current: Mutex<Arc<TenantPolicy>>,
    /// Serialises `apply_policy`: a newer policy is installed on every live tenant before the
    /// next one starts.
    writer: Mutex<()>,
    key: Box<PolicyKey<K>>,
}

impl<K> Policy<K> {
    fn current(&self) -> Arc<TenantPolicy> {
        Arc::clone(&lock(&self.current))
    }
}

/// Per-tenant limits: one [`LlmBulkhead`] per key (a tenant, an API key), created on first use
/// from a template, each with its own limits, evicted once idle, at most `max_tenants` at a
/// time.
///
/// Cloning is cheap (a reference count) and every clone is the same family.
///
/// [`get`](Tenants::get) returns a clone of the key's bulkhead, which shares its state: get it
/// per request (a lock, a hash lookup and a reference count) and use it for that request.
///
/// # Eviction
///
/// When `max_tenants` tenants exist, a new key evicts a tenant that has been idle (nothing in
/// flight, queued or unsettled) for at least [`idle_after`](TenantsBuilder::idle_after): the
/// first such tenant a clock finds in a bounded number of steps (oldest in its shard's ring
/// first, skipping tenants used within `idle_after`), so that a flood of unknown keys costs
/// O(1) per key and holds no lock for long; [`evict_idle`](Tenants::evict_idle) sweeps every
/// such tenant. Since only an idle tenant is evicted, no capacity is lost with it. What is
/// forgotten: the limits applied to it (the next `get` builds a fresh bulkhead from the
/// template, with the template's limits), its statistics, and its event subscriptions. Keep a
/// tenant's limits where your control plane writes them and let the template read them there,
/// so that a rebuilt tenant starts with them (see [`apply_limits`](Tenants::apply_limits)).
///
/// A bulkhead used within `idle_after` of the `get` that returned it cannot be evicted under
/// that use (the `get` counts as activity, and a call in flight keeps it busy). A caller that
/// keeps a clone longer keeps a working bulkhead even after eviction, but it is no longer the
/// tenant's: its calls are counted against the old instance's capacity, apart from the fresh
/// one's.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, tenants::Tenants};
///
/// // Two concurrent calls per tenant; "enterprise" gets eight.
/// let tenants = Tenants::builder(|tenant: &String| {
///     let slots = if tenant == "enterprise" { 8 } else { 2 };
///     LlmBulkhead::builder("gpt-4o", slots)
/// })
/// .max_tenants(10_000)
/// .idle_after(Duration::from_secs(300))
/// .build()?;
///
/// let request = LlmRequest::new().user("Hello").max_tokens(100);
/// let acme = tenants.get("acme")?;
/// let _a = acme.try_acquire(&request, AcquireOptions::new())?;
/// let _b = acme.try_acquire(&request, AcquireOptions::new())?;
/// let refused = acme.try_acquire(&request, AcquireOptions::new()).unwrap_err();
/// assert_eq!(refused.rejection().unwrap().reason(), RejectReason::ConcurrencyLimit);
///
/// // Another tenant is not affected by acme's load.
/// let _c = tenants.get("enterprise")?.try_acquire_owned(&request, AcquireOptions::new())?;
/// assert_eq!(tenants.stats("enterprise").unwrap().limits.max_concurrent, 8);
/// assert_eq!(tenants.len(), 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Tenants<K> {
    shared: Arc<Shared<K>>,
}

/// What every clone of a [`Tenants`](crate::tenants::Tenants) shares.
struct Shared<K> {
    template: Box<Template<K>>,
    max_tenants: usize,
    idle_after: Duration,
    /// Picks a key's shard (random keys per family: a client cannot aim its keys at a shard).
    hasher: RandomState,
    shards: Box<[CachePadded<Mutex<Shard<K>>>]>,
    /// The tenants that exist (or have a place taken for them), at most `max_tenants`.
    count: AtomicU64,
    /// Where the next look for room in other shards starts.
    hand: AtomicU64,
    /// Per-tenant limits as data, if the family has them.
    policy: Option<Policy<K>>,
    /// Told of each tenant created (after its insertion) and removed (evicted, or by
    /// `remove`; after it left the map), unlocked; a panic is caught and counted.
    on_created: Option<Box<Hook<K>>>,
    on_removed: Option<Box<Hook<K>>>,
    /// Panics caught in those hooks.
    hook_panics: AtomicU64,
}

impl<K> Shared<K> {
    /// Tells the creation hook, unlocked.
    fn created(&self, key: &K, bulkhead: &LlmBulkhead) {
        if let Some(hook) = &self.on_created
            && contain(|| hook(key, bulkhead))
        {
            self.hook_panics.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Tells the removal hook (an eviction, or `remove`), unlocked.
    fn removed(&self, key: &K, bulkhead: &LlmBulkhead) {
        if let Some(hook) = &self.on_removed
            && contain(|| hook(key, bulkhead))
        {
            self.hook_panics.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A tenant just inserted with the policy of revision `applied` (and its key): if a newer
    /// policy was installed meanwhile, which may not have seen the tenant, its limits too.
    /// (`apply_policy` installs the policy before it reads the shards, and the insertion locked
    /// the tenant's shard before this reads the policy: one of the two sees the other.) A
    /// refusal leaves the tenant at the limits it has; a stale snapshot changes nothing.
    fn catch_up(&self, bulkhead: &LlmBulkhead, applied: Option<(u64, K)>) {
        let (Some(policy), Some((revision, key))) = (&self.policy, applied) else {
            return;
        };
        let latest = policy.current();
        if latest.revision != revision {
            let _ = bulkhead.apply_limits(latest.limits_for((policy.key)(&key)));
        }
    }
}

impl<K: Eq + Hash> Shared<K> {
    /// The shard of `key` (a power-of-two count: the hash's low bits).
    fn shard_of<Q: Hash + ?Sized>(&self, key: &Q) -> usize {
        (self.hasher.hash_one(key) as usize) & (self.shards.len() - 1)
    }

    /// Whether `max_tenants` tenants exist (or have their place taken).
    fn is_full(&self) -> bool {
        self.count.load(Ordering::Acquire) >= self.max_tenants as u64
    }

    /// Takes a place for a new tenant if there is one below `max_tenants`.
    fn take_place(&self) -> bool {
        let max = self.max_tenants as u64;
        update(&self.count, |n| (n < max).then_some(n + 1)).is_ok()
    }

    /// Looks for room for a new key of shard `own`: in `own`, then in `hint` (where an earlier
    /// look found some), then in every other shard, from where the family's hand points (so
    /// that successive looks start at different shards); each shard one lock and at most
    /// [`PROBES`] steps of its clock. With `evict`, the tenant found is evicted (its
    /// place given back) and dropped after the lock. The shard where room was found.
    fn room(&self, own: usize, hint: Option<usize>, now: Instant, evict: bool) -> Option<usize> {
        let start = if self.shards.len() == 1 {
            0
        } else {
            self.hand.fetch_add(1, Ordering::Relaxed) as usize
        };
        let hint = hint.filter(|&h| h != own);
        let order = core::iter::once(own).chain(hint).chain(
            (0..self.shards.len())
                .map(|i| (start + i) % self.shards.len())
                .filter(|&i| i != own && Some(i) != hint),
        );
        for index in order {
            let found = lock(&self.shards[index]).probe(now, self.idle_after, evict);
            match found {
                Probe::Nothing => {}
                Probe::Found => return Some(index),
                Probe::Evicted(key, gone) => {
                    self.count.fetch_sub(1, Ordering::AcqRel);
                    // After the lock (see the module docs).
                    self.removed(&key, &gone);
                    return Some(index);
                }
            }
        }
        None
    }
}

/// One shard: its tenants, and its clock (every key of `map` once, oldest first).
struct Shard<K> {
    map: HashMap<K, Tenant>,
    ring: VecDeque<K>,
}

impl<K: Eq + Hash> Shard<K> {
    /// Looks for an evictable tenant: at most [`PROBES`] steps of the clock. With `evict`, the
    /// one found leaves the shard and is returned; without, it stays first in the ring (the
    /// next look finds it at once) and `Found` says there is one.
    fn probe(&mut self, now: Instant, idle_after: Duration, evict: bool) -> Probe<K> {
        for _ in 0..PROBES.min(self.ring.len()) {
            let Some(key) = self.ring.pop_front() else {
                break;
            };
            let tenant = self
                .map
                .get(&key)
                .expect("every key of the ring is in the map");
            // Not even checked while it has been active within `idle_after`.
            let old = now.saturating_duration_since(tenant.last_active.get()) >= idle_after;
            if old && tenant.evictable(now, idle_after) {
                if !evict {
                    self.ring.push_front(key);
                    return Probe::Found;
                }
                let tenant = self.map.remove(&key).expect("just found");
                return Probe::Evicted(key, tenant.bulkhead);
            }
            self.ring.push_back(key);
        }
        Probe::Nothing
    }
}

/// What a look for room found.
enum Probe<K> {
    /// Nothing evictable within the clock's steps.
    Nothing,
    /// An evictable tenant, left in place.
    Found,
    /// An evicted tenant's key and bulkhead, to drop after the lock.
    Evicted(K, LlmBulkhead),
}

/// One live tenant.
struct Tenant {
    bulkhead: LlmBulkhead,
    /// Its last known activity: creation, a `get`, or a check that saw it busy or changed.
    /// (`Cell`s: a `get` refreshes it through a shared borrow of the map, under its lock.)
    last_active: Cell<Instant>,
    /// The fingerprint of its cumulative counters at the last check.
    seen: Cell<u64>,
}

impl Tenant {
    fn new(bulkhead: LlmBulkhead, now: Instant) -> Tenant {
        let seen = fingerprint(&bulkhead);
        Tenant {
            bulkhead,
            last_active: Cell::new(now),
            seen: Cell::new(seen),
        }
    }

    /// Checks the tenant at `now`: whether it may be evicted (idle, unchanged since the last
    /// check, and last active at least `idle_after` ago). A busy or changed tenant counts as
    /// active now.
    fn evictable(&self, now: Instant, idle_after: Duration) -> bool {
        let core = &self.bulkhead.core;
        let engine = core.engine();
        // The live word first, then the fingerprint: a call admitted after the first read has
        // almost always changed the fingerprint by the second (its counter is stored just after
        // its admission: one racing that window, or admitted after both reads, meets the
        // eviction like any call through a clone kept past it). A busy tenant is active now,
        // and its fingerprint is not read (it is a sum over the counters' shards): the first
        // check after its calls end sees the fingerprint changed since the last one read.
        if !engine.occupancy().idle {
            self.last_active.set(now);
            return false;
        }
        let activity = fingerprint(&self.bulkhead);
        if activity != self.seen.get() {
            self.seen.set(activity);
            self.last_active.set(now);
            return false;
        }
        now.saturating_duration_since(self.last_active.get()) >= idle_after
    }
}

/// A number that changes whenever the bulkhead admits, releases, refuses or bypasses a call
/// (the sum of those cumulative counters).
fn fingerprint(bulkhead: &LlmBulkhead) -> u64 {
    let figures = bulkhead.core.engine().figures();
    let refused = figures
        .rejected
        .iter()
        .fold(0u64, |sum, n| sum.wrapping_add(*n));
    let bypassed = bulkhead
        .core
        .observe_counters()
        .stats()
        .map_or(0, |observe| {
            observe.bypassed.wrapping_add(observe.usage_reported)
        });
    figures
        .admitted
        .wrapping_add(figures.released)
        .wrapping_add(refused)
        .wrapping_add(bypassed)
}

impl<K> Tenants<K> {
    /// Starts a family whose tenants are built by `template`, called with the tenant's key on
    /// its first use (so each key may get different limits, a different estimator, classes,
    /// and so on). Defaults: `max_tenants` 1,024, `idle_after` 60 s.
    ///
    /// The template runs on the thread that calls [`get`](Tenants::get), under no lock of the
    /// crate; if it panics, the panic reaches that caller and nothing is stored. Two threads
    /// that get a new key at once may both call it (one result is kept).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants, TokenBudget};
    ///
    /// let tenants = Tenants::builder(|_key: &u64| {
    ///     LlmBulkhead::builder("claude-sonnet-4", 4).token_budget(TokenBudget::new(50_000))
    /// })
    /// .build()?;
    /// assert_eq!(tenants.get(&7)?.limits().token_budget.unwrap().budget, 50_000);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn builder(
        template: impl Fn(&K) -> LlmBulkheadBuilder + Send + Sync + 'static,
    ) -> TenantsBuilder<K> {
        TenantsBuilder {
            template: Box::new(template),
            max_tenants: DEFAULT_MAX_TENANTS,
            idle_after: DEFAULT_IDLE_AFTER,
            policy: None,
            on_created: None,
            on_removed: None,
        }
    }

    /// The most tenants that may exist at once.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants};
    ///
    /// let tenants = Tenants::builder(|_: &u32| LlmBulkhead::builder("m", 1)).max_tenants(5).build()?;
    /// assert_eq!(tenants.max_tenants(), 5);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn max_tenants(&self) -> usize {
        self.shared.max_tenants
    }

    /// How long a tenant must have been idle before it may be evicted.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants};
    ///
    /// let tenants = Tenants::builder(|_: &u32| LlmBulkhead::builder("m", 1)).build()?;
    /// assert_eq!(tenants.idle_after(), Duration::from_secs(60));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn idle_after(&self) -> Duration {
        self.shared.idle_after
    }

    /// Panics caught in the [`on_created`](TenantsBuilder::on_created) and
    /// [`on_removed`](TenantsBuilder::on_removed) hooks.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants};
    ///
    /// let tenants = Tenants::builder(|_: &u32| LlmBulkhead::builder("m", 1))
    ///     .on_created(|_, _| panic!("a broken hook"))
    ///     .build()?;
    /// assert!(tenants.get(&1).is_ok()); // the tenant is served all the same
    /// assert_eq!(tenants.hook_panics(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn hook_panics(&self) -> u64 {
        self.shared.hook_panics.load(Ordering::Relaxed)
    }

    /// How many tenants exist now.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants};
    ///
    /// let tenants = Tenants::builder(|_: &u32| LlmBulkhead::builder("m", 1)).build()?;
    /// assert_eq!(tenants.len(), 0);
    /// tenants.get(&1)?;
    /// tenants.get(&1)?;
    /// assert_eq!(tenants.len(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn len(&self) -> usize {
        self.shared
            .shards
            .iter()
            .map(|shard| lock(shard).map.len())
            .sum()
    }

    /// Whether no tenant exists now.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants};
    ///
    /// let tenants = Tenants::builder(|_: &u32| LlmBulkhead::builder("m", 1)).build()?;
    /// assert!(tenants.is_empty());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn is_empty(&self) -> bool {
        self.shared
            .shards
            .iter()
            .all(|shard| lock(shard).map.is_empty())
    }
}

impl<K: Eq + Hash> Tenants<K> {
    /// The key's bulkhead, created from the template on the key's first use (or its first use
    /// since it was evicted). A clone: it shares the tenant's state. Counts as the tenant's
    /// activity.
    ///
    /// When the key is new and `max_tenants` tenants exist, a tenant idle for at least
    /// `idle_after` is evicted to make room: the first the family's clock finds, in a bounded
    /// number of steps (see [`Tenants`]' eviction notes).
    ///
    /// # Errors
    ///
    /// - [`TenantsError::Full`](crate::tenants::TenantsError::Full) when the key is new, `max_tenants` tenants exist and none may
    ///   be evicted; checked before the template is called, and again after (nothing is
    ///   stored).
    /// - [`TenantsError::Template`](crate::tenants::TenantsError::Template) when the template's builder refuses its configuration;
    ///   nothing is stored and nothing is evicted.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, tenants::Tenants, tenants::TenantsError};
    ///
    /// let tenants = Tenants::builder(|_: &String| LlmBulkhead::builder("m", 1))
    ///     .max_tenants(1)
    ///     .build()?;
    /// let acme = tenants.get("acme")?;
    /// let permit = acme.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// // The same tenant: one instance, whichever clone admitted.
    /// assert_eq!(tenants.get("acme")?.stats().in_flight, 1);
    /// // A second tenant does not fit while acme is busy.
    /// assert_eq!(tenants.get("globex").unwrap_err(), TenantsError::Full { max: 1 });
    /// # drop(permit);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn get<Q>(&self, key: &Q) -> Result<LlmBulkhead, TenantsError>
    where
        K: Borrow<Q> + Clone,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let shared = &*self.shared;
        let own = shared.shard_of(key);
        {
            // The clock is read before the lock, not under it.
            let now = Instant::now();
            let shard = lock(&shared.shards[own]);
            if let Some(tenant) = shard.map.get(key) {
                tenant.last_active.set(now);
                return Ok(tenant.bulkhead.clone());
            }
        }
        // A new key: refused before the template runs when the family is full and the clock
        // finds nothing to evict.
        let mut hint = None;
        if shared.is_full() {
            hint = shared.room(own, None, Instant::now(), false);
            if hint.is_none() {
                return Err(TenantsError::Full {
                    max: shared.max_tenants,
                });
            }
        }
        let owned = key.to_owned();
        let built = (shared.template)(&owned)
            .build()
            .map_err(TenantsError::Template)?;
        // The policy's limits for the key, before anyone sees the tenant (unlocked: listeners
        // hear the change); the revision applied, to catch up after the insertion.
        let applied = match &shared.policy {
            Some(policy) => {
                let current = policy.current();
                built
                    .apply_limits(current.limits_for((policy.key)(&owned)))
                    .map_err(TenantsError::Policy)?;
                Some((current.revision, owned.clone()))
            }
            None => None,
        };
        // Twice at most: a place another thread takes between our eviction and our insertion
        // sends us round once more, then `Full`.
        for _ in 0..2 {
            let now = Instant::now();
            let mut shard = lock(&shared.shards[own]);
            if let Some(tenant) = shard.map.get(key) {
                // Another thread created it meanwhile: keep the first, drop ours.
                tenant.last_active.set(now);
                let first = tenant.bulkhead.clone();
                drop(shard);
                drop(built);
                return Ok(first);
            }
            if shared.take_place() {
                shard.ring.push_back(owned.clone());
                shard
                    .map
                    .insert(owned.clone(), Tenant::new(built.clone(), now));
                drop(shard);
                shared.catch_up(&built, applied);
                shared.created(&owned, &built);
                return Ok(built);
            }
            // Full: evict in this shard, in place of ours, if the clock finds a tenant here.
            if let Probe::Evicted(gone_key, gone) = shard.probe(now, shared.idle_after, true) {
                shard.ring.push_back(owned.clone());
                shard
                    .map
                    .insert(owned.clone(), Tenant::new(built.clone(), now));
                drop(shard);
                // After the lock (see the module docs).
                shared.removed(&gone_key, &gone);
                shared.catch_up(&built, applied);
                shared.created(&owned, &built);
                return Ok(built);
            }
            drop(shard);
            hint = shared.room(own, hint, now, true);
            if hint.is_none() {
                break;
            }
        }
        drop(built);
        Err(TenantsError::Full {
            max: shared.max_tenants,
        })
    }

    /// The key's live bulkhead, if it exists, without creating it and without counting as its
    /// activity.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants};
    ///
    /// let tenants = Tenants::builder(|_: &String| LlmBulkhead::builder("m", 1)).build()?;
    /// assert!(tenants.peek("acme").is_none());
    /// tenants.get("acme")?;
    /// assert!(tenants.peek("acme").is_some());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn peek<Q>(&self, key: &Q) -> Option<LlmBulkhead>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let shared = &*self.shared;
        lock(&shared.shards[shared.shard_of(key)])
            .map
            .get(key)
            .map(|tenant| tenant.bulkhead.clone())
    }

    /// The statistics of the key's live bulkhead, if it exists; without creating it and
    /// without counting as its activity.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, tenants::Tenants};
    ///
    /// let tenants = Tenants::builder(|_: &String| LlmBulkhead::builder("m", 3)).build()?;
    /// assert!(tenants.stats("acme").is_none());
    /// let _permit = tenants.get("acme")?.try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())?;
    /// let stats = tenants.stats("acme").unwrap();
    /// assert_eq!((stats.in_flight, stats.limits.max_concurrent), (1, 3));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn stats<Q>(&self, key: &Q) -> Option<Stats>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.peek(key).map(|bulkhead| bulkhead.stats())
    }

    /// Applies `limits` to the key's live bulkhead (see [`LlmBulkhead::apply_limits`]); returns
    /// `Ok(None)` when the key has no live bulkhead. Does not create one and does not count as
    /// its activity: limits given to no instance would be forgotten at its next eviction
    /// anyway.
    ///
    /// Limits applied to a tenant last as long as its instance: once it is evicted, the next
    /// `get` builds a fresh one from the template. For limits that survive eviction, store
    /// them where the template reads them, then apply them to the live instance, if any.
    ///
    /// # Errors
    ///
    /// The bulkhead's [`LimitsError`](crate::limits::LimitsError), nothing changed.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::collections::HashMap;
    /// use std::sync::{Arc, RwLock};
    /// use async_bulkhead_llm::{Limits, LlmBulkhead, tenants::Tenants};
    ///
    /// // The control plane's store, read by the template.
    /// let store: Arc<RwLock<HashMap<String, Limits>>> = Arc::default();
    /// let read = store.clone();
    /// let tenants = Tenants::builder(move |tenant: &String| {
    ///     let limits = read.read().unwrap().get(tenant).cloned().unwrap_or(Limits::new(0, 2));
    ///     LlmBulkhead::builder("gpt-4o", limits.max_concurrent as usize).initial_revision(limits.revision)
    /// })
    /// .build()?;
    ///
    /// // Not live yet: the store is enough.
    /// let limits = Limits::new(1, 5);
    /// store.write().unwrap().insert("acme".into(), limits.clone());
    /// assert_eq!(tenants.apply_limits("acme", limits)?, None);
    /// assert_eq!(tenants.get("acme")?.limits(), Limits::new(1, 5));
    ///
    /// // Live: the new limits apply at once.
    /// let limits = Limits::new(2, 9);
    /// store.write().unwrap().insert("acme".into(), limits.clone());
    /// assert!(tenants.apply_limits("acme", limits)?.unwrap().is_applied());
    /// assert_eq!(tenants.stats("acme").unwrap().limits.max_concurrent, 9);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn apply_limits<Q>(
        &self,
        key: &Q,
        limits: Limits,
    ) -> Result<Option<ApplyOutcome>, LimitsError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        // Unlocked: `apply_limits` announces the change to the bulkhead's listeners.
        self.peek(key)
            .map(|bulkhead| bulkhead.apply_limits(limits))
            .transpose()
    }

    /// Removes the key's tenant whatever it is doing, and returns its bulkhead (to close or
    /// drain it, say); the next `get` of the key builds a fresh one. Calls in flight on the
    /// removed bulkhead go on and release normally, apart from the fresh one's capacity.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants};
    ///
    /// let tenants = Tenants::builder(|_: &String| LlmBulkhead::builder("m", 1)).build()?;
    /// tenants.get("acme")?;
    /// let gone = tenants.remove("acme").unwrap();
    /// gone.close();
    /// assert!(tenants.is_empty());
    /// assert!(!tenants.get("acme")?.is_closed()); // a fresh instance
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn remove<Q>(&self, key: &Q) -> Option<LlmBulkhead>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let shared = &*self.shared;
        let mut shard = lock(&shared.shards[shared.shard_of(key)]);
        let (key, removed) = shard.map.remove_entry(key)?;
        shard.ring.retain(|k| *k != key);
        drop(shard);
        shared.count.fetch_sub(1, Ordering::AcqRel);
        shared.removed(&key, &removed.bulkhead);
        Some(removed.bulkhead)
    }

    /// Installs `next` if its revision is newer than the policy in force: checks the limits it
    /// gives every live tenant against that tenant's bulkhead first (nothing changes if one
    /// does not fit), then installs it and applies each live tenant's limits (unlocked:
    /// listeners hear the change). Tenants created from then on get theirs from it, and so does
    /// a tenant evicted and created again. A stale policy changes nothing (and is not checked).
    ///
    /// Limits applied to one tenant with [`apply_limits`](Tenants::apply_limits) last until the
    /// next policy of a higher revision than theirs, or until the tenant is evicted.
    ///
    /// # Errors
    ///
    /// [`PolicyError`](crate::tenants::PolicyError): the family has no policy; the revision is
    /// 0 or too large; a live tenant's limits do not fit it. Nothing changed.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Limits, LlmBulkhead, limits::ApplyOutcome, tenants::{TenantPolicy, Tenants}};
    ///
    /// let tenants = Tenants::builder(|_: &String| LlmBulkhead::builder("gpt-4o", 1))
    ///     .policy(TenantPolicy::new(1, Limits::new(0, 2)))
    ///     .build()?;
    /// let acme = tenants.get("acme")?;
    /// assert_eq!(acme.limits().max_concurrent, 2);
    /// // The control plane raises acme's limits: the live tenant changes at once.
    /// let next = TenantPolicy::new(2, Limits::new(0, 2)).tenant("acme", Limits::new(0, 8));
    /// assert!(tenants.apply_policy(next)?.is_applied());
    /// assert_eq!(acme.limits().max_concurrent, 8);
    /// // A stale policy changes nothing.
    /// let stale = TenantPolicy::new(2, Limits::new(0, 1));
    /// assert!(matches!(tenants.apply_policy(stale)?, ApplyOutcome::Stale { .. }));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn apply_policy(
        &self,
        next: TenantPolicy,
    ) -> Result<ApplyOutcome<TenantPolicy>, PolicyError> {
        let shared = &*self.shared;
        let policy = shared.policy.as_ref().ok_or(PolicyError::NotConfigured)?;
        next.check_revision()?;
        let _writer = lock(&policy.writer);
        let current = policy.current();
        if next.revision <= current.revision {
            return Ok(ApplyOutcome::Stale {
                current: TenantPolicy::clone(&current),
            });
        }
        // Every live tenant (the bulkheads dropped after the locks, see the module docs).
        let live = || {
            let mut live = Vec::new();
            for shard in shared.shards.iter() {
                let shard = lock(shard);
                live.extend(
                    shard
                        .map
                        .iter()
                        .map(|(key, t)| ((policy.key)(key).to_owned(), t.bulkhead.clone())),
                );
            }
            live
        };
        for (key, bulkhead) in &live() {
            bulkhead
                .core
                .engine()
                .check_limits(&next.limits_for(key))
                .map_err(|error| PolicyError::Tenant {
                    key: key.clone(),
                    error,
                })?;
        }
        let next = Arc::new(next);
        *lock(&policy.current) = Arc::clone(&next);
        // Read again after the installation: a tenant inserted since the check either is in
        // this reading or reads the new policy after its insertion (`Shared::catch_up`).
        for (key, bulkhead) in &live() {
            // Checked above (but a tenant created since); stale only if this tenant got newer
            // limits of its own meanwhile.
            let _ = bulkhead.apply_limits(next.limits_for(key));
        }
        Ok(ApplyOutcome::Applied {
            previous: TenantPolicy::clone(&current),
            current: TenantPolicy::clone(&next),
        })
    }

    /// The policy in force, if the family has one.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Limits, LlmBulkhead, tenants::{TenantPolicy, Tenants}};
    ///
    /// let tenants = Tenants::builder(|_: &String| LlmBulkhead::builder("m", 1))
    ///     .policy(TenantPolicy::new(4, Limits::new(0, 2)))
    ///     .build()?;
    /// assert_eq!(tenants.policy().unwrap().revision, 4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn policy(&self) -> Option<TenantPolicy> {
        self.shared
            .policy
            .as_ref()
            .map(|policy| TenantPolicy::clone(&policy.current()))
    }

    /// Evicts every tenant idle for at least `idle_after` (see [`Tenants`](crate::tenants::Tenants)); returns how many.
    /// A sweep also notices the activity of the tenants it keeps, so calling it periodically
    /// (at most every `idle_after` or so) keeps idle times accurate.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, tenants::Tenants};
    ///
    /// let tenants = Tenants::builder(|_: &u32| LlmBulkhead::builder("m", 1))
    ///     .idle_after(Duration::ZERO)
    ///     .build()?;
    /// let busy = tenants.get(&1)?.try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())?;
    /// tenants.get(&2)?;
    /// assert_eq!(tenants.evict_idle(), 1); // tenant 2: idle, unchanged, nothing held
    /// assert_eq!(tenants.keys(), [1]);
    /// # drop(busy);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn evict_idle(&self) -> usize {
        let shared = &*self.shared;
        let mut evicted = Vec::new();
        for shard in shared.shards.iter() {
            let mut shard = lock(shard);
            let now = Instant::now();
            let before = evicted.len();
            evicted.extend(
                shard
                    .map
                    .extract_if(|_, tenant| tenant.evictable(now, shared.idle_after))
                    .map(|(key, tenant)| (key, tenant.bulkhead)),
            );
            if evicted.len() > before {
                let Shard { map, ring } = &mut *shard;
                ring.retain(|k| map.contains_key(k));
                shared
                    .count
                    .fetch_sub((evicted.len() - before) as u64, Ordering::AcqRel);
            }
        }
        // Told and dropped after the locks (see the module docs).
        for (key, bulkhead) in &evicted {
            shared.removed(key, bulkhead);
        }
        evicted.len()
    }
}

impl<K: Clone> Tenants<K> {
    /// The keys of the live tenants, in no particular order.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants};
    ///
    /// let tenants = Tenants::builder(|_: &String| LlmBulkhead::builder("m", 1)).build()?;
    /// tenants.get("acme")?;
    /// tenants.get("globex")?;
    /// let mut keys = tenants.keys();
    /// keys.sort();
    /// assert_eq!(keys, ["acme", "globex"]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn keys(&self) -> Vec<K> {
        let mut keys = Vec::new();
        for shard in self.shared.shards.iter() {
            keys.extend(lock(shard).map.keys().cloned());
        }
        keys
    }
}

impl<K> Clone for Tenants<K> {
    fn clone(&self) -> Tenants<K> {
        Tenants {
            shared: self.shared.clone(),
        }
    }
}

impl<K> fmt::Debug for Tenants<K> {
    /// Never blocks: shows the configuration only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tenants")
            .field("max_tenants", &self.shared.max_tenants)
            .field("idle_after", &self.shared.idle_after)
            .finish_non_exhaustive()
    }
}

/// Configures a [`Tenants`](crate::tenants::Tenants) family; made by [`Tenants::builder`](crate::tenants::Tenants::builder).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants};
///
/// let tenants = Tenants::builder(|_: &String| LlmBulkhead::builder("gpt-4o", 4))
///     .max_tenants(500)
///     .idle_after(Duration::from_secs(120))
///     .build()?;
/// assert_eq!((tenants.max_tenants(), tenants.idle_after()), (500, Duration::from_secs(120)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct TenantsBuilder<K> {
    template: Box<Template<K>>,
    max_tenants: usize,
    idle_after: Duration,
    policy: Option<(TenantPolicy, Box<PolicyKey<K>>)>,
    on_created: Option<Box<Hook<K>>>,
    on_removed: Option<Box<Hook<K>>>,
}

impl<K> TenantsBuilder<K> {
    /// The most tenants that may exist at once (at least 1; default 1,024). A new key beyond it
    /// evicts an idle tenant, or is refused [`TenantsError::Full`](crate::tenants::TenantsError::Full).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants, tenants::TenantsConfigError};
    ///
    /// let err = Tenants::builder(|_: &u32| LlmBulkhead::builder("m", 1)).max_tenants(0).build().unwrap_err();
    /// assert_eq!(err, TenantsConfigError::MaxTenantsZero);
    /// ```
    pub fn max_tenants(mut self, max_tenants: usize) -> TenantsBuilder<K> {
        self.max_tenants = max_tenants;
        self
    }

    /// How long a tenant must have been idle (nothing in flight, queued or unsettled) before
    /// it may be evicted (default 60 s). Zero evicts a tenant at the first check that finds
    /// it idle and unchanged since the previous check.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants};
    ///
    /// let tenants = Tenants::builder(|_: &u32| LlmBulkhead::builder("m", 1))
    ///     .idle_after(Duration::from_secs(30))
    ///     .build()?;
    /// assert_eq!(tenants.idle_after(), Duration::from_secs(30));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn idle_after(mut self, idle_after: Duration) -> TenantsBuilder<K> {
        self.idle_after = idle_after;
        self
    }

    /// Builds the (empty) family.
    ///
    /// # Errors
    ///
    /// [`TenantsConfigError::MaxTenantsZero`](crate::tenants::TenantsConfigError::MaxTenantsZero) when `max_tenants` is 0.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants};
    ///
    /// let tenants = Tenants::builder(|_: &u32| LlmBulkhead::builder("m", 1)).build()?;
    /// assert!(tenants.is_empty());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn build(self) -> Result<Tenants<K>, TenantsConfigError> {
        if self.max_tenants == 0 {
            return Err(TenantsConfigError::MaxTenantsZero);
        }
        let policy = match self.policy {
            Some((policy, key)) => {
                policy
                    .check_revision()
                    .map_err(TenantsConfigError::Policy)?;
                Some(Policy {
                    current: Mutex::new(Arc::new(policy)),
                    writer: Mutex::new(()),
                    key,
                })
            }
            None => None,
        };
        let shards = (self.max_tenants / 64)
            .clamp(1, MAX_SHARDS)
            .next_power_of_two();
        let shards = (0..shards)
            .map(|_| {
                CachePadded::new(Mutex::new(Shard {
                    map: HashMap::new(),
                    ring: VecDeque::new(),
                }))
            })
            .collect();
        Ok(Tenants {
            shared: Arc::new(Shared {
                template: self.template,
                max_tenants: self.max_tenants,
                idle_after: self.idle_after,
                hasher: RandomState::new(),
                shards,
                count: AtomicU64::new(0),
                hand: AtomicU64::new(0),
                policy,
                on_created: self.on_created,
                on_removed: self.on_removed,
                hook_panics: AtomicU64::new(0),
            }),
        })
    }
}

impl<K> TenantsBuilder<K> {
    /// Calls `hook` with each tenant the family creates, once it is in the family (before the
    /// `get` that created it returns), under no lock of the crate: to register its metrics
    /// with a `tenant` label, or subscribe to its events. A panic is caught and counted
    /// ([`Tenants::hook_panics`](crate::tenants::Tenants::hook_panics)).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants};
    ///
    /// let seen = Arc::new(Mutex::new(Vec::new()));
    /// let log = seen.clone();
    /// let tenants = Tenants::builder(|_: &String| LlmBulkhead::builder("m", 1))
    ///     .on_created(move |key, bulkhead| log.lock().unwrap().push((key.clone(), bulkhead.limits().max_concurrent)))
    ///     .build()?;
    /// tenants.get("acme")?;
    /// tenants.get("acme")?; // not created again
    /// assert_eq!(*seen.lock().unwrap(), [("acme".to_owned(), 1)]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn on_created(
        mut self,
        hook: impl Fn(&K, &LlmBulkhead) + Send + Sync + 'static,
    ) -> TenantsBuilder<K> {
        self.on_created = Some(Box::new(hook));
        self
    }

    /// Calls `hook` with each tenant that leaves the family (evicted when idle, by
    /// [`evict_idle`](crate::tenants::Tenants::evict_idle), or by
    /// [`remove`](crate::tenants::Tenants::remove)), once it is out, under no lock of the crate:
    /// to stop publishing its metrics (drop its `BulkheadMetrics`; an exporter's idle timeout
    /// then drops its series) or forget what `on_created` kept. A panic is caught and counted.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants};
    ///
    /// let gone = Arc::new(Mutex::new(Vec::new()));
    /// let log = gone.clone();
    /// let tenants = Tenants::builder(|_: &String| LlmBulkhead::builder("m", 1))
    ///     .on_removed(move |key, _| log.lock().unwrap().push(key.clone()))
    ///     .build()?;
    /// tenants.get("acme")?;
    /// tenants.remove("acme");
    /// assert_eq!(*gone.lock().unwrap(), ["acme"]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn on_removed(
        mut self,
        hook: impl Fn(&K, &LlmBulkhead) + Send + Sync + 'static,
    ) -> TenantsBuilder<K> {
        self.on_removed = Some(Box::new(hook));
        self
    }
}

impl<K: AsRef<str>> TenantsBuilder<K> {
    /// Gives the family per-tenant limits as data: each tenant it creates gets the limits
    /// `policy` gives its key (after the template built it), and
    /// [`Tenants::apply_policy`](crate::tenants::Tenants::apply_policy) installs newer ones.
    /// The policy outlives the tenants: one evicted and created again gets its limits from the
    /// policy in force. Its revision must be at least 1 (checked by
    /// [`build`](TenantsBuilder::build)).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Limits, LlmBulkhead, tenants::{TenantPolicy, Tenants}};
    ///
    /// let policy = TenantPolicy::new(1, Limits::new(0, 2)).tenant("ent-acme", Limits::new(0, 16));
    /// let tenants = Tenants::builder(|_: &String| LlmBulkhead::builder("gpt-4o", 1))
    ///     .policy(policy)
    ///     .build()?;
    /// assert_eq!(tenants.get("ent-acme")?.limits().max_concurrent, 16);
    /// assert_eq!(tenants.get("someone")?.limits().max_concurrent, 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn policy(mut self, policy: TenantPolicy) -> TenantsBuilder<K> {
        self.policy = Some((policy, Box::new(|key: &K| key.as_ref())));
        self
    }
}

impl<K> fmt::Debug for TenantsBuilder<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantsBuilder")
            .field("max_tenants", &self.max_tenants)
            .field("idle_after", &self.idle_after)
            .finish_non_exhaustive()
    }
}

/// [`TenantsBuilder::build`](crate::tenants::TenantsBuilder::build) refused its configuration. Nothing was built.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{LlmBulkhead, tenants::Tenants};
///
/// let err = Tenants::builder(|_: &u32| LlmBulkhead::builder("m", 1)).max_tenants(0).build().unwrap_err();
/// assert_eq!(err.to_string(), "max_tenants (0) must be >= 1");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TenantsConfigError {
    /// `max_tenants` is 0: no tenant could ever exist.
    MaxTenantsZero,
    /// The policy given to the builder was refused.
    Policy(PolicyError),
}

impl fmt::Display for TenantsConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TenantsConfigError::MaxTenantsZero => f.write_str("max_tenants (0) must be >= 1"),
            TenantsConfigError::Policy(error) => {
                write!(f, "the tenant policy was refused: {error}")
            }
        }
    }
}

impl std::error::Error for TenantsConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TenantsConfigError::MaxTenantsZero => None,
            TenantsConfigError::Policy(error) => Some(error),
        }
    }
}

/// [`Tenants::get`](crate::tenants::Tenants::get) could not give a bulkhead for a new key. Nothing was stored or evicted.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{builder::ConfigError, LlmBulkhead, tenants::Tenants, tenants::TenantsError};
///
/// let tenants = Tenants::builder(|key: &String| LlmBulkhead::builder(key.as_str(), 1)).build()?;
/// let err = tenants.get("").unwrap_err();
/// assert_eq!(err, TenantsError::Template(ConfigError::EmptyModel { model: "".into() }));
/// assert_eq!(err.to_string(), "the template's builder was refused: model must be a non-empty string (got \"\")");
/// assert!(tenants.is_empty());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TenantsError {
    /// `max` tenants exist and none has been idle for `idle_after`.
    Full {
        /// The configured `max_tenants`.
        max: usize,
    },
    /// The template's builder refused its configuration for this key.
    Template(ConfigError),
    /// The limits the family's policy gives this key do not fit the bulkhead its template
    /// built (its budget, its classes).
    Policy(LimitsError),
}

impl fmt::Display for TenantsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TenantsError::Full { max } => write!(
                f,
                "all {max} tenants (max_tenants) are busy or active within idle_after: none can be evicted"
            ),
            TenantsError::Template(error) => {
                write!(f, "the template's builder was refused: {error}")
            }
            TenantsError::Policy(error) => {
                write!(f, "the policy's limits for this key were refused: {error}")
            }
        }
    }
}

impl std::error::Error for TenantsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TenantsError::Full { .. } => None,
            TenantsError::Template(error) => Some(error),
            TenantsError::Policy(error) => Some(error),
        }
    }
}
