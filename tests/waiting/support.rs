//! Helpers shared by the waiting tests.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};
use std::{fmt, thread};

use async_bulkhead_llm::futures::Acquire;
use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, Rejection, Reservation,
    TokenBudget, TokenUsage, stats::TokenBudgetStats,
};

/// An empty request for futures that outlive the statement that made them (an acquire
/// borrows its request until its first poll).
static EMPTY_REQUEST: std::sync::LazyLock<async_bulkhead_llm::LlmRequest> =
    std::sync::LazyLock::new(async_bulkhead_llm::LlmRequest::new);

/// A queue timeout long enough to be sure the waiter queued first, short enough for fast tests.
pub(crate) const SHORT: Duration = Duration::from_millis(20);
/// How long to wait for another thread before declaring a hang.
pub(crate) const PATIENCE: Duration = Duration::from_secs(10);

pub(crate) fn req() -> LlmRequest {
    LlmRequest::new()
}

pub(crate) fn opts() -> AcquireOptions {
    AcquireOptions::new()
}

/// Options reserving exactly `tokens` tokens (ignored by a bulkhead without a budget).
pub(crate) fn toks(tokens: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(0, tokens).expect("fits in u64"))
}

/// Options with a per-call queue timeout.
pub(crate) fn within(timeout: Duration) -> AcquireOptions {
    AcquireOptions::new().timeout(timeout)
}

pub(crate) fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).expect("fits in u64")
}

/// A bulkhead without a token budget.
pub(crate) fn plain(max_concurrent: usize, max_queue: usize) -> LlmBulkhead {
    LlmBulkhead::builder("test-model", max_concurrent)
        .max_queue(max_queue)
        .build()
        .expect("valid configuration")
}

/// A bulkhead with a token budget (no high-priority reserve).
pub(crate) fn budgeted(max_concurrent: usize, max_queue: usize, budget: u64) -> LlmBulkhead {
    LlmBulkhead::builder("test-model", max_concurrent)
        .max_queue(max_queue)
        .token_budget(TokenBudget::new(budget))
        .build()
        .expect("valid configuration")
}

pub(crate) fn tokens(bulkhead: &LlmBulkhead) -> TokenBudgetStats {
    bulkhead.stats().token_budget.expect("has a token budget")
}

/// `(in_flight, pending, admitted)`.
pub(crate) fn figures(bulkhead: &LlmBulkhead) -> (u64, u64, u64) {
    let s = bulkhead.stats();
    (s.in_flight, s.pending, s.admitted)
}

/// Refusals counted for `reason`.
pub(crate) fn count(bulkhead: &LlmBulkhead, reason: RejectReason) -> u64 {
    bulkhead.stats().rejected_by_reason.get(reason)
}

pub(crate) fn poll_with<F: Future>(fut: &mut Pin<Box<F>>, waker: &Waker) -> Poll<F::Output> {
    fut.as_mut().poll(&mut Context::from_waker(waker))
}

pub(crate) fn poll_now<F: Future>(fut: &mut Pin<Box<F>>) -> Poll<F::Output> {
    poll_with(fut, Waker::noop())
}

#[track_caller]
pub(crate) fn ready<F: Future>(fut: &mut Pin<Box<F>>) -> F::Output {
    match poll_now(fut) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("expected the future to be ready"),
    }
}

#[track_caller]
pub(crate) fn assert_pending<F: Future>(fut: &mut Pin<Box<F>>)
where
    F::Output: fmt::Debug,
{
    if let Poll::Ready(out) = poll_now(fut) {
        panic!("expected the future to be pending, got {out:?}");
    }
}

/// Starts an acquire and polls it once: it must have joined the queue.
#[track_caller]
pub(crate) fn queued<'a>(
    bulkhead: &'a LlmBulkhead,
    options: AcquireOptions,
) -> Pin<Box<Acquire<'a, 'static>>> {
    let mut fut = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, options));
    assert_pending(&mut fut);
    fut
}

/// The rejection of a refused acquire; panics on success or on invalid input.
#[track_caller]
pub(crate) fn rejection<T: fmt::Debug>(result: Result<T, AcquireError>) -> Rejection {
    match result {
        Err(AcquireError::Rejected(rejection)) => rejection,
        other => panic!("expected a capacity rejection, got {other:?}"),
    }
}

#[track_caller]
pub(crate) fn reason_of<T: fmt::Debug>(result: Result<T, AcquireError>) -> RejectReason {
    rejection(result).reason()
}

/// A waker that counts its wake-ups.
pub(crate) struct WakeCount(AtomicUsize);

impl WakeCount {
    pub(crate) fn get(&self) -> usize {
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

pub(crate) fn counting_waker() -> (Waker, Arc<WakeCount>) {
    let count = Arc::new(WakeCount(AtomicUsize::new(0)));
    (Waker::from(Arc::clone(&count)), count)
}

/// Waits (bounded) until `cond` holds, for conditions set by other threads.
#[track_caller]
pub(crate) fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < deadline, "gave up waiting until {what}");
        thread::sleep(Duration::from_millis(1));
    }
}

/// Sets its flag when dropped.
pub(crate) struct SetOnDrop<'a>(pub(crate) &'a Cell<bool>);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.set(true);
    }
}

/// A drain report's `(drained, in_flight, pending)`, to compare (`DrainReport` is
/// `#[non_exhaustive]`).
pub(crate) fn parts(report: async_bulkhead_llm::futures::DrainReport) -> (bool, u64, u64) {
    (report.drained, report.in_flight, report.pending)
}
