//! Helpers shared by the admission tests.

use std::fmt;

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, Priority, RejectReason, Rejection,
    Reservation, TokenBudget, TokenUsage, admission::AdmissionId, rejection::CapacityDetail,
    rejection::TokenBudgetDetail, stats::RejectionCounts, stats::TokenBudgetStats,
    usage::ReleaseReport,
};

pub(crate) fn res(input: u64, max_output: u64) -> Reservation {
    Reservation::new(input, max_output).expect("reservation fits in u64")
}

/// Normal-priority options with a reservation override of `input + max_output`.
pub(crate) fn opts(input: u64, max_output: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(res(input, max_output))
}

/// High-priority options with a reservation override of `input + max_output`.
pub(crate) fn high(input: u64, max_output: u64) -> AcquireOptions {
    opts(input, max_output).priority(Priority::High)
}

pub(crate) fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).expect("usage fits in u64")
}

pub(crate) fn req() -> LlmRequest {
    LlmRequest::new()
}

/// A bulkhead without a token budget.
pub(crate) fn plain(max_concurrent: usize) -> LlmBulkhead {
    LlmBulkhead::builder("test-model", max_concurrent)
        .build()
        .expect("valid configuration")
}

/// A bulkhead with a token budget and a high-priority reserve.
pub(crate) fn budgeted(max_concurrent: usize, budget: u64, reserve: u64) -> LlmBulkhead {
    LlmBulkhead::builder("test-model", max_concurrent)
        .token_budget(TokenBudget::new(budget).high_priority_reserve(reserve))
        .build()
        .expect("valid configuration")
}

/// The rejection of a refused acquire; panics on success or on an invalid-input error.
pub(crate) fn rejected<T: fmt::Debug>(result: Result<T, AcquireError>) -> Rejection {
    match result {
        Err(AcquireError::Rejected(rejection)) => rejection,
        other => panic!("expected a capacity rejection, got {other:?}"),
    }
}

/// The refusal reason of a refused acquire.
pub(crate) fn reason_of<T: fmt::Debug>(result: Result<T, AcquireError>) -> RejectReason {
    rejected(result).reason()
}

pub(crate) fn tokens(bulkhead: &LlmBulkhead) -> TokenBudgetStats {
    bulkhead
        .stats()
        .token_budget
        .expect("bulkhead has a token budget")
}

/// `(budget, in_flight_tokens, effective_budget, available, requested)` of a detail.
pub(crate) fn budget_figures(detail: &CapacityDetail) -> (u64, u64, u64, u64, u64) {
    let t: TokenBudgetDetail = detail.token_budget.expect("detail has a token block");
    (
        t.budget,
        t.in_flight_tokens,
        t.effective_budget,
        t.available,
        t.requested,
    )
}

/// `(limit_revision, in_flight, max_concurrent, pending, max_queue)` of a detail.
pub(crate) fn slot_figures(detail: &CapacityDetail) -> (u64, u64, u32, u64, u32) {
    (
        detail.limit_revision,
        detail.in_flight,
        detail.max_concurrent,
        detail.pending,
        detail.max_queue,
    )
}

/// `(held_tokens, refunded_tokens, usage)` of a release report.
pub(crate) fn report_figures(report: &ReleaseReport) -> (u64, u64, Option<TokenUsage>) {
    (report.held_tokens, report.refunded_tokens, report.usage)
}

/// `(total_reserved, total_consumed, total_refunded, total_overrun)`.
pub(crate) fn totals(t: &TokenBudgetStats) -> (u64, u64, u64, u64) {
    (
        t.total_reserved,
        t.total_consumed,
        t.total_refunded,
        t.total_overrun,
    )
}

/// All six rejection counters in declaration order.
pub(crate) fn counts(c: &RejectionCounts) -> [u64; 6] {
    [
        c.shutdown,
        c.concurrency_limit,
        c.budget_limit,
        c.queue_limit,
        c.timeout,
        c.aborted,
    ]
}

pub(crate) fn text(chars: usize) -> LlmRequest {
    LlmRequest::new().user("x".repeat(chars))
}

fn assert_v4_uuid_text(text: &str) {
    assert_eq!(text.len(), 36, "{text}");
    for (i, c) in text.char_indices() {
        match i {
            8 | 13 | 18 | 23 => assert_eq!(c, '-', "{text}"),
            _ => assert!(
                c.is_ascii_digit() || ('a'..='f').contains(&c),
                "not lowercase hex: {text}"
            ),
        }
    }
    assert_eq!(&text[14..15], "4", "version nibble: {text}");
    assert!(
        matches!(&text[19..20], "8" | "9" | "a" | "b"),
        "variant: {text}"
    );
    let parsed = uuid::Uuid::parse_str(text).expect("parses as a UUID");
    assert_eq!(parsed.get_version_num(), 4);
    assert_eq!(parsed.get_variant(), uuid::Variant::RFC4122);
}

pub(crate) fn assert_valid_id(id: AdmissionId) {
    let uuid = id.to_uuid();
    assert_eq!(uuid.get_version_num(), 4, "{id}");
    assert_eq!(uuid.get_variant(), uuid::Variant::RFC4122, "{id}");
    assert_eq!(uuid.as_u128(), id.as_u128());
    assert_eq!(uuid::Uuid::from(id), uuid);
    assert_v4_uuid_text(&id.to_string());
}
