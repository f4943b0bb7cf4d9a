//! Behavioural tests of waiting: the bounded strictly-FIFO queue with direct hand-off, queue
//! limits, the token budget that never queues, timeouts (on several executors), cancellation,
//! `close`, `apply_limits` while calls wait, `drain`/`drain_timeout`, profiles, `run`, the
//! blocking acquires and the `'static` owned future.
//!
//! Semantics come from issue 3, `upstream-behavior.md` §2, §3.2, §14, §15 and RUST-DESIGN §4
//! (Q5: drain completes whenever the bulkhead becomes idle; Q7: a queued request is admitted
//! only when its slot and its tokens fit together, and the budget never queues).
//!
//! Waiters are put into the queue deterministically by polling their futures by hand (an
//! acquire takes its place at its first poll). A slot handed to a waiter is counted in
//! `stats().in_flight` at once; the waiter counts as admitted when its future is polled again.

use std::cell::Cell;
use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::thread;
use std::time::{Duration, Instant};

use async_bulkhead_llm::futures::{Acquire, AcquireOwned};
use async_bulkhead_llm::{
    AcquireError, AcquireOptions, DrainReport, Limits, LlmBulkhead, LlmRequest, Priority, Profile,
    RejectReason, Rejection, Reservation, RunError, TokenBudget, TokenBudgetStats, TokenUsage,
    Verdict,
};
use futures::executor::block_on;

// ===== helpers =====

/// A queue timeout long enough to be sure the waiter queued first, short enough for fast tests.
const SHORT: Duration = Duration::from_millis(20);
/// How long to wait for another thread before declaring a hang.
const PATIENCE: Duration = Duration::from_secs(10);

fn req() -> LlmRequest {
    LlmRequest::new()
}

fn opts() -> AcquireOptions {
    AcquireOptions::new()
}

/// Options reserving exactly `tokens` tokens (ignored by a bulkhead without a budget).
fn toks(tokens: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(0, tokens).expect("fits in u64"))
}

/// Options with a per-call queue timeout.
fn within(timeout: Duration) -> AcquireOptions {
    AcquireOptions::new().timeout(timeout)
}

fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).expect("fits in u64")
}

/// A bulkhead without a token budget.
fn plain(max_concurrent: u32, max_queue: u32) -> LlmBulkhead {
    LlmBulkhead::builder("test-model", max_concurrent)
        .max_queue(max_queue)
        .build()
        .expect("valid configuration")
}

/// A bulkhead with a token budget (no high-priority reserve).
fn budgeted(max_concurrent: u32, max_queue: u32, budget: u64) -> LlmBulkhead {
    LlmBulkhead::builder("test-model", max_concurrent)
        .max_queue(max_queue)
        .token_budget(TokenBudget::new(budget))
        .build()
        .expect("valid configuration")
}

fn tokens(bulkhead: &LlmBulkhead) -> TokenBudgetStats {
    bulkhead.stats().token_budget.expect("has a token budget")
}

/// `(in_flight, pending, admitted)`.
fn figures(bulkhead: &LlmBulkhead) -> (u64, u64, u64) {
    let s = bulkhead.stats();
    (s.in_flight, s.pending, s.admitted)
}

/// Refusals counted for `reason`.
fn count(bulkhead: &LlmBulkhead, reason: RejectReason) -> u64 {
    bulkhead.stats().rejected_by_reason.get(reason)
}

fn poll_with<F: Future>(fut: &mut Pin<Box<F>>, waker: &Waker) -> Poll<F::Output> {
    fut.as_mut().poll(&mut Context::from_waker(waker))
}

fn poll_now<F: Future>(fut: &mut Pin<Box<F>>) -> Poll<F::Output> {
    poll_with(fut, Waker::noop())
}

#[track_caller]
fn ready<F: Future>(fut: &mut Pin<Box<F>>) -> F::Output {
    match poll_now(fut) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("expected the future to be ready"),
    }
}

#[track_caller]
fn assert_pending<F: Future>(fut: &mut Pin<Box<F>>)
where
    F::Output: fmt::Debug,
{
    if let Poll::Ready(out) = poll_now(fut) {
        panic!("expected the future to be pending, got {out:?}");
    }
}

/// Starts an acquire and polls it once: it must have joined the queue.
#[track_caller]
fn queued<'a>(bulkhead: &'a LlmBulkhead, options: AcquireOptions) -> Pin<Box<Acquire<'a>>> {
    let mut fut = Box::pin(bulkhead.acquire(&req(), options));
    assert_pending(&mut fut);
    fut
}

/// The rejection of a refused acquire; panics on success or on invalid input.
#[track_caller]
fn rejection<T: fmt::Debug>(result: Result<T, AcquireError>) -> Rejection {
    match result {
        Err(AcquireError::Rejected(rejection)) => rejection,
        other => panic!("expected a capacity rejection, got {other:?}"),
    }
}

#[track_caller]
fn reason_of<T: fmt::Debug>(result: Result<T, AcquireError>) -> RejectReason {
    rejection(result).reason()
}

/// A waker that counts its wake-ups.
struct WakeCount(AtomicUsize);

impl WakeCount {
    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl Wake for WakeCount {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counting_waker() -> (Waker, Arc<WakeCount>) {
    let count = Arc::new(WakeCount(AtomicUsize::new(0)));
    (Waker::from(Arc::clone(&count)), count)
}

/// Waits (bounded) until `cond` holds, for conditions set by other threads.
#[track_caller]
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < deadline, "gave up waiting until {what}");
        thread::sleep(Duration::from_millis(1));
    }
}

/// Sets its flag when dropped.
struct SetOnDrop<'a>(&'a Cell<bool>);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.set(true);
    }
}

// ===== FIFO order and hand-off =====

#[test]
fn releases_grant_waiters_strictly_in_arrival_order() {
    let bulkhead = plain(1, 8);
    let mut held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let wakers: Vec<(Waker, Arc<WakeCount>)> = (0..5).map(|_| counting_waker()).collect();
    let mut waiters: Vec<Option<Pin<Box<Acquire<'_>>>>> = Vec::new();
    for (i, (waker, _)) in wakers.iter().enumerate() {
        let mut fut = Box::pin(bulkhead.acquire(&req(), opts()));
        assert!(poll_with(&mut fut, waker).is_pending(), "waiter {i} queues");
        assert_eq!(bulkhead.stats().pending, i as u64 + 1);
        waiters.push(Some(fut));
    }
    assert_eq!(figures(&bulkhead), (1, 5, 1));

    let mut order = Vec::new();
    for turn in 0..5 {
        drop(held);
        // The slot went straight to the head: in flight at once, admitted only once picked up.
        assert_eq!(figures(&bulkhead), (1, 4 - turn as u64, 1 + turn as u64));
        // Exactly the head was woken by this release.
        let woken: Vec<usize> = wakers.iter().map(|(_, c)| c.get()).collect();
        let expected: Vec<usize> = (0..5).map(|j| usize::from(j <= turn)).collect();
        assert_eq!(woken, expected, "wake-ups after release {turn}");
        // Poll every remaining waiter (with its own waker), latest first: only the head is
        // ready.
        let mut granted = None;
        for j in (turn..5).rev() {
            let fut = waiters[j].as_mut().expect("still waiting");
            if let Poll::Ready(result) = poll_with(fut, &wakers[j].0) {
                assert!(granted.is_none(), "a single waiter is granted per release");
                order.push(j);
                granted = Some(result.expect("handed the slot"));
            }
        }
        waiters[turn] = None;
        held = granted.expect("the head was granted");
        assert_eq!(held.limit_revision(), 0);
        assert_eq!(figures(&bulkhead), (1, 4 - turn as u64, 2 + turn as u64));
    }
    assert_eq!(order, vec![0, 1, 2, 3, 4]);
    drop(held);
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.pending,
            stats.admitted,
            stats.released
        ),
        (0, 0, 6, 6)
    );
    assert_eq!(stats.rejected, 0);
}

#[test]
fn raising_max_concurrent_admits_the_first_waiters_at_once_in_order() {
    let bulkhead = plain(1, 8);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let wakers: Vec<(Waker, Arc<WakeCount>)> = (0..5).map(|_| counting_waker()).collect();
    let mut waiters: Vec<Pin<Box<Acquire<'_>>>> = wakers
        .iter()
        .map(|(waker, _)| {
            let mut fut = Box::pin(bulkhead.acquire(&req(), opts()));
            assert!(poll_with(&mut fut, waker).is_pending());
            fut
        })
        .collect();
    assert_eq!(figures(&bulkhead), (1, 5, 1));

    let outcome = bulkhead
        .apply_limits(Limits::new(1, 4).with_max_queue(8))
        .expect("valid limits");
    assert!(outcome.is_applied());
    // Three slots freed: the first three waiters hold them at once, the last two still wait.
    assert_eq!(figures(&bulkhead), (4, 2, 1));
    let woken: Vec<usize> = wakers.iter().map(|(_, c)| c.get()).collect();
    assert_eq!(woken, vec![1, 1, 1, 0, 0]);

    assert_pending(&mut waiters[4]);
    assert_pending(&mut waiters[3]);
    let mut permits = Vec::new();
    for waiter in &mut waiters[..3] {
        let permit = ready(waiter).expect("handed a slot");
        assert_eq!(
            permit.limit_revision(),
            1,
            "granted under the raised limits"
        );
        permits.push(permit);
    }
    assert_eq!(figures(&bulkhead), (4, 2, 4));

    drop(held);
    assert_eq!(figures(&bulkhead), (4, 1, 4));
    assert_pending(&mut waiters[4]);
    permits.push(ready(&mut waiters[3]).expect("fourth in line"));
    drop(permits.remove(0));
    assert_eq!(figures(&bulkhead), (4, 0, 5));
    permits.push(ready(&mut waiters[4]).expect("fifth in line"));
    drop(permits);
    assert_eq!(figures(&bulkhead), (0, 0, 6));
    assert_eq!(bulkhead.stats().released, 6);
}

#[test]
fn priority_does_not_reorder_the_queue() {
    let bulkhead = budgeted(1, 4, 10_000);
    let held = bulkhead.try_acquire(&req(), toks(100)).expect("free slot");
    let mut normal = queued(&bulkhead, toks(100));
    let mut high = queued(&bulkhead, toks(100).priority(Priority::High));
    drop(held);
    assert_pending(&mut high);
    let first = ready(&mut normal).expect("first in line");
    assert_eq!(first.priority(), Priority::Normal);
    drop(first);
    let second = ready(&mut high).expect("second in line");
    assert_eq!(second.priority(), Priority::High);
    drop(second);
    assert_eq!(figures(&bulkhead), (0, 0, 3));
}

#[test]
fn an_acquire_takes_its_place_at_its_first_poll_not_at_creation() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut created_first = Box::pin(bulkhead.acquire(&req(), opts()));
    let mut polled_first = queued(&bulkhead, opts());
    assert_eq!(
        bulkhead.stats().pending,
        1,
        "an unpolled acquire is not queued"
    );
    assert_pending(&mut created_first);
    assert_eq!(bulkhead.stats().pending, 2);
    drop(held);
    assert_pending(&mut created_first);
    let permit = ready(&mut polled_first).expect("first to be polled, first served");
    drop(permit);
    drop(ready(&mut created_first).expect("served second"));
    assert_eq!(figures(&bulkhead), (0, 0, 3));
}

#[test]
fn an_acquire_with_a_free_slot_is_admitted_at_its_first_poll() {
    let bulkhead = plain(2, 4);
    let mut fut = Box::pin(bulkhead.acquire(&req(), opts()));
    let permit = ready(&mut fut).expect("free slot");
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    let mut owned = Box::pin(bulkhead.acquire_owned(&req(), opts()));
    let owned_permit = ready(&mut owned).expect("free slot");
    assert_eq!(figures(&bulkhead), (2, 0, 2));
    drop((permit, owned_permit));
    assert_eq!(figures(&bulkhead), (0, 0, 2));
}

#[test]
fn released_counts_a_permit_whose_slot_was_handed_to_a_waiter() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut waiter = queued(&bulkhead, opts());
    drop(held);
    // Single thread, nothing racing: every figure must be exact. One admission (`held`) was
    // made and settled; the waiter holds the slot but has not been admitted yet.
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.admitted), (1, 1));
    assert_eq!(stats.released, 1, "`held` was released");
    drop(ready(&mut waiter).expect("handed the slot"));
    assert_eq!(bulkhead.stats().released, 2);
}

// ===== no barging =====

#[test]
fn a_slot_handed_to_a_waiter_is_not_taken_by_try_acquire() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut waiter = queued(&bulkhead, opts());
    drop(held);
    // The slot already belongs to the waiter, although its future has not run again.
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    let refused = rejection(bulkhead.try_acquire(&req(), opts().priority(Priority::High)));
    assert_eq!(refused.reason(), RejectReason::ConcurrencyLimit);
    assert_eq!(refused.detail().in_flight, 1);
    assert_eq!(
        reason_of(bulkhead.try_acquire_owned(&req(), opts())),
        RejectReason::ConcurrencyLimit
    );
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    let permit = ready(&mut waiter).expect("the waiter gets the slot");
    assert_eq!(figures(&bulkhead), (1, 0, 2));
    assert_eq!(count(&bulkhead, RejectReason::ConcurrencyLimit), 2);
    drop(permit);
    assert_eq!(figures(&bulkhead), (0, 0, 2));
}

#[test]
fn a_fresh_acquire_queues_behind_existing_waiters() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut a = queued(&bulkhead, opts());
    let mut b = queued(&bulkhead, opts());
    drop(held);
    assert_eq!(figures(&bulkhead), (1, 1, 1));
    // A newcomer sees the queue and joins its tail, even before A has picked its slot up.
    assert_eq!(
        bulkhead.would_admit(&req(), opts()).expect("valid"),
        Verdict::Queue
    );
    let mut c = queued(&bulkhead, opts());
    assert_eq!(figures(&bulkhead), (1, 2, 1));
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts())),
        RejectReason::ConcurrencyLimit
    );
    let pa = ready(&mut a).expect("A first");
    drop(pa);
    assert_pending(&mut c);
    let pb = ready(&mut b).expect("B before the newcomer");
    drop(pb);
    let pc = ready(&mut c).expect("then the newcomer");
    drop(pc);
    assert_eq!(figures(&bulkhead), (0, 0, 4));
    assert_eq!(bulkhead.stats().rejected, 1);
}

// ===== limits of queueing =====

#[test]
fn a_full_queue_refuses_queue_limit_with_pending_equal_to_max_queue() {
    let bulkhead = plain(1, 2);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let a = queued(&bulkhead, opts());
    let _b = queued(&bulkhead, opts());
    let mut c = Box::pin(bulkhead.acquire(&req(), opts()));
    let refused = rejection(ready(&mut c));
    assert_eq!(refused.reason(), RejectReason::QueueLimit);
    let d = refused.detail();
    assert_eq!(
        (d.in_flight, d.max_concurrent, d.pending, d.max_queue),
        (1, 1, 2, 2)
    );
    assert_eq!(refused.limit_revision(), 0);
    let mut owned = Box::pin(bulkhead.acquire_owned(&req(), opts()));
    assert_eq!(reason_of(ready(&mut owned)), RejectReason::QueueLimit);
    assert_eq!(bulkhead.stats().pending, 2);
    assert_eq!(count(&bulkhead, RejectReason::QueueLimit), 2);

    // A place freed by a cancellation can be taken again.
    drop(a);
    assert_eq!(bulkhead.stats().pending, 1);
    let _again = queued(&bulkhead, opts());
    assert_eq!(bulkhead.stats().pending, 2);
    drop(held);
}

#[test]
fn zero_max_concurrent_never_queues_even_with_a_queue() {
    let bulkhead = plain(0, 5);
    let mut fut = Box::pin(bulkhead.acquire(&req(), opts()));
    let refused = rejection(ready(&mut fut));
    assert_eq!(refused.reason(), RejectReason::ConcurrencyLimit);
    assert_eq!(
        (refused.detail().pending, refused.detail().max_queue),
        (0, 5)
    );
    assert_eq!(bulkhead.stats().pending, 0);

    // The same when the limit drops to 0 at runtime.
    let bulkhead = plain(1, 5);
    bulkhead
        .apply_limits(Limits::new(1, 0).with_max_queue(5))
        .expect("valid limits");
    let mut fut = Box::pin(bulkhead.acquire(&req(), within(PATIENCE)));
    assert_eq!(reason_of(ready(&mut fut)), RejectReason::ConcurrencyLimit);
    let mut owned = Box::pin(bulkhead.acquire_owned(&req(), opts()));
    assert_eq!(reason_of(ready(&mut owned)), RejectReason::ConcurrencyLimit);
    assert_eq!(bulkhead.stats().pending, 0);
    assert_eq!(count(&bulkhead, RejectReason::ConcurrencyLimit), 2);
}

#[test]
fn zero_max_queue_refuses_concurrency_limit() {
    let bulkhead = plain(1, 0);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut fut = Box::pin(bulkhead.acquire(&req(), within(PATIENCE)));
    let refused = rejection(ready(&mut fut));
    assert_eq!(refused.reason(), RejectReason::ConcurrencyLimit);
    assert_eq!(
        (refused.detail().pending, refused.detail().max_queue),
        (0, 0)
    );
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    assert_eq!(bulkhead.stats().rejected, 1);
    drop(held);
}

#[test]
fn try_acquire_never_queues() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts())),
        RejectReason::ConcurrencyLimit
    );
    assert_eq!(
        reason_of(bulkhead.try_acquire_owned(&req(), within(PATIENCE))),
        RejectReason::ConcurrencyLimit
    );
    assert_eq!(bulkhead.stats().pending, 0);
    // With the queue full, try_acquire still says concurrency_limit: it never looks at the queue.
    let _w = (0..4)
        .map(|_| queued(&bulkhead, opts()))
        .collect::<Vec<_>>();
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts())),
        RejectReason::ConcurrencyLimit
    );
    assert_eq!(bulkhead.stats().pending, 4);
    assert_eq!(count(&bulkhead, RejectReason::ConcurrencyLimit), 3);
    assert_eq!(count(&bulkhead, RejectReason::QueueLimit), 0);
    drop(held);
}

#[test]
fn an_acquire_never_polled_counts_nothing_and_holds_nothing() {
    let bulkhead = budgeted(1, 4, 1000);
    let held = bulkhead.try_acquire(&req(), toks(100)).expect("free slot");
    let fut = bulkhead.acquire(&req(), toks(100));
    let owned = bulkhead.acquire_owned(&req(), toks(100));
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    drop(fut);
    drop(owned);
    let stats = bulkhead.stats();
    assert_eq!((stats.pending, stats.rejected), (0, 0));
    drop(held);
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 0);
}

// ===== the token budget never queues =====

#[test]
fn tokens_that_do_not_fit_are_refused_at_once_even_with_a_queue() {
    let bulkhead = budgeted(1, 4, 1000);
    let held = bulkhead.try_acquire(&req(), toks(600)).expect("free slot");
    let mut big = Box::pin(bulkhead.acquire(&req(), toks(500)));
    let refused = rejection(ready(&mut big));
    assert_eq!(refused.reason(), RejectReason::BudgetLimit);
    let d = refused.detail();
    let t = d.token_budget.expect("budget detail");
    assert_eq!(
        (t.budget, t.in_flight_tokens, t.available, t.requested),
        (1000, 600, 400, 500)
    );
    assert_eq!(d.pending, 0);
    assert_eq!(bulkhead.stats().pending, 0);
    assert_eq!(count(&bulkhead, RejectReason::BudgetLimit), 1);

    // Tokens that fit wait for the slot instead.
    let mut fits = queued(&bulkhead, toks(400));
    assert_eq!(bulkhead.stats().pending, 1);
    // A newcomer that does not fit is still refused at once, not queued behind it.
    let mut big = Box::pin(bulkhead.acquire(&req(), toks(401)));
    assert_eq!(reason_of(ready(&mut big)), RejectReason::BudgetLimit);
    assert_eq!(bulkhead.stats().pending, 1);
    drop(held);
    let permit = ready(&mut fits).expect("handed the slot and its tokens");
    assert_eq!(permit.held_tokens(), 400);
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 400);
    drop(permit);
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 0);
    assert_eq!(count(&bulkhead, RejectReason::BudgetLimit), 2);
}

#[test]
fn the_batch_profile_does_not_queue_for_tokens() {
    let bulkhead = LlmBulkhead::builder("test-model", 4)
        .profile(Profile::Batch)
        .token_budget(TokenBudget::new(1000))
        .build()
        .expect("valid configuration");
    let held = bulkhead.try_acquire(&req(), toks(600)).expect("free slot");
    let mut fut = Box::pin(bulkhead.acquire(&req(), toks(500)));
    assert_eq!(reason_of(ready(&mut fut)), RejectReason::BudgetLimit);
    assert_eq!(bulkhead.stats().pending, 0);
    drop(held);
}

#[test]
fn a_waiter_whose_tokens_do_not_fit_at_its_turn_passes_the_turn_on() {
    // The slots are raised to 4; the head takes 500, which leaves 400 of the 1000: the second
    // waiter's 450 no longer fit at its turn, the third's 100 do.
    let bulkhead = budgeted(1, 5, 1000);
    let held = bulkhead.try_acquire(&req(), toks(100)).expect("free slot");
    let mut a = queued(&bulkhead, toks(500));
    let mut b = queued(&bulkhead, toks(450));
    let mut c = queued(&bulkhead, toks(100));
    assert_eq!(figures(&bulkhead), (1, 3, 1));
    bulkhead
        .apply_limits(
            Limits::new(1, 4)
                .with_max_queue(5)
                .with_token_budget(1000, 0),
        )
        .expect("valid limits");
    assert_eq!(figures(&bulkhead), (3, 0, 1));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 700);
    assert_eq!(count(&bulkhead, RejectReason::BudgetLimit), 1);

    let refused = rejection(ready(&mut b));
    assert_eq!(refused.reason(), RejectReason::BudgetLimit);
    assert_eq!(refused.limit_revision(), 1);
    let t = refused.detail().token_budget.expect("budget detail");
    assert_eq!((t.in_flight_tokens, t.requested), (600, 450));
    let pc = ready(&mut c).expect("the turn passed to C");
    let pa = ready(&mut a).expect("A was granted first");
    assert_eq!((pa.held_tokens(), pc.held_tokens()), (500, 100));
    assert_eq!(figures(&bulkhead), (3, 0, 3));

    drop((held, pa, pc));
    assert_eq!(figures(&bulkhead), (0, 0, 3));
    let t = tokens(&bulkhead);
    assert_eq!((t.in_flight_tokens, t.total_reserved), (0, 700));
    assert_eq!(bulkhead.stats().released, 3);
}

#[test]
fn a_waiter_whose_tokens_no_longer_fit_is_refused_at_its_turn_and_the_next_gets_the_slot() {
    let bulkhead = budgeted(1, 4, 1000);
    let held = bulkhead.try_acquire(&req(), toks(600)).expect("free slot");
    let mut a = queued(&bulkhead, toks(400));
    let mut b = queued(&bulkhead, toks(100));
    let shrunk = bulkhead.set_budget(300).expect("has a budget");
    assert_eq!(shrunk.revision, 1);
    // No slot has freed: nobody has reached its turn, both keep their places.
    assert_eq!(figures(&bulkhead), (1, 2, 1));
    assert_eq!(count(&bulkhead, RejectReason::BudgetLimit), 0);
    assert_pending(&mut a);
    assert_pending(&mut b);

    drop(held);
    // A's turn: 400 > 300, refused; the turn passes to B, whose 100 fit: B holds the slot.
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 100);
    assert_eq!(count(&bulkhead, RejectReason::BudgetLimit), 1);
    let refused = rejection(ready(&mut a));
    assert_eq!(refused.reason(), RejectReason::BudgetLimit);
    assert_eq!(refused.limit_revision(), 1);
    let t = refused.detail().token_budget.expect("budget detail");
    assert_eq!((t.budget, t.requested), (300, 400));
    let pb = ready(&mut b).expect("B gets the slot");
    assert_eq!((pb.held_tokens(), pb.limit_revision()), (100, 1));
    drop(pb);
    assert_eq!(figures(&bulkhead), (0, 0, 2));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 0);
}

#[test]
fn a_waiter_behind_a_granted_head_keeps_its_place_until_a_slot_frees_for_it() {
    let bulkhead = budgeted(2, 4, 1000);
    let h1 = bulkhead.try_acquire(&req(), toks(100)).expect("free slot");
    let h2 = bulkhead.try_acquire(&req(), toks(100)).expect("free slot");
    let mut a = queued(&bulkhead, toks(500)); // 200 + 500 fit
    let mut b = queued(&bulkhead, toks(450)); // 200 + 450 fit
    drop(h1);
    // A takes the freed slot (100 + 500 held). B is now the head but no slot is free for it:
    // its turn has not come, so it keeps waiting.
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 600);
    assert_eq!(figures(&bulkhead), (2, 1, 2));
    assert_eq!(count(&bulkhead, RejectReason::BudgetLimit), 0);
    let pa = ready(&mut a).expect("A gets the freed slot");
    assert_pending(&mut b);
    drop(h2);
    // B's turn: 500 + 450 = 950 fit in 1000.
    let pb = ready(&mut b).expect("B gets the next slot");
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 950);
    drop((pa, pb));
    assert_eq!(figures(&bulkhead), (0, 0, 4));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 0);
}

#[test]
fn a_limit_change_that_frees_no_slot_does_not_refuse_a_waiter_for_tokens() {
    let bulkhead = budgeted(2, 4, 1000);
    let h1 = bulkhead.try_acquire(&req(), toks(100)).expect("free slot");
    let h2 = bulkhead.try_acquire(&req(), toks(100)).expect("free slot");
    let mut a = queued(&bulkhead, toks(500)); // 200 + 500 fit
    let mut b = queued(&bulkhead, toks(450)); // 200 + 450 fit
    drop(h1);
    let pa = ready(&mut a).expect("A gets the freed slot");
    assert_eq!(figures(&bulkhead), (2, 1, 3));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 600);
    // Only the queue grows: no slot frees, so B's turn has not come and it keeps waiting.
    bulkhead
        .apply_limits(
            Limits::new(1, 2)
                .with_max_queue(8)
                .with_token_budget(1000, 0),
        )
        .expect("valid limits");
    assert_eq!(figures(&bulkhead), (2, 1, 3));
    assert_eq!(count(&bulkhead, RejectReason::BudgetLimit), 0);
    assert_pending(&mut b);
    drop(h2);
    // B's turn: 500 + 450 = 950 fit in 1000.
    let pb = ready(&mut b).expect("B gets the next slot");
    assert_eq!((pb.held_tokens(), pb.limit_revision()), (450, 1));
    drop((pa, pb));
    assert_eq!(figures(&bulkhead), (0, 0, 4));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 0);
}

// ===== timeouts =====

#[test]
fn a_per_call_timeout_refuses_timeout_and_leaves_the_queue() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let started = Instant::now();
    let mut a = queued(&bulkhead, within(SHORT));
    let mut b = queued(&bulkhead, opts());
    let refused = rejection(block_on(&mut a));
    let waited = started.elapsed();
    assert_eq!(refused.reason(), RejectReason::Timeout);
    assert!(
        waited >= SHORT && waited < PATIENCE,
        "timed out after {waited:?}"
    );
    assert_eq!(refused.detail().pending, 1, "only B is left in the queue");
    let stats = bulkhead.stats();
    assert_eq!((stats.pending, stats.rejected), (1, 1));
    assert_eq!(stats.rejected_by_reason.timeout, 1);
    drop(held);
    let permit = ready(&mut b).expect("B is now first");
    drop(permit);
    assert_eq!(figures(&bulkhead), (0, 0, 2));
}

#[test]
fn the_bulkhead_default_timeout_applies_when_the_call_sets_none() {
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .max_queue(4)
        .queue_timeout(SHORT)
        .build()
        .expect("valid configuration");
    assert_eq!(bulkhead.queue_timeout(), Some(SHORT));
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let started = Instant::now();
    assert_eq!(
        reason_of(block_on(bulkhead.acquire(&req(), opts()))),
        RejectReason::Timeout
    );
    assert!(started.elapsed() >= SHORT);
    assert_eq!(
        reason_of(block_on(bulkhead.acquire_owned(&req(), opts()))),
        RejectReason::Timeout
    );
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.pending,
            stats.in_flight,
            stats.rejected_by_reason.timeout
        ),
        (0, 1, 2)
    );
    drop(held);
}

#[test]
fn a_per_call_timeout_overrides_the_default() {
    // Shorter than the default: it fires long before the default would.
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .max_queue(4)
        .queue_timeout(PATIENCE)
        .build()
        .expect("valid configuration");
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let started = Instant::now();
    assert_eq!(
        reason_of(block_on(bulkhead.acquire(&req(), within(SHORT)))),
        RejectReason::Timeout
    );
    assert!(started.elapsed() < PATIENCE / 2);
    drop(held);

    // Longer than the default: a call that queued before one relying on the default outlives it.
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .max_queue(4)
        .queue_timeout(SHORT)
        .build()
        .expect("valid configuration");
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut patient = queued(&bulkhead, within(PATIENCE));
    let mut default = queued(&bulkhead, opts());
    assert_eq!(
        reason_of(block_on(&mut default)),
        RejectReason::Timeout,
        "the default applies to the call that set none"
    );
    assert_pending(&mut patient);
    assert_eq!(bulkhead.stats().pending, 1);
    drop(held);
    drop(ready(&mut patient).expect("still waiting, then served"));
    assert_eq!(count(&bulkhead, RejectReason::Timeout), 1);
}

#[test]
fn profile_default_timeouts_apply_to_the_queue() {
    let custom = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Custom {
            max_queue: 2,
            timeout: Some(SHORT),
        })
        .build()
        .expect("valid configuration");
    assert_eq!(custom.queue_timeout(), Some(SHORT));
    let held = custom.try_acquire(&req(), opts()).expect("free slot");
    assert_eq!(
        reason_of(block_on(custom.acquire(&req(), opts()))),
        RejectReason::Timeout
    );
    assert_eq!(custom.stats().pending, 0);
    drop(held);

    // Batch waits 30 s by default: a call without a timeout outlives one with a short one.
    let batch = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Batch)
        .build()
        .expect("valid configuration");
    assert_eq!(batch.queue_timeout(), Some(Duration::from_secs(30)));
    let held = batch.try_acquire(&req(), opts()).expect("free slot");
    let mut default = queued(&batch, opts());
    let mut short = queued(&batch, within(SHORT));
    assert_eq!(reason_of(block_on(&mut short)), RejectReason::Timeout);
    assert_pending(&mut default);
    drop(held);
    drop(ready(&mut default).expect("served after the release"));
    assert_eq!(figures(&batch), (0, 0, 2));
}

#[test]
fn a_timeout_bounds_only_the_queue_wait() {
    let bulkhead = plain(2, 4);
    let mut instant = Box::pin(bulkhead.acquire(&req(), within(Duration::ZERO)));
    let p1 = ready(&mut instant).expect("a free slot admits at once, whatever the timeout");
    let mut tiny = Box::pin(bulkhead.acquire_owned(&req(), within(Duration::from_nanos(1))));
    let p2 = ready(&mut tiny).expect("a free slot admits at once");
    thread::sleep(Duration::from_millis(5)); // both timeouts are long past
    assert_eq!(figures(&bulkhead), (2, 0, 2));
    assert_eq!(bulkhead.stats().rejected, 0);

    // A slot handed over before the deadline is kept even if the future is polled after it.
    let mut waiter = queued(&bulkhead, within(Duration::from_millis(5)));
    drop(p1);
    thread::sleep(Duration::from_millis(15));
    let p3 = ready(&mut waiter).expect("the hand-off won before the deadline");
    assert_eq!(count(&bulkhead, RejectReason::Timeout), 0);
    assert_eq!(figures(&bulkhead), (2, 0, 3));
    drop((p2, p3));
    assert_eq!(figures(&bulkhead), (0, 0, 3));
}

#[test]
fn a_zero_timeout_queues_and_times_out_at_the_first_check() {
    let bulkhead = plain(1, 1);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut zero = Box::pin(bulkhead.acquire(&req(), within(Duration::ZERO)));
    let refused = rejection(ready(&mut zero));
    // `timeout`, not `concurrency_limit`: it did join the queue, then gave up at once.
    assert_eq!(refused.reason(), RejectReason::Timeout);
    assert_eq!(refused.detail().pending, 0);
    assert_eq!(bulkhead.stats().pending, 0);
    assert_eq!(count(&bulkhead, RejectReason::Timeout), 1);
    assert_eq!(
        reason_of(bulkhead.acquire_blocking(&req(), within(Duration::ZERO))),
        RejectReason::Timeout
    );

    // The queue is judged first: a full queue says queue_limit, no queue concurrency_limit.
    let _w = queued(&bulkhead, opts());
    let mut zero = Box::pin(bulkhead.acquire(&req(), within(Duration::ZERO)));
    assert_eq!(reason_of(ready(&mut zero)), RejectReason::QueueLimit);
    let no_queue = plain(1, 0);
    let _h = no_queue.try_acquire(&req(), opts()).expect("free slot");
    let mut zero = Box::pin(no_queue.acquire(&req(), within(Duration::ZERO)));
    assert_eq!(reason_of(ready(&mut zero)), RejectReason::ConcurrencyLimit);

    assert_eq!(count(&bulkhead, RejectReason::Timeout), 2);
    assert_eq!(count(&bulkhead, RejectReason::QueueLimit), 1);
    drop(held);
}

/// Times out in the queue twice (bulkhead default, then per call), drains with a deadline and
/// then for real; used on every executor.
async fn time_out_in_the_queue() {
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Custom {
            max_queue: 4,
            timeout: Some(SHORT),
        })
        .build()
        .expect("valid configuration");
    let held = bulkhead
        .try_acquire_owned(&req(), opts())
        .expect("free slot");
    let started = Instant::now();
    let refused = rejection(bulkhead.acquire(&req(), opts()).await);
    assert_eq!(refused.reason(), RejectReason::Timeout);
    let waited = started.elapsed();
    assert!(waited >= SHORT && waited < PATIENCE, "waited {waited:?}");
    let refused = rejection(
        bulkhead
            .acquire_owned(&req(), within(Duration::from_millis(5)))
            .await,
    );
    assert_eq!(refused.reason(), RejectReason::Timeout);
    let report = bulkhead.drain_timeout(Duration::from_millis(5)).await;
    assert_eq!(
        report,
        DrainReport {
            drained: false,
            in_flight: 1,
            pending: 0
        }
    );
    drop(held);
    bulkhead.drain().await;
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.pending, stats.admitted), (0, 0, 1));
    assert_eq!(stats.rejected_by_reason.timeout, 2);
    assert_eq!(stats.rejected, 2);
}

#[test]
fn timeouts_fire_on_tokio_current_thread() {
    // No `enable_time()`: the crate must not need tokio's timer.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    rt.block_on(time_out_in_the_queue());
}

#[test]
fn timeouts_fire_on_tokio_multi_thread() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .expect("runtime");
    rt.block_on(async { tokio::spawn(time_out_in_the_queue()).await })
        .expect("the task did not panic");
}

#[test]
fn timeouts_fire_on_smol() {
    smol::block_on(time_out_in_the_queue());
}

#[test]
fn timeouts_fire_on_async_std() {
    async_std::task::block_on(time_out_in_the_queue());
}

#[test]
fn timeouts_fire_on_futures_executor() {
    block_on(time_out_in_the_queue());
}

// ===== cancellation =====

#[test]
fn dropping_queued_futures_removes_them_and_later_waiters_move_up() {
    let bulkhead = plain(1, 8);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let a = queued(&bulkhead, opts());
    let b = queued(&bulkhead, opts());
    let mut c = queued(&bulkhead, opts());
    let mut d = queued(&bulkhead, opts());
    assert_eq!(bulkhead.stats().pending, 4);

    drop(b); // from the middle
    assert_eq!(bulkhead.stats().pending, 3);
    assert_eq!(count(&bulkhead, RejectReason::Aborted), 1);
    drop(a); // the head
    assert_eq!(bulkhead.stats().pending, 2);
    assert_eq!(count(&bulkhead, RejectReason::Aborted), 2);

    drop(held);
    assert_pending(&mut d);
    let pc = ready(&mut c).expect("C moved up to the head");
    drop(pc);
    let pd = ready(&mut d).expect("then D");
    drop(pd);
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.pending,
            stats.admitted,
            stats.released
        ),
        (0, 0, 3, 3)
    );
    assert_eq!((stats.rejected, stats.rejected_by_reason.aborted), (2, 2));
}

#[test]
fn dropping_a_future_handed_a_slot_returns_slot_and_tokens_to_the_next_waiter() {
    let bulkhead = budgeted(1, 4, 1000);
    let held = bulkhead.try_acquire(&req(), toks(300)).expect("free slot");
    let a = queued(&bulkhead, toks(200));
    let (waker_b, woken_b) = counting_waker();
    let mut b = Box::pin(bulkhead.acquire_owned(&req(), toks(100)));
    assert!(poll_with(&mut b, &waker_b).is_pending());
    drop(held);
    // A holds the slot and its 200 tokens but has not picked them up.
    assert_eq!(figures(&bulkhead), (1, 1, 1));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 200);
    assert_eq!(woken_b.get(), 0);

    drop(a);
    // Counted as aborted; the slot went on to B with B's tokens.
    assert_eq!(count(&bulkhead, RejectReason::Aborted), 1);
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 100);
    assert_eq!(woken_b.get(), 1, "B was woken by the hand-off");
    let pb = ready(&mut b).expect("B got the slot");
    assert_eq!(pb.held_tokens(), 100);
    drop(pb);

    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.pending,
            stats.admitted,
            stats.released
        ),
        (0, 0, 2, 2)
    );
    let t = tokens(&bulkhead);
    assert_eq!((t.in_flight_tokens, t.total_reserved), (0, 400));
    assert_eq!(stats.rejected, 1);
}

#[test]
fn dropping_the_last_handed_future_frees_the_slot() {
    let bulkhead = budgeted(1, 4, 1000);
    let held = bulkhead.try_acquire(&req(), toks(300)).expect("free slot");
    let a = queued(&bulkhead, toks(200));
    drop(held);
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    drop(a);
    assert_eq!(figures(&bulkhead), (0, 0, 1));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 0);
    assert_eq!(count(&bulkhead, RejectReason::Aborted), 1);
    let again = bulkhead
        .try_acquire(&req(), toks(1000))
        .expect("all capacity is back");
    drop(again);
    assert_eq!(bulkhead.stats().released, 2);
}

#[test]
fn dropping_a_completed_future_counts_nothing() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut a = queued(&bulkhead, opts());
    drop(held);
    let permit = ready(&mut a).expect("handed the slot");
    drop(a);
    assert_eq!(figures(&bulkhead), (1, 0, 2));
    drop(permit);
    assert_eq!(bulkhead.stats().rejected, 0);
    assert_eq!(figures(&bulkhead), (0, 0, 2));
}

// ===== close =====

#[test]
fn close_refuses_every_waiter_with_shutdown_at_once() {
    let bulkhead = plain(1, 8);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let wakers: Vec<(Waker, Arc<WakeCount>)> = (0..3).map(|_| counting_waker()).collect();
    let mut waiters: Vec<Pin<Box<Acquire<'_>>>> = wakers
        .iter()
        .map(|(waker, _)| {
            let mut fut = Box::pin(bulkhead.acquire(&req(), within(PATIENCE)));
            assert!(poll_with(&mut fut, waker).is_pending());
            fut
        })
        .collect();
    let unpolled_later = queued(&bulkhead, opts());

    assert!(bulkhead.close());
    // Refused and counted at once, before any future runs again; every waiter was woken.
    let stats = bulkhead.stats();
    assert_eq!((stats.pending, stats.in_flight, stats.closed), (0, 1, true));
    assert_eq!(stats.rejected_by_reason.shutdown, 4);
    assert!(wakers.iter().all(|(_, c)| c.get() == 1));
    for waiter in &mut waiters {
        let refused = rejection(ready(waiter));
        assert_eq!(refused.reason(), RejectReason::Shutdown);
    }
    // Dropping a refused future that never looked at its refusal counts nothing more.
    drop(unpolled_later);
    assert_eq!(count(&bulkhead, RejectReason::Aborted), 0);

    // Nothing is admitted afterwards; the permit in flight releases normally.
    let mut late = Box::pin(bulkhead.acquire(&req(), opts()));
    assert_eq!(reason_of(ready(&mut late)), RejectReason::Shutdown);
    drop(held);
    assert_eq!(figures(&bulkhead), (0, 0, 1));
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts())),
        RejectReason::Shutdown
    );
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.released,
            stats.rejected,
            stats.rejected_by_reason.shutdown
        ),
        (1, 6, 6)
    );
}

#[test]
fn close_keeps_a_slot_already_handed_over() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut a = queued(&bulkhead, opts());
    let mut b = queued(&bulkhead, opts());
    drop(held);
    assert!(bulkhead.close());
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    assert_eq!(reason_of(ready(&mut b)), RejectReason::Shutdown);
    let pa = ready(&mut a).expect("A was handed the slot before the close");
    drop(pa);
    assert_eq!(figures(&bulkhead), (0, 0, 2));
    assert_eq!(bulkhead.stats().rejected, 1);
}

#[test]
fn close_wakes_a_waiter_awaited_on_another_thread() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let worker = {
        let bulkhead = bulkhead.clone();
        thread::spawn(move || reason_of(block_on(bulkhead.acquire_owned(&req(), opts()))))
    };
    wait_until("the worker is queued", || bulkhead.stats().pending == 1);
    bulkhead.close();
    assert_eq!(
        worker.join().expect("worker did not panic"),
        RejectReason::Shutdown
    );
    drop(held);
    assert_eq!(figures(&bulkhead), (0, 0, 1));
}

#[test]
fn a_release_wakes_a_waiter_awaited_on_another_thread() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let worker = {
        let bulkhead = bulkhead.clone();
        thread::spawn(move || {
            let permit = block_on(bulkhead.acquire_owned(&req(), opts())).expect("handed the slot");
            permit.limit_revision()
        })
    };
    wait_until("the worker is queued", || bulkhead.stats().pending == 1);
    drop(held);
    assert_eq!(worker.join().expect("worker did not panic"), 0);
    assert_eq!(figures(&bulkhead), (0, 0, 2));
}

// ===== apply_limits while calls wait =====

#[test]
fn lowering_max_concurrent_keeps_waiters_until_capacity_frees_under_the_new_limit() {
    let bulkhead = plain(2, 4);
    let p1 = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let p2 = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut a = queued(&bulkhead, opts());
    let mut b = queued(&bulkhead, opts());
    bulkhead
        .apply_limits(Limits::new(1, 1).with_max_queue(4))
        .expect("valid limits");
    assert_eq!(figures(&bulkhead), (2, 2, 2));
    drop(p1);
    // 1 in flight under a limit of 1: nothing frees for the queue.
    assert_eq!(figures(&bulkhead), (1, 2, 2));
    assert_pending(&mut a);
    // Newcomers still queue (the queue has room under the new limits).
    let mut c = queued(&bulkhead, opts());
    assert_eq!(bulkhead.stats().pending, 3);
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts())),
        RejectReason::ConcurrencyLimit
    );
    drop(p2);
    assert_eq!(figures(&bulkhead), (1, 2, 2));
    let pa = ready(&mut a).expect("A first");
    assert_eq!(pa.limit_revision(), 1);
    assert_pending(&mut b);
    drop(pa);
    drop(ready(&mut b).expect("then B"));
    drop(ready(&mut c).expect("then C"));
    assert_eq!(figures(&bulkhead), (0, 0, 5));
}

#[test]
fn lowering_max_queue_keeps_accepted_waiters_and_refuses_newcomers() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut waiters: Vec<_> = (0..3).map(|_| queued(&bulkhead, opts())).collect();
    bulkhead
        .apply_limits(Limits::new(1, 1).with_max_queue(1))
        .expect("valid limits");
    assert_eq!(bulkhead.stats().pending, 3);
    let mut late = Box::pin(bulkhead.acquire(&req(), opts()));
    let refused = rejection(ready(&mut late));
    assert_eq!(refused.reason(), RejectReason::QueueLimit);
    assert_eq!(
        (refused.detail().pending, refused.detail().max_queue),
        (3, 1)
    );
    assert_eq!(refused.limit_revision(), 1);

    bulkhead
        .apply_limits(Limits::new(2, 1).with_max_queue(0))
        .expect("valid limits");
    let mut late = Box::pin(bulkhead.acquire(&req(), opts()));
    assert_eq!(reason_of(ready(&mut late)), RejectReason::ConcurrencyLimit);
    assert_eq!(bulkhead.stats().pending, 3);

    // The kept waiters are served in order as capacity frees.
    let mut permit = held;
    for i in 0..3 {
        drop(permit);
        for later in &mut waiters[i + 1..] {
            assert_pending(later);
        }
        permit = ready(&mut waiters[i]).expect("kept waiter served in order");
        assert_eq!(permit.limit_revision(), 2);
    }
    drop(permit);
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.pending, stats.admitted), (0, 0, 4));
    assert_eq!(
        (
            stats.rejected_by_reason.queue_limit,
            stats.rejected_by_reason.concurrency_limit
        ),
        (1, 1)
    );
}

#[test]
fn zero_max_concurrent_keeps_a_waiter_until_the_limit_is_raised() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let (waker, woken) = counting_waker();
    let mut a = Box::pin(bulkhead.acquire(&req(), opts()));
    assert!(poll_with(&mut a, &waker).is_pending());
    bulkhead
        .apply_limits(Limits::new(1, 0).with_max_queue(4))
        .expect("valid limits");
    drop(held);
    assert_eq!(figures(&bulkhead), (0, 1, 1));
    assert_eq!(woken.get(), 0);
    assert!(poll_with(&mut a, &waker).is_pending());
    let mut late = Box::pin(bulkhead.acquire(&req(), opts()));
    assert_eq!(reason_of(ready(&mut late)), RejectReason::ConcurrencyLimit);

    bulkhead
        .apply_limits(Limits::new(2, 1).with_max_queue(4))
        .expect("valid limits");
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    assert_eq!(woken.get(), 1);
    let pa = ready(&mut a).expect("granted by the raise");
    assert_eq!(pa.limit_revision(), 2);
    drop(pa);
    assert_eq!(figures(&bulkhead), (0, 0, 2));
}

// ===== drain =====

#[test]
fn drain_resolves_at_once_when_idle() {
    let bulkhead = plain(1, 4);
    let mut drain = Box::pin(bulkhead.drain());
    assert!(poll_now(&mut drain).is_ready());
    let mut report = Box::pin(bulkhead.drain_timeout(Duration::ZERO));
    assert_eq!(
        ready(&mut report),
        DrainReport {
            drained: true,
            in_flight: 0,
            pending: 0
        }
    );
    assert_eq!(
        block_on(bulkhead.drain_timeout(PATIENCE)),
        DrainReport {
            drained: true,
            in_flight: 0,
            pending: 0
        }
    );

    // Busy: a zero timeout answers "not idle" at once.
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let _w = queued(&bulkhead, opts());
    let mut report = Box::pin(bulkhead.drain_timeout(Duration::ZERO));
    assert_eq!(
        ready(&mut report),
        DrainReport {
            drained: false,
            in_flight: 1,
            pending: 1
        }
    );
    drop(held);
}

#[test]
fn drain_resolves_after_the_last_release() {
    let bulkhead = plain(2, 4);
    let p1 = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let p2 = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut a = queued(&bulkhead, opts());
    let (waker, woken) = counting_waker();
    let mut drain = Box::pin(bulkhead.drain());
    assert!(poll_with(&mut drain, &waker).is_pending());

    drop(p1); // hands the slot to A: still busy
    assert!(poll_with(&mut drain, &waker).is_pending());
    let pa = ready(&mut a).expect("handed the slot");
    drop(p2);
    assert!(poll_with(&mut drain, &waker).is_pending());
    assert_eq!(woken.get(), 0);
    drop(pa);
    assert!(woken.get() > 0, "the last release woke the drain");
    assert!(poll_with(&mut drain, &waker).is_ready());
    assert_eq!(figures(&bulkhead), (0, 0, 3));
}

#[test]
fn drain_resolves_when_the_last_waiter_times_out_with_nothing_in_flight() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut a = queued(&bulkhead, within(SHORT));
    bulkhead
        .apply_limits(Limits::new(1, 0).with_max_queue(4))
        .expect("valid limits");
    drop(held);
    assert_eq!(
        figures(&bulkhead),
        (0, 1, 1),
        "A is preserved, nothing in flight"
    );
    let (waker, woken) = counting_waker();
    let mut drain = Box::pin(bulkhead.drain());
    assert!(poll_with(&mut drain, &waker).is_pending());

    assert_eq!(reason_of(block_on(&mut a)), RejectReason::Timeout);
    assert_eq!(figures(&bulkhead), (0, 0, 1));
    assert!(
        woken.get() > 0,
        "the timeout made it idle and woke the drain"
    );
    assert!(poll_with(&mut drain, &waker).is_ready());
}

#[test]
fn drain_resolves_when_the_last_waiter_is_cancelled_with_nothing_in_flight() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let a = queued(&bulkhead, opts());
    let b = queued(&bulkhead, opts());
    bulkhead
        .apply_limits(Limits::new(1, 0).with_max_queue(4))
        .expect("valid limits");
    drop(held);
    let (waker, woken) = counting_waker();
    let mut drain = Box::pin(bulkhead.drain());
    assert!(poll_with(&mut drain, &waker).is_pending());
    drop(a);
    assert!(poll_with(&mut drain, &waker).is_pending(), "B still waits");
    drop(b);
    assert!(
        woken.get() > 0,
        "the cancellation made it idle and woke the drain"
    );
    assert!(poll_with(&mut drain, &waker).is_ready());
    assert_eq!(count(&bulkhead, RejectReason::Aborted), 2);
}

#[test]
fn drain_resolves_when_close_refuses_the_last_waiters() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut a = queued(&bulkhead, opts());
    bulkhead
        .apply_limits(Limits::new(1, 0).with_max_queue(4))
        .expect("valid limits");
    drop(held);
    let (waker, woken) = counting_waker();
    let mut drain = Box::pin(bulkhead.drain());
    assert!(poll_with(&mut drain, &waker).is_pending());
    bulkhead.close();
    assert!(woken.get() > 0, "close made it idle and woke the drain");
    assert!(poll_with(&mut drain, &waker).is_ready());
    assert_eq!(reason_of(ready(&mut a)), RejectReason::Shutdown);
}

#[test]
fn drain_resolves_when_a_limit_change_refuses_the_last_waiter() {
    // Raising the slots gives the waiter its turn, but a smaller budget in the same snapshot
    // leaves its tokens no room: it is refused and the bulkhead becomes idle.
    let bulkhead = budgeted(1, 4, 1000);
    let held = bulkhead.try_acquire(&req(), toks(100)).expect("free slot");
    let mut a = queued(&bulkhead, toks(300));
    bulkhead
        .apply_limits(
            Limits::new(1, 0)
                .with_max_queue(4)
                .with_token_budget(1000, 0),
        )
        .expect("valid limits");
    drop(held);
    let (waker, woken) = counting_waker();
    let mut drain = Box::pin(bulkhead.drain());
    assert!(poll_with(&mut drain, &waker).is_pending());
    bulkhead
        .apply_limits(
            Limits::new(2, 1)
                .with_max_queue(4)
                .with_token_budget(200, 0),
        )
        .expect("valid limits");
    assert_eq!(figures(&bulkhead), (0, 0, 1));
    assert!(
        woken.get() > 0,
        "the refusal made it idle and woke the drain"
    );
    assert!(poll_with(&mut drain, &waker).is_ready());
    assert_eq!(reason_of(ready(&mut a)), RejectReason::BudgetLimit);
}

#[test]
fn drain_timeout_reports_what_is_left_and_cancels_nothing() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut a = queued(&bulkhead, opts());
    let mut b = queued(&bulkhead, opts());
    let started = Instant::now();
    let report = block_on(bulkhead.drain_timeout(SHORT));
    assert!(started.elapsed() >= SHORT);
    assert_eq!(
        report,
        DrainReport {
            drained: false,
            in_flight: 1,
            pending: 2
        }
    );
    // Nothing was cancelled or counted; the waiters still wait and are served normally.
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.pending,
            stats.admitted,
            stats.rejected
        ),
        (1, 2, 1, 0)
    );
    assert_pending(&mut a);
    drop(held);
    let pa = ready(&mut a).expect("A served");
    assert_eq!(
        block_on(bulkhead.drain_timeout(Duration::ZERO)),
        DrainReport {
            drained: false,
            in_flight: 1,
            pending: 1
        }
    );
    drop(pa);
    let pb = ready(&mut b).expect("B served");
    let mut bounded = Box::pin(bulkhead.drain_timeout(PATIENCE));
    assert_pending(&mut bounded);
    drop(pb);
    assert_eq!(
        ready(&mut bounded),
        DrainReport {
            drained: true,
            in_flight: 0,
            pending: 0
        }
    );
    assert_eq!(figures(&bulkhead), (0, 0, 3));
}

// ===== profiles =====

#[test]
fn the_default_profile_is_interactive_without_queue_or_timeout() {
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .build()
        .expect("valid configuration");
    assert_eq!(Profile::default(), Profile::Interactive);
    assert_eq!(bulkhead.limits().max_queue, 0);
    assert_eq!(bulkhead.queue_timeout(), None);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut fut = Box::pin(bulkhead.acquire(&req(), opts()));
    assert_eq!(reason_of(ready(&mut fut)), RejectReason::ConcurrencyLimit);
    assert_eq!(bulkhead.stats().pending, 0);
    drop(held);

    let explicit = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Interactive)
        .build()
        .expect("valid configuration");
    assert_eq!(
        (explicit.limits().max_queue, explicit.queue_timeout()),
        (0, None)
    );
}

#[test]
fn the_batch_profile_queues_twenty_for_thirty_seconds() {
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Batch)
        .build()
        .expect("valid configuration");
    assert_eq!(bulkhead.limits().max_queue, 20);
    assert_eq!(bulkhead.queue_timeout(), Some(Duration::from_secs(30)));
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let waiters: Vec<_> = (0..20).map(|_| queued(&bulkhead, opts())).collect();
    let mut extra = Box::pin(bulkhead.acquire(&req(), opts()));
    let refused = rejection(ready(&mut extra));
    assert_eq!(refused.reason(), RejectReason::QueueLimit);
    assert_eq!(
        (refused.detail().pending, refused.detail().max_queue),
        (20, 20)
    );
    drop(waiters);
    let stats = bulkhead.stats();
    assert_eq!((stats.pending, stats.rejected_by_reason.aborted), (0, 20));
    drop(held);
}

#[test]
fn a_custom_profile_sets_queue_and_timeout() {
    let custom = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Custom {
            max_queue: 3,
            timeout: Some(Duration::from_millis(250)),
        })
        .build()
        .expect("valid configuration");
    assert_eq!(custom.limits().max_queue, 3);
    assert_eq!(custom.queue_timeout(), Some(Duration::from_millis(250)));
    let held = custom.try_acquire(&req(), opts()).expect("free slot");
    let _w: Vec<_> = (0..3).map(|_| queued(&custom, opts())).collect();
    let mut extra = Box::pin(custom.acquire(&req(), opts()));
    assert_eq!(reason_of(ready(&mut extra)), RejectReason::QueueLimit);
    drop(held);

    let forever = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Custom {
            max_queue: 1,
            timeout: None,
        })
        .build()
        .expect("valid configuration");
    assert_eq!(
        (forever.limits().max_queue, forever.queue_timeout()),
        (1, None)
    );
}

#[test]
fn explicit_options_override_the_profile_whatever_the_order() {
    let timeout = Duration::from_millis(250);
    let before = LlmBulkhead::builder("test-model", 1)
        .max_queue(3)
        .queue_timeout(timeout)
        .profile(Profile::Batch)
        .build()
        .expect("valid configuration");
    let after = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Batch)
        .max_queue(3)
        .queue_timeout(timeout)
        .build()
        .expect("valid configuration");
    for bulkhead in [&before, &after] {
        assert_eq!(bulkhead.limits().max_queue, 3);
        assert_eq!(bulkhead.queue_timeout(), Some(timeout));
    }

    // One explicit option, the other from the profile.
    let mixed = LlmBulkhead::builder("test-model", 1)
        .max_queue(0)
        .profile(Profile::Batch)
        .build()
        .expect("valid configuration");
    assert_eq!(mixed.limits().max_queue, 0);
    assert_eq!(mixed.queue_timeout(), Some(Duration::from_secs(30)));
    let held = mixed.try_acquire(&req(), opts()).expect("free slot");
    let mut fut = Box::pin(mixed.acquire(&req(), opts()));
    assert_eq!(reason_of(ready(&mut fut)), RejectReason::ConcurrencyLimit);
    drop(held);

    let custom = LlmBulkhead::builder("test-model", 1)
        .queue_timeout(timeout)
        .profile(Profile::Custom {
            max_queue: 7,
            timeout: None,
        })
        .build()
        .expect("valid configuration");
    assert_eq!(
        (custom.limits().max_queue, custom.queue_timeout()),
        (7, Some(timeout))
    );

    // The last profile chosen wins over an earlier one.
    let replaced = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Batch)
        .profile(Profile::Interactive)
        .build()
        .expect("valid configuration");
    assert_eq!(
        (replaced.limits().max_queue, replaced.queue_timeout()),
        (0, None)
    );
}

// ===== run =====

#[test]
fn run_returns_the_value_and_settles() {
    let bulkhead = plain(1, 0);
    let value = block_on(bulkhead.run(&req(), opts(), async |_ctx| Ok::<_, io::Error>(42)))
        .expect("admitted and succeeded");
    assert_eq!(value, 42);
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.pending,
            stats.admitted,
            stats.released
        ),
        (0, 0, 1, 1)
    );
    assert_eq!(stats.rejected, 0);
}

#[test]
fn run_with_usage_books_consumed_and_refunded_exactly() {
    let bulkhead = budgeted(2, 0, 10_000);
    let options = AcquireOptions::new().reservation(Reservation::new(100, 1000).expect("fits"));
    let reply = block_on(bulkhead.run_with_usage(
        &req(),
        options,
        |reply: &(&str, TokenUsage)| Some(reply.1),
        async |_ctx| Ok::<_, io::Error>(("hi", usage(90, 10))),
    ))
    .expect("admitted and succeeded");
    assert_eq!(reply.0, "hi");
    let t = tokens(&bulkhead);
    assert_eq!(
        (
            t.in_flight_tokens,
            t.total_reserved,
            t.total_consumed,
            t.total_refunded
        ),
        (0, 1100, 100, 1000)
    );

    // Usage above the hold refunds nothing; an extractor answering None books nothing.
    block_on(bulkhead.run_with_usage(
        &req(),
        options,
        |u: &TokenUsage| Some(*u),
        async |_ctx| Ok::<_, io::Error>(usage(900, 300)),
    ))
    .expect("admitted and succeeded");
    block_on(bulkhead.run_with_usage(
        &req(),
        options,
        |_: &()| None,
        async |_ctx| Ok::<_, io::Error>(()),
    ))
    .expect("admitted and succeeded");
    let t = tokens(&bulkhead);
    assert_eq!(
        (
            t.in_flight_tokens,
            t.total_reserved,
            t.total_consumed,
            t.total_refunded
        ),
        (0, 3300, 1300, 1000)
    );
    assert_eq!(figures(&bulkhead), (0, 0, 3));
}

#[test]
fn a_failed_callback_is_failed_and_settles_without_usage() {
    let bulkhead = budgeted(1, 0, 10_000);
    let extracted = Cell::new(false);
    let err = block_on(bulkhead.run_with_usage(
        &req(),
        toks(500),
        |_: &()| {
            extracted.set(true);
            Some(usage(1, 1))
        },
        async |_ctx| Err::<(), _>(io::Error::other("provider down")),
    ))
    .expect_err("the callback failed");
    assert!(
        matches!(&err, RunError::Failed(e) if e.to_string() == "provider down"),
        "got {err:?}"
    );
    assert!(err.rejection().is_none());
    assert!(!extracted.get(), "no usage is extracted from a failure");
    let t = tokens(&bulkhead);
    assert_eq!(
        (
            t.in_flight_tokens,
            t.total_reserved,
            t.total_consumed,
            t.total_refunded
        ),
        (0, 500, 0, 0)
    );
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.admitted,
            stats.released,
            stats.rejected
        ),
        (0, 1, 1, 0)
    );
}

#[test]
fn a_rejected_run_never_calls_the_callback() {
    let called = Cell::new(false);
    let call = async |_ctx: async_bulkhead_llm::RunContext<'_>| {
        called.set(true);
        Ok::<_, io::Error>(())
    };

    let full = plain(1, 0);
    let held = full.try_acquire(&req(), opts()).expect("free slot");
    let err = block_on(full.run(&req(), opts(), call)).expect_err("no slot");
    match &err {
        RunError::Rejected(r) => assert_eq!(r.reason(), RejectReason::ConcurrencyLimit),
        other => panic!("expected a rejection, got {other:?}"),
    }
    assert_eq!(
        err.rejection().map(Rejection::reason),
        Some(RejectReason::ConcurrencyLimit)
    );
    drop(held);

    let small = budgeted(1, 4, 100);
    let err = block_on(small.run(&req(), toks(500), call)).expect_err("too many tokens");
    assert_eq!(
        err.rejection().map(Rejection::reason),
        Some(RejectReason::BudgetLimit)
    );
    assert_eq!(small.stats().pending, 0);

    let closed = plain(1, 4);
    closed.close();
    let err = block_on(closed.run(&req(), opts(), call)).expect_err("closed");
    assert_eq!(
        err.rejection().map(Rejection::reason),
        Some(RejectReason::Shutdown)
    );

    assert!(!called.get(), "the callback never ran");
    assert_eq!(full.stats().admitted, 1);
    assert_eq!((small.stats().admitted, closed.stats().admitted), (0, 0));
}

#[test]
fn the_run_context_describes_the_admission() {
    let bulkhead = LlmBulkhead::builder("test-model", 2)
        .initial_revision(3)
        .token_budget(TokenBudget::new(10_000))
        .build()
        .expect("valid configuration");
    bulkhead
        .apply_limits(Limits::new(5, 2).with_token_budget(10_000, 0))
        .expect("valid limits");
    let reservation = Reservation::new(100, 1000).expect("fits");
    let options = AcquireOptions::new()
        .reservation(reservation)
        .priority(Priority::High);
    let run = async || {
        bulkhead
            .run(&req(), options, async |ctx| {
                Ok::<_, io::Error>((
                    ctx.admission_id(),
                    ctx.limit_revision(),
                    ctx.reservation(),
                    ctx.priority(),
                ))
            })
            .await
            .expect("admitted")
    };
    let (id1, revision, seen, priority) = block_on(run());
    assert_eq!(revision, 5);
    assert_eq!(seen, Some(reservation));
    assert_eq!(priority, Priority::High);
    let (id2, ..) = block_on(run());
    assert_ne!(id1, id2, "every admission has its own id");

    let unbudgeted = plain(1, 0);
    let (reservation, priority) = block_on(unbudgeted.run(&req(), opts(), async |ctx| {
        Ok::<_, io::Error>((ctx.reservation(), ctx.priority()))
    }))
    .expect("admitted");
    assert_eq!((reservation, priority), (None, Priority::Normal));
}

#[test]
fn dropping_a_run_future_while_the_callback_runs_settles_at_once() {
    let bulkhead = budgeted(1, 4, 1000);
    let callback_dropped = Cell::new(false);
    let mut running = Box::pin(bulkhead.run(&req(), toks(300), async |_ctx| {
        let _guard = SetOnDrop(&callback_dropped);
        std::future::pending::<Result<(), io::Error>>().await
    }));
    assert_pending(&mut running);
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 300);
    let mut next = queued(&bulkhead, toks(200));

    drop(running);
    assert!(callback_dropped.get(), "the callback's future was dropped");
    // Settled at once: the slot and the next waiter's tokens went to the waiter.
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 200);
    let permit = ready(&mut next).expect("the next waiter got the slot");
    drop(permit);
    let t = tokens(&bulkhead);
    assert_eq!(
        (t.in_flight_tokens, t.total_consumed, t.total_refunded),
        (0, 0, 0)
    );
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.admitted,
            stats.released,
            stats.rejected
        ),
        (0, 2, 2, 0)
    );
}

#[test]
fn run_waits_in_the_queue_like_acquire() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let called = Cell::new(false);
    let mut waiting = Box::pin(bulkhead.run(&req(), opts(), async |ctx| {
        called.set(true);
        Ok::<_, io::Error>(ctx.limit_revision())
    }));
    assert_pending(&mut waiting);
    assert_eq!(figures(&bulkhead), (1, 1, 1));
    assert!(!called.get());
    bulkhead
        .apply_limits(Limits::new(6, 2).with_max_queue(4))
        .expect("valid limits");
    assert_eq!(figures(&bulkhead), (2, 0, 1));
    let revision = ready(&mut waiting).expect("handed a slot by the raise");
    assert_eq!(revision, 6);
    assert!(called.get());
    assert_eq!(figures(&bulkhead), (1, 0, 2));

    // A queued run times out, and a dropped queued run counts as aborted.
    let second = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut timed =
        Box::pin(bulkhead.run(&req(), within(SHORT), async |_ctx| Ok::<_, io::Error>(())));
    let err = block_on(&mut timed).expect_err("timed out in the queue");
    assert_eq!(
        err.rejection().map(Rejection::reason),
        Some(RejectReason::Timeout)
    );
    let mut dropped = Box::pin(bulkhead.run(&req(), opts(), async |_ctx| Ok::<_, io::Error>(())));
    assert_pending(&mut dropped);
    assert_eq!(bulkhead.stats().pending, 1);
    drop(dropped);
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.pending,
            stats.rejected_by_reason.timeout,
            stats.rejected_by_reason.aborted
        ),
        (0, 1, 1)
    );
    drop((held, second));
    assert_eq!(figures(&bulkhead), (0, 0, 3));
}

// ===== blocking acquires =====

#[test]
fn blocking_acquires_from_threads_are_served_one_at_a_time_in_fifo_order() {
    const THREADS: usize = 6;
    let bulkhead = plain(1, 8);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let active = AtomicUsize::new(0);
    let most = AtomicUsize::new(0);
    let order = Mutex::new(Vec::new());
    thread::scope(|s| {
        let mut workers = Vec::new();
        for i in 0..THREADS {
            let (bulkhead, active, most, order) = (&bulkhead, &active, &most, &order);
            let critical = move || {
                let now = active.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                order.lock().expect("not poisoned").push(i);
                thread::sleep(Duration::from_millis(1));
                active.fetch_sub(1, Ordering::SeqCst);
            };
            workers.push(s.spawn(move || {
                if i % 2 == 0 {
                    let permit = bulkhead
                        .acquire_blocking(&req(), opts())
                        .expect("served in turn");
                    critical();
                    drop(permit);
                } else {
                    let permit = bulkhead
                        .acquire_blocking_owned(&req(), opts())
                        .expect("served in turn");
                    critical();
                    drop(permit);
                }
            }));
            // Queue the threads one after another, so their order is known.
            wait_until("the thread is queued", || {
                bulkhead.stats().pending == i as u64 + 1
            });
        }
        assert_eq!(figures(&bulkhead), (1, THREADS as u64, 1));
        drop(held);
        for worker in workers {
            worker.join().expect("worker did not panic");
        }
    });
    assert_eq!(
        *order.lock().expect("not poisoned"),
        (0..THREADS).collect::<Vec<_>>()
    );
    assert_eq!(most.load(Ordering::SeqCst), 1, "one at a time");
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.pending,
            stats.admitted,
            stats.released
        ),
        (0, 0, THREADS as u64 + 1, THREADS as u64 + 1)
    );
    assert_eq!(stats.rejected, 0);
}

#[test]
fn a_blocking_acquire_with_a_short_timeout_returns_timeout() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let started = Instant::now();
    let refused = rejection(bulkhead.acquire_blocking(&req(), within(SHORT)));
    assert_eq!(refused.reason(), RejectReason::Timeout);
    let waited = started.elapsed();
    assert!(waited >= SHORT && waited < PATIENCE, "waited {waited:?}");
    assert_eq!(
        reason_of(bulkhead.acquire_blocking_owned(&req(), within(SHORT))),
        RejectReason::Timeout
    );
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.pending,
            stats.in_flight,
            stats.rejected_by_reason.timeout
        ),
        (0, 1, 2)
    );
    // Without a queue, a blocking acquire refuses at once.
    let no_queue = plain(1, 0);
    let _h = no_queue.try_acquire(&req(), opts()).expect("free slot");
    assert_eq!(
        reason_of(no_queue.acquire_blocking(&req(), opts())),
        RejectReason::ConcurrencyLimit
    );
    drop(held);
    // With a free slot it returns at once.
    let permit = bulkhead
        .acquire_blocking(&req(), within(Duration::ZERO))
        .expect("free slot");
    drop(permit);
}

#[test]
fn close_wakes_blocked_waiters_with_shutdown() {
    const THREADS: u64 = 3;
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let workers: Vec<_> = (0..THREADS)
        .map(|i| {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                if i % 2 == 0 {
                    reason_of(bulkhead.acquire_blocking_owned(&req(), opts()))
                } else {
                    reason_of(bulkhead.acquire_blocking(&req(), opts()))
                }
            })
        })
        .collect();
    wait_until("every thread is queued", || {
        bulkhead.stats().pending == THREADS
    });
    assert!(bulkhead.close());
    for worker in workers {
        assert_eq!(
            worker.join().expect("worker did not panic"),
            RejectReason::Shutdown
        );
    }
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.pending,
            stats.in_flight,
            stats.rejected_by_reason.shutdown
        ),
        (0, 1, THREADS)
    );
    drop(held);
    assert_eq!(figures(&bulkhead), (0, 0, 1));
}

// ===== Send and 'static =====

fn assert_send_static<T: Send + 'static>(_: &T) {}

#[test]
fn the_owned_acquire_future_can_be_spawned_on_tokio_multi_thread() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .expect("runtime");
    let bulkhead = plain(1, 4);
    let held = bulkhead
        .try_acquire_owned(&req(), opts())
        .expect("free slot");
    let fut: AcquireOwned = bulkhead.acquire_owned(&req(), opts());
    assert_send_static(&fut);
    let task = rt.spawn(async move {
        let permit = fut.await.expect("handed the slot");
        permit.limit_revision()
    });
    wait_until("the spawned acquire is queued", || {
        bulkhead.stats().pending == 1
    });
    drop(held);
    assert_eq!(rt.block_on(task).expect("task did not panic"), 0);
    assert_eq!(figures(&bulkhead), (0, 0, 2));

    // Spawned directly, with a timeout.
    let held = bulkhead
        .try_acquire_owned(&req(), opts())
        .expect("free slot");
    let task = rt.spawn(bulkhead.acquire_owned(&req(), within(SHORT)));
    let result = rt.block_on(task).expect("task did not panic");
    assert_eq!(reason_of(result), RejectReason::Timeout);
    drop(held);
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.pending,
            stats.admitted,
            stats.rejected
        ),
        (0, 0, 3, 1)
    );
}
