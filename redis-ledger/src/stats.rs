//! The ledger's counters, read as one [`LedgerStats`] snapshot.

use std::sync::atomic::{AtomicU64, Ordering};

/// What one replica's ledger has done since it started (monotonic counts) and holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LedgerStats {
    /// Calls reserved in the global ledger (exact mode).
    pub reserved: u64,
    /// Calls the global ledger refused (exact mode).
    pub refused_global: u64,
    /// Calls a global rate window refused (exact mode).
    pub refused_rate: u64,
    /// Calls admitted on the local floor while Redis was unavailable.
    pub admitted_on_floor: u64,
    /// Calls refused because Redis was unavailable (or the ledger recovering).
    pub refused_unavailable: u64,
    /// Reservations Redis answered "recovering" (the ledger lost its data and waits for every
    /// replica to put its holds back): each then took the failure policy.
    pub recovering: u64,
    /// Usage updates applied to the global hold.
    pub usage_applied: u64,
    /// Usage updates the ledger ignored (a sequence not newer than the last applied).
    pub usage_stale: u64,
    /// Usage updates not sent because Redis was down (the global hold keeps the size of the
    /// last update sent until a later one or the release).
    pub usage_skipped: u64,
    /// Calls to Redis that failed or timed out.
    pub store_errors: u64,
    /// Leases lost: times Redis no longer knew this replica (its lease lapsed and its holds or
    /// slice were purged, or Redis restarted without its data), each counted once, whether a
    /// renewal or a reservation found it out, and even when the reply that first said so
    /// arrived after the replica stopped waiting for it (a lapsed lease is not renewed).
    pub leases_lost: u64,
    /// Times this replica re-registered its live holds because Redis no longer knew it (a
    /// restart without its data, or a lapsed lease), before reserving anything new.
    pub reregistrations: u64,
    /// Tokens those re-registrations put back in the global total.
    pub reregistered_tokens: u64,
    /// Tokens of holds Redis still had after this replica released them (a release Redis lost,
    /// as in a failover to a replica that missed it), released by a renewal's reconciliation.
    pub stray_tokens_released: u64,
    /// Tokens of live holds Redis had lost (a reservation or a usage update lost, as in a
    /// failover), put back by a renewal's reconciliation.
    pub missing_tokens_put_back: u64,
    /// Global releases made (every release and drop of a permit held globally, and every
    /// reservation that timed out): each rides on a later reservation or is sent by the
    /// background task.
    pub releases_deferred: u64,
    /// Of them, those that rode on a reservation (no round trip of their own).
    pub releases_on_reservations: u64,
    /// Releases still waiting for Redis.
    pub releases_pending: u64,
    /// Rebalances done (leased mode).
    pub rebalances: u64,
    /// The slice this replica leases now (leased mode).
    pub slice: u64,
    /// The local floor's tokens in flight now.
    pub floor_in_flight: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) reserved: AtomicU64,
    pub(crate) refused_global: AtomicU64,
    pub(crate) refused_rate: AtomicU64,
    pub(crate) admitted_on_floor: AtomicU64,
    pub(crate) refused_unavailable: AtomicU64,
    pub(crate) recovering: AtomicU64,
    pub(crate) usage_applied: AtomicU64,
    pub(crate) usage_stale: AtomicU64,
    pub(crate) usage_skipped: AtomicU64,
    pub(crate) store_errors: AtomicU64,
    pub(crate) leases_lost: AtomicU64,
    pub(crate) reregistrations: AtomicU64,
    pub(crate) reregistered_tokens: AtomicU64,
    pub(crate) stray_tokens_released: AtomicU64,
    pub(crate) missing_tokens_put_back: AtomicU64,
    pub(crate) releases_deferred: AtomicU64,
    pub(crate) releases_on_reservations: AtomicU64,
    pub(crate) releases_pending: AtomicU64,
    pub(crate) rebalances: AtomicU64,
    pub(crate) slice: AtomicU64,
    pub(crate) floor_in_flight: AtomicU64,
}

/// Reads a ledger's stats and whether it is degraded (Redis not answering, or a leased
/// replica on the failure policy's budget); `None` once the ledger is gone. What the metrics
/// hold instead of a clone of the ledger.
#[cfg(feature = "metrics")]
pub(crate) type StatsReader = std::sync::Arc<dyn Fn() -> Option<(LedgerStats, bool)> + Send + Sync>;

pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    pub(crate) fn snapshot(&self) -> LedgerStats {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LedgerStats {
            reserved: load(&self.reserved),
            refused_global: load(&self.refused_global),
            refused_rate: load(&self.refused_rate),
            admitted_on_floor: load(&self.admitted_on_floor),
            refused_unavailable: load(&self.refused_unavailable),
            recovering: load(&self.recovering),
            usage_applied: load(&self.usage_applied),
            usage_stale: load(&self.usage_stale),
            usage_skipped: load(&self.usage_skipped),
            store_errors: load(&self.store_errors),
            leases_lost: load(&self.leases_lost),
            reregistrations: load(&self.reregistrations),
            reregistered_tokens: load(&self.reregistered_tokens),
            stray_tokens_released: load(&self.stray_tokens_released),
            missing_tokens_put_back: load(&self.missing_tokens_put_back),
            releases_deferred: load(&self.releases_deferred),
            releases_on_reservations: load(&self.releases_on_reservations),
            releases_pending: load(&self.releases_pending),
            rebalances: load(&self.rebalances),
            slice: load(&self.slice),
            floor_in_flight: load(&self.floor_in_flight),
        }
    }
}
