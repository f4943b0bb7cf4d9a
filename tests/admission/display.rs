//! `Display` texts of refusals and errors.

use async_bulkhead_llm::{AcquireOptions, Priority, RejectReason};

use crate::support::{budgeted, high, opts, plain, req};

#[test]
fn rejection_display_texts() {
    // shutdown
    let closed = plain(1);
    closed.close();
    let err = closed
        .try_acquire(&req(), AcquireOptions::new())
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "bulkhead rejected: shutdown (the bulkhead is closed)"
    );
    assert_eq!(
        err.rejection().unwrap().to_string(),
        "bulkhead rejected: shutdown (the bulkhead is closed)"
    );

    // concurrency_limit, slots full
    let full = plain(1);
    let _held = full.try_acquire(&req(), AcquireOptions::new()).unwrap();
    let err = full.try_acquire(&req(), AcquireOptions::new()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "bulkhead rejected: concurrency_limit (1 of 1 slots in flight)"
    );

    // concurrency_limit, max_concurrent 0
    let zero = plain(0);
    let err = zero.try_acquire(&req(), AcquireOptions::new()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "bulkhead rejected: concurrency_limit (max_concurrent is 0)"
    );

    // budget_limit
    let budget = budgeted(4, 2400, 400);
    let _a = budget.try_acquire(&req(), opts(100, 1000)).unwrap();
    let err = budget.try_acquire(&req(), opts(100, 1000)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "bulkhead rejected: budget_limit (requested 1100 tokens, 900 of effective budget 2000 available, 1100 in flight)"
    );
    let err = budget.try_acquire(&req(), high(2000, 0)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "bulkhead rejected: budget_limit (requested 2000 tokens, 1300 of effective budget 2400 available, 1100 in flight)"
    );

    // Rejections and all errors are std errors.
    let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(err);
    assert!(
        boxed
            .to_string()
            .starts_with("bulkhead rejected: budget_limit")
    );
    let rejection: &dyn std::error::Error = err.rejection().unwrap();
    assert!(rejection.source().is_none());
}

#[test]
fn reject_reason_wire_names() {
    let names: Vec<&str> = RejectReason::ALL.iter().map(|r| r.as_str()).collect();
    assert_eq!(
        names,
        [
            "shutdown",
            "concurrency_limit",
            "budget_limit",
            "queue_limit",
            "timeout",
            "aborted",
            "rate_limit"
        ]
    );
    for &reason in RejectReason::ALL {
        assert_eq!(reason.to_string(), reason.as_str());
    }
    assert_eq!(Priority::Normal.as_str(), "normal");
    assert_eq!(Priority::High.as_str(), "high");
    assert_eq!(Priority::default(), Priority::Normal);
    assert_eq!(AcquireOptions::default(), AcquireOptions::new());
}
