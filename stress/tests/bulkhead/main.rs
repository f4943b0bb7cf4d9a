//! Behavioural tests of the general [`Bulkhead`](async_bulkhead_llm::Bulkhead), one module per
//! statement of its specification (the bulkhead pattern: at most `max_concurrent` calls in
//! flight, a bounded FIFO queue with a timeout, typed refusals never retried):
//!
//! - `problem`: a slow dependency capped at 5 cannot block a fast one; one shared pool can;
//! - `defaults`: a queue of 50 and a queue timeout of 10 s (on tokio's paused clock with the
//!   `tokio` feature), `wait_indefinitely`, `max_queue(0)`;
//! - `config`: `max_concurrent` of 0 (or above `MAX_CONCURRENT`) refused where it is set;
//! - `fifo`: the oldest queued call is promoted; newcomers never barge;
//! - `cancellation`: a dropped queued call leaves the queue at once and holds no slot;
//! - `deadline`: a call's deadline bounds its wait, never a free slot;
//! - `errors`: `QueueFull`, `QueueTimeout`, `Shutdown`, none retryable;
//! - `observe`: `state()` and the reject hook (and a hook that panics);
//! - `sizing`: every row of the sizing guide;
//! - `limits`: raising and lowering `max_concurrent` at run time, stale revisions;
//! - `call`, `blocking`, `drain`: `call`'s slot, the blocking acquires, drain after close;
//! - `stress`: tasks and threads hammering one bulkhead, exact books at the end.
//!
//! Scenarios that wait are written once as an `async fn` and run on a tokio multi-thread
//! runtime, on smol and on async-std (`support::on_three_runtimes!`: tests `<statement>::tokio`,
//! `::smol`, `::async_std`). Waiters are queued deterministically by polling their futures by
//! hand (an acquire takes its place in the queue at its first poll).

#![allow(clippy::result_large_err)]

mod support;

mod blocking;
mod cancellation;
mod config;
mod deadline;
mod defaults;
mod drain;
mod errors;
mod fifo;
mod limits;
mod observe;
mod problem;
mod run;
mod sizing;
mod stress;
