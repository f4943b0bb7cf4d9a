//! The tower layer against a real axum server and a real hyper client on 127.0.0.1: a streamed
//! body holds its permit until it ends, a client that disconnects mid-stream releases it, usage
//! is read from OpenAI-style and Anthropic-style server-sent events and from JSON responses,
//! and refusals are answered with their status, JSON body and headers.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget,
    tenants::Tenants,
    tower::{Disconnect, LlmLayer},
};
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::mpsc;

mod bulkhead;
mod disconnect;

/// The chunks the mock provider will stream for the next call, fed by the test.
type Feed = Arc<Mutex<Option<mpsc::Receiver<Bytes>>>>;

/// A mock provider: streams what the test feeds (SSE), or answers JSON for `/json`.
async fn provider(State(feed): State<Feed>) -> Response {
    event_stream(feed.lock().unwrap().take().expect("one call fed"))
}

/// A server-sent events response streaming what `rx` receives, until its sender is dropped.
fn event_stream(rx: mpsc::Receiver<Bytes>) -> Response {
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|chunk| (Ok::<_, Infallible>(chunk), rx))
    });
    let mut response = Response::new(Body::from_stream(stream));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    response
}

async fn json_provider() -> Response {
    let body = r#"{"id":"1","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":30,"completion_tokens":12}}"#;
    let mut response = Response::new(Body::from(body));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// A gateway on a loopback port: the layer over the mock provider.
async fn gateway(bulkhead: &LlmBulkhead) -> (SocketAddr, mpsc::Sender<Bytes>) {
    serve(
        LlmLayer::new(bulkhead.clone())
            .options(|_| AcquireOptions::new().reservation(Reservation::new(100, 400).unwrap())),
    )
    .await
}

/// A gateway on a loopback port with `layer` over the mock provider.
async fn serve(layer: LlmLayer) -> (SocketAddr, mpsc::Sender<Bytes>) {
    let (tx, rx) = mpsc::channel(16);
    let feed: Feed = Arc::new(Mutex::new(Some(rx)));
    let app = Router::new()
        .route("/v1/chat/completions", post(provider))
        .route("/json", post(json_provider))
        .with_state(feed)
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, tx)
}

fn budgeted(max_concurrent: usize) -> LlmBulkhead {
    LlmBulkhead::builder("gpt-4o", max_concurrent)
        .token_budget(TokenBudget::new(10_000))
        .build()
        .unwrap()
}

const CHAT: &str =
    r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello"}],"stream":true}"#;

fn post_to(addr: SocketAddr, path: &str, body: &str) -> http::Request<Full<Bytes>> {
    http::Request::post(format!("http://{addr}{path}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap()
}

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Waits (up to 5 s) until `f` holds.
async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_body_holds_its_permit_until_it_ends_and_reports_openai_usage() {
    let bulkhead = budgeted(4);
    let (addr, tx) = gateway(&bulkhead).await;
    let response = client()
        .request(post_to(addr, "/v1/chat/completions", CHAT))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // The head arrived: the call still holds its slot and its 500 tokens.
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.token_budget.unwrap().in_flight_tokens
        ),
        (1, 500)
    );
    let mut body = response.into_body();
    tx.send(Bytes::from(
        "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n",
    ))
    .await
    .unwrap();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(first.starts_with(b"data: "), "passed on as it came");
    // The usage chunk is cut in two by the network: read once whole.
    tx.send(Bytes::from(
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,",
    ))
    .await
    .unwrap();
    tx.send(Bytes::from(
        "\"completion_tokens\":25}}\n\ndata: [DONE]\n\n",
    ))
    .await
    .unwrap();
    body.frame().await.unwrap().unwrap();
    body.frame().await.unwrap().unwrap();
    // Reported as it passed: the hold is the actual input plus the whole output reservation.
    eventually("the usage report moved the hold", || {
        bulkhead.stats().token_budget.unwrap().in_flight_tokens == 440
    })
    .await;
    assert_eq!(bulkhead.stats().in_flight, 1);
    drop(tx); // the provider ends the stream
    assert!(body.frame().await.is_none());
    eventually("released at the end of the body", || {
        bulkhead.stats().in_flight == 0
    })
    .await;
    let tokens = bulkhead.stats().token_budget.unwrap();
    assert_eq!((tokens.total_consumed, tokens.in_flight_tokens), (65, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_stream_releases_at_once() {
    let bulkhead = budgeted(4);
    let (addr, tx) = gateway(&bulkhead).await;
    let response = client()
        .request(post_to(addr, "/v1/chat/completions", CHAT))
        .await
        .unwrap();
    let mut body = response.into_body();
    tx.send(Bytes::from("data: {\"choices\":[]}\n\n"))
        .await
        .unwrap();
    body.frame().await.unwrap().unwrap();
    assert_eq!(bulkhead.stats().in_flight, 1);
    drop(body); // the client goes away; the provider would go on streaming
    eventually("released when the client left", || {
        bulkhead.stats().in_flight == 0
    })
    .await;
    drop(tx);
}

/// With `Disconnect::Hold`, a client gone mid-stream leaves its slot held for the grace (the
/// provider may still be generating), then released by the timer; a response that ends is
/// released at once all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_grace_holds_the_slot_then_releases_it() {
    let bulkhead = budgeted(4);
    let grace = Duration::from_millis(300);
    let layer = LlmLayer::new(bulkhead.clone())
        .options(|_| AcquireOptions::new().reservation(Reservation::new(100, 400).unwrap()))
        .on_disconnect(Disconnect::Hold(grace));
    let (addr, tx) = serve(layer).await;
    let response = client()
        .request(post_to(addr, "/v1/chat/completions", CHAT))
        .await
        .unwrap();
    let mut body = response.into_body();
    tx.send(Bytes::from("data: {\"choices\":[]}\n\n"))
        .await
        .unwrap();
    body.frame().await.unwrap().unwrap();
    let left = Instant::now();
    drop(body); // the client goes away mid-stream
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(bulkhead.stats().in_flight, 1, "held within the grace");
    eventually("released after the grace", || {
        bulkhead.stats().in_flight == 0
    })
    .await;
    assert!(
        left.elapsed() >= grace,
        "released after {:?}",
        left.elapsed()
    );
    assert_eq!(bulkhead.stats().released, 1);
    // A response that ends is released at once.
    let response = client()
        .request(post_to(addr, "/json", CHAT))
        .await
        .unwrap();
    response.into_body().collect().await.unwrap();
    let ended = Instant::now();
    eventually("released at its end", || bulkhead.stats().in_flight == 0).await;
    assert!(ended.elapsed() < grace, "{:?}", ended.elapsed());
    drop(tx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_events_report_input_then_growing_output() {
    let bulkhead = budgeted(4);
    let (addr, tx) = gateway(&bulkhead).await;
    let response = client()
        .request(post_to(addr, "/v1/chat/completions", CHAT))
        .await
        .unwrap();
    let mut body = response.into_body();
    for chunk in [
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"cache_read_input_tokens\":5,\"output_tokens\":1}}}\n\n",
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"Hi\"}}\n\n",
        "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":40}}\n\n",
    ] {
        tx.send(Bytes::from(chunk)).await.unwrap();
        body.frame().await.unwrap().unwrap();
    }
    drop(tx);
    assert!(body.frame().await.is_none());
    eventually("released", || bulkhead.stats().in_flight == 0).await;
    // 25 input + 5 cached input, 40 output.
    assert_eq!(bulkhead.stats().token_budget.unwrap().total_consumed, 70);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_response_settles_with_its_usage_block() {
    let bulkhead = budgeted(4);
    let (addr, _tx) = gateway(&bulkhead).await;
    let response = client()
        .request(post_to(addr, "/json", CHAT))
        .await
        .unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert!(body.starts_with(b"{\"id\":\"1\""));
    eventually("released", || bulkhead.stats().in_flight == 0).await;
    assert_eq!(bulkhead.stats().token_budget.unwrap().total_consumed, 42);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_is_a_429_with_the_provider_shaped_body_and_no_retry_after() {
    let bulkhead = budgeted(1);
    let (addr, _tx) = gateway(&bulkhead).await;
    let held = bulkhead
        .try_acquire(
            &LlmRequest::new(),
            AcquireOptions::new().reservation(Reservation::new(1, 1).unwrap()),
        )
        .unwrap();
    let response = client()
        .request(post_to(addr, "/v1/chat/completions", CHAT))
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
    assert!(response.headers().get(header::RETRY_AFTER).is_none());
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["error"]["type"], "rate_limit_error");
    assert_eq!(json["error"]["code"], "concurrency_limit");
    // The gateway's whole capacity is not shown to a client by default.
    assert_eq!(
        json["error"]["message"],
        "bulkhead rejected: concurrency_limit"
    );
    assert!(json["error"].get("detail").is_none());
    drop(held);
    assert_eq!(bulkhead.stats().rejected_by_reason.concurrency_limit, 1);
}

/// A refusal with the bulkhead's figures when the gateway chooses to show them, the
/// rate-limit headers on a 429 and on an admitted call's response, and a hook reshaping the
/// answer: through a real server and client on loopback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_controls_its_refusals_and_rate_limit_headers() {
    let bulkhead = budgeted(2);
    let layer = LlmLayer::new(bulkhead.clone())
        .options(|_| AcquireOptions::new().reservation(Reservation::new(100, 400).unwrap()))
        .expose_capacity(true)
        .rate_limit_headers(true)
        .on_refusal(|refused, answer| {
            let reason = refused.rejection().unwrap().reason().as_str();
            answer
                .headers_mut()
                .insert("x-refused", http::HeaderValue::from_static(reason));
        });
    let (addr, tx) = serve(layer).await;
    // Admitted: the figures after its admission (one of two slots, 500 of 10,000 tokens).
    let admitted = client()
        .request(post_to(addr, "/v1/chat/completions", CHAT))
        .await
        .unwrap();
    assert_eq!(admitted.status(), 200);
    let headers = admitted.headers();
    assert_eq!(headers["ratelimit-limit"], "2");
    assert_eq!(headers["ratelimit-remaining"], "1");
    assert_eq!(headers["ratelimit-reset"], "1"); // no call released yet
    assert_eq!(headers["x-ratelimit-limit-requests"], "2");
    assert_eq!(headers["x-ratelimit-remaining-requests"], "1");
    assert_eq!(headers["x-ratelimit-reset-requests"], "1s");
    assert_eq!(headers["x-ratelimit-limit-tokens"], "10000");
    assert_eq!(headers["x-ratelimit-remaining-tokens"], "9500");
    let held = bulkhead
        .try_acquire(
            &LlmRequest::new(),
            AcquireOptions::new().reservation(Reservation::new(1, 1).unwrap()),
        )
        .unwrap();
    let refused = client()
        .request(post_to(addr, "/v1/chat/completions", CHAT))
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["x-refused"], "concurrency_limit");
    assert_eq!(refused.headers()["ratelimit-remaining"], "0");
    assert_eq!(refused.headers()["x-ratelimit-remaining-tokens"], "9498");
    let body = refused.into_body().collect().await.unwrap().to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["error"]["detail"]["in_flight"], 2);
    assert_eq!(json["error"]["detail"]["max_concurrent"], 2);
    drop((held, tx, admitted));
    eventually("released", || bulkhead.stats().in_flight == 0).await;
}

/// Per tenant, a refusal shows the tenant's own figures by default (its scope).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_tenant_refusal_shows_the_tenants_own_figures() {
    let tenants = Tenants::builder(|_: &String| LlmBulkhead::builder("gpt-4o", 1))
        .build()
        .unwrap();
    let layer = LlmLayer::per_tenant(tenants.clone(), |head| {
        head.headers["x-api-key"].to_str().unwrap().to_owned()
    });
    let (addr, _tx) = serve(layer).await;
    let _held = tenants
        .get("acme")
        .unwrap()
        .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    let mut request = post_to(addr, "/v1/chat/completions", CHAT);
    request
        .headers_mut()
        .insert("x-api-key", http::HeaderValue::from_static("acme"));
    let refused = client().request(request).await.unwrap();
    assert_eq!(refused.status(), 429);
    let body = refused.into_body().collect().await.unwrap().to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["error"]["detail"]["in_flight"], 1);
    assert_eq!(json["error"]["detail"]["max_concurrent"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_is_not_a_provider_request_is_a_400_and_admits_nothing() {
    let bulkhead = budgeted(1);
    let (addr, _tx) = gateway(&bulkhead).await;
    let response = client()
        .request(post_to(addr, "/v1/chat/completions", "not json"))
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["error"]["type"], "invalid_request_error");
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.rejected), (0, 0));
}

#[test]
fn the_layer_reads_usage_as_providers_state_it() {
    use async_bulkhead_llm::{TokenUsage, tower::provider_usage};
    let usage = |s: &str| provider_usage(&serde_json::from_str(s).unwrap());
    assert_eq!(
        usage(r#"{"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#),
        Some(TokenUsage::new(3, 4).unwrap())
    );
    assert_eq!(usage(r#"{"choices":[],"usage":null}"#), None);
    assert_eq!(
        usage(
            r#"{"type":"message_start","message":{"usage":{"input_tokens":9,"output_tokens":1}}}"#
        ),
        Some(TokenUsage::new(9, 1).unwrap())
    );
    assert_eq!(
        usage(r#"{"type":"message_delta","usage":{"output_tokens":15}}"#),
        Some(TokenUsage::new(0, 15).unwrap())
    );
}

fn with_key(addr: SocketAddr, key: &str) -> http::Request<Full<Bytes>> {
    let mut request = post_to(addr, "/json", CHAT);
    request
        .headers_mut()
        .insert("x-api-key", HeaderValue::from_str(key).unwrap());
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenant_is_admitted_by_its_own_bulkhead() {
    use async_bulkhead_llm::tenants::Tenants;
    let tenants = Tenants::builder(|_: &String| LlmBulkhead::builder("gpt-4o", 1))
        .max_tenants(2)
        .idle_after(Duration::from_secs(3600))
        .build()
        .unwrap();
    let layer = LlmLayer::per_tenant(tenants.clone(), |head| {
        head.headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("anonymous")
            .to_owned()
    });
    let (addr, _tx) = serve(layer).await;
    // Tenant a's one slot is taken: a is refused, b is served.
    let a = tenants.get("a").unwrap();
    let held = a
        .try_acquire(&LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    let refused = client().request(with_key(addr, "a")).await.unwrap();
    assert_eq!(refused.status(), 429);
    let served = client().request(with_key(addr, "b")).await.unwrap();
    assert_eq!(served.status(), 200);
    served.into_body().collect().await.unwrap();
    // Two tenants exist and neither has been idle an hour: a third is refused.
    let third = client().request(with_key(addr, "c")).await.unwrap();
    assert_eq!(third.status(), 429);
    let body = third.into_body().collect().await.unwrap().to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["error"]["code"], "too_many_tenants");
    drop(held);
    assert_eq!(a.stats().rejected, 1);
    assert_eq!(tenants.get("b").unwrap().stats().admitted, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_opted_in_retry_after_hint_comes_from_measured_hold_times() {
    let bulkhead = budgeted(1);
    let layer = LlmLayer::new(bulkhead.clone()).retry_after_hint(true);
    let (addr, tx) = serve(layer).await;
    let held = bulkhead
        .try_acquire(
            &LlmRequest::new(),
            AcquireOptions::new().reservation(Reservation::new(1, 1).unwrap()),
        )
        .unwrap();
    // No call released through the layer yet: no hint.
    let refused = client()
        .request(post_to(addr, "/v1/chat/completions", CHAT))
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    assert!(refused.headers().get(header::RETRY_AFTER).is_none());
    drop(held);
    // One streamed call held for ~50 ms: the hint rounds it up to 1 s.
    let response = client()
        .request(post_to(addr, "/v1/chat/completions", CHAT))
        .await
        .unwrap();
    let held = bulkhead.try_acquire(
        &LlmRequest::new(),
        AcquireOptions::new().reservation(Reservation::new(1, 1).unwrap()),
    );
    assert!(held.is_err(), "the streamed call holds the one slot");
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(tx);
    response.into_body().collect().await.unwrap();
    eventually("released", || bulkhead.stats().in_flight == 0).await;
    let held = bulkhead
        .try_acquire(
            &LlmRequest::new(),
            AcquireOptions::new().reservation(Reservation::new(1, 1).unwrap()),
        )
        .unwrap();
    let refused = client()
        .request(post_to(addr, "/json", CHAT))
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()[header::RETRY_AFTER], "1");
    drop(held);
}

/// `wait_in_queue(true)` on a bulkhead without a queue is refused when the layer is built
/// (every request would be refused at once anyway); a layer over a bulkhead with a queue waits
/// by default: a request that finds no free slot waits in it and is served once one frees up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_in_the_queue_needs_a_queue_and_then_waits() {
    use async_bulkhead_llm::tower::LayerError;
    let no_queue = budgeted(1);
    assert_eq!(
        LlmLayer::new(no_queue.clone())
            .wait_in_queue(true)
            .unwrap_err(),
        LayerError::NoQueue
    );
    // Not waiting is fine on any bulkhead.
    assert!(LlmLayer::new(no_queue).wait_in_queue(false).is_ok());

    let bulkhead = LlmBulkhead::builder("gpt-4o", 1)
        .max_queue(4)
        .queue_timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    // No `wait_in_queue(true)`: the bulkhead has a queue, so the layer waits by default.
    let (addr, _tx) = serve(LlmLayer::new(bulkhead.clone())).await;
    let held = bulkhead
        .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    let waiting = tokio::spawn(client().request(post_to(addr, "/json", CHAT)));
    eventually("the request waits in the queue", || {
        bulkhead.stats().pending == 1
    })
    .await;
    drop(held);
    let response = waiting.await.unwrap().unwrap();
    assert_eq!(response.status(), 200);
    response.into_body().collect().await.unwrap();
    eventually("the call settles", || bulkhead.stats().in_flight == 0).await;
    assert_eq!(bulkhead.stats().admitted, 2);
}

/// Tenants within a global limit through one layer, on a real server: a refusal names its
/// level in its JSON, shows the tenant's own figures and hides the global ones, a global
/// refusal is counted nowhere at the tenant, the streamed usage moves both holds, and every
/// count adds up once the streams end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_within_a_global_limit_are_decided_together_through_one_layer() {
    let global = LlmBulkhead::builder("gpt-4o", 2)
        .token_budget(TokenBudget::new(100_000))
        .build()
        .unwrap();
    let tenants = Tenants::builder(|_: &String| {
        LlmBulkhead::builder("gpt-4o", 1).token_budget(TokenBudget::new(10_000))
    })
    .build()
    .unwrap();
    let layer = LlmLayer::tenants_within(global.clone(), tenants.clone(), |head| {
        head.headers["x-api-key"].to_str().unwrap().to_owned()
    })
    .rate_limit_headers(true);
    let (addr, tx) = serve(layer).await;
    let call = |key: &str| {
        let mut request = post_to(addr, "/v1/chat/completions", CHAT);
        let key = HeaderValue::from_str(key).unwrap();
        request.headers_mut().insert("x-api-key", key);
        request
    };
    async fn refusal_json(response: hyper::Response<hyper::body::Incoming>) -> serde_json::Value {
        assert_eq!(response.status(), 429);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&body).unwrap()
    }

    // acme streams (its one slot and one of the two global ones held).
    let acme = client().request(call("acme")).await.unwrap();
    assert_eq!(acme.status(), 200);
    assert_eq!(acme.headers()["ratelimit-limit"], "1"); // the tenant's own figures
    assert_eq!(acme.headers()["ratelimit-remaining"], "0");
    // A second acme call: the tenant's limit, with the tenant's figures.
    let json = refusal_json(client().request(call("acme")).await.unwrap()).await;
    assert_eq!(json["error"]["scope"], "tenant");
    assert_eq!(json["error"]["detail"]["max_concurrent"], 1);
    // Another tenant holds the second global slot from outside the layer.
    let globex = tenants.get("globex").unwrap();
    let held = globex
        .try_acquire_within(&global, &LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    // initech's own limit has room, the global one not: scoped global, figures hidden.
    let json = refusal_json(client().request(call("initech")).await.unwrap()).await;
    assert_eq!(json["error"]["scope"], "global");
    assert_eq!(json["error"]["code"], "concurrency_limit");
    assert!(json["error"].get("detail").is_none(), "{json}");
    let initech = tenants.stats("initech").unwrap();
    assert_eq!(
        (initech.admitted, initech.rejected, initech.in_flight),
        (0, 0, 0)
    );
    drop(held);

    // acme's stream reports usage: both holds move; it ends: both release.
    let acme_stats = || tenants.stats("acme").unwrap();
    let reserved = acme_stats().token_budget.unwrap().in_flight_tokens;
    assert_eq!(
        global.stats().token_budget.unwrap().in_flight_tokens,
        reserved
    );
    let mut body = acme.into_body();
    let usage = r#"data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5}}"#;
    tx.send(Bytes::from(format!("{usage}\n\n"))).await.unwrap();
    body.frame().await.unwrap().unwrap();
    eventually("usage reported at both levels", || {
        let held = acme_stats().token_budget.unwrap().in_flight_tokens;
        held != reserved && held == global.stats().token_budget.unwrap().in_flight_tokens
    })
    .await;
    drop(tx);
    assert!(body.frame().await.is_none());
    eventually("released at both levels", || {
        acme_stats().in_flight == 0 && global.stats().in_flight == 0
    })
    .await;
    let (a, g) = (acme_stats(), global.stats());
    assert_eq!((a.admitted, a.rejected, a.released), (1, 1, 1));
    // The global level: acme's and globex's admissions, initech's refusal.
    assert_eq!((g.admitted, g.rejected, g.released), (2, 1, 2));
    assert_eq!(a.token_budget.unwrap().total_consumed, 12);
    assert_eq!(g.token_budget.unwrap().total_consumed, 12);
}

/// A rate window's refusal through the layer: 429 with the exact `Retry-After`, and the
/// windows' figures in the rate-limit headers OpenAI's clients read, on a 200 and on the 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_window_refusal_carries_its_exact_retry_after_and_the_window_headers() {
    use async_bulkhead_llm::rate::{ManualClock, RateClock, RateLimits};
    let clock = ManualClock::new();
    let bulkhead = LlmBulkhead::builder("gpt-4o", 8)
        .token_budget(TokenBudget::new(100_000))
        .rate_limits(
            RateLimits::new(Duration::from_secs(60))
                .requests(2)
                .tokens(10_000),
        )
        .rate_clock(RateClock::manual(&clock))
        .build()
        .unwrap();
    let layer = LlmLayer::new(bulkhead.clone())
        .options(|_| AcquireOptions::new().reservation(Reservation::new(1_000, 1_000).unwrap()))
        .rate_limit_headers(true);
    let (addr, _tx) = serve(layer).await;
    let ok = client()
        .request(post_to(addr, "/json", CHAT))
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let headers = ok.headers().clone();
    ok.into_body().collect().await.unwrap();
    assert_eq!(headers["x-ratelimit-limit-requests"], "2");
    assert_eq!(headers["x-ratelimit-remaining-requests"], "1");
    assert_eq!(headers["x-ratelimit-reset-requests"], "30s");
    assert_eq!(headers["x-ratelimit-limit-tokens"], "10000");
    assert_eq!(headers["x-ratelimit-remaining-tokens"], "8000");
    assert_eq!(headers["x-ratelimit-reset-tokens"], "12s");
    assert_eq!(headers["ratelimit-remaining"], "1");
    // The JSON response settled with its usage (42 tokens): the tokens window got the rest back.
    assert_eq!(
        bulkhead.rate_status().unwrap().tokens.unwrap().remaining,
        10_000 - 42
    );
    let second = client()
        .request(post_to(addr, "/json", CHAT))
        .await
        .unwrap();
    second.into_body().collect().await.unwrap();
    let refused = client()
        .request(post_to(addr, "/json", CHAT))
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    // Two requests of two per minute used: the next one's share of the minute is 30 s away.
    assert_eq!(refused.headers()["retry-after"], "30");
    assert_eq!(refused.headers()["x-ratelimit-remaining-requests"], "0");
    let body = refused.into_body().collect().await.unwrap().to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["error"]["code"], "rate_limit");
    assert_eq!(json["error"]["type"], "rate_limit_error");
    clock.advance(Duration::from_secs(30));
    let again = client()
        .request(post_to(addr, "/json", CHAT))
        .await
        .unwrap();
    assert_eq!(again.status(), 200);
}

/// A layer learning its windows from the provider's answers, on a real server: the provider's
/// stated tokens limit becomes the window's, and its 429 lowers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learning_layer_follows_the_provider_s_headers_and_its_429s() {
    use async_bulkhead_llm::rate::{LearnBounds, LimitLearner, RateLimits};
    use axum::http::StatusCode;
    let bulkhead = LlmBulkhead::builder("gpt-4o", 8)
        .token_budget(TokenBudget::new(1_000_000))
        .rate_limits(RateLimits::per_minute().tokens(500_000))
        .build()
        .unwrap();
    let learner = LimitLearner::new(bulkhead.clone()).tokens(LearnBounds::new(1_000, 1_000_000));
    let layer = LlmLayer::new(bulkhead.clone())
        .options(|_| AcquireOptions::new().reservation(Reservation::new(100, 100).unwrap()))
        .learn_limits(Arc::new(learner));
    let calls = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let provider = {
        let calls = calls.clone();
        move || {
            let n = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move {
                let mut response = Response::new(Body::from("{}"));
                if n == 0 {
                    response.headers_mut().insert(
                        "x-ratelimit-limit-tokens",
                        HeaderValue::from_static("90000"),
                    );
                } else {
                    *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                }
                response
            }
        }
    };
    let app = Router::new()
        .route("/v1/chat/completions", post(provider))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let window = || bulkhead.limits().rate.unwrap().tokens.unwrap();
    let first = client()
        .request(post_to(addr, "/v1/chat/completions", CHAT))
        .await
        .unwrap();
    first.into_body().collect().await.unwrap();
    assert_eq!(window(), 90_000);
    let throttled = client()
        .request(post_to(addr, "/v1/chat/completions", CHAT))
        .await
        .unwrap();
    assert_eq!(throttled.status(), 429); // the provider's own answer, passed on
    throttled.into_body().collect().await.unwrap();
    assert_eq!(window(), 63_000); // lowered by 30%
    assert_eq!(bulkhead.limits().revision, 2);
}
