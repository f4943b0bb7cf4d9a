//! The tower layer of the general bulkhead (feature `tower`): [`BulkheadLayer`](crate::tower::BulkheadLayer) admits each
//! HTTP request through a [`Bulkhead`] before the inner service sees it, answers a refusal
//! itself (503 Service Unavailable with a small JSON body; `Retry-After` only with
//! [`BulkheadLayer::retry_after_hint`](crate::tower::BulkheadLayer::retry_after_hint)), and wraps the response body in a [`BulkheadBody`](crate::tower::BulkheadBody)
//! that holds the call's [`OwnedBulkheadPermit`](crate::bulkhead::OwnedBulkheadPermit) until the body ends, fails or is dropped (a
//! client that disconnects mid-body releases at once).
//!
//! Unlike the LLM layer it knows nothing of the request: the request, its body included, is
//! passed to the inner service untouched, and every request asks for one slot. Works with any
//! tower stack over `http` 1 types: axum 0.8 routers (put it on the routes of the slow
//! dependency with `route_layer`, or on a sub-router), hyper 1 services.

use core::fmt;
use core::future::Future;
use core::pin::Pin;
use core::task::{Context, Poll};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};

use crate::bulkhead::{Bulkhead, BulkheadError, OwnedBulkheadPermit};

use super::body::{self, HeldBody};
use super::error::LayerError;
use super::hold_times::HoldTimes;

/// A tower layer that admits each HTTP request through a [`Bulkhead`] before the inner service
/// sees it. By default a request waits in the bulkhead's queue (under its queue timeout) when
/// every slot is taken; a refusal ([`BulkheadError`]) is answered by the layer itself: 503
/// Service Unavailable, `content-type: application/json`, and the body
/// `{"error":{"type":"<as_str>","message":"<Display>","active":N,"queued":M}}`, without
/// `Retry-After` unless [`retry_after_hint`](BulkheadLayer::retry_after_hint) is on. An
/// admitted request's response body becomes a [`BulkheadBody`](crate::tower::BulkheadBody) that holds the slot until the
/// body ends, fails or is dropped; an error of the inner service releases it at once.
///
/// Cheap to clone; clones share the bulkhead (and the hold-time history of the hint).
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{Bulkhead, tower::BulkheadLayer};
/// use bytes::Bytes;
/// use http_body_util::{BodyExt, Full};
/// use tower::{Layer, ServiceExt};
///
/// # ::futures::executor::block_on(async {
/// let bulkhead = Bulkhead::builder(1).max_queue(0).build()?;
/// // The slow dependency (here a stub; in a service an axum router or a proxy client).
/// let slow_api = tower::service_fn(|_request: http::Request<String>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from("done"))))
/// });
/// let guarded = BulkheadLayer::new(bulkhead.clone()).layer(slow_api);
///
/// let held = bulkhead.try_acquire()?;
/// let refused = guarded.clone().oneshot(http::Request::new(String::new())).await?;
/// assert_eq!(refused.status(), 503); // the one slot is taken and there is no queue
/// assert_eq!(refused.headers()["content-type"], "application/json");
/// drop(held);
///
/// let response = guarded.oneshot(http::Request::new(String::new())).await?;
/// assert_eq!(response.status(), 200);
/// assert_eq!(bulkhead.state().active, 1); // held by the body until it ends
/// let body = response.into_body().collect().await?.to_bytes();
/// assert_eq!(body, "done");
/// assert_eq!(bulkhead.state().active, 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct BulkheadLayer {
    config: Config,
}

#[derive(Clone)]
struct Config {
    bulkhead: Bulkhead,
    /// Wait in the queue (`acquire_owned`) rather than fail fast (`try_acquire_owned`).
    wait: bool,
    /// With `retry_after_hint`: the recent hold time of released calls.
    holds: Option<Arc<HoldTimes>>,
}

impl BulkheadLayer {
    /// A layer admitting through `bulkhead`: requests wait in its queue if it has one
    /// (`max_queue` above 0 now; else they are refused at once, see
    /// [`wait_in_queue`](BulkheadLayer::wait_in_queue)), no `Retry-After` (as
    /// [`LlmLayer::new`](crate::tower::LlmLayer::new)).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Bulkhead, tower::BulkheadLayer};
    ///
    /// let layer = BulkheadLayer::new(Bulkhead::builder(5).max_queue(20).build()?);
    /// # let _ = layer;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(bulkhead: Bulkhead) -> BulkheadLayer {
        let wait = bulkhead.limits().max_queue > 0;
        BulkheadLayer {
            config: Config {
                bulkhead,
                wait,
                holds: None,
            },
        }
    }

    /// Whether a request waits in the bulkhead's queue when every slot is taken (the default
    /// when the bulkhead has a queue: up to the bulkhead's queue timeout, refused with
    /// `bulkhead_queue_full` when the queue is full and `bulkhead_queue_timeout` when the wait
    /// runs out), or is refused at once with `bulkhead_queue_full` (`false`:
    /// [`Bulkhead::try_acquire`]).
    ///
    /// # Errors
    ///
    /// [`LayerError::NoQueue`](crate::tower::LayerError::NoQueue) (the layer unchanged) when
    /// `wait` is asked of a layer whose bulkhead has no queue (`max_queue` 0 now): its
    /// requests could only be refused at once, as without waiting (as
    /// [`LlmLayer::wait_in_queue`](crate::tower::LlmLayer::wait_in_queue)).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Bulkhead, tower::BulkheadLayer};
    /// use bytes::Bytes;
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt};
    ///
    /// # ::futures::executor::block_on(async {
    /// // A queue of 10 places, which this layer does not use.
    /// let bulkhead = Bulkhead::builder(1).max_queue(10).build()?;
    /// let service = BulkheadLayer::new(bulkhead.clone()).wait_in_queue(false)?.layer(
    ///     tower::service_fn(|_request: http::Request<()>| async {
    ///         Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::new())))
    ///     }),
    /// );
    /// let _held = bulkhead.try_acquire()?;
    /// let refused = service.oneshot(http::Request::new(())).await?;
    /// assert_eq!(refused.status(), 503);
    /// assert_eq!(bulkhead.state().queued, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn wait_in_queue(mut self, wait: bool) -> Result<BulkheadLayer, LayerError> {
        if wait && self.config.bulkhead.limits().max_queue == 0 {
            return Err(LayerError::NoQueue);
        }
        self.config.wait = wait;
        Ok(self)
    }

    /// Adds a `Retry-After` header to capacity refusals (`bulkhead_queue_full`,
    /// `bulkhead_queue_timeout`; never to `bulkhead_shutdown`): an *estimate* of when a slot
    /// frees up, the recent average time the layer's admitted calls held their slot, from
    /// admission to the end of the response body or to the inner service's error (an
    /// exponentially weighted average, rounded up to whole seconds, at least 1; none until a
    /// call was released). Off by default: a saturated bulkhead has no honest ETA, only this
    /// history, and clients that all retry after the same hint come back together. A layer and its clones share the history;
    /// turning the hint on again starts a new one.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Bulkhead, tower::BulkheadLayer};
    /// use bytes::Bytes;
    /// use http_body_util::{BodyExt, Full};
    /// use tower::{Layer, ServiceExt};
    ///
    /// # ::futures::executor::block_on(async {
    /// let bulkhead = Bulkhead::builder(1).max_queue(0).build()?;
    /// let service = BulkheadLayer::new(bulkhead.clone()).retry_after_hint(true).layer(
    ///     tower::service_fn(|_request: http::Request<()>| async {
    ///         Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::new())))
    ///     }),
    /// );
    /// // One call through the layer, held well under a second: the hint rounds up to 1.
    /// let served = service.clone().oneshot(http::Request::new(())).await?;
    /// served.into_body().collect().await?;
    /// let _held = bulkhead.try_acquire()?;
    /// let refused = service.oneshot(http::Request::new(())).await?;
    /// assert_eq!(refused.status(), 503);
    /// assert_eq!(refused.headers()["retry-after"], "1");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn retry_after_hint(mut self, on: bool) -> BulkheadLayer {
        self.config.holds = on.then(Arc::default);
        self
    }
}

impl fmt::Debug for BulkheadLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkheadLayer")
            .field("bulkhead", &self.config.bulkhead)
            .field("wait_in_queue", &self.config.wait)
            .field("retry_after_hint", &self.config.holds.is_some())
            .finish()
    }
}

impl<S> tower_layer::Layer<S> for BulkheadLayer {
    type Service = BulkheadService<S>;

    fn layer(&self, inner: S) -> BulkheadService<S> {
        BulkheadService {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service [`BulkheadLayer`](crate::tower::BulkheadLayer) makes: admits each request through the bulkhead, then passes
/// it, untouched, to the inner service.
///
/// `poll_ready` is the inner service's: the bulkhead decides per request, in `call`, and never
/// makes `poll_ready` wait; the ready service is the one called (a clone takes its place). So
/// an inner service that reserves capacity when it is ready (tower's `ConcurrencyLimit`,
/// `Buffer`) keeps that reservation while the request waits in the bulkhead's queue: put such
/// layers inside this one only knowingly.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{Bulkhead, tower::BulkheadLayer, tower::BulkheadService};
/// use tower::Layer;
///
/// let inner = tower::service_fn(|_request: http::Request<()>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Empty::<bytes::Bytes>::new()))
/// });
/// let service: BulkheadService<_> = BulkheadLayer::new(Bulkhead::new(4)?).layer(inner);
/// # let _ = service;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct BulkheadService<S> {
    inner: S,
    config: Config,
}

impl<S> fmt::Debug for BulkheadService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkheadService")
            .field("bulkhead", &self.config.bulkhead)
            .field("wait_in_queue", &self.config.wait)
            .finish_non_exhaustive()
    }
}

impl<S, B, R> tower_service::Service<Request<B>> for BulkheadService<S>
where
    S: tower_service::Service<Request<B>, Response = Response<R>> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
    R: Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<BulkheadBody<R>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The service polled ready is the one that serves this request.
        let clone = self.inner.clone();
        let mut inner = core::mem::replace(&mut self.inner, clone);
        let Config {
            bulkhead,
            wait,
            holds,
        } = self.config.clone();
        Box::pin(async move {
            let admitted = if wait {
                bulkhead.acquire_owned().await
            } else {
                bulkhead.try_acquire_owned()
            };
            let permit = match admitted {
                Ok(permit) => permit,
                Err(error) => return Ok(refusal(&error, holds.as_deref())),
            };
            let hold = Hold {
                timing: holds.map(|holds| (holds, Instant::now())),
                _permit: permit,
            };
            // An inner failure drops the hold here: released at once.
            let response = inner.call(request).await?;
            Ok(response.map(|body| BulkheadBody::admitted(body, hold)))
        })
    }
}

/// A refusal as 503 and its JSON body, with the hold-time hint as `Retry-After` when it is on,
/// known, and the refusal is one of capacity (not a shutdown).
fn refusal<R>(error: &BulkheadError, holds: Option<&HoldTimes>) -> Response<BulkheadBody<R>> {
    let status =
        StatusCode::from_u16(error.http_status()).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    let retry_after = match error {
        BulkheadError::Shutdown { .. } => None,
        _ => holds.and_then(HoldTimes::hint_seconds),
    };
    body::send(body::answer(
        status,
        Bytes::from(error.http_body()),
        retry_after,
    ))
    .map(|held| BulkheadBody { held })
}

/// An admitted call's slot, and when it was admitted (only with the hint): dropping it records
/// the hold, then releases the slot.
struct Hold {
    timing: Option<(Arc<HoldTimes>, Instant)>,
    _permit: OwnedBulkheadPermit,
}

impl body::Hold for Hold {}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some((holds, at)) = &self.timing {
            holds.record(at.elapsed());
        }
    }
}

/// The response body of [`BulkheadService`](crate::tower::BulkheadService): the inner service's body holding the call's
/// slot, or the layer's own answer to a request it refused.
///
/// The slot is released when the inner body ends (`Ready(None)`, or a frame after which it
/// reports [`is_end_stream`](Body::is_end_stream): a server may never poll a finished sized
/// body again), fails (an error frame), or when this body is dropped (a client gone mid-body).
/// The inner body is dropped with its slot, and never polled again: this body is fused, and
/// answers `Ready(None)` from then on. `is_end_stream` and `size_hint` are the inner body's.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{Bulkhead, tower::BulkheadLayer};
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use tower::{Layer, ServiceExt};
///
/// # ::futures::executor::block_on(async {
/// let bulkhead = Bulkhead::new(1)?;
/// let service = BulkheadLayer::new(bulkhead.clone()).layer(tower::service_fn(
///     |_request: http::Request<()>| async {
///         Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from("abc"))))
///     },
/// ));
/// let body = service.oneshot(http::Request::new(())).await?.into_body();
/// assert!(body.holds_permit());
/// drop(body); // a client gone before the end: the slot goes back
/// assert_eq!(bulkhead.state().active, 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
pub struct BulkheadBody<B> {
    held: HeldBody<B, Hold>,
}

impl<B> BulkheadBody<B> {
    fn admitted(body: B, hold: Hold) -> BulkheadBody<B> {
        BulkheadBody {
            held: HeldBody::admitted(body, hold),
        }
    }

    /// Whether this body still holds its slot (false for the layer's own answer to a refused
    /// request, and once the body ended or failed).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Bulkhead, tower::BulkheadLayer};
    /// use bytes::Bytes;
    /// use http_body_util::{BodyExt, Full};
    /// use tower::{Layer, ServiceExt};
    ///
    /// # ::futures::executor::block_on(async {
    /// let bulkhead = Bulkhead::new(1)?;
    /// let service = BulkheadLayer::new(bulkhead.clone()).layer(tower::service_fn(
    ///     |_request: http::Request<()>| async {
    ///         Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from("abc"))))
    ///     },
    /// ));
    /// let mut body = service.oneshot(http::Request::new(())).await?.into_body();
    /// assert!(body.holds_permit());
    /// let frame = body.frame().await.unwrap()?; // the last frame of a sized body
    /// assert_eq!(frame.into_data().unwrap(), "abc");
    /// assert!(!body.holds_permit());
    /// assert_eq!(bulkhead.state().active, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn holds_permit(&self) -> bool {
        self.held.holds()
    }
}

impl<B> fmt::Debug for BulkheadBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkheadBody")
            .field("holds_permit", &self.holds_permit())
            .finish_non_exhaustive()
    }
}

impl<B> Body for BulkheadBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        // `BulkheadBody` is `Unpin`: the inner body is pinned in its own box.
        self.get_mut().held.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.held.size_hint()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use core::pin::Pin;
    use core::task::{Context, Poll};

    use bytes::Bytes;
    use http_body::{Body, Frame, SizeHint};

    use super::{BulkheadBody, Hold};
    use crate::bulkhead::Bulkhead;

    /// One poll of the scripted body.
    type Step = Poll<Option<Result<Frame<Bytes>, &'static str>>>;

    /// A body of scripted polls that fails the test if polled after its end.
    struct Scripted {
        frames: Vec<Step>,
        ended: bool,
    }

    impl Body for Scripted {
        type Data = Bytes;
        type Error = &'static str;

        fn poll_frame(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Step {
            assert!(!self.ended, "polled after its end");
            let next = self.frames.remove(0);
            if matches!(next, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
                self.ended = true;
            }
            next
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(7)
        }
    }

    fn body(bulkhead: &Bulkhead, frames: Vec<Step>) -> BulkheadBody<Scripted> {
        let hold = Hold {
            timing: None,
            _permit: bulkhead.try_acquire_owned().unwrap(),
        };
        BulkheadBody::admitted(
            Scripted {
                frames,
                ended: false,
            },
            hold,
        )
    }

    fn poll(body: &mut BulkheadBody<Scripted>) -> Step {
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        Pin::new(body).poll_frame(&mut cx)
    }

    #[test]
    fn an_error_frame_releases_and_the_body_stays_ended() {
        let bulkhead = Bulkhead::new(1).unwrap();
        let mut body = body(
            &bulkhead,
            vec![
                Poll::Pending,
                Poll::Ready(Some(Ok(Frame::data(Bytes::from("a"))))),
                Poll::Ready(Some(Err("reset"))),
            ],
        );
        assert_eq!(body.size_hint().exact(), Some(7));
        assert!(poll(&mut body).is_pending());
        assert!(matches!(poll(&mut body), Poll::Ready(Some(Ok(_)))));
        assert_eq!(bulkhead.state().active, 1);
        assert!(matches!(poll(&mut body), Poll::Ready(Some(Err("reset")))));
        assert_eq!(bulkhead.state().active, 0);
        // Fused: the inner body (which would panic) is not polled again.
        assert!(matches!(poll(&mut body), Poll::Ready(None)));
        assert!(body.is_end_stream());
        assert_eq!(body.size_hint().exact(), Some(0));
    }

    #[test]
    fn the_end_releases_and_the_body_stays_ended() {
        let bulkhead = Bulkhead::new(1).unwrap();
        let mut body = body(&bulkhead, vec![Poll::Ready(None)]);
        assert!(!body.is_end_stream());
        assert!(matches!(poll(&mut body), Poll::Ready(None)));
        assert_eq!(bulkhead.state().active, 0);
        assert!(matches!(poll(&mut body), Poll::Ready(None)));
        assert!(!body.holds_permit());
    }
}
