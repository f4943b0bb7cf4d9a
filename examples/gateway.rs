//! A real LLM gateway on loopback: an axum server whose one route forwards OpenAI
//! chat-completions requests to a provider with a hyper client, streaming the provider's
//! server-sent events back unchanged, behind `LlmLayer` (feature `tower`). The provider is a
//! mock embedded here (another axum server on 127.0.0.1) that streams tokens at a realistic
//! pace (a first token after 100-400 ms, then 60-200 tokens/s) and states the call's usage in
//! its last chunk; the layer reads that usage as the chunk passes and settles the call's
//! tokens with it when the stream ends.
//!
//! The gateway serves several tenants (the `x-api-key` header) within one global limit
//! (`LlmLayer::tenants_within`): each call must fit its tenant's limits *and* the global ones,
//! decided together, each level counting only what it decided. The tenants' limits are data:
//! `examples/tenants.json` (a `TenantPolicy`: limits for `acme`, `globex` and `initech`, a
//! default for every other key; `GATEWAY_POLICY=path` reads another file).
//!
//! A bounded load generator then fires a burst of streaming requests of mixed tenants, sizes,
//! `max_tokens` and priorities at the gateway, and a second wave spread over a few seconds,
//! reads every answer to its end, and prints what came back: how many were admitted, the
//! refusals by status, code and scope (the tenant's limits or the global ones), each tenant's
//! figures, the token accounting, the peaks against the limits, the global bulkhead's decision
//! time and the latencies. It ends by checking its invariants: every request was answered, the
//! 200s are exactly the admissions at both levels, each level's refusals are exactly what it
//! counted, nothing is left in flight, no tenant ever ran more than its policy allows, and the
//! tokens counted as consumed are exactly the usage the provider stated.
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
//! `metrics`, under `metrics-exporter-prometheus`'s recorder), outside the layer: the global
//! bulkhead's series labelled `scope="global"`, each tenant's registered when the tenant is
//! created (labelled `scope="tenant"` and its `tenant`, only the series that moved). The demo
//! scrapes it after the load, prints the series, and checks that the scrape agrees with
//! `stats()` at both levels.
//!
//! Run: `cargo run --release --example gateway --features tower,metrics` (about 12 s; loopback
//! only).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use std::collections::BTreeMap;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, Priority, Profile, TokenBudget,
    events::Event,
    events::EventKind,
    observability::BulkheadMetrics,
    rejection::Scope,
    tenants::{TenantPolicy, Tenants},
    tower::LlmLayer,
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
/// The tenants of the load, with their share of the requests (out of 20): the three the policy
/// names, and five trial keys it does not (the policy's default limits).
const TENANTS: [(&str, usize); 8] = [
    ("acme", 6),
    ("globex", 5),
    ("initech", 4),
    ("trial-1", 1),
    ("trial-2", 1),
    ("trial-3", 1),
    ("trial-4", 1),
    ("trial-5", 1),
];
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
    /// Each live tenant's, registered by the family's `on_created` hook and dropped by its
    /// `on_removed` hook.
    tenants: Arc<Mutex<BTreeMap<String, BulkheadMetrics>>>,
    prometheus: PrometheusHandle,
}

/// `GET /metrics`: publishes the bulkheads' counters and gauges from their stats, then
/// renders everything the recorder holds in Prometheus text.
async fn metrics_text(State(scrape): State<Arc<Scrape>>) -> String {
    scrape.metrics.publish();
    for metrics in scrape.tenants.lock().unwrap().values() {
        metrics.publish();
    }
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
    tenant: &'static str,
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
            let mut pick = rng.usize(0..20);
            let tenant = TENANTS
                .iter()
                .find(|(_, share)| {
                    let found = pick < *share;
                    pick = pick.saturating_sub(*share);
                    found
                })
                .map_or("acme", |(key, _)| key);
            Spec {
                tenant,
                high: rng.u8(0..5) == 0,
                body: body.to_string(),
                at,
            }
        })
        .collect()
}

/// What came back for one request.
struct Outcome {
    tenant: &'static str,
    high: bool,
    status: u16,
    /// The JSON error body's `code` and `scope` (`tenant` or `global`), for a refusal.
    code: Option<String>,
    scope: Option<String>,
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
    request = request.header("x-api-key", spec.tenant);
    let request = request
        .body(Full::new(Bytes::from(spec.body)))
        .expect("a valid request");
    live.sent.fetch_add(1, Ordering::Relaxed);
    let sent = Instant::now();
    let failed = |error: String| Outcome {
        tenant: spec.tenant,
        high: spec.high,
        status: 0,
        code: None,
        scope: None,
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
    let (code, scope, usage) = if status == 200 {
        (None, None, stream_usage(&bytes))
    } else {
        let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
        let text = |field: &str| json["error"][field].as_str().map(str::to_owned);
        (text("code"), text("scope"), None)
    };
    Outcome {
        tenant: spec.tenant,
        high: spec.high,
        status,
        code,
        scope,
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
    /// Each tenant's calls and tokens in flight at their highest.
    tenants: Mutex<BTreeMap<&'static str, (u64, u64)>>,
}

/// One tenant's figures in the summary: its key; the 200s and the tenant-scoped refusals its
/// clients saw; its bulkhead's admissions, refusals and tokens consumed; what it still holds
/// (calls, tokens); its peaks (calls, tokens); its limits.
type TenantRow = (
    &'static str,
    u64,
    u64,
    u64,
    u64,
    u64,
    u64,
    u64,
    (u64, u64),
    async_bulkhead_llm::Limits,
);

/// The tenants' limits: `examples/tenants.json`, or the file `GATEWAY_POLICY` names.
fn policy() -> Result<(String, TenantPolicy), Box<dyn std::error::Error>> {
    let path = std::env::var("GATEWAY_POLICY").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/examples/tenants.json").to_owned()
    });
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    let policy = serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
    Ok((path, policy))
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
    // Metrics: a Prometheus recorder for the process, the bulkheads' series registered with it.
    let recorder = PrometheusBuilder::new().build_recorder();
    let prometheus = recorder.handle();
    metrics::set_global_recorder(recorder)?;
    // The tenants: one bulkhead per key, made on first use, its limits from the policy file;
    // its metrics registered when it is created and dropped when it is evicted.
    let (policy_path, policy) = policy()?;
    let tenant_metrics = Arc::new(Mutex::new(BTreeMap::new()));
    let (created, removed) = (tenant_metrics.clone(), tenant_metrics.clone());
    let tenants = Tenants::builder(|key: &String| {
        // The policy replaces these limits at once; the budget's output cap stays.
        LlmBulkhead::builder(MODEL, 1)
            .token_budget(TokenBudget::new(1).output_cap(OUTPUT_CAP))
            .tenant(key.clone())
    })
    .policy(policy.clone())
    .on_created(move |key, tenant| {
        let metrics = BulkheadMetrics::builder(tenant, "tenants")
            .scope(Scope::Tenant)
            .label("tenant", key.clone())
            .skip_unmoved(true)
            .install();
        created.lock().unwrap().insert(key.clone(), metrics);
    })
    .on_removed(move |key, _| {
        removed.lock().unwrap().remove(key);
    })
    .build()?;
    let scrape = Arc::new(Scrape {
        metrics: BulkheadMetrics::builder(&bulkhead, "gateway")
            .provider("openai")
            .scope(Scope::Global)
            .install(),
        tenants: tenant_metrics,
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
    let layer = LlmLayer::tenants_within(bulkhead.clone(), tenants.clone(), |head| {
        head.headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("anonymous")
            .to_owned()
    })
    .options(|head| {
        let high = head.headers.get("x-priority").is_some_and(|v| v == "high");
        AcquireOptions::new().priority(if high {
            Priority::High
        } else {
            Priority::Normal
        })
    })
    .wait_in_queue(true)
    .expect("the global bulkhead has a queue");
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
        "  global   {SLOTS} slots, {BUDGET} tokens in flight ({HIGH_RESERVE} reserved for high \
         priority), queue {MAX_QUEUE} for {} s",
        QUEUE_TIMEOUT.as_secs_f64()
    );
    println!(
        "  tenants  x-api-key, each within the global limits; limits from {policy_path} \
         (revision {}):",
        policy.revision
    );
    let named = policy
        .tenants
        .iter()
        .map(|(key, limits)| (key.as_str(), limits))
        .chain([("(default)", &policy.default)]);
    for (key, limits) in named {
        let budget = limits.token_budget.map_or(0, |b| b.budget);
        println!(
            "           {key:<10} {:>2} slots, {budget:>5} tokens",
            limits.max_concurrent
        );
    }
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
        let tenants = tenants.clone();
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
                for (key, _) in TENANTS {
                    if let Some(own) = tenants.stats(key) {
                        let held = own.token_budget.map_or(0, |t| t.in_flight_tokens);
                        let mut by_tenant = peaks.tenants.lock().unwrap();
                        let peak = by_tenant.entry(key).or_default();
                        *peak = (peak.0.max(own.in_flight), peak.1.max(held));
                    }
                }
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
    let busy = || {
        bulkhead.stats().in_flight > 0
            || TENANTS
                .iter()
                .any(|(key, _)| tenants.stats(*key).is_some_and(|s| s.in_flight > 0))
    };
    while busy() && settle.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.store(true, Ordering::Release);
    sampler.await?;

    // ----- Summary -----
    let stats = bulkhead.stats();
    let tokens = stats.token_budget.expect("a token budget");
    let count = |f: &dyn Fn(&Outcome) -> bool| outcomes.iter().filter(|o| f(o)).count() as u64;
    let ok = count(&|o| o.status == 200);
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
    let by = |status: u16, code: &str, scope: &str| {
        count(&|o| {
            o.status == status
                && o.code.as_deref() == Some(code)
                && o.scope.as_deref() == Some(scope)
        })
    };
    let lines: [(u16, &str, &str, &str); 7] = [
        (
            429,
            "concurrency_limit",
            "tenant",
            "the tenant's own calls at its limit",
        ),
        (
            429,
            "budget_limit",
            "tenant",
            "the tenant's own tokens in flight",
        ),
        (
            413,
            "budget_limit",
            "tenant",
            "more tokens than the tenant's whole budget",
        ),
        (
            429,
            "queue_limit",
            "global",
            "32 callers already waiting: refused at once",
        ),
        (
            429,
            "budget_limit",
            "global",
            "did not fit the global tokens in flight",
        ),
        (
            429,
            "concurrency_limit",
            "global",
            "no global slot and no queue",
        ),
        (503, "timeout", "global", "waited 1.5 s in the global queue"),
    ];
    for (status, code, scope, why) in lines {
        println!(
            "  {status} {code:<17} {scope:<6} {:>4}   ({why})",
            by(status, code, scope)
        );
    }
    let unscoped = count(&|o| o.error.is_none() && o.status != 200 && o.scope.is_none());
    println!(
        "  other statuses             {other:>4}   transport errors {:>4}   refusals without a scope {unscoped}",
        errors.len()
    );

    // Each tenant, as its own bulkhead counted it and as its clients saw it.
    println!("tenants (limits from the policy; the trial keys have the default)");
    println!(
        "  {:<10} {:>5} {:>6} {:>5} {:>4} {:>11} {:>11} {:>9} {:>9} {:>9}",
        "tenant",
        "slots",
        "tokens",
        "sent",
        "200",
        "429 tenant",
        "refused ↑",
        "admitted",
        "peak",
        "consumed"
    );
    let peak_of = peaks.tenants.lock().unwrap().clone();
    let mut tenant_figures: Vec<TenantRow> = Vec::new();
    for (key, _) in TENANTS {
        let sent = count(&|o| o.tenant == key);
        let own = tenants.stats(key);
        let limits = policy.limits_for(key);
        let (admitted, rejected, consumed, in_flight, held) = own.map_or((0, 0, 0, 0, 0), |s| {
            let t = s.token_budget.expect("a budget");
            (
                s.admitted,
                s.rejected,
                t.total_consumed,
                s.in_flight,
                t.in_flight_tokens,
            )
        });
        let ok = count(&|o| o.tenant == key && o.status == 200);
        let own_refusals = count(&|o| o.tenant == key && o.scope.as_deref() == Some("tenant"));
        let global_refusals = count(&|o| o.tenant == key && o.scope.as_deref() == Some("global"));
        let peak = peak_of.get(key).copied().unwrap_or_default();
        let budget = limits.token_budget.map_or(0, |b| b.budget);
        println!(
            "  {key:<10} {:>5} {budget:>6} {sent:>5} {ok:>4} {own_refusals:>11} {global_refusals:>11} {admitted:>9} {:>9} {consumed:>9}",
            limits.max_concurrent,
            format!("{}/{}", peak.0, limits.max_concurrent),
        );
        tenant_figures.push((
            key,
            ok,
            own_refusals,
            admitted,
            rejected,
            consumed,
            in_flight,
            held,
            peak,
            limits,
        ));
    }
    println!(
        "  (refused ↑: by the global limits; counted by the global bulkhead, not the tenant's)"
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
    println!(
        "GET /metrics (non-zero series, sorted; summaries as _count and _sum): the global \
         bulkhead's, and one tenant's"
    );
    let moved: Vec<&str> = scraped
        .lines()
        .filter(|l| {
            !l.starts_with('#')
                && (l.starts_with("llm_bulkhead_") || l.starts_with("gen_ai_"))
                && !l.contains("quantile=")
                && !l.ends_with(" 0")
        })
        .collect();
    let (mut shown, others): (Vec<&str>, Vec<&str>) = moved
        .iter()
        .partition(|l| l.contains("scope=\"global\"") || l.contains("tenant=\"initech\""));
    shown.sort_unstable();
    for line in shown {
        println!("  {line}");
    }
    println!(
        "  ... and {} series of the other tenants (registered as each was created, only those \
         that moved)",
        others.len()
    );
    // The sum of a series' values over its label sets (those with `label`).
    let series_with = |name: &str, label: &str| -> u64 {
        scraped
            .lines()
            .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
            .filter(|l| l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };

    // ----- Invariants -----
    let reasons = stats.rejected_by_reason;
    let sum = |pick: fn(&TenantRow) -> u64| tenant_figures.iter().map(pick).sum::<u64>();
    let global_by = |status: u16, code: &str| by(status, code, "global");
    let checks: [(&str, bool); 13] = [
        (
            "every request got an answer",
            errors.is_empty() && outcomes.len() == total,
        ),
        ("only 200, 429, 413 and 503 answers", other == 0),
        (
            "200s == admissions at both levels == provider calls",
            ok == stats.admitted
                && ok == sum(|t| t.3)
                && ok == timing.admits.load(Ordering::Relaxed)
                && ok == book.calls.load(Ordering::Relaxed),
        ),
        (
            "every refusal names its scope; each level counted exactly its own",
            unscoped == 0
                && global_by(429, "queue_limit") == reasons.queue_limit
                && global_by(429, "concurrency_limit") == reasons.concurrency_limit
                && global_by(429, "budget_limit") + global_by(413, "budget_limit")
                    == reasons.budget_limit
                && global_by(503, "timeout") == reasons.timeout
                && tenant_figures.iter().all(|t| t.2 == t.4)
                && ok + stats.rejected + sum(|t| t.4) == total as u64,
        ),
        (
            "per tenant: its 200s == its admissions",
            tenant_figures.iter().all(|t| t.1 == t.3),
        ),
        (
            "nothing in flight, nothing queued, no tokens held, at either level",
            stats.in_flight == 0
                && stats.pending == 0
                && tokens.in_flight_tokens == 0
                && stats.released == stats.admitted
                && tenant_figures.iter().all(|t| t.6 == 0 && t.7 == 0),
        ),
        (
            "every 200 streamed its usage and [DONE]",
            count(&|o| o.status == 200 && o.usage.is_some()) == ok
                && book.stated_calls.load(Ordering::Relaxed) == ok,
        ),
        (
            "consumed == the usage the provider stated == what the clients read, at both levels",
            tokens.total_consumed == stated_in + stated_out
                && sum(|t| t.5) == stated_in + stated_out
                && (seen_in, seen_out) == (stated_in, stated_out),
        ),
        (
            "reserved + overrun + reheld == consumed + refunded + returned unreported",
            tokens.total_reserved + tokens.total_overrun + tokens.total_reheld
                == tokens.total_consumed + tokens.total_refunded + tokens.total_returned_unreported,
        ),
        (
            "peaks within the limits: global, and every tenant's own",
            peaks.in_flight.load(Ordering::Relaxed) <= SLOTS as u64
                && peaks.tokens.load(Ordering::Relaxed) <= BUDGET
                && peaks.pending.load(Ordering::Relaxed) <= u64::from(MAX_QUEUE)
                && tenant_figures.iter().all(|t| {
                    t.8.0 <= u64::from(t.9.max_concurrent)
                        && t.8.1 <= t.9.token_budget.map_or(0, |b| b.budget)
                }),
        ),
        (
            "the load exceeded both kinds of limits",
            stats.rejected > 0 && sum(|t| t.4) > 0,
        ),
        (
            "/metrics agrees with stats() at both levels",
            series_with("llm_bulkhead_admissions_total", "scope=\"global\"") == stats.admitted
                && series_with("llm_bulkhead_rejections_total", "scope=\"global\"")
                    == stats.rejected
                && series_with("llm_bulkhead_admissions_total", "scope=\"tenant\"") == sum(|t| t.3)
                && series_with("llm_bulkhead_rejections_total", "scope=\"tenant\"") == sum(|t| t.4)
                && series_with("llm_bulkhead_tokens_consumed_total", "scope=\"global\"")
                    == tokens.total_consumed
                && series_with("llm_bulkhead_in_flight_calls", "scope=\"global\"") == 0
                && series_with(
                    "llm_bulkhead_queue_wait_seconds_count",
                    "outcome=\"admitted\"",
                ) == timing.queue_waits.lock().unwrap().len() as u64
                && series_with(
                    "llm_bulkhead_queue_wait_seconds_count",
                    "outcome=\"timeout\"",
                ) == reasons.timeout,
        ),
        (
            "every tenant's series carries its tenant label",
            tenant_figures.iter().filter(|t| t.3 > 0).all(|t| {
                series_with(
                    "llm_bulkhead_admissions_total",
                    &format!("tenant=\"{}\"", t.0),
                ) == t.3
            }),
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
