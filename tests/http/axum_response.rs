//! Feature `axum`: refusals as `axum` responses, read back without a server.

use async_bulkhead_llm::{AcquireError, http::HttpRefusal, request::RequestError};
use axum::body::Body;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;

use crate::support;

/// The status, the content type, whether a `Retry-After` was set, and the body text.
fn read(response: Response) -> (StatusCode, String, bool, String) {
    let (parts, body): (_, Body) = response.into_parts();
    let bytes = futures::executor::block_on(body.collect())
        .expect("an in-memory body")
        .to_bytes();
    (
        parts.status,
        parts.headers[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .to_owned(),
        parts.headers.contains_key(header::RETRY_AFTER),
        String::from_utf8(bytes.to_vec()).unwrap(),
    )
}

#[test]
fn a_rejection_responds_with_its_status_content_type_and_body() {
    let rejection = support::budget_limit_never();
    let (status, content_type, retry_after, body) = read(rejection.into_response());
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(content_type, "application/json");
    assert!(!retry_after);
    assert_eq!(
        body,
        concat!(
            r#"{"error":{"type":"request_too_large","code":"budget_limit","#,
            r#""message":"request too large: it reserves 1500 tokens, more than the effective token budget of 1000 even with nothing in flight, so it can never fit: do not retry it unchanged (reserve fewer tokens)","#,
            r#""detail":{"limit_revision":0,"in_flight":0,"max_concurrent":4,"pending":0,"max_queue":0,"#,
            r#""token_budget":{"budget":1000,"in_flight_tokens":0,"effective_budget":1000,"available":1000,"requested":1500}}}}"#
        )
    );
}

#[test]
fn every_kind_of_refusal_responds_with_the_mapped_status() {
    let cases = [
        (support::concurrency_limit().into_response(), 429),
        (support::budget_limit_later().into_response(), 429),
        (support::queue_limit().into_response(), 429),
        (support::shutdown().into_response(), 503),
        (support::timeout().into_response(), 503),
        (
            AcquireError::Rejected(support::budget_limit_never()).into_response(),
            413,
        ),
        (
            AcquireError::Invalid(RequestError::ZeroBorrowedConcurrencyDeadline).into_response(),
            400,
        ),
        (
            RequestError::ZeroBorrowedConcurrencyDeadline.into_response(),
            400,
        ),
    ];
    for (response, expected) in cases {
        let (status, content_type, retry_after, body) = read(response);
        assert_eq!(status.as_u16(), expected, "{body}");
        assert_eq!(content_type, "application/json");
        assert!(!retry_after);
        let value: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(value["error"]["message"].is_string());
    }
}

#[test]
fn an_http_refusal_responds_as_it_is_even_edited() {
    let (reason, detail) = support::aborted();
    let refusal = HttpRefusal::for_reason(reason, detail);
    let expected = refusal.body();
    let (status, _, _, body) = read(refusal.into_response());
    assert_eq!((status.as_u16(), body), (499, expected));

    let mut edited = HttpRefusal::from(support::shutdown());
    edited.status = 1000; // not a status: the response says so with a 500
    assert_eq!(
        read(edited.into_response()).0,
        StatusCode::INTERNAL_SERVER_ERROR
    );
}

#[test]
fn a_handler_result_responds_with_the_refusal() {
    fn handler(result: Result<&'static str, AcquireError>) -> Response {
        result.into_response()
    }
    let (status, _, _, body) = read(handler(Err(support::concurrency_limit().into())));
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        body,
        r#"{"error":{"type":"rate_limit_error","code":"concurrency_limit","message":"bulkhead rejected: concurrency_limit (1 of 1 slots in flight)","detail":{"limit_revision":0,"in_flight":1,"max_concurrent":1,"pending":0,"max_queue":0}}}"#
    );
    let (status, _, _, body) = read(handler(Ok("fine")));
    assert_eq!((status, body.as_str()), (StatusCode::OK, "fine"));
}
