//! A sequential reference model of [`LlmBulkhead`], and a harness that drives the real crate and
//! the model side by side, failing on the first disagreement.
//!
//! The model is the specification: plain integers, a `VecDeque` for the queue, no atomics, no
//! clock. Every rule cites where it comes from: `upstream §n` is
//! `shared/spec/upstream-behavior.md`, `Qn` is a deliberate difference listed in
//! `shared/spec/RUST-DESIGN.md` §4, and a few rules are the crate's own documented design
//! (named with their source file).
//!
//! # What the harness checks
//!
//! After every operation: every result (permit, rejection with reason and full capacity detail,
//! usage report, release report, verdict, limits outcome, error value), every live permit's
//! accessors, `stats()` field by field, and the events a subscribed listener received. When
//! auto-polling is on (the default), it then polls every waiting future and every pending
//! drain, in creation order, and checks everything again: the crate hands capacity to the
//! queue head at release time and the future picks it up at its next poll, so the state
//! between the two (a slot in flight that is not yet an admission) is checked too. `finish`
//! cancels every waiter, drops every permit and checks the end invariants.
//!
//! # Why a worker thread
//!
//! Borrowed permits and futures ([`Permit`], [`Acquire`], [`Drain`]) borrow the bulkhead, so
//! they cannot live in a struct next to it. The harness therefore keeps the bulkhead, the
//! model and everything borrowed on the stack of one worker thread and sends it the
//! operations one by one. A disagreement panics on the worker; the caller re-raises that panic
//! with its original message. Everything the crate does still happens on one thread, in a
//! deterministic order.
//!
//! # Left out
//!
//! Queue timeouts other than zero (a non-zero timeout is only ever "long", and never expires
//! during a run), several threads, `run`, the blocking acquires, estimators other than the
//! default model-aware one, and the timing figures of events.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, mpsc};
use std::task::{Context, Poll, Waker};
use std::thread;
use std::time::Duration;

use async_bulkhead_llm::futures::{Acquire, AcquireOwned, Drain};
use async_bulkhead_llm::{
    AcquireError, AcquireOptions, AdmissionId, ApplyOutcome, CapacityDetail, ConfigError,
    DrainReport, Event, Limits, LimitsError, LlmBulkhead, LlmRequest, MAX_BUDGET, MAX_CONCURRENT,
    MAX_REVISION, OwnedPermit, Permit, Priority, Progressive, RejectReason, Rejection,
    ReleaseReport, RequestError, Reservation, Stats, Subscription, TokenBudget, TokenUsage,
    UsageError, UsageReport, Verdict,
};

// ============================================================================================
// Public interface
// ============================================================================================

/// A bulkhead to build. [`Harness::new`] checks that the builder refuses out-of-range values
/// (in its documented order), then clamps them into range and builds that.
#[derive(Clone, Debug)]
pub struct Config {
    pub max_concurrent: u32,
    pub max_queue: u32,
    /// `(budget, high_priority_reserve)`.
    pub budget: Option<(u64, u64)>,
    pub initial_revision: u64,
}

/// What one call asks for: its priority, and either an explicit reservation or a request for
/// the bulkhead's estimator (the default model-aware one, upstream §13.3).
#[derive(Clone, Debug)]
pub struct Call {
    pub high: bool,
    /// Use `Reservation::new(input, max_output)` instead of the estimator.
    pub explicit: bool,
    pub input: u64,
    pub max_output: u64,
    /// The request's model: 0 = none (the bulkhead's, unknown: 4.0 chars per token), 1 =
    /// `gpt-4o` (3.7), 2 = `claude-sonnet-4` (3.9), 3 = `GPT-4o-mini` (3.7); taken modulo 4.
    pub model: u8,
    /// Characters of the user message (taken modulo [`MAX_CHARS`]).
    pub chars: u32,
    pub has_max_tokens: bool,
    pub max_tokens: u64,
    pub has_extra_input: bool,
    pub extra_input: u64,
}

/// One operation. Indices ("which permit", "which waiter") are taken modulo the number of live
/// ones (an operation on none does nothing); token counts are used as they are.
#[derive(Clone, Debug)]
pub enum Op {
    /// `try_acquire` (or `try_acquire_owned`).
    TryAcquire { owned: bool, call: Call },
    /// `acquire` (or `acquire_owned`), polled once; kept as a waiter if pending. `timeout`
    /// (modulo 4): 1 = zero (gives up at its first poll), 2 = one hour (never expires here),
    /// else none.
    Acquire {
        owned: bool,
        timeout: u8,
        call: Call,
    },
    /// `would_admit`, or `would_admit_with_detail`.
    WouldAdmit { with_detail: bool, call: Call },
    /// `estimate` of the call's request (its explicit reservation plays no part).
    Estimate { call: Call },
    /// `report_usage` on a live permit.
    ReportUsage {
        permit: u32,
        input: u64,
        output: u64,
    },
    /// `report_usage_progressive` on a live permit.
    ReportProgressive {
        permit: u32,
        input: u64,
        output: u64,
        remaining: u64,
        margin: u64,
    },
    /// `release` of a live permit, with `TokenUsage::new(input, output)` or without usage.
    Release {
        permit: u32,
        with_usage: bool,
        input: u64,
        output: u64,
    },
    /// Drops a live permit.
    DropPermit { permit: u32 },
    /// Drops a waiting future (cancellation).
    CancelWaiter { waiter: u32 },
    /// Polls one waiting future.
    PollWaiter { waiter: u32 },
    /// Turns re-polling every waiter and drain after each operation on or off.
    AutoPoll { on: bool },
    /// `apply_limits` at `current revision + revision_delta` (clamped to `0..=u64::MAX`), with
    /// a token budget iff the bulkhead has one, unless `flip_budget`.
    ApplyLimits {
        revision_delta: i64,
        max_concurrent: u32,
        max_queue: u32,
        flip_budget: bool,
        budget: u64,
        reserve: u64,
    },
    /// `set_budget`.
    SetBudget { tokens: u64 },
    /// `close`.
    Close,
    /// `drain_timeout(Duration::ZERO)` polled once, or `drain()` polled once and kept if
    /// pending.
    Drain { zero_timeout: bool },
    /// Subscribes (or drops) an event listener that records every event.
    Listen { on: bool },
}

/// Characters of a request's text are taken modulo this.
pub const MAX_CHARS: u32 = 12_000;

/// Drives a real bulkhead and the reference model side by side; panics with a clear message
/// on any disagreement.
pub struct Harness {
    commands: Option<mpsc::Sender<Command>>,
    replies: mpsc::Receiver<Reply>,
    worker: Option<thread::JoinHandle<()>>,
}

impl Harness {
    /// Builds the bulkhead (checking the builder's refusals of out-of-range values first) and
    /// the model.
    pub fn new(config: Config) -> Harness {
        let (commands, inbox) = mpsc::channel();
        let (outbox, replies) = mpsc::channel();
        let worker = thread::Builder::new()
            .name("model-harness".into())
            .spawn(move || serve(config, inbox, outbox))
            .expect("spawn the harness worker");
        let mut harness = Harness {
            commands: Some(commands),
            replies,
            worker: Some(worker),
        };
        harness.wait_for_reply();
        harness
    }

    /// Applies `op` to the crate and the model and checks that they agree.
    pub fn apply(&mut self, op: &Op) {
        self.request(Command::Apply(op.clone()));
    }

    /// Cancels every waiter, drops every permit, and checks the end invariants.
    pub fn finish(self) {
        self.finish_with_tally();
    }

    /// [`finish`](Harness::finish), returning how often each notable situation happened.
    pub(crate) fn finish_with_tally(mut self) -> BTreeMap<&'static str, u64> {
        let tally = match self.request(Command::Finish) {
            Reply::Tally(tally) => tally,
            Reply::Done => unreachable!("finishing is answered with the tally"),
        };
        self.commands = None;
        if let Some(worker) = self.worker.take()
            && let Err(payload) = worker.join()
        {
            std::panic::resume_unwind(payload);
        }
        tally
    }

    /// How often each notable situation happened so far (for tests that must reach them).
    #[allow(dead_code)]
    pub(crate) fn tally(&mut self) -> BTreeMap<&'static str, u64> {
        match self.request(Command::Tally) {
            Reply::Tally(tally) => tally,
            Reply::Done => unreachable!("a tally request is answered with the tally"),
        }
    }

    fn request(&mut self, command: Command) -> Reply {
        let sent = self
            .commands
            .as_ref()
            .is_some_and(|commands| commands.send(command).is_ok());
        if !sent {
            self.rethrow();
        }
        self.wait_for_reply()
    }

    fn wait_for_reply(&mut self) -> Reply {
        match self.replies.recv() {
            Ok(reply) => reply,
            Err(_) => self.rethrow(),
        }
    }

    /// The worker stopped: re-raise its panic here, with its message.
    fn rethrow(&mut self) -> ! {
        self.commands = None;
        let worker = self.worker.take().expect("the harness worker was running");
        match worker.join() {
            Err(payload) => std::panic::resume_unwind(payload),
            Ok(()) => panic!("the harness worker stopped without panicking"),
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        // Closing the channel stops the worker, which drops everything it holds.
        self.commands = None;
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

enum Command {
    Apply(Op),
    Tally,
    Finish,
}

enum Reply {
    Done,
    Tally(BTreeMap<&'static str, u64>),
}

/// The worker: owns the bulkhead and everything that borrows it.
fn serve(config: Config, inbox: mpsc::Receiver<Command>, outbox: mpsc::Sender<Reply>) {
    let (bulkhead, limits) = build(&config);
    let mut driver = Driver::new(&bulkhead, limits, config);
    driver.check_all();
    if outbox.send(Reply::Done).is_err() {
        return;
    }
    while let Ok(command) = inbox.recv() {
        let reply = match command {
            Command::Apply(op) => {
                driver.apply(op);
                Reply::Done
            }
            Command::Tally => Reply::Tally(driver.model.tally.clone()),
            Command::Finish => {
                driver.finish();
                let _ = outbox.send(Reply::Tally(driver.model.tally.clone()));
                return;
            }
        };
        if outbox.send(reply).is_err() {
            return;
        }
    }
}

// ============================================================================================
// The reference model
// ============================================================================================

/// The bulkhead's model name, unknown to the ratio table (fallback 4.0 chars per token,
/// upstream §13.3).
const MODEL_NAME: &str = "model-under-test";
/// Maximum output of a request without `max_tokens` (upstream §1.4 `tokenBudget.outputCap`).
const DEFAULT_OUTPUT_CAP: u64 = 2048;

/// Why a call was refused (upstream §1.3 `LLMRejectReason` without the dedup reason).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reason {
    Shutdown,
    ConcurrencyLimit,
    BudgetLimit,
    QueueLimit,
    Timeout,
    Aborted,
}

/// In the crate's declaration order (`RejectReason::ALL`).
const REASONS: [Reason; 6] = [
    Reason::Shutdown,
    Reason::ConcurrencyLimit,
    Reason::BudgetLimit,
    Reason::QueueLimit,
    Reason::Timeout,
    Reason::Aborted,
];

/// The versioned limits (upstream §8.1, without admission classes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ModelLimits {
    revision: u64,
    max_concurrent: u32,
    max_queue: u32,
    /// `(budget B, high-priority reserve R)`.
    budget: Option<(u64, u64)>,
}

/// The capacity snapshot of a decision (upstream §1.6 `LLMRejectDetail`, without classes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Detail {
    limit_revision: u64,
    in_flight: u64,
    max_concurrent: u32,
    pending: u64,
    max_queue: u32,
    tokens: Option<TokenDetail>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TokenDetail {
    budget: u64,
    in_flight_tokens: u64,
    effective_budget: u64,
    available: u64,
    requested: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Refused {
    reason: Reason,
    detail: Detail,
}

/// A resolved call (upstream §3.1): its priority and its reservation `(input, max_output)`,
/// none without a token budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ask {
    high: bool,
    reservation: Option<(u64, u64)>,
}

impl Ask {
    /// `r = input + max_output` (upstream §4.1); 0 without a budget. Resolution checked the sum.
    fn reserved(&self) -> u64 {
        self.reservation.map_or(0, |(input, output)| input + output)
    }
}

/// An admission as its permit sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ModelPermit {
    revision: u64,
    high: bool,
    reservation: Option<(u64, u64)>,
    /// Tokens it contributes to the tokens in flight (upstream §4.2).
    held: u64,
    /// Cumulative usage reported so far, per-field maximum (upstream §4.3 step 3).
    reported: Option<(u64, u64)>,
    sequence: u64,
}

impl ModelPermit {
    fn reserved(&self) -> u64 {
        self.reservation.map_or(0, |(input, output)| input + output)
    }
}

/// Where a waiting call is (crate queue.rs: queued, handed a slot, or refused, until its future
/// picks the outcome up).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WaiterState {
    Queued,
    /// Handed a slot and its tokens at this revision; not yet picked up.
    Handed {
        revision: u64,
    },
    /// Refused while waiting (already counted); not yet picked up.
    Refused(Refused),
}

#[derive(Clone, Copy, Debug)]
struct ModelWaiter {
    key: u64,
    ask: Ask,
    state: WaiterState,
}

/// How a newcomer is refused before the queue is considered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    Shutdown,
    Budget,
    NoSlot,
}

/// What an `acquire` did at its first poll.
enum Started {
    Admitted(ModelPermit),
    Refused(Refused),
    Queued(u64),
}

/// An event as recorded (the fields that are not timing).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Observed {
    Admit {
        revision: u64,
        reserved: u64,
        high: bool,
    },
    Reject(Refused),
    Usage {
        revision: u64,
        sequence: u64,
        reserved: u64,
        previous_held: u64,
        held: u64,
        usage: (u64, u64),
    },
    Release {
        revision: u64,
        reserved: u64,
        held: u64,
        refunded: u64,
        sequence: u64,
        usage: Option<(u64, u64)>,
    },
    Reconfigure {
        previous: ModelLimits,
        current: ModelLimits,
    },
    Other(String),
}

/// A usage report's snapshot (upstream §4.3 step 6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct UsageSnapshot {
    limit_revision: u64,
    sequence: u64,
    reserved: u64,
    held: u64,
    consumed: u64,
    output_cap: Option<u64>,
    output_remaining: Option<u64>,
    over_reservation: bool,
}

/// A settlement's report (crate permit.rs `ReleaseReport`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Settled {
    held_tokens: u64,
    refunded_tokens: u64,
    overrun_tokens: u64,
    usage: Option<(u64, u64)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LimitsOutcome {
    Applied {
        previous: ModelLimits,
        current: ModelLimits,
    },
    Stale {
        current: ModelLimits,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ModelVerdict {
    Admit,
    Queue,
    Reject(Reason),
}

/// `stats()` (upstream §12, merged into one block as the crate's stats.rs documents).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ModelStats {
    limits: ModelLimits,
    closed: bool,
    in_flight: u64,
    pending: u64,
    admitted: u64,
    released: u64,
    rejected: u64,
    rejected_by_reason: [u64; 6],
    tokens: Option<TokenStats>,
    listener_panics: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TokenStats {
    budget: u64,
    high_priority_reserve: u64,
    in_flight_tokens: u64,
    available: u64,
    total_reserved: u64,
    total_consumed: u64,
    total_refunded: u64,
    total_overrun: u64,
}

/// How one move of a hold is booked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Booking {
    overrun: u64,
    refunded: u64,
    reheld: u64,
}

/// Books a move of a hold from `old` to `new` tokens for an admission that reserved `r`
/// (crate usage.rs "Booking (our Q4 fix)"; Q4): what rises above `r` is overrun, what rises
/// back up to `r` re-holds tokens refunded earlier (and is taken off the refunds), and every
/// fall is refunded. So for an admission settled with usage,
/// `r + overrun == consumed + refunded - reheld` whatever path its hold took.
fn book(r: u64, old: u64, new: u64) -> Booking {
    if new >= old {
        Booking {
            overrun: new.max(r) - old.max(r),
            refunded: 0,
            reheld: new.min(r) - old.min(r),
        }
    } else {
        Booking {
            overrun: 0,
            refunded: old - new,
            reheld: 0,
        }
    }
}

/// A cumulative total as the crate shows it: saturating at `u64::MAX` (crate stats.rs).
fn saturate(total: u128) -> u64 {
    u64::try_from(total).unwrap_or(u64::MAX)
}

struct Model {
    /// Whether the bulkhead has a token budget (fixed at construction, upstream §1.4 notes).
    has_budget: bool,
    limits: ModelLimits,
    closed: bool,
    /// Slots held: by permits, and by waiters handed a slot that have not picked it up.
    slots: u64,
    /// Tokens in flight `T` (upstream §4).
    tokens: u64,
    /// Keys of the queued waiters, in arrival order (upstream §2: strictly FIFO).
    queue: VecDeque<u64>,
    /// Every waiter whose future has not finished, in creation order.
    waiters: Vec<ModelWaiter>,
    next_key: u64,
    admitted: u64,
    released: u64,
    rejected: [u64; 6],
    // Exact cumulative token totals; `stats()` saturates them like the crate.
    reserved: u128,
    consumed: u128,
    refunded: u128,
    reheld: u128,
    overrun: u128,
    /// Whether every settled admission with a reservation knew its usage (upstream §4.5).
    all_settled_with_usage: bool,
    /// Counts the moments the bulkhead became idle (upstream §15.2, Q5).
    idle_epoch: u64,
    /// Whether an event listener is subscribed.
    listening: bool,
    /// Events emitted and not yet compared.
    events: Vec<Observed>,
    /// Notable situations reached, for coverage checks.
    tally: BTreeMap<&'static str, u64>,
}

impl Model {
    fn new(limits: ModelLimits) -> Model {
        Model {
            has_budget: limits.budget.is_some(),
            limits,
            closed: false,
            slots: 0,
            tokens: 0,
            queue: VecDeque::new(),
            waiters: Vec::new(),
            next_key: 0,
            admitted: 0,
            released: 0,
            rejected: [0; 6],
            reserved: 0,
            consumed: 0,
            refunded: 0,
            reheld: 0,
            overrun: 0,
            all_settled_with_usage: true,
            idle_epoch: 0,
            listening: false,
            events: Vec::new(),
            tally: BTreeMap::new(),
        }
    }

    fn note(&mut self, what: &'static str) {
        *self.tally.entry(what).or_insert(0) += 1;
    }

    // ----- resolution (upstream §3.1, §3.7, §13.3) -----

    /// The estimate of the call's request by the default model-aware estimator (upstream
    /// §13.3): input `ceil(chars / ratio) + extra_input_tokens`, maximum output `max_tokens`
    /// or the output cap; a sum that does not fit in 64 bits is an error naming its parts.
    fn estimate(call: &Call) -> Result<(u64, u64), RequestError> {
        let ratio = match call.model % 4 {
            0 => 4.0, // the bulkhead's own model, unknown to the table: the fallback
            1 | 3 => 3.7,
            _ => 3.9,
        };
        let text_tokens = (f64::from(call.chars % MAX_CHARS) / ratio).ceil() as u64;
        let extra = if call.has_extra_input {
            call.extra_input
        } else {
            0
        };
        let input = text_tokens
            .checked_add(extra)
            .ok_or(RequestError::InputOverflow {
                text_tokens,
                opaque_tokens: 0,
                extra_input_tokens: extra,
            })?;
        let max_output = if call.has_max_tokens {
            call.max_tokens
        } else {
            DEFAULT_OUTPUT_CAP
        };
        match input.checked_add(max_output) {
            Some(_) => Ok((input, max_output)),
            None => Err(RequestError::ReservationOverflow { input, max_output }),
        }
    }

    /// Resolves a call (upstream §3.1): without a budget nothing is estimated and an override
    /// is ignored (step 4); an override replaces the estimator (step 5); else the estimator
    /// (step 6). An explicit reservation was checked when it was built.
    fn resolve(&self, call: &Call) -> Result<Ask, RequestError> {
        let reservation = if !self.has_budget {
            None
        } else if call.explicit {
            Some((call.input, call.max_output))
        } else {
            Some(Model::estimate(call)?)
        };
        Ok(Ask {
            high: call.high,
            reservation,
        })
    }

    // ----- derived figures -----

    fn pending(&self) -> u64 {
        self.queue.len() as u64
    }

    /// No slot held and nobody queued (upstream §15.2).
    fn is_idle(&self) -> bool {
        self.slots == 0 && self.queue.is_empty()
    }

    /// `E(priority)` (upstream §3.5, §5): the whole budget for high priority, the budget
    /// minus the reserve, at least 0, for normal priority.
    fn effective_budget(&self, high: bool) -> Option<u64> {
        self.limits.budget.map(|(budget, reserve)| {
            if high {
                budget
            } else {
                budget.saturating_sub(reserve)
            }
        })
    }

    /// The capacity snapshot for `ask`, now (upstream §1.6, §5 "detail example").
    fn detail(&self, ask: Ask) -> Detail {
        Detail {
            limit_revision: self.limits.revision,
            in_flight: self.slots,
            max_concurrent: self.limits.max_concurrent,
            pending: self.pending(),
            max_queue: self.limits.max_queue,
            tokens: self.limits.budget.map(|(budget, _)| {
                let effective_budget = self.effective_budget(ask.high).expect("a budget");
                TokenDetail {
                    budget,
                    in_flight_tokens: self.tokens,
                    effective_budget,
                    available: effective_budget.saturating_sub(self.tokens),
                    requested: ask.reserved(),
                }
            }),
        }
    }

    /// Upstream §3.4 step 1: refused iff `T + r > E(priority)` (strict: an exact fit
    /// admits; computed without overflow).
    fn tokens_fit(&self, ask: Ask) -> bool {
        match self.effective_budget(ask.high) {
            None => true,
            Some(effective) => {
                u128::from(self.tokens) + u128::from(ask.reserved()) <= u128::from(effective)
            }
        }
    }

    fn slot_free(&self) -> bool {
        self.slots < u64::from(self.limits.max_concurrent)
    }

    /// A newcomer, in the order Q1 fixes: shutdown first, then the priority-adjusted budget
    /// (which never queues, Q7), then a slot. Newcomers never pass a waiter (RUST-DESIGN §2
    /// "while waiters exist, newcomers cannot barge past them").
    fn judge_newcomer(&self, ask: Ask) -> Result<(), Refusal> {
        if self.closed {
            Err(Refusal::Shutdown)
        } else if !self.tokens_fit(ask) {
            Err(Refusal::Budget)
        } else if !self.slot_free() || !self.queue.is_empty() {
            Err(Refusal::NoSlot)
        } else {
            Ok(())
        }
    }

    /// A newcomer without a slot (upstream §2.1 steps 3-4, §3.8): zero concurrency or a zero
    /// queue never queues (`concurrency_limit`); a full queue is `queue_limit`.
    fn queue_verdict(&self) -> Result<(), Reason> {
        if self.limits.max_concurrent == 0 || self.limits.max_queue == 0 {
            Err(Reason::ConcurrencyLimit)
        } else if self.pending() >= u64::from(self.limits.max_queue) {
            Err(Reason::QueueLimit)
        } else {
            Ok(())
        }
    }

    // ----- state changes -----

    /// Takes a slot and `reserved` tokens in one step (Q7).
    fn take(&mut self, reserved: u64) {
        self.slots += 1;
        self.tokens += reserved;
    }

    /// Returns a slot and `held` tokens (upstream §4.4 step 5: `T -= heldAtRelease`), then
    /// serves the queue (upstream §2.4: release pumps).
    fn release_capacity(&mut self, held: u64) {
        let was_idle = self.is_idle();
        self.slots -= 1;
        self.tokens -= held;
        self.became_idle(was_idle);
        if !self.queue.is_empty() {
            self.pump();
        }
    }

    /// Takes `key` out of the queue.
    fn leave_queue(&mut self, key: u64) {
        let was_idle = self.is_idle();
        let at = self
            .queue
            .iter()
            .position(|&k| k == key)
            .expect("the waiter is queued");
        self.queue.remove(at);
        self.became_idle(was_idle);
    }

    /// Q5: becoming idle for any reason completes the drains waiting for it.
    fn became_idle(&mut self, was_idle: bool) {
        if !was_idle && self.is_idle() {
            self.idle_epoch += 1;
        }
    }

    /// Counts a refusal and snapshots the capacity now (upstream §2.1 "every rejection bumps
    /// `rejected` and `rejectedByReason`", §12).
    fn refuse(&mut self, reason: Reason, ask: Ask) -> Refused {
        self.rejected[reason as usize] += 1;
        Refused {
            reason,
            detail: self.detail(ask),
        }
    }

    /// Emits a reject event if someone listens now (upstream §11.2: every outcome reaches the
    /// listeners registered when it is announced, including an outcome of a call that waited
    /// in the queue since before they subscribed).
    fn announce_reject(&mut self, refused: Refused) {
        if self.listening {
            self.events.push(Observed::Reject(refused));
        }
    }

    /// Counts an admission (upstream §3.2 G: `admitted++`; §4.1: `totalReserved += r`) and
    /// builds its permit: it holds its reservation (upstream §4.1).
    fn admit(&mut self, ask: Ask, revision: u64) -> ModelPermit {
        self.admitted += 1;
        self.reserved += u128::from(ask.reserved());
        if self.listening {
            self.events.push(Observed::Admit {
                revision,
                reserved: ask.reserved(),
                high: ask.high,
            });
        }
        if ask.high
            && self
                .effective_budget(false)
                .is_some_and(|e| u128::from(self.tokens) > u128::from(e))
        {
            self.note("admitted into the high-priority reserve");
        }
        ModelPermit {
            revision,
            high: ask.high,
            reservation: ask.reservation,
            held: ask.reserved(),
            reported: None,
            sequence: 0,
        }
    }

    fn reason_of(refusal: Refusal, no_slot: Reason) -> Reason {
        match refusal {
            Refusal::Shutdown => Reason::Shutdown,
            Refusal::Budget => Reason::BudgetLimit,
            Refusal::NoSlot => no_slot,
        }
    }

    // ----- operations -----

    /// `try_acquire`: admits now or refuses now, never waits.
    fn try_acquire(&mut self, ask: Ask) -> Result<ModelPermit, Refused> {
        match self.judge_newcomer(ask) {
            Ok(()) => {
                self.take(ask.reserved());
                Ok(self.admit(ask, self.limits.revision))
            }
            Err(refusal) => {
                let refused = self.refuse(Model::reason_of(refusal, Reason::ConcurrencyLimit), ask);
                self.announce_reject(refused);
                self.note_refusal(refused.reason);
                Err(refused)
            }
        }
    }

    /// An `acquire` at its first poll (upstream §3.2 with Q1 and Q7, §2.1).
    fn acquire(&mut self, ask: Ask, zero_timeout: bool) -> Started {
        let reason = match self.judge_newcomer(ask) {
            Ok(()) => {
                self.take(ask.reserved());
                return Started::Admitted(self.admit(ask, self.limits.revision));
            }
            Err(Refusal::NoSlot) => match self.queue_verdict() {
                Ok(()) => {
                    let key = self.next_key;
                    self.next_key += 1;
                    self.queue.push_back(key);
                    self.note("queued");
                    if !zero_timeout {
                        self.waiters.push(ModelWaiter {
                            key,
                            ask,
                            state: WaiterState::Queued,
                        });
                        return Started::Queued(key);
                    }
                    // A zero timeout gives up at the first check (crate options.rs `timeout`):
                    // nothing can have been handed to it in between.
                    self.leave_queue(key);
                    self.note("timed out");
                    Reason::Timeout
                }
                Err(reason) => reason,
            },
            Err(refusal) => Model::reason_of(refusal, Reason::ConcurrencyLimit),
        };
        let refused = self.refuse(reason, ask);
        self.announce_reject(refused);
        self.note_refusal(reason);
        Started::Refused(refused)
    }

    fn note_refusal(&mut self, reason: Reason) {
        self.note(match reason {
            Reason::Shutdown => "refused: shutdown",
            Reason::ConcurrencyLimit => "refused: concurrency_limit",
            Reason::BudgetLimit => "refused: budget_limit",
            Reason::QueueLimit => "refused: queue_limit",
            Reason::Timeout => "refused: timeout",
            Reason::Aborted => "refused: aborted",
        });
    }

    fn waiter_mut(&mut self, key: u64) -> &mut ModelWaiter {
        self.waiters
            .iter_mut()
            .find(|w| w.key == key)
            .expect("a live waiter")
    }

    fn remove_waiter(&mut self, key: u64) -> ModelWaiter {
        let at = self
            .waiters
            .iter()
            .position(|w| w.key == key)
            .expect("a live waiter");
        self.waiters.remove(at)
    }

    /// Hands free capacity to the queue head, in order (upstream §2.3, with Q7: the head's
    /// slot and tokens are taken together). The head keeps its place until a slot frees,
    /// whatever its tokens; when one is free, tokens that do not fit refuse it `budget_limit`
    /// and the turn passes on (upstream §3.2 "Consequences"; crate policy.rs `Turn::Head`).
    fn pump(&mut self) {
        while let Some(&key) = self.queue.front() {
            let ask = self.waiter_mut(key).ask;
            let reason = if self.closed {
                // Unreachable: `close` empties the queue. The crate's policy says shutdown.
                Reason::Shutdown
            } else if !self.slot_free() {
                break;
            } else if self.tokens_fit(ask) {
                // Slot and tokens first, then out of the queue: one step in the crate.
                self.take(ask.reserved());
                self.leave_queue(key);
                let revision = self.limits.revision;
                self.waiter_mut(key).state = WaiterState::Handed { revision };
                self.note("handed a slot");
                if ask.reserved() > 0 {
                    self.note("handed a slot and tokens");
                }
                continue;
            } else {
                self.note("queue head refused for its tokens");
                Reason::BudgetLimit
            };
            self.leave_queue(key);
            let refused = self.refuse(reason, ask);
            self.waiter_mut(key).state = WaiterState::Refused(refused);
        }
    }

    /// Polls a waiter's future: a decided outcome is picked up (upstream §3.2 G happens now
    /// for a hand-off: the admission is counted and its permit built).
    fn poll_waiter(&mut self, key: u64) -> Poll<Result<ModelPermit, Refused>> {
        let waiter = *self.waiter_mut(key);
        match waiter.state {
            WaiterState::Queued => Poll::Pending,
            WaiterState::Handed { revision } => {
                self.remove_waiter(key);
                if self.closed {
                    self.note("hand-off picked up after close");
                }
                Poll::Ready(Ok(self.admit(waiter.ask, revision)))
            }
            WaiterState::Refused(refused) => {
                self.remove_waiter(key);
                self.announce_reject(refused);
                self.note_refusal(refused.reason);
                Poll::Ready(Err(refused))
            }
        }
    }

    /// Drops a waiter's future (RUST-DESIGN §3: a dropped waiter counts as `aborted`; §2: a
    /// hand-off it received passes on, "no stranded waiter").
    fn cancel_waiter(&mut self, key: u64) {
        let waiter = self.remove_waiter(key);
        let refused = match waiter.state {
            WaiterState::Queued => {
                self.leave_queue(key);
                self.note("cancelled while queued");
                self.refuse(Reason::Aborted, waiter.ask)
            }
            WaiterState::Handed { .. } => {
                // Counted with the slot still held, then the slot and tokens go back as a
                // release returns them (to the next waiter, if any).
                let refused = self.refuse(Reason::Aborted, waiter.ask);
                self.release_capacity(waiter.ask.reserved());
                self.note("cancelled after a hand-off");
                refused
            }
            WaiterState::Refused(refused) => {
                self.note("cancelled after a refusal");
                refused
            }
        };
        self.announce_reject(refused);
    }

    /// `report_usage` / `report_usage_progressive` (upstream §4.3; Q4 booking). Checks
    /// everything before changing anything.
    fn report(
        &mut self,
        permit: &mut ModelPermit,
        usage: (u64, u64),
        progressive: Option<(u64, u64)>,
    ) -> Result<UsageSnapshot, UsageError> {
        // Step 2: the remaining output may not exceed the reserved output cap (only checked
        // when there is a reservation).
        if let (Some((remaining, _)), Some((_, cap))) = (progressive, permit.reservation)
            && remaining > cap
        {
            self.note("usage error: remaining exceeds cap");
            return Err(UsageError::RemainingExceedsCap { remaining, cap });
        }
        // Step 3: cumulative, per field; the clamped total must fit in 64 bits.
        let reported = match permit.reported {
            None => usage,
            Some((input, output)) => (input.max(usage.0), output.max(usage.1)),
        };
        if reported.0.checked_add(reported.1).is_none() {
            self.note("usage error: clamped total overflows");
            return Err(UsageError::TotalOverflow {
                input: reported.0,
                output: reported.1,
            });
        }
        // Step 4: the new hold.
        let hold = match permit.reservation {
            None => Some(0),
            Some((_, max_output)) => match progressive {
                // Legacy: actual input plus the whole output reservation, expanded by output
                // beyond it.
                None => reported.0.checked_add(max_output.max(reported.1)),
                // Progressive: what may still come, plus the margin, plus output beyond the
                // reservation.
                Some((remaining, margin)) => remaining
                    .checked_add(margin)
                    .and_then(|h| h.checked_add(reported.1.saturating_sub(max_output))),
            },
        };
        // The hold, and the tokens in flight with it, must fit what the crate counts
        // (`MAX_BUDGET`, crate limits.rs).
        let tokens = hold.and_then(|hold| {
            (u128::from(self.tokens) - u128::from(permit.held) + u128::from(hold)
                <= u128::from(MAX_BUDGET))
            .then(|| self.tokens - permit.held + hold)
        });
        let (Some(hold), Some(tokens)) = (hold, tokens) else {
            self.note("usage error: hold overflows");
            return Err(UsageError::HoldOverflow);
        };
        let previous_hold = permit.held;
        let moved = hold != previous_hold;
        if moved {
            self.tokens = tokens;
            self.record(book(permit.reserved(), previous_hold, hold));
        }
        let usage_changed = permit.reported != Some(reported);
        permit.held = hold;
        permit.reported = Some(reported);
        // Step 5: only an effective report counts and is announced.
        if usage_changed || moved {
            permit.sequence += 1;
            if self.listening {
                self.events.push(Observed::Usage {
                    revision: permit.revision,
                    sequence: permit.sequence,
                    reserved: permit.reserved(),
                    previous_held: previous_hold,
                    held: hold,
                    usage: reported,
                });
            }
        } else {
            self.note("stale usage report");
        }
        if permit.reservation.is_some() && hold == 0 {
            self.note("hold driven to zero");
        }
        // Step 6: the snapshot.
        let consumed = reported.0 + reported.1;
        let output_cap = permit.reservation.map(|(_, cap)| cap);
        Ok(UsageSnapshot {
            limit_revision: permit.revision,
            sequence: permit.sequence,
            reserved: permit.reserved(),
            held: hold,
            consumed,
            output_cap,
            output_remaining: output_cap.map(|cap| cap.saturating_sub(reported.1)),
            over_reservation: permit.reservation.is_some() && consumed > permit.reserved(),
        })
    }

    fn record(&mut self, booking: Booking) {
        self.overrun += u128::from(booking.overrun);
        self.refunded += u128::from(booking.refunded);
        self.reheld += u128::from(booking.reheld);
        if booking.overrun > 0 {
            self.note("overrun booked");
        }
        if booking.reheld > 0 {
            self.note("tokens re-held");
        }
    }

    /// Settles an admission: `release(usage)`, or a drop (`usage` none) (upstream §4.4 with
    /// Q3: the usage given, else the last reported one, always reaches `total_consumed`; the
    /// hold moves to that usage before it is returned, booked like any move, crate usage.rs).
    fn settle(&mut self, permit: ModelPermit, usage: Option<(u64, u64)>) -> Settled {
        let usage = usage.or(permit.reported);
        let mut booking = book(0, 0, 0);
        match usage {
            Some((input, output)) => {
                let total = input + output;
                self.consumed += u128::from(total);
                if permit.reservation.is_some() {
                    booking = book(permit.reserved(), permit.held, total);
                    self.record(booking);
                    if permit.held == 0 {
                        self.note("settled a hold of zero with usage");
                    }
                }
            }
            None => {
                if permit.reservation.is_some() {
                    self.all_settled_with_usage = false;
                }
            }
        }
        self.released += 1;
        self.release_capacity(permit.held);
        if self.listening {
            self.events.push(Observed::Release {
                revision: permit.revision,
                reserved: permit.reserved(),
                held: permit.held,
                refunded: booking.refunded,
                sequence: permit.sequence,
                usage,
            });
        }
        Settled {
            held_tokens: permit.held,
            refunded_tokens: booking.refunded,
            overrun_tokens: booking.overrun,
            usage,
        }
    }

    /// Installs new limits (upstream §8.2 step 9): shrink by attrition, raised limits serve
    /// the queue at once.
    fn install(&mut self, next: ModelLimits) -> ModelLimits {
        let previous = self.limits;
        self.limits = next;
        if !self.queue.is_empty() {
            self.note("limits changed while calls wait");
            self.pump();
        }
        if self.listening {
            self.events.push(Observed::Reconfigure {
                previous,
                current: next,
            });
        }
        previous
    }

    /// `apply_limits` (upstream §8.2): the revision bound first (step 2), then staleness
    /// without examining the rest (step 3), then the rest (crate limits.rs `validate`: the
    /// word's bounds, and the budget's presence fixed at construction, step 5).
    fn apply_limits(&mut self, next: ModelLimits) -> Result<LimitsOutcome, LimitsError> {
        if next.revision > MAX_REVISION {
            self.note("limits refused");
            return Err(LimitsError::RevisionTooLarge {
                value: next.revision,
                max: MAX_REVISION,
            });
        }
        if next.revision <= self.limits.revision {
            self.note("stale limits");
            return Ok(LimitsOutcome::Stale {
                current: self.limits,
            });
        }
        let invalid = if next.max_concurrent > MAX_CONCURRENT {
            Some(LimitsError::MaxConcurrentTooLarge {
                value: next.max_concurrent,
                max: MAX_CONCURRENT,
            })
        } else {
            match (self.has_budget, next.budget) {
                (true, None) => Some(LimitsError::TokenBudgetRequired),
                (false, Some(_)) => Some(LimitsError::TokenBudgetNotConfigured),
                (true, Some((budget, _))) if budget > MAX_BUDGET => {
                    Some(LimitsError::BudgetTooLarge {
                        value: budget,
                        max: MAX_BUDGET,
                    })
                }
                _ => None,
            }
        };
        if let Some(error) = invalid {
            self.note("limits refused");
            return Err(error);
        }
        self.note("limits applied");
        let previous = self.install(next);
        Ok(LimitsOutcome::Applied {
            previous,
            current: next,
        })
    }

    /// `set_budget` (upstream §8.4): the budget only, at the next revision, keeping the
    /// reserve.
    fn set_budget(&mut self, tokens: u64) -> Result<ModelLimits, LimitsError> {
        let Some((_, reserve)) = self.limits.budget else {
            return Err(LimitsError::TokenBudgetNotConfigured);
        };
        if self.limits.revision >= MAX_REVISION {
            self.note("limits refused");
            return Err(LimitsError::RevisionExhausted {
                current: self.limits.revision,
            });
        }
        if tokens > MAX_BUDGET {
            self.note("limits refused");
            return Err(LimitsError::BudgetTooLarge {
                value: tokens,
                max: MAX_BUDGET,
            });
        }
        let next = ModelLimits {
            revision: self.limits.revision + 1,
            budget: Some((tokens, reserve)),
            ..self.limits
        };
        self.note("budget set");
        self.install(next);
        Ok(next)
    }

    /// `close` (upstream §15.1, Q1/Q2): idempotent; every queued waiter is refused
    /// `shutdown`, in order (a waiter already handed a slot keeps it).
    fn close(&mut self) -> bool {
        if self.closed {
            return false;
        }
        self.closed = true;
        // Upstream §15.1: every waiter is refused, and each refusal's detail is the state after
        // the close emptied the queue (`pending: 0` for all of them).
        let refused: Vec<u64> = self.queue.iter().copied().collect();
        for &key in &refused {
            self.leave_queue(key);
        }
        for key in refused {
            let ask = self.waiter_mut(key).ask;
            let refused = self.refuse(Reason::Shutdown, ask);
            self.waiter_mut(key).state = WaiterState::Refused(refused);
            self.note("waiter refused by close");
        }
        true
    }

    /// `would_admit` (upstream §3.6 with Q1): reserves and counts nothing.
    fn would_admit(&self, ask: Ask) -> (ModelVerdict, Detail) {
        let verdict = match self.judge_newcomer(ask) {
            Ok(()) => ModelVerdict::Admit,
            Err(Refusal::NoSlot) => match self.queue_verdict() {
                Ok(()) => ModelVerdict::Queue,
                Err(reason) => ModelVerdict::Reject(reason),
            },
            Err(refusal) => {
                ModelVerdict::Reject(Model::reason_of(refusal, Reason::ConcurrencyLimit))
            }
        };
        (verdict, self.detail(ask))
    }

    /// `drain_timeout(0)` (upstream §15.3: an idle bulkhead wins over the zero timer).
    fn drain_now(&self) -> (bool, u64, u64) {
        if self.is_idle() {
            (true, 0, 0)
        } else {
            (false, self.slots, self.pending())
        }
    }

    /// Whether a drain that started at `epoch` is done (Q5: idle now, or idle at some moment
    /// since).
    fn drain_done(&self, epoch: u64) -> bool {
        self.is_idle() || self.idle_epoch != epoch
    }

    fn stats(&self) -> ModelStats {
        ModelStats {
            limits: self.limits,
            closed: self.closed,
            in_flight: self.slots,
            pending: self.pending(),
            admitted: self.admitted,
            released: self.released,
            rejected: self.rejected.iter().sum(),
            rejected_by_reason: self.rejected,
            tokens: self.limits.budget.map(|(budget, reserve)| TokenStats {
                budget,
                high_priority_reserve: reserve,
                in_flight_tokens: self.tokens,
                // Not adjusted for priority (upstream §4.5, Q11).
                available: budget.saturating_sub(self.tokens),
                total_reserved: saturate(self.reserved),
                total_consumed: saturate(self.consumed),
                total_refunded: saturate(self.refunded - self.reheld),
                total_overrun: saturate(self.overrun),
            }),
            listener_panics: 0,
        }
    }
}

// ============================================================================================
// The driver: the real crate and the model side by side
// ============================================================================================

/// A live permit of either kind.
enum Live<'b> {
    Borrowed(Permit<'b>),
    Owned(OwnedPermit),
}

impl Live<'_> {
    fn report(
        &mut self,
        usage: TokenUsage,
        progressive: Option<Progressive>,
    ) -> Result<UsageReport, UsageError> {
        match (self, progressive) {
            (Live::Borrowed(p), None) => p.report_usage(usage),
            (Live::Borrowed(p), Some(g)) => p.report_usage_progressive(usage, g),
            (Live::Owned(p), None) => p.report_usage(usage),
            (Live::Owned(p), Some(g)) => p.report_usage_progressive(usage, g),
        }
    }

    fn release(self, usage: Option<TokenUsage>) -> ReleaseReport {
        match self {
            Live::Borrowed(p) => p.release(usage),
            Live::Owned(p) => p.release(usage),
        }
    }

    /// `(admission_id, held_tokens, reservation, limit_revision, high priority)`.
    fn accessors(&self) -> (AdmissionId, u64, Option<(u64, u64)>, u64, bool) {
        let (id, held, reservation, revision, priority) = match self {
            Live::Borrowed(p) => (
                p.admission_id(),
                p.held_tokens(),
                p.reservation(),
                p.limit_revision(),
                p.priority(),
            ),
            Live::Owned(p) => (
                p.admission_id(),
                p.held_tokens(),
                p.reservation(),
                p.limit_revision(),
                p.priority(),
            ),
        };
        (
            id,
            held,
            reservation.map(|r| (r.input(), r.max_output())),
            revision,
            priority == Priority::High,
        )
    }
}

/// A waiting future of either kind.
enum Waiting<'b> {
    Borrowed(Acquire<'b>),
    Owned(AcquireOwned),
}

impl<'b> Waiting<'b> {
    fn poll(&mut self) -> Poll<Result<Live<'b>, AcquireError>> {
        let mut cx = Context::from_waker(Waker::noop());
        match self {
            Waiting::Borrowed(f) => Pin::new(f).poll(&mut cx).map_ok(Live::Borrowed),
            Waiting::Owned(f) => Pin::new(f).poll(&mut cx).map_ok(Live::Owned),
        }
    }
}

struct LivePermit<'b> {
    real: Live<'b>,
    model: ModelPermit,
    id: AdmissionId,
}

struct Driver<'b> {
    bulkhead: &'b LlmBulkhead,
    model: Model,
    config: Config,
    permits: Vec<LivePermit<'b>>,
    /// Waiting futures with their model keys, in creation order.
    waiters: Vec<(Waiting<'b>, u64)>,
    /// Pending drains with the model's idle epoch when they started.
    drains: Vec<(Drain<'b>, u64)>,
    auto_poll: bool,
    recorded: Arc<Mutex<Vec<Observed>>>,
    subscription: Option<Subscription>,
    ids: HashSet<AdmissionId>,
    step: usize,
    /// The operation being checked, for messages.
    op: String,
}

/// Builds the bulkhead for `config`: first the raw values, whose out-of-range ones the builder
/// must refuse in its documented order (crate config.rs `build`), then the clamped ones.
fn build(config: &Config) -> (LlmBulkhead, ModelLimits) {
    let builder = |max_concurrent, initial_revision, budget: Option<(u64, u64)>| {
        let mut builder = LlmBulkhead::builder(MODEL_NAME, max_concurrent)
            .max_queue(config.max_queue)
            .initial_revision(initial_revision);
        if let Some((budget, reserve)) = budget {
            builder = builder.token_budget(TokenBudget::new(budget).high_priority_reserve(reserve));
        }
        builder.build()
    };
    let expected = if config.max_concurrent > MAX_CONCURRENT {
        Some(ConfigError::MaxConcurrentTooLarge {
            value: config.max_concurrent,
            max: MAX_CONCURRENT,
        })
    } else if config.initial_revision > MAX_REVISION {
        Some(ConfigError::InitialRevisionTooLarge {
            value: config.initial_revision,
            max: MAX_REVISION,
        })
    } else {
        match config.budget {
            Some((budget, _)) if budget > MAX_BUDGET => Some(ConfigError::BudgetTooLarge {
                value: budget,
                max: MAX_BUDGET,
            }),
            Some((budget, reserve)) if reserve > budget => {
                Some(ConfigError::ReserveExceedsBudget { reserve, budget })
            }
            _ => None,
        }
    };
    let raw = builder(
        config.max_concurrent,
        config.initial_revision,
        config.budget,
    );
    assert_eq!(
        raw.as_ref().err(),
        expected.as_ref(),
        "the builder's verdict on {config:?}"
    );
    let limits = ModelLimits {
        revision: config.initial_revision.min(MAX_REVISION),
        max_concurrent: config.max_concurrent.min(MAX_CONCURRENT),
        max_queue: config.max_queue,
        budget: config.budget.map(|(budget, reserve)| {
            let budget = budget.min(MAX_BUDGET);
            (budget, reserve.min(budget))
        }),
    };
    let bulkhead = match raw {
        Ok(bulkhead) => bulkhead,
        Err(_) => builder(limits.max_concurrent, limits.revision, limits.budget)
            .expect("a clamped configuration builds"),
    };
    (bulkhead, limits)
}

fn reason_of(reason: RejectReason) -> Reason {
    match reason {
        RejectReason::Shutdown => Reason::Shutdown,
        RejectReason::ConcurrencyLimit => Reason::ConcurrencyLimit,
        RejectReason::BudgetLimit => Reason::BudgetLimit,
        RejectReason::QueueLimit => Reason::QueueLimit,
        RejectReason::Timeout => Reason::Timeout,
        RejectReason::Aborted => Reason::Aborted,
        other => panic!("a reason the model does not know: {other:?}"),
    }
}

fn limits_of(limits: &Limits) -> ModelLimits {
    ModelLimits {
        revision: limits.revision,
        max_concurrent: limits.max_concurrent,
        max_queue: limits.max_queue,
        budget: limits
            .token_budget
            .map(|b| (b.budget, b.high_priority_reserve)),
    }
}

fn limits_from(limits: ModelLimits) -> Limits {
    let next = Limits::new(limits.revision, limits.max_concurrent).with_max_queue(limits.max_queue);
    match limits.budget {
        Some((budget, reserve)) => next.with_token_budget(budget, reserve),
        None => next,
    }
}

fn detail_of(d: &CapacityDetail) -> Detail {
    Detail {
        limit_revision: d.limit_revision,
        in_flight: d.in_flight,
        max_concurrent: d.max_concurrent,
        pending: d.pending,
        max_queue: d.max_queue,
        tokens: d.token_budget.map(|t| TokenDetail {
            budget: t.budget,
            in_flight_tokens: t.in_flight_tokens,
            effective_budget: t.effective_budget,
            available: t.available,
            requested: t.requested,
        }),
    }
}

fn refused_of(rejection: &Rejection) -> Refused {
    let refused = Refused {
        reason: reason_of(rejection.reason()),
        detail: detail_of(rejection.detail()),
    };
    assert_eq!(
        rejection.limit_revision(),
        refused.detail.limit_revision,
        "a rejection's revision is its detail's"
    );
    refused
}

fn usage_of(usage: Option<TokenUsage>) -> Option<(u64, u64)> {
    usage.map(|u| (u.input(), u.output()))
}

fn stats_of(s: &Stats) -> ModelStats {
    let by_reason = core::array::from_fn(|i| s.rejected_by_reason.get(RejectReason::ALL[i]));
    ModelStats {
        limits: limits_of(&s.limits),
        closed: s.closed,
        in_flight: s.in_flight,
        pending: s.pending,
        admitted: s.admitted,
        released: s.released,
        rejected: s.rejected,
        rejected_by_reason: by_reason,
        tokens: s.token_budget.map(|t| TokenStats {
            budget: t.budget,
            high_priority_reserve: t.high_priority_reserve,
            in_flight_tokens: t.in_flight_tokens,
            available: t.available,
            total_reserved: t.total_reserved,
            total_consumed: t.total_consumed,
            total_refunded: t.total_refunded,
            total_overrun: t.total_overrun,
        }),
        listener_panics: s.listener_panics,
    }
}

fn observe(event: &Event<'_>) -> Observed {
    match event {
        Event::Admit(e) => Observed::Admit {
            revision: e.limit_revision,
            reserved: e.reserved_tokens,
            high: e.priority == Priority::High,
        },
        Event::Reject(e) => Observed::Reject(Refused {
            reason: reason_of(e.reason),
            detail: {
                assert_eq!(e.limit_revision, e.detail.limit_revision);
                detail_of(&e.detail)
            },
        }),
        Event::Usage(e) => Observed::Usage {
            revision: e.limit_revision,
            sequence: e.sequence,
            reserved: e.reserved_tokens,
            previous_held: e.previous_held_tokens,
            held: e.held_tokens,
            usage: (e.usage.input(), e.usage.output()),
        },
        Event::Release(e) => Observed::Release {
            revision: e.limit_revision,
            reserved: e.reserved_tokens,
            held: e.held_tokens,
            refunded: e.refunded_tokens,
            sequence: e.usage_sequence,
            usage: usage_of(e.usage),
        },
        Event::Reconfigure(e) => Observed::Reconfigure {
            previous: limits_of(&e.previous),
            current: limits_of(&e.current),
        },
        other => Observed::Other(format!("{other:?}")),
    }
}

/// The request and options of a call, or the error building its explicit reservation.
fn prepare(call: &Call) -> Result<(LlmRequest, AcquireOptions), RequestError> {
    let mut request = LlmRequest::new();
    match call.model % 4 {
        1 => request = request.model("gpt-4o"),
        2 => request = request.model("claude-sonnet-4"),
        3 => request = request.model("GPT-4o-mini"),
        _ => {}
    }
    request = request.user("x".repeat((call.chars % MAX_CHARS) as usize));
    if call.has_max_tokens {
        request = request.max_tokens(call.max_tokens);
    }
    if call.has_extra_input {
        request = request.extra_input_tokens(call.extra_input);
    }
    let mut options = AcquireOptions::new().priority(if call.high {
        Priority::High
    } else {
        Priority::Normal
    });
    if call.explicit {
        options = options.reservation(Reservation::new(call.input, call.max_output)?);
    }
    Ok((request, options))
}

impl<'b> Driver<'b> {
    fn new(bulkhead: &'b LlmBulkhead, limits: ModelLimits, config: Config) -> Driver<'b> {
        // The model counts refusals by `reason as usize`, in the crate's order.
        assert_eq!(
            RejectReason::ALL
                .iter()
                .map(|&r| reason_of(r))
                .collect::<Vec<_>>(),
            REASONS
        );
        Driver {
            bulkhead,
            model: Model::new(limits),
            config,
            permits: Vec::new(),
            waiters: Vec::new(),
            drains: Vec::new(),
            auto_poll: true,
            recorded: Arc::new(Mutex::new(Vec::new())),
            subscription: None,
            ids: HashSet::new(),
            step: 0,
            op: "building the bulkhead".into(),
        }
    }

    /// Panics unless the crate's `real` equals the model's `model`.
    #[track_caller]
    fn agree<T: PartialEq + Debug>(&self, what: &str, real: T, model: T) {
        if real != model {
            panic!(
                "the crate and the model disagree on {what}\n  at step {} ({})\n  config: \
                 {:?}\n  crate: {real:?}\n  model: {model:?}",
                self.step, self.op, self.config
            );
        }
    }

    fn apply(&mut self, op: Op) {
        self.step += 1;
        self.op = format!("{op:?}");
        match op {
            Op::TryAcquire { owned, call } => self.try_acquire(owned, &call),
            Op::Acquire {
                owned,
                timeout,
                call,
            } => self.acquire(owned, timeout, &call),
            Op::WouldAdmit { with_detail, call } => self.would_admit(with_detail, &call),
            Op::Estimate { call } => self.estimate(&call),
            Op::ReportUsage {
                permit,
                input,
                output,
            } => self.report(permit, (input, output), None),
            Op::ReportProgressive {
                permit,
                input,
                output,
                remaining,
                margin,
            } => self.report(permit, (input, output), Some((remaining, margin))),
            Op::Release {
                permit,
                with_usage,
                input,
                output,
            } => self.release(permit, with_usage.then_some((input, output))),
            Op::DropPermit { permit } => {
                if !self.permits.is_empty() {
                    let at = permit as usize % self.permits.len();
                    let LivePermit { real, model, .. } = self.permits.remove(at);
                    drop(real);
                    // A drop settles with the last reported usage (RUST-DESIGN §3 `Drop`).
                    self.model.settle(model, None);
                }
            }
            Op::CancelWaiter { waiter } => {
                if !self.waiters.is_empty() {
                    let at = waiter as usize % self.waiters.len();
                    let (future, key) = self.waiters.remove(at);
                    drop(future);
                    self.model.cancel_waiter(key);
                }
            }
            Op::PollWaiter { waiter } => {
                if !self.waiters.is_empty() {
                    self.poll_waiter(waiter as usize % self.waiters.len());
                }
            }
            Op::AutoPoll { on } => self.auto_poll = on,
            Op::ApplyLimits {
                revision_delta,
                max_concurrent,
                max_queue,
                flip_budget,
                budget,
                reserve,
            } => {
                let revision = (i128::from(self.model.limits.revision) + i128::from(revision_delta))
                    .clamp(0, i128::from(u64::MAX)) as u64;
                let next = ModelLimits {
                    revision,
                    max_concurrent,
                    max_queue,
                    budget: (self.model.has_budget != flip_budget).then_some((budget, reserve)),
                };
                let real =
                    self.bulkhead
                        .apply_limits(limits_from(next))
                        .map(|outcome| match outcome {
                            ApplyOutcome::Applied { previous, current } => LimitsOutcome::Applied {
                                previous: limits_of(&previous),
                                current: limits_of(&current),
                            },
                            ApplyOutcome::Stale { current } => LimitsOutcome::Stale {
                                current: limits_of(&current),
                            },
                        });
                let model = self.model.apply_limits(next);
                self.agree("apply_limits", real, model);
            }
            Op::SetBudget { tokens } => {
                let real = self.bulkhead.set_budget(tokens).map(|l| limits_of(&l));
                let model = self.model.set_budget(tokens);
                self.agree("set_budget", real, model);
            }
            Op::Close => {
                let real = self.bulkhead.close();
                let model = self.model.close();
                self.agree("close", real, model);
                self.agree("is_closed", self.bulkhead.is_closed(), true);
            }
            Op::Drain { zero_timeout } => self.drain(zero_timeout),
            Op::Listen { on } => {
                if on && self.subscription.is_none() {
                    let sink = Arc::clone(&self.recorded);
                    self.subscription = Some(self.bulkhead.on(move |event| {
                        sink.lock().expect("the recorder").push(observe(event));
                    }));
                } else if !on {
                    self.subscription = None;
                }
                self.model.listening = on;
            }
        }
        self.check_all();
        if self.auto_poll {
            self.poll_all();
            self.check_all();
        }
    }

    /// A permit the crate granted, checked against the model's, and kept.
    fn keep(&mut self, real: Live<'b>, model: ModelPermit) {
        let (id, ..) = real.accessors();
        let new = self.ids.insert(id);
        self.agree("whether the admission id is new", new, true);
        self.permits.push(LivePermit { real, model, id });
    }

    /// The call's request and options, and the model's resolution of it; `None` when the
    /// explicit reservation cannot even be built (checked against the model).
    fn resolve(
        &mut self,
        call: &Call,
    ) -> Option<(LlmRequest, AcquireOptions, Result<Ask, RequestError>)> {
        match prepare(call) {
            Ok((request, options)) => Some((request, options, self.model.resolve(call))),
            Err(error) => {
                let expected = RequestError::ReservationOverflow {
                    input: call.input,
                    max_output: call.max_output,
                };
                self.agree("building the explicit reservation", error, expected);
                self.model.note("invalid explicit reservation");
                None
            }
        }
    }

    fn try_acquire(&mut self, owned: bool, call: &Call) {
        let Some((request, options, ask)) = self.resolve(call) else {
            return;
        };
        let real = if owned {
            self.bulkhead
                .try_acquire_owned(&request, options)
                .map(Live::Owned)
        } else {
            self.bulkhead
                .try_acquire(&request, options)
                .map(Live::Borrowed)
        };
        let model = ask.map(|ask| self.model.try_acquire(ask));
        self.outcome("try_acquire", real, model);
    }

    /// Checks a finished acquire against the model's outcome, keeping the permit.
    fn outcome(
        &mut self,
        what: &str,
        real: Result<Live<'b>, AcquireError>,
        model: Result<Result<ModelPermit, Refused>, RequestError>,
    ) {
        match (real, model) {
            (Ok(permit), Ok(Ok(expected))) => {
                let (_, held, reservation, revision, high) = permit.accessors();
                self.agree(
                    what,
                    (held, reservation, revision, high),
                    (
                        expected.held,
                        expected.reservation,
                        expected.revision,
                        expected.high,
                    ),
                );
                self.keep(permit, expected);
            }
            (Err(AcquireError::Rejected(rejection)), Ok(Err(expected))) => {
                self.agree(what, refused_of(&rejection), expected);
            }
            (Err(AcquireError::Invalid(error)), Err(expected)) => {
                self.model.note("invalid request");
                self.agree(what, error, expected);
            }
            (real, model) => {
                let real = real.map(|p| p.accessors());
                self.agree(what, format!("{real:?}"), format!("{model:?}"));
            }
        }
    }

    fn acquire(&mut self, owned: bool, timeout: u8, call: &Call) {
        let Some((request, mut options, ask)) = self.resolve(call) else {
            return;
        };
        let zero_timeout = timeout % 4 == 1;
        if zero_timeout {
            options = options.timeout(Duration::ZERO);
        } else if timeout % 4 == 2 {
            options = options.timeout(Duration::from_secs(3600));
        }
        let mut future = if owned {
            Waiting::Owned(self.bulkhead.acquire_owned(&request, options))
        } else {
            Waiting::Borrowed(self.bulkhead.acquire(&request, options))
        };
        let real = future.poll();
        let model = ask.map(|ask| self.model.acquire(ask, zero_timeout));
        match (real, model) {
            (Poll::Pending, Ok(Started::Queued(key))) => self.waiters.push((future, key)),
            (Poll::Ready(real), Ok(Started::Admitted(permit))) => {
                self.outcome("acquire", real, Ok(Ok(permit)));
            }
            (Poll::Ready(real), Ok(Started::Refused(refused))) => {
                self.outcome("acquire", real, Ok(Err(refused)));
            }
            (Poll::Ready(real), Err(error)) => self.outcome("acquire", real, Err(error)),
            (real, model) => {
                let real = real.map(|r| r.map(|p| p.accessors()));
                let model = model.map(|started| match started {
                    Started::Admitted(p) => format!("admitted {p:?}"),
                    Started::Refused(r) => format!("refused {r:?}"),
                    Started::Queued(key) => format!("queued as waiter {key}"),
                });
                self.agree("acquire", format!("{real:?}"), format!("{model:?}"));
            }
        }
    }

    fn poll_waiter(&mut self, at: usize) {
        let key = self.waiters[at].1;
        let real = self.waiters[at].0.poll();
        let model = self.model.poll_waiter(key);
        match (real, model) {
            (Poll::Pending, Poll::Pending) => {}
            (Poll::Ready(real), Poll::Ready(model)) => {
                self.waiters.remove(at);
                self.outcome("a waiter's poll", real, Ok(model));
            }
            (real, model) => {
                let real = real.map(|r| r.map(|p| p.accessors()));
                self.agree("a waiter's poll", format!("{real:?}"), format!("{model:?}"));
            }
        }
    }

    fn would_admit(&mut self, with_detail: bool, call: &Call) {
        let Some((request, options, ask)) = self.resolve(call) else {
            return;
        };
        let verdict_of = |verdict: Verdict| match verdict {
            Verdict::Admit => ModelVerdict::Admit,
            Verdict::Queue => ModelVerdict::Queue,
            Verdict::Reject(reason) => ModelVerdict::Reject(reason_of(reason)),
        };
        let model = ask.map(|ask| self.model.would_admit(ask));
        if with_detail {
            let real = self
                .bulkhead
                .would_admit_with_detail(&request, options)
                .map(|(verdict, detail)| (verdict_of(verdict), detail_of(&detail)));
            self.agree("would_admit_with_detail", real, model);
        } else {
            let real = self.bulkhead.would_admit(&request, options).map(verdict_of);
            self.agree("would_admit", real, model.map(|(verdict, _)| verdict));
        }
    }

    fn estimate(&mut self, call: &Call) {
        let request = match prepare(&Call {
            explicit: false,
            ..call.clone()
        }) {
            Ok((request, _)) => request,
            Err(_) => unreachable!("only an explicit reservation can fail to build"),
        };
        let real = self
            .bulkhead
            .estimate(&request)
            .map(|r| r.map(|r| (r.input(), r.max_output())));
        // Upstream §3.7: `None` without a budget; never reflects an override.
        let model = if self.model.has_budget {
            Model::estimate(call).map(Some)
        } else {
            Ok(None)
        };
        self.agree("estimate", real, model);
    }

    fn report(&mut self, permit: u32, usage: (u64, u64), progressive: Option<(u64, u64)>) {
        if self.permits.is_empty() {
            return;
        }
        let at = permit as usize % self.permits.len();
        let token_usage = match TokenUsage::new(usage.0, usage.1) {
            Ok(u) => u,
            Err(error) => {
                let expected = UsageError::TotalOverflow {
                    input: usage.0,
                    output: usage.1,
                };
                self.agree("building the usage", error, expected);
                return;
            }
        };
        let progress = progressive
            .map(|(remaining, margin)| Progressive::new(remaining).safety_margin(margin));
        let live = &mut self.permits[at];
        let real = live.real.report(token_usage, progress);
        let id = live.id;
        let mut model_permit = live.model;
        let model = self.model.report(&mut model_permit, usage, progressive);
        self.permits[at].model = model_permit;
        let real = real.map(|r| {
            self.agree("a usage report's admission id", r.admission_id, id);
            UsageSnapshot {
                limit_revision: r.limit_revision,
                sequence: r.sequence,
                reserved: r.reserved,
                held: r.held,
                consumed: r.consumed,
                output_cap: r.output_cap,
                output_remaining: r.output_remaining,
                over_reservation: r.over_reservation,
            }
        });
        self.agree("a usage report", real, model);
    }

    fn release(&mut self, permit: u32, usage: Option<(u64, u64)>) {
        if self.permits.is_empty() {
            return;
        }
        let at = permit as usize % self.permits.len();
        let token_usage = match usage.map(|(input, output)| TokenUsage::new(input, output)) {
            None => None,
            Some(Ok(u)) => Some(u),
            Some(Err(error)) => {
                let (input, output) = usage.expect("usage");
                self.agree(
                    "building the usage",
                    error,
                    UsageError::TotalOverflow { input, output },
                );
                return;
            }
        };
        let LivePermit { real, model, .. } = self.permits.remove(at);
        let real = real.release(token_usage);
        let model = self.model.settle(model, usage);
        let real = Settled {
            held_tokens: real.held_tokens,
            refunded_tokens: real.refunded_tokens,
            overrun_tokens: real.overrun_tokens,
            usage: usage_of(real.usage),
        };
        self.agree("a release report", real, model);
    }

    fn drain(&mut self, zero_timeout: bool) {
        let mut cx = Context::from_waker(Waker::noop());
        if zero_timeout {
            let mut future = self.bulkhead.drain_timeout(Duration::ZERO);
            let real = match Pin::new(&mut future).poll(&mut cx) {
                Poll::Ready(DrainReport {
                    drained,
                    in_flight,
                    pending,
                    ..
                }) => Some((drained, in_flight, pending)),
                Poll::Pending => None,
            };
            self.agree("drain_timeout(0)", real, Some(self.model.drain_now()));
        } else {
            let mut future = self.bulkhead.drain();
            let epoch = self.model.idle_epoch;
            let ready = Pin::new(&mut future).poll(&mut cx).is_ready();
            self.agree("a new drain's readiness", ready, self.model.is_idle());
            if !ready {
                self.drains.push((future, epoch));
            }
        }
    }

    /// Polls every waiter and every pending drain, in creation order.
    fn poll_all(&mut self) {
        let keys: Vec<u64> = self.waiters.iter().map(|(_, key)| *key).collect();
        for key in keys {
            let at = self
                .waiters
                .iter()
                .position(|(_, k)| *k == key)
                .expect("still waiting");
            self.poll_waiter(at);
        }
        let mut cx = Context::from_waker(Waker::noop());
        let mut at = 0;
        while at < self.drains.len() {
            let (future, epoch) = &mut self.drains[at];
            let epoch = *epoch;
            let ready = Pin::new(future).poll(&mut cx).is_ready();
            self.agree(
                "a pending drain's readiness",
                ready,
                self.model.drain_done(epoch),
            );
            if ready {
                self.model.note("pending drain completed");
                drop(self.drains.remove(at));
            } else {
                at += 1;
            }
        }
    }

    /// Stats, events and every live permit.
    fn check_all(&mut self) {
        self.agree(
            "stats()",
            stats_of(&self.bulkhead.stats()),
            self.model.stats(),
        );
        self.agree(
            "limits()",
            limits_of(&self.bulkhead.limits()),
            self.model.limits,
        );
        let events = std::mem::take(&mut *self.recorded.lock().expect("the recorder"));
        let expected = std::mem::take(&mut self.model.events);
        self.agree("the events", events, expected);
        for p in &self.permits {
            self.agree(
                "a live permit's accessors",
                p.real.accessors(),
                (
                    p.id,
                    p.model.held,
                    p.model.reservation,
                    p.model.revision,
                    p.model.high,
                ),
            );
        }
    }

    /// Cancels every waiter, drops every permit (oldest first), and checks the end
    /// invariants (upstream §4.5, §15).
    fn finish(&mut self) {
        self.op = "finish".into();
        self.step += 1;
        while !self.waiters.is_empty() {
            let (future, key) = self.waiters.remove(0);
            drop(future);
            self.model.cancel_waiter(key);
            self.check_all();
        }
        while !self.permits.is_empty() {
            let LivePermit { real, model, .. } = self.permits.remove(0);
            drop(real);
            self.model.settle(model, None);
            self.check_all();
        }
        // Q5: every pending drain completes once the bulkhead is idle.
        self.poll_all();
        self.agree("drains left pending when idle", self.drains.len(), 0);
        let mut cx = Context::from_waker(Waker::noop());
        let drained = Pin::new(&mut self.bulkhead.drain())
            .poll(&mut cx)
            .is_ready();
        self.agree("an idle bulkhead's drain", drained, true);
        self.check_all();

        let stats = self.bulkhead.stats();
        self.agree("the slots in flight at the end", stats.in_flight, 0);
        self.agree("the calls waiting at the end", stats.pending, 0);
        self.agree(
            "admitted == released at the end",
            stats.admitted,
            stats.released,
        );
        if let Some(t) = stats.token_budget {
            self.agree("the tokens in flight at the end", t.in_flight_tokens, 0);
            let saturated = [
                t.total_reserved,
                t.total_consumed,
                t.total_refunded,
                t.total_overrun,
            ]
            .contains(&u64::MAX);
            if self.model.all_settled_with_usage && !saturated {
                self.agree(
                    "reserved + overrun == consumed + refunded",
                    u128::from(t.total_reserved) + u128::from(t.total_overrun),
                    u128::from(t.total_consumed) + u128::from(t.total_refunded),
                );
                self.model.note("token identity checked");
            }
        }
    }
}
