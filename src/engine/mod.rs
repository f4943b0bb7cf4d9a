//! The admission engine: a hard cap on slots and tokens in flight, decided by one lock-free
//! compare-and-swap per admission (a class call beyond its floors takes its class's lock, see
//! `classes`), with a strictly FIFO wait queue, versioned limits, close and drain. It knows
//! nothing of requests, estimators or events: a call asks for a number of tokens at a priority
//! ([`Ask`]) and gets a [`Grant`], a [`Rejection`](crate::rejection::Rejection) or a place in the queue.
//!
//! Everything above it (the two faces, `crate::llm` and `crate::bulkhead`) goes through
//! [`Engine`]'s crate-internal face, 36 calls in ten groups; every other method and every
//! field is private to this folder:
//!
//! - admit: `try_admit_fast` (the fast lane of either kind of call), `try_admit_fast_windowed`
//!   (the lane of a call without a class on an engine with rate windows), `try_admit`,
//!   `try_admit_class` (never wait; the caller dispatches on the class before it builds the
//!   ask, which keeps a refusal 5 instructions shorter), `admit`, `admit_in_place` (may
//!   queue), `refuse_undecided`;
//! - decide in two levels: `try_provisional` and `try_provisional_fast` (take the slot and
//!   tokens, count nothing),
//!   then `confirm` (count and mint) or `cancel_provisional` (give them back, count
//!   nothing): the lower
//!   level of a tenant-within-global decision;
//! - advise: `advise` (decide without admitting);
//! - wait: [`queued::Queued`], the one wait protocol of both faces' acquire futures;
//! - release and report: `release`, `release_unreported`, `move_hold` (a usage report),
//!   `abandon` (a borrowed slot given back early), `count_all` (the counters a face settles);
//! - limits: `limits`, `revision`, `apply_limits`, `check_limits` (validate only),
//!   `set_budget`, `classes`;
//! - close and drain: `close`, `is_closed`, `drain` (and [`drain::Drain::within`]);
//! - figures: `figures`, `occupancy`, `has_budget`, `has_fast_lane`, `has_window_lane`,
//!   `has_rate`;
//! - rate windows: `correct_rate` (a usage report's correction), `rate_status`,
//!   `class_rate_status`;
//! - build: `new`; and the permit core, [`permit::PermitCore`], both faces' permits are made of.
//!
//! The files, one responsibility each:
//!
//! - `wait`: [`Wait`], how a call that finds no free slot waits (a leaf); `decision`:
//!   [`Decision`], what a door that may queue answers.
//! - `assembly`: the [`Engine`] struct, its construction and its readers; `admission`: the
//!   doors, the decision (`decide`: one CAS), refusals and the advisory check; `release`:
//!   holds and releases; `reconfigure`: `apply_limits`, `set_budget`, `close`; `drain`:
//!   waiting for quiescence; `figures`: what a statistics snapshot reads.
//! - `state`: the packed admission word (slots, tokens, epoch bits, flags; 128 bits with
//!   admission classes); `policy`: the decision as a pure function of (word, limits, ask);
//!   `limits`: validation and the double-buffered limits that admissions read without a lock.
//! - `classes`: the class table and its protocol; `class_path`: the engine's operations on a
//!   class call.
//! - `queue`, `fifo`, `pool` and `waiting`: the wait queue's data, its slab list, recycled
//!   waiters, and the engine's methods that arrive, hand off, withdraw and refuse; `queued`: a
//!   queued call's side of the wait.
//! - `rate`: the rate windows and their clock; `rate_path`: the engine's operations on them.
//! - `grant`: what the engine records of one admission; `permit`: the permit core;
//!   `provisional`: an admission taken but not yet counted (two-level decisions).
//! - `counters` and `local`: cumulative counters in per-thread shards; admission ids.
//! - `timer`: the process-wide timer behind queue timeouts, bounded drains and run deadlines.
//!
//! # How a decision is made
//!
//! [`Engine::decide`] reads the word and the limits published for its epoch, decides with a pure
//! function and commits with one CAS; a change of limits advances the epoch bits, so a decision
//! made under old limits fails its CAS and is made again (`limits` explains the protocol and the
//! one case the bits cannot settle). A release is one `fetch_sub` and serves the queue or the
//! drainers only when the word says someone waits.

mod admission;
mod assembly;
mod class_path;
pub(crate) mod classes;
mod counters;
mod decision;
pub(crate) mod drain;
mod fifo;
mod figures;
mod grant;
pub(crate) mod limits;
mod local;
pub(crate) mod permit;
pub(crate) mod policy;
mod pool;
mod provisional;
mod queue;
pub(crate) mod queued;
pub(crate) mod rate;
mod rate_path;
mod reconfigure;
mod release;
mod state;
pub(crate) mod timer;
mod wait;
mod waiting;

pub(crate) use assembly::Engine;
pub(crate) use counters::{ClassCounter, Counter};
pub(crate) use decision::Decision;
pub(crate) use figures::{ClassFigures, ClassesFigures, Figures};
pub(crate) use grant::Grant;
pub(crate) use policy::Ask;
pub(crate) use pool::WaiterHandle;
pub(crate) use provisional::Provisional;
pub(crate) use wait::Wait;
