//! The ledger's metrics (`LedgerMetrics`, feature `metrics`) and `tracing` events (feature
//! `tracing`) against a real redis-server: each metric equals the stats published, and each
//! change of state (Redis down and back, a lease lost, a registration, a recovery) is one
//! event.

mod common;

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_bulkhead_llm::LlmRequest;
use async_bulkhead_llm_redis::{ExactLedger, FailurePolicy, LedgerConfig, LedgerMetrics};
use common::{RedisServer, bulkhead, reserve};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tracing_subscriber::layer::SubscriberExt;

fn config(server: &RedisServer, ns: &str, id: &str) -> LedgerConfig {
    LedgerConfig::new(server.url(), ns, 1_000)
        .replica_id(id)
        .lease(Duration::from_millis(900))
        .timeout(Duration::from_millis(100))
        .retry_every(Duration::from_millis(100))
        .failure(FailurePolicy::FailClosed)
}

/// One snapshot (the debugging recorder's snapshot drains its counters): metric name, its
/// extra label (besides `ledger` and `replica`) -> value.
type Metrics = std::collections::HashMap<(String, Option<(String, String)>), DebugValue>;

fn read(snapshotter: &Snapshotter) -> Metrics {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let key = key.key();
            assert!(
                key.labels()
                    .any(|l| l.key() == "ledger" && l.value() == "{metrics}")
            );
            assert!(
                key.labels()
                    .any(|l| l.key() == "replica" && l.value() == "a")
            );
            let extra = key
                .labels()
                .find(|l| l.key() != "ledger" && l.key() != "replica")
                .map(|l| (l.key().to_owned(), l.value().to_owned()));
            ((key.name().to_owned(), extra), value)
        })
        .collect()
}

fn get<'a>(
    metrics: &'a Metrics,
    name: &str,
    label: Option<(&str, &str)>,
) -> Option<&'a DebugValue> {
    metrics.get(&(
        name.to_owned(),
        label.map(|(k, v)| (k.to_owned(), v.to_owned())),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_are_the_stats_published() {
    let mut server = RedisServer::start();
    let ledger = ExactLedger::connect(bulkhead(10_000), config(&server, "{metrics}", "a"))
        .await
        .unwrap();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let metrics = metrics::with_local_recorder(&recorder, || LedgerMetrics::exact(&ledger));
    let held = ledger
        .try_acquire(&LlmRequest::new(), reserve(100, 500))
        .await
        .unwrap();
    let second = ledger
        .try_acquire(&LlmRequest::new(), reserve(50, 50))
        .await
        .unwrap();
    drop(second);
    assert!(ledger.settled(Duration::from_secs(2)).await);
    // 600 + 500 > 1,000: a global refusal.
    assert!(
        ledger
            .try_acquire(&LlmRequest::new(), reserve(100, 400))
            .await
            .is_err()
    );
    let stats = metrics.publish().unwrap();
    assert_eq!((stats.reserved, stats.refused_global), (2, 1));
    let seen = read(&snapshotter);
    let counter = |name, label| get(&seen, name, label);
    assert_eq!(seen.len(), 22, "every metric registered: {seen:?}");
    assert_eq!(
        counter("llm_ledger_reservations_total", None),
        Some(&DebugValue::Counter(2))
    );
    assert_eq!(
        counter("llm_ledger_refusals_total", Some(("reason", "global"))),
        Some(&DebugValue::Counter(1))
    );
    assert_eq!(
        counter("llm_ledger_refusals_total", Some(("reason", "unavailable"))),
        Some(&DebugValue::Counter(0))
    );
    assert_eq!(
        counter("llm_ledger_releases_total", None),
        Some(&DebugValue::Counter(1))
    );
    assert_eq!(
        counter("llm_ledger_degraded", None),
        Some(&DebugValue::Gauge(0.0.into()))
    );
    // Redis down: a refusal for it, and degraded.
    server.kill();
    assert!(
        ledger
            .try_acquire(&LlmRequest::new(), reserve(10, 10))
            .await
            .is_err()
    );
    let stats = metrics.publish().unwrap();
    assert_eq!(stats.refused_unavailable, 1);
    let seen = read(&snapshotter);
    let counter = |name, label| get(&seen, name, label);
    assert_eq!(
        counter("llm_ledger_refusals_total", Some(("reason", "unavailable"))),
        Some(&DebugValue::Counter(1))
    );
    assert_eq!(
        counter("llm_ledger_store_errors_total", None),
        Some(&DebugValue::Counter(stats.store_errors))
    );
    assert!(stats.store_errors >= 1);
    assert_eq!(
        counter("llm_ledger_degraded", None),
        Some(&DebugValue::Gauge(1.0.into()))
    );
    drop(held);
    drop(ledger);
    // The metrics keep no clone: the ledger is gone once its background task lets go (after
    // the step it is in: here a retry against the dead server, within a timeout).
    let started = Instant::now();
    while metrics.publish().is_some() {
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the metrics keep the ledger"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Collects every event as `LEVEL message field=value ...`.
#[derive(Clone, Default)]
struct Collect(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Collect {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Fields(String);
        impl tracing::field::Visit for Fields {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                let _ = write!(self.0, " {}={:?}", field.name(), value);
            }
        }
        let mut fields = Fields(String::new());
        event.record(&mut fields);
        let line = format!("{}{}", event.metadata().level(), fields.0);
        self.0.lock().unwrap().push(line);
    }
}

impl Collect {
    fn find(&self, needle: &str) -> Option<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .find(|line| line.contains(needle))
            .cloned()
    }
}

/// One thread (the ledger's background task included), so the thread's subscriber sees every
/// event.
#[tokio::test]
async fn a_restart_is_told_as_events() {
    let collect = Collect::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(collect.clone()));
    let mut server = RedisServer::start();
    let ledger = ExactLedger::connect(bulkhead(1_000), config(&server, "{traced}", "a"))
        .await
        .unwrap();
    let held = ledger
        .try_acquire(&LlmRequest::new(), reserve(100, 500))
        .await
        .unwrap();
    server.restart();
    let started = Instant::now();
    while collect.find("lease lost").is_none() || collect.find("tokens_added=600").is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            collect.0.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lost = collect.find("lease lost").unwrap();
    assert!(lost.starts_with("WARN"), "{lost}");
    assert!(
        lost.contains("ledger=\"{traced}\"") && lost.contains("replica=\"a\""),
        "{lost}"
    );
    let registered = collect.find("tokens_added=600").unwrap();
    assert!(
        registered.starts_with("INFO") && registered.contains("holds=1"),
        "{registered}"
    );
    // It knew the ledger and found it gone: a recovery, told once.
    let recovering = collect.find("recovering").unwrap();
    assert!(
        recovering.starts_with("WARN") && recovering.contains("wait_ms="),
        "{recovering}"
    );
    assert_eq!(ledger.stats().leases_lost, 1);
    drop(held);
}
