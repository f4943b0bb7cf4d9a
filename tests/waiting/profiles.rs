//! Profiles: their queue and timeout, and explicit options overriding them.

use std::time::Duration;

use async_bulkhead_llm::{LlmBulkhead, Profile, RejectReason};

use crate::support::{opts, queued, ready, reason_of, rejection, req};

/// An empty request for futures that outlive the statement that made them (an acquire
/// borrows its request until its first poll).
static EMPTY_REQUEST: std::sync::LazyLock<async_bulkhead_llm::LlmRequest> =
    std::sync::LazyLock::new(async_bulkhead_llm::LlmRequest::new);

#[test]
fn the_default_profile_is_interactive_without_queue_or_timeout() {
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .build()
        .expect("valid configuration");
    assert_eq!(Profile::default(), Profile::Interactive);
    assert_eq!(bulkhead.limits().max_queue, 0);
    assert_eq!(bulkhead.queue_timeout(), None);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut fut = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, opts()));
    assert_eq!(reason_of(ready(&mut fut)), RejectReason::ConcurrencyLimit);
    assert_eq!(bulkhead.stats().pending, 0);
    drop(held);

    let explicit = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Interactive)
        .build()
        .expect("valid configuration");
    assert_eq!(
        (explicit.limits().max_queue, explicit.queue_timeout()),
        (0, None)
    );
}

#[test]
fn the_batch_profile_queues_twenty_for_thirty_seconds() {
    let bulkhead = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Batch)
        .build()
        .expect("valid configuration");
    assert_eq!(bulkhead.limits().max_queue, 20);
    assert_eq!(bulkhead.queue_timeout(), Some(Duration::from_secs(30)));
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let waiters: Vec<_> = (0..20).map(|_| queued(&bulkhead, opts())).collect();
    let mut extra = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, opts()));
    let refused = rejection(ready(&mut extra));
    assert_eq!(refused.reason(), RejectReason::QueueLimit);
    assert_eq!(
        (refused.detail().pending, refused.detail().max_queue),
        (20, 20)
    );
    drop(waiters);
    let stats = bulkhead.stats();
    assert_eq!((stats.pending, stats.rejected_by_reason.aborted), (0, 20));
    drop(held);
}

#[test]
fn a_custom_profile_sets_queue_and_timeout() {
    let custom = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Custom {
            max_queue: 3,
            timeout: Some(Duration::from_millis(250)),
        })
        .build()
        .expect("valid configuration");
    assert_eq!(custom.limits().max_queue, 3);
    assert_eq!(custom.queue_timeout(), Some(Duration::from_millis(250)));
    let held = custom.try_acquire(&req(), opts()).expect("free slot");
    let _w: Vec<_> = (0..3).map(|_| queued(&custom, opts())).collect();
    let mut extra = Box::pin(custom.acquire(&EMPTY_REQUEST, opts()));
    assert_eq!(reason_of(ready(&mut extra)), RejectReason::QueueLimit);
    drop(held);

    let forever = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Custom {
            max_queue: 1,
            timeout: None,
        })
        .build()
        .expect("valid configuration");
    assert_eq!(
        (forever.limits().max_queue, forever.queue_timeout()),
        (1, None)
    );
}

#[test]
fn explicit_options_override_the_profile_whatever_the_order() {
    let timeout = Duration::from_millis(250);
    let before = LlmBulkhead::builder("test-model", 1)
        .max_queue(3)
        .queue_timeout(timeout)
        .profile(Profile::Batch)
        .build()
        .expect("valid configuration");
    let after = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Batch)
        .max_queue(3)
        .queue_timeout(timeout)
        .build()
        .expect("valid configuration");
    for bulkhead in [&before, &after] {
        assert_eq!(bulkhead.limits().max_queue, 3);
        assert_eq!(bulkhead.queue_timeout(), Some(timeout));
    }

    // One explicit option, the other from the profile.
    let mixed = LlmBulkhead::builder("test-model", 1)
        .max_queue(0)
        .profile(Profile::Batch)
        .build()
        .expect("valid configuration");
    assert_eq!(mixed.limits().max_queue, 0);
    assert_eq!(mixed.queue_timeout(), Some(Duration::from_secs(30)));
    let held = mixed.try_acquire(&req(), opts()).expect("free slot");
    let mut fut = Box::pin(mixed.acquire(&EMPTY_REQUEST, opts()));
    assert_eq!(reason_of(ready(&mut fut)), RejectReason::ConcurrencyLimit);
    drop(held);

    let custom = LlmBulkhead::builder("test-model", 1)
        .queue_timeout(timeout)
        .profile(Profile::Custom {
            max_queue: 7,
            timeout: None,
        })
        .build()
        .expect("valid configuration");
    assert_eq!(
        (custom.limits().max_queue, custom.queue_timeout()),
        (7, Some(timeout))
    );

    // The last profile chosen wins over an earlier one.
    let replaced = LlmBulkhead::builder("test-model", 1)
        .profile(Profile::Batch)
        .profile(Profile::Interactive)
        .build()
        .expect("valid configuration");
    assert_eq!(
        (replaced.limits().max_queue, replaced.queue_timeout()),
        (0, None)
    );
}
