//! A panicking `Estimator::observe`: the release completes, the capacity comes
//! back, and the panic is counted; a permit dropped while its thread unwinds does not abort
//! the process (run in a child process, `crate::common::child_process::isolated`).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, TokenBudget, TokenUsage, estimate::Estimator,
    estimate::TokenEstimate, request::RequestError,
};

use crate::common::child_process::isolated;

fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).unwrap()
}

/// An estimator whose `observe` panics (its estimates are plain).
struct PanicsOnObserve;

impl Estimator for PanicsOnObserve {
    fn estimate(&self, _request: &LlmRequest) -> Result<TokenEstimate, RequestError> {
        Ok(TokenEstimate::new(100, 100))
    }

    fn observe(&self, _estimate: &TokenEstimate, _usage: TokenUsage) {
        panic!("estimator observe panics");
    }
}

fn panicking_estimator_bulkhead(slots: usize) -> LlmBulkhead {
    LlmBulkhead::builder("m", slots)
        .token_budget(TokenBudget::new(10_000))
        .estimator(PanicsOnObserve)
        .build()
        .unwrap()
}

#[test]
fn a_panicking_estimator_observe_returns_the_capacity_and_is_counted() {
    let bulkhead = panicking_estimator_bulkhead(2);
    for round in 1..=2u64 {
        let permit = bulkhead
            .try_acquire(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        assert_eq!(permit.held_tokens(), 200);
        // The release completes: the panic is caught, not unwound into the caller.
        let released = catch_unwind(AssertUnwindSafe(|| {
            permit.release(Some(usage(50, 20)));
        }));
        assert!(released.is_ok(), "round {round}: release unwound");
        let stats = bulkhead.stats();
        assert_eq!(
            (stats.in_flight, stats.admitted, stats.released),
            (0, round, round)
        );
        assert_eq!(stats.estimator_panics, round);
        let tokens = stats.token_budget.unwrap();
        assert_eq!(tokens.in_flight_tokens, 0);
        assert_eq!(
            (tokens.total_consumed, tokens.total_refunded),
            (70 * round, 130 * round)
        );
    }
    // Both slots are free: two more calls are admitted.
    let a = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new());
    let b = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new());
    assert!(a.is_ok() && b.is_ok());
    drop((a, b));
    assert!(
        futures::executor::block_on(bulkhead.drain_timeout(Duration::from_millis(100))).drained
    );
}

#[test]
fn a_panicking_estimator_observe_under_run_settles_the_call() {
    let bulkhead = panicking_estimator_bulkhead(1);
    let result = futures::executor::block_on(bulkhead.run_with_usage(
        &LlmRequest::new(),
        AcquireOptions::new(),
        |_: &u32| Some(usage(10, 10)),
        async |_| Ok::<_, std::io::Error>(7u32),
    ));
    assert_eq!(result.unwrap(), 7);
    let stats = bulkhead.stats();
    assert_eq!(
        (stats.in_flight, stats.released, stats.estimator_panics),
        (0, 1, 1)
    );
    assert!(
        bulkhead
            .try_acquire(&LlmRequest::new(), AcquireOptions::new())
            .is_ok()
    );
}

fn dropped_while_unwinding() {
    let bulkhead = panicking_estimator_bulkhead(1);
    let worker = {
        let bulkhead = bulkhead.clone();
        std::thread::spawn(move || {
            let mut permit = bulkhead
                .try_acquire(&LlmRequest::new(), AcquireOptions::new())
                .unwrap();
            permit.report_usage(usage(30, 5)).unwrap();
            // The permit drops while this thread unwinds, settling with the reported usage:
            // the estimator's panic must not escape the drop (that aborts the process).
            panic!("the caller's own failure");
        })
    };
    assert!(worker.join().is_err(), "the worker panicked");
    let stats = bulkhead.stats();
    assert_eq!(
        (stats.in_flight, stats.released, stats.estimator_panics),
        (0, 1, 1)
    );
}

#[test]
fn a_permit_dropped_while_unwinding_with_a_panicking_estimator_does_not_abort() {
    isolated(
        "panicking_estimator::a_permit_dropped_while_unwinding_with_a_panicking_estimator_does_not_abort",
        Duration::from_secs(30),
        dropped_while_unwinding,
    );
}
