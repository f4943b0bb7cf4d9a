//! Admission control for LLM calls: should this call run right now?
//!
//! An [`LlmBulkhead`] sits between a gateway and its LLM provider. It enforces a hard cap on
//! calls in flight and, optionally, on tokens in flight (estimated input plus maximum output,
//! corrected by the usage the call reports as it streams and at release), with a
//! high-priority reserve, an optional short FIFO queue, atomic versioned limits pushed by a
//! control plane, typed lifecycle events, and a graceful close/drain. Refusals are immediate,
//! typed, and carry a capacity snapshot for a 429/503 body.
//!
//! # Two minutes
//!
//! ```
//! use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, TokenBudget, TokenUsage};
//!
//! // 10 calls in flight, 200,000 tokens in flight (40,000 only for high-priority calls),
//! // and up to 20 calls waiting for a slot.
//! let bulkhead = LlmBulkhead::builder("claude-sonnet-4", 10)
//!     .token_budget(TokenBudget::new(200_000).high_priority_reserve(40_000))
//!     .max_queue(20)
//!     .build()?;
//! let request = LlmRequest::new().user("Summarise this thread.").max_tokens(512);
//!
//! // Fail fast: admitted now, or refused now with a reason and a capacity snapshot.
//! match bulkhead.try_acquire(&request, AcquireOptions::new()) {
//!     // Call the provider, then settle with the usage it reported.
//!     Ok(permit) => {
//!         permit.release(Some(TokenUsage::new(9, 230)?));
//!     }
//!     // Answer 429/503, with `refused.rejection()`'s capacity detail in the body.
//!     Err(refused) => eprintln!("{refused}"),
//! }
//!
//! // Or wait in the FIFO queue for a slot, on any executor.
//! futures::executor::block_on(async {
//!     let mut permit = bulkhead.acquire(&request, AcquireOptions::new()).await?;
//!     permit.report_usage(TokenUsage::new(9, 40)?)?; // as the response streams
//!     drop(permit); // settles with the last reported usage
//!     Ok::<_, Box<dyn std::error::Error>>(())
//! })?;
//! assert_eq!(bulkhead.stats().in_flight, 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! In the repository, `cargo run --release --example gateway --features tower,metrics` runs a
//! real gateway on loopback (`LlmLayer` over an axum proxy to a streaming mock provider, eight
//! tenants within one global limit, its `/metrics`), `cargo run --example runtimes` the same
//! admission code under smol and async-std, and `bash scripts/test.sh` every test.
//!
//! # The crate
//!
//! - [`LlmBulkhead`]: the bulkhead; built by [`LlmBulkhead::builder`], with a queueing
//!   [`Profile`].
//! - [`try_acquire`](LlmBulkhead::try_acquire) (never waits), [`acquire`](LlmBulkhead::acquire)
//!   (may wait in the queue), [`acquire_blocking`](LlmBulkhead::acquire_blocking), and
//!   [`run`](LlmBulkhead::run) (acquire, call, settle).
//! - [`Permit`] / [`OwnedPermit`]: RAII admissions; report streamed usage
//!   ([`Permit::report_usage`], [`Progressive`](crate::usage::Progressive)), release with usage or drop. Both (and a
//!   `run` callback's [`RunContext`]) dereference to the call's [`Admission`](crate::admission::Admission).
//! - [`close`](LlmBulkhead::close), [`drain`](LlmBulkhead::drain),
//!   [`drain_timeout`](LlmBulkhead::drain_timeout): graceful shutdown.
//! - [`Rejection`]: a capacity refusal ([`RejectReason`], [`CapacityDetail`](crate::rejection::CapacityDetail));
//!   [`HttpRefusal`](crate::http::HttpRefusal): a refusal as an HTTP status and a provider-shaped JSON error body.
//! - [`Limits`]: the versioned limits snapshot for [`LlmBulkhead::apply_limits`].
//! - [`Stats`]: counters and live figures.
//! - [`Tenants`](crate::tenants::Tenants): per-tenant limits, a bulkhead per key made from a template on first use,
//!   evicted once idle, at most `max_tenants` at a time.
//! - [`Event`](crate::events::Event): lifecycle events for [`LlmBulkhead::on`], with admission timing.
//! - [`LlmRequest`], [`Reservation`], [`TokenUsage`]: what is asked, reserved and used; with the
//!   `serde` feature an `LlmRequest` reads OpenAI and Anthropic request bodies as they come.
//! - [`Estimator`](crate::estimate::Estimator): sizes reservations; [`ModelAwareEstimator`](crate::estimate::ModelAwareEstimator) (the default, per-model-family
//!   chars-per-token ratios), [`NaiveEstimator`](crate::estimate::NaiveEstimator), [`AdaptiveEstimator`](crate::estimate::AdaptiveEstimator) (learns a per-model
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
//! deduplication and [`Tenants`](crate::tenants::Tenants) take short locks. `docs/design.md` in the repository lists
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
//! use async_bulkhead_llm::{usage::Progressive};
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
//! [`LlmBulkhead::on`] subscribes a listener to typed [`Event`](crate::events::Event)s (admit, reject, usage,
//! release, reconfigure), delivered synchronously where they happen, in registration order,
//! never under a lock of the bulkhead. Admit and reject events carry the decision time and the
//! queue wait. With no listener, an event costs one relaxed atomic load.
//!
//! ```
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use std::sync::Arc;
//! use async_bulkhead_llm::*;
//! use async_bulkhead_llm::{events::Event, events::EventKind};
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
//!   [`Limits`]; `Serialize` for [`Stats`], for [`Rejection`] and its [`CapacityDetail`](crate::rejection::CapacityDetail), for
//!   ids, [`Priority`] and [`AdmissionClass`](crate::classes::AdmissionClass); [`HttpRefusal::body`](crate::http::HttpRefusal::body).
//! - `axum` (enables `serde`): `axum::response::IntoResponse` for [`Rejection`],
//!   [`AcquireError`], [`RequestError`](crate::request::RequestError) and [`HttpRefusal`](crate::http::HttpRefusal) (axum 0.8): the status and the
//!   JSON error body of [`HttpRefusal`](crate::http::HttpRefusal), as `application/json`.
//! - `tokio`: queue timeouts and deadlines polled inside a tokio runtime whose time driver is
//!   on wait on `tokio::time`, so they follow a paused clock (see [Waiting](#waiting)); the
//!   crate's own timer everywhere else. Depends on tokio 1.49+ (`rt` and `time` only).
//! - `loom` (unstable, outside semver): builds the crate against loom's model types when
//!   compiled with `RUSTFLAGS="--cfg loom"`; used by the `loom-tests` workspace member.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
// A rejection carries its whole capacity snapshot by value (with admission classes, the class
// and shared-pool figures too: about 340 bytes), so that refusing never allocates. Boxing it
// would cost an allocation per refusal, the path that must stay cheapest under overload; the
// copies are measured in `benches/` (the rejection line) instead.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]
#![doc(test(attr(deny(warnings, rust_2018_idioms), allow(dead_code, unused_variables))))]

// The layers, from the ground up; each imports only the layers below it (ARCHITECTURE.md).
// Where atomics, locks and `Arc` come from, and how user code's panics are caught.
mod support;
// Plain values every layer shares.
mod vocabulary;
// The admission engine: slots and tokens as numbers (imports only the two layers above).
mod engine;
// Events and statistics over the engine.
pub mod events;
pub mod stats;
// The general bulkhead, a face on the engine.
pub mod bulkhead;
// Refusals of both faces as HTTP answers.
pub mod http;
// The LLM wing: the LLM bulkhead, a face on the engine with requests, estimators and tokens.
mod llm;
// Integrations with other crates, over the public API (behind their features).
#[cfg(any(
    feature = "axum",
    feature = "tower",
    feature = "metrics",
    feature = "tracing"
))]
mod integrations;

// The types most users touch.
pub use bulkhead::{Bulkhead, BulkheadError};
pub use llm::builder::{LlmBulkheadBuilder, Profile, TokenBudget};
pub use llm::bulkhead::LlmBulkhead;
pub use llm::context::RunContext;
pub use llm::options::{AcquireOptions, RunOptions};
pub use llm::permit::{OwnedPermit, Permit};
pub use llm::request::LlmRequest;
pub use llm::run::RunError;
pub use stats::Stats;
pub use vocabulary::error::AcquireError;
pub use vocabulary::limits::Limits;
pub use vocabulary::priority::Priority;
pub use vocabulary::rejection::{RejectReason, Rejection};
pub use vocabulary::reservation::{Reservation, TokenUsage};

/// Admitting one LLM call: its options, its permit, the admission it holds, and what an
/// advisory check predicts.
pub mod admission {
    pub use crate::llm::admission::Admission;
    pub use crate::llm::options::AcquireOptions;
    pub use crate::llm::permit::{OwnedPermit, Permit};
    pub use crate::vocabulary::admission_id::AdmissionId;
    pub use crate::vocabulary::error::AcquireError;
    pub use crate::vocabulary::priority::Priority;
    pub use crate::vocabulary::verdict::Verdict;
}

/// Building an [`LlmBulkhead`]: its builder, queueing profiles, the token
/// budget, and what a build refuses.
pub mod builder {
    pub use crate::llm::builder::{LlmBulkheadBuilder, Profile, TokenBudget};
    pub use crate::vocabulary::error::ConfigError;
}

/// Tokens: what a call reserves, what it used, and the reports of a usage report and of a
/// release.
pub mod usage {
    pub use crate::vocabulary::error::UsageError;
    pub use crate::vocabulary::reservation::{
        DEFAULT_OUTPUT_CAP, Progressive, ReleaseReport, Reservation, TokenUsage, UsageReport,
    };
}

/// The request model: what a call asks of the provider, read from OpenAI and Anthropic bodies
/// with the `serde` feature.
pub mod request {
    pub use crate::llm::request::{Content, ContentBlock, LlmRequest, Message};
    pub use crate::vocabulary::error::RequestError;
}

/// Estimators: how a request's reservation is sized.
pub mod estimate {
    pub use crate::llm::estimate::{
        AdaptiveEstimator, AdaptiveEstimatorBuilder, Correction, Estimator, Memo,
        ModelAwareEstimator, ModelAwareEstimatorBuilder, NaiveEstimator, OpaqueBlockTokens,
        TokenEstimate,
    };
    pub use crate::vocabulary::error::EstimatorError;
}

/// Versioned limits: the snapshot a control plane pushes, what applying it did, and the
/// ceilings the admission word can count.
pub mod limits {
    pub use crate::vocabulary::error::LimitsError;
    pub use crate::vocabulary::limits::{
        ApplyOutcome, BudgetLimits, Limits, MAX_BUDGET, MAX_CONCURRENT, MAX_REVISION,
    };
}

/// Admission classes: per-class floors and ceilings over shared global limits.
pub mod classes {
    pub use crate::llm::builder::AdmissionClasses;
    pub use crate::vocabulary::admission_class::{
        AbandonCause, AdmissionClass, ClassLimits, Resources,
    };
    pub use crate::vocabulary::error::{ClassField, ClassLimitsError, ClassLookupError};
    pub use crate::vocabulary::limits::ClassLimitsTable;
}

/// Capacity refusals: why a call may not run now, with the capacity snapshot of the moment.
pub mod rejection {
    pub use crate::vocabulary::rejection::{
        CapacityDetail, ClassDetail, ClassTokenDetail, Constraint, RejectReason, Rejection, Scope,
        SharedCapacity, SharedPool, TokenBudgetDetail,
    };
}

/// `run`: acquire, call and settle in one step, and what its callback gets.
pub mod run {
    pub use crate::llm::context::RunContext;
    pub use crate::llm::options::RunOptions;
    pub use crate::llm::run::{BorrowedConcurrencyDeadlineError, RunError};
}

/// In-flight deduplication: identical calls in flight share one provider call
/// ([`LlmBulkhead::run_shared`](crate::LlmBulkhead::run_shared)).
pub mod dedup {
    pub use crate::llm::dedup::Deduplication;
    pub use crate::llm::options::DedupScope;
    pub use crate::llm::run_shared::Sharing;
}

/// Observe (shadow) mode: calls the bulkhead would refuse run anyway, recorded as bypasses.
pub mod observe {
    pub use crate::llm::observe::Bypass;
    pub use crate::llm::options::{NotShadowable, ShadowReasons};
    pub use crate::vocabulary::admission_id::ShadowId;
}

/// Per-tenant limits: a bulkhead per key, made from a template on first use, evicted once
/// idle.
pub mod tenants {
    pub use crate::llm::tenants::{Tenants, TenantsBuilder, TenantsConfigError, TenantsError};
    pub use crate::llm::within::{TenantPermit, TenantReleaseReport};
    pub use crate::vocabulary::tenant_policy::{PolicyError, TenantPolicy};
}

/// Rate limits: requests and tokens per window, decided with the limits in flight
/// ([`RateLimits`](crate::rate::RateLimits)), and the clock the windows read.
pub mod rate {
    pub use crate::engine::rate::{ManualClock, RateClock, RateStatus, WindowStatus};
    pub use crate::llm::learn::{LearnBounds, LimitLearner, ProviderLimits};
    pub use crate::vocabulary::rate_limits::RateLimits;
    pub use crate::vocabulary::rejection::RateWindow;
}

/// The named futures of the crate, and where a drain with a deadline ended.
pub mod futures {
    pub use crate::bulkhead::{BulkheadAcquire, BulkheadAcquireOwned};
    pub use crate::engine::drain::{Drain, DrainTimeout};
    pub use crate::llm::acquire::{Acquire, AcquireOwned};
    pub use crate::vocabulary::drain_report::DrainReport;
}

/// Tower layers for HTTP gateways (axum, hyper): [`LlmLayer`](tower::LlmLayer) admits each
/// request through an [`LlmBulkhead`], [`BulkheadLayer`](tower::BulkheadLayer)
/// through a [`Bulkhead`]; the permit is held by the response body.
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub mod tower {
    pub use crate::integrations::tower::bulkhead::{BulkheadBody, BulkheadLayer, BulkheadService};
    pub use crate::integrations::tower::error::{BoxError, LayerError};
    pub use crate::integrations::tower::grace::Disconnect;
    pub use crate::integrations::tower::llm::{
        DEFAULT_MAX_REQUEST_BODY, LlmBody, LlmLayer, LlmService, provider_limits,
    };
    pub use crate::integrations::tower::usage::provider_usage;
}

/// Metrics (feature `metrics`) and tracing (feature `tracing`) for a bulkhead.
#[cfg(any(feature = "metrics", feature = "tracing"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "metrics", feature = "tracing"))))]
pub mod observability {
    #[cfg(feature = "metrics")]
    #[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
    pub use crate::integrations::metrics::{
        BulkheadMetrics, BulkheadMetricsBuilder, DEFAULT_SAMPLE_EVERY, Publisher,
    };
    #[cfg(feature = "tracing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tracing")))]
    pub use crate::integrations::tracing::{trace_events, trace_events_sampled};
}

/// The guide: every capability of the crate, one section each, with examples that run (its
/// source is `docs/guide.md`).
pub mod guide {
    #![doc = include_str!("../docs/guide.md")]
}

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
    both::<bulkhead::BulkheadPermit<'static>>();
    both::<bulkhead::OwnedBulkheadPermit>();
    both::<BulkheadError>();
    both::<bulkhead::BulkheadStats>();
    both::<futures::BulkheadAcquire<'static>>();
    both::<futures::BulkheadAcquireOwned>();
    both::<Permit<'static>>();
    both::<OwnedPermit>();
    both::<admission::Admission>();
    both::<Rejection>();
    both::<AcquireError>();
    both::<Stats>();
    both::<Limits>();
    both::<LlmBulkheadBuilder>();
    both::<admission::AdmissionId>();
    both::<LlmRequest>();
    both::<futures::Acquire<'static, 'static>>();
    both::<futures::AcquireOwned>();
    both::<futures::Drain<'static>>();
    both::<futures::DrainTimeout<'static>>();
    both::<RunContext<'static>>();
    both::<RunError<std::io::Error>>();
    both::<classes::AdmissionClass>();
    both::<classes::AdmissionClasses>();
    both::<RunOptions>();
    both::<run::BorrowedConcurrencyDeadlineError>();
    both::<dedup::Deduplication>();
    both::<dedup::Sharing<String>>();
    both::<observe::Bypass>();
    both::<observe::ShadowId>();
    both::<observe::ShadowReasons>();
    both::<dedup::DedupScope>();
    both::<http::HttpRefusal>();
    both::<tenants::Tenants<String>>();
    both::<tenants::TenantsBuilder<String>>();
    both::<tenants::TenantsError>();
    both::<tenants::TenantsConfigError>();
    #[cfg(feature = "metrics")]
    {
        both::<observability::BulkheadMetrics>();
        both::<observability::BulkheadMetricsBuilder>();
        both::<observability::Publisher>();
    }
    #[cfg(feature = "tower")]
    {
        both::<tower::BulkheadLayer>();
        both::<tower::BulkheadService<()>>();
        both::<tower::BulkheadBody<http_body_util::Full<bytes::Bytes>>>();
    }
}
