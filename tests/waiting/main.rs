//! Behavioural tests of waiting: the bounded strictly-FIFO queue with direct hand-off, queue
//! limits, the token budget that never queues, timeouts (on several executors), cancellation,
//! `close`, `apply_limits` while calls wait, `drain`/`drain_timeout`, profiles, `run`, the
//! blocking acquires, the `'static` owned future, the timer thread facing user wakers that
//! panic, block or own a timed task, and (feature `tokio`) timeouts on tokio's paused clock.
//!
//! Semantics come from design §U2, §U3.2, §U14, §U15 and design §D4 (Q5: drain
//! completes whenever the bulkhead becomes idle; Q7: a queued request is admitted only when its
//! slot and its tokens fit together, and the budget never queues).
//!
//! Waiters are put into the queue deterministically by polling their futures by hand (an
//! acquire takes its place at its first poll). A slot handed to a waiter is counted in
//! `stats().in_flight` at once; the waiter counts as admitted when its future is polled again.
//!
//! Some tests are regression tests for defects found by adversarial probing (user code that
//! panics or blocks, re-entrant wakers and listeners) and by comparing the crate with the
//! JavaScript original; each failed before its fix.
//!
//! Scenarios that hung or aborted before their fix run in a child process with a watchdog
//! (`common::child_process::isolated`).
//!
//! `§U..`, `§D..` and `Qn` refer to sections and quirks of `docs/design.md`.

#[path = "../common/mod.rs"]
mod common;
mod support;

mod blocking;
mod cancellation;
mod close;
mod drain;
mod fifo;
mod limit_changes;
mod profiles;
mod queue_limits;
mod run;
mod send_static;
mod timeouts;
mod timer_wakers;
mod token_budget;
#[cfg(feature = "tokio")]
mod tokio_timer;
