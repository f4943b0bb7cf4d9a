//! A sequential reference model of [`LlmBulkhead`], and a harness that drives the real crate and
//! the model side by side, failing on the first disagreement.
//!
//! The model is the specification: plain integers, a `VecDeque` for the queue, no atomics, no
//! clock of its own (the rate windows' manual clock moves only by `Op::Advance`, in step with
//! the model's). Every rule cites where it comes from: `design §Un` is the original's behaviour and
//! `Qn` a deliberate difference from it (design §D4), both in `docs/design.md`, and a few rules
//! are the crate's own documented design (named with their source file).
//!
//! # What the model covers
//!
//! The gate and the queue (design §U2), admission and its judging order (§D4, §U3), token
//! accounting (§U4), the high-priority reserve (§U5), admission classes (§U6: floors,
//! ceilings, the shared pool, the class decision, its detail), resources, abandoning a
//! borrowed slot and the `run` borrowed-slot deadline (§U7), limits with and without classes
//! (§U8), events (§U11), statistics with the per-class block (§U12), the default estimator
//! (§U13.3), close and drain (§U15); in-flight deduplication (`run_shared`, `flights.rs`) and
//! observe mode (`bypass.rs`), after the crate's documentation of them (run_shared.rs, run.rs,
//! options.rs, observe.rs).
//!
//! # Rate windows
//!
//! The bulkhead's pair of windows (`RateLimits`: requests, tokens or both per window) and each
//! admission class's (`ClassLimits::rate`), after the crate's src/engine/rate.rs module docs
//! (`rate.rs` here): a GCRA per window in the crate's ticks, modelled exactly (see `rate.rs`
//! for why ticks and not rational time), on a `ManualClock` the harness owns and moves with
//! `Op::Advance`. Covered: the builder's refusals of rate limits (the bulkhead's after the
//! global values, a class's last among its limits; then built repaired); the judging order (a
//! closed bulkhead refuses `shutdown` before any window; the bulkhead's requests then tokens
//! window, then the class's, before the in-flight decision); a window's refusal (`rate_limit`,
//! counted globally and for the call's class, announced, with the global detail for the
//! bulkhead's windows and the class's figures for a class's, the window, and the exact
//! `retry_after` in whole milliseconds, or none for a call larger than the limit); the charge
//! given back when a later window refuses (the class's after the bulkhead's, tokens after
//! requests), when the in-flight decision refuses, and when a queued call's wait ends refused
//! (picked up, zero timeout, cancelled, closed; on the windows configured then); the tokens
//! charge corrected at settlement to the usage and charged beyond the reservation as reports
//! arrive, on both pairs; a permit dropped without usage keeping its charge; `rate_status()`,
//! every class's `class_rate_status()` and `limits().rate` (the classes' too) after every
//! step; `apply_limits` with other rate limits for the bulkhead (`Op::ApplyRate`) or its
//! classes (class limits carrying rates), the units charged and not yet drained staying
//! charged (at most the new limit, in the new ticks; a window added or removed starts empty),
//! and its `LimitsError::Rate*` and `ClassLimitsError::Rate` refusals, which change nothing.
//! A `retry_after` beyond about 1.55 days (reachable only through usage charged far beyond a
//! window's limit) is carried in whole seconds (see `rate.rs`). Not covered: the system, precise and tokio clocks, a decision racing
//! `apply_limits`, the fast lane as such (its outcome is the general path's), and windows with
//! `run`, `run_shared` or observe mode (the driver refuses those operations on a bulkhead with
//! windows rather than check them wrongly).
//!
//! # What the harness checks
//!
//! After every operation: every result (permit, rejection with reason and full capacity
//! detail including the constraint, the shared pools and the class's figures, and its
//! `rate_window()` and `retry_after()` (none for every refusal but a window's; a window's
//! `http_status()` 429, or 413 when it never fits), usage report,
//! release report, verdict, limits outcome, error value), every live permit's and every
//! running `run` context's accessors (id, hold, reservation, revision, priority, class,
//! resources, whether it holds its slot, usage, sequence; for a bypassed call its bypass),
//! `stats()` field by field (the abandonment counts, the class block, the deduplication and
//! observe figures included), `limits()` (its `rate` too), `rate_status()`, and the events a subscribed listener received (with
//! their class, resources, the abandon, bypass and deduplication events). When auto-polling
//! is on (the default), it then polls every waiting future, waiting run and pending drain, in
//! creation order, and checks everything again: the crate hands capacity to the queue head at
//! release time and the future picks it up at its next poll, so the state between the two (a
//! slot in flight that is not yet an admission) is checked too. At construction it checks the
//! builder's refusals (global values, then the classes in the order of design §U6.1) and the
//! class handles and lookups. `finish` cancels every waiter, drops every run and permit and
//! checks the end invariants (nothing in flight or abandoned, every class empty, the token
//! identity of §U4.5 globally and per class).
//!
//! # Classes
//!
//! A configuration has up to four classes with fixed ids (`CLASS_IDS`, one with spaces kept
//! verbatim). A call names one of them, none (the default class) or a handle of another
//! bulkhead; `apply_limits` snapshots carry the class part in any order and of any shape (the
//! ids of construction, one left out, renamed or added, or absent/present against the
//! build), so every validation error of design §U8.2 is reached.
//!
//! # `run`
//!
//! A `run` future lives on the worker like a waiter; its callback is driven through a mailbox
//! (report usage, abandon its slot, finish, fail), so everything it does happens at a known
//! step. The borrowed-slot deadline (design §U7.3) is deterministic: a 1 ms deadline is only
//! set with a callback that then waits for the worker, and as soon as the run is admitted with
//! a borrowed slot it still holds, the worker blocks on it until the crate's timer cuts it
//! (giving up after ten seconds); a callback that finishes or abandons at once is never cut;
//! long deadlines (an hour, `Duration::MAX`) never pass during a test.
//!
//! # `run_shared` and observe mode
//!
//! A bulkhead may deduplicate by the whole request (`Deduplication::new`) or by a key function
//! (the request's model name: none is an empty key, one model name makes the function panic).
//! A `run_shared` call leads, follows (same request, scope and class) or runs alone; it is
//! polled at once, and like a run its callback obeys a mailbox, whichever of the call's
//! waiters polls it, so the model knows which callback runs, who drives it (a follower, once
//! its leader is dropped), and what every caller gets (the value names the callback that made
//! it). A follower's own wait ends deterministically: a zero timeout gives up at its first
//! poll that finds no outcome (in observe mode it then runs its own callback as a bypass); a
//! long one never passes. A `run` or `run_shared` in observe mode is bypassed on a predicted
//! refusal of its set, or after a counted one (a zero queue timeout, a queue head refused at
//! its turn); a bypass's callback reports usage and ends like an admitted one, holding
//! nothing. Bypasses are numbered in the order they began, which the shadow ids of the
//! contexts, reports and events must follow.
//!
//! # Why a worker thread
//!
//! Borrowed permits and futures ([`Permit`], [`Acquire`], [`Drain`], `run`) borrow the
//! bulkhead, so they cannot live in a struct next to it. The harness therefore keeps the
//! bulkhead, the model and everything borrowed on the stack of one worker thread and sends it
//! the operations one by one. A disagreement panics on the worker; the caller re-raises that
//! panic with its original message. Everything the crate does still happens on one thread, in
//! a deterministic order (the crate's timer thread only ever fires a deadline the worker is
//! blocked on).
//!
//! # Left out
//!
//! Queue timeouts other than zero (a non-zero timeout is only ever "long", and never expires
//! during a run), a borrowed-slot deadline passing while the worker does something else,
//! several threads, the blocking acquires, estimators other than the default model-aware one,
//! builder refusals of class ids (blank, repeated, an unknown default class: the ids here are
//! fixed), the panics of listeners and estimators, and the timing figures of events. For
//! `run_shared`: a future dropped before its first poll in random runs (every call is polled
//! when it is made; a scenario pins that case), borrowed-slot deadlines, `Sharing::with` hooks (and their panics), callbacks that
//! panic, different result types under one key, and the race bypass of a decision that
//! changed between the advisory check and the admission (the model is sequential: it
//! reaches `raced` only through a refusal after the call queued).

mod bypass;
mod convert;
mod driver;
mod flights;
mod handles;
mod harness;
mod limits;
mod operations;
mod rate;
mod runs;
mod shared;
mod state;
mod values;

// The fuzz target `fuzz/fuzz_targets/operations.rs` includes this model too and uses only part
// of what the proptests and scenarios do.
#[allow(unused_imports)]
pub use flights::DedupKind;
#[allow(unused_imports)]
pub use harness::{Call, Classes, Config, Harness, MAX_CHARS, Op, Step};
#[allow(unused_imports)]
pub use rate::Rate;
#[allow(unused_imports)]
pub(crate) use rate::Status;
pub use values::ClassCaps;
#[allow(unused_imports)]
pub(crate) use values::{Constraint, Pool, Reason, Refused};
