//! Chaos stress: many tasks (tokio multi-thread and current-thread, smol, async-std, a futures
//! thread pool) or plain threads run *random mixes* of every operation against one bulkhead at
//! once, while a control plane changes the limits at random and closes the bulkhead at a random
//! point.
//!
//! Each worker performs a seeded random sequence of operations: `try_acquire(_owned)`,
//! `acquire(_owned)` with random queue timeouts (none, zero, a few ms), acquire futures
//! cancelled at random points (`tokio::select!` against a timer or a few executor turns,
//! `tokio::time::timeout`, polled once and dropped, dropped before the first poll),
//! `acquire_blocking(_owned)` on threads, several permits held at once, owned permits handed to
//! another task or thread, `run` / `run_with_usage` whose callbacks report usage, fail, or are
//! cancelled, advisory `would_admit` checks, requests that cannot be estimated and reservations
//! no budget can fit. Admitted calls hold their permits for random short times while streaming
//! random cumulative usage reports (plain and progressive, growing, stale, refused for a
//! remaining output above the cap or for a hold too large to count), then release with explicit
//! usage, release with the last reported usage, or drop the permit.
//!
//! Meanwhile the control plane applies random limits (`max_concurrent` grown, shrunk or 0,
//! `max_queue` grown, shrunk or 0, a budget below the tokens in flight, a reserve above the
//! budget), stale and invalid snapshots (which must change nothing), `set_budget`, drains, and
//! at a random point `close()`. From then on every call must be refused with `shutdown`, slots
//! in flight never grow, nothing waits, and every `drain()` started along the way resolves;
//! whenever it then finds nothing in flight (a quiet point: no admission left, none can come)
//! the token identity must hold at 0 (`reserved + overrun + reheld - refunded - consumed -
//! returned_unreported == in_flight_tokens`), while the callers keep calling.
//!
//! Every caller models its own admission (the hold rules and the booking split, written
//! independently of `src/usage.rs`) and checks every report and release against it. Each run
//! ends with exact invariants: nothing in flight (slots, tokens) or queued, `admitted ==
//! released`, `admitted + rejected ==` the calls that were decided (counted by the callers,
//! with a wrapper that knows whether an acquire future was ever polled), every token booking
//! equal to the callers' sums, `reserved + overrun + reheld == consumed + refunded +
//! returned_unreported`, the listener's events matching, and never more holders than
//! `max_concurrent` (an independent ledger kept by the callers) while it is fixed.
//!
//! The runtimes, the seeds (`CHAOS_SEED` replays a failed run's random choices; the
//! interleaving differs), `STRESS_SCALE` (a multiplier of the operations per worker, e.g.
//! `STRESS_SCALE=100`), the watchdog, the worker loop, the control plane's loop, the acquisition
//! kinds of the mix, the callers' books, the ledger and the listener's books come from
//! `crate::kit`; this family keeps its operation mix (`callers`), its limit changes and quiet
//! points (`control_plane`) and its end-of-run invariants (`books`).

use crate::kit::scene::Setup;

mod books;
mod callers;
mod control_plane;
mod runtimes;

/// What the control plane changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plane {
    /// Nothing (only stale and invalid snapshots, which change nothing): fixed limits.
    Fixed,
    /// The budget, the reserve and the queue; `max_concurrent` stays at `SLOTS`.
    SlotsFixed,
    /// Everything, `max_concurrent` 0 (the kill switch) and `max_queue` 0 included.
    Varying,
}

impl Setup<Plane> {
    /// The most holders there may ever be at once.
    pub(crate) fn ceiling(&self) -> u64 {
        u64::from(match self.plane {
            Plane::Fixed | Plane::SlotsFixed => SLOTS,
            Plane::Varying => PEAK_SLOTS,
        })
    }
}

/// Slots of the bulkheads, and the fixed `max_concurrent` of the scenarios that keep it.
const SLOTS: u32 = 4;
/// The largest `max_concurrent` the varying control plane applies.
const PEAK_SLOTS: u32 = 7;
/// The initial `max_queue`.
const QUEUE: u32 = 6;
/// The largest `max_queue` the control plane applies.
const PEAK_QUEUE: u32 = 10;
const BUDGET: u64 = 3_000;
const RESERVE: u64 = 300;
/// Operations every worker performs after it saw the close (all of them refused).
const POST_CLOSE_OPS: u64 = 12;
