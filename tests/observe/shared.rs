//! Observe mode under deduplication: a bypassed leader's outcome reaches its followers, and a
//! follower in observe mode whose own timeout passes runs its own callback as a bypass.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, dedup::Deduplication,
    observe::ShadowReasons,
};
use futures::executor::block_on;

fn dedup(max_concurrent: usize) -> LlmBulkhead {
    LlmBulkhead::builder("m", max_concurrent)
        .max_queue(0)
        .deduplication(Deduplication::new())
        .build()
        .unwrap()
}

#[test]
fn a_bypassed_leaders_value_reaches_its_followers() {
    let bulkhead = dedup(0); // refuses everything: the leader is bypassed
    let request = LlmRequest::new().user("shadow");
    let runs = Arc::new(AtomicU64::new(0));
    let call = || {
        let runs = Arc::clone(&runs);
        move |ctx: async_bulkhead_llm::RunContext<'static>| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>(ctx.bypass().map(|b| b.reason))
        }
    };
    let observe = AcquireOptions::new().observe(ShadowReasons::ALL);
    let leader = bulkhead.run_shared(&request, observe, call());
    let follower = bulkhead.run_shared(&request, observe, call());
    let (a, b) = block_on(futures::future::join(leader, follower));
    assert_eq!(a, Ok(Some(RejectReason::ConcurrencyLimit)));
    assert_eq!(b, a);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let stats = bulkhead.stats();
    assert_eq!(stats.observe.unwrap().bypassed, 1);
    assert_eq!((stats.deduplication.unwrap().hits, stats.rejected), (1, 0));
}

#[test]
fn an_observe_follower_whose_own_timeout_passes_runs_its_own_callback_as_a_bypass() {
    let bulkhead = dedup(1);
    let request = LlmRequest::new().user("slow leader");
    let (release, hold) = futures::channel::oneshot::channel::<()>();
    let mut leader =
        Box::pin(
            bulkhead.run_shared(&request, AcquireOptions::new(), move |_ctx| async move {
                let _ = hold.await;
                Ok::<_, String>("leader")
            }),
        );
    assert!(
        futures::FutureExt::poll_unpin(
            &mut leader,
            &mut std::task::Context::from_waker(std::task::Waker::noop())
        )
        .is_pending()
    );
    let impatient = AcquireOptions::new()
        .timeout(Duration::from_millis(20))
        .observe(ShadowReasons::ALL);
    let follower = bulkhead.run_shared(&request, impatient, |ctx| async move {
        let bypass = ctx.bypass().expect("bypassed");
        assert_eq!(
            (bypass.reason, bypass.raced, bypass.detail),
            (RejectReason::Timeout, false, None)
        );
        Ok::<_, String>("own")
    });
    assert_eq!(block_on(follower), Ok("own"));
    let stats = bulkhead.stats();
    // Counted as a refusal (its own wait), then bypassed.
    assert_eq!(stats.rejected_by_reason.timeout, 1);
    assert_eq!(stats.observe.unwrap().bypassed_by_reason.timeout, 1);
    let _ = release.send(());
    assert_eq!(block_on(leader), Ok("leader"));
    assert_eq!(bulkhead.stats().in_flight, 0);
}
