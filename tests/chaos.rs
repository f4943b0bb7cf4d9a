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
//! in flight never grow, nothing waits, and every `drain()` started along the way resolves.
//!
//! Every caller models its own admission (the hold rules and the booking split, written
//! independently of `src/usage.rs`) and checks every report and release against it. Each run
//! ends with exact invariants: nothing in flight (slots, tokens) or queued, `admitted ==
//! released`, `admitted + rejected ==` the calls that were decided (counted by the callers,
//! with a wrapper that knows whether an acquire future was ever polled), every token booking
//! equal to the callers' sums, `reserved + overrun == consumed + refunded` when every admission
//! settled with usage, the listener's events matching, and never more holders than
//! `max_concurrent` (an independent ledger kept by the callers) while it is fixed.
//!
//! Seeds are random per run and printed when a scenario fails (`CHAOS_SEED=<seed>` replays the
//! same random choices; the interleaving differs). A watchdog aborts a scenario that hangs.
//!
//! `STRESS_SCALE` (default 1) multiplies the operations per worker, e.g. `STRESS_SCALE=100`.

mod common;

use std::any::Any;
use std::collections::HashSet;
use std::future::{Future, poll_fn};
use std::panic::{AssertUnwindSafe, resume_unwind};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, AdmissionId, ApplyOutcome, Event, Limits, LimitsError,
    LlmBulkhead, LlmRequest, MAX_BUDGET, MAX_CONCURRENT, Priority, Progressive, RejectReason,
    Reservation, RunContext, RunError, TokenBudget, TokenUsage, Verdict,
};
use common::{AnyPermit, Model, Reporter, Settled};
use futures::FutureExt;
use futures::future::{Either, join_all, select};

fn scale() -> u64 {
    std::env::var("STRESS_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1)
}

/// `CHAOS_SEED` if set (to replay a failure's random choices), else a fresh random seed.
fn fresh_seed() -> u64 {
    std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..))
}

/// Mixes a seed with a stream number (splitmix64), so workers get unrelated sequences.
fn mix(seed: u64, stream: u64) -> u64 {
    let mut z = seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).expect("usage fits in u64")
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
/// Far above `MAX_BUDGET`: a hold this large can never be counted (`HoldOverflow`).
const HUGE: u64 = 1 << 40;
/// Operations every worker performs after it saw the close (all of them refused).
const POST_CLOSE_OPS: u64 = 12;

// ------------------------------------------------------------------------------------------
// Scenarios and runtimes.
// ------------------------------------------------------------------------------------------

/// What the control plane changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plane {
    /// Nothing (only stale and invalid snapshots, which change nothing): fixed limits.
    Fixed,
    /// The budget, the reserve and the queue; `max_concurrent` stays at `SLOTS`.
    SlotsFixed,
    /// Everything, `max_concurrent` 0 (the kill switch) and `max_queue` 0 included.
    Varying,
}

#[derive(Clone, Copy, Debug)]
struct Setup {
    seed: u64,
    plane: Plane,
    /// Every admission settles with usage (an early report, or explicit usage), so the plain
    /// identity `reserved + overrun == consumed + refunded` must hold.
    always_usage: bool,
    /// A listener subscribed to every event (it also changes the paths: admissions are timed).
    listen: bool,
    workers: u64,
    /// Operations per worker before the close can happen (the close comes at a random point).
    ops: u64,
}

impl Setup {
    fn new(plane: Plane, workers: u64, ops: u64) -> Setup {
        Setup {
            seed: fresh_seed(),
            plane,
            always_usage: false,
            listen: false,
            workers,
            ops: ops * scale(),
        }
    }

    fn always_usage(mut self) -> Setup {
        self.always_usage = true;
        self
    }

    fn listen(mut self) -> Setup {
        self.listen = true;
        self
    }

    /// The most holders there may ever be at once.
    fn ceiling(&self) -> u64 {
        u64::from(match self.plane {
            Plane::Fixed | Plane::SlotsFixed => SLOTS,
            Plane::Varying => PEAK_SLOTS,
        })
    }
}

type Task = Pin<Box<dyn Future<Output = ()> + Send>>;
type Spawn = Arc<dyn Fn(Task) -> Task + Send + Sync>;

/// Which timer the runtime offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Timer {
    Tokio,
    /// `async-io` (smol's timer; works on any executor).
    AsyncIo,
    AsyncStd,
    /// Plain threads: a blocking sleep, and `acquire_blocking` is allowed.
    Thread,
}

#[derive(Clone)]
struct Rt {
    timer: Timer,
    spawn: Spawn,
}

impl Rt {
    fn new(timer: Timer, spawn: impl Fn(Task) -> Task + Send + Sync + 'static) -> Rt {
        Rt {
            timer,
            spawn: Arc::new(spawn),
        }
    }

    fn sleep(&self, duration: Duration) -> Task {
        match self.timer {
            Timer::Tokio => Box::pin(tokio::time::sleep(duration)),
            Timer::AsyncIo => Box::pin(async move {
                smol::Timer::after(duration).await;
            }),
            Timer::AsyncStd => Box::pin(async_std::task::sleep(duration)),
            Timer::Thread => Box::pin(async move { std::thread::sleep(duration) }),
        }
    }

    fn threads(&self) -> bool {
        self.timer == Timer::Thread
    }
}

fn tokio_spawn(task: Task) -> Task {
    let handle = tokio::spawn(task);
    Box::pin(async move { handle.await.unwrap() })
}

/// A thread per task; the returned future blocks while it joins it (threads mode only).
fn thread_spawn(task: Task) -> Task {
    let handle = std::thread::spawn(move || futures::executor::block_on(task));
    Box::pin(async move { handle.join().unwrap() })
}

/// Yields to the executor once, whatever the runtime.
async fn yield_now() {
    let mut yielded = false;
    poll_fn(|cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await
}

async fn yields(n: usize) {
    for _ in 0..n {
        yield_now().await;
    }
}

/// A future that remembers whether it was ever polled: an acquire decides (and is counted) at
/// its first poll, and not at all if it is dropped before.
struct Tracked<F> {
    inner: F,
    polled: bool,
}

impl<F: Future + Unpin> Tracked<F> {
    fn new(inner: F) -> Tracked<F> {
        Tracked {
            inner,
            polled: false,
        }
    }
}

impl<F: Future + Unpin> Future for Tracked<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<F::Output> {
        self.polled = true;
        Pin::new(&mut self.inner).poll(cx)
    }
}

/// Polls `future` exactly once.
async fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
    poll_fn(|cx| Poll::Ready(Pin::new(&mut *future).poll(cx))).await
}

/// Prints the seed if the scenario fails, and aborts the process if it hangs.
struct Guard {
    what: String,
    stop: Option<mpsc::Sender<()>>,
    watchdog: Option<std::thread::JoinHandle<()>>,
}

impl Guard {
    fn new(what: String, bulkhead: LlmBulkhead) -> Guard {
        // Generous: a healthy scenario takes a few seconds even at a large scale.
        let limit = Duration::from_secs(120 + 60 * scale());
        let (stop, stopped) = mpsc::channel::<()>();
        let name = what.clone();
        let watchdog = std::thread::spawn(move || {
            if let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(limit) {
                eprintln!(
                    "chaos: {name} still running after {limit:?}: hung; {:?}",
                    bulkhead.stats()
                );
                std::process::abort();
            }
        });
        Guard {
            what,
            stop: Some(stop),
            watchdog: Some(watchdog),
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(watchdog) = self.watchdog.take() {
            let _ = watchdog.join();
        }
        if std::thread::panicking() {
            eprintln!("chaos: FAILED {} (replay with CHAOS_SEED)", self.what);
        }
    }
}

// ------------------------------------------------------------------------------------------
// The callers' model of one admission.
// ------------------------------------------------------------------------------------------

// `Model` (the hold rules and the booking split) lives in `tests/common/mod.rs`.

impl Model {
    /// A random report: growing (plain or progressive), stale, or one that must be refused
    /// (a remaining output above the cap, a hold too large to count). `valid` only
    /// draws reports that must be accepted.
    fn random_report(
        &self,
        rng: &mut fastrand::Rng,
        valid: bool,
    ) -> (TokenUsage, Option<Progressive>) {
        let cap = self.cap();
        let prev = self.reported.unwrap_or(usage(0, 0));
        let growth = |rng: &mut fastrand::Rng| {
            usage(
                prev.input()
                    .max(rng.u64(0..=self.reservation.input() * 3 / 2 + 10)),
                prev.output() + rng.u64(0..=cap / 3 + 40),
            )
        };
        let kind = if valid { rng.u8(4..10) } else { rng.u8(0..10) };
        match kind {
            // Stale or duplicate; a progressive one may still move the hold.
            0 => {
                let stale = usage(rng.u64(0..=prev.input()), rng.u64(0..=prev.output()));
                let progressive = rng
                    .bool()
                    .then(|| Progressive::new(rng.u64(0..=cap)).safety_margin(rng.u64(0..32)));
                (stale, progressive)
            }
            // A plain hold too large to count.
            1 => (usage(HUGE, prev.output()), None),
            // A remaining output above the cap.
            2 => (
                growth(rng),
                Some(Progressive::new(cap + 1 + rng.u64(0..100))),
            ),
            // A safety margin too large to count.
            3 => (
                growth(rng),
                Some(Progressive::new(rng.u64(0..=cap)).safety_margin(HUGE)),
            ),
            4..=6 => (growth(rng), None),
            7 => {
                // Authoritative: what may still come, plus a margin.
                let next = growth(rng);
                let remaining = cap.saturating_sub(next.output());
                let p = Progressive::new(remaining).safety_margin(rng.u64(0..64));
                (next, Some(p))
            }
            // Arbitrary remaining output: may raise the hold again (re-held).
            _ => (
                growth(rng),
                Some(Progressive::new(rng.u64(0..=cap)).safety_margin(rng.u64(0..64))),
            ),
        }
    }

    /// Random explicit usage for a settlement: below, at or above the reservation.
    fn random_usage(&self, rng: &mut fastrand::Rng) -> TokenUsage {
        usage(
            rng.u64(0..=self.reservation.input() * 2 + 5),
            rng.u64(0..=self.cap() * 3 / 2 + 10),
        )
    }
}

// ------------------------------------------------------------------------------------------
// Permits and reports.
// ------------------------------------------------------------------------------------------

/// One random report through `reporter`, checked against (and applied to) the model.
fn report_step(
    reporter: &mut impl Reporter,
    model: &mut Model,
    rng: &mut fastrand::Rng,
    valid: bool,
    tally: &Tally,
) {
    assert_eq!(reporter.held(), model.held);
    let (report, progressive) = model.random_report(rng, valid);
    let predicted = model.predict(report, progressive);
    match (predicted, reporter.report(report, progressive)) {
        (Err(expected), Err(error)) => {
            assert_eq!(error, expected, "{report:?} {progressive:?} on {model:?}");
            assert_eq!(
                reporter.held(),
                model.held,
                "a refused report changes nothing"
            );
        }
        (Ok((merged, hold)), Ok(got)) => {
            let effective = model.apply(merged, hold);
            assert_eq!(
                (got.held, got.sequence, got.reserved, got.consumed),
                (model.held, model.sequence, model.reserved(), merged.total()),
                "(held, sequence, reserved, consumed) after {report:?} {progressive:?} on {model:?}"
            );
            assert_eq!(got.over_reservation, merged.total() > model.reserved());
            assert_eq!(got.output_cap, Some(model.cap()));
            assert_eq!(reporter.held(), model.held);
            if effective {
                tally.effective_reports.fetch_add(1, Ordering::Relaxed);
            }
        }
        (predicted, got) => panic!(
            "report {report:?} {progressive:?} on {model:?}: expected {predicted:?}, got {got:?}"
        ),
    }
}

// ------------------------------------------------------------------------------------------
// Shared books.
// ------------------------------------------------------------------------------------------

fn reason_index(reason: RejectReason) -> usize {
    RejectReason::ALL.iter().position(|&r| r == reason).unwrap()
}

/// The callers' own sums, compared with the bulkhead's statistics at the end.
#[derive(Default)]
struct Tally {
    /// Calls the bulkhead decided: returned a result, or were polled and then cancelled.
    decided: AtomicU64,
    admitted: AtomicU64,
    /// Refusals the callers saw, by reason.
    seen: [AtomicU64; 6],
    /// Calls polled (so decided) and cancelled before their result: each counted as a refusal
    /// (aborted, or whatever refused it before the caller gave up).
    vanished: AtomicU64,
    /// Acquire futures dropped before their first poll (decided nothing).
    unpolled: AtomicU64,
    /// Calls refused for invalid input (decided nothing).
    invalid: AtomicU64,
    /// Refusals (all `shutdown`) of calls that started after `close()` returned.
    post_close_refused: AtomicU64,
    effective_reports: AtomicU64,
    reserved: AtomicU64,
    /// Reservations of admissions settled without any usage (they book nothing).
    unused_reserved: AtomicU64,
    consumed: AtomicU64,
    overrun: AtomicU64,
    refunded: AtomicU64,
    reheld: AtomicU64,
    /// Limit changes applied (each is a reconfigure event).
    limit_changes: AtomicU64,
    drains_started: AtomicU64,
    drains_resolved: AtomicU64,
}

impl Tally {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn load(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    fn seen(&self, reason: RejectReason) -> u64 {
        Tally::load(&self.seen[reason_index(reason)])
    }

    /// Books a settled admission (the model already includes the settlement's move).
    fn settled(&self, model: &Model, settled: &Settled) {
        self.reserved.fetch_add(model.reserved(), Ordering::Relaxed);
        match settled.usage {
            Some(u) => self.consumed.fetch_add(u.total(), Ordering::Relaxed),
            None => self
                .unused_reserved
                .fetch_add(model.reserved(), Ordering::Relaxed),
        };
        self.overrun.fetch_add(model.overrun, Ordering::Relaxed);
        self.refunded.fetch_add(model.refunded, Ordering::Relaxed);
        self.reheld.fetch_add(model.reheld, Ordering::Relaxed);
    }
}

/// Holders counted by the callers themselves: a caller counts itself right after it got its
/// permit and uncounts itself before it settles, so the ledger never exceeds what the
/// bulkhead really holds.
#[derive(Default)]
struct Ledger {
    holders: AtomicU64,
    peak: AtomicU64,
}

/// What the listener heard.
#[derive(Default)]
struct Heard {
    admits: AtomicU64,
    releases: AtomicU64,
    usages: AtomicU64,
    reconfigures: AtomicU64,
    rejects: [AtomicU64; 6],
    reserved: AtomicU64,
    /// Admissions between their admit and release events, and inconsistencies seen.
    open: Mutex<(HashSet<AdmissionId>, Vec<String>)>,
}

impl Heard {
    fn hear(&self, event: &Event<'_>) {
        match event {
            Event::Admit(e) => {
                Tally::bump(&self.admits);
                self.reserved
                    .fetch_add(e.reserved_tokens, Ordering::Relaxed);
                let mut open = self.open.lock().unwrap();
                if !open.0.insert(e.admission_id) {
                    open.1
                        .push(format!("admission {} admitted twice", e.admission_id));
                }
            }
            Event::Release(e) => {
                Tally::bump(&self.releases);
                let mut open = self.open.lock().unwrap();
                if !open.0.remove(&e.admission_id) {
                    open.1.push(format!(
                        "release of {} outside its admission",
                        e.admission_id
                    ));
                }
            }
            Event::Usage(e) => {
                Tally::bump(&self.usages);
                let mut open = self.open.lock().unwrap();
                if !open.0.contains(&e.admission_id) {
                    open.1
                        .push(format!("usage of {} outside its admission", e.admission_id));
                }
            }
            Event::Reject(e) => Tally::bump(&self.rejects[reason_index(e.reason)]),
            Event::Reconfigure(_) => Tally::bump(&self.reconfigures),
            _ => {}
        }
    }
}

/// Everything the tasks of one scenario share.
struct Shared {
    setup: Setup,
    bulkhead: LlmBulkhead,
    rt: Rt,
    tally: Tally,
    ledger: Ledger,
    heard: Arc<Heard>,
    /// Set (Release) once `close()` returned: a call that sees it must be refused.
    closed: AtomicBool,
    /// The largest `max_queue` ever applied (raised before it is applied).
    peak_queue: AtomicU64,
    ops_done: AtomicU64,
    workers_done: AtomicU64,
    /// The first panic of any task, re-raised once every task stopped.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    failed: AtomicBool,
}

impl Shared {
    fn spawn(self: &Arc<Self>, task: impl Future<Output = ()> + Send + 'static) -> Task {
        let shared = Arc::clone(self);
        (self.rt.spawn)(Box::pin(async move {
            if let Err(panic) = AssertUnwindSafe(task).catch_unwind().await {
                shared.failed.store(true, Ordering::Release);
                let mut kept = shared.panic.lock().unwrap_or_else(PoisonError::into_inner);
                kept.get_or_insert(panic);
            }
        }))
    }

    fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    fn rethrow(&self) {
        let kept = self
            .panic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(panic) = kept {
            resume_unwind(panic);
        }
    }

    fn enter(&self) {
        let holders = self.ledger.holders.fetch_add(1, Ordering::AcqRel) + 1;
        self.ledger.peak.fetch_max(holders, Ordering::Relaxed);
        assert!(
            holders <= self.setup.ceiling(),
            "{holders} holders at once, max_concurrent at most {}",
            self.setup.ceiling()
        );
    }

    fn leave(&self) {
        self.ledger.holders.fetch_sub(1, Ordering::AcqRel);
    }

    /// A refusal the caller saw.
    fn refused(&self, reason: RejectReason, closed_before: bool) {
        assert_ne!(
            reason,
            RejectReason::Aborted,
            "only a dropped call is aborted"
        );
        Tally::bump(&self.tally.seen[reason_index(reason)]);
        if closed_before {
            assert_eq!(reason, RejectReason::Shutdown, "refused after close()");
            Tally::bump(&self.tally.post_close_refused);
        }
    }

    /// Books a decided call's result; returns the permit (counted in the ledger) if admitted.
    fn decided<P>(&self, result: Result<P, AcquireError>, closed_before: bool) -> Option<P> {
        Tally::bump(&self.tally.decided);
        match result {
            Ok(permit) => {
                assert!(!closed_before, "admitted after close() returned");
                Tally::bump(&self.tally.admitted);
                self.enter();
                Some(permit)
            }
            Err(AcquireError::Rejected(rejection)) => {
                self.refused(rejection.reason(), closed_before);
                None
            }
            Err(AcquireError::Invalid(error)) => panic!("valid input refused: {error}"),
        }
    }

    /// A call cancelled before its result.
    fn vanished(&self, polled: bool) {
        if polled {
            Tally::bump(&self.tally.decided);
            Tally::bump(&self.tally.vanished);
        } else {
            Tally::bump(&self.tally.unpolled);
        }
    }

    /// The end-of-run invariants, once every task finished.
    fn verify(&self) {
        let (tally, setup) = (&self.tally, self.setup);
        let load = Tally::load;
        let stats = self.bulkhead.stats();
        let tokens = stats.token_budget.unwrap();

        // Everything is back.
        assert!(stats.closed);
        assert_eq!(
            (stats.in_flight, stats.pending, tokens.in_flight_tokens),
            (0, 0, 0),
            "{stats:?}"
        );
        assert_eq!(load(&self.ledger.holders), 0);
        assert!(load(&self.ledger.peak) <= setup.ceiling());

        // Every decided call counted exactly once, every admission settled exactly once.
        assert_eq!(
            stats.admitted,
            load(&tally.admitted),
            "admissions the callers saw"
        );
        assert_eq!(stats.released, stats.admitted, "every admission released");
        assert_eq!(
            stats.admitted + stats.rejected,
            load(&tally.decided),
            "admitted + rejected == decided calls"
        );
        let by = stats.rejected_by_reason;
        let seen: u64 = RejectReason::ALL.iter().map(|&r| tally.seen(r)).sum();
        assert_eq!(
            stats.rejected,
            seen + load(&tally.vanished),
            "refusals: seen + cancelled after their first poll ({by:?})"
        );
        for &reason in RejectReason::ALL {
            assert!(
                by.get(reason) >= tally.seen(reason),
                "{reason}: {} counted, {} seen",
                by.get(reason),
                tally.seen(reason)
            );
        }
        assert!(by.aborted <= load(&tally.vanished));
        assert!(by.shutdown >= load(&tally.post_close_refused));
        assert_eq!(stats.listener_panics, 0);

        // The token books.
        let unused = load(&tally.unused_reserved);
        assert_eq!(tokens.total_reserved, load(&tally.reserved), "reserved");
        assert_eq!(tokens.total_consumed, load(&tally.consumed), "consumed");
        assert_eq!(tokens.total_overrun, load(&tally.overrun), "overrun");
        assert_eq!(
            tokens.total_refunded,
            load(&tally.refunded) - load(&tally.reheld),
            "refunded (net of re-holds)"
        );
        if setup.always_usage {
            assert_eq!(unused, 0, "every admission settled with usage");
            assert_eq!(
                tokens.total_reserved + tokens.total_overrun,
                tokens.total_consumed + tokens.total_refunded,
                "reserved + overrun == consumed + refunded: {tokens:?}"
            );
        } else {
            assert_eq!(
                tokens.total_reserved - unused + tokens.total_overrun,
                tokens.total_consumed + tokens.total_refunded,
                "the identity over the admissions settled with usage: {tokens:?}"
            );
        }

        // Every drain resolved.
        assert_eq!(load(&tally.drains_started), load(&tally.drains_resolved));

        // The listener heard everything, consistently.
        if setup.listen {
            let heard = &self.heard;
            let open = heard.open.lock().unwrap();
            assert!(open.1.is_empty(), "{:#?}", open.1);
            assert!(
                open.0.is_empty(),
                "{} admissions never released",
                open.0.len()
            );
            assert_eq!(load(&heard.admits), stats.admitted, "admit events");
            assert_eq!(load(&heard.releases), stats.admitted, "release events");
            assert_eq!(load(&heard.reserved), tokens.total_reserved);
            assert_eq!(
                load(&heard.usages),
                load(&tally.effective_reports),
                "usage events"
            );
            assert_eq!(
                load(&heard.reconfigures),
                load(&tally.limit_changes),
                "reconfigure events"
            );
            for &reason in RejectReason::ALL {
                assert_eq!(
                    load(&heard.rejects[reason_index(reason)]),
                    by.get(reason),
                    "{reason} events"
                );
            }
        }

        // Not a vacuous pass.
        assert!(stats.admitted > 0);
        assert!(load(&tally.post_close_refused) > 0, "calls after the close");
        println!(
            "chaos seed {} {:?}: decided {}, admitted {}, refused {by:?}, cancelled {}, \
             unpolled {}, invalid {}, effective reports {}, limit changes {}, peak holders {}, \
             tokens {tokens:?}",
            setup.seed,
            setup.plane,
            load(&tally.decided),
            stats.admitted,
            load(&tally.vanished),
            load(&tally.unpolled),
            load(&tally.invalid),
            load(&tally.effective_reports),
            load(&tally.limit_changes),
            load(&self.ledger.peak),
        );
    }
}

// ------------------------------------------------------------------------------------------
// The callers.
// ------------------------------------------------------------------------------------------

/// A short random pause: nothing, a few executor turns, or a short sleep.
async fn pause(shared: &Shared, rng: &mut fastrand::Rng) {
    match rng.u8(0..8) {
        0 | 1 => {}
        2..=4 => yields(rng.usize(1..4)).await,
        5 | 6 => {
            shared
                .rt
                .sleep(Duration::from_micros(rng.u64(0..300)))
                .await
        }
        _ => {
            shared
                .rt
                .sleep(Duration::from_micros(rng.u64(300..1_500)))
                .await
        }
    }
}

/// A random request and options: an explicit reservation or one the estimator sizes.
fn random_call(rng: &mut fastrand::Rng) -> (LlmRequest, AcquireOptions) {
    let mut options = AcquireOptions::new();
    if rng.u8(0..4) == 0 {
        options = options.priority(Priority::High);
    }
    let request = match rng.u8(0..12) {
        0..=2 => LlmRequest::new()
            .user("x".repeat(rng.usize(0..1_600)))
            .max_tokens(rng.u64(1..500)),
        3 => {
            options = options.reservation(Reservation::new(0, 0).unwrap());
            LlmRequest::new()
        }
        _ => {
            let reservation = Reservation::new(rng.u64(0..200), rng.u64(0..500)).unwrap();
            options = options.reservation(reservation);
            LlmRequest::new()
        }
    };
    (request, options)
}

/// The options with a random queue timeout: none, zero, or up to a few ms.
fn queued(rng: &mut fastrand::Rng, options: AcquireOptions) -> AcquireOptions {
    match rng.u8(0..8) {
        0 | 1 => options,
        2 => options.timeout(Duration::ZERO),
        _ => options.timeout(Duration::from_micros(rng.u64(0..3_000))),
    }
}

/// Something that fires soon: a few executor turns or a short sleep.
fn canceller(shared: &Shared, rng: &mut fastrand::Rng) -> Task {
    match rng.u8(0..3) {
        0 => Box::pin(yields(rng.usize(0..4))),
        _ => shared.rt.sleep(Duration::from_micros(rng.u64(0..2_500))),
    }
}

/// Holds an admitted permit (already counted in the ledger) for a random short time, streaming
/// random usage reports, then settles it: explicit usage, the last reported, or a drop.
async fn hold(shared: &Shared, rng: &mut fastrand::Rng, mut permit: AnyPermit<'_>) {
    let reservation = permit
        .reservation()
        .expect("a budget: every admission reserves");
    let mut model = Model::new(reservation);
    assert_eq!(permit.held(), reservation.reserved());
    if shared.setup.always_usage {
        report_step(&mut permit, &mut model, rng, true, &shared.tally);
    }
    for _ in 0..rng.usize(0..5) {
        pause(shared, rng).await;
        report_step(&mut permit, &mut model, rng, false, &shared.tally);
    }
    pause(shared, rng).await;
    shared.leave();
    match rng.u8(0..3) {
        0 => {
            drop(permit);
            let settled = model.settle(None);
            shared.tally.settled(&model, &settled);
        }
        finish => {
            let explicit = (finish == 1).then(|| model.random_usage(rng));
            let report = permit.release(explicit);
            let settled = model.settle(explicit);
            assert_eq!(
                (
                    report.held_tokens,
                    report.refunded_tokens,
                    report.overrun_tokens,
                    report.usage
                ),
                (
                    settled.held,
                    settled.refunded,
                    settled.overrun,
                    settled.usage
                ),
                "release report of {model:?}"
            );
            shared.tally.settled(&model, &settled);
        }
    }
}

/// Holds the permit if the call was admitted.
async fn hold_if(shared: &Shared, rng: &mut fastrand::Rng, permit: Option<AnyPermit<'_>>) {
    if let Some(permit) = permit {
        hold(shared, rng, permit).await;
    }
}

/// One random operation of a worker.
async fn op(shared: &Arc<Shared>, rng: &mut fastrand::Rng, handoffs: &mut Vec<Task>) {
    let bulkhead = &shared.bulkhead;
    // Read before the call starts: if set, `close()` returned before it, so it must be refused.
    let closed_before = shared.closed.load(Ordering::Acquire);
    let (request, options) = random_call(rng);
    let kinds = if shared.rt.threads() { 17 } else { 15 };
    match rng.u8(0..kinds) {
        0 => {
            let result = bulkhead.try_acquire(&request, options);
            let permit = shared.decided(result.map(AnyPermit::Borrowed), closed_before);
            hold_if(shared, rng, permit).await;
        }
        1 => {
            let result = bulkhead.try_acquire_owned(&request, options);
            let permit = shared.decided(result.map(AnyPermit::Owned), closed_before);
            hold_if(shared, rng, permit).await;
        }
        2 | 3 => {
            let result = bulkhead.acquire(&request, queued(rng, options)).await;
            let permit = shared.decided(result.map(AnyPermit::Borrowed), closed_before);
            hold_if(shared, rng, permit).await;
        }
        4 => {
            let result = bulkhead.acquire_owned(&request, queued(rng, options)).await;
            let permit = shared.decided(result.map(AnyPermit::Owned), closed_before);
            hold_if(shared, rng, permit).await;
        }
        5 => {
            // Cancelled by `tokio::select!` (random branch order: it may never be polled).
            let mut acquire = Tracked::new(bulkhead.acquire(&request, queued(rng, options)));
            let cancel = canceller(shared, rng);
            let result = tokio::select! {
                result = &mut acquire => Some(result),
                () = cancel => None,
            };
            match result {
                Some(result) => {
                    let permit = shared.decided(result.map(AnyPermit::Borrowed), closed_before);
                    drop(acquire);
                    hold_if(shared, rng, permit).await;
                }
                None => {
                    let polled = acquire.polled;
                    // Dropped wherever it is: queued, or handed a slot it never picked up.
                    drop(acquire);
                    shared.vanished(polled);
                }
            }
        }
        6 => {
            // Cancelled by a timeout around the future.
            let mut acquire = Tracked::new(bulkhead.acquire_owned(&request, queued(rng, options)));
            let limit = Duration::from_micros(rng.u64(0..2_500));
            let result = if shared.rt.timer == Timer::Tokio {
                tokio::time::timeout(limit, &mut acquire).await.ok()
            } else {
                match select(&mut acquire, shared.rt.sleep(limit)).await {
                    Either::Left((result, _)) => Some(result),
                    Either::Right(_) => None,
                }
            };
            match result {
                Some(result) => {
                    let permit = shared.decided(result.map(AnyPermit::Owned), closed_before);
                    hold_if(shared, rng, permit).await;
                }
                None => {
                    let polled = acquire.polled;
                    drop(acquire);
                    shared.vanished(polled);
                }
            }
        }
        7 => {
            // Polled once or twice, then dropped.
            let mut acquire = Tracked::new(bulkhead.acquire(&request, queued(rng, options)));
            let mut result = poll_once(&mut acquire).await;
            if result.is_pending() && rng.bool() {
                yields(rng.usize(0..3)).await;
                result = poll_once(&mut acquire).await;
            }
            match result {
                Poll::Ready(result) => {
                    let permit = shared.decided(result.map(AnyPermit::Borrowed), closed_before);
                    hold_if(shared, rng, permit).await;
                }
                Poll::Pending => {
                    drop(acquire);
                    shared.vanished(true);
                }
            }
        }
        8 => {
            // Dropped before the first poll: decides nothing, counts nothing.
            match rng.u8(0..3) {
                0 => drop(bulkhead.acquire(&request, options)),
                1 => drop(bulkhead.acquire_owned(&request, options)),
                _ => drop(bulkhead.run(&request, options, async |_| Ok::<(), ()>(()))),
            }
            shared.vanished(false);
        }
        9 | 10 => {
            let options = queued(rng, options);
            run_op(shared, rng, &request, options, closed_before).await;
        }
        11 => {
            // An owned permit handed to another task (or thread), which holds and settles it.
            let result = if rng.bool() {
                bulkhead.try_acquire_owned(&request, options)
            } else {
                bulkhead.acquire_owned(&request, queued(rng, options)).await
            };
            if let Some(permit) = shared.decided(result, closed_before) {
                let (inner, mut inner_rng) =
                    (Arc::clone(shared), fastrand::Rng::with_seed(rng.u64(..)));
                handoffs.push(shared.spawn(async move {
                    hold(&inner, &mut inner_rng, AnyPermit::Owned(permit)).await;
                }));
            }
        }
        12 => {
            // Several permits at once (only `try_acquire`: never wait while holding), held
            // concurrently by this one task.
            let mut held = Vec::new();
            for _ in 0..rng.usize(2..5) {
                let (request, options) = random_call(rng);
                let result = bulkhead.try_acquire(&request, options);
                if let Some(permit) = shared.decided(result.map(AnyPermit::Borrowed), closed_before)
                {
                    held.push(permit);
                }
            }
            let sessions = held.into_iter().map(|permit| {
                let mut rng = fastrand::Rng::with_seed(rng.u64(..));
                async move { hold(shared, &mut rng, permit).await }
            });
            join_all(sessions.collect::<Vec<_>>()).await;
        }
        13 => odd_call(shared, rng, &request, options, closed_before).await,
        14 => {
            // A quick look at the figures.
            let stats = bulkhead.stats();
            assert!(stats.in_flight <= shared.setup.ceiling(), "{stats:?}");
            assert!(
                stats.pending <= shared.peak_queue.load(Ordering::Acquire),
                "{stats:?}"
            );
            if closed_before {
                assert!(stats.closed && bulkhead.is_closed());
            }
        }
        15 => {
            let result = bulkhead.acquire_blocking(&request, queued(rng, options));
            let permit = shared.decided(result.map(AnyPermit::Borrowed), closed_before);
            hold_if(shared, rng, permit).await;
        }
        _ => {
            let result = bulkhead.acquire_blocking_owned(&request, queued(rng, options));
            let permit = shared.decided(result.map(AnyPermit::Owned), closed_before);
            hold_if(shared, rng, permit).await;
        }
    }
}

/// Advisory checks, input that cannot be estimated, and a reservation no budget fits.
async fn odd_call(
    shared: &Shared,
    rng: &mut fastrand::Rng,
    request: &LlmRequest,
    options: AcquireOptions,
    closed_before: bool,
) {
    let bulkhead = &shared.bulkhead;
    match rng.u8(0..3) {
        0 => {
            // Advisory: decides and counts nothing.
            let verdict = bulkhead.would_admit(request, options).unwrap();
            if closed_before {
                assert_eq!(verdict, Verdict::Reject(RejectReason::Shutdown));
            }
        }
        1 => {
            // The estimate overflows: invalid, before anything else (even after the close).
            let invalid = LlmRequest::new()
                .user("hello")
                .extra_input_tokens(u64::MAX)
                .max_tokens(10);
            let options = AcquireOptions::new();
            let invalid_result = match rng.u8(0..5) {
                0 => bulkhead.try_acquire(&invalid, options).map(drop),
                1 => bulkhead.try_acquire_owned(&invalid, options).map(drop),
                2 => bulkhead
                    .acquire(&invalid, queued(rng, options))
                    .await
                    .map(drop),
                3 => {
                    let result = bulkhead
                        .run(&invalid, options, async |_| Ok::<(), ()>(()))
                        .await;
                    assert!(matches!(result, Err(RunError::Invalid(_))), "{result:?}");
                    Tally::bump(&shared.tally.invalid);
                    return;
                }
                _ => {
                    assert!(bulkhead.would_admit(&invalid, options).is_err());
                    Tally::bump(&shared.tally.invalid);
                    return;
                }
            };
            assert!(
                matches!(invalid_result, Err(AcquireError::Invalid(_))),
                "{invalid_result:?}"
            );
            Tally::bump(&shared.tally.invalid);
        }
        _ => {
            // Fits no budget: refused for tokens at once, even when it may queue.
            let options = AcquireOptions::new()
                .reservation(Reservation::new(MAX_BUDGET, 1).unwrap())
                .priority(Priority::High);
            let result = if rng.bool() {
                bulkhead.try_acquire(request, options)
            } else {
                bulkhead
                    .acquire(request, options.timeout(Duration::from_secs(60)))
                    .await
            };
            let reason = result.unwrap_err().rejection().unwrap().reason();
            assert!(
                reason == RejectReason::BudgetLimit || reason == RejectReason::Shutdown,
                "{reason}"
            );
            Tally::bump(&shared.tally.decided);
            shared.refused(reason, closed_before);
        }
    }
}

/// A call through `run` / `run_with_usage`: the callback reports usage and then succeeds
/// (settling with the last report, or with usage extracted from its result), fails, or is
/// cancelled at a random point (while waiting, or while the callback runs).
async fn run_op(
    shared: &Shared,
    rng: &mut fastrand::Rng,
    request: &LlmRequest,
    options: AcquireOptions,
    closed_before: bool,
) {
    // 0: plain run, 1: run_with_usage, 2: the callback fails, 3: the run is cancelled.
    let variant = rng.u8(0..4);
    let (fails, cancelled) = (variant == 2, variant == 3);
    let mut run_rng = fastrand::Rng::with_seed(rng.u64(..));
    // The callback keeps its model (and the usage it returns) here, so it survives a
    // cancelled run; `Some` once the callback started, i.e. once the call was admitted.
    let cell: Mutex<Option<(Model, Option<TokenUsage>)>> = Mutex::new(None);
    let callback = {
        let cell = &cell;
        let run_rng = &mut run_rng;
        async move |mut ctx: RunContext<'_>| {
            assert!(!closed_before, "admitted after close() returned");
            Tally::bump(&shared.tally.admitted);
            // A cancelled run settles when its future is dropped, with no chance to leave the
            // ledger first: it stays out of it (the ledger stays a lower bound).
            if !cancelled {
                shared.enter();
            }
            let mut model = Model::new(ctx.reservation().unwrap());
            if shared.setup.always_usage {
                // Before any await: a cancellation cannot come first.
                report_step(&mut ctx, &mut model, run_rng, true, &shared.tally);
            }
            *cell.lock().unwrap() = Some((model, None));
            for _ in 0..run_rng.usize(0..4) {
                pause(shared, run_rng).await;
                report_step(&mut ctx, &mut model, run_rng, false, &shared.tally);
                *cell.lock().unwrap() = Some((model, None));
            }
            pause(shared, run_rng).await;
            if !cancelled {
                shared.leave();
            }
            let explicit = (variant == 1 && run_rng.bool()).then(|| model.random_usage(run_rng));
            *cell.lock().unwrap() = Some((model, explicit));
            if fails { Err(()) } else { Ok(explicit) }
        }
    };
    let bulkhead = &shared.bulkhead;
    type RunFuture<'a> =
        Pin<Box<dyn Future<Output = Result<Option<TokenUsage>, RunError<()>>> + Send + 'a>>;
    let future: RunFuture<'_> = if variant == 1 {
        Box::pin(bulkhead.run_with_usage(request, options, |u: &Option<TokenUsage>| *u, callback))
    } else {
        Box::pin(bulkhead.run(request, options, callback))
    };
    let mut run = Tracked::new(future);
    let result = if cancelled {
        let cancel = canceller(shared, rng);
        tokio::select! {
            result = &mut run => Some(result),
            () = cancel => None,
        }
    } else {
        Some((&mut run).await)
    };
    let polled = run.polled;
    drop(run);
    let explicit = match result {
        Some(Ok(explicit)) => {
            assert!(!fails);
            explicit
        }
        Some(Err(RunError::Failed(()))) => {
            assert!(fails);
            None
        }
        Some(Err(RunError::Rejected(rejection))) => {
            assert!(cell.lock().unwrap().is_none());
            Tally::bump(&shared.tally.decided);
            return shared.refused(rejection.reason(), closed_before);
        }
        Some(Err(RunError::Invalid(error))) => panic!("valid input refused: {error}"),
        None => None, // cancelled: settled (if admitted) with the last reported usage
    };
    let Some((mut model, _)) = cell.into_inner().unwrap() else {
        assert!(result.is_none());
        return shared.vanished(polled);
    };
    Tally::bump(&shared.tally.decided);
    let settled = model.settle(explicit);
    shared.tally.settled(&model, &settled);
}

async fn worker(shared: Arc<Shared>, index: u64) {
    let mut rng = fastrand::Rng::with_seed(mix(shared.setup.seed, index + 1));
    let mut handoffs = Vec::new();
    for _ in 0..shared.setup.ops {
        op(&shared, &mut rng, &mut handoffs).await;
        shared.ops_done.fetch_add(1, Ordering::AcqRel);
        if handoffs.len() > 4 {
            join_all(handoffs.drain(..)).await;
        }
        // Think time, as a client has: without it refused calls come back at once and the
        // run is all refusals, however long it is.
        pause(&shared, &mut rng).await;
        yield_now().await;
        if shared.failed() {
            break;
        }
    }
    // Keep calling until the close, then a few more: all of those are refused. Each round
    // sleeps a little: a task that only yields is re-polled at once by some executors (the
    // futures thread pool re-runs a task that woke itself on the same thread), so a few such
    // loops would hold every pool thread and starve the control plane that closes.
    while !shared.closed.load(Ordering::Acquire) && !shared.failed() {
        op(&shared, &mut rng, &mut handoffs).await;
        shared
            .rt
            .sleep(Duration::from_micros(rng.u64(50..500)))
            .await;
    }
    for _ in 0..POST_CLOSE_OPS {
        op(&shared, &mut rng, &mut handoffs).await;
        yield_now().await;
    }
    join_all(handoffs).await;
    shared.workers_done.fetch_add(1, Ordering::AcqRel);
}

// ------------------------------------------------------------------------------------------
// The control plane.
// ------------------------------------------------------------------------------------------

/// A random budget: 0, below the tokens in flight, below the initial one, or up to three
/// times it (the common case, so that calls are admitted between the squeezes).
fn random_budget(bulkhead: &LlmBulkhead, rng: &mut fastrand::Rng) -> u64 {
    match rng.u8(0..12) {
        0 => 0,
        1 => rng.u64(0..=bulkhead.stats().token_budget.unwrap().in_flight_tokens),
        2 | 3 => rng.u64(300..BUDGET),
        _ => rng.u64(BUDGET..=3 * BUDGET),
    }
}

/// One random change (or non-change) of the limits, checked.
fn reconfigure(shared: &Shared, rng: &mut fastrand::Rng) {
    let bulkhead = &shared.bulkhead;
    let before = bulkhead.limits();
    let changes = shared.setup.plane != Plane::Fixed;
    match rng.u8(0..10) {
        0..=4 if changes => {
            let max_concurrent = match shared.setup.plane {
                Plane::Varying if rng.u8(0..8) == 0 => 0, // the kill switch, waiters kept
                Plane::Varying => rng.u32(1..=PEAK_SLOTS),
                _ => SLOTS,
            };
            let max_queue = if rng.u8(0..8) == 0 {
                0
            } else {
                rng.u32(1..=PEAK_QUEUE)
            };
            let budget = random_budget(bulkhead, rng);
            let reserve = match rng.u8(0..12) {
                // Above the budget: normal-priority calls get no tokens at all.
                0 => budget + rng.u64(0..100),
                _ => rng.u64(0..=budget / 4),
            };
            let next = Limits::new(before.revision + 1, max_concurrent)
                .with_max_queue(max_queue)
                .with_token_budget(budget, reserve);
            shared
                .peak_queue
                .fetch_max(u64::from(max_queue), Ordering::AcqRel);
            let outcome = bulkhead.apply_limits(next).unwrap();
            assert_eq!(
                outcome,
                ApplyOutcome::Applied {
                    previous: before,
                    current: next
                }
            );
            assert_eq!(bulkhead.limits(), next);
            Tally::bump(&shared.tally.limit_changes);
        }
        5 | 6 if changes => {
            let budget = random_budget(bulkhead, rng);
            let now = bulkhead.set_budget(budget).unwrap();
            assert_eq!(now.revision, before.revision + 1);
            assert_eq!(now.token_budget.unwrap().budget, budget);
            assert_eq!(
                (now.max_concurrent, now.max_queue),
                (before.max_concurrent, before.max_queue)
            );
            assert_eq!(bulkhead.limits(), now);
            Tally::bump(&shared.tally.limit_changes);
        }
        7 => {
            // Stale: nothing changes, the rest is not even examined.
            let stale = Limits::new(rng.u64(0..=before.revision), rng.u32(0..=PEAK_SLOTS));
            assert_eq!(
                bulkhead.apply_limits(stale).unwrap(),
                ApplyOutcome::Stale { current: before }
            );
            assert_eq!(bulkhead.limits(), before);
        }
        8 => {
            // Invalid: refused whole, nothing changes.
            let next = Limits::new(before.revision + 1, SLOTS);
            let (invalid, expected) = match rng.u8(0..3) {
                0 => (next, LimitsError::TokenBudgetRequired),
                1 => (
                    Limits::new(before.revision + 1, MAX_CONCURRENT + 1).with_token_budget(1, 0),
                    LimitsError::MaxConcurrentTooLarge {
                        value: MAX_CONCURRENT + 1,
                        max: MAX_CONCURRENT,
                    },
                ),
                _ => (
                    next.with_token_budget(MAX_BUDGET + 1, 0),
                    LimitsError::BudgetTooLarge {
                        value: MAX_BUDGET + 1,
                        max: MAX_BUDGET,
                    },
                ),
            };
            assert_eq!(bulkhead.apply_limits(invalid).unwrap_err(), expected);
            assert_eq!(bulkhead.limits(), before);
        }
        _ => {
            let stats = bulkhead.stats();
            assert!(stats.in_flight <= shared.setup.ceiling(), "{stats:?}");
            assert!(
                stats.pending <= shared.peak_queue.load(Ordering::Acquire),
                "{stats:?}"
            );
            assert_eq!(stats.limits, before);
        }
    }
}

fn start_drain(shared: &Arc<Shared>, drains: &mut Vec<Task>) {
    Tally::bump(&shared.tally.drains_started);
    let inner = Arc::clone(shared);
    drains.push(shared.spawn(async move {
        inner.bulkhead.drain().await;
        Tally::bump(&inner.tally.drains_resolved);
    }));
}

async fn control_plane(shared: Arc<Shared>) {
    let mut rng = fastrand::Rng::with_seed(mix(shared.setup.seed, 0));
    let bulkhead = &shared.bulkhead;
    let total = shared.setup.workers * shared.setup.ops;
    let close_at = rng.u64(total / 2..=total * 19 / 20);
    let mut drains = Vec::new();
    while shared.ops_done.load(Ordering::Acquire) < close_at && !shared.failed() {
        reconfigure(&shared, &mut rng);
        match rng.u8(0..40) {
            0 => start_drain(&shared, &mut drains),
            1 => {
                // Cancels nothing, whatever it finds.
                let wait = Duration::from_micros(rng.u64(0..500));
                let report = bulkhead.drain_timeout(wait).await;
                if report.drained {
                    assert_eq!((report.in_flight, report.pending), (0, 0));
                }
            }
            _ => {}
        }
        pause(&shared, &mut rng).await;
        yield_now().await;
    }

    assert!(bulkhead.close(), "the control plane closes");
    shared.closed.store(true, Ordering::Release);
    assert!(!bulkhead.close(), "close is idempotent");
    start_drain(&shared, &mut drains);
    // After the close: nothing waits, and slots in flight only go down, whatever the limits.
    let mut in_flight = u64::MAX;
    while shared.workers_done.load(Ordering::Acquire) < shared.setup.workers && !shared.failed() {
        let stats = bulkhead.stats();
        assert!(stats.closed);
        assert_eq!(stats.pending, 0, "nobody waits after the close");
        assert!(
            stats.in_flight <= in_flight,
            "{} -> {}",
            in_flight,
            stats.in_flight
        );
        in_flight = stats.in_flight;
        reconfigure(&shared, &mut rng);
        pause(&shared, &mut rng).await;
        yield_now().await;
    }
    if !shared.failed() {
        bulkhead.drain().await;
    }
    join_all(drains).await;
}

async fn scenario(name: &str, setup: Setup, rt: Rt) {
    let bulkhead = LlmBulkhead::builder("gpt-4o", SLOTS)
        .max_queue(QUEUE)
        .token_budget(TokenBudget::new(BUDGET).high_priority_reserve(RESERVE))
        .build()
        .unwrap();
    let _guard = Guard::new(
        format!("{name}: seed {} {setup:?}", setup.seed),
        bulkhead.clone(),
    );
    let heard = Arc::new(Heard::default());
    let _subscription = setup.listen.then(|| {
        let heard = Arc::clone(&heard);
        bulkhead.on(move |event| heard.hear(event))
    });
    let shared = Arc::new(Shared {
        setup,
        bulkhead: bulkhead.clone(),
        rt,
        tally: Tally::default(),
        ledger: Ledger::default(),
        heard,
        closed: AtomicBool::new(false),
        peak_queue: AtomicU64::new(u64::from(QUEUE)),
        ops_done: AtomicU64::new(0),
        workers_done: AtomicU64::new(0),
        panic: Mutex::new(None),
        failed: AtomicBool::new(false),
    });
    let started = Instant::now();
    let plane = shared.spawn(control_plane(Arc::clone(&shared)));
    let workers: Vec<_> = (0..setup.workers)
        .map(|w| shared.spawn(worker(Arc::clone(&shared), w)))
        .collect();
    join_all(workers).await;
    plane.await;
    shared.rethrow();
    assert!(bulkhead.drain_timeout(Duration::ZERO).await.drained);
    bulkhead.drain().await;
    shared.verify();
    println!("chaos {name}: {:?}", started.elapsed());
}

// ------------------------------------------------------------------------------------------
// The runtimes.
// ------------------------------------------------------------------------------------------

#[test]
fn tokio_multi_thread() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_time()
        .build()
        .unwrap();
    let rt = Rt::new(Timer::Tokio, tokio_spawn);
    for setup in [
        Setup::new(Plane::Fixed, 12, 2_000).always_usage().listen(),
        Setup::new(Plane::SlotsFixed, 12, 2_000),
        Setup::new(Plane::Varying, 12, 2_000).listen(),
    ] {
        runtime.block_on(scenario("tokio_multi_thread", setup, rt.clone()));
    }
}

#[test]
fn tokio_current_thread() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let rt = Rt::new(Timer::Tokio, tokio_spawn);
    for setup in [
        Setup::new(Plane::Varying, 10, 2_000).always_usage(),
        Setup::new(Plane::SlotsFixed, 10, 2_000).listen(),
    ] {
        runtime.block_on(scenario("tokio_current_thread", setup, rt.clone()));
    }
}

#[test]
fn smol_executor() {
    let rt = Rt::new(Timer::AsyncIo, |task| Box::pin(smol::spawn(task)));
    for setup in [
        Setup::new(Plane::Fixed, 10, 2_000),
        Setup::new(Plane::Varying, 10, 2_000)
            .always_usage()
            .listen(),
    ] {
        smol::block_on(scenario("smol", setup, rt.clone()));
    }
}

#[test]
fn async_std_executor() {
    let rt = Rt::new(Timer::AsyncStd, |task| {
        Box::pin(async_std::task::spawn(task))
    });
    for setup in [
        Setup::new(Plane::SlotsFixed, 10, 2_000).always_usage(),
        Setup::new(Plane::Varying, 10, 2_000).listen(),
    ] {
        async_std::task::block_on(scenario("async_std", setup, rt.clone()));
    }
}

#[test]
fn futures_thread_pool() {
    let pool = futures::executor::ThreadPool::builder()
        .pool_size(4)
        .create()
        .unwrap();
    let rt = Rt::new(Timer::AsyncIo, move |task| {
        let (remote, handle) = task.remote_handle();
        pool.spawn_ok(remote);
        Box::pin(handle)
    });
    let setup = Setup::new(Plane::Varying, 10, 2_000).listen();
    futures::executor::block_on(scenario("futures_thread_pool", setup, rt));
}

/// Plain threads: a thread per worker (and per handed-off permit, drain and control plane),
/// with `acquire_blocking(_owned)` among the operations and blocking sleeps.
#[test]
fn std_threads() {
    let rt = Rt::new(Timer::Thread, thread_spawn);
    for setup in [
        Setup::new(Plane::Fixed, 8, 2_000).always_usage(),
        Setup::new(Plane::Varying, 8, 2_000).listen(),
        Setup::new(Plane::SlotsFixed, 8, 2_000)
            .always_usage()
            .listen(),
    ] {
        futures::executor::block_on(scenario("std_threads", setup, rt.clone()));
    }
}
