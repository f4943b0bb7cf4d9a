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
use std::time::Instant;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full, Limited};

use crate::http::HttpRefusal;
use crate::llm::bulkhead::LlmBulkhead;
use crate::llm::options::AcquireOptions;
use crate::llm::permit::OwnedPermit;
use crate::llm::request::LlmRequest;
use crate::llm::tenants::{Tenants, TenantsError};
use crate::vocabulary::error::AcquireError;
use crate::vocabulary::reservation::TokenUsage;

use super::hold_times::HoldTimes;

/// The error type of the layer's bodies and of inner services it accepts (tower's).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

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

/// A layer's configuration that cannot work, refused when it is built.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{tower::LayerError, LlmBulkhead, tower::LlmLayer};
///
/// let no_queue = LlmBulkhead::builder("m", 1).build()?;
/// let err = LlmLayer::new(no_queue).wait_in_queue(true).unwrap_err();
/// assert_eq!(err, LayerError::NoQueue);
/// assert!(err.to_string().contains("max_queue is 0"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LayerError {
    /// [`LlmLayer::wait_in_queue`](crate::tower::LlmLayer::wait_in_queue) or
    /// [`BulkheadLayer::wait_in_queue`](crate::tower::BulkheadLayer::wait_in_queue) on a
    /// bulkhead without a queue: every request that finds no
    /// free slot would be refused at once anyway.
    NoQueue,
}

impl fmt::Display for LayerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayerError::NoQueue => f.write_str(
                "wait_in_queue(true) on a bulkhead without a queue (max_queue is 0): requests \
                 could only be refused at once; give the bulkhead a queue first",
            ),
        }
    }
}

impl std::error::Error for LayerError {}

/// A non-streamed JSON response is read for its usage up to this size; a larger one settles
/// with the usage reported so far.
const MAX_JSON_RESPONSE: usize = 4 << 20;

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
    request: Arc<ToRequest>,
    options: Arc<ToOptions>,
    /// The reader of [`LlmLayer::usage`](crate::tower::LlmLayer::usage); `None`: [`provider_usage`](crate::tower::provider_usage), which lets a JSON
    /// response be read for its usage members alone (see [`json_response_usage`]).
    usage: Option<Arc<ToUsage>>,
    wait: bool,
    max_body: usize,
    /// With `retry_after_hint`: the recent hold time of released calls.
    holds: Option<Arc<HoldTimes>>,
}

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
    /// is refused, 500.
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
        LlmLayer::with_source(Arc::new(move |head| tenants.get(&key(head))), None)
    }

    fn with_source(bulkhead: Arc<ToBulkhead>, single: Option<LlmBulkhead>) -> LlmLayer {
        LlmLayer {
            config: Arc::new(Config {
                bulkhead,
                single,
                holds: None,
                request: Arc::new(|_, body: &Bytes| {
                    serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))
                }),
                options: Arc::new(|_| AcquireOptions::new()),
                usage: None,
                wait: false,
                max_body: DEFAULT_MAX_REQUEST_BODY,
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
        self.config().holds = on.then(Arc::default);
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
            let admitted = if config.wait {
                bulkhead.acquire_owned(&llm_request, options).await
            } else {
                bulkhead.try_acquire_owned(&llm_request, options)
            };
            let permit = match admitted {
                Ok(permit) => permit,
                Err(error) => return Ok(refusal(&error, config.holds.as_deref())),
            };
            // The hold counts from here (a JSON call's generation happens before its head).
            let admitted_at = config.holds.as_ref().map(|_| Instant::now());
            // An inner failure drops the permit here: released at once.
            let response = inner
                .call(Request::from_parts(head, Full::new(bytes)))
                .await?;
            let (parts, body) = response.into_parts();
            let reader = Reader::for_response(&parts.headers);
            Ok(Response::from_parts(
                parts,
                LlmBody::admitted(body, permit, reader, config, admitted_at),
            ))
        })
    }
}

/// A refusal as the provider-shaped JSON answer of [`HttpRefusal`](crate::http::HttpRefusal), with the hold-time hint
/// as `Retry-After` on a 429 when it is on and known.
fn refusal<R>(error: &AcquireError, holds: Option<&HoldTimes>) -> Response<LlmBody<R>> {
    let answer = HttpRefusal::from(error);
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = respond(status, Bytes::from(answer.body()));
    if status == StatusCode::TOO_MANY_REQUESTS
        && let Some(seconds) = holds.and_then(HoldTimes::hint_seconds)
    {
        response
            .headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
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
    };
    respond(status, Bytes::from(answer.body()))
}

fn respond<R>(status: StatusCode, body: Bytes) -> Response<LlmBody<R>> {
    let mut response = Response::new(LlmBody {
        state: State::Answer(Some(body)),
    });
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static(HttpRefusal::CONTENT_TYPE),
    );
    response
}

/// The response body of [`LlmService`](crate::tower::LlmService): the inner service's body with the call's permit
/// (released when the body ends, fails or is dropped), or the layer's own answer to a request
/// it refused.
pub struct LlmBody<B> {
    state: State<B>,
}

enum State<B> {
    /// The layer's own answer (a refusal); `None` once sent.
    Answer(Option<Bytes>),
    Streaming(Box<Streaming<B>>),
    /// The inner body ended or failed: it is dropped, and the body stays ended.
    Done,
}

struct Streaming<B> {
    inner: Pin<Box<B>>,
    /// `None` once released.
    permit: Option<OwnedPermit>,
    reader: Reader,
    config: Arc<Config>,
    /// When the call was admitted (only with `retry_after_hint`).
    admitted_at: Option<Instant>,
}

impl<B> Drop for Streaming<B> {
    /// A body dropped before its end (a client gone, a server that stops polling once a sized
    /// body is written) settles here, with what was read.
    fn drop(&mut self) {
        self.finish();
    }
}

impl<B> LlmBody<B> {
    fn admitted(
        body: B,
        permit: OwnedPermit,
        reader: Reader,
        config: Arc<Config>,
        admitted_at: Option<Instant>,
    ) -> LlmBody<B> {
        LlmBody {
            state: State::Streaming(Box::new(Streaming {
                inner: Box::pin(body),
                permit: Some(permit),
                reader,
                admitted_at,
                config,
            })),
        }
    }

    /// Whether this body still holds its admission (false for the layer's own answer to a
    /// refused request, and once the body ended or failed). See [`LlmLayer`](crate::tower::LlmLayer) for an example.
    pub fn holds_permit(&self) -> bool {
        matches!(&self.state, State::Streaming(s) if s.permit.is_some())
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
        let this = self.get_mut();
        match &mut this.state {
            State::Answer(body) => Poll::Ready(body.take().map(|b| Ok(Frame::data(b)))),
            State::Streaming(streaming) => match streaming.inner.as_mut().poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        streaming.observe(data);
                    }
                    // A server that sees the end may never poll again (a sized body): settle
                    // with this last frame.
                    if streaming.inner.is_end_stream() {
                        streaming.finish();
                    }
                    Poll::Ready(Some(Ok(frame)))
                }
                Poll::Ready(Some(Err(error))) => {
                    // Settled as the inner body is dropped (`Streaming`'s drop).
                    this.state = State::Done;
                    Poll::Ready(Some(Err(error.into())))
                }
                Poll::Ready(None) => {
                    this.state = State::Done;
                    Poll::Ready(None)
                }
                Poll::Pending => Poll::Pending,
            },
            State::Done => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.state {
            State::Answer(body) => body.is_none(),
            State::Streaming(streaming) => streaming.inner.is_end_stream(),
            State::Done => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.state {
            State::Answer(Some(body)) => SizeHint::with_exact(body.len() as u64),
            State::Answer(None) | State::Done => SizeHint::with_exact(0),
            State::Streaming(streaming) => streaming.inner.size_hint(),
        }
    }
}

impl<B> Streaming<B> {
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
                    // A provider's figures that do not fit are ignored, never fatal to the
                    // stream.
                    let _ = permit.report_usage(found);
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

    /// The body ended or failed: settles with the usage it said (a JSON body's), else the
    /// last reported.
    fn finish(&mut self) {
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
        let _ = permit.release(usage);
        if let (Some(holds), Some(at)) = (&self.config.holds, self.admitted_at) {
            holds.record(at.elapsed());
        }
    }
}

/// How a response's usage is read.
enum Reader {
    /// `text/event-stream`: every complete event line that mentions `usage`.
    Events(EventLines),
    /// `application/json`: the whole body, read at its end.
    Json(Vec<u8>),
    /// Anything else: no usage (the call settles with nothing reported).
    Other,
}

impl Reader {
    /// The reader of a response with these headers: by its content type; none for an encoded
    /// (compressed) body, whose bytes say nothing readable.
    fn for_response(headers: &http::HeaderMap) -> Reader {
        let encoded = headers
            .get(http::header::CONTENT_ENCODING)
            .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
        if encoded {
            return Reader::Other;
        }
        let kind = headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or("").trim());
        match kind {
            Some(k) if k.eq_ignore_ascii_case("text/event-stream") => {
                Reader::Events(EventLines::default())
            }
            Some(k) if k.eq_ignore_ascii_case("application/json") => Reader::Json(Vec::new()),
            _ => Reader::Other,
        }
    }
}

/// The longest unfinished line kept between chunks; the rest of a longer line (a large
/// content delta, a stream that never sends a newline) is skipped up to its end.
const MAX_PARTIAL_LINE: usize = 64 << 10;

/// Splits a server-sent event stream into lines as chunks pass, keeping only the unfinished
/// tail of a chunk (a line cut in two by the network, at most [`MAX_PARTIAL_LINE`]); lines
/// are looked at in place. Lines end with LF or CRLF (a bare CR, which the SSE format also
/// allows, is not a line end here), and an event's `data:` is read from one line.
#[derive(Default)]
struct EventLines {
    partial: Vec<u8>,
    /// The current line outgrew `MAX_PARTIAL_LINE`: skipped up to its end.
    skipping: bool,
}

impl EventLines {
    /// Feeds `chunk`, calling `found` with the JSON of each complete `data:` line that
    /// states a usage.
    fn feed(&mut self, chunk: &[u8], mut found: impl FnMut(&serde_json::Value)) {
        let mut rest = chunk;
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            let (line, after) = rest.split_at(end);
            rest = &after[1..];
            if core::mem::take(&mut self.skipping) {
                continue;
            }
            if self.partial.is_empty() {
                Self::line(line, &mut found);
            } else {
                self.partial.extend_from_slice(line);
                Self::line(&self.partial, &mut found);
                self.partial.clear();
            }
        }
        if rest.is_empty() || self.skipping {
            return;
        }
        if self.partial.len() + rest.len() > MAX_PARTIAL_LINE {
            self.partial.clear();
            self.skipping = true;
        } else {
            self.partial.extend_from_slice(rest);
        }
    }

    fn line(line: &[u8], found: &mut impl FnMut(&serde_json::Value)) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        // Only events that state a usage are parsed: with `include_usage` every OpenAI chunk
        // says `"usage":null`.
        if !states_usage(data) {
            return;
        }
        if let Ok(json) = serde_json::from_slice::<serde_json::Value>(data) {
            found(&json);
        }
    }
}

/// Whether some `"usage":` in `data` is followed by something other than `null`.
fn states_usage(data: &[u8]) -> bool {
    const KEY: &[u8] = b"\"usage\":";
    let mut rest = data;
    while let Some(at) = rest.windows(KEY.len()).position(|w| w == KEY) {
        rest = &rest[at + KEY.len()..];
        if !rest.trim_ascii_start().starts_with(b"null") {
            return true;
        }
    }
    false
}

/// The cumulative usage a provider's JSON document states: OpenAI's `usage` (`prompt_tokens`,
/// `completion_tokens`; in a streamed chunk with `stream_options.include_usage`, or a whole
/// response), Anthropic's `message_start` (`message.usage`) and `message_delta` (`usage`,
/// whose `output_tokens` is cumulative), or a messages response's `usage` (`input_tokens`,
/// `output_tokens`; cache reads and writes count as input).
pub fn provider_usage(json: &serde_json::Value) -> Option<TokenUsage> {
    usage_of(json.get("usage"), json.get("message"))
}

/// The top-level members of a JSON response that [`provider_usage`](crate::tower::provider_usage) reads; every other
/// member is skipped without being built (a whole response as a `serde_json::Value` is a tree
/// of maps: about a fifth of the layer's time per request, measured with `perf`).
#[derive(serde::Deserialize)]
struct UsageDocument {
    usage: Option<serde_json::Value>,
    message: Option<serde_json::Value>,
}

/// [`provider_usage`](crate::tower::provider_usage) of a whole JSON response body, reading only its `usage` and `message`
/// members. A body that is not a JSON object, or that names either member twice, states no
/// usage.
fn json_response_usage(body: &[u8]) -> Option<TokenUsage> {
    let document: UsageDocument = serde_json::from_slice(body).ok()?;
    usage_of(document.usage.as_ref(), document.message.as_ref())
}

/// The usage a document states from its top-level `usage` and `message` members: `usage` if
/// it is an object, else `message.usage` (see [`provider_usage`](crate::tower::provider_usage)).
fn usage_of(
    usage: Option<&serde_json::Value>,
    message: Option<&serde_json::Value>,
) -> Option<TokenUsage> {
    let usage = usage
        .filter(|u| u.is_object())
        .or_else(|| message.and_then(|m| m.get("usage")))?;
    usage_block(usage)
}

/// The usage a provider's `usage` block states (see [`provider_usage`](crate::tower::provider_usage)).
fn usage_block(usage: &serde_json::Value) -> Option<TokenUsage> {
    let n = |key: &str| usage.get(key).and_then(serde_json::Value::as_u64);
    if let (Some(input), Some(output)) = (n("prompt_tokens"), n("completion_tokens")) {
        return TokenUsage::new(input, output).ok();
    }
    let input = n("input_tokens").map(|i| {
        i.saturating_add(n("cache_creation_input_tokens").unwrap_or(0))
            .saturating_add(n("cache_read_input_tokens").unwrap_or(0))
    });
    match (input, n("output_tokens")) {
        (Some(input), Some(output)) => TokenUsage::new(input, output).ok(),
        // A `message_delta` states the output only: the input stands as reported before
        // (cumulative reports keep each field's maximum).
        (None, Some(output)) => TokenUsage::new(0, output).ok(),
        (Some(input), None) => TokenUsage::new(input, 0).ok(),
        (None, None) => None,
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::{EventLines, MAX_PARTIAL_LINE, json_response_usage, provider_usage, states_usage};

    /// The typed read of a JSON response agrees with `provider_usage` of the whole document.
    #[test]
    fn a_json_response_is_read_for_its_usage_like_the_whole_document() {
        let documents: [&str; 12] = [
            r#"{"id":"x","choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":500,"completion_tokens":20}}"#,
            r#"{"type":"message","content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":7,"cache_read_input_tokens":3,"output_tokens":9}}"#,
            r#"{"type":"message_start","message":{"id":"m","usage":{"input_tokens":12,"output_tokens":1}}}"#,
            r#"{"usage":null,"message":{"usage":{"input_tokens":4,"output_tokens":2}}}"#,
            r#"{"usage":"none","message":"text"}"#,
            r#"{"usage":{"output_tokens":5}}"#,
            r#"{"usage":{"prompt_tokens":-1,"completion_tokens":2}}"#,
            r#"{"choices":[]}"#,
            r#"[{"usage":{"prompt_tokens":1,"completion_tokens":1}}]"#,
            r#"not json"#,
            r#"{"usage":{"prompt_tokens":1,"completion_tokens":1}"#,
            r#"{"message":{"content":"x"},"usage":{"input_tokens":1,"output_tokens":0}}"#,
        ];
        let mut stated = 0;
        for document in documents {
            let whole = serde_json::from_str::<serde_json::Value>(document)
                .ok()
                .and_then(|json| provider_usage(&json));
            assert_eq!(
                json_response_usage(document.as_bytes()),
                whole,
                "{document}"
            );
            stated += usize::from(whole.is_some());
        }
        assert_eq!(stated, 6);
    }

    fn lines(chunks: &[&[u8]]) -> (Vec<serde_json::Value>, usize) {
        let mut events = EventLines::default();
        let mut found = Vec::new();
        let mut kept = 0;
        for chunk in chunks {
            events.feed(chunk, |json| found.push(json.clone()));
            kept = kept.max(events.partial.len());
        }
        (found, kept)
    }

    #[test]
    fn a_line_split_anywhere_is_read_once_whole() {
        let event = b"data: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\r\n\r\n";
        for cut in 0..event.len() {
            let (found, _) = lines(&[&event[..cut], &event[cut..]]);
            assert_eq!(found.len(), 1, "cut at {cut}");
            assert_eq!(found[0]["usage"]["prompt_tokens"], 3);
        }
    }

    #[test]
    fn null_usage_is_not_parsed_and_a_line_without_end_is_bounded() {
        assert!(!states_usage(b" {\"choices\":[],\"usage\":null}"));
        assert!(!states_usage(b" {\"usage\": null, \"x\": 1}"));
        assert!(states_usage(
            b" {\"usage\":null,\"message\":{\"usage\":{\"input_tokens\":1}}}"
        ));
        let (found, _) = lines(&[b"data: {\"usage\":null}\n"]);
        assert!(found.is_empty());
        // A stream that never sends a newline keeps at most MAX_PARTIAL_LINE bytes, then
        // skips to the next line end and reads the line after it.
        let filler = vec![b'x'; 16 << 10];
        let mut chunks: Vec<&[u8]> = vec![b"data: {\"usage\":"];
        chunks.extend(std::iter::repeat_n(&filler[..], 8));
        chunks.push(b"}\ndata: {\"usage\":{\"output_tokens\":5}}\n");
        let (found, kept) = lines(&chunks);
        assert!(kept <= MAX_PARTIAL_LINE, "kept {kept}");
        assert_eq!(found.len(), 1);
        assert_eq!(found[0]["usage"]["output_tokens"], 5);
    }
}
