//! The tower layer for HTTP gateways (feature `tower`): [`LlmLayer`](crate::tower::LlmLayer) admits each request
//! through an [`LlmBulkhead`] before the inner service sees it, answers a refusal itself (429,
//! 413, 503 or 400 with the provider-shaped JSON body of [`HttpRefusal`](crate::http::HttpRefusal); 500 if a tenant's
//! bulkhead cannot be built; `Retry-After` only with [`LlmLayer::retry_after_hint`](crate::tower::LlmLayer::retry_after_hint)), and
//! wraps the
//! response body in an [`LlmBody`](crate::tower::LlmBody) that holds the call's [`OwnedPermit`] until the body ends,
//! fails or is dropped (a client that disconnects mid-stream releases at once). As chunks pass
//! it reads the provider's usage from them and reports it, so the token budget follows the
//! stream; the chunks themselves are passed on as they come, neither copied nor delayed.
//!
//! Works with any tower stack over `http` 1 types: axum 0.8 routers, hyper 1 services. Every
//! request through the layer is read as an LLM call: in axum, put it on the completion routes
//! with `route_layer` (with `Router::layer`, other routes and the fallback are answered 400).

use core::fmt;
use core::future::Future;
use core::pin::Pin;
use core::task::{Context, Poll};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::HeaderValue;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full, Limited};

use crate::engine::rate::RateStatus;
use crate::http::HttpRefusal;
use crate::llm::bulkhead::LlmBulkhead;
use crate::llm::learn::{LimitLearner, ProviderLimits};
use crate::llm::options::AcquireOptions;
use crate::llm::permit::OwnedPermit;
use crate::llm::request::LlmRequest;
use crate::llm::tenants::{Tenants, TenantsError};
use crate::llm::within::TenantPermit;
use crate::vocabulary::error::AcquireError;
use crate::vocabulary::rejection::{CapacityDetail, Rejection, Scope};
use crate::vocabulary::reservation::TokenUsage;

use super::body::{self, HeldBody};
use super::error::{BoxError, LayerError};
use super::grace::{self, Disconnect};
use super::hold_times::HoldTimes;
use super::usage::{MAX_JSON_RESPONSE, Reader, json_response_usage, provider_usage};

/// Turns an HTTP request (its head and its whole body) into what the bulkhead sizes.
type ToRequest = dyn Fn(&http::request::Parts, &Bytes) -> Result<LlmRequest, String> + Send + Sync;
/// Picks a request's options (priority, reservation, class) from its head.
type ToOptions = dyn Fn(&http::request::Parts) -> AcquireOptions + Send + Sync;
/// Reads a cumulative usage from one JSON document of the response (an SSE event's data, or
/// the whole body of a JSON response).
type ToUsage = dyn Fn(&serde_json::Value) -> Option<TokenUsage> + Send + Sync;

/// Request bodies larger than this are refused with 413 before anything is admitted (the
/// default of [`LlmLayer::max_request_body`](crate::tower::LlmLayer::max_request_body)).
pub const DEFAULT_MAX_REQUEST_BODY: usize = 4 << 20;

/// A tower layer that admits each HTTP request through an [`LlmBulkhead`] before the inner
/// service sees it. The request's body is read whole and parsed as an OpenAI chat-completions
/// or Anthropic messages body (or by [`request`](LlmLayer::request)) to size its reservation;
/// a refusal is answered by the layer itself (429, 413, 503 or 400, the JSON body of
/// [`HttpRefusal`](crate::http::HttpRefusal), no `Retry-After`); an admitted call's response body becomes an [`LlmBody`](crate::tower::LlmBody)
/// that holds the permit until the body ends, fails or is dropped, and reports the usage the
/// provider states as the chunks pass.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, tower::LlmLayer, Priority};
/// use bytes::Bytes;
/// use http_body_util::{BodyExt, Full};
/// use tower::{Layer, ServiceExt};
///
/// # ::futures::executor::block_on(async {
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 1).build()?;
/// let layer = LlmLayer::new(bulkhead.clone())
///     // Requests marked interactive get the high-priority reserve.
///     .options(|head| {
///         let high = head.headers.get("x-priority").is_some_and(|v| v == "high");
///         AcquireOptions::new().priority(if high { Priority::High } else { Priority::Normal })
///     });
/// // The provider (here a stub; in a gateway an axum router or a proxy client).
/// let provider = tower::service_fn(|_request: http::Request<Full<Bytes>>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from("{}"))))
/// });
/// let gateway = layer.layer(provider);
/// let request = || {
///     http::Request::post("/v1/chat/completions")
///         .body(Full::new(Bytes::from(r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#)))
///         .unwrap()
/// };
/// let held = bulkhead.try_acquire(&async_bulkhead_llm::LlmRequest::new(), AcquireOptions::new())?;
/// let refused = gateway.clone().oneshot(request()).await?;
/// assert_eq!(refused.status(), 429); // the one slot is taken
/// drop(held);
/// let response = gateway.oneshot(request()).await?;
/// assert_eq!(response.status(), 200);
/// assert_eq!(bulkhead.stats().in_flight, 1); // held by the body until it ends
/// let body = response.into_body().collect().await.map_err(|e| e.to_string())?;
/// assert_eq!(body.to_bytes(), "{}");
/// assert_eq!(bulkhead.stats().in_flight, 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct LlmLayer {
    config: Arc<Config>,
}

/// Which bulkhead admits a request.
type ToBulkhead = dyn Fn(&http::request::Parts) -> Result<LlmBulkhead, TenantsError> + Send + Sync;

#[derive(Clone)]
struct Config {
    bulkhead: Arc<ToBulkhead>,
    /// The one bulkhead of a layer made by [`LlmLayer::new`](crate::tower::LlmLayer::new) (`None` per tenant).
    single: Option<LlmBulkhead>,
    /// The global bulkhead every tenant is admitted within, for a layer made by
    /// [`LlmLayer::tenants_within`](crate::tower::LlmLayer::tenants_within).
    global: Option<LlmBulkhead>,
    request: Arc<ToRequest>,
    options: Arc<ToOptions>,
    /// The reader of [`LlmLayer::usage`](crate::tower::LlmLayer::usage); `None`: [`provider_usage`](crate::tower::provider_usage), which lets a JSON
    /// response be read for its usage members alone (see [`json_response_usage`]).
    usage: Option<Arc<ToUsage>>,
    wait: bool,
    max_body: usize,
    /// With `retry_after_hint` or `rate_limit_headers`: the recent hold time of released calls.
    holds: Option<Arc<HoldTimes>>,
    /// `Retry-After` on capacity refusals.
    retry_after: bool,
    /// `RateLimit-*` and `x-ratelimit-*` headers on admitted calls' responses and on 429s.
    rate_limit_headers: bool,
    /// Whether refusals show the bulkhead's figures (else the reason alone).
    expose_capacity: bool,
    /// Reshapes the layer's answer to a refusal.
    on_refusal: Option<Arc<OnRefusal>>,
    /// What a client gone mid-response does to its call's permit.
    disconnect: Disconnect,
    /// Learns the rate windows from the provider's answers.
    learner: Option<Arc<LimitLearner>>,
}

impl Config {
    /// Keeps the hold times while a feature reads them (`Retry-After`, `RateLimit-Reset`),
    /// and drops them when none does.
    fn keep_hold_times(&mut self) {
        let measured = matches!(self.disconnect, Disconnect::Measured { .. });
        if !(self.retry_after || self.rate_limit_headers || measured) {
            self.holds = None;
        } else if self.holds.is_none() {
            self.holds = Some(Arc::default());
        }
    }
}

/// Reshapes the layer's answer to a refusal (status, headers, body).
type OnRefusal = dyn Fn(&AcquireError, &mut Response<Bytes>) + Send + Sync;

impl LlmLayer {
    /// A layer admitting through `bulkhead`: requests parsed as OpenAI chat-completions or
    /// Anthropic messages JSON, default options, waiting in the bulkhead's queue if it has one
    /// (`max_queue` above 0 now; else refused at once, see
    /// [`wait_in_queue`](LlmLayer::wait_in_queue)), bodies up to 4 MiB, usage read from
    /// OpenAI and Anthropic responses (as [`BulkheadLayer::new`](crate::tower::BulkheadLayer::new)).
    pub fn new(bulkhead: LlmBulkhead) -> LlmLayer {
        let single = Some(bulkhead.clone());
        let mut layer = LlmLayer::with_source(Arc::new(move |_| Ok(bulkhead.clone())), None);
        let config = layer.config();
        config.wait = single.as_ref().is_some_and(|b| b.limits().max_queue > 0);
        config.single = single;
        layer
    }

    /// A layer admitting each request through its tenant's bulkhead: `key` names the tenant
    /// from the request's head (an API key header, a path segment), [`Tenants::get`](crate::tenants::Tenants::get) makes the
    /// bulkhead on first use from its template. A request whose tenant cannot be made (the
    /// family is full of busy tenants) is answered 429 `too_many_tenants`; one whose template
    /// is refused, 500. Refusals show the tenant's own figures (its scope: see
    /// [`expose_capacity`](LlmLayer::expose_capacity)).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, tower::LlmLayer, tenants::Tenants};
    ///
    /// let tenants = Tenants::builder(|_tenant: &String| LlmBulkhead::builder("gpt-4o", 4)).build()?;
    /// let layer = LlmLayer::per_tenant(tenants, |head| {
    ///     head.headers
    ///         .get("x-api-key")
    ///         .and_then(|v| v.to_str().ok())
    ///         .unwrap_or("anonymous")
    ///         .to_owned()
    /// });
    /// # let _ = layer;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn per_tenant<K>(
        tenants: Tenants<K>,
        key: impl Fn(&http::request::Parts) -> K + Send + Sync + 'static,
    ) -> LlmLayer
    where
        K: Eq + core::hash::Hash + Clone + Send + Sync + 'static,
    {
        let mut layer = LlmLayer::with_source(Arc::new(move |head| tenants.get(&key(head))), None);
        layer.config().expose_capacity = true;
        layer
    }

    /// A layer admitting each request through its tenant's bulkhead *and* `global` together
    /// ([`LlmBulkhead::try_acquire_within`](crate::LlmBulkhead::try_acquire_within)): the
    /// body parsed and sized once, the call admitted only when it fits both, each level
    /// counting only what it decided. `key` names the tenant from the request's head, as for
    /// [`per_tenant`](LlmLayer::per_tenant). The refusal's JSON names its level
    /// (`"scope":"tenant"` or `"global"`); a tenant's refusal shows the tenant's own figures, a
    /// global one only its reason (unless [`expose_capacity`](LlmLayer::expose_capacity)). It
    /// waits in the global bulkhead's queue when that has one (the tenant level never queues).
    /// The rate-limit headers, when on, show the tenant's figures.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, tower::LlmLayer, tenants::Tenants};
    /// use bytes::Bytes;
    /// use http_body_util::{BodyExt, Full};
    /// use tower::{Layer, ServiceExt};
    ///
    /// # ::futures::executor::block_on(async {
    /// let global = LlmBulkhead::builder("gpt-4o", 1).build()?;
    /// let tenants = Tenants::builder(|_: &String| LlmBulkhead::builder("gpt-4o", 4)).build()?;
    /// let gateway = LlmLayer::tenants_within(global.clone(), tenants.clone(), |head| {
    ///     head.headers["x-api-key"].to_str().unwrap_or("").to_owned()
    /// })
    /// .layer(tower::service_fn(|_: http::Request<Full<Bytes>>| async {
    ///     Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::new())))
    /// }));
    /// let call = |key: &str| {
    ///     http::Request::post("/v1/chat/completions")
    ///         .header("x-api-key", key)
    ///         .body(Full::new(Bytes::from(r#"{"messages":[]}"#)))
    ///         .unwrap()
    /// };
    /// let first = gateway.clone().oneshot(call("acme")).await?; // holds the global slot
    /// let refused = gateway.oneshot(call("globex")).await?;
    /// assert_eq!(refused.status(), 429);
    /// let body = refused.into_body().collect().await.unwrap().to_bytes();
    /// assert!(body.starts_with(br#"{"error":{"type":"rate_limit_error","code":"concurrency_limit","scope":"global""#));
    /// assert_eq!(tenants.stats("globex").unwrap().admitted, 0); // counted nowhere but globally
    /// assert_eq!(global.stats().rejected, 1);
    /// # drop(first);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn tenants_within<K>(
        global: LlmBulkhead,
        tenants: Tenants<K>,
        key: impl Fn(&http::request::Parts) -> K + Send + Sync + 'static,
    ) -> LlmLayer
    where
        K: Eq + core::hash::Hash + Clone + Send + Sync + 'static,
    {
        let mut layer = LlmLayer::with_source(Arc::new(move |head| tenants.get(&key(head))), None);
        let config = layer.config();
        config.wait = global.limits().max_queue > 0;
        config.global = Some(global);
        layer
    }

    fn with_source(bulkhead: Arc<ToBulkhead>, single: Option<LlmBulkhead>) -> LlmLayer {
        LlmLayer {
            config: Arc::new(Config {
                bulkhead,
                single,
                global: None,
                holds: None,
                request: Arc::new(|_, body: &Bytes| {
                    serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))
                }),
                options: Arc::new(|_| AcquireOptions::new()),
                usage: None,
                wait: false,
                max_body: DEFAULT_MAX_REQUEST_BODY,
                retry_after: false,
                rate_limit_headers: false,
                expose_capacity: false,
                on_refusal: None,
                disconnect: Disconnect::Release,
                learner: None,
            }),
        }
    }

    /// The configuration to change (copied first if a clone of the layer shares it, so a
    /// clone keeps what it had).
    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// Builds the [`LlmRequest`] from the request's head and body instead of parsing the body
    /// as provider JSON; an `Err` is answered with 400 and that message.
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn request(
        mut self,
        f: impl Fn(&http::request::Parts, &Bytes) -> Result<LlmRequest, String> + Send + Sync + 'static,
    ) -> LlmLayer {
        self.config().request = Arc::new(f);
        self
    }

    /// Takes each request's options (priority, reservation, admission class) from its head.
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn options(
        mut self,
        f: impl Fn(&http::request::Parts) -> AcquireOptions + Send + Sync + 'static,
    ) -> LlmLayer {
        self.config().options = Arc::new(f);
        self
    }

    /// Reads usage with `f` instead of the OpenAI / Anthropic shapes: it gets every JSON
    /// document of the response (each SSE event's data that states `"usage":` with a value
    /// other than `null`, or a JSON response's whole body) and returns the call's cumulative
    /// usage, if it says one.
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn usage(
        mut self,
        f: impl Fn(&serde_json::Value) -> Option<TokenUsage> + Send + Sync + 'static,
    ) -> LlmLayer {
        self.config().usage = Some(Arc::new(f));
        self
    }

    /// Whether a request waits in the bulkhead's queue (`acquire`) rather than being refused
    /// at once when no slot is free (`try_acquire`). The default: wait when the layer's
    /// bulkhead has a queue; a [`per_tenant`](LlmLayer::per_tenant) layer fails fast until
    /// told to wait.
    ///
    /// # Errors
    ///
    /// [`LayerError::NoQueue`](crate::tower::LayerError::NoQueue) (the layer unchanged) when `wait` is asked of a layer whose
    /// bulkhead has no queue (`max_queue` 0 now): its requests could only be refused at once,
    /// as without waiting. Give the bulkhead a queue ([`max_queue`], or a profile with one)
    /// first. A layer made by [`per_tenant`](LlmLayer::per_tenant) cannot see its tenants'
    /// bulkheads before they exist: their template must give them a queue.
    ///
    /// [`max_queue`]: crate::LlmBulkheadBuilder::max_queue
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{tower::LayerError, LlmBulkhead, tower::LlmLayer};
    ///
    /// let queued = LlmBulkhead::builder("gpt-4o", 4).max_queue(16).build()?;
    /// let layer = LlmLayer::new(queued).wait_in_queue(true)?;
    /// # let _ = layer;
    /// let fail_fast = LlmBulkhead::builder("gpt-4o", 4).build()?; // no queue
    /// let err = LlmLayer::new(fail_fast).wait_in_queue(true).unwrap_err();
    /// assert_eq!(err, LayerError::NoQueue);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn wait_in_queue(mut self, wait: bool) -> Result<LlmLayer, LayerError> {
        if wait
            && self
                .config
                .single
                .as_ref()
                .or(self.config.global.as_ref())
                .is_some_and(|b| b.limits().max_queue == 0)
        {
            return Err(LayerError::NoQueue);
        }
        self.config().wait = wait;
        Ok(self)
    }

    /// Adds a `Retry-After` header to capacity refusals (429): an *estimate* of when capacity
    /// frees up, the recent average time the layer's admitted calls held their permit
    /// (rounded up to whole seconds, at least 1; none until a call was released). Off by
    /// default: a fail-fast bulkhead has no honest ETA, only this history, and clients that
    /// all retry after the same hint come back together. The history is the layer's: with
    /// [`per_tenant`](LlmLayer::per_tenant) it mixes every tenant's calls.
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn retry_after_hint(mut self, on: bool) -> LlmLayer {
        let config = self.config();
        config.retry_after = on;
        config.keep_hold_times();
        self
    }

    /// Adds rate-limit headers to admitted calls' responses and to capacity refusals (429),
    /// the figures of the bulkhead that decided (with [`per_tenant`](LlmLayer::per_tenant),
    /// the tenant's): `RateLimit-Limit` (`max_concurrent`), `RateLimit-Remaining` (slots free),
    /// `RateLimit-Reset` (seconds: the recent average hold time, at least 1, 1 until a call was
    /// released), and the names OpenAI's client libraries read, `x-ratelimit-limit-requests`,
    /// `x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests` (`"<n>s"`), with a token
    /// budget `x-ratelimit-limit-tokens` (the budget a normal-priority call may use),
    /// `x-ratelimit-remaining-tokens`, `x-ratelimit-reset-tokens`. Off by default: a gateway in
    /// front of several clients shows them its capacity only if it chooses to. An admitted
    /// call's figures are read once after its admission (one read of the word and the limits).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{LlmBulkhead, tower::LlmLayer};
    /// use bytes::Bytes;
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt};
    ///
    /// # ::futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("gpt-4o", 4).build()?;
    /// let gateway = LlmLayer::new(bulkhead).rate_limit_headers(true).layer(tower::service_fn(
    ///     |_: http::Request<Full<Bytes>>| async {
    ///         Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from("{}"))))
    ///     },
    /// ));
    /// let request = http::Request::post("/v1/chat/completions")
    ///     .body(Full::new(Bytes::from(r#"{"model":"gpt-4o","messages":[]}"#)))?;
    /// let response = gateway.oneshot(request).await?;
    /// assert_eq!(response.headers()["ratelimit-limit"], "4");
    /// assert_eq!(response.headers()["ratelimit-remaining"], "3"); // this call holds one
    /// assert_eq!(response.headers()["x-ratelimit-remaining-requests"], "3");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn rate_limit_headers(mut self, on: bool) -> LlmLayer {
        let config = self.config();
        config.rate_limit_headers = on;
        config.keep_hold_times();
        self
    }

    /// Whether a refusal's answer shows the figures of the bulkhead that refused (calls and
    /// tokens in flight, the limits, the queue: the `detail` of the JSON body, and the
    /// message's figures) or only its reason. Default: hidden for [`new`](LlmLayer::new),
    /// whose bulkhead is the gateway's whole capacity, shown for
    /// [`per_tenant`](LlmLayer::per_tenant), whose bulkhead is the client's own.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, tower::{LlmBody, LlmLayer}};
    /// use bytes::Bytes;
    /// use http_body_util::{BodyExt, Full};
    /// use tower::{Layer, ServiceExt};
    ///
    /// # ::futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("gpt-4o", 1).build()?;
    /// let provider = tower::service_fn(|_: http::Request<Full<Bytes>>| async {
    ///     Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::new())))
    /// });
    /// let hidden = LlmLayer::new(bulkhead.clone()).layer(provider.clone());
    /// let shown = LlmLayer::new(bulkhead.clone()).expose_capacity(true).layer(provider);
    /// let _held = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// let request = || http::Request::post("/").body(Full::new(Bytes::from(r#"{"messages":[]}"#)));
    /// async fn text(r: http::Response<LlmBody<Full<Bytes>>>) -> String {
    ///     let bytes = r.into_body().collect().await.unwrap().to_bytes();
    ///     String::from_utf8(bytes.to_vec()).unwrap()
    /// }
    /// let hidden = text(hidden.oneshot(request()?).await?).await;
    /// assert!(!hidden.contains("detail") && hidden.contains("concurrency_limit"));
    /// let shown = text(shown.oneshot(request()?).await?).await;
    /// assert!(shown.contains(r#""detail":{"#) && shown.contains("1 of 1 slots"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn expose_capacity(mut self, on: bool) -> LlmLayer {
        self.config().expose_capacity = on;
        self
    }

    /// Reshapes the layer's answer to every refusal by the bulkhead: `hook` gets the refusal
    /// and the answer the layer made (status, headers with `Retry-After` and rate-limit headers
    /// when on, the JSON body), and may change any of it: a body in your API's own error
    /// shape, headers of your own. The layer's other answers (400, 413 for a body over
    /// [`max_request_body`](LlmLayer::max_request_body), `too_many_tenants`) are not passed.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, tower::LlmLayer};
    /// use bytes::Bytes;
    /// use http_body_util::{BodyExt, Full};
    /// use tower::{Layer, ServiceExt};
    ///
    /// # ::futures::executor::block_on(async {
    /// let bulkhead = LlmBulkhead::builder("gpt-4o", 1).build()?;
    /// let gateway = LlmLayer::new(bulkhead.clone())
    ///     .on_refusal(|refused, answer| {
    ///         let code = refused.rejection().map_or("invalid", |r| r.reason().as_str());
    ///         *answer.body_mut() = Bytes::from(format!(r#"{{"busy":"{code}"}}"#));
    ///         answer.headers_mut().insert("x-gateway", http::HeaderValue::from_static("a"));
    ///     })
    ///     .layer(tower::service_fn(|_: http::Request<Full<Bytes>>| async {
    ///         Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::new())))
    ///     }));
    /// let _held = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// let request = http::Request::post("/").body(Full::new(Bytes::from(r#"{"messages":[]}"#)))?;
    /// let answer = gateway.oneshot(request).await?;
    /// assert_eq!(answer.status(), 429);
    /// assert_eq!(answer.headers()["x-gateway"], "a");
    /// let body = answer.into_body().collect().await.unwrap().to_bytes();
    /// assert_eq!(body, r#"{"busy":"concurrency_limit"}"#);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn on_refusal(
        mut self,
        hook: impl Fn(&AcquireError, &mut Response<Bytes>) + Send + Sync + 'static,
    ) -> LlmLayer {
        self.config().on_refusal = Some(Arc::new(hook));
        self
    }

    /// What to do with an admitted call whose client goes away before its response ended
    /// (the response body dropped mid-stream): release at once (the default), or keep the
    /// permit a while, since the provider may still be generating (see [`Disconnect`]). A
    /// call whose response ended or failed is released at once whatever this says.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::{LlmBulkhead, tower::{Disconnect, LlmLayer}};
    ///
    /// let bulkhead = LlmBulkhead::builder("gpt-4o", 32).build()?;
    /// let layer = LlmLayer::new(bulkhead).on_disconnect(Disconnect::Hold(Duration::from_secs(2)));
    /// # let _ = layer;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn on_disconnect(mut self, disconnect: Disconnect) -> LlmLayer {
        let config = self.config();
        config.disconnect = disconnect;
        config.keep_hold_times();
        self
    }

    /// Adapts the rate windows to what the provider says: every answer of the inner service
    /// (its status and its rate-limit headers, read by [`provider_limits`]) goes to `learner`
    /// (see [`LimitLearner`](crate::rate::LimitLearner)), which follows the provider's stated
    /// limits, lowers the windows on a 429 or 529 and raises them slowly while calls succeed.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use async_bulkhead_llm::{LlmBulkhead, TokenBudget, tower::LlmLayer};
    /// use async_bulkhead_llm::rate::{LearnBounds, LimitLearner, RateLimits};
    ///
    /// let bulkhead = LlmBulkhead::builder("gpt-4o", 64)
    ///     .token_budget(TokenBudget::new(1_000_000))
    ///     .rate_limits(RateLimits::per_minute().tokens(100_000))
    ///     .build()?;
    /// let learner = LimitLearner::new(bulkhead.clone()).tokens(LearnBounds::new(10_000, 2_000_000));
    /// let layer = LlmLayer::new(bulkhead).learn_limits(Arc::new(learner));
    /// # let _ = layer;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn learn_limits(mut self, learner: Arc<LimitLearner>) -> LlmLayer {
        self.config().learner = Some(learner);
        self
    }

    /// Refuses request bodies larger than `bytes` with 413 (default 4 MiB).
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn max_request_body(mut self, bytes: usize) -> LlmLayer {
        self.config().max_body = bytes;
        self
    }
}

impl fmt::Debug for LlmLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlmLayer")
            .field("wait_in_queue", &self.config.wait)
            .field("max_request_body", &self.config.max_body)
            .finish_non_exhaustive()
    }
}

impl<S> tower_layer::Layer<S> for LlmLayer {
    type Service = LlmService<S>;

    fn layer(&self, inner: S) -> LlmService<S> {
        LlmService {
            inner,
            config: Arc::clone(&self.config),
        }
    }
}

/// The service [`LlmLayer`](crate::tower::LlmLayer) makes. Its inner service receives the request with its body read
/// whole (a [`Full`] body: it had to be parsed to be sized).
///
/// `poll_ready` is the inner service's: the bulkhead decides per request (its decision needs
/// the request), in `call`, and never makes `poll_ready` wait; the ready service is the one
/// called (a clone takes its place). So an inner service that reserves capacity when it is
/// ready (tower's `ConcurrencyLimit`, `Buffer`) keeps that reservation while the request's
/// body is read and, with [`LlmLayer::wait_in_queue`](crate::tower::LlmLayer::wait_in_queue), while it waits in the bulkhead's queue:
/// put such layers inside this one only knowingly.
#[derive(Clone)]
pub struct LlmService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> fmt::Debug for LlmService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlmService")
            .field("wait_in_queue", &self.config.wait)
            .finish_non_exhaustive()
    }
}

impl<S, B, R> tower_service::Service<Request<B>> for LlmService<S>
where
    S: tower_service::Service<Request<Full<Bytes>>, Response = Response<R>>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    R: Body<Data = Bytes> + Send + 'static,
    R::Error: Into<BoxError>,
{
    type Response = Response<LlmBody<R>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The service polled ready is the one that serves this request.
        let clone = self.inner.clone();
        let mut inner = core::mem::replace(&mut self.inner, clone);
        let config = Arc::clone(&self.config);
        Box::pin(async move {
            let (head, body) = request.into_parts();
            let bytes = match Limited::new(body, config.max_body).collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(error) => {
                    let too_large = error
                        .downcast_ref::<http_body_util::LengthLimitError>()
                        .is_some();
                    return Ok(if too_large {
                        plain_error(
                            StatusCode::PAYLOAD_TOO_LARGE,
                            "request_too_large",
                            &format!("the request body exceeds {} bytes", config.max_body),
                        )
                    } else {
                        plain_error(
                            StatusCode::BAD_REQUEST,
                            "invalid_request_error",
                            &format!("the request body could not be read: {error}"),
                        )
                    });
                }
            };
            let llm_request = match (config.request)(&head, &bytes) {
                Ok(request) => request,
                Err(message) => {
                    return Ok(plain_error(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        &message,
                    ));
                }
            };
            let bulkhead = match (config.bulkhead)(&head) {
                Ok(bulkhead) => bulkhead,
                Err(TenantsError::Full { max }) => {
                    return Ok(plain_error(
                        StatusCode::TOO_MANY_REQUESTS,
                        "too_many_tenants",
                        &format!("{max} tenants are busy: no bulkhead for another one now"),
                    ));
                }
                Err(error) => {
                    return Ok(plain_error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "api_error",
                        &error.to_string(),
                    ));
                }
            };
            let options = (config.options)(&head);
            let admitted = match (&config.global, config.wait) {
                (Some(global), true) => bulkhead
                    .acquire_within(global, &llm_request, options)
                    .await
                    .map(Held::Within),
                (Some(global), false) => bulkhead
                    .try_acquire_within(global, &llm_request, options)
                    .map(Held::Within),
                (None, true) => bulkhead
                    .acquire_owned(&llm_request, options)
                    .await
                    .map(Held::One),
                (None, false) => bulkhead
                    .try_acquire_owned(&llm_request, options)
                    .map(Held::One),
            };
            let permit = match admitted {
                Ok(permit) => permit,
                Err(error) => {
                    let rate = if config.rate_limit_headers {
                        bulkhead.rate_status()
                    } else {
                        None
                    };
                    return Ok(refusal(&error, &config, rate));
                }
            };
            // The figures after this call's admission, for the rate-limit headers.
            let capacity = config
                .rate_limit_headers
                .then(|| (bulkhead.capacity(), bulkhead.rate_status()));
            // The hold counts from here (a JSON call's generation happens before its head).
            let admitted_at = config.holds.as_ref().map(|_| Instant::now());
            // An inner failure drops the permit here: released at once.
            let response = inner
                .call(Request::from_parts(head, Full::new(bytes)))
                .await?;
            let (mut parts, body) = response.into_parts();
            if let Some(learner) = &config.learner {
                // The revision the call was admitted under, on the learner's bulkhead: one
                // decrease per round of calls.
                let admitted_under = match &permit {
                    Held::One(permit) => learner.learns(&bulkhead).then(|| permit.limit_revision()),
                    Held::Within(permit) => match &config.global {
                        Some(global) if learner.learns(global) => {
                            Some(permit.global().limit_revision())
                        }
                        _ => learner
                            .learns(&bulkhead)
                            .then(|| permit.tenant().limit_revision()),
                    },
                };
                let mut seen = provider_limits(parts.status, &parts.headers);
                seen.admitted_under = admitted_under;
                learner.observe(seen);
            }
            if let Some(capacity) = &capacity {
                let (capacity, rate) = capacity;
                rate_limit_headers(
                    &mut parts.headers,
                    capacity,
                    rate.as_ref(),
                    config.holds.as_deref(),
                );
            }
            let reader = Reader::for_response(&parts.headers);
            Ok(Response::from_parts(
                parts,
                LlmBody::admitted(body, permit, reader, config, admitted_at),
            ))
        })
    }
}

/// A refusal as the provider-shaped JSON answer of [`HttpRefusal`](crate::http::HttpRefusal)
/// (its figures only with `expose_capacity`), with the hold-time hint as `Retry-After` on a 429
/// when it is on and known, and the rate-limit headers on a 429 when they are on; then the
/// layer's `on_refusal` hook.
fn refusal<R>(
    error: &AcquireError,
    config: &Config,
    rate: Option<RateStatus>,
) -> Response<LlmBody<R>> {
    let scoped;
    let error = match error {
        // A per-tenant layer's refusals are its tenants' own.
        AcquireError::Rejected(rejection)
            if config.single.is_none() && rejection.scope().is_none() =>
        {
            scoped = AcquireError::Rejected(rejection.with_scope(Scope::Tenant));
            &scoped
        }
        error => error,
    };
    let mut answer = HttpRefusal::from(error);
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    // A client sees its own scope's figures; the global ones only when the layer shows them.
    let own_scope = answer.scope == Some(Scope::Tenant);
    let show = config.expose_capacity || own_scope;
    if !show && answer.detail.is_some() {
        answer.detail = None;
        answer.message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "the call can never fit this gateway's limits: do not retry it unchanged".to_owned()
        } else {
            format!("bulkhead rejected: {}", answer.code)
        };
    }
    let holds = config.holds.as_deref();
    let too_many = status == StatusCode::TOO_MANY_REQUESTS;
    // A rate window's refusal knows its wait exactly; a capacity refusal has only the
    // hold-time hint, when it is on.
    let exact = error
        .rejection()
        .and_then(Rejection::retry_after)
        .map(|wait| wait.as_millis().div_ceil(1000).max(1) as u64);
    let retry_after = match exact {
        Some(seconds) if too_many => Some(seconds),
        _ if too_many && config.retry_after => holds.and_then(HoldTimes::hint_seconds),
        _ => None,
    };
    let mut response = body::answer(status, Bytes::from(answer.body()), retry_after);
    // The rate-limit headers are opted into; a global level's figures stay hidden from a
    // tenant's client unless the layer shows them.
    if too_many
        && config.rate_limit_headers
        && let Some(rejection) = error.rejection()
        && (rejection.scope() != Some(Scope::Global) || config.expose_capacity)
    {
        rate_limit_headers(
            response.headers_mut(),
            rejection.detail(),
            rate.as_ref(),
            holds,
        );
    }
    if let Some(hook) = &config.on_refusal {
        hook(error, &mut response);
    }
    body::send(response).map(|held| LlmBody { held })
}

/// The rate-limit headers of [`LlmLayer::rate_limit_headers`](crate::tower::LlmLayer::rate_limit_headers)
/// from a capacity snapshot.
fn rate_limit_headers(
    headers: &mut http::HeaderMap,
    capacity: &CapacityDetail,
    rate: Option<&RateStatus>,
    holds: Option<&HoldTimes>,
) {
    if let Some(rate) = rate {
        return window_headers(headers, rate);
    }
    let reset = holds.and_then(HoldTimes::hint_seconds).unwrap_or(1);
    let limit = u64::from(capacity.max_concurrent);
    let remaining = limit.saturating_sub(capacity.in_flight);
    let seconds = HeaderValue::from_str(&format!("{reset}s")).expect("digits and `s`");
    headers.insert("ratelimit-limit", HeaderValue::from(limit));
    headers.insert("ratelimit-remaining", HeaderValue::from(remaining));
    headers.insert("ratelimit-reset", HeaderValue::from(reset));
    headers.insert("x-ratelimit-limit-requests", HeaderValue::from(limit));
    headers.insert(
        "x-ratelimit-remaining-requests",
        HeaderValue::from(remaining),
    );
    headers.insert("x-ratelimit-reset-requests", seconds.clone());
    if let Some(budget) = &capacity.token_budget {
        headers.insert(
            "x-ratelimit-limit-tokens",
            HeaderValue::from(budget.effective_budget),
        );
        headers.insert(
            "x-ratelimit-remaining-tokens",
            HeaderValue::from(budget.available),
        );
        headers.insert("x-ratelimit-reset-tokens", seconds);
    }
}

/// What a provider's answer says of its limits: the status (429, and Anthropic's 529
/// overloaded, are throttling) and the rate-limit headers OpenAI
/// (`x-ratelimit-{limit,remaining}-{requests,tokens}`) and Anthropic
/// (`anthropic-ratelimit-{requests,tokens}-{limit,remaining}`) send.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::tower::provider_limits;
///
/// let mut headers = http::HeaderMap::new();
/// headers.insert("x-ratelimit-limit-tokens", http::HeaderValue::from_static("90000"));
/// headers.insert("anthropic-ratelimit-requests-remaining", http::HeaderValue::from_static("7"));
/// let seen = provider_limits(http::StatusCode::OK, &headers);
/// assert_eq!((seen.limit_tokens, seen.remaining_requests), (Some(90_000), Some(7)));
/// assert!(provider_limits(http::StatusCode::TOO_MANY_REQUESTS, &headers).throttled);
/// ```
pub fn provider_limits(status: StatusCode, headers: &http::HeaderMap) -> ProviderLimits {
    let number = |names: [&str; 2]| {
        names.iter().find_map(|name| {
            headers
                .get(*name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
    };
    let mut seen = if status == StatusCode::TOO_MANY_REQUESTS || status.as_u16() == 529 {
        ProviderLimits::throttled()
    } else {
        ProviderLimits::new()
    };
    seen.limit_requests = number([
        "x-ratelimit-limit-requests",
        "anthropic-ratelimit-requests-limit",
    ]);
    seen.limit_tokens = number([
        "x-ratelimit-limit-tokens",
        "anthropic-ratelimit-tokens-limit",
    ]);
    seen.remaining_requests = number([
        "x-ratelimit-remaining-requests",
        "anthropic-ratelimit-requests-remaining",
    ]);
    seen.remaining_tokens = number([
        "x-ratelimit-remaining-tokens",
        "anthropic-ratelimit-tokens-remaining",
    ]);
    seen
}

/// The rate-limit headers of a bulkhead with rate windows: its windows' figures (the requests
/// window for `RateLimit-*`, else the tokens window), resets as OpenAI writes them (`"1s"`,
/// `"250ms"`, `"6m0s"`).
fn window_headers(headers: &mut http::HeaderMap, rate: &RateStatus) {
    let text = |reset: Duration| {
        HeaderValue::from_str(&go_duration(reset)).expect("digits and unit letters")
    };
    if let Some(first) = rate.requests.or(rate.tokens) {
        let seconds = first.reset.as_millis().div_ceil(1000) as u64;
        headers.insert("ratelimit-limit", HeaderValue::from(first.limit));
        headers.insert("ratelimit-remaining", HeaderValue::from(first.remaining));
        headers.insert("ratelimit-reset", HeaderValue::from(seconds));
    }
    if let Some(requests) = rate.requests {
        headers.insert(
            "x-ratelimit-limit-requests",
            HeaderValue::from(requests.limit),
        );
        headers.insert(
            "x-ratelimit-remaining-requests",
            HeaderValue::from(requests.remaining),
        );
        headers.insert("x-ratelimit-reset-requests", text(requests.reset));
    }
    if let Some(tokens) = rate.tokens {
        headers.insert("x-ratelimit-limit-tokens", HeaderValue::from(tokens.limit));
        headers.insert(
            "x-ratelimit-remaining-tokens",
            HeaderValue::from(tokens.remaining),
        );
        headers.insert("x-ratelimit-reset-tokens", text(tokens.reset));
    }
}

/// A duration as Go prints one (OpenAI's reset headers): `"0s"`, `"250ms"`, `"1.5s"`, `"6m0s"`.
fn go_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        return "0s".to_owned();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (minutes, rest) = (ms / 60_000, ms % 60_000);
    let seconds = if rest % 1000 == 0 {
        format!("{}s", rest / 1000)
    } else {
        format!("{}.{:03}s", rest / 1000, rest % 1000)
            .trim_end_matches('0')
            .to_owned()
    };
    if minutes > 0 {
        format!("{minutes}m{seconds}")
    } else {
        seconds
    }
}

/// An answer of the layer's own (not a bulkhead's refusal), in [`HttpRefusal`](crate::http::HttpRefusal)'s shape.
fn plain_error<R>(
    status: StatusCode,
    error_type: &'static str,
    message: &str,
) -> Response<LlmBody<R>> {
    let answer = HttpRefusal {
        status: status.as_u16(),
        error_type,
        code: error_type,
        message: message.to_owned(),
        detail: None,
        scope: None,
    };
    body::send(body::answer(status, Bytes::from(answer.body()), None)).map(|held| LlmBody { held })
}

/// What an admitted call holds: one bulkhead's permit, or a tenant's within the global one.
enum Held {
    One(OwnedPermit),
    Within(TenantPermit),
}

impl Held {
    /// Reports a cumulative usage the provider stated; figures that do not fit are ignored,
    /// never fatal to the stream.
    fn report_usage(&mut self, usage: TokenUsage) {
        let _ = match self {
            Held::One(permit) => permit.report_usage(usage),
            Held::Within(permit) => permit.report_usage(usage),
        };
    }

    fn release(self, usage: Option<TokenUsage>) {
        match self {
            Held::One(permit) => {
                permit.release(usage);
            }
            Held::Within(permit) => {
                permit.release(usage);
            }
        }
    }
}

/// The response body of [`LlmService`](crate::tower::LlmService): the inner service's body with the call's permit
/// (released when the body ends, fails or is dropped), or the layer's own answer to a request
/// it refused.
pub struct LlmBody<B> {
    held: HeldBody<B, Settle>,
}

/// What an admitted call's body holds: its permit, the reader of the provider's usage, and
/// when it was admitted (for the hold-time hint). Dropped, it settles: at the body's end, at an
/// error, or when the body is dropped before its end (a client gone, a server that stops
/// polling once a sized body is written), with what was read.
struct Settle {
    /// Taken when it settles.
    permit: Option<Held>,
    reader: Reader,
    config: Arc<Config>,
    /// When the call was admitted (only with `retry_after_hint`).
    admitted_at: Option<Instant>,
    /// Whether the body ended or failed (else a drop is a client gone mid-response).
    ended: bool,
}

impl<B> LlmBody<B> {
    fn admitted(
        body: B,
        permit: Held,
        reader: Reader,
        config: Arc<Config>,
        admitted_at: Option<Instant>,
    ) -> LlmBody<B> {
        let settle = Settle {
            permit: Some(permit),
            reader,
            config,
            admitted_at,
            ended: false,
        };
        LlmBody {
            held: HeldBody::admitted(body, settle),
        }
    }

    /// Whether this body still holds its admission (false for the layer's own answer to a
    /// refused request, and once the body ended or failed). See [`LlmLayer`](crate::tower::LlmLayer) for an example.
    pub fn holds_permit(&self) -> bool {
        self.held.holds()
    }
}

impl<B> fmt::Debug for LlmBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlmBody")
            .field("holds_permit", &self.holds_permit())
            .finish_non_exhaustive()
    }
}

impl<B> Body for LlmBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        // `LlmBody` is `Unpin`: the inner body is pinned in its own box.
        self.get_mut()
            .held
            .poll_frame(cx)
            .map(|frame| frame.map(|result| result.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.held.size_hint()
    }
}

impl body::Hold for Settle {
    fn ended(&mut self) {
        self.ended = true;
    }

    /// Reads what a data frame says about usage, and reports it.
    fn observe(&mut self, data: &Bytes) {
        let Some(permit) = self.permit.as_mut() else {
            return;
        };
        let usage = self.config.usage.as_deref();
        match &mut self.reader {
            Reader::Events(events) => events.feed(data, |json| {
                let found = match usage {
                    Some(read) => read(json),
                    None => provider_usage(json),
                };
                if let Some(found) = found {
                    permit.report_usage(found);
                }
            }),
            Reader::Json(body) => {
                if body.len() + data.len() <= MAX_JSON_RESPONSE {
                    body.extend_from_slice(data);
                } else {
                    self.reader = Reader::Other;
                }
            }
            Reader::Other => {}
        }
    }
}

impl Drop for Settle {
    /// The body ended, failed or was dropped: settles with the usage it said (a JSON body's),
    /// else the last reported; a client gone mid-response, after the layer's grace if any.
    fn drop(&mut self) {
        if !self.ended && self.permit.is_some() && !std::thread::panicking() {
            let average = self.config.holds.as_deref().and_then(HoldTimes::average);
            let grace = self.config.disconnect.grace(self.admitted_at, average);
            if !grace.is_zero() {
                // The same settlement, later: moved out whole, marked ended.
                let later = Settle {
                    permit: self.permit.take(),
                    reader: core::mem::replace(&mut self.reader, Reader::Other),
                    config: Arc::clone(&self.config),
                    admitted_at: self.admitted_at,
                    ended: true,
                };
                grace::hold_for(later, grace);
                return;
            }
        }
        let Some(permit) = self.permit.take() else {
            return;
        };
        // The usage reader is user code: not called again while a panic unwinds (this may be
        // the drop of a body whose reader panicked).
        let usage = match &self.reader {
            Reader::Json(body) => match &self.config.usage {
                None => json_response_usage(body),
                Some(read) if !std::thread::panicking() => serde_json::from_slice(body)
                    .ok()
                    .and_then(|json| read(&json)),
                Some(_) => None,
            },
            _ => None,
        };
        permit.release(usage);
        if let (Some(holds), Some(at)) = (&self.config.holds, self.admitted_at) {
            holds.record(at.elapsed());
        }
    }
}
