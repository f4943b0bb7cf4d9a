//! The stress kit: everything the stress families (`chaos`, `classes`, `dedup`, `usage`) have
//! in common, so that each family keeps only its own operation mix and its own checks.
//!
//! - [`runtimes`]: the runtimes (tokio multi-thread and current-thread, with or without its
//!   time driver, smol, async-std, a futures thread pool, a thread per task), how a scenario's
//!   tasks are spawned on each and their first panic kept, timers and yields that work on any
//!   of them, and the watchdog that aborts a hung scenario and names its seed;
//! - [`scene`]: what a scenario is made of (its [`Setup`](scene::Setup): seed, workers,
//!   operations, what the control plane varies, usage and listener switches; its
//!   [`Scene`](scene::Scene): the bulkhead, the runtime, the close flag and the progress
//!   counters), the [`Family`](scene::Family) trait a family implements (one operation, one
//!   change of the limits, its checks) and [`play`](scene::play), which runs a scenario;
//! - [`control_plane`]: the control-plane loop every family runs (random limit changes at random
//!   intervals, drains, the close at a random point, then the checks of a closed bulkhead until
//!   every worker is done), parameterised by the family's [`Schedule`](control_plane::Schedule)
//!   and by what its `reconfigure` changes, and the checked limit changes several families make;
//! - [`books`]: the callers' sums for a scope (the bulkhead, or one class) and their exact check
//!   against its statistics, the ledger of holders, and the listener's books (events counted per
//!   scope, every admission followed from its admit to its release event);
//! - [`callers`]: the worker loop, the acquisitions of the chaos mix (queued, cancelled in every
//!   way, dropped unpolled, blocking), random calls, queue timeouts and cancellers, `run` driven
//!   or cancelled, and the odd calls (advisory, invalid, beyond every budget);
//! - [`reports`]: random usage reports and settlements, each checked against the callers' model
//!   of the admission (`crate::caller_model`).
//!
//! `STRESS_SCALE` (default 1) multiplies every family's operations; `CHAOS_SEED=<seed>` replays
//! a failed scenario's random choices (every family draws its seed from [`fresh_seed`], prints
//! it when a scenario fails, and derives each task's random stream from it with [`mix`]).

use async_bulkhead_llm::TokenUsage;

pub(crate) mod books;
pub(crate) mod callers;
pub(crate) mod control_plane;
pub(crate) mod reports;
pub(crate) mod runtimes;
pub(crate) mod scene;

/// `STRESS_SCALE` (default 1): how many times the default work every scenario does.
pub(crate) fn scale() -> u64 {
    std::env::var("STRESS_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1)
}

/// `CHAOS_SEED` if set (to replay a failure's random choices), else a fresh random seed.
pub(crate) fn fresh_seed() -> u64 {
    std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..))
}

/// Mixes a seed with a stream number (splitmix64), so that tasks get unrelated sequences.
pub(crate) fn mix(seed: u64, stream: u64) -> u64 {
    let mut z = seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub(crate) fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).expect("usage fits in u64")
}
