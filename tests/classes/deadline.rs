//! The borrowed-slot deadline of `run`: it cuts only a call holding a borrowed slot, returns
//! the slot at once, drops the callback's future, settles its tokens with the last reported
//! usage, and returns a typed error.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, RunError, RunOptions, TokenBudget, TokenUsage,
    classes::AdmissionClasses, classes::ClassLimits, request::RequestError,
};

use crate::support::{class_stats, in_class, tokens};

fn tiers() -> LlmBulkhead {
    LlmBulkhead::builder("m", 2)
        .token_budget(TokenBudget::new(1000).output_cap(100))
        .admission_classes(
            AdmissionClasses::new("batch")
                .class("premium", ClassLimits::new().protected_concurrent(1))
                .class("batch", ClassLimits::new()),
        )
        .build()
        .unwrap()
}

/// Set when dropped: tells whether the callback's future was dropped.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[test]
fn a_borrowed_slot_past_its_deadline_is_cut_and_settled_with_the_last_usage() {
    let b = tiers();
    let dropped = Arc::new(AtomicBool::new(false));
    let flag = DropFlag(dropped.clone());
    let options = tokens(in_class(&b, "batch"), 100, 400)
        .borrowed_concurrency_deadline(Duration::from_millis(30));
    let result =
        futures::executor::block_on(b.run(&LlmRequest::new(), options, async |mut ctx| {
            let _flag = flag;
            ctx.report_usage(TokenUsage::new(100, 50).unwrap()).unwrap();
            futures::future::pending::<()>().await;
            Ok::<(), std::io::Error>(())
        }));
    let Err(RunError::BorrowedConcurrencyDeadline(cut)) = result else {
        panic!("expected the deadline, got {result:?}")
    };
    assert!(
        dropped.load(Ordering::SeqCst),
        "the callback's future was dropped"
    );
    assert_eq!(cut.deadline, Duration::from_millis(30));
    assert_eq!(cut.class.unwrap().id(), "batch");
    assert!(cut.resources.borrowed_concurrency);
    assert_eq!(cut.resources.borrowed_tokens, 500);
    let stats = b.stats();
    assert_eq!(
        (stats.in_flight, stats.abandoned_in_flight, stats.released),
        (0, 0, 1)
    );
    assert_eq!(stats.borrowed_concurrency_abandoned_by_cause.deadline, 1);
    let t = stats.token_budget.unwrap();
    assert_eq!((t.in_flight_tokens, t.total_consumed), (0, 150));
    let c = class_stats(&b, b.class("batch").unwrap());
    assert_eq!(
        (
            c.borrowed_concurrency_abandoned_by_cause.deadline,
            c.released
        ),
        (1, 1)
    );
    assert!(cut.to_string().contains("batch"));
}

#[test]
fn the_deadline_never_cuts_a_slot_within_the_floor() {
    let b = tiers();
    let options = in_class(&b, "premium").borrowed_concurrency_deadline(Duration::from_millis(1));
    let value = futures::executor::block_on(b.run(&LlmRequest::new(), options, async |ctx| {
        assert!(!ctx.resources().borrowed_concurrency);
        std::thread::sleep(Duration::from_millis(20));
        futures::future::ready(()).await;
        Ok::<_, std::io::Error>(7)
    }))
    .unwrap();
    assert_eq!(value, 7);
    assert_eq!(b.stats().borrowed_concurrency_abandoned, 0);
}

#[test]
fn a_callback_that_finishes_first_is_not_cut() {
    let b = tiers();
    let options = in_class(&b, "batch").borrowed_concurrency_deadline(Duration::from_secs(60));
    let value = futures::executor::block_on(b.run(&LlmRequest::new(), options, async |_| {
        Ok::<_, std::io::Error>("done")
    }))
    .unwrap();
    assert_eq!(value, "done");
    assert_eq!(b.stats().borrowed_concurrency_abandoned, 0);
}

#[test]
fn after_a_manual_abandonment_the_deadline_no_longer_applies() {
    let b = tiers();
    let options = in_class(&b, "batch").borrowed_concurrency_deadline(Duration::from_millis(5));
    let value = futures::executor::block_on(b.run(&LlmRequest::new(), options, async |mut ctx| {
        assert!(ctx.abandon_borrowed_concurrency());
        // Well past the deadline, on a timer of our own.
        futures_timer(Duration::from_millis(40)).await;
        Ok::<_, std::io::Error>(1)
    }))
    .unwrap();
    assert_eq!(value, 1);
    let by = b.stats().borrowed_concurrency_abandoned_by_cause;
    assert_eq!((by.manual, by.deadline), (1, 0));
}

#[test]
fn a_zero_deadline_is_refused_before_anything_happens() {
    let b = tiers();
    let ran = AtomicBool::new(false);
    let options =
        RunOptions::from(AcquireOptions::new()).borrowed_concurrency_deadline(Duration::ZERO);
    let result = futures::executor::block_on(b.run(&LlmRequest::new(), options, async |_| {
        ran.store(true, Ordering::SeqCst);
        Ok::<(), std::io::Error>(())
    }));
    assert!(matches!(
        result,
        Err(RunError::Invalid(
            RequestError::ZeroBorrowedConcurrencyDeadline
        ))
    ));
    assert!(!ran.load(Ordering::SeqCst));
    let stats = b.stats();
    assert_eq!((stats.admitted, stats.rejected), (0, 0));
    // Refused even on a bulkhead where it could never apply.
    let plain = LlmBulkhead::builder("m", 1).build().unwrap();
    let result = futures::executor::block_on(plain.run(&LlmRequest::new(), options, async |_| {
        Ok::<(), std::io::Error>(())
    }));
    assert!(matches!(result, Err(RunError::Invalid(_))));
}

#[test]
fn the_deadline_works_on_tokio_without_its_timer() {
    // A current-thread runtime with no time driver: the deadline uses the crate's own timer.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let b = tiers();
    let options = in_class(&b, "batch").borrowed_concurrency_deadline(Duration::from_millis(10));
    let result = rt.block_on(b.run(&LlmRequest::new(), options, async |_| {
        futures::future::pending::<Result<(), std::io::Error>>().await
    }));
    assert!(matches!(
        result,
        Err(RunError::BorrowedConcurrencyDeadline(_))
    ));
    assert_eq!(b.stats().in_flight, 0);
}

/// A sleep that needs no runtime: a thread wakes the task.
fn futures_timer(duration: Duration) -> impl Future<Output = ()> {
    let (tx, rx) = futures::channel::oneshot::channel::<()>();
    std::thread::spawn(move || {
        std::thread::sleep(duration);
        let _ = tx.send(());
    });
    async move {
        let _ = rx.await;
    }
}
