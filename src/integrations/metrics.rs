//! Metrics through the [`metrics`] facade (feature `metrics`): [`BulkheadMetrics`](crate::observability::BulkheadMetrics) registers,
//! for one bulkhead under a `bulkhead` and a `model` label, counters and gauges read from its
//! [`stats`](crate::LlmBulkhead::stats) when published, and histograms fed by a sampled event
//! listener ([`on_events_sampled`](crate::LlmBulkhead::on_events_sampled)).
//!
//! Nothing here writes to shared memory on an admission the sampler passes over: counters and
//! gauges cost nothing until [`publish`](BulkheadMetrics::publish) (they are the stats'
//! per-thread counters, summed then), and only sampled calls (and every call that waited in
//! the queue) reach the histograms.

use core::fmt;
use core::num::NonZeroU32;
use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use metrics::{Counter, Gauge, Histogram, Label, Unit};

use crate::events::{Event, EventKind, Subscription};
use crate::llm::bulkhead::LlmBulkhead;
use crate::stats::Stats;
use crate::vocabulary::admission_class::AbandonCause;
use crate::vocabulary::admission_id::AdmissionId;
use crate::vocabulary::rejection::{RejectReason, Scope};

/// The default sampling rate of the histograms: one call in 64 on each thread (and every call
/// that waited in the queue).
pub const DEFAULT_SAMPLE_EVERY: NonZeroU32 = NonZeroU32::new(64).unwrap();

/// Metrics of one [`LlmBulkhead`], registered with the `metrics` recorder installed when
/// [`install`](BulkheadMetrics::install) runs (install the recorder first, e.g.
/// `metrics-exporter-prometheus`'s).
///
/// Every metric carries the labels `bulkhead` (the name given) and `model` (the bulkhead's
/// model); names follow Prometheus conventions (snake_case, the unit in the name, `_total` for
/// counters). The OpenTelemetry GenAI histograms keep their semantic-convention names and
/// attributes (an exporter such as Prometheus's turns the dots into underscores).
///
/// | Metric | Kind | Labels | Source |
/// |---|---|---|---|
/// | `llm_bulkhead_admissions_total` | counter | | [`Stats::admitted`] |
/// | `llm_bulkhead_rejections_total` | counter | `reason` | [`Stats::rejected_by_reason`] |
/// | `llm_bulkhead_releases_total` | counter | | [`Stats::released`] |
/// | `llm_bulkhead_usage_reports_total` | counter | | [`Stats::usage_reports`] |
/// | `llm_bulkhead_tokens_reserved_total` | counter | | `token_budget.total_reserved` |
/// | `llm_bulkhead_tokens_consumed_total` | counter | | `token_budget.total_consumed` |
/// | `llm_bulkhead_tokens_refunded_total` | counter | | `token_budget.total_refunded` |
/// | `llm_bulkhead_tokens_overrun_total` | counter | | `token_budget.total_overrun` |
/// | `llm_bulkhead_tokens_reheld_total` | counter | | `token_budget.total_reheld` |
/// | `llm_bulkhead_tokens_returned_unreported_total` | counter | | `token_budget.total_returned_unreported` |
/// | `llm_bulkhead_borrowed_concurrency_abandoned_total` | counter | `cause` | [`Stats::borrowed_concurrency_abandoned_by_cause`] |
/// | `llm_bulkhead_listener_panics_total` | counter | | [`Stats::listener_panics`] |
/// | `llm_bulkhead_dedup_hits_total` | counter | | `deduplication.hits` |
/// | `llm_bulkhead_bypassed_total` | counter | | `observe.bypassed` |
/// | `llm_bulkhead_in_flight_calls` | gauge | | [`Stats::in_flight`] |
/// | `llm_bulkhead_abandoned_in_flight_calls` | gauge | | [`Stats::abandoned_in_flight`] |
/// | `llm_bulkhead_queued_calls` | gauge | | [`Stats::pending`] (the queue depth) |
/// | `llm_bulkhead_in_flight_tokens` | gauge | | `token_budget.in_flight_tokens` |
/// | `llm_bulkhead_available_tokens` | gauge | | `token_budget.available` |
/// | `llm_bulkhead_budget_tokens` | gauge | | `limits.token_budget` |
/// | `llm_bulkhead_max_concurrent_calls` | gauge | | `limits.max_concurrent` |
/// | `llm_bulkhead_max_queue_calls` | gauge | | `limits.max_queue` |
/// | `llm_bulkhead_limits_revision` | gauge | | `limits.revision` |
/// | `llm_bulkhead_closed` | gauge | | [`Stats::closed`] (0 or 1) |
/// | `llm_bulkhead_class_in_flight_calls` | gauge | `class` | per class `in_flight` |
/// | `llm_bulkhead_class_in_flight_tokens` | gauge | `class` | per class `in_flight_tokens` |
/// | `llm_bulkhead_class_admissions_total` | counter | `class` | per class `admitted` |
/// | `llm_bulkhead_class_rejections_total` | counter | `class`, `reason` | per class `rejected_by_reason` |
/// | `llm_bulkhead_queue_wait_seconds` | histogram | `outcome` | every call that waited: admit or reject event's `queue_wait` (`outcome` is `admitted` or the refusal's reason) |
/// | `llm_bulkhead_decision_seconds` | histogram | | sampled admit and reject events' `decision_duration` |
/// | `llm_bulkhead_hold_seconds` | histogram | | sampled admissions: admit event to release event |
/// | `gen_ai.client.token.usage` | histogram | `gen_ai.token.type`, `gen_ai.request.model`, `gen_ai.operation.name` (`gen_ai.provider.name`) | sampled release events' `usage` (input and output) |
/// | `gen_ai.client.operation.duration` | histogram | `gen_ai.request.model`, `gen_ai.operation.name` (`gen_ai.provider.name`) | the same as `llm_bulkhead_hold_seconds` |
///
/// Counters and gauges change only when [`publish`](BulkheadMetrics::publish) reads the stats
/// (call it before each scrape, or let [`publish_every`](BulkheadMetrics::publish_every) do it):
/// every `total_*` of the stats only grows, so each is written with
/// [`Counter::absolute`](metrics::Counter::absolute) and equals the stats read at that moment.
/// Per-class metrics exist on a bulkhead with admission classes, `llm_bulkhead_dedup_hits_total`
/// on one that deduplicates, and the token metrics on one with a token budget.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, observability::BulkheadMetrics, LlmBulkhead, LlmRequest};
/// use metrics_util::debugging::{DebugValue, DebuggingRecorder};
///
/// let recorder = DebuggingRecorder::new();
/// let snapshotter = recorder.snapshotter();
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 4).build()?;
/// let metrics = metrics::with_local_recorder(&recorder, || BulkheadMetrics::install(&bulkhead, "primary"));
///
/// drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?);
/// metrics.publish();
///
/// let admissions = snapshotter.snapshot().into_vec().into_iter().find_map(|(key, _, _, value)| {
///     (key.key().name() == "llm_bulkhead_admissions_total").then_some(value)
/// });
/// assert_eq!(admissions, Some(DebugValue::Counter(1)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct BulkheadMetrics {
    bulkhead: LlmBulkhead,
    published: Arc<Published>,
    _sampled: Subscription,
}

/// The builder of [`BulkheadMetrics`](crate::observability::BulkheadMetrics): labels and the histograms' sampling rate.
///
/// # Examples
///
/// ```
/// use std::num::NonZeroU32;
/// use async_bulkhead_llm::{observability::BulkheadMetrics, LlmBulkhead};
///
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 4).build()?;
/// let _metrics = BulkheadMetrics::builder(&bulkhead, "primary")
///     .sample_every(NonZeroU32::new(8).unwrap())
///     .provider("openai")
///     .label("region", "eu-west-1")
///     .install();
/// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
/// ```
#[must_use = "a builder does nothing until `install`"]
pub struct BulkheadMetricsBuilder {
    bulkhead: LlmBulkhead,
    name: String,
    sample_every: NonZeroU32,
    provider: Option<String>,
    operation: String,
    labels: Vec<Label>,
    skip_unmoved: bool,
}

impl BulkheadMetricsBuilder {
    /// The histograms hear one call in `every` on each thread, and every call that waited in
    /// the queue ([`DEFAULT_SAMPLE_EVERY`](crate::observability::DEFAULT_SAMPLE_EVERY) unless set). 1 makes them exact (every call pays a
    /// delivery and two clock reads).
    pub fn sample_every(mut self, every: NonZeroU32) -> BulkheadMetricsBuilder {
        self.sample_every = every;
        self
    }

    /// The `gen_ai.provider.name` attribute of the OpenTelemetry GenAI histograms (e.g.
    /// `"openai"`, `"anthropic"`); absent unless set.
    pub fn provider(mut self, provider: impl Into<String>) -> BulkheadMetricsBuilder {
        self.provider = Some(provider.into());
        self
    }

    /// The `gen_ai.operation.name` attribute of the OpenTelemetry GenAI histograms (`"chat"`
    /// unless set).
    pub fn operation(mut self, operation: impl Into<String>) -> BulkheadMetricsBuilder {
        self.operation = operation.into();
        self
    }

    /// Registers each series only once it first moves from 0 (a counter that counted, a gauge
    /// off 0, a histogram that recorded), instead of every series at `install`: a family of
    /// many tenants then exports only what its tenants did, not a block of zeros per tenant.
    /// A series registered stays registered. A series is registered with the recorder current
    /// where it first moves (a `publish`, or the thread a sampled call ran on): use it with a
    /// global recorder. Default: off (every series at `install`).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{observability::BulkheadMetrics, LlmBulkhead};
    ///
    /// let bulkhead = LlmBulkhead::builder("gpt-4o", 4).build()?;
    /// let metrics = BulkheadMetrics::builder(&bulkhead, "tenant-acme").skip_unmoved(true).install();
    /// metrics.publish(); // registers `max_concurrent_calls` (4), not the zero counters
    /// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
    /// ```
    pub fn skip_unmoved(mut self, on: bool) -> BulkheadMetricsBuilder {
        self.skip_unmoved = on;
        self
    }

    /// The level this bulkhead decides in a tenant-within-global admission (see
    /// [`LlmBulkhead::try_acquire_within`](crate::LlmBulkhead::try_acquire_within)): every
    /// metric gets the label `scope` (`tenant` or `global`), so that
    /// `sum by (scope, reason) (llm_bulkhead_rejections_total)` tells the refusals of the
    /// tenants' own limits from the global ones (each level counts only its own refusals).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{observability::BulkheadMetrics, rejection::Scope, LlmBulkhead};
    ///
    /// let global = LlmBulkhead::builder("gpt-4o", 32).build()?;
    /// let _metrics = BulkheadMetrics::builder(&global, "openai").scope(Scope::Global).install();
    /// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
    /// ```
    pub fn scope(self, scope: Scope) -> BulkheadMetricsBuilder {
        self.label("scope", scope.as_str())
    }

    /// A label added to every metric (e.g. the region or the replica).
    pub fn label(
        mut self,
        key: impl Into<String>,
        value: impl Into<String>,
    ) -> BulkheadMetricsBuilder {
        self.labels.push(Label::new(key.into(), value.into()));
        self
    }

    /// Registers every metric with the current recorder and subscribes the sampled listener.
    pub fn install(self) -> BulkheadMetrics {
        let mut labels = vec![
            Label::new("bulkhead", self.name),
            Label::new("model", self.bulkhead.model().to_owned()),
        ];
        labels.extend(self.labels);
        describe();
        let stats = self.bulkhead.stats();
        let eager = !self.skip_unmoved;
        let published = Arc::new(Published::new(eager, &labels, &stats));
        let mut gen_ai = vec![
            Label::new("gen_ai.request.model", self.bulkhead.model().to_owned()),
            Label::new("gen_ai.operation.name", self.operation),
        ];
        if let Some(provider) = self.provider {
            gen_ai.push(Label::new("gen_ai.provider.name", provider));
        }
        gen_ai.extend(labels.iter().cloned());
        let sampled = Arc::new(Sampled::new(eager, &labels, &gen_ai));
        let subscription = self.bulkhead.on_events_sampled(
            [EventKind::Admit, EventKind::Reject, EventKind::Release],
            self.sample_every,
            move |event| sampled.hear(event),
        );
        BulkheadMetrics {
            bulkhead: self.bulkhead,
            published,
            _sampled: subscription,
        }
    }
}

impl BulkheadMetrics {
    /// Installs the metrics of `bulkhead` under the label `bulkhead="name"`, with the default
    /// sampling rate (see [`builder`](BulkheadMetrics::builder)).
    pub fn install(bulkhead: &LlmBulkhead, name: impl Into<String>) -> BulkheadMetrics {
        BulkheadMetrics::builder(bulkhead, name).install()
    }

    /// A builder, to set the sampling rate or add labels.
    pub fn builder(bulkhead: &LlmBulkhead, name: impl Into<String>) -> BulkheadMetricsBuilder {
        BulkheadMetricsBuilder {
            bulkhead: bulkhead.clone(),
            name: name.into(),
            sample_every: DEFAULT_SAMPLE_EVERY,
            provider: None,
            operation: "chat".to_owned(),
            labels: Vec::new(),
            skip_unmoved: false,
        }
    }

    /// Reads the bulkhead's stats once and writes every counter and gauge from them; returns
    /// the stats read.
    pub fn publish(&self) -> Stats {
        let stats = self.bulkhead.stats();
        self.published.write(&stats);
        stats
    }

    /// Publishes now and then every `period` on a thread of its own, until the returned
    /// [`Publisher`](crate::observability::Publisher) is dropped.
    ///
    /// # Panics
    ///
    /// If the thread cannot be spawned.
    pub fn publish_every(&self, period: Duration) -> Publisher {
        let (stop, stopped) = mpsc::channel::<()>();
        let bulkhead = self.bulkhead.clone();
        let published = Arc::clone(&self.published);
        let thread = thread::Builder::new()
            .name("llm-bulkhead-metrics".into())
            .spawn(move || {
                loop {
                    published.write(&bulkhead.stats());
                    match stopped.recv_timeout(period) {
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                }
            })
            .expect("spawn the metrics publisher thread");
        Publisher {
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl fmt::Debug for BulkheadMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkheadMetrics")
            .field("model", &self.bulkhead.model())
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for BulkheadMetricsBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkheadMetricsBuilder")
            .field("name", &self.name)
            .field("sample_every", &self.sample_every)
            .finish_non_exhaustive()
    }
}

/// A thread publishing a bulkhead's metrics periodically (see
/// [`BulkheadMetrics::publish_every`](crate::observability::BulkheadMetrics::publish_every)); dropping it stops the thread and waits for it.
#[derive(Debug)]
pub struct Publisher {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

const REJECTIONS: &str = "llm_bulkhead_rejections_total";
const QUEUE_WAIT: &str = "llm_bulkhead_queue_wait_seconds";

/// Registers the descriptions and units of every metric with the current recorder.
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        "llm_bulkhead_admissions_total",
        Unit::Count,
        "Calls admitted."
    );
    describe_counter!(REJECTIONS, Unit::Count, "Calls refused, by reason.");
    describe_counter!(
        "llm_bulkhead_releases_total",
        Unit::Count,
        "Admissions settled."
    );
    describe_counter!(
        "llm_bulkhead_usage_reports_total",
        Unit::Count,
        "Usage reports that changed an admission's usage or hold."
    );
    for (name, what) in [
        (
            "llm_bulkhead_tokens_reserved_total",
            "Tokens reserved by admissions.",
        ),
        (
            "llm_bulkhead_tokens_consumed_total",
            "Tokens admissions were settled with.",
        ),
        (
            "llm_bulkhead_tokens_refunded_total",
            "Tokens removed from holds (gross).",
        ),
        (
            "llm_bulkhead_tokens_overrun_total",
            "Tokens held above reservations.",
        ),
        (
            "llm_bulkhead_tokens_reheld_total",
            "Tokens added back to holds below reservations.",
        ),
        (
            "llm_bulkhead_tokens_returned_unreported_total",
            "Tokens of holds released without any usage.",
        ),
    ] {
        describe_counter!(name, Unit::Count, what);
    }
    describe_counter!(
        "llm_bulkhead_borrowed_concurrency_abandoned_total",
        Unit::Count,
        "Admissions that gave their borrowed slot back before settling, by cause."
    );
    describe_counter!(
        "llm_bulkhead_listener_panics_total",
        Unit::Count,
        "Panics of event listeners, caught."
    );
    describe_counter!(
        "llm_bulkhead_dedup_hits_total",
        Unit::Count,
        "Calls that joined an identical call in flight."
    );
    describe_counter!(
        "llm_bulkhead_bypassed_total",
        Unit::Count,
        "Observe-mode calls run although refused."
    );
    describe_gauge!(
        "llm_bulkhead_in_flight_calls",
        Unit::Count,
        "Admissions holding a slot."
    );
    describe_gauge!(
        "llm_bulkhead_abandoned_in_flight_calls",
        Unit::Count,
        "Unsettled admissions that gave their borrowed slot back."
    );
    describe_gauge!(
        "llm_bulkhead_queued_calls",
        Unit::Count,
        "Calls waiting in the queue."
    );
    describe_gauge!(
        "llm_bulkhead_in_flight_tokens",
        Unit::Count,
        "Tokens held by admissions."
    );
    describe_gauge!(
        "llm_bulkhead_available_tokens",
        Unit::Count,
        "Budget minus tokens held."
    );
    describe_gauge!(
        "llm_bulkhead_budget_tokens",
        Unit::Count,
        "The token budget in force."
    );
    describe_gauge!(
        "llm_bulkhead_max_concurrent_calls",
        Unit::Count,
        "The concurrency cap."
    );
    describe_gauge!(
        "llm_bulkhead_max_queue_calls",
        Unit::Count,
        "The queue's capacity."
    );
    describe_gauge!(
        "llm_bulkhead_limits_revision",
        Unit::Count,
        "Revision of the limits."
    );
    describe_gauge!(
        "llm_bulkhead_closed",
        Unit::Count,
        "1 once the bulkhead is closed."
    );
    describe_gauge!(
        "llm_bulkhead_class_in_flight_calls",
        Unit::Count,
        "Admissions per class."
    );
    describe_gauge!(
        "llm_bulkhead_class_in_flight_tokens",
        Unit::Count,
        "Tokens held per class."
    );
    describe_counter!(
        "llm_bulkhead_class_admissions_total",
        Unit::Count,
        "Admissions per class."
    );
    describe_counter!(
        "llm_bulkhead_class_rejections_total",
        Unit::Count,
        "Refusals per class, by reason."
    );
    describe_histogram!(
        QUEUE_WAIT,
        Unit::Seconds,
        "Time calls waited in the queue, by outcome (every call that waited)."
    );
    describe_histogram!(
        "llm_bulkhead_decision_seconds",
        Unit::Seconds,
        "Time an admission decision took, queue wait excluded (sampled)."
    );
    describe_histogram!(
        "llm_bulkhead_hold_seconds",
        Unit::Seconds,
        "Time admissions held their capacity, admit to release (sampled)."
    );
    describe_histogram!(
        "gen_ai.client.token.usage",
        Unit::Count,
        "Input and output tokens per call (OpenTelemetry GenAI; sampled)."
    );
    describe_histogram!(
        "gen_ai.client.operation.duration",
        Unit::Seconds,
        "Duration of a call, admit to release (OpenTelemetry GenAI; sampled)."
    );
}

fn with(labels: &[Label], key: &'static str, value: impl Into<String>) -> Vec<Label> {
    let mut labels = labels.to_vec();
    labels.push(Label::new(key, value.into()));
    labels
}

/// One series: registered with the recorder at once, or (with
/// [`skip_unmoved`](BulkheadMetricsBuilder::skip_unmoved)) the first time it moves from 0.
struct Series<T> {
    name: &'static str,
    labels: Vec<Label>,
    make: fn(&'static str, Vec<Label>) -> T,
    handle: OnceLock<T>,
}

impl<T> Series<T> {
    fn new(
        eager: bool,
        make: fn(&'static str, Vec<Label>) -> T,
        name: &'static str,
        labels: &[Label],
    ) -> Series<T> {
        let series = Series {
            name,
            labels: labels.to_vec(),
            make,
            handle: OnceLock::new(),
        };
        if eager {
            series.handle();
        }
        series
    }

    fn handle(&self) -> &T {
        self.handle
            .get_or_init(|| (self.make)(self.name, self.labels.clone()))
    }

    /// The handle once the series has moved (or was registered eagerly), for a value `moved`.
    fn moved(&self, moved: bool) -> Option<&T> {
        if moved {
            Some(self.handle())
        } else {
            self.handle.get()
        }
    }
}

impl Series<Counter> {
    fn absolute(&self, value: u64) {
        if let Some(counter) = self.moved(value != 0) {
            counter.absolute(value);
        }
    }
}

impl Series<Gauge> {
    fn set(&self, value: f64) {
        if let Some(gauge) = self.moved(value != 0.0) {
            gauge.set(value);
        }
    }
}

impl Series<Histogram> {
    fn record(&self, value: impl metrics::IntoF64) {
        self.handle().record(value);
    }
}

fn counter(eager: bool, name: &'static str, labels: &[Label]) -> Series<Counter> {
    Series::new(
        eager,
        |name, labels| metrics::counter!(name, labels),
        name,
        labels,
    )
}

fn gauge(eager: bool, name: &'static str, labels: &[Label]) -> Series<Gauge> {
    Series::new(
        eager,
        |name, labels| metrics::gauge!(name, labels),
        name,
        labels,
    )
}

fn histogram(eager: bool, name: &'static str, labels: &[Label]) -> Series<Histogram> {
    Series::new(
        eager,
        |name, labels| metrics::histogram!(name, labels),
        name,
        labels,
    )
}

/// The counters and gauges written from the stats.
struct Published {
    admissions: Series<Counter>,
    rejections: [Series<Counter>; RejectReason::ALL.len()],
    releases: Series<Counter>,
    usage_reports: Series<Counter>,
    abandoned: [Series<Counter>; AbandonCause::ALL.len()],
    listener_panics: Series<Counter>,
    bypassed: Series<Counter>,
    dedup_hits: Option<Series<Counter>>,
    in_flight: Series<Gauge>,
    abandoned_in_flight: Series<Gauge>,
    queued: Series<Gauge>,
    max_concurrent: Series<Gauge>,
    max_queue: Series<Gauge>,
    revision: Series<Gauge>,
    closed: Series<Gauge>,
    tokens: Option<TokenMetrics>,
    classes: Vec<ClassMetrics>,
}

struct TokenMetrics {
    reserved: Series<Counter>,
    consumed: Series<Counter>,
    refunded: Series<Counter>,
    overrun: Series<Counter>,
    reheld: Series<Counter>,
    returned_unreported: Series<Counter>,
    in_flight: Series<Gauge>,
    available: Series<Gauge>,
    budget: Series<Gauge>,
}

struct ClassMetrics {
    in_flight: Series<Gauge>,
    in_flight_tokens: Series<Gauge>,
    admissions: Series<Counter>,
    rejections: [Series<Counter>; RejectReason::ALL.len()],
}

impl Published {
    fn new(eager: bool, labels: &[Label], stats: &Stats) -> Published {
        let by_reason = |name, labels: &[Label]| {
            core::array::from_fn(|i| {
                counter(
                    eager,
                    name,
                    &with(labels, "reason", RejectReason::ALL[i].as_str()),
                )
            })
        };
        Published {
            admissions: counter(eager, "llm_bulkhead_admissions_total", labels),
            rejections: by_reason(REJECTIONS, labels),
            releases: counter(eager, "llm_bulkhead_releases_total", labels),
            usage_reports: counter(eager, "llm_bulkhead_usage_reports_total", labels),
            abandoned: core::array::from_fn(|i| {
                counter(
                    eager,
                    "llm_bulkhead_borrowed_concurrency_abandoned_total",
                    &with(labels, "cause", AbandonCause::ALL[i].to_string()),
                )
            }),
            listener_panics: counter(eager, "llm_bulkhead_listener_panics_total", labels),
            bypassed: counter(eager, "llm_bulkhead_bypassed_total", labels),
            dedup_hits: stats
                .deduplication
                .map(|_| counter(eager, "llm_bulkhead_dedup_hits_total", labels)),
            in_flight: gauge(eager, "llm_bulkhead_in_flight_calls", labels),
            abandoned_in_flight: gauge(eager, "llm_bulkhead_abandoned_in_flight_calls", labels),
            queued: gauge(eager, "llm_bulkhead_queued_calls", labels),
            max_concurrent: gauge(eager, "llm_bulkhead_max_concurrent_calls", labels),
            max_queue: gauge(eager, "llm_bulkhead_max_queue_calls", labels),
            revision: gauge(eager, "llm_bulkhead_limits_revision", labels),
            closed: gauge(eager, "llm_bulkhead_closed", labels),
            tokens: stats.token_budget.map(|_| TokenMetrics {
                reserved: counter(eager, "llm_bulkhead_tokens_reserved_total", labels),
                consumed: counter(eager, "llm_bulkhead_tokens_consumed_total", labels),
                refunded: counter(eager, "llm_bulkhead_tokens_refunded_total", labels),
                overrun: counter(eager, "llm_bulkhead_tokens_overrun_total", labels),
                reheld: counter(eager, "llm_bulkhead_tokens_reheld_total", labels),
                returned_unreported: counter(
                    eager,
                    "llm_bulkhead_tokens_returned_unreported_total",
                    labels,
                ),
                in_flight: gauge(eager, "llm_bulkhead_in_flight_tokens", labels),
                available: gauge(eager, "llm_bulkhead_available_tokens", labels),
                budget: gauge(eager, "llm_bulkhead_budget_tokens", labels),
            }),
            classes: stats
                .admission_classes
                .iter()
                .flat_map(|classes| &classes.classes)
                .map(|class| {
                    let labels = with(labels, "class", class.class.to_string());
                    ClassMetrics {
                        in_flight: gauge(eager, "llm_bulkhead_class_in_flight_calls", &labels),
                        in_flight_tokens: gauge(
                            eager,
                            "llm_bulkhead_class_in_flight_tokens",
                            &labels,
                        ),
                        admissions: counter(eager, "llm_bulkhead_class_admissions_total", &labels),
                        rejections: by_reason("llm_bulkhead_class_rejections_total", &labels),
                    }
                })
                .collect(),
        }
    }

    fn write(&self, stats: &Stats) {
        self.admissions.absolute(stats.admitted);
        for (counter, reason) in self.rejections.iter().zip(RejectReason::ALL) {
            counter.absolute(stats.rejected_by_reason.get(*reason));
        }
        self.releases.absolute(stats.released);
        self.usage_reports.absolute(stats.usage_reports);
        let abandoned = stats.borrowed_concurrency_abandoned_by_cause;
        for (counter, cause) in self.abandoned.iter().zip(AbandonCause::ALL) {
            counter.absolute(match cause {
                AbandonCause::Manual => abandoned.manual,
                AbandonCause::Deadline => abandoned.deadline,
            });
        }
        self.listener_panics.absolute(stats.listener_panics);
        self.bypassed
            .absolute(stats.observe.map_or(0, |observe| observe.bypassed));
        if let (Some(counter), Some(dedup)) = (&self.dedup_hits, stats.deduplication) {
            counter.absolute(dedup.hits);
        }
        self.in_flight.set(as_f64(stats.in_flight));
        self.abandoned_in_flight
            .set(as_f64(stats.abandoned_in_flight));
        self.queued.set(as_f64(stats.pending));
        self.max_concurrent
            .set(f64::from(stats.limits.max_concurrent));
        self.max_queue
            .set(as_f64(u64::from(stats.limits.max_queue)));
        self.revision.set(as_f64(stats.limits.revision));
        self.closed.set(if stats.closed { 1.0 } else { 0.0 });
        if let (Some(metrics), Some(tokens)) = (&self.tokens, stats.token_budget) {
            metrics.reserved.absolute(tokens.total_reserved);
            metrics.consumed.absolute(tokens.total_consumed);
            metrics.refunded.absolute(tokens.total_refunded);
            metrics.overrun.absolute(tokens.total_overrun);
            metrics.reheld.absolute(tokens.total_reheld);
            metrics
                .returned_unreported
                .absolute(tokens.total_returned_unreported);
            metrics.in_flight.set(as_f64(tokens.in_flight_tokens));
            metrics.available.set(as_f64(tokens.available));
            metrics.budget.set(as_f64(tokens.budget));
        }
        if let Some(classes) = &stats.admission_classes {
            for (metrics, class) in self.classes.iter().zip(&classes.classes) {
                metrics.in_flight.set(as_f64(class.in_flight));
                metrics.in_flight_tokens.set(as_f64(class.in_flight_tokens));
                metrics.admissions.absolute(class.admitted);
                for (counter, reason) in metrics.rejections.iter().zip(RejectReason::ALL) {
                    counter.absolute(class.rejected_by_reason.get(*reason));
                }
            }
        }
    }
}

/// A count as a gauge's value (exact below 2^53, far above any count a bulkhead reaches).
#[allow(clippy::cast_precision_loss)]
fn as_f64(value: u64) -> f64 {
    value as f64
}

/// The histograms, fed by the sampled listener.
struct Sampled {
    /// Queue waits of admitted calls, then of refused calls by reason.
    queue_wait_admitted: Series<Histogram>,
    queue_wait_refused: [Series<Histogram>; RejectReason::ALL.len()],
    decision: Series<Histogram>,
    hold: Series<Histogram>,
    input_tokens: Series<Histogram>,
    output_tokens: Series<Histogram>,
    operation: Series<Histogram>,
    /// When each sampled admission was admitted (removed at its release).
    admitted_at: Mutex<HashMap<AdmissionId, Instant>>,
}

impl Sampled {
    fn new(eager: bool, labels: &[Label], gen_ai: &[Label]) -> Sampled {
        Sampled {
            queue_wait_admitted: histogram(eager, QUEUE_WAIT, &with(labels, "outcome", "admitted")),
            queue_wait_refused: core::array::from_fn(|i| {
                histogram(
                    eager,
                    QUEUE_WAIT,
                    &with(labels, "outcome", RejectReason::ALL[i].as_str()),
                )
            }),
            decision: histogram(eager, "llm_bulkhead_decision_seconds", labels),
            hold: histogram(eager, "llm_bulkhead_hold_seconds", labels),
            input_tokens: histogram(
                eager,
                "gen_ai.client.token.usage",
                &with(gen_ai, "gen_ai.token.type", "input"),
            ),
            output_tokens: histogram(
                eager,
                "gen_ai.client.token.usage",
                &with(gen_ai, "gen_ai.token.type", "output"),
            ),
            operation: histogram(eager, "gen_ai.client.operation.duration", gen_ai),
            admitted_at: Mutex::new(HashMap::new()),
        }
    }

    fn hear(&self, event: &Event<'_>) {
        match event {
            Event::Admit(admit) => {
                self.decision.record(admit.decision_duration);
                if !admit.queue_wait.is_zero() {
                    self.queue_wait_admitted.record(admit.queue_wait);
                }
                self.admitted_at
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(admit.admission_id, Instant::now());
            }
            Event::Reject(reject) => {
                self.decision.record(reject.decision_duration);
                let reason = RejectReason::ALL.iter().position(|r| *r == reject.reason);
                if let Some(i) = reason
                    && !reject.queue_wait.is_zero()
                {
                    self.queue_wait_refused[i].record(reject.queue_wait);
                }
            }
            Event::Release(release) => {
                let admitted_at = self
                    .admitted_at
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&release.admission_id);
                // An admission admitted before the subscription has no start.
                if let Some(admitted_at) = admitted_at {
                    let held = admitted_at.elapsed();
                    self.hold.record(held);
                    self.operation.record(held);
                }
                if let Some(usage) = release.usage {
                    self.input_tokens.record(as_f64(usage.input()));
                    self.output_tokens.record(as_f64(usage.output()));
                }
            }
            _ => {}
        }
    }
}
