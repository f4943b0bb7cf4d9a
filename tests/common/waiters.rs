//! A full bulkhead with a queue, and polling a future once by hand: waiters are put into the
//! queue deterministically (an acquire takes its place at its first poll).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest};

pub(crate) fn poll_once<F: Future + Unpin>(future: &mut F, waker: &Waker) -> Poll<F::Output> {
    Pin::new(future).poll(&mut Context::from_waker(waker))
}

/// A full bulkhead (one slot, held) with a queue.
pub(crate) fn full_with_queue(max_queue: usize) -> (LlmBulkhead, async_bulkhead_llm::OwnedPermit) {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .max_queue(max_queue)
        .build()
        .unwrap();
    let held = bulkhead
        .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    (bulkhead, held)
}
