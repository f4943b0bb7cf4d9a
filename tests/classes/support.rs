//! Builders and helpers shared by the class tests.

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, Permit, Rejection, Reservation, TokenBudget,
    classes::AdmissionClass, classes::AdmissionClasses, classes::ClassLimits, stats::ClassStats,
};

/// The upstream example's shape: 4 slots, premium floor 2, standard floor 1 (shared 1).
pub(crate) fn four_slots() -> LlmBulkhead {
    LlmBulkhead::builder("m", 4)
        .admission_classes(
            AdmissionClasses::new("standard")
                .class("premium", ClassLimits::new().protected_concurrent(2))
                .class("standard", ClassLimits::new().protected_concurrent(1)),
        )
        .build()
        .unwrap()
}

/// The upstream token example: budget 2000, premium token floor 400, standard 800 (shared 800).
pub(crate) fn token_floors() -> LlmBulkhead {
    LlmBulkhead::builder("m", 100)
        .token_budget(TokenBudget::new(2000))
        .admission_classes(
            AdmissionClasses::new("standard")
                .class(
                    "premium",
                    ClassLimits::new().protected_in_flight_tokens(400),
                )
                .class(
                    "standard",
                    ClassLimits::new().protected_in_flight_tokens(800),
                ),
        )
        .build()
        .unwrap()
}

pub(crate) fn in_class(bulkhead: &LlmBulkhead, id: &str) -> AcquireOptions {
    AcquireOptions::new().class(bulkhead.class(id).unwrap())
}

pub(crate) fn tokens(options: AcquireOptions, input: u64, output: u64) -> AcquireOptions {
    options.reservation(Reservation::new(input, output).unwrap())
}

pub(crate) fn admit<'a>(bulkhead: &'a LlmBulkhead, options: AcquireOptions) -> Permit<'a> {
    bulkhead
        .try_acquire(&LlmRequest::new(), options)
        .unwrap_or_else(|e| panic!("expected an admission, got {e}"))
}

pub(crate) fn refuse(bulkhead: &LlmBulkhead, options: AcquireOptions) -> Rejection {
    match bulkhead.try_acquire(&LlmRequest::new(), options) {
        Ok(permit) => panic!("expected a refusal, got {permit:?}"),
        Err(e) => *e.rejection().expect("a capacity refusal"),
    }
}

pub(crate) fn class_stats(bulkhead: &LlmBulkhead, class: AdmissionClass) -> ClassStats {
    bulkhead.stats().admission_classes.expect("classes").classes[usize::from(class.index())].clone()
}
