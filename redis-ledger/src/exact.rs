//! Exact mode: every admission of the local bulkhead also reserves its tokens in the global
//! ledger (one script), usage reports move the global hold by sequence number, and release
//! removes it (riding on the replica's next reservation, or sent by the background task within
//! a few milliseconds); the background task also renews the replica's lease.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, OwnedPermit, TokenUsage, usage::ReleaseReport,
    usage::UsageError, usage::UsageReport,
};

use async_bulkhead_llm::rate::RateWindow;

use crate::config::{FailurePolicy, LedgerConfig, RateSpec};
use crate::error::{
    GlobalRateRejection, GlobalRejection, LedgerError, LedgerRefusal, StoreError,
    UnavailableRejection,
};
use crate::health::Health;
use crate::stats::{Counters, LedgerStats, bump};
use crate::store::{GlobalRateStatus, GlobalSnapshot, Moved, Reserved, Store};
use crate::trace;

/// A replica's exact share of one global token budget: the local bulkhead decides first (in
/// nanoseconds, lock-free), then one Redis script reserves the admission's tokens globally.
///
/// Cloning is cheap (one `Arc`); the background task stops when the last clone is dropped.
///
/// # Examples
///
/// ```no_run
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, TokenBudget, TokenUsage};
/// use async_bulkhead_llm_redis::{ExactLedger, LedgerConfig};
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 64)
///     .token_budget(TokenBudget::new(100_000))
///     .build()?;
/// let config = LedgerConfig::new("redis://127.0.0.1:6379/", "{gpt-4o}", 200_000);
/// let ledger = ExactLedger::connect(bulkhead, config).await?;
/// let request = LlmRequest::new().max_tokens(500);
/// let mut permit = ledger.acquire(&request, AcquireOptions::new()).await?;
/// permit.report_usage(TokenUsage::new(120, 40)?).await?;
/// permit.release(None);
/// ledger.close().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ExactLedger {
    inner: Arc<Inner>,
}

struct Inner {
    bulkhead: LlmBulkhead,
    store: Store,
    config: LedgerConfig,
    /// The global rate windows every reservation is charged to, if configured.
    rate: Option<RateSpec>,
    health: Health,
    counters: Counters,
    /// Ids whose global hold must still be released (`id`, or `id=<used>` to correct the
    /// tokens window to the call's final usage): they ride on this replica's next
    /// reservation, or go from the background task after `RIDE_WINDOW`.
    pending: std::sync::Mutex<Vec<String>>,
    /// Wakes the background task when `pending` stops being empty.
    wake: tokio::sync::Notify,
    /// Stops the background task at once (`close`).
    stop: tokio::sync::Notify,
    /// This replica's live global holds (`id` -> held tokens, usage sequence): what it
    /// re-registers when Redis no longer knows it (a restart without its data, a lapsed
    /// lease). One short lock per reservation, usage report and release, beside a round trip.
    live: std::sync::Mutex<std::collections::HashMap<String, (u64, u64)>>,
    /// Whether Redis knew this replica at its last word (so that a lease lost is counted once,
    /// however many renewals or reservations find it so before it re-registers).
    registered: std::sync::atomic::AtomicBool,
    /// The ledger's epoch at this replica's last registration: a replica that knew one and
    /// finds Redis without it opens the new epoch recovering (Redis lost holds it cannot
    /// name: every live replica puts its own back first).
    epoch: std::sync::atomic::AtomicU64,
}

impl ExactLedger {
    /// Validates `config`, connects to Redis and starts the lease renewal task (on the
    /// current tokio runtime).
    ///
    /// # Errors
    ///
    /// [`LedgerError::Config`] for an invalid configuration or a bulkhead without a token
    /// budget, [`LedgerError::Store`] when Redis cannot be reached; nothing is left running.
    pub async fn connect(bulkhead: LlmBulkhead, config: LedgerConfig) -> Result<Self, LedgerError> {
        let store = Store::open(&bulkhead, &config).await?;
        // Joins with no hold (holds an earlier process left under this id stay counted while
        // the id renews: give every process its own id), knowing no epoch: a new ledger admits
        // at once (a recovering one answers "recovering" until every replica is back).
        let joined = store
            .register(config.lease, 0, config.recovery_value(), &[])
            .await?;
        let inner = Arc::new(Inner {
            bulkhead,
            store,
            rate: config.rate.as_ref().map(RateSpec::of),
            health: Health::new(config.retry_every),
            config,
            counters: Counters::default(),
            pending: std::sync::Mutex::new(Vec::new()),
            wake: tokio::sync::Notify::new(),
            stop: tokio::sync::Notify::new(),
            live: std::sync::Mutex::new(std::collections::HashMap::new()),
            registered: std::sync::atomic::AtomicBool::new(true),
            epoch: std::sync::atomic::AtomicU64::new(joined.epoch),
        });
        tokio::spawn(background(Arc::downgrade(&inner)));
        Ok(ExactLedger { inner })
    }

    /// Admits a call locally (as [`LlmBulkhead::acquire_owned`], queueing if the local
    /// bulkhead allows), then reserves its tokens in the global ledger.
    ///
    /// # Errors
    ///
    /// [`LedgerRefusal::Local`] when the local bulkhead refuses, [`LedgerRefusal::Global`]
    /// when the global budget cannot hold the call (the local admission is returned first),
    /// [`LedgerRefusal::Unavailable`] when Redis is out of reach and the failure policy
    /// refuses.
    pub async fn acquire(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<GlobalPermit, LedgerRefusal> {
        let permit = self
            .inner
            .bulkhead
            .acquire_owned(request, options)
            .await
            .map_err(LedgerRefusal::Local)?;
        self.reserve(permit).await
    }

    /// [`acquire`](Self::acquire) with [`LlmBulkhead::try_acquire_owned`] locally (never
    /// waits in the local queue).
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire).
    pub async fn try_acquire(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<GlobalPermit, LedgerRefusal> {
        let permit = self
            .inner
            .bulkhead
            .try_acquire_owned(request, options)
            .map_err(LedgerRefusal::Local)?;
        self.reserve(permit).await
    }

    async fn reserve(&self, permit: OwnedPermit) -> Result<GlobalPermit, LedgerRefusal> {
        let inner = &self.inner;
        let tokens = permit.held_tokens();
        let id = permit.admission_id().to_string();
        if !inner.health.should_try() {
            return self.fallback(permit, "waiting before trying Redis again".into());
        }
        let riders = inner.take_pending(RIDERS);
        let (budget, lease) = (inner.config.global_budget, inner.config.lease);
        let mut reserved = inner
            .store
            .reserve(&id, tokens, budget, lease, inner.rate, &riders)
            .await;
        if let Ok(Some(Reserved::Unregistered)) = reserved {
            inner.lost();
            // Redis lost this replica: its live holds go back first, then the call is judged
            // against them (the riders were released by the first try).
            reserved = match inner.register().await {
                Ok(()) => {
                    inner
                        .store
                        .reserve(&id, tokens, budget, lease, inner.rate, &[])
                        .await
                }
                Err(error) => Err(error),
            };
        }
        if reserved.is_ok() {
            inner.released(riders.len());
            inner
                .counters
                .releases_on_reservations
                .fetch_add(riders.len() as u64, Ordering::Relaxed);
        } else {
            inner.put_back(riders);
        }
        match reserved {
            // `None`: the id holds already. Admission ids are unique, so only this very
            // reservation, run twice (resent by some layer after its first run's answer was
            // lost), can hold it: reserved.
            Ok(Some(Reserved::Yes { .. }) | None) => {
                inner.answered();
                bump(&inner.counters.reserved);
                inner.live().insert(id.clone(), (tokens, 0));
                Ok(GlobalPermit {
                    permit: Some(permit),
                    hold: Hold::Global(id),
                    ledger: Arc::clone(inner),
                })
            }
            Ok(Some(Reserved::No { total, budget })) => {
                inner.answered();
                bump(&inner.counters.refused_global);
                drop(permit);
                Err(LedgerRefusal::Global(GlobalRejection {
                    requested: tokens,
                    global_in_flight: total,
                    global_budget: budget,
                    local: inner.bulkhead.stats().token_budget,
                    local_capacity: inner.bulkhead.capacity(),
                }))
            }
            Ok(Some(Reserved::RateLimited {
                tokens: by_tokens,
                retry_after,
            })) => {
                inner.answered();
                bump(&inner.counters.refused_rate);
                drop(permit);
                let spec = inner
                    .rate
                    .expect("only a rated reservation is rate limited");
                let (window, requested, limit) = match by_tokens {
                    true => (RateWindow::Tokens, tokens, spec.tokens),
                    false => (RateWindow::Requests, 1, spec.requests),
                };
                Err(LedgerRefusal::GlobalRate(GlobalRateRejection {
                    window,
                    requested,
                    limit,
                    period: std::time::Duration::from_micros(spec.window_us),
                    retry_after,
                    local: inner.bulkhead.stats().token_budget,
                    local_capacity: inner.bulkhead.capacity(),
                }))
            }
            Ok(Some(Reserved::Recovering { wait })) => {
                // Redis answered: the ledger waits for every replica to put its holds back.
                inner.answered();
                bump(&inner.counters.recovering);
                self.fallback_for(
                    permit,
                    format!("the ledger is recovering from a data loss for {wait:?} more"),
                    Some(wait),
                )
            }
            // A replica just registered is known (unless Redis lost it again between the
            // two calls): the failure policy, as for any failed call.
            Ok(Some(Reserved::Unregistered)) => {
                inner.lost();
                self.fallback(
                    permit,
                    "redis lost this replica again while it registered".into(),
                )
            }
            Err(error) => {
                inner.failed();
                // A timed-out reservation may have been applied: release it once Redis
                // answers (the release of an absent hold changes nothing).
                inner.defer(id);
                self.fallback(permit, error.to_string())
            }
        }
    }

    /// The failure policy for a call admitted locally while Redis is unavailable.
    fn fallback(&self, permit: OwnedPermit, cause: String) -> Result<GlobalPermit, LedgerRefusal> {
        self.fallback_for(permit, cause, None)
    }

    /// The failure policy for a call admitted locally while Redis is unavailable, or while
    /// the ledger is `recovering` (for that long).
    fn fallback_for(
        &self,
        permit: OwnedPermit,
        cause: String,
        recovering: Option<std::time::Duration>,
    ) -> Result<GlobalPermit, LedgerRefusal> {
        let inner = &self.inner;
        let requested = permit.held_tokens();
        let floor = match inner.config.failure {
            FailurePolicy::FailClosed => None,
            FailurePolicy::LocalFloor { tokens } => Some(tokens),
        };
        if let Some(size) = floor {
            let held = &inner.counters.floor_in_flight;
            // A CAS loop of its own (std deprecates `fetch_update`).
            let mut now = held.load(Ordering::Acquire);
            let taken = loop {
                let Some(after) = now.checked_add(requested).filter(|&after| after <= size) else {
                    break false;
                };
                match held.compare_exchange_weak(now, after, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => break true,
                    Err(actual) => now = actual,
                }
            };
            if taken {
                bump(&inner.counters.admitted_on_floor);
                return Ok(GlobalPermit {
                    permit: Some(permit),
                    hold: Hold::Floor(requested),
                    ledger: Arc::clone(inner),
                });
            }
        }
        bump(&inner.counters.refused_unavailable);
        drop(permit);
        Err(LedgerRefusal::Unavailable(UnavailableRejection {
            cause,
            requested,
            floor: floor.map(|size| (inner.counters.floor_in_flight.load(Ordering::Acquire), size)),
            recovering,
        }))
    }

    /// The local bulkhead.
    pub fn bulkhead(&self) -> &LlmBulkhead {
        &self.inner.bulkhead
    }

    /// This replica's id in the ledger.
    pub fn replica_id(&self) -> &str {
        self.inner.store.replica()
    }

    /// The ledger's counters.
    pub fn stats(&self) -> LedgerStats {
        self.inner.counters.snapshot()
    }

    /// The namespace and this replica's id (the metrics' labels).
    #[cfg(feature = "metrics")]
    pub(crate) fn names(&self) -> (&str, &str) {
        (self.inner.store.namespace(), self.inner.store.replica())
    }

    /// Reads the stats and the health while the ledger lives (no clone of it is kept).
    #[cfg(feature = "metrics")]
    pub(crate) fn reader(&self) -> crate::stats::StatsReader {
        let inner = Arc::downgrade(&self.inner);
        Arc::new(move || {
            let inner = inner.upgrade()?;
            Some((inner.counters.snapshot(), inner.health.is_down()))
        })
    }

    /// Whether the last call to Redis failed (calls are on the failure policy).
    pub fn is_degraded(&self) -> bool {
        self.inner.health.is_down()
    }

    /// One `PING` to Redis: the round trip a reservation is judged against.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when Redis cannot be reached.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.inner.store.ping().await
    }

    /// The global rate windows now, read from Redis (`None` when the namespace enforces
    /// none): limit, what each would let through at once, and when it is whole again.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when Redis cannot be reached.
    pub async fn global_rate(&self) -> Result<Option<GlobalRateStatus>, StoreError> {
        self.inner.store.rate_status().await
    }

    /// The global figures, read from Redis.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when Redis cannot be reached.
    pub async fn global(&self) -> Result<GlobalSnapshot, StoreError> {
        self.inner.store.snapshot().await
    }

    /// Waits until every release made so far has reached Redis (or `limit` has passed);
    /// whether none is pending. For a graceful shutdown, and for tests that read Redis.
    pub async fn settled(&self, limit: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if self.inner.counters.releases_pending.load(Ordering::Acquire) == 0 {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_micros(200)).await;
        }
    }

    /// Leaves the ledger: stops the renewal and removes this replica's lease and every hold
    /// it still has (calls still in flight keep their local permits; their global holds are
    /// gone). The tokens freed globally.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when Redis cannot be reached (the lease then expires on its own).
    pub async fn close(&self) -> Result<u64, StoreError> {
        self.inner.stop.notify_one();
        self.inner.store.leave().await
    }
}

impl Inner {
    fn failed(&self) {
        bump(&self.counters.store_errors);
        if self.health.down() {
            trace::unavailable(&self.store);
        }
    }

    /// Redis answered.
    fn answered(&self) {
        if self.health.up() {
            trace::available(&self.store);
        }
    }

    fn defer(&self, id: String) {
        bump(&self.counters.releases_deferred);
        self.queue_release(id);
    }

    /// Holds of `snapshot` (sent with a renewal) released since: the renewal may have run
    /// after their release and put them back as live, so each is released again (plain: no
    /// window correction twice; a release of an absent hold changes nothing).
    fn release_again_if_gone(&self, snapshot: &[(String, u64, u64)]) {
        let gone: Vec<String> = {
            let live = self.live();
            snapshot
                .iter()
                .filter(|(id, _, _)| !live.contains_key(id))
                .map(|(id, _, _)| id.clone())
                .collect()
        };
        for id in gone {
            self.queue_release(id);
        }
    }

    /// Queues a release for the next reservation or the background task.
    fn queue_release(&self, id: String) {
        self.counters
            .releases_pending
            .fetch_add(1, Ordering::AcqRel);
        let first = {
            let mut pending = self.pending.lock().expect("not poisoned");
            pending.push(id);
            pending.len() == 1
        };
        if first {
            self.wake.notify_one();
        }
    }

    /// Takes up to `max` waiting releases (the newest first).
    fn take_pending(&self, max: usize) -> Vec<String> {
        let mut pending = self.pending.lock().expect("not poisoned");
        let from = pending.len().saturating_sub(max);
        pending.drain(from..).collect()
    }

    /// Returns releases that could not be sent (they are idempotent: sent again later).
    fn put_back(&self, ids: Vec<String>) {
        if !ids.is_empty() {
            self.pending.lock().expect("not poisoned").extend(ids);
        }
    }

    fn released(&self, sent: usize) {
        self.counters
            .releases_pending
            .fetch_sub(sent as u64, Ordering::AcqRel);
    }

    /// Sends every waiting release, 256 ids per script; on a failure the rest wait for the
    /// next renewal.
    async fn flush(&self) {
        loop {
            let batch = self.take_pending(256);
            if batch.is_empty() {
                return;
            }
            match self.store.release(&batch).await {
                Ok(_) => self.released(batch.len()),
                Err(_) => {
                    self.put_back(batch);
                    self.failed();
                    return;
                }
            }
        }
    }
}

/// The most waiting releases one reservation carries.
const RIDERS: usize = 64;

/// How long a release waits for a reservation to ride on before the background task sends
/// it on its own.
const RIDE_WINDOW: std::time::Duration = std::time::Duration::from_millis(2);

/// Renews the lease every renewal period (a failed renewal is tried again after the retry
/// period) and sends the releases no reservation took within `RIDE_WINDOW`, retrying those
/// that fail; stops when the ledger is closed or dropped.
async fn background(ledger: Weak<Inner>) {
    let period = match ledger.upgrade() {
        Some(inner) => inner.config.renew_every_value(),
        None => return,
    };
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let Some(inner) = ledger.upgrade() else {
            return;
        };
        let renew = tokio::select! {
            _ = tick.tick() => true,
            () = inner.wake.notified() => false,
            () = inner.stop.notified() => return,
        };
        if renew {
            let holds = inner.live_holds();
            match inner
                .store
                .renew(inner.config.lease, inner.config.renew_every_value(), &holds)
                .await
            {
                Ok(renewed) => {
                    inner.answered();
                    inner.reconciled(renewed.released, renewed.put_back);
                    if !renewed.lost {
                        inner.release_again_if_gone(&holds);
                    }
                    if renewed.lost {
                        // Redis does not know this replica: its live holds go back at once.
                        inner.lost();
                        if inner.register().await.is_err() {
                            inner.failed();
                            tick.reset_after(inner.config.retry_every.min(period));
                        }
                    }
                    inner.flush().await;
                }
                Err(_) => {
                    // Tried again after the retry period, not a whole renewal period: a
                    // restarted Redis hears from every live replica within the recovery
                    // period (`LedgerConfig::recovery_value`).
                    inner.failed();
                    tick.reset_after(inner.config.retry_every.min(period));
                }
            }
            continue;
        }
        drop(inner);
        tokio::time::sleep(RIDE_WINDOW).await;
        let Some(inner) = ledger.upgrade() else {
            return;
        };
        if !inner.health.is_down() {
            inner.flush().await;
        }
    }
}

/// Where a permit's tokens are held beyond the local bulkhead.
#[derive(Debug)]
enum Hold {
    /// In the global ledger, under this admission id.
    Global(String),
    /// On the local floor (Redis was unavailable): these tokens.
    Floor(u64),
}

/// A call admitted by the local bulkhead and held in the global ledger (or, while Redis is
/// unavailable under [`FailurePolicy::LocalFloor`], on the local floor).
///
/// Release it with [`release`](Self::release) (or drop it): locally at once, globally a
/// moment later (see `release`).
pub struct GlobalPermit {
    permit: Option<OwnedPermit>,
    hold: Hold,
    ledger: Arc<Inner>,
}

impl std::fmt::Debug for GlobalPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GlobalPermit")
            .field("permit", &self.permit)
            .field("hold", &self.hold)
            .finish_non_exhaustive()
    }
}

impl GlobalPermit {
    /// The local permit.
    pub fn permit(&self) -> &OwnedPermit {
        self.permit.as_ref().expect("held until release")
    }

    /// Whether the call's tokens are held in the global ledger (`false`: on the local floor).
    pub fn is_global(&self) -> bool {
        matches!(self.hold, Hold::Global(_))
    }

    /// Reports cumulative usage: the local hold moves at once (as
    /// [`Permit::report_usage`](async_bulkhead_llm::Permit::report_usage)), then the global
    /// hold follows with the report's sequence number (an update Redis sees late or twice
    /// changes nothing). A failed global update is counted and left to the next update or
    /// the release.
    ///
    /// # Errors
    ///
    /// The local [`UsageError`]; nothing changes.
    pub async fn report_usage(&mut self, usage: TokenUsage) -> Result<UsageReport, UsageError> {
        let permit = self.permit.as_mut().expect("held until release");
        let before = permit.usage_sequence();
        let report = permit.report_usage(usage)?;
        let used = self
            .ledger
            .charges_tokens()
            .then(|| permit.usage())
            .flatten();
        if let Hold::Global(id) = &self.hold
            && report.sequence > before
        {
            self.ledger
                .apply_usage(id, report.sequence, report.held, used.map(|u| u.total()))
                .await;
        }
        Ok(report)
    }

    /// Releases the call: locally at once; globally with this replica's next reservation
    /// (one script releases what waits, then reserves), or from the background task if no
    /// reservation comes within 2 ms (one script per batch). Until then the global ledger
    /// still counts the tokens: a release can only be late, never early.
    ///
    /// With a global tokens window, the call's final usage (`usage`, else the last reported)
    /// corrects the window with the release: what it was charged beyond the usage is given
    /// back, usage beyond it is charged. Without any usage the charge stays (as the core
    /// crate keeps a dropped permit's).
    pub fn release(mut self, usage: Option<TokenUsage>) -> ReleaseReport {
        let permit = self.permit.take().expect("held until release");
        let used = usage.or(permit.usage()).map(|u| u.total());
        let report = permit.release(usage);
        let hold = std::mem::replace(&mut self.hold, Hold::Floor(0));
        self.ledger.settle(hold, used);
        report
    }
}

impl Inner {
    /// Moves a global hold to `held` (the local usage sequence `sequence`). While Redis is
    /// down the update is skipped (counted), as every call skips Redis then but one per retry
    /// period: a report must not wait for a timeout each time.
    async fn apply_usage(&self, id: &str, sequence: u64, held: u64, used: Option<u64>) {
        if let Some(hold) = self.live().get_mut(id) {
            *hold = (held, sequence);
        }
        if !self.health.should_try() {
            bump(&self.counters.usage_skipped);
            return;
        }
        match self.store.usage(id, sequence, held, used).await {
            Ok(moved) => {
                self.answered();
                match moved {
                    Moved::Applied => bump(&self.counters.usage_applied),
                    Moved::Stale | Moved::Gone => bump(&self.counters.usage_stale),
                }
            }
            Err(_) => self.failed(),
        }
    }

    /// The live holds (a poisoned lock's data is still whole: every update is one insert,
    /// assignment or removal).
    fn live(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, (u64, u64)>> {
        self.live
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Redis said it does not know this replica: a lease lost, counted once until the
    /// replica re-registers.
    fn lost(&self) {
        if self.registered.swap(false, Ordering::Relaxed) {
            bump(&self.counters.leases_lost);
            trace::lease_lost(&self.store);
        }
    }

    /// Every live global hold: `(id, held tokens, usage sequence)`.
    fn live_holds(&self) -> Vec<(String, u64, u64)> {
        self.live()
            .iter()
            .map(|(id, &(held, sequence))| (id.clone(), held, sequence))
            .collect()
    }

    /// A renewal reconciled this replica's holds with Redis's: `released` tokens of holds Redis
    /// kept after their release (a release it lost), `put_back` tokens of live holds it had
    /// lost (or held at an older usage).
    fn reconciled(&self, released: u64, put_back: u64) {
        if released > 0 {
            self.counters
                .stray_tokens_released
                .fetch_add(released, Ordering::Relaxed);
        }
        if put_back > 0 {
            self.counters
                .missing_tokens_put_back
                .fetch_add(put_back, Ordering::Relaxed);
        }
        if released > 0 || put_back > 0 {
            trace::reconciled(&self.store, released, put_back);
        }
    }

    /// Re-registers this replica and its live holds (Redis no longer knew it).
    async fn register(&self) -> Result<(), StoreError> {
        let holds = self.live_holds();
        let known = self.epoch.load(Ordering::Relaxed);
        let registered = self
            .store
            .register(
                self.config.lease,
                known,
                self.config.recovery_value(),
                &holds,
            )
            .await?;
        self.epoch.store(registered.epoch, Ordering::Relaxed);
        self.registered.store(true, Ordering::Relaxed);
        trace::registered(&self.store, holds.len(), registered.added, registered.epoch);
        if !registered.recovering.is_zero() {
            trace::recovering(&self.store, registered.recovering);
        }
        bump(&self.counters.reregistrations);
        self.counters
            .reregistered_tokens
            .fetch_add(registered.added, Ordering::Relaxed);
        Ok(())
    }

    /// Whether reservations are charged to a global tokens window.
    fn charges_tokens(&self) -> bool {
        self.rate.is_some_and(|spec| spec.tokens > 0)
    }

    /// Returns `hold`: the floor at once, a global hold from the background task (with the
    /// call's final usage `used`, to correct the tokens window, if it has one).
    fn settle(&self, hold: Hold, used: Option<u64>) {
        match hold {
            Hold::Floor(tokens) => {
                self.counters
                    .floor_in_flight
                    .fetch_sub(tokens, Ordering::AcqRel);
            }
            Hold::Global(id) => {
                self.live().remove(&id);
                match used.filter(|_| self.charges_tokens()) {
                    Some(used) => self.defer(format!("{id}={used}")),
                    None => self.defer(id),
                }
            }
        }
    }
}

impl Drop for GlobalPermit {
    fn drop(&mut self) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        let used = permit.usage().map(|u| u.total());
        drop(permit);
        let hold = std::mem::replace(&mut self.hold, Hold::Floor(0));
        self.ledger.settle(hold, used);
    }
}
