//! The ledger's metrics through the [`metrics`] facade (feature `metrics`):
//! [`LedgerMetrics`] registers one replica's counters and gauges and sets them from its
//! [`LedgerStats`] when published, as the core crate's `BulkheadMetrics` does for a bulkhead.

use metrics::{Counter, Gauge, Label};

use crate::exact::ExactLedger;
use crate::leased::LeasedLedger;
use crate::stats::{LedgerStats, StatsReader};

/// What a metric reads from the stats.
type Source = fn(&LedgerStats) -> u64;

/// A label beyond `ledger` and `replica`.
type Extra = Option<(&'static str, &'static str)>;

/// The counters, each with what it reads.
const COUNTERS: [(&str, Extra, Source); 18] = [
    ("llm_ledger_reservations_total", None, |s| s.reserved),
    (
        "llm_ledger_refusals_total",
        Some(("reason", "global")),
        |s| s.refused_global,
    ),
    ("llm_ledger_refusals_total", Some(("reason", "rate")), |s| {
        s.refused_rate
    }),
    (
        "llm_ledger_refusals_total",
        Some(("reason", "unavailable")),
        |s| s.refused_unavailable,
    ),
    ("llm_ledger_floor_admissions_total", None, |s| {
        s.admitted_on_floor
    }),
    (
        "llm_ledger_usage_updates_total",
        Some(("outcome", "applied")),
        |s| s.usage_applied,
    ),
    (
        "llm_ledger_usage_updates_total",
        Some(("outcome", "stale")),
        |s| s.usage_stale,
    ),
    (
        "llm_ledger_usage_updates_total",
        Some(("outcome", "skipped")),
        |s| s.usage_skipped,
    ),
    ("llm_ledger_store_errors_total", None, |s| s.store_errors),
    ("llm_ledger_leases_lost_total", None, |s| s.leases_lost),
    ("llm_ledger_registrations_total", None, |s| {
        s.reregistrations
    }),
    ("llm_ledger_registered_tokens_total", None, |s| {
        s.reregistered_tokens
    }),
    ("llm_ledger_recovering_total", None, |s| s.recovering),
    ("llm_ledger_releases_total", None, |s| s.releases_deferred),
    ("llm_ledger_releases_on_reservations_total", None, |s| {
        s.releases_on_reservations
    }),
    ("llm_ledger_rebalances_total", None, |s| s.rebalances),
    ("llm_ledger_stray_tokens_released_total", None, |s| {
        s.stray_tokens_released
    }),
    ("llm_ledger_missing_tokens_put_back_total", None, |s| {
        s.missing_tokens_put_back
    }),
];

/// The gauges read from the stats (and `llm_ledger_degraded`, from the ledger's health).
const GAUGES: [(&str, Source); 3] = [
    ("llm_ledger_releases_pending", |s| s.releases_pending),
    ("llm_ledger_slice_tokens", |s| s.slice),
    ("llm_ledger_floor_in_flight_tokens", |s| s.floor_in_flight),
];

/// Metrics of one replica's ledger, registered with the `metrics` recorder installed when it
/// is created (install the recorder first). Every metric carries the labels `ledger` (the
/// namespace) and `replica` (the replica's id).
///
/// | Metric | Kind | Labels | Source |
/// |---|---|---|---|
/// | `llm_ledger_reservations_total` | counter | | [`LedgerStats::reserved`] |
/// | `llm_ledger_refusals_total` | counter | `reason` (`global`, `rate`, `unavailable`) | `refused_global`, `refused_rate`, `refused_unavailable` |
/// | `llm_ledger_floor_admissions_total` | counter | | `admitted_on_floor` |
/// | `llm_ledger_usage_updates_total` | counter | `outcome` (`applied`, `stale`, `skipped`) | `usage_applied`, `usage_stale`, `usage_skipped` |
/// | `llm_ledger_store_errors_total` | counter | | `store_errors` |
/// | `llm_ledger_leases_lost_total` | counter | | `leases_lost` |
/// | `llm_ledger_registrations_total` | counter | | `reregistrations` |
/// | `llm_ledger_registered_tokens_total` | counter | | `reregistered_tokens` |
/// | `llm_ledger_recovering_total` | counter | | `recovering` |
/// | `llm_ledger_releases_total` | counter | | `releases_deferred` |
/// | `llm_ledger_releases_on_reservations_total` | counter | | `releases_on_reservations` |
/// | `llm_ledger_rebalances_total` | counter | | `rebalances` (leased mode) |
/// | `llm_ledger_stray_tokens_released_total` | counter | | `stray_tokens_released` |
/// | `llm_ledger_missing_tokens_put_back_total` | counter | | `missing_tokens_put_back` |
/// | `llm_ledger_releases_pending` | gauge | | `releases_pending` |
/// | `llm_ledger_slice_tokens` | gauge | | `slice` (leased mode) |
/// | `llm_ledger_floor_in_flight_tokens` | gauge | | `floor_in_flight` |
/// | `llm_ledger_degraded` | gauge | | 1 while Redis does not answer (exact: [`ExactLedger::is_degraded`]; leased: [`LeasedLedger::is_on_fallback`]), else 0 |
///
/// They change only when [`publish`](Self::publish) reads the stats (call it before each
/// scrape, or from a periodic task): every counter only grows, so each is written with
/// [`Counter::absolute`] and equals the stats read then. The metrics hold no clone of the
/// ledger: once it is dropped (and its background task has finished the step it was in),
/// `publish` does nothing.
///
/// # Examples
///
/// ```no_run
/// use async_bulkhead_llm::{LlmBulkhead, TokenBudget};
/// use async_bulkhead_llm_redis::{ExactLedger, LedgerConfig, LedgerMetrics};
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// // Install a recorder first (metrics-exporter-prometheus, for example).
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 64)
///     .token_budget(TokenBudget::new(100_000))
///     .build()?;
/// let config = LedgerConfig::new("redis://127.0.0.1:6379/", "{gpt-4o}", 200_000);
/// let ledger = ExactLedger::connect(bulkhead, config).await?;
/// let metrics = LedgerMetrics::exact(&ledger);
/// // Before each scrape:
/// let stats = metrics.publish();
/// assert!(stats.is_some());
/// # Ok(()) }
/// ```
pub struct LedgerMetrics {
    read: StatsReader,
    counters: Vec<(Counter, Source)>,
    gauges: Vec<(Gauge, Source)>,
    degraded: Gauge,
}

impl LedgerMetrics {
    /// Registers the metrics of an exact-mode replica.
    pub fn exact(ledger: &ExactLedger) -> LedgerMetrics {
        let (namespace, replica) = ledger.names();
        LedgerMetrics::register(namespace, replica, ledger.reader())
    }

    /// Registers the metrics of a leased-mode replica.
    pub fn leased(ledger: &LeasedLedger) -> LedgerMetrics {
        let (namespace, replica) = ledger.names();
        LedgerMetrics::register(namespace, replica, ledger.reader())
    }

    fn register(namespace: &str, replica: &str, read: StatsReader) -> LedgerMetrics {
        let base = [
            Label::new("ledger", namespace.to_owned()),
            Label::new("replica", replica.to_owned()),
        ];
        let labels = |extra: Extra| {
            let mut labels = base.to_vec();
            if let Some((key, value)) = extra {
                labels.push(Label::new(key, value));
            }
            labels
        };
        LedgerMetrics {
            read,
            counters: COUNTERS
                .iter()
                .map(|&(name, extra, source)| (metrics::counter!(name, labels(extra)), source))
                .collect(),
            gauges: GAUGES
                .iter()
                .map(|&(name, source)| (metrics::gauge!(name, labels(None)), source))
                .collect(),
            degraded: metrics::gauge!("llm_ledger_degraded", labels(None)),
        }
    }

    /// Reads the ledger's stats and sets every metric from them; the stats read (`None`, and
    /// nothing set, once the ledger is gone).
    pub fn publish(&self) -> Option<LedgerStats> {
        let (stats, degraded) = (self.read)()?;
        for (counter, source) in &self.counters {
            counter.absolute(source(&stats));
        }
        for (gauge, source) in &self.gauges {
            gauge.set(source(&stats) as f64);
        }
        self.degraded.set(if degraded { 1.0 } else { 0.0 });
        Some(stats)
    }
}

impl std::fmt::Debug for LedgerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LedgerMetrics")
            .field("counters", &self.counters.len())
            .field("gauges", &(self.gauges.len() + 1))
            .finish_non_exhaustive()
    }
}
