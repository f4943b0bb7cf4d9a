//! Admission control for LLM calls: should this call run right now?
//!
//! An [`LlmBulkhead`] sits between a gateway and its LLM provider. It enforces a hard cap on
//! calls in flight and, optionally, on tokens in flight (estimated input plus maximum output,
//! corrected by the usage the call reports as it streams and at release), with a
//! high-priority reserve, an optional short FIFO queue, atomic versioned limits pushed by a
//! control plane, typed lifecycle events, and a graceful close/drain. Refusals are immediate,
//! typed, and carry a capacity snapshot for a 429/503 body.
//!
//! - [`LlmBulkhead`]: the bulkhead; built by [`LlmBulkhead::builder`], with a queueing
//!   [`Profile`].
//! - [`try_acquire`](LlmBulkhead::try_acquire) (never waits), [`acquire`](LlmBulkhead::acquire)
//!   (may wait in the queue), [`acquire_blocking`](LlmBulkhead::acquire_blocking), and
//!   [`run`](LlmBulkhead::run) (acquire, call, settle).
//! - [`Permit`] / [`OwnedPermit`]: RAII admissions; report streamed usage
//!   ([`Permit::report_usage`], [`Progressive`]), release with usage or drop. Both (and a
//!   `run` callback's [`RunContext`]) dereference to the call's [`Admission`].
//! - [`close`](LlmBulkhead::close), [`drain`](LlmBulkhead::drain),
//!   [`drain_timeout`](LlmBulkhead::drain_timeout): graceful shutdown.
//! - [`Rejection`]: a capacity refusal ([`RejectReason`], [`CapacityDetail`]);
//!   [`HttpRefusal`]: a refusal as an HTTP status and a provider-shaped JSON error body.
//! - [`Limits`]: the versioned limits snapshot for [`LlmBulkhead::apply_limits`].
//! - [`Stats`]: counters and live figures.
//! - [`Tenants`]: per-tenant limits, a bulkhead per key made from a template on first use,
//!   evicted once idle, at most `max_tenants` at a time.
//! - [`Event`]: lifecycle events for [`LlmBulkhead::on`], with admission timing.
//! - [`LlmRequest`], [`Reservation`], [`TokenUsage`]: what is asked, reserved and used; with the
//!   `serde` feature an `LlmRequest` reads OpenAI and Anthropic request bodies as they come.
//! - [`Estimator`]: sizes reservations; [`ModelAwareEstimator`] (the default, per-model-family
//!   chars-per-token ratios), [`NaiveEstimator`], [`AdaptiveEstimator`] (learns a per-model
//!   correction from reported usage), or any closure.
//!
//! # How a decision is made
//!
//! Slots in flight, tokens in flight, a limits epoch and the closed flag share one atomic word.
//! An admission reads it, reads the limits published for its epoch, decides with a pure function
//! and commits slot and tokens together with one compare-and-swap: no lock, no allocation, no
//! transient half-admission that could make another call fail spuriously. A change of limits
//! advances the epoch, so a decision made under old limits cannot commit after the change
//! returns. Statistics live in per-thread shards, so no shared counter slows the fast path.
//!
//! That fast path (no admission class, or a class call within its class's floors: one
//! compare-and-swap of the class's word) is lock-free. A class call beyond its floors takes its
//! class's lock for a few instructions; waiting in the queue, changing limits, closing,
//! deduplication and [`Tenants`] take short locks. `docs/design.md` in the repository lists
//! every path ("Progress, path by path").
//!
//! # Examples
//!
//! ```
//! use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Priority, TokenBudget, TokenUsage};
//!
//! let bulkhead = LlmBulkhead::builder("claude-sonnet-4", 10)
//!     .token_budget(TokenBudget::new(200_000).high_priority_reserve(40_000))
//!     .build()?;
//!
//! let request = LlmRequest::new()
//!     .system("You are a helpful assistant.")
//!     .user("Write a haiku about backpressure.")
//!     .max_tokens(256);
//!
//! match bulkhead.try_acquire(&request, AcquireOptions::new().priority(Priority::High)) {
//!     Ok(permit) => {
//!         // ... call the provider, then settle with the usage it reported ...
//!         let report = permit.release(Some(TokenUsage::new(24, 17)?));
//!         assert_eq!(report.refunded_tokens, report.held_tokens - 41);
//!     }
//!     Err(err) => {
//!         // Respond 429/503 with `err.rejection().map(|r| r.detail())` in the body.
//!         panic!("unexpected refusal: {err}");
//!     }
//! }
//! assert_eq!(bulkhead.stats().in_flight, 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Streaming usage
//!
//! A streamed response reports the provider's cumulative usage as it arrives; each report
//! moves the admission's hold at once, so the budget reflects what calls really use while they
//! run, not only after they finish.
//!
//! ```
//! use async_bulkhead_llm::*;
//!
//! let bulkhead = LlmBulkhead::builder("gpt-4o", 4).token_budget(TokenBudget::new(5_000)).build()?;
//! let request = LlmRequest::new().user("x".repeat(3_700)).max_tokens(1_000);
//! let mut permit = bulkhead.try_acquire(&request, AcquireOptions::new())?;
//! assert_eq!(permit.held_tokens(), 2_000); // 1,000 estimated input + 1,000 output
//!
//! // First chunk: the prompt was 700 tokens; 300 go back to the budget now.
//! permit.report_usage(TokenUsage::new(700, 12)?)?;
//! assert_eq!(bulkhead.stats().token_budget.unwrap().in_flight_tokens, 1_700);
//! // Later: with the cap known, hold only what may still come (plus a margin).
//! permit.report_usage_progressive(TokenUsage::new(700, 600)?, Progressive::new(400).safety_margin(50))?;
//! assert_eq!(permit.held_tokens(), 450);
//!
//! let report = permit.release(None); // settles with the last reported usage
//! assert_eq!(report.usage, Some(TokenUsage::new(700, 600)?));
//! let tokens = bulkhead.stats().token_budget.unwrap();
//! // Refunds are gross (300 + 1,250); settling at 1,300 held 850 of them again.
//! assert_eq!((tokens.total_consumed, tokens.total_refunded, tokens.total_reheld), (1_300, 1_550, 850));
//! assert_eq!(tokens.in_flight_tokens, 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Events
//!
//! [`LlmBulkhead::on`] subscribes a listener to typed [`Event`]s (admit, reject, usage,
//! release, reconfigure), delivered synchronously where they happen, in registration order,
//! never under a lock of the bulkhead. Admit and reject events carry the decision time and the
//! queue wait. With no listener, an event costs one relaxed atomic load.
//!
//! ```
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use std::sync::Arc;
//! use async_bulkhead_llm::*;
//!
//! let bulkhead = LlmBulkhead::builder("gpt-4o", 4).build()?;
//! let admitted = Arc::new(AtomicU64::new(0));
//! let counter = admitted.clone();
//! let subscription = bulkhead.on_events([EventKind::Admit], move |event| {
//!     if let Event::Admit(admit) = event {
//!         assert_eq!(admit.queue_wait, std::time::Duration::ZERO); // admitted at once
//!         counter.fetch_add(1, Ordering::Relaxed);
//!     }
//! });
//! drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?);
//! drop(subscription); // unsubscribes
//! drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?);
//! assert_eq!(admitted.load(Ordering::Relaxed), 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! **Sampled listeners, metrics, tracing.** [`LlmBulkhead::on_events_sampled`] hears one call
//! in `n` per thread (and every call that waited in the queue) for its whole life, so a
//! listener that times calls stays cheap. The `metrics` feature builds `BulkheadMetrics` on it
//! (counters and gauges written from [`stats`](LlmBulkhead::stats), sampled histograms,
//! OpenTelemetry GenAI token usage); the `tracing` feature opens spans around queued waits and
//! [`run`](LlmBulkhead::run), and `trace_events` logs a bulkhead's events at `DEBUG` with their
//! admission ids.
//!
//! # Waiting
//!
//! With `max_queue > 0` (e.g. [`Profile::Batch`]), a call that finds no free slot may wait in
//! one strictly FIFO queue. Capacity that frees up is *handed* to the queue head (its slot and
//! its tokens in one step), so nobody barges past a waiter. Tokens never make a call wait: a
//! call whose tokens do not fit is refused at once. Futures work on any executor (tokio,
//! smol, async-std, `futures::executor`); queue timeouts need no runtime timer (but can use
//! tokio's, see below).
//!
//! Queue timeouts and drain deadlines are served by one process-wide timer: a clock thread,
//! started on first use, and a waker thread that calls the wakers of passed deadlines, normally
//! within a millisecond or two. Wakers are your executor's code: one that panics is caught
//! (and costs only its own wake-up); wakers that block hold back other deadlines by about 2 ms,
//! not by as long as they block, while fewer than 64 block at once (the clock starts a waker
//! thread for each waker that has waited 2 ms for one, up to 64 threads: measured, a 20 ms
//! timeout due behind 40 wakers blocking 150 ms fired 2.4 ms late); past 64 blocking at once, a
//! deadline waits for a waker thread to come free (behind 70 wakers blocking 300 ms: 293 ms
//! late); and none is called or dropped while the timer's lock is held, so a waker may own
//! tasks that use the timer too.
//!
//! **Tokio's clock (feature `tokio`).** With the feature on, a queue timeout, a follower's own
//! timeout ([`run_shared`](LlmBulkhead::run_shared)), a borrowed-slot deadline
//! ([`RunOptions::borrowed_concurrency_deadline`]) or a drain deadline that is polled inside a
//! tokio runtime whose time driver is on waits on `tokio::time` instead, from tokio's "now"
//! when the wait began. So under a paused clock (`#[tokio::test(start_paused = true)]`,
//! `tokio::time::pause`) it passes in virtual time: a 2 s timeout fires as soon as the runtime
//! is idle, after 2 s of tokio's clock and no real wait (without the feature the crate's timer
//! waits the 2 s of real time while the paused clock stands still). Everywhere else (no
//! runtime, a tokio runtime built without `enable_time`, another executor, blocking acquires)
//! the crate's own timer is used, exactly as without the feature. tokio has no query for
//! whether a runtime's time driver is on, so the first timed wait in each runtime creates its
//! tokio sleep under `catch_unwind`: in a runtime without a time driver that probe panics once
//! (your panic hook reports it once per such runtime) and the runtime is remembered. Under
//! `panic = "abort"` nothing can be caught, so there the crate's own timer is always used. A
//! wait on tokio's clock must be polled by that runtime (do not `block_on` it on one of the
//! runtime's own threads, or with another executor inside the runtime's context: nothing
//! would drive the clock).
//!
#![cfg_attr(feature = "tokio", doc = "```")]
#![cfg_attr(not(feature = "tokio"), doc = "```ignore")]
//! use std::time::Duration;
//! use async_bulkhead_llm::{AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, RejectReason};
//!
//! let runtime = tokio::runtime::Builder::new_current_thread()
//!     .enable_time()
//!     .start_paused(true) // tokio's `test-util` feature
//!     .build()?;
//! runtime.block_on(async {
//!     let bulkhead = LlmBulkhead::builder("gpt-4o", 1).max_queue(4).build()?;
//!     let request = LlmRequest::new();
//!     let _held = bulkhead.try_acquire(&request, AcquireOptions::new())?;
//!     let started = tokio::time::Instant::now();
//!     let patient = AcquireOptions::new().timeout(Duration::from_secs(30));
//!     let waited = bulkhead.acquire(&request, patient).await;
//!     assert!(matches!(waited, Err(AcquireError::Rejected(r)) if r.reason() == RejectReason::Timeout));
//!     // 30 s of the paused clock, and no real wait.
//!     assert_eq!(started.elapsed(), Duration::from_secs(30));
//!     Ok::<(), Box<dyn std::error::Error>>(())
//! })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ```
//! use std::time::Duration;
//! use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Profile};
//!
//! # futures::executor::block_on(async {
//! let bulkhead = LlmBulkhead::builder("gpt-4o", 8).profile(Profile::Batch).build()?;
//! let request = LlmRequest::new().user("Classify this ticket.").max_tokens(64);
//! let options = AcquireOptions::new().timeout(Duration::from_secs(5));
//! let label = bulkhead
//!     .run(&request, options, async |ctx| {
//!         // call the provider with `ctx.admission_id()` in the trace
//!         Ok::<_, std::io::Error>("billing")
//!     })
//!     .await?;
//! assert_eq!(label, "billing");
//!
//! bulkhead.close();
//! bulkhead.drain().await;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! # Features
//!
//! - `serde` (default): `Serialize`/`Deserialize` for [`LlmRequest`] and its parts and for
//!   [`Limits`]; `Serialize` for [`Stats`], for [`Rejection`] and its [`CapacityDetail`], for
//!   ids, [`Priority`] and [`AdmissionClass`]; [`HttpRefusal::body`].
//! - `axum` (enables `serde`): `axum::response::IntoResponse` for [`Rejection`],
//!   [`AcquireError`], [`RequestError`] and [`HttpRefusal`] (axum 0.8): the status and the
//!   JSON error body of [`HttpRefusal`], as `application/json`.
//! - `tokio`: queue timeouts and deadlines polled inside a tokio runtime whose time driver is
//!   on wait on `tokio::time`, so they follow a paused clock (see [Waiting](#waiting)); the
//!   crate's own timer everywhere else. Depends on tokio 1.49+ (`rt` and `time` only).
//! - `loom` (unstable, outside semver): builds the crate against loom's model types when
//!   compiled with `RUSTFLAGS="--cfg loom"`; used by the `loom-tests` workspace member.
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
// A rejection carries its whole capacity snapshot by value (with admission classes, the class
// and shared-pool figures too: about 340 bytes), so that refusing never allocates. Boxing it
// would cost an allocation per refusal, the path that must stay cheapest under overload; the
// copies are measured in `benches/` (the rejection line) instead.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]
#![doc(test(attr(deny(warnings, rust_2018_idioms), allow(dead_code, unused_variables))))]

// The plain vocabulary every layer shares (imports nothing above it).
mod admission_class;
mod admission_id;
mod contain;
mod error;
mod http;
mod priority;
mod rejection;
mod reservation;
mod sync;

// The admission engine (imports only the vocabulary).
mod engine;

// Events and statistics over the engine.
mod events;
mod stats;

// The general bulkhead (imports the engine and the vocabulary).
mod bulkhead;

// The LLM wing (imports everything below it).
mod llm;

// Integrations with other crates, over the public API (behind their features).
#[cfg(any(
    feature = "axum",
    feature = "tower",
    feature = "metrics",
    feature = "tracing"
))]
mod integrations;

/// The named futures of the crate.
pub mod futures {
    pub use crate::bulkhead::acquire::{BulkheadAcquire, BulkheadAcquireOwned};
    pub use crate::engine::drain::{Drain, DrainTimeout};
    pub use crate::llm::acquire::{Acquire, AcquireOwned};
}

pub use admission_class::{AbandonCause, AdmissionClass, ClassLimits, Resources};
pub use admission_id::{AdmissionId, ShadowId};
pub use bulkhead::Bulkhead;
pub use bulkhead::builder::{BulkheadBuilder, DEFAULT_MAX_QUEUE, DEFAULT_QUEUE_TIMEOUT};
pub use bulkhead::error::{BulkheadConfigError, BulkheadError, BulkheadState};
pub use bulkhead::limits::BulkheadLimits;
pub use bulkhead::permit::{BulkheadPermit, OwnedBulkheadPermit};
pub use bulkhead::stats::BulkheadStats;
pub use engine::drain::DrainReport;
pub use engine::limits::{
    ApplyOutcome, BudgetLimits, ClassLimitsTable, Limits, MAX_BUDGET, MAX_CONCURRENT, MAX_REVISION,
};
pub use engine::policy::Verdict;
pub use error::{
    AcquireError, ClassField, ClassLimitsError, ClassLookupError, ConfigError, EstimatorError,
    LimitsError, RequestError, UsageError,
};
pub use events::{
    AdmitEvent, BorrowedConcurrencyAbandonEvent, BypassEvent, BypassReleaseEvent, BypassUsageEvent,
    DedupEvent, Event, EventKind, ReconfigureEvent, RejectEvent, ReleaseEvent, Subscription,
    UsageEvent,
};
pub use http::HttpRefusal;
#[cfg(feature = "metrics")]
pub use integrations::metrics::{
    BulkheadMetrics, BulkheadMetricsBuilder, DEFAULT_SAMPLE_EVERY, Publisher,
};
#[cfg(feature = "tower")]
pub use integrations::tower::{
    BoxError, DEFAULT_MAX_REQUEST_BODY, LayerError, LlmBody, LlmLayer, LlmService, provider_usage,
};
#[cfg(feature = "tower")]
pub use integrations::tower_bulkhead::{BulkheadBody, BulkheadLayer, BulkheadService};
#[cfg(feature = "tracing")]
pub use integrations::tracing::{trace_events, trace_events_sampled};
pub use llm::admission::Admission;
pub use llm::builder::{AdmissionClasses, LlmBulkheadBuilder, Profile, TokenBudget};
pub use llm::bulkhead::LlmBulkhead;
pub use llm::context::RunContext;
pub use llm::dedup::Deduplication;
pub use llm::estimate::{
    AdaptiveEstimator, AdaptiveEstimatorBuilder, Correction, Estimator, Memo, ModelAwareEstimator,
    ModelAwareEstimatorBuilder, NaiveEstimator, OpaqueBlockTokens, TokenEstimate,
};
pub use llm::observe::Bypass;
pub use llm::options::{AcquireOptions, DedupScope, NotShadowable, RunOptions, ShadowReasons};
pub use llm::permit::{OwnedPermit, Permit};
pub use llm::request::{Content, ContentBlock, LlmRequest, Message};
pub use llm::run::{BorrowedConcurrencyDeadlineError, RunError};
pub use llm::run_shared::Sharing;
pub use llm::tenants::{Tenants, TenantsBuilder, TenantsConfigError, TenantsError};
pub use priority::Priority;
pub use rejection::{
    CapacityDetail, ClassDetail, ClassTokenDetail, Constraint, RejectReason, Rejection,
    SharedCapacity, SharedPool, TokenBudgetDetail,
};
pub use reservation::{
    DEFAULT_OUTPUT_CAP, Progressive, ReleaseReport, Reservation, TokenUsage, UsageReport,
};
pub use stats::{
    AbandonCounts, ClassStats, ClassesStats, DedupStats, ObserveStats, RejectionCounts,
    SharedStats, SharedTokenStats, Stats, TokenBudgetStats,
};

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// Every public type is `Send` and `Sync` (checked at compile time).
#[allow(dead_code)]
fn _assert_send_sync() {
    fn both<T: Send + Sync>() {}
    both::<LlmBulkhead>();
    both::<Bulkhead>();
    both::<BulkheadPermit<'static>>();
    both::<OwnedBulkheadPermit>();
    both::<BulkheadError>();
    both::<BulkheadStats>();
    both::<futures::BulkheadAcquire<'static>>();
    both::<futures::BulkheadAcquireOwned>();
    both::<Permit<'static>>();
    both::<OwnedPermit>();
    both::<Admission>();
    both::<Rejection>();
    both::<AcquireError>();
    both::<Stats>();
    both::<Limits>();
    both::<LlmBulkheadBuilder>();
    both::<AdmissionId>();
    both::<LlmRequest>();
    both::<futures::Acquire<'static, 'static>>();
    both::<futures::AcquireOwned>();
    both::<futures::Drain<'static>>();
    both::<futures::DrainTimeout<'static>>();
    both::<RunContext<'static>>();
    both::<RunError<std::io::Error>>();
    both::<AdmissionClass>();
    both::<AdmissionClasses>();
    both::<RunOptions>();
    both::<BorrowedConcurrencyDeadlineError>();
    both::<Deduplication>();
    both::<Sharing<String>>();
    both::<Bypass>();
    both::<ShadowId>();
    both::<ShadowReasons>();
    both::<DedupScope>();
    both::<HttpRefusal>();
    both::<Tenants<String>>();
    both::<TenantsBuilder<String>>();
    both::<TenantsError>();
    both::<TenantsConfigError>();
    #[cfg(feature = "metrics")]
    {
        both::<BulkheadMetrics>();
        both::<BulkheadMetricsBuilder>();
        both::<Publisher>();
    }
    #[cfg(feature = "tower")]
    {
        both::<BulkheadLayer>();
        both::<BulkheadService<()>>();
        both::<BulkheadBody<http_body_util::Full<bytes::Bytes>>>();
    }
}
