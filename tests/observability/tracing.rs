//! `trace_events` and the spans against a test subscriber: a layer that keeps every event with
//! its fields and the span it was recorded in (with that span's fields at that moment).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, Mutex};

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, TokenBudget, TokenUsage, observability::trace_events,
};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Dispatch, Event, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{Layer, Registry};

use super::{bulkhead, on_two_threads, options};

type Fields = BTreeMap<String, String>;

/// One event as the subscriber saw it.
#[derive(Clone, Debug)]
struct Logged {
    message: String,
    fields: Fields,
    /// The name and fields of the span it was recorded in.
    span: Option<(String, Fields)>,
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<Logged>>>);

impl Capture {
    fn dispatch(&self) -> Dispatch {
        Dispatch::new(Registry::default().with(self.clone()))
    }

    fn logged(&self) -> Vec<Logged> {
        self.0.lock().expect("not poisoned").clone()
    }
}

struct Visitor<'a>(&'a mut Fields);

impl Visit for Visitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

/// A span's fields, kept in its extensions.
#[derive(Clone, Default)]
struct SpanFields(Fields);

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = SpanFields::default();
        attrs.record(&mut Visitor(&mut fields.0));
        ctx.span(id)
            .expect("new span")
            .extensions_mut()
            .insert(fields);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).expect("recorded span");
        let mut extensions = span.extensions_mut();
        if let Some(fields) = extensions.get_mut::<SpanFields>() {
            values.record(&mut Visitor(&mut fields.0));
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::new();
        event.record(&mut Visitor(&mut fields));
        let message = fields.remove("message").unwrap_or_default();
        let span = ctx.event_span(event).map(|span| {
            let fields = span
                .extensions()
                .get::<SpanFields>()
                .cloned()
                .unwrap_or_default();
            (span.name().to_owned(), fields.0)
        });
        self.0.lock().expect("not poisoned").push(Logged {
            message,
            fields,
            span,
        });
    }
}

fn count(logged: &[Logged], message: &str) -> u64 {
    logged.iter().filter(|l| l.message == message).count() as u64
}

fn ids(logged: &[Logged], message: &str) -> BTreeSet<String> {
    logged
        .iter()
        .filter(|l| l.message == message)
        .map(|l| l.fields["admission_id"].clone())
        .collect()
}

#[test]
fn debug_events_equal_the_stats_after_two_threads_and_follow_each_admission() {
    let _serial = super::serial();
    let capture = Capture::default();
    let dispatch = capture.dispatch();
    let bulkhead = bulkhead();
    let _tracing = trace_events(&bulkhead);
    on_two_threads(&bulkhead, |work| {
        tracing::dispatcher::with_default(&dispatch, work)
    });
    let stats = bulkhead.stats();
    let logged = capture.logged();

    assert!(stats.admitted > 200 && stats.rejected > 20, "{stats:?}");
    assert_eq!(count(&logged, "admitted"), stats.admitted);
    assert_eq!(count(&logged, "rejected"), stats.rejected);
    assert_eq!(count(&logged, "released"), stats.released);
    assert_eq!(count(&logged, "usage"), stats.usage_reports);
    assert!(stats.usage_reports > 0);
    // Every admission can be followed: unique ids, each released, each usage line of one.
    let admitted = ids(&logged, "admitted");
    assert_eq!(admitted.len() as u64, stats.admitted);
    assert_eq!(ids(&logged, "released"), admitted);
    assert!(ids(&logged, "usage").is_subset(&admitted));
    // Refusals carry their reason and the capacity figures.
    for line in logged.iter().filter(|l| l.message == "rejected") {
        let reason = line.fields["reason"].as_str();
        let counted = stats.rejected_by_reason.get(
            *async_bulkhead_llm::RejectReason::ALL
                .iter()
                .find(|r| r.as_str() == reason)
                .expect("a reason"),
        );
        assert!(counted > 0, "{reason}");
        for field in [
            "in_flight",
            "max_concurrent",
            "pending",
            "max_queue",
            "budget",
            "requested_tokens",
        ] {
            assert!(line.fields.contains_key(field), "{field} missing: {line:?}");
        }
        assert_eq!(line.fields["max_concurrent"], "2");
    }
    // A call that waited was decided inside its wait's span, which names its outcome.
    let mut waited = 0;
    for line in &logged {
        let Some((name, span)) = &line.span else {
            continue;
        };
        assert_eq!(name, "llm_bulkhead.queue_wait");
        assert_eq!(span["model"], "gpt-4o");
        assert_eq!(
            (span["bulkhead"].as_str(), span["tenant"].as_str()),
            ("primary", "acme")
        );
        match line.message.as_str() {
            "admitted" => {
                assert_eq!(span["outcome"], "admitted");
                assert_eq!(span["admission_id"], line.fields["admission_id"]);
                assert_ne!(line.fields["queue_wait_us"], "");
                waited += 1;
            }
            "rejected" => assert_eq!(span["outcome"], line.fields["reason"]),
            other => panic!("{other} inside a wait's span"),
        }
    }
    assert!(waited > 0, "no admission after a wait");
}

#[test]
fn a_refusal_logs_its_reason_and_detail() {
    let _serial = super::serial();
    let capture = Capture::default();
    let bulkhead = LlmBulkhead::builder("m", 1)
        .token_budget(TokenBudget::new(5000))
        .build()
        .expect("valid");
    let _tracing = trace_events(&bulkhead);
    tracing::dispatcher::with_default(&capture.dispatch(), || {
        let request = LlmRequest::new();
        let held = bulkhead.try_acquire(&request, options()).expect("free");
        assert!(bulkhead.try_acquire(&request, options()).is_err());
        drop(held);
    });
    let logged = capture.logged();
    let messages: Vec<&str> = logged.iter().map(|l| l.message.as_str()).collect();
    assert_eq!(messages, ["admitted", "rejected", "released"]);
    let rejected = &logged[1].fields;
    for (field, value) in [
        ("model", "m"),
        ("reason", "concurrency_limit"),
        ("in_flight", "1"),
        ("max_concurrent", "1"),
        ("pending", "0"),
        ("budget", "5000"),
        ("in_flight_tokens", "1100"),
        ("requested_tokens", "1100"),
    ] {
        assert_eq!(rejected[field], value, "{field}");
    }
    assert_eq!(logged[0].fields["reserved_tokens"], "1100");
    assert_eq!(logged[2].fields["held_tokens"], "1100");
    assert_eq!(
        logged[0].fields["admission_id"],
        logged[2].fields["admission_id"]
    );
}

#[test]
fn a_run_is_one_span_holding_its_admission_id_its_events_and_the_callback_s_logs() {
    let _serial = super::serial();
    let capture = Capture::default();
    let bulkhead = LlmBulkhead::builder("gpt-4o", 1)
        .token_budget(TokenBudget::new(5000))
        .build()
        .expect("valid");
    let _tracing = trace_events(&bulkhead);
    let id = tracing::dispatcher::with_default(&capture.dispatch(), || {
        futures::executor::block_on(
            bulkhead.run(&LlmRequest::new(), options(), async |mut ctx| {
                tracing::info!("calling the provider");
                ctx.report_usage(TokenUsage::new(100, 50).expect("valid"))
                    .expect("valid");
                Ok::<_, std::io::Error>(ctx.admission_id().expect("admitted").to_string())
            }),
        )
        .expect("ran")
    });
    let logged = capture.logged();
    let messages: Vec<&str> = logged.iter().map(|l| l.message.as_str()).collect();
    assert_eq!(
        messages,
        ["admitted", "calling the provider", "usage", "released"]
    );
    // The admit event comes before the id is recorded on the span; everything after carries it.
    for line in &logged {
        let (name, span) = line.span.as_ref().expect("inside the run's span");
        assert_eq!(name, "llm_bulkhead.run");
        assert_eq!(span["model"], "gpt-4o");
        if line.message != "admitted" {
            assert_eq!(span["admission_id"], id);
        }
    }
    assert_eq!(logged[0].fields["admission_id"], id);
    assert_eq!(logged[2].fields["input_tokens"], "100");
}

#[test]
fn without_trace_events_an_admission_logs_nothing() {
    let _serial = super::serial();
    let capture = Capture::default();
    let bulkhead = bulkhead();
    tracing::dispatcher::with_default(&capture.dispatch(), || {
        drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()));
    });
    assert!(capture.logged().is_empty());
}
