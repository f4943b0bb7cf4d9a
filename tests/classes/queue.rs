//! The one global FIFO queue with classes: a head is admitted only when its slot, its tokens
//! and its class limits all fit; a head whose class limits no longer fit is refused with the
//! class reason and the turn passes on.

use std::time::Duration;

use async_bulkhead_llm::{
    AcquireError, LlmBulkhead, LlmRequest, RejectReason, classes::AdmissionClasses,
    classes::ClassLimits, classes::ClassLimitsTable, rejection::Constraint,
};

use crate::support::{admit, class_stats, in_class};

/// An empty request for futures that outlive the statement that made them (an acquire
/// borrows its request until its first poll).
static EMPTY_REQUEST: std::sync::LazyLock<async_bulkhead_llm::LlmRequest> =
    std::sync::LazyLock::new(async_bulkhead_llm::LlmRequest::new);

fn queued(max_concurrent: usize) -> LlmBulkhead {
    LlmBulkhead::builder("m", max_concurrent)
        .max_queue(4)
        .admission_classes(
            AdmissionClasses::new("a")
                .class("a", ClassLimits::new())
                .class("b", ClassLimits::new()),
        )
        .build()
        .unwrap()
}

#[test]
fn a_waiter_is_admitted_in_its_class_when_a_slot_frees() {
    let b = queued(1);
    let a = in_class(&b, "a");
    let held = admit(&b, in_class(&b, "b"));
    futures::executor::block_on(async {
        let mut waiting =
            std::pin::pin!(b.acquire(&EMPTY_REQUEST, a.timeout(Duration::from_secs(5))));
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        drop(held);
        let permit = waiting.await.unwrap();
        assert_eq!(permit.class(), Some(b.class("a").unwrap()));
        let s = class_stats(&b, b.class("a").unwrap());
        assert_eq!((s.in_flight, s.admitted), (1, 1));
        assert_eq!(class_stats(&b, b.class("b").unwrap()).in_flight, 0);
    });
}

#[test]
fn a_head_whose_class_no_longer_fits_is_refused_with_the_class_reason() {
    let b = queued(1);
    let held = admit(&b, in_class(&b, "b"));
    futures::executor::block_on(async {
        let request = LlmRequest::new();
        let mut first =
            std::pin::pin!(b.acquire(&request, in_class(&b, "a").timeout(Duration::from_secs(5))));
        let mut second =
            std::pin::pin!(b.acquire(&request, in_class(&b, "b").timeout(Duration::from_secs(5))));
        assert!(futures::poll!(first.as_mut()).is_pending());
        assert!(futures::poll!(second.as_mut()).is_pending());
        // Class a's ceiling drops to 0 while its call waits: at its turn it is refused and
        // the slot goes to the next waiter.
        let mut next = b.limits();
        next.revision += 1;
        next.admission_classes = Some(
            ClassLimitsTable::new()
                .with("a", ClassLimits::new().max_concurrent(0))
                .with("b", ClassLimits::new()),
        );
        b.apply_limits(next).unwrap();
        drop(held);
        match first.await {
            Err(AcquireError::Rejected(r)) => {
                assert_eq!(r.reason(), RejectReason::ConcurrencyLimit);
                assert_eq!(r.detail().constraint, Some(Constraint::AdmissionClass));
                let class = r.detail().admission_class().unwrap();
                assert_eq!((class.class.id(), class.max_concurrent), ("a", Some(0)));
            }
            other => panic!("{other:?}"),
        }
        let permit = second.await.unwrap();
        assert_eq!(permit.class().unwrap().id(), "b");
    });
    let a = class_stats(&b, b.class("a").unwrap());
    assert_eq!((a.rejected_by_reason.concurrency_limit, a.admitted), (1, 0));
}

#[test]
fn class_refusals_never_queue() {
    let b = LlmBulkhead::builder("m", 4)
        .max_queue(4)
        .admission_classes(
            AdmissionClasses::new("a")
                .class("a", ClassLimits::new().max_concurrent(1))
                .class("b", ClassLimits::new()),
        )
        .build()
        .unwrap();
    let _held = admit(&b, in_class(&b, "a"));
    futures::executor::block_on(async {
        let refused = b
            .acquire(
                &LlmRequest::new(),
                in_class(&b, "a").timeout(Duration::from_secs(5)),
            )
            .await
            .unwrap_err();
        let r = refused.rejection().unwrap();
        assert_eq!(r.detail().constraint, Some(Constraint::AdmissionClass));
    });
    assert_eq!(b.stats().pending, 0);
}
