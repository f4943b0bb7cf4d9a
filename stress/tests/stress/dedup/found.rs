//! What the dedup stress found in the crate, each as the smallest test that failed because of
//! it before the fix.

use std::future::{Future, poll_fn};
use std::task::Poll;

use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, dedup::Deduplication};
use futures::executor::block_on;

/// `run_shared`'s docs: "A follower's wait ends early only by its own explicit timeout or by
/// dropping its future: both are counted as rejections (`timeout`, `aborted`)". A follower
/// joins when `run_shared` is called (it is counted in `hits` and announced by a `DedupEvent`
/// then), so its cancellation counts even before its first poll (it used to count only once
/// its future was polled, and the followers did not balance: `hits` != outcomes + own
/// timeouts + `aborted`).
#[test]
fn a_follower_dropped_before_its_first_poll_is_counted_aborted() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .deduplication(Deduplication::new())
        .build()
        .unwrap();
    let request = LlmRequest::new().user("hi");
    let call = |n: u32| {
        bulkhead.run_shared(&request, AcquireOptions::new(), move |_| async move {
            Ok::<_, ()>(n)
        })
    };
    // The leader's callback runs until the gate opens.
    let (open, gate) = futures::channel::oneshot::channel::<()>();
    let mut leader =
        Box::pin(
            bulkhead.run_shared(&request, AcquireOptions::new(), move |_| async move {
                gate.await.unwrap();
                Ok::<u32, ()>(1)
            }),
        );
    let mut polled = Box::pin(call(2));
    let unpolled = call(3);
    block_on(poll_fn(|cx| {
        assert!(leader.as_mut().poll(cx).is_pending());
        assert!(polled.as_mut().poll(cx).is_pending());
        Poll::Ready(())
    }));
    // Polled, then dropped: counted.
    drop(polled);
    assert_eq!(bulkhead.stats().rejected_by_reason.aborted, 1);
    // Never polled, then dropped: not counted.
    drop(unpolled);
    open.send(()).unwrap();
    assert_eq!(block_on(leader).unwrap(), 1);
    let stats = bulkhead.stats();
    assert_eq!(stats.deduplication.unwrap().hits, 2);
    assert_eq!(stats.rejected_by_reason.aborted, 2, "{stats:#?}");
}
