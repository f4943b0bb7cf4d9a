//! The public interface of the reference model: what to build ([`Config`]), the
//! operations ([`Op`], [`Call`]), and the [`Harness`] that applies them to the crate and
//! the model on a worker thread.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::mpsc;
use std::thread;

use std::time::Duration;

use async_bulkhead_llm::limits::MAX_CONCURRENT;
use async_bulkhead_llm::rate::ManualClock;

use super::convert::build;
use super::driver::Driver;
use super::flights::DedupKind;
use super::rate::Rate;
use super::state::Model;
use super::values::ClassCaps;

/// A bulkhead to build. [`Harness::new`] checks that the builder refuses out-of-range values
/// (in its documented order), then clamps them into range and builds that.
#[derive(Clone, Debug)]
pub struct Config {
    pub max_concurrent: u32,
    pub max_queue: u32,
    /// `(budget, high_priority_reserve)`.
    pub budget: Option<(u64, u64)>,
    pub initial_revision: u64,
    /// Admission classes, if any.
    pub classes: Option<Classes>,
    /// In-flight deduplication, if any.
    pub dedup: Option<DedupKind>,
    /// The bulkhead's rate windows, if any (valid values only: the builder's refusals of rate
    /// limits are not checked), read on a manual clock the harness owns.
    pub rate: Option<Rate>,
}

/// Admission classes to build with: each class's limits, in order (the ids are the first of
/// `CLASS_IDS`, at most four classes), and the default class (a position, taken modulo the
/// number of classes). Values the builder refuses (design §U6.1) are checked, then repaired:
/// clamped, floors lowered to their ceilings, token limits dropped without a budget, and
/// floors dropped whose sum is too large.
#[derive(Clone, Debug)]
pub struct Classes {
    pub default: usize,
    pub caps: Vec<ClassCaps>,
}

/// What one call asks for: its class, its priority, and either an explicit reservation or a
/// request for the bulkhead's estimator (the default model-aware one, design §U13.3).
#[derive(Clone, Debug)]
pub struct Call {
    /// 0 = none (the default class); 1 to 4 = the bulkhead's class `(n - 1)` modulo the number
    /// of classes; 5 and more = a handle of another bulkhead (design §U6.2). Without classes,
    /// any class is another bulkhead's.
    pub class: u8,
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
    /// Moves the rate windows' manual clock (and the model's) forward.
    Advance { by: Duration },
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
    /// `abandon_borrowed_concurrency` on a live permit.
    Abandon { permit: u32 },
    /// Drops a waiting future (cancellation).
    CancelWaiter { waiter: u32 },
    /// Polls one waiting future.
    PollWaiter { waiter: u32 },
    /// Turns re-polling every waiter and drain after each operation on or off.
    AutoPoll { on: bool },
    /// `apply_limits` at `current revision + revision_delta` (clamped to `0..=u64::MAX`), with
    /// a token budget iff the bulkhead has one, unless `flip_budget`. Its class part
    /// (`class_shape` modulo 9): 0 = the classes' limits in force; 1 to 4 = `classes` (the
    /// first of them, one per class); 5 = present iff the bulkhead has no classes; 6 = the last
    /// class left out; 7 = the last class renamed to an unknown id; 8 = an unknown id added.
    /// The ids come in an order picked by `class_order` (a rotation, reversed if odd).
    ApplyLimits {
        revision_delta: i64,
        max_concurrent: u32,
        max_queue: u32,
        flip_budget: bool,
        budget: u64,
        reserve: u64,
        class_shape: u8,
        class_order: u8,
        classes: [ClassCaps; 4],
    },
    /// `apply_limits` of the limits in force at `current revision + revision_delta` (clamped
    /// as for [`Op::ApplyLimits`]) with `rate` as the rate limits (none: without any).
    ApplyRate {
        revision_delta: i64,
        rate: Option<Rate>,
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
    /// `run_with_usage`, polled once, kept while it waits or its callback runs. `timeout` as
    /// for [`Op::Acquire`]; `deadline` (modulo 5), the borrowed-slot deadline: 0 = none, 1 =
    /// zero (refused), 2 = 1 ms (a borrowed slot is then driven to the deadline at once,
    /// blocking), 3 = one hour, 4 = `Duration::MAX` (never passes). At admission the callback
    /// first reports `report_first` if any, abandons its borrowed slot if `abandon_first`,
    /// and finishes at once (with no usage of its own) if `finish_first`; then it waits for
    /// the operations below. `observe` (modulo 6) picks observe mode: 0 = none (enforce); 1 =
    /// every reason that may be bypassed; 2 = budget; 3 = timeout; 4 = concurrency and queue
    /// limit; 5 = the empty set. A bypassed callback runs the same steps (holding nothing, so
    /// its abandonment is refused, and no deadline applies).
    Run {
        call: Call,
        timeout: u8,
        deadline: u8,
        report_first: Option<(u64, u64)>,
        abandon_first: bool,
        finish_first: bool,
        observe: u8,
    },
    /// A running callback reports usage (progressive if `progressive` is some:
    /// `(remaining, margin)`).
    RunReport {
        run: u32,
        input: u64,
        output: u64,
        progressive: Option<(u64, u64)>,
    },
    /// A running callback abandons its borrowed slot.
    RunAbandon { run: u32 },
    /// A running callback finishes: `Ok(usage)` (settled with it, else the last reported
    /// one) or an error (settled with the last reported usage).
    RunFinish {
        run: u32,
        ok: bool,
        usage: Option<(u64, u64)>,
    },
    /// Drops a run's future, waiting or running (index over every run).
    DropRun { run: u32 },
    /// `run_shared` (or, with `extract`, `run_shared_with` settling with the usage in the
    /// value), polled once, kept until its outcome: it leads, follows or runs alone. `scope`
    /// (modulo 3): 0 = the unnamed scope, else one of two named ones; `timeout` as for
    /// [`Op::Acquire`] (a follower's own wait: zero gives up at its first poll); `observe` as
    /// for [`Op::Run`]. If its own callback is called it first reports `report_first` if any,
    /// and finishes at once (with no usage of its own) if `finish_first`; then it waits for
    /// [`Op::SharedStep`].
    Shared {
        call: Call,
        scope: u8,
        no_dedup: bool,
        timeout: u8,
        observe: u8,
        report_first: Option<(u64, u64)>,
        finish_first: bool,
        extract: bool,
    },
    /// The callback of a running shared call (index over them) takes `step`, and the call is
    /// polled through one of its waiters (`via`, modulo their number): the leader's, or a
    /// follower's.
    SharedStep { flight: u32, via: u32, step: Step },
    /// Drops a `run_shared` caller's future (index over every caller not finished).
    DropShared { caller: u32 },
    /// Polls one `run_shared` caller.
    PollShared { caller: u32 },
}

/// What a running shared callback does (see [`Op::SharedStep`]).
#[derive(Clone, Copy, Debug)]
pub enum Step {
    /// Reports usage (progressive if `progressive` is some: `(remaining, margin)`).
    Report {
        input: u64,
        output: u64,
        progressive: Option<(u64, u64)>,
    },
    /// Gives its borrowed slot back.
    Abandon,
    /// Finishes: `Ok(usage)` or an error.
    Finish { ok: bool, usage: Option<(u64, u64)> },
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
            _ => unreachable!("finishing is answered with the tally"),
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
            _ => unreachable!("a tally request is answered with the tally"),
        }
    }

    /// Reads the model (which agrees with the crate so far): for scenarios that pin exact
    /// figures.
    pub(crate) fn inspect<R: Send + 'static>(
        &mut self,
        read: impl FnOnce(&Model) -> R + Send + 'static,
    ) -> R {
        let read: Inspect = Box::new(move |model| Box::new(read(model)));
        match self.request(Command::Inspect(read)) {
            Reply::Inspected(value) => *value.downcast().expect("the type read"),
            _ => unreachable!("an inspection is answered with its value"),
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

type Inspect = Box<dyn FnOnce(&Model) -> Box<dyn Any + Send> + Send>;

enum Command {
    Apply(Op),
    Tally,
    Inspect(Inspect),
    Finish,
}

enum Reply {
    Done,
    Tally(BTreeMap<&'static str, u64>),
    Inspected(Box<dyn Any + Send>),
}

/// The worker: owns the bulkhead and everything that borrows it.
fn serve(config: Config, inbox: mpsc::Receiver<Command>, outbox: mpsc::Sender<Reply>) {
    let clock = ManualClock::new();
    let (bulkhead, limits, default_class, classes_refused) = build(&config, &clock);
    let mut driver = Driver::new(&bulkhead, limits, default_class, config, clock);
    if classes_refused {
        driver.model.note("classes refused by the builder");
    }
    if limits.classes.is_some() && limits.max_concurrent == MAX_CONCURRENT {
        driver.model.note("classes at the engine's bounds");
    }
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
            Command::Inspect(read) => Reply::Inspected(read(&driver.model)),
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
