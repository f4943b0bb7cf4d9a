//! `serde` output of rejections, capacity details (with and without admission classes), ids,
//! priorities and classes.

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, Priority, classes::AdmissionClasses,
    classes::ClassLimits, observe::ShadowReasons,
};
use serde_json::{Value, json};

use crate::support;

fn to_value(value: impl serde::Serialize) -> Value {
    serde_json::to_value(value).unwrap()
}

#[test]
fn a_rejection_without_classes_has_no_class_fields() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .initial_revision(7)
        .build()
        .unwrap();
    let _held = bulkhead
        .try_acquire(&LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    let rejection =
        support::rejection(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()));
    assert_eq!(
        to_value(rejection),
        json!({
            "reason": "concurrency_limit",
            "limit_revision": 7,
            "detail": {"limit_revision": 7, "in_flight": 1, "max_concurrent": 1, "pending": 0, "max_queue": 0}
        })
    );
    assert_eq!(
        serde_json::to_string(&rejection).unwrap(),
        r#"{"reason":"concurrency_limit","limit_revision":7,"detail":{"limit_revision":7,"in_flight":1,"max_concurrent":1,"pending":0,"max_queue":0}}"#
    );
    let detail = to_value(support::budget_limit_never().detail());
    let keys: Vec<_> = detail.as_object().unwrap().keys().cloned().collect();
    assert_eq!(
        keys,
        [
            "in_flight",
            "limit_revision",
            "max_concurrent",
            "max_queue",
            "pending",
            "token_budget"
        ]
    );
}

#[test]
fn a_class_slot_refusal_serializes_its_class_and_shared_pool() {
    let rejection = support::class_slots();
    assert_eq!(
        to_value(rejection),
        json!({
            "reason": "concurrency_limit",
            "limit_revision": 0,
            "detail": {
                "limit_revision": 0,
                "in_flight": 3,
                "max_concurrent": 4,
                "pending": 0,
                "max_queue": 0,
                "constraint": "admission_class_protection",
                "admission_class": {
                    "class": "premium",
                    "in_flight": 3,
                    "protected_concurrent": 2,
                    "protected_concurrent_in_use": 2,
                    "borrowed_concurrent": 1,
                    "available_protected_concurrent": 0,
                    "max_concurrent": null,
                    "available_concurrent": null
                },
                "shared_capacity": {
                    "concurrency": {"capacity": 1, "in_use": 1, "available": 0, "requested_borrowed": 1}
                }
            }
        })
    );
}

#[test]
fn a_class_token_refusal_serializes_both_pools_and_the_class_tokens() {
    let rejection = support::class_tokens();
    assert_eq!(
        to_value(rejection.detail()),
        json!({
            "limit_revision": 0,
            "in_flight": 3,
            "max_concurrent": 10,
            "pending": 0,
            "max_queue": 0,
            "token_budget": {
                "budget": 2000,
                "in_flight_tokens": 1200,
                "effective_budget": 2000,
                "available": 800,
                "requested": 400
            },
            "constraint": "admission_class_protection",
            "admission_class": {
                "class": "premium",
                "in_flight": 3,
                "protected_concurrent": 0,
                "protected_concurrent_in_use": 0,
                "borrowed_concurrent": 3,
                "available_protected_concurrent": 0,
                "max_concurrent": null,
                "available_concurrent": null,
                "token_budget": {
                    "in_flight_tokens": 1200,
                    "protected_in_flight_tokens": 400,
                    "protected_tokens_in_use": 400,
                    "borrowed_in_flight_tokens": 800,
                    "available_protected_tokens": 0,
                    "max_in_flight_tokens": null,
                    "available": null,
                    "requested": 400
                }
            },
            "shared_capacity": {
                "concurrency": {"capacity": 10, "in_use": 3, "available": 7, "requested_borrowed": 1},
                "token_budget": {"capacity": 800, "in_use": 800, "available": 0, "requested_borrowed": 400}
            }
        })
    );
    assert_eq!(to_value(rejection)["reason"], "budget_limit");
}

#[test]
fn a_class_ceiling_serializes_as_a_number() {
    let detail = to_value(support::class_ceiling_never().detail());
    assert_eq!(detail["constraint"], "admission_class");
    assert_eq!(detail["admission_class"]["max_concurrent"], 2);
    assert_eq!(detail["admission_class"]["available_concurrent"], 2);
    assert_eq!(
        detail["admission_class"]["token_budget"]["max_in_flight_tokens"],
        1000
    );
    assert_eq!(detail["admission_class"]["token_budget"]["available"], 1000);
}

#[test]
fn ids_serialize_as_their_uuid_text() {
    let bulkhead = LlmBulkhead::builder("m", 1).build().unwrap();
    let permit = bulkhead
        .try_acquire(&LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    let id = permit.admission_id();
    let value = to_value(id);
    let text = value.as_str().expect("a string");
    assert_eq!(text, id.to_string());
    let uuid = uuid::Uuid::parse_str(text).expect("a UUID");
    assert_eq!(uuid, id.to_uuid());
    assert_eq!(uuid.get_version_num(), 4);
    assert_eq!(text, uuid.hyphenated().to_string());
    assert_eq!(text.len(), 36);
    drop(permit);

    let closed = LlmBulkhead::builder("m", 0).build().unwrap();
    let options = AcquireOptions::new().observe(ShadowReasons::ALL);
    let shadow =
        futures::executor::block_on(closed.run(&LlmRequest::new(), options, async |ctx| {
            Ok::<_, std::io::Error>(ctx.bypass().expect("bypassed").shadow_id)
        }))
        .unwrap();
    assert_eq!(
        to_value(shadow),
        json!(format!("shadow-{}", shadow.to_uuid().hyphenated()))
    );
}

#[test]
fn priorities_and_classes_serialize_as_their_names() {
    assert_eq!(to_value(Priority::Normal), json!("normal"));
    assert_eq!(to_value(Priority::High), json!("high"));
    let bulkhead = LlmBulkhead::builder("m", 4)
        .admission_classes(
            AdmissionClasses::new("batch")
                .class("premium", ClassLimits::new())
                .class("batch", ClassLimits::new()),
        )
        .build()
        .unwrap();
    assert_eq!(
        to_value(bulkhead.class("premium").unwrap()),
        json!("premium")
    );
}
