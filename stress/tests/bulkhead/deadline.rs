//! Deadlines: a queued call also gives up when its deadline budget runs out (`QueueTimeout`),
//! at about the deadline when it is shorter than the queue timeout, with how long it waited reported; a deadline bounds waiting only, so a free
//! slot admits a call whose deadline already passed.

use std::time::{Duration, Instant};

use async_bulkhead_llm::bulkhead::WaitOptions;
use async_bulkhead_llm::{Bulkhead, BulkheadError};

use crate::support::{Heard, PATIENCE, on_three_runtimes, ready, st};

/// The deadline budget of the scenarios, far shorter than the queue timeout.
const BUDGET: Duration = Duration::from_millis(50);

fn patient() -> (Bulkhead, Heard) {
    let heard = Heard::new();
    let bulkhead = heard
        .on(Bulkhead::builder(1).queue_timeout(Duration::from_secs(30)))
        .build()
        .expect("valid");
    (bulkhead, heard)
}

/// Checks a timeout that ended a wait begun at `started`.
fn assert_timed_out_at_the_deadline(error: BulkheadError, started: Instant) {
    let elapsed = started.elapsed();
    assert!(
        elapsed >= BUDGET && elapsed < PATIENCE,
        "gave up after {elapsed:?}"
    );
    let BulkheadError::QueueTimeout { waited, state } = error else {
        panic!("expected a queue timeout, got {error:?}")
    };
    assert!(
        waited >= BUDGET && waited <= elapsed,
        "waited {waited:?} of {elapsed:?}"
    );
    assert_eq!(state, st(1, 0), "it left the queue");
}

/// `acquire_by` and `call_by` with a 50 ms deadline under a 30 s queue timeout: refused
/// `QueueTimeout` after about 50 ms, `waited` reported; `call_by`'s body never runs.
async fn a_deadline_shorter_than_the_queue_timeout_ends_the_wait() {
    let (bulkhead, heard) = patient();
    let _held = bulkhead.try_acquire().expect("free");

    let started = Instant::now();
    let refused = bulkhead
        .acquire_with(WaitOptions::new().deadline(started + BUDGET))
        .await
        .unwrap_err();
    assert_timed_out_at_the_deadline(refused, started);

    let started = Instant::now();
    let refused: Result<(), _> = bulkhead
        .run_with(WaitOptions::new().deadline(started + BUDGET), async {
            unreachable!("never started")
        })
        .await;
    assert_timed_out_at_the_deadline(refused.unwrap_err(), started);

    let started = Instant::now();
    let refused = bulkhead
        .acquire_owned_with(WaitOptions::new().deadline(started + BUDGET))
        .await
        .unwrap_err();
    assert_timed_out_at_the_deadline(refused, started);

    assert_eq!(heard.count(), 3);
    let stats = bulkhead.stats();
    assert_eq!((stats.timed_out, stats.queued, stats.active), (3, 0, 1));
}

on_three_runtimes!(
    a_deadline_shorter_than_the_queue_timeout_ends_in_queue_timeout_at_the_deadline,
    super::a_deadline_shorter_than_the_queue_timeout_ends_the_wait
);

/// A deadline already past: a free slot still admits (it bounds waiting only); with no free
/// slot the call is refused `QueueTimeout` at its first poll.
async fn a_past_deadline_admits_to_a_free_slot() {
    let (bulkhead, heard) = patient();
    let past = Instant::now()
        .checked_sub(Duration::from_secs(1))
        .expect("the clock is older than a second");
    let permit = bulkhead
        .acquire_with(WaitOptions::new().deadline(past))
        .await
        .expect("a free slot admits");
    let mut late = bulkhead.acquire_with(WaitOptions::new().deadline(past));
    let refused = ready(&mut late).await.unwrap_err();
    assert!(matches!(refused, BulkheadError::QueueTimeout { state, .. } if state == st(1, 0)));
    drop(permit);
    let answer = bulkhead
        .run_with(WaitOptions::new().deadline(past), async { 42 })
        .await;
    assert_eq!(answer, Ok(42));
    let owned = bulkhead
        .acquire_owned_with(WaitOptions::new().deadline(past))
        .await
        .expect("free");
    drop(owned);
    let blocking = bulkhead
        .acquire_blocking_with(WaitOptions::new().deadline(past))
        .expect("free");
    drop(blocking);
    assert_eq!(heard.count(), 1);
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released, stats.timed_out), (4, 4, 1));
}

on_three_runtimes!(
    a_past_deadline_with_a_free_slot_still_admits,
    super::a_past_deadline_admits_to_a_free_slot
);

/// A deadline later than the queue timeout: the queue timeout ends the wait first.
async fn the_queue_timeout_ends_a_wait_before_a_later_deadline() {
    let bulkhead = Bulkhead::builder(1)
        .queue_timeout(BUDGET)
        .build()
        .expect("valid");
    let _held = bulkhead.try_acquire().expect("free");
    let started = Instant::now();
    let refused = bulkhead
        .acquire_with(WaitOptions::new().deadline(started + Duration::from_secs(3_600)))
        .await
        .unwrap_err();
    assert_timed_out_at_the_deadline(refused, started);
}

on_three_runtimes!(
    the_queue_timeout_ends_a_wait_before_a_later_deadline,
    super::the_queue_timeout_ends_a_wait_before_a_later_deadline
);

#[test]
fn a_blocking_acquire_gives_up_at_its_deadline() {
    let (bulkhead, heard) = patient();
    let _held = bulkhead.try_acquire().expect("free");
    let started = Instant::now();
    let refused = bulkhead
        .acquire_blocking_with(WaitOptions::new().deadline(started + BUDGET))
        .unwrap_err();
    assert_timed_out_at_the_deadline(refused, started);
    assert_eq!(heard.count(), 1);
}
