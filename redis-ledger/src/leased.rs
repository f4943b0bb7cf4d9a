//! Leased mode: the replica leases a slice of the global budget and installs it as its local
//! budget, so admissions stay local and lock-free; a background task rebalances the slice
//! (fair share plus what the replica has been using) and renews its lease.
//!
//! The order of every change keeps the sum of what the replicas may admit within the global
//! budget: a slice grows in Redis first and locally after; it shrinks locally first (new
//! admissions refused above it), then in Redis to `max(new slice, tokens still in flight)`.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use async_bulkhead_llm::limits::ApplyOutcome;
use async_bulkhead_llm::rate::RateLimits;
use async_bulkhead_llm::{LlmBulkhead, RejectReason};

use crate::config::{FailurePolicy, LedgerConfig};
use crate::error::{LedgerError, StoreError};
use crate::health::Health;
use crate::stats::{Counters, LedgerStats, bump};
use crate::store::{GlobalSnapshot, PlanAsk, Store};
use crate::trace;

/// A replica's leased slice of one global token budget, installed as the local bulkhead's
/// budget: admissions go through the bulkhead as usual, at local speed.
///
/// # Examples
///
/// ```no_run
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, TokenBudget};
/// use async_bulkhead_llm_redis::{LeasedLedger, LedgerConfig};
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 64)
///     .token_budget(TokenBudget::new(100_000))
///     .build()?;
/// let config = LedgerConfig::new("redis://127.0.0.1:6379/", "{gpt-4o}", 200_000);
/// let ledger = LeasedLedger::start(bulkhead.clone(), config).await?;
/// let permit = bulkhead.acquire(&LlmRequest::new(), AcquireOptions::new()).await?;
/// drop(permit);
/// println!("this replica leases {} tokens", ledger.slice());
/// ledger.close().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct LeasedLedger {
    inner: Arc<Inner>,
}

struct Inner {
    bulkhead: LlmBulkhead,
    store: Store,
    config: LedgerConfig,
    health: Health,
    counters: Counters,
    state: Mutex<State>,
    stop: tokio::sync::Notify,
    /// One rebalance (or the close) at a time, so that the grow and shrink orders are never
    /// interleaved (the background task and `rebalance()` can both run one); `true` once
    /// closed: no rebalance after the close.
    turn: tokio::sync::Mutex<bool>,
    /// The ledger's epoch at this replica's last rebalance (0: none yet): a replica that knew
    /// one and finds Redis without it opens the new epoch recovering, and puts its slice back.
    epoch: std::sync::atomic::AtomicU64,
}

struct State {
    /// When this replica stops admitting from its slice unless renewed: its lease less the
    /// drift margin, by its own clock, counted from before the request that renewed it was
    /// sent (Redis counts the lease from when the script ran).
    lease_until: Option<Instant>,
    /// The highest in-flight tokens seen since the last rebalance.
    peak: u64,
    /// The most this replica asks for: its local budget when the ledger started (its own
    /// per-replica cap), at most the global budget.
    cap: u64,
    /// Budget refusals counted at the last rebalance.
    budget_refusals: u64,
    /// Whether the local budget is the failure policy's (Redis unavailable, lease over).
    on_fallback: bool,
    /// The fair share at the last rebalance (the budget over the leased replicas).
    fair: u64,
}

impl LeasedLedger {
    /// Validates `config`, takes a first slice (the local budget is set to zero first, then
    /// to the slice; the bulkhead's budget when this is called is the most the replica will
    /// ever ask for) and starts the rebalance task on the current tokio runtime.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Config`] for an invalid configuration or a bulkhead without a token
    /// budget, and [`ConfigError::LocalRateWindowsMissing`](crate::ConfigError::LocalRateWindowsMissing)
    /// for a configuration with rate limits and a bulkhead without rate windows (nothing is
    /// started or written),
    /// [`LedgerError::Store`] when Redis cannot be reached (the local budget is then
    /// the failure policy's), [`LedgerError::Limits`] if the local budget cannot be set.
    pub async fn start(bulkhead: LlmBulkhead, config: LedgerConfig) -> Result<Self, LedgerError> {
        if config.rate.is_some() && bulkhead.limits().rate.is_none() {
            config.validate()?;
            return Err(crate::error::ConfigError::LocalRateWindowsMissing.into());
        }
        let store = match Store::open(&bulkhead, &config).await {
            Ok(store) => store,
            Err(LedgerError::Store(error)) => {
                // No slice: the replica runs on the failure policy's budget until it starts.
                install(&bulkhead, &config, policy_budget(&config)).map_err(LedgerError::Limits)?;
                return Err(LedgerError::Store(error));
            }
            Err(other) => return Err(other),
        };
        let cap = bulkhead
            .limits()
            .token_budget
            .map_or(0, |b| b.budget)
            .min(config.global_budget);
        // Nothing may be admitted above a slice this replica does not hold.
        install(&bulkhead, &config, 0).map_err(LedgerError::Limits)?;
        let inner = Arc::new(Inner {
            bulkhead,
            store,
            health: Health::new(config.retry_every),
            config,
            counters: Counters::default(),
            state: Mutex::new(State {
                lease_until: None,
                peak: 0,
                cap,
                budget_refusals: 0,
                on_fallback: false,
                fair: 0,
            }),
            stop: tokio::sync::Notify::new(),
            turn: tokio::sync::Mutex::new(false),
            epoch: std::sync::atomic::AtomicU64::new(0),
        });
        if let Err(error) = inner.rebalance(true).await {
            inner.expire_if_due().map_err(LedgerError::Limits)?;
            return Err(error.into());
        }
        tokio::spawn(background(Arc::downgrade(&inner)));
        Ok(LeasedLedger { inner })
    }

    /// The slice this replica leases now.
    pub fn slice(&self) -> u64 {
        self.inner.counters.slice.load(Ordering::Acquire)
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

    /// Reads the stats and whether the replica is on the failure policy's budget, while the
    /// ledger lives (no clone of it is kept).
    #[cfg(feature = "metrics")]
    pub(crate) fn reader(&self) -> crate::stats::StatsReader {
        let inner = Arc::downgrade(&self.inner);
        Arc::new(move || {
            let inner = inner.upgrade()?;
            let fallback = inner.state.lock().expect("not poisoned").on_fallback;
            Some((inner.counters.snapshot(), fallback))
        })
    }

    /// Whether the local budget is the failure policy's (Redis unavailable past the lease).
    pub fn is_on_fallback(&self) -> bool {
        self.inner.state.lock().expect("not poisoned").on_fallback
    }

    /// Rebalances now (the background task does it every renewal period); the slice after.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when Redis cannot be reached (the failure policy applies once the lease
    /// has expired).
    pub async fn rebalance(&self) -> Result<u64, StoreError> {
        self.inner.rebalance(false).await?;
        Ok(self.slice())
    }

    /// The global figures, read from Redis.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when Redis cannot be reached.
    pub async fn global(&self) -> Result<GlobalSnapshot, StoreError> {
        self.inner.store.snapshot().await
    }

    /// Leaves the ledger: stops rebalancing, sets the local budget to zero (calls in flight
    /// finish) and gives the slice back. The tokens freed globally.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when Redis cannot be reached (the lease then expires on its own).
    pub async fn close(&self) -> Result<u64, StoreError> {
        let mut closed = self.inner.turn.lock().await;
        *closed = true;
        self.inner.stop.notify_one();
        let _ = install(&self.inner.bulkhead, &self.inner.config, 0);
        self.inner.counters.slice.store(0, Ordering::Release);
        self.inner.store.leave().await
    }
}

impl Inner {
    fn in_flight(&self) -> u64 {
        self.bulkhead
            .stats()
            .token_budget
            .map_or(0, |b| b.in_flight_tokens)
    }

    fn budget_refusals(&self) -> u64 {
        self.bulkhead
            .stats()
            .rejected_by_reason
            .get(RejectReason::BudgetLimit)
    }

    /// What to ask for, never above the replica's cap (its local budget when the ledger
    /// started): at first the cap (the script gives a fair share when others want theirs); later what was used at the peak plus a quarter, and if calls were
    /// refused for want of tokens at least twice the slice and the fair share.
    fn want(&self, first: bool) -> u64 {
        let mut state = self.state.lock().expect("not poisoned");
        let cap = state.cap.max(1);
        if first {
            return cap;
        }
        let peak = std::mem::take(&mut state.peak).max(self.in_flight());
        let refusals = self.budget_refusals();
        let starved = refusals > state.budget_refusals;
        state.budget_refusals = refusals;
        let fair = state.fair;
        drop(state);
        let slice = self.counters.slice.load(Ordering::Acquire);
        let mut want = peak + peak / 4;
        if starved {
            want = want.max(slice.saturating_mul(2)).max(fair).max(cap / 64);
        }
        want.clamp(1, cap)
    }

    fn sample(&self) {
        let now = self.in_flight();
        let mut state = self.state.lock().expect("not poisoned");
        state.peak = state.peak.max(now);
    }

    async fn rebalance(&self, first: bool) -> Result<(), StoreError> {
        let closed = self.turn.lock().await;
        if *closed {
            return Ok(());
        }
        let ask = PlanAsk {
            want: self.want(first),
            floor: self.in_flight(),
            budget: self.config.global_budget,
            lease: self.config.lease,
            renew_every: self.config.renew_every_value(),
            known: self.epoch.load(Ordering::Relaxed),
            recovery: self.config.recovery_value(),
            installed: self.counters.slice.load(Ordering::Acquire),
        };
        let sent = Instant::now();
        let plan = match self.store.plan(&ask).await {
            Ok(plan) => plan,
            Err(error) => {
                bump(&self.counters.store_errors);
                if self.health.down() {
                    trace::unavailable(&self.store);
                }
                let _ = self.expire_if_due();
                return Err(error);
            }
        };
        if self.health.up() {
            trace::available(&self.store);
        }
        bump(&self.counters.rebalances);
        self.epoch.store(plan.epoch, Ordering::Relaxed);
        if plan.lost && !first {
            bump(&self.counters.leases_lost);
            trace::lease_lost(&self.store);
        }
        if plan.lost {
            // While recovering, the script put the installed slice back.
            let back = if plan.recovering.is_zero() {
                0
            } else {
                ask.installed
            };
            trace::registered(&self.store, 0, back, plan.epoch);
        }
        if !plan.recovering.is_zero() {
            // Redis lost the ledger: this replica's slice is back in it, and no slice grows
            // until every live replica has put its own back.
            bump(&self.counters.recovering);
            trace::recovering(&self.store, plan.recovering);
        }
        {
            let mut state = self.state.lock().expect("not poisoned");
            state.lease_until = Some(sent + local_lease(self.config.lease));
            state.on_fallback = false;
            state.fair = self.config.global_budget / plan.replicas.max(1);
        }
        if plan.target < plan.slice {
            // Shrink: locally first, then in Redis down to what is still in flight.
            let _ = install(&self.bulkhead, &self.config, plan.target);
            let still = self.in_flight();
            let slice = self
                .store
                .shrink(plan.target.max(still).min(plan.slice))
                .await;
            let slice = slice.unwrap_or(plan.slice);
            self.counters.slice.store(slice, Ordering::Release);
            trace::slice(&self.store, ask.installed, slice);
        } else {
            // Grown (or unchanged) in Redis: now locally.
            let _ = install(&self.bulkhead, &self.config, plan.slice);
            self.counters.slice.store(plan.slice, Ordering::Release);
            trace::slice(&self.store, ask.installed, plan.slice);
        }
        Ok(())
    }

    /// When the slice stops unless renewed ([`local_lease`] after the last granted renewal);
    /// `None` once on the failure policy's budget.
    fn lease_end(&self) -> Option<Instant> {
        let state = self.state.lock().expect("not poisoned");
        if state.on_fallback {
            return None;
        }
        state.lease_until
    }

    /// At the lease's local end (and after a failed rebalance): once the lease is over, the
    /// local budget becomes the failure policy's (the floor, or zero when failing closed).
    fn expire_if_due(&self) -> Result<(), async_bulkhead_llm::limits::LimitsError> {
        let state = self.state.lock().expect("not poisoned");
        let due = state
            .lease_until
            .is_none_or(|until| Instant::now() >= until);
        if !due || state.on_fallback {
            return Ok(());
        }
        // Marked once the policy's budget is installed (so `is_on_fallback` never answers
        // before the budget says so), and without holding the lock over the install (it
        // announces the change to listeners). Callers take turns (`turn`, or `start` alone),
        // so no other expiry or rebalance runs meanwhile.
        drop(state);
        self.counters.slice.store(0, Ordering::Release);
        let budget = policy_budget(&self.config);
        trace::lease_ended(&self.store, budget);
        let installed = install(&self.bulkhead, &self.config, budget);
        self.state.lock().expect("not poisoned").on_fallback = true;
        installed
    }
}

/// How long a replica admits from its slice after it sent a renewal that Redis granted: the
/// lease less a tenth. Redis counts the lease from when its script ran (after the replica
/// sent it) on its own clock; the replica counts from before it sent, on its own: so a replica
/// whose clock runs at most 10% slower than Redis's stops admitting from its slice before
/// Redis can give the slice away (calls admitted before then still run: see the crate's
/// "Under faults").
pub(crate) fn local_lease(lease: Duration) -> Duration {
    lease - lease / 10
}

/// Installs `slice` as the local budget and, with global rate windows, the local windows'
/// share of them ([`rate_share`]) in the same snapshot (one revision): both shrink before
/// Redis is told (the caller's order) and grow after Redis granted.
fn install(
    bulkhead: &LlmBulkhead,
    config: &LedgerConfig,
    slice: u64,
) -> Result<(), async_bulkhead_llm::limits::LimitsError> {
    let Some(global) = config.rate else {
        return bulkhead.set_budget(slice).map(|_| ());
    };
    let share = rate_share(global, slice, config.global_budget);
    loop {
        let mut next = bulkhead.limits();
        let Some(budget) = next.token_budget.as_mut() else {
            // `start` checked the budget; a control plane that removed it is told here.
            return bulkhead.set_budget(slice).map(|_| ());
        };
        if budget.budget == slice && next.rate == Some(share) {
            return Ok(());
        }
        budget.budget = slice;
        next.rate = Some(share);
        next.revision += 1;
        // Stale: another writer (a control plane) changed the limits meanwhile; again.
        if let ApplyOutcome::Applied { .. } = bulkhead.apply_limits(next)? {
            return Ok(());
        }
    }
}

/// A replica's share of the global rate windows: each limit times `slice / budget`, rounded
/// down, at least 1 (a window cannot be empty; a replica with no slice admits nothing
/// anyway). The shares of replicas whose slices sum to at most the budget sum to at most each
/// limit, plus one per replica whose share was rounded up to 1.
pub(crate) fn rate_share(global: RateLimits, slice: u64, budget: u64) -> RateLimits {
    let part = |limit: u64| {
        let part = u128::from(limit) * u128::from(slice.min(budget)) / u128::from(budget.max(1));
        u64::try_from(part).unwrap_or(limit).max(1)
    };
    let mut share = global;
    share.requests = global.requests.map(part);
    share.tokens = global.tokens.map(part);
    share
}

/// The local budget while Redis is unavailable and no lease is held: the floor, or zero when
/// failing closed.
fn policy_budget(config: &LedgerConfig) -> u64 {
    match config.failure {
        FailurePolicy::FailClosed => 0,
        FailurePolicy::LocalFloor { tokens } => tokens,
    }
}

/// Samples the local peak eight times per period and rebalances once per period (or once
/// per retry period while Redis is down); stops when the ledger is closed or dropped.
async fn background(ledger: Weak<Inner>) {
    let (period, retry) = match ledger.upgrade() {
        Some(inner) => (inner.config.renew_every_value(), inner.config.retry_every),
        None => return,
    };
    let step = period / 8;
    let mut tick = tokio::time::interval(step.max(Duration::from_millis(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next = Instant::now() + period;
    loop {
        {
            let Some(inner) = ledger.upgrade() else {
                return;
            };
            // The lease's local end, while the slice is installed: the slice stops there
            // (not at the next failed rebalance), with no check on the admission path.
            let end = inner.lease_end();
            let (stop, ended) = tokio::select! {
                _ = tick.tick() => (false, false),
                () = inner.stop.notified() => (true, false),
                () = until(end) => (false, true),
            };
            if stop {
                return;
            }
            if ended {
                // In turn with rebalances (`rebalance()` may be renewing right now: its new
                // lease wins) and never after the close.
                let closed = inner.turn.lock().await;
                if *closed {
                    return;
                }
                let _ = inner.expire_if_due();
                continue;
            }
        }
        let Some(inner) = ledger.upgrade() else {
            return;
        };
        inner.sample();
        if Instant::now() < next {
            continue;
        }
        let failed = inner.rebalance(false).await.is_err();
        next = Instant::now() + if failed { retry.min(period) } else { period };
    }
}

/// Sleeps until `end` (forever without one).
async fn until(end: Option<Instant>) {
    match end {
        Some(end) => tokio::time::sleep_until(tokio::time::Instant::from_std(end)).await,
        None => std::future::pending().await,
    }
}
