//! Regression tests for the defects of issue #11, found by adversarial probing (user code that
//! panics or blocks, re-entrant wakers and listeners) and by comparing the crate with the
//! JavaScript original. Each test failed before its fix.
//!
//! Scenarios that hung, aborted or broke process-wide state before their fix run in a child
//! process with a watchdog ([`isolated`]): a hang or an abort fails the test instead of the
//! whole test binary.

use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use async_bulkhead_llm::futures::AcquireOwned;
use async_bulkhead_llm::{
    AcquireError, AcquireOptions, Estimator, Event, EventKind, Limits, LlmBulkhead, LlmRequest,
    RejectReason, RequestError, Reservation, TokenBudget, TokenEstimate, TokenUsage,
};

// ===== helpers =====

/// Runs `scenario` in a child process (this test binary, filtered to the test `name`), and
/// fails unless it exits successfully within `limit`. In the child, runs it directly.
fn isolated(name: &str, limit: Duration, scenario: fn()) {
    const CHILD: &str = "ABL_RELIABILITY_CHILD";
    if std::env::var(CHILD).as_deref() == Ok(name) {
        scenario();
        return;
    }
    let mut child = Command::new(std::env::current_exe().expect("the test binary"))
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, name)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the child test process");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the child") {
            break Some(status);
        }
        if started.elapsed() > limit {
            child.kill().expect("kill the hung child");
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let output = child.wait_with_output().expect("the child's output");
    let text = format!(
        "--- child stdout ---\n{}\n--- child stderr ---\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    match status {
        None => panic!("{name}: the scenario hung (killed after {limit:?})\n{text}"),
        Some(status) => assert!(
            status.success(),
            "{name}: the scenario failed or aborted ({status})\n{text}"
        ),
    }
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("1 passed"),
        "{name}: the child did not run the scenario\n{text}"
    );
}

fn res(input: u64, max_output: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(input, max_output).unwrap())
}

fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).unwrap()
}

/// An estimator whose `observe` panics (its estimates are plain).
struct PanicsOnObserve;

impl Estimator for PanicsOnObserve {
    fn estimate(&self, _request: &LlmRequest) -> Result<TokenEstimate, RequestError> {
        Ok(TokenEstimate::new(100, 100))
    }

    fn observe(&self, _estimate: &TokenEstimate, _usage: TokenUsage) {
        panic!("estimator observe panics");
    }
}

fn panicking_estimator_bulkhead(slots: u32) -> LlmBulkhead {
    LlmBulkhead::builder("m", slots)
        .token_budget(TokenBudget::new(10_000))
        .estimator(PanicsOnObserve)
        .build()
        .unwrap()
}

/// A waker that counts its wake-ups.
#[derive(Default)]
struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn poll_once<F: Future + Unpin>(future: &mut F, waker: &Waker) -> Poll<F::Output> {
    Pin::new(future).poll(&mut Context::from_waker(waker))
}

/// A full bulkhead (one slot, held) with a queue.
fn full_with_queue(max_queue: u32) -> (LlmBulkhead, async_bulkhead_llm::OwnedPermit) {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .max_queue(max_queue)
        .build()
        .unwrap();
    let held = bulkhead
        .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    (bulkhead, held)
}

// ===== 1. a panicking `Estimator::observe` =====

#[test]
fn a_panicking_estimator_observe_returns_the_capacity_and_is_counted() {
    let bulkhead = panicking_estimator_bulkhead(2);
    for round in 1..=2u64 {
        let permit = bulkhead
            .try_acquire(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        assert_eq!(permit.held_tokens(), 200);
        // The release completes: the panic is caught, not unwound into the caller.
        let released = catch_unwind(AssertUnwindSafe(|| {
            permit.release(Some(usage(50, 20)));
        }));
        assert!(released.is_ok(), "round {round}: release unwound");
        let stats = bulkhead.stats();
        assert_eq!(
            (stats.in_flight, stats.admitted, stats.released),
            (0, round, round)
        );
        assert_eq!(stats.estimator_panics, round);
        let tokens = stats.token_budget.unwrap();
        assert_eq!(tokens.in_flight_tokens, 0);
        assert_eq!(
            (tokens.total_consumed, tokens.total_refunded),
            (70 * round, 130 * round)
        );
    }
    // Both slots are free: two more calls are admitted.
    let a = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new());
    let b = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new());
    assert!(a.is_ok() && b.is_ok());
    drop((a, b));
    assert!(
        futures::executor::block_on(bulkhead.drain_timeout(Duration::from_millis(100))).drained
    );
}

#[test]
fn a_panicking_estimator_observe_under_run_settles_the_call() {
    let bulkhead = panicking_estimator_bulkhead(1);
    let result = futures::executor::block_on(bulkhead.run_with_usage(
        &LlmRequest::new(),
        AcquireOptions::new(),
        |_: &u32| Some(usage(10, 10)),
        async |_| Ok::<_, std::io::Error>(7u32),
    ));
    assert_eq!(result.unwrap(), 7);
    let stats = bulkhead.stats();
    assert_eq!(
        (stats.in_flight, stats.released, stats.estimator_panics),
        (0, 1, 1)
    );
    assert!(
        bulkhead
            .try_acquire(&LlmRequest::new(), AcquireOptions::new())
            .is_ok()
    );
}

fn dropped_while_unwinding() {
    let bulkhead = panicking_estimator_bulkhead(1);
    let worker = {
        let bulkhead = bulkhead.clone();
        std::thread::spawn(move || {
            let mut permit = bulkhead
                .try_acquire(&LlmRequest::new(), AcquireOptions::new())
                .unwrap();
            permit.report_usage(usage(30, 5)).unwrap();
            // The permit drops while this thread unwinds, settling with the reported usage:
            // the estimator's panic must not escape the drop (that aborts the process).
            panic!("the caller's own failure");
        })
    };
    assert!(worker.join().is_err(), "the worker panicked");
    let stats = bulkhead.stats();
    assert_eq!(
        (stats.in_flight, stats.released, stats.estimator_panics),
        (0, 1, 1)
    );
}

#[test]
fn a_permit_dropped_while_unwinding_with_a_panicking_estimator_does_not_abort() {
    isolated(
        "a_permit_dropped_while_unwinding_with_a_panicking_estimator_does_not_abort",
        Duration::from_secs(30),
        dropped_while_unwinding,
    );
}

// ===== 2. the timer thread and user wakers =====

/// A waker whose `wake` panics.
struct PanicsOnWake;

impl Wake for PanicsOnWake {
    fn wake(self: Arc<Self>) {
        panic!("waker panics");
    }
}

/// A queue timeout on a fresh bulkhead completes about on time (blocking acquire on the
/// futures executor, which only polls again when woken).
fn short_timeout_fires(within: Duration) {
    let (bulkhead, _held) = full_with_queue(1);
    let started = Instant::now();
    let options = AcquireOptions::new().timeout(Duration::from_millis(20));
    let result = futures::executor::block_on(bulkhead.acquire(&LlmRequest::new(), options));
    let took = started.elapsed();
    match result {
        Err(AcquireError::Rejected(r)) => assert_eq!(r.reason(), RejectReason::Timeout),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(
        took >= Duration::from_millis(20) && took < within,
        "a 20 ms timeout completed after {took:?}"
    );
}

fn panicking_waker_scenario() {
    let (bulkhead, _held) = full_with_queue(1);
    let waker = Waker::from(Arc::new(PanicsOnWake));
    let mut waiting = bulkhead.acquire_owned(
        &LlmRequest::new(),
        AcquireOptions::new().timeout(Duration::from_millis(5)),
    );
    assert!(poll_once(&mut waiting, &waker).is_pending());
    // Let the timer call (and survive) the panicking waker.
    std::thread::sleep(Duration::from_millis(50));
    for _ in 0..3 {
        short_timeout_fires(Duration::from_millis(1_000));
    }
    drop(waiting);
}

#[test]
fn a_panicking_waker_does_not_stop_the_timer() {
    isolated(
        "a_panicking_waker_does_not_stop_the_timer",
        Duration::from_secs(30),
        panicking_waker_scenario,
    );
}

/// A waker whose `wake` blocks for a while.
struct BlocksOnWake(Duration);

impl Wake for BlocksOnWake {
    fn wake(self: Arc<Self>) {
        std::thread::sleep(self.0);
    }
}

fn blocking_waker_scenario() {
    let (bulkhead, _held) = full_with_queue(2);
    let waker = Waker::from(Arc::new(BlocksOnWake(Duration::from_millis(1_500))));
    let mut stuck = bulkhead.acquire_owned(
        &LlmRequest::new(),
        AcquireOptions::new().timeout(Duration::from_millis(10)),
    );
    assert!(poll_once(&mut stuck, &waker).is_pending());
    // The blocking waker is called at about 10 ms and holds its thread for 1.5 s; an unrelated
    // 20 ms timeout registered now must not wait for it.
    std::thread::sleep(Duration::from_millis(15));
    short_timeout_fires(Duration::from_millis(500));
    drop(stuck);
}

#[test]
fn a_blocking_waker_does_not_hold_back_other_timeouts() {
    isolated(
        "a_blocking_waker_does_not_hold_back_other_timeouts",
        Duration::from_secs(30),
        blocking_waker_scenario,
    );
}

// ===== 3. a waker dropped under the timer lock =====

/// A waker that owns a task: here, another timed acquire future. Dropping the last reference
/// drops that future, which cancels its own timer registration.
struct OwnsTask(Mutex<Option<AcquireOwned>>);

impl Wake for OwnsTask {
    fn wake(self: Arc<Self>) {
        // A real task would poll its future here; these scenarios never wake it.
        drop(self.0.lock().unwrap().take());
    }
}

fn replaced_waker_scenario() {
    let (bulkhead, _held) = full_with_queue(4);
    let timeout = AcquireOptions::new().timeout(Duration::from_secs(60));
    // The task the first waker owns: a queued acquire with a live timer registration.
    let mut owned = bulkhead.acquire_owned(&LlmRequest::new(), timeout);
    assert!(poll_once(&mut owned, Waker::noop()).is_pending());
    let first = Waker::from(Arc::new(OwnsTask(Mutex::new(Some(owned)))));

    // A second queued acquire, polled by the first task, then moved to another task: the
    // timer replaces the first waker by the second, dropping the first's last reference.
    let mut moved = bulkhead.acquire_owned(&LlmRequest::new(), timeout);
    assert!(poll_once(&mut moved, &first).is_pending());
    drop(first);
    let second = Waker::from(Arc::new(Count::default()));
    assert!(poll_once(&mut moved, &second).is_pending());
    assert_eq!(
        bulkhead.stats().rejected_by_reason.aborted,
        1,
        "the owned task was dropped"
    );

    // Cancelling (dropping a registered acquire) drops its waker outside the lock too.
    let mut other = bulkhead.acquire_owned(&LlmRequest::new(), timeout);
    let mut inner = bulkhead.acquire_owned(&LlmRequest::new(), timeout);
    assert!(poll_once(&mut inner, Waker::noop()).is_pending());
    let owner = Waker::from(Arc::new(OwnsTask(Mutex::new(Some(inner)))));
    assert!(poll_once(&mut other, &owner).is_pending());
    drop(owner);
    drop(other);
    drop(moved);
    assert_eq!(bulkhead.stats().rejected_by_reason.aborted, 4);
    // The timer still works.
    short_timeout_fires(Duration::from_millis(1_000));
}

#[test]
fn a_waker_that_owns_a_timed_task_is_dropped_outside_the_timer_lock() {
    isolated(
        "a_waker_that_owns_a_timed_task_is_dropped_outside_the_timer_lock",
        Duration::from_secs(30),
        replaced_waker_scenario,
    );
}

// ===== 4. waking under the limits writer lock =====

/// A waker that polls its task inline, as some executors do.
struct PollsInline {
    task: Mutex<Option<AcquireOwned>>,
    admitted: AtomicBool,
}

impl Wake for PollsInline {
    fn wake(self: Arc<Self>) {
        let waker = Waker::from(self.clone());
        let mut task = self.task.lock().unwrap();
        if let Some(future) = task.as_mut()
            && let Poll::Ready(result) = poll_once(future, &waker)
        {
            assert!(result.is_ok(), "handed a slot by the raised limits");
            self.admitted.store(true, Ordering::SeqCst);
            *task = None;
        }
    }
}

fn inline_poll_scenario() {
    let (bulkhead, _held) = full_with_queue(1);
    // An admit listener that pushes a new revision (as a control plane hook would).
    let reconfigured = Arc::new(AtomicU64::new(0));
    let _subscription = {
        let (handle, reconfigured) = (bulkhead.clone(), reconfigured.clone());
        bulkhead.on_events([EventKind::Admit], move |_| {
            let next = Limits::new(handle.limits().revision + 1, 2).with_max_queue(1);
            handle.apply_limits(next).unwrap();
            reconfigured.fetch_add(1, Ordering::SeqCst);
        })
    };
    let waker = Arc::new(PollsInline {
        task: Mutex::new(None),
        admitted: AtomicBool::new(false),
    });
    let mut waiting = bulkhead.acquire_owned(&LlmRequest::new(), AcquireOptions::new());
    assert!(poll_once(&mut waiting, &Waker::from(waker.clone())).is_pending());
    *waker.task.lock().unwrap() = Some(waiting);

    // Raising the limits hands the slot to the waiter; its waker polls it inline, its admit
    // listener calls `apply_limits` again.
    bulkhead
        .apply_limits(Limits::new(1, 2).with_max_queue(1))
        .unwrap();
    assert!(waker.admitted.load(Ordering::SeqCst));
    assert_eq!(reconfigured.load(Ordering::SeqCst), 1);
    assert_eq!(bulkhead.limits().revision, 2);
}

#[test]
fn apply_limits_wakes_waiters_after_releasing_its_lock() {
    isolated(
        "apply_limits_wakes_waiters_after_releasing_its_lock",
        Duration::from_secs(30),
        inline_poll_scenario,
    );
}

// ===== 6. what dropping a subscription guarantees =====

#[test]
fn a_dropped_subscription_hears_no_event_that_starts_after_the_drop() {
    let bulkhead = LlmBulkhead::builder("m", 4).build().unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    for round in 0..200u64 {
        let subscription = {
            let calls = calls.clone();
            bulkhead.on(move |_| {
                calls.fetch_add(1, Ordering::SeqCst);
            })
        };
        // Events on another thread race the drop...
        let racer = {
            let bulkhead = bulkhead.clone();
            std::thread::spawn(move || {
                for _ in 0..20 {
                    drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()));
                }
            })
        };
        drop(subscription);
        racer.join().unwrap();
        // ...but once the drop returned (and the racer is joined), no event reaches it.
        let before = calls.load(Ordering::SeqCst);
        drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()));
        bulkhead.apply_limits(Limits::new(round + 1, 4)).unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), before, "round {round}");
    }
}

#[test]
fn a_listener_may_drop_its_own_subscription() {
    let bulkhead = LlmBulkhead::builder("m", 4).build().unwrap();
    let slot: Arc<Mutex<Option<async_bulkhead_llm::Subscription>>> = Arc::default();
    let calls = Arc::new(AtomicU64::new(0));
    let subscription = {
        let (slot, calls) = (slot.clone(), calls.clone());
        bulkhead.on(move |_| {
            calls.fetch_add(1, Ordering::SeqCst);
            drop(slot.lock().unwrap().take());
        })
    };
    *slot.lock().unwrap() = Some(subscription);
    drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()));
    // Admit (which unsubscribed), then nothing more.
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

// ===== 7. listeners subscribed while a call waits =====

/// Records every event's kind, and the reject reasons.
fn recorder(bulkhead: &LlmBulkhead) -> (Arc<Mutex<Vec<String>>>, async_bulkhead_llm::Subscription) {
    let log: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = log.clone();
    let subscription = bulkhead.on(move |event| {
        let entry = match event {
            Event::Admit(e) => format!("admit reserved={}", e.reserved_tokens),
            Event::Reject(e) => format!("reject {}", e.reason),
            other => other.kind().as_str().to_string(),
        };
        seen.lock().unwrap().push(entry);
    });
    (log, subscription)
}

#[test]
fn a_listener_subscribed_while_a_call_waits_hears_its_admit() {
    let (bulkhead, held) = full_with_queue(1);
    let mut waiting = bulkhead.acquire_owned(&LlmRequest::new(), AcquireOptions::new());
    assert!(poll_once(&mut waiting, Waker::noop()).is_pending());
    let (log, _subscription) = recorder(&bulkhead);
    let queued_for = Instant::now();
    std::thread::sleep(Duration::from_millis(5));
    drop(held); // hands the slot over
    let admitted = Arc::new(Mutex::new(None));
    let _timing = {
        let admitted = admitted.clone();
        bulkhead.on_events([EventKind::Admit], move |event| {
            if let Event::Admit(e) = event {
                *admitted.lock().unwrap() = Some(e.queue_wait);
            }
        })
    };
    let permit = match poll_once(&mut waiting, Waker::noop()) {
        Poll::Ready(result) => result.unwrap(),
        Poll::Pending => panic!("handed a slot"),
    };
    let waited = queued_for.elapsed();
    assert_eq!(*log.lock().unwrap(), ["release", "admit reserved=0"]);
    let queue_wait = admitted.lock().unwrap().expect("timed");
    assert!(
        queue_wait >= Duration::from_millis(5) && queue_wait <= waited + Duration::from_secs(1)
    );
    drop(permit);
}

fn refused_reason(
    poll: Poll<Result<async_bulkhead_llm::OwnedPermit, AcquireError>>,
) -> RejectReason {
    match poll {
        Poll::Ready(Err(error)) => error.rejection().expect("a capacity refusal").reason(),
        Poll::Ready(Ok(_)) => panic!("admitted"),
        Poll::Pending => panic!("still waiting"),
    }
}

#[test]
fn a_listener_subscribed_while_calls_wait_hears_every_refusal() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .max_queue(4)
        .token_budget(TokenBudget::new(1_000))
        .build()
        .unwrap();
    let held = bulkhead
        .try_acquire_owned(&LlmRequest::new(), res(100, 0))
        .unwrap();
    let mut head = bulkhead.acquire_owned(&LlmRequest::new(), res(500, 0));
    let mut handed = bulkhead.acquire_owned(&LlmRequest::new(), res(10, 0));
    let mut cancelled = bulkhead.acquire_owned(&LlmRequest::new(), res(10, 0));
    let mut closed = bulkhead.acquire_owned(&LlmRequest::new(), res(10, 0));
    for future in [&mut head, &mut handed, &mut cancelled, &mut closed] {
        assert!(poll_once(future, Waker::noop()).is_pending());
    }
    // Subscribed for other kinds when they queued, and for everything only now.
    let _other_kinds = bulkhead.on_events([EventKind::Usage], |_| {});
    let (log, _subscription) = recorder(&bulkhead);
    bulkhead.set_budget(200).unwrap();
    // The head's 500 tokens no longer fit: refused at its turn; the next call gets the slot.
    drop(held);
    assert_eq!(
        refused_reason(poll_once(&mut head, Waker::noop())),
        RejectReason::BudgetLimit
    );
    drop(cancelled); // while queued
    bulkhead.close(); // refuses the last waiter
    assert_eq!(
        refused_reason(poll_once(&mut closed, Waker::noop())),
        RejectReason::Shutdown
    );
    drop(handed); // handed a slot it never picked up
    assert_eq!(
        *log.lock().unwrap(),
        [
            "reconfigure",
            "release",
            "reject budget_limit",
            "reject aborted",
            "reject shutdown",
            "reject aborted"
        ]
    );
    assert_eq!(bulkhead.stats().in_flight, 0);
}

// ===== 8. the refusal detail of waiters refused by `close()` =====

#[test]
fn close_refuses_every_waiter_with_the_state_after_the_close() {
    let (bulkhead, held) = full_with_queue(2);
    let mut first = bulkhead.acquire_owned(&LlmRequest::new(), AcquireOptions::new());
    let mut second = bulkhead.acquire_owned(&LlmRequest::new(), AcquireOptions::new());
    assert!(poll_once(&mut first, Waker::noop()).is_pending());
    assert!(poll_once(&mut second, Waker::noop()).is_pending());
    assert_eq!(bulkhead.stats().pending, 2);
    bulkhead.close();
    for future in [&mut first, &mut second] {
        let Poll::Ready(Err(error)) = poll_once(future, Waker::noop()) else {
            panic!("refused by the close");
        };
        let rejection = error.rejection().unwrap();
        assert_eq!(rejection.reason(), RejectReason::Shutdown);
        let detail = rejection.detail();
        assert_eq!((detail.pending, detail.in_flight), (0, 1));
    }
    drop(held);
}
