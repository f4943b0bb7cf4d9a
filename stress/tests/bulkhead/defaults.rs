//! The defaults: a queue of 50 places (the 51st waiter is refused `QueueFull` seeing 50
//! queued), a queue timeout of 10 s (on tokio's paused clock, feature `tokio`),
//! `wait_indefinitely` waiting past it, `max_queue(0)` refusing at once.

use std::time::Duration;

use async_bulkhead_llm::{
    Bulkhead, BulkheadError, bulkhead::DEFAULT_MAX_QUEUE, bulkhead::DEFAULT_QUEUE_TIMEOUT,
};

use crate::support::{Heard, assert_pending, bulkhead, on_three_runtimes, ready, st};

#[test]
fn the_defaults_are_a_queue_of_50_and_a_timeout_of_10_s() {
    assert_eq!(DEFAULT_MAX_QUEUE, 50);
    assert_eq!(DEFAULT_QUEUE_TIMEOUT, Duration::from_secs(10));
    let bulkhead = Bulkhead::new(20).expect("valid");
    let limits = bulkhead.limits();
    assert_eq!((limits.max_concurrent, limits.max_queue), (20, 50));
    assert_eq!(bulkhead.queue_timeout(), Some(Duration::from_secs(10)));
    let built = Bulkhead::builder(20).build().expect("valid");
    assert_eq!(built.limits().max_queue, 50);
    assert_eq!(built.queue_timeout(), Some(Duration::from_secs(10)));
}

/// 3 slots held, 50 acquires queued: the 51st waiter is refused `QueueFull` seeing
/// `{active: 3, queued: 50}`, and so is a `try_acquire`; the hook hears both.
async fn the_51st_waiter_is_refused_queue_full() {
    let heard = Heard::new();
    let bulkhead = heard.on(Bulkhead::builder(3)).build().expect("valid");
    let held: Vec<_> = (0..3)
        .map(|_| bulkhead.try_acquire().expect("free"))
        .collect();
    let mut waiters = Vec::new();
    for _ in 0..50 {
        let mut waiter = bulkhead.acquire();
        assert_pending(&mut waiter).await;
        waiters.push(waiter);
    }
    assert_eq!(bulkhead.state(), st(3, 50));
    let mut fifty_first = bulkhead.acquire();
    let refused = ready(&mut fifty_first).await.unwrap_err();
    assert_eq!(refused, BulkheadError::QueueFull { state: st(3, 50) });
    let refused = bulkhead.try_acquire().unwrap_err();
    assert_eq!(refused, BulkheadError::QueueFull { state: st(3, 50) });
    assert_eq!(heard.states(), vec![st(3, 50), st(3, 50)]);
    assert_eq!(bulkhead.stats().rejected_queue_full, 2);

    drop(held);
    let mut served = 0;
    for waiter in waiters {
        drop(waiter.await.expect("served in turn"));
        served += 1;
    }
    assert_eq!(served, 50);
    assert_eq!(bulkhead.state(), st(0, 0));
}

on_three_runtimes!(
    the_default_max_queue_is_50_and_the_51st_waiter_is_refused_queue_full,
    super::the_51st_waiter_is_refused_queue_full
);

/// `max_queue(0)`: with the slot taken, an acquire is refused at its first poll, without
/// queueing.
async fn max_queue_0_refuses_at_once() {
    let bulkhead = bulkhead(1, 0);
    let _held = bulkhead.try_acquire().expect("free");
    let mut waiter = bulkhead.acquire();
    assert_eq!(
        ready(&mut waiter).await.unwrap_err(),
        BulkheadError::QueueFull { state: st(1, 0) }
    );
    let mut call = Box::pin(bulkhead.run(async { unreachable!("never started") }));
    let refused: Result<(), _> = ready(&mut call).await;
    assert!(matches!(refused, Err(BulkheadError::QueueFull { .. })));
    let stats = bulkhead.stats();
    assert_eq!((stats.queued, stats.rejected_queue_full), (0, 2));
}

on_three_runtimes!(
    max_queue_0_refuses_immediately,
    super::max_queue_0_refuses_at_once
);

/// On tokio's paused clock (feature `tokio`): the default timeout passes in virtual time.
#[cfg(feature = "tokio")]
mod paused_clock {
    use std::time::{Duration, Instant};

    use async_bulkhead_llm::{Bulkhead, BulkheadError};

    use crate::support::{Heard, assert_pending, poll_once, st};

    /// The most real time a paused-clock scenario may take (it takes a few milliseconds).
    const REAL_BOUND: Duration = Duration::from_secs(2);

    #[tokio::test(start_paused = true)]
    async fn the_default_queue_timeout_refuses_a_waiter_after_exactly_10_s() {
        let heard = Heard::new();
        let bulkhead = heard.on(Bulkhead::builder(1)).build().expect("valid");
        let _held = bulkhead.try_acquire().expect("free");
        let virtual_start = tokio::time::Instant::now();
        let real_start = Instant::now();
        let refused = bulkhead.acquire().await.unwrap_err();
        let virtual_elapsed = virtual_start.elapsed();
        // tokio's timer ticks in whole milliseconds and a paused clock starts on a tick.
        assert_eq!(virtual_elapsed, Duration::from_secs(10));
        assert!(real_start.elapsed() < REAL_BOUND);
        let BulkheadError::QueueTimeout { state, .. } = refused else {
            panic!("expected a queue timeout, got {refused:?}")
        };
        assert_eq!(state, st(1, 0), "it left the queue");
        assert_eq!(heard.all(), vec![refused]);
        assert_eq!(bulkhead.stats().timed_out, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_is_still_queued_just_before_10_s_and_refused_just_after() {
        let bulkhead = Bulkhead::new(1).expect("valid");
        let _held = bulkhead.try_acquire().expect("free");
        let mut waiter = bulkhead.acquire();
        assert_pending(&mut waiter).await;
        tokio::time::sleep(Duration::from_millis(9_999)).await;
        assert_pending(&mut waiter).await;
        assert_eq!(bulkhead.state(), st(1, 1));
        tokio::time::sleep(Duration::from_millis(1)).await;
        let refused = poll_once(&mut waiter).await;
        assert!(
            matches!(
                refused,
                std::task::Poll::Ready(Err(BulkheadError::QueueTimeout { .. }))
            ),
            "{refused:?}"
        );
        assert_eq!(bulkhead.state(), st(1, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn wait_indefinitely_waits_past_10_s_until_served() {
        let bulkhead = Bulkhead::builder(1)
            .wait_indefinitely()
            .build()
            .expect("valid");
        assert_eq!(bulkhead.queue_timeout(), None);
        let held = bulkhead.try_acquire().expect("free");
        let mut waiter = bulkhead.acquire();
        assert_pending(&mut waiter).await;
        tokio::time::sleep(Duration::from_secs(3_600)).await;
        assert_pending(&mut waiter).await;
        assert_eq!(bulkhead.state(), st(1, 1), "still queued after an hour");
        drop(held);
        let permit = waiter.await.expect("served when the slot frees");
        assert_eq!(bulkhead.state(), st(1, 0));
        drop(permit);
        assert_eq!(bulkhead.stats().timed_out, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_custom_queue_timeout_of_3_s_passes_in_3_s() {
        let bulkhead = Bulkhead::builder(20)
            .max_queue(100)
            .queue_timeout(Duration::from_millis(3_000))
            .build()
            .expect("valid");
        let _held: Vec<_> = (0..20)
            .map(|_| bulkhead.try_acquire().expect("free"))
            .collect();
        let start = tokio::time::Instant::now();
        let refused = bulkhead.acquire().await.unwrap_err();
        assert_eq!(start.elapsed(), Duration::from_secs(3));
        assert!(matches!(refused, BulkheadError::QueueTimeout { .. }));
    }
}
