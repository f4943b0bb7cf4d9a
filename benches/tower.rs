//! The tower layer's cost per request, side by side with its baselines in one run (feature
//! `tower`; `cargo bench --bench tower --features tower`).
//!
//! Every case sends one request through a stub provider that answers at once (a small JSON
//! body) and reads the response body to its end, polled without an executor (each step
//! completes in one poll, which the bench asserts):
//!
//! - `tower_layer/bare`: the stub alone;
//! - `tower_layer/concurrency_limit`: behind tower's `ConcurrencyLimit` (the layer gateways use
//!   today: a semaphore permit per request, released at the response head);
//! - `tower_layer/llm_layer`: behind `LlmLayer` with a token budget: the body read and parsed,
//!   the admission, the body wrapped, the usage block of the JSON response read and settled;
//! - `tower_layer/json_parse`: parsing the request body into an `LlmRequest` alone (the part of
//!   the layer's cost that grows with the request: the target excludes it).
//!
//! The request is an OpenAI chat-completions body with a 2,000-character message.

use std::convert::Infallible;
use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use async_bulkhead_llm::{LlmBulkhead, LlmRequest, TokenBudget, tower::LlmLayer};
use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http_body_util::{BodyExt, Full};
use tower::{Layer, Service, ServiceExt};

/// Polls `future` once; it must be ready.
fn now<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("every step of a case completes in one poll"),
    }
}

fn body() -> Bytes {
    let prose = "The quick brown fox jumps over the lazy dog. ".repeat(45);
    let text = &prose[..2000];
    Bytes::from(format!(
        r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"{text}"}}],"max_tokens":256}}"#
    ))
}

fn stub() -> impl Service<
    http::Request<Full<Bytes>>,
    Response = http::Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Future<Output = Result<http::Response<Full<Bytes>>, Infallible>> + Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(|_request: http::Request<Full<Bytes>>| async {
        let mut response = http::Response::new(Full::new(Bytes::from_static(
            br#"{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":500,"completion_tokens":20}}"#,
        )));
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        Ok(response)
    })
}

/// One request through `service`, its response body read to the end; the body's length.
fn round_trip<S, B>(service: &mut S, body: &Bytes) -> usize
where
    S: Service<http::Request<Full<Bytes>>, Response = http::Response<B>>,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let request = http::Request::post("/v1/chat/completions")
        .body(Full::new(body.clone()))
        .unwrap();
    let ready = now(service.ready()).unwrap();
    let response = now(ready.call(request)).unwrap();
    assert_eq!(response.status(), 200);
    now(response.into_body().collect())
        .unwrap()
        .to_bytes()
        .len()
}

fn layer(c: &mut Criterion) {
    let body = body();
    let mut group = c.benchmark_group("tower_layer");

    let mut bare = stub();
    group.bench_function("bare", |b| {
        b.iter(|| black_box(round_trip(&mut bare, black_box(&body))))
    });

    let mut limited = tower::limit::ConcurrencyLimitLayer::new(1024).layer(stub());
    group.bench_function("concurrency_limit", |b| {
        b.iter(|| black_box(round_trip(&mut limited, black_box(&body))))
    });

    let bulkhead = LlmBulkhead::builder("gpt-4o", 1024)
        .token_budget(TokenBudget::new(1 << 34))
        .build()
        .unwrap();
    let mut guarded = LlmLayer::new(bulkhead.clone()).layer(stub());
    group.bench_function("llm_layer", |b| {
        b.iter(|| black_box(round_trip(&mut guarded, black_box(&body))))
    });
    // Every call was admitted and settled with the usage of its response.
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.rejected), (0, 0));
    assert_eq!(
        stats.token_budget.unwrap().total_consumed,
        stats.admitted * 520
    );

    group.bench_function("json_parse", |b| {
        b.iter(|| black_box(serde_json::from_slice::<LlmRequest>(black_box(&body)).unwrap()))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default();
    targets = layer
}
criterion_main!(benches);
