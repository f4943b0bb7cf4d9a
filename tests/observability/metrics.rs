//! `BulkheadMetrics` against a test recorder.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, TokenUsage, classes::AdmissionClass,
    classes::AdmissionClasses, classes::ClassLimits, events::Event, events::EventKind,
    observability::BulkheadMetrics,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

use super::{bulkhead, on_two_threads, options};

type Recorded = Vec<(String, Vec<(String, String)>, DebugValue)>;

fn read(snapshotter: &Snapshotter) -> Recorded {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let labels = key
                .key()
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            (key.key().name().to_owned(), labels, value)
        })
        .collect()
}

/// The value of the metric `name` whose labels include `labels`; panics unless exactly one.
fn value<'r>(recorded: &'r Recorded, name: &str, labels: &[(&str, &str)]) -> &'r DebugValue {
    let mut found = recorded.iter().filter(|(n, have, _)| {
        n == name
            && labels
                .iter()
                .all(|(k, v)| have.iter().any(|(hk, hv)| hk == k && hv == v))
    });
    let (_, _, value) = found
        .next()
        .unwrap_or_else(|| panic!("no {name} {labels:?}"));
    assert!(found.next().is_none(), "several {name} {labels:?}");
    value
}

fn counter(recorded: &Recorded, name: &str, labels: &[(&str, &str)]) -> u64 {
    match value(recorded, name, labels) {
        DebugValue::Counter(v) => *v,
        other => panic!("{name} is {other:?}"),
    }
}

fn gauge(recorded: &Recorded, name: &str, labels: &[(&str, &str)]) -> f64 {
    match value(recorded, name, labels) {
        DebugValue::Gauge(v) => v.into_inner(),
        other => panic!("{name} is {other:?}"),
    }
}

fn samples(recorded: &Recorded, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
    match value(recorded, name, labels) {
        DebugValue::Histogram(v) => v.iter().map(|x| x.into_inner()).collect(),
        other => panic!("{name} is {other:?}"),
    }
}

fn every(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}

/// What a full listener saw: the expected histogram counts.
#[derive(Default)]
struct Seen {
    decisions: AtomicU64,
    waited_admitted: AtomicU64,
    waited_refused: AtomicU64,
    released_with_usage: AtomicU64,
    input_tokens: AtomicU64,
}

#[test]
fn counters_gauges_and_histograms_equal_the_stats_after_two_threads() {
    let _serial = super::serial();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let bulkhead = bulkhead();
    let metrics = metrics::with_local_recorder(&recorder, || {
        BulkheadMetrics::builder(&bulkhead, "primary")
            .sample_every(every(1))
            .install()
    });
    let seen = Arc::new(Seen::default());
    let log = seen.clone();
    let _full = bulkhead.on_events(
        [EventKind::Admit, EventKind::Reject, EventKind::Release],
        move |event| match event {
            Event::Admit(e) => {
                log.decisions.fetch_add(1, Ordering::Relaxed);
                if !e.queue_wait.is_zero() {
                    log.waited_admitted.fetch_add(1, Ordering::Relaxed);
                }
            }
            Event::Reject(e) => {
                log.decisions.fetch_add(1, Ordering::Relaxed);
                if !e.queue_wait.is_zero() {
                    log.waited_refused.fetch_add(1, Ordering::Relaxed);
                }
            }
            Event::Release(e) => {
                if let Some(usage) = e.usage {
                    log.released_with_usage.fetch_add(1, Ordering::Relaxed);
                    log.input_tokens.fetch_add(usage.input(), Ordering::Relaxed);
                }
            }
            _ => {}
        },
    );

    on_two_threads(&bulkhead, |work| work());
    let stats = metrics.publish();
    let r = read(&snapshotter);

    // The workload did what it is for.
    assert!(stats.admitted > 200 && stats.rejected > 20, "{stats:?}");
    let waited = seen.waited_admitted.load(Ordering::Relaxed);
    assert!(waited > 0, "no call was admitted after waiting");
    assert!(stats.usage_reports > 0);

    let by = [("bulkhead", "primary"), ("model", "gpt-4o")];
    assert_eq!(
        counter(&r, "llm_bulkhead_admissions_total", &by),
        stats.admitted
    );
    assert_eq!(
        counter(&r, "llm_bulkhead_releases_total", &by),
        stats.released
    );
    assert_eq!(
        counter(&r, "llm_bulkhead_usage_reports_total", &by),
        stats.usage_reports
    );
    let mut refused = 0;
    for reason in async_bulkhead_llm::RejectReason::ALL {
        let n = counter(
            &r,
            "llm_bulkhead_rejections_total",
            &[("reason", reason.as_str())],
        );
        assert_eq!(n, stats.rejected_by_reason.get(*reason), "{reason:?}");
        refused += n;
    }
    assert_eq!(refused, stats.rejected);
    let t = stats.token_budget.expect("budget");
    for (name, expected) in [
        ("llm_bulkhead_tokens_reserved_total", t.total_reserved),
        ("llm_bulkhead_tokens_consumed_total", t.total_consumed),
        ("llm_bulkhead_tokens_refunded_total", t.total_refunded),
        ("llm_bulkhead_tokens_overrun_total", t.total_overrun),
        ("llm_bulkhead_tokens_reheld_total", t.total_reheld),
        (
            "llm_bulkhead_tokens_returned_unreported_total",
            t.total_returned_unreported,
        ),
    ] {
        assert_eq!(counter(&r, name, &by), expected, "{name}");
    }
    assert_eq!(t.total_reserved, stats.admitted * 1100);
    assert_eq!(gauge(&r, "llm_bulkhead_in_flight_calls", &by), 0.0);
    assert_eq!(gauge(&r, "llm_bulkhead_in_flight_tokens", &by), 0.0);
    assert_eq!(gauge(&r, "llm_bulkhead_queued_calls", &by), 0.0);
    assert_eq!(gauge(&r, "llm_bulkhead_budget_tokens", &by), 3500.0);
    assert_eq!(gauge(&r, "llm_bulkhead_available_tokens", &by), 3500.0);
    assert_eq!(gauge(&r, "llm_bulkhead_max_concurrent_calls", &by), 2.0);
    assert_eq!(gauge(&r, "llm_bulkhead_max_queue_calls", &by), 1.0);
    assert_eq!(
        gauge(&r, "llm_bulkhead_limits_revision", &by),
        stats.limits.revision as f64
    );
    assert_eq!(gauge(&r, "llm_bulkhead_closed", &by), 0.0);

    // Every call sampled (`sample_every(1)`): one hold per admission, one decision per event.
    let holds = samples(&r, "llm_bulkhead_hold_seconds", &by);
    assert_eq!(holds.len() as u64, stats.released);
    assert!(holds.iter().all(|&s| s >= 0.0));
    let decisions = samples(&r, "llm_bulkhead_decision_seconds", &by);
    assert_eq!(
        decisions.len() as u64,
        seen.decisions.load(Ordering::Relaxed)
    );
    assert_eq!(decisions.len() as u64, stats.admitted + stats.rejected);
    let admitted_waits = samples(
        &r,
        "llm_bulkhead_queue_wait_seconds",
        &[("outcome", "admitted")],
    );
    assert_eq!(admitted_waits.len() as u64, waited);
    let timed_out = samples(
        &r,
        "llm_bulkhead_queue_wait_seconds",
        &[("outcome", "timeout")],
    );
    assert_eq!(
        timed_out.len() as u64
            + samples(
                &r,
                "llm_bulkhead_queue_wait_seconds",
                &[("outcome", "shutdown")]
            )
            .len() as u64,
        seen.waited_refused.load(Ordering::Relaxed)
    );
    assert_eq!(timed_out.len() as u64, stats.rejected_by_reason.timeout);
    // Token usage, OpenTelemetry GenAI: one input and one output sample per settled usage.
    let gen_ai = [
        ("gen_ai.request.model", "gpt-4o"),
        ("gen_ai.operation.name", "chat"),
    ];
    let input = samples(
        &r,
        "gen_ai.client.token.usage",
        &[gen_ai[0], gen_ai[1], ("gen_ai.token.type", "input")],
    );
    let output = samples(
        &r,
        "gen_ai.client.token.usage",
        &[gen_ai[0], gen_ai[1], ("gen_ai.token.type", "output")],
    );
    let with_usage = seen.released_with_usage.load(Ordering::Relaxed);
    assert_eq!(
        (input.len() as u64, output.len() as u64),
        (with_usage, with_usage)
    );
    assert_eq!(
        input.iter().sum::<f64>() as u64,
        seen.input_tokens.load(Ordering::Relaxed)
    );
    assert_eq!(
        input.iter().chain(&output).sum::<f64>() as u64,
        t.total_consumed,
        "every settled usage is a consumption"
    );
    assert_eq!(
        samples(&r, "gen_ai.client.operation.duration", &gen_ai).len() as u64,
        stats.released
    );
}

#[test]
fn a_sampled_histogram_hears_one_call_in_every_and_every_call_that_waited() {
    let _serial = super::serial();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let bulkhead = LlmBulkhead::builder("m", 1)
        .max_queue(4)
        .build()
        .expect("valid");
    let metrics = metrics::with_local_recorder(&recorder, || {
        BulkheadMetrics::builder(&bulkhead, "b")
            .sample_every(every(8))
            .install()
    });
    let request = LlmRequest::new();
    std::thread::spawn({
        let bulkhead = bulkhead.clone();
        move || {
            for _ in 0..80 {
                drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()));
            }
        }
    })
    .join()
    .expect("no panic");
    // One call in 8 on that thread: 10 decisions, 10 holds.
    let r = read(&snapshotter);
    assert_eq!(samples(&r, "llm_bulkhead_decision_seconds", &[]).len(), 10);
    assert_eq!(samples(&r, "llm_bulkhead_hold_seconds", &[]).len(), 10);

    // A call that waits is always heard: hold the slot, queue one call, release.
    let held = bulkhead
        .try_acquire(&request, AcquireOptions::new())
        .expect("free");
    let admitted = std::thread::scope(|scope| {
        let waiter = scope.spawn(|| {
            bulkhead
                .acquire_blocking(&request, AcquireOptions::new())
                .is_ok()
        });
        while bulkhead.stats().pending == 0 {
            std::thread::yield_now();
        }
        drop(held);
        waiter.join().expect("no panic")
    });
    assert!(admitted, "admitted after waiting");
    let r = read(&snapshotter);
    let waits = samples(
        &r,
        "llm_bulkhead_queue_wait_seconds",
        &[("outcome", "admitted")],
    );
    assert_eq!(waits.len(), 1);
    assert!(waits[0] > 0.0);
    drop(metrics);
}

#[test]
fn counters_are_absolute_and_never_go_down_between_publishes() {
    let _serial = super::serial();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let bulkhead = bulkhead();
    let metrics =
        metrics::with_local_recorder(&recorder, || BulkheadMetrics::install(&bulkhead, "b"));
    let request = LlmRequest::new();
    let mut permit = bulkhead.try_acquire(&request, options()).expect("free");
    // Holds 1100, lowered to 550, raised to 750, settled at 700: refunded only grows.
    let usage = TokenUsage::new(100, 300).expect("valid");
    permit
        .report_usage_progressive(usage, async_bulkhead_llm::usage::Progressive::new(550))
        .expect("valid");
    metrics.publish();
    let first = counter(
        &read(&snapshotter),
        "llm_bulkhead_tokens_refunded_total",
        &[],
    );
    permit
        .report_usage_progressive(usage, async_bulkhead_llm::usage::Progressive::new(750))
        .expect("valid");
    permit.release(Some(TokenUsage::new(100, 600).expect("valid")));
    metrics.publish();
    let r = read(&snapshotter);
    let second = counter(&r, "llm_bulkhead_tokens_refunded_total", &[]);
    assert_eq!((first, second), (550, 550 + 50));
    assert_eq!(counter(&r, "llm_bulkhead_tokens_reheld_total", &[]), 200);
    assert_eq!(counter(&r, "llm_bulkhead_tokens_consumed_total", &[]), 700);
    assert_eq!(counter(&r, "llm_bulkhead_usage_reports_total", &[]), 2);
}

#[test]
fn classes_get_their_own_series_and_labels_carry_the_builder_s() {
    let _serial = super::serial();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let classes = AdmissionClasses::new("batch")
        .class("premium", ClassLimits::new().protected_concurrent(1))
        .class("batch", ClassLimits::new().max_concurrent(1));
    let bulkhead = LlmBulkhead::builder("claude", 3)
        .admission_classes(classes)
        .build()
        .expect("valid");
    let metrics = metrics::with_local_recorder(&recorder, || {
        BulkheadMetrics::builder(&bulkhead, "tiers")
            .provider("anthropic")
            .label("region", "eu")
            .install()
    });
    let batch: AdmissionClass = bulkhead.class("batch").expect("exists");
    let request = LlmRequest::new();
    let a = bulkhead
        .try_acquire(&request, AcquireOptions::new().class(batch))
        .expect("free");
    let refused = bulkhead.try_acquire(&request, AcquireOptions::new().class(batch));
    assert!(refused.is_err());
    metrics.publish();
    let r = read(&snapshotter);
    let batch_labels = [
        ("bulkhead", "tiers"),
        ("model", "claude"),
        ("region", "eu"),
        ("class", "batch"),
    ];
    assert_eq!(
        gauge(&r, "llm_bulkhead_class_in_flight_calls", &batch_labels),
        1.0
    );
    assert_eq!(
        counter(&r, "llm_bulkhead_class_admissions_total", &batch_labels),
        1
    );
    assert_eq!(
        counter(
            &r,
            "llm_bulkhead_class_rejections_total",
            &[("class", "batch"), ("reason", "concurrency_limit")]
        ),
        1
    );
    assert_eq!(
        gauge(
            &r,
            "llm_bulkhead_class_in_flight_calls",
            &[("class", "premium")]
        ),
        0.0
    );
    drop(a);
    // The GenAI histograms carry the provider (registered at install, empty until a release).
    assert!(r.iter().any(
        |(name, labels, _)| name == "gen_ai.client.operation.duration"
            && labels.contains(&("gen_ai.provider.name".to_owned(), "anthropic".to_owned()))
    ));
}

#[test]
fn a_periodic_publisher_publishes_until_dropped() {
    let _serial = super::serial();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let bulkhead = bulkhead();
    let metrics =
        metrics::with_local_recorder(&recorder, || BulkheadMetrics::install(&bulkhead, "b"));
    let _held = bulkhead
        .try_acquire(&LlmRequest::new(), options())
        .expect("free");
    let publisher = metrics.publish_every(std::time::Duration::from_millis(1));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while gauge(&read(&snapshotter), "llm_bulkhead_in_flight_calls", &[]) != 1.0 {
        assert!(std::time::Instant::now() < deadline, "never published");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    drop(publisher); // joins the thread
}

/// With `skip_unmoved`, a series is registered only once it moves from 0: a fresh bulkhead
/// exports its limits, not a block of zero counters; a counter appears with its first count.
#[test]
fn skip_unmoved_registers_a_series_when_it_first_moves() {
    let _serial = super::serial();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let bulkhead = LlmBulkhead::builder("m", 3).build().expect("valid");
    metrics::with_local_recorder(&recorder, || {
        let metrics = BulkheadMetrics::builder(&bulkhead, "tenant")
            .skip_unmoved(true)
            .install();
        metrics.publish();
        let recorded = read(&snapshotter);
        let names: Vec<&str> = recorded.iter().map(|(n, _, _)| n.as_str()).collect();
        assert!(
            names.contains(&"llm_bulkhead_max_concurrent_calls"),
            "{names:?}"
        );
        assert!(
            !names.contains(&"llm_bulkhead_admissions_total"),
            "{names:?}"
        );
        assert!(
            !names.contains(&"llm_bulkhead_in_flight_calls"),
            "{names:?}"
        );
        assert!(!names.iter().any(|n| n.contains("rejections")), "{names:?}");
        let permit = bulkhead
            .try_acquire(&LlmRequest::new(), AcquireOptions::new())
            .expect("free");
        metrics.publish();
        let recorded = read(&snapshotter);
        let by = [("bulkhead", "tenant")];
        assert_eq!(counter(&recorded, "llm_bulkhead_admissions_total", &by), 1);
        assert_eq!(gauge(&recorded, "llm_bulkhead_in_flight_calls", &by), 1.0);
        drop(permit);
        metrics.publish();
        // Registered once moved: back at 0, it stays.
        assert_eq!(
            gauge(&read(&snapshotter), "llm_bulkhead_in_flight_calls", &by),
            0.0
        );
    });
}

/// Tenants within a global limit, each level's metrics labelled with its scope: the refusals
/// by scope add up to what each level refused, and the global refusal is nowhere in the
/// tenant's series.
#[test]
fn refusals_are_counted_by_the_scope_that_made_them() {
    use async_bulkhead_llm::rejection::Scope;
    let _serial = super::serial();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let global = LlmBulkhead::builder("m", 2).build().expect("valid");
    let tenant = LlmBulkhead::builder("m", 1).build().expect("valid");
    let other = LlmBulkhead::builder("m", 2).build().expect("valid");
    metrics::with_local_recorder(&recorder, || {
        let global_metrics = BulkheadMetrics::builder(&global, "openai")
            .scope(Scope::Global)
            .install();
        let tenant_metrics = BulkheadMetrics::builder(&tenant, "tenants")
            .scope(Scope::Tenant)
            .label("tenant", "acme")
            .install();
        let request = LlmRequest::new();
        let mine = tenant
            .try_acquire_within(&global, &request, AcquireOptions::new())
            .expect("room at both levels");
        // The tenant's limit: scope tenant.
        assert!(
            tenant
                .try_acquire_within(&global, &request, AcquireOptions::new())
                .is_err()
        );
        let theirs = other
            .try_acquire_within(&global, &request, AcquireOptions::new())
            .expect("the second global slot");
        drop(mine);
        let more = other
            .try_acquire_within(&global, &request, AcquireOptions::new())
            .expect("the freed global slot");
        // The global limit: scope global, nothing at the tenant.
        let err = tenant
            .try_acquire_within(&global, &request, AcquireOptions::new())
            .expect_err("the global level is full");
        assert_eq!(err.rejection().unwrap().scope(), Some(Scope::Global));
        drop((theirs, more));
        global_metrics.publish();
        tenant_metrics.publish();
        let recorded = read(&snapshotter);
        let rejections = |scope: &str| {
            counter(
                &recorded,
                "llm_bulkhead_rejections_total",
                &[("scope", scope), ("reason", "concurrency_limit")],
            )
        };
        assert_eq!((rejections("tenant"), rejections("global")), (1, 1));
        let admissions = |scope: &str| {
            counter(
                &recorded,
                "llm_bulkhead_admissions_total",
                &[("scope", scope)],
            )
        };
        assert_eq!((admissions("tenant"), admissions("global")), (1, 3));
    });
}
