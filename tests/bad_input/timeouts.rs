//! Queue timeouts: zero, huge and Duration::MAX (acquire, acquire_owned, acquire_blocking(_owned),
//! run, builder queue_timeout, Profile::Custom)

use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, OwnedPermit, Priority, Profile, RejectReason,
    TokenBudget,
};
use futures::executor::block_on;

use crate::support::{Entry, MODEL, Outcome, Twin, call, plus_one_rejection, probe, res, with_res};

/// An empty request for futures that outlive the statement that made them (an acquire
/// borrows its request until its first poll).
static EMPTY_REQUEST: std::sync::LazyLock<async_bulkhead_llm::LlmRequest> =
    std::sync::LazyLock::new(async_bulkhead_llm::LlmRequest::new);

fn queued_twin() -> Twin {
    let mut twin = Twin::new(|| {
        LlmBulkhead::builder(MODEL, 1)
            .max_queue(4)
            .token_budget(TokenBudget::new(1000))
            .build()
            .unwrap()
    });
    twin.hold(with_res(10, 10));
    twin
}

#[test]
fn a_zero_timeout_on_a_free_slot_admits_at_once() {
    let b = LlmBulkhead::builder(MODEL, 1).max_queue(4).build().unwrap();
    let options = AcquireOptions::new().timeout(Duration::ZERO);
    drop(block_on(b.acquire(&LlmRequest::new(), options)).unwrap());
    drop(b.acquire_blocking(&LlmRequest::new(), options).unwrap());
    let stats = b.stats();
    assert_eq!((stats.admitted, stats.rejected, stats.in_flight), (2, 0, 0));
}

#[test]
fn a_zero_timeout_while_queued_gives_up_at_the_first_check_and_leaves_the_queue() {
    let zero = AcquireOptions::new().timeout(Duration::ZERO);
    type Wait = (&'static str, fn(&LlmBulkhead, AcquireOptions) -> Outcome);
    let waits: [Wait; 5] = [
        ("acquire", |b, o| {
            call(Entry::Acquire, b, &LlmRequest::new(), o)
        }),
        ("acquire_owned", |b, o| {
            call(Entry::AcquireOwned, b, &LlmRequest::new(), o)
        }),
        ("acquire_blocking", |b, o| {
            call(Entry::AcquireBlocking, b, &LlmRequest::new(), o)
        }),
        ("acquire_blocking_owned", |b, o| {
            call(Entry::AcquireBlockingOwned, b, &LlmRequest::new(), o)
        }),
        ("run", |b, o| call(Entry::Run, b, &LlmRequest::new(), o)),
    ];
    for (name, wait) in waits {
        for options in [
            zero.reservation(res(5, 5)),
            zero.reservation(res(0, 0)).priority(Priority::High),
        ] {
            let twin = queued_twin();
            let before = twin.subject.stats();
            let Outcome::Rejected(rejection) = wait(&twin.subject, options) else {
                panic!("{name}: expected a timeout");
            };
            assert_eq!(rejection.reason(), RejectReason::Timeout, "{name}");
            assert_eq!(
                rejection.to_string(),
                "bulkhead rejected: timeout (no slot was granted before the queue timeout)"
            );
            let after = twin.subject.stats();
            assert_eq!(
                after,
                plus_one_rejection(before, RejectReason::Timeout),
                "{name}"
            );
            assert_eq!((after.pending, after.in_flight), (0, 1), "{name}");
            assert_eq!(probe(&twin.subject), probe(&twin.control), "{name}");
        }
    }
}

/// Queues one acquire with `options`, checks it waits, frees the slot, checks it is then
/// admitted (the timeout did not fire or panic).
fn waits_then_admits(b: &LlmBulkhead, options: AcquireOptions, holder: OwnedPermit) {
    block_on(async {
        let mut waiting = Box::pin(b.acquire(&EMPTY_REQUEST, options));
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        assert!(
            futures::poll!(waiting.as_mut()).is_pending(),
            "polled twice"
        );
        assert_eq!(b.stats().pending, 1);
        drop(holder);
        let permit = waiting.await.expect("handed the freed slot");
        assert_eq!(b.stats().in_flight, 1);
        drop(permit);
    });
    let stats = b.stats();
    assert_eq!((stats.in_flight, stats.pending, stats.rejected), (0, 0, 0));
}

#[test]
fn duration_max_and_huge_timeouts_never_panic_and_wait_for_a_slot() {
    let huge = [
        Duration::MAX,
        Duration::new(u64::MAX, 0),
        Duration::from_secs(u64::MAX / 2),
        Duration::from_secs(1 << 40), // representable as an Instant: registers a timer
    ];
    for timeout in huge {
        // Per-call timeout.
        let b = LlmBulkhead::builder(MODEL, 1).max_queue(2).build().unwrap();
        let holder = b
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        waits_then_admits(&b, AcquireOptions::new().timeout(timeout), holder);

        // Bulkhead default timeout (builder and custom profile).
        for b in [
            LlmBulkhead::builder(MODEL, 1)
                .max_queue(2)
                .queue_timeout(timeout)
                .build()
                .unwrap(),
            LlmBulkhead::builder(MODEL, 1)
                .profile(Profile::Custom {
                    max_queue: 2,
                    timeout: Some(timeout),
                })
                .build()
                .unwrap(),
        ] {
            assert_eq!(b.queue_timeout(), Some(timeout));
            let holder = b
                .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
                .unwrap();
            waits_then_admits(&b, AcquireOptions::new(), holder);
        }

        // Blocking: another thread frees the slot.
        let b = LlmBulkhead::builder(MODEL, 1).max_queue(2).build().unwrap();
        let holder = b
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let watcher = b.clone();
        let releaser = std::thread::spawn(move || {
            while watcher.stats().pending == 0 {
                std::thread::yield_now();
            }
            drop(holder);
        });
        let permit = b
            .acquire_blocking_owned(&LlmRequest::new(), AcquireOptions::new().timeout(timeout))
            .expect("handed the freed slot");
        releaser.join().unwrap();
        drop(permit);
        assert_eq!(b.stats().rejected, 0);
    }

    // The timer still works afterwards: a short timeout still fires.
    let b = LlmBulkhead::builder(MODEL, 1).max_queue(2).build().unwrap();
    let _holder = b
        .try_acquire(&LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    let err = block_on(b.acquire(
        &LlmRequest::new(),
        AcquireOptions::new().timeout(Duration::from_millis(20)),
    ))
    .unwrap_err();
    assert_eq!(err.rejection().unwrap().reason(), RejectReason::Timeout);
}

#[test]
fn dropping_a_waiter_with_a_duration_max_timeout_aborts_cleanly() {
    let twin = queued_twin();
    block_on(async {
        let mut waiting = Box::pin(
            twin.subject
                .acquire(&EMPTY_REQUEST, with_res(1, 1).timeout(Duration::MAX)),
        );
        assert!(futures::poll!(waiting.as_mut()).is_pending());
    });
    let stats = twin.subject.stats();
    assert_eq!(stats.pending, 0);
    assert_eq!(stats.rejected_by_reason.aborted, 1);
    assert_eq!(probe(&twin.subject), probe(&twin.control));
}
