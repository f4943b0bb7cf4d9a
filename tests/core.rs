//! Behavioural tests of the public API of `async-bulkhead-llm`: builder validation, the order of
//! admission checks, reservation resolution, permits and token accounting, versioned limits,
//! advisory checks, close, statistics and display texts.
//!
//! Figures come from the upstream behaviour reference (`upstream-behavior.md` §1.4, §1.6, §3,
//! §4, §5, §8, §15.1) as adapted by RUST-DESIGN §3–§4 (shutdown is always checked first; reported
//! usage always reaches `total_consumed`).

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, AdmissionId, ApplyOutcome, CapacityDetail, ConfigError, Content,
    ContentBlock, DEFAULT_OUTPUT_CAP, Limits, LimitsError, LlmBulkhead, LlmBulkheadBuilder,
    LlmRequest, MAX_BUDGET, MAX_CONCURRENT, MAX_REVISION, OwnedPermit, Permit, Priority,
    RejectReason, Rejection, RejectionCounts, ReleaseReport, RequestError, Reservation, Stats,
    TokenBudget, TokenBudgetDetail, TokenBudgetStats, TokenUsage, UsageError, Verdict,
};

// ===== helpers =====

fn res(input: u64, max_output: u64) -> Reservation {
    Reservation::new(input, max_output).expect("reservation fits in u64")
}

/// Normal-priority options with a reservation override of `input + max_output`.
fn opts(input: u64, max_output: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(res(input, max_output))
}

/// High-priority options with a reservation override of `input + max_output`.
fn high(input: u64, max_output: u64) -> AcquireOptions {
    opts(input, max_output).priority(Priority::High)
}

fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).expect("usage fits in u64")
}

fn req() -> LlmRequest {
    LlmRequest::new()
}

/// A bulkhead without a token budget.
fn plain(max_concurrent: u32) -> LlmBulkhead {
    LlmBulkhead::builder("test-model", max_concurrent)
        .build()
        .expect("valid configuration")
}

/// A bulkhead with a token budget and a high-priority reserve.
fn budgeted(max_concurrent: u32, budget: u64, reserve: u64) -> LlmBulkhead {
    LlmBulkhead::builder("test-model", max_concurrent)
        .token_budget(TokenBudget::new(budget).high_priority_reserve(reserve))
        .build()
        .expect("valid configuration")
}

/// The rejection of a refused acquire; panics on success or on an invalid-input error.
fn rejected<T: fmt::Debug>(result: Result<T, AcquireError>) -> Rejection {
    match result {
        Err(AcquireError::Rejected(rejection)) => rejection,
        other => panic!("expected a capacity rejection, got {other:?}"),
    }
}

/// The refusal reason of a refused acquire.
fn reason_of<T: fmt::Debug>(result: Result<T, AcquireError>) -> RejectReason {
    rejected(result).reason()
}

fn tokens(bulkhead: &LlmBulkhead) -> TokenBudgetStats {
    bulkhead
        .stats()
        .token_budget
        .expect("bulkhead has a token budget")
}

/// `(budget, in_flight_tokens, effective_budget, available, requested)` of a detail.
fn budget_figures(detail: &CapacityDetail) -> (u64, u64, u64, u64, u64) {
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
fn slot_figures(detail: &CapacityDetail) -> (u64, u64, u32, u64, u32) {
    (
        detail.limit_revision,
        detail.in_flight,
        detail.max_concurrent,
        detail.pending,
        detail.max_queue,
    )
}

/// `(held_tokens, refunded_tokens, usage)` of a release report.
fn report_figures(report: &ReleaseReport) -> (u64, u64, Option<TokenUsage>) {
    (report.held_tokens, report.refunded_tokens, report.usage)
}

/// `(total_reserved, total_consumed, total_refunded, total_overrun)`.
fn totals(t: &TokenBudgetStats) -> (u64, u64, u64, u64) {
    (
        t.total_reserved,
        t.total_consumed,
        t.total_refunded,
        t.total_overrun,
    )
}

/// All six rejection counters in declaration order.
fn counts(c: &RejectionCounts) -> [u64; 6] {
    [
        c.shutdown,
        c.concurrency_limit,
        c.budget_limit,
        c.queue_limit,
        c.timeout,
        c.aborted,
    ]
}

fn text(chars: usize) -> LlmRequest {
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

fn assert_valid_id(id: AdmissionId) {
    let uuid = id.to_uuid();
    assert_eq!(uuid.get_version_num(), 4, "{id}");
    assert_eq!(uuid.get_variant(), uuid::Variant::RFC4122, "{id}");
    assert_eq!(uuid.as_u128(), id.as_u128());
    assert_eq!(uuid::Uuid::from(id), uuid);
    assert_v4_uuid_text(&id.to_string());
}

// ===== builder validation =====

#[test]
fn builder_rejects_empty_model_with_exact_text() {
    let err = LlmBulkhead::builder("", 1).build().unwrap_err();
    assert_eq!(
        err,
        ConfigError::EmptyModel {
            model: String::new()
        }
    );
    assert_eq!(
        err.to_string(),
        r#"model must be a non-empty string (got "")"#
    );
}

#[test]
fn builder_rejects_whitespace_only_model_with_exact_text() {
    let err = LlmBulkhead::builder(" \t\n ", 1).build().unwrap_err();
    assert_eq!(
        err,
        ConfigError::EmptyModel {
            model: " \t\n ".to_owned()
        }
    );
    assert_eq!(
        err.to_string(),
        r#"model must be a non-empty string (got " \t\n ")"#
    );

    // Unicode whitespace is whitespace too (the original trims with JS `trim`).
    let err = LlmBulkhead::builder("\u{3000}\u{00A0}", 1)
        .build()
        .unwrap_err();
    assert!(matches!(err, ConfigError::EmptyModel { .. }), "{err:?}");
}

#[test]
fn builder_accepts_a_model_with_surrounding_whitespace() {
    let bulkhead = LlmBulkhead::builder("  gpt-4o  ", 1).build().unwrap();
    assert!(!bulkhead.model().trim().is_empty());
    assert_eq!(LlmBulkhead::builder("m", 1).build().unwrap().model(), "m");
}

#[test]
fn builder_rejects_max_concurrent_one_above_the_maximum() {
    assert_eq!(MAX_CONCURRENT, (1 << 16) - 1);
    let err = LlmBulkhead::builder("m", MAX_CONCURRENT + 1)
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        ConfigError::MaxConcurrentTooLarge {
            value: 65_536,
            max: 65_535
        }
    );
    assert_eq!(err.to_string(), "max_concurrent (65536) must be <= 65535");
}

#[test]
fn builder_rejects_max_concurrent_u32_max() {
    let err = LlmBulkhead::builder("m", u32::MAX).build().unwrap_err();
    assert_eq!(
        err,
        ConfigError::MaxConcurrentTooLarge {
            value: u32::MAX,
            max: MAX_CONCURRENT
        }
    );
    assert_eq!(
        err.to_string(),
        "max_concurrent (4294967295) must be <= 65535"
    );
}

#[test]
fn builder_rejects_initial_revision_one_above_the_maximum() {
    assert_eq!(MAX_REVISION, (1 << 53) - 1);
    let err = LlmBulkhead::builder("m", 1)
        .initial_revision(MAX_REVISION + 1)
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        ConfigError::InitialRevisionTooLarge {
            value: 9_007_199_254_740_992,
            max: 9_007_199_254_740_991
        }
    );
    assert_eq!(
        err.to_string(),
        "initial_revision (9007199254740992) must be <= 9007199254740991"
    );
}

#[test]
fn builder_rejects_initial_revision_u64_max() {
    let err = LlmBulkhead::builder("m", 1)
        .initial_revision(u64::MAX)
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        ConfigError::InitialRevisionTooLarge {
            value: u64::MAX,
            max: MAX_REVISION
        }
    );
    assert_eq!(
        err.to_string(),
        "initial_revision (18446744073709551615) must be <= 9007199254740991"
    );
}

#[test]
fn builder_rejects_reserve_above_budget() {
    let err = LlmBulkhead::builder("m", 1)
        .token_budget(TokenBudget::new(100).high_priority_reserve(101))
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        ConfigError::ReserveExceedsBudget {
            reserve: 101,
            budget: 100
        }
    );
    assert_eq!(
        err.to_string(),
        "token_budget.high_priority_reserve (101) must be <= token_budget.budget (100)"
    );

    let err = LlmBulkhead::builder("m", 1)
        .token_budget(TokenBudget::new(0).high_priority_reserve(u64::MAX))
        .build()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "token_budget.high_priority_reserve (18446744073709551615) must be <= token_budget.budget (0)"
    );
}

#[test]
fn builder_validation_order_is_model_concurrency_revision_reserve() {
    let bad_reserve = TokenBudget::new(1).high_priority_reserve(2);
    let all_bad = || {
        LlmBulkhead::builder(" ", u32::MAX)
            .initial_revision(u64::MAX)
            .token_budget(bad_reserve)
    };
    assert!(matches!(
        all_bad().build().unwrap_err(),
        ConfigError::EmptyModel { .. }
    ));

    let err = LlmBulkhead::builder("m", u32::MAX)
        .initial_revision(u64::MAX)
        .token_budget(bad_reserve)
        .build()
        .unwrap_err();
    assert!(
        matches!(err, ConfigError::MaxConcurrentTooLarge { .. }),
        "{err:?}"
    );

    let err = LlmBulkhead::builder("m", 1)
        .initial_revision(u64::MAX)
        .token_budget(bad_reserve)
        .build()
        .unwrap_err();
    assert!(
        matches!(err, ConfigError::InitialRevisionTooLarge { .. }),
        "{err:?}"
    );

    let err = LlmBulkhead::builder("m", 1)
        .token_budget(bad_reserve)
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        ConfigError::ReserveExceedsBudget {
            reserve: 2,
            budget: 1
        }
    );
}

#[test]
fn builder_defaults_are_revision_zero_no_queue_no_budget() {
    let bulkhead = plain(4);
    assert_eq!(bulkhead.limits(), Limits::new(0, 4));
    assert_eq!(bulkhead.limits().max_queue, 0);
    assert!(bulkhead.limits().token_budget.is_none());
    assert_eq!(DEFAULT_OUTPUT_CAP, 2048);
    assert_eq!(TokenBudget::new(5).output_cap, 2048);
    assert_eq!(TokenBudget::new(5).high_priority_reserve, 0);
}

#[test]
fn builder_is_cloneable_and_each_clone_builds_an_independent_bulkhead() {
    let builder: LlmBulkheadBuilder = LlmBulkhead::builder("m", 1).max_queue(3);
    let a = builder.clone().build().unwrap();
    let b = builder.build().unwrap();
    let _held = a.try_acquire(&req(), AcquireOptions::new()).unwrap();
    assert!(b.try_acquire(&req(), AcquireOptions::new()).is_ok());
    assert_eq!(a.limits().max_queue, 3);
}

#[test]
fn max_concurrent_zero_builds_fail_closed() {
    let bulkhead = LlmBulkhead::builder("m", 0).max_queue(5).build().unwrap();
    for _ in 0..3 {
        let rejection = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
        assert_eq!(rejection.reason(), RejectReason::ConcurrencyLimit);
        assert_eq!(slot_figures(rejection.detail()), (0, 0, 0, 0, 5));
        assert!(rejection.detail().token_budget.is_none());
        assert_eq!(
            rejection.to_string(),
            "bulkhead rejected: concurrency_limit (max_concurrent is 0)"
        );
    }
    assert_eq!(
        reason_of(
            bulkhead.try_acquire_owned(&req(), AcquireOptions::new().priority(Priority::High))
        ),
        RejectReason::ConcurrencyLimit
    );
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.rejected, stats.in_flight), (0, 4, 0));
    assert_eq!(stats.rejected_by_reason.concurrency_limit, 4);

    // With a budget too: a request that fits the budget still has no slot.
    let budgeted_zero = budgeted(0, 1000, 0);
    assert_eq!(
        reason_of(budgeted_zero.try_acquire(&req(), opts(1, 1))),
        RejectReason::ConcurrencyLimit
    );
}

#[test]
fn max_concurrent_at_the_maximum_is_accepted() {
    let bulkhead = plain(MAX_CONCURRENT);
    assert_eq!(bulkhead.limits().max_concurrent, MAX_CONCURRENT);
    let held: Vec<Permit<'_>> = (0..100)
        .map(|_| bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap())
        .collect();
    assert_eq!(bulkhead.stats().in_flight, 100);
    drop(held);
    assert_eq!(bulkhead.stats().in_flight, 0);
}

#[test]
fn initial_revision_at_the_maximum_is_accepted() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .initial_revision(MAX_REVISION)
        .build()
        .unwrap();
    assert_eq!(bulkhead.limits().revision, MAX_REVISION);
    let permit = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    assert_eq!(permit.limit_revision(), MAX_REVISION);
    let rejection = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
    assert_eq!(rejection.limit_revision(), MAX_REVISION);
}

#[test]
fn budget_zero_and_the_largest_budget_are_accepted_and_above_is_refused() {
    let zero = budgeted(1, 0, 0);
    assert_eq!(zero.limits(), Limits::new(0, 1).with_token_budget(0, 0));
    let t = tokens(&zero);
    assert_eq!((t.budget, t.available, t.in_flight_tokens), (0, 0, 0));

    assert_eq!(MAX_BUDGET, (1 << 35) - 1);
    let max = budgeted(1, MAX_BUDGET, 0);
    assert_eq!(
        max.limits(),
        Limits::new(0, 1).with_token_budget(MAX_BUDGET, 0)
    );
    let t = tokens(&max);
    assert_eq!(
        (t.budget, t.available, t.in_flight_tokens),
        (MAX_BUDGET, MAX_BUDGET, 0)
    );
    // The whole budget can be held at once.
    let permit = max.try_acquire(&req(), opts(MAX_BUDGET - 1, 1)).unwrap();
    assert_eq!(tokens(&max).in_flight_tokens, MAX_BUDGET);
    drop(permit);

    // Above it: a typed error, at build, apply_limits and set_budget, and nothing changes.
    let err = LlmBulkhead::builder("m", 1)
        .token_budget(TokenBudget::new(MAX_BUDGET + 1))
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        ConfigError::BudgetTooLarge {
            value: MAX_BUDGET + 1,
            max: MAX_BUDGET
        }
    );
    assert_eq!(
        err.to_string(),
        "token_budget.budget (34359738368) must be <= 34359738367"
    );
    let too_large = LimitsError::BudgetTooLarge {
        value: u64::MAX,
        max: MAX_BUDGET,
    };
    assert_eq!(max.set_budget(u64::MAX).unwrap_err(), too_large);
    assert_eq!(
        max.apply_limits(Limits::new(1, 1).with_token_budget(u64::MAX, 0))
            .unwrap_err(),
        too_large
    );
    assert_eq!(
        too_large.to_string(),
        "limits.token_budget.budget (18446744073709551615) must be <= 34359738367"
    );
    assert_eq!(
        max.limits(),
        Limits::new(0, 1).with_token_budget(MAX_BUDGET, 0)
    );
}

#[test]
fn reserve_equal_to_budget_is_accepted_and_leaves_normal_priority_nothing() {
    let bulkhead = budgeted(4, 500, 500);
    assert_eq!(
        bulkhead.limits().effective_budget(Priority::Normal),
        Some(0)
    );
    let rejection = rejected(bulkhead.try_acquire(&req(), opts(1, 0)));
    assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
    assert_eq!(budget_figures(rejection.detail()), (500, 0, 0, 0, 1));
    let permit = bulkhead.try_acquire(&req(), high(200, 300)).unwrap();
    assert_eq!(permit.held_tokens(), 500);
}

#[test]
fn output_cap_zero_is_accepted_and_reserves_no_output() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .token_budget(TokenBudget::new(10).output_cap(0))
        .build()
        .unwrap();
    assert_eq!(bulkhead.estimate(&text(8)).unwrap(), Some(res(2, 0)));
    // max_tokens still wins over the cap.
    assert_eq!(
        bulkhead.estimate(&text(8).max_tokens(5)).unwrap(),
        Some(res(2, 5))
    );
    let permit = bulkhead
        .try_acquire(&text(40), AcquireOptions::new())
        .unwrap();
    assert_eq!(permit.reservation(), Some(res(10, 0)));
    assert_eq!(permit.held_tokens(), 10);
}

// ===== try_acquire: reasons and their order =====

#[test]
fn closed_bulkhead_says_shutdown_even_when_over_budget_and_out_of_slots() {
    let bulkhead = budgeted(1, 100, 0);
    let _held = bulkhead.try_acquire(&req(), opts(50, 0)).unwrap();
    assert!(bulkhead.close());

    // Over budget (50 + 200 > 100) and no free slot: shutdown wins.
    let rejection = rejected(bulkhead.try_acquire(&req(), opts(100, 100)));
    assert_eq!(rejection.reason(), RejectReason::Shutdown);
    assert_eq!(slot_figures(rejection.detail()), (0, 1, 1, 0, 0));
    assert_eq!(budget_figures(rejection.detail()), (100, 50, 100, 50, 200));
    assert_eq!(
        rejection.to_string(),
        "bulkhead rejected: shutdown (the bulkhead is closed)"
    );
    // The same for the owned flavour and for high priority.
    assert_eq!(
        reason_of(bulkhead.try_acquire_owned(&req(), high(1000, 1000))),
        RejectReason::Shutdown
    );

    // A closed bulkhead with zero slots and a zero budget also says shutdown.
    let zero = budgeted(0, 0, 0);
    zero.close();
    assert_eq!(
        reason_of(zero.try_acquire(&req(), opts(5, 5))),
        RejectReason::Shutdown
    );
    // And one without a budget.
    let unbudgeted = plain(0);
    unbudgeted.close();
    assert_eq!(
        reason_of(unbudgeted.try_acquire(&req(), AcquireOptions::new())),
        RejectReason::Shutdown
    );

    let stats = bulkhead.stats();
    assert_eq!(counts(&stats.rejected_by_reason), [2, 0, 0, 0, 0, 0]);
    assert_eq!(stats.rejected, 2);
}

#[test]
fn budget_is_checked_before_concurrency() {
    let bulkhead = budgeted(1, 1000, 0);
    let _held = bulkhead.try_acquire(&req(), opts(600, 0)).unwrap();

    // 600 + 500 > 1000 and no slot: the budget reason is reported.
    let rejection = rejected(bulkhead.try_acquire(&req(), opts(500, 0)));
    assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
    assert_eq!(
        budget_figures(rejection.detail()),
        (1000, 600, 1000, 400, 500)
    );

    // 600 + 400 fits exactly, but there is no slot.
    let rejection = rejected(bulkhead.try_acquire(&req(), opts(400, 0)));
    assert_eq!(rejection.reason(), RejectReason::ConcurrencyLimit);
    assert_eq!(slot_figures(rejection.detail()), (0, 1, 1, 0, 0));
    assert_eq!(
        budget_figures(rejection.detail()),
        (1000, 600, 1000, 400, 400)
    );

    // max_concurrent 0 with an over-budget request: budget still comes first.
    let zero_slots = budgeted(0, 10, 0);
    assert_eq!(
        reason_of(zero_slots.try_acquire(&req(), opts(11, 0))),
        RejectReason::BudgetLimit
    );
    assert_eq!(
        reason_of(zero_slots.try_acquire(&req(), opts(10, 0))),
        RejectReason::ConcurrencyLimit
    );

    let counts_now = bulkhead.stats().rejected_by_reason;
    assert_eq!(counts(&counts_now), [0, 1, 1, 0, 0, 0]);
}

#[test]
fn exact_fit_admits_and_one_more_token_is_refused() {
    let bulkhead = budgeted(4, 1000, 0);
    let a = bulkhead.try_acquire(&req(), opts(400, 600)).unwrap();
    assert_eq!(a.held_tokens(), 1000);
    let t = tokens(&bulkhead);
    assert_eq!((t.in_flight_tokens, t.available), (1000, 0));

    // T + 0 = B is not above B: a 0-token request still fits.
    let b = bulkhead.try_acquire(&req(), opts(0, 0)).unwrap();
    assert_eq!(b.held_tokens(), 0);

    let rejection = rejected(bulkhead.try_acquire(&req(), opts(0, 1)));
    assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
    assert_eq!(budget_figures(rejection.detail()), (1000, 1000, 1000, 0, 1));
    assert_eq!(rejection.detail().in_flight, 2);

    drop(a);
    let c = bulkhead.try_acquire(&req(), opts(1000, 0)).unwrap();
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 1000);
    drop((b, c));
}

#[test]
fn budget_zero_admits_zero_token_requests_only() {
    let bulkhead = budgeted(4, 0, 0);
    let permit = bulkhead.try_acquire(&req(), opts(0, 0)).unwrap();
    assert_eq!(permit.reservation(), Some(Reservation::new(0, 0).unwrap()));
    assert_eq!(permit.held_tokens(), 0);

    // An estimate of 0 is admitted too (empty request, max_tokens 0).
    let estimated = bulkhead
        .try_acquire(&req().max_tokens(0), AcquireOptions::new())
        .unwrap();
    assert_eq!(estimated.reservation(), Some(res(0, 0)));

    for o in [opts(0, 1), opts(1, 0), high(1, 0)] {
        let rejection = rejected(bulkhead.try_acquire(&req(), o));
        assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
        assert_eq!(budget_figures(rejection.detail()), (0, 0, 0, 0, 1));
    }
    // The default estimate of an empty request is 0 + 2048.
    let rejection = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
    assert_eq!(budget_figures(rejection.detail()), (0, 0, 0, 0, 2048));

    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.in_flight, stats.rejected), (2, 2, 4));
    assert_eq!(stats.rejected_by_reason.budget_limit, 4);
}

#[test]
fn tokens_above_the_budget_after_a_shrink_refuse_even_zero_token_requests() {
    let bulkhead = budgeted(4, 1000, 0);
    let held = bulkhead.try_acquire(&req(), opts(800, 0)).unwrap();
    let now = bulkhead.set_budget(500).unwrap();
    assert_eq!(now.token_budget.unwrap().budget, 500);

    for o in [opts(0, 0), high(0, 0)] {
        let rejection = rejected(bulkhead.try_acquire(&req(), o));
        assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
        assert_eq!(budget_figures(rejection.detail()), (500, 800, 500, 0, 0));
        assert_eq!(rejection.limit_revision(), 1);
    }
    let t = tokens(&bulkhead);
    assert_eq!((t.budget, t.in_flight_tokens, t.available), (500, 800, 0));

    drop(held);
    let a = bulkhead.try_acquire(&req(), opts(0, 0)).unwrap();
    let b = bulkhead.try_acquire(&req(), opts(500, 0)).unwrap();
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 500);
    drop((a, b));
}

#[test]
fn high_priority_reserve_follows_the_upstream_example() {
    let bulkhead = budgeted(4, 2400, 400);
    let first = bulkhead.try_acquire(&req(), opts(100, 1000)).unwrap();
    assert_eq!(first.priority(), Priority::Normal);

    let rejection = rejected(bulkhead.try_acquire(&req(), opts(100, 1000)));
    assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
    let detail = rejection.detail();
    assert_eq!(slot_figures(detail), (0, 1, 4, 0, 0));
    assert_eq!(budget_figures(detail), (2400, 1100, 2000, 900, 1100));
    assert_eq!(
        rejection.to_string(),
        "bulkhead rejected: budget_limit (requested 1100 tokens, 900 of effective budget 2000 available, 1100 in flight)"
    );

    let second = bulkhead.try_acquire(&req(), high(100, 1000)).unwrap();
    assert_eq!(second.priority(), Priority::High);
    let t = tokens(&bulkhead);
    assert_eq!((t.in_flight_tokens, t.available), (2200, 200));

    // 2200 + 1100 > 2400 even for high priority.
    let rejection = rejected(bulkhead.try_acquire(&req(), high(100, 1000)));
    assert_eq!(
        budget_figures(rejection.detail()),
        (2400, 2200, 2400, 200, 1100)
    );

    // Priority through `From<Priority>` works the same way.
    let options: AcquireOptions = Priority::High.into();
    assert_eq!(options.priority, Priority::High);
    let third = bulkhead
        .try_acquire(&req().max_tokens(200), options)
        .unwrap();
    assert_eq!(third.held_tokens(), 200);
    drop((first, second, third));
}

#[test]
fn reserve_above_a_shrunken_budget_leaves_normal_nothing_and_high_everything() {
    let bulkhead = budgeted(4, 1000, 400);
    let now = bulkhead.set_budget(300).unwrap();
    let budget = now.token_budget.unwrap();
    assert_eq!((budget.budget, budget.high_priority_reserve), (300, 400));

    let rejection = rejected(bulkhead.try_acquire(&req(), opts(0, 1)));
    assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
    assert_eq!(budget_figures(rejection.detail()), (300, 0, 0, 0, 1));

    let zero = bulkhead.try_acquire(&req(), opts(0, 0)).unwrap();
    let all = bulkhead.try_acquire(&req(), high(100, 200)).unwrap();
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 300);
    let rejection = rejected(bulkhead.try_acquire(&req(), high(0, 1)));
    assert_eq!(budget_figures(rejection.detail()), (300, 300, 300, 0, 1));
    drop((zero, all));
}

#[test]
fn token_sum_overflow_is_a_budget_refusal_not_a_panic() {
    const M: u64 = MAX_BUDGET;
    let bulkhead = budgeted(8, M, 0);
    let small = bulkhead.try_acquire(&req(), opts(0, 2)).unwrap();

    for (o, requested) in [
        (opts(0, u64::MAX), u64::MAX),
        (high(u64::MAX, 0), u64::MAX),
        (opts(M, 0), M),
    ] {
        let rejection = rejected(bulkhead.try_acquire(&req(), o));
        assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
        assert_eq!(
            budget_figures(rejection.detail()),
            (M, 2, M, M - 2, requested)
        );
    }
    let rejection = rejected(bulkhead.try_acquire(&req(), opts(0, u64::MAX)));
    assert_eq!(
        rejection.to_string(),
        "bulkhead rejected: budget_limit (requested 18446744073709551615 tokens, \
         34359738365 of effective budget 34359738367 available, 2 in flight)"
    );
    assert_eq!(
        bulkhead.would_admit(&req(), opts(0, u64::MAX)).unwrap(),
        Verdict::Reject(RejectReason::BudgetLimit)
    );

    // Filling the budget exactly to the largest one works; then only 0-token requests fit.
    let rest = bulkhead.try_acquire(&req(), opts(M - 3, 1)).unwrap();
    let t = tokens(&bulkhead);
    assert_eq!(
        (t.in_flight_tokens, t.available, t.total_reserved),
        (M, 0, M)
    );
    let zero = bulkhead.try_acquire(&req(), opts(0, 0)).unwrap();
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), high(0, 1))),
        RejectReason::BudgetLimit
    );
    drop((small, rest, zero));
    let t = tokens(&bulkhead);
    assert_eq!((t.in_flight_tokens, t.available), (0, M));
    assert_eq!(bulkhead.stats().rejected_by_reason.budget_limit, 5);
}

#[test]
fn full_slots_refuse_with_concurrency_limit_until_a_release() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .initial_revision(6)
        .build()
        .unwrap();
    let a = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    let b = bulkhead
        .try_acquire_owned(&req(), AcquireOptions::new())
        .unwrap();
    let rejection = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
    assert_eq!(rejection.reason(), RejectReason::ConcurrencyLimit);
    assert_eq!(rejection.limit_revision(), 6);
    assert_eq!(slot_figures(rejection.detail()), (6, 2, 2, 0, 0));
    assert!(rejection.detail().token_budget.is_none());
    assert_eq!(
        rejection.to_string(),
        "bulkhead rejected: concurrency_limit (2 of 2 slots in flight)"
    );
    drop(a);
    let c = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    drop((b, c));
    assert_eq!(bulkhead.stats().in_flight, 0);
}

#[test]
fn try_acquire_never_waits_even_with_a_queue_configured() {
    let bulkhead = LlmBulkhead::builder("m", 1).max_queue(3).build().unwrap();
    let _held = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    let rejection = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
    assert_eq!(rejection.reason(), RejectReason::ConcurrencyLimit);
    assert_eq!(slot_figures(rejection.detail()), (0, 1, 1, 0, 3));
    assert_eq!(bulkhead.stats().pending, 0);
}

#[test]
fn clones_share_one_bulkhead() {
    let a = plain(1);
    let b = a.clone();
    let _held = a.try_acquire(&req(), AcquireOptions::new()).unwrap();
    assert_eq!(
        reason_of(b.try_acquire(&req(), AcquireOptions::new())),
        RejectReason::ConcurrencyLimit
    );
    assert_eq!(b.stats().in_flight, 1);
    assert_eq!(a.stats().rejected, 1);
    b.close();
    assert!(a.is_closed());
}

// ===== reservation resolution =====

#[test]
fn naive_estimate_is_ceil_chars_over_four_plus_default_output_cap() {
    let bulkhead = budgeted(1, 1_000_000, 0);
    assert_eq!(bulkhead.estimate(&text(400)).unwrap(), Some(res(100, 2048)));
    assert_eq!(bulkhead.estimate(&text(401)).unwrap(), Some(res(101, 2048)));
    assert_eq!(bulkhead.estimate(&text(1)).unwrap(), Some(res(1, 2048)));
    assert_eq!(bulkhead.estimate(&text(3)).unwrap(), Some(res(1, 2048)));
    assert_eq!(bulkhead.estimate(&req()).unwrap(), Some(res(0, 2048)));
    assert_eq!(
        bulkhead.estimate(&req().user("")).unwrap(),
        Some(res(0, 2048))
    );
}

#[test]
fn system_prompt_and_every_message_count_before_rounding() {
    let bulkhead = budgeted(1, 1_000_000, 0);
    // user 4 + system 8 chars -> ceil(12 / 4) = 3 (upstream §13.2 example).
    let request = req().user("abcd").system("12345678");
    assert_eq!(bulkhead.estimate(&request).unwrap(), Some(res(3, 2048)));
    // A system prompt alone counts.
    assert_eq!(
        bulkhead.estimate(&req().system("x".repeat(40))).unwrap(),
        Some(res(10, 2048))
    );
    // Characters are summed over all messages before rounding up: 1 + 1 chars -> 1 token.
    let request = req().user("a").message("assistant", "b");
    assert_eq!(bulkhead.estimate(&request).unwrap(), Some(res(1, 2048)));
    let request = req()
        .user("x".repeat(5))
        .message("assistant", "y".repeat(5))
        .user("z".repeat(5));
    assert_eq!(bulkhead.estimate(&request).unwrap(), Some(res(4, 2048)));
}

#[test]
fn extra_input_tokens_and_max_tokens_shape_the_estimate() {
    let bulkhead = budgeted(1, 1_000_000, 0);
    let request = text(10).extra_input_tokens(300).max_tokens(64);
    assert_eq!(bulkhead.estimate(&request).unwrap(), Some(res(303, 64)));
    assert_eq!(
        bulkhead.estimate(&req().extra_input_tokens(7)).unwrap(),
        Some(res(7, 2048))
    );
    assert_eq!(
        bulkhead.estimate(&text(4).max_tokens(0)).unwrap(),
        Some(res(1, 0))
    );

    // A custom output cap replaces 2048 only when max_tokens is absent.
    let custom = LlmBulkhead::builder("m", 1)
        .token_budget(TokenBudget::new(1_000_000).output_cap(4096))
        .build()
        .unwrap();
    assert_eq!(custom.estimate(&text(4)).unwrap(), Some(res(1, 4096)));
    assert_eq!(
        custom.estimate(&text(4).max_tokens(10)).unwrap(),
        Some(res(1, 10))
    );
}

#[test]
fn text_is_counted_in_utf16_code_units() {
    let bulkhead = budgeted(1, 1_000_000, 0);
    // Four emoji: 4 chars, 16 bytes, 8 UTF-16 units -> ceil(8 / 4) = 2.
    let emoji = req().user("\u{1F600}".repeat(4));
    assert_eq!(emoji.text_len(), 8);
    assert_eq!(bulkhead.estimate(&emoji).unwrap(), Some(res(2, 2048)));
    // One emoji counts 2.
    assert_eq!(req().user("\u{1F600}").text_len(), 2);
    // Two-byte UTF-8 letters count 1 each: 4 units (8 bytes) -> 1.
    let accents = req().user("é".repeat(4));
    assert_eq!(accents.text_len(), 4);
    assert_eq!(bulkhead.estimate(&accents).unwrap(), Some(res(1, 2048)));
    // Three-byte UTF-8 characters in the BMP count 1 each: 5 units (15 bytes) -> 2.
    let cjk = req().user("日本語です");
    assert_eq!(cjk.text_len(), 5);
    assert_eq!(bulkhead.estimate(&cjk).unwrap(), Some(res(2, 2048)));
    // Mixed, in the system prompt: 2 + 1 + 2 = 5 -> 2.
    let mixed = req().system("\u{1F600}a\u{10FFFF}");
    assert_eq!(mixed.text_len(), 5);
    assert_eq!(bulkhead.estimate(&mixed).unwrap(), Some(res(2, 2048)));
}

#[test]
fn opaque_blocks_count_zero() {
    let bulkhead = budgeted(1, 1_000_000, 0);
    let blocks = Content::Blocks(vec![
        ContentBlock::text("abcd"),
        ContentBlock::opaque("image"),
        ContentBlock::text("efgh"),
        ContentBlock::opaque("document"),
    ]);
    let request = req().user(blocks);
    assert_eq!(request.text_len(), 8);
    assert_eq!(bulkhead.estimate(&request).unwrap(), Some(res(2, 2048)));

    let only_opaque = req()
        .user(vec![
            ContentBlock::opaque("image"),
            ContentBlock::opaque("text"),
        ])
        .system(Content::Blocks(vec![]));
    assert_eq!(only_opaque.text_len(), 0);
    assert_eq!(bulkhead.estimate(&only_opaque).unwrap(), Some(res(0, 2048)));
}

#[test]
fn admission_uses_the_estimate_when_no_override_is_given() {
    let bulkhead = budgeted(2, 10_000, 0);
    let request = text(401).max_tokens(99);
    let permit = bulkhead
        .try_acquire(&request, AcquireOptions::new())
        .unwrap();
    assert_eq!(permit.reservation(), Some(res(101, 99)));
    assert_eq!(permit.held_tokens(), 200);
    let t = tokens(&bulkhead);
    assert_eq!((t.in_flight_tokens, t.total_reserved), (200, 200));
}

#[test]
fn an_override_skips_the_estimator() {
    let bulkhead = budgeted(2, 10_000, 0);
    // This request's estimate is unrepresentable; an override never asks for it.
    let poisoned = text(8).extra_input_tokens(u64::MAX);
    assert!(bulkhead.estimate(&poisoned).is_err());
    let permit = bulkhead.try_acquire(&poisoned, opts(5, 7)).unwrap();
    assert_eq!(permit.reservation(), Some(res(5, 7)));
    assert_eq!(permit.held_tokens(), 12);
    assert_eq!(
        bulkhead.would_admit(&poisoned, opts(5, 7)).unwrap(),
        Verdict::Admit
    );
    // And the override replaces a perfectly good estimate too.
    let other = bulkhead.try_acquire(&text(4000), opts(1, 1)).unwrap();
    assert_eq!(other.held_tokens(), 2);
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 14);
}

#[test]
fn estimate_round_trips_as_the_override() {
    let bulkhead = budgeted(2, 10_000, 0);
    let request = req()
        .system("be brief")
        .user("x".repeat(123))
        .extra_input_tokens(9);
    let preview = bulkhead.estimate(&request).unwrap().unwrap();
    // chars 8 + 123 = 131 -> 33, plus 9 extra.
    assert_eq!(preview, res(42, 2048));
    assert_eq!(preview.reserved(), preview.input() + preview.max_output());
    let stored =
        Reservation::with_reserved(preview.input(), preview.max_output(), preview.reserved())
            .unwrap();
    assert_eq!(stored, preview);

    let a = bulkhead
        .try_acquire(&req(), AcquireOptions::new().reservation(stored))
        .unwrap();
    let b = bulkhead
        .try_acquire(&request, AcquireOptions::new())
        .unwrap();
    assert_eq!(a.reservation(), Some(preview));
    assert_eq!(b.reservation(), Some(preview));
    assert_eq!(a.held_tokens(), b.held_tokens());
    // estimate() never reserves anything.
    assert_eq!(tokens(&bulkhead).total_reserved, 2 * 2090);
}

#[test]
fn without_a_budget_nothing_is_estimated_and_overrides_are_ignored() {
    let bulkhead = plain(4);
    let request = text(400).max_tokens(100);
    assert_eq!(bulkhead.estimate(&request).unwrap(), None);

    let permit = bulkhead
        .try_acquire(&request, AcquireOptions::new())
        .unwrap();
    assert_eq!(permit.reservation(), None);
    assert_eq!(permit.held_tokens(), 0);

    let overridden = bulkhead.try_acquire(&request, opts(100, 1000)).unwrap();
    assert_eq!(overridden.reservation(), None);
    assert_eq!(overridden.held_tokens(), 0);

    // Even an unrepresentable estimate is never computed.
    let poisoned = text(8).extra_input_tokens(u64::MAX).max_tokens(u64::MAX);
    assert_eq!(bulkhead.estimate(&poisoned).unwrap(), None);
    let owned = bulkhead
        .try_acquire_owned(&poisoned, AcquireOptions::new())
        .unwrap();
    assert_eq!(owned.reservation(), None);
    assert_eq!(
        bulkhead
            .would_admit(&poisoned, AcquireOptions::new())
            .unwrap(),
        Verdict::Admit
    );

    let report = overridden.release(Some(usage(30, 40)));
    assert_eq!(report_figures(&report), (0, 0, Some(usage(30, 40))));
    drop((permit, owned));
    let stats = bulkhead.stats();
    assert!(stats.token_budget.is_none());
    assert_eq!((stats.admitted, stats.released, stats.in_flight), (3, 3, 0));
}

#[test]
fn input_overflow_is_invalid_everywhere_and_counts_nothing() {
    let bulkhead = budgeted(2, 1000, 0);
    let fresh = bulkhead.stats();
    let request = text(8).extra_input_tokens(u64::MAX);
    let expected = RequestError::InputOverflow {
        text_tokens: 2,
        opaque_tokens: 0,
        extra_input_tokens: u64::MAX,
    };

    let err = bulkhead
        .try_acquire(&request, AcquireOptions::new())
        .unwrap_err();
    assert_eq!(err, AcquireError::Invalid(expected));
    assert!(err.rejection().is_none());
    assert_eq!(
        err.to_string(),
        "invalid request: estimated input (2 text tokens + 0 opaque-block tokens + 18446744073709551615 extra input tokens) does not fit in 64 bits"
    );
    assert_eq!(
        bulkhead
            .try_acquire_owned(&request, AcquireOptions::new().priority(Priority::High))
            .unwrap_err(),
        AcquireError::Invalid(expected)
    );
    assert_eq!(bulkhead.estimate(&request).unwrap_err(), expected);
    assert_eq!(
        bulkhead
            .would_admit(&request, AcquireOptions::new())
            .unwrap_err(),
        expected
    );
    assert_eq!(
        bulkhead
            .would_admit_with_detail(&request, AcquireOptions::new())
            .unwrap_err(),
        expected
    );

    let stats = bulkhead.stats();
    assert_eq!(stats, fresh);
    assert_eq!((stats.admitted, stats.rejected), (0, 0));
    assert_eq!(totals(&stats.token_budget.unwrap()), (0, 0, 0, 0));
}

#[test]
fn reservation_overflow_is_invalid_everywhere_and_counts_nothing() {
    let bulkhead = budgeted(2, MAX_BUDGET, 0);
    let fresh = bulkhead.stats();
    let request = text(8).max_tokens(u64::MAX);
    let expected = RequestError::ReservationOverflow {
        input: 2,
        max_output: u64::MAX,
    };
    let err = bulkhead
        .try_acquire(&request, AcquireOptions::new())
        .unwrap_err();
    assert_eq!(err, AcquireError::Invalid(expected));
    assert_eq!(
        err.to_string(),
        "invalid request: token reservation (2 input + 18446744073709551615 max output) does not fit in 64 bits"
    );
    assert_eq!(
        bulkhead
            .try_acquire_owned(&request, AcquireOptions::new())
            .unwrap_err(),
        AcquireError::Invalid(expected)
    );
    assert_eq!(bulkhead.estimate(&request).unwrap_err(), expected);
    assert_eq!(
        bulkhead
            .would_admit(&request, AcquireOptions::new())
            .unwrap_err(),
        expected
    );

    // The output cap can overflow too, when the request names no max_tokens.
    let capped = LlmBulkhead::builder("m", 1)
        .token_budget(TokenBudget::new(MAX_BUDGET).output_cap(u64::MAX))
        .build()
        .unwrap();
    assert_eq!(capped.estimate(&req()).unwrap(), Some(res(0, u64::MAX)));
    let expected_cap = RequestError::ReservationOverflow {
        input: 1,
        max_output: u64::MAX,
    };
    assert_eq!(capped.estimate(&text(4)).unwrap_err(), expected_cap);
    assert_eq!(
        capped
            .try_acquire(&text(4), AcquireOptions::new())
            .unwrap_err(),
        AcquireError::Invalid(expected_cap)
    );

    assert_eq!(bulkhead.stats(), fresh);
    let stats = capped.stats();
    assert_eq!((stats.admitted, stats.rejected), (0, 0));
}

#[test]
fn invalid_input_wins_over_shutdown_and_capacity() {
    let bulkhead = budgeted(0, 0, 0);
    bulkhead.close();
    let fresh = bulkhead.stats();
    let request = text(8).extra_input_tokens(u64::MAX);
    assert!(matches!(
        bulkhead.try_acquire(&request, AcquireOptions::new()),
        Err(AcquireError::Invalid(RequestError::InputOverflow { .. }))
    ));
    assert!(matches!(
        bulkhead.would_admit(&request, AcquireOptions::new()),
        Err(RequestError::InputOverflow { .. })
    ));
    assert_eq!(bulkhead.stats(), fresh);
    assert_eq!(bulkhead.stats().rejected, 0);
}

#[test]
fn reservation_and_usage_constructors_refuse_unrepresentable_values() {
    assert_eq!(
        Reservation::new(u64::MAX, 1),
        Err(RequestError::ReservationOverflow {
            input: u64::MAX,
            max_output: 1
        })
    );
    assert_eq!(Reservation::new(u64::MAX, 0).unwrap().reserved(), u64::MAX);
    assert_eq!(
        Reservation::with_reserved(100, 1000, 999),
        Err(RequestError::ReservedMismatch {
            reserved: 999,
            input: 100,
            max_output: 1000
        })
    );
    assert_eq!(
        Reservation::with_reserved(u64::MAX, 1, 0),
        Err(RequestError::ReservationOverflow {
            input: u64::MAX,
            max_output: 1
        })
    );
    assert_eq!(
        res(100, 1000).to_string(),
        "1100 tokens (100 input + 1000 max output)"
    );
    let err = TokenUsage::new(u64::MAX, 1).unwrap_err();
    assert_eq!(
        err,
        UsageError::TotalOverflow {
            input: u64::MAX,
            output: 1
        }
    );
    assert_eq!(
        err.to_string(),
        "token usage total (18446744073709551615 input + 1 output) does not fit in 64 bits"
    );
    assert_eq!(usage(3, 4).total(), 7);
}

// ===== permits and token accounting =====

#[test]
fn release_with_usage_below_the_hold_refunds_the_rest() {
    let bulkhead = budgeted(2, 5000, 0);
    let permit = bulkhead.try_acquire(&req(), opts(100, 1000)).unwrap();
    assert_eq!(permit.held_tokens(), 1100);
    let report = permit.release(Some(usage(20, 5)));
    assert_eq!(report_figures(&report), (1100, 1075, Some(usage(20, 5))));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 25, 1075, 0));
    assert_eq!((t.in_flight_tokens, t.available), (0, 5000));
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released, stats.in_flight), (1, 1, 0));
}

#[test]
fn release_with_usage_above_the_hold_refunds_nothing() {
    let bulkhead = budgeted(2, 5000, 0);
    let permit = bulkhead.try_acquire_owned(&req(), opts(100, 1000)).unwrap();
    let report = permit.release(Some(usage(100, 1400)));
    assert_eq!(report_figures(&report), (1100, 0, Some(usage(100, 1400))));
    // The 400 tokens used beyond the reservation are booked as overrun at release (as a
    // report would have), so reserved + overrun == consumed + refunded.
    assert_eq!(report.overrun_tokens, 400);
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1100, 1500, 0, 400));
    assert_eq!(t.in_flight_tokens, 0);
}

#[test]
fn release_with_usage_equal_to_the_hold_refunds_nothing() {
    let bulkhead = budgeted(2, 5000, 0);
    let permit = bulkhead.try_acquire(&req(), opts(100, 1000)).unwrap();
    let report = permit.release(Some(usage(100, 1000)));
    assert_eq!(report_figures(&report), (1100, 0, Some(usage(100, 1000))));
    assert_eq!(totals(&tokens(&bulkhead)), (1100, 1100, 0, 0));
}

#[test]
fn release_without_usage_returns_the_hold_and_books_nothing() {
    let bulkhead = budgeted(2, 5000, 0);
    let permit = bulkhead.try_acquire(&req(), opts(100, 1000)).unwrap();
    let owned = bulkhead.try_acquire_owned(&req(), opts(10, 20)).unwrap();
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 1130);

    let report = permit.release(None);
    assert_eq!(report_figures(&report), (1100, 0, None));
    let report = owned.release(None);
    assert_eq!(report_figures(&report), (30, 0, None));

    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (1130, 0, 0, 0));
    assert_eq!(t.in_flight_tokens, 0);
    assert_eq!(bulkhead.stats().released, 2);
}

#[test]
fn dropping_a_permit_returns_the_hold_and_books_nothing() {
    let bulkhead = budgeted(2, 5000, 0);
    {
        let _permit = bulkhead.try_acquire(&req(), opts(100, 1000)).unwrap();
        let _owned = bulkhead.try_acquire_owned(&req(), opts(1, 2)).unwrap();
        let stats = bulkhead.stats();
        assert_eq!(stats.in_flight, 2);
        assert_eq!(stats.token_budget.unwrap().in_flight_tokens, 1103);
        // Both slots are taken.
        assert_eq!(
            reason_of(bulkhead.try_acquire(&req(), opts(0, 0))),
            RejectReason::ConcurrencyLimit
        );
    }
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released, stats.in_flight), (2, 2, 0));
    let t = stats.token_budget.unwrap();
    assert_eq!(totals(&t), (1103, 0, 0, 0));
    assert_eq!(t.in_flight_tokens, 0);
    // The capacity is really back.
    let again = bulkhead.try_acquire(&req(), opts(2500, 2500)).unwrap();
    assert_eq!(again.held_tokens(), 5000);
}

#[test]
fn usage_reaches_total_consumed_even_with_a_zero_token_hold() {
    // RUST-DESIGN Q3: upstream drops usage when the hold is 0; the port books it.
    let bulkhead = budgeted(2, 1000, 0);
    let permit = bulkhead.try_acquire(&req(), opts(0, 0)).unwrap();
    assert_eq!(permit.held_tokens(), 0);
    let report = permit.release(Some(usage(7, 3)));
    assert_eq!(report_figures(&report), (0, 0, Some(usage(7, 3))));
    assert_eq!(report.overrun_tokens, 10); // all of it beyond the zero reservation
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (0, 10, 0, 10));
    assert_eq!(t.in_flight_tokens, 0);

    // Same on a zero budget, with the owned flavour.
    let zero = budgeted(1, 0, 0);
    let owned = zero.try_acquire_owned(&req(), opts(0, 0)).unwrap();
    owned.release(Some(usage(7, 3)));
    assert_eq!(totals(&tokens(&zero)), (0, 10, 0, 10));
}

#[test]
fn books_balance_after_everything_settles_with_usage_within_the_hold() {
    let bulkhead = budgeted(16, 100_000, 10_000);
    let plan: [(u64, u64, Priority, u64, u64); 6] = [
        (100, 1000, Priority::Normal, 20, 5),
        (100, 1000, Priority::High, 100, 1000),
        (0, 2048, Priority::Normal, 0, 0),
        (5000, 5000, Priority::High, 4000, 1),
        (1, 1, Priority::Normal, 1, 0),
        (333, 0, Priority::Normal, 300, 0),
    ];
    let permits: Vec<_> = plan
        .iter()
        .map(|&(i, o, p, _, _)| {
            bulkhead
                .try_acquire_owned(&req(), opts(i, o).priority(p))
                .unwrap()
        })
        .collect();
    let reserved: u64 = plan.iter().map(|&(i, o, ..)| i + o).sum();
    assert_eq!(tokens(&bulkhead).in_flight_tokens, reserved);

    let mut refunded = 0;
    let mut consumed = 0;
    for (permit, &(i, o, p, ui, uo)) in permits.into_iter().zip(plan.iter()) {
        assert_eq!(permit.priority(), p);
        let report = permit.release(Some(usage(ui, uo)));
        assert_eq!(report.held_tokens, i + o);
        assert_eq!(report.refunded_tokens, i + o - (ui + uo));
        refunded += report.refunded_tokens;
        consumed += ui + uo;
    }
    let t = tokens(&bulkhead);
    assert_eq!(t.in_flight_tokens, 0);
    assert_eq!(totals(&t), (reserved, consumed, refunded, 0));
    assert_eq!(
        t.total_reserved + t.total_overrun,
        t.total_consumed + t.total_refunded
    );
    assert_eq!((reserved, consumed, refunded), (14_583, 5_427, 9_156));
}

#[test]
fn owned_permit_outlives_every_bulkhead_handle() {
    let bulkhead = budgeted(1, 5000, 0);
    let permit = bulkhead.try_acquire_owned(&req(), opts(100, 1000)).unwrap();
    drop(bulkhead);
    assert_eq!(permit.held_tokens(), 1100);
    assert_eq!(permit.limit_revision(), 0);
    assert_valid_id(permit.admission_id());
    let report = permit.release(Some(usage(20, 5)));
    assert_eq!(report_figures(&report), (1100, 1075, Some(usage(20, 5))));

    // Dropping (rather than releasing) after the handle is gone is fine too.
    let bulkhead = plain(1);
    let permit = bulkhead
        .try_acquire_owned(&req(), AcquireOptions::new())
        .unwrap();
    drop(bulkhead);
    drop(permit);
}

#[test]
fn owned_permit_moves_to_another_thread_after_the_handle_is_dropped() {
    let bulkhead = budgeted(1, 5000, 0);
    let observer = bulkhead.clone();
    let permit: OwnedPermit = bulkhead.try_acquire_owned(&req(), opts(100, 1000)).unwrap();
    drop(bulkhead);
    let report = std::thread::spawn(move || permit.release(Some(usage(20, 5))))
        .join()
        .unwrap();
    assert_eq!(report_figures(&report), (1100, 1075, Some(usage(20, 5))));
    let stats = observer.stats();
    assert_eq!((stats.admitted, stats.released, stats.in_flight), (1, 1, 0));
    let t = stats.token_budget.unwrap();
    assert_eq!(totals(&t), (1100, 25, 1075, 0));
    assert_eq!(t.in_flight_tokens, 0);
    assert!(observer.try_acquire(&req(), opts(2500, 2500)).is_ok());
}

#[test]
fn borrowed_permit_can_be_released_on_a_scoped_thread() {
    let bulkhead = budgeted(1, 5000, 0);
    let permit = bulkhead.try_acquire(&req(), opts(10, 10)).unwrap();
    let report = std::thread::scope(|s| {
        s.spawn(move || permit.release(Some(usage(5, 5))))
            .join()
            .unwrap()
    });
    assert_eq!(report_figures(&report), (20, 10, Some(usage(5, 5))));
    assert_eq!(bulkhead.stats().in_flight, 0);
}

#[test]
fn admission_ids_are_unique_v4_uuids_across_four_threads() {
    const THREADS: usize = 4;
    const PER_THREAD: usize = 2000;
    let bulkhead = budgeted(64, 1_000_000, 0);
    let ids: Vec<AdmissionId> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let bulkhead = &bulkhead;
                s.spawn(move || {
                    let mut ids = Vec::with_capacity(PER_THREAD);
                    for i in 0..PER_THREAD {
                        if (t + i) % 2 == 0 {
                            let p = bulkhead.try_acquire(&req(), opts(1, 1)).unwrap();
                            ids.push(p.admission_id());
                            p.release(Some(usage(1, 0)));
                        } else {
                            let p = bulkhead.try_acquire_owned(&req(), opts(1, 1)).unwrap();
                            ids.push(p.admission_id());
                            drop(p);
                        }
                    }
                    ids
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    assert_eq!(ids.len(), THREADS * PER_THREAD);
    let unique: HashSet<AdmissionId> = ids.iter().copied().collect();
    assert_eq!(unique.len(), ids.len(), "duplicate admission ids");
    let unique_text: HashSet<String> = ids.iter().map(ToString::to_string).collect();
    assert_eq!(unique_text.len(), ids.len());
    for &id in &ids {
        assert_valid_id(id);
    }
    let first = ids[0];
    assert_eq!(format!("{first:?}"), format!("AdmissionId({first})"));

    let stats = bulkhead.stats();
    assert_eq!(stats.admitted, 8000);
    assert_eq!(stats.released, 8000);
    assert_eq!(stats.in_flight, 0);
    let t = stats.token_budget.unwrap();
    assert_eq!(totals(&t), (16_000, 4000, 4000, 0));
    assert_eq!(t.in_flight_tokens, 0);
}

#[test]
fn admission_ids_stay_unique_across_short_lived_threads_and_bulkheads() {
    // Threads that exit hand their statistics shard to the next thread; ids must not repeat.
    let a = plain(4);
    let b = plain(4);
    let mut ids = Vec::new();
    for _ in 0..8 {
        let (a2, b2) = (a.clone(), b.clone());
        let batch = std::thread::spawn(move || {
            let mut ids = Vec::new();
            for _ in 0..100 {
                ids.push(
                    a2.try_acquire(&req(), AcquireOptions::new())
                        .unwrap()
                        .admission_id(),
                );
                ids.push(
                    b2.try_acquire(&req(), AcquireOptions::new())
                        .unwrap()
                        .admission_id(),
                );
            }
            ids
        })
        .join()
        .unwrap();
        ids.extend(batch);
    }
    for _ in 0..100 {
        ids.push(
            a.try_acquire(&req(), AcquireOptions::new())
                .unwrap()
                .admission_id(),
        );
        ids.push(
            b.try_acquire(&req(), AcquireOptions::new())
                .unwrap()
                .admission_id(),
        );
    }
    let unique: HashSet<AdmissionId> = ids.iter().copied().collect();
    assert_eq!(unique.len(), 1800);
    assert_eq!(a.stats().admitted, 900);
    assert_eq!(b.stats().admitted, 900);
}

#[test]
fn limit_revision_is_the_revision_at_admission() {
    let bulkhead = LlmBulkhead::builder("m", 4)
        .initial_revision(4)
        .token_budget(TokenBudget::new(1000))
        .build()
        .unwrap();
    let early = bulkhead.try_acquire(&req(), opts(1, 1)).unwrap();
    let early_owned = bulkhead.try_acquire_owned(&req(), opts(1, 1)).unwrap();
    assert_eq!(early.limit_revision(), 4);

    bulkhead
        .apply_limits(Limits::new(9, 5).with_token_budget(2000, 0))
        .unwrap();
    assert_eq!(early.limit_revision(), 4);
    assert_eq!(early_owned.limit_revision(), 4);
    let middle = bulkhead.try_acquire(&req(), opts(1, 1)).unwrap();
    assert_eq!(middle.limit_revision(), 9);

    bulkhead.set_budget(3000).unwrap();
    assert_eq!(early.limit_revision(), 4);
    assert_eq!(middle.limit_revision(), 9);
    let late = bulkhead.try_acquire(&req(), opts(1, 1)).unwrap();
    assert_eq!(late.limit_revision(), 10);

    // A stale snapshot changes nothing.
    bulkhead.apply_limits(Limits::new(3, 1)).unwrap();
    let latest = bulkhead.try_acquire(&req(), opts(1, 1)).unwrap();
    assert_eq!(latest.limit_revision(), 10);
    drop((early, early_owned, middle, late, latest));
}

#[test]
fn permit_accessors_report_what_was_admitted() {
    let bulkhead = budgeted(2, 10_000, 0);
    let permit = bulkhead
        .try_acquire(
            &text(400).max_tokens(100),
            AcquireOptions::new().priority(Priority::High),
        )
        .unwrap();
    assert_eq!(permit.priority(), Priority::High);
    assert_eq!(permit.reservation(), Some(res(100, 100)));
    assert_eq!(permit.held_tokens(), 200);
    assert_eq!(permit.limit_revision(), 0);
    assert_valid_id(permit.admission_id());
    let owned = bulkhead.try_acquire_owned(&req(), opts(3, 4)).unwrap();
    assert_eq!(owned.priority(), Priority::Normal);
    assert_eq!(owned.reservation(), Some(res(3, 4)));
    assert_eq!(owned.held_tokens(), 7);
    assert_ne!(owned.admission_id(), permit.admission_id());
    assert!(format!("{permit:?}").starts_with("Permit"));
    assert!(format!("{owned:?}").starts_with("OwnedPermit"));
}

// ===== apply_limits and set_budget =====

#[test]
fn revision_above_the_maximum_is_an_error_checked_first() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .initial_revision(MAX_REVISION)
        .token_budget(TokenBudget::new(100))
        .build()
        .unwrap();
    let before = (bulkhead.limits(), bulkhead.stats());

    let err = bulkhead
        .apply_limits(Limits::new(MAX_REVISION + 1, 2).with_token_budget(100, 0))
        .unwrap_err();
    assert_eq!(
        err,
        LimitsError::RevisionTooLarge {
            value: MAX_REVISION + 1,
            max: MAX_REVISION
        }
    );
    assert_eq!(
        err.to_string(),
        "limits.revision (9007199254740992) must be <= 9007199254740991"
    );
    // Checked before the rest of the snapshot (too many slots, wrong budget shape).
    let err = bulkhead
        .apply_limits(Limits::new(u64::MAX, u32::MAX))
        .unwrap_err();
    assert_eq!(
        err,
        LimitsError::RevisionTooLarge {
            value: u64::MAX,
            max: MAX_REVISION
        }
    );
    assert_eq!(
        err.to_string(),
        "limits.revision (18446744073709551615) must be <= 9007199254740991"
    );
    // Also on a bulkhead whose revision is far below (not stale, not applied).
    let low = plain(1);
    assert!(matches!(
        low.apply_limits(Limits::new(MAX_REVISION + 1, 1)),
        Err(LimitsError::RevisionTooLarge { .. })
    ));
    assert_eq!(low.limits(), Limits::new(0, 1));

    assert_eq!((bulkhead.limits(), bulkhead.stats()), before);
    // MAX_REVISION itself is stale here.
    assert_eq!(
        bulkhead.apply_limits(Limits::new(MAX_REVISION, 2).with_token_budget(1, 0)),
        Ok(ApplyOutcome::Stale { current: before.0 })
    );
}

#[test]
fn stale_snapshots_are_not_validated() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .initial_revision(10)
        .max_queue(1)
        .token_budget(TokenBudget::new(500).high_priority_reserve(50))
        .build()
        .unwrap();
    let current = bulkhead.limits();
    assert_eq!(
        current,
        Limits::new(10, 2)
            .with_max_queue(1)
            .with_token_budget(500, 50)
    );

    // Too many slots and no token budget: both invalid, but the revision is stale.
    for stale in [
        Limits::new(10, u32::MAX),
        Limits::new(9, MAX_CONCURRENT + 1).with_token_budget(1, 2),
        Limits::new(0, 5),
        Limits::new(10, 3).with_token_budget(9000, 0),
    ] {
        let outcome = bulkhead.apply_limits(stale).unwrap();
        assert_eq!(outcome, ApplyOutcome::Stale { current });
        assert!(!outcome.is_applied());
        assert_eq!(outcome.current(), current);
    }
    // A budget on a budget-less bulkhead, stale: still Stale, not TokenBudgetNotConfigured.
    let unbudgeted = LlmBulkhead::builder("m", 2)
        .initial_revision(3)
        .build()
        .unwrap();
    assert_eq!(
        unbudgeted.apply_limits(Limits::new(3, 9).with_token_budget(10, 0)),
        Ok(ApplyOutcome::Stale {
            current: Limits::new(3, 2)
        })
    );
    assert_eq!(bulkhead.limits(), current);
    assert_eq!(bulkhead.stats().limits, current);
}

#[test]
fn a_newer_snapshot_is_validated_whole_before_anything_changes() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .token_budget(TokenBudget::new(1000).high_priority_reserve(100))
        .build()
        .unwrap();
    let held = bulkhead.try_acquire(&req(), opts(10, 10)).unwrap();
    let _ = rejected(bulkhead.try_acquire(&req(), opts(1000, 0)));
    let before = (bulkhead.limits(), bulkhead.stats());

    let err = bulkhead
        .apply_limits(Limits::new(1, MAX_CONCURRENT + 1).with_token_budget(5000, 0))
        .unwrap_err();
    assert_eq!(
        err,
        LimitsError::MaxConcurrentTooLarge {
            value: MAX_CONCURRENT + 1,
            max: MAX_CONCURRENT
        }
    );
    assert_eq!(
        err.to_string(),
        "limits.max_concurrent (65536) must be <= 65535"
    );

    // Too many slots and a missing budget: max_concurrent is reported first.
    assert!(matches!(
        bulkhead.apply_limits(Limits::new(2, u32::MAX)),
        Err(LimitsError::MaxConcurrentTooLarge {
            value: u32::MAX,
            ..
        })
    ));

    let err = bulkhead.apply_limits(Limits::new(1, 8)).unwrap_err();
    assert_eq!(err, LimitsError::TokenBudgetRequired);
    assert_eq!(
        err.to_string(),
        "limits.token_budget is required because a token budget was configured at construction"
    );
    assert_eq!((bulkhead.limits(), bulkhead.stats()), before);

    let unbudgeted = plain(2);
    let before_plain = (unbudgeted.limits(), unbudgeted.stats());
    let err = unbudgeted
        .apply_limits(Limits::new(1, 8).with_token_budget(100, 0))
        .unwrap_err();
    assert_eq!(err, LimitsError::TokenBudgetNotConfigured);
    assert_eq!(
        err.to_string(),
        "limits.token_budget must be omitted because no token budget was configured at construction"
    );
    assert_eq!((unbudgeted.limits(), unbudgeted.stats()), before_plain);

    // The failed attempts did not consume revision 1.
    let outcome = bulkhead
        .apply_limits(Limits::new(1, 3).with_token_budget(900, 100))
        .unwrap();
    assert!(outcome.is_applied());
    assert_eq!(bulkhead.limits().revision, 1);
    // The rejected snapshot's values never took effect: 2 slots were never 8.
    drop(held);
}

#[test]
fn applied_snapshot_reports_previous_and_current() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .initial_revision(3)
        .token_budget(TokenBudget::new(1000).high_priority_reserve(100))
        .build()
        .unwrap();
    let next = Limits::new(4, 8)
        .with_max_queue(2)
        .with_token_budget(5000, 500);
    let outcome = bulkhead.apply_limits(next).unwrap();
    assert_eq!(
        outcome,
        ApplyOutcome::Applied {
            previous: Limits::new(3, 2).with_token_budget(1000, 100),
            current: next,
        }
    );
    assert!(outcome.is_applied());
    assert_eq!(outcome.current(), next);
    assert_eq!(bulkhead.limits(), next);
    assert_eq!(bulkhead.stats().limits, next);
    let t = tokens(&bulkhead);
    assert_eq!((t.budget, t.high_priority_reserve), (5000, 500));

    // Revisions may jump, and identical values at a newer revision still apply.
    let same = Limits::new(100, 8)
        .with_max_queue(2)
        .with_token_budget(5000, 500);
    assert_eq!(
        bulkhead.apply_limits(same),
        Ok(ApplyOutcome::Applied {
            previous: next,
            current: same
        })
    );
    // Reaching MAX_REVISION is allowed.
    let top = Limits::new(MAX_REVISION, MAX_CONCURRENT).with_token_budget(0, 0);
    assert!(bulkhead.apply_limits(top).unwrap().is_applied());
    assert_eq!(bulkhead.limits(), top);
}

#[test]
fn lowering_concurrency_shrinks_by_attrition() {
    let bulkhead = plain(3);
    let a = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    let b = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    let c = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    bulkhead.apply_limits(Limits::new(1, 1)).unwrap();
    assert_eq!(bulkhead.stats().in_flight, 3);

    let rejection = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
    assert_eq!(
        rejection.to_string(),
        "bulkhead rejected: concurrency_limit (3 of 1 slots in flight)"
    );
    assert_eq!(slot_figures(rejection.detail()), (1, 3, 1, 0, 0));
    drop(a);
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), AcquireOptions::new())),
        RejectReason::ConcurrencyLimit
    );
    drop(b);
    let rejection = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
    assert_eq!(
        rejection.to_string(),
        "bulkhead rejected: concurrency_limit (1 of 1 slots in flight)"
    );
    drop(c);
    let d = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    assert_eq!(d.limit_revision(), 1);
    assert_eq!(bulkhead.stats().rejected, 3);
}

#[test]
fn lowering_the_budget_shrinks_by_attrition() {
    let bulkhead = budgeted(4, 1000, 0);
    let a = bulkhead.try_acquire(&req(), opts(300, 0)).unwrap();
    let b = bulkhead.try_acquire(&req(), opts(300, 0)).unwrap();
    bulkhead
        .apply_limits(Limits::new(1, 4).with_token_budget(400, 0))
        .unwrap();
    let t = tokens(&bulkhead);
    assert_eq!((t.budget, t.in_flight_tokens, t.available), (400, 600, 0));
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts(0, 0))),
        RejectReason::BudgetLimit
    );
    drop(a);
    // 300 + 101 > 400.
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts(101, 0))),
        RejectReason::BudgetLimit
    );
    let c = bulkhead.try_acquire(&req(), opts(100, 0)).unwrap();
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 400);
    drop((b, c));
}

#[test]
fn raising_limits_takes_effect_for_the_next_admission() {
    let bulkhead = plain(1);
    let _a = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    assert!(bulkhead.try_acquire(&req(), AcquireOptions::new()).is_err());
    bulkhead.apply_limits(Limits::new(1, 2)).unwrap();
    let b = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    assert_eq!(b.limit_revision(), 1);

    let budget = budgeted(4, 100, 0);
    let _full = budget.try_acquire(&req(), opts(100, 0)).unwrap();
    assert!(budget.try_acquire(&req(), opts(1, 0)).is_err());
    budget.set_budget(101).unwrap();
    let one = budget.try_acquire(&req(), opts(1, 0)).unwrap();
    assert_eq!(one.limit_revision(), 1);
    budget
        .apply_limits(Limits::new(2, 4).with_token_budget(200, 0))
        .unwrap();
    let more = budget.try_acquire(&req(), opts(99, 0)).unwrap();
    assert_eq!(more.limit_revision(), 2);
    let t = tokens(&budget);
    // 100 + 1 + 99: a 1-token reservation is booked like any other.
    assert_eq!((t.in_flight_tokens, t.total_reserved), (200, 200));
}

#[test]
fn zero_concurrency_at_runtime_is_a_kill_switch_until_raised() {
    let bulkhead = LlmBulkhead::builder("m", 2).max_queue(4).build().unwrap();
    let held = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    bulkhead
        .apply_limits(Limits::new(1, 0).with_max_queue(4))
        .unwrap();
    let rejection = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
    assert_eq!(
        rejection.to_string(),
        "bulkhead rejected: concurrency_limit (max_concurrent is 0)"
    );
    assert_eq!(
        bulkhead.would_admit(&req(), AcquireOptions::new()).unwrap(),
        Verdict::Reject(RejectReason::ConcurrencyLimit)
    );
    drop(held);
    assert!(bulkhead.try_acquire(&req(), AcquireOptions::new()).is_err());
    bulkhead
        .apply_limits(Limits::new(2, 1).with_max_queue(4))
        .unwrap();
    assert!(bulkhead.try_acquire(&req(), AcquireOptions::new()).is_ok());
}

#[test]
fn reserve_above_budget_is_accepted_at_runtime() {
    let bulkhead = budgeted(4, 1000, 0);
    let next = Limits::new(1, 4).with_token_budget(100, 500);
    assert!(bulkhead.apply_limits(next).unwrap().is_applied());
    assert_eq!(bulkhead.limits(), next);
    assert_eq!(
        bulkhead.limits().effective_budget(Priority::Normal),
        Some(0)
    );
    assert_eq!(
        bulkhead.limits().effective_budget(Priority::High),
        Some(100)
    );

    let rejection = rejected(bulkhead.try_acquire(&req(), opts(1, 0)));
    assert_eq!(budget_figures(rejection.detail()), (100, 0, 0, 0, 1));
    let zero = bulkhead.try_acquire(&req(), opts(0, 0)).unwrap();
    let top = bulkhead.try_acquire(&req(), high(50, 50)).unwrap();
    let t = tokens(&bulkhead);
    assert_eq!(
        (
            t.budget,
            t.high_priority_reserve,
            t.in_flight_tokens,
            t.available
        ),
        (100, 500, 100, 0)
    );
    drop((zero, top));
}

#[test]
fn set_budget_keeps_the_rest_and_advances_the_revision() {
    let bulkhead = LlmBulkhead::builder("m", 3)
        .initial_revision(7)
        .max_queue(2)
        .token_budget(TokenBudget::new(1000).high_priority_reserve(200))
        .build()
        .unwrap();
    let now = bulkhead.set_budget(5000).unwrap();
    let expected = Limits::new(8, 3)
        .with_max_queue(2)
        .with_token_budget(5000, 200);
    assert_eq!(now, expected);
    assert_eq!(bulkhead.limits(), expected);

    // Below the reserve and down to 0 are fine; the reserve is kept.
    assert_eq!(
        bulkhead.set_budget(100).unwrap(),
        Limits::new(9, 3)
            .with_max_queue(2)
            .with_token_budget(100, 200)
    );
    assert_eq!(
        bulkhead.set_budget(0).unwrap(),
        Limits::new(10, 3)
            .with_max_queue(2)
            .with_token_budget(0, 200)
    );
    assert_eq!(
        bulkhead.set_budget(MAX_BUDGET).unwrap(),
        Limits::new(11, 3)
            .with_max_queue(2)
            .with_token_budget(MAX_BUDGET, 200)
    );
    // A stale apply after set_budget sees the new revision.
    assert_eq!(
        bulkhead.apply_limits(Limits::new(11, 1).with_token_budget(1, 0)),
        Ok(ApplyOutcome::Stale {
            current: bulkhead.limits()
        })
    );
}

#[test]
fn set_budget_without_a_budget_is_refused_and_changes_nothing() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .initial_revision(4)
        .build()
        .unwrap();
    let before = (bulkhead.limits(), bulkhead.stats());
    let err = bulkhead.set_budget(100).unwrap_err();
    assert_eq!(err, LimitsError::TokenBudgetNotConfigured);
    assert_eq!(
        err.to_string(),
        "limits.token_budget must be omitted because no token budget was configured at construction"
    );
    assert_eq!((bulkhead.limits(), bulkhead.stats()), before);
}

#[test]
fn set_budget_at_the_maximum_revision_is_refused_and_changes_nothing() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .initial_revision(MAX_REVISION - 1)
        .token_budget(TokenBudget::new(1000).high_priority_reserve(10))
        .build()
        .unwrap();
    let now = bulkhead.set_budget(2000).unwrap();
    assert_eq!(now.revision, MAX_REVISION);
    let before = bulkhead.limits();
    let err = bulkhead.set_budget(3000).unwrap_err();
    assert_eq!(
        err,
        LimitsError::RevisionExhausted {
            current: MAX_REVISION
        }
    );
    assert_eq!(
        err.to_string(),
        "cannot advance the limit revision beyond 9007199254740991 (the largest revision)"
    );
    assert_eq!(bulkhead.limits(), before);
    assert_eq!(
        bulkhead.limits(),
        Limits::new(MAX_REVISION, 2).with_token_budget(2000, 10)
    );
    // The refused budget did not take effect: 2001 tokens do not fit.
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), high(2001, 0))),
        RejectReason::BudgetLimit
    );
}

#[test]
fn upstream_apply_limits_example_adapted_to_fail_fast() {
    // Upstream §8.2: one request in flight (400 tokens of 1000) and one waiting for a slot;
    // applying {rev 8, max_concurrent 2, max_queue 3, budget 500, reserve 100} frees a slot,
    // but the waiting request no longer fits the budget: budget_limit at revision 8, in flight
    // stays 1 and the tokens stay 400.
    let bulkhead = LlmBulkhead::builder("claude", 1)
        .initial_revision(7)
        .max_queue(1)
        .token_budget(TokenBudget::new(1000))
        .build()
        .unwrap();
    let first = bulkhead.try_acquire(&req(), opts(100, 300)).unwrap();
    // The second request would wait (it fits the budget but has no slot).
    assert_eq!(
        bulkhead.would_admit(&req(), opts(100, 300)).unwrap(),
        Verdict::Queue
    );
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts(100, 300))),
        RejectReason::ConcurrencyLimit
    );

    let next = Limits::new(8, 2)
        .with_max_queue(3)
        .with_token_budget(500, 100);
    assert_eq!(
        bulkhead.apply_limits(next),
        Ok(ApplyOutcome::Applied {
            previous: Limits::new(7, 1)
                .with_max_queue(1)
                .with_token_budget(1000, 0),
            current: next,
        })
    );
    let rejection = rejected(bulkhead.try_acquire(&req(), opts(100, 300)));
    assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
    assert_eq!(rejection.limit_revision(), 8);
    assert_eq!(slot_figures(rejection.detail()), (8, 1, 2, 0, 3));
    assert_eq!(budget_figures(rejection.detail()), (500, 400, 400, 0, 400));

    let stats = bulkhead.stats();
    assert_eq!(stats.in_flight, 1);
    assert_eq!(stats.token_budget.unwrap().in_flight_tokens, 400);
    assert_eq!(counts(&stats.rejected_by_reason), [0, 1, 1, 0, 0, 0]);
    assert_eq!(first.limit_revision(), 7);
    // A high-priority request of up to 100 tokens still fits.
    let small = bulkhead.try_acquire(&req(), high(0, 100)).unwrap();
    assert_eq!(small.limit_revision(), 8);
    drop((first, small));
}

// ===== would_admit =====

#[test]
fn would_admit_answers_admit_then_queue_then_reject() {
    let queued = LlmBulkhead::builder("m", 1).max_queue(2).build().unwrap();
    assert_eq!(
        queued.would_admit(&req(), AcquireOptions::new()).unwrap(),
        Verdict::Admit
    );
    let _held = queued.try_acquire(&req(), AcquireOptions::new()).unwrap();
    assert_eq!(
        queued.would_admit(&req(), AcquireOptions::new()).unwrap(),
        Verdict::Queue
    );

    let unqueued = plain(1);
    let _held2 = unqueued.try_acquire(&req(), AcquireOptions::new()).unwrap();
    assert_eq!(
        unqueued.would_admit(&req(), AcquireOptions::new()).unwrap(),
        Verdict::Reject(RejectReason::ConcurrencyLimit)
    );
    assert_eq!(queued.stats().admitted, 1);
    assert_eq!(queued.stats().rejected, 0);
    assert_eq!(unqueued.stats().rejected, 0);
}

#[test]
fn would_admit_checks_closed_first() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .max_queue(5)
        .token_budget(TokenBudget::new(100))
        .build()
        .unwrap();
    let _held = bulkhead.try_acquire(&req(), opts(50, 0)).unwrap();
    bulkhead.close();
    for o in [opts(500, 0), opts(0, 0), high(10, 10)] {
        assert_eq!(
            bulkhead.would_admit(&req(), o).unwrap(),
            Verdict::Reject(RejectReason::Shutdown)
        );
    }
    let (verdict, detail) = bulkhead
        .would_admit_with_detail(&req(), opts(500, 0))
        .unwrap();
    assert_eq!(verdict, Verdict::Reject(RejectReason::Shutdown));
    assert_eq!(slot_figures(&detail), (0, 1, 1, 0, 5));
    assert_eq!(budget_figures(&detail), (100, 50, 100, 50, 500));

    let zero = LlmBulkhead::builder("m", 0).max_queue(3).build().unwrap();
    zero.close();
    assert_eq!(
        zero.would_admit(&req(), AcquireOptions::new()).unwrap(),
        Verdict::Reject(RejectReason::Shutdown)
    );
}

#[test]
fn would_admit_checks_the_budget_before_slots_and_queue() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .max_queue(5)
        .token_budget(TokenBudget::new(100).high_priority_reserve(20))
        .build()
        .unwrap();
    let _held = bulkhead.try_acquire(&req(), opts(50, 0)).unwrap();
    // 50 + 60 > 100: refused for budget although it could queue for a slot.
    assert_eq!(
        bulkhead.would_admit(&req(), high(60, 0)).unwrap(),
        Verdict::Reject(RejectReason::BudgetLimit)
    );
    // 50 + 31 > 80 for normal priority, fits 100 for high.
    assert_eq!(
        bulkhead.would_admit(&req(), opts(31, 0)).unwrap(),
        Verdict::Reject(RejectReason::BudgetLimit)
    );
    assert_eq!(
        bulkhead.would_admit(&req(), high(31, 0)).unwrap(),
        Verdict::Queue
    );
    assert_eq!(
        bulkhead.would_admit(&req(), opts(30, 0)).unwrap(),
        Verdict::Queue
    );
}

#[test]
fn would_admit_with_zero_concurrency_refuses_even_with_a_queue() {
    let bulkhead = LlmBulkhead::builder("m", 0)
        .max_queue(10)
        .token_budget(TokenBudget::new(100))
        .build()
        .unwrap();
    assert_eq!(
        bulkhead.would_admit(&req(), opts(1, 1)).unwrap(),
        Verdict::Reject(RejectReason::ConcurrencyLimit)
    );
    // Budget still comes first.
    assert_eq!(
        bulkhead.would_admit(&req(), opts(101, 0)).unwrap(),
        Verdict::Reject(RejectReason::BudgetLimit)
    );
}

#[test]
fn would_admit_with_detail_gives_the_snapshot_for_an_admit_too() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .initial_revision(3)
        .token_budget(TokenBudget::new(1000).high_priority_reserve(100))
        .build()
        .unwrap();
    let _held = bulkhead.try_acquire(&req(), opts(100, 200)).unwrap();

    let (verdict, detail) = bulkhead
        .would_admit_with_detail(&req(), opts(200, 200))
        .unwrap();
    assert_eq!(verdict, Verdict::Admit);
    assert_eq!(slot_figures(&detail), (3, 1, 2, 0, 0));
    assert_eq!(budget_figures(&detail), (1000, 300, 900, 600, 400));

    let (verdict, detail) = bulkhead
        .would_admit_with_detail(&req(), high(200, 200))
        .unwrap();
    assert_eq!(verdict, Verdict::Admit);
    assert_eq!(budget_figures(&detail), (1000, 300, 1000, 700, 400));

    let (verdict, detail) = bulkhead
        .would_admit_with_detail(&req(), opts(601, 0))
        .unwrap();
    assert_eq!(verdict, Verdict::Reject(RejectReason::BudgetLimit));
    assert_eq!(budget_figures(&detail), (1000, 300, 900, 600, 601));

    // The estimate is the requested figure when no override is given.
    let (_, detail) = bulkhead
        .would_admit_with_detail(&text(40), AcquireOptions::new())
        .unwrap();
    assert_eq!(detail.token_budget.unwrap().requested, 10 + 2048);

    let unbudgeted = plain(1);
    let (verdict, detail) = unbudgeted
        .would_admit_with_detail(&req(), opts(5, 5))
        .unwrap();
    assert_eq!(verdict, Verdict::Admit);
    assert_eq!(slot_figures(&detail), (0, 0, 1, 0, 0));
    assert!(detail.token_budget.is_none());
}

#[test]
fn would_admit_counts_and_reserves_nothing() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .max_queue(1)
        .token_budget(TokenBudget::new(100))
        .build()
        .unwrap();
    let held = bulkhead.try_acquire(&req(), opts(10, 10)).unwrap();
    let before = bulkhead.stats();
    for o in [opts(0, 0), opts(1000, 0), high(1, 1)] {
        let _ = bulkhead.would_admit(&req(), o).unwrap();
        let _ = bulkhead.would_admit_with_detail(&req(), o).unwrap();
    }
    let _ = bulkhead.would_admit(&text(8).max_tokens(u64::MAX), AcquireOptions::new());
    assert_eq!(bulkhead.stats(), before);
    drop(held);
    let before = bulkhead.stats();
    assert_eq!(
        bulkhead.would_admit(&req(), opts(100, 0)).unwrap(),
        Verdict::Admit
    );
    // Nothing was reserved: the whole budget is still there.
    assert_eq!(bulkhead.stats(), before);
    assert!(bulkhead.try_acquire(&req(), opts(100, 0)).is_ok());
}

#[test]
fn would_admit_agrees_with_try_acquire() {
    let bulkhead = budgeted(2, 1000, 200);
    let cases = [
        opts(500, 0),
        opts(400, 0),
        high(300, 0),
        opts(0, 0),
        high(1, 0),
    ];
    let mut held = Vec::new();
    for o in cases {
        let verdict = bulkhead.would_admit(&req(), o).unwrap();
        match bulkhead.try_acquire(&req(), o) {
            Ok(permit) => {
                assert_eq!(verdict, Verdict::Admit);
                held.push(permit);
            }
            Err(err) => assert_eq!(verdict, Verdict::Reject(err.rejection().unwrap().reason())),
        }
    }
    // 500 admitted, 400 refused for budget (900 > 800), 300 high admitted (800 <= 1000), then
    // no slot for the rest.
    assert_eq!(held.len(), 2);
    assert_eq!(
        counts(&bulkhead.stats().rejected_by_reason),
        [0, 2, 1, 0, 0, 0]
    );
}

#[test]
fn verdict_helpers() {
    assert!(Verdict::Admit.is_admit());
    assert!(Verdict::Queue.is_admit());
    assert!(!Verdict::Reject(RejectReason::Shutdown).is_admit());
    assert_eq!(Verdict::Admit.reject_reason(), None);
    assert_eq!(Verdict::Queue.reject_reason(), None);
    assert_eq!(
        Verdict::Reject(RejectReason::BudgetLimit).reject_reason(),
        Some(RejectReason::BudgetLimit)
    );
}

// ===== close =====

#[test]
fn close_returns_true_once_and_is_idempotent() {
    let bulkhead = plain(2);
    assert!(!bulkhead.is_closed());
    assert!(!bulkhead.stats().closed);
    assert!(bulkhead.close());
    assert!(!bulkhead.close());
    assert!(!bulkhead.clone().close());
    assert!(bulkhead.is_closed());
    assert!(bulkhead.stats().closed);
    for _ in 0..3 {
        assert_eq!(
            reason_of(bulkhead.try_acquire(&req(), AcquireOptions::new())),
            RejectReason::Shutdown
        );
    }
    let stats = bulkhead.stats();
    assert_eq!(counts(&stats.rejected_by_reason), [3, 0, 0, 0, 0, 0]);
    assert_eq!((stats.rejected, stats.admitted), (3, 0));
}

#[test]
fn close_races_have_exactly_one_winner() {
    for _ in 0..50 {
        let bulkhead = plain(1);
        let winners = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4).map(|_| s.spawn(|| bulkhead.close())).collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .filter(|&won| won)
                .count()
        });
        assert_eq!(winners, 1);
        assert!(bulkhead.is_closed());
    }
}

#[test]
fn permits_in_flight_release_normally_after_close() {
    let bulkhead = budgeted(3, 5000, 0);
    let a = bulkhead.try_acquire(&req(), opts(100, 1000)).unwrap();
    let b = bulkhead.try_acquire_owned(&req(), opts(10, 10)).unwrap();
    let c = bulkhead.try_acquire(&req(), opts(1, 1)).unwrap();
    assert!(bulkhead.close());
    assert_eq!(bulkhead.stats().in_flight, 3);

    let report = a.release(Some(usage(20, 5)));
    assert_eq!(report_figures(&report), (1100, 1075, Some(usage(20, 5))));
    let report = std::thread::spawn(move || b.release(None)).join().unwrap();
    assert_eq!(report_figures(&report), (20, 0, None));
    drop(c);

    let stats = bulkhead.stats();
    assert!(stats.closed);
    assert_eq!((stats.admitted, stats.released, stats.in_flight), (3, 3, 0));
    let t = stats.token_budget.unwrap();
    assert_eq!(totals(&t), (1122, 25, 1075, 0));
    assert_eq!(t.in_flight_tokens, 0);
    // Freed capacity does not reopen a closed bulkhead.
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts(0, 0))),
        RejectReason::Shutdown
    );
}

#[test]
fn limits_and_set_budget_keep_working_after_close() {
    let bulkhead = budgeted(1, 100, 0);
    bulkhead.close();
    let outcome = bulkhead
        .apply_limits(Limits::new(1, 10).with_token_budget(1000, 0))
        .unwrap();
    assert!(outcome.is_applied());
    let now = bulkhead.set_budget(2000).unwrap();
    assert_eq!(now, Limits::new(2, 10).with_token_budget(2000, 0));
    assert_eq!(bulkhead.limits(), now);
    let stats = bulkhead.stats();
    assert!(stats.closed);
    assert_eq!(stats.limits, now);
    assert_eq!(stats.token_budget.unwrap().budget, 2000);
    let rejection = rejected(bulkhead.try_acquire(&req(), opts(1, 1)));
    assert_eq!(rejection.reason(), RejectReason::Shutdown);
    assert_eq!(rejection.limit_revision(), 2);
    assert_eq!(slot_figures(rejection.detail()), (2, 0, 10, 0, 0));
    assert_eq!(budget_figures(rejection.detail()), (2000, 0, 2000, 2000, 2));
    // Applying limits never reopens it.
    assert!(bulkhead.is_closed());
}

// ===== stats =====

#[test]
fn stats_after_a_scripted_sequence() {
    let bulkhead = LlmBulkhead::builder("m", 2)
        .initial_revision(5)
        .token_budget(TokenBudget::new(10_000).high_priority_reserve(1000))
        .build()
        .unwrap();

    let fresh = bulkhead.stats();
    assert_eq!(
        fresh.limits,
        Limits::new(5, 2).with_token_budget(10_000, 1000)
    );
    assert!(!fresh.closed);
    assert_eq!(
        (
            fresh.in_flight,
            fresh.pending,
            fresh.admitted,
            fresh.released,
            fresh.rejected
        ),
        (0, 0, 0, 0, 0)
    );
    assert_eq!(fresh.rejected_by_reason, RejectionCounts::default());
    let t = fresh.token_budget.unwrap();
    assert_eq!(
        (
            t.budget,
            t.high_priority_reserve,
            t.in_flight_tokens,
            t.available
        ),
        (10_000, 1000, 0, 10_000)
    );
    assert_eq!(totals(&t), (0, 0, 0, 0));

    let a = bulkhead.try_acquire(&req(), opts(100, 1000)).unwrap(); // T = 1100
    let b = bulkhead.try_acquire(&req(), high(200, 2000)).unwrap(); // T = 3300
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts(0, 0))),
        RejectReason::ConcurrencyLimit
    );
    // 3300 + 7000 > 9000 (normal ceiling).
    assert_eq!(
        reason_of(bulkhead.try_acquire(&req(), opts(5000, 2000))),
        RejectReason::BudgetLimit
    );
    let mid = bulkhead.stats();
    assert_eq!(
        (mid.in_flight, mid.admitted, mid.released, mid.rejected),
        (2, 2, 0, 2)
    );
    let t = mid.token_budget.unwrap();
    assert_eq!((t.in_flight_tokens, t.available), (3300, 6700));

    a.release(Some(usage(50, 250))); // consumed 300, refunded 800, T = 2200
    drop(b); // nothing booked, T = 0
    let c = bulkhead.try_acquire(&req(), opts(10, 90)).unwrap(); // T = 100
    assert!(bulkhead.close());
    for _ in 0..2 {
        assert_eq!(
            reason_of(bulkhead.try_acquire(&req(), opts(0, 0))),
            RejectReason::Shutdown
        );
    }

    let stats: Stats = bulkhead.stats();
    assert_eq!(
        stats.limits,
        Limits::new(5, 2).with_token_budget(10_000, 1000)
    );
    assert_eq!(stats.limits, bulkhead.limits());
    assert!(stats.closed);
    assert_eq!(stats.in_flight, 1);
    assert_eq!(stats.pending, 0);
    assert_eq!(stats.admitted, 3);
    assert_eq!(stats.released, 2);
    assert_eq!(stats.rejected, 4);
    assert_eq!(counts(&stats.rejected_by_reason), [2, 1, 1, 0, 0, 0]);
    assert_eq!(stats.rejected_by_reason.total(), 4);
    for (reason, expected) in RejectReason::ALL.iter().copied().zip([2, 1, 1, 0, 0, 0]) {
        assert_eq!(stats.rejected_by_reason.get(reason), expected, "{reason}");
    }
    let t = stats.token_budget.unwrap();
    assert_eq!(
        (
            t.budget,
            t.high_priority_reserve,
            t.in_flight_tokens,
            t.available
        ),
        (10_000, 1000, 100, 9900)
    );
    assert_eq!(totals(&t), (3400, 300, 800, 0));

    c.release(Some(usage(10, 90)));
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.admitted, stats.released), (0, 3, 3));
    let t = stats.token_budget.unwrap();
    assert_eq!((t.in_flight_tokens, t.available), (0, 10_000));
    assert_eq!(totals(&t), (3400, 400, 800, 0));
}

#[test]
fn stats_without_a_budget_have_no_token_block() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .initial_revision(2)
        .max_queue(7)
        .build()
        .unwrap();
    let p = bulkhead.try_acquire(&req(), opts(100, 100)).unwrap();
    let _ = rejected(bulkhead.try_acquire(&req(), AcquireOptions::new()));
    let stats = bulkhead.stats();
    assert!(stats.token_budget.is_none());
    assert_eq!(stats.limits, Limits::new(2, 1).with_max_queue(7));
    assert_eq!(
        (
            stats.in_flight,
            stats.pending,
            stats.admitted,
            stats.released,
            stats.rejected
        ),
        (1, 0, 1, 0, 1)
    );
    assert_eq!(counts(&stats.rejected_by_reason), [0, 1, 0, 0, 0, 0]);
    p.release(Some(usage(1, 1)));
    let stats = bulkhead.stats();
    assert!(stats.token_budget.is_none());
    assert_eq!((stats.in_flight, stats.released), (0, 1));
}

#[test]
fn stats_available_saturates_when_tokens_exceed_the_budget() {
    let bulkhead = budgeted(2, 1000, 300);
    let _held = bulkhead.try_acquire(&req(), high(900, 0)).unwrap();
    // Not priority-adjusted: budget - in flight, not (budget - reserve) - in flight.
    assert_eq!(tokens(&bulkhead).available, 100);
    bulkhead.set_budget(600).unwrap();
    let t = tokens(&bulkhead);
    assert_eq!((t.budget, t.in_flight_tokens, t.available), (600, 900, 0));
}

#[test]
fn stats_sum_every_thread_exactly_after_join() {
    let bulkhead = budgeted(64, 1_000_000, 0);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..500 {
                    let p = bulkhead.try_acquire(&req(), opts(10, 10)).unwrap();
                    p.release(Some(usage(5, 5)));
                }
                for _ in 0..100 {
                    let _ = rejected(bulkhead.try_acquire(&req(), opts(2_000_000, 0)));
                }
            });
        }
    });
    // Threads have exited; their counts must survive.
    let stats = bulkhead.stats();
    assert_eq!(
        (stats.admitted, stats.released, stats.in_flight),
        (2000, 2000, 0)
    );
    assert_eq!(stats.rejected, 400);
    assert_eq!(counts(&stats.rejected_by_reason), [0, 0, 400, 0, 0, 0]);
    let t = stats.token_budget.unwrap();
    assert_eq!(totals(&t), (40_000, 20_000, 20_000, 0));
    assert_eq!(t.in_flight_tokens, 0);
}

#[test]
fn concurrent_admissions_never_exceed_slots_or_tokens() {
    const SLOTS: u64 = 3;
    const BUDGET: u64 = 1000;
    let bulkhead = budgeted(SLOTS as u32, BUDGET, 0);
    let slots_seen = AtomicU64::new(0);
    let tokens_seen = AtomicU64::new(0);
    let peak_slots = AtomicU64::new(0);
    let peak_tokens = AtomicU64::new(0);
    let admitted = AtomicU64::new(0);
    let refused = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..6u64 {
            let (bulkhead, slots_seen, tokens_seen) = (&bulkhead, &slots_seen, &tokens_seen);
            let (peak_slots, peak_tokens) = (&peak_slots, &peak_tokens);
            let (admitted, refused) = (&admitted, &refused);
            s.spawn(move || {
                for i in 0..3000u64 {
                    let size = 100 + (t * 37 + i * 13) % 400;
                    match bulkhead.try_acquire(&req(), opts(size, 0)) {
                        Ok(permit) => {
                            // Counted after admission and uncounted before release, so these
                            // figures never exceed what the bulkhead really holds.
                            let s_now = slots_seen.fetch_add(1, Ordering::SeqCst) + 1;
                            let t_now = tokens_seen.fetch_add(size, Ordering::SeqCst) + size;
                            peak_slots.fetch_max(s_now, Ordering::SeqCst);
                            peak_tokens.fetch_max(t_now, Ordering::SeqCst);
                            slots_seen.fetch_sub(1, Ordering::SeqCst);
                            tokens_seen.fetch_sub(size, Ordering::SeqCst);
                            permit.release(Some(usage(size, 0)));
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(err) => {
                            assert!(err.rejection().is_some(), "{err}");
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            });
        }
    });
    assert!(peak_slots.load(Ordering::SeqCst) <= SLOTS);
    assert!(peak_tokens.load(Ordering::SeqCst) <= BUDGET);
    let stats = bulkhead.stats();
    assert_eq!(stats.admitted, admitted.load(Ordering::Relaxed));
    assert_eq!(stats.rejected, refused.load(Ordering::Relaxed));
    assert_eq!(stats.admitted + stats.rejected, 18_000);
    assert_eq!((stats.in_flight, stats.released), (0, stats.admitted));
    let t = stats.token_budget.unwrap();
    assert_eq!(t.in_flight_tokens, 0);
    assert_eq!(t.total_reserved, t.total_consumed);
    assert_eq!((t.total_refunded, t.total_overrun), (0, 0));
}

// ===== display texts =====

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
            "aborted"
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

// ===== Send, Sync and 'static =====

#[test]
fn public_types_are_send_sync_and_static() {
    fn check<T: Send + Sync + 'static>() {}
    fn error<T: std::error::Error + Send + Sync + 'static>() {}
    check::<LlmBulkhead>();
    check::<OwnedPermit>();
    check::<Permit<'static>>();
    check::<Rejection>();
    check::<AcquireError>();
    check::<Stats>();
    check::<Limits>();
    check::<ApplyOutcome>();
    check::<CapacityDetail>();
    check::<AdmissionId>();
    check::<Reservation>();
    check::<TokenUsage>();
    check::<ReleaseReport>();
    check::<Verdict>();
    check::<LlmRequest>();
    check::<LlmBulkheadBuilder>();
    error::<ConfigError>();
    error::<LimitsError>();
    error::<RequestError>();
    error::<UsageError>();
    error::<AcquireError>();
    error::<Rejection>();
}

#[test]
fn bulkhead_and_owned_permits_move_freely_between_threads() {
    let bulkhead = budgeted(4, 1000, 0);
    let permits: Vec<OwnedPermit> = (0..4)
        .map(|_| bulkhead.try_acquire_owned(&req(), opts(100, 100)).unwrap())
        .collect();
    let handles: Vec<_> = permits
        .into_iter()
        .map(|p| std::thread::spawn(move || p.release(Some(usage(50, 50))).refunded_tokens))
        .collect();
    let refunded: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(refunded, 400);

    let moved = bulkhead.clone();
    let from_thread = std::thread::spawn(move || {
        let p = moved.try_acquire_owned(&req(), opts(1, 1)).unwrap();
        (moved.stats().in_flight, p)
    })
    .join()
    .unwrap();
    assert_eq!(from_thread.0, 1);
    assert_eq!(bulkhead.stats().in_flight, 1);
    drop(from_thread);
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released, stats.in_flight), (5, 5, 0));
    assert_eq!(totals(&stats.token_budget.unwrap()), (802, 400, 400, 0));
}
