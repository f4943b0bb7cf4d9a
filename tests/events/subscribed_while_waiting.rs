//! Listeners subscribed while a call waits hear its outcome (design §D4: every outcome of a
//! call that waited reaches the listeners subscribed when it is announced).

use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, Reservation, TokenBudget,
    events::Event, events::EventKind,
};

use crate::common::waiters::{full_with_queue, poll_once};

fn res(input: u64, max_output: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(input, max_output).unwrap())
}

/// Records every event's kind, and the reject reasons.
fn recorder(
    bulkhead: &LlmBulkhead,
) -> (
    Arc<Mutex<Vec<String>>>,
    async_bulkhead_llm::events::Subscription,
) {
    let log: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = log.clone();
    let subscription = bulkhead.on(move |event| {
        let entry = match event {
            Event::Admit(e) => format!("admit reserved={}", e.reserved_tokens),
            Event::Reject(e) => format!("reject {}", e.reason),
            other => other.kind().as_str().to_string(),
        };
        seen.lock().unwrap().push(entry);
    });
    (log, subscription)
}

#[test]
fn a_listener_subscribed_while_a_call_waits_hears_its_admit() {
    let (bulkhead, held) = full_with_queue(1);
    let mut waiting = bulkhead.acquire_owned(&LlmRequest::new(), AcquireOptions::new());
    assert!(poll_once(&mut waiting, Waker::noop()).is_pending());
    let (log, _subscription) = recorder(&bulkhead);
    let queued_for = Instant::now();
    std::thread::sleep(Duration::from_millis(5));
    drop(held); // hands the slot over
    let admitted = Arc::new(Mutex::new(None));
    let _timing = {
        let admitted = admitted.clone();
        bulkhead.on_events([EventKind::Admit], move |event| {
            if let Event::Admit(e) = event {
                *admitted.lock().unwrap() = Some(e.queue_wait);
            }
        })
    };
    let permit = match poll_once(&mut waiting, Waker::noop()) {
        Poll::Ready(result) => result.unwrap(),
        Poll::Pending => panic!("handed a slot"),
    };
    let waited = queued_for.elapsed();
    assert_eq!(*log.lock().unwrap(), ["release", "admit reserved=0"]);
    let queue_wait = admitted.lock().unwrap().expect("timed");
    assert!(
        queue_wait >= Duration::from_millis(5) && queue_wait <= waited + Duration::from_secs(1)
    );
    drop(permit);
}

fn refused_reason(
    poll: Poll<Result<async_bulkhead_llm::OwnedPermit, AcquireError>>,
) -> RejectReason {
    match poll {
        Poll::Ready(Err(error)) => error.rejection().expect("a capacity refusal").reason(),
        Poll::Ready(Ok(_)) => panic!("admitted"),
        Poll::Pending => panic!("still waiting"),
    }
}

#[test]
fn a_listener_subscribed_while_calls_wait_hears_every_refusal() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .max_queue(4)
        .token_budget(TokenBudget::new(1_000))
        .build()
        .unwrap();
    let held = bulkhead
        .try_acquire_owned(&LlmRequest::new(), res(100, 0))
        .unwrap();
    let mut head = bulkhead.acquire_owned(&LlmRequest::new(), res(500, 0));
    let mut handed = bulkhead.acquire_owned(&LlmRequest::new(), res(10, 0));
    let mut cancelled = bulkhead.acquire_owned(&LlmRequest::new(), res(10, 0));
    let mut closed = bulkhead.acquire_owned(&LlmRequest::new(), res(10, 0));
    for future in [&mut head, &mut handed, &mut cancelled, &mut closed] {
        assert!(poll_once(future, Waker::noop()).is_pending());
    }
    // Subscribed for other kinds when they queued, and for everything only now.
    let _other_kinds = bulkhead.on_events([EventKind::Usage], |_| {});
    let (log, _subscription) = recorder(&bulkhead);
    bulkhead.set_budget(200).unwrap();
    // The head's 500 tokens no longer fit: refused at its turn; the next call gets the slot.
    drop(held);
    assert_eq!(
        refused_reason(poll_once(&mut head, Waker::noop())),
        RejectReason::BudgetLimit
    );
    drop(cancelled); // while queued
    bulkhead.close(); // refuses the last waiter
    assert_eq!(
        refused_reason(poll_once(&mut closed, Waker::noop())),
        RejectReason::Shutdown
    );
    drop(handed); // handed a slot it never picked up
    assert_eq!(
        *log.lock().unwrap(),
        [
            "reconfigure",
            "release",
            "reject budget_limit",
            "reject aborted",
            "reject shutdown",
            "reject aborted"
        ]
    );
    assert_eq!(bulkhead.stats().in_flight, 0);
}
