//! The leader/follower lifecycle: a call registers before it is admitted (so an identical call
//! joins it while it waits in the queue); followers take no capacity and are never estimated;
//! a follower's own timeout and cancellation end its wait alone; the call goes on while anyone
//! waits and is dropped (its admission settled) when nobody does; no call joins after `close`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, LlmRequest, RejectReason, RunError, TokenBudget, estimate::TokenEstimate,
    events::EventKind,
};
use futures::executor::block_on;

use super::support::{Gate, Heard, Runs, builder, dedup, poll_once, prompt};

fn plain() -> AcquireOptions {
    AcquireOptions::new()
}

fn refused<T: std::fmt::Debug>(result: Result<T, RunError<String>>) -> RejectReason {
    match result {
        Err(RunError::Rejected(rejection)) => rejection.reason(),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn an_identical_call_joins_a_leader_still_waiting_in_the_queue() {
    let bulkhead = builder(1).max_queue(4).build().unwrap();
    let request = prompt("queued");
    let holder = bulkhead.try_acquire(&LlmRequest::new(), plain()).unwrap();
    let gate = Gate::new();
    let runs = Runs::default();
    // Registration happens in the call itself, before any poll.
    let leader = bulkhead.run_shared(&request, plain(), runs.call(&gate, 5));
    let follower = bulkhead.run_shared(&request, plain(), runs.call(&gate, 6));
    assert_eq!(bulkhead.stats().deduplication.unwrap().hits, 1);
    let mut both = Box::pin(futures::future::join(leader, follower));
    assert!(poll_once(&mut both).is_pending());
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.pending), (1, 1)); // only the leader queued
    drop(holder);
    gate.open();
    assert_eq!(block_on(both), (Ok(5), Ok(5)));
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released, stats.in_flight), (2, 2, 0));
    assert_eq!(runs.started(), 1);
}

#[test]
fn followers_take_no_capacity_and_are_never_estimated() {
    let estimates = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&estimates);
    let bulkhead = builder(2)
        .token_budget(TokenBudget::new(1_000))
        .estimator(move |_: &LlmRequest| {
            counted.fetch_add(1, Ordering::SeqCst);
            TokenEstimate::new(300, 400)
        })
        .build()
        .unwrap();
    let request = prompt("sized");
    let gate = Gate::new();
    let runs = Runs::default();
    let mut leader = Box::pin(bulkhead.run_shared(&request, plain(), runs.call(&gate, 1)));
    assert!(poll_once(&mut leader).is_pending());
    let followers: Vec<_> = (0..5)
        .map(|_| bulkhead.run_shared(&request, plain(), runs.call(&gate, 2)))
        .collect();
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.admitted), (1, 1));
    assert_eq!(stats.token_budget.unwrap().in_flight_tokens, 700);
    assert_eq!(stats.deduplication.unwrap().hits, 5);
    assert_eq!(estimates.load(Ordering::SeqCst), 1); // the leader only
    gate.open();
    let values = block_on(futures::future::join_all(followers));
    assert!(values.iter().all(|v| *v == Ok(1)));
    assert_eq!(block_on(leader), Ok(1));
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released, stats.rejected), (1, 1, 0));
}

#[test]
fn a_followers_own_timeout_ends_its_wait_alone_counted_and_announced_untimed() {
    let bulkhead = dedup(2);
    let (heard, _subscription) = Heard::on(&bulkhead);
    let request = prompt("slow");
    let gate = Gate::new();
    let runs = Runs::default();
    let mut leader = Box::pin(bulkhead.run_shared(&request, plain(), runs.call(&gate, 1)));
    assert!(poll_once(&mut leader).is_pending());
    let impatient = plain().timeout(Duration::from_millis(30));
    let follower = bulkhead.run_shared(&request, impatient, runs.call(&gate, 2));
    assert_eq!(refused(block_on(follower)), RejectReason::Timeout);
    let stats = bulkhead.stats();
    assert_eq!((stats.rejected, stats.rejected_by_reason.timeout), (1, 1));
    assert_eq!(stats.in_flight, 1); // the shared call goes on
    gate.open();
    assert_eq!(block_on(leader), Ok(1));
    assert_eq!(
        heard.kinds(),
        [
            EventKind::Admit,
            EventKind::Dedup,
            EventKind::Reject,
            EventKind::Release
        ]
    );
    assert_eq!(bulkhead.stats().deduplication.unwrap().active, 0);
}

#[test]
fn the_bulkheads_queue_timeout_does_not_bound_a_followers_wait() {
    let bulkhead = builder(2)
        .queue_timeout(Duration::from_millis(10))
        .build()
        .unwrap();
    let request = prompt("patient");
    let gate = Gate::new();
    let runs = Runs::default();
    let mut leader = Box::pin(bulkhead.run_shared(&request, plain(), runs.call(&gate, 1)));
    assert!(poll_once(&mut leader).is_pending());
    let mut follower = Box::pin(bulkhead.run_shared(&request, plain(), runs.call(&gate, 2)));
    assert!(poll_once(&mut follower).is_pending());
    std::thread::sleep(Duration::from_millis(60));
    assert!(poll_once(&mut follower).is_pending());
    gate.open();
    assert_eq!(block_on(follower), Ok(1));
    assert_eq!(block_on(leader), Ok(1));
    assert_eq!(bulkhead.stats().rejected, 0);
}

#[test]
fn a_cancelled_follower_counts_as_aborted_and_the_call_goes_on() {
    let bulkhead = dedup(2);
    let request = prompt("cancel");
    let gate = Gate::new();
    let runs = Runs::default();
    let mut leader = Box::pin(bulkhead.run_shared(&request, plain(), runs.call(&gate, 1)));
    assert!(poll_once(&mut leader).is_pending());
    let mut follower = Box::pin(bulkhead.run_shared(&request, plain(), runs.call(&gate, 2)));
    assert!(poll_once(&mut follower).is_pending());
    drop(follower);
    let stats = bulkhead.stats();
    assert_eq!((stats.rejected, stats.rejected_by_reason.aborted), (1, 1));
    // A follower joins when it is made: dropped before its first poll, it was cancelled too.
    drop(bulkhead.run_shared(&request, plain(), runs.call(&gate, 3)));
    assert_eq!(bulkhead.stats().rejected_by_reason.aborted, 2);
    gate.open();
    assert_eq!(block_on(leader), Ok(1));
    assert_eq!((runs.started(), runs.dropped()), (1, 0));
}

#[test]
fn a_leader_dropped_while_a_follower_waits_leaves_the_call_to_the_follower() {
    let bulkhead = dedup(2);
    let request = prompt("hand over");
    let gate = Gate::new();
    let runs = Runs::default();
    let mut leader = Box::pin(bulkhead.run_shared(&request, plain(), runs.call(&gate, 1)));
    assert!(poll_once(&mut leader).is_pending()); // admitted, the callback waits
    let follower = bulkhead.run_shared(&request, plain(), runs.call(&gate, 2));
    drop(leader);
    assert_eq!(bulkhead.stats().in_flight, 1);
    // Opened from another thread while the follower drives the call.
    let opener = {
        let gate = gate.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            gate.open();
        })
    };
    assert_eq!(block_on(follower), Ok(1));
    opener.join().unwrap();
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released, stats.in_flight), (1, 1, 0));
    assert_eq!((runs.started(), runs.dropped()), (1, 0));
    assert_eq!(stats.rejected, 0); // a leader leaving is not a refusal
}

#[test]
fn when_every_waiter_is_gone_the_call_is_dropped_and_its_admission_settles() {
    let bulkhead = dedup(2);
    let request = prompt("abandoned");
    let gate = Gate::new();
    let runs = Runs::default();
    let mut leader = Box::pin(bulkhead.run_shared(&request, plain(), runs.call(&gate, 1)));
    assert!(poll_once(&mut leader).is_pending());
    let mut follower = Box::pin(bulkhead.run_shared(&request, plain(), runs.call(&gate, 2)));
    assert!(poll_once(&mut follower).is_pending());
    drop(leader);
    assert_eq!(runs.dropped(), 0);
    drop(follower);
    assert_eq!((runs.started(), runs.dropped()), (1, 1));
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released, stats.in_flight), (1, 1, 0));
    assert_eq!(stats.deduplication.unwrap().active, 0);
    // The key is free again: the next identical call leads.
    let again = bulkhead.run_shared(&request, plain(), runs.call(&Gate::open_now(), 3));
    assert_eq!(block_on(again), Ok(3));
}

#[test]
fn a_queued_call_whose_waiters_all_leave_leaves_the_queue() {
    let bulkhead = builder(1).max_queue(4).build().unwrap();
    let holder = bulkhead.try_acquire(&LlmRequest::new(), plain()).unwrap();
    let request = prompt("never admitted");
    let gate = Gate::new();
    let runs = Runs::default();
    let mut leader = Box::pin(bulkhead.run_shared(&request, plain(), runs.call(&gate, 1)));
    let mut follower = Box::pin(bulkhead.run_shared(&request, plain(), runs.call(&gate, 2)));
    assert!(poll_once(&mut leader).is_pending());
    assert!(poll_once(&mut follower).is_pending());
    assert_eq!(bulkhead.stats().pending, 1);
    drop(follower);
    drop(leader);
    let stats = bulkhead.stats();
    assert_eq!(stats.pending, 0);
    // The follower's cancellation and the queued call's are both counted.
    assert_eq!(stats.rejected_by_reason.aborted, 2);
    assert_eq!(runs.started(), 0);
    drop(holder);
    assert_eq!(bulkhead.stats().in_flight, 0);
}

#[test]
fn finished_calls_leave_the_registry_and_identical_calls_start_anew() {
    let bulkhead = dedup(2);
    let request = prompt("again");
    let runs = Runs::default();
    for value in 0..3 {
        let call = bulkhead.run_shared(&request, plain(), runs.call(&Gate::open_now(), value));
        assert_eq!(block_on(call), Ok(value));
        assert_eq!(bulkhead.stats().deduplication.unwrap().active, 0);
    }
    assert_eq!(runs.started(), 3);
    assert_eq!(bulkhead.stats().deduplication.unwrap().hits, 0);
}

#[test]
fn no_call_joins_after_close() {
    let bulkhead = dedup(2);
    let request = prompt("closing");
    let gate = Gate::new();
    let runs = Runs::default();
    let mut leader = Box::pin(bulkhead.run_shared(&request, plain(), runs.call(&gate, 1)));
    assert!(poll_once(&mut leader).is_pending());
    let before = bulkhead.run_shared(&request, plain(), runs.call(&gate, 2));
    assert!(bulkhead.close());
    let after = bulkhead.run_shared(&request, plain(), runs.call(&gate, 3));
    assert_eq!(refused(block_on(after)), RejectReason::Shutdown);
    gate.open();
    // Admitted before the close, the shared call finishes for its leader and its follower.
    assert_eq!(block_on(before), Ok(1));
    assert_eq!(block_on(leader), Ok(1));
    let stats = bulkhead.stats();
    assert_eq!(stats.deduplication.unwrap().hits, 1);
    assert_eq!((stats.rejected_by_reason.shutdown, stats.in_flight), (1, 0));
}

#[test]
fn each_join_is_announced_with_its_rank_and_counted() {
    let bulkhead = dedup(2);
    let (heard, _subscription) = Heard::on(&bulkhead);
    let request = prompt("popular");
    let gate = Gate::new();
    let runs = Runs::default();
    let calls: Vec<_> = (0..4)
        .map(|i| bulkhead.run_shared(&request, plain(), runs.call(&gate, i)))
        .collect();
    let dedup = bulkhead.stats().deduplication.unwrap();
    assert_eq!((dedup.active, dedup.hits), (1, 3));
    assert_eq!(heard.followers(), [1, 2, 3]);
    gate.open();
    assert_eq!(
        block_on(futures::future::join_all(calls)),
        [Ok(0), Ok(0), Ok(0), Ok(0)]
    );
    assert_eq!(bulkhead.stats().deduplication.unwrap().active, 0);
}
