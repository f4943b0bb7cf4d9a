//! `max_concurrent` must be at least 1 (and at most `MAX_CONCURRENT`): refused with a typed
//! error at every call that sets it (`new`, `builder`, `apply_limits`, `set_max_concurrent`),
//! with nothing changed.

use async_bulkhead_llm::{Bulkhead, BulkheadConfigError, BulkheadLimits, MAX_CONCURRENT};

use crate::support::st;

fn too_large() -> BulkheadConfigError {
    BulkheadConfigError::MaxConcurrentTooLarge {
        value: MAX_CONCURRENT + 1,
        max: MAX_CONCURRENT,
    }
}

#[test]
fn max_concurrent_0_is_refused_by_new_and_builder() {
    assert_eq!(
        Bulkhead::new(0).unwrap_err(),
        BulkheadConfigError::ZeroMaxConcurrent
    );
    assert_eq!(
        Bulkhead::builder(0).unwrap_err(),
        BulkheadConfigError::ZeroMaxConcurrent
    );
    assert_eq!(
        BulkheadConfigError::ZeroMaxConcurrent.to_string(),
        "bulkhead max_concurrent must be >= 1 (0 would refuse or deadlock every call)"
    );
}

#[test]
fn max_concurrent_0_is_refused_by_apply_limits_and_set_max_concurrent_with_nothing_changed() {
    let bulkhead = Bulkhead::new(2).expect("valid");
    let held = bulkhead.try_acquire().expect("free");
    let before = bulkhead.limits();
    assert_eq!(
        bulkhead.apply_limits(BulkheadLimits::new(before.revision + 1, 0).with_max_queue(7)),
        Err(BulkheadConfigError::ZeroMaxConcurrent)
    );
    assert_eq!(bulkhead.limits(), before, "not even max_queue changed");
    assert_eq!(
        bulkhead.set_max_concurrent(0),
        Err(BulkheadConfigError::ZeroMaxConcurrent)
    );
    assert_eq!(bulkhead.limits(), before);
    assert_eq!(bulkhead.state(), st(1, 0));
    // The bulkhead still works with its old limits: one slot left.
    let second = bulkhead.try_acquire().expect("the second slot");
    assert!(bulkhead.try_acquire().is_err());
    drop((held, second));
}

#[test]
fn max_concurrent_above_max_concurrent_is_refused_everywhere_with_nothing_changed() {
    assert_eq!(Bulkhead::new(MAX_CONCURRENT + 1).unwrap_err(), too_large());
    assert_eq!(
        Bulkhead::builder(MAX_CONCURRENT + 1).unwrap_err(),
        too_large()
    );
    assert_eq!(
        Bulkhead::new(u32::MAX).unwrap_err(),
        BulkheadConfigError::MaxConcurrentTooLarge {
            value: u32::MAX,
            max: MAX_CONCURRENT
        }
    );
    let bulkhead = Bulkhead::new(2).expect("valid");
    let before = bulkhead.limits();
    assert_eq!(
        bulkhead.apply_limits(
            BulkheadLimits::new(before.revision + 1, MAX_CONCURRENT + 1).with_max_queue(7)
        ),
        Err(too_large())
    );
    assert_eq!(
        bulkhead.set_max_concurrent(MAX_CONCURRENT + 1),
        Err(too_large())
    );
    assert_eq!(bulkhead.limits(), before);
}

#[test]
fn max_concurrent_of_exactly_max_concurrent_and_of_1_are_accepted() {
    let widest = Bulkhead::new(MAX_CONCURRENT).expect("the largest is valid");
    assert_eq!(widest.limits().max_concurrent, MAX_CONCURRENT);
    let narrowest = Bulkhead::new(1).expect("1 is valid");
    let bulkhead = Bulkhead::new(2).expect("valid");
    let limits = bulkhead.set_max_concurrent(MAX_CONCURRENT).expect("valid");
    assert_eq!(limits.max_concurrent, MAX_CONCURRENT);
    let limits = bulkhead.set_max_concurrent(1).expect("valid");
    assert_eq!(limits.max_concurrent, 1);
    drop(narrowest);
}
