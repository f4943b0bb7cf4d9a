//! JSON: LlmRequest and Limits bodies (feature `serde`)

use async_bulkhead_llm::{
    AcquireOptions, Limits, LlmBulkhead, LlmRequest, TokenBudget, limits::LimitsError,
    limits::MAX_BUDGET, limits::MAX_CONCURRENT, limits::MAX_REVISION, request::RequestError,
};

use crate::support::{ENTRIES, MODEL, Outcome, Twin, budgeted, call};

fn parse(body: &str) -> Result<LlmRequest, String> {
    serde_json::from_str::<LlmRequest>(body).map_err(|e| e.to_string())
}

#[test]
fn token_counts_that_are_not_non_negative_integers_are_refused_naming_field_and_value() {
    let values: [(&str, &str); 17] = [
        ("-1", "-1"),
        ("-1.0", "-1.0"),
        ("-9223372036854775808", "-9223372036854775808"),
        ("1.5", "1.5"),
        ("0.5", "0.5"),
        ("1e-7", "1e-7"),
        ("1.0000000000000002", "1.0000000000000002"),
        ("1e20", "1e+20"),
        ("18446744073709551616", "1.8446744073709552e+19"),
        ("1e400", ""), // out of f64 range: a parse error
        ("\"7\"", "\"7\""),
        ("\"\"", "\"\""),
        ("true", "true"),
        ("false", "false"),
        ("[]", "[]"),
        ("[1]", "[1]"),
        ("{}", "{}"),
    ];
    let fields = [
        ("max_tokens", "max_tokens"),
        ("max_completion_tokens", "max_completion_tokens"),
        ("extra_input_tokens", "extra_input_tokens"),
        ("extraInputTokens", "extra_input_tokens"),
    ];
    for (key, field) in fields {
        for (value, shown) in values {
            let body = format!("{{\"{key}\": {value}}}");
            let err = parse(&body).expect_err(&body);
            if shown.is_empty() {
                continue;
            }
            let message = format!("request.{field} must be an integer >= 0 (got {shown})");
            assert!(err.starts_with(&message), "{body}: {err}");
        }
    }
    // The spec's wording for max_tokens (design §U16) is a prefix of ours.
    assert!(
        parse(r#"{"max_tokens": -1}"#)
            .unwrap_err()
            .starts_with("request.max_tokens must be an integer >= 0")
    );
}

#[test]
fn whole_token_counts_are_accepted_up_to_u64_max() {
    let cases: [(&str, Option<u64>); 9] = [
        ("null", None),
        ("0", Some(0)),
        ("-0", Some(0)),
        ("-0.0", Some(0)),
        ("2.0", Some(2)),
        ("1e3", Some(1000)),
        ("18446744073709551615", Some(u64::MAX)),
        ("18446744073709551614", Some(u64::MAX - 1)),
        ("18446744073709549568.0", Some(18_446_744_073_709_549_568)),
    ];
    for (value, expected) in cases {
        let r = parse(&format!(
            "{{\"max_tokens\": {value}, \"max_completion_tokens\": {value}, \"extraInputTokens\": {value}}}"
        ))
        .unwrap_or_else(|e| panic!("{value}: {e}"));
        assert_eq!(
            (r.max_tokens, r.max_completion_tokens, r.extra_input_tokens),
            (expected, expected, expected),
            "{value}"
        );
    }
}

#[test]
fn malformed_bodies_are_refused_without_panicking() {
    let deep_content = format!(
        "{{\"messages\":[{{\"role\":\"user\",\"content\":{}}}]}}",
        "[".repeat(100_000)
    );
    let deep_extra = format!("{{\"x\":{}}}", "[".repeat(100_000));
    let deep_message_extra = format!(
        "{{\"messages\":[{{\"role\":\"user\",\"tool_calls\":{}}}]}}",
        "{\"a\":".repeat(100_000)
    );
    let deep_block = format!(
        "{{\"messages\":[{{\"role\":\"user\",\"content\":[{}]}}]}}",
        "{\"type\":\"image\",\"x\":".repeat(50_000)
    );
    let cases: Vec<(&str, &str)> = vec![
        ("", "EOF while parsing"),
        ("[]", "invalid type: sequence"),
        ("\"body\"", "invalid type: string"),
        ("5", "invalid type: integer"),
        ("null", "invalid type: null"),
        ("true", "invalid type: boolean"),
        (r#"{"max_tokens": 1"#, "EOF while parsing"),
        (r#"{"max_tokens": NaN}"#, "expected value"),
        (r#"{"max_tokens": Infinity}"#, "expected value"),
        (r#"{"max_tokens": 1,}"#, "trailing comma"),
        (
            r#"{"max_tokens": 1, "max_tokens": 2}"#,
            "duplicate field `max_tokens`",
        ),
        (
            r#"{"extra_input_tokens": 1, "extraInputTokens": 2}"#,
            "duplicate field `extra_input_tokens`",
        ),
        (
            r#"{"model": 5}"#,
            "invalid type: integer `5`, expected a string",
        ),
        (
            r#"{"model": []}"#,
            "invalid type: sequence, expected a string",
        ),
        (
            r#"{"messages": "hi"}"#,
            "invalid type: string \"hi\", expected a sequence",
        ),
        (
            r#"{"messages": {}}"#,
            "invalid type: map, expected a sequence",
        ),
        (r#"{"messages": [5]}"#, "invalid type: integer `5`"),
        (r#"{"messages": [null]}"#, "invalid type: null"),
        (
            r#"{"messages": [{"content": "x"}]}"#,
            "missing field `role`",
        ),
        (
            r#"{"messages": [{"role": null}]}"#,
            "invalid type: null, expected a string",
        ),
        (
            r#"{"messages": [{"role": 5}]}"#,
            "invalid type: integer `5`, expected a string",
        ),
        (
            r#"{"messages": [{"role": "user", "content": 5}]}"#,
            "content must be a string or an array of blocks (got 5)",
        ),
        (
            r#"{"messages": [{"role": "user", "content": {}}]}"#,
            "content must be a string or an array of blocks (got {})",
        ),
        (
            r#"{"messages": [{"role": "user", "content": true}]}"#,
            "content must be a string or an array of blocks (got true)",
        ),
        (
            r#"{"system": 5}"#,
            "content must be a string or an array of blocks (got 5)",
        ),
        (
            r#"{"system": {"type": "text", "text": "x"}}"#,
            "content must be a string or an array of blocks (got {",
        ),
        (
            r#"{"messages": [{"role": "user", "content": "\ud800"}]}"#,
            "hex escape",
        ),
        (
            r#"{"messages": [{"role": "user", "content": "\x"}]}"#,
            "invalid escape",
        ),
        (&deep_content, "recursion limit exceeded"),
        (&deep_extra, "recursion limit exceeded"),
        (&deep_message_extra, "recursion limit exceeded"),
        (&deep_block, "recursion limit exceeded"),
    ];
    for (body, expected) in cases {
        let err = parse(body).expect_err(&body[..body.len().min(80)]);
        assert!(
            err.contains(expected),
            "{}: {err}",
            &body[..body.len().min(80)]
        );
    }
}

#[test]
fn odd_but_valid_content_blocks_are_kept_as_opaque() {
    let r = parse(
        r#"{"messages": [
                {"role": "user", "content": [5, null, "s", [], {}, {"type": 5}, {"type": "text", "text": 5}, {"type": "text"}]},
                {"role": "assistant"},
                {"role": "tool", "content": null}
            ], "model": null, "system": null}"#,
    )
    .unwrap();
    assert_eq!(r.text_len(), 0);
    let mut kinds = Vec::new();
    r.for_each_opaque_block(|k| kinds.push(k.to_owned()));
    assert_eq!(kinds, ["", "", "", "", "", "", "text", "text"]);
    assert_eq!(r.model, None);
    assert_eq!(r.system, None);
}

#[test]
fn parsed_bodies_with_huge_token_counts_are_refused_by_the_bulkhead_changing_nothing() {
    let cases = [
        (
            r#"{"max_tokens": 18446744073709551615, "messages": [{"role": "user", "content": "x"}]}"#,
            RequestError::ReservationOverflow {
                input: 1,
                max_output: u64::MAX,
            },
        ),
        (
            r#"{"max_completion_tokens": 18446744073709549568.0, "extraInputTokens": 2048, "messages": [{"role": "user", "content": [{"type": "text", "text": "xxxxxxxx"}]}]}"#,
            RequestError::ReservationOverflow {
                input: 2050,
                max_output: 18_446_744_073_709_549_568,
            },
        ),
        (
            r#"{"extraInputTokens": 18446744073709551615, "messages": [{"role": "user", "content": "xxxxxxxx"}]}"#,
            RequestError::InputOverflow {
                text_tokens: 2,
                opaque_tokens: 0,
                extra_input_tokens: u64::MAX,
            },
        ),
        (
            r#"{"extra_input_tokens": 18446744073709549568.0, "system": "xxxx", "max_tokens": 1e4}"#,
            RequestError::ReservationOverflow {
                input: 18_446_744_073_709_549_569,
                max_output: 10_000,
            },
        ),
    ];
    for (body, expected) in cases {
        let request = parse(body).unwrap();
        for entry in ENTRIES {
            let twin = Twin::new(|| budgeted(4, 10_000, 0));
            assert_eq!(
                call(entry, &twin.subject, &request, AcquireOptions::new()),
                Outcome::Invalid(expected),
                "{body} / {entry:?}"
            );
            twin.assert_behaves_like_control(body);
        }
    }
}

#[test]
fn limits_bodies_of_the_wrong_shape_are_refused() {
    let cases = [
        (
            r#"{"revision": -1, "max_concurrent": 1}"#,
            "invalid value: integer `-1`",
        ),
        (
            r#"{"revision": 1.5, "max_concurrent": 1}"#,
            "invalid type: floating point",
        ),
        (
            r#"{"revision": 18446744073709551616, "max_concurrent": 1}"#,
            "invalid type: floating point",
        ),
        (
            r#"{"revision": "1", "max_concurrent": 1}"#,
            "invalid type: string",
        ),
        (
            r#"{"revision": null, "max_concurrent": 1}"#,
            "invalid type: null",
        ),
        (r#"{"max_concurrent": 1}"#, "missing field `revision`"),
        (r#"{"revision": 1}"#, "missing field `max_concurrent`"),
        (
            r#"{"revision": 1, "max_concurrent": -1}"#,
            "invalid value: integer `-1`",
        ),
        (
            r#"{"revision": 1, "max_concurrent": 4294967296}"#,
            "invalid value: integer `4294967296`, expected u32",
        ),
        (
            r#"{"revision": 1, "max_concurrent": 1, "max_queue": -1}"#,
            "invalid value: integer `-1`",
        ),
        (
            r#"{"revision": 1, "max_concurrent": 1, "max_queue": 4294967296}"#,
            "expected u32",
        ),
        (
            r#"{"revision": 1, "max_concurrent": 1, "token_budget": 5}"#,
            "invalid type: integer `5`",
        ),
        (
            r#"{"revision": 1, "max_concurrent": 1, "token_budget": {"budget": 5}}"#,
            "missing field `high_priority_reserve`",
        ),
        (
            r#"{"revision": 1, "max_concurrent": 1, "token_budget": {"high_priority_reserve": 5}}"#,
            "missing field `budget`",
        ),
        (
            r#"{"revision": 1, "max_concurrent": 1, "token_budget": {"budget": -5, "high_priority_reserve": 0}}"#,
            "invalid value: integer `-5`",
        ),
        ("", "EOF while parsing"),
    ];
    for (body, expected) in cases {
        let err = serde_json::from_str::<Limits>(body)
            .expect_err(body)
            .to_string();
        assert!(err.contains(expected), "{body}: {err}");
    }
}

#[test]
fn parsed_limits_out_of_range_are_refused_by_apply_limits_changing_nothing() {
    let cases: [(&str, bool, LimitsError); 6] = [
        (
            r#"{"revision": 9007199254740992, "max_concurrent": 1, "token_budget": {"budget": 1, "high_priority_reserve": 0}}"#,
            true,
            LimitsError::RevisionTooLarge {
                value: MAX_REVISION + 1,
                max: MAX_REVISION,
            },
        ),
        (
            r#"{"revision": 18446744073709551615, "max_concurrent": 1}"#,
            false,
            LimitsError::RevisionTooLarge {
                value: u64::MAX,
                max: MAX_REVISION,
            },
        ),
        (
            r#"{"revision": 6, "max_concurrent": 65536, "token_budget": {"budget": 1, "high_priority_reserve": 0}}"#,
            true,
            LimitsError::MaxConcurrentTooLarge {
                value: MAX_CONCURRENT + 1,
                max: MAX_CONCURRENT,
            },
        ),
        (
            r#"{"revision": 6, "max_concurrent": 1, "token_budget": {"budget": 34359738368, "high_priority_reserve": 0}}"#,
            true,
            LimitsError::BudgetTooLarge {
                value: MAX_BUDGET + 1,
                max: MAX_BUDGET,
            },
        ),
        (
            r#"{"revision": 6, "max_concurrent": 1, "token_budget": null}"#,
            true,
            LimitsError::TokenBudgetRequired,
        ),
        (
            r#"{"revision": 6, "max_concurrent": 1, "token_budget": {"budget": 0, "high_priority_reserve": 0}}"#,
            false,
            LimitsError::TokenBudgetNotConfigured,
        ),
    ];
    for (body, with_budget, expected) in cases {
        let next: Limits = serde_json::from_str(body).unwrap();
        let twin = Twin::new(|| {
            let b = LlmBulkhead::builder(MODEL, 2).initial_revision(5);
            if with_budget {
                b.token_budget(TokenBudget::new(1000)).build().unwrap()
            } else {
                b.build().unwrap()
            }
        });
        assert_eq!(twin.subject.apply_limits(next), Err(expected), "{body}");
        twin.assert_behaves_like_control(body);
    }
}
