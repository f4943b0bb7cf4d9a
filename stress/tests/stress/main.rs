//! Stress tests on real threads and real runtimes (tokio multi-thread and current-thread, smol,
//! async-std, a futures thread pool, blocked threads): many callers hammer one bulkhead while a
//! control plane changes the limits and closes it, and every run ends with exact invariants.
//!
//! - `admission`: random reservations, priorities, releases, limit changes and a close;
//! - `queue`: queueing with random timeouts and cancellations;
//! - `usage`: streaming usage reports checked by every caller and by a listener;
//! - `chaos`: random mixes of every operation, with cancellations and a random close;
//! - `classes`: the chaos mix with admission classes (floors, ceilings, abandonments, `run`
//!   deadlines, class limits changing), and two classes hammered at a floor boundary;
//! - `dedup`: `run_shared` with identical and near-identical requests, scopes, `no_dedup`,
//!   follower timeouts, cancellations and observe-mode bypasses on a small bulkhead, every
//!   outcome traced to the callback that produced it;
//! - `threads`: statistics shards and admission ids across thread lifetimes;
//! - `phantom_probe`: the "phantom commit" probe.
//!
//! `STRESS_SCALE` (default 1) multiplies the work, e.g. `STRESS_SCALE=100 cargo test --release
//! --test stress chaos::`; `CHAOS_SEED=<seed>` replays a failed chaos, classes or dedup run's
//! random choices; `PHANTOM_PROBE_SECS` sets the phantom probe's duration (default 10 s).
//!
//! `§U..`, `§D..` and `Qn` refer to sections and quirks of `docs/design.md`.

mod caller_model;

mod admission;
mod chaos;
mod classes;
mod dedup;
mod phantom_probe;
mod queue;
mod threads;
mod usage;
