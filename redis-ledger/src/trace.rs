//! The ledger's `tracing` events (feature `tracing`; without it every function here is
//! empty): what changed for one replica, at target `async_bulkhead_llm_redis`, each with the
//! fields `ledger` (the namespace) and `replica`.
//!
//! | level | message | fields |
//! |---|---|---|
//! | `WARN` | `redis unavailable: calls take the failure policy` | |
//! | `INFO` | `redis answers again` | |
//! | `WARN` | `lease lost: redis no longer knew this replica` | |
//! | `INFO` | `registered` | `holds`, `tokens_added`, `epoch` |
//! | `WARN` | `ledger recovering from a data loss: nothing new admitted` | `wait_ms` |
//! | `WARN` | `reconciled: redis had lost writes of this replica` | `released`, `put_back` |
//! | `WARN` | `lease ended: the slice gives way to the failure policy's budget` | `budget` |
//! | `DEBUG` | `slice changed` | `from`, `to` |
//!
//! Each is emitted once per change (a transition, a registration, a rebalance), never per
//! admission.

use std::time::Duration;

use crate::store::Store;

#[cfg(feature = "tracing")]
const TARGET: &str = "async_bulkhead_llm_redis";

/// Redis stopped answering (it answered before).
pub(crate) fn unavailable(store: &Store) {
    #[cfg(feature = "tracing")]
    tracing::warn!(target: TARGET, ledger = store.namespace(), replica = store.replica(),
        "redis unavailable: calls take the failure policy");
    #[cfg(not(feature = "tracing"))]
    let _ = store;
}

/// Redis answered again after failing.
pub(crate) fn available(store: &Store) {
    #[cfg(feature = "tracing")]
    tracing::info!(target: TARGET, ledger = store.namespace(), replica = store.replica(),
        "redis answers again");
    #[cfg(not(feature = "tracing"))]
    let _ = store;
}

/// Redis no longer knew this replica (counted once per loss).
pub(crate) fn lease_lost(store: &Store) {
    #[cfg(feature = "tracing")]
    tracing::warn!(target: TARGET, ledger = store.namespace(), replica = store.replica(),
        "lease lost: redis no longer knew this replica");
    #[cfg(not(feature = "tracing"))]
    let _ = store;
}

/// The replica registered `holds` live holds, `added` tokens of them new to Redis, in `epoch`.
pub(crate) fn registered(store: &Store, holds: usize, added: u64, epoch: u64) {
    #[cfg(feature = "tracing")]
    tracing::info!(target: TARGET, ledger = store.namespace(), replica = store.replica(),
        holds, tokens_added = added, epoch, "registered");
    #[cfg(not(feature = "tracing"))]
    let _ = (store, holds, added, epoch);
}

/// A renewal's reconciliation released `released` tokens of holds Redis kept after their
/// release and put back `put_back` tokens of live holds Redis had lost.
pub(crate) fn reconciled(store: &Store, released: u64, put_back: u64) {
    #[cfg(feature = "tracing")]
    tracing::warn!(target: TARGET, ledger = store.namespace(), replica = store.replica(),
        released, put_back, "reconciled: redis had lost writes of this replica");
    #[cfg(not(feature = "tracing"))]
    let _ = (store, released, put_back);
}

/// The ledger is recovering from a data loss for `wait` more.
pub(crate) fn recovering(store: &Store, wait: Duration) {
    #[cfg(feature = "tracing")]
    tracing::warn!(target: TARGET, ledger = store.namespace(), replica = store.replica(),
        wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
        "ledger recovering from a data loss: nothing new admitted");
    #[cfg(not(feature = "tracing"))]
    let _ = (store, wait);
}

/// A leased replica's lease ended unrenewed: its local budget is now `budget`.
pub(crate) fn lease_ended(store: &Store, budget: u64) {
    #[cfg(feature = "tracing")]
    tracing::warn!(target: TARGET, ledger = store.namespace(), replica = store.replica(),
        budget, "lease ended: the slice gives way to the failure policy's budget");
    #[cfg(not(feature = "tracing"))]
    let _ = (store, budget);
}

/// A leased replica's slice moved.
pub(crate) fn slice(store: &Store, from: u64, to: u64) {
    #[cfg(feature = "tracing")]
    if from != to {
        tracing::debug!(target: TARGET, ledger = store.namespace(), replica = store.replica(),
            from, to, "slice changed");
    }
    #[cfg(not(feature = "tracing"))]
    let _ = (store, from, to);
}
