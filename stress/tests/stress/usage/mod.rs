//! Usage-reconciliation stress on real runtimes (tokio multi-thread and current-thread, smol,
//! async-std, a futures thread pool) and on blocked threads: many callers acquire
//! (`try_acquire`, queued `acquire` with timeouts, `run`), stream cumulative usage reports
//! (plain and progressive, stale ones, refused ones, holds rising above the reservation and
//! falling below it), and settle by releasing with or without usage, by dropping the permit or
//! by cancelling a `run`, while a control plane changes the limits and the budget (and, in
//! some runs, closes the bulkhead halfway and drains it, after which it must stay idle and
//! refuse every call with `shutdown`) and a listener subscribed to every event checks and
//! tallies them (some runs have no listener, which takes other paths).
//!
//! Every caller keeps its own model of its admission (the hold rules and the booking split of
//! `src/usage.rs`, written here independently) and checks each report and each release against
//! it. A ledger of holders, kept by the callers themselves, checks the concurrency ceiling
//! during the run. At the end everything must be back and every book must balance: every call
//! decided exactly once, the bulkhead's counters (admissions, refusals by reason, cancellations,
//! token bookings) against the callers' sums, the listener's per-admission traces (usage
//! events, sum of their `delta_tokens`, the release) against the callers' own, a reconfigure
//! event per limit change, and `reserved + overrun + reheld == consumed + refunded +
//! returned_unreported`.
//!
//! The runtimes (tokio here without its time driver: queue timeouts on the crate's own timer),
//! the seeds (`CHAOS_SEED=<seed>` replays a failed run's random choices), `STRESS_SCALE` (a
//! multiplier of the calls per worker, e.g. `STRESS_SCALE=100`), the watchdog, the worker and
//! control-plane loops (at the busy pace: a few workers per slot keep the bulkhead contended),
//! the callers' books, the ledger and the listener come from `crate::kit`; this family keeps
//! its calls and their plans (`callers`, `plan`), its limit changes and its end-of-run checks
//! (`books`).
//!
//! Two focused tests check that an overrun hold really blocks admissions until it is released.

use async_bulkhead_llm::{AcquireOptions, Reservation};

use crate::kit::scene::Setup;
use crate::kit::usage;

mod books;
mod callers;
mod overrun;
mod plan;
mod runtimes;

fn with(reservation: Reservation) -> AcquireOptions {
    AcquireOptions::new().reservation(reservation)
}

/// What the control plane does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plane {
    /// Changes the budget, the reserve and the queue; `max_concurrent` stays at `SLOTS`.
    SlotsFixed,
    /// Changes `max_concurrent` too (0, the kill switch, included): the ledger's ceiling is
    /// then the largest limit ever applied.
    Varying,
    /// As `SlotsFixed`, and closes the bulkhead once half the calls are done, with calls still
    /// streaming usage, and checks that `drain()` resolves with every token back.
    Closes,
}

impl Setup<Plane> {
    /// The most holders there may ever be at once.
    pub(crate) fn ceiling(&self) -> u64 {
        u64::from(match self.plane {
            Plane::Varying => PEAK_SLOTS,
            Plane::SlotsFixed | Plane::Closes => SLOTS,
        })
    }
}

/// Slots of the bulkheads whose concurrency limit never changes.
const SLOTS: u32 = 4;
/// The largest `max_concurrent` the varying control plane ever applies.
const PEAK_SLOTS: u32 = 6;
/// Concurrent callers of the async scenarios (a few per slot).
const WORKERS: u64 = 10;
/// Calls of every worker of the async scenarios.
const CALLS: u64 = 2_000;
