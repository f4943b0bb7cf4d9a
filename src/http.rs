//! Refusals as HTTP answers, for both bulkheads: which status, error type, code and message a
//! gateway answers a [`Rejection`], a [`RequestError`] or an [`AcquireError`] with
//! ([`HttpRefusal`]), and, with the `serde` feature, the JSON error body in the shape LLM
//! providers use; and the general bulkhead's [`BulkheadError`] (always 503, a small JSON body,
//! [`BulkheadError::http_body`]). It depends on no HTTP crate: statuses are plain `u16`s; the
//! `axum` feature turns these into responses and the tower layers answer with them.
//!
//! | refusal | status | `type` |
//! |---|---|---|
//! | `concurrency_limit`, `queue_limit`, `budget_limit`, `rate_limit` | 429 Too Many Requests | `rate_limit_error` |
//! | `budget_limit` or `rate_limit` for a call that can never fit (more than the budget, a class's ceiling or a whole window) | 413 Content Too Large | `request_too_large` |
//! | `shutdown` | 503 Service Unavailable | `unavailable_error` |
//! | `timeout` (in the queue) | 503 Service Unavailable | `overloaded_error` |
//! | `aborted` | 499 (client closed request) | `client_closed_request` |
//! | an invalid request ([`RequestError`]) | 400 Bad Request | `invalid_request_error` |
//!
//! - **413.** A call whose reservation exceeds what the limits in force let it hold even with
//!   nothing in flight ([`CapacityDetail::can_never_fit`](crate::rejection::CapacityDetail::can_never_fit): more tokens than the budget its
//!   priority may use, or than its class's token ceiling) is refused `budget_limit` like any
//!   call that does not fit now, but a retry cannot succeed: it is answered 413, and its
//!   message says that it can never fit, so that a client does not retry it unchanged.
//! - **503 for a queue timeout, not 504.** 504 says an upstream did not answer in time; here
//!   no upstream was called: the bulkhead itself gave up waiting for a slot. Like `shutdown`,
//!   it is the service being unable to take the call now.
//! - **499 for `aborted`.** The caller went away while it waited (its future was dropped);
//!   499 is nginx's "client closed request", outside the standard statuses, used because no
//!   standard status says "the client left". Nobody usually receives it: there is no one left
//!   to answer. It is there for logs and access-log metrics (e.g. a reject event's reason).
//! - **No `Retry-After` here.** A fail-fast bulkhead has no honest estimate of when capacity
//!   frees up (that depends on how long the calls in flight run), so this mapping invents no
//!   header. The tower layers can add one on request (`retry_after_hint`: an estimate from
//!   their admitted calls' recent hold times, off by default), and a gateway that knows
//!   better can add its own.
//!
//! `code` is the refusal's reason (`concurrency_limit`, ...) or the kind of invalid request
//! (`reservation_overflow`, ...); `message` is the refusal's `Display`, except for a call that
//! can never fit.

use crate::bulkhead::BulkheadError;
use crate::vocabulary::error::{AcquireError, RequestError};
use crate::vocabulary::rejection::{CapacityDetail, RejectReason, Rejection, Scope};

/// 499: nginx's "client closed request", for a call whose caller went away while it waited.
const CLIENT_CLOSED_REQUEST: u16 = 499;

/// A refusal as an HTTP answer: the status, the error's `type` and `code`, a message for
/// people, and the capacity snapshot of a capacity refusal.
///
/// Built with `From` from a [`Rejection`], a [`RequestError`] or an [`AcquireError`] (the
/// mapping is in the table of this module's docs: 429 for capacity, 413 for a call that can
/// never fit, 503 for shutdown and queue timeouts, 499 for aborted, 400 for invalid requests).
/// With the `serde` feature, [`body`](HttpRefusal::body) renders the JSON error body, and the
/// refusal serializes as that body; with the `axum` feature it is an `IntoResponse`.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, http::HttpRefusal, LlmBulkhead, LlmRequest};
///
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 1).build()?;
/// let _held = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
/// let err = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).unwrap_err();
/// let refusal = HttpRefusal::from(err);
/// assert_eq!((refusal.status, refusal.error_type, refusal.code), (429, "rate_limit_error", "concurrency_limit"));
/// assert_eq!(refusal.message, "bulkhead rejected: concurrency_limit (1 of 1 slots in flight)");
/// assert_eq!(refusal.detail.unwrap().in_flight, 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HttpRefusal {
    /// The HTTP status: 429, 413, 503, 499 or 400.
    pub status: u16,
    /// The error's `type`, as providers name their error classes: `rate_limit_error`,
    /// `request_too_large`, `unavailable_error`, `overloaded_error`, `client_closed_request`,
    /// `invalid_request_error`.
    pub error_type: &'static str,
    /// The error's `code`: the refusal's reason ([`RejectReason::as_str`]) or the kind of
    /// invalid request (e.g. `reservation_overflow`).
    pub code: &'static str,
    /// What went wrong, with the figures.
    pub message: String,
    /// The capacity snapshot of a capacity refusal (none for an invalid request).
    pub detail: Option<CapacityDetail>,
    /// The level that refused, for a tenant-within-global admission
    /// ([`Rejection::scope`]); serialized as the error's `scope` when present.
    pub scope: Option<Scope>,
}

impl HttpRefusal {
    /// The content type of [`body`](HttpRefusal::body).
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::http::HttpRefusal::CONTENT_TYPE, "application/json");
    /// ```
    pub const CONTENT_TYPE: &'static str = "application/json";

    /// The answer to a refusal known by its reason and detail, e.g. from a
    /// [`RejectEvent`](crate::events::RejectEvent) (the answer a call refused `aborted` would have had,
    /// for an access log). The same as `HttpRefusal::from` the rejection.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use async_bulkhead_llm::*;
    /// use async_bulkhead_llm::{events::Event, events::EventKind, http::HttpRefusal};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 0).build()?;
    /// let seen = Arc::new(Mutex::new(None));
    /// let sink = seen.clone();
    /// let _subscription = bulkhead.on_events([EventKind::Reject], move |event| {
    ///     if let Event::Reject(reject) = event {
    ///         *sink.lock().unwrap() = Some(HttpRefusal::for_reason(reject.reason, reject.detail));
    ///     }
    /// });
    /// let err = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).unwrap_err();
    /// assert_eq!(seen.lock().unwrap().take(), Some(HttpRefusal::from(err)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn for_reason(reason: RejectReason, detail: CapacityDetail) -> HttpRefusal {
        HttpRefusal::from(Rejection::new(reason, detail))
    }

    /// The JSON error body, in the shape LLM providers use:
    /// `{"error": {"type": .., "code": .., "scope": .., "message": .., "detail": {..}}}`,
    /// `scope` (`tenant` or `global`) only for a tenant-within-global refusal, `detail` (the
    /// capacity snapshot, serialized as [`CapacityDetail`] is) omitted for an invalid request.
    /// Its content type is [`CONTENT_TYPE`](HttpRefusal::CONTENT_TYPE).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, http::HttpRefusal, LlmBulkhead, LlmRequest};
    ///
    /// let bulkhead = LlmBulkhead::builder("gpt-4o", 0).build()?;
    /// let err = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).unwrap_err();
    /// assert_eq!(
    ///     HttpRefusal::from(err).body(),
    ///     r#"{"error":{"type":"rate_limit_error","code":"concurrency_limit","#.to_owned()
    ///         + r#""message":"bulkhead rejected: concurrency_limit (max_concurrent is 0)","#
    ///         + r#""detail":{"limit_revision":0,"in_flight":0,"max_concurrent":0,"pending":0,"max_queue":0}}}"#,
    /// );
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[cfg(feature = "serde")]
    pub fn body(&self) -> String {
        serde_json::to_string(self).expect("an error body is strings and integers: it serializes")
    }
}

impl From<Rejection> for HttpRefusal {
    fn from(rejection: Rejection) -> HttpRefusal {
        let reason = rejection.reason();
        let detail = *rejection.detail();
        let status = rejection.http_status();
        let (error_type, message) = if status == 413 {
            ("request_too_large", never_fits(&detail))
        } else {
            (reason_type(reason), rejection.to_string())
        };
        HttpRefusal {
            status,
            error_type,
            code: reason.as_str(),
            message,
            detail: Some(detail),
            scope: rejection.scope(),
        }
    }
}

impl From<&Rejection> for HttpRefusal {
    fn from(rejection: &Rejection) -> HttpRefusal {
        HttpRefusal::from(*rejection)
    }
}

impl From<RequestError> for HttpRefusal {
    fn from(error: RequestError) -> HttpRefusal {
        HttpRefusal {
            status: error.http_status(),
            error_type: "invalid_request_error",
            code: request_code(&error),
            message: AcquireError::Invalid(error).to_string(),
            detail: None,
            scope: None,
        }
    }
}

impl From<AcquireError> for HttpRefusal {
    fn from(error: AcquireError) -> HttpRefusal {
        match error {
            AcquireError::Rejected(rejection) => HttpRefusal::from(rejection),
            AcquireError::Invalid(error) => HttpRefusal::from(error),
        }
    }
}

impl From<&AcquireError> for HttpRefusal {
    fn from(error: &AcquireError) -> HttpRefusal {
        HttpRefusal::from(*error)
    }
}

impl RejectReason {
    /// The HTTP status of a refusal for this reason, from the reason alone: 429 for capacity
    /// (`concurrency_limit`, `budget_limit`, `queue_limit`), 503 for `shutdown` and `timeout`,
    /// 499 for `aborted`. A `budget_limit` refusal of a call that can never fit is 413, which
    /// only its detail tells: see [`Rejection::http_status`].
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::RejectReason;
    ///
    /// assert_eq!(RejectReason::QueueLimit.http_status(), 429);
    /// assert_eq!(RejectReason::Timeout.http_status(), 503);
    /// assert_eq!(RejectReason::Aborted.http_status(), 499);
    /// ```
    pub const fn http_status(self) -> u16 {
        match self {
            RejectReason::ConcurrencyLimit
            | RejectReason::BudgetLimit
            | RejectReason::QueueLimit
            | RejectReason::RateLimit => 429,
            RejectReason::Shutdown | RejectReason::Timeout => 503,
            RejectReason::Aborted => CLIENT_CLOSED_REQUEST,
        }
    }
}

impl Rejection {
    /// The HTTP status to answer this refusal with: its reason's
    /// ([`RejectReason::http_status`]), except 413 for a `budget_limit` refusal of a call that
    /// can never fit ([`CapacityDetail::can_never_fit`](crate::rejection::CapacityDetail::can_never_fit)).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 4).token_budget(TokenBudget::new(1000)).build()?;
    /// let options = AcquireOptions::new().reservation(Reservation::new(500, 1000)?);
    /// let err = bulkhead.try_acquire(&LlmRequest::new(), options).unwrap_err();
    /// assert_eq!(err.rejection().unwrap().http_status(), 413); // 1,500 tokens of 1,000: never
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn http_status(&self) -> u16 {
        match self.reason() {
            RejectReason::BudgetLimit if self.detail().can_never_fit() => 413,
            RejectReason::RateLimit if self.detail().rate_never_fits() => 413,
            reason => reason.http_status(),
        }
    }
}

impl RequestError {
    /// The HTTP status to answer an invalid request with: 400.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::request::RequestError;
    ///
    /// assert_eq!(RequestError::ZeroBorrowedConcurrencyDeadline.http_status(), 400);
    /// ```
    pub const fn http_status(&self) -> u16 {
        400
    }
}

impl AcquireError {
    /// The HTTP status to answer this error with: the rejection's
    /// ([`Rejection::http_status`]) or 400 for an invalid request.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireError, request::RequestError};
    ///
    /// let err = AcquireError::Invalid(RequestError::ReservationOverflow { input: 1, max_output: u64::MAX });
    /// assert_eq!(err.http_status(), 400);
    /// ```
    pub fn http_status(&self) -> u16 {
        match self {
            AcquireError::Rejected(rejection) => rejection.http_status(),
            AcquireError::Invalid(error) => error.http_status(),
        }
    }
}

impl BulkheadError {
    /// The HTTP status of every refusal of the general bulkhead: 503 Service Unavailable (the
    /// dependency behind the bulkhead is saturated or shut down; the client did nothing
    /// wrong).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::bulkhead::Bulkhead;
    ///
    /// let bulkhead = Bulkhead::builder(1).max_queue(0).build()?;
    /// let _held = bulkhead.try_acquire()?;
    /// assert_eq!(bulkhead.try_acquire().unwrap_err().http_status(), 503);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub const fn http_status(&self) -> u16 {
        503
    }

    /// The JSON body of the refusal, with the occupancy it saw:
    /// `{"error":{"type":"<as_str>","message":"<Display>","active":N,"queued":M}}`
    /// (`application/json`; what the axum response and the tower layer send).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::bulkhead::Bulkhead;
    ///
    /// let bulkhead = Bulkhead::builder(1).max_queue(0).build()?;
    /// let _held = bulkhead.try_acquire()?;
    /// let body = bulkhead.try_acquire().unwrap_err().http_body();
    /// assert!(body.starts_with(r#"{"error":{"type":"bulkhead_queue_full","#));
    /// assert!(body.ends_with(r#""active":1,"queued":0}}"#));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[cfg(feature = "serde")]
    pub fn http_body(&self) -> String {
        #[derive(serde::Serialize)]
        struct Envelope<'a> {
            error: Detail<'a>,
        }

        /// Fields in this order: `type`, `message`, `active`, `queued`.
        #[derive(serde::Serialize)]
        struct Detail<'a> {
            #[serde(rename = "type")]
            kind: &'a str,
            message: String,
            active: u64,
            queued: u64,
        }

        let state = self.state();
        let envelope = Envelope {
            error: Detail {
                kind: self.as_str(),
                message: self.to_string(),
                active: state.active,
                queued: state.queued,
            },
        };
        // A struct of strings and integers always serializes.
        serde_json::to_string(&envelope).unwrap_or_default()
    }
}

/// The error `type` of a refusal that could succeed later.
const fn reason_type(reason: RejectReason) -> &'static str {
    match reason {
        RejectReason::ConcurrencyLimit
        | RejectReason::BudgetLimit
        | RejectReason::QueueLimit
        | RejectReason::RateLimit => "rate_limit_error",
        RejectReason::Shutdown => "unavailable_error",
        RejectReason::Timeout => "overloaded_error",
        RejectReason::Aborted => "client_closed_request",
    }
}

/// The message of a call that can never fit: the limit it exceeds, with the figures, and that
/// retrying it unchanged cannot help.
fn never_fits(detail: &CapacityDetail) -> String {
    const ADVICE: &str = "even with nothing in flight, so it can never fit: do not retry it unchanged (reserve fewer tokens)";
    if let Some(budget) = detail.token_budget.filter(|budget| budget.can_never_fit()) {
        return format!(
            "request too large: it reserves {} tokens, more than the effective token budget of {} {ADVICE}",
            budget.requested, budget.effective_budget
        );
    }
    // A window's refusal first: its snapshot may show a class ceiling the call is within.
    if detail.rate_never_fits() {
        return format!(
            "request too large: it reserves more tokens than its rate window allows in a whole window {ADVICE}"
        );
    }
    if let Some(class) = detail.admission_class()
        && let Some(tokens) = class.token_budget
        && let Some(ceiling) = tokens.max_in_flight_tokens
        && tokens.requested > ceiling
    {
        return format!(
            "request too large: it reserves {} tokens, more than admission class {:?}'s ceiling of {ceiling} tokens {ADVICE}",
            tokens.requested,
            class.class.id(),
        );
    }
    // `can_never_fit` says one of the two: this line is not reached.
    format!("request too large: it reserves more tokens than it may ever hold {ADVICE}")
}

/// The error `code` of an invalid request: the variant's name in snake_case.
const fn request_code(error: &RequestError) -> &'static str {
    match error {
        RequestError::ReservationOverflow { .. } => "reservation_overflow",
        RequestError::ReservedMismatch { .. } => "reserved_mismatch",
        RequestError::InputOverflow { .. } => "input_overflow",
        RequestError::TextTooLarge { .. } => "text_too_large",
        RequestError::ClassesNotConfigured { .. } => "classes_not_configured",
        RequestError::ForeignClass { .. } => "foreign_class",
        RequestError::ZeroBorrowedConcurrencyDeadline => "zero_borrowed_concurrency_deadline",
    }
}

/// The body's envelope: `{"error": {..}}`.
#[cfg(feature = "serde")]
impl serde::Serialize for HttpRefusal {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeStruct, Serializer};

        /// The inner `error` object.
        struct Error<'a>(&'a HttpRefusal);

        impl serde::Serialize for Error<'_> {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                let refusal = self.0;
                let fields = 3
                    + usize::from(refusal.detail.is_some())
                    + usize::from(refusal.scope.is_some());
                let mut s = serializer.serialize_struct("Error", fields)?;
                s.serialize_field("type", refusal.error_type)?;
                s.serialize_field("code", refusal.code)?;
                match refusal.scope {
                    Some(scope) => s.serialize_field("scope", scope.as_str())?,
                    None => s.skip_field("scope")?,
                }
                s.serialize_field("message", &refusal.message)?;
                match &refusal.detail {
                    Some(detail) => s.serialize_field("detail", detail)?,
                    None => s.skip_field("detail")?,
                }
                s.end()
            }
        }

        let mut s = serializer.serialize_struct("HttpRefusal", 1)?;
        s.serialize_field("error", &Error(self))?;
        s.end()
    }
}

#[cfg(all(test, feature = "serde", not(loom)))]
mod tests {
    use crate::bulkhead::{BulkheadError, BulkheadState};

    #[test]
    fn a_bulkhead_refusal_body_names_the_refusal_and_its_occupancy_in_order() {
        let error = BulkheadError::QueueFull {
            state: BulkheadState::new(2, 1),
        };
        assert_eq!(
            error.http_body(),
            r#"{"error":{"type":"bulkhead_queue_full","message":"bulkhead queue full (2 active, 1 queued); the call was shed: do not retry it","active":2,"queued":1}}"#
        );
    }
}
