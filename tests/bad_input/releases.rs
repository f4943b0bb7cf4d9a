//! release / drop: usage totals that saturate

use async_bulkhead_llm::{AcquireOptions, LlmRequest};

use crate::support::{budgeted, plain, probe, usage, with_res};

#[test]
fn settling_with_huge_usage_saturates_the_totals_and_returns_every_token() {
    let b = budgeted(4, 1000, 0);
    for _ in 0..3 {
        let permit = b.try_acquire(&LlmRequest::new(), with_res(10, 20)).unwrap();
        let report = permit.release(Some(usage(u64::MAX, 0)));
        assert_eq!(report.held_tokens, 30);
        assert_eq!(report.refunded_tokens, 0);
        assert_eq!(report.overrun_tokens, u64::MAX - 30);
        assert_eq!(report.usage, Some(usage(u64::MAX, 0)));
    }
    let t = b.stats().token_budget.unwrap();
    assert_eq!(t.in_flight_tokens, 0);
    assert_eq!(t.total_consumed, u64::MAX, "saturates");
    assert_eq!(t.total_overrun, u64::MAX, "saturates");
    assert_eq!(t.total_reserved, 90);
    assert_eq!(b.stats().in_flight, 0);
    // Still admits normally.
    let fresh = budgeted(4, 1000, 0);
    let (a, c) = (probe(&b), probe(&fresh));
    assert_eq!(a.admission, c.admission);
    assert_eq!(a.tokens_after, c.tokens_after);

    // Without a budget, usage still reaches nothing but the consumed total (no budget
    // stats), and releases never panic.
    let b = plain(2);
    for _ in 0..2 {
        let permit = b
            .try_acquire(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let report = permit.release(Some(usage(0, u64::MAX)));
        assert_eq!((report.held_tokens, report.refunded_tokens), (0, 0));
    }
    assert_eq!(b.stats().in_flight, 0);
}
