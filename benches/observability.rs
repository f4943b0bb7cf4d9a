//! What the `metrics` and `tracing` integrations cost an admission, in the same run:
//!
//! - `metrics/*`: `try_acquire` + release with a token budget (the `events/no_listener` cycle)
//!   without metrics, with `BulkheadMetrics` installed at its default sampling (one call in 64
//!   per thread feeds the histograms) under a real Prometheus recorder, and with every call
//!   sampled (`sample_every(1)`: exact histograms, a delivery and two clock reads per call).
//!   `metrics/publish` is one `publish()` (a stats read and every counter and gauge written).
//! - `tracing/*`: the same cycle with `trace_events` subscribed, with no subscriber and with one
//!   that filters `DEBUG` out (the listener runs; `tracing` drops the event).
//!
//! Figures are recorded in `benches/README.md`; `benches/targets.py` judges
//! `metrics/default_sampling` against `metrics/off` (<= 1.5x).

use std::hint::black_box;
use std::num::NonZeroU32;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget,
    observability::BulkheadMetrics, observability::trace_events,
};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

fn bulkhead() -> LlmBulkhead {
    LlmBulkhead::builder("claude-sonnet-4", 1024)
        .token_budget(TokenBudget::new(1 << 34))
        .build()
        .expect("valid configuration")
}

fn options() -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(100, 1000).expect("fits"))
}

fn metrics(c: &mut Criterion) {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).expect("the only recorder");
    let request = LlmRequest::new();
    let opts = options();

    let mut group = c.benchmark_group("metrics");
    group.throughput(Throughput::Elements(1));
    let off = bulkhead();
    group.bench_function("off", |b| {
        b.iter(|| drop(black_box(off.try_acquire(&request, black_box(opts)))))
    });
    let sampled = bulkhead();
    let sampled_metrics = BulkheadMetrics::install(&sampled, "sampled");
    group.bench_function("default_sampling", |b| {
        b.iter(|| drop(black_box(sampled.try_acquire(&request, black_box(opts)))))
    });
    let exact = bulkhead();
    let _exact_metrics = BulkheadMetrics::builder(&exact, "exact")
        .sample_every(NonZeroU32::MIN)
        .install();
    group.bench_function("every_call_sampled", |b| {
        b.iter(|| drop(black_box(exact.try_acquire(&request, black_box(opts)))))
    });
    group.bench_function("publish", |b| {
        b.iter(|| black_box(sampled_metrics.publish()))
    });
    group.finish();
    // The scrape renders what was recorded (kept alive to here, and a check it works).
    assert!(handle.render().contains("llm_bulkhead_admissions_total"));
}

fn tracing(c: &mut Criterion) {
    let request = LlmRequest::new();
    let opts = options();
    let mut group = c.benchmark_group("tracing");
    group.throughput(Throughput::Elements(1));
    let traced = bulkhead();
    let _traced = trace_events(&traced);
    group.bench_function("trace_events_no_subscriber", |b| {
        b.iter(|| drop(black_box(traced.try_acquire(&request, black_box(opts)))))
    });
    let info = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_writer(std::io::sink)
        .finish();
    tracing::subscriber::with_default(info, || {
        group.bench_function("trace_events_debug_filtered_out", |b| {
            b.iter(|| drop(black_box(traced.try_acquire(&request, black_box(opts)))))
        });
    });
    group.finish();
}

criterion_group!(benches, metrics, tracing);
criterion_main!(benches);
