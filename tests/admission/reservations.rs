//! Reservation resolution: estimates, overrides and what a call without a budget reserves.

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, Priority, Reservation, TokenBudget, TokenUsage,
    admission::Verdict, limits::MAX_BUDGET, request::Content, request::ContentBlock,
    request::RequestError, usage::UsageError,
};

use crate::support::{
    budgeted, opts, plain, report_figures, req, res, text, tokens, totals, usage,
};

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
    // user 4 + system 8 chars -> ceil(12 / 4) = 3 (design §U13.2: the characters of the
    // messages and the system text, over 4, rounded up).
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
