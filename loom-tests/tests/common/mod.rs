//! Helpers shared by the model files (`limits.rs`, `arrival.rs`, `blocking.rs`, `dedup.rs`,
//! `drain.rs`, `events.rs`, `queue.rs`, `classes.rs`): wakers that remember being woken, hand polling, and
//! the end-of-model checks.
//!
//! Each model file uses only some of them.
#![allow(dead_code)]

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc as StdArc;
use std::task::{Context, Poll, Wake, Waker};

use async_bulkhead_llm::futures::AcquireOwned;
use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, OwnedPermit, RejectReason, Reservation,
};
use loom::sync::atomic::AtomicBool;
use loom::sync::atomic::Ordering::{AcqRel, Acquire};

/// A waker that remembers being woken. The flag is a loom atomic, so the model sees it: a
/// wake-up that never happens fails the final check instead of hanging the model.
pub struct Flag(AtomicBool);

impl Flag {
    pub fn woken(&self) -> bool {
        self.0.load(Acquire)
    }
}

impl Wake for Flag {
    fn wake(self: StdArc<Self>) {
        self.0.store(true, AcqRel);
    }
}

pub fn flag() -> (StdArc<Flag>, Waker) {
    let flag = StdArc::new(Flag(AtomicBool::new(false)));
    (flag.clone(), Waker::from(flag))
}

/// A waker that sets `flag`.
pub fn waker(flag: &StdArc<Flag>) -> Waker {
    Waker::from(flag.clone())
}

pub fn poll<F: Future + Unpin>(future: &mut F, waker: &Waker) -> Poll<F::Output> {
    Pin::new(future).poll(&mut Context::from_waker(waker))
}

pub fn tokens(input: u64, max_output: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(input, max_output).unwrap())
}

pub fn reason(result: Result<OwnedPermit, AcquireError>) -> Result<OwnedPermit, RejectReason> {
    result.map_err(|e| {
        e.rejection()
            .expect("capacity refusal, not invalid input")
            .reason()
    })
}

/// An acquire that has been polled once with a recording waker and is waiting in the queue.
pub struct Queued {
    pub future: AcquireOwned,
    pub flag: StdArc<Flag>,
}

/// Starts an acquire and checks that it joined the queue.
pub fn queued(bulkhead: &LlmBulkhead, options: AcquireOptions) -> Queued {
    let mut future = bulkhead.acquire_owned(&LlmRequest::new(), options);
    let (flag, waker) = flag();
    assert!(poll(&mut future, &waker).is_pending(), "joins the queue");
    Queued { future, flag }
}

/// The outcome of an acquire that was polled (at least) once with a recording waker, after
/// every thread that could decide it has been joined.
///
/// `first` is what its first poll returned. If it was pending, someone must have woken it (a
/// lost wake-up fails here) and one more poll must finish it (a waiter stranded in the queue
/// fails here).
pub fn settle(
    mut future: AcquireOwned,
    first: Poll<Result<OwnedPermit, AcquireError>>,
    flag: &Flag,
) -> Result<OwnedPermit, RejectReason> {
    match first {
        Poll::Ready(result) => reason(result),
        Poll::Pending => {
            assert!(
                flag.woken(),
                "a waiter whose fate was decided was never woken"
            );
            match poll(&mut future, Waker::noop()) {
                Poll::Ready(result) => reason(result),
                Poll::Pending => panic!("a waiter was left in the queue"),
            }
        }
    }
}

/// Polls `future` once with a fresh recording waker.
pub fn first_poll(
    future: &mut AcquireOwned,
) -> (Poll<Result<OwnedPermit, AcquireError>>, StdArc<Flag>) {
    let (flag, waker) = flag();
    (poll(future, &waker), flag)
}

/// Runs `bulkhead.drain()` to completion on the calling (loom) thread: one poll with a
/// recording waker, then, if pending, wait for the wake-up and poll again, which must finish.
/// After a lost notification the wait never ends, and loom fails the model when it exceeds its
/// branch limit.
pub fn drain_to_completion(bulkhead: &LlmBulkhead) {
    let (woken, waker) = flag();
    let mut drain = Box::pin(bulkhead.drain());
    if drain
        .as_mut()
        .poll(&mut Context::from_waker(&waker))
        .is_ready()
    {
        return;
    }
    while !woken.woken() {
        loom::thread::yield_now();
    }
    assert!(
        drain
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_ready(),
        "a woken drain found no idle moment"
    );
}

/// Nothing in flight, nothing queued, every token back, every admission settled.
pub fn assert_idle(bulkhead: &LlmBulkhead) {
    let stats = bulkhead.stats();
    assert_eq!(
        (stats.in_flight, stats.pending),
        (0, 0),
        "slots and places returned exactly"
    );
    if let Some(tokens) = stats.token_budget {
        assert_eq!(tokens.in_flight_tokens, 0, "tokens returned exactly");
    }
    assert_eq!(stats.admitted, stats.released);
}
