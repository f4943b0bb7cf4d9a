//! The general bulkhead's tower layer against a real axum (or hyper) server and a real hyper
//! client on 127.0.0.1: a slow route behind the layer queues and sheds while a fast route
//! beside it keeps answering, a streamed body holds its slot until it ends or the client
//! leaves, refusals are 503s with their JSON body, and the opt-in `Retry-After` follows the
//! measured hold times.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    Bulkhead, BulkheadError, bulkhead::BulkheadState, bulkhead::OwnedBulkheadPermit,
    tower::BulkheadLayer,
};
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use axum::routing::get;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::{mpsc, oneshot};

use super::eventually;

/// Each call of the slow route hands the test the sender of its response body: the body
/// streams what the test sends and ends when the test drops the sender.
type Calls = mpsc::UnboundedSender<mpsc::Sender<Bytes>>;

async fn slow(State(calls): State<Calls>) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    calls.send(tx).expect("the test listens");
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|chunk| (Ok::<_, std::convert::Infallible>(chunk), rx))
    });
    let mut response = Response::new(Body::from_stream(stream));
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    response
}

async fn fast() -> &'static str {
    "fast"
}

/// A server on a loopback port: `/slow` behind `layer`, `/fast` beside it without the layer.
async fn serve(layer: BulkheadLayer) -> (SocketAddr, mpsc::UnboundedReceiver<mpsc::Sender<Bytes>>) {
    let (calls, rx) = mpsc::unbounded_channel();
    let app = Router::new()
        .route("/slow", get(slow).route_layer(layer))
        .route("/fast", get(fast))
        .with_state(calls);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, rx)
}

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn get_from(addr: SocketAddr, path: &str) -> http::Response<hyper::body::Incoming> {
    let request = http::Request::get(format!("http://{addr}{path}"))
        .body(Empty::new())
        .unwrap();
    client().request(request).await.unwrap()
}

/// Reads a refusal: asserts 503 and the JSON content type, returns the `Retry-After` header
/// and the body.
async fn refused(response: http::Response<hyper::body::Incoming>) -> (Option<String>, String) {
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
    let retry_after = response
        .headers()
        .get(header::RETRY_AFTER)
        .map(|v| v.to_str().unwrap().to_owned());
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (retry_after, String::from_utf8(body.to_vec()).unwrap())
}

/// The body the layer answers `error` with, spelled out from its parts.
fn expected_body(error: &BulkheadError) -> String {
    let state = error.state();
    format!(
        r#"{{"error":{{"type":"{}","message":"{}","active":{},"queued":{}}}}}"#,
        error.as_str(),
        error,
        state.active,
        state.queued
    )
}

/// Takes every slot of `bulkhead` outside the layer.
fn take_all(bulkhead: &Bulkhead) -> Vec<OwnedBulkheadPermit> {
    let n = bulkhead.limits().max_concurrent;
    (0..n)
        .map(|_| bulkhead.try_acquire_owned().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_route_at_its_cap_queues_one_sheds_the_next_and_a_fast_route_keeps_answering() {
    let bulkhead = Bulkhead::builder(2).max_queue(1).build().unwrap();
    let (addr, mut calls) = serve(BulkheadLayer::new(bulkhead.clone())).await;

    // Two calls admitted: their heads arrive, their bodies stay open.
    let first = get_from(addr, "/slow").await;
    let second = get_from(addr, "/slow").await;
    assert_eq!(
        (first.status().as_u16(), second.status().as_u16()),
        (200, 200)
    );
    let first_tx = calls.recv().await.unwrap();
    let second_tx = calls.recv().await.unwrap();
    assert_eq!(bulkhead.state(), BulkheadState::new(2, 0));

    // The third waits in the queue (its handler is not called).
    let third = tokio::spawn(async move { get_from(addr, "/slow").await });
    eventually("the third call queued", || bulkhead.state().queued == 1).await;

    // The fourth finds the queue full: shed with the exact body, no Retry-After.
    let (retry_after, body) = refused(get_from(addr, "/slow").await).await;
    assert_eq!(retry_after, None);
    assert_eq!(
        body,
        r#"{"error":{"type":"bulkhead_queue_full","message":"bulkhead queue full (2 active, 1 queued); the call was shed: do not retry it","active":2,"queued":1}}"#
    );

    // The fast route, on the same server, is not behind the bulkhead.
    let fast = get_from(addr, "/fast").await;
    assert_eq!(fast.status(), 200);
    assert_eq!(fast.into_body().collect().await.unwrap().to_bytes(), "fast");
    assert_eq!(bulkhead.state(), BulkheadState::new(2, 1));

    // The first body ends: its slot goes to the queued third call.
    first_tx.send(Bytes::from("one")).await.unwrap();
    drop(first_tx);
    let body = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "one");
    let third = third.await.unwrap();
    assert_eq!(third.status(), 200);
    let third_tx = calls.recv().await.unwrap();
    assert_eq!(bulkhead.state(), BulkheadState::new(2, 0));

    drop((second_tx, third_tx));
    second.into_body().collect().await.unwrap();
    third.into_body().collect().await.unwrap();
    assert_eq!(bulkhead.state(), BulkheadState::new(0, 0));
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released), (3, 3));
    assert_eq!(stats.rejected_queue_full, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_is_held_until_the_body_ends_and_released_when_the_client_drops_it() {
    let bulkhead = Bulkhead::new(2).unwrap();
    let (addr, mut calls) = serve(BulkheadLayer::new(bulkhead.clone())).await;

    // Read to the end.
    let response = get_from(addr, "/slow").await;
    let tx = calls.recv().await.unwrap();
    let mut body = response.into_body();
    tx.send(Bytes::from("chunk")).await.unwrap();
    let frame = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(frame, "chunk");
    assert_eq!(bulkhead.state().active, 1, "held while the body is open");
    drop(tx);
    assert!(body.frame().await.is_none());
    // The layer releases as the inner body ends, before the server writes the last chunk.
    assert_eq!(bulkhead.state().active, 0);

    // A client gone mid-body.
    let response = get_from(addr, "/slow").await;
    let tx = calls.recv().await.unwrap();
    let mut body = response.into_body();
    tx.send(Bytes::from("chunk")).await.unwrap();
    body.frame().await.unwrap().unwrap();
    assert_eq!(bulkhead.state().active, 1);
    drop(body);
    eventually("released when the client left", || {
        bulkhead.state().active == 0
    })
    .await;
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released), (2, 2));
    drop(tx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_timeout_and_a_shutdown_are_503s_of_their_type_without_retry_after() {
    let bulkhead = Bulkhead::builder(1)
        .max_queue(1)
        .queue_timeout(Duration::from_millis(50))
        .build()
        .unwrap();
    let (addr, _calls) = serve(BulkheadLayer::new(bulkhead.clone())).await;
    let held = take_all(&bulkhead);

    let (retry_after, body) = refused(get_from(addr, "/slow").await).await;
    assert_eq!(retry_after, None);
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(json["error"]["type"], "bulkhead_queue_timeout");
    assert_eq!(json["error"]["active"], 1);
    assert_eq!(json["error"]["queued"], 0);
    let message = json["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("bulkhead queue timeout after "),
        "{message}"
    );
    assert_eq!(bulkhead.stats().timed_out, 1);

    bulkhead.close();
    let (retry_after, body) = refused(get_from(addr, "/slow").await).await;
    assert_eq!(retry_after, None);
    let shutdown = BulkheadError::Shutdown {
        state: BulkheadState::new(1, 0),
    };
    assert_eq!(body, expected_body(&shutdown));
    assert_eq!(
        body,
        r#"{"error":{"type":"bulkhead_shutdown","message":"bulkhead is shut down; the call was refused: do not retry it","active":1,"queued":0}}"#
    );
    drop(held);
}

/// Whole seconds, rounded up (the hint's rounding).
fn ceil_seconds(d: Duration) -> u64 {
    u64::try_from(d.as_micros())
        .unwrap()
        .div_ceil(1_000_000)
        .max(1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_opted_in_retry_after_is_the_measured_hold_time_and_never_sent_on_shutdown() {
    const CALLS: usize = 3;
    const HOLD: Duration = Duration::from_millis(1_200);
    let bulkhead = Bulkhead::builder(CALLS).max_queue(0).build().unwrap();
    let layer = BulkheadLayer::new(bulkhead.clone()).retry_after_hint(true);
    let (addr, mut calls) = serve(layer).await;

    // No call released through the layer yet: no hint.
    let held = take_all(&bulkhead);
    let (retry_after, body) = refused(get_from(addr, "/slow").await).await;
    assert_eq!(retry_after, None);
    assert!(body.contains(r#""type":"bulkhead_queue_full""#), "{body}");
    drop(held);

    // Three calls held open for at least HOLD each (the hold is the measured quantity here,
    // not a synchronisation), timed from the client: each hold the layer measures lies
    // between HOLD and the client's request-to-end time.
    let mut started = Vec::new();
    let mut open = Vec::new();
    for _ in 0..CALLS {
        started.push(Instant::now());
        let response = get_from(addr, "/slow").await;
        assert_eq!(response.status(), 200);
        open.push((response, calls.recv().await.unwrap()));
    }
    assert_eq!(bulkhead.state().active, CALLS as u64);
    tokio::time::sleep(HOLD).await;
    let mut longest = Duration::ZERO;
    for ((response, tx), at) in open.into_iter().zip(&started) {
        drop(tx);
        response.into_body().collect().await.unwrap();
        longest = longest.max(at.elapsed());
    }
    assert_eq!(bulkhead.state().active, 0);

    // A weighted average of holds within [HOLD, longest] lies within them too.
    let (low, high) = (ceil_seconds(HOLD), ceil_seconds(longest));
    let held = take_all(&bulkhead);
    let (retry_after, body) = refused(get_from(addr, "/slow").await).await;
    let hint: u64 = retry_after
        .expect("a hint once holds are known")
        .parse()
        .unwrap();
    assert!(
        (low..=high).contains(&hint),
        "hint {hint}, holds between {HOLD:?} ({low} s) and {longest:?} ({high} s)"
    );
    if low == high {
        assert_eq!(hint, low);
    }
    let full = BulkheadError::QueueFull {
        state: BulkheadState::new(CALLS as u64, 0),
    };
    assert_eq!(body, expected_body(&full));

    // A shutdown is not a matter of time: no hint, though one is known.
    bulkhead.close();
    let (retry_after, body) = refused(get_from(addr, "/slow").await).await;
    assert_eq!(retry_after, None);
    assert!(body.contains(r#""type":"bulkhead_shutdown""#), "{body}");
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_fast_refuses_at_once_though_the_queue_has_room() {
    // Waiting needs a queue: asked of a bulkhead without one, the layer refuses to be built
    // (as the LLM layer does).
    let no_queue = Bulkhead::builder(1).max_queue(0).build().unwrap();
    assert_eq!(
        BulkheadLayer::new(no_queue).wait_in_queue(true).err(),
        Some(async_bulkhead_llm::tower::LayerError::NoQueue)
    );
    let bulkhead = Bulkhead::builder(1).max_queue(5).build().unwrap();
    let (addr, mut calls) = serve(
        BulkheadLayer::new(bulkhead.clone())
            .wait_in_queue(false)
            .expect("failing fast is always allowed"),
    )
    .await;
    let held = take_all(&bulkhead);

    // With the default 10 s queue timeout a waiting call would still be waiting.
    let (retry_after, body) = refused(get_from(addr, "/slow").await).await;
    assert_eq!(retry_after, None);
    assert_eq!(
        body,
        r#"{"error":{"type":"bulkhead_queue_full","message":"bulkhead queue full (1 active, 0 queued); the call was shed: do not retry it","active":1,"queued":0}}"#
    );
    let stats = bulkhead.stats();
    assert_eq!((stats.queued, stats.rejected_queue_full), (0, 1));

    drop(held);
    let response = get_from(addr, "/slow").await;
    assert_eq!(response.status(), 200);
    drop(calls.recv().await.unwrap());
    response.into_body().collect().await.unwrap();
    assert_eq!(bulkhead.state().active, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inner_service_error_releases_the_slot_at_once() {
    use tower::{Layer, ServiceExt};

    let bulkhead = Bulkhead::new(1).unwrap();
    // The inner service tells the test it was called, then fails when the test says so.
    let (called_tx, mut called) = mpsc::unbounded_channel::<oneshot::Sender<()>>();
    let inner = tower::service_fn(move |_request: http::Request<hyper::body::Incoming>| {
        let called_tx = called_tx.clone();
        async move {
            let (fail_tx, fail) = oneshot::channel();
            called_tx.send(fail_tx).unwrap();
            fail.await.unwrap();
            Err::<http::Response<Full<Bytes>>, std::io::Error>(std::io::Error::other(
                "the dependency failed",
            ))
        }
    });
    let service = BulkheadLayer::new(bulkhead.clone()).layer(inner);

    // A hyper server on a loopback port, one connection.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let service = hyper::service::service_fn(move |request| service.clone().oneshot(request));
        // The connection ends with the service's error.
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
            .await;
    });

    let request = http::Request::get(format!("http://{addr}/"))
        .body(Empty::<Bytes>::new())
        .unwrap();
    let answer = tokio::spawn(async move { client().request(request).await });
    let fail = called.recv().await.unwrap();
    assert_eq!(
        bulkhead.state().active,
        1,
        "held while the inner service runs"
    );
    fail.send(()).unwrap();
    eventually("released on the inner error", || {
        bulkhead.state().active == 0
    })
    .await;
    assert!(answer.await.unwrap().is_err(), "the connection failed");
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released), (1, 1));
}

#[cfg(feature = "axum")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_returning_a_bulkhead_error_answers_the_layers_503() {
    let bulkhead = Bulkhead::builder(1).max_queue(0).build().unwrap();
    let handler = |State(bulkhead): State<Bulkhead>| async move {
        let _permit = bulkhead.try_acquire()?;
        Ok::<_, BulkheadError>("served")
    };
    let app = Router::new()
        .route("/", get(handler))
        .with_state(bulkhead.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let held = bulkhead.try_acquire_owned().unwrap();
    let (retry_after, body) = refused(get_from(addr, "/").await).await;
    assert_eq!(retry_after, None);
    assert_eq!(
        body,
        r#"{"error":{"type":"bulkhead_queue_full","message":"bulkhead queue full (1 active, 0 queued); the call was shed: do not retry it","active":1,"queued":0}}"#
    );
    drop(held);
    let served = get_from(addr, "/").await;
    assert_eq!(served.status(), 200);
}
