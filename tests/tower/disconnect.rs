//! What the provider sees when clients drop their streams, on a real server: a mock provider
//! that keeps generating each call to its natural end whether or not anyone still reads it (a
//! provider notices a gone client only when it next writes to the closed connection; this one
//! never does: the worst case), behind a layer with a limit of 8, under 48 clients of which
//! half leave mid-stream. It counts the calls the provider runs at once.
//!
//! With `Disconnect::Hold` at least as long as a generation, the provider never runs more
//! than the limit; with `Release` (the default) the calls that clients left keep running
//! while new ones are admitted in their slots. The figures each policy gave are printed
//! (`cargo test --all-features --test tower disconnect -- --nocapture`), and recorded in
//! `Disconnect`'s docs.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    LlmBulkhead,
    tower::{Disconnect, LlmLayer},
};
use axum::Router;
use axum::extract::State;
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use http_body_util::BodyExt;

use super::{CHAT, client, event_stream, post_to};

const LIMIT: usize = 8;
const CLIENTS: u64 = 48;
/// Each generation's length: a token every 10 ms for 15-30 tokens, each at its own instant
/// from the start (no drift), so none is longer than `LONGEST` but for the timer's lateness.
const TOKEN: Duration = Duration::from_millis(10);
const LONGEST: Duration = Duration::from_millis(300);
/// The hold tried: the longest generation and a margin for timers that fire late (a grace
/// timer firing late only holds longer; a generation's end firing late would look like an
/// overlap).
const HOLD: Duration = Duration::from_millis(350);
const RUN: Duration = Duration::from_millis(1_500);

/// The provider's calls in progress, now and at their highest.
#[derive(Default)]
struct Generating {
    now: AtomicU64,
    peak: AtomicU64,
    calls: AtomicU64,
}

/// Streams 15-30 tokens, one every `TOKEN`, and counts the call as generating until the last
/// one was produced, whether the gateway still reads or not.
async fn provider(State(generating): State<Arc<Generating>>) -> Response {
    let n = generating.calls.fetch_add(1, Ordering::Relaxed);
    let now = generating.now.fetch_add(1, Ordering::SeqCst) + 1;
    generating.peak.fetch_max(now, Ordering::SeqCst);
    let tokens = 15 + n % 16;
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        let start = tokio::time::Instant::now();
        for i in 1..=u32::try_from(tokens).unwrap() {
            tokio::time::sleep_until(start + TOKEN * i).await;
            // A gone reader is not noticed: the generation runs to its end.
            let _ = tx.try_send(Bytes::from_static(b"data: {\"choices\":[]}\n\n"));
        }
        generating.now.fetch_sub(1, Ordering::SeqCst);
    });
    event_stream(rx)
}

/// Runs the load through a layer with `disconnect`; the provider's peak of calls at once, and
/// the calls it ran.
async fn peak_with(disconnect: Disconnect) -> (u64, u64) {
    let bulkhead = LlmBulkhead::builder("gpt-4o", LIMIT)
        .max_queue(64)
        .build()
        .unwrap();
    let generating = Arc::new(Generating::default());
    let layer = LlmLayer::new(bulkhead.clone()).on_disconnect(disconnect);
    let app = Router::new()
        .route("/v1/chat/completions", post(provider))
        .with_state(generating.clone())
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let end = Instant::now() + RUN;
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            tokio::spawn(async move {
                let client = client();
                let leaves = i % 2 == 0;
                while Instant::now() < end {
                    let response = client
                        .request(post_to(addr, "/v1/chat/completions", CHAT))
                        .await
                        .unwrap();
                    if response.status() != 200 {
                        continue;
                    }
                    let mut body = response.into_body();
                    if leaves {
                        // Reads three tokens, then goes away.
                        for _ in 0..3 {
                            body.frame().await;
                        }
                        drop(body);
                    } else {
                        while body.frame().await.is_some() {}
                    }
                }
            })
        })
        .collect();
    for client in clients {
        client.await.unwrap();
    }
    // Every generation and every grace ended: nothing is left held.
    tokio::time::sleep(LONGEST * 2).await;
    assert_eq!(bulkhead.stats().in_flight, 0);
    assert_eq!(generating.now.load(Ordering::SeqCst), 0);
    (
        generating.peak.load(Ordering::SeqCst),
        generating.calls.load(Ordering::Relaxed),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_as_long_as_a_generation_keeps_the_provider_within_the_limit() {
    let (released, released_calls) = peak_with(Disconnect::Release).await;
    let (held, held_calls) = peak_with(Disconnect::Hold(HOLD)).await;
    let (measured, measured_calls) = peak_with(Disconnect::Measured { max: LONGEST }).await;
    println!(
        "provider calls at once, limit {LIMIT}, {CLIENTS} clients (half leave mid-stream) for {RUN:?}: \
         Release {released} ({released_calls} calls), Hold({HOLD:?}) {held} ({held_calls} calls), \
         Measured {{ max: {LONGEST:?} }} {measured} ({measured_calls} calls)"
    );
    assert!(held <= LIMIT as u64, "Hold: {held} calls at once");
    assert!(
        released > LIMIT as u64,
        "Release: the left calls ran beyond the limit ({released})"
    );
    assert!(released_calls > held_calls, "{released_calls} {held_calls}");
}
