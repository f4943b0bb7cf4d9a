//! The owned acquire future is `Send` and `'static`: it can be spawned.

use async_bulkhead_llm::RejectReason;
use async_bulkhead_llm::futures::AcquireOwned;

use crate::support::{SHORT, figures, opts, plain, reason_of, req, wait_until, within};

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
