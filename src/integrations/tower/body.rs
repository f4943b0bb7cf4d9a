//! The response body both layers return, and the refusal response.
//!
//! [`HeldBody`] is either the layer's own answer (a refusal, sent as one frame) or the inner
//! service's body with what the admitted call holds (a [`Hold`]: the permit, and for the LLM
//! layer the usage reader). The hold sees every data frame as it passes and is settled by
//! being dropped, exactly once, at the first of: the inner body's end (`Ready(None)`, or a
//! frame after which it reports [`is_end_stream`](Body::is_end_stream): a server may never
//! poll a finished sized body again), an error frame, or the drop of this body (a client gone
//! mid-body). The inner body is dropped with its hold and never polled again: the body is
//! fused, and answers `Ready(None)` from then on.

use core::pin::Pin;
use core::task::{Context, Poll};

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body::{Body, Frame, SizeHint};

use crate::http::HttpRefusal;

/// What an admitted call holds while its response body streams: settled when dropped.
pub(super) trait Hold {
    /// A data frame passed on to the client (the LLM layer reads the provider's usage here;
    /// by default nothing).
    fn observe(&mut self, _data: &Bytes) {}

    /// The inner body ended or failed (the hold is dropped next): a drop without this call is
    /// a client gone mid-body.
    fn ended(&mut self) {}
}

/// The response body of a layer: its own answer, or the inner body and the call's hold.
pub(super) struct HeldBody<B, H> {
    state: State<B, H>,
}

enum State<B, H> {
    /// The layer's own answer; `None` once sent.
    Answer(Option<Bytes>),
    /// The inner body, pinned in its own box (so that the body is `Unpin`), and the call's
    /// hold.
    Streaming(Streaming<B, H>),
    /// The inner body ended or failed: dropped with its hold, and the body stays ended.
    Done,
}

struct Streaming<B, H> {
    inner: Pin<Box<B>>,
    hold: H,
}

impl<B, H: Hold> HeldBody<B, H> {
    /// The inner body of an admitted call, holding `hold` until it ends.
    pub(super) fn admitted(body: B, hold: H) -> HeldBody<B, H> {
        HeldBody {
            state: State::Streaming(Streaming {
                inner: Box::pin(body),
                hold,
            }),
        }
    }

    /// Whether this body still holds its call (false for the layer's own answer, and once
    /// the inner body ended or failed).
    pub(super) fn holds(&self) -> bool {
        matches!(self.state, State::Streaming(_))
    }

    /// Polls the next frame: the answer's one frame, or the inner body's, settling the hold
    /// at the end or at an error.
    pub(super) fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>>
    where
        B: Body<Data = Bytes>,
    {
        match &mut self.state {
            State::Answer(body) => Poll::Ready(body.take().map(|b| Ok(Frame::data(b)))),
            State::Streaming(streaming) => match streaming.inner.as_mut().poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        streaming.hold.observe(data);
                    }
                    // A server that sees the end may never poll again (a sized body): settle
                    // with this last frame.
                    if streaming.inner.is_end_stream() {
                        streaming.hold.ended();
                        self.state = State::Done;
                    }
                    Poll::Ready(Some(Ok(frame)))
                }
                Poll::Ready(Some(Err(error))) => {
                    streaming.hold.ended();
                    self.state = State::Done;
                    Poll::Ready(Some(Err(error)))
                }
                Poll::Ready(None) => {
                    streaming.hold.ended();
                    self.state = State::Done;
                    Poll::Ready(None)
                }
                Poll::Pending => Poll::Pending,
            },
            State::Done => Poll::Ready(None),
        }
    }

    /// [`Body::is_end_stream`]: the answer's, else the inner body's.
    pub(super) fn is_end_stream(&self) -> bool
    where
        B: Body,
    {
        match &self.state {
            State::Answer(body) => body.is_none(),
            State::Streaming(streaming) => streaming.inner.is_end_stream(),
            State::Done => true,
        }
    }

    /// [`Body::size_hint`]: the answer's exact size, else the inner body's hint.
    pub(super) fn size_hint(&self) -> SizeHint
    where
        B: Body,
    {
        match &self.state {
            State::Answer(Some(body)) => SizeHint::with_exact(body.len() as u64),
            State::Answer(None) | State::Done => SizeHint::with_exact(0),
            State::Streaming(streaming) => streaming.inner.size_hint(),
        }
    }
}

/// The layer's own answer: `status`, `body` as [`HttpRefusal`]'s JSON content type, and a
/// `Retry-After` of `retry_after` seconds when there is one.
pub(super) fn answer(status: StatusCode, body: Bytes, retry_after: Option<u64>) -> Response<Bytes> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static(HttpRefusal::CONTENT_TYPE),
    );
    if let Some(seconds) = retry_after {
        headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}

/// An answer made whole (status, headers, body) as the layer's response.
pub(super) fn send<B, H>(answer: Response<Bytes>) -> Response<HeldBody<B, H>> {
    answer.map(|body| HeldBody {
        state: State::Answer(Some(body)),
    })
}
