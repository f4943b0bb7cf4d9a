//! Which calls share: the canonical request key (every field counts, key order and null
//! members do not), custom key functions (an empty key or a panic opts out), and the
//! partitions no outcome crosses (scopes, classes, result types, `no_dedup`).

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, RunOptions, classes::AdmissionClasses,
    classes::ClassLimits, dedup::DedupScope, dedup::Deduplication,
};
use futures::executor::block_on;

use super::support::{Gate, Runs, builder, dedup, poll_once, prompt};

#[cfg(feature = "serde")]
fn body(json: &str) -> LlmRequest {
    serde_json::from_str(json).unwrap()
}

/// Whether a call of `second` made while a call of `first` is in flight joins it. Both
/// finish; the bulkhead ends idle with no registry entry left.
fn shares(
    bulkhead: &LlmBulkhead,
    (first, first_options): (&LlmRequest, RunOptions),
    (second, second_options): (&LlmRequest, RunOptions),
) -> bool {
    let gate = Gate::new();
    let runs = Runs::default();
    let hits = bulkhead.stats().deduplication.unwrap().hits;
    let mut leader = Box::pin(bulkhead.run_shared(first, first_options, runs.call(&gate, 1u8)));
    assert!(poll_once(&mut leader).is_pending());
    let other = Box::pin(bulkhead.run_shared(second, second_options, runs.call(&gate, 2u8)));
    let joined = bulkhead.stats().deduplication.unwrap().hits == hits + 1;
    gate.open();
    let (a, b) = block_on(futures::future::join(leader, other));
    assert_eq!(a, Ok(1));
    // A follower gets the leader's value; a call of its own gets its own.
    assert_eq!(b, Ok(if joined { 1 } else { 2 }));
    assert_eq!(runs.started(), if joined { 1 } else { 2 });
    let stats = bulkhead.stats();
    assert_eq!(
        (stats.in_flight, stats.deduplication.unwrap().active),
        (0, 0)
    );
    joined
}

fn plain() -> RunOptions {
    RunOptions::from(AcquireOptions::new())
}

#[cfg(feature = "serde")]
#[test]
fn identical_requests_share_and_the_key_ignores_object_key_order_and_null_members() {
    let bulkhead = dedup(4);
    let a = body(
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"temperature":0.2,"metadata":{"a":1,"b":[1,2]},"max_tokens":50}"#,
    );
    let reordered = body(
        r#"{"max_tokens":50,"metadata":{"b":[1,2],"a":1},"temperature":0.2,"messages":[{"content":"hi","role":"user"}],"model":"gpt-4o"}"#,
    );
    let with_nulls = body(
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi","name":null}],"temperature":0.2,"metadata":{"a":1,"b":[1,2],"c":null},"max_tokens":50,"top_p":null}"#,
    );
    assert!(shares(&bulkhead, (&a, plain()), (&a.clone(), plain())));
    assert!(shares(&bulkhead, (&a, plain()), (&reordered, plain())));
    assert!(shares(&bulkhead, (&a, plain()), (&with_nulls, plain())));
    assert_eq!(bulkhead.stats().deduplication.unwrap().hits, 3);
}

#[cfg(feature = "serde")]
#[test]
fn any_differing_field_or_array_order_prevents_sharing() {
    let bulkhead = dedup(4);
    let a = body(
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"temperature":0.2,"stop":["x","y"],"max_tokens":50}"#,
    );
    let variants = [
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"temperature":0.3,"stop":["x","y"],"max_tokens":50}"#,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"temperature":0.2,"stop":["y","x"],"max_tokens":50}"#,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"temperature":0.2,"stop":["x","y"],"max_tokens":51}"#,
        r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"temperature":0.2,"stop":["x","y"],"max_tokens":50}"#,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi!"}],"temperature":0.2,"stop":["x","y"],"max_tokens":50}"#,
        r#"{"model":"gpt-4o","messages":[{"role":"system","content":"hi"}],"temperature":0.2,"stop":["x","y"],"max_tokens":50}"#,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"temperature":0.2,"stop":["x","y"],"max_tokens":50,"user":"u1"}"#,
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"temperature":0.2,"stop":["x","y"],"max_tokens":50,"extra_input_tokens":7}"#,
    ];
    for variant in variants {
        assert!(
            !shares(&bulkhead, (&a, plain()), (&body(variant), plain())),
            "{variant}"
        );
    }
    assert_eq!(bulkhead.stats().deduplication.unwrap().hits, 0);
}

#[test]
fn scopes_and_classes_partition_keys() {
    let bulkhead = dedup(4);
    let request = prompt("same");
    let tenant = |name: &str| AcquireOptions::new().dedup_scope(DedupScope::new(name));
    assert!(shares(
        &bulkhead,
        (&request, tenant("a")),
        (&request, tenant("a"))
    ));
    assert!(!shares(
        &bulkhead,
        (&request, tenant("a")),
        (&request, tenant("b"))
    ));
    assert!(!shares(
        &bulkhead,
        (&request, tenant("a")),
        (&request, plain())
    ));

    let classes = builder(4)
        .admission_classes(
            AdmissionClasses::new("standard")
                .class("premium", ClassLimits::new())
                .class("standard", ClassLimits::new()),
        )
        .build()
        .unwrap();
    let premium = AcquireOptions::new().class(classes.class("premium").unwrap());
    let standard = AcquireOptions::new().class(classes.class("standard").unwrap());
    assert!(shares(
        &classes,
        (&request, premium.into()),
        (&request, premium.into())
    ));
    assert!(!shares(
        &classes,
        (&request, premium.into()),
        (&request, standard.into())
    ));
    // The default class is the class a call without one belongs to.
    assert!(shares(
        &classes,
        (&request, standard.into()),
        (&request, plain())
    ));
}

#[test]
fn calls_whose_result_types_differ_never_share() {
    let bulkhead = dedup(4);
    let request = prompt("typed");
    let gate = Gate::new();
    let runs = Runs::default();
    let mut number = Box::pin(bulkhead.run_shared(&request, plain(), runs.call(&gate, 7u32)));
    assert!(poll_once(&mut number).is_pending());
    let text = bulkhead.run_shared(&request, plain(), runs.call(&gate, String::from("seven")));
    let again = bulkhead.run_shared(&request, plain(), runs.call(&gate, 8u32));
    assert_eq!(bulkhead.stats().deduplication.unwrap().hits, 1); // only the second u32 call
    assert_eq!(bulkhead.stats().deduplication.unwrap().active, 2);
    gate.open();
    let (a, b, c) = block_on(futures::future::join3(number, text, again));
    assert_eq!((a, b.as_deref(), c), (Ok(7), Ok("seven"), Ok(7)));
    assert_eq!(runs.started(), 2);
}

#[test]
fn no_dedup_neither_joins_nor_leads() {
    let bulkhead = dedup(4);
    let request = prompt("solo");
    assert!(!shares(
        &bulkhead,
        (&request, plain()),
        (&request, plain().no_dedup())
    ));
    assert!(!shares(
        &bulkhead,
        (&request, plain().no_dedup()),
        (&request, plain())
    ));
}

#[test]
fn a_custom_key_decides_and_an_empty_or_panicking_key_opts_out() {
    let bulkhead = builder(4)
        .deduplication(Deduplication::by_key(|request| {
            let text = format!(
                "{:?}",
                request.messages.first().and_then(|m| m.content.clone())
            );
            if text.contains("panic") {
                panic!("the key function panics");
            }
            if text.contains("private") {
                return String::new();
            }
            // The model does not count: only the first message does.
            text
        }))
        .build()
        .unwrap();
    let a = prompt("hello");
    assert!(shares(
        &bulkhead,
        (&a, plain()),
        (&a.clone().model("other"), plain())
    ));
    let private = prompt("private data");
    assert!(!shares(&bulkhead, (&private, plain()), (&private, plain())));
    let panics = prompt("panic now");
    assert!(!shares(&bulkhead, (&panics, plain()), (&panics, plain())));
    let dedup = bulkhead.stats().deduplication.unwrap();
    assert_eq!((dedup.hits, dedup.key_panics), (1, 2));
}

#[test]
fn a_bulkhead_without_deduplication_runs_every_call() {
    let bulkhead = LlmBulkhead::builder("m", 4).build().unwrap();
    let request = prompt("x");
    let gate = Gate::new();
    let runs = Runs::default();
    let a = bulkhead.run_shared(&request, plain(), runs.call(&gate, 1));
    let b = bulkhead.run_shared(&request, plain(), runs.call(&gate, 2));
    gate.open();
    assert_eq!(block_on(futures::future::join(a, b)), (Ok(1), Ok(2)));
    assert_eq!(runs.started(), 2);
    assert!(bulkhead.stats().deduplication.is_none());
}
