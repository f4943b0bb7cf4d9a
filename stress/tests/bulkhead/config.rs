//! `max_concurrent` must be at least 1 (and at most `MAX_CONCURRENT`), `max_queue` at most
//! `u32::MAX`: refused with a typed error at every call that sets them (`new`, `build`,
//! `apply_limits`, `set_max_concurrent`, `set_max_queue`), with nothing changed. The builder
//! takes a gateway's `usize` and checks it at `build`, as the LLM bulkhead's does.

use async_bulkhead_llm::{
    Bulkhead, bulkhead::BulkheadConfigError, bulkhead::BulkheadLimits, limits::MAX_CONCURRENT,
};

use crate::support::st;

const MAX: usize = MAX_CONCURRENT as usize;

fn too_large() -> BulkheadConfigError {
    BulkheadConfigError::MaxConcurrentTooLarge {
        value: MAX + 1,
        max: MAX,
    }
}

#[test]
fn max_concurrent_0_is_refused_by_new_and_build() {
    assert_eq!(
        Bulkhead::new(0).unwrap_err(),
        BulkheadConfigError::ZeroMaxConcurrent
    );
    assert_eq!(
        Bulkhead::builder(0).max_queue(3).build().unwrap_err(),
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
    assert_eq!(Bulkhead::new(MAX + 1).unwrap_err(), too_large());
    assert_eq!(Bulkhead::builder(MAX + 1).build().unwrap_err(), too_large());
    // Past what a `u32` holds too: refused, not truncated into range.
    let huge = u32::MAX as usize + 2;
    assert_eq!(
        Bulkhead::new(huge).unwrap_err(),
        BulkheadConfigError::MaxConcurrentTooLarge {
            value: huge,
            max: MAX
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
    assert_eq!(bulkhead.set_max_concurrent(MAX + 1), Err(too_large()));
    assert_eq!(bulkhead.limits(), before);
}

#[test]
fn max_concurrent_of_exactly_max_concurrent_and_of_1_are_accepted() {
    let widest = Bulkhead::new(MAX).expect("the largest is valid");
    assert_eq!(widest.limits().max_concurrent, MAX_CONCURRENT);
    let narrowest = Bulkhead::new(1).expect("1 is valid");
    let bulkhead = Bulkhead::new(2).expect("valid");
    let limits = bulkhead.set_max_concurrent(MAX).expect("valid");
    assert_eq!(limits.max_concurrent, MAX_CONCURRENT);
    let limits = bulkhead.set_max_concurrent(1).expect("valid");
    assert_eq!(limits.max_concurrent, 1);
    drop(narrowest);
}

#[test]
fn max_queue_above_u32_max_is_refused_by_build_and_set_max_queue_with_nothing_changed() {
    let huge = u32::MAX as usize + 1;
    let refused = BulkheadConfigError::MaxQueueTooLarge {
        value: huge,
        max: u32::MAX as usize,
    };
    assert_eq!(
        Bulkhead::builder(2).max_queue(huge).build().unwrap_err(),
        refused
    );
    assert_eq!(
        refused.to_string(),
        format!("bulkhead max_queue ({huge}) must be <= {}", u32::MAX)
    );
    let widest = Bulkhead::builder(2)
        .max_queue(u32::MAX as usize)
        .build()
        .expect("u32::MAX places is valid");
    assert_eq!(widest.limits().max_queue, u32::MAX);
    let bulkhead = Bulkhead::new(2).expect("valid");
    let before = bulkhead.limits();
    assert_eq!(bulkhead.set_max_queue(huge), Err(refused));
    assert_eq!(bulkhead.limits(), before);
}
