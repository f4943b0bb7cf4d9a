//! Deduplication and observe-mode stress (`run_shared`, `docs/design.md` §U9, §U10) on the
//! kit's runtimes (tokio multi-thread and current-thread, smol, async-std, a futures thread
//! pool, a thread per task), with its seeds, watchdog, `STRESS_SCALE`, worker loop and
//! control-plane loop (`crate::kit`); this family keeps its calls (`callers`, `requests`), its
//! listener that knows in whose hands each event was emitted (`heard`), its records (`books`)
//! and its end-of-run checks (`checks`).
//!
//! Many callers issue `run_shared` calls drawn from a small table of requests (`requests`): 4
//! prompts, each in 3 variants that differ by one field (`max_tokens`, or the temperature in
//! `extra`), each written in several forms that must share (JSON bodies with their keys in
//! another order, null members, a request built in code), in a random scope among three. Every
//! call has random options: `no_dedup`, observe mode (every reason, or only `timeout`), a short
//! explicit timeout (a follower's own wait, or a leader's queue wait), and a random end: none,
//! dropped before its first poll, after a few polls, or after a short delay. Some calls come
//! in bursts of the same key, made before any of them is polled. Callbacks sleep a little,
//! report growing usage and sometimes fail. The bulkhead is small (2 slots, a queue of 2, a
//! token budget of 1,500) so that calls are refused, queued, timed out and bypassed, while a
//! control plane changes its limits and then closes it (after which nothing may wait and
//! slots in flight only fall).
//!
//! Every callback returns a value naming its run (a number from a counter), the caller that
//! owns the callback, and the request's identity and scope; a failing callback returns the
//! same as its error. A caller's role is read from the [`DedupEvent`] emitted on its own thread
//! while `run_shared` registers it, and calls of one key are made under that key's lock, so
//! the callers know exactly which shared call ("flight") each follower joined. Each poll and
//! drop of a caller's future runs with the caller named in a thread-local, so the listener
//! knows in whose hands every refusal was counted (any waiter drives a shared call: its
//! refusals are counted while one of its waiters polls or drops it).
//!
//! Exact at the end of each run:
//! - every caller got exactly one outcome (a value, an error or a refusal) unless it was
//!   cancelled; a call made after `close()` returned never followed and, once polled, was
//!   refused `shutdown`;
//! - every value or error a caller got came from the callback of its own flight's leader (or,
//!   for a follower in observe mode whose own timeout passed, from its own bypassed callback),
//!   of the same request identity and scope; every waiter of a flight that got the flight's
//!   outcome got the same one; callbacks ran only in the polls of their flight's waiters;
//! - followers joined in order (`DedupEvent::followers` 1, 2, ... per flight), `hits` equals
//!   the followers the callers counted and the dedup events heard, and `active` is 0;
//! - callbacks run == `admitted` + `observe.bypassed`; the admitted ones are exactly the
//!   flights' leaders (or solo calls) the bulkhead admitted (their ids are the admit and
//!   release events' ids), the bypassed ones match `bypassed_by_reason` and `race_bypassed`
//!   and the bypass events; followers never hold an admission;
//! - every refusal is accounted for, by reason, in the hands it was counted in: a flight's
//!   refusal is counted once however many waiters got it (the reason they got), or once when
//!   its queued call is dropped with its last waiter (never if no waiter polled it); a bypass
//!   is counted only when the admission itself refused it (`raced`, or a queue timeout); a
//!   follower's own timeout is counted `timeout` (untimed, not before its timeout passed) and
//!   its cancellation before its outcome `aborted` (if it was polled); a bypass that meets the
//!   close adds its `shutdown` (the double refusal of observe mode, Q6); a leader never has
//!   refusals of its own; the sums by reason are `rejected_by_reason`;
//! - nothing is left in flight, queued or held (`in_flight`, `pending`, tokens), the token
//!   books equal the admitted callbacks' reservations and reported usage, and the observe
//!   usage figures equal the bypassed callbacks' reports.
//!
//! `requests` also checks the table once, deterministically: every form of an identity joins
//! the same flight, and no two identities or scopes share one. `found` keeps what the stress
//! found in the crate, as the smallest tests that fail because of it (ignored until fixed).
//!
//! Seeds are printed when a scenario fails (`CHAOS_SEED=<seed>` replays its random choices;
//! the interleaving differs), a watchdog aborts a hang, and `STRESS_SCALE` (default 1)
//! multiplies the operations per worker.
//!
//! Calls of one key are made one at a time (under the key's lock: the registry serializes them
//! anyway), so the window between a leader's registration and the installation of its call,
//! inside `run_shared` itself, is not raced here.
//!
//! [`DedupEvent`]: async_bulkhead_llm::events::DedupEvent

mod books;
mod callers;
mod checks;
mod control_plane;
mod found;
mod heard;
mod requests;
mod runtimes;

/// The bulkhead's `max_concurrent` (the control plane moves it between 1 and `PEAK_SLOTS`).
const SLOTS: u32 = 2;
const PEAK_SLOTS: u32 = 3;
/// The bulkhead's `max_queue` (the control plane moves it between 0 and `PEAK_QUEUE`).
const QUEUE: u32 = 2;
const PEAK_QUEUE: u32 = 3;
/// The token budget (the control plane moves it between `BUDGET / 2` and `2 * BUDGET`).
const BUDGET: u64 = 1_500;
/// Operations every worker performs after it saw the close (all of them refused).
const POST_CLOSE_OPS: u64 = 6;
