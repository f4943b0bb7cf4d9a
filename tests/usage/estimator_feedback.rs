//! The estimator learns from the usage a release settles with.

use std::sync::Arc;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, TokenBudget, estimate::AdaptiveEstimator,
    estimate::Correction, estimate::ModelAwareEstimator,
};
use futures::executor::block_on;

use crate::common::usage_fixtures::{progressive, res, tokens, usage};

#[test]
fn releases_settled_with_reported_usage_feed_the_adaptive_estimator() {
    let base = ModelAwareEstimator::builder()
        .default_model("gpt-4o")
        .build()
        .unwrap();
    let adaptive = Arc::new(
        AdaptiveEstimator::builder(base)
            .smoothing(1.0)
            .min_samples(1)
            .build()
            .unwrap(),
    );
    let bulkhead = LlmBulkhead::builder("gpt-4o", 8)
        .token_budget(TokenBudget::new(100_000))
        .estimator(adaptive.clone())
        .build()
        .unwrap();
    // 370 characters: a base estimate of 100 input tokens for gpt-4o.
    let request = LlmRequest::new().user("x".repeat(370)).max_tokens(10);
    // `(model, samples, factor, applied)` of each correction.
    let correction =
        |samples: u64, factor: f64| vec![("gpt-4o".to_owned(), samples, factor, factor)];
    let corrections = |adaptive: &AdaptiveEstimator| -> Vec<(String, u64, f64, f64)> {
        adaptive
            .corrections()
            .into_iter()
            .map(|c: Correction| (c.model, c.samples, c.factor, c.applied))
            .collect()
    };
    assert_eq!(bulkhead.estimate(&request).unwrap(), Some(res(100, 10)));

    // Released without usage after reports: the last reported usage is observed.
    let mut permit = bulkhead
        .try_acquire(&request, AcquireOptions::new())
        .unwrap();
    assert_eq!(permit.reservation(), Some(res(100, 10)));
    permit.report_usage(usage(120, 1)).unwrap();
    permit.report_usage(usage(150, 5)).unwrap();
    permit.release(None);
    assert_eq!(corrections(&adaptive), correction(1, 1.5));
    assert_eq!(bulkhead.estimate(&request).unwrap(), Some(res(150, 10)));

    // Dropped after a report: observed against the uncorrected base (100), not 150.
    let mut permit = bulkhead
        .try_acquire_owned(&request, AcquireOptions::new())
        .unwrap();
    assert_eq!(permit.reservation(), Some(res(150, 10)));
    permit
        .report_usage_progressive(usage(80, 3), progressive(7, 0))
        .unwrap();
    drop(permit);
    assert_eq!(corrections(&adaptive), correction(2, 0.8));

    // Explicit usage at release wins over the reports.
    let mut permit = bulkhead
        .try_acquire(&request, AcquireOptions::new())
        .unwrap();
    permit.report_usage(usage(300, 3)).unwrap();
    permit.release(Some(usage(120, 3)));
    assert_eq!(corrections(&adaptive), correction(3, 1.2));

    // Nothing known, nothing observed.
    bulkhead
        .try_acquire(&request, AcquireOptions::new())
        .unwrap()
        .release(None);
    assert_eq!(corrections(&adaptive), correction(3, 1.2));

    // A run settled with what its callback reported.
    block_on(
        bulkhead.run(&request, AcquireOptions::new(), async |mut ctx| {
            ctx.report_usage(usage(90, 2))
        }),
    )
    .unwrap();
    assert_eq!(corrections(&adaptive), correction(4, 0.9));
    assert_eq!(bulkhead.estimate(&request).unwrap(), Some(res(90, 10)));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 0);
}
