//! The request model: built in code and read from OpenAI / Anthropic JSON bodies.

use std::collections::HashSet;

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmRequest, estimate::Estimator, estimate::NaiveEstimator,
    request::Content, request::ContentBlock, request::RequestError,
};
use serde_json::{Value, json};

use crate::support::{
    anthropic_body, budgeted, input_of, kinds, openai_body, parse, parse_err, res, utf16,
    without_content, xs,
};

#[test]
fn openai_body_is_read_with_text_blocks_ceiling_and_every_other_field() {
    let body = openai_body();
    let request = parse(&body);

    assert_eq!(request.model.as_deref(), Some("gpt-4o-2024-08-06"));
    let roles: Vec<&str> = request.messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
    assert_eq!(request.text_len(), 120);
    assert_eq!(
        request.text_len(),
        utf16("You are a helpful assistant. Réponds en français.")
            + utf16("What's in this image? \u{1F5BC}\u{FE0F}")
            + utf16("{\"temp_c\":18,\"sky\":\"clear\"}")
            + utf16("Merci ! Et demain ?")
    );
    assert_eq!(kinds(&request), ["image_url", "image_url"]);
    assert_eq!(request.system, None);
    assert_eq!(
        (request.max_tokens, request.max_completion_tokens),
        (None, Some(512))
    );
    assert_eq!(request.output_ceiling(), Some(512));
    assert_eq!(request.extra_input_tokens, None);

    // A null content (a turn that only calls tools) is no content at all.
    assert_eq!(request.messages[2].content, None);

    // Request level: everything not interpreted, as received.
    let extra_keys: HashSet<&str> = request.extra.keys().map(String::as_str).collect();
    let expected_keys: HashSet<&str> = [
        "temperature",
        "top_p",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "user",
    ]
    .into_iter()
    .collect();
    assert_eq!(extra_keys, expected_keys);
    assert_eq!(request.extra["temperature"], json!(0.7));
    assert_eq!(request.extra["stream"], json!(true));
    assert_eq!(request.extra["tools"], body["tools"]);
    // Message level.
    assert_eq!(request.messages[0].extra.len(), 0);
    assert_eq!(request.messages[1].extra["name"], json!("alice"));
    assert_eq!(
        request.messages[2].extra["tool_calls"],
        body["messages"][2]["tool_calls"]
    );
    assert_eq!(
        request.messages[3].extra["tool_call_id"],
        json!("call_abc123")
    );
    // Block level: an opaque block is kept whole, its type included.
    let Some(Content::Blocks(blocks)) = &request.messages[1].content else {
        panic!("the user message has blocks");
    };
    assert_eq!(blocks.len(), 3);
    match &blocks[1] {
        ContentBlock::Opaque { kind, data, .. } => {
            assert_eq!(kind, "image_url");
            assert_eq!(data.clone(), body["messages"][1]["content"][1]);
        }
        other => panic!("expected an opaque block, got {other:?}"),
    }

    // Serialized back, the body is the one received (the null content is checked on its own
    // in `openai_null_and_absent_content_round_trip_as_received`).
    let written = serde_json::to_value(&request).unwrap();
    assert_eq!(without_content(written, 2), without_content(body, 2));
}

#[test]
fn openai_null_and_absent_content_round_trip_as_received() {
    let body = openai_body();
    let written = serde_json::to_value(parse(&body)).unwrap();
    assert_eq!(written["messages"][2]["content"], Value::Null);
    assert_eq!(written, body);

    // An absent content reads as no content too, and is written back as `null` (absent and
    // null are the same request, as for the dedup key).
    let mut absent = json!({
        "model": "gpt-4o",
        "messages": [{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}]}]
    });
    let request = parse(&absent);
    assert_eq!(request.messages[0].content, None);
    absent["messages"][0]["content"] = Value::Null;
    assert_eq!(serde_json::to_value(&request).unwrap(), absent);
}

#[test]
fn anthropic_body_with_block_system_is_read_with_every_field_kept() {
    let body = anthropic_body();
    let request = parse(&body);

    assert_eq!(request.model.as_deref(), Some("claude-sonnet-4-5-20250929"));
    assert_eq!(request.text_len(), 103);
    assert_eq!(
        request.text_len(),
        utf16("You are a meticulous analyst.")
            + utf16("日本語で答えてください。")
            + utf16("Summarise the chart and the report.")
            + utf16("Let me look up the figures.")
    );
    assert_eq!(
        kinds(&request),
        ["image", "document", "tool_use", "tool_result"]
    );
    assert_eq!(
        (request.max_tokens, request.max_completion_tokens),
        (Some(1024), None)
    );
    assert_eq!(request.output_ceiling(), Some(1024));

    let extra_keys: HashSet<&str> = request.extra.keys().map(String::as_str).collect();
    let expected_keys: HashSet<&str> = [
        "metadata",
        "temperature",
        "stop_sequences",
        "tools",
        "stream",
    ]
    .into_iter()
    .collect();
    assert_eq!(extra_keys, expected_keys);
    assert_eq!(request.extra["metadata"], json!({"user_id": "u-42"}));
    assert_eq!(request.extra["stream"], json!(false));

    // The system blocks are text blocks; their other fields are kept on the block.
    let Some(Content::Blocks(system)) = &request.system else {
        panic!("the system prompt has blocks");
    };
    match &system[0] {
        ContentBlock::Text { text, extra, .. } => {
            assert_eq!(text, "You are a meticulous analyst.");
            assert_eq!(extra.len(), 1);
            assert_eq!(extra["cache_control"], json!({"type": "ephemeral"}));
        }
        other => panic!("expected a text block, got {other:?}"),
    }
    match &system[1] {
        ContentBlock::Text { text, extra, .. } => {
            assert_eq!(text, "日本語で答えてください。");
            assert!(extra.is_empty());
        }
        other => panic!("expected a text block, got {other:?}"),
    }
    let Some(Content::Blocks(first)) = &request.messages[0].content else {
        panic!("the first message has blocks");
    };
    match &first[2] {
        ContentBlock::Text { extra, .. } => {
            assert_eq!(
                extra["cache_control"],
                json!({"type": "ephemeral", "ttl": "1h"})
            );
        }
        other => panic!("expected a text block, got {other:?}"),
    }
    match &first[1] {
        ContentBlock::Opaque { kind, data, .. } => {
            assert_eq!(kind, "document");
            assert_eq!(data.clone(), body["messages"][0]["content"][1]);
        }
        other => panic!("expected an opaque block, got {other:?}"),
    }

    assert_eq!(serde_json::to_value(&request).unwrap(), body);
}

#[test]
fn anthropic_body_with_string_system_is_read_and_written_back() {
    let body = json!({
        "model": "claude-haiku-4-5",
        "system": "Réponds brièvement. \u{1F680}",
        "messages": [
            {"role": "user", "content": "Quelle heure est-il à 東京 ?"},
            {"role": "assistant", "content": "Il est 9 h."}
        ],
        "max_tokens": 256,
        "metadata": {"user_id": "u-7"}
    });
    let request = parse(&body);
    // 20 + 2 (the rocket), 26, 11.
    assert_eq!(request.text_len(), 22 + 26 + 11);
    assert_eq!(
        request.system,
        Some(Content::from("Réponds brièvement. \u{1F680}"))
    );
    assert!(kinds(&request).is_empty());
    assert_eq!(request.output_ceiling(), Some(256));
    assert_eq!(request.extra["metadata"], json!({"user_id": "u-7"}));
    assert_eq!(serde_json::to_value(&request).unwrap(), body);
}

#[test]
fn malformed_and_untyped_blocks_are_opaque_and_kept_whole() {
    let body = json!({
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": 123},
            {"type": "text"},
            {"type": "text", "text": "abc"},
            {"type": "text", "text": null, "note": 1},
            {"text": "no type"},
            {"type": 7, "text": "numeric type"},
            {"type": "image"}
        ]}]
    });
    let request = parse(&body);
    assert_eq!(kinds(&request), ["text", "text", "text", "", "", "image"]);
    assert_eq!(
        request.text_len(),
        3,
        "only the well-formed text block counts"
    );
    let Some(Content::Blocks(blocks)) = &request.messages[0].content else {
        panic!("blocks expected");
    };
    match &blocks[0] {
        ContentBlock::Opaque { kind, data, .. } => {
            assert_eq!(kind, "text");
            assert_eq!(data.clone(), json!({"type": "text", "text": 123}));
        }
        other => panic!("a text block with numeric text must be opaque, got {other:?}"),
    }
    assert_eq!(serde_json::to_value(&request).unwrap(), body);
}

#[test]
fn non_object_block_round_trips_as_received() {
    let body = json!({"messages": [{"role": "user", "content": ["hello", 5, null]}]});
    let request = parse(&body);
    assert_eq!(kinds(&request), ["", "", ""]);
    assert_eq!(request.text_len(), 0);
    assert_eq!(serde_json::to_value(&request).unwrap(), body);
}

#[test]
fn invalid_token_counts_are_refused_with_exact_messages() {
    let bad: [(Value, &str); 7] = [
        (json!(-1), "-1"),
        (json!(i64::MIN), "-9223372036854775808"),
        (json!(1.5), "1.5"),
        (json!(0.25), "0.25"),
        (json!("7"), "\"7\""),
        (json!(true), "true"),
        (json!(false), "false"),
    ];
    for (key, field) in [
        ("max_tokens", "max_tokens"),
        ("max_completion_tokens", "max_completion_tokens"),
        ("extra_input_tokens", "extra_input_tokens"),
        ("extraInputTokens", "extra_input_tokens"),
    ] {
        for (value, shown) in &bad {
            let mut body = json!({"model": "gpt-4o", "messages": []});
            body[key] = value.clone();
            assert_eq!(
                parse_err(body.clone()),
                format!("request.{field} must be an integer >= 0 (got {shown})"),
                "{key} = {value}"
            );
            // From text the position is appended.
            let from_text = serde_json::from_str::<LlmRequest>(&body.to_string())
                .unwrap_err()
                .to_string();
            assert!(
                from_text.starts_with(&format!(
                    "request.{field} must be an integer >= 0 (got {shown})"
                )),
                "{from_text}"
            );
        }
    }
    assert_eq!(
        parse_err(json!({"max_tokens": [1]})),
        "request.max_tokens must be an integer >= 0 (got [1])"
    );
    assert_eq!(
        parse_err(json!({"max_tokens": {"n": 1}})),
        "request.max_tokens must be an integer >= 0 (got {\"n\":1})"
    );

    // Valid counts: null is absent, 0 and u64::MAX are kept.
    let ok = parse(&json!({
        "max_tokens": null,
        "max_completion_tokens": 0,
        "extra_input_tokens": u64::MAX
    }));
    assert_eq!(
        (
            ok.max_tokens,
            ok.max_completion_tokens,
            ok.extra_input_tokens
        ),
        (None, Some(0), Some(u64::MAX))
    );
}

#[test]
fn integral_float_token_counts_are_accepted_like_javascript() {
    // JSON has one number type; the original reads 2.0 and 1e3 as the integers 2 and 1000.
    let two: Value = serde_json::from_str(r#"{"max_tokens": 2.0}"#).unwrap();
    assert_eq!(parse(&two).max_tokens, Some(2));
    let thousand: Value = serde_json::from_str(r#"{"extra_input_tokens": 1e3}"#).unwrap();
    assert_eq!(parse(&thousand).extra_input_tokens, Some(1000));
}

#[test]
fn extra_input_tokens_alias_is_read_and_counted() {
    let request = parse(&json!({
        "messages": [{"role": "user", "content": xs(400)}],
        "extraInputTokens": 300
    }));
    assert_eq!(request.extra_input_tokens, Some(300));
    assert!(request.extra.is_empty(), "the alias is not left in `extra`");
    assert_eq!(input_of(&NaiveEstimator::new(), &request), 100 + 300);
    let snake = parse(&json!({"extra_input_tokens": 5}));
    assert_eq!(snake.extra_input_tokens, Some(5));
}

#[test]
fn max_tokens_wins_over_max_completion_tokens() {
    let both = parse(&json!({"max_tokens": 50, "max_completion_tokens": 100}));
    assert_eq!(both.output_ceiling(), Some(50));
    assert_eq!(
        NaiveEstimator::new().estimate(&both).unwrap().max_output,
        50
    );
    let newer = parse(&json!({"max_completion_tokens": 100}));
    assert_eq!(
        NaiveEstimator::new().estimate(&newer).unwrap().max_output,
        100
    );
    let zero = parse(&json!({"max_tokens": 0, "max_completion_tokens": 100}));
    assert_eq!(zero.output_ceiling(), Some(0));
}

#[test]
fn parsed_bodies_are_admitted_with_the_estimated_reservation() {
    // OpenAI: 120 chars at 3.7 (gpt-4o family) -> 33, output 512.
    let openai = parse(&openai_body());
    let bulkhead = budgeted("gpt-4o");
    let preview = bulkhead.estimate(&openai).unwrap().unwrap();
    assert_eq!(preview, res(33, 512));
    let permit = bulkhead
        .try_acquire(&openai, AcquireOptions::new())
        .unwrap();
    assert_eq!(permit.reservation(), Some(preview));
    assert_eq!(permit.held_tokens(), 545);

    // Anthropic: the body's model (claude-sonnet-4-5, 3.9) wins over the bulkhead's (gpt-4o):
    // 103 chars -> 27, output 1024; opaque blocks cost nothing by default.
    let anthropic = parse(&anthropic_body());
    let preview = bulkhead.estimate(&anthropic).unwrap().unwrap();
    assert_eq!(preview, res(27, 1024));
    let second = bulkhead
        .try_acquire(&anthropic, AcquireOptions::new())
        .unwrap();
    assert_eq!(second.reservation(), Some(preview));
    assert_eq!(
        bulkhead.stats().token_budget.unwrap().in_flight_tokens,
        545 + 1051
    );
    drop((permit, second));

    // A body whose ceiling cannot be added to its input is invalid, and holds nothing.
    let huge = parse(&json!({
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": xs(37)}],
        "max_tokens": u64::MAX
    }));
    assert_eq!(
        bulkhead
            .try_acquire(&huge, AcquireOptions::new())
            .unwrap_err(),
        AcquireError::Invalid(RequestError::ReservationOverflow {
            input: 10,
            max_output: u64::MAX
        })
    );
    assert_eq!(bulkhead.stats().token_budget.unwrap().in_flight_tokens, 0);
}
