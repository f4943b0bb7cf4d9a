//! The LLM bulkhead's queue timeouts and `drain_timeout` fire on every executor (tokio
//! current-thread without its timer, tokio multi-thread, smol, async-std,
//! `futures::executor`): the crate needs no runtime's timer.

use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, Profile, RejectReason, Rejection,
};

/// The bulkhead's default queue timeout.
const SHORT: Duration = Duration::from_millis(20);
/// How long a wait may take before it counts as a hang.
const PATIENCE: Duration = Duration::from_secs(10);

fn rejection<T: std::fmt::Debug>(result: Result<T, AcquireError>) -> Rejection {
    match result {
        Err(AcquireError::Rejected(rejection)) => rejection,
        other => panic!("expected a capacity rejection, got {other:?}"),
    }
}

/// Times out in the queue twice (bulkhead default, then per call), drains with a deadline and
/// then for real.
async fn time_out_in_the_queue() {
    let request = LlmRequest::new();
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Custom {
            max_queue: 4,
            timeout: Some(SHORT),
        })
        .build()
        .expect("valid configuration");
    let held = bulkhead
        .try_acquire_owned(&request, AcquireOptions::new())
        .expect("free slot");
    let started = Instant::now();
    let refused = rejection(bulkhead.acquire(&request, AcquireOptions::new()).await);
    assert_eq!(refused.reason(), RejectReason::Timeout);
    let waited = started.elapsed();
    assert!(waited >= SHORT && waited < PATIENCE, "waited {waited:?}");
    let per_call = AcquireOptions::new().timeout(Duration::from_millis(5));
    let refused = rejection(bulkhead.acquire_owned(&request, per_call).await);
    assert_eq!(refused.reason(), RejectReason::Timeout);
    let report = bulkhead.drain_timeout(Duration::from_millis(5)).await;
    assert_eq!(
        (report.drained, report.in_flight, report.pending),
        (false, 1, 0)
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
    futures::executor::block_on(time_out_in_the_queue());
}
