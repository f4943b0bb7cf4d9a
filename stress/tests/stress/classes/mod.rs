//! Chaos stress with admission classes (`docs/design.md` §U6, §U7): the chaos scenarios, on the
//! kit's runtimes with its seeds, watchdog, `STRESS_SCALE`, worker loop, control-plane loop and
//! acquisitions (`crate::kit`), on a bulkhead with 2 to 4 classes with random floors and
//! ceilings, of slots and of tokens, under a token budget.
//!
//! Every worker runs a seeded random mix of every operation of the chaos mix (`try_acquire`,
//! `acquire` with queue timeouts, cancelled and unpolled acquires, `acquire_blocking` on
//! threads, several permits at once, owned permits handed to another task, `run` /
//! `run_with_usage` succeeding, failing or cancelled, advisory checks, invalid input, random
//! usage reports checked against the callers' model) in a random class (or none: the default
//! class), plus: abandoning the borrowed slot at random moments (and then reporting usage on,
//! releasing or dropping), and `run` with a borrowed-slot deadline, short or long, with
//! callbacks that hang (a borrowed slot: must be cut), linger past the deadline (a slot within
//! the floor, or already given back: must not be cut) or finish. One class, `solo`, is used by
//! worker 0 alone, which keeps an exact book of its slots and tokens.
//!
//! Meanwhile the control plane applies random limits (the class floors and ceilings moved up
//! and down, valid by construction, with the global limits, budget and reserve), random
//! `set_budget`, invalid snapshots and budgets below the token floors (which must change
//! nothing, with the exact error), stale snapshots, drains, and closes at a random point.
//! Every applied revision is recorded *before* it is applied, so any admission or refusal can
//! be checked against the exact limits that decided it (its `limit_revision`).
//!
//! Checked live:
//! - every admission: its class is the one asked; its resources agree with the floors of its
//!   revision (a class without a floor always borrows its slot; without a token floor every
//!   token is borrowed; never more than reserved, at least what exceeds the token floor), with
//!   the permits the caller itself holds in the class (at or above the floor: borrowed), and
//!   exactly with the `solo` book (borrowed iff its slots were at the floor; tokens borrowed
//!   beyond the free token floor; its ceilings respected);
//! - a ledger of slot holders per class, packed in one word (a caller counts itself after its
//!   admission and uncounts itself before it gives the slot back, so it never exceeds the
//!   truth): no class above the largest ceiling in force since the entering admission's
//!   revision (with fixed limits: its ceiling), the total never above `max_concurrent` likewise,
//!   and, with fixed limits, the borrowed slots `Σ max(0, holders − floor)` never above the
//!   shared pool;
//! - every refusal's detail: its revision is one that was applied and its class, floors,
//!   ceilings and shared capacities are exactly that revision's; what the call would borrow is
//!   what the snapshot implies; the constraint is consistent with the figures (a class ceiling
//!   reached, a shared pool overdrawn, the global budget exceeded); for `solo`, the class
//!   figures equal the book;
//! - `abandon_borrowed_concurrency` answers exactly whether the slot was borrowed and still
//!   held; a deadline cuts exactly the callbacks that hang on a borrowed slot, with the right
//!   error; the listener sees each admission's abandonment at most once, inside its admission,
//!   with the admit event's class and resources; sampled statistics keep classes under their
//!   ceilings and, after the close, every class's slots only fall.
//!
//! Exact at the end of each run: nothing in flight (slots, tokens, abandoned admissions, every
//! class, the shared pool) or queued; per class `admitted == released`, `admitted + rejected`
//! equal to the decided calls the callers counted in that class, the token books, the borrowed
//! admissions and tokens, and abandonments by cause equal to the callers' sums; every global
//! counter equal to the sum over the classes; the listener's events per class matching, and
//! every admission's events (usage sequence, hold moves, release) matching the callers' model.
//!
//! The kit holds each class's callers' sums (`crate::kit::books::Book`, checked exactly per
//! class), the ledger (one word, 16 bits a class) and the listener; this family keeps its
//! configurations (`config`), its mix with classes, abandonments and deadlines (`callers`,
//! `runs`), its live checks of every admission and refusal (`books`, `checks`) and its limit
//! changes (`control_plane`).
//!
//! Seeds are printed when a scenario fails (`CHAOS_SEED=<seed>` replays the random choices,
//! the class configuration included; the interleaving differs). A watchdog aborts a hang.
//!
//! `contention` hammers two classes at a floor boundary from plain threads.

mod books;
mod callers;
mod checks;
mod config;
mod contention;
mod control_plane;
mod runs;
mod runtimes;

/// `max_concurrent` of the scenarios that keep it.
const SLOTS: u32 = 4;
/// The largest `max_concurrent` the varying control plane applies.
const PEAK_SLOTS: u32 = 7;
/// The initial `max_queue`.
const QUEUE: u32 = 6;
/// The largest `max_queue` the control plane applies.
const PEAK_QUEUE: u32 = 10;
const BUDGET: u64 = 4_000;
const RESERVE: u64 = 300;
/// Operations every worker performs after it saw the close (all of them refused).
const POST_CLOSE_OPS: u64 = 12;
/// Class ids; a scenario takes the first `n - 1` and `solo` (the last class, worker 0's).
const IDS: [&str; 3] = ["premium", "standard", "batch"];
const SOLO: &str = "solo";
