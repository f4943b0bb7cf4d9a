//! The JSON error body: `{"error": {"type", "code", "message", "detail"}}`, exact.

use async_bulkhead_llm::{http::HttpRefusal, request::RequestError};
use serde_json::{Value, json};

use crate::support;

fn body(refusal: &HttpRefusal) -> Value {
    let text = refusal.body();
    let value: Value = serde_json::from_str(&text).expect("the body is JSON");
    assert_eq!(
        serde_json::to_value(refusal).unwrap(),
        value,
        "serializes as its body"
    );
    value
}

#[test]
fn a_call_that_can_never_fit_has_a_413_body_with_its_figures() {
    let refusal = HttpRefusal::from(support::budget_limit_never());
    assert_eq!(refusal.status, 413);
    assert_eq!(
        body(&refusal),
        json!({
            "error": {
                "type": "request_too_large",
                "code": "budget_limit",
                "message": "request too large: it reserves 1500 tokens, more than the effective token budget of 1000 even with nothing in flight, so it can never fit: do not retry it unchanged (reserve fewer tokens)",
                "detail": {
                    "limit_revision": 0,
                    "in_flight": 0,
                    "max_concurrent": 4,
                    "pending": 0,
                    "max_queue": 0,
                    "token_budget": {
                        "budget": 1000,
                        "in_flight_tokens": 0,
                        "effective_budget": 1000,
                        "available": 1000,
                        "requested": 1500
                    }
                }
            }
        })
    );
}

#[test]
fn the_body_text_is_in_field_order() {
    let refusal = HttpRefusal::from(support::concurrency_limit());
    assert_eq!(
        refusal.body(),
        concat!(
            r#"{"error":{"type":"rate_limit_error","code":"concurrency_limit","#,
            r#""message":"bulkhead rejected: concurrency_limit (1 of 1 slots in flight)","#,
            r#""detail":{"limit_revision":0,"in_flight":1,"max_concurrent":1,"pending":0,"max_queue":0}}}"#
        )
    );
    assert_eq!(HttpRefusal::CONTENT_TYPE, "application/json");
}

#[test]
fn a_429_budget_body_and_a_queue_body() {
    assert_eq!(
        body(&HttpRefusal::from(support::budget_limit_later())),
        json!({
            "error": {
                "type": "rate_limit_error",
                "code": "budget_limit",
                "message": "bulkhead rejected: budget_limit (requested 600 tokens, 400 of effective budget 1000 available, 600 in flight)",
                "detail": {
                    "limit_revision": 0,
                    "in_flight": 1,
                    "max_concurrent": 4,
                    "pending": 0,
                    "max_queue": 0,
                    "token_budget": {
                        "budget": 1000,
                        "in_flight_tokens": 600,
                        "effective_budget": 1000,
                        "available": 400,
                        "requested": 600
                    }
                }
            }
        })
    );
    assert_eq!(
        body(&HttpRefusal::from(support::queue_limit()))["error"]["detail"],
        json!({"limit_revision": 0, "in_flight": 1, "max_concurrent": 1, "pending": 1, "max_queue": 1})
    );
}

#[test]
fn an_invalid_request_body_has_no_detail() {
    let refusal = HttpRefusal::from(RequestError::ZeroBorrowedConcurrencyDeadline);
    assert_eq!(
        body(&refusal),
        json!({
            "error": {
                "type": "invalid_request_error",
                "code": "zero_borrowed_concurrency_deadline",
                "message": "invalid request: borrowed_concurrency_deadline must be greater than zero"
            }
        })
    );
}

#[test]
fn a_class_refusal_body_carries_the_class_and_the_shared_pool() {
    let value = body(&HttpRefusal::from(support::class_slots()));
    assert_eq!(value["error"]["type"], "rate_limit_error");
    assert_eq!(value["error"]["code"], "concurrency_limit");
    let detail = &value["error"]["detail"];
    assert_eq!(detail["constraint"], "admission_class_protection");
    assert_eq!(detail["admission_class"]["class"], "premium");
    assert_eq!(
        detail["shared_capacity"],
        json!({"concurrency": {"capacity": 1, "in_use": 1, "available": 0, "requested_borrowed": 1}})
    );
}
