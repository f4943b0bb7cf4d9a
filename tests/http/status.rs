//! Every refusal's status, error type, code and message.

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, Priority, RejectReason, Reservation, TokenBudget,
    classes::AdmissionClasses, classes::ClassLimits, http::HttpRefusal, request::RequestError,
};

use crate::support::{self, req, tokens};

/// (status, type, code, message) of a refusal.
fn parts(refusal: &HttpRefusal) -> (u16, &'static str, &'static str, &str) {
    (
        refusal.status,
        refusal.error_type,
        refusal.code,
        refusal.message.as_str(),
    )
}

#[test]
fn capacity_refusals_are_429_rate_limit_errors() {
    let concurrency = support::concurrency_limit();
    assert_eq!(
        parts(&HttpRefusal::from(concurrency)),
        (
            429,
            "rate_limit_error",
            "concurrency_limit",
            "bulkhead rejected: concurrency_limit (1 of 1 slots in flight)"
        )
    );
    assert_eq!(concurrency.http_status(), 429);

    let budget = support::budget_limit_later();
    assert!(!budget.detail().can_never_fit());
    assert_eq!(
        parts(&HttpRefusal::from(budget)),
        (
            429,
            "rate_limit_error",
            "budget_limit",
            "bulkhead rejected: budget_limit (requested 600 tokens, 400 of effective budget 1000 available, 600 in flight)"
        )
    );
    assert_eq!(budget.http_status(), 429);

    let queue = support::queue_limit();
    assert_eq!(queue.reason(), RejectReason::QueueLimit);
    assert_eq!(
        parts(&HttpRefusal::from(queue)),
        (
            429,
            "rate_limit_error",
            "queue_limit",
            "bulkhead rejected: queue_limit (1 of 1 queue places taken)"
        )
    );
    assert_eq!(queue.http_status(), 429);
}

#[test]
fn shutdown_and_queue_timeout_are_503() {
    let shutdown = support::shutdown();
    assert_eq!(
        parts(&HttpRefusal::from(shutdown)),
        (
            503,
            "unavailable_error",
            "shutdown",
            "bulkhead rejected: shutdown (the bulkhead is closed)"
        )
    );
    assert_eq!(shutdown.http_status(), 503);

    let timeout = support::timeout();
    assert_eq!(timeout.reason(), RejectReason::Timeout);
    assert_eq!(
        parts(&HttpRefusal::from(timeout)),
        (
            503,
            "overloaded_error",
            "timeout",
            "bulkhead rejected: timeout (no slot was granted before the queue timeout)"
        )
    );
    assert_eq!(timeout.http_status(), 503);
}

#[test]
fn aborted_is_499_from_its_reject_event() {
    let (reason, detail) = support::aborted();
    assert_eq!(reason, RejectReason::Aborted);
    let refusal = HttpRefusal::for_reason(reason, detail);
    assert_eq!(
        parts(&refusal),
        (
            499,
            "client_closed_request",
            "aborted",
            "bulkhead rejected: aborted (the waiting call was cancelled)"
        )
    );
    assert_eq!(refusal.detail, Some(detail));
    assert_eq!((detail.in_flight, detail.pending), (1, 0));
}

#[test]
fn every_reason_has_its_status() {
    let statuses: Vec<_> = RejectReason::ALL
        .iter()
        .map(|reason| (reason.as_str(), reason.http_status()))
        .collect();
    assert_eq!(
        statuses,
        [
            ("shutdown", 503),
            ("concurrency_limit", 429),
            ("budget_limit", 429),
            ("queue_limit", 429),
            ("timeout", 503),
            ("aborted", 499),
            ("rate_limit", 429),
        ]
    );
}

#[test]
fn a_call_that_can_never_fit_is_413_and_says_so() {
    let never = support::budget_limit_never();
    let budget = never.detail().token_budget.unwrap();
    assert_eq!(
        (
            budget.requested,
            budget.effective_budget,
            budget.in_flight_tokens
        ),
        (1500, 1000, 0)
    );
    assert!(budget.can_never_fit());
    assert!(never.detail().can_never_fit());
    assert_eq!(never.http_status(), 413);
    assert_eq!(
        parts(&HttpRefusal::from(never)),
        (
            413,
            "request_too_large",
            "budget_limit",
            "request too large: it reserves 1500 tokens, more than the effective token budget of 1000 even with nothing in flight, so it can never fit: do not retry it unchanged (reserve fewer tokens)"
        )
    );
}

#[test]
fn never_fitting_is_judged_against_the_budget_the_priority_may_use() {
    // Budget 1000 with 200 kept for high priority: a normal 900-token call can never fit...
    let bulkhead = LlmBulkhead::builder("m", 4)
        .token_budget(TokenBudget::new(1000).high_priority_reserve(200))
        .build()
        .unwrap();
    let normal = support::rejection(bulkhead.try_acquire(&req(), tokens(100, 800)));
    assert_eq!(normal.http_status(), 413);
    assert!(
        HttpRefusal::from(normal)
            .message
            .contains("more than the effective token budget of 800 even with nothing in flight")
    );
    // ... and a high-priority one refused for what is in flight fits later: 429.
    let _held = bulkhead
        .try_acquire(&req(), tokens(0, 200).priority(Priority::High))
        .unwrap();
    let high =
        support::rejection(bulkhead.try_acquire(&req(), tokens(100, 800).priority(Priority::High)));
    let budget = high.detail().token_budget.unwrap();
    assert_eq!(
        (
            budget.requested,
            budget.effective_budget,
            budget.in_flight_tokens
        ),
        (900, 1000, 200)
    );
    assert_eq!(high.http_status(), 429);
    // A call exactly the size of the budget fits once the budget is free: 429, not 413.
    let exact = support::rejection(bulkhead.try_acquire(&req(), tokens(0, 800)));
    assert_eq!(
        (
            exact.detail().token_budget.unwrap().requested,
            exact.http_status()
        ),
        (800, 429)
    );
    // Tokens in flight do not hide a call that can never fit.
    let too_big = support::rejection(bulkhead.try_acquire(&req(), tokens(0, 801)));
    assert_eq!(too_big.http_status(), 413);
}

#[test]
fn a_call_above_its_class_token_ceiling_is_413() {
    let never = support::class_ceiling_never();
    let class = never.detail().admission_class().unwrap();
    let tokens = class.token_budget.unwrap();
    assert_eq!(
        (
            tokens.requested,
            tokens.max_in_flight_tokens,
            tokens.in_flight_tokens
        ),
        (1500, Some(1000), 0)
    );
    assert!(tokens.can_never_fit());
    assert!(!never.detail().token_budget.unwrap().can_never_fit());
    assert_eq!(
        parts(&HttpRefusal::from(never)),
        (
            413,
            "request_too_large",
            "budget_limit",
            "request too large: it reserves 1500 tokens, more than admission class \"batch\"'s ceiling of 1000 tokens even with nothing in flight, so it can never fit: do not retry it unchanged (reserve fewer tokens)"
        )
    );
}

#[test]
fn class_protection_refusals_are_429() {
    for rejection in [support::class_slots(), support::class_tokens()] {
        assert!(!rejection.detail().can_never_fit());
        let refusal = HttpRefusal::from(rejection);
        assert_eq!(
            (refusal.status, refusal.error_type),
            (429, "rate_limit_error")
        );
    }
}

#[test]
fn invalid_requests_are_400_without_detail() {
    let overflow = Reservation::new(1, u64::MAX).unwrap_err();
    let refusal = HttpRefusal::from(overflow);
    assert_eq!(
        parts(&refusal),
        (
            400,
            "invalid_request_error",
            "reservation_overflow",
            "invalid request: token reservation (1 input + 18446744073709551615 max output) does not fit in 64 bits"
        )
    );
    assert_eq!(refusal.detail, None);
    assert_eq!(overflow.http_status(), 400);

    // A class handle given to a bulkhead without classes, through `try_acquire`.
    let classed = LlmBulkhead::builder("m", 1)
        .admission_classes(AdmissionClasses::new("premium").class("premium", ClassLimits::new()))
        .build()
        .unwrap();
    let plain = LlmBulkhead::builder("m", 1).build().unwrap();
    let options = AcquireOptions::new().class(classed.class("premium").unwrap());
    let err = plain.try_acquire(&req(), options).unwrap_err();
    assert!(matches!(
        err,
        AcquireError::Invalid(RequestError::ClassesNotConfigured { .. })
    ));
    assert_eq!(err.http_status(), 400);
    assert_eq!(
        parts(&HttpRefusal::from(&err)),
        (
            400,
            "invalid_request_error",
            "classes_not_configured",
            "invalid request: admission class \"premium\" requires admission classes to be configured"
        )
    );
}

#[test]
fn acquire_errors_map_like_what_they_carry() {
    let rejection = support::budget_limit_never();
    let err = AcquireError::from(rejection);
    assert_eq!(err.http_status(), 413);
    assert_eq!(HttpRefusal::from(err), HttpRefusal::from(&rejection));
    assert_eq!(
        HttpRefusal::for_reason(rejection.reason(), *rejection.detail()),
        HttpRefusal::from(rejection)
    );
}
