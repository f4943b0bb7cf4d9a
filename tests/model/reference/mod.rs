//! A sequential reference model of [`LlmBulkhead`], and a harness that drives the real crate and
//! the model side by side, failing on the first disagreement.
//!
//! The model is the specification: plain integers, a `VecDeque` for the queue, no atomics, no
//! clock. Every rule cites where it comes from: `design §Un` is the original's behaviour and
//! `Qn` a deliberate difference from it (design §D4), both in `docs/design.md`, and a few rules
//! are the crate's own documented design (named with their source file).
//!
//! # What the harness checks
//!
//! After every operation: every result (permit, rejection with reason and full capacity detail,
//! usage report, release report, verdict, limits outcome, error value), every live permit's
//! accessors, `stats()` field by field, and the events a subscribed listener received. When
//! auto-polling is on (the default), it then polls every waiting future and every pending
//! drain, in creation order, and checks everything again: the crate hands capacity to the
//! queue head at release time and the future picks it up at its next poll, so the state
//! between the two (a slot in flight that is not yet an admission) is checked too. `finish`
//! cancels every waiter, drops every permit and checks the end invariants.
//!
//! # Why a worker thread
//!
//! Borrowed permits and futures ([`Permit`], [`Acquire`], [`Drain`]) borrow the bulkhead, so
//! they cannot live in a struct next to it. The harness therefore keeps the bulkhead, the
//! model and everything borrowed on the stack of one worker thread and sends it the
//! operations one by one. A disagreement panics on the worker; the caller re-raises that panic
//! with its original message. Everything the crate does still happens on one thread, in a
//! deterministic order.
//!
//! # Left out
//!
//! Queue timeouts other than zero (a non-zero timeout is only ever "long", and never expires
//! during a run), several threads, `run`, the blocking acquires, estimators other than the
//! default model-aware one, and the timing figures of events.

mod convert;
mod driver;
mod harness;
mod operations;
mod state;
mod values;

pub use harness::{Call, Config, Harness, MAX_CHARS, Op};
