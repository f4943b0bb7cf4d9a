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
//! The four families `usage`, `chaos`, `classes` and `dedup` run on one stress kit (`kit`):
//! its runtimes and how tasks are spawned on each, the watchdog, the seeds, `STRESS_SCALE`, the
//! worker loop, the control-plane loop (limit changes, drains, the close), the callers' books
//! and their exact checks, the ledger of holders and the listener's books. Each family keeps
//! only its operation mix and its own checks. `caller_model` is the callers' model of an
//! admission's token hold, which the kit's reports check every report and release against.
//!
//! `STRESS_SCALE` (default 1) multiplies the work, e.g. `STRESS_SCALE=100 cargo test --release
//! --test stress chaos::`; `CHAOS_SEED=<seed>` replays a failed usage, chaos, classes or dedup
//! run's random choices (and the class contention tests'); `PHANTOM_PROBE_SECS` sets the
//! phantom probe's duration (default 10 s).
//!
//! `§U..`, `§D..` and `Qn` refer to sections and quirks of `docs/design.md`.

mod caller_model;
mod kit;

mod admission;
mod chaos;
mod classes;
mod dedup;
mod phantom_probe;
mod queue;
mod threads;
mod usage;
