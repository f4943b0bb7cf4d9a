//! A real LLM gateway on loopback: an axum server whose one route forwards OpenAI
//! chat-completions requests to a provider with a hyper client, streaming the provider's
//! server-sent events back unchanged, behind `LlmLayer` (feature `tower`). The provider is a
//! mock embedded here (another axum server on 127.0.0.1) that streams tokens at a realistic
//! pace (a first token after 100-400 ms, then 60-200 tokens/s) and states the call's usage in
//! its last chunk; the layer reads that usage as the chunk passes and settles the call's
//! tokens with it when the stream ends.
//!
//! A bounded load generator then fires a burst of streaming requests of mixed sizes,
//! `max_tokens` and priorities at the gateway, and a second wave spread over a few seconds,
//! reads every answer to its end, and prints what came back: how many were admitted, the
//! refusals by status and code, the token accounting, the peaks against the limits, the
//! bulkhead's decision time and the latencies. It ends by checking its invariants: every
//! request was answered, the 200s are exactly the admissions, nothing is left in flight, and
//! the tokens the bulkhead counts as consumed are exactly the usage the provider stated.
//!
//! The bulkhead: 16 slots, a budget of 24,000 tokens in flight of which 4,000 only calls marked
//! `x-priority: high` may use, and a short queue. **Why a queue, and a short one.** A gateway
//! in front of a streaming provider sees bursts far above what it may run at once, and a slot
//! frees every few hundred milliseconds as streams end. A small queue (32 places, 1.5 s)
//! absorbs the head of a burst and the jitter of arrivals: a caller whose slot frees a moment
//! later gets a 200 rather than a 429. The two bounds keep the gateway honest: past 32 waiting
//! callers a request is refused at once (429 `queue_limit`), so the gateway never holds
//! thousands of idle connections, and a caller that waited 1.5 s without a slot is answered
//! 503 `timeout` (overloaded) rather than minutes late. Tokens never wait: a call whose
//! reservation does not fit the tokens in flight when it is decided (on arrival, or when a slot
//! frees for it) is refused then (429 `budget_limit`), and one that could never fit is answered
//! 413 so that its client does not retry it unchanged.
//!
//! The gateway also serves `GET /metrics` in Prometheus text (`BulkheadMetrics`, feature
//! `metrics`, under `metrics-exporter-prometheus`'s recorder), outside the layer: the demo
//! scrapes it after the load, prints the bulkhead's series, and checks that the scrape agrees
//! with `stats()`.
//!
//! Run: `cargo run --release --example gateway --features tower,metrics` (about 12 s; loopback
//! only).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, Priority, Profile, TokenBudget, events::Event, events::EventKind,
    observability::BulkheadMetrics, tower::LlmLayer,
};
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

const MODEL: &str = "gpt-4o";
/// Calls the gateway lets run at once.
const SLOTS: usize = 16;
/// Tokens (input + maximum output) the calls in flight may hold at once.
const BUDGET: u64 = 24_000;
/// Of those, the tokens only `x-priority: high` calls may use.
const HIGH_RESERVE: u64 = 4_000;
/// Output tokens reserved for a request that names no `max_tokens`.
const OUTPUT_CAP: u64 = 1_024;
/// Callers that may wait for a slot, and for how long.
const MAX_QUEUE: u32 = 32;
const QUEUE_TIMEOUT: Duration = Duration::from_millis(1_500);
/// Requests fired at once at the start.
const BURST: usize = 200;
/// Requests of the second wave, spread evenly over `WAVE_SPREAD` from `WAVE_START`.
const WAVE: usize = 150;
const WAVE_START: Duration = Duration::from_secs(2);
const WAVE_SPREAD: Duration = Duration::from_secs(4);
/// Requests of the burst whose prompt can never fit the budget (answered 413).
const OVERSIZED: usize = 2;
/// The request mix is the same on every run; the provider's pace is not.
const SEED: u64 = 15;
/// The progress line is redrawn this often; peaks are sampled every `SAMPLE`.
const PROGRESS_EVERY: Duration = Duration::from_millis(100);
const SAMPLE: Duration = Duration::from_millis(2);

// ---------------------------------------------------------------------------------------------
// The mock provider
// ---------------------------------------------------------------------------------------------

/// What the provider served and the usage it stated, call by call, added up.
#[derive(Default)]
struct ProviderBook {
    calls: AtomicU64,
    stated_calls: AtomicU64,
    stated_input: AtomicU64,
    stated_output: AtomicU64,
}

/// The prompt tokens the provider states for a chat-completions body: about four characters a
/// token, plus a few tokens of framing per message (as OpenAI counts them). The bulkhead's
/// estimator uses 3.7 characters a token for gpt-4o, so its input estimates run a little high
/// and the difference is refunded when the usage arrives.
fn prompt_tokens(json: &serde_json::Value) -> u64 {
    let messages = json["messages"].as_array().map_or(&[][..], Vec::as_slice);
    3 + messages
        .iter()
        .map(|m| {
            let chars = m["content"].as_str().map_or(0, str::len) as u64;
            4 + chars.div_ceil(4)
        })
        .sum::<u64>()
}

fn sse(json: &serde_json::Value) -> Bytes {
    Bytes::from(format!("data: {json}\n\n"))
}

const WORDS: [&str; 12] = [
    " the", " gateway", " admits", " each", " call", " once", " and", " streams", " tokens",
    " back", " to", " you",
];

/// `POST /v1/chat/completions` with `"stream": true`: a role chunk and one chunk per token at
/// this call's pace, a finish chunk, the usage chunk (`stream_options.include_usage`), then
/// `data: [DONE]`.
async fn provider(State(book): State<Arc<ProviderBook>>, body: Bytes) -> Response {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return (StatusCode::BAD_REQUEST, "invalid JSON").into_response();
    };
    if json["stream"] != true {
        return (StatusCode::BAD_REQUEST, "this mock only streams").into_response();
    }
    let n = book.calls.fetch_add(1, Ordering::Relaxed) + 1;
    let id = format!("chatcmpl-{n}");
    let prompt = prompt_tokens(&json);
    let mut rng = fastrand::Rng::new();
    // The answer the model would write, cut at `max_tokens`.
    let natural = rng.u64(16..=400);
    let max_tokens = json["max_tokens"].as_u64();
    let completion = max_tokens.map_or(natural, |max| natural.min(max));
    let finish = if completion < natural {
        "length"
    } else {
        "stop"
    };
    let first_token = Duration::from_millis(rng.u64(100..=400));
    let per_token = Duration::from_secs(1) / rng.u32(60..=200);

    let (tx, rx) = mpsc::channel::<Bytes>(8);
    tokio::spawn(async move {
        let chunk = |delta: serde_json::Value, finish: Option<&str>| {
            sse(&serde_json::json!({
                "id": id, "object": "chat.completion.chunk", "model": MODEL,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }))
        };
        tokio::time::sleep(first_token).await;
        // A send fails only when the gateway dropped the stream: stop writing then.
        if tx
            .send(chunk(serde_json::json!({"role": "assistant"}), None))
            .await
            .is_err()
        {
            return;
        }
        let mut next = tokio::time::Instant::now();
        for i in 0..completion {
            let word = WORDS[i as usize % WORDS.len()];
            if tx
                .send(chunk(serde_json::json!({"content": word}), None))
                .await
                .is_err()
            {
                return;
            }
            next += per_token;
            tokio::time::sleep_until(next).await;
        }
        let usage = sse(&serde_json::json!({
            "id": id, "object": "chat.completion.chunk", "model": MODEL, "choices": [],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        }));
        if tx
            .send(chunk(serde_json::json!({}), Some(finish)))
            .await
            .is_err()
            || tx.send(usage).await.is_err()
        {
            return;
        }
        // Stated: the usage chunk is on its way to the gateway.
        book.stated_calls.fetch_add(1, Ordering::Relaxed);
        book.stated_input.fetch_add(prompt, Ordering::Relaxed);
        book.stated_output.fetch_add(completion, Ordering::Relaxed);
        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    });
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

// ---------------------------------------------------------------------------------------------
// The gateway
// ---------------------------------------------------------------------------------------------

#[derive(Clone)]
struct Upstream {
    client: Client<HttpConnector, Body>,
    url: String,
}

/// Forwards the (admitted) request to the provider and hands its streamed body back as it
/// comes. The layer around the router holds the call's permit until that body ends.
async fn forward(State(upstream): State<Upstream>, request: axum::extract::Request) -> Response {
    let (head, body) = request.into_parts();
    let mut out = http::Request::post(&upstream.url);
    if let Some(content_type) = head.headers.get(header::CONTENT_TYPE) {
        out = out.header(header::CONTENT_TYPE, content_type);
    }
    let out = out.body(body).expect("a valid request head");
    match upstream.client.request(out).await {
        Ok(response) => {
            let (mut parts, body) = response.into_parts();
            // Hop-by-hop: the gateway's own connection frames the body.
            parts.headers.remove(header::TRANSFER_ENCODING);
            parts.headers.remove(header::CONNECTION);
            Response::from_parts(parts, Body::new(body))
        }
        Err(error) => (StatusCode::BAD_GATEWAY, format!("provider: {error}")).into_response(),
    }
}

/// What `GET /metrics` serves.
struct Scrape {
    metrics: BulkheadMetrics,
    prometheus: PrometheusHandle,
}

/// `GET /metrics`: publishes the bulkhead's counters and gauges from its stats, then renders
/// everything the recorder holds in Prometheus text.
async fn metrics_text(State(scrape): State<Arc<Scrape>>) -> String {
    scrape.metrics.publish();
    scrape.prometheus.render()
}

/// Scrapes the gateway's `/metrics` as a Prometheus server would.
async fn scrape_metrics(gateway: SocketAddr) -> Result<String, Box<dyn std::error::Error>> {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let response = client
        .get(format!("http://{gateway}/metrics").parse()?)
        .await?;
    let body = response.into_body().collect().await?.to_bytes();
    Ok(String::from_utf8(body.to_vec())?)
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let addr = listener.local_addr().expect("bound");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serving") });
    addr
}

/// What the bulkhead's listener collects.
#[derive(Default)]
struct Timing {
    admits: AtomicU64,
    decisions: Mutex<Vec<Duration>>,
    queue_waits: Mutex<Vec<Duration>>,
}

// ---------------------------------------------------------------------------------------------
// The load generator
// ---------------------------------------------------------------------------------------------

/// One request of the load.
struct Spec {
    high: bool,
    body: String,
    /// When it is fired, after the start.
    at: Duration,
}

fn specs() -> Vec<Spec> {
    let mut rng = fastrand::Rng::with_seed(SEED);
    let text = |rng: &mut fastrand::Rng, chars: usize| {
        let mut s = String::with_capacity(chars + 16);
        while s.len() < chars {
            s.push_str(WORDS[rng.usize(..WORDS.len())]);
        }
        s.truncate(chars);
        s
    };
    let total = BURST + WAVE;
    (0..total)
        .map(|i| {
            let oversized = i < OVERSIZED;
            // Mostly short prompts, some long, a few very long (up to ~4k tokens).
            let chars = if oversized {
                160_000
            } else {
                match rng.u8(0..10) {
                    0..=6 => rng.usize(200..1_200),
                    7..=8 => rng.usize(1_200..6_000),
                    _ => rng.usize(6_000..16_000),
                }
            };
            let max_tokens = match rng.u8(0..10) {
                0 => None, // the budget's output cap is reserved
                _ => Some([64u64, 128, 256, 512, 1024][rng.usize(..5)]),
            };
            let mut body = serde_json::json!({
                "model": MODEL,
                "stream": true,
                "stream_options": {"include_usage": true},
                "messages": [
                    {"role": "system", "content": "You are a concise assistant."},
                    {"role": "user", "content": text(&mut rng, chars)},
                ],
            });
            if let Some(max) = max_tokens {
                body["max_tokens"] = max.into();
            }
            let at = if i < BURST {
                Duration::ZERO
            } else {
                WAVE_START + WAVE_SPREAD * (i - BURST) as u32 / WAVE as u32
            };
            Spec {
                high: rng.u8(0..5) == 0,
                body: body.to_string(),
                at,
            }
        })
        .collect()
}

/// What came back for one request.
struct Outcome {
    high: bool,
    status: u16,
    /// The JSON error body's `code`, for a refusal.
    code: Option<String>,
    /// Until the first body frame: the first token for a 200, the whole answer for a refusal.
    first_byte: Duration,
    end_to_end: Duration,
    /// The usage stated in the stream, as the client read it.
    usage: Option<(u64, u64)>,
    /// A transport failure (never expected on loopback).
    error: Option<String>,
}

/// Live figures for the progress line.
#[derive(Default)]
struct Live {
    sent: AtomicU64,
    answered: AtomicU64,
    ok: AtomicU64,
    too_many: AtomicU64,
    too_large: AtomicU64,
    unavailable: AtomicU64,
    other: AtomicU64,
    done: AtomicU64,
}

async fn one_request(
    client: Client<HttpConnector, Full<Bytes>>,
    gateway: SocketAddr,
    spec: Spec,
    start: Instant,
    live: Arc<Live>,
) -> Outcome {
    tokio::time::sleep_until((start + spec.at).into()).await;
    let mut request = http::Request::post(format!("http://{gateway}/v1/chat/completions"))
        .header(header::CONTENT_TYPE, "application/json");
    if spec.high {
        request = request.header("x-priority", "high");
    }
    let request = request
        .body(Full::new(Bytes::from(spec.body)))
        .expect("a valid request");
    live.sent.fetch_add(1, Ordering::Relaxed);
    let sent = Instant::now();
    let failed = |error: String| Outcome {
        high: spec.high,
        status: 0,
        code: None,
        first_byte: sent.elapsed(),
        end_to_end: sent.elapsed(),
        usage: None,
        error: Some(error),
    };
    let response = match client.request(request).await {
        Ok(response) => response,
        Err(error) => return failed(error.to_string()),
    };
    let status = response.status().as_u16();
    live.answered.fetch_add(1, Ordering::Relaxed);
    match status {
        200 => &live.ok,
        429 => &live.too_many,
        503 => &live.unavailable,
        413 => &live.too_large,
        _ => &live.other,
    }
    .fetch_add(1, Ordering::Relaxed);
    let mut body = response.into_body();
    let mut bytes = Vec::new();
    let mut first_byte = None;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => {
                if let Some(data) = frame.data_ref() {
                    first_byte.get_or_insert_with(|| sent.elapsed());
                    bytes.extend_from_slice(data);
                }
            }
            Err(error) => return failed(error.to_string()),
        }
    }
    let end_to_end = sent.elapsed();
    live.done.fetch_add(1, Ordering::Relaxed);
    let (code, usage) = if status == 200 {
        (None, stream_usage(&bytes))
    } else {
        let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
        (json["error"]["code"].as_str().map(str::to_owned), None)
    };
    Outcome {
        high: spec.high,
        status,
        code,
        first_byte: first_byte.unwrap_or(end_to_end),
        end_to_end,
        usage,
        error: None,
    }
}

/// The usage an OpenAI event stream states, as a client reads it (`None` without one, or
/// without the final `[DONE]`).
fn stream_usage(bytes: &[u8]) -> Option<(u64, u64)> {
    let text = std::str::from_utf8(bytes).ok()?;
    let mut usage = None;
    let mut done = false;
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            done = true;
        } else if data.contains("\"usage\"") {
            let json: serde_json::Value = serde_json::from_str(data).ok()?;
            let u = &json["usage"];
            usage = Some((
                u["prompt_tokens"].as_u64()?,
                u["completion_tokens"].as_u64()?,
            ));
        }
    }
    usage.filter(|_| done)
}

// ---------------------------------------------------------------------------------------------
// Figures
// ---------------------------------------------------------------------------------------------

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

/// The median, 99th percentile and maximum of `values`, shown with `show`, and their count.
fn spread(mut values: Vec<Duration>, show: fn(Duration) -> String) -> String {
    values.sort();
    format!(
        "p50 {}, p99 {}, max {} (of {})",
        show(percentile(&values, 0.50)),
        show(percentile(&values, 0.99)),
        show(values.last().copied().unwrap_or_default()),
        values.len()
    )
}

#[derive(Default)]
struct Peaks {
    in_flight: AtomicU64,
    tokens: AtomicU64,
    pending: AtomicU64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();

    // The provider.
    let book = Arc::new(ProviderBook::default());
    let provider_addr = serve(
        Router::new()
            .route("/v1/chat/completions", post(provider))
            .with_state(book.clone()),
    )
    .await;

    // The gateway: the layer in front of a router that forwards to the provider.
    let bulkhead = LlmBulkhead::builder(MODEL, SLOTS)
        .token_budget(
            TokenBudget::new(BUDGET)
                .high_priority_reserve(HIGH_RESERVE)
                .output_cap(OUTPUT_CAP),
        )
        .profile(Profile::Custom {
            max_queue: MAX_QUEUE,
            timeout: Some(QUEUE_TIMEOUT),
        })
        .build()?;
    // Metrics: a Prometheus recorder for the process, the bulkhead's series registered with it.
    let recorder = PrometheusBuilder::new().build_recorder();
    let prometheus = recorder.handle();
    metrics::set_global_recorder(recorder)?;
    let scrape = Arc::new(Scrape {
        metrics: BulkheadMetrics::builder(&bulkhead, "gateway")
            .provider("openai")
            .install(),
        prometheus,
    });
    let timing = Arc::new(Timing::default());
    let sink = timing.clone();
    let _subscription = bulkhead.on_events([EventKind::Admit], move |event| {
        if let Event::Admit(admit) = event {
            sink.admits.fetch_add(1, Ordering::Relaxed);
            sink.decisions.lock().unwrap().push(admit.decision_duration);
            if admit.queue_wait > Duration::ZERO {
                sink.queue_waits.lock().unwrap().push(admit.queue_wait);
            }
        }
    });
    let upstream = Upstream {
        client: Client::builder(TokioExecutor::new()).build_http(),
        url: format!("http://{provider_addr}/v1/chat/completions"),
    };
    let layer = LlmLayer::new(bulkhead.clone())
        .options(|head| {
            let high = head.headers.get("x-priority").is_some_and(|v| v == "high");
            AcquireOptions::new().priority(if high {
                Priority::High
            } else {
                Priority::Normal
            })
        })
        .wait_in_queue(true)
        .expect("the bulkhead has a queue");
    let gateway = serve(
        Router::new()
            .route("/v1/chat/completions", post(forward))
            .with_state(upstream)
            .layer(layer)
            // Added after the layer, so a scrape is never admitted or refused by it.
            .merge(
                Router::new()
                    .route("/metrics", get(metrics_text))
                    .with_state(scrape),
            ),
    )
    .await;

    let specs = specs();
    let total = specs.len();
    let high_sent = specs.iter().filter(|s| s.high).count();
    println!(
        "async-bulkhead-llm gateway: LlmLayer in front of an axum router proxying to a provider"
    );
    println!("  gateway  http://{gateway}/v1/chat/completions  (x-priority: high for the reserve)");
    println!(
        "  provider http://{provider_addr}/v1/chat/completions  (mock {MODEL}: SSE, first token \
         100-400 ms, 60-200 tokens/s, usage in the last chunk)"
    );
    println!(
        "  bulkhead {SLOTS} slots, {BUDGET} tokens in flight ({HIGH_RESERVE} reserved for high \
         priority), queue {MAX_QUEUE} for {} s",
        QUEUE_TIMEOUT.as_secs_f64()
    );
    println!(
        "  load     {total} streaming requests ({high_sent} high priority): a burst of {BURST} at \
         once ({OVERSIZED} of them too large to ever fit), then {WAVE} over {} s from t = {} s",
        WAVE_SPREAD.as_secs(),
        WAVE_START.as_secs()
    );

    // A sampler for the peaks and the progress line.
    let live = Arc::new(Live::default());
    let peaks = Arc::new(Peaks::default());
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (bulkhead, live, peaks, stop) =
            (bulkhead.clone(), live.clone(), peaks.clone(), stop.clone());
        tokio::spawn(async move {
            let start = Instant::now();
            let mut last_print = Instant::now() - PROGRESS_EVERY;
            loop {
                let stopping = stop.load(Ordering::Acquire);
                let stats = bulkhead.stats();
                let tokens = stats.token_budget.map_or(0, |t| t.in_flight_tokens);
                peaks
                    .in_flight
                    .fetch_max(stats.in_flight, Ordering::Relaxed);
                peaks.tokens.fetch_max(tokens, Ordering::Relaxed);
                peaks.pending.fetch_max(stats.pending, Ordering::Relaxed);
                if stopping || last_print.elapsed() >= PROGRESS_EVERY {
                    last_print = Instant::now();
                    let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
                    eprint!(
                        "\r  [{:>4.1} s] sent {:>3}/{total}  answered {:>3}  finished {:>3} | \
                         streaming {:>2}/{SLOTS}  tokens {:>5}/{BUDGET}  queued {:>2}/{MAX_QUEUE} \
                         | 200 {:>3}  429 {:>3}  413 {}  503 {:>3} ",
                        start.elapsed().as_secs_f64(),
                        n(&live.sent),
                        n(&live.answered),
                        n(&live.done),
                        stats.in_flight,
                        tokens,
                        stats.pending,
                        n(&live.ok),
                        n(&live.too_many),
                        n(&live.too_large),
                        n(&live.unavailable),
                    );
                }
                if stopping {
                    eprintln!();
                    break;
                }
                tokio::time::sleep(SAMPLE).await;
            }
        })
    };

    // The load.
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let start = Instant::now();
    let mut calls = JoinSet::new();
    for spec in specs {
        calls.spawn(one_request(
            client.clone(),
            gateway,
            spec,
            start,
            live.clone(),
        ));
    }
    let mut outcomes = Vec::with_capacity(total);
    while let Some(outcome) = calls.join_next().await {
        outcomes.push(outcome?);
    }
    let load_time = start.elapsed();
    // The last permits are released as the gateway reads the end of the provider's streams,
    // which is before the clients see their end; give a straggler a moment all the same.
    let settle = Instant::now();
    while bulkhead.stats().in_flight > 0 && settle.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.store(true, Ordering::Release);
    sampler.await?;

    // ----- Summary -----
    let stats = bulkhead.stats();
    let tokens = stats.token_budget.expect("a token budget");
    let count = |f: &dyn Fn(&Outcome) -> bool| outcomes.iter().filter(|o| f(o)).count() as u64;
    let ok = count(&|o| o.status == 200);
    let by_code =
        |status: u16, code: &str| count(&|o| o.status == status && o.code.as_deref() == Some(code));
    let errors: Vec<&String> = outcomes.iter().filter_map(|o| o.error.as_ref()).collect();
    let other = count(&|o| o.error.is_none() && ![200, 429, 413, 503].contains(&o.status));

    println!(
        "\nanswers ({} of {total} in {:.1} s)",
        outcomes.len() - errors.len(),
        load_time.as_secs_f64()
    );
    println!(
        "  200 admitted and streamed  {ok:>4}   (high priority {} of {high_sent}, normal {} of {})",
        count(&|o| o.status == 200 && o.high),
        count(&|o| o.status == 200 && !o.high),
        total - high_sent
    );
    println!(
        "  429 queue_limit            {:>4}   (32 callers already waiting: refused at once)",
        by_code(429, "queue_limit")
    );
    println!(
        "  429 budget_limit           {:>4}   (the reservation did not fit the tokens in flight)",
        by_code(429, "budget_limit")
    );
    println!(
        "  429 concurrency_limit      {:>4}",
        by_code(429, "concurrency_limit")
    );
    println!(
        "  413 can never fit          {:>4}   (more tokens than the whole budget)",
        count(&|o| o.status == 413)
    );
    println!(
        "  503 timeout                {:>4}   (waited {} s in the queue without a slot)",
        by_code(503, "timeout"),
        QUEUE_TIMEOUT.as_secs_f64()
    );
    println!(
        "  other statuses             {other:>4}   transport errors {:>4}",
        errors.len()
    );

    let (stated_in, stated_out) = (
        book.stated_input.load(Ordering::Relaxed),
        book.stated_output.load(Ordering::Relaxed),
    );
    let (seen_in, seen_out) = outcomes
        .iter()
        .filter_map(|o| o.usage)
        .fold((0, 0), |(i, o), (ui, uo)| (i + ui, o + uo));
    println!("tokens (bulkhead stats)");
    println!(
        "  reserved  {:>9}   (estimated input + max_tokens, at admission)",
        tokens.total_reserved
    );
    println!(
        "  consumed  {:>9}   (the provider stated {} = {stated_in} prompt + {stated_out} completion)",
        tokens.total_consumed,
        stated_in + stated_out
    );
    println!(
        "  refunded  {:>9}   (taken off holds: short answers, over-estimated prompts)",
        tokens.total_refunded
    );
    println!(
        "  re-held   {:>9}   (held again below a reservation after a refund)",
        tokens.total_reheld
    );
    println!(
        "  overrun   {:>9}   (used above a reservation)",
        tokens.total_overrun
    );
    println!("peaks (sampled every {} ms)", SAMPLE.as_millis());
    println!(
        "  in flight {:>5} of {SLOTS} slots   tokens {:>5} of {BUDGET}   queued {:>2} of {MAX_QUEUE}",
        peaks.in_flight.load(Ordering::Relaxed),
        peaks.tokens.load(Ordering::Relaxed),
        peaks.pending.load(Ordering::Relaxed),
    );
    let decisions = timing.decisions.lock().unwrap().clone();
    let waits = timing.queue_waits.lock().unwrap().clone();
    println!("timing");
    println!("  admission decision       {}", spread(decisions, us));
    println!("  queue wait (admitted)    {}", spread(waits, ms));
    let of = |f: &dyn Fn(&Outcome) -> bool, pick: fn(&Outcome) -> Duration| -> Vec<Duration> {
        outcomes.iter().filter(|o| f(o)).map(pick).collect()
    };
    println!(
        "  200: first token         {}",
        spread(of(&|o| o.status == 200, |o| o.first_byte), ms)
    );
    println!(
        "  200: end to end          {}",
        spread(of(&|o| o.status == 200, |o| o.end_to_end), ms)
    );
    println!(
        "  429/413: answered in     {}",
        spread(of(&|o| matches!(o.status, 429 | 413), |o| o.end_to_end), ms)
    );
    println!(
        "  503: answered in         {}",
        spread(of(&|o| o.status == 503, |o| o.end_to_end), ms)
    );

    // ----- The scrape -----
    let scraped = scrape_metrics(gateway).await?;
    println!("GET /metrics (the bulkhead's non-zero series, sorted; summaries as _count and _sum)");
    let mut shown: Vec<&str> = scraped
        .lines()
        .filter(|l| {
            !l.starts_with('#')
                && (l.starts_with("llm_bulkhead_") || l.starts_with("gen_ai_"))
                && !l.contains("quantile=")
                && !l.ends_with(" 0")
        })
        .collect();
    shown.sort_unstable();
    for line in shown {
        println!("  {line}");
    }
    // The sum of a series' values over its label sets (those with `label`).
    let series_with = |name: &str, label: &str| -> u64 {
        scraped
            .lines()
            .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
            .filter(|l| l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };
    let series = |name: &str| series_with(name, "");

    // ----- Invariants -----
    let reasons = stats.rejected_by_reason;
    let checks: [(&str, bool); 11] = [
        (
            "every request got an answer",
            errors.is_empty() && outcomes.len() == total,
        ),
        ("only 200, 429, 413 and 503 answers", other == 0),
        (
            "200s == admissions == provider calls",
            ok == stats.admitted
                && ok == timing.admits.load(Ordering::Relaxed)
                && ok == book.calls.load(Ordering::Relaxed),
        ),
        (
            "refusals by code == the bulkhead's by reason",
            by_code(429, "queue_limit") == reasons.queue_limit
                && by_code(429, "concurrency_limit") == reasons.concurrency_limit
                && by_code(429, "budget_limit") + count(&|o| o.status == 413)
                    == reasons.budget_limit
                && by_code(503, "timeout") == reasons.timeout
                && ok + stats.rejected == total as u64,
        ),
        (
            "nothing in flight, nothing queued, no tokens held",
            stats.in_flight == 0
                && stats.pending == 0
                && tokens.in_flight_tokens == 0
                && stats.released == stats.admitted,
        ),
        (
            "every 200 streamed its usage and [DONE]",
            count(&|o| o.status == 200 && o.usage.is_some()) == ok
                && book.stated_calls.load(Ordering::Relaxed) == ok,
        ),
        (
            "consumed == the usage the provider stated == what the clients read",
            tokens.total_consumed == stated_in + stated_out
                && (seen_in, seen_out) == (stated_in, stated_out),
        ),
        (
            "reserved + overrun + reheld == consumed + refunded + returned unreported",
            tokens.total_reserved + tokens.total_overrun + tokens.total_reheld
                == tokens.total_consumed + tokens.total_refunded + tokens.total_returned_unreported,
        ),
        (
            "peaks within the limits",
            peaks.in_flight.load(Ordering::Relaxed) <= SLOTS as u64
                && peaks.tokens.load(Ordering::Relaxed) <= BUDGET
                && peaks.pending.load(Ordering::Relaxed) <= u64::from(MAX_QUEUE),
        ),
        ("the burst exceeded the limits", stats.rejected > 0),
        (
            "/metrics agrees with stats()",
            series("llm_bulkhead_admissions_total") == stats.admitted
                && series("llm_bulkhead_rejections_total") == stats.rejected
                && series("llm_bulkhead_tokens_consumed_total") == tokens.total_consumed
                && series("llm_bulkhead_in_flight_calls") == 0
                && series_with(
                    "llm_bulkhead_queue_wait_seconds_count",
                    "outcome=\"admitted\"",
                ) == timing.queue_waits.lock().unwrap().len() as u64
                && series_with(
                    "llm_bulkhead_queue_wait_seconds_count",
                    "outcome=\"timeout\"",
                ) == reasons.timeout,
        ),
    ];
    println!("invariants");
    for (what, holds) in &checks {
        println!("  [{}] {what}", if *holds { "ok" } else { "FAILED" });
    }
    for error in errors.iter().take(5) {
        println!("  transport error: {error}");
    }
    println!("done in {:.1} s", started.elapsed().as_secs_f64());
    if checks.iter().any(|(_, holds)| !holds) {
        return Err("an invariant does not hold".into());
    }
    Ok(())
}
